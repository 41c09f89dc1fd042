"""Which layers a recipe with `model.options.softmax_layers: auto:N` keeps as softmax attention.

After attention transfer (stage 1) every layer is GLA or hybrid. Following fla's hybrid
distillation (arXiv 2512.20569), each layer in turn is restored to the teacher's softmax
attention (its `self_attn.mode` set to "softmax", every other layer "gla", LoRA adapters as
they are) and the layer is scored by how much that one change lowers KL(teacher || student)
on next-token distributions, against the all-GLA student. One pass per layer, and the N
layers with the largest drops are kept: a greedy search (restore the best, measure again)
would cost N passes over all layers for each layer kept.

The KL is counted only where a token's exact attention cannot reach everything it read: at
positions within its document of at least `window + sinks` (config.window; 0 for pure GLA,
whose state is its only memory) and at least MIN_POSITION tokens in, or half the block where
blocks are shorter. Recall beyond the window is what the kept layers are for, and inside it
a hybrid layer already attends exactly. The text is the recipe's evaluation data (held out
from training), in blocks of data.seq_len; the blocks with the most such positions are
used. The teacher (softmax in every layer, adapters off) runs once; its final hidden states
are kept and the logits of both models are made a chunk at a time. Layers below the restored
one are GLA in that pass as in the all-GLA one, so they hand back the all-GLA pass's outputs
instead of running again: the passes cost about half the layers each.

The run folder gets ranking.json (the record a resumed run reuses, written last and
atomically) and ranking.png (the drop per layer, the kept ones highlighted).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import torch

from glaswap.distill.losses import kl_sum
from glaswap.distill.student import adapters_off

RANKING_JSON = "ranking.json"
RANKING_PNG = "ranking.png"
METHOD = "each layer alone restored to softmax attention, ranked by the drop of KL(teacher || student) (arXiv 2512.20569)"
MIN_POSITION = 256     # the first position counted, unless window + sinks lies further in
MAX_SEQUENCES = 8      # blocks scored at most, whatever the budget allows
SHARE = 0.2            # the most of the recipe's time the selection is allowed
# Forward passes' worth of work per training token: the teacher's forward and the student's
# forward and backward (stage 1's transfer pass counts as one forward). Conversion and the
# evaluations add to the recipe's time, so the budget below errs on the safe side.
TRAIN_PASSES = 3.0


def counted_from(config, seq_len: int) -> int:
    """The first position within a document whose KL the ranking counts."""
    window = int(getattr(config, "window", 0) or 0)
    sinks = int(getattr(config, "sinks", 0) or 0) if window else 0
    return max(window + sinks, min(MIN_POSITION, seq_len // 2))


def selection_passes(num_layers: int) -> float:
    """Whole forward passes' worth of work per block: the teacher's, the all-GLA student's,
    and one per layer from that layer up."""
    return 2 + (num_layers + 1) / 2


def sequences_for_budget(recipe, num_layers: int, world: int = 1) -> int:
    """How many blocks of data.seq_len the selection scores: as many as keep its forward
    passes within SHARE of the recipe's time, between 1 and MAX_SEQUENCES. Training's blocks
    are counted over all processes, the selection's are shared among them."""
    s1, s2 = recipe.stage1, recipe.stage2
    train_blocks = (s1.steps * s1.batch_size * s1.grad_accum + s2.steps * s2.batch_size * s2.grad_accum) * world
    allowed = SHARE / (1 - SHARE) * TRAIN_PASSES * train_blocks / selection_passes(num_layers)
    return int(min(MAX_SEQUENCES, max(1, math.floor(allowed))))


def _positions(blocks, i: int) -> np.ndarray:
    """Position of each token of block i within its document (documents restart at each block)."""
    _, starts = blocks.block(i)
    pos = np.arange(blocks.seq_len)
    return pos - starts[np.searchsorted(starts, pos, side="right") - 1]


def pick_blocks(blocks, n: int, start: int) -> list[int]:
    """The n blocks with the most positions at or past `start` (the first blocks on ties),
    leaving out blocks with none."""
    counts = [(int((_positions(blocks, i) >= start).sum()), i) for i in range(len(blocks))]
    best = sorted((c for c in counts if c[0] > 0), key=lambda c: (-c[0], c[1]))[:n]
    return sorted(i for _, i in best)


def _autocast(device, dtype):
    if device.type == "cuda" and dtype != torch.float32:
        return torch.autocast("cuda", dtype=dtype)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _softmax_in(lm, layer: int | None):
    """Every layer GLA, but `layer` (None: none) softmax, for the length of the block."""
    with lm.attention_mode("gla"):
        if layer is not None:
            lm.model.layers[layer].self_attn.mode = "softmax"
        yield


def _stored(output, *_args, **_kwargs):
    """A decoder layer's forward that hands back an output computed before (no transfer loss)."""
    return output, None


@contextlib.contextmanager
def _reuse_below(lm, layer: int, outputs: list):
    """Layers below `layer` return `outputs` (theirs in the all-GLA pass) without running."""
    below = list(lm.model.layers)[:layer]
    for module, out in zip(below, outputs):
        module.forward = functools.partial(_stored, out)
    try:
        yield
    finally:
        for module in below:
            del module.forward   # the class's forward again


@contextlib.contextmanager
def _record_outputs(lm, outputs: list):
    """Append each decoder layer's output hidden states to `outputs` as the model runs."""
    hooks = [m.register_forward_hook(lambda _m, _args, out: outputs.append(out[0])) for m in lm.model.layers]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def rank_layers(lm, blocks, n_sequences: int, batch_size: int, device, dtype, dist=None,
                chunk_tokens: int = 4096) -> dict:
    """Score every layer of `lm` (a GLASwapForCausalLM, every layer GLA) on `blocks` (PackedBlocks):
    the mean KL(teacher || student) over the counted positions of the all-GLA student and of
    the student with each layer alone in softmax, and each layer's drop and rank (1: the
    largest drop). `dist` (parallel.Dist) shares the blocks among processes and sums their KL."""
    t0 = time.time()
    layers = len(lm.model.layers)
    start = counted_from(lm.config, blocks.seq_len)
    chosen = pick_blocks(blocks, n_sequences, start)
    rank, world = (dist.rank, dist.world) if dist is not None else (0, 1)
    mine = chosen[rank::world]
    was_training = lm.training
    lm.eval()
    # sums[0]: the all-GLA student; sums[1 + l]: layer l in softmax; sums[-1]: tokens counted
    sums = torch.zeros(layers + 2, dtype=torch.float64, device=device)
    for b in range(0, len(mine), batch_size):
        idx = mine[b:b + batch_size]
        batch = blocks.batch(idx)
        ids = batch["input_ids"].to(device)
        cu = batch["cu_seqlens"].to(device) if batch["cu_seqlens"] is not None else None
        if cu is None and device.type == "cuda":   # one document per row: the kernel variants training runs
            T = blocks.seq_len
            cu = torch.arange(0, len(idx) * T + 1, T, dtype=torch.int32, device=device)
        keep = torch.from_numpy(np.concatenate([_positions(blocks, i) >= start for i in idx])).to(device)
        with _autocast(device, dtype):
            with adapters_off(lm), lm.attention_mode("softmax"):
                h_t = lm.model(input_ids=ids, cu_seqlens=cu, use_cache=False).last_hidden_state.flatten(0, 1)[keep]
            outputs = []
            for j, layer in enumerate([None, *range(layers)]):
                with _softmax_in(lm, layer), (_record_outputs(lm, outputs) if layer is None
                                              else _reuse_below(lm, layer, outputs)):
                    h_s = lm.model(input_ids=ids, cu_seqlens=cu, use_cache=False).last_hidden_state
                sums[j] += kl_sum(h_s.flatten(0, 1)[keep], h_t, lm.lm_head.weight, chunk_tokens).double()
            del outputs
        sums[-1] += keep.sum()
    if was_training:
        lm.train()
    if dist is not None:
        sums = dist.sum(sums)
    tokens = int(sums[-1].item())
    kl = (sums[:-1] / max(tokens, 1)).tolist()
    base = kl[0]
    drops = [base - k for k in kl[1:]]
    order = sorted(range(layers), key=lambda i: (-drops[i], i))
    ranks = {layer: r + 1 for r, layer in enumerate(order)}
    return {
        "method": METHOD,
        "baseline_kl": base,
        "layers": [{"layer": i, "kl": kl[1 + i], "drop": drops[i], "rank": ranks[i]} for i in range(layers)],
        "counted_from_position": start,
        "tokens": tokens,
        "sequences": len(chosen),
        "seq_len": blocks.seq_len,
        "blocks": chosen,
        "seconds": time.time() - t0,
    }


def top_layers(ranking: dict, n: int) -> list[int]:
    """The n layers of the largest drops, in layer order."""
    return sorted(r["layer"] for r in ranking["layers"] if r["rank"] <= n)


# ----------------------------------------------------------------------------- run folder
def write_ranking(folder: Path, ranking: dict):
    """ranking.png, then ranking.json atomically: the JSON's presence means the choice is made."""
    folder = Path(folder)
    plot_ranking(ranking, folder / RANKING_PNG)
    tmp = folder / (RANKING_JSON + ".tmp")
    tmp.write_text(json.dumps(ranking, indent=2) + "\n")
    os.replace(tmp, folder / RANKING_JSON)


def read_ranking(folder: Path) -> dict | None:
    """The ranking a run folder recorded, or None."""
    path = Path(folder) / RANKING_JSON
    return json.loads(path.read_text()) if path.is_file() else None


def plot_ranking(ranking: dict, path: Path):
    """A bar chart of each layer's KL drop, the kept layers highlighted; skipped without
    matplotlib (the `plots` extra): ranking.json has the figures."""
    if importlib.util.find_spec("matplotlib") is None:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ranking["layers"]
    kept = set(ranking.get("chosen", []))
    colours = ["tab:orange" if r["layer"] in kept else "tab:blue" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.28 * len(rows) + 2), 4))
    ax.bar([r["layer"] for r in rows], [r["drop"] for r in rows], color=colours)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xlabel("layer restored to softmax attention")
    ax.set_ylabel("drop of KL(teacher || student), nats/token")
    ax.set_title(f"{len(kept)} of {len(rows)} layers kept as softmax (orange); all-GLA KL "
                 f"{ranking['baseline_kl']:.4g}\n{ranking['tokens']:,} tokens at positions >= "
                 f"{ranking['counted_from_position']}", fontsize=10)
    ax.set_xticks([r["layer"] for r in rows])
    ax.tick_params(axis="x", labelsize=7 if len(rows) > 24 else 9)
    for label, r in zip(ax.get_xticklabels(), rows):   # a kept layer's drop may be too small to see
        if r["layer"] in kept:
            label.set_color("tab:orange")
            label.set_fontweight("bold")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- in a run
def choose_softmax_layers(run, lm, data, n: int, recorded: dict | None, started: float, log) -> dict:
    """The ranking of a run (loop.RunState) after stage 1, with its choice of n layers under
    "chosen": `recorded` (the run folder's ranking.json, read as a resumed run started) as it
    is, else measured now on the evaluation blocks (the training blocks when there are none)
    and written into the run folder. `started`: time.time() when the run began, for the
    share of its time the selection took."""
    if recorded is not None:
        log(f"softmax layers {recorded['chosen']}: as {RANKING_JSON} in {run.folder} records")
        return recorded
    recipe = run.recipe
    blocks = data.eval_blocks if data.eval_blocks is not None and len(data.eval_blocks) else data.blocks
    seqs = sequences_for_budget(recipe, len(lm.model.layers), run.dist.world)
    bs = max(recipe.stage1.batch_size, recipe.stage2.batch_size)
    ranking = rank_layers(lm, blocks, seqs, bs, run.device, run.dtype, run.dist, recipe.stage2.loss_chunk_tokens)
    ranking["data"] = "evaluation" if blocks is data.eval_blocks else "training"
    ranking["n"] = n
    ranking["chosen"] = top_layers(ranking, n)
    ranking["share_of_run_so_far"] = ranking["seconds"] / max(time.time() - started, 1e-9)
    run.dist.main_only(lambda: write_ranking(run.folder, ranking))
    run.metrics.log(stage=1, step=recipe.stage1.steps, event="softmax_selection", layers=ranking["chosen"],
                    baseline_kl=ranking["baseline_kl"], tokens=ranking["tokens"], seconds=ranking["seconds"])
    log(f"softmax layers {ranking['chosen']} of {len(ranking['layers'])}, by the KL each removes "
        f"({ranking['tokens']:,} tokens at positions >= {ranking['counted_from_position']}, all-GLA KL "
        f"{ranking['baseline_kl']:.4f}): {ranking['seconds']:.1f} s, "
        f"{100 * ranking['share_of_run_so_far']:.1f}% of the run so far")
    return ranking
