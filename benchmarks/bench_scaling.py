"""Distillation steps on 1..N GPUs under torchrun: tokens/s, per GPU and in total, and peak memory.

    torchrun --standalone --nproc-per-node 8 benchmarks/bench_scaling.py --recipe llama-3.1-8b --json s.jsonl
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_scaling.py --shape llama-3.2-1b --layout ddp
    python benchmarks/bench_scaling.py --summary s.jsonl      # the table, scaling from the smallest count
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_scaling.py --dry-run   # CPU, gloo, tiny shape

A model of the recipe's shape (or --shape's) with random weights, since the Hub is out of
reach, set up as `glaswap distill` sets it up: the recipe's GLA options, LoRA, gradient
checkpointing, layout (FSDP2 or DDP) and batch per process, each process on its own random
tokens. Three steps, each with its own AdamW over what it trains:
- stage1: attention transfer (per-layer MSE of GLA against softmax outputs; gates and maps);
- stage2: distillation (teacher forward, student forward and backward, KL on the logits);
- teacher: the teacher's own LoRA fine-tuning step (softmax attention, cross-entropy on full
  logits, the same LoRA and batch): the anchor the distillation step is held against.
Rank 0 prints a JSON line per step: the median step time (barriers around each step), the
global and per-GPU tokens/s, and the peak memory of the fullest GPU. Scaling efficiency is the
per-GPU tokens/s at N GPUs over that at the smallest count run (`--summary`), so a run per GPU
count (`bash benchmarks/run_gpu.sh scaling`) measures the plan. `--checkpoint DIR` also times
glaswap's checkpoint of the stage-2 state (gathered full tensors, rank 0 writes) and its share
of the steps between two of the recipe's checkpoints; a checkpoint another GPU count left in
DIR is loaded first, timed and checked to restore exactly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_distill import SHAPES  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=256, tie_word_embeddings=False, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
STEPS = ("stage1", "stage2", "teacher")


def settings(args):
    """(recipe, shape, sequences per process, sequence length, layout): the recipe's values,
    then the flags that were given. Without --recipe: glaswap's recipe defaults (pure GLA,
    LoRA r=8 on q/k/v/o, no gradient checkpointing, ddp) at llama-3.2-1b, 8 x 2048."""
    from glaswap.distill.recipe import Recipe, load_recipe, resolve_recipe

    if args.recipe:
        recipe = load_recipe(resolve_recipe(args.recipe))
    else:
        recipe = Recipe(name="llama-3.2-1b")
        recipe.stage2.batch_size, recipe.data.seq_len = 8, 2048
    shape = args.shape or recipe.name
    batch = args.batch or recipe.stage2.batch_size
    seq = args.seq or recipe.data.seq_len
    layout = args.layout or ("fsdp" if recipe.train.distributed == "fsdp" else "ddp")
    if args.dry_run:
        shape, batch, seq = "tiny", 2, 64
        recipe.train.gradient_checkpointing = False
    if shape != "tiny" and shape not in SHAPES:
        raise SystemExit(f"no shape {shape!r}; pass --shape, one of {', '.join(SHAPES)}")
    return recipe, shape, batch, seq, layout


def build(recipe, shape: str, dtype, device):
    """The student of `shape` with random weights, built in `dtype` (Dist.storage_dtype, as
    glaswap distill builds it) and set up for training as distill does (prepare_student).
    Built on `device`: an 8B model is 16 GB of random bf16 weights, slow to draw on a host's CPU."""
    from transformers import LlamaConfig

    from glaswap.convert import glaswap_config
    from glaswap.distill.student import prepare_student
    from glaswap.models.modeling_glaswap import GLASwapForCausalLM

    torch.manual_seed(0)  # the same random model on every process (the seed covers every device)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in dtype, not cast after: an 8B model in float32 takes 32 GB
    try:
        with device:
            lm = GLASwapForCausalLM(glaswap_config(
                LlamaConfig(**(TINY if shape == "tiny" else SHAPES[shape])).to_dict(), recipe.model.options))
            return prepare_student(lm, recipe)
    finally:
        torch.set_default_dtype(default)


def step_functions(student, stage2):
    """name -> (parameters it trains, function of one batch that runs forward and backward)."""
    from glaswap.distill.losses import kd_step, transfer_step

    lm = student.lm

    def transfer(batch):
        with lm.attention_mode("transfer"):
            transfer_step(lm, batch).backward()

    def distill(batch):
        loss = kd_step(lm, batch, stage2)
        (loss[0] if isinstance(loss, tuple) else loss).backward()

    def teacher(batch):  # what a plain LoRA fine-tune of the teacher runs
        ids = batch["input_ids"]
        # backward inside the mode too: gradient checkpointing recomputes the forward there
        with lm.attention_mode("softmax"):
            logits = lm(input_ids=ids, use_cache=False).logits
            F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).backward()

    params = dict(lm.named_parameters())
    new, lora = student.new_names, student.lora_names
    trains = {"stage1": new, "stage2": lora | (new if stage2.train_new_params else set()), "teacher": lora}
    fns = {"stage1": transfer, "stage2": distill, "teacher": teacher}
    return {k: ([params[n] for n in sorted(trains[k])], fns[k]) for k in STEPS}


def measure(name, params, fn, stage2, vocab, batch, seq, dist, device, dtype, steps):
    """(median seconds of a step after 2 warm-up steps, peak GiB of the fullest process, the
    optimizer and schedule, as glaswap distill makes them, with the state the steps left)."""
    from glaswap.distill.loop import make_optimizer

    opt, sched = make_optimizer(params, stage2, 2 + steps)
    gen = torch.Generator(device="cpu").manual_seed(1000 + dist.rank)
    cuda = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=dtype) if cuda and dtype != torch.float32 else contextlib.nullcontext()

    def one():
        ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
        with autocast:
            fn({"input_ids": ids, "cu_seqlens": None})
        dist.sync_grads(params)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(2 + steps):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        one()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        if i >= 2:
            times.append(time.perf_counter() - t0)
        if dist.is_main:
            print(f"  {name} step {i + 1}/{2 + steps}: {times[-1] if times else time.perf_counter() - t0:.2f} s",
                  file=sys.stderr, flush=True)
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0], device=device)
    if dist.world > 1:
        torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    return statistics.median(times), float(peak), (opt, sched)


def checkpoint_round(lm, trainable, opt, sched, dist, folder: Path) -> dict:
    """glaswap distill's checkpoint of this stage-2 state, written to `folder` and timed. A
    checkpoint already there (from a run at another GPU count) is first loaded, timed and
    checked to restore exactly: resuming across counts at this size."""
    from glaswap.distill.checkpoints import restore_optimizer, save_checkpoint

    row = {"step": "checkpoint", "world": dist.world}
    saved = folder / "checkpoints" / "stage2"
    if (saved / "state.json").is_file():
        from safetensors.torch import load_file

        dist.barrier()
        t0 = time.perf_counter()
        dist.load_trainable(lm, saved)
        restore_optimizer(saved, opt, sched, dist, lm)
        dist.barrier()
        row["load_s"] = round(time.perf_counter() - t0, 2)
        got = dist.gather_trainable(lm, trainable)
        if dist.is_main:
            want = load_file(str(saved / "trainable.safetensors"))
            row["restored_exactly"] = want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)
            row["saved_by_world"] = json.loads((folder / "bench_world.json").read_text())["world"]
    dist.barrier()
    t0 = time.perf_counter()
    save_checkpoint(folder, 2, 0, lm, trainable, opt, sched, dist)
    row["save_s"] = round(time.perf_counter() - t0, 2)
    if dist.is_main:
        row["gib"] = round(sum(f.stat().st_size for f in saved.iterdir()) / 2**30, 3)
        (folder / "bench_world.json").write_text(json.dumps({"world": dist.world}))
    dist.barrier()
    return row


def summary(path: str) -> str:
    """The table of a --json file: per step kind and GPU count, and the scaling efficiency from
    the smallest count (per-GPU tokens/s at N over that at the smallest)."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    lines = [f"{'step':8s} {'GPUs':>4s} {'step s':>7s} {'tok/s':>9s} {'tok/s/GPU':>9s} {'peak GiB':>8s} "
             f"{'efficiency':>10s} {'x teacher':>9s}"]
    teacher = {r["world"]: r["tokens_per_s"] for r in rows if r["step"] == "teacher"}
    for kind in STEPS:
        mine = sorted((r for r in rows if r["step"] == kind), key=lambda r: r["world"])
        for r in mine:
            base = mine[0]["tokens_per_s_per_gpu"]
            vs = r["tokens_per_s"] / teacher[r["world"]] if r["world"] in teacher and kind != "teacher" else None
            lines.append(f"{kind:8s} {r['world']:4d} {r['step_s']:7.3f} {r['tokens_per_s']:9,.0f} "
                         f"{r['tokens_per_s_per_gpu']:9,.0f} {r['peak_gib']:8.1f} {r['tokens_per_s_per_gpu'] / base:10.0%} "
                         + (f"{vs:9.2f}" if vs is not None else f"{'':9s}"))
    for r in sorted((r for r in rows if r["step"] == "checkpoint"), key=lambda r: r["world"]):
        line = f"checkpoint on {r['world']} GPUs: {r['gib']:.2f} GiB written in {r['save_s']:.1f} s"
        if r.get("stall_at_every") is not None:
            line += f" ({r['stall_at_every']:.1%} of the steps between two checkpoints)"
        if "load_s" in r:
            line += (f"; the one {r['saved_by_world']} GPUs wrote loaded in {r['load_s']:.1f} s, "
                     + ("restored exactly" if r["restored_exactly"] else "NOT restored exactly"))
        lines.append(line)
    return "\n".join(lines)


def write(row: dict, path):
    print(json.dumps(row), flush=True)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", help="take shape, GLA options, LoRA, batch, length, layout, checkpointing from it")
    ap.add_argument("--shape", help=f"one of {', '.join(SHAPES)} (default: the recipe's, else llama-3.2-1b)")
    ap.add_argument("--layout", choices=["ddp", "fsdp"])
    ap.add_argument("--batch", type=int, help="sequences per process")
    ap.add_argument("--seq", type=int)
    ap.add_argument("--steps", type=int, default=8, help="timed steps of each kind, after 2 warm-up steps")
    ap.add_argument("--only", help=f"comma-separated, of {', '.join(STEPS)}")
    ap.add_argument("--json", metavar="PATH", help="append the JSON lines to PATH")
    ap.add_argument("--summary", metavar="PATH", help="print the table of a --json file and exit")
    ap.add_argument("--checkpoint", metavar="DIR",
                    help="after the stage-2 steps, time glaswap's checkpoint of that state to DIR; a checkpoint "
                         "already in DIR (another GPU count's) is loaded first, timed and checked")
    ap.add_argument("--dry-run", action="store_true", help="CPU (gloo), a tiny shape, 2 steps: tests this script")
    args = ap.parse_args(argv)
    if args.summary:
        if not os.path.isfile(args.summary):
            print(f"bench_scaling: no file {args.summary}; write one with --json", file=sys.stderr)
            return 2
        print(summary(args.summary))
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("bench_scaling: no CUDA GPU; pass --dry-run to test the script on the CPU", file=sys.stderr)
        return 2
    recipe, shape, batch, seq, layout = settings(args)
    if args.dry_run:
        args.steps = 2
    from glaswap.distill.parallel import setup_distributed

    dist = setup_distributed(layout)
    device = torch.device("cuda", dist.local_rank) if torch.cuda.is_available() and not args.dry_run \
        else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    student = build(recipe, shape, dist.storage_dtype(dtype), device)
    dist.wrap(student.lm, device, dtype)
    steps = step_functions(student, recipe.stage2)
    vocab = (TINY if shape == "tiny" else SHAPES[shape])["vocab_size"]
    kinds = args.only.split(",") if args.only else list(STEPS)
    for kind in kinds:
        if kind not in steps:
            raise SystemExit(f"--only: no step {kind!r}; choose from {', '.join(STEPS)}")
        sec, peak, (opt, sched) = measure(kind, *steps[kind], recipe.stage2, vocab, batch, seq, dist, device, dtype,
                                          args.steps)
        tokens = dist.world * batch * seq
        row = {"step": kind, "world": dist.world, "layout": dist.mode if dist.world > 1 else "single",
               "shape": shape, "batch_per_gpu": batch, "seq": seq, "step_s": round(sec, 4),
               "tokens_per_s": round(tokens / sec, 1), "tokens_per_s_per_gpu": round(tokens / sec / dist.world, 1),
               "peak_gib": round(peak, 2), "options": recipe.model.options, "device": str(device)}
        if dist.is_main:
            write(row, args.json)
        if kind == "stage2" and args.checkpoint:
            ck = checkpoint_round(student.lm, student.trainable, opt, sched, dist, Path(args.checkpoint))
            every = recipe.train.checkpoint_every
            ck["stall_at_every"] = round(ck["save_s"] / (every * sec), 4) if every else None
            if dist.is_main:
                write(ck, args.json)
        del opt, sched
    if dist.world > 1:
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
