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
