"""Decode and prefill on the CPU: a converted model against its teacher, in one process.

    python benchmarks/bench_cpu_decode.py MODEL [--teacher auto] [--contexts 256,1024] [--json F]

`glaswap generate --bench` times each model once per context. On a CPU that other jobs share,
one slow stretch then lands on one model only, so here the models take turns in rounds, each
round timing both with generate.time_decode (a random prompt read into a cache, then greedy
single-token steps), and each figure is the median over rounds. float32, torch's default
thread count. The teacher is found as `glaswap eval` finds it (`auto`: the source in
glaswap.json; or a folder or .gguf file).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from glaswap.generate import time_decode  # noqa: E402
from glaswap.runtime import open_model  # noqa: E402


def bench(models, vocab, contexts, rounds, steps):
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in contexts:
        prompt = torch.randint(0, vocab, (1, n), generator=gen)
        times = {name: {"decode": [], "prefill": []} for name in models}
        for _ in range(rounds):
            for name, m in models.items():
                r = time_decode(m, prompt, steps)
                times[name]["decode"].append(r["ms_per_step"])
                times[name]["prefill"].append(1000 * r["prefill_s"])
        row = {"context": n}
        for name, t in times.items():
            row[name] = {"decode_ms": statistics.median(t["decode"]), "prefill_ms": statistics.median(t["prefill"])}
        rows.append(row)
        s, te = row["student"], row["teacher"]
        print(f"context {n:5d}: decode {s['decode_ms']:.1f} ms/token, teacher {te['decode_ms']:.1f} "
              f"({te['decode_ms'] / s['decode_ms']:.2f}x); prefill {s['prefill_ms']:.0f} ms, teacher "
              f"{te['prefill_ms']:.0f} ({te['prefill_ms'] / s['prefill_ms']:.2f}x)", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a converted or distilled glaswap folder")
    ap.add_argument("--teacher", default="auto", help="auto (glaswap.json's source), a folder or a .gguf file")
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps a round")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    opened = open_model(args.model, device="cpu", dtype="float32", teacher=args.teacher, tokenizer=False)
    if opened.teacher is None:
        sys.exit("this benchmark needs a teacher to load: pass --teacher FOLDER or FILE.gguf")
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}", flush=True)
    models = {"student": opened.student, "teacher": opened.teacher}
    rows = bench(models, opened.student.config.vocab_size, [int(c) for c in args.contexts.split(",")],
                 args.rounds, args.steps)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
