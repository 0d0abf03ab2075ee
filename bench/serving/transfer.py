"""Prefill -> decode handover speed vs raw ZMQ, and TTFT disaggregated vs colocated.

    python -m baton.bench.serving.transfer [--config 110m] [--lengths 128,512,1024,2048,4096] [--output out.json]

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
        max_rooms_per_peer=1024,
    )


def decode_process(conn, model_dir: str, dtype: str, threads: int) -> None:
    """The decode side: a DecodeWorker and a raw ROUTER socket, driven by commands on `conn`."""
    if threads:
        torch.set_num_threads(threads)
    context = zmq.Context()
    decoder = DecodeWorker(Engine(model_dir, dtype=dtype, **ENGINE_ARGS), config("decode"), context)
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
                poller.poll(5)
                decoder.poll()
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
    def __init__(self, model_dir: str, dtype: str, threads: int, context: zmq.Context):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=decode_process, args=(child, model_dir, dtype, threads), daemon=True
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
    ap.add_argument("--lengths", default="128,512,1024,2048,4096")
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
    context = zmq.Context.instance()
    rows = []
    with tempfile.TemporaryDirectory() as model_dir:
        save_model(args.config, model_dir)
        engine_args = dict(dtype=args.dtype, **ENGINE_ARGS)
        # The whole prompt in one prefill step: every byte moves after the prefill, so the
        # handover is measured alone (chunked prefills also stream pages while computing).
        one_chunk = dict(chunked_prefill_size=8192, max_num_batched_tokens=8192)
        prefill = PrefillWorker(
            Engine(model_dir, **engine_args, **one_chunk), config("prefill"), context
        )
        decode = DecodeSide(model_dir, args.dtype, args.threads, context)
        colocated = Engine(model_dir, **engine_args)
        # TTFT compares like with like: a prefill worker chunking exactly as the colocated engine.
        prefill_ttft = PrefillWorker(Engine(model_dir, **engine_args), config("prefill"), context)
        handover(prefill, decode, [5] * 64, "warmup")
        decode.raw_bytes_per_s(1 << 20)
        ttft_colocated(colocated, [5] * 64, "warmup")
        for n in lengths:
            prompt = [(7 * i) % 31000 + 3 for i in range(n)]
            handover(prefill, decode, prompt, f"w{n}")  # first use of this many pages
            # Alternating, so both see the same machine noise.
            runs, raws = [], []
            for i in range(args.repeats):
                runs.append(handover(prefill, decode, prompt, f"h{n}-{i}"))
                raws.append(decode.raw_bytes_per_s(runs[-1]["bytes"]))
            rates = [r["bytes_per_s"] for r in runs]
            h, raw = statistics.median(rates), statistics.median(raws)
            t_colo = t_disagg = float("nan")
            if not args.no_ttft:
                t_colo = min(ttft_colocated(colocated, prompt, f"c{n}-{i}") for i in range(2))
                t_disagg = min(
                    ttft_disaggregated(prefill_ttft, decode, prompt, f"d{n}-{i}") for i in range(2)
                )
            row = {
                "prompt_tokens": n,
                "bytes": runs[0]["bytes"],
                "handover_seconds": [r["seconds"] for r in runs],
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
                f"{n:5d} tokens: {row['bytes'] / 2**20:6.1f} MiB, handover median "
                f"{row['bytes'] / h * 1e3:6.2f} ms = {h / 2**30:5.2f} GiB/s, raw ZMQ "
                f"{raw / 2**30:5.2f} GiB/s: {row['fraction_of_raw']:.2f} of raw "
                f"(best vs best {row['fraction_of_raw_best']:.2f}); TTFT colocated "
                f"{t_colo * 1e3:.0f} ms, disaggregated {t_disagg * 1e3:.0f} ms",
                flush=True,
            )
        prefill.close()
        prefill_ttft.close()
        decode.close()
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
