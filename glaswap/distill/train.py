"""`glaswap distill`: attention transfer, then LoRA distillation, resumable.

Layout of a run with output folder OUT:
    OUT.run.lock        held (flock) by the one process that runs in OUT.run
    OUT.run/            work in progress (removed when the run finishes)
        glaswap-run.json  marks the folder as a glaswap run folder (--force replaces only such)
        converted/      the step-0 GLA model (`glaswap convert` output)
        recipe.yaml     the resolved recipe the run started with
        metrics.jsonl   one JSON line per logged step and evaluation
        checkpoints/    the latest checkpoint per stage, written atomically
        ranking.json    with softmax_layers auto:N, the layers' ranking after stage 1 and the
        ranking.png     N chosen (select.py); a resumed run keeps that choice
    OUT/                the distilled model (LoRA merged), written atomically at the end,
        adapter/        the peft adapter: LoRA, and the trained gates / feature maps as
                        modules_to_save (adapter.py); its base rebuilds as OUT.base
        recipe.yaml, metrics.jsonl, loss.png, eval.json (and ranking.json, ranking.png;
                        recipe.yaml then lists the chosen layers)

This file is the run from start to end; one stage's loop is in loop.py, the student's
set-up in student.py, the run folder's checkpoints and metrics in checkpoints.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

import torch

from glaswap.checkpoint import check_out_path, exclusive_lock, output_folder, write_model_code
from glaswap.distill import data as D
from glaswap.distill.adapter import adapter_model, base_record, save_adapter
from glaswap.distill.checkpoints import (START_OVER, Metrics, check_checkpoint, checkpoint_softmax_layers,
                                         copy_state, damaged, latest_checkpoint, model_fingerprint, read_json_file,
                                         restore_optimizer)
from glaswap.distill.losses import kd_step, transfer_step
from glaswap.distill.loop import RunState, StageContext, evaluate_blocks, make_optimizer, run_stage
from glaswap.distill.parallel import Dist, setup_distributed
from glaswap.distill.recipe import (Recipe, auto_softmax_layers, conversion_options, dump_recipe, recipe_file,
                                    training_hash)
from glaswap.distill.select import RANKING_JSON, RANKING_PNG, choose_softmax_layers, read_ranking, selection_blocks
from glaswap.distill.student import (build_student, device_dtype, fuse_layers, keep_softmax_layers,
                                     lora_inputs_in_compute_dtype)
from glaswap.errors import GlaswapError
from glaswap.models.gla_options import GLA_OPTIONS, decay_bound
from glaswap.runtime import DTYPES, atomic_write, check_finite_weights, write_error

RUN_MARKER = "glaswap-run.json"


def distill(recipe: Recipe, out=None, resume: bool = False, force: bool = False, log=print,
            stop_after: tuple[int, int] | None = None, trust_remote_code: bool = False) -> dict:
    """Run a recipe; returns the figures written to OUT/glaswap.json.

    `stop_after=(stage, step)` stops like Ctrl-C right after that step (checkpoint written;
    at a stage's last step, before its evaluation); STEP runs from 1 to the stage's steps, and
    a resumed run stops only at a step after its checkpoint. The resume tests use it.
    `trust_remote_code` lets the tokenizer run Python code its folder ships. Under torchrun this closes the process group it started; a script of your own
    should then end with `os._exit(0)` as `glaswap distill` does (see `_end_torchrun_worker`
    in glaswap/cli.py for the gloo shutdown race it avoids).
    """
    out, folder = _paths(recipe, out)
    _check_stop_after(recipe, stop_after)
    dist = setup_distributed(recipe.train.distributed)
    ok = False
    try:
        with contextlib.ExitStack() as held:
            meta = _distill(recipe, out, folder, resume, force, log, stop_after, dist, trust_remote_code, held)
        ok = True
        return meta
    except Exception as e:
        err = write_error(e, folder)
        if err is not None:
            raise err from e
        raise
    finally:
        dist.close(ok)


def _distill(recipe: Recipe, out: Path, folder: Path, resume: bool, force: bool, log, stop_after, dist: Dist,
             trust_remote_code: bool, held: contextlib.ExitStack) -> dict:
    started = time.time()
    inputs = [("model.source", recipe.model.source), ("recipe", recipe_file(recipe))]
    inputs += [("data path", p) for p in D.local_paths(recipe)]
    check_out_path(out, inputs)
    check_out_path(folder, inputs)
    lock = folder.with_name(folder.name + ".lock")
    dist.main_only(lambda: held.enter_context(exclusive_lock(
        lock, f"another glaswap distill is running in {folder} (it holds {lock}); wait for it to end or stop it")))
    _check_folders(out, folder, resume, force)   # every rank: they all see the same folders
    fresh = force or not folder.exists()         # this call creates the run folder
    D.check_paths(recipe)
    D.check_cache(recipe)
    dist.barrier()
    device, dtype = device_dtype(recipe, dist)
    if recipe.train.threads and device.type == "cpu":
        torch.set_num_threads(recipe.train.threads)
    log = log if dist.is_main else (lambda *a, **k: None)

    try:
        dist.main_only(lambda: _prepare_run_folder(folder, out, recipe, resume, force, trust_remote_code, log))
        converted = folder / "converted"
        step0 = read_json_file(converted / "glaswap.json").get("step0", {})
        # what each checkpoint records and a resumed run checks: the training settings, and
        # the weights it trains on (another model of the same shape fits the tensors too)
        belongs = {"recipe": training_hash(recipe, dist.world), "model": model_fingerprint(converted)}
        data = D.load_run_data(converted, recipe, log, trust_remote_code)
        torch.manual_seed(recipe.train.seed)
        student = build_student(converted, recipe, dist.storage_dtype(dtype))
        auto = _check_auto(recipe, student.lm.config.num_hidden_layers)
        ranked_on = selection_blocks(recipe, data) if auto is not None else None
    except (GlaswapError, OSError):
        # Refused before any training (a bad source, empty data, a set shorter than one block,
        # no tokenizer, unknown LoRA targets, a full disk): a run folder this call created holds
        # at most the conversion, so it goes, and the same command works again once the cause
        # is fixed (no --force needed). Under torchrun the other ranks may still be reading it:
        # the folder stays there.
        if fresh and dist.world == 1:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    lm = student.lm
    if device.type == "cuda" and dtype != torch.float32:  # every step runs under autocast
        lora_inputs_in_compute_dtype(lm)
    if device.type == "cuda":
        fuse_layers(lm)
    lm.train()
    dist.wrap(lm, device, dtype)  # once: the module structure is fixed from here on

    run = RunState(folder=folder, recipe=recipe, dist=dist, device=device, dtype=dtype,
                   metrics=Metrics(folder / "metrics.jsonl", dist.is_main), trainable=student.trainable,
                   stop_after=stop_after, belongs=belongs)
    ckpt = latest_checkpoint(folder) if resume else None
    if ckpt:
        _check_resume(ckpt, recipe, belongs, run.metrics, stop_after)
    start_stage, start_step = (ckpt[0], ckpt[1]) if ckpt else (1, 0)
    # a resumed run keeps the softmax layers its first run chose (after stage 1, on the state
    # of that moment), never measuring again
    ranking = read_ranking(folder) if resume and auto is not None else None
    if ckpt:
        run.metrics.truncate_after(start_stage, start_step)
        if auto is not None and start_stage == 2:
            # a stage-2 checkpoint holds no gates or feature maps of the softmax layers
            chosen = checkpoint_softmax_layers(ckpt[2])
            if ranking is None or ranking["chosen"] != chosen:
                raise GlaswapError(f"{folder / RANKING_JSON} is missing or names other softmax layers than the "
                                   f"checkpoint in {ckpt[2]}; restart the run with --force")
            keep_softmax_layers(student, chosen)
            run.trainable = student.trainable
        dist.load_trainable(lm, ckpt[2])
        log(f"resuming stage {start_stage} after step {start_step}")
    elif dist.is_main:
        run.metrics.path.unlink(missing_ok=True)
        run.metrics.log(stage=0, step=0, event="step0", **step0)
    evals = {"step0": step0}
    params = dict(lm.named_parameters())

    # ---- stage 1: attention transfer (gates and feature maps only)
    s1 = recipe.stage1
    if start_stage == 1 and s1.steps > 0:
        opt, sched = make_optimizer([params[n] for n in sorted(student.new_names)], s1, s1.steps)
        if ckpt:
            restore_optimizer(ckpt[2], opt, sched, dist, lm)
        stage = StageContext(number=1, cfg=s1, step_fn=lambda b: transfer_step(lm, b), model=lm, optimizer=opt,
                             scheduler=sched, blocks=data.blocks, start_step=start_step, run=run)
        with lm.attention_mode("transfer"):
            run_stage(stage)
        if recipe.train.eval_after_stage1:
            evals["stage1"] = _evaluate(run, lm, data, 1, s1.steps, log)
    elif start_stage == 2:  # stage 1 ran before the interruption: its evaluation is in the log
        evals["stage1"] = _logged_evaluation(run.metrics, 1)

    # ---- softmax_layers auto:N: rank the layers on the stage-1 student, keep the top N
    selection = None
    if auto is not None:
        measured_now = ranking is None
        ranking = choose_softmax_layers(run, lm, ranked_on, auto, ranking, started, log)
        if list(getattr(lm.config, "softmax_layers", None) or []) != ranking["chosen"]:
            keep_softmax_layers(student, ranking["chosen"])
            run.trainable = student.trainable
        selection = {"layers": ranking["chosen"], "seconds": ranking["seconds"],
                     "measured_now": measured_now}
        params = dict(lm.named_parameters())

    # ---- stage 2: LoRA distillation (LoRA, and the new parameters unless told otherwise)
    s2 = recipe.stage2
    if student.peft_model is not None:
        names = sorted(student.lora_names | (student.new_names if s2.train_new_params else set()))
        opt, sched = make_optimizer([params[n] for n in names], s2, s2.steps)
        s2_start = 0
        if ckpt and ckpt[0] == 2:
            restore_optimizer(ckpt[2], opt, sched, dist, lm)
            s2_start = start_step
        stage = StageContext(number=2, cfg=s2, step_fn=lambda b: kd_step(lm, b, s2), model=lm, optimizer=opt,
                             scheduler=sched, blocks=data.blocks, start_step=s2_start, run=run)
        run_stage(stage)
        evals["stage2"] = _evaluate(run, lm, data, 2, s2.steps, log)

    # ---- output
    meta = json.loads((converted / "glaswap.json").read_text())
    # the step-0 model lived in the run folder, which goes at the end: what identifies it is
    # its weights' fingerprint (its options and source are the fields beside this one)
    meta["converted"] = {"fingerprint": belongs["model"]}
    meta["distill"] = {"recipe": recipe.name, "stage1_steps": s1.steps, "stage2_steps": s2.steps,
                       "train_tokens": data.train.n_tokens, "heldout_tokens": data.heldout.n_tokens,
                       "eval_tokens": data.eval.n_tokens, "device": str(device), "dtype": str(dtype),
                       "world_size": dist.world,
                       # this process's time: a resumed run's earlier part is not counted
                       "seconds": round(time.time() - started, 1), "resumed": bool(ckpt)}
    meta["eval"] = evals
    if selection is not None:
        meta["options"] = dict(meta["options"], softmax_layers=selection["layers"])
        # the share is of this process's time: a resumed run's earlier part is not counted
        share = selection["seconds"] / max(time.time() - started, 1e-9) if selection["measured_now"] else None
        meta["distill"]["softmax_selection"] = {"layers": selection["layers"], "seconds": selection["seconds"],
                                                "share_of_run": share}
    out_dtype = _output_dtype(recipe, converted)
    trained = dist.gather_trainable(lm, run.trainable)   # collective; full tensors on every rank

    def save():
        _save_final(out, force, trained, data.tokenizer, recipe, folder, meta, out_dtype, log)
        shutil.rmtree(folder, ignore_errors=True)
        for line in summary_lines(meta, out, time.time() - started):
            log(line)

    dist.main_only(save)
    if recipe.output.tasks:
        from glaswap.tasks import evaluate_tasks

        # after OUT is written: a task run that fails costs nothing of the distillation
        dist.main_only(lambda: evaluate_tasks(out, recipe.output.tasks, limit=recipe.output.tasks_limit,
                                              device=recipe.train.device, log=log))
    return meta


# ----------------------------------------------------------------------------- folders
def _paths(recipe: Recipe, out) -> tuple[Path, Path]:
    out = Path(out or recipe.output.dir or Path("runs") / recipe.name).expanduser()
    check_out_path(out)                  # ".", "~", "/" are refused before OUT.run is named
    if out.name in ("", ".", ".."):
        out = Path(os.path.abspath(out))
    return out, out.with_name(out.name + ".run")


def _check_folders(out: Path, run: Path, resume: bool, force: bool):
    if resume and force:
        raise GlaswapError("--resume and --force contradict each other; pass one of them")
    if out.exists() and not force:
        if resume:
            raise GlaswapError(f"{out} already holds a finished run; nothing to resume (pass --force to redo it)")
        raise GlaswapError(f"{out} already exists; choose another --out, or pass --force to replace it")
    if force:
        _check_replaceable(out, ("glaswap.json",), "output")
        _check_replaceable(run, (RUN_MARKER, "converted/glaswap.json"), "run")
    recipe = run / "recipe.yaml"
    if resume and not run.exists():
        raise GlaswapError(f"nothing to resume in {run}; start the run without --resume")
    if resume and not recipe.is_file():
        raise damaged(recipe, "is missing, so the run cannot be resumed")
    if run.exists() and not resume and not force:
        if not recipe.is_file():
            raise GlaswapError(f"an unfinished run is in {run}, but without its recipe.yaml it cannot be "
                               f"resumed; {START_OVER}")
        raise GlaswapError(f"an unfinished run is in {run}; pass --resume to continue it or --force to restart")


def _check_replaceable(folder: Path, marks: tuple[str, ...], kind: str):
    """Refuse to let --force replace anything but a folder glaswap wrote (one holding one of
    `marks`) or an empty folder: whatever else is there is the user's."""
    if not (folder.exists() or folder.is_symlink()):
        return
    fix = "choose another --out, or move it away"
    if folder.is_symlink() or not folder.is_dir():
        raise GlaswapError(f"{folder} is not a folder; --force replaces only a glaswap {kind} folder; {fix}")
    if any((folder / mark).is_file() for mark in marks) or not any(folder.iterdir()):
        return
    raise GlaswapError(f"{folder} is not a glaswap {kind} folder (it has no {marks[0]}), so --force does not "
                       f"replace it; {fix}")


def _check_stop_after(recipe: Recipe, stop_after):
    """--stop-after STAGE:STEP names a step of the recipe: stage 1 or 2, and a step from 1 to
    that stage's steps."""
    if stop_after is None:
        return
    stage, step = stop_after
    given = f"--stop-after {stage}:{step}"
    if stage not in (1, 2):
        raise GlaswapError(f"{given}: there is no stage {stage}; STAGE is 1 (attention transfer) or 2 (LoRA)")
    steps = (recipe.stage1 if stage == 1 else recipe.stage2).steps
    if steps == 0:
        raise GlaswapError(f"{given}: stage {stage} has no steps (stage{stage}.steps: 0); stop in the other stage")
    if not 1 <= step <= steps:
        raise GlaswapError(f"{given}: STEP must be from 1 to {steps}, the steps of stage {stage} "
                           f"(stage{stage}.steps)")


def _check_resume(ckpt, recipe: Recipe, belongs: dict, metrics: Metrics, stop_after):
    """A checkpoint this run can continue from, with its log, and a stop point after it."""
    stage, step, folder = ckpt
    check_checkpoint(folder, (recipe.stage1 if stage == 1 else recipe.stage2).steps, belongs)
    if metrics.enabled:
        if not metrics.path.is_file():
            raise damaged(metrics.path, "is missing (it holds the evaluations made before the checkpoint)")
        metrics.read()
    if stop_after is not None and tuple(stop_after) <= (stage, step):
        raise GlaswapError(f"--stop-after {stop_after[0]}:{stop_after[1]} is not after the checkpoint the run "
                           f"resumes from (stage {stage} step {step}); give a later step or leave it out")


def length_defaults(recipe: Recipe) -> dict:
    """The options distill takes from the training length where the recipe leaves them out:
    RoPE on the GLA path only for the pairs that turn within it (the slow pairs would show the
    feature maps unseen angles past it), and for hybrid layers a decay horizon of that length,
    where the starting decay allows one (the state's sums then stop growing within it, and on
    longer inputs do not outweigh the exact window, sinks and sparse cache)."""
    T = float(recipe.data.seq_len)
    options = recipe.model.options
    defaults = {"rope_max_wavelength": T}
    start = float(options.get("gate_init_decay", GLA_OPTIONS["gate_init_decay"].default))
    if options.get("window") and start < decay_bound(T):
        defaults["decay_horizon"] = T
    return defaults


def _prepare_run_folder(run: Path, out: Path, recipe: Recipe, resume: bool, force: bool, trust_remote_code: bool,
                        log):
    """The run folder: its marker, the resolved recipe, and the converted (step-0) model. Each
    file is written atomically: a full disk leaves the one before or none, never half a file."""
    from glaswap.convert import convert

    if force:
        shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True, exist_ok=True)
    if not (run / RUN_MARKER).is_file():
        atomic_write(run / RUN_MARKER, lambda tmp: tmp.write_text(json.dumps({"output": str(out)}) + "\n"))
    resolved = dump_recipe(recipe)
    if resume:
        try:
            started_with = (run / "recipe.yaml").read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise damaged(run / "recipe.yaml", f"cannot be read ({type(e).__name__})")
        if not started_with.strip():
            raise damaged(run / "recipe.yaml", "is empty")
        if started_with != resolved:
            raise GlaswapError(f"the recipe differs from the one {run} started with; resume with the same "
                               f"recipe and overrides, or pass --force to restart")
    else:
        atomic_write(run / "recipe.yaml", lambda tmp: tmp.write_text(resolved))
    if not (run / "converted" / "glaswap.json").is_file():
        shutil.rmtree(run / "converted", ignore_errors=True)
        options = length_defaults(recipe) | conversion_options(recipe)
        convert(recipe.model.source, run / "converted", options=options,
                seed=recipe.model.seed, trust_remote_code=trust_remote_code, log=log)


def _check_auto(recipe: Recipe, num_layers: int) -> int | None:
    """N of the recipe's softmax_layers auto:N (None without one), once the layer count is known."""
    auto = auto_softmax_layers(recipe.model.options)
    if auto is not None and not 1 <= auto <= num_layers - 1:
        raise GlaswapError(f"recipe key model.options.softmax_layers: auto:{auto} asks for {auto} softmax layers "
                           f"of the model's {num_layers}; choose N from 1 to {num_layers - 1}")
    return auto


# ----------------------------------------------------------------------------- evaluation
def _evaluate(run: RunState, lm, data: D.RunData, stage: int, steps: int, log) -> dict:
    """Teacher and student perplexity on every evaluation set, logged and printed. The main
    set's figures (data.eval, else the held-out part) are the result's own; the held-out
    part, when data.eval is the main set, is under "heldout", each extra set under "extra".
    Every entry names its text."""
    recipe = run.recipe
    bs = max(recipe.stage1.batch_size, recipe.stage2.batch_size)
    result = {}
    for es in data.eval_sets:
        res = evaluate_blocks(lm, es.blocks, recipe.data.eval_tokens, bs, run.device, run.dtype, run.dist)
        if not res:                                 # data.eval_tokens = 0: no evaluation
            continue
        res = {"text": es.text, **res}
        if es.name == data.main_name:
            result.update(res)
            run.metrics.log(stage=stage, step=steps, event="eval", **res)
        else:
            if es.name == D.HELDOUT:
                result["heldout"] = res
            else:
                result.setdefault("extra", {})[es.name] = res
            run.metrics.log(stage=stage, step=steps, event="eval", set=es.name, **res)
        log(f"after stage {stage} [{es.name}]: teacher ppl {res['teacher_ppl']:.2f}, "
            f"student ppl {res['student_ppl']:.2f} ({res['tokens']:,} tokens)")
    return result


def _logged_evaluation(metrics: Metrics, stage: int) -> dict:
    """A stage's evaluation as `_evaluate` returned it, read back from the metrics log."""
    logged = [r for r in metrics.read() if r.get("event") == "eval" and r["stage"] == stage]
    drop = ("stage", "step", "event", "set")
    result = next(({k: v for k, v in r.items() if k not in drop} for r in logged if "set" not in r), {})
    for r in logged:
        figures = {k: v for k, v in r.items() if k not in drop}
        if r.get("set") == D.HELDOUT:
            result["heldout"] = figures
        elif "set" in r:
            result.setdefault("extra", {})[r["set"]] = figures
    return result


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds // 60 % 60} min"


def summary_lines(meta: dict, out: Path, seconds: float) -> list[str]:
    """The lines a run ends with: each text the last evaluation scored (its name, tokens,
    teacher and student perplexity), the `seconds` this process took, and where the model and
    its files are."""
    evals = meta.get("eval", {})
    last = next((name for name in ("stage2", "stage1") if evals.get(name)), None)
    took = _duration(seconds)
    if meta["distill"].get("resumed"):
        took += " (since --resume)"
    lines = []
    if last is None:
        lines.append(f"distilled in {took}; no evaluation text was scored (data.eval_tokens 0 or no text)")
    else:
        ev = evals[last]
        lines.append(f"distilled in {took}; after stage {last[-1]}, perplexity of teacher and student on:")
        sets = ([ev] if "tokens" in ev else []) + ([ev["heldout"]] if "heldout" in ev else [])
        sets += list(ev.get("extra", {}).values())
        for res in sets:
            lines.append(f"  {res.get('text', '?')}, {res['tokens']:,} tokens: teacher {res['teacher_ppl']:.2f}, "
                         f"student {res['student_ppl']:.2f}")
    lines.append(f"model: {out}/ (loads like a converted model)")
    for name, what in (("eval.json", "every evaluation, each naming its text"),
                       ("loss.png", "the losses per step and the evaluations"),
                       ("adapter", "the LoRA adapter")):
        if (out / name).exists():
            lines.append(f"  {out / name}: {what}")
    return lines


# ----------------------------------------------------------------------------- output
def _output_dtype(recipe: Recipe, converted: Path):
    if recipe.output.dtype != "auto":
        return DTYPES[recipe.output.dtype]
    meta = json.loads((converted / "glaswap.json").read_text())
    return DTYPES.get(meta.get("dtype"), torch.float32)


def _save_final(out, force, trained, tokenizer, recipe, run, meta, out_dtype, log):
    """Rebuild the student on the CPU from the converted model and the trained tensors, merge
    LoRA in float32, and write OUT (and OUT/adapter) atomically."""
    student = build_student(run / "converted", recipe, torch.float32)
    softmax = (meta["distill"].get("softmax_selection") or {}).get("layers")
    if softmax:
        keep_softmax_layers(student, softmax)
    lm, peft_model = student.lm, student.peft_model
    if peft_model is None:
        copy_state(lm, trained)
    else:
        peft_model = adapter_model(student, trained)
    check_finite_weights(peft_model if peft_model is not None else lm, "the distilled model")  # never an OUT that cannot run
    with output_folder(out, force=force) as tmp:
        if peft_model is not None and recipe.output.save_adapter:
            converted = json.loads((run / "converted" / "glaswap.json").read_text())
            if softmax:   # the adapter's base keeps the chosen layers softmax, as the model does
                converted["options"] = dict(converted["options"], softmax_layers=softmax)
            base = base_record(recipe.model.source, converted, out)
            save_adapter(peft_model, tmp / "adapter", base)
        if peft_model is not None:
            lm = peft_model.merge_and_unload()
        lm = lm.to(dtype=out_dtype)
        lm.save_pretrained(str(tmp), safe_serialization=True)
        write_model_code(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if softmax:
            _write_chosen_recipe(recipe, softmax, tmp / "recipe.yaml")
            _copy_ranking(run, tmp, meta["distill"]["softmax_selection"])
        else:
            shutil.copyfile(run / "recipe.yaml", tmp / "recipe.yaml")
        if (run / "metrics.jsonl").is_file():
            shutil.copyfile(run / "metrics.jsonl", tmp / "metrics.jsonl")
        _plot_losses(Metrics(run / "metrics.jsonl", True).read(), tmp / "loss.png")
        (tmp / "glaswap.json").write_text(json.dumps(meta, indent=2) + "\n")
        (tmp / "eval.json").write_text(json.dumps(meta.get("eval", {}), indent=2) + "\n")


def _write_chosen_recipe(recipe: Recipe, layers: list[int], path: Path):
    """The resolved recipe with its auto:N replaced by the layers chosen: run again, it
    converts with those layers softmax and distils the rest as this run did."""
    auto = recipe.model.options["softmax_layers"]
    chosen = dataclasses.replace(recipe, model=dataclasses.replace(
        recipe.model, options=dict(recipe.model.options, softmax_layers=list(layers))))
    path.write_text(f"# model.options.softmax_layers: chosen by {auto} after stage 1 (ranking.json)\n"
                    + dump_recipe(chosen))


def _copy_ranking(run: Path, out: Path, selection: dict):
    """ranking.json and ranking.png into OUT, the JSON with the selection's share of the run."""
    ranking = json.loads((run / RANKING_JSON).read_text())
    ranking["share_of_run"] = selection["share_of_run"]
    (out / RANKING_JSON).write_text(json.dumps(ranking, indent=2) + "\n")
    if (run / RANKING_PNG).is_file():
        shutil.copyfile(run / RANKING_PNG, out / RANKING_PNG)


def _plot_losses(records, path: Path):
    """loss.png: each stage's loss per step (left axis) and its evaluations, teacher and student
    perplexity per scored set (right axis, at the step after which they ran). Skipped without
    matplotlib (the `plots` extra): metrics.jsonl has the figures."""
    if importlib.util.find_spec("matplotlib") is None:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    evals = [r for r in records if r.get("event") == "eval" and r.get("stage") in (1, 2)]
    names = list(dict.fromkeys(r.get("set", "") for r in evals))   # "" is the main set
    colours = {name: f"C{3 + i}" for i, name in enumerate(names)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.4))
    for ax, stage, title in ((axes[0], 1, "stage 1: attention transfer (MSE)"),
                             (axes[1], 2, "stage 2: LoRA distillation (KL)")):
        rows = [r for r in records if r.get("stage") == stage and "loss" in r]
        handles = []
        if rows:
            steps = [r["step"] for r in rows]
            handles += ax.plot(steps, [r["loss"] for r in rows], lw=1.2, label="loss")
            # with a cross-entropy weight, stage 2's two terms apart (the loss is kl + w * ce)
            terms = [name for name in ("kl", "ce") if all(name in r for r in rows)]
            for name in terms:
                handles += ax.plot(steps, [r[name] for r in rows], lw=0.9, alpha=0.8, label=name)
            if terms:
                title = title.replace("(KL)", "(KL + weighted CE)")
            values = [r[k] for r in rows for k in ["loss", *terms] if r[k] > 0]
            # a log axis only where the values span a decade or more; plain decimals either way
            if values and max(values) >= 10 * min(values):
                ax.set_yscale("log")
                ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
                ax.yaxis.set_minor_formatter(ticker.NullFormatter())
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _pos: f"{y:.4g}"))
        ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        stage_evals = [r for r in evals if r["stage"] == stage]
        if stage_evals:
            right = ax.twinx()
            for r in stage_evals:
                name = r.get("set", "")
                label = r.get("text", name or "evaluation").split(" (")[0]
                c = colours[name]
                handles += right.plot([r["step"]], [r["teacher_ppl"]], "D", mfc="none", color=c, ms=7,
                                      label=f"teacher ppl, {label}")
                handles += right.plot([r["step"]], [r["student_ppl"]], "o", color=c, ms=6,
                                      label=f"student ppl, {label}")
                right.annotate(f"{r['student_ppl']:.2f} / {r['teacher_ppl']:.2f}", (r["step"], r["student_ppl"]),
                               textcoords="offset points", xytext=(-6, 6), ha="right", fontsize=8, color=c)
            right.margins(x=0.05, y=0.2)
            right.set_ylabel("perplexity after the stage (student / teacher)")
            right.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _pos: f"{y:.4g}"))
        if handles:
            # below the panel, where it covers no curve or marker
            ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
    # what the per-step curves are (run_stage logs the loss of each step's own micro-batches,
    # drawn from the training blocks by step), so a curve that ends above its start is read right
    fig.text(0.5, 0.01, "each step's loss is on that step's own batch, so it moves with the batch; "
             "the markers are evaluations on fixed texts", ha="center", fontsize=8, style="italic")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
