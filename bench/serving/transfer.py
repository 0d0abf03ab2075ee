"""Prefill -> decode handover speed per transfer backend (zmq, nixl) vs raw ZMQ, and TTFT
disaggregated vs colocated.

    python -m baton.bench.serving.transfer [--config 110m] [--lengths 1024,8000]
        [--backends zmq,nixl] [--output out.json]

With nixl, UCX_TLS picks UCX's transports (tcp,self or sm,tcp,self on one host; the run records
it); the handover is then the decode side's READ from the prefill engine's pools plus the control
messages around it (the offer, the ReadDone that releases the prefill side's hold).

The prefill worker runs in this process and the decode worker in a child process, each with its
own engine and ZMQ context, talking over tcp://127.0.0.1 exactly as in production (msgpack
header + raw tensor frames, zero-copy sends). For each prompt length (prefilled in one step, so
no page streams while computing) it times the handover from the prefill engine finishing the
prompt (its finish hook: K/V pages and Mamba state pushed) to the decode engine having installed
everything (CLOCK_MONOTONIC on both sides, which Linux keeps system-wide), and divides the bytes
moved by that time. The baseline is one raw ZMQ DEALER -> ROUTER multipart message of the same
bytes between the same two processes, alternated with the handovers. Medians and bests of
--repeats each are printed; the fraction is median over median. TTFT compares one request at low
load, colocated (one engine) vs disaggregated (prefill here, first token from the decode
process), no HTTP in either.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import tempfile
import time

import torch
import zmq

from baton.bench.workloads import save_model
from baton.disagg.decode import DecodeWorker
from baton.disagg.prefill import PrefillWorker
from baton.disagg.rooms import DisaggConfig
from baton.engine.core.engine import Engine
from baton.engine.core.sampling_params import SamplingParams

ENGINE_ARGS = dict(enable_prefix_caching=False, max_total_tokens=16384, max_running_requests=4)


def config(role: str, backend: str) -> DisaggConfig:
    return DisaggConfig(
        role=role,
        host="127.0.0.1",
        port=0,
        secret=None,
        bootstrap_timeout_s=600,
        transfer_timeout_s=600,
        heartbeat_interval_s=1.0,
        lease_timeout_s=600,
        max_rooms_per_peer=1024,
        transfer_backend=backend,
    )


def decode_process(conn, model_dir: str, dtype: str, threads: int, backend: str) -> None:
    """The decode side: a DecodeWorker and a raw ROUTER socket, driven by commands on `conn`."""
    if threads:
        torch.set_num_threads(threads)
    context = zmq.Context()
    engine = Engine(model_dir, dtype=dtype, **ENGINE_ARGS)
    decoder = DecodeWorker(engine, config("decode", backend), context)
    raw = context.socket(zmq.ROUTER)
    conn.send(raw.bind_to_random_port("tcp://127.0.0.1"))
    while True:
        command, *args = conn.recv()
        if command == "stop":
            break
        if command == "raw":
            for _ in range(args[0]):
                raw.recv_multipart(copy=False)
            conn.send(time.monotonic())
            continue
        rid, prompt, address = args
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        before = decoder.counters.bytes_total
        decoder.add_request(rid, prompt, params, room=rid, prefill_addr=address)
        poller = zmq.Poller()
        for socket in decoder.sockets():
            poller.register(socket, zmq.POLLIN)
        if command == "handover":
            while rid in decoder.rooms:  # installed once the room is gone
                poller.poll(1 if decoder.reader is not None and decoder.reader.reads else 5)
                decoder.poll()
                decoder.finish_reads()  # (nixl: a READ is done when the agent says so)
            result = (time.monotonic(), decoder.counters.bytes_total - before)
        else:  # "ttft": the first token as the decode worker emits it
            result = None
            while result is None:
                if not decoder.engine.has_unfinished_requests():
                    poller.poll(5)  # waiting on the prefill side, as the engine loop does
                for delta in decoder.step():
                    if delta.request_id == rid and delta.new_token_ids:
                        result = time.monotonic()
        while decoder.has_unfinished_requests():
            decoder.step()
        conn.send(result)
    decoder.close()
    raw.close(linger=0)


class DecodeSide:
    def __init__(
        self, model_dir: str, dtype: str, threads: int, backend: str, context: zmq.Context
    ):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=decode_process, args=(child, model_dir, dtype, threads, backend), daemon=True
        )
        self.process.start()
        self.raw = context.socket(zmq.DEALER)
        self.raw.connect(f"tcp://127.0.0.1:{self.conn.recv()}")
        self.source = torch.ones(0, dtype=torch.uint8)

    def raw_bytes_per_s(self, nbytes: int) -> float:
        """The same bytes as plain ZMQ messages of 4 MiB (the size the K/V pushes use, and
        faster here than one multipart message), sent zero-copy from memory already touched."""
        if self.source.numel() < nbytes:
            self.source = torch.ones(nbytes, dtype=torch.uint8)
        frame = 4 << 20
        view = memoryview(self.source.numpy())
        self.conn.send(("raw", -(-nbytes // frame)))
        time.sleep(0.01)  # the child is waiting in recv
        start = time.monotonic()
        for offset in range(0, nbytes, frame):
            self.raw.send(view[offset : min(offset + frame, nbytes)], copy=False)
        return nbytes / (self.conn.recv() - start)

    def close(self) -> None:
        self.conn.send(("stop",))
        self.process.join(timeout=30)
        self.raw.close(linger=0)


def run_prefill(prefill: PrefillWorker, rid: str) -> None:
    while rid in prefill.rooms or prefill.engine.has_unfinished_requests():
        prefill.step()


def release_holds(prefill: PrefillWorker) -> None:
    """Pages and slots held by zero-copy sends come back once ZMQ has sent them."""
    while prefill.has_unfinished_requests():
        time.sleep(0.001)
        prefill.step()


def handover(prefill: PrefillWorker, decode: DecodeSide, prompt: list[int], rid: str) -> dict:
    """One handover, timed from the prefill engine finishing the prompt (its finish hook) to the
    decode engine having installed everything."""
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    decode.conn.send(("handover", rid, prompt, prefill.address))
    prefill.add_request(rid, prompt, params, room=rid)
    room = prefill.rooms[rid]
    while room.peer is None:  # the Register message: bootstrapping is not part of the handover
        prefill.socket.poll(5)
        prefill.poll()
    marks: dict[str, float] = {}
    finished = prefill._prefilled

    def timed(r, req):
        marks["start"] = time.monotonic()
        finished(r, req)

    prefill._prefilled = timed
    try:
        run_prefill(prefill, rid)
    finally:
        del prefill._prefilled
    end, moved = decode.conn.recv()
    release_holds(prefill)
    elapsed = end - marks["start"]
    return {"bytes": moved, "seconds": elapsed, "bytes_per_s": moved / elapsed}


def ttft_colocated(engine: Engine, prompt: list[int], rid: str) -> float:
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        if engine.step():
            break
    return time.perf_counter() - start


def ttft_disaggregated(
    prefill: PrefillWorker, decode: DecodeSide, prompt: list[int], rid: str
) -> float:
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    start = time.monotonic()
    decode.conn.send(("ttft", rid, prompt, prefill.address))
    prefill.add_request(rid, prompt, params, room=rid)
    run_prefill(prefill, rid)
    first = decode.conn.recv()
    release_holds(prefill)
    return first - start


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default="110m", choices=["19m", "110m"])
    # (8k: the configs' context is 8192 tokens, the prompt and its 2 new tokens within it)
    ap.add_argument("--lengths", default="1024,8000")
    ap.add_argument(
        "--backends",
        default="zmq,nixl",
        help="transfer backends to compare, alternated in each round (nixl needs baton[nixl])",
    )
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=15, help="handovers (and raw runs) per length")
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads (default: torch's choice)"
    )
    ap.add_argument("--no-ttft", action="store_true", help="time the handover only")
    ap.add_argument("--output")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    backends = args.backends.split(",")
    context = zmq.Context.instance()
    rows = []
    with tempfile.TemporaryDirectory() as model_dir:
        save_model(args.config, model_dir)
        engine_args = dict(dtype=args.dtype, **ENGINE_ARGS)
        # The whole prompt in one prefill step: every byte moves after the prefill, so the
        # handover is measured alone (chunked prefills also stream pages while computing).
        one_chunk = dict(chunked_prefill_size=8192, max_num_batched_tokens=8192)
        pairs = {
            b: (
                PrefillWorker(
                    Engine(model_dir, **engine_args, **one_chunk), config("prefill", b), context
                ),
                DecodeSide(model_dir, args.dtype, args.threads, b, context),
            )
            for b in backends
        }
        raw_side = pairs[backends[0]][1]
        colocated = Engine(model_dir, **engine_args)
        # TTFT compares like with like: a prefill worker chunking exactly as the colocated engine.
        ttft_prefill = {
            b: PrefillWorker(Engine(model_dir, **engine_args), config("prefill", b), context)
            for b in backends
        }
        for b, (prefill, decode) in pairs.items():
            handover(prefill, decode, [5] * 64, f"warmup-{b}")
        raw_side.raw_bytes_per_s(1 << 20)
        ttft_colocated(colocated, [5] * 64, "warmup")
        for n in lengths:
            prompt = [(7 * i) % 31000 + 3 for i in range(n)]
            for b, (prefill, decode) in pairs.items():
                handover(prefill, decode, prompt, f"w{n}-{b}")  # first use of this many pages
            # Alternating, so every backend and the raw baseline see the same machine noise.
            runs: dict[str, list[dict]] = {b: [] for b in backends}
            raws = []
            for i in range(args.repeats):
                for b, (prefill, decode) in pairs.items():
                    runs[b].append(handover(prefill, decode, prompt, f"h{n}-{i}-{b}"))
                raws.append(raw_side.raw_bytes_per_s(runs[backends[0]][-1]["bytes"]))
            raw = statistics.median(raws)
            t_colo = float("nan")
            if not args.no_ttft:
                t_colo = min(ttft_colocated(colocated, prompt, f"c{n}-{i}") for i in range(2))
            for b, (_, decode) in pairs.items():
                rates = [r["bytes_per_s"] for r in runs[b]]
                h = statistics.median(rates)
                t_disagg = float("nan")
                if not args.no_ttft:
                    t_disagg = min(
                        ttft_disaggregated(ttft_prefill[b], decode, prompt, f"d{n}-{i}-{b}")
                        for i in range(2)
                    )
                row = {
                    "backend": b,
                    "ucx_tls": os.environ.get("UCX_TLS") if b == "nixl" else None,
                    "prompt_tokens": n,
                    "bytes": runs[b][0]["bytes"],
                    "handover_seconds": [r["seconds"] for r in runs[b]],
                    "handover_seconds_median": statistics.median(r["seconds"] for r in runs[b]),
                    "handover_bytes_per_s_median": h,
                    "raw_zmq_bytes_per_s": raws,
                    "raw_zmq_bytes_per_s_median": raw,
                    "fraction_of_raw": h / raw,
                    "fraction_of_raw_best": max(rates) / max(raws),
                    "ttft_colocated_s": t_colo,
                    "ttft_disaggregated_s": t_disagg,
                }
                rows.append(row)
                print(
                    f"{b:4s} {n:5d} tokens: {row['bytes'] / 2**20:6.1f} MiB, handover median "
                    f"{row['handover_seconds_median'] * 1e3:6.2f} ms = {h / 2**30:5.2f} GiB/s,"
                    f" raw ZMQ {raw / 2**30:5.2f} GiB/s: {row['fraction_of_raw']:.2f} of raw "
                    f"(best vs best {row['fraction_of_raw_best']:.2f}); TTFT colocated "
                    f"{t_colo * 1e3:.0f} ms, disaggregated {t_disagg * 1e3:.0f} ms",
                    flush=True,
                )
        for prefill, decode in pairs.values():
            prefill.close()
            decode.close()
        for prefill in ttft_prefill.values():
            prefill.close()
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
