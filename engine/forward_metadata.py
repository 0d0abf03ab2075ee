"""Batch carriers and the ONE builder that turns a scheduled batch into forward metadata.

    Request (mutable, scheduler) -> ScheduledBatch (frozen, host data)
        -> build_metadata() -> Mamba2Metadata (holds ForwardMetadata, which holds ForwardBatch)

Every carrier is frozen, keyword-only, slotted and has NO defaults: a constructor that forgets a
field fails with a TypeError instead of silently taking a default. That is the cure for baton's
seed bug (a `has_mamba_track_mask` defaulted to False in two constructors, so Mamba states were
never checkpointed). Mamba2Metadata does not re-list ForwardMetadata's fields, it holds it.

The same builder serves every mode (extend, decode, mixed, verify) and CUDA-graph capture and
replay. Host facts stay on the host: `has_mamba_track_mask` is a Python bool decided by the
scheduler, never a `.any()` on a device tensor.

Token order inside a batch: all decode sequences first (one token each), then prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kernels.attention import AttentionLayout, build_attention_layout
from kernels.conv1d import ConvLayout, build_conv_layout
from kernels.ssd import ChunkLayout, build_chunk_layout

ForwardMode = Literal["extend", "decode", "mixed", "verify"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TrackPoint:
    """Checkpoint the Mamba state of sequence `seq_index` right after its local token
    `token_offset` of this step into checkpoint slot `dst_slot`."""

    seq_index: int
    token_offset: int
    dst_slot: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduledBatch:
    """What the scheduler decided for one step; host data only. Decode sequences come first."""

    mode: ForwardMode
    request_ids: tuple[str, ...]  # (num_seqs,)
    num_decode_seqs: int
    input_ids: tuple[int, ...]  # (num_tokens,) packed
    seq_lens: tuple[int, ...]  # (num_seqs,) tokens fed this step
    start_positions: tuple[int, ...]  # (num_seqs,) tokens already in the state/cache
    kv_pages: tuple[tuple[int, ...], ...]  # (num_seqs,) page table covering start + len tokens
    mamba_slots: tuple[int, ...]  # (num_seqs,) working Mamba slot
    logits_seqs: tuple[int, ...]  # sequences whose last token's logits are needed (sampling)
    prompt_logprob_seqs: tuple[int, ...]  # sequences needing logits for every token fed
    has_mamba_track_mask: bool  # decided on the host: is any TrackPoint present
    track_points: tuple[TrackPoint, ...]

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass(frozen=True, kw_only=True, slots=True)
class ForwardBatch:
    """Token-level tensors of one forward."""

    mode: ForwardMode
    num_seqs: int
    num_decode_seqs: int
    num_decode_tokens: int
    input_ids: torch.Tensor  # (num_tokens,) int64
    positions: torch.Tensor  # (num_tokens,) int64 absolute positions
    logits_indices: torch.Tensor  # (num_logit_rows,) int64 rows of the hidden states to project
    logits_row_owner: tuple[int, ...]  # (num_logit_rows,) seq index owning each logits row


@dataclass(frozen=True, kw_only=True, slots=True)
class ForwardMetadata:
    """What attention layers need. Empty segments have layouts with num_seqs == 0."""

    batch: ForwardBatch
    slot_mapping: torch.Tensor  # (num_tokens,) int64 KV token slot of each new token
    decode_attention: AttentionLayout  # decode segment (max_q == 1)
    prefill_attention: AttentionLayout  # prefill segment


@dataclass(frozen=True, kw_only=True, slots=True)
class Mamba2Metadata:
    """What Mamba layers need, on top of (not re-listing) the ForwardMetadata."""

    forward: ForwardMetadata
    decode_slots: torch.Tensor  # (num_decode_seqs,) int64 working slots of decode rows
    prefill_slots: torch.Tensor  # (num_prefill_seqs,) int64 working slots of prefill seqs
    chunk_layout: ChunkLayout  # SSD chunks of the prefill segment, aligned to absolute positions
    conv_layout: ConvLayout  # conv rows of the prefill segment
    has_mamba_track_mask: bool  # host flag: run the checkpoint copies this step
    num_decode_tracks: int  # the first this-many track entries come from decode rows
    track_conv_indices: (
        torch.Tensor
    )  # (M,) int64: decode entries: decode row; prefill: prefill-segment token
    track_ssm_src: (
        torch.Tensor
    )  # (M,) int64 into [decode rows' new states | prefill chunk-end states (S_p * C)]
    track_ssm_dst: torch.Tensor  # (M,) int64 checkpoint slots (conv window and SSM state)


def build_metadata(
    sched: ScheduledBatch,
    *,
    page_size: int,
    chunk_size: int,
    conv_kernel: int,
    device: torch.device | str,
    kv_capacity: int | None,
    track_capacity: int | None,
) -> Mamba2Metadata:
    """The one builder: every mode, eager and graph capture alike.

    Eager callers pass kv_capacity=None and track_capacity=None (shapes fit the batch). The decode
    graph runner passes fixed capacities so every tensor has the shape captured in its graph:
    attention key width `kv_capacity`, and (when tracking) exactly `track_capacity` track entries,
    the extra ones copying dummy slot 0 onto itself.
    """
    nd = sched.num_decode_seqs
    lens, starts = sched.seq_lens, sched.start_positions
    if nd and any(n != 1 for n in lens[:nd]):
        raise ValueError("decode sequences must feed exactly one token each")
    num_seqs = sched.num_seqs
    max_pages = max((len(p) for p in sched.kv_pages), default=0)
    if kv_capacity is not None:
        max_pages = max(max_pages, -(-kv_capacity // page_size))
    page_table = torch.tensor(
        [list(p) + [0] * (max_pages - len(p)) for p in sched.kv_pages], dtype=torch.int64
    ).view(num_seqs, max_pages)  # padding -> dummy page 0
    lens_t = torch.tensor(lens, dtype=torch.int64)
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), lens_t)
    token_offsets = [0]
    for n in lens:
        token_offsets.append(token_offsets[-1] + n)
    local = (
        torch.arange(len(sched.input_ids))
        - torch.tensor(token_offsets[:-1], dtype=torch.int64)[seq_of_token]
    )
    positions = torch.tensor(starts, dtype=torch.int64)[seq_of_token] + local
    slot_mapping = (
        page_table[seq_of_token, positions // page_size] * page_size + positions % page_size
    )
    # Token-slot table: row s lists the cache slot of each of its positions, page by page.
    token_table = (page_table[:, :, None] * page_size + torch.arange(page_size)).view(num_seqs, -1)
    num_decode_tokens = nd

    logits_rows = []  # rows of the hidden states projected to logits
    owners = []  # sequence owning each of those rows
    for s in range(sched.num_seqs):
        if s in sched.prompt_logprob_seqs:
            rows = range(token_offsets[s], token_offsets[s + 1])
        elif s in sched.logits_seqs:
            rows = range(token_offsets[s + 1] - 1, token_offsets[s + 1])
        else:
            continue
        logits_rows.extend(rows)
        owners.extend([s] * len(rows))

    batch = ForwardBatch(
        mode=sched.mode,
        num_seqs=sched.num_seqs,
        num_decode_seqs=nd,
        num_decode_tokens=num_decode_tokens,
        input_ids=torch.tensor(sched.input_ids, dtype=torch.int64, device=device),
        positions=positions.to(device),
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device),
        logits_row_owner=tuple(owners),
    )
    kv_lens = [start + n for start, n in zip(starts, lens)]
    forward = ForwardMetadata(
        batch=batch,
        slot_mapping=slot_mapping.to(device),
        decode_attention=build_attention_layout(
            list(lens[:nd]), kv_lens[:nd], token_table[:nd], device, kv_width=kv_capacity
        ),
        prefill_attention=build_attention_layout(
            list(lens[nd:]), kv_lens[nd:], token_table[nd:], device
        ),
    )

    prefill_lens, prefill_starts = list(lens[nd:]), list(starts[nd:])
    chunk_layout = build_chunk_layout(prefill_lens, prefill_starts, chunk_size, device)
    track_conv, track_src, track_dst, num_decode_tracks = _track_indices(
        sched, chunk_layout.num_chunks, chunk_size, token_offsets
    )
    if track_capacity is not None and sched.has_mamba_track_mask:
        if len(track_dst) > track_capacity or num_decode_tracks != len(track_dst):
            raise ValueError(
                "graph-captured batches carry at most track_capacity decode checkpoints"
            )
        pad = track_capacity - len(track_dst)
        track_conv, track_src, track_dst = (
            track_conv + [0] * pad,
            track_src + [0] * pad,
            track_dst + [0] * pad,
        )
        num_decode_tracks = track_capacity
    return Mamba2Metadata(
        forward=forward,
        decode_slots=torch.tensor(sched.mamba_slots[:nd], dtype=torch.int64, device=device),
        prefill_slots=torch.tensor(sched.mamba_slots[nd:], dtype=torch.int64, device=device),
        chunk_layout=chunk_layout,
        conv_layout=build_conv_layout(prefill_lens, conv_kernel, device),
        has_mamba_track_mask=sched.has_mamba_track_mask,
        num_decode_tracks=num_decode_tracks,
        track_conv_indices=torch.tensor(track_conv, dtype=torch.int64, device=device),
        track_ssm_src=torch.tensor(track_src, dtype=torch.int64, device=device),
        track_ssm_dst=torch.tensor(track_dst, dtype=torch.int64, device=device),
    )


def _track_indices(
    sched: ScheduledBatch, num_chunks: int, chunk_size: int, token_offsets: list[int]
) -> tuple[list[int], list[int], list[int], int]:
    """Translate TrackPoints into index lists, decode entries first."""
    if sched.has_mamba_track_mask != bool(sched.track_points):
        raise ValueError("has_mamba_track_mask must be True exactly when track points exist")
    nd = sched.num_decode_seqs
    decode = [p for p in sched.track_points if p.seq_index < nd]
    prefill = [p for p in sched.track_points if p.seq_index >= nd]
    conv, src, dst = [], [], []
    for p in decode:
        conv.append(p.seq_index)
        src.append(p.seq_index)
        dst.append(p.dst_slot)
    for p in prefill:
        s_p = p.seq_index - nd
        start = sched.start_positions[p.seq_index]
        end = start + p.token_offset + 1  # absolute position right after the token
        if end % chunk_size:
            raise ValueError(
                f"prefill checkpoint at position {end} is not a multiple of the chunk size {chunk_size}"
            )
        chunk = (start % chunk_size + p.token_offset) // chunk_size
        conv.append(token_offsets[p.seq_index] - token_offsets[nd] + p.token_offset)
        src.append(nd + s_p * num_chunks + chunk)
        dst.append(p.dst_slot)
    return conv, src, dst, len(decode)
