"""The training loop of one stage (micro-batches, clipping, logging, checkpoints, Ctrl-C) and
the teacher-and-student evaluation between stages."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from glaswap.distill import data as D
from glaswap.distill.checkpoints import Metrics, save_checkpoint
from glaswap.distill.losses import next_token_labels
from glaswap.distill.parallel import Dist
from glaswap.distill.recipe import Recipe, Stage1, Stage2
from glaswap.distill.student import adapters_off
from glaswap.errors import GlaswapError
from glaswap.scoring import teacher_and_student, token_nll


class Interrupted(Exception):
    """Raised inside the loop after a checkpoint was written on Ctrl-C (or a test's stop)."""


@dataclass
class RunState:
    """What every stage of one run shares."""
    folder: Path                            # OUT.run, where checkpoints go
    recipe: Recipe
    dist: Dist
    device: torch.device
    dtype: torch.dtype                      # the compute dtype (autocast's on CUDA)
    metrics: Metrics
    trainable: set[str]                     # the parameters a checkpoint holds
    stop_after: tuple[int, int] | None = None   # (stage, step): stop right after that step, as on Ctrl-C
    belongs: dict | None = None             # what each checkpoint records it belongs to (check_checkpoint)


@dataclass
class StageContext:
    """One stage for `run_stage`."""
    number: int                             # 1: attention transfer, 2: LoRA distillation
    cfg: Stage1 | Stage2                    # the recipe's section for this stage
    step_fn: Callable                       # batch -> loss, or (loss, {name: detached term}) to log terms
    model: torch.nn.Module                  # whose grads are cleared after each step, and checkpointed
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    blocks: D.PackedBlocks
    start_step: int                         # steps already done (a resumed run)
    run: RunState


def _schedule(step, warmup, total):
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def make_optimizer(params, cfg, steps):
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, cfg.warmup_steps, steps))
    return opt, sched


def _autocast(device, dtype):
    if device.type == "cuda" and dtype != torch.float32:
        return torch.autocast("cuda", dtype=dtype)
    return contextlib.nullcontext()


def _to_device(batch, device):
    """The batch on `device`. On a GPU a batch without document boundaries inside its blocks
    still gets cu_seqlens (one document per row): every batch then runs the same packed
    kernel variants, where a plain [B, T] batch would make Triton compile a second set mid-run
    the first time one comes. The CPU keeps plain batches, which its PyTorch paths handle
    whole rather than document by document."""
    batch = {k: (v.to(device, non_blocking=True) if v is not None else None) for k, v in batch.items()}
    if "cu_seqlens" in batch and batch["cu_seqlens"] is None and torch.device(device).type == "cuda":
        B, T = batch["input_ids"].shape
        batch["cu_seqlens"] = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=device)
    return batch


def _diverged(stage: StageContext, step: int, what: str):
    """The one-line stop of a run whose training went non-finite; the checkpoint on disk is
    the last good one, as nothing non-finite is ever saved."""
    key = f"stage{stage.number}.lr"
    return GlaswapError(f"stage {stage.number} step {step}: {what} is not finite; training stopped and the last "
                        f"good checkpoint stays in {stage.run.folder}; lower {key} (now {stage.cfg.lr:g}) and "
                        f"start again with --force")


def _weights_finite(stage: StageContext) -> bool:
    """Whether every trained parameter is finite, over all processes (FSDP holds shards)."""
    params = [p for group in stage.optimizer.param_groups for p in group["params"]]
    local = [(p.to_local() if hasattr(p, "to_local") else p).detach() for p in params]
    bad = sum((~torch.isfinite(t)).any().float() for t in local if t.numel())
    bad = torch.as_tensor(bad, dtype=torch.float32).reshape(1)
    return stage.run.dist.sum(bad).item() == 0


def _checkpoint(stage: StageContext, done: int):
    run = stage.run
    if not _weights_finite(stage):
        raise _diverged(stage, done, "a trained weight")
    save_checkpoint(run.folder, stage.number, done, stage.model, run.trainable, stage.optimizer, stage.scheduler,
                    run.dist, run.belongs)


def run_stage(stage: StageContext):
    """Train `stage` from its start step to cfg.steps, checkpointing as the recipe says."""
    cfg, run = stage.cfg, stage.run
    dist, train = run.dist, run.recipe.train
    if cfg.steps == 0 or stage.start_step >= cfg.steps:
        return
    params = [p for group in stage.optimizer.param_groups for p in group["params"]]
    tokens_per_step = cfg.batch_size * cfg.grad_accum * dist.world * stage.blocks.seq_len
    bar = tqdm(total=cfg.steps, initial=stage.start_step, desc=f"stage {stage.number}", unit="step",
               disable=not dist.is_main, dynamic_ncols=True)
    step = stage.start_step
    try:
        for step in range(stage.start_step, cfg.steps):
            t0 = time.time()
            total, terms = 0.0, {}
            for micro in range(cfg.grad_accum):
                idx = D.batch_indices(len(stage.blocks), train.seed + stage.number, step, micro, cfg.grad_accum,
                                      cfg.batch_size, dist.rank, dist.world)
                batch = _to_device(stage.blocks.batch(idx), run.device)
                with _autocast(run.device, run.dtype):
                    out = stage.step_fn(batch)
                loss, parts = out if isinstance(out, tuple) else (out, {})
                loss = loss / cfg.grad_accum
                loss.backward()
                total += loss.detach()
                for name, value in parts.items():
                    terms[name] = terms.get(name, 0.0) + value / cfg.grad_accum
            dist.sync_grads(params)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            loss_value = dist.mean(total)
            # Checked before the update: a non-finite loss or gradient would make every weight NaN.
            if not math.isfinite(loss_value):
                raise _diverged(stage, step + 1, f"the loss ({loss_value})")
            if not math.isfinite(float(grad_norm)):
                raise _diverged(stage, step + 1, f"the gradient norm ({float(grad_norm)})")
            stage.optimizer.step()
            stage.scheduler.step()
            stage.model.zero_grad(set_to_none=True)  # also the grads this stage does not train
            terms = {name: dist.mean(value) for name, value in terms.items()}
            dt = time.time() - t0
            tok_s = tokens_per_step / max(dt, 1e-9)
            bar.set_postfix(loss=f"{loss_value:.4g}", **{k: f"{v:.4g}" for k, v in terms.items()},
                            tok_s=f"{tok_s:,.0f}")
            bar.update(1)
            if (step + 1) % train.log_every == 0 or step + 1 == cfg.steps:
                run.metrics.log(stage=stage.number, step=step + 1, loss=loss_value, **terms,
                                lr=stage.scheduler.get_last_lr()[0], grad_norm=float(grad_norm),
                                tokens_per_s=tok_s, seconds=dt)
            done = step + 1
            every = train.checkpoint_every
            stop = run.stop_after == (stage.number, done)
            if (every and done % every == 0) or done == cfg.steps or stop:
                _checkpoint(stage, done)
            if stop:   # at a stage's last step: before its evaluation, which the resumed run makes
                raise Interrupted(f"stopped after stage {stage.number} step {done}")
    except KeyboardInterrupt:
        # `step` is the step that was running; the last completed one is step.
        _checkpoint(stage, step)
        raise Interrupted(f"interrupted in stage {stage.number} at step {step}")
    finally:
        bar.close()


@torch.no_grad()
def evaluate_blocks(lm, blocks, max_tokens, batch_size, device, dtype, dist) -> dict:
    """Teacher (softmax, adapters off) and student perplexity on evaluation blocks."""
    if blocks is None or len(blocks) == 0 or max_tokens == 0:
        return {}
    n = min(len(blocks), max(1, max_tokens // blocks.seq_len))
    sums = torch.zeros(3, dtype=torch.float64, device=device)   # teacher nll, student nll, tokens
    lm.eval()
    # Every process runs the same number of forwards (sharded layers gather collectively);
    # a process with nothing left scores a repeat of the first batch with weight 0.
    per_round = batch_size * dist.world
    for round_start in range(0, n, per_round):
        start = round_start + dist.rank * batch_size
        weight = 1.0 if start < n else 0.0
        start = start if start < n else 0
        batch = _to_device(blocks.batch(range(start, min(n, start + batch_size))), device)
        ids, cu = batch["input_ids"], batch["cu_seqlens"]
        labels = next_token_labels(ids, cu)
        valid = labels != -100
        with _autocast(device, dtype):
            with adapters_off(lm), lm.attention_mode("softmax"):
                t_logits = lm(input_ids=ids, cu_seqlens=cu, use_cache=False).logits
            s_logits = lm(input_ids=ids, cu_seqlens=cu, use_cache=False).logits
        for i, logits in enumerate((t_logits, s_logits)):
            nll = token_nll(logits.flatten(0, 1)[valid], labels[valid], reduction="sum")
            sums[i] += weight * nll.double()
        sums[2] += weight * valid.sum()
    lm.train()
    sums = dist.sum(sums)
    return teacher_and_student(*sums.tolist())
