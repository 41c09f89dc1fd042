"""Where a training step's GPU time goes: teacher (SDPA) against student (GLA), per op.

Builds the models of bench_distill.py (random weights, bf16, LoRA r=8) and profiles a few
steps of each with torch.profiler: the teacher's plain LoRA step, the student's, and glaswap's
stage-2 distillation step (teacher forward + student forward/backward + vocabulary loss);
prints the ops with the most device time, per step. --steps picks some of the three.

    python benchmarks/profile_step.py --shape llama-3.2-1b --batch 8x2048
    python benchmarks/profile_step.py --steps distill --option window=128 --option sinks=4
"""

from __future__ import annotations

import argparse
import importlib.util
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("bench_distill", os.path.join(HERE, "bench_distill.py"))
bench_distill = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_distill)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--batch", default="8x2048")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--rows", type=int, default=28)
    ap.add_argument("--set", action="append", metavar="KEY=VALUE", help="as in bench_distill.py")
    ap.add_argument("--steps", default="teacher,student,distill",
                    help="which steps to profile, comma-separated (teacher, student, distill)")
    ap.add_argument("--option", action="append", metavar="KEY=VALUE", default=[],
                    help="a GLA option of the student, e.g. window=128 (as in bench_distill.py)")
    ap.add_argument("--layers", default="fused", choices=["fused", "eager"],
                    help="the distill step's RMSNorms and MLPs: fused as `glaswap distill` runs them on a GPU, or eager")
    args = ap.parse_args()
    bench_distill.apply_overrides(args.set)
    from glaswap.distill.recipe import parse_override
    options = {".".join(key): value for key, value in map(parse_override, args.option)}
    from torch.profiler import ProfilerActivity, profile

    B, T = (int(x) for x in args.batch.split("x"))
    teacher, student, peft_student = bench_distill.build(args.shape, options=options)
    opt_t = torch.optim.AdamW([p for p in teacher.parameters() if p.requires_grad], lr=1e-5)
    opt_s = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, bench_distill.SHAPES[args.shape]["vocab_size"], (B, T), device="cuda")
    steps = {"teacher": lambda: bench_distill.ce_step(teacher, ids, opt_t),
             "student": lambda: (bench_distill.set_fused(student, False), bench_distill.ce_step(peft_student, ids, opt_s)),
             "distill": lambda: (bench_distill.set_fused(student, args.layers == "fused"),
                                 bench_distill.distill_step(student, ids, opt_s))}
    chosen = args.steps.split(",")
    unknown = set(chosen) - set(steps)
    if unknown:
        raise SystemExit(f"unknown --steps {sorted(unknown)}: choose among {sorted(steps)}")
    for name in chosen:
        fn = steps[name]
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                fn()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
        events.sort(key=lambda e: -e.self_device_time_total)
        total = sum(e.self_device_time_total for e in events) / args.iters / 1e3
        print(f"## {name} {args.shape} {B}x{T}: {total:.1f} ms of device time per step")
        for e in events[: args.rows]:
            ms = e.self_device_time_total / args.iters / 1e3
            print(f"  {ms:8.2f} ms {100 * ms / total:5.1f}%  x{e.count // args.iters:<5} {e.key[:150]}")
        # The same time by the aten op that launched it (inclusive: nested ops overlap).
        ops = [e for e in prof.key_averages() if e.key.startswith("aten::")
               and getattr(e, "device_time_total", 0) > 0]
        ops.sort(key=lambda e: -e.device_time_total)
        print(f"## {name}: aten ops by inclusive device time")
        for e in ops[: args.rows]:
            ms = e.device_time_total / args.iters / 1e3
            print(f"  {ms:8.2f} ms  x{e.count // args.iters:<5} {e.key}")


if __name__ == "__main__":
    main()
