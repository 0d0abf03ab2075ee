"""Pool occupancy of a model with sliding-window and full attention over a long decode (issue 54).

    python -m baton.bench.offline.window_pages                   # 2,048 tokens, window 256
    python -m baton.bench.offline.window_pages --tokens 4096 --requests 4

Builds LFM3 with the published 1.7B config's layers (tests/fixtures/published_configs/lfm3_1_7b:
13 convs, 6 full and 5 sliding attention layers, window 256, 4 KV heads of 128) at a small
hidden width (the pool's bytes follow the KV heads, not the width), random weights, and
decodes --tokens greedy tokens after a 16-token prompt for each of --requests requests on one
engine (bf16, pages of 16), reading the pool's page entries in use before every step. Prints:
- the peak and the last step's page entries (the full table's and the sliding table's) and the
  pool bytes they hold: entries x page size x the pool's bytes per page-slot token (the
  sliding pools live inside the full ones: ModelStateSpec.bytes_per_page_token);
- what one page table would hold at the same step (every position's page, every attention
  layer's K/V: the layout before the sliding layers had a table of their own), and the ratio.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

FIXTURE = (
    Path(__file__).resolve().parents[2]
    / "tests"
    / "fixtures"
    / "published_configs"
    / "lfm3_1_7b"
    / "config.json"
)
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4)


def save_model(path: str, window: int) -> None:
    import torch
    import transformers

    raw = json.loads(FIXTURE.read_text())
    raw.update(SMALL, sliding_window=window, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    raw.pop("architectures", None)
    raw.pop("dtype", None)
    torch.manual_seed(0)
    transformers.Lfm3ForCausalLM(transformers.Lfm3Config(**raw)).save_pretrained(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="new tokens per request")
    parser.add_argument("--window", type=int, default=256, help="the sliding layers' window")
    parser.add_argument("--requests", type=int, default=1)
    args = parser.parse_args(argv)

    from baton import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as model_dir:
        save_model(model_dir, args.window)
        prompt_len, page = 16, 16
        llm = LLM(
            model_dir,
            dtype="bfloat16",
            page_size=page,
            max_model_len=prompt_len + args.tokens + page,
            enable_prefix_caching=False,
        )
        engine = llm.engine
        spec = engine.state_spec
        used: list[tuple[int, int]] = []  # (page entries in use, positions the batch reached)
        forward = engine.forward

        def counting(sched):
            reached = sum(s + n for s, n in zip(sched.start_positions, sched.seq_lens))
            used.append((engine.pages.used, reached))
            return forward(sched)

        engine.forward = counting
        prompts = [[3 + (7 * i + j) % 500 for j in range(prompt_len)] for i in range(args.requests)]
        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts, params)
        assert engine.pages.used == 0

    slot_bytes = spec.bytes_per_page_token() * page  # one page entry
    one_table = spec.bytes_per_token() * page  # one page of every layer, one table

    def report(what: str, entries: int, reached: int) -> None:
        pages = -(-reached // page) if args.requests == 1 else None
        held = entries * slot_bytes
        line = f"{what}: {entries} page entries, {held / 2**20:.2f} MiB"
        if pages is not None:
            before = pages * one_table
            line += (
                f"; one table would hold {pages} pages, {before / 2**20:.2f} MiB:"
                f" {held / before:.0%} of it"
            )
        print(line)

    print(
        f"LFM3-1.7B layers ({spec.page_tables} page tables, window {spec.page_window}),"
        f" {args.requests} x (16 + {args.tokens}) tokens, pages of {page}:"
        f" {spec.bytes_per_page_token()} B per page-slot token,"
        f" {spec.bytes_per_token()} B per token of every layer"
    )
    peak = max(used)
    report("peak", peak[0], peak[1])
    report("last step", used[-1][0], used[-1][1])


if __name__ == "__main__":
    main()
