"""Per-step metadata through buffers allocated once: int32 pages cross over, never a token-level
table; the bytes copied per decode step do not depend on max_model_len; the decode layout built
on the device equals the kernels' own layout builder (the oracle)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baton import SamplingParams
from baton.engine.core.engine import Engine
from baton.engine.executor.forward_metadata import ScheduledBatch, build_metadata
from baton.engine.executor.graph_runner import copy_from
from baton.engine.executor.metadata_buffers import MetadataBuffers
from baton.kernels.attention import build_attention_layout
from tests.test_metadata import CHUNK, CONV, PAGE, scheduled


def _build(sched, buffers, *, decode_mask=True, kv_capacity=None, track_capacity=None):
    return build_metadata(
        sched,
        page_size=PAGE,
        page_tables=1,
        chunk_size=CHUNK,
        window_width=CONV,
        buffers=buffers,
        decode_mask=decode_mask,
        kv_capacity=kv_capacity,
        track_capacity=track_capacity,
    )


@pytest.mark.parametrize("mode", ["decode", "mixed"])
@pytest.mark.parametrize("kv_capacity", [None, 64])
def test_decode_layout_equals_the_kernels_layout_builder(mode, kv_capacity):
    sched = scheduled(mode, track=False)
    nd = sched.num_decode_seqs
    buffers = MetadataBuffers("cpu", ints=4, kv_rows=1, kv_width=4, fixed=False)
    got = _build(sched, buffers, kv_capacity=kv_capacity).forward.decode_attention
    kv_lens = [s + n for s, n in zip(sched.start_positions[:nd], sched.seq_lens[:nd])]
    width = kv_capacity or max(kv_lens)
    table = torch.zeros(nd, width, dtype=torch.int64)
    for s, pages in enumerate(sched.kv_pages[:nd]):
        slots = torch.tensor(pages)[:, None] * PAGE + torch.arange(PAGE)
        table[s, : len(pages) * PAGE] = slots.flatten()[:width]
    want = build_attention_layout([1] * nd, kv_lens, table, "cpu", kv_width=kv_capacity)
    assert (got.num_seqs, got.max_q, got.max_kv) == (want.num_seqs, want.max_q, want.max_kv)
    for name in ("query_start_loc", "kv_lens", "q_slot", "slot_q", "mask"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.kv_indices.shape == want.kv_indices.shape
    for s, n in enumerate(kv_lens):  # every slot a kernel reads (below kv_len) is the same
        assert torch.equal(got.kv_indices[s, :n], want.kv_indices[s, :n])


def test_no_decode_mask_when_the_kernel_does_not_read_one():
    sched = scheduled("decode", track=False)
    buffers = MetadataBuffers("cpu", ints=4, kv_rows=1, kv_width=4, fixed=False)
    layout = _build(sched, buffers, decode_mask=False).forward.decode_attention
    assert layout.mask.shape == (2, 1, 1, 0)


class _HostToDevice:
    """Counts the bytes of CPU tensors moved to another device (here: meta) while active."""

    def __init__(self, monkeypatch):
        self.bytes = 0
        original_to, original_copy = torch.Tensor.to, torch.Tensor.copy_

        def to(tensor, *args, **kwargs):
            out = original_to(tensor, *args, **kwargs)
            if tensor.device.type == "cpu" and out.device.type != "cpu":
                self.bytes += tensor.numel() * tensor.element_size()
            return out

        def copy_(tensor, src, *args, **kwargs):
            if src.device.type == "cpu" and tensor.device.type != "cpu":
                self.bytes += src.numel() * src.element_size()
            return original_copy(tensor, src, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", to)
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)


def _decode_batch(engine: Engine) -> ScheduledBatch:
    """Run two requests to their decode phase and return the next decode step's batch."""
    for i, prompt in enumerate(([5, 6, 7, 8, 9, 10, 11], [12, 13, 14])):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.scheduler.waiting or any(
        r.num_computed < len(r.prompt_ids) for r in engine.scheduler.running
    ):
        engine.step()
    sched = engine.scheduler.schedule()
    assert sched is not None and sched.mode == "decode"
    return sched


def test_bytes_copied_per_decode_step_do_not_depend_on_max_model_len(base_model, monkeypatch):
    model_dir, _ = base_model
    copied, widths = [], []
    for max_model_len in (64, 4096):
        engine = Engine(
            model_dir, page_size=PAGE, max_model_len=max_model_len, cpu_padded_decode=True
        )
        graphs = engine.graph_runner
        padded = graphs.pad(_decode_batch(engine), 4)
        # What a CUDA-graph step builds: static key width = the engine's capacity, buffers
        # allocated once at that capacity, on another device so that copies are visible.
        buffers = MetadataBuffers(
            "meta",
            ints=4 * (10 + graphs.kv_capacity // PAGE),
            kv_rows=4,
            kv_width=graphs.kv_capacity,
            fixed=True,
        )
        build = dict(decode_mask=False, kv_capacity=graphs.kv_capacity, track_capacity=4)
        _build(padded, buffers, **build)  # the first step also builds the empty prefill layouts
        counter = _HostToDevice(monkeypatch)
        md = _build(padded, buffers, **build)
        monkeypatch.undo()
        copied.append((counter.bytes, buffers.last_copy_bytes))
        widths.append(md.forward.decode_attention.kv_indices.shape[1])
    assert widths == [64, 4096]  # the static key width follows the capacity ...
    assert copied[0] == copied[1]  # ... the bytes crossing over do not
    # 4 rows x (ids, positions, slot, logits row, Mamba slot, kv_len, adapter slot) + their
    # pages, as int32.
    pages = max(len(p) for p in padded.kv_pages)
    assert copied[0] == (4 * (7 + pages) * 4,) * 2


def test_fixed_buffers_refuse_to_grow():
    buffers = MetadataBuffers("cpu", ints=4, kv_rows=1, kv_width=4, fixed=True)
    with pytest.raises(ValueError, match="metadata ints"):
        buffers.stage([torch.arange(5).numpy()])
    with pytest.raises(ValueError, match="exceeds the fixed"):
        buffers.token_table("decode", torch.zeros(2, 1, dtype=torch.int32), PAGE, 4)


def test_graph_replay_finds_every_tensor_built_in_place(monkeypatch):
    """With buffers allocated once, a replay's metadata lands where the captured graph reads
    it: copy_from copies nothing (no capacity-wide table, not even the small index tensors)."""
    buffers = MetadataBuffers("cpu", ints=64, kv_rows=2, kv_width=64, fixed=True)
    sched = scheduled("decode", track=True)
    kw = dict(decode_mask=False, kv_capacity=64, track_capacity=2)
    static = _build(sched, buffers, **kw)
    moved = dataclasses.replace(sched, input_ids=(11, 12), start_positions=(13, 6))
    new = _build(moved, buffers, **kw)
    calls = []
    original = torch.Tensor.copy_
    monkeypatch.setattr(
        torch.Tensor,
        "copy_",
        lambda t, s, *a, **k: calls.append(t.shape) or original(t, s, *a, **k),
    )
    copy_from(static, new)
    monkeypatch.undo()
    assert calls == []
    assert static.forward.batch.input_ids.tolist() == [11, 12]
    assert static.forward.decode_attention.kv_lens.tolist() == [14, 7]
