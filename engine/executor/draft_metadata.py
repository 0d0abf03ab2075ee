"""The MTP head's draft passes take their metadata from the target step they follow instead of
building it again (engine/spec_decode/mtp.py): one `build_metadata` per speculative step.

    target step (decode or verify rows)   built by the one builder into the fixed buffers
      │
      ├─ pass 1    the same rows, each with the token after it: `with_tokens` (eager, and a
      │            plan's recording) or `retoken` (a replay: the two token-level tensors
      │            rewritten in place)
      └─ pass 2..k one row per drafting request, one position further each pass: `advance`
                   rewrites, in place, the metadata a chained pass's plan recorded (itself
                   built once by the one builder, at that plan's recording), taking the rows'
                   token slots from the step's own token table

Nothing here constructs metadata of another shape: `with_tokens` derives with `replace`, the
other two only refill tensors of metadata the builder made, so no field can be dropped; a test
compares every tensor they leave against a fresh build (tests/test_draft_metadata.py).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from baton.engine.executor.forward_metadata import Mamba2Metadata, ScheduledBatch
from baton.engine.executor.metadata_rows import logits_rows_of


def same_rows(a: ScheduledBatch, b: ScheduledBatch) -> bool:
    """Whether two batches feed the same rows (sequences, lengths, positions, pages, slots),
    whatever tokens they feed (and whatever adapters: an MTP head's pass drafts as the base)."""
    return (
        a.mode == b.mode
        and a.num_decode_seqs == b.num_decode_seqs
        and a.num_verify_seqs == b.num_verify_seqs
        and a.seq_lens == b.seq_lens
        and a.start_positions == b.start_positions
        and a.kv_pages == b.kv_pages
        and a.mamba_slots == b.mamba_slots
    )


def token_fields(sched: ScheduledBatch, rows: int) -> tuple[list[int], list[int], tuple[int, ...]]:
    """`sched`'s tokens padded to `rows` (padding rows feed token 0), its logits rows and the
    sequence owning each: what `with_tokens` and `retoken` write."""
    padding = rows - sched.num_tokens
    if padding < 0:
        raise ValueError(f"{sched.num_tokens} tokens do not fit a step of {rows} rows")
    logits_rows, owners = logits_rows_of(sched, [0, *itertools.accumulate(sched.seq_lens)])
    return [*sched.input_ids, *(0,) * padding], logits_rows, tuple(owners)


def with_tokens(md: Mamba2Metadata, sched: ScheduledBatch) -> Mamba2Metadata:
    """`md`, built for a step, feeding `sched`'s tokens with `sched`'s logits rows instead: the
    batch of an MTP head's first pass over the step it follows (the same rows, each with the
    token after it; engine/spec_decode/mtp.py), without a second build of the same layouts.
    `sched` must have the rows `md` was built from (same_rows), or their first rows when `md`
    is a padded step's (engine/executor/graph_runner.py), whose padding rows then feed token 0.
    Only the token-level fields change: the head reads no recurrent state (its blocks are
    attention and MoE), so the state slots and track entries are left as they were."""
    batch = md.forward.batch
    if sched.num_seqs > batch.num_seqs:
        raise ValueError(f"{sched.num_seqs} sequences do not fit a step of {batch.num_seqs}")
    ids, logits_rows, owners = token_fields(sched, batch.input_ids.shape[0])
    device = batch.input_ids.device
    return dataclasses.replace(
        md,
        forward=dataclasses.replace(
            md.forward,
            batch=dataclasses.replace(
                batch,
                input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
                logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device),
                logits_row_owner=owners,
            ),
        ),
    )


def retoken(static: Mamba2Metadata, sched: ScheduledBatch) -> None:
    """`with_tokens` in place: `static` is a first pass's metadata `with_tokens` made over the
    same step (a recorded CPU plan's, whose replay reads these very tensors), and its logits
    rows must belong to the same sequences (plans are keyed by them)."""
    batch = static.forward.batch
    ids, logits_rows, owners = token_fields(sched, batch.input_ids.shape[0])
    if owners != batch.logits_row_owner:
        raise ValueError(f"logits rows of {owners}, recorded for {batch.logits_row_owner}")
    # host values straight into the CPU tensors (a tensor made and copied costs ~4x as much)
    batch.input_ids.numpy()[:] = ids
    batch.logits_indices.numpy()[:] = logits_rows


def advance(static: Mamba2Metadata, sched: ScheduledBatch, token_slots: torch.Tensor) -> None:
    """Refill `static`, a padded decode step's metadata made by the one builder (a chained
    pass's CPU plan's), in place for `sched`: one-token rows (its first rows; the rest padding,
    on dummy page 0 and slot 0) whose key slots are the first rows of `token_slots`, the (rows,
    width) token table of the step the pass follows, which holds the same pages.

    Every tensor the builder put in the fixed buffers is written, not only those that move
    with the positions: other steps' builds stage their own parts over the same buffers, so a
    part left as recorded (the logits rows, the adapter slots) may hold another step's ints by
    now. The rest (the query layout, the empty segments) lives outside them."""
    forward, layout = static.forward, static.forward.decode_attention
    if forward.window is not None:  # (no family has an MTP head beside windowed layers)
        raise ValueError("a chained pass over two page tables is built, not advanced")
    bs, n = forward.batch.num_seqs, sched.num_seqs
    if sched.mode != "decode" or forward.batch.mode != "decode" or n > bs:
        raise ValueError(f"{n} one-token rows cannot refill a decode step of {bs}")
    if sched.logits_seqs != tuple(range(n)):
        raise ValueError("a chained pass drafts at every row")
    pad = (0,) * (bs - n)
    positions = (*sched.start_positions, *pad)
    # host values straight into the CPU tensors (a tensor made and copied costs ~4x as much)
    forward.batch.input_ids.numpy()[:] = (*sched.input_ids, *pad)
    forward.batch.positions.numpy()[:] = positions
    static.decode_slots.numpy()[:] = (*sched.mamba_slots, *pad)
    forward.batch.logits_indices.numpy()[:] = range(bs)  # every row, as the padded build's
    forward.batch.lora_slots.numpy()[:] = (*sched.lora_slots, *(-1,) * (bs - n))
    layout.kv_lens.numpy()[:] = [p + 1 for p in positions]
    table = layout.kv_indices  # (bs, width)
    if token_slots.data_ptr() != table.data_ptr():  # (the same table after a decode step)
        table[:n].copy_(token_slots[:n, : table.shape[1]])
    if n < bs:
        table[n:].zero_()  # padding rows read and write dummy page 0
    torch.gather(table, 1, forward.batch.positions[:, None], out=forward.slot_mapping[:, None])
    if layout.mask.shape[-1]:  # as decode_attention_layout: keys < kv_len, never none
        width = layout.mask.shape[-1]
        keys = torch.arange(width, device=table.device)
        torch.lt(keys[None, :], layout.kv_lens[:, None], out=layout.mask.view(bs, width))
        layout.mask[..., 0] = True
