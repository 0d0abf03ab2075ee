"""The prefill and decode workers on a CUDA device, in one process over real ZMQ sockets: the
K/V pages and Mamba state leave and enter GPU pools. In float32 the pair is token-identical to
a colocated CUDA engine; in bfloat16, where batch composition moves logits by rounding, nearly
all tokens agree (a garbled state or a misplaced page would change most of them).

    TRITON_INTERPRET=0 .venv/bin/python -m pytest -m gpu tests/gpu/test_disagg_gpu.py
"""

from __future__ import annotations

import pytest
import torch

zmq = pytest.importorskip("zmq")

from baton import SamplingParams  # noqa: E402
from baton.disagg.decode import DecodeWorker  # noqa: E402
from baton.disagg.prefill import PrefillWorker  # noqa: E402
from baton.engine.core.engine import Engine  # noqa: E402
from tests.test_disagg_unit import (  # noqa: E402
    assert_pools_empty,
    colocated_tokens,
    config,
    run_pair,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_pair_is_token_identical_to_colocated(base_model, dtype):
    model_dir, _ = base_model
    args = dict(device="cuda", dtype=dtype, page_size=4, max_running_requests=16)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [list(range(3, 3 + n)) for n in (1, 6, 45, 130)]
    colocated = Engine(model_dir, **args, chunked_prefill_size=32)
    expect = colocated_tokens(colocated, prompts, params)
    ctx = zmq.Context()
    prefill = PrefillWorker(
        Engine(model_dir, **args, chunked_prefill_size=32), config("prefill"), ctx
    )
    decoder = DecodeWorker(Engine(model_dir, **args), config("decode"), ctx)
    try:
        got = run_pair(prefill, decoder, prompts, params, timeout=60.0)
        assert {r: len(t) for r, t in got.items()} == {r: len(t) for r, t in expect.items()}
        if dtype == "float32":
            assert got == expect
        else:
            same = sum(a == b for r in expect for a, b in zip(got[r], expect[r]))
            assert same >= 0.9 * sum(len(t) for t in expect.values()), (got, expect)
        assert decoder.take_failures() == [] and prefill.take_failures() == []
        assert prefill.counters.kv_chunks >= 3
        assert_pools_empty(prefill, decoder)
    finally:
        prefill.close()
        decoder.close()
