"""Benchmark one whole attention layer: pure GLA, hybrid (window + sinks, both mixes) and the
teacher's softmax attention (SDPA), forward+backward, bf16.

The layer is glaswap's GLAAttention at a Llama-3.2-1B attention shape (hidden 2048, 32 heads,
8 KV heads, D 64; hedgehog_pm maps, low-rank gate, normaliser) and at H16 D128 (hidden 2048,
16 heads, 8 KV heads); gradients reach every parameter and the input, as in stage 2. The table
gives median ms and the ratios a hybrid layer is held to: hybrid / pure GLA (target <= 1.25)
and teacher / hybrid (target >= 1.5 at T = 2048). On CUDA each row also gives the GPU's own
time, the sum of the kernels of one forward+backward (torch profiler): one layer alone can be
bound by the host's launches, which a whole model's step hides when the GPU is the bottleneck.

    python benchmarks/bench_hybrid_layer.py
    python benchmarks/bench_hybrid_layer.py --windows 64 --sinks 4 --json out.json
    python benchmarks/bench_hybrid_layer.py --dry-run     # CPU, Triton interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import bench_kernels  # same folder: run as a script
from bench_kernels import bench_device

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def shapes(dry_run):
    if dry_run:
        return [dict(name="1x40 H4 D16", B=1, T=40, hidden=64, H=4, KV=2, D=16)]
    return [dict(name=f"{B}x{T} H{H} D{D}", B=B, T=T, hidden=2048, H=H, KV=8, D=D)
            for H, D in [(32, 64), (16, 128)] for B, T in [(8, 2048), (1, 16384)]]


def layer(s, options, device, dtype):
    from glaswap.layers.gla_attention import GLAAttention
    from glaswap.models.configuration_glaswap import GLASwapConfig

    cfg = GLASwapConfig(hidden_size=s["hidden"], num_attention_heads=s["H"], num_key_value_heads=s["KV"],
                        head_dim=s["D"], num_hidden_layers=1, vocab_size=128, feature_map="hedgehog_pm",
                        gate_init_decay=0.995, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
                        **options)
    torch.manual_seed(0)
    return GLAAttention(cfg, 0).to(device=device, dtype=dtype)


def time_layer(s, options, mode, device, dtype, profile=False):
    from glaswap.models.modeling_glaswap import RotaryEmbedding

    attn = layer(s, options, device, dtype)
    attn.mode = mode
    x = torch.randn(s["B"], s["T"], s["hidden"], device=device, dtype=dtype, requires_grad=True)
    cos, sin = RotaryEmbedding(attn.config).to(device)(x, torch.arange(s["T"], device=device)[None])
    do = torch.randn_like(x)

    def fwd_bwd():
        out, _ = attn(x, position_embeddings=(cos, sin))
        out.backward(do)
    wall = bench_kernels.bench(fwd_bwd, quick=True)
    if device != "cuda":
        return wall, float("nan")
    from torch.profiler import ProfilerActivity, profile as torch_profile
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fwd_bwd()
        torch.cuda.synchronize()
    if profile:   # GPU time per op
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return wall, sum(e.device_time_total for e in kernels) / 1e3 / 5


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", default="16,64,128", help="comma-separated window lengths")
    ap.add_argument("--sinks", default="0,4", help="comma-separated sink counts")
    ap.add_argument("--mixes", default="shared,learned")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--profile", action="store_true",
                    help="print the GPU time per op of the pure GLA layer and of each hybrid variant (torch profiler)")
    ap.add_argument("--shapes", default=None, help="comma-separated shape names to run (default: all)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, the Triton interpreter, tiny shapes")
    args = ap.parse_args(argv)
    bench_kernels.DRY_RUN = args.dry_run
    device = bench_device(args.dry_run)
    if device is None:
        return 1
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    variants = [(w, sk, mix) for w in map(int, args.windows.split(",")) for sk in map(int, args.sinks.split(","))
                for mix in args.mixes.split(",")]
    rows = []
    for s in shapes(args.dry_run):
        if args.shapes and s["name"] not in args.shapes.split(","):
            continue
        gla, gla_gpu = time_layer(s, {}, "gla", device, dtype, args.profile and device == "cuda")
        teacher, teacher_gpu = time_layer(s, {}, "softmax", device, dtype)
        print(f"{s['name']}: pure GLA {gla:.3f} ms (GPU {gla_gpu:.3f}), teacher softmax (SDPA) {teacher:.3f} ms "
              f"(GPU {teacher_gpu:.3f})")
        print(f"  {'variant':<18} {'ms':>8} {'GPU ms':>8}   hybrid/GLA (GPU)   teacher/hybrid (GPU)")
        for w, sk, mix in variants:
            ms, gpu = time_layer(s, {"window": w, "sinks": sk, "window_mix": mix}, "gla", device, dtype,
                                 args.profile and device == "cuda")
            row = dict(shape=s["name"], window=w, sinks=sk, mix=mix, ms=ms, gla_ms=gla, teacher_ms=teacher,
                       hybrid_over_gla=ms / gla, teacher_over_hybrid=teacher / ms, gpu_ms=gpu, gla_gpu_ms=gla_gpu,
                       teacher_gpu_ms=teacher_gpu, hybrid_over_gla_gpu=gpu / gla_gpu,
                       teacher_over_hybrid_gpu=teacher_gpu / gpu)
            rows.append(row)
            print(f"  W{w:<4} S{sk} {mix:<8} {ms:8.3f} {gpu:8.3f}   {ms / gla:5.2f} ({gpu / gla_gpu:4.2f})"
                  f"        {teacher / ms:5.2f} ({teacher_gpu / gpu:4.2f})", flush=True)
    if args.json:
        with open(args.json + ".tmp", "w") as fh:
            json.dump(rows, fh, indent=1)
        os.replace(args.json + ".tmp", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
