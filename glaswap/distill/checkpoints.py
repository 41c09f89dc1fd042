"""What a run folder keeps so that an interrupted run can resume: the latest checkpoint of
each stage (checkpoints/stage{1,2}, written atomically) and metrics.jsonl, cut back to the
checkpoint on resume.

A checkpoint holds full (unsharded) float32 tensors keyed by parameter name, whatever the
process layout that wrote it (see glaswap/distill/parallel.py). Every file is safetensors or
JSON: loading a checkpoint runs no code, whoever wrote it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from glaswap.errors import GlaswapError

OPTIMIZER_TENSORS = "optimizer.safetensors"   # optimizer state tensors and the CPU random state
OPTIMIZER_JSON = "optimizer.json"             # the rest: parameter groups, other state, schedule


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
    _save_optimizer(tmp, optim_state, scheduler.state_dict(), torch.get_rng_state())
    record = {"stage": stage, "step": step}
    softmax = list(getattr(model.config, "softmax_layers", None) or [])
    if softmax:   # the layers the tensors were trained with in softmax attention
        record["softmax_layers"] = softmax
    (tmp / "state.json").write_text(json.dumps(record))
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


def checkpoint_softmax_layers(folder: Path) -> list[int]:
    """The softmax layers of the model a checkpoint was saved from ([] for none)."""
    return list(json.loads((Path(folder) / "state.json").read_text()).get("softmax_layers", []))


def _save_optimizer(folder: Path, optim_state: dict, schedule: dict, rng: torch.Tensor):
    """Tensors of the optimizer state (keyed "state/<parameter>/<key>") and the random state
    into safetensors; everything else, plain numbers and lists, into JSON."""
    tensors, other = {"rng": rng}, {}
    for name, st in optim_state["state"].items():
        for key, value in st.items():
            if torch.is_tensor(value):
                tensors[f"state/{name}/{key}"] = value.detach().cpu().contiguous()
            else:
                other.setdefault(name, {})[key] = value
    save_file(tensors, str(folder / OPTIMIZER_TENSORS))
    (folder / OPTIMIZER_JSON).write_text(json.dumps(
        {"param_groups": optim_state["param_groups"], "state": other, "scheduler": schedule}))


def _load_optimizer(folder: Path) -> dict:
    """What _save_optimizer wrote, as {"optimizer", "scheduler", "rng"}. A run folder holding
    optimizer.pt instead is read with weights_only=True: tensors and containers, no objects."""
    try:
        if not (folder / OPTIMIZER_TENSORS).is_file() and (folder / "optimizer.pt").is_file():
            return torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True)
        tensors = load_file(str(folder / OPTIMIZER_TENSORS))
        saved = json.loads((folder / OPTIMIZER_JSON).read_text())
    except Exception as e:   # missing or truncated files; an optimizer.pt holding objects
        raise GlaswapError(f"the checkpoint in {folder} is unreadable or not glaswap's ({type(e).__name__}); "
                           f"restart the run with --force")
    state = {name: dict(st) for name, st in saved["state"].items()}
    for key, value in tensors.items():
        if key.startswith("state/"):
            name, _, field = key[len("state/"):].rpartition("/")
            state.setdefault(name, {})[field] = value
    return {"optimizer": {"state": state, "param_groups": saved["param_groups"]},
            "scheduler": saved["scheduler"], "rng": tensors["rng"]}


def restore_optimizer(folder: Path, optimizer, scheduler, dist, model):
    """The optimizer, schedule and CPU random state a checkpoint saved, into this run's."""
    state = _load_optimizer(folder)
    for group, saved in zip(optimizer.param_groups, state["optimizer"]["param_groups"]):
        for key, value in saved.items():   # JSON has no tuples (AdamW's betas is one)
            if isinstance(value, list) and isinstance(group.get(key), tuple):
                saved[key] = tuple(value)
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
