"""`glaswap distill` under torchrun: two CPU processes (gloo) match one process with the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import tiny_recipe
from safetensors.torch import load_file

from glaswap.distill import distill, load_recipe


def _torchrun(nproc, args, cwd):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "glaswap.cli", "distill", *map(str, args)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=str(cwd), env=env, capture_output=True, text=True, timeout=900)


def _why(proc) -> str:
    """What a failed torchrun printed: the lines that name an error, then the tails (a SIGABRT's
    cause, e.g. gloo's 'terminate called after ...', sits far above torchrun's own summary)."""
    keys = ("error", "terminate", "what()", "abort", "exception", "traceback")
    flagged = [line for line in proc.stderr.splitlines() if any(k in line.lower() for k in keys)]
    return "\n".join(["-- flagged stderr lines:", *flagged[:40], "-- stdout tail:", proc.stdout[-1500:],
                      "-- stderr tail:", proc.stderr[-3000:]])


def _losses(folder):
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [(r["stage"], r["step"], r["loss"]) for r in rows if "loss" in r]


def _assert_same_run(a, b, rtol=2e-4, atol=2e-5):
    la, lb = _losses(a), _losses(b)
    assert [x[:2] for x in la] == [x[:2] for x in lb]
    for (stage, step, x), (_, _, y) in zip(la, lb):
        assert abs(x - y) <= atol + rtol * abs(y), (stage, step, x, y)
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("layout,options", [("ddp", []), ("fsdp", []),
                                            ("fsdp", ["model.options.window=4", "model.options.sinks=2"])])
def test_two_processes_match_one(tmp_path, layout, options):
    path = tiny_recipe(tmp_path, s1=3, s2=3, every=0)
    # One process with 2 blocks per micro-batch = two processes with 1 block each.
    distill(load_recipe(path, ["stage1.batch_size=2", "stage2.batch_size=2", *options]), out=tmp_path / "one",
            log=lambda *_: None)
    proc = _torchrun(2, ["--recipe", path, "stage1.batch_size=1", "stage2.batch_size=1", *options,
                         f"train.distributed={layout}", "--out", tmp_path / "two"], tmp_path)
    assert proc.returncode == 0, _why(proc)
    assert not (tmp_path / "two.run").exists()
    two = json.loads((tmp_path / "two" / "glaswap.json").read_text())
    assert two["distill"]["world_size"] == 2
    _assert_same_run(tmp_path / "one", tmp_path / "two")


@pytest.mark.slow
def test_saved_with_two_processes_resumes_with_one(tmp_path):
    path = tiny_recipe(tmp_path, s1=3, s2=3, every=1)
    overrides = ["stage1.batch_size=1", "stage2.batch_size=1", "train.distributed=fsdp"]
    proc = _torchrun(2, ["--recipe", path, *overrides, "--out", tmp_path / "run", "--stop-after", "2:1"], tmp_path)
    # Each process exits with 130 (interrupted); torchrun reports that as its own failure.
    assert proc.returncode != 0 and "checkpoint saved" in proc.stderr, _why(proc)
    assert not (tmp_path / "run").exists()
    # Resume in one process with the same global batch (2 blocks per micro-batch).
    recipe = load_recipe(path, overrides)
    recipe.stage1.batch_size = recipe.stage2.batch_size = 2
    recipe_file = tmp_path / "run.run" / "recipe.yaml"
    from glaswap.distill.recipe import dump_recipe

    recipe_file.write_text(dump_recipe(recipe))  # the same run, now described for one process
    distill(recipe, out=tmp_path / "run", resume=True, log=lambda *_: None)
    distill(load_recipe(path, ["stage1.batch_size=2", "stage2.batch_size=2"]), out=tmp_path / "ref",
            log=lambda *_: None)
    _assert_same_run(tmp_path / "ref", tmp_path / "run")


# ----------------------------------------------------------------------------- benchmarks/bench_scaling.py
BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _bench_scaling(nproc, args, cwd):
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    cmd = [sys.executable, *launcher, os.path.join(BENCH, "bench_scaling.py"), "--dry-run", *map(str, args)]
    return subprocess.run(cmd, cwd=str(cwd), env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_bench_scaling_measures_each_step_and_resumes_a_checkpoint_across_counts(tmp_path):
    """The 8B plan's script, on two CPU processes (FSDP2, gloo) then one: a row per step kind,
    and the checkpoint the two processes wrote restores exactly in one."""
    out, ck = tmp_path / "s.jsonl", tmp_path / "ck"
    for nproc in (2, 1):
        proc = _bench_scaling(nproc, ["--recipe", "llama-3.1-8b", "--json", out, "--checkpoint", ck], tmp_path)
        assert proc.returncode == 0, _why(proc)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["step"], r["world"]) for r in rows] == [(k, w) for w in (2, 1) for k in
                                                       ("stage1", "stage2", "checkpoint", "teacher")]
    for r in rows:
        if r["step"] != "checkpoint":
            assert r["layout"] == ("fsdp" if r["world"] == 2 else "single")
            assert r["tokens_per_s"] == pytest.approx(r["world"] * 2 * 64 / r["step_s"], rel=1e-2)
    two, one = (r for r in rows if r["step"] == "checkpoint")
    assert "load_s" not in two and one["saved_by_world"] == 2 and one["restored_exactly"] is True
    assert (ck / "checkpoints" / "stage2" / "trainable.safetensors").is_file()
    summary = subprocess.run([sys.executable, os.path.join(BENCH, "bench_scaling.py"), "--summary", str(out)],
                             capture_output=True, text=True, timeout=60).stdout
    assert "restored exactly" in summary and "stage2      1" in summary


def test_bench_scaling_summary_by_hand(tmp_path):
    sys.path.insert(0, BENCH)
    from bench_scaling import summary

    rows = [dict(step="stage2", world=1, step_s=1.0, tokens_per_s=1000.0, tokens_per_s_per_gpu=1000.0, peak_gib=50.0),
            dict(step="stage2", world=4, step_s=1.1, tokens_per_s=3600.0, tokens_per_s_per_gpu=900.0, peak_gib=20.0),
            dict(step="teacher", world=4, step_s=1.0, tokens_per_s=4000.0, tokens_per_s_per_gpu=1000.0, peak_gib=19.0)]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = summary(str(path)).splitlines()
    assert lines[1].split()[-1] == "100%"                        # 1 GPU, no teacher row at 1
    assert lines[2].split()[-2:] == ["90%", "0.90"]              # 900 / 1000 per GPU; 3600 / 4000 total
    assert lines[3].split()[-1] == "100%"                        # the teacher's own smallest count
