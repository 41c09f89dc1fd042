"""Is a GLA forward+backward bound by the GPU or by the host's launches?

For each shape it times one fused_chunk_gla forward+backward (bf16, the benchmark's inputs)
four ways:
  kernels  the sum of the kernels' GPU time (torch profiler, as profile_kernels.py);
  events   CUDA events around one call started on an idle GPU (median of --reps): the
           kernels, or the host's enqueueing when that takes longer;
  host     wall time to enqueue one call, from a synchronize to the call's return, without
           waiting for the GPU (median): what the host spends per call;
  queue    --reps calls back to back, no synchronize between them: wall time per call, what
           a training loop without CUDA graphs sees.
Then a cProfile of --prof calls lists where the host time goes (top functions by own time).
Needs a GPU.

    python benchmarks/profile_host.py                          # 8x2048 D64, GQA, D128
    python benchmarks/profile_host.py --shape 8x2048:32/8:64 --reps 50
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import os
import pstats
import statistics
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


_spec = importlib.util.spec_from_file_location("profile_kernels", os.path.join(HERE, "profile_kernels.py"))
profile_kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(profile_kernels)
bench_kernels = profile_kernels.bench_kernels           # the copy profile_kernels loaded


def measure(s, gla_triton, reps: int, prof_calls: int):
    sets, cu = bench_kernels.make_inputs(s, 1, "cuda")
    q, k, v, g, do = sets[0]
    xs = [x.clone().requires_grad_() for x in (q, k, v, g)]
    norm = s.get("norm", False)

    def call():
        o, _ = gla_triton.fused_chunk_gla(*xs, cu_seqlens=cu, normalizer=norm)
        torch.autograd.grad(o, xs, do)

    for _ in range(5):                                   # compile, warm the caches
        call()
    torch.cuda.synchronize()
    kernels = sum(us for _, us in profile_kernels.profile(call, 10).values()) / 1e3
    gpu, host = [], []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        call()
        end.record()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        call()
    torch.cuda.synchronize()
    queue = (time.perf_counter() - t0) * 1e3 / reps

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(prof_calls):
        call()
    pr.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(12)
    return kernels, statistics.median(gpu), statistics.median(host), queue, out.getvalue()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", help="BxT:H[/Hkv]:D[+norm] (repeatable)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--prof", type=int, default=20, help="calls under cProfile")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_host.py needs a GPU")
    _, gla_triton = bench_kernels._import_kernels()
    shapes = args.shape or ["8x2048:32:64", "8x2048:32/8:64", "8x2048:16:128"]
    rows = []
    for text in shapes:
        s = profile_kernels.parse_shape(text)
        s["seqs"] = None
        kernels, events, host, queue, stats = measure(s, gla_triton, args.reps, args.prof)
        rows.append((text, kernels, events, host, queue))
        print(f"## {text}: kernels {kernels:.3f} ms, events {events:.3f}, host {host:.3f}, "
              f"back to back {queue:.3f} ms a call")
        print("\n".join(line for line in stats.splitlines() if line.strip())[:3000])
    print(f"{'shape':<24} {'kernels':>8} {'events':>8} {'host':>8} {'queue':>8}  (ms)  bound by")
    for text, kernels, events, host, queue in rows:
        print(f"{text:<24} {kernels:8.3f} {events:8.3f} {host:8.3f} {queue:8.3f}        "
              f"{'host' if host > kernels else 'GPU'}")


if __name__ == "__main__":
    main()
