"""The two steps of `glaswap distill` as a recipe runs them, timed on a GPU.

bench_distill.py times one unpacked batch; a recipe packs documents into its blocks, so
every step passes `cu_seqlens` to the kernels, and stage 1 (attention transfer) is a step
of its own. This script builds the student of a recipe's shape (random weights, bf16, its
GLA options and LoRA targets), packs documents of random lengths (exponential, mean
--doc-mean tokens) into B x T blocks and times, with CUDA events, in interleaved rounds:
  stage1   teacher pass with every layer's GLA scored against its softmax output (MSE),
           backward, AdamW on the new parameters
  stage2   teacher forward + student forward/backward + chunked KL + AdamW (LoRA + new)
  teacher  stage 2's teacher forward alone (softmax mode, no grad): flash varlen attention
           per document where torch has it; with --teacher-mask also `teacher_mask`, the
           same forward through SDPA with the block-diagonal causal mask
Then it profiles a few steps of each and prints how busy the GPU was: kernel time / wall
time. A step far below 100% is bound by the host (Python, launches, syncs).

    PYTHONPATH=<folder with glaswap and glaswap_kernels> python benchmarks/bench_recipe_step.py \\
        --option feature_map=hedgehog_pm --lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("bench_distill", os.path.join(HERE, "bench_distill.py"))
bench_distill = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_distill)


def packed_batch(B, T, vocab, doc_mean, seed=0):
    """input_ids [B, T] on the GPU and cu_seqlens over the flat B*T tokens: documents of
    exponential lengths, cut at block ends as PackedBlocks cuts them."""
    gen = torch.Generator().manual_seed(seed)
    cu = [0]
    for b in range(B):
        pos = 0
        while pos < T:
            n = max(1, int(torch.empty(1).exponential_(1.0 / doc_mean, generator=gen)))
            pos = min(T, pos + n)
            cu.append(b * T + pos)
    ids = torch.randint(0, vocab, (B, T), generator=gen)
    return {"input_ids": ids.cuda(), "cu_seqlens": torch.tensor(cu, dtype=torch.int32).cuda()}


def real_batch(path, B, T):
    """Blocks 0..B-1 of a token file in the recipe's order for step 0 (seed 0, stage 2)."""
    from glaswap.distill import data as D
    from glaswap.distill.recipe import DataSource

    blocks = D.PackedBlocks(D.load_tokens(DataSource(path=path), None, vocab_size=2**16), T)
    batch = blocks.batch(D.batch_indices(len(blocks), 2, 0, 0, 1, B))
    return {k: (v.cuda() if v is not None else None) for k, v in batch.items()}


def strong_gates(lm, fraction, decay=0.3, seed=0):
    """Low-rank gates: a random `fraction` of the channels of every layer decays by `decay` a
    step (their gate_up bias), the rest keep their start: gates as steep as a real stage 1
    learns, which take the kernels' slow path and so set the step time of a trained model."""
    from glaswap.layers.gla_attention import logit_for_decay

    gen = torch.Generator().manual_seed(seed)
    strong = logit_for_decay(decay, lm.config.gate_normalizer)
    with torch.no_grad():
        for layer in lm.model.layers:
            bias = layer.self_attn.gate_up.bias
            pick = (torch.rand(bias.shape, generator=gen) < fraction).to(bias.device)
            bias.copy_(torch.where(pick, torch.full_like(bias, strong), bias))


def stage1_step(lm, params, opt, batch):
    """As stage 1 runs it: the transfer mode (softmax attention, MSE of every layer)."""
    from glaswap.distill.losses import transfer_step

    with lm.attention_mode("transfer"):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = transfer_step(lm, batch)
        loss.backward()     # inside the mode: gradient checkpointing recomputes the forward here
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    lm.zero_grad(set_to_none=True)


def stage2_step(lm, params, opt, batch):
    from glaswap.distill.losses import kd_step
    from glaswap.distill.recipe import Stage2

    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = kd_step(lm, batch, Stage2(loss_chunk_tokens=8192))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    lm.zero_grad(set_to_none=True)


def teacher_forward(lm, batch, mask=False):
    """Stage 2's teacher part: hidden states with adapters off, softmax attention, no grad;
    mask=True takes SDPA with a [T, T] mask instead of the varlen kernel."""
    from glaswap.distill.student import adapters_off
    from glaswap.layers import softmax_attention

    usable = softmax_attention.varlen_ok
    if mask:
        softmax_attention.varlen_ok = lambda *a: False
    try:
        with torch.no_grad(), adapters_off(lm), lm.attention_mode("softmax"), \
                torch.autocast("cuda", dtype=torch.bfloat16):
            lm.model(input_ids=batch["input_ids"], cu_seqlens=batch["cu_seqlens"], use_cache=False)
    finally:
        softmax_attention.varlen_ok = usable


def busy_fraction(fn, iters=3, top=0):
    """Kernel time over wall time for `iters` runs of fn (one stream: kernels do not overlap);
    with `top`, also prints the kernels with the most device time per step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    wall = a.elapsed_time(b)
    if top:
        per = {}
        for e in kernels:
            n, t = per.get(e.name, (0, 0.0))
            per[e.name] = (n + 1, t + e.device_time_total)
        print(f"  wall {wall / iters:.1f} ms a step; kernels with the most device time a step:")
        for name, (n, t) in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"  {t / iters / 1e3:8.2f} ms  x{n // iters:<5} {name[:110]}")
    return sum(e.device_time_total for e in kernels) / 1e3 / wall


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(bench_distill.SHAPES))
    ap.add_argument("--batch", default="8x2048")
    ap.add_argument("--doc-mean", type=float, default=1000.0, help="mean document length in tokens")
    ap.add_argument("--option", action="append", metavar="KEY=VALUE", default=[],
                    help="a GLA option of the student, e.g. feature_map=hedgehog_pm")
    ap.add_argument("--lora-targets", default="q_proj,k_proj,v_proj,o_proj")
    ap.add_argument("--data", help="a token file (.npz of prepare_corpus.py): take the first batch of "
                                   "blocks from it, as the recipe packs them, instead of random documents")
    ap.add_argument("--top", type=int, default=0, help="print the N kernels with the most device time per step")
    ap.add_argument("--strong-gates", type=float, default=0.0, metavar="FRACTION",
                    help="start this fraction of every layer's gate channels at a decay of 0.3 a "
                         "step, as trained gates end up (the kernels' slow path); the default "
                         "starts every channel at the recipe's gate_init_decay")
    ap.add_argument("--teacher-mask", action="store_true",
                    help="also time the teacher forward with SDPA and a mask (step teacher_mask)")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    from glaswap.distill.recipe import parse_override
    options = {".".join(key): value for key, value in map(parse_override, args.option)}
    B, T = (int(x) for x in args.batch.split("x"))
    teacher, lm, _ = bench_distill.build(args.shape, options=options, lora_targets=args.lora_targets.split(","))
    del teacher
    torch.cuda.empty_cache()
    if args.strong_gates:
        strong_gates(lm, args.strong_gates)
    new = set(lm.new_parameter_names())
    named = dict(lm.named_parameters())
    p1 = [named[n] for n in sorted(new)]
    p2 = [p for p in named.values() if p.requires_grad]
    opt1 = torch.optim.AdamW(p1, lr=1e-5)
    opt2 = torch.optim.AdamW(p2, lr=1e-5)
    if args.data:
        batch = real_batch(args.data, B, T)
    else:
        batch = packed_batch(B, T, bench_distill.SHAPES[args.shape]["vocab_size"], args.doc_mean)
    n_docs = B if batch["cu_seqlens"] is None else batch["cu_seqlens"].numel() - 1
    steps = {"stage1": lambda: stage1_step(lm, p1, opt1, batch),
             "stage2": lambda: stage2_step(lm, p2, opt2, batch),
             "teacher": lambda: teacher_forward(lm, batch)}
    if args.teacher_mask:
        steps["teacher_mask"] = lambda: teacher_forward(lm, batch, mask=True)
    times = bench_distill.measure(steps, args.reps)
    rows = []
    for name, (ms, peak) in times.items():
        if args.top:
            print(f"## {name}")
        busy = float("nan") if args.no_profile else busy_fraction(steps[name], top=args.top)
        rows.append(dict(shape=args.shape, B=B, T=T, docs=n_docs, step=name, ms=ms, tok_s=B * T / ms * 1e3,
                         peak_gib=peak, gpu_busy=busy, options=options, lora_targets=args.lora_targets,
                         strong_gates=args.strong_gates))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.shape} {B}x{T}, {n_docs} documents, "
          f"options {options or 'default'}, LoRA on {args.lora_targets}, strong gates {args.strong_gates}")
    print(f"{'step':12} {'ms':>8} {'tok/s':>9} {'GiB':>6} {'GPU busy':>9}")
    for r in rows:
        print(f"{r['step']:12} {r['ms']:8.1f} {r['tok_s']:9,.0f} {r['peak_gib']:6.1f} {100 * r['gpu_busy']:8.0f}%")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
