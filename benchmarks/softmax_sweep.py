"""How many softmax layers, and which: distil a recipe once per choice, then score each on passkey
in prose, loss by position in one pass, and decode memory, in one table.

    python benchmarks/softmax_sweep.py --out runs/sweep --filler runs/jargon.txt \\
        --variant n0=none --variant n2=18,20 --variant n4=18,20,7,23 --variant last4=26,27,28,29 \\
        -- model.source=$PWD/runs/model.gguf output.tasks=

Each --variant NAME=LAYERS sets model.options.softmax_layers (none: no softmax layers; auto:N:
chosen by distill). The arguments after -- are recipe overrides for every run. `--parallel`
distillations share the GPU at a time (a 135M model leaves most of an H100 idle), then as
many scoring jobs: `glaswap passkey` (the teacher in the first variant's only: its rows are the
same for all), `glaswap eval --by-position` on the filler, and, once all are done,
`benchmarks/decode_memory.py` for each choice of layers on a random model of SmolLM2's shape.

A job whose output already exists is skipped, so an interrupted sweep continues where it
stopped. Each job's log is OUT/logs/NAME-STEP.log; the progress lines say what started and
ended, and how long the sweep has run. The summary is OUT/summary.md and OUT/summary.json.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GLASWAP = [sys.executable, "-c", "from glaswap.cli import main; main()"]


def parse_variant(text: str) -> tuple[str, str]:
    """NAME=LAYERS -> (NAME, the softmax_layers override's value)."""
    name, sep, layers = text.partition("=")
    if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
        raise SystemExit(f"--variant {text!r}: write NAME=LAYERS, e.g. n4=18,20,7,23, n0=none or a8=auto:8")
    layers = layers.strip()
    if layers in ("", "none"):
        return name, "[]"
    if layers.startswith("auto:"):
        return name, layers
    try:
        return name, "[" + ",".join(str(int(x)) for x in layers.split(",")) + "]"
    except ValueError:
        raise SystemExit(f"--variant {text!r}: LAYERS are layer indices separated by commas, none, or auto:N")


class Jobs:
    """Runs commands at most `parallel` at a time, each with its log file, and reports progress."""

    def __init__(self, parallel: int, logs: Path, log=print):
        self.parallel, self.logs, self.log = parallel, logs, log
        self.start = time.time()
        logs.mkdir(parents=True, exist_ok=True)

    def run(self, jobs: list[tuple[str, list[str]]]) -> dict[str, int]:
        """jobs: (name, command); returns each name's exit status."""
        waiting, running, done = list(jobs), {}, {}
        while waiting or running:
            while waiting and len(running) < self.parallel:
                name, cmd = waiting.pop(0)
                f = open(self.logs / f"{name}.log", "w")
                running[name] = (subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO), f)
                self.log(f"[{self.elapsed()}] start {name}")
            for name, (proc, f) in list(running.items()):
                if proc.poll() is not None:
                    f.close()
                    done[name] = proc.returncode
                    del running[name]
                    status = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode}, see {f.name})"
                    self.log(f"[{self.elapsed()}] {status}: {name}; {len(waiting) + len(running)} to go")
            time.sleep(0.5)
        return done

    def elapsed(self) -> str:
        s = int(time.time() - self.start)
        return f"{s // 60}m{s % 60:02d}s"


def _read(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def passkey_rows(result: dict | None, role: str) -> dict:
    """Mean accuracy and key nats by length for `role` (student or teacher) of a passkey.json."""
    if not result:
        return {}
    rows = {}
    for cell in result["cells"]:
        if role in cell:
            r = rows.setdefault(cell["length"], {"accuracy": [], "key_nats": []})
            r["accuracy"].append(cell[role]["accuracy"])
            r["key_nats"].append(cell[role]["key_nats"])
    return {n: {k: sum(v) / len(v) for k, v in r.items()} for n, r in sorted(rows.items())}


def by_position(folder: Path) -> dict | None:
    """The --by-position figure of the eval JSON in folder."""
    for path in sorted(folder.glob("*.json")) if folder.exists() else []:
        result = json.loads(path.read_text())
        if isinstance(result, dict) and result.get("by_absolute_position"):
            return result["by_absolute_position"]
    return None


def summarise(out: Path, variants: list[tuple[str, str]]) -> dict:
    """The sweep's figures per variant, from the files its jobs wrote."""
    rows, teacher = {}, None
    for name, layers in variants:
        run = out / name
        cfg = _read(run / "config.json") or {}
        ev = (_read(run / "eval.json") or {}).get("stage2") or {}
        pk = _read(run / "passkey" / "passkey.json")
        teacher = teacher or (passkey_rows(pk, "teacher") or None)
        mem = _read(out / "memory" / f"{name}.json")
        rows[name] = {
            "softmax_layers": cfg.get("softmax_layers", layers),
            "perplexity": {"held_out": ev.get("student_ppl"), "teacher_held_out": ev.get("teacher_ppl"),
                           **{k: v.get("student_ppl") for k, v in (ev.get("extra") or {}).items()}},
            "passkey": passkey_rows(pk, "student"),
            "by_position": by_position(run / "bypos"),
            "memory": mem,
        }
    return {"variants": rows, "teacher_passkey": teacher or {}}


def _f(x, digits=2):
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def markdown(summary: dict) -> str:
    rows, teacher = summary["variants"], summary["teacher_passkey"]
    lengths = sorted({n for r in rows.values() for n in r["passkey"]} | {int(n) for n in teacher})
    head = ["variant", "softmax layers", "held-out", "milton", "jargon"] + \
        [f"passkey {n // 1024}K (acc / nats)" for n in lengths]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cells(pk):
        return [f"{_f(pk[n]['accuracy'])} / {_f(pk[n]['key_nats'], 1)}" if n in pk else "–" for n in lengths]

    if teacher:
        tpk = {int(n): v for n, v in teacher.items()}
        first = next(iter(rows.values()), {}).get("perplexity", {})
        lines.append("| " + " | ".join(["teacher", "all", _f(first.get("teacher_held_out")), "", ""] + cells(tpk)) + " |")
    for name, r in rows.items():
        p = r["perplexity"]
        layers = ",".join(map(str, r["softmax_layers"])) if isinstance(r["softmax_layers"], list) else r["softmax_layers"]
        lines.append("| " + " | ".join([name, layers or "none", _f(p.get("held_out")), _f(p.get("milton")),
                                        _f(p.get("jargon"))] + cells({int(n): v for n, v in r["passkey"].items()}))
                     + " |")
    bins = [b["label"] for r in rows.values() if r["by_position"] for b in r["by_position"]["bins"]]
    labels = list(dict.fromkeys(bins))
    if labels:
        lines += ["", "One pass by position, mean loss (nats): the student, then the teacher's one pass where it has one",
                  "", "| variant | " + " | ".join(labels) + " |", "|" + "---|" * (len(labels) + 1)]
        for name, r in rows.items():
            if r["by_position"]:
                got = {b["label"]: b for b in r["by_position"]["bins"]}
                lines.append("| " + " | ".join([name] + [
                    f"{_f(got[l]['student_one_pass'], 3)} / {_f(got[l]['teacher_one_pass'], 3)}" if l in got else "–"
                    for l in labels]) + " |")
    mems = {n: r["memory"] for n, r in rows.items() if r["memory"]}
    if mems:
        contexts = [x["context"] for x in next(iter(mems.values()))]
        lines += ["", "Decode memory: peak GiB while decoding (a random model of SmolLM2's shape, eager / CUDA "
                  "graph)", "", "| variant | " + " | ".join(f"{c // 1024}K" for c in contexts) + " |",
                  "|" + "---|" * (len(contexts) + 1)]
        for name, m in mems.items():
            lines.append("| " + " | ".join([name] + [f"{_f(x.get('eager_peak_gib'), 3)} / {_f(x.get('graph_peak_gib'), 3)}"
                                                     for x in m]) + " |")
    return "\n".join(lines) + "\n"


def memory_rows(path: Path) -> list | None:
    """decode_memory.py's JSON as [{context, eager_peak_gib, graph_peak_gib}], or None."""
    result = _read(path)
    if not result:
        return None
    by_context = {}
    for r in result["rows"]:
        row = by_context.setdefault(r["context"], {"context": r["context"]})
        row["graph_peak_gib" if r["graph"] else "eager_peak_gib"] = r["decoding_peak"]
    return list(by_context.values()) or None


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="smollm2-135m")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=LAYERS")
    ap.add_argument("--parallel", type=int, default=3, help="jobs at a time (default 3)")
    ap.add_argument("--filler", required=True, help="a long text never trained on: passkey filler and the "
                                                    "--by-position document")
    ap.add_argument("--lengths", default="1K,2K,4K,8K", help="passkey lengths (default 1K,2K,4K,8K)")
    ap.add_argument("--trials", type=int, default=4, help="passkey keys a cell (default 4)")
    ap.add_argument("--by-position-tokens", type=int, default=65536, help="tokens of the filler read in one pass")
    ap.add_argument("--memory-contexts", default="2K,32K", help="decode_memory.py's contexts ('' to skip)")
    args = ap.parse_args(argv)
    variants = [parse_variant(v) for v in args.variant]
    if len({n for n, _ in variants}) != len(variants):
        raise SystemExit("--variant: every NAME once")
    out = args.out.resolve()
    jobs = Jobs(args.parallel, out / "logs")

    def missing(name, path):
        return not (out / name / path).exists()

    distill = [(f"{n}-distill", GLASWAP + ["distill", "--recipe", args.recipe, "--out", str(out / n), "--force",
                                           f"model.options.softmax_layers={layers}", *overrides])
               for n, layers in variants if missing(n, "config.json")]
    status = jobs.run(distill)
    trained = [(n, layers) for n, layers in variants if not missing(n, "config.json")]
    scoring = []
    for i, (n, _) in enumerate(trained):
        if missing(n, "passkey/passkey.json"):
            scoring.append((f"{n}-passkey", GLASWAP + [
                "passkey", str(out / n), "--filler", args.filler, "--lengths", args.lengths, "--trials",
                str(args.trials), "--out", str(out / n / "passkey")] + ([] if i == 0 else ["--no-teacher"])))
        if by_position(out / n / "bypos") is None:
            scoring.append((f"{n}-bypos", GLASWAP + [
                "eval", str(out / n), "--text", args.filler, "--max-tokens", str(args.by_position_tokens),
                "--context", "2048", "--by-position", "--out", str(out / n / "bypos")]))
    status.update(jobs.run(scoring))
    if args.memory_contexts:
        (out / "memory").mkdir(exist_ok=True)
        memory, same_count = [], {}
        for n, layers in variants:
            chosen = json.loads(layers) if layers.startswith("[") else \
                (_read(out / n / "config.json") or {}).get("softmax_layers")
            if chosen is None:
                continue
            # decode memory depends on how many layers keep a KV cache, not on which
            first = same_count.setdefault(len(chosen), n)
            if first != n or (out / "memory" / f"{n}-raw.json").exists():
                continue
            memory.append((f"{n}-memory", [sys.executable, str(REPO / "benchmarks" / "decode_memory.py"),
                                           "--softmax-layers", ",".join(map(str, chosen)) or "none",
                                           "--contexts", args.memory_contexts,
                                           "--json", str(out / "memory" / f"{n}-raw.json")]))
        status.update(Jobs(1, out / "logs").run(memory))     # one at a time: each reads its own peak
        for n, layers in variants:
            chosen = json.loads(layers) if layers.startswith("[") else \
                (_read(out / n / "config.json") or {}).get("softmax_layers")
            first = same_count.get(len(chosen)) if chosen is not None else None
            rows = memory_rows(out / "memory" / f"{first or n}-raw.json")
            if rows:
                (out / "memory" / f"{n}.json").write_text(json.dumps(rows, indent=2) + "\n")
    summary = summarise(out, variants)
    summary["failed"] = sorted(k for k, v in status.items() if v)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = markdown(summary)
    (out / "summary.md").write_text(text)
    print(text)
    if summary["failed"]:
        print(f"failed: {', '.join(summary['failed'])} (logs in {out / 'logs'})")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
