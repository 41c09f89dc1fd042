"""Where a prompt's read and one decode step spend their time: kernels launched (in all and per
layer), GPU time by kernel, and wall time, for a random model of SmolLM2-135M's shape converted
with the GPU recipe's hybrid options, beside its teacher. Wall time well above the kernels' GPU
time means the host's launches bound the call. The decode step runs eagerly (a CUDA graph
replays the same kernels, without the host's part).

    python benchmarks/profile_decode.py                      # 2K context, batch 1
    python benchmarks/profile_decode.py --context 16384 --batch-size 8 --option 'softmax_layers=[18,20]'

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from random_models import random_models  # noqa: E402

RECIPE = dict(gate="lowrank", feature_map="hedgehog_pm", normalizer=True, use_rope=True, rope_max_wavelength=2048,
              gate_init_decay=0.995, window=128, sinks=4, window_mix="shared", decay_horizon=2048)


def _kernels(prof):
    """kernel name -> [calls, GPU µs] of a torch profile."""
    kernels = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[e.name]
            k[0] += 1
            k[1] += e.time_range.elapsed_us()
    return kernels


def profile_model(model, prompt, steps):
    """({kernel: [calls, µs]} of one prompt read into an empty cache, its wall ms; the same over
    `steps` greedy single-token steps after it, their wall ms)."""
    from torch.profiler import ProfilerActivity, profile

    from glaswap.models.modeling_glaswap import CACHE_NAME, cache_of

    def read():
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1:].argmax(-1), cache_of(out)

    def step(token, cache):
        out = model(input_ids=token, **{CACHE_NAME: cache}, use_cache=True)
        return out.logits[:, -1:].argmax(-1), cache_of(out)

    def timed(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        return out, 1000 * (time.perf_counter() - t0)

    with torch.no_grad():
        token, cache = read()                                    # warm: compile, cuBLAS heuristics
        for _ in range(3):
            token, cache = step(token, cache)
        del cache
        _, read_ms = timed(read)                                 # wall time outside the profiler
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            token, cache = read()
            torch.cuda.synchronize()
        prompt_kernels = _kernels(prof)

        def run_steps():
            nonlocal token, cache
            for _ in range(steps):
                token, cache = step(token, cache)

        _, steps_ms = timed(run_steps)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run_steps()
            torch.cuda.synchronize()
    return (prompt_kernels, read_ms), (_kernels(prof), steps_ms / steps)


def report(name, kernels, wall_ms, reps, layers, top):
    calls = sum(c for c, _ in kernels.values()) / reps
    us = sum(t for _, t in kernels.values()) / reps
    bound = "the host's launches" if wall_ms > 1.5 * us / 1000 else "the GPU"
    print(f"\n{name}: {calls:.0f} kernels ({calls / layers:.1f} a layer), {us / 1000:.3f} ms of GPU time, "
          f"{wall_ms:.3f} ms of wall time: bound by {bound}")
    print(f"{'kernel':<90} {'calls':>7} {'µs':>10}")
    for k, (c, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{k[:90]:<90} {c / reps:>7.1f} {t / reps:>10.1f}")


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
        for name, model in (("glaswap", student), ("teacher (dynamic KV cache)", teacher)):
            (pk, p_ms), (dk, d_ms) = profile_model(model, prompt, args.steps)
            report(f"{name}, prompt of {args.context} tokens into an empty cache", pk, p_ms, 1, layers, args.top)
            report(f"{name}, one decode step (eager)", dk, d_ms, args.steps, layers, args.top)


if __name__ == "__main__":
    main()
