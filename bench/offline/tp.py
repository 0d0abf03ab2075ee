"""Tensor-parallel communication per decode step: the bytes rank 0 hands to all-reduces (and to
the logits gather) at TP=2, against the analytic count for the model, and the decode step time
at TP=2 (captured, and eager) against TP=1 in the same run.

    python -m baton.bench.offline.tp --config 19m --batch 8 --output tp.json

Analytic all-reduce bytes per rank per decode step (batch B, hidden h, model dtype of s bytes):
one (B, h) all-reduce for the embedding and one per layer (its row-parallel output), plus one
(B, 1) float32 per Mamba layer when n_groups == 1 (the gated norm's variance). Every rank hands
in the same bytes (the same layers reduce the same shapes); a ring all-reduce puts
2 (N-1) / N of them on the wire, as many as handed in at N = 2. The gather sends each rank's
vocabulary part of the logits, (B, V / N) in the model dtype, to rank 0.

Handover across TP sizes (`--handover`, prefill TP=p -> decode TP=d for p != d): a prefill and a
decode worker in this process hand `--batch` prompts over rank to rank; printed per decode rank
are the shard bytes it received against the bytes of the K/V heads, conv channels and SSM heads
it owns for those prompts (target: no more than it owns), and the whole state a TP=1 rank would
hold, for scale.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch
import zmq

from baton.bench.workloads import CONFIGS, save_model
from baton.disagg.decode import DecodeWorker
from baton.disagg.prefill import PrefillWorker
from baton.disagg.rooms import DisaggConfig
from baton.disagg.tp_layout import owned
from baton.disagg.tp_transfer import connector_spec
from baton.engine.config import ModelConfig
from baton.engine.core.engine import Engine
from baton.engine.core.llm import LLM
from baton.engine.core.sampling_params import SamplingParams
from baton.engine.models.registry import model_state_spec

PAGE_SIZE = 16


def analytic_bytes(config: dict, batch: int, itemsize: int, tp: int) -> dict[str, int]:
    layers = len(config["hybrid_override_pattern"])
    mamba_layers = config["hybrid_override_pattern"].count("M")
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    variance = mamba_layers * batch * 4 if config["n_groups"] == 1 and tp > 1 else 0
    return {
        "all_reduce_bytes": (1 + layers) * batch * hidden * itemsize + variance,
        "all_reduce_calls": 1 + layers + (mamba_layers if variance else 0),
        "gather_bytes": batch * (-(-vocab // tp)) * itemsize,
    }


def decode_steps(llm: LLM, prompts: list[list[int]], steps: int) -> dict[str, float]:
    """Prefill every prompt in one step, then time and count `steps` decode-only steps."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(
            f"r{i}", prompt, SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
        )
    engine.step()  # the prefill (every prompt fits one step)
    tp = engine.ranks.tp if engine.ranks is not None else None
    before = (tp.all_reduce_bytes, tp.all_reduce_calls, tp.gather_bytes) if tp else (0, 0, 0)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    after = (tp.all_reduce_bytes, tp.all_reduce_calls, tp.gather_bytes) if tp else (0, 0, 0)
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "step_ms": 1e3 * elapsed / steps,
        "all_reduce_bytes": (after[0] - before[0]) / steps,
        "all_reduce_calls": (after[1] - before[1]) / steps,
        "gather_bytes": (after[2] - before[2]) / steps,
    }


def owned_bytes(
    config: ModelConfig,
    size: int,
    rank: int,
    prompt_lens: list[int],
    itemsize: int,
    track_interval: int | None,
) -> int:
    """Bytes of the prompts' K/V pages, final Mamba state and prefix-cache block checkpoints
    (one per `track_interval` tokens; none without a prefix cache) that decode rank `rank` of
    `size` holds (its units of each component; SSM state in float32)."""
    spec = model_state_spec(config, torch.float32 if itemsize == 4 else torch.bfloat16)
    pages = sum(-(-n // PAGE_SIZE) for n in prompt_lens)
    blocks = sum(n // track_interval for n in prompt_lens if track_interval)
    count = {"pages": pages * PAGE_SIZE, "slots": len(prompt_lens), "checkpoints": blocks}
    total = 0
    for component, ranges in owned(spec, size, rank).items():
        field, name = component.split("/", 1)
        group, tensor = spec.tensor(name)
        unit_bytes = tensor.bytes() // tensor.shape[tensor.unit_dim]
        total += sum(n for _, n in ranges) * unit_bytes * group.num_layers * count[field]
    return total


def handover_bytes(
    model_dir: str, dtype: str, prefill_tp: int, decode_tp: int, prompts: list[list[int]]
) -> dict:
    """Hand every prompt from a TP=prefill_tp worker to a TP=decode_tp worker; per decode rank
    the shard bytes received and owned."""
    disagg = dict(
        host="127.0.0.1",
        port=0,
        secret=None,
        bootstrap_timeout_s=60.0,
        transfer_timeout_s=60.0,
        heartbeat_interval_s=1.0,
        lease_timeout_s=60.0,
        max_rooms_per_peer=1024,
        transfer_backend="zmq",
    )
    context = zmq.Context()
    workers = []
    try:
        for role, size, cls in (
            ("prefill", prefill_tp, PrefillWorker),
            ("decode", decode_tp, DecodeWorker),
        ):
            engine = Engine(
                model_dir,
                dtype=dtype,
                page_size=PAGE_SIZE,
                tensor_parallel_size=size,
                handover_connector=connector_spec(role, "127.0.0.1"),
            )
            workers.append(cls(engine, DisaggConfig(role=role, **disagg), context))
        prefill, decoder = workers
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            decoder.add_request(
                f"r{i}", prompt, params, room=f"room{i}", prefill_addr=prefill.address
            )
            prefill.add_request(f"r{i}", prompt, params, room=f"room{i}")
        deadline = time.monotonic() + 300
        while decoder.has_unfinished_requests() or prefill.has_unfinished_requests():
            if time.monotonic() > deadline:
                raise RuntimeError("the handover did not finish in 300 s")
            prefill.step()
            decoder.step()
        failures = decoder.take_failures() + prefill.take_failures()
        if failures:
            raise RuntimeError(f"handover failed: {failures}")
        config = decoder.engine.model_config
        itemsize = decoder.engine.dtype.itemsize
        lens = [len(p) for p in prompts]
        # Both sides cut blocks at the same interval here, and the decode side caches nothing
        # of these fresh prompts: every block's checkpoint travels.
        interval = decoder.engine.handover.track_interval or None  # 0: no prefix cache
        ranks = []
        for rank, received in enumerate(decoder.engine.handover.shards.bytes_received):
            own = owned_bytes(config, decode_tp, rank, lens, itemsize, interval)
            ranks.append({"received": received, "owned": own, "ratio": received / own})
        return {
            "prefill_tp": prefill_tp,
            "decode_tp": decode_tp,
            "whole_state_bytes": owned_bytes(config, 1, 0, lens, itemsize, interval),
            "decode_ranks": ranks,
        }
    finally:
        for worker in workers:
            worker.close()
            worker.engine.close()
        context.term()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=["19m", "110m", "moe100m"], default="19m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--output", help="write the figures as JSON here")
    ap.add_argument(
        "--handover",
        nargs="*",
        default=["2:1", "1:2"],
        metavar="P:D",
        help="prefill:decode TP sizes whose handover bytes to measure (default: 2:1 1:2)",
    )
    args = ap.parse_args()
    config = CONFIGS[args.config]
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, config["vocab_size"], (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.batch)
    ]
    itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    results: dict = {"config": args.config, "batch": args.batch, "dtype": args.dtype}
    with tempfile.TemporaryDirectory() as model_dir:
        save_model(args.config, model_dir)
        # tp2_eager: the decode step run layer by layer in Python, which is where the
        # all-reduce and gather bytes are counted (a replayed plan calls its collectives in C++)
        runs = {"tp1": (1, True), "tp2_eager": (2, False), "tp2": (2, True)}
        for key, (size, capture) in runs.items():
            with LLM(
                model_dir, dtype=args.dtype, tensor_parallel_size=size, cpu_step_capture=capture
            ) as llm:
                decode_steps(llm, prompts, 4)  # warm-up: first-use costs (prepacking, plans)
                measured = decode_steps(llm, prompts, args.steps)
            results[key] = measured
        results["handover"] = [
            handover_bytes(model_dir, args.dtype, *map(int, pair.split(":")), prompts)
            for pair in args.handover
        ]
    expected = analytic_bytes(config, args.batch, itemsize, 2)
    results["analytic_tp2"] = expected
    eager = results["tp2_eager"]
    results["all_reduce_bytes_ratio"] = eager["all_reduce_bytes"] / expected["all_reduce_bytes"]
    results["gather_bytes_ratio"] = eager["gather_bytes"] / expected["gather_bytes"]
    results["step_time_tp2_over_tp1"] = results["tp2"]["step_ms"] / results["tp1"]["step_ms"]
    results["tp2_eager_over_captured"] = eager["step_ms"] / results["tp2"]["step_ms"]
    print(json.dumps(results, indent=2))
    print(
        f"decode step: TP=1 {results['tp1']['step_ms']:.2f} ms, TP=2 captured "
        f"{results['tp2']['step_ms']:.2f} ms, TP=2 eager {eager['step_ms']:.2f} ms "
        f"(captured {results['tp2_eager_over_captured']:.2f}x faster)"
    )
    print(
        f"all-reduce TP=2: {eager['all_reduce_bytes']:.0f} B per decode step per rank, "
        f"analytic {expected['all_reduce_bytes']} B (ratio {results['all_reduce_bytes_ratio']:.3f})"
    )
    for h in results["handover"]:
        for rank, r in enumerate(h["decode_ranks"]):
            print(
                f"handover TP={h['prefill_tp']} -> TP={h['decode_tp']}, decode rank {rank}: "
                f"received {r['received']} B, owns {r['owned']} B (ratio {r['ratio']:.3f}; "
                f"whole state {h['whole_state_bytes']} B)"
            )
    if args.output:
        with open(args.output, "w") as out:
            json.dump(results, out, indent=2)


if __name__ == "__main__":
    main()
