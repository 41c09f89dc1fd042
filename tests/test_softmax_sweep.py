"""benchmarks/softmax_sweep.py on the CPU: its variants, its job runner, and its summary of files
that runs write (made by hand here: the sweep itself needs a GPU and the real model)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sweep():
    spec = importlib.util.spec_from_file_location("softmax_sweep", REPO / "benchmarks" / "softmax_sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_variants(sweep):
    assert sweep.parse_variant("n0=none") == ("n0", "[]")
    assert sweep.parse_variant("n4=18, 20,7,23") == ("n4", "[18,20,7,23]")
    assert sweep.parse_variant("a8=auto:8") == ("a8", "auto:8")
    for bad in ("n4", "=1,2", "n4=1,x", "n 4=1"):
        with pytest.raises(SystemExit, match="--variant"):
            sweep.parse_variant(bad)


def test_jobs_run_at_most_parallel_at_a_time_and_report_failures(sweep, tmp_path):
    lines = []
    jobs = sweep.Jobs(2, tmp_path / "logs", log=lines.append)
    py = sys.executable
    status = jobs.run([("a", [py, "-c", "print('hello')"]), ("b", [py, "-c", "import sys; sys.exit(3)"]),
                       ("c", [py, "-c", "print('third')"])])
    assert status == {"a": 0, "b": 3, "c": 0}
    assert (tmp_path / "logs" / "a.log").read_text() == "hello\n"
    assert sum("start" in line for line in lines) == 3
    assert any("FAILED (exit 3" in line and ": b" in line for line in lines)


def _cell(length, depth, acc, nats, teacher=None):
    cell = {"length": length, "depth": depth, "student": {"accuracy": acc, "key_nats": nats}}
    if teacher:
        cell["teacher"] = {"accuracy": teacher[0], "key_nats": teacher[1]}
    return cell


def _fake_run(out, name, layers, acc, with_teacher):
    run = out / name
    (run / "passkey").mkdir(parents=True)
    (run / "bypos").mkdir()
    (run / "config.json").write_text(json.dumps({"softmax_layers": layers}))
    (run / "eval.json").write_text(json.dumps({"stage2": {
        "student_ppl": 11.0 + len(layers), "teacher_ppl": 12.7,
        "extra": {"milton": {"student_ppl": 54.0}, "jargon": {"student_ppl": 34.0}}}}))
    teacher = (0.8, 2.0) if with_teacher else None
    cells = [_cell(n, d, acc, 3.0, teacher) for n in (1024, 2048) for d in (0.0, 1.0)]
    (run / "passkey" / "passkey.json").write_text(json.dumps({"cells": cells}))
    bins = [{"label": "0-1K", "student_one_pass": 3.1, "teacher_one_pass": 3.2},
            {"label": "1K-2K", "student_one_pass": 2.0, "teacher_one_pass": None}]
    (run / "bypos" / "eval-x.json").write_text(json.dumps({"by_absolute_position": {"bins": bins}}))


def test_a_finished_sweep_is_summarised_without_running_anything(sweep, tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    _fake_run(out, "n0", [], 0.2, True)
    _fake_run(out, "n2", [18, 20], 0.5, False)
    _fake_run(out, "last2", [26, 27], 0.4, False)      # as many layers as n2: its memory, not measured again
    (out / "memory").mkdir(parents=True)
    (out / "memory" / "n2-raw.json").write_text(json.dumps({"rows": [
        {"context": 2048, "graph": False, "decoding_peak": 0.30}, {"context": 2048, "graph": True, "decoding_peak": 0.37},
        {"context": 32768, "graph": False, "decoding_peak": 0.61}, {"context": 32768, "graph": True,
                                                                    "decoding_peak": 0.59}]}))
    (out / "memory" / "n0-raw.json").write_text(json.dumps({"rows": []}))

    def no_jobs(self, jobs):
        assert jobs == [], f"ran {jobs}"
        return {}

    monkeypatch.setattr(sweep.Jobs, "run", no_jobs)
    assert sweep.main(["--out", str(out), "--variant", "n0=none", "--variant", "n2=18,20",
                       "--variant", "last2=26,27", "--filler", "x.txt", "--", "output.tasks="]) == 0
    summary = json.loads((out / "summary.json").read_text())
    n2 = summary["variants"]["n2"]
    assert n2["passkey"] == {"1024": {"accuracy": 0.5, "key_nats": 3.0}, "2048": {"accuracy": 0.5, "key_nats": 3.0}}
    assert n2["perplexity"] == {"held_out": 13.0, "teacher_held_out": 12.7, "milton": 54.0, "jargon": 34.0}
    assert summary["teacher_passkey"]["1024"] == {"accuracy": 0.8, "key_nats": 2.0}
    assert n2["memory"] == [{"context": 2048, "eager_peak_gib": 0.30, "graph_peak_gib": 0.37},
                            {"context": 32768, "eager_peak_gib": 0.61, "graph_peak_gib": 0.59}]
    assert summary["variants"]["last2"]["memory"] == n2["memory"]
    text = (out / "summary.md").read_text()
    assert "| teacher | all | 12.70 |  |  | 0.80 / 2.0 | 0.80 / 2.0 |" in text
    assert "| n2 | 18,20 | 13.00 | 54.00 | 34.00 | 0.50 / 3.0 | 0.50 / 3.0 |" in text
    assert "| n0 | 3.100 / 3.200 | 2.000 / – |" in text
    assert "| n2 | 0.300 / 0.370 | 0.610 / 0.590 |" in text


def test_bad_variants_are_refused(sweep, tmp_path):
    with pytest.raises(SystemExit, match="every NAME once"):
        sweep.main(["--out", str(tmp_path), "--variant", "a=1", "--variant", "a=2", "--filler", "x"])
