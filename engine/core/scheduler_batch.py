"""One step's rows -> the ScheduledBatch carrier (engine/executor/forward_metadata.py), every
field given: decode rows first, then verify rows (the last token and its drafts), then prefill
chunks, the order the model expects."""

from __future__ import annotations

from baton.engine.core.request import Request
from baton.engine.core.scheduler_blocks import PrefixBlocks
from baton.engine.core.scheduler_spec import Speculation
from baton.engine.executor.forward_metadata import ScheduledBatch

Rows = list[tuple[Request, int]]  # (request, tokens it feeds this step)


def page_table(req: Request, tables: int) -> tuple[int, ...]:
    """The request's page entries by position (`tables` interleaved page tables:
    ModelStateSpec.page_tables). Pages released behind a sliding window are 0 in
    `req.kv_pages` (engine/core/scheduler_memory.py); here they show the request's last page
    of the same table instead, so that no live row's table names the dummy page that padded
    rows write (the graph runners refuse that). Those positions are behind the window of
    every layer that reads that table: nothing reads or writes them
    (kernels/window_attention.py), whatever page they name."""
    pages = req.kv_pages
    if 0 not in pages:
        return tuple(pages)
    last = len(pages) - tables
    return tuple(p or pages[last + i % tables] for i, p in enumerate(pages))


def scheduled_batch(
    decodes: Rows, verifies: Rows, prefills: Rows, blocks: PrefixBlocks | None, page_tables: int
) -> ScheduledBatch:
    """The batch of these rows (requests holding `page_tables` interleaved page tables);
    `blocks` marks the rows whose tokens cross a checkpoint
    position (the track points and `has_mamba_track_mask`; verify rows are checkpointed only at
    accepted positions, after the step)."""
    rows = decodes + verifies + prefills
    nd, nv = len(decodes), len(verifies)
    input_ids = []  # the step's tokens, row after row
    logits_seqs, prompt_logprob_seqs = [], []
    for s, (req, n) in enumerate(rows):
        if nd <= s < nd + nv:  # the last token, then the drafts
            input_ids.extend([req.all_ids[req.num_computed], *req.drafts])
            logits_seqs.append(s)
            continue
        input_ids.extend(req.all_ids[req.num_computed : req.num_computed + n])
        if req.num_computed + n == req.num_tokens:
            logits_seqs.append(s)
        if req.wants_prompt_logprobs and req.num_computed < len(req.prompt_ids):
            prompt_logprob_seqs.append(s)
    if not prefills:
        mode = "verify" if verifies else "decode"
    else:
        mode = "extend" if not decodes and not verifies else "mixed"
    points = blocks.track_points(rows, skip=range(nd, nd + nv)) if blocks is not None else []
    return ScheduledBatch(
        mode=mode,
        request_ids=tuple(req.request_id for req, _ in rows),
        num_decode_seqs=nd,
        num_verify_seqs=nv,
        input_ids=tuple(input_ids),
        seq_lens=tuple(n for _, n in rows),
        start_positions=tuple(req.num_computed for req, _ in rows),
        kv_pages=tuple(page_table(req, page_tables) for req, _ in rows),
        mamba_slots=tuple(req.mamba_slot for req, _ in rows),
        verify_slots=tuple(Speculation.verify_slots(req) for req, _ in verifies),
        logits_seqs=tuple(logits_seqs),
        prompt_logprob_seqs=tuple(prompt_logprob_seqs),
        has_mamba_track_mask=bool(points),
        track_points=tuple(points),
        lora_slots=tuple(req.lora_slot for req, _ in rows),
    )
