"""CUDA-graph decode replay equals eager decode at Nemotron-Nano-9B-v2-like shapes (bf16,
random weights, fewer layers), checkpoints (the track mask) included.

    TRITON_INTERPRET=0 .venv/bin/python -m pytest -m gpu tests/gpu/test_graph_runner_gpu.py
"""

from __future__ import annotations

import json

import pytest
import torch

from baton.engine.cache.pools import StateCache
from baton.engine.checkpoint.loader import load_model
from baton.engine.executor.forward_metadata import ScheduledBatch, TrackPoint
from baton.engine.executor.graph_runner import DecodeGraphRunner
from baton.engine.executor.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# Nano-9B-v2 block shapes; 8 layers keep the test quick (2 Mamba, 1 attention, MLPs between).
NANO_LIKE = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "vocab_size": 131072,
    "hidden_size": 4480,
    "hybrid_override_pattern": "M-M*-M--",
    "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 8192,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 15680,
    "mlp_hidden_act": "relu2",
    "mamba_num_heads": 128,
    "mamba_head_dim": 80,
    "ssm_state_size": 128,
    "n_groups": 8,
    "conv_kernel": 4,
    "chunk_size": 128,
    "use_conv_bias": True,
    "mamba_proj_bias": False,
    "eos_token_id": 2,
    "bos_token_id": 1,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}
PAGE = 16


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.double() - expected.double()).norm()
    return (diff / expected.double().norm().clamp_min(1e-30)).item()


@torch.no_grad()
def init_random_(model: torch.nn.Module) -> None:
    """Weights at the scales a trained Mamba2 hybrid has (A in [-e^2, -1], unit norms)."""
    for name, p in model.named_parameters():
        p.normal_(0, 0.02 if p.dim() > 1 else 0.1)
        if name.endswith("A_log"):
            p.uniform_(0, 2)
        if "norm" in name:
            p.fill_(1.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from safetensors.torch import save_file

    from baton.engine.config import ModelConfig
    from baton.engine.models.nemotron_h import NemotronHForCausalLM

    path = tmp_path_factory.mktemp("nano-like")
    (path / "config.json").write_text(json.dumps(NANO_LIKE))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = NemotronHForCausalLM(ModelConfig.from_dict(NANO_LIKE)).to(torch.bfloat16)
    init_random_(model)
    save_file(
        {k: v.cpu().contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors"
    )
    return path


def test_graph_replay_equals_eager_with_tracking(model_dir):
    model = load_model(model_dir, torch.bfloat16, "cuda")
    config = model.config
    caches = [
        StateCache.for_model(
            config,
            num_pages=400,
            page_size=PAGE,
            num_slots=80,
            dtype=torch.bfloat16,
            device="cuda",
        )
        for _ in range(2)
    ]
    eager = ModelRunner(model, caches[0], "cuda")
    graphed = DecodeGraphRunner(
        ModelRunner(model, caches[1], "cuda"),
        max_bs=32,
        kv_capacity=1024,
        capture="cuda",
        verify_width=None,
    )
    n = 13  # not a capture size: 3 padded rows
    g = torch.Generator().manual_seed(1)
    lens = [int(x) for x in torch.randint(20, 200, (n,), generator=g)]
    pages = [tuple(range(1 + 20 * i, 21 + 20 * i)) for i in range(n)]
    slots = [1 + i for i in range(n)]
    for runner in (eager, graphed.runner):
        for i in range(n):
            tokens = torch.randint(
                3, 1000, (lens[i],), generator=torch.Generator().manual_seed(i)
            ).tolist()
            runner.forward(
                ScheduledBatch(
                    mode="extend",
                    request_ids=(f"r{i}",),
                    num_decode_seqs=0,
                    num_verify_seqs=0,
                    input_ids=tuple(tokens),
                    seq_lens=(lens[i],),
                    start_positions=(0,),
                    kv_pages=(pages[i],),
                    mamba_slots=(slots[i],),
                    verify_slots=(),
                    logits_seqs=(0,),
                    prompt_logprob_seqs=(),
                    has_mamba_track_mask=False,
                    track_points=(),
                    lora_slots=(-1,) * len((f"r{i}",)),
                )
            )
    torch.cuda.synchronize()
    for step in range(4):
        track = step % 2 == 1
        points = (
            tuple(TrackPoint(seq_index=i, token_offset=0, dst_slot=40 + i) for i in range(0, n, 3))
            if track
            else ()
        )
        sched = ScheduledBatch(
            mode="decode",
            request_ids=tuple(f"r{i}" for i in range(n)),
            num_decode_seqs=n,
            num_verify_seqs=0,
            input_ids=tuple(5 + i + step for i in range(n)),
            seq_lens=(1,) * n,
            start_positions=tuple(lens[i] + step for i in range(n)),
            kv_pages=tuple(pages),
            mamba_slots=tuple(slots),
            verify_slots=(),
            logits_seqs=tuple(range(n)),
            prompt_logprob_seqs=(),
            has_mamba_track_mask=track,
            track_points=points,
            lora_slots=(-1,) * len(tuple(f"r{i}" for i in range(n))),
        )
        _, ref = eager.forward(sched)
        _, got = graphed.forward(sched)
        # The graph runs the padded batch (16 rows for 13) and attention over the static key
        # capacity, so cuBLAS and the key splits may pick other reduction orders: bf16 logits
        # move by an ulp or two (~0.03 at |logit| ~ 4), a wrong index or state by O(1).
        assert torch.equal(got.argmax(-1), ref.argmax(-1))
        assert rel_err(got, ref) < 1e-2
        assert (got.float() - ref.float()).abs().max() < 0.25
    assert graphed.graphs, "no CUDA graph was captured"
    live = slots + [40 + i for i in range(0, n, 3)]
    assert (
        rel_err(caches[1].pools["mamba2.ssm"][:, live], caches[0].pools["mamba2.ssm"][:, live])
        < 1e-2
    )
    assert (
        rel_err(caches[1].pools["mamba2.conv"][:, live], caches[0].pools["mamba2.conv"][:, live])
        < 1e-2
    )
    assert caches[1].pools["mamba2.ssm"][:, 40].abs().sum() > 0
