"""One process or many: what the training loop needs to know about torchrun.

Under `torchrun --nproc-per-node N`, every process holds the model (replicated: gradients of
the trainable parameters, which are small, are all-reduced) or a shard of it (FSDP2:
`fully_shard` per decoder layer, then the root). Without torchrun, everything here is a
no-op and the loop runs as one process.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as tdist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    mode: str = "single"          # single | ddp | fsdp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # -- collectives (no-ops in one process)
    def barrier(self):
        if self.world > 1:
            tdist.barrier()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            t = t.clone()
            tdist.all_reduce(t)
        return t

    def mean(self, value) -> float:
        t = value.detach().float().reshape(1) if torch.is_tensor(value) else torch.tensor([float(value)])
        if self.world > 1:
            t = t.to(self._device())
            tdist.all_reduce(t)
            t = t / self.world
        return float(t.item())

    def _device(self):
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() and \
            tdist.get_backend() == "nccl" else torch.device("cpu")

    # -- the model
    def wrap(self, model, device):
        """Make the model ready for this layout; returns the module that owns the hooks."""
        return model

    def no_sync(self, model, last: bool):
        return contextlib.nullcontext()

    def sync_grads(self, params):
        """Average gradients of replicated trainable parameters across processes."""
        if self.world > 1 and self.mode == "ddp":
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                flat = torch.cat([g.reshape(-1).float() for g in grads])
                tdist.all_reduce(flat)
                flat /= self.world
                offset = 0
                for g in grads:
                    n = g.numel()
                    g.copy_(flat[offset:offset + n].view_as(g))
                    offset += n

    def gather_trainable(self, model, keep=()) -> dict:
        """Full float32 copies of the trainable parameters (and `keep` names), on CPU."""
        return {n: p.detach().float().cpu().contiguous() for n, p in model.named_parameters()
                if p.requires_grad or n in keep}

    def optimizer_state(self, model, optimizer):
        return optimizer.state_dict()

    def load_optimizer_state(self, model, optimizer, state):
        optimizer.load_state_dict(state)


def setup_distributed(mode: str = "auto") -> Dist:
    """Read torchrun's environment; start the process group when there are several processes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not tdist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        tdist.init_process_group(backend)
    return Dist(rank=rank, world=world, local_rank=local_rank, mode="ddp" if mode in ("auto", "ddp") else mode)
