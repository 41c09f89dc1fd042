"""Where one decode step's GPU time goes: kernels per step and per layer, and GPU time by kernel,
for a random model of SmolLM2-135M's shape converted with the GPU recipe's hybrid options, after
a prompt read into the cache. The step runs eagerly (a CUDA graph replays the same kernels), so
the kernel count is what a graph replays; the teacher's eager step is profiled beside it.

    python benchmarks/profile_decode.py                      # 2K context, batch 1
    python benchmarks/profile_decode.py --context 16384 --batch-size 8 --option 'softmax_layers=[18,20]'

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from random_models import random_models  # noqa: E402

RECIPE = dict(gate="lowrank", feature_map="hedgehog_pm", normalizer=True, use_rope=True, rope_max_wavelength=2048,
              gate_init_decay=0.995, window=128, sinks=4, window_mix="shared", decay_horizon=2048)


def profile_steps(model, prompt, steps):
    """(kernel name -> [calls, GPU µs]) over `steps` greedy single-token steps after `prompt`."""
    from torch.profiler import ProfilerActivity, profile

    from glaswap.models.modeling_glaswap import CACHE_NAME, cache_of

    def step(token, cache):
        out = model(input_ids=token, **{CACHE_NAME: cache}, use_cache=True)
        return out.logits[:, -1:].argmax(-1), cache_of(out)

    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        token, cache = out.logits[:, -1:].argmax(-1), cache_of(out)
        for _ in range(3):                                       # warm: compile, cuBLAS heuristics
            token, cache = step(token, cache)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                token, cache = step(token, cache)
            torch.cuda.synchronize()
    kernels = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[e.name]
            k[0] += 1
            k[1] += e.time_range.elapsed_us()
    return kernels


def report(name, kernels, steps, layers, top):
    calls = sum(c for c, _ in kernels.values()) / steps
    us = sum(t for _, t in kernels.values()) / steps
    print(f"\n{name}: {calls:.0f} kernels a step ({calls / layers:.1f} a layer), {us:.0f} µs of GPU time a step")
    print(f"{'kernel':<90} {'a step':>7} {'µs a step':>10}")
    for k, (c, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{k[:90]:<90} {c / steps:>7.1f} {t / steps:>10.1f}")


def main():
    from glaswap.distill.recipe import parse_override

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--top", type=int, default=25, help="kernels listed per model")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="a convert option on top of the recipe's hybrid ones")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode.py needs a CUDA GPU")
    options = dict(RECIPE, **{".".join(k): v for k, v in map(parse_override, args.option)})
    with tempfile.TemporaryDirectory(prefix="glaswap-profile-") as tmp:
        student, teacher = random_models("smollm2", torch.bfloat16, torch.device("cuda"), Path(tmp), options=options)
        student.set_attention_mode("gla")
        prompt = torch.randint(0, student.config.vocab_size, (args.batch_size, args.context), device="cuda")
        layers = student.config.num_hidden_layers
        print(f"{torch.cuda.get_device_name()}, bf16, batch {args.batch_size}, context {args.context}, "
              f"options {options}")
        report("glaswap", profile_steps(student, prompt, args.steps), args.steps, layers, args.top)
        report("teacher (dynamic KV cache)", profile_steps(teacher, prompt, args.steps), args.steps, layers, args.top)


if __name__ == "__main__":
    main()
