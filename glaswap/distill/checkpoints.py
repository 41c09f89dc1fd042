"""What a run folder keeps so that an interrupted run can resume: the latest checkpoint of
each stage (checkpoints/stage{1,2}, written atomically) and metrics.jsonl, cut back to the
checkpoint on resume.

A checkpoint holds full (unsharded) float32 tensors keyed by parameter name, whatever the
process layout that wrote it (see glaswap/distill/parallel.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from glaswap.errors import GlaswapError


class Metrics:
    """metrics.jsonl in the run folder; on resume, lines past the checkpoint are dropped."""

    def __init__(self, path: Path, enabled: bool):
        self.path, self.enabled = path, enabled

    def truncate_after(self, stage: int, step: int):
        """Keep what the run logged up to its checkpoint at (stage, step). An evaluation logged
        at that very point is dropped too: the resumed run evaluates there again (a stage-1
        end checkpoint resumes into stage 1's evaluation), and would otherwise log it twice."""
        if not (self.enabled and self.path.is_file()):
            return
        keep = []
        for line in self.path.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            at = (record["stage"], record.get("step", 0))
            if at < (stage, step) or (at == (stage, step) and record.get("event") != "eval"):
                keep.append(line)
        self.path.write_text("".join(line + "\n" for line in keep))

    def log(self, **record):
        if self.enabled:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")

    def read(self):
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def save_checkpoint(run: Path, stage: int, step: int, model, trainable: set[str], optimizer, scheduler, dist):
    """Write checkpoints/stage{stage} atomically (temp folder, then rename).

    `trainable` names every parameter a run trains, the new (gate, feature-map) ones included
    even in a stage that keeps them frozen, so a stage-2 checkpoint alone restores the whole
    student.
    """
    state = dist.gather_trainable(model, trainable)  # all ranks take part; rank 0 writes
    optim_state = dist.optimizer_state(model, optimizer)
    if not dist.is_main:
        dist.barrier()
        return
    final = run / "checkpoints" / f"stage{stage}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "trainable.safetensors"))
    torch.save({"optimizer": optim_state, "scheduler": scheduler.state_dict(),
                "rng": torch.get_rng_state()}, tmp / "optimizer.pt")
    (tmp / "state.json").write_text(json.dumps({"stage": stage, "step": step}))
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    dist.barrier()


def latest_checkpoint(run: Path):
    """(stage, step, folder) of the furthest checkpoint, or None."""
    best = None
    for stage in (1, 2):
        folder = run / "checkpoints" / f"stage{stage}"
        if (folder / "state.json").is_file():
            st = json.loads((folder / "state.json").read_text())
            best = (st["stage"], st["step"], folder)
    return best


def restore_optimizer(folder: Path, optimizer, scheduler, dist, model):
    """The optimizer, schedule and CPU random state a checkpoint saved, into this run's."""
    state = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=False)
    dist.load_optimizer_state(model, optimizer, state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])


def copy_state(model, state: dict[str, torch.Tensor], source="checkpoint"):
    """Copy named tensors into a model's parameters (in their dtype)."""
    params = dict(model.named_parameters())
    missing = [n for n in state if n not in params]
    if missing:
        raise GlaswapError(f"{source} does not match the model ({missing[0]}); restart with --force")
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value.to(params[name].dtype))
