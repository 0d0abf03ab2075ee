"""baton's bf16 GEMM (kernels/cpu/gemm.c) against oneDNN's prepacked linear on the 110M model's
shapes, and its two paths (register kernels, AMX tiles) against each other. Run from the
repository root: `python bench/results/cpu-2vcpu-2026-12-02/s6-spr/gemm_paths.py`.

cold: each weight copied until the copies fill ~256 MB (past the caches), every copy called once
per round, best of 3 rounds: decode's case, weights streamed from memory.
paths: the same cold weights, AMX from one row vs the register kernels, alternated, best of 5.
hot: one weight called back to back (prefill-sized rows), best of 3 after a warm-up."""

import sys
import time

import torch

sys.path.insert(0, ".")
from baton.kernels.cpu import gemm as cpu_gemm  # noqa: E402

SHAPES = [(768, 5144), (1536, 768), (768, 2048), (2048, 768), (768, 32000)]  # (in, out)


def onednn(weight):
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def baton(weight):
    packed = cpu_gemm.pack(weight)
    return lambda x: cpu_gemm.linear(x, packed, weight.shape[0])


def cold(rows: int) -> None:
    for k, n in SHAPES:
        weight = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
        copies = max(2, int(256e6 // (n * k * 2)))
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        for name, make in (("onednn", onednn), ("baton", baton)):
            calls = [make(weight) for _ in range(copies)]
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                for call in calls:
                    call(x)
                best = min(best, (time.perf_counter() - start) / copies)
            gbs = n * k * 2 / best / 1e9
            print(f"cold {name:6s} rows {rows:3d} {k}x{n}: {best * 1e6:8.1f} us {gbs:5.1f} GB/s")


def paths(rows: int) -> None:
    weights = {}
    for k, n in SHAPES:
        weight = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
        copies = max(2, int(200e6 // (n * k * 2)))
        weights[(k, n)] = [cpu_gemm.pack(weight) for _ in range(copies)]
    best = {"amx": float("inf"), "registers": float("inf")}
    for _ in range(5):
        for path in best:
            cpu_gemm.amx_from_rows(1 if path == "amx" else 0)
            total = 0.0
            for (k, n), packs in weights.items():
                x = torch.randn(rows, k, dtype=torch.bfloat16)
                start = time.perf_counter()
                for packed in packs:
                    cpu_gemm.linear(x, packed, n)
                total += (time.perf_counter() - start) / len(packs)
            best[path] = min(best[path], total)
    cpu_gemm.amx_from_rows(cpu_gemm.AMX_MIN_ROWS)
    ratio = best["registers"] / best["amx"]
    print(
        f"paths rows {rows:3d}: amx {best['amx'] * 1e3:.2f} ms, registers "
        f"{best['registers'] * 1e3:.2f} ms (registers / amx {ratio:.2f})"
    )


def hot(rows: int) -> None:
    totals = {"onednn": 0.0, "baton": 0.0}
    for k, n in SHAPES:
        weight = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        calls = {"onednn": onednn(weight), "baton": baton(weight)}
        best = dict.fromkeys(calls, float("inf"))
        for round_ in range(4):
            for name, call in calls.items():
                start = time.perf_counter()
                call(x)
                if round_:
                    best[name] = min(best[name], time.perf_counter() - start)
        for name in totals:
            totals[name] += best[name]
    ratio = totals["baton"] / totals["onednn"]
    print(
        f"hot rows {rows:4d}: onednn {totals['onednn'] * 1e3:.1f} ms, baton "
        f"{totals['baton'] * 1e3:.1f} ms (baton / onednn {ratio:.2f})"
    )


def main() -> None:
    print("AMX in this build and process:", cpu_gemm.has_amx())
    for rows in (1, 8, 32, 256):
        cold(rows)
    for rows in (1, 2, 4, 8, 16, 32):
        paths(rows)
    for rows in (64, 512, 2048):
        hot(rows)


if __name__ == "__main__":
    main()
