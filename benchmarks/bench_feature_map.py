"""The feature map in front of GLA (RoPE, Hedgehog matrix, softmax): fused kernel vs PyTorch.

Checks the fused output and gradients against the PyTorch form in float32, then prints
median ms (forward, forward+backward) for both at the shapes of a 1B and a 135M student.

    PYTHONPATH=<folder with glaswap_kernels> python benchmarks/bench_feature_map.py
"""

from __future__ import annotations

import argparse

import torch
import triton

from glaswap_kernels import feature_map_triton
from glaswap_kernels.feature_map_triton import fused_feature_map
from glaswap_kernels.gla.reference import feature_map_torch

SHAPES = [  # (name, B, T, H, D)
    ("1B q   8x2048 H32 D64", 8, 2048, 32, 64),
    ("1B k   8x2048 H8 D64", 8, 2048, 8, 64),
    ("135M q 1x16384 H9 D64", 1, 16384, 9, 64),
    ("8B q   4x2048 H32 D128", 4, 2048, 32, 128),
]


def inputs(B, T, H, D, dtype=torch.bfloat16):
    x = torch.randn(B, T, H, D, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.eye(D, device="cuda").repeat(H, 1, 1) + 0.1 * torch.randn(H, D, D, device="cuda")).requires_grad_()
    ang = torch.rand(1, T, D, device="cuda") * 6.3
    return x, ang.cos().to(dtype), ang.sin().to(dtype), w


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="launch setting of feature_map_triton.LAUNCH (BN, warps, stages)")
    ap.add_argument("--only", help="run only shapes whose name contains this")
    args = ap.parse_args()
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in feature_map_triton.LAUNCH:
            ap.error(f"unknown launch setting {key!r}; choose from {', '.join(feature_map_triton.LAUNCH)}")
        feature_map_triton.LAUNCH[key] = int(value)
    print(f"# launch: {feature_map_triton.LAUNCH}")
    print(f"{'shape':26} {'check':>9} | {'torch fwd':>9} {'torch f+b':>9} | {'fused fwd':>9} {'fused f+b':>9} | {'x f+b':>6}")
    for name, B, T, H, D in SHAPES:
        if args.only and args.only not in name:
            continue
        x, cos, sin, w = inputs(B, T, H, D)
        do = torch.randn_like(x)
        # correctness in float32 (against the PyTorch form in float64)
        x32 = x.detach().float().requires_grad_()
        outs = []
        for fn, dt in ((feature_map_torch, torch.float64), (fused_feature_map, torch.float32)):
            xx = x32.detach().to(dt).requires_grad_()
            ww = w.detach().to(dt if fn is feature_map_torch else torch.float32).requires_grad_()
            y = fn(xx, cos.to(dt), sin.to(dt), ww)
            (y * do.to(dt)).sum().backward()
            outs.append((y, xx.grad, ww.grad))
        err = max(rel(a, b) for a, b in zip(outs[1], outs[0]))
        times = []
        with torch.autocast("cuda", dtype=torch.bfloat16):
            for fn in (feature_map_torch, fused_feature_map):
                fwd = triton.testing.do_bench(lambda: fn(x, cos, sin, w), return_mode="median")
                fb = triton.testing.do_bench(
                    lambda: torch.autograd.backward(fn(x, cos, sin, w), do, inputs=[x, w]),
                    return_mode="median")
                times += [fwd, fb]
        flag = "pass" if err < 1e-4 else "FAIL"
        print(f"{name:26} {flag} {err:.0e} | {times[0]:9.3f} {times[1]:9.3f} | {times[2]:9.3f} {times[3]:9.3f} "
              f"| {times[1] / times[3]:5.1f}x", flush=True)
    print("# median ms, bf16 under autocast; check = worst relative RMS of (phi, dx, dW) in float32")


if __name__ == "__main__":
    main()
