"""The host-side index work of the one metadata builder (engine/executor/forward_metadata.py):
page tables and token slots, logits rows, checkpoint (track) entries, the verify width. Plain
numpy and Python over a ScheduledBatch; nothing here touches a device."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from baton.engine.executor.forward_metadata import ScheduledBatch


def split_page_tables(kv_pages: tuple[tuple[int, ...], ...], page_tables: int) -> list[np.ndarray]:
    """(num_seqs, pages) int64 per page table, as wide as the longest page list (padding:
    dummy page 0), from each sequence's interleaved page entries (entry i * page_tables + t is
    table t's page of positions i * page_size ..: ModelStateSpec.page_tables)."""
    # a row copy per sequence: faster than one vectorized scatter at every batch size (batch
    # 1: 2.6 vs 16 us; 64 sequences of 48 pages: 69 vs 76 us)
    page_table = np.zeros((len(kv_pages), max(map(len, kv_pages), default=0)), dtype=np.int64)
    for row, pages in zip(page_table, kv_pages):
        row[: len(pages)] = pages
    return [page_table[:, t::page_tables] for t in range(page_tables)]


def token_slots(
    table: np.ndarray, seq_of_token: np.ndarray, positions: np.ndarray, page_size: int
) -> np.ndarray:
    """The KV token slot each new token writes in `table`'s pages (all zero when no sequence
    holds a page: a model with no paged state writes nothing by token)."""
    if not table.shape[1]:
        return np.zeros(len(positions), dtype=np.int64)
    return table[seq_of_token, positions // page_size] * page_size + positions % page_size


def verify_width(sched: ScheduledBatch) -> int:
    """q, the tokens every verify sequence feeds (0 without verify sequences)."""
    nd, nv = sched.num_decode_seqs, sched.num_verify_seqs
    widths = set(sched.seq_lens[nd : nd + nv])
    if len(sched.verify_slots) != nv:
        raise ValueError(f"{nv} verify sequences need {nv} verify slot lists")
    if len(widths) > 1 or widths & {0, 1}:
        raise ValueError(
            f"verify sequences must each feed the same q >= 2 tokens, got {sorted(widths)}"
        )
    q = widths.pop() if widths else 0
    if any(len(slots) != q for slots in sched.verify_slots):
        raise ValueError(f"each verify sequence needs one state slot per token ({q})")
    return q


def logits_rows_of(sched: ScheduledBatch, token_offsets: list[int]) -> tuple[list[int], list[int]]:
    """Rows of the hidden states projected to logits, and the sequence owning each: a sampled
    sequence's last row, every row of a verify sequence or of one that wants prompt logprobs."""
    nd, nv = sched.num_decode_seqs, sched.num_verify_seqs
    if not sched.prompt_logprob_seqs and not nv:  # the common case: one row a sequence
        owners = sorted(sched.logits_seqs)
        return [token_offsets[s + 1] - 1 for s in owners], owners
    every_row = set(sched.prompt_logprob_seqs) | set(range(nd, nd + nv))
    logits_rows, owners = [], []
    sampled = set(sched.logits_seqs)
    for s in range(sched.num_seqs):
        if s in every_row:
            rows = range(token_offsets[s], token_offsets[s + 1])
        elif s in sampled:
            rows = range(token_offsets[s + 1] - 1, token_offsets[s + 1])
        else:
            continue
        logits_rows.extend(rows)
        owners.extend([s] * len(rows))
    return logits_rows, owners


def track_indices(
    sched: ScheduledBatch, num_chunks: int, chunk_size: int, token_offsets: list[int]
) -> tuple[list[int], list[int], list[int], int]:
    """Translate TrackPoints into index lists, decode entries first. Verify sequences carry
    none: which of their positions to keep is known only after acceptance, when the scheduler
    copies the accepted position's slot (engine/core/scheduler_spec.py)."""
    if sched.has_mamba_track_mask != bool(sched.track_points):
        raise ValueError("has_mamba_track_mask must be True exactly when track points exist")
    nd, npf = sched.num_decode_seqs, sched.num_decode_seqs + sched.num_verify_seqs
    if any(nd <= p.seq_index < npf for p in sched.track_points):
        raise ValueError("verify sequences are checkpointed after acceptance, not in the forward")
    decode = [p for p in sched.track_points if p.seq_index < nd]
    prefill = [p for p in sched.track_points if p.seq_index >= npf]
    window, src, dst = [], [], []
    for p in decode:
        window.append(p.seq_index)
        src.append(p.seq_index)
        dst.append(p.dst_slot)
    for p in prefill:
        s_p = p.seq_index - npf
        start = sched.start_positions[p.seq_index]
        end = start + p.token_offset + 1  # absolute position right after the token
        if end % chunk_size:
            raise ValueError(
                f"prefill checkpoint at position {end} is not a multiple of the chunk size {chunk_size}"
            )
        chunk = (start % chunk_size + p.token_offset) // chunk_size
        window.append(token_offsets[p.seq_index] - token_offsets[npf] + p.token_offset)
        src.append(nd + s_p * num_chunks + chunk)
        dst.append(p.dst_slot)
    return window, src, dst, len(decode)
