"""Which layers a recipe with `model.options.softmax_layers: auto:N` keeps as softmax attention.

After attention transfer (stage 1) every layer is GLA or hybrid. As in fla's hybrid
distillation (arXiv 2512.20569), layers are restored to the teacher's softmax attention (their
`self_attn.mode` set to "softmax", LoRA adapters as they are) and scored by how much that
lowers KL(teacher || student) on next-token distributions. The choice is greedy: each of the N
steps tries every remaining layer on top of the layers already chosen and keeps the best, so
a layer that only repeats what a chosen one already does is not kept twice.

What the kept layers are for is recall beyond the window, so the score counts two things,
each as the share of the all-GLA student's KL that a step removes:
- natural text, at positions within its document of at least `window + sinks` (config.window;
  0 for pure GLA, whose state is its only memory) and at least MIN_POSITION tokens in, or
  half the block where blocks are shorter: inside the window a hybrid layer attends exactly;
- copies: spans of the same text planted later in their document, further from their source
  than the window reaches. The teacher predicts a copy from its source (induction), the
  GLA state barely can, so the KL there falls only with a layer that retrieves from far back,
  the rare dependence that natural text shows too seldom to rank by.

The text is the recipe's evaluation data (held out from training), in blocks of
data.seq_len or stage1.select_seq_len; the blocks with the most counted positions are used.
The teacher (softmax in every layer, adapters off) runs once; its final hidden states are
kept and the logits of both models are made a chunk at a time. Layers below a candidate are
in the same mode as in that step's pass without it, so they hand back that pass's outputs
instead of running again: a candidate costs about half the layers.

The run folder gets ranking.json (the record a resumed run reuses, written last and
atomically) and ranking.png (each layer's score alone, the kept ones highlighted, and the
KL as the steps add them).
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

from glaswap.distill.data import PackedBlocks
from glaswap.distill.losses import kl_sum
from glaswap.distill.student import adapters_off
from glaswap.errors import GlaswapError

RANKING_JSON = "ranking.json"
RANKING_PNG = "ranking.png"
METHOD = ("greedy: each step restores the layer whose softmax attention removes the largest share of "
          "KL(teacher || student) past the window and at copied spans (after arXiv 2512.20569)")
MIN_POSITION = 256     # the first position counted, unless window + sinks lies further in
MAX_SEQUENCES = 8      # blocks scored at most, whatever the budget allows
COPY_SPAN = 32         # tokens of each planted copy (shorter in blocks under 512 tokens)
COPIES = 4             # copies planted in each block, where its documents have room
NEAR = 8               # tokens after a copy that the natural KL leaves out (the text jumps back)
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


def selection_passes(num_layers: int, keep: int = 1) -> float:
    """Whole forward passes' worth of work per block: the teacher's, then for each layer kept
    the pass with those chosen so far and one per remaining layer from that layer up."""
    return 1 + keep * (1 + (num_layers + 1) / 2)


def selection_seq_len(recipe) -> int:
    """The length of the blocks the layers are ranked on: stage1.select_seq_len, else data.seq_len."""
    return recipe.stage1.select_seq_len or recipe.data.seq_len


def sequences_for_budget(recipe, num_layers: int, world: int = 1, keep: int = 1) -> int:
    """How many blocks of selection_seq_len the selection scores: as many as keep its forward
    passes within SHARE of the recipe's time, between 1 and MAX_SEQUENCES. Training's blocks
    are counted over all processes, the selection's are shared among them."""
    s1, s2 = recipe.stage1, recipe.stage2
    train_blocks = (s1.steps * s1.batch_size * s1.grad_accum + s2.steps * s2.batch_size * s2.grad_accum) * world
    longer = selection_seq_len(recipe) / recipe.data.seq_len
    allowed = SHARE / (1 - SHARE) * TRAIN_PASSES * train_blocks / (selection_passes(num_layers, keep) * longer)
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
def _softmax_in(lm, layers: list[int]):
    """Every layer GLA but `layers`, which are softmax, for the length of the block."""
    with lm.attention_mode("gla"):
        for layer in layers:
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


def plant_copies(ids: np.ndarray, positions: np.ndarray, start: int, config, span: int, rng,
                 copies: int = COPIES):
    """Copy up to `copies` spans of `span` tokens of a block (ids [T], its tokens' positions
    within their documents) to later places of the same document, as many as leave three
    quarters of the counted positions natural. Each copy lies further than the window from its
    source, so only a layer whose attention reaches beyond the window can predict it from
    there. Returns the new ids, the positions whose next token is a copied one (from a copy's
    first token to its second-to-last: a copy's first token cannot be foreseen), and the
    positions in or just after a copy, which the natural KL leaves out."""
    window = int(getattr(config, "window", 0) or 0)
    sinks = int(getattr(config, "sinks", 0) or 0) if window else 0
    gap = max(window + 2, span)          # a copy's token and its source: further apart than the window
    ids = ids.copy()
    copy = np.zeros(len(ids), dtype=bool)
    near = np.zeros(len(ids), dtype=bool)
    doc0 = np.nonzero(positions == 0)[0]
    ends = np.append(doc0[1:], len(ids))
    slots = []
    for d0, d1 in zip(doc0, ends):       # where a copy may go: counted, and far enough from a source
        lo = d0 + max(start, sinks + gap)
        if d1 - span >= lo:
            slots.append((d0, lo, d1 - span))
    if not slots:
        return ids, copy, near
    # the copies share the room of the documents that have some, in equal slices
    room = sum(hi - lo + 1 for _, lo, hi in slots)
    copies = min(copies, int((positions >= start).sum()) // (4 * (span + NEAR)))   # most text stays natural
    if copies == 0:
        return ids, copy, near
    per = room / copies
    for c in range(copies):
        at = int(per * c + rng.integers(0, max(1, int(per) - span + 1)))
        for d0, lo, hi in slots:
            if at <= hi - lo:
                dest = lo + at
                break
            at -= hi - lo + 1
        else:
            continue
        if near[dest:dest + span].any():
            continue
        src = int(rng.integers(d0 + sinks, dest - gap + 1))
        ids[dest:dest + span] = ids[src:src + span]
        copy[dest + 1:dest + span - 1] = True
        near[dest:dest + span + NEAR] = True
    return ids, copy, near


def _batches(blocks, chosen, batch_size, start, config, span, device, seed):
    """The selection's batches: (input_ids, cu_seqlens, natural mask, copy mask), the masks
    over the flattened tokens, the copies planted with a fixed seed."""
    rng = np.random.default_rng(seed)
    out = []
    for b in range(0, len(chosen), batch_size):
        idx = chosen[b:b + batch_size]
        batch = blocks.batch(idx)
        rows, natural, copy = [], [], []
        for j, i in enumerate(idx):
            pos = _positions(blocks, i)
            ids, c, near = plant_copies(batch["input_ids"][j].numpy(), pos, start, config, span, rng)
            rows.append(ids)
            natural.append((pos >= start) & ~near)
            copy.append(c)
        ids = torch.from_numpy(np.stack(rows)).to(device)
        cu = batch["cu_seqlens"].to(device) if batch["cu_seqlens"] is not None else None
        if cu is None and device.type == "cuda":   # one document per row: the kernel variants training runs
            T = blocks.seq_len
            cu = torch.arange(0, len(idx) * T + 1, T, dtype=torch.int32, device=device)
        out.append((ids, cu, torch.from_numpy(np.concatenate(natural)).to(device),
                    torch.from_numpy(np.concatenate(copy)).to(device)))
    return out


@torch.no_grad()
def rank_layers(lm, blocks, n_sequences: int, batch_size: int, device, dtype, dist=None,
                chunk_tokens: int = 4096, keep: int = 1, span: int | None = None, seed: int = 0) -> dict:
    """Choose `keep` layers of `lm` (a GLASwapForCausalLM, every layer GLA) to restore to softmax
    attention, greedily, on `blocks` (PackedBlocks) with copies planted (plant_copies; `span`
    tokens each, default COPY_SPAN or a sixteenth of a block). Each step tries every layer not yet
    chosen on top of those chosen and keeps the one whose score is highest: the share of the
    all-GLA student's KL(teacher || student) it removes at natural positions past the window,
    plus the share it removes at the copies. Returns the layers' rows (their KL and score when
    each was tried alone, and their rank: the order chosen, then by the last step's score) and
    the steps. `dist` (parallel.Dist) shares the blocks among processes and sums their KL."""
    t0 = time.time()
    layers = len(lm.model.layers)
    keep = max(1, min(keep, layers))
    start = counted_from(lm.config, blocks.seq_len)
    span = span or min(COPY_SPAN, max(8, blocks.seq_len // 16))
    chosen_blocks = pick_blocks(blocks, n_sequences, start)
    rank, world = (dist.rank, dist.world) if dist is not None else (0, 1)
    mine = chosen_blocks[rank::world]
    was_training = lm.training
    lm.eval()
    batches = _batches(blocks, mine, batch_size, start, lm.config, span, device, seed=[seed, rank])
    teacher = []                     # the teacher's final hidden states at the counted positions
    with _autocast(device, dtype), adapters_off(lm), lm.attention_mode("softmax"):
        for ids, cu, natural, copy in batches:
            h = lm.model(input_ids=ids, cu_seqlens=cu, use_cache=False).last_hidden_state.flatten(0, 1)
            teacher.append((h[natural], h[copy]))

    def kl_of(restored: list[int], candidates: list[int]):
        """[1 + len(candidates), 2] summed KL (natural, copy): `restored` in softmax, then each
        candidate on top of it; layers below a candidate are taken from the first pass."""
        sums = torch.zeros(1 + len(candidates), 2, dtype=torch.float64, device=device)
        for (ids, cu, natural, copy), (t_nat, t_copy) in zip(batches, teacher):
            outputs = []
            with _autocast(device, dtype):
                for j, layer in enumerate([None, *candidates]):
                    with _softmax_in(lm, restored + ([] if layer is None else [layer])), \
                            (_record_outputs(lm, outputs) if layer is None else _reuse_below(lm, layer, outputs)):
                        h = lm.model(input_ids=ids, cu_seqlens=cu, use_cache=False).last_hidden_state.flatten(0, 1)
                    sums[j, 0] += kl_sum(h[natural], t_nat, lm.lm_head.weight, chunk_tokens).double()
                    sums[j, 1] += kl_sum(h[copy], t_copy, lm.lm_head.weight, chunk_tokens).double()
        return dist.sum(sums) if dist is not None else sums

    counts = torch.tensor([sum(int(n.sum()) for _, _, n, _ in batches), sum(int(c.sum()) for *_, c in batches)],
                          dtype=torch.float64, device=device)
    counts = dist.sum(counts) if dist is not None else counts
    tokens = counts.clamp(min=1)
    restored, steps, first, scores = [], [], None, None
    base = None
    for _ in range(keep):
        candidates = [i for i in range(layers) if i not in restored]
        kl = (kl_of(restored, candidates) / tokens).tolist()
        if base is None:
            base = kl[0]
        # the share of the all-GLA KL each candidate removes, natural and copies alike
        scores = {c: sum((kl[0][m] - kl[1 + j][m]) / base[m] for m in (0, 1) if base[m] > 0)
                  for j, c in enumerate(candidates)}
        tried = {c: kl[1 + j] for j, c in enumerate(candidates)}
        if first is None:
            first = (tried, scores)
        best = max(candidates, key=lambda c: (scores[c], -c))
        restored.append(best)
        steps.append({"layer": best, "kl": tried[best][0], "kl_copy": tried[best][1], "score": scores[best]})
    if was_training:
        lm.train()
    rest = sorted((i for i in range(layers) if i not in restored), key=lambda i: (-scores[i], i))
    ranks = {layer: r + 1 for r, layer in enumerate(restored + rest)}
    tried, alone = first
    return {
        "method": METHOD,
        "baseline_kl": base[0],
        "baseline_kl_copy": base[1],
        "layers": [{"layer": i, "kl": tried[i][0], "kl_copy": tried[i][1], "drop": base[0] - tried[i][0],
                    "drop_copy": base[1] - tried[i][1], "score": alone[i], "rank": ranks[i]} for i in range(layers)],
        "steps": steps,
        "counted_from_position": start,
        "tokens": int(counts[0].item()),
        "copy_tokens": int(counts[1].item()),
        "copy_span": span,
        "sequences": len(chosen_blocks),
        "seq_len": blocks.seq_len,
        "blocks": chosen_blocks,
        "seconds": time.time() - t0,
    }


def top_layers(ranking: dict, n: int) -> list[int]:
    """The n layers ranked first (the first n chosen), in layer order."""
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
    """Each layer's score alone, the kept layers highlighted, and the KL at natural positions
    and at copies as the greedy steps add layers; skipped without matplotlib (the `plots`
    extra): ranking.json has the figures."""
    if importlib.util.find_spec("matplotlib") is None:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ranking["layers"]
    kept = set(ranking.get("chosen", []))
    colours = ["tab:orange" if r["layer"] in kept else "tab:blue" for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(max(6.0, 0.28 * len(rows) + 2) + 4.5, 4),
                                  gridspec_kw={"width_ratios": [max(6.0, 0.28 * len(rows) + 2), 4.5]})
    ax.bar([r["layer"] for r in rows], [r["score"] for r in rows], color=colours)
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xlabel("layer restored to softmax attention, alone")
    ax.set_ylabel("share of the all-GLA KL removed\n(natural + copies)")
    ax.set_title(f"{len(kept)} of {len(rows)} layers kept as softmax (orange)\n{ranking['tokens']:,} tokens at "
                 f"positions >= {ranking['counted_from_position']}, {ranking['copy_tokens']:,} in copies",
                 fontsize=10)
    ax.set_xticks([r["layer"] for r in rows])
    ax.tick_params(axis="x", labelsize=7 if len(rows) > 24 else 9)
    for label, r in zip(ax.get_xticklabels(), rows):   # a kept layer's score may be too small to see
        if r["layer"] in kept:
            label.set_color("tab:orange")
            label.set_fontweight("bold")
    ax.grid(axis="y", alpha=0.3)

    steps = ranking["steps"]
    x = list(range(len(steps) + 1))
    ax2.plot(x, [ranking["baseline_kl"]] + [s["kl"] for s in steps], "o-", label="natural, past the window")
    if ranking["copy_tokens"]:
        ax2.plot(x, [ranking["baseline_kl_copy"]] + [s["kl_copy"] for s in steps], "s-", label="copies")
    ax2.set_xticks(x, ["none"] + [f"+{s['layer']}" for s in steps])
    ax2.set_xlabel("layers restored, in the order chosen")
    ax2.set_ylabel("KL(teacher || student), nats/token")
    ax2.set_yscale("log")
    ax2.set_title("greedy steps", fontsize=10)
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- in a run
def selection_blocks(recipe, data) -> tuple[PackedBlocks, str]:
    """The blocks auto:N ranks the layers on and what text they hold: the evaluation set's
    (the training text's when there is none), in blocks of selection_seq_len. A GlaswapError,
    one line, when that text is shorter than one such block: checked before any training."""
    evaluation = data.eval_blocks is not None and len(data.eval_blocks) > 0
    blocks, kind = (data.eval_blocks, "evaluation") if evaluation else (data.blocks, "training")
    length = selection_seq_len(recipe)
    if length != blocks.seq_len:
        tokens = data.eval if evaluation else data.train
        blocks = PackedBlocks(tokens, length)
        if len(blocks) == 0:
            raise GlaswapError(f"stage1.select_seq_len={length} is longer than the {kind} text "
                               f"({tokens.n_tokens:,} tokens); lower it, or 0 for data.seq_len")
    return blocks, kind


def choose_softmax_layers(run, lm, ranked_on: tuple[PackedBlocks, str], n: int, recorded: dict | None,
                          started: float, log) -> dict:
    """The ranking of a run (loop.RunState) after stage 1, with its choice of n layers under
    "chosen": `recorded` (the run folder's ranking.json, read as a resumed run started) as it
    is, else measured now on `ranked_on` (selection_blocks) and written into the run folder.
    `started`: time.time() when the run began, for the share of its time the selection took."""
    if recorded is not None:
        log(f"softmax layers {recorded['chosen']}: as {RANKING_JSON} in {run.folder} records")
        return recorded
    recipe = run.recipe
    blocks, kind = ranked_on
    seqs = sequences_for_budget(recipe, len(lm.model.layers), run.dist.world, keep=n)
    bs = max(recipe.stage1.batch_size, recipe.stage2.batch_size)
    ranking = rank_layers(lm, blocks, seqs, bs, run.device, run.dtype, run.dist, recipe.stage2.loss_chunk_tokens,
                          keep=n, seed=recipe.train.seed)
    ranking["data"] = kind
    ranking["n"] = n
    ranking["chosen"] = top_layers(ranking, n)
    ranking["share_of_run_so_far"] = ranking["seconds"] / max(time.time() - started, 1e-9)
    run.dist.main_only(lambda: write_ranking(run.folder, ranking))
    run.metrics.log(stage=1, step=recipe.stage1.steps, event="softmax_selection", layers=ranking["chosen"],
                    baseline_kl=ranking["baseline_kl"], tokens=ranking["tokens"], seconds=ranking["seconds"])
    last = ranking["steps"][-1]
    log(f"softmax layers {ranking['chosen']} of {len(ranking['layers'])}, chosen greedily by the KL each removes "
        f"({ranking['tokens']:,} tokens at positions >= {ranking['counted_from_position']}, "
        f"{ranking['copy_tokens']:,} in copies; KL {ranking['baseline_kl']:.4f} -> {last['kl']:.4f}, copies "
        f"{ranking['baseline_kl_copy']:.3f} -> {last['kl_copy']:.3f}): {ranking['seconds']:.1f} s, "
        f"{100 * ranking['share_of_run_so_far']:.1f}% of the run so far")
    return ranking
