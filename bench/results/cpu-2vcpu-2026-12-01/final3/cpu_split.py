import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, "/work/main")
from bench.serve import BenchConfig, BenchPrompt, run_benchmark
from bench.serve_side_by_side import server_commands, start, stop
from server.up import free_port

model = "/tmp/m110"
rng = random.Random(0)
prompts = [
    BenchPrompt(prompt=[rng.randrange(3, 32000) for _ in range(128)], prompt_len=128, output_len=64)
    for _ in range(int(os.environ.get("NPROMPTS", "64")))
]


def tree(pid):
    out = subprocess.run(
        ["ps", "-o", "pid=,comm=,args=", "--ppid", str(pid)], capture_output=True, text=True
    ).stdout
    kids = [int(l.split()[0]) for l in out.strip().splitlines() if l.strip()]
    res = [pid]
    for k in kids:
        res += tree(k)
    return res


def cpu(pid):
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def name(pid):
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:90]
    except OSError:
        return "?"


kind = sys.argv[1]
port = free_port()
cmd = server_commands(kind, model, "bfloat16", port, "/tmp/vcpu")
if os.environ.get("PLAIN"):
    cmd = [c for c in cmd if c not in ("--request-metrics", "--no-prefix-cache")]
print(cmd)
p = start(cmd, port, Path(f"/tmp/cs_{kind}.log"), 600)
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
        num_warmups=2,
        slos_ms={},
        percentiles=(50, 90, 99),
        api_key=None,
        seed=0,
        progress=False,
    )
    asyncio.run(run_benchmark(cfg))
    pids = tree(p.pid)
    before = {q: cpu(q) for q in pids}
    me0 = os.times()
    t0 = time.time()
    s = asyncio.run(run_benchmark(cfg))
    s.pop("requests")
    wall = time.time() - t0
    me1 = os.times()
    print(
        f"{kind}: {s['output_throughput']:.1f} tok/s wall {wall:.2f} s; client CPU {me1.user + me1.system - me0.user - me0.system:.2f} s"
    )
    for q in pids:
        d = cpu(q) - before[q]
        if d > 0.01:
            print(f"   {d:6.2f} s  {name(q)}")
finally:
    stop(p)
