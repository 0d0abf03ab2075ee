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

Token order inside a batch, three segments:

    [ decode: one token each | verify: q = k + 1 tokens each | prefill chunks ]

A verify sequence (speculative decoding, engine/spec_decode/) feeds its last token and k drafts;
attention reads them as q causal queries over the paged prefix, every recurrent mixer keeps its
state after each of the q tokens in slot `verify_slots[s][i]` (the first: the working slot, in
place; then k scratch slots the request holds), and logits come back for all q positions.
Acceptance then picks the slot of the last accepted position: that is the whole rollback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from baton.engine.executor.metadata_buffers import (
    MetadataBuffers,
    decode_attention_layout,
    prefill_attention_layout,
    prefill_layouts,
    verify_attention_layout,
)
from baton.engine.executor.metadata_rows import (
    logits_rows_of,
    split_page_tables,
    token_slots,
    track_indices,
    verify_width,
)
from baton.kernels.layouts import AttentionLayout, ChunkLayout, ConvLayout

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
    num_verify_seqs: int  # the sequences right after the decode ones, at least 2 tokens each
    input_ids: tuple[int, ...]  # (num_tokens,) packed
    seq_lens: tuple[int, ...]  # (num_seqs,) tokens fed this step
    start_positions: tuple[int, ...]  # (num_seqs,) tokens already in the state/cache
    # (num_seqs,) page entries covering start + len tokens, the page tables interleaved (entry
    # i * page_tables + t: table t's page of positions i * page_size ..; ModelStateSpec)
    kv_pages: tuple[tuple[int, ...], ...]
    mamba_slots: tuple[int, ...]  # (num_seqs,) working Mamba slot
    # (num_verify_seqs,) each (q,): the slot that receives the recurrent state after each fed
    # token (the first is the working slot itself)
    verify_slots: tuple[tuple[int, ...], ...]
    logits_seqs: tuple[int, ...]  # sequences whose logits are needed (a verify's: all q rows)
    prompt_logprob_seqs: tuple[int, ...]  # sequences needing logits for every token fed
    has_mamba_track_mask: bool  # decided on the host: is any TrackPoint present
    track_points: tuple[TrackPoint, ...]
    # (num_seqs,) the adapter slot each sequence runs under (engine/lora/slots.py), -1: none
    lora_slots: tuple[int, ...]

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
    num_verify_seqs: int
    num_verify_tokens: int  # num_verify_seqs * q, right after the decode tokens
    input_ids: torch.Tensor  # (num_tokens,) int64
    positions: torch.Tensor  # (num_tokens,) int64 absolute positions
    logits_indices: torch.Tensor  # (num_logit_rows,) int64 rows of the hidden states to project
    logits_row_owner: tuple[int, ...]  # (num_logit_rows,) seq index owning each logits row
    lora_slots: torch.Tensor  # (num_tokens,) int64 adapter slot of each token's row, -1: none
    has_lora: bool  # host fact: some row runs under an adapter (else the deltas are skipped)


@dataclass(frozen=True, kw_only=True, slots=True)
class WindowTable:
    """The second page table's token slots and layouts (ModelStateSpec.page_tables == 2: the
    windowed kinds beside full ones read their own pages), the same fields as ForwardMetadata's
    so a windowed layer reads either alike."""

    slot_mapping: torch.Tensor
    decode_attention: AttentionLayout
    verify_attention: AttentionLayout
    prefill_attention: AttentionLayout


@dataclass(frozen=True, kw_only=True, slots=True)
class ForwardMetadata:
    """What attention layers need. Empty segments have layouts with num_seqs == 0."""

    batch: ForwardBatch
    slot_mapping: torch.Tensor  # (num_tokens,) int64 KV token slot of each new token
    decode_attention: AttentionLayout  # decode segment (max_q == 1)
    verify_attention: AttentionLayout  # verify segment (max_q == q, every sequence q queries)
    prefill_attention: AttentionLayout  # prefill segment
    # the windowed kinds' table beside full ones (two page tables), else None
    window: WindowTable | None

    def table(self, windowed: bool) -> ForwardMetadata | WindowTable:
        """What a paged layer reads: the window table for a windowed kind when there is one."""
        return self.window if windowed and self.window is not None else self


@dataclass(frozen=True, kw_only=True, slots=True)
class Mamba2Metadata:
    """What Mamba layers need, on top of (not re-listing) the ForwardMetadata."""

    forward: ForwardMetadata
    decode_slots: torch.Tensor  # (num_decode_seqs,) int64 working slots of decode rows
    # (num_verify_seqs, q + 1) int64: column 0 the slot read (working), column i + 1 the slot
    # that receives the state after token i
    verify_slots: torch.Tensor
    prefill_slots: torch.Tensor  # (num_prefill_seqs,) int64 working slots of prefill seqs
    chunk_layout: ChunkLayout  # SSD chunks of the prefill segment, aligned to absolute positions
    window_layout: ConvLayout  # conv window rows of the prefill segment
    has_mamba_track_mask: bool  # host flag: run the checkpoint copies this step
    num_decode_tracks: int  # the first this-many track entries come from decode rows
    track_window_indices: (
        torch.Tensor
    )  # (M,) int64: decode entries: decode row; prefill: prefill-segment token
    track_state_src: (
        torch.Tensor
    )  # (M,) int64 into [decode rows' new states | prefill chunk-end states (S_p * C)]
    track_state_dst: torch.Tensor  # (M,) int64 checkpoint slots (window and recurrent state)


def build_metadata(
    sched: ScheduledBatch,
    *,
    page_size: int,
    page_tables: int,
    chunk_size: int,
    window_width: int,
    buffers: MetadataBuffers,
    decode_mask: bool,
    kv_capacity: int | None,
    track_capacity: int | None,
) -> Mamba2Metadata:
    """The one builder: every mode, eager and graph capture alike.

    Every per-token and per-sequence index goes through `buffers` (one host-to-device copy of
    int32s, the decode page table as pages); the decode attention layout is derived on the
    device. `decode_mask`: build the decode rows' attention mask (only the torch attention path
    reads it; the C and Triton decode kernels stop at kv_len), else it has width 0.

    Eager callers pass kv_capacity=None and track_capacity=None (shapes fit the batch). The decode
    graph runner passes fixed capacities so every tensor has the shape captured in its graph:
    attention key width `kv_capacity`, and (when tracking) exactly `track_capacity` track entries,
    the extra ones copying dummy slot 0 onto itself.
    """
    nd, nv = sched.num_decode_seqs, sched.num_verify_seqs
    lens, starts = sched.seq_lens, sched.start_positions
    if nd and any(n != 1 for n in lens[:nd]):
        raise ValueError("decode sequences must feed exactly one token each")
    q = verify_width(sched)
    if len(sched.lora_slots) != sched.num_seqs:
        raise ValueError(f"{sched.num_seqs} sequences need {sched.num_seqs} adapter slots")
    npf = nd + nv  # the first prefill sequence
    num_seqs = sched.num_seqs
    lens_np = np.asarray(lens, dtype=np.int64).reshape(num_seqs)
    starts_np = np.asarray(starts, dtype=np.int64).reshape(num_seqs)
    token_offsets = [0]
    for n in lens:
        token_offsets.append(token_offsets[-1] + n)
    seq_of_token = np.repeat(np.arange(num_seqs), lens_np)
    positions = np.repeat(starts_np - np.asarray(token_offsets[:-1]), lens_np) + np.arange(
        token_offsets[-1]
    )
    # one page table per kind of paged state (ScheduledBatch.kv_pages interleaves them), each
    # as wide as the batch's longest page list; they cross over as int32 pages, never as a
    # token-level table
    tables = split_page_tables(sched.kv_pages, page_tables)
    num_pages = tables[0].shape[1]
    slot_mappings = [token_slots(t, seq_of_token, positions, page_size) for t in tables]
    slot_mapping = slot_mappings[0]
    kv_lens = starts_np + lens_np

    logits_rows, owners = logits_rows_of(sched, token_offsets)

    prefill_lens, prefill_starts = list(lens[npf:]), list(starts[npf:])
    num_chunks = max(
        (
            (p % chunk_size + n + chunk_size - 1) // chunk_size
            for p, n in zip(prefill_starts, prefill_lens)
        ),
        default=0,
    )
    track_window, track_src, track_dst, num_decode_tracks = track_indices(
        sched, num_chunks, chunk_size, token_offsets
    )
    if track_capacity is not None and sched.has_mamba_track_mask:
        if len(track_dst) > track_capacity or num_decode_tracks != len(track_dst):
            raise ValueError(
                "graph-captured batches carry at most track_capacity decode checkpoints"
            )
        pad = track_capacity - len(track_dst)
        track_window, track_src, track_dst = (
            track_window + [0] * pad,
            track_src + [0] * pad,
            track_dst + [0] * pad,
        )
        num_decode_tracks = track_capacity

    ints, longs = buffers.stage(
        [
            np.asarray(sched.input_ids, dtype=np.int64),
            positions,
            slot_mapping,
            np.asarray(logits_rows, dtype=np.int64),
            np.asarray(sched.mamba_slots, dtype=np.int64),
            kv_lens[:nd],
            np.asarray(track_window, dtype=np.int64),
            np.asarray(track_src, dtype=np.int64),
            np.asarray(track_dst, dtype=np.int64),
            kv_lens[nd:npf],
            np.asarray(
                [(sched.mamba_slots[nd + v], *sched.verify_slots[v]) for v in range(nv)],
                dtype=np.int64,
            ).reshape(-1),
            np.repeat(np.asarray(sched.lora_slots, dtype=np.int64).reshape(num_seqs), lens_np),
            *slot_mappings[1:],
            # Last, the page tables, as wide as the batch's longest sequence: every part
            # before them keeps its offset from step to step at a batch size (a captured step
            # reads its parts where its recording found them), and a graph-runner step has
            # decode rows or verify rows, never both, so the one of them it has comes last.
            *(part for table in tables for part in (table[:nd].ravel(), table[nd:npf].ravel())),
        ]
    )
    input_ids, positions_d, slot_mapping_d, logits_d, slots = longs[:5]
    track_window_d, track_src_d, track_dst_d = longs[6:9]
    first_table = 12 + page_tables - 1
    decode_kv_lens_d, verify_kv_lens_d, verify_slots_d = ints[5], ints[9], longs[10]
    batch = ForwardBatch(
        mode=sched.mode,
        num_seqs=sched.num_seqs,
        num_decode_seqs=nd,
        num_decode_tokens=nd,
        num_verify_seqs=nv,
        num_verify_tokens=nv * q,
        input_ids=input_ids,
        positions=positions_d,
        logits_indices=logits_d,
        logits_row_owner=tuple(owners),
        lora_slots=longs[11],
        has_lora=any(slot >= 0 for slot in sched.lora_slots),
    )
    prefill_attention, chunk_layout, window_layout = prefill_layouts(
        buffers,
        prefill_lens,
        prefill_starts,
        kv_lens[npf:].tolist(),
        tables[0][npf:],
        page_size=page_size,
        chunk_size=chunk_size,
        window_width=window_width,
    )
    decode_kv = kv_capacity if kv_capacity is not None else int(kv_lens[:nd].max(initial=0))
    verify_kv = kv_capacity if kv_capacity is not None else int(kv_lens[nd:npf].max(initial=0))

    def attention(table: int) -> dict[str, AttentionLayout]:
        """The decode and verify layouts over page table `table` (its staged parts)."""
        suffix = "" if table == 0 else "_window"
        decode_pages = ints[first_table + 2 * table]
        verify_pages = ints[first_table + 2 * table + 1]
        return dict(
            decode_attention=decode_attention_layout(
                buffers,
                decode_kv_lens_d,
                decode_pages.view(nd, num_pages),
                page_size,
                max_kv=decode_kv,
                with_mask=decode_mask,
                segment="decode" + suffix,
            ),
            verify_attention=verify_attention_layout(
                buffers,
                verify_kv_lens_d,
                verify_pages.view(nv, num_pages),
                page_size,
                q=q,
                max_kv=verify_kv,
                with_mask=decode_mask,
                segment="verify" + suffix,
            ),
        )

    window = None
    if page_tables == 2:
        window = WindowTable(
            slot_mapping=longs[12],
            prefill_attention=prefill_attention
            if not prefill_lens  # (the empty layout, built once)
            else prefill_attention_layout(
                buffers, prefill_lens, kv_lens[npf:].tolist(), tables[1][npf:], page_size
            ),
            **attention(1),
        )
    forward = ForwardMetadata(
        batch=batch,
        slot_mapping=slot_mapping_d,
        prefill_attention=prefill_attention,
        window=window,
        **attention(0),
    )
    return Mamba2Metadata(
        forward=forward,
        decode_slots=slots[:nd],
        verify_slots=verify_slots_d.view(nv, q + 1),
        prefill_slots=slots[npf:],
        chunk_layout=chunk_layout,
        window_layout=window_layout,
        has_mamba_track_mask=sched.has_mamba_track_mask,
        num_decode_tracks=num_decode_tracks,
        track_window_indices=track_window_d,
        track_state_src=track_src_d,
        track_state_dst=track_dst_d,
    )
