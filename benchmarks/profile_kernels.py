"""Where the time of one GLA forward+backward goes: GPU time per kernel (torch profiler).

For each shape it runs glaswap's fused_chunk_gla forward+backward, and SDPA flash causal
forward+backward on the same [B, T, H, D], under torch.profiler and prints the device time
of every kernel per call (mean over the profiled iterations) and its share of the total.
The totals are the sum of kernel times (no launch gaps), so they sit a little below the
medians of bench_kernels.py.

    python benchmarks/profile_kernels.py                    # 6 shapes
    python benchmarks/profile_kernels.py --shape 8x2048:32:64 --set BT=128
    python benchmarks/profile_kernels.py --no-sdpa --shape 1x16384:9/3:64x65   # SmolLM2, K != V
    python benchmarks/profile_kernels.py --no-sdpa --shape 8x2048:32:64+norm   # in-kernel normaliser
    python benchmarks/profile_kernels.py --no-sdpa --shape 8x2048:16:128 --gates trained   # steep gates
    python benchmarks/profile_kernels.py --ncu              # one iteration per shape, for
        ncu --clock-control none -k regex:_kernel python benchmarks/profile_kernels.py --ncu
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("bench_kernels", os.path.join(HERE, "bench_kernels.py"))
bench_kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_kernels)

DEFAULT_SHAPES = ["8x2048:32:64", "2x8192:32:64", "1x16384:32:64",
                  "8x2048:16:128", "2x8192:16:128", "1x16384:16:128"]


def parse_shape(text: str) -> dict:
    """'BxT:H:D', 'BxT:H/Hkv:D' or with K != V 'BxT:H/Hkv:KxV' (e.g. 1x16384:9/3:64x65);
    a '+norm' suffix turns the in-kernel normaliser on (e.g. 8x2048:32:64+norm)."""
    body, plus, flag = text.partition("+")
    if plus and flag != "norm":
        raise SystemExit(f"unknown shape suffix +{flag} in {text!r}: only +norm is known")
    bt, h, d = body.split(":")
    B, T = (int(x) for x in bt.split("x"))
    H, _, Hkv = h.partition("/")
    H = int(H)
    Hkv = int(Hkv) if Hkv else H
    K, _, V = d.partition("x")
    return dict(name=text, B=B, T=T, H=H, Hkv=Hkv, K=int(K), V=int(V or K), seqs=None, norm=bool(plus))


def _device_time(evt) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(evt, attr):
            return float(getattr(evt, attr))
    return 0.0


def profile(fn, iters: int) -> dict:
    """Kernel name -> (calls per iteration, µs per iteration)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = collections.OrderedDict()
    for evt in prof.key_averages():
        t = _device_time(evt)
        if t <= 0:
            continue
        out[evt.key] = (evt.count / iters, t / iters)
    return out


def glaswap_fn(s, gla_triton, dtype=torch.bfloat16):
    sets, cu = bench_kernels.make_inputs(s, 2, "cuda", dtype=dtype)
    grad_sets = [tuple(x.clone().requires_grad_() for x in st[:4]) + (st[4],) for st in sets]
    nxt = bench_kernels._rotating(grad_sets)

    def run():
        q, k, v, g, do = nxt()
        o, _ = gla_triton.fused_chunk_gla(q, k, v, g, cu_seqlens=cu, normalizer=s["norm"],
                                          _overrides=bench_kernels.OVERRIDES)
        torch.autograd.grad(o, (q, k, v, g), do)
    return run


def sdpa_fn(s):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, T, H, Hkv, D = s["B"], s["T"], s["H"], s["Hkv"], s["K"]
    q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)

    def run():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               enable_gqa=Hkv != H)
        torch.autograd.grad(o, (q, k, v), do)
    return run


def show(title, table):
    total = sum(t for _, t in table.values())
    print(f"\n## {title}: {total / 1e3:.3f} ms of kernel time per fwd+bwd")
    for name, (calls, t) in sorted(table.items(), key=lambda kv: -kv[1][1]):
        print(f"  {t / 1e3:8.3f} ms {100 * t / total:5.1f}%  x{calls:g}  {name[:90]}")
    return total


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", help="BxT:H[/Hkv]:D (repeatable)")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE", help="LaunchConfig override")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16",
                    help="glaswap's inputs (SDPA stays bf16)")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--ncu", action="store_true",
                    help="no profiler: warm up, then one marked iteration per shape (for ncu)")
    ap.add_argument("--gates", default="seed", choices=("seed", "trained", "steep"),
                    help="weak gates (seed), what distillation learns (trained: 40%% steep channels) "
                         "or logsigmoid(N(0,1)) (steep)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    _, gla_triton = bench_kernels._import_kernels()
    bench_kernels.OVERRIDES.update(bench_kernels._parse_sets(args.set))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    results = {}
    for text in args.shape or DEFAULT_SHAPES:
        s = dict(parse_shape(text), gates=args.gates)
        run = glaswap_fn(s, gla_triton, dtype)
        if args.ncu:
            for _ in range(2):
                run()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(f"glaswap {text}")
            run()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            continue
        res = {"glaswap": profile(run, args.iters)}
        g_total = show(f"glaswap {text} [{args.gates} gates] {bench_kernels.OVERRIDES or ''}", res["glaswap"])
        if not args.no_sdpa and s["K"] == s["V"] and not s["norm"]:
            res["sdpa"] = profile(sdpa_fn(s), args.iters)
            s_total = show(f"sdpa flash {text}", res["sdpa"])
            print(f"  kernel-time ratio sdpa/glaswap: {s_total / g_total:.2f}")
        results[text] = res
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
