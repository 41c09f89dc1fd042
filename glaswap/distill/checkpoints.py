"""What a run folder keeps so that an interrupted run can resume: the latest checkpoint of
each stage (checkpoints/stage{1,2}, written atomically) and metrics.jsonl, cut back to the
checkpoint on resume.

A checkpoint holds full (unsharded) float32 tensors keyed by parameter name, whatever the
process layout that wrote it (see glaswap/distill/parallel.py). Every file is safetensors or
JSON: loading a checkpoint runs no code, whoever wrote it. Its state.json records what it
belongs to (the recipe's training hash, the converted model's fingerprint, the stage and
step), and resuming checks each of them: a checkpoint of another run, another model of the
same shape or a step the recipe does not have is refused in one line, as is a damaged file.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from glaswap.errors import GlaswapError

OPTIMIZER_TENSORS = "optimizer.safetensors"   # optimizer state tensors and the CPU random state
OPTIMIZER_JSON = "optimizer.json"             # the rest: parameter groups, other state, schedule
TRAINABLE = "trainable.safetensors"           # the trained parameters
STATE = "state.json"                          # stage, step and what the checkpoint belongs to
START_OVER = "pass --force to start the run over"


def damaged(path, what: str) -> GlaswapError:
    """The one line for a run folder file that cannot be used: which file, why, the way out."""
    return GlaswapError(f"{path} {what}; the run folder is damaged, {START_OVER}")


def read_json_file(path: Path, kind=dict):
    """A JSON file of the run folder, which must hold a `kind`; `damaged` otherwise."""
    try:
        value = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise damaged(path, "is missing")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise damaged(path, f"is not valid JSON ({type(e).__name__})")
    if not isinstance(value, kind):
        raise damaged(path, f"does not hold a JSON {'object' if kind is dict else kind.__name__}")
    return value


def safetensors_header(path: Path) -> tuple[bytes, dict]:
    """The raw header and its parsed entries of a safetensors file whose length matches what
    the header says; `damaged` for a missing, truncated or foreign file."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            size = os.fstat(fh.fileno()).st_size
            raw = fh.read(n) if 0 < n <= size - 8 else b""
    except FileNotFoundError:
        raise damaged(path, "is missing")
    except OSError as e:
        raise damaged(path, f"cannot be read ({e.strerror})")
    try:
        entries = json.loads(raw)
        end = max([0] + [int(v["data_offsets"][1]) for k, v in entries.items() if k != "__metadata__"])
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise damaged(path, "is not a safetensors file (truncated or overwritten)")
    if size != 8 + n + end:
        raise damaged(path, f"is truncated or padded ({size} bytes where its header says {8 + n + end})")
    return raw, entries


def model_fingerprint(folder: Path) -> str:
    """A fingerprint of a model folder's weights, the one convert records of a teacher
    (runtime.source_fingerprint: names, sizes, headers and the ends of each file), after each
    safetensors header is read: `damaged` for a file that is missing or not whole."""
    from glaswap.runtime import source_fingerprint

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise damaged(Path(folder) / "model.safetensors", "is missing")
    for f in files:
        safetensors_header(f)
    return source_fingerprint("folder", Path(folder))["sha256"][:24]


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
        for line, record in zip(self._lines(), self.read()):
            at = (record["stage"], record.get("step", 0))
            if at < (stage, step) or (at == (stage, step) and record.get("event") != "eval"):
                keep.append(line)
        self.path.write_text("".join(line + "\n" for line in keep))

    def _lines(self):
        try:
            return [line for line in self.path.read_text().splitlines() if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise damaged(self.path, f"cannot be read ({type(e).__name__})")

    def log(self, **record):
        if self.enabled:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")

    def read(self):
        """The logged records; `damaged` for a line that is not one (a JSON object with an
        integer stage)."""
        if not self.path.is_file():
            return []
        records = []
        for i, line in enumerate(self._lines()):
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not (isinstance(record, dict) and isinstance(record.get("stage"), int)
                    and isinstance(record.get("step", 0), int)):
                raise damaged(self.path, f"line {i + 1} is not a metrics record")
            records.append(record)
        return records


def save_checkpoint(run: Path, stage: int, step: int, model, trainable: set[str], optimizer, scheduler, dist,
                    belongs: dict | None = None):
    """Write checkpoints/stage{stage} atomically (temp folder, then rename).

    `trainable` names every parameter a run trains, the new (gate, feature-map) ones included
    even in a stage that keeps them frozen, so a stage-2 checkpoint alone restores the whole
    student. `belongs` ({"recipe": training hash, "model": fingerprint}) goes into state.json
    for `check_checkpoint`.
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
    save_file(state, str(tmp / TRAINABLE))
    _save_optimizer(tmp, optim_state, scheduler.state_dict(), torch.get_rng_state())
    record = {"stage": stage, "step": step, **(belongs or {})}
    softmax = list(getattr(model.config, "softmax_layers", None) or [])
    if softmax:   # the layers the tensors were trained with in softmax attention
        record["softmax_layers"] = softmax
    (tmp / STATE).write_text(json.dumps(record))
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
    """(stage, step, folder) of the furthest checkpoint, or None; `damaged` for a state.json
    that is not one."""
    best = None
    for stage in (1, 2):
        folder = run / "checkpoints" / f"stage{stage}"
        if (folder / STATE).exists():
            st = read_json_file(folder / STATE)
            if st.get("stage") != stage or type(st.get("step")) is not int or st["step"] < 0:
                raise damaged(folder / STATE, f"does not hold stage {stage} and a step")
            best = (st["stage"], st["step"], folder)
    return best


def check_checkpoint(folder: Path, steps: int, belongs: dict):
    """Refuse a checkpoint this run cannot continue: a step past the `steps` of its stage, or
    a record of another recipe or converted model than `belongs`."""
    st = read_json_file(Path(folder) / STATE)
    if st["step"] > steps:
        raise damaged(Path(folder) / STATE, f"says step {st['step']} of stage {st['stage']}, which has {steps} "
                                             f"steps in the recipe")
    for key, what in (("recipe", "a recipe with other training settings"), ("model", "another converted model")):
        if key not in st:
            raise damaged(Path(folder) / STATE, f"does not record which {key} it belongs to (it predates "
                                                 f"that record, or was edited)")
        if st[key] != belongs[key]:
            raise GlaswapError(f"the checkpoint in {folder} belongs to {what} than this run's; it cannot be "
                               f"resumed here, {START_OVER}")


def checkpoint_softmax_layers(folder: Path) -> list[int]:
    """The softmax layers of the model a checkpoint was saved from ([] for none)."""
    layers = read_json_file(Path(folder) / STATE).get("softmax_layers", [])
    if not (isinstance(layers, list) and all(type(i) is int for i in layers)):
        raise damaged(Path(folder) / STATE, "holds softmax_layers that are not a list of layers")
    return layers


def load_trainable_state(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint's trainable.safetensors; `damaged` for a file not whole."""
    path = Path(folder) / TRAINABLE
    safetensors_header(path)
    try:
        return load_file(str(path))
    except Exception as e:
        raise damaged(path, f"cannot be read ({type(e).__name__})")


def check_state(params: dict, state: dict[str, torch.Tensor], source):
    """Refuse tensors that are not this model's: an unknown name, or another shape."""
    for name, value in state.items():
        if name not in params:
            raise damaged(source, f"holds {name}, which the model does not have (a checkpoint of another model)")
        if tuple(value.shape) != tuple(params[name].shape):
            raise damaged(source, f"holds {name} of shape {list(value.shape)} where the model's is "
                                  f"{list(params[name].shape)} (a checkpoint of another model)")


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
    """The optimizer, schedule and CPU random state a checkpoint saved, into this run's;
    `damaged` (naming optimizer.json) for state that does not fit them."""
    try:
        state = _load_optimizer(folder)
        _check_optimizer(state, optimizer, scheduler, dict(model.named_parameters()))
        for group, saved in zip(optimizer.param_groups, state["optimizer"]["param_groups"]):
            for key, value in saved.items():   # JSON has no tuples (AdamW's betas is one)
                if isinstance(value, list) and isinstance(group.get(key), tuple):
                    saved[key] = tuple(value)
        dist.load_optimizer_state(model, optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError, AttributeError) as e:
        raise damaged(Path(folder) / OPTIMIZER_JSON, f"does not fit this run's optimizer ({type(e).__name__}: {e})")


def _check_optimizer(state: dict, optimizer, scheduler, params: dict):
    """Raise ValueError where saved optimizer state differs in form from this run's: the
    groups, their settings' types, each parameter's state tensors and the schedule's keys.
    Loading then cannot fail halfway, nor a later step on a tensor of another shape."""
    groups = state["optimizer"]["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(optimizer.param_groups):
        raise ValueError("another number of parameter groups")
    for group, saved in zip(optimizer.param_groups, groups):
        for key, value in group.items():
            if key != "params" and isinstance(value, (int, float)) and not isinstance(saved.get(key), (int, float)):
                raise ValueError(f"parameter group setting {key} is {saved.get(key)!r}")
    for name, st in state["optimizer"]["state"].items():
        if name not in params or not isinstance(st, dict):
            raise ValueError(f"state of an unknown parameter {name}")
        for key, value in st.items():
            if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != tuple(params[name].shape):
                raise ValueError(f"{name} {key} has shape {list(value.shape)}, the parameter "
                                 f"{list(params[name].shape)}")
            if key == "step" and not (torch.is_tensor(value) or isinstance(value, (int, float))):
                raise ValueError(f"{name} step is {value!r}")
    saved_schedule = state["scheduler"]
    if not isinstance(saved_schedule, dict) or set(saved_schedule) != set(scheduler.state_dict()):
        raise ValueError("a schedule of another form")
    if not (torch.is_tensor(state["rng"]) and state["rng"].dtype == torch.uint8
            and state["rng"].shape == torch.get_rng_state().shape):
        raise ValueError("not a random state")


def copy_state(model, state: dict[str, torch.Tensor], source="checkpoint"):
    """Copy named tensors into a model's parameters (in their dtype)."""
    params = dict(model.named_parameters())
    check_state(params, state, source)
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value.to(params[name].dtype))
