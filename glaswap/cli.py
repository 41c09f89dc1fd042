"""glaswap's command line: thin Click commands over importable functions."""

from __future__ import annotations

import functools
import os
import shlex
import signal
import sys
import threading

import click

import glaswap
from glaswap.errors import GlaswapError
from glaswap.tasks import TASK_BATCH
from glaswap.models.gla_options import GLA_OPTIONS


def _friendly(fn):
    """Turn GlaswapError (and a few common OS errors) into a one-line message and exit 1; a
    SIGTERM (a scheduler's, `timeout`'s) stops like Ctrl-C, so temporary files are removed."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():   # signal handlers live there only
            signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        try:
            return fn(*args, **kwargs)
        except GlaswapError as e:
            raise click.ClickException(str(e))
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
    return wrapper


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def _end_torchrun_worker(code: int):
    """Under torchrun, end the process here, skipping Python's shutdown: at shutdown a gloo
    worker thread can still hold the last reference to a finished collective, whose tensors
    need the GIL to be freed; the finalizing interpreter makes that thread exit, and the
    process dies of SIGABRT ("terminate called without an active exception") after its work
    was written. Everything is saved and the process group closed by now, so only the standard
    streams need flushing. One process: no-op."""
    if os.environ.get("WORLD_SIZE", "1").strip() not in ("", "0", "1"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="glaswap")
def main():
    """Convert pretrained Llama-family models to Gated Linear Attention, distil and evaluate them."""
    if "TOKENIZERS_PARALLELISM" not in os.environ:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        glaswap.tokenizers_parallelism_defaulted = True
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # glaswap shows its own progress; keep the terminal readable
    hf_logging.set_verbosity_error()


_TRUST_HELP = ("Run Python code that a model or tokenizer folder ships (auto_map). Only for folders whose code "
               "you trust; glaswap's own model code never needs it.")


class _LayerList(click.ParamType):
    """Layer indices written as 3,9,15 (or [3, 9, 15]): a list of ints. Text that is not one
    passes on unchanged, so that convert's own check names the problem in one line (click's
    usage error would print the usage as well)."""
    name = "LAYERS"

    def convert(self, value, param, ctx):
        if isinstance(value, str):
            items = value.strip().strip("[]").replace(" ", "")
            parts = items.split(",") if items else []
            if all(p.lstrip("-").isdigit() for p in parts):
                return [int(p) for p in parts]
        return value


def _gla_options(fn):
    """convert's flag for each GLA option that has one, from GLA_OPTIONS: a switch as
    --x/--no-x, choices as click.Choice, numbers as int or float, layer lists as 3,9,15 (their
    ranges are check_gla_options', which convert runs), each passed on under the option's name."""
    for opt in reversed([o for o in GLA_OPTIONS.values() if o.flag]):
        if opt.type is bool:
            fn = click.option("/".join(opt.flags), opt.name, default=opt.default, show_default=True,
                              help=opt.help)(fn)
        elif opt.type is list:
            fn = click.option(opt.flag, opt.name, type=_LayerList(), default=opt.default, show_default="none",
                              help=opt.help)(fn)
        else:
            kind = click.Choice(opt.choices) if opt.choices else opt.type
            fn = click.option(opt.flag, opt.name, type=kind, default=opt.default, show_default=True,
                              help=opt.help)(fn)
    return fn


@main.command(short_help="Convert a Llama-family model (folder, .gguf, hub id) to GLA.")
@click.argument("source")
@click.argument("out", type=click.Path(file_okay=False))
@_gla_options
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]), default="auto",
              show_default=True, help="Weights dtype (auto: the source's; bfloat16 for GGUF).")
@click.option("--max-shard-size", default="2GB", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the new parameters.")
@click.option("--report/--no-report", default=True, show_default=True,
              help="Teacher vs converted perplexity on sample text at the end.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@click.option("--trust-remote-code", is_flag=True, help=_TRUST_HELP)
@_friendly
def convert(source, out, dtype, max_shard_size, seed, report, force, trust_remote_code, **options):
    """Convert SOURCE (a model folder, a .gguf file, a hub id, or smollm2-135m) into a GLA model in OUT."""
    from glaswap.convert import convert as run

    run(source, out, options=options, force=force, dtype=dtype, max_shard_size=max_shard_size, report=report,
        seed=seed, trust_remote_code=trust_remote_code, log=click.echo)


@main.command(context_settings={"ignore_unknown_options": False},
              short_help="Distil a converted model from its teacher, as a recipe says.")
@click.option("--recipe", "recipe_path", required=True, metavar="NAME|FILE",
              help="A shipped recipe's name (`glaswap recipes` lists them) or a recipe YAML file.")
@click.argument("overrides", nargs=-1)
@click.option("--out", type=click.Path(file_okay=False), help="Output folder (default: the recipe's output.dir).")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from its last checkpoint.")
@click.option("--force", is_flag=True, help="Replace an existing output folder and unfinished run.")
@click.option("--stop-after", metavar="STAGE:STEP", default=None,
              help="Stop like Ctrl-C right after that step (checkpoint written), e.g. 1:50; resume later. "
                   "STAGE is 1 or 2, STEP from 1 to that stage's steps (its last: stop before the stage's "
                   "evaluation); anything else is refused.")
@click.option("--trust-remote-code", is_flag=True, help=_TRUST_HELP)
@_friendly
def distill(recipe_path, overrides, out, resume, force, stop_after, trust_remote_code):
    """Distil a converted model from its teacher, as a recipe says.

    OVERRIDES are key.sub=value pairs, e.g. stage2.lr=1e-4 data.seq_len=1024.
    """
    from glaswap.distill import distill as run, load_recipe
    from glaswap.distill.loop import Interrupted

    recipe = load_recipe(recipe_path, overrides)
    stop = None
    if stop_after:
        try:
            stage, step = (int(x) for x in stop_after.split(":"))
            stop = (stage, step)
        except ValueError:   # not two integers
            raise GlaswapError(f"--stop-after {stop_after!r}: write STAGE:STEP, e.g. 1:50")
    try:
        run(recipe, out=out, resume=resume, force=force, log=click.echo, stop_after=stop,
            trust_remote_code=trust_remote_code)
    except Interrupted as e:
        again = ["glaswap", "distill", "--recipe", recipe_path, *overrides, *(["--out", out] if out else []),
                 *(["--trust-remote-code"] if trust_remote_code else []), "--resume"]
        click.echo(f"{e}; checkpoint saved. Continue with: {shlex.join(again)}", err=True)
        _end_torchrun_worker(130)
        sys.exit(130)
    _end_torchrun_worker(0)


@main.group(invoke_without_command=True, short_help="List the shipped recipes; `recipes cp` copies one.")
@click.pass_context
def recipes(ctx):
    """List the shipped distillation recipes, one line each; `recipes cp NAME FILE` copies one to edit."""
    if ctx.invoked_subcommand is not None:
        return
    from glaswap.distill.recipe import recipe_summary, shipped_recipes

    shipped = shipped_recipes()
    width = max(map(len, shipped))
    for name, path in shipped.items():
        click.echo(f"{name:<{width}}  {recipe_summary(path)}")


@recipes.command(name="cp")
@click.argument("name")
@click.argument("file", type=click.Path())
@click.option("--force", is_flag=True, help="Replace FILE if it exists.")
@_friendly
def recipes_cp(name, file, force):
    """Copy the shipped recipe NAME to FILE (a folder gets NAME.yaml), to edit and run with --recipe FILE."""
    from pathlib import Path

    from glaswap.distill.recipe import shipped_recipes
    from glaswap.runtime import atomic_write

    shipped = shipped_recipes()
    name = name[:-len(".yaml")] if name.endswith(".yaml") else name
    if name not in shipped:
        raise GlaswapError(f"no recipe named {name!r}; shipped recipes: {', '.join(shipped)}")
    dest = Path(file)
    if dest.is_dir():
        dest = dest / f"{name}.yaml"
    if dest.is_symlink() and not dest.exists() and not force:   # exists() follows the link
        raise GlaswapError(f"{dest} is a symbolic link (to a file that does not exist); choose another FILE, "
                           f"or pass --force to replace the link")
    if dest.exists() and not force:
        raise GlaswapError(f"{dest} already exists; choose another FILE, or pass --force to replace it")
    if dest.is_dir():
        raise GlaswapError(f"{dest} is a folder; choose another FILE")
    text = shipped[name].read_text()
    # the header's first line is the command that runs the recipe: make it run this copy
    first, _, rest = text.partition("\n")
    text = first.replace(f"--recipe {name}", f"--recipe {dest}", 1) + "\n" + rest
    try:
        atomic_write(dest, lambda tmp: tmp.write_text(text))
    except OSError as e:
        raise GlaswapError(f"cannot write {dest} ({e.strerror or type(e).__name__}); choose a FILE in a folder "
                           f"you can write")
    click.echo(f"wrote {dest}; run it with: glaswap distill --recipe {dest}")


def _scoring_options(fn):
    """--device, --dtype and --trust-remote-code, as eval and passkey take them."""
    fn = click.option("--trust-remote-code", is_flag=True, help=_TRUST_HELP)(fn)
    fn = click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
                      show_default=True, help="auto: bfloat16 on CUDA, float32 on CPU.")(fn)
    return click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda.")(fn)


_SPARSE_HELP = ("Keep this many older tokens of each of a hybrid MODEL's layers out of the state, attended "
                "exactly: those the state recalls worst (default: as saved; 0: none).")


@main.command(name="eval", short_help="MODEL beside its teacher: perplexity on text, or tasks.")
@click.argument("model", type=click.Path())
@click.argument("more_texts", nargs=-1, metavar="")
@click.option("--text", "texts", multiple=True, metavar="FILE [FILE ...]",
              help="UTF-8 text files to score (several may follow --text).")
@click.option("--teacher", default="auto", show_default=True,
              help="auto: the source model recorded in MODEL/glaswap.json; self: MODEL's own softmax attention "
                   "(the teacher before distillation, no second model); or a Hugging Face folder / .gguf file.")
@click.option("--context", type=click.IntRange(2), default=512, show_default=True, help="Window length (tokens).")
@click.option("--stride", type=click.IntRange(1), default=None,
              help="Window step (default: the context). Below the context, the first context-stride tokens "
                   "of each window are context only.")
@click.option("--max-tokens", type=click.IntRange(2), default=None, help="Use at most N tokens of each file.")
@click.option("--batch-size", type=click.IntRange(1), default=None,
              help="Windows per forward pass (default 1); with --tasks, requests per forward pass (default "
                   f"{TASK_BATCH['cuda']} on CUDA, {TASK_BATCH['cpu']} on the CPU).")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Folder for the JSON and PNG (default: MODEL/eval).")
@_scoring_options
@click.option("--bos", is_flag=True,
              help="Put BOS (EOS if none) first and score every token, as lm-eval's loglikelihood_rolling "
                   "does with max_length = the context.")
@click.option("--by-position", is_flag=True,
              help="Also read each file in one pass with the teacher (up to its positions) and report both "
                   "models' loss in doubling bins of absolute position (0-1K, 1K-2K, 2K-4K, ...), with a PNG.")
@click.option("--first-bin", type=click.IntRange(1), default=1024, show_default=True,
              help="Width of the first --by-position bin (tokens); each later bin doubles.")
@click.option("--sparse-cache", type=click.IntRange(0), default=None,
              help=_SPARSE_HELP + " Only the stateful column reads with a cache.")
@click.option("--tasks", "task_list", default=None, metavar="NAMES",
              help="Score lm-eval tasks instead of text: comma-separated, of piqa, hellaswag, winogrande, "
                   "arc_easy, arc_challenge, openbookqa, sciq, mmlu; zeroshot and fewshot name the standard "
                   "sets (fewshot: ARC-C 25, HellaSwag 10, WinoGrande 5, MMLU 5 shots); NAME:K gives one task "
                   "K shots, e.g. arc_challenge:25,hellaswag:10.")
@click.option("--num-fewshot", type=int, default=None,
              help="Shots for every task (default: 0, or the fewshot set's).")
@click.option("--limit", type=int, default=None,
              help="Score only the first N items of each task (MMLU: of each subject).")
@_friendly
def eval_(model, more_texts, texts, teacher, context, stride, max_tokens, batch_size, out, device, dtype,
          trust_remote_code, bos, by_position, first_bin, sparse_cache, task_list, num_fewshot, limit):
    """Perplexity and bits per byte of MODEL and its teacher on identical windows of text files,
    plus MODEL reading each file in one pass with its recurrent state (the "stateful" column);
    with --tasks, both on zero- and few-shot tasks (lm-evaluation-harness, data read offline)."""
    if task_list is not None:
        from glaswap.tasks import evaluate_tasks

        if texts or more_texts:
            raise GlaswapError("--tasks scores tasks, not text files; run eval once for each")
        evaluate_tasks(model, task_list, num_fewshot=num_fewshot, limit=limit, teacher=teacher,
                       batch_size=batch_size, out=out, device=device, dtype=dtype,
                       trust_remote_code=trust_remote_code, log=click.echo)
        return
    from glaswap.evaluate import evaluate

    evaluate(model, list(texts) + list(more_texts), teacher=teacher, context=context, stride=stride,
             max_tokens=max_tokens, batch_size=batch_size or 1, out=out, device=device, dtype=dtype,
             trust_remote_code=trust_remote_code, bos=bos, by_position=by_position, first_bin=first_bin,
             sparse_cache=sparse_cache, log=click.echo)


@main.command(short_help="Passkey retrieval by length and depth, beside the teacher.")
@click.argument("model", type=click.Path())
@click.option("--lengths", default="1K,2K,4K,8K,16K,32K", show_default=True,
              help="Prompt lengths in tokens, comma-separated (K = 1024).")
@click.option("--depths", default="0,0.25,0.5,0.75,1", show_default=True,
              help="Where the key sits in the filler: 0 at the start, 1 just before the question.")
@click.option("--trials", type=click.IntRange(1), default=2, show_default=True, help="Keys per length and depth.")
@click.option("--teacher", default="auto", show_default=True,
              help="auto: the source recorded in MODEL/glaswap.json; self: MODEL's own softmax attention; "
                   "or a Hugging Face folder / .gguf file.")
@click.option("--no-teacher", is_flag=True, help="Score MODEL alone.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the keys.")
@click.option("--filler", type=click.Path(dir_okay=False), default=None,
              help="A text file to fill the prompts with, instead of repeated sentences.")
@click.option("--sparse-cache", type=click.IntRange(0), default=None, help=_SPARSE_HELP)
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Folder for passkey.json and passkey.png (default: MODEL/eval).")
@_scoring_options
@_friendly
def passkey(model, lengths, depths, trials, teacher, no_teacher, seed, filler, sparse_cache, out, device, dtype,
            trust_remote_code):
    """Passkey retrieval of MODEL and its teacher: a 5-digit key stated once in filler text, asked
    for at the end, answered by greedy decoding; accuracy by prompt length and key depth."""
    from glaswap.passkey import parse_depths, passkey as run_passkey
    from glaswap.runtime import parse_contexts

    run_passkey(model, lengths=parse_contexts(lengths, "--lengths", "length"), depths=parse_depths(depths),
                trials=trials, teacher=None if no_teacher else teacher, seed=seed, out=out, device=device, dtype=dtype,
                trust_remote_code=trust_remote_code, filler=filler, sparse_cache=sparse_cache, log=click.echo)


@main.command(short_help="Continue a prompt with MODEL, or benchmark its decoding.")
@click.argument("model", type=click.Path())
@click.option("--prompt", default=None, help="Text to continue.")
@click.option("--max-new-tokens", type=click.IntRange(1), default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for sampling.")
@click.option("--graph", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="Replay each decode step from a CUDA graph (auto: on CUDA).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda.")
@click.option("--bench", is_flag=True,
              help="Instead of generating text, time decoding against the teacher at several contexts.")
@click.option("--contexts", default=None,
              help="Contexts for --bench, e.g. 1K,4K,16K,32K (default; 64,256 on CPU).")
@click.option("--batch-size", type=click.IntRange(1), default=1, show_default=True, help="Rows for --bench.")
@click.option("--new-tokens", type=click.IntRange(1), default=32, show_default=True,
              help="Timed decode steps per context for --bench.")
@click.option("--teacher", default="auto", show_default=True,
              help="Teacher for --bench: auto (the source in glaswap.json), a folder / .gguf, or none.")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Folder for --bench's JSON and PNG (default: MODEL/eval).")
@click.option("--sparse-cache", type=click.IntRange(0), default=None, help=_SPARSE_HELP)
@click.option("--trust-remote-code", is_flag=True, help=_TRUST_HELP)
@_friendly
def generate(model, prompt, max_new_tokens, temperature, seed, graph, device, bench, contexts, batch_size,
             new_tokens, teacher, out, sparse_cache, trust_remote_code):
    """Continue a prompt with MODEL (streamed), or with --bench compare its decode speed and memory
    with the teacher's."""
    from glaswap.generate import bench_model, generate_text
    from glaswap.runtime import parse_contexts

    if bench:
        bench_model(model, teacher=teacher, contexts=parse_contexts(contexts) if contexts else None,
                    batch_size=batch_size, new_tokens=new_tokens, graph=graph, device=device, out=out,
                    trust_remote_code=trust_remote_code, sparse_cache=sparse_cache, log=click.echo)
        return
    if prompt is None:
        raise click.UsageError("pass --prompt TEXT (or --bench)")
    res = generate_text(model, prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                        device=device, graph=graph, trust_remote_code=trust_remote_code, sparse_cache=sparse_cache,
                        log=click.echo)
    click.echo(f"\n[{res['new_tokens']} tokens in {res['seconds']:.1f} s, {res['tokens_per_second']:.1f} tokens/s"
               f"{', CUDA graph' if res['cuda_graph'] else ''}]", err=True)


if __name__ == "__main__":
    main()
