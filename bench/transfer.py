"""Prefill -> decode handover speed vs raw ZMQ, and TTFT disaggregated vs colocated.

    python -m bench.transfer [--config 110m] [--lengths 128,512,1024,2048,4096] [--output out.json]

Both workers run in this process on their own engines and ZMQ contexts and talk over
tcp://127.0.0.1 exactly as in production (msgpack header + raw tensor frames, zero-copy sends);
the decode worker polls in its own thread. For each prompt length (prefilled in one step, so no
page streams while computing) it times the handover from the prefill engine finishing the prompt
(gather + push of the K/V pages, Mamba state snapshot) to the decode engine having installed
everything, and divides the bytes moved by that time. The baseline is a raw ZMQ DEALER -> ROUTER
message of the same bytes between two contexts, alternated with the handovers (best of
--repeats each). TTFT compares the time to the first token of one request at low load,
colocated vs disaggregated (no HTTP in either).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time

import torch
import zmq

from bench.offline import save_model
from disagg.decode import DecodeWorker
from disagg.prefill import PrefillWorker
from disagg.rooms import DisaggConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams


def config(role: str) -> DisaggConfig:
    return DisaggConfig(
        role=role,
        host="127.0.0.1",
        port=0,
        secret=None,
        bootstrap_timeout_s=600,
        transfer_timeout_s=600,
        heartbeat_interval_s=1.0,
        lease_timeout_s=600,
    )


def raw_zmq_bytes_per_s(
    context: zmq.Context, peer_context: zmq.Context, frames: list[torch.Tensor], repeats: int = 3
) -> float:
    """One multipart message of `frames`, DEALER (context) -> ROUTER (peer_context): two
    contexts, so two I/O threads, like the two worker processes of a deployment."""
    router = peer_context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    payload = [memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy()) for t in frames]
    size = sum(len(p) for p in payload)
    dealer.send_multipart([b"warm"])
    router.recv_multipart()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dealer.send_multipart(payload, copy=False)
        router.recv_multipart(copy=False)
        best = min(best, time.perf_counter() - start)
    dealer.close(linger=0)
    router.close(linger=0)
    return size / best


def handover(prefill: PrefillWorker, decoder: DecodeWorker, prompt: list[int], rid: str) -> dict:
    """One handover, timed from the prefill engine finishing the prompt (its finish hook:
    the K/V pages are gathered and pushed, the Mamba state snapshot follows) to the decode engine
    having installed everything. The decode worker runs its own loop in a thread, as it runs
    in its own process in production, so it installs while later messages are on the wire."""
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    decoder.add_request(rid, prompt, params, room=rid, prefill_addr=prefill.address)
    prefill.add_request(rid, prompt, params, room=rid)
    room = prefill.rooms[rid]
    while room.peer is None:  # the Register message: bootstrapping is not part of the handover
        decoder.poll()
        prefill.poll()
    marks: dict[str, float] = {}
    finished = prefill._prefilled

    def timed(r, req):
        marks["start"] = time.perf_counter()
        finished(r, req)

    prefill._prefilled = timed
    bytes_before = decoder.counters.bytes_total
    poller = zmq.Poller()
    for socket in decoder.sockets():
        poller.register(socket, zmq.POLLIN)

    def decode_loop():
        while rid in decoder.rooms:
            poller.poll(5)
            decoder.poll()
        marks["end"] = time.perf_counter()

    thread = threading.Thread(target=decode_loop)
    thread.start()
    try:
        while rid in prefill.rooms or prefill.engine.has_unfinished_requests():
            prefill.step()
        thread.join()
    finally:
        del prefill._prefilled
    elapsed = marks["end"] - marks["start"]
    moved = decoder.counters.bytes_total - bytes_before
    while decoder.has_unfinished_requests():
        decoder.step()
    return {"bytes": moved, "seconds": elapsed, "bytes_per_s": moved / elapsed}


def ttft_colocated(engine: Engine, prompt: list[int], rid: str) -> float:
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        if engine.step():
            break
    return time.perf_counter() - start


def ttft_disaggregated(
    prefill: PrefillWorker, decoder: DecodeWorker, prompt: list[int], rid: str
) -> float:
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    decoder.add_request(rid, prompt, params, room=rid, prefill_addr=prefill.address)
    prefill.add_request(rid, prompt, params, room=rid)
    while True:
        prefill.step()
        if decoder.step():
            return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="110m", choices=["19m", "110m"])
    ap.add_argument("--lengths", default="128,512,1024,2048,4096")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=5, help="handovers (and raw runs) per length")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads (default: torch's choice)"
    )
    ap.add_argument("--output")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    context = zmq.Context.instance()
    rows = []
    with tempfile.TemporaryDirectory() as model_dir:
        save_model(args.config, model_dir)
        engine_args = dict(
            dtype=args.dtype,
            enable_prefix_caching=False,
            max_total_tokens=16384,
            max_running_requests=4,
        )
        # The whole prompt in one prefill step: every byte moves after the prefill, so the
        # handover is measured alone (chunked prefills also stream pages while computing).
        one_chunk = dict(chunked_prefill_size=8192, max_num_batched_tokens=8192)
        prefill = PrefillWorker(
            Engine(model_dir, **engine_args, **one_chunk), config("prefill"), context
        )
        # Each worker gets its own context (its own ZMQ I/O thread), as separate processes do.
        decode_context = zmq.Context()
        decoder = DecodeWorker(Engine(model_dir, **engine_args), config("decode"), decode_context)
        colocated = Engine(model_dir, **engine_args)
        # TTFT compares like with like: a prefill worker chunking exactly as the colocated engine.
        prefill_ttft = PrefillWorker(Engine(model_dir, **engine_args), config("prefill"), context)
        handover(prefill, decoder, [5] * 64, "warmup")
        ttft_colocated(colocated, [5] * 64, "warmup")
        for n in lengths:
            prompt = [(7 * i) % 31000 + 3 for i in range(n)]
            # Best of `repeats` each, alternating, so both see the same machine noise.
            runs, raws = [], []
            for i in range(args.repeats):
                runs.append(handover(prefill, decoder, prompt, f"h{n}-{i}"))
                frames = [torch.empty(runs[-1]["bytes"] // 4, dtype=torch.float32)]  # same bytes
                raws.append(raw_zmq_bytes_per_s(context, decode_context, frames, repeats=1))
            h = max(runs, key=lambda r: r["bytes_per_s"])
            raw = max(raws)
            t_colo = min(ttft_colocated(colocated, prompt, f"c{n}-{i}") for i in range(2))
            t_disagg = min(
                ttft_disaggregated(prefill_ttft, decoder, prompt, f"d{n}-{i}") for i in range(2)
            )
            row = {
                "prompt_tokens": n,
                "handover": h,
                "raw_zmq_bytes_per_s": raw,
                "fraction_of_raw": h["bytes_per_s"] / raw,
                "ttft_colocated_s": t_colo,
                "ttft_disaggregated_s": t_disagg,
            }
            rows.append(row)
            print(
                f"{n:5d} tokens: {h['bytes'] / 2**20:7.1f} MiB in {h['seconds'] * 1e3:7.1f} ms = "
                f"{h['bytes_per_s'] / 2**30:5.2f} GiB/s = {row['fraction_of_raw']:.2f} of raw ZMQ "
                f"({raw / 2**30:.2f} GiB/s); TTFT colocated {t_colo * 1e3:.0f} ms, disaggregated {t_disagg * 1e3:.0f} ms",
                flush=True,
            )
        prefill.close()
        prefill_ttft.close()
        decoder.close()
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
