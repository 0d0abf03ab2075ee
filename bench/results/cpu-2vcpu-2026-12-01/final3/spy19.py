import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, "/work/main")
from bench.peer import save_word_tokenizer
from bench.serve import BenchConfig, BenchPrompt, run_benchmark
from bench.serve_side_by_side import server_commands, start, stop
from bench.workloads import save_model
from server.up import free_port

model = "/tmp/m19"
if not Path(model, "config.json").exists():
    save_model("19m", model)
    save_word_tokenizer(model, 32000)
rng = random.Random(0)
prompts = [
    BenchPrompt(prompt=[rng.randrange(3, 32000) for _ in range(128)], prompt_len=128, output_len=64)
    for _ in range(32)
]
port = free_port()
cmd = [
    c
    for c in server_commands("baton", model, "bfloat16", port, None)
    if c not in ("--request-metrics", "--no-prefix-cache")
]
p = start(cmd, port, Path("/tmp/spy19.log"), 600)
rate = int(os.environ.get("RATE", "100"))
try:
    cfg = BenchConfig(
        base_url=f"http://127.0.0.1:{port}",
        endpoint="/v1/completions",
        model=model,
        prompts=prompts,
        request_rate=float("inf"),
        burstiness=1.0,
        max_concurrency=None,
        ignore_eos=True,
        num_warmups=0,
        slos_ms={},
        percentiles=(50, 90, 99),
        api_key=None,
        seed=0,
        progress=False,
    )
    for _ in range(2):
        s = asyncio.run(run_benchmark(cfg))
        print("plain tok/s", round(s["output_throughput"]), "ttft", round(s["mean_ttft_ms"]))
    eng = subprocess.run(
        ["pgrep", "-f", "engine.process"], capture_output=True, text=True
    ).stdout.split()[0]
    spies = [
        subprocess.Popen(
            [
                "/tmp/tools/bin/py-spy",
                "record",
                "-p",
                str(pid),
                "-d",
                "6",
                "-r",
                str(rate),
                "-f",
                "raw",
                "-o",
                f"/tmp/spy19_{name}.txt",
                "--nonblocking",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, pid in (("engine", eng), ("server", p.pid))
    ]
    time.sleep(0.3)
    t0 = time.time()
    while time.time() - t0 < 5:
        s = asyncio.run(run_benchmark(cfg))
        print("spied tok/s", round(s["output_throughput"]), "ttft", round(s["mean_ttft_ms"]))
    for sp in spies:
        sp.wait()
finally:
    stop(p)
