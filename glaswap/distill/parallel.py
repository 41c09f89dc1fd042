"""One process or many: what the training loop needs to know about torchrun.

Under `torchrun --nproc-per-node N` (and torchrun's rendezvous flags across nodes):
- ddp: every process holds the whole model; the gradients of the trainable parameters (LoRA,
  gates, feature maps: a few MB) are averaged with one all-reduce per step.
- fsdp: PyTorch's FSDP2, `fully_shard` on every decoder layer, so each process keeps 1/N of
  every layer (parameters stored in float32, gathered in the training dtype). The teacher's
  forward runs through the same sharded layers in softmax mode, so no process holds a full
  copy it does not need. Embeddings, final norm and LM head stay whole on every process.
Without torchrun, everything here is a no-op and training runs in one process.

Checkpoints hold full (unsharded) tensors of the trainable parameters and their optimizer
state, keyed by parameter name, so a run saved with N processes resumes with M.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as tdist

from glaswap.distill.checkpoints import TRAINABLE, check_state, copy_state, load_trainable_state
from glaswap.errors import GlaswapError


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly sharded) parameter or optimizer state, on the CPU."""
    if _is_dtensor(t):
        t = t.full_tensor()
    return t.detach().float().cpu().contiguous() if t.is_floating_point() else t.detach().cpu()


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    mode: str = "single"          # single | ddp | fsdp
    owns_group: bool = False      # started the process group here, so closes it too

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ---------------------------------------------------------------- collectives
    def barrier(self):
        if self.world > 1:
            tdist.barrier()

    def _device(self):
        if self.world > 1 and tdist.get_backend() == "nccl":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dev = t.device
            t = t.detach().clone().to(self._device())
            tdist.all_reduce(t)
            t = t.to(dev)
        return t

    def mean(self, value) -> float:
        t = value.detach().float().reshape(1) if torch.is_tensor(value) else torch.tensor([float(value)])
        return float(self.sum(t).item()) / self.world

    def main_only(self, fn):
        """Run fn on rank 0 only; if it raises, every rank raises the same GlaswapError
        (instead of the others waiting for rank 0 at the next collective forever)."""
        from glaswap.errors import GlaswapError

        error = None
        result = None
        if self.is_main:
            try:
                result = fn()
            except GlaswapError as e:
                error = str(e)
            except Exception as e:
                if self.world == 1:
                    raise
                error = f"{type(e).__name__}: {e}"
        if self.world > 1:
            box = [error]
            tdist.broadcast_object_list(box, src=0)
            error = box[0]
        if error is not None:
            raise GlaswapError(error)
        return result

    def close(self, ok: bool):
        """Leave the process group. After a clean run every process first waits for the others,
        so none exits (closing its sockets) while a peer is still in a collective with it.
        After an error there is no barrier: a peer that did not fail the same way would keep
        this one waiting for the collective timeout. (The CLI then also skips Python's
        shutdown under torchrun; see `_end_torchrun_worker` in glaswap/cli.py.)"""
        if self.owns_group and tdist.is_initialized():
            if ok:
                tdist.barrier()
            tdist.destroy_process_group()

    # ---------------------------------------------------------------- the model
    def storage_dtype(self, compute: torch.dtype) -> torch.dtype:
        """The dtype to build the model in: FSDP shards need one dtype per layer (the new
        parameters train in float32), so under fsdp the model is kept in float32 and gathered
        in the compute dtype; otherwise frozen weights are stored in the compute dtype."""
        return torch.float32 if self.mode == "fsdp" else compute

    def wrap(self, model, device, compute=torch.float32):
        """Place the model: whole on `device`, or its decoder layers sharded (fsdp), stored
        in their dtype and gathered in the `compute` dtype for each forward and backward."""
        if self.mode != "fsdp":
            return model.to(device)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (self.world,))
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) \
            if compute != torch.float32 else MixedPrecisionPolicy()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        return model.to(device)  # what is not sharded (embeddings, norm, head) goes whole

    def sync_grads(self, params):
        """Average gradients of replicated trainable parameters across processes (ddp)."""
        if self.world > 1 and self.mode == "ddp":
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                flat = torch.cat([g.reshape(-1).float() for g in grads])
                tdist.all_reduce(flat.to(self._device()) if flat.device != self._device() else flat)
                flat /= self.world
                offset = 0
                for g in grads:
                    n = g.numel()
                    g.copy_(flat[offset:offset + n].view_as(g))
                    offset += n

    def gather_trainable(self, model, names) -> dict:
        """Full float32 copies of the named parameters, on the CPU; collective."""
        return {n: _full(p) for n, p in model.named_parameters() if n in names}

    def load_trainable(self, model, folder: Path):
        """Load a checkpoint's parameters, sharding them as this process's layout wants; one
        line naming the file when it is damaged or of another model."""
        state = load_trainable_state(folder)
        if self.mode == "fsdp":
            from torch.distributed.tensor import distribute_tensor

            params = dict(model.named_parameters())
            check_state(params, state, Path(folder) / TRAINABLE)   # a DTensor's shape is the whole one
            with torch.no_grad():
                for name, value in state.items():
                    p = params[name]
                    if _is_dtensor(p):
                        value = distribute_tensor(value.to(p.dtype), p.device_mesh, p.placements)
                        p.to_local().copy_(value.to_local())
                    else:
                        p.copy_(value.to(p.dtype))
            return
        copy_state(model, state, Path(folder) / TRAINABLE)

    # ---------------------------------------------------------------- optimizer state
    def optimizer_state(self, model, optimizer) -> dict:
        """Optimizer state keyed by parameter name, with full tensors; collective."""
        names = {id(p): n for n, p in model.named_parameters()}
        state, groups = {}, []
        for group in optimizer.param_groups:
            groups.append({k: v for k, v in group.items() if k != "params"} |
                          {"params": [names[id(p)] for p in group["params"]]})
            for p in group["params"]:
                st = optimizer.state.get(p, {})
                state[names[id(p)]] = {k: (_full(v) if torch.is_tensor(v) and v.dim() > 0 else v)
                                       for k, v in st.items()}
        return {"state": state, "param_groups": groups}

    def load_optimizer_state(self, model, optimizer, saved: dict):
        """The reverse of optimizer_state, re-sharding for this process's layout."""
        params = dict(model.named_parameters())
        names = {id(p): n for n, p in params.items()}
        for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
            if saved_group["params"] != [names[id(p)] for p in group["params"]]:
                raise ValueError("the checkpoint's optimizer does not match this run's trainable parameters")
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        for name, st in saved["state"].items():
            p = params[name]
            restored = {}
            for k, v in st.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    if _is_dtensor(p):
                        from torch.distributed.tensor import distribute_tensor

                        v = distribute_tensor(v.to(device=p.to_local().device, dtype=torch.float32),
                                              p.device_mesh, p.placements)
                    else:
                        v = v.to(device=p.device, dtype=torch.float32)
                elif torch.is_tensor(v):
                    v = v.clone()
                restored[k] = v
            optimizer.state[p] = restored


def _env_int(name: str, default: str | None, low: int, high: int | None = None) -> int:
    """An integer of torchrun's environment, in [low, high]; one line for a missing or odd one
    (a variable left over in the shell, not a torchrun launch)."""
    raw = os.environ.get(name, default)
    fix = "launch with torchrun, or unset WORLD_SIZE to run in one process"
    if raw is None:
        raise GlaswapError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but {name} is not; {fix}")
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise GlaswapError(f"{name}={raw!r} is not an integer {bound}; {fix}")
    return value


def setup_distributed(mode: str = "auto") -> Dist:
    """Read torchrun's environment; start the process group when there are several processes."""
    world = _env_int("WORLD_SIZE", "1", 0)
    if world <= 1:
        return Dist()
    rank, local_rank = _env_int("RANK", None, 0, world - 1), _env_int("LOCAL_RANK", "0", 0, world - 1)
    owns = not tdist.is_initialized()
    if owns:
        for name in ("MASTER_ADDR", "MASTER_PORT"):   # the rendezvous torchrun sets up
            if name not in os.environ:
                raise GlaswapError(f"WORLD_SIZE={world} is set but {name} is not; launch with torchrun, "
                                   f"or unset WORLD_SIZE to run in one process")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        tdist.init_process_group(backend)
    return Dist(rank=rank, world=world, local_rank=local_rank, mode="fsdp" if mode == "fsdp" else "ddp",
                owns_group=owns)
