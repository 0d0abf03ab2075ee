"""Buffers the metadata builder fills every step, allocated once per runner.

    host ints (int32, pinned on CUDA)  ──one copy of the used prefix──>  device ints (int32)
                                                                       └─widened─> device longs (int64)
    [input_ids | positions | slot_mapping | logits rows | mamba slots | decode kv_lens |
     track window | track src | track dst | verify kv_lens |
     verify slot table (num_verify_seqs x (q + 1)) |
     decode page table (num_decode_seqs x batch pages) | verify page table]

    device ints' page tables ──expanded on the device──> decode / verify token tables
                                                         (rows x width, int64)

One step moves only what its batch holds: the page table is int32 pages, as wide as the batch's
longest sequence, never a token-level table and never as wide as `max_model_len`, so the bytes
copied per decode step do not depend on the capacity the engine was sized for. The decode (and
speculative verify) token tables the attention kernels read live on the device only; a step writes the columns its pages
cover and leaves the rest (stale but valid slots, never read: every kernel stops at kv_len).

On the CPU host and device are one tensor and nothing is copied. The int64 fields of the metadata are views of the device longs: a CUDA-graph replay finds them
already where its graph reads them (same offsets for the same batch size). The buffers grow
(doubling)
when a step needs more, except when `fixed`: a CUDA-graph runner sizes them for its largest
batch and full capacity up front, since its graphs captured their addresses.
"""

from __future__ import annotations

import numpy as np
import torch

from baton.kernels.attention import build_attention_layout
from baton.kernels.conv1d import build_window_layout
from baton.kernels.layouts import AttentionLayout, ChunkLayout, ConvLayout
from baton.kernels.ssd import build_chunk_layout


class StagedViews:
    """The views of one staged buffer's parts, part i = buffer[offsets[i]:offsets[i + 1]], each
    made when it is read (an int index gives a view, a slice a list of them) and kept in `made`
    (the buffers' own cache, emptied when they are reallocated): a part at the offsets of an
    earlier step's is that step's view again, not a new tensor (a view costs ~5 us; a padded
    decode step reads the same parts at the same offsets every time)."""

    __slots__ = ("buffer", "offsets", "made")

    def __init__(
        self,
        buffer: torch.Tensor,
        offsets: list[int],
        made: dict[tuple[int, int], torch.Tensor],
    ):
        self.buffer = buffer
        self.offsets = offsets
        self.made = made

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int | slice) -> torch.Tensor | list[torch.Tensor]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"part {index} of {len(self)}")
        span = (self.offsets[index], self.offsets[index + 1])
        view = self.made.get(span)
        if view is None:
            view = self.made[span] = self.buffer[span[0] : span[1]]
        return view


class MetadataBuffers:
    def __init__(
        self, device: torch.device | str, *, ints: int, kv_rows: int, kv_width: int, fixed: bool
    ):
        self.device = torch.device(device)
        self.fixed = fixed
        self.last_copy_bytes = 0  # bytes of the latest step's host-to-device copy (0 on CPU)
        self._copy_done: torch.cuda.Event | None = None
        self._alloc_ints(ints)
        # The token tables of the decode rows and of the verify rows (speculation), each
        # allocated once: (rows, width) int64 token slots, expanded on the device; "_window":
        # the same over the second page table (ModelStateSpec.page_tables), allocated when a
        # step first has one.
        self.token_tables = {
            segment: torch.zeros(kv_rows, kv_width, dtype=torch.int64, device=self.device)
            for segment in ("decode", "verify")
        }
        # (chunk_size, window_width) -> the empty prefill layouts of decode-only steps;
        # "verify" -> the empty verify layout of steps without speculation
        self.empty_layouts: dict[tuple[int, int] | str, tuple | AttentionLayout] = {}
        # decode rows -> (arange(rows) int64, arange(rows + 1) int32, the (rows, 1, 1, 0) mask
        # of the kernels that read none): the query layout of one query per sequence
        self.decode_rows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # (verify rows, q) -> the same for q queries per sequence: (arange(rows * q) int64,
        # arange(0, (rows + 1) q, q) int32, the (rows, 1, q, 0) mask of the kernels that read none)
        self.verify_rows: dict[
            tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        ] = {}
        # page size -> arange(page_size) int64: a page's token offsets (token_table)
        self.page_offsets: dict[int, torch.Tensor] = {}

    def _alloc_ints(self, size: int) -> None:
        on_cuda = self.device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=on_cuda)
        self.host_np = self.host.numpy()
        self.ints = (
            self.host
            if self.device.type == "cpu"
            else torch.zeros(size, dtype=torch.int32, device=self.device)
        )
        self.longs = torch.zeros(size, dtype=torch.int64, device=self.device)
        # (start, end) -> the view of that span, of the int32 and of the int64 buffer
        self.int_views: dict[tuple[int, int], torch.Tensor] = {}
        self.long_views: dict[tuple[int, int], torch.Tensor] = {}

    def stage(self, parts: list[np.ndarray]) -> tuple[StagedViews, StagedViews]:
        """Pack `parts` (1-D integer arrays) into the host buffer, copy the used prefix to the
        device in one copy, widen it there in one more, and return the int32 and the int64 device
        views of the parts (each view made when it is read: a step reads about half)."""
        total = sum(len(p) for p in parts)
        if total > self.host.numel():
            if self.fixed:
                raise ValueError(
                    f"step needs {total} metadata ints, buffers hold {self.host.numel()}"
                )
            self._alloc_ints(max(total, 2 * self.host.numel()))
        if self._copy_done is not None:
            # The previous step's asynchronous copy may still read the pinned buffer.
            self._copy_done.synchronize()
        offsets = [0]
        for part in parts:
            start = offsets[-1]
            self.host_np[start : start + len(part)] = part
            offsets.append(start + len(part))
        if self.ints is not self.host:
            self.ints[:total].copy_(self.host[:total], non_blocking=True)
            if self.device.type == "cuda":
                self._copy_done = torch.cuda.Event()
                self._copy_done.record()
        self.last_copy_bytes = 0 if self.ints is self.host else total * 4
        self.longs[:total].copy_(self.ints[:total])
        return (
            StagedViews(self.ints, offsets, self.int_views),
            StagedViews(self.longs, offsets, self.long_views),
        )

    def token_table(
        self, segment: str, page_table: torch.Tensor, page_size: int, width: int
    ) -> torch.Tensor:
        """(rows, width) int64 token slots of the decode (or verify) rows from their int32 page
        table (rows, pages), expanded on the device into that segment's allocated-once table."""
        rows, pages = page_table.shape
        covered = pages * page_size
        table = self.token_tables.get(segment)
        if table is None:  # a window table: as its full table's
            table = self.token_tables[segment] = torch.zeros_like(
                self.token_tables[segment.removesuffix("_window")]
            )
        if rows > table.shape[0] or max(width, covered) > table.shape[1]:
            if self.fixed:
                raise ValueError(
                    f"{segment} table of {rows} x {max(width, covered)} exceeds the fixed "
                    f"{tuple(table.shape)}"
                )
            table = self.token_tables[segment] = torch.zeros(
                max(rows, 2 * table.shape[0]),
                max(width, covered, 2 * table.shape[1]),
                dtype=torch.int64,
                device=self.device,
            )
        offsets = self.page_offsets.get(page_size)
        if offsets is None:
            offsets = self.page_offsets[page_size] = torch.arange(
                page_size, dtype=torch.int64, device=self.device
            )
        table = table[:rows]
        # slot = page * page_size + offset, written in place (one op)
        torch.add(
            offsets,
            page_table[:, :, None],
            alpha=page_size,
            out=table[:, :covered].view(rows, pages, page_size),
        )
        return table[:, :width]


def prefill_layouts(
    buffers: MetadataBuffers,
    lens: list[int],
    starts: list[int],
    kv_lens: list[int],
    page_table: np.ndarray,
    *,
    page_size: int,
    chunk_size: int,
    window_width: int,
) -> tuple[AttentionLayout, ChunkLayout, ConvLayout]:
    """The prefill segment's layouts, by the kernels' own builders (their host token table is
    as long as the chunks, and prefill steps are few). A decode-only step reuses empty layouts
    built once, so that nothing but the staged ints crosses over."""
    device = buffers.device
    if not lens:
        key = (chunk_size, window_width)
        if key not in buffers.empty_layouts:
            buffers.empty_layouts[key] = (
                build_attention_layout([], [], torch.zeros(0, 0, dtype=torch.int64), device),
                build_chunk_layout([], [], chunk_size, device),
                build_window_layout([], window_width, device),
            )
        return buffers.empty_layouts[key]
    return (
        prefill_attention_layout(buffers, lens, kv_lens, page_table, page_size),
        build_chunk_layout(lens, starts, chunk_size, device),
        build_window_layout(lens, window_width, device),
    )


def prefill_attention_layout(
    buffers: MetadataBuffers,
    lens: list[int],
    kv_lens: list[int],
    page_table: np.ndarray,
    page_size: int,
) -> AttentionLayout:
    """A non-empty prefill segment's attention layout over `page_table` (prefill_layouts'
    first; a second page table's alone: ModelStateSpec.page_tables)."""
    table = torch.from_numpy(page_table[:, :, None] * page_size + np.arange(page_size))
    return build_attention_layout(lens, kv_lens, table.reshape(len(lens), -1), buffers.device)


def decode_attention_layout(
    buffers: MetadataBuffers,
    kv_lens: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    *,
    max_kv: int,
    with_mask: bool,
    segment: str,
) -> AttentionLayout:
    """What `build_attention_layout` gives for one query per sequence, built on the device from
    the staged int32 kv_lens (nd,) and page table (nd, pages): nothing else crosses over."""
    nd = kv_lens.shape[0]
    device = buffers.device
    if nd not in buffers.decode_rows:  # per batch size, once: replays find them in place
        buffers.decode_rows[nd] = (
            torch.arange(nd, dtype=torch.int64, device=device),
            torch.arange(nd + 1, dtype=torch.int32, device=device),
            torch.ones(nd, 1, 1, 0, dtype=torch.bool, device=device),
        )
    rows, query_start_loc, no_mask = buffers.decode_rows[nd]
    if with_mask:
        mask = torch.arange(max_kv, device=device)[None, :] < kv_lens[:, None]
        if max_kv:
            mask[:, 0] = True  # as build_attention_layout: no all -inf rows
        mask = mask.view(nd, 1, 1, max_kv)
    else:
        mask = no_mask
    return AttentionLayout(
        num_seqs=nd,
        max_q=1 if nd else 0,
        max_kv=max_kv,
        query_start_loc=query_start_loc,
        kv_lens=kv_lens,
        kv_indices=buffers.token_table(segment, page_table, page_size, max_kv),
        q_slot=rows,
        slot_q=rows,
        mask=mask,
    )


def verify_attention_layout(
    buffers: MetadataBuffers,
    kv_lens: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    *,
    q: int,
    max_kv: int,
    with_mask: bool,
    segment: str,
) -> AttentionLayout:
    """What `build_attention_layout` gives for `q` causal queries per sequence (a speculative
    verify: the last token and its k drafts over the cached prefix), built on the device from
    the staged int32 kv_lens (nv,) and page table (nv, pages) like the decode layout, so a
    CUDA graph can capture it: every sequence has exactly q queries, so the packed and the
    padded query orders coincide."""
    nv = kv_lens.shape[0]
    device = buffers.device
    if nv == 0:  # most steps: an empty layout built once
        if "verify" not in buffers.empty_layouts:
            empty = torch.zeros(0, dtype=torch.int64, device=device)
            buffers.empty_layouts["verify"] = AttentionLayout(
                num_seqs=0,
                max_q=0,
                max_kv=0,
                query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
                kv_lens=kv_lens,
                kv_indices=torch.zeros(0, 0, dtype=torch.int64, device=device),
                q_slot=empty,
                slot_q=empty,
                mask=torch.ones(0, 1, 0, 0, dtype=torch.bool, device=device),
            )
        return buffers.empty_layouts["verify"]
    if (nv, q) not in buffers.verify_rows:  # per shape, once: replays find them in place
        buffers.verify_rows[nv, q] = (
            torch.arange(nv * q, dtype=torch.int64, device=device),
            torch.arange(0, (nv + 1) * q, q, dtype=torch.int32, device=device),
            torch.ones(nv, 1, q, 0, dtype=torch.bool, device=device),
        )
    flat, query_start_loc, no_mask = buffers.verify_rows[nv, q]
    if with_mask:
        # query i of a sequence sits at kv_len - q + i and sees keys 0 .. that
        q_pos = kv_lens[:, None].long() - q + torch.arange(q, device=device)[None, :]
        keys = torch.arange(max_kv, device=device)
        mask = keys[None, None, :] <= q_pos[:, :, None]
        if max_kv:
            mask[:, :, 0] = True  # as build_attention_layout: no all -inf rows
        mask = mask.unsqueeze(1)
    else:
        mask = no_mask
    return AttentionLayout(
        num_seqs=nv,
        max_q=q if nv else 0,
        max_kv=max_kv,
        query_start_loc=query_start_loc,
        kv_lens=kv_lens,
        kv_indices=buffers.token_table(segment, page_table, page_size, max_kv),
        q_slot=flat,
        slot_q=flat,
        mask=mask,
    )
