"""What a JSON schema costs decode throughput: batch 32 with a grammar vs without, same run.

    python -m baton.bench.offline.structured_output --config 19m,110m --dtype float32 --rounds 3 --output r.json

Each config (bench/workloads.py, random weights) gets a byte-level tokenizer of its 32000-token
vocabulary shaped like a trained one (save_byte_tokenizer), so xgrammar's masks have real work. The workload is the side-by-side one (32 prompts of 128
random ids, 64 new tokens each). The grammar run asks every request for a JSON array of records
(strings, bounded integers, enums, a nested object, an email format) with `minItems` high enough
that no request can end early: both runs decode the same number of tokens at batch 32. The two
runs alternate `--rounds` times; each round's ratio pairs neighbours (a burst of load on a shared
machine skews one round), the median is the figure, in wall time and per CPU second of the
process (steadier when other work shares the cores). Also printed: the time the engine spent
filling and applying bitmasks per step (engine/structured_output/grammars.py's MaskTiming).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

import torch

from baton.bench.workloads import CONFIGS, save_model, workload

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "zip": {"pattern": "^[0-9]{5}$", "type": "string"},
            },
            "required": ["street", "zip"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "role", "tags", "address", "active"],
}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 1000}


def save_byte_tokenizer(path: str, vocab_size: int, seed: int = 0) -> None:
    """A byte-level BPE tokenizer (decoding only: no merges) shaped like a trained one: the 256
    bytes, the model's special tokens, the JSON punctuation pairs real vocabularies learn, and
    random words of 2-8 letters or digits, a third of them with a leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    rng = random.Random(seed)
    letters = [c for c in alphabet if c.isascii() and c.isalnum()]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for char in sorted(alphabet):
        vocab[char] = len(vocab)
    for first in '{}[]":,':
        for second in '{}[]":,Ġ':
            vocab.setdefault(first + second, len(vocab))
    while len(vocab) < vocab_size:
        word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 8)))
        vocab.setdefault(("Ġ" if rng.random() < 1 / 3 else "") + word, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)


def timed_generate(llm, requests, structured) -> dict:
    from baton import SamplingParams

    params = SamplingParams(
        max_tokens=requests[0][1],
        temperature=1.0,
        seed=0,
        ignore_eos=True,
        structured_outputs=structured,
    )
    grammars = llm.engine.grammars
    timing = grammars.timing
    mask_before = (timing.steps, timing.rows, timing.seconds, timing.accept_seconds)
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.generate([prompt for prompt, _ in requests], params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = sum(len(out.token_ids) for out in outs)
    assert all(out.finish_reason == "length" for out in outs), "a request ended early"
    steps = timing.steps - mask_before[0]
    mask_s = timing.seconds - mask_before[2]
    accept_s = timing.accept_seconds - mask_before[3]
    return {
        "tok_per_s": tokens / elapsed,
        "tok_per_cpu_s": tokens / cpu,
        "seconds": elapsed,
        "output_tokens": tokens,
        "mask_steps": steps,
        "mask_rows": timing.rows - mask_before[1],
        "mask_ms_per_step": 1e3 * mask_s / steps if steps else 0.0,
        "accept_ms_per_step": 1e3 * accept_s / steps if steps else 0.0,
        "mask_fraction_of_time": mask_s / elapsed,
    }


def run_config(name: str, dtype: str, rounds: int) -> dict:
    from baton import LLM
    from baton.engine.core.sampling_params import StructuredOutputs

    structured = StructuredOutputs(kind="json", spec=json.dumps(SCHEMA), after_token_ids=())
    requests = workload(name, None, side_by_side=True)
    with tempfile.TemporaryDirectory() as model_dir:
        save_model(name, model_dir)
        save_byte_tokenizer(model_dir, CONFIGS[name]["vocab_size"])
        llm = LLM(
            model_dir,
            dtype=dtype,
            max_running_requests=64,
            max_num_batched_tokens=2048,
            chunked_prefill_size=1024,
        )
        compile_start = time.perf_counter()
        timed_generate(llm, requests[:1], structured)  # warm-up, and the schema's compile
        first_request_s = time.perf_counter() - compile_start
        timed_generate(llm, requests[:1], None)
        pairs = []
        for _ in range(rounds):
            plain = timed_generate(llm, requests, None)
            constrained = timed_generate(llm, requests, structured)
            pairs.append(
                {
                    "plain": plain,
                    "json_schema": constrained,
                    "ratio": constrained["tok_per_s"] / plain["tok_per_s"],
                    "cpu_ratio": constrained["tok_per_cpu_s"] / plain["tok_per_cpu_s"],
                }
            )
            print(
                f"{name} {dtype}: plain {plain['tok_per_s']:.1f} tok/s, json schema "
                f"{constrained['tok_per_s']:.1f} tok/s (ratio {pairs[-1]['ratio']:.3f}; per CPU "
                f"second {pairs[-1]['cpu_ratio']:.3f}), "
                f"mask {constrained['mask_ms_per_step']:.2f} ms/step, matcher advance "
                f"{constrained['accept_ms_per_step']:.2f} ms/step "
                f"({100 * constrained['mask_fraction_of_time']:.1f}% of the time)",
                flush=True,
            )
        llm.close()
    ratio = statistics.median(p["ratio"] for p in pairs)
    cpu_ratio = statistics.median(p["cpu_ratio"] for p in pairs)
    return {
        "config": name,
        "dtype": dtype,
        "batch": len(requests),
        "prompt_tokens": len(requests[0][0]),
        "new_tokens": requests[0][1],
        "first_request_with_compile_s": first_request_s,
        "rounds": pairs,
        "median_ratio": ratio,
        "grammar_cost": 1 - ratio,
        "median_cpu_ratio": cpu_ratio,
        "grammar_cost_per_cpu_second": 1 - cpu_ratio,
        "threads": torch.get_num_threads(),
        "median_mask_ms_per_step": statistics.median(
            p["json_schema"]["mask_ms_per_step"] for p in pairs
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="19m,110m", help="comma-separated configs")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0: torch's default); on a machine shared with other work, 1 and the "
        "per-CPU-second ratio are the steadier figures",
    )
    parser.add_argument("--output", help="write the results here as JSON")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = [run_config(name, args.dtype, args.rounds) for name in args.config.split(",")]
    for result in results:
        print(
            f"{result['config']} {result['dtype']} batch {result['batch']}: json schema / plain "
            f"= {result['median_ratio']:.3f} (grammar cost {100 * result['grammar_cost']:.1f}%; "
            f"per CPU second {100 * result['grammar_cost_per_cpu_second']:.1f}%), "
            f"mask {result['median_mask_ms_per_step']:.2f} ms/step"
        )
    if args.output:
        with open(args.output, "w") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
