"""Benchmark the sliding-window + sink attention kernels against the GLA kernel and SDPA flash.

For each shape, forward+backward median ms of:
- window: glaswap_kernels.ops.window_attention (window 64, sinks 4), gradients of o and lse;
- gla: glaswap_kernels.ops.chunk_gla with the in-kernel normaliser on hedgehog-sized
  inputs (feature maps as wide as the head: K = V = D; --pm: K = 2D, hedgehog_pm);
- sdpa: F.scaled_dot_product_attention, flash backend, causal, same [B, T, H, D].
It prints window/gla (the target for a hybrid layer, (gla + window)/gla <= 1.25,
needs <= 0.25), (gla + window)/gla and sdpa/(gla + window) (target >= 1.5 at T = 2048).
Each shape is first checked in bf16 against the float32 reference on its first 2048 tokens.

    python benchmarks/bench_window.py
    python benchmarks/bench_window.py --window 128 --set BM=32 --set BN=32   # tuning
    python benchmarks/bench_window.py --dry-run        # CPU, Triton interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from bench_kernels import _parse_sets as parse_sets, _rotating, bench_device, kernel_modules  # same folder: run as a script

HERE = os.path.dirname(os.path.abspath(__file__))
DRY_RUN = False


def _import_kernels():
    return kernel_modules("ops", "window.reference", "window.triton")


def shapes():
    if DRY_RUN:
        return [dict(name="1x80 H2 D16", B=1, T=80, H=2, D=16)]
    return [dict(name=f"{B}x{T} H{H} D{D}", B=B, T=T, H=H, D=D)
            for H, D in [(32, 64), (16, 128)] for B, T in [(8, 2048), (1, 16384)]]


def bench(fn):
    """Median ms: CUDA events around each call after warmup (triton.testing.do_bench)."""
    if DRY_RUN:
        import time
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _randn(*shape, gen, device, grad=True):
    x = torch.randn(*shape, device=device, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    return x.requires_grad_(grad)


def check(s, args, window_triton, window_torch, device):
    """bf16 kernels, with the launch options being timed, vs the float32 reference (relative
    RMS of o, lse, dq, dk, dv)."""
    T = min(s["T"], 2048)
    gen = torch.Generator(device=device).manual_seed(1)
    q, k, v = (_randn(1, T, s["H"], s["D"], gen=gen, device=device) for _ in range(3))
    do = _randn(1, T, s["H"], s["D"], gen=gen, device=device, grad=False)
    dlse = torch.randn(1, T, s["H"], device=device, generator=gen)
    rs = [x.detach().float().requires_grad_() for x in (q, k, v)]
    o, lse = window_triton.fused_window_attention(q, k, v, args.window, args.sinks, _overrides=args.overrides)
    o_r, lse_r = window_torch.window_attention_torch(*rs, args.window, args.sinks)
    got = torch.autograd.grad((o, lse), (q, k, v), (do, dlse))
    want = torch.autograd.grad((o_r, lse_r), rs, (do.float(), dlse))
    errs = [rel(o, o_r), rel(lse, lse_r)] + [rel(a, b) for a, b in zip(got, want)]
    return all(e <= 2e-2 for e in errs), errs


def rel(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def time_window(s, args, window_triton, device):
    gen = torch.Generator(device=device).manual_seed(0)
    B, T, H, D = s["B"], s["T"], s["H"], s["D"]
    sets = [tuple(_randn(B, T, H, D, gen=gen, device=device) for _ in range(3))
            + (_randn(B, T, H, D, gen=gen, device=device, grad=False),
               torch.randn(B, T, H, device=device, generator=gen)) for _ in range(3)]
    nxt = _rotating(sets)

    def fwd_bwd():
        q, k, v, do, dlse = nxt()
        o, lse = window_triton.fused_window_attention(q, k, v, args.window, args.sinks,
                                                      _overrides=args.overrides)
        torch.autograd.grad((o, lse), (q, k, v), (do, dlse))
    return bench(fwd_bwd)


def time_gla(s, args, ops, device):
    gen = torch.Generator(device=device).manual_seed(0)
    B, T, H, D = s["B"], s["T"], s["H"], s["D"]
    K = 2 * D if args.pm else D
    sets = []
    for _ in range(3):
        q, k = (_randn(B, T, H, K, gen=gen, device=device) for _ in range(2))
        v = _randn(B, T, H, D, gen=gen, device=device)
        g = (F.logsigmoid(torch.randn(B, T, H, K, device=device, generator=gen)) / 16)
        g = g.to(torch.bfloat16).requires_grad_()
        do = _randn(B, T, H, D + 1, gen=gen, device=device, grad=False)
        sets.append((q, k, v, g, do))
    nxt = _rotating(sets)

    def fwd_bwd():
        q, k, v, g, do = nxt()
        o, _ = ops.chunk_gla(q, k, v, g, normalizer=True)
        torch.autograd.grad(o, (q, k, v, g), do)
    return bench(fwd_bwd)


def time_sdpa(s, device):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = SDPBackend.MATH if DRY_RUN else SDPBackend.FLASH_ATTENTION
    gen = torch.Generator(device=device).manual_seed(0)
    B, T, H, D = s["B"], s["T"], s["H"], s["D"]
    sets = [tuple(_randn(B, H, T, D, gen=gen, device=device) for _ in range(3))
            + (_randn(B, H, T, D, gen=gen, device=device, grad=False),) for _ in range(3)]
    nxt = _rotating(sets)

    def fwd_bwd():
        q, k, v, do = nxt()
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(o, (q, k, v), do)
    return bench(fwd_bwd)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--pm", action="store_true", help="GLA at hedgehog_pm width (K = 2D)")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="a launch option of window_triton._Plan (BM, BN, BS, warps, stages)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--dry-run", action="store_true",
                    help="test this script on CPU (Triton interpreter, tiny shapes, rough timer)")
    args = ap.parse_args(argv)
    args.overrides = parse_sets(args.set)
    global DRY_RUN
    DRY_RUN = args.dry_run
    device = bench_device(DRY_RUN)
    if device is None:
        return 2
    ops, window_torch, window_triton = _import_kernels()
    import triton
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    print(f"# {name} | torch {torch.__version__} | triton {triton.__version__} | window "
          f"{args.window} sinks {args.sinks} | gla K = {'2D' if args.pm else 'D'} | "
          f"overrides {args.overrides or '-'}")
    head = (f"{'shape':18s} {'check':5s} | {'window':>7s} {'gla':>7s} {'sdpa':>7s} | "
            f"{'win/gla':>7s} {'hyb/gla':>7s} {'sdpa/hyb':>8s}")
    print(head)
    print("-" * len(head))
    ok_all = True
    for s in shapes():
        status = "-"
        if not args.no_check:
            ok, errs = check(s, args, window_triton, window_torch, device)
            ok_all &= ok
            status = "pass" if ok else "FAIL"
            if not ok:
                print(f"  CHECK FAILED {s['name']}: o, lse, dq, dk, dv = "
                      f"{', '.join(f'{e:.2e}' for e in errs)}", file=sys.stderr)
        w = time_window(s, args, window_triton, device)
        g = time_gla(s, args, ops, device)
        a = time_sdpa(s, device)
        print(f"{s['name']:18s} {status:5s} | {w:7.3f} {g:7.3f} {a:7.3f} | {w / g:7.2f} "
              f"{(w + g) / g:7.2f} {a / (w + g):8.2f}", flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    print("# forward+backward median ms; hyb = gla + window (target hyb/gla <= 1.25, "
          "sdpa/hyb >= 1.5 at T = 2048)")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
