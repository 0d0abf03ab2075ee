"""Client CPU per streamed chunk: httpx (bench.serve today) vs aiohttp, against fake_sse.py."""

import asyncio
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, "/work/main")
import aiohttp
import httpx

PORT = 18777
N, REQS = 64, 32
payload = {"model": "m", "prompt": [5] * 128, "max_tokens": 64, "stream": True}


async def httpx_one(client):
    n = 0
    async with client.stream("POST", f"http://127.0.0.1:{PORT}/v1/completions", json=payload) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            c = json.loads(data)
            if c.get("choices"):
                time.perf_counter()
                n += 1
    return n


async def aiohttp_one(session):
    n = 0
    async with session.post(f"http://127.0.0.1:{PORT}/v1/completions", json=payload) as r:
        async for raw in r.content:
            if not raw.startswith(b"data:"):
                continue
            data = raw[5:].strip()
            if data == b"[DONE]":
                break
            c = json.loads(data)
            if c.get("choices"):
                time.perf_counter()
                n += 1
    return n


async def run(kind):
    if kind == "httpx":
        async with httpx.AsyncClient(
            limits=httpx.Limits(max_connections=REQS), timeout=httpx.Timeout(None)
        ) as c:
            await asyncio.gather(*(httpx_one(c) for _ in range(2)))
            t0 = os.times()
            w = time.perf_counter()
            got = await asyncio.gather(*(httpx_one(c) for _ in range(REQS)))
    else:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=REQS), timeout=aiohttp.ClientTimeout(total=None)
        ) as s:
            await asyncio.gather(*(aiohttp_one(s) for _ in range(2)))
            t0 = os.times()
            w = time.perf_counter()
            got = await asyncio.gather(*(aiohttp_one(s) for _ in range(REQS)))
    t1 = os.times()
    cpu = t1.user + t1.system - t0.user - t0.system
    print(
        f"{kind}: {sum(got)} chunks, CPU {cpu:.3f} s = {cpu / sum(got) * 1e6:.0f} us/chunk, wall {time.perf_counter() - w:.2f} s"
    )


srv = subprocess.Popen([sys.executable, "/work/lead/client/fake_sse.py", str(PORT)])
time.sleep(1.0)
try:
    for kind in ("httpx", "aiohttp", "httpx", "aiohttp"):
        asyncio.run(run(kind))
finally:
    srv.terminate()
