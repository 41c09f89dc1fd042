"""`glaswap distill`: attention transfer, then LoRA distillation, resumable.

Layout of a run with output folder OUT:
    OUT.run/            work in progress (removed when the run finishes)
        converted/      the step-0 GLA model (`glaswap convert` output)
        recipe.yaml     the resolved recipe the run started with
        metrics.jsonl   one JSON line per logged step and evaluation
        checkpoints/    the latest checkpoint per stage, written atomically
    OUT/                the distilled model (LoRA merged), written atomically at the end,
        adapter/        the LoRA adapter and the trained gates / feature maps beside it,
        recipe.yaml, metrics.jsonl, loss.png, eval.json
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from glaswap.checkpoint import output_folder, write_model_code
from glaswap.distill import data as D
from glaswap.distill.losses import kd_loss, next_token_labels
from glaswap.distill.parallel import Dist, setup_distributed
from glaswap.distill.recipe import Recipe, dump_recipe
from glaswap.errors import GlaswapError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class Interrupted(Exception):
    """Raised inside the loop after a checkpoint was written on Ctrl-C (or a test's stop)."""


# ----------------------------------------------------------------------------- set-up
def _paths(recipe: Recipe, out) -> tuple[Path, Path]:
    out = Path(out or recipe.output.dir or Path("runs") / recipe.name)
    return out, out.with_name(out.name + ".run")


def _check_folders(out: Path, run: Path, resume: bool, force: bool):
    if resume and force:
        raise GlaswapError("--resume and --force contradict each other; pass one of them")
    if out.exists() and not force:
        if resume:
            raise GlaswapError(f"{out} already holds a finished run; nothing to resume (pass --force to redo it)")
        raise GlaswapError(f"{out} already exists; choose another --out, or pass --force to replace it")
    if resume and not (run / "recipe.yaml").is_file():
        raise GlaswapError(f"nothing to resume in {run}; start the run without --resume")
    if run.exists() and not resume and not force:
        raise GlaswapError(f"an unfinished run is in {run}; pass --resume to continue it or --force to restart")


def _device_dtype(recipe: Recipe, dist: Dist):
    want = recipe.train.device
    if want == "cuda" and not torch.cuda.is_available():
        raise GlaswapError("train.device is cuda but no CUDA GPU is visible; use train.device=cpu")
    cuda = torch.cuda.is_available() if want == "auto" else want == "cuda"
    device = torch.device("cuda", dist.local_rank) if cuda else torch.device("cpu")
    if recipe.train.dtype == "auto":
        dtype = torch.bfloat16 if cuda else torch.float32
    else:
        dtype = DTYPES[recipe.train.dtype]
    return device, dtype


def _all_sources(recipe: Recipe):
    return (list(recipe.data.train) + list(recipe.data.eval)
            + [s for extra in recipe.data.extra_eval for s in extra.sources])


def _check_data_paths(recipe: Recipe):
    """Fail on a missing data file before the (slow) conversion starts."""
    for spec in _all_sources(recipe):
        if spec.path:
            if spec.path.endswith(".npz"):
                if not Path(spec.path).expanduser().is_file():
                    raise GlaswapError(f"data file {spec.path} does not exist; check data paths in the recipe")
            else:
                for f in D._local_files(spec):
                    if f.stat().st_size == 0 or (f.stat().st_size < 1 << 20 and not f.read_bytes().strip()):
                        raise GlaswapError(f"data file {f} is empty; remove it from the recipe or add text")


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


# ----------------------------------------------------------------------------- checkpoints
def save_checkpoint(run: Path, stage: int, step: int, model, optimizer, scheduler, dist: Dist):
    """Write checkpoints/stage{stage} atomically (temp folder, then rename).

    It holds every trainable parameter and the new (gate, feature-map) parameters even when
    they are frozen, so a stage-2 checkpoint alone restores the whole student.
    """
    state = dist.gather_trainable(model, model._glaswap_trainable)  # all ranks take part; rank 0 writes
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


def copy_state(model, state: dict[str, torch.Tensor], source="checkpoint"):
    """Copy named tensors into a model's parameters (in their dtype)."""
    params = dict(model.named_parameters())
    missing = [n for n in state if n not in params]
    if missing:
        raise GlaswapError(f"{source} does not match the model ({missing[0]}); restart with --force")
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value.to(params[name].dtype))


# ----------------------------------------------------------------------------- training
def _schedule(step, warmup, total):
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _optimizer(params, cfg, steps):
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, cfg.warmup_steps, steps))
    return opt, sched


def _autocast(device, dtype):
    if device.type == "cuda" and dtype != torch.float32:
        return torch.autocast("cuda", dtype=dtype)
    return contextlib.nullcontext()


def _to_device(batch, device):
    return {k: (v.to(device, non_blocking=True) if v is not None else None) for k, v in batch.items()}


def _transfer_step(lm, batch):
    """Stage 1: mean over layers of the MSE between GLA and softmax attention outputs."""
    out = lm.model(input_ids=batch["input_ids"], cu_seqlens=batch["cu_seqlens"], use_cache=False)
    return torch.stack(out.transfer_losses).mean()


@contextlib.contextmanager
def adapters_off(model):
    """LoRA layers pass their base layer's output through, as peft's disable_adapter() does,
    but without its side effect of toggling requires_grad: under FSDP2 that toggle lands on
    whichever parameter objects (sharded or gathered) the module holds at that moment."""
    layers = [m for m in model.modules() if hasattr(m, "_disable_adapters")]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, b in zip(layers, before):
            m._disable_adapters = b


def _kd_step(lm, peft_model, batch, cfg):
    """Stage 2: teacher hidden states (adapters off, softmax) then the student's, KL on logits.
    With a cross-entropy weight the two terms also come back apart, for the metrics log."""
    ids, cu = batch["input_ids"], batch["cu_seqlens"]
    with torch.no_grad(), adapters_off(lm), lm.attention_mode("softmax"):
        h_t = lm.model(input_ids=ids, cu_seqlens=cu, use_cache=False).last_hidden_state
    h_s = lm.model(input_ids=ids, cu_seqlens=cu, use_cache=False).last_hidden_state
    labels = next_token_labels(ids, cu)
    parts = {}
    loss = kd_loss(h_s.flatten(0, 1), h_t.flatten(0, 1), lm.lm_head.weight, labels, cfg.ce_weight,
                   cfg.kd_temperature, cfg.loss_chunk_tokens, parts=parts)
    return (loss, parts) if cfg.ce_weight else loss


def _run_stage(stage, cfg, step_fn, model_for_grads, optimizer, blocks, recipe, run, start_step, scheduler,
               dist, metrics, device, dtype, stop_after):
    """The shared loop of both stages: micro-batches, clipping, logging, checkpoints, Ctrl-C.
    step_fn returns the loss, or (loss, {name: detached term}) to log the terms apart too."""
    if cfg.steps == 0 or start_step >= cfg.steps:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    tokens_per_step = cfg.batch_size * cfg.grad_accum * dist.world * blocks.seq_len
    bar = tqdm(total=cfg.steps, initial=start_step, desc=f"stage {stage}", unit="step",
               disable=not dist.is_main, dynamic_ncols=True)
    step = start_step
    try:
        for step in range(start_step, cfg.steps):
            t0 = time.time()
            total, terms = 0.0, {}
            for micro in range(cfg.grad_accum):
                idx = D.batch_indices(len(blocks), recipe.train.seed + stage, step, micro, cfg.grad_accum,
                                      cfg.batch_size, dist.rank, dist.world)
                batch = _to_device(blocks.batch(idx), device)
                with _autocast(device, dtype):
                    out = step_fn(batch)
                loss, parts = out if isinstance(out, tuple) else (out, {})
                loss = loss / cfg.grad_accum
                loss.backward()
                total += loss.detach()
                for name, value in parts.items():
                    terms[name] = terms.get(name, 0.0) + value / cfg.grad_accum
            dist.sync_grads(params)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            model_for_grads.zero_grad(set_to_none=True)  # also the grads this stage does not train
            loss_value = dist.mean(total)
            terms = {name: dist.mean(value) for name, value in terms.items()}
            dt = time.time() - t0
            tok_s = tokens_per_step / max(dt, 1e-9)
            bar.set_postfix(loss=f"{loss_value:.4g}", **{k: f"{v:.4g}" for k, v in terms.items()},
                            tok_s=f"{tok_s:,.0f}")
            bar.update(1)
            if (step + 1) % recipe.train.log_every == 0 or step + 1 == cfg.steps:
                metrics.log(stage=stage, step=step + 1, loss=loss_value, **terms, lr=scheduler.get_last_lr()[0],
                            grad_norm=float(grad_norm), tokens_per_s=tok_s, seconds=dt)
            done = step + 1
            every = recipe.train.checkpoint_every
            if (every and done % every == 0) or done == cfg.steps:
                save_checkpoint(run, stage, done, model_for_grads, optimizer, scheduler, dist)
            if stop_after is not None and (stage, done) >= stop_after and done < cfg.steps:
                save_checkpoint(run, stage, done, model_for_grads, optimizer, scheduler, dist)
                raise Interrupted(f"stopped after stage {stage} step {done}")
    except KeyboardInterrupt:
        # `step` is the step that was running; the last completed one is step.
        save_checkpoint(run, stage, step, model_for_grads, optimizer, scheduler, dist)
        raise Interrupted(f"interrupted in stage {stage} at step {step}")
    finally:
        bar.close()


# ----------------------------------------------------------------------------- evaluation
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
        off = adapters_off(lm)
        with _autocast(device, dtype):
            with off, lm.attention_mode("softmax"):
                t_logits = lm(input_ids=ids, cu_seqlens=cu, use_cache=False).logits
            s_logits = lm(input_ids=ids, cu_seqlens=cu, use_cache=False).logits
        for i, logits in enumerate((t_logits, s_logits)):
            nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float()[valid], labels[valid],
                                                    reduction="sum")
            sums[i] += weight * nll.double()
        sums[2] += weight * valid.sum()
    lm.train()
    sums = dist.sum(sums)
    t, s, count = sums.tolist()
    return {"tokens": int(count), "teacher_ppl": math.exp(t / count), "student_ppl": math.exp(min(s / count, 700))}


# ----------------------------------------------------------------------------- output
def _plot_losses(records, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, stage, title in ((axes[0], 1, "stage 1: attention transfer (MSE)"),
                             (axes[1], 2, "stage 2: LoRA distillation (KL)")):
        rows = [r for r in records if r.get("stage") == stage and "loss" in r]
        if rows:
            steps = [r["step"] for r in rows]
            ax.plot(steps, [r["loss"] for r in rows], lw=1.2, label="loss")
            # with a cross-entropy weight, stage 2's two terms apart (the loss is kl + w * ce)
            terms = [name for name in ("kl", "ce") if all(name in r for r in rows)]
            for name in terms:
                ax.plot(steps, [r[name] for r in rows], lw=0.9, alpha=0.8, label=name)
            if terms:
                ax.legend()
                title = title.replace("(KL)", "(KL + weighted CE)")
            ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _save_final(out, force, trained, tokenizer, recipe, run, meta, out_dtype, log):
    """Rebuild the student on the CPU from the converted model and the trained tensors, merge
    LoRA in float32, and write OUT (and OUT/adapter) atomically."""
    lm, peft_model, new_names, _ = build_student(run / "converted", recipe, torch.float32)
    copy_state(lm, trained)
    with output_folder(out, force=force) as tmp:
        if peft_model is not None and recipe.output.save_adapter:
            adapter = tmp / "adapter"
            peft_model.save_pretrained(str(adapter))
            save_file({n: trained[n] for n in sorted(new_names)}, str(adapter / "glaswap_new_parameters.safetensors"))
            (adapter / "README.md").write_text(
                "LoRA adapter of a glaswap distillation (peft), for the converted model of the same run;\n"
                "`glaswap_new_parameters.safetensors` holds the trained gates and feature maps, which the\n"
                "adapter alone does not carry. The folder above has both merged into the weights.\n")
        if peft_model is not None:
            lm = peft_model.merge_and_unload()
        lm = lm.to(dtype=out_dtype)
        lm.save_pretrained(str(tmp), safe_serialization=True)
        write_model_code(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        shutil.copyfile(run / "recipe.yaml", tmp / "recipe.yaml")
        if (run / "metrics.jsonl").is_file():
            shutil.copyfile(run / "metrics.jsonl", tmp / "metrics.jsonl")
        _plot_losses(Metrics(run / "metrics.jsonl", True).read(), tmp / "loss.png")
        (tmp / "glaswap.json").write_text(json.dumps(meta, indent=2) + "\n")
        (tmp / "eval.json").write_text(json.dumps(meta.get("eval", {}), indent=2) + "\n")


# ----------------------------------------------------------------------------- entry point
def distill(recipe: Recipe, out=None, resume: bool = False, force: bool = False, log=print,
            stop_after: tuple[int, int] | None = None) -> dict:
    """Run a recipe; returns the figures written to OUT/glaswap.json.

    `stop_after=(stage, step)` stops like Ctrl-C after that step (checkpoint written); the
    resume test uses it. Under torchrun this closes the process group it started; a script
    of your own should then end with `os._exit(0)` as `glaswap distill` does (see
    `_end_torchrun_worker` in glaswap/cli.py for the gloo shutdown race it avoids).
    """
    dist = setup_distributed(recipe.train.distributed)
    ok = False
    try:
        meta = _distill(recipe, out, resume, force, log, stop_after, dist)
        ok = True
        return meta
    finally:
        dist.close(ok)


def _distill(recipe: Recipe, out, resume: bool, force: bool, log, stop_after, dist: Dist) -> dict:
    from glaswap.convert import convert

    out, run = _paths(recipe, out)
    _check_folders(out, run, resume, force)   # every rank: they all see the same folders
    fresh = force or not run.exists()         # this call creates the run folder
    _check_data_paths(recipe)
    dist.barrier()
    device, dtype = _device_dtype(recipe, dist)
    if recipe.train.threads and device.type == "cpu":
        torch.set_num_threads(recipe.train.threads)
    log = log if dist.is_main else (lambda *a, **k: None)

    def prepare_run_folder():
        """The run folder: resolved recipe, and the converted (step-0) model."""
        if force:
            shutil.rmtree(run, ignore_errors=True)
        run.mkdir(parents=True, exist_ok=True)
        resolved = dump_recipe(recipe)
        if resume and (run / "recipe.yaml").read_text() != resolved:
            raise GlaswapError(f"the recipe differs from the one {run} started with; resume with the same "
                               f"recipe and overrides, or pass --force to restart")
        (run / "recipe.yaml").write_text(resolved)
        if not (run / "converted" / "glaswap.json").is_file():
            shutil.rmtree(run / "converted", ignore_errors=True)
            convert(recipe.model.source, run / "converted", options=recipe.model.options,
                    seed=recipe.model.seed, log=log)

    dist.main_only(prepare_run_folder)
    converted = run / "converted"
    step0 = json.loads((converted / "glaswap.json").read_text()).get("step0", {})

    try:
        tokenizer, data = _load_data(converted, recipe, log)
    except GlaswapError:
        # Refused before any training (empty data, a set shorter than one block, no tokenizer):
        # a run folder this call created holds only the conversion, so it goes, and the same
        # command works again once the recipe is fixed (no --force needed). Under torchrun
        # the other ranks may still be reading it: the folder stays there.
        if fresh and dist.world == 1:
            shutil.rmtree(run, ignore_errors=True)
        raise
    train_tokens, heldout, eval_tokens = data["train"], data["heldout"], data["eval"]
    blocks, eval_blocks, extra_blocks = data["blocks"], data["eval_blocks"], data["extra_blocks"]

    torch.manual_seed(recipe.train.seed)
    # FSDP shards need one dtype per layer: keep float32 there and gather in the compute dtype.
    lm, peft_model, new_names, lora_names = build_student(converted, recipe,
                                                          torch.float32 if dist.mode == "fsdp" else dtype)
    lm._glaswap_compute_dtype = dtype
    lm._glaswap_trainable = new_names | lora_names   # what checkpoints and the final save carry
    if device.type == "cuda" and dtype != torch.float32:  # every step runs under autocast
        lora_inputs_in_compute_dtype(lm)
    lm.train()
    dist.wrap(lm, device)  # once: the module structure is fixed from here on

    metrics = Metrics(run / "metrics.jsonl", dist.is_main)
    ckpt = latest_checkpoint(run) if resume else None
    start_stage, start_step = (ckpt[0], ckpt[1]) if ckpt else (1, 0)
    if ckpt:
        metrics.truncate_after(start_stage, start_step)
        dist.load_trainable(lm, ckpt[2])
        log(f"resuming stage {start_stage} after step {start_step}")
    elif dist.is_main:
        metrics.path.unlink(missing_ok=True)
        metrics.log(stage=0, step=0, event="step0", **step0)
    evals = {"step0": step0}

    def evaluate_after(stage, steps):
        """Teacher and student perplexity on the evaluation text (and on each extra set,
        under "extra"), logged and printed."""
        bs = max(recipe.stage1.batch_size, recipe.stage2.batch_size)
        result = evaluate_blocks(lm, eval_blocks, recipe.data.eval_tokens, bs, device, dtype, dist)
        if result:
            metrics.log(stage=stage, step=steps, event="eval", **result)
            log(f"after stage {stage}: teacher ppl {result['teacher_ppl']:.2f}, "
                f"student ppl {result['student_ppl']:.2f}")
        for name, extra in extra_blocks.items():
            res = evaluate_blocks(lm, extra, recipe.data.eval_tokens, bs, device, dtype, dist)
            if not res:                                 # data.eval_tokens = 0: no evaluation
                continue
            result.setdefault("extra", {})[name] = res
            metrics.log(stage=stage, step=steps, event="eval", set=name, **res)
            log(f"after stage {stage} [{name}]: teacher ppl {res['teacher_ppl']:.2f}, "
                f"student ppl {res['student_ppl']:.2f}")
        evals[f"stage{stage}"] = result
    params = dict(lm.named_parameters())

    # ---- stage 1: attention transfer (gates and feature maps only)
    s1 = recipe.stage1
    if start_stage == 1 and s1.steps > 0:
        for layer in lm.model.layers:
            layer.self_attn.transfer = True
        opt, sched = _optimizer([params[n] for n in sorted(new_names)], s1, s1.steps)
        if ckpt:
            _restore_optimizer(ckpt[2], opt, sched, dist, lm)
        with lm.attention_mode("softmax"):
            _run_stage(1, s1, lambda b: _transfer_step(lm, b), lm, opt, blocks, recipe, run, start_step, sched,
                       dist, metrics, device, dtype, stop_after)
        for layer in lm.model.layers:
            layer.self_attn.transfer = False
        if recipe.train.eval_after_stage1:
            evaluate_after(1, s1.steps)
    elif start_stage == 2:  # stage 1 ran before the interruption: its evaluation is in the log
        logged = [r for r in metrics.read() if r.get("event") == "eval" and r["stage"] == 1]
        drop = ("stage", "step", "event", "set")
        evals["stage1"] = next(({k: v for k, v in r.items() if k not in drop}
                                for r in logged if "set" not in r), {})
        for r in logged:
            if "set" in r:
                evals["stage1"].setdefault("extra", {})[r["set"]] = {k: v for k, v in r.items()
                                                                     if k not in drop}

    # ---- stage 2: LoRA distillation (LoRA, and the new parameters unless told otherwise)
    s2 = recipe.stage2
    if peft_model is not None:
        names = sorted(lora_names | (new_names if s2.train_new_params else set()))
        opt, sched = _optimizer([params[n] for n in names], s2, s2.steps)
        s2_start = 0
        if ckpt and ckpt[0] == 2:
            _restore_optimizer(ckpt[2], opt, sched, dist, lm)
            s2_start = start_step
        _run_stage(2, s2, lambda b: _kd_step(lm, peft_model, b, s2), lm, opt, blocks, recipe, run, s2_start,
                   sched, dist, metrics, device, dtype, stop_after)
        evaluate_after(2, s2.steps)

    # ---- output
    meta = json.loads((converted / "glaswap.json").read_text())
    meta["converted"] = str(converted)
    meta["distill"] = {"recipe": recipe.name, "stage1_steps": s1.steps, "stage2_steps": s2.steps,
                       "train_tokens": train_tokens.n_tokens, "heldout_tokens": heldout.n_tokens,
                       "eval_tokens": eval_tokens.n_tokens, "device": str(device), "dtype": str(dtype),
                       "world_size": dist.world}
    meta["eval"] = evals
    out_dtype = _output_dtype(recipe, converted)
    trained = dist.gather_trainable(lm, lm._glaswap_trainable)   # collective; full tensors on every rank

    def save():
        _save_final(out, force, trained, tokenizer, recipe, run, meta, out_dtype, log)
        shutil.rmtree(run, ignore_errors=True)
        log(f"wrote {out}")

    dist.main_only(save)
    return meta


def build_student(converted: Path, recipe: Recipe, dtype, device="cpu"):
    """The converted model with LoRA attached from the start (its B matrices are zero, so it
    changes nothing until stage 2 trains it): the module structure never changes during a
    run, which lets FSDP shard it once. Returns (model, peft model or None, names of the
    new parameters, names of the LoRA parameters); all of them require grad, each stage's
    optimizer takes the ones it trains."""
    from glaswap.models.modeling_glaswap import GLASwapForCausalLM

    lm = GLASwapForCausalLM.from_pretrained(str(converted), dtype=dtype)
    if recipe.train.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    new_names = set(lm.new_parameter_names())
    peft_model = None
    s2 = recipe.stage2
    if s2.steps > 0:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=s2.lora_rank, lora_alpha=s2.lora_alpha, lora_dropout=s2.lora_dropout,
                          target_modules=list(s2.lora_targets), bias="none")
        try:
            peft_model = get_peft_model(lm, lora)
        except ValueError as e:
            raise GlaswapError(f"stage2.lora_targets: {str(e).splitlines()[0]}")
    lora_names = set()
    for name, p in lm.named_parameters():
        if name in new_names:
            p.data = p.data.float()  # optimizer updates in float32 even when the model is bf16
        is_lora = ".lora_" in name
        if is_lora:
            lora_names.add(name)
        p.requires_grad_(name in new_names or is_lora)
    return lm, peft_model, new_names, lora_names


def lora_inputs_in_compute_dtype(model):
    """Stop peft from casting each LoRA layer's input to its adapter's dtype.

    peft keeps adapters in float32 when the base model is bf16 and casts the input to float32
    before them; autocast then casts it straight back to bf16 for the matmul. That is 13
    activation-sized copies per decoder layer and step, forward and backward (counted with
    the profiler on a tiny model), ~2.6 GB of traffic per layer for a 1B model at 16K tokens.
    Only for steps that run under autocast: there the result is the same, bit for bit (a
    bf16 -> float32 -> bf16 round trip is exact). Returns the number of layers changed."""
    n = 0
    for module in model.modules():
        if hasattr(module, "cast_input_dtype_enabled") and hasattr(module, "lora_A"):
            module.cast_input_dtype_enabled = False
            n += 1
    return n


def _load_data(converted: Path, recipe: Recipe, log):
    """Tokenizer and every data set of the recipe, packed into blocks; GlaswapError (one line)
    when one is empty or shorter than one block."""
    tokenizer = _load_tokenizer(converted, recipe)
    vocab = json.loads((converted / "config.json").read_text())["vocab_size"]
    train_tokens = D.load_sources(recipe.data.train, tokenizer, log, vocab)
    if train_tokens.n_tokens == 0:
        raise GlaswapError("data.train holds no text (0 tokens); check the sources in the recipe")
    train_tokens, heldout = D.split_heldout(train_tokens, recipe.data.heldout_fraction)
    eval_tokens = D.load_sources(recipe.data.eval, tokenizer, log, vocab) if recipe.data.eval else heldout
    blocks = D.PackedBlocks(train_tokens, recipe.data.seq_len)
    eval_blocks = D.PackedBlocks(eval_tokens, recipe.data.seq_len) if eval_tokens.n_tokens else None
    if len(blocks) == 0:
        raise GlaswapError(f"data.train has {train_tokens.n_tokens} tokens, fewer than one block of "
                           f"data.seq_len={recipe.data.seq_len}; add text or lower seq_len")
    log(f"data: {train_tokens.n_tokens:,} training tokens ({len(blocks):,} blocks of {recipe.data.seq_len}), "
        f"{heldout.n_tokens:,} held out, {eval_tokens.n_tokens:,} for evaluation")
    extra_blocks = {}
    for extra in recipe.data.extra_eval:
        toks = D.load_sources(extra.sources, tokenizer, log, vocab)
        extra_blocks[extra.name] = D.PackedBlocks(toks, recipe.data.seq_len)
        if len(extra_blocks[extra.name]) == 0:
            raise GlaswapError(f"data.extra_eval {extra.name!r} has {toks.n_tokens} tokens, fewer than one "
                               f"block of data.seq_len={recipe.data.seq_len}; add text or lower seq_len")
        log(f"data: {toks.n_tokens:,} tokens for evaluation set {extra.name!r}")
    return tokenizer, dict(train=train_tokens, heldout=heldout, eval=eval_tokens, blocks=blocks,
                           eval_blocks=eval_blocks, extra_blocks=extra_blocks)


def _load_tokenizer(converted: Path, recipe: Recipe):
    """The model's tokenizer; None is fine when every source is pre-tokenised (.npz)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(converted), trust_remote_code=True)
    except Exception:
        if all(s.path and s.path.endswith(".npz") for s in _all_sources(recipe)):
            return None
        raise GlaswapError(f"{recipe.model.source} has no tokenizer; give pre-tokenised .npz data "
                           f"or a model folder with tokenizer files")


def _restore_optimizer(folder, opt, sched, dist, lm):
    state = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=False)
    dist.load_optimizer_state(lm, opt, state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])


def _output_dtype(recipe: Recipe, converted: Path):
    if recipe.output.dtype != "auto":
        return DTYPES[recipe.output.dtype]
    meta = json.loads((converted / "glaswap.json").read_text())
    return DTYPES.get(meta.get("dtype"), torch.float32)
