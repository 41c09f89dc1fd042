"""`glaswap passkey`: can the model fetch a 5-digit key stated once, far back in its context?

Each prompt is filler text with one sentence giving the key at a chosen depth (0: right
after the opening line, 1: right before the question), then the question. The model
answers by greedy decoding; it is right when the first number it writes is the key. The
student reads the prompt in chunks with its recurrent state; the teacher reads it with its
KV cache (or, for "self", the student's own softmax attention, recomputed every step).
Accuracy by length and depth for both, as a table, JSON and a heatmap PNG; beside it, the
key's nats: -log p of the key's tokens read back after the question, a graded measure of
how much of the key a model kept where its greedy answers are all right or all wrong.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import math
import re
import time
from pathlib import Path

import numpy as np
import torch

from glaswap.errors import GlaswapError
from glaswap.runtime import atomic_write, open_model, read_text_file, versions

INTRO = "There is a pass key hidden in this text. Find it and remember it, you will be asked for it."
FILLER = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
ANSWER_TOKENS = 10        # enough for " 12345" under tokenizers that split digits


def parse_depths(text: str) -> list[float]:
    try:
        depths = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise GlaswapError(f"invalid --depths {text!r}; pass fractions between 0 and 1, e.g. 0,0.5,1")
    if not depths or not all(0.0 <= d <= 1.0 for d in depths):
        raise GlaswapError(f"invalid --depths {text!r}; each depth is a fraction between 0 and 1")
    return depths


def build_prompt(tokenizer, length: int, depth: float, key: str, text_ids: list[int] | None = None,
                 offset: int = 0) -> list[int]:
    """Token ids of about `length` tokens (never more): the opening line, filler, the key at
    `depth` of the filler, more filler, the question. The filler is FILLER repeated, or with
    `text_ids` (a tokenised text) that text's tokens from `offset` on, wrapping around."""
    def enc(text, first=False):
        return tokenizer(text, add_special_tokens=first)["input_ids"]

    intro, needle, question = enc(INTRO, True), enc(NEEDLE.format(key=key)), enc(QUESTION)
    room = length - len(intro) - len(needle) - len(question)
    if room < 0:
        raise GlaswapError(f"a passkey prompt needs at least {length - room} tokens with this tokenizer; "
                           f"pass longer --lengths")
    if text_ids:
        n = room
        filler = [text_ids[(offset + i) % len(text_ids)] for i in range(n)]
        before = int(round(depth * n))
        return intro + filler[:before] + needle + filler[before:] + question
    filler = enc(FILLER)
    n = room // len(filler)
    before = int(round(depth * n))
    return intro + filler * before + needle + filler * (n - before) + question


def key_tokens(tokenizer, key: str) -> list[int]:
    """The key as the answer writes it after the question: " 12345"."""
    return tokenizer(" " + key, add_special_tokens=False)["input_ids"]


def answer_is_key(text: str, key: str) -> bool:
    """Right when the first number in the answer is the key."""
    m = re.search(r"\d+", text)
    return m is not None and m.group(0) == key


def _cache_name(model) -> str:
    """The forward's name for the cache: `cache` where it takes one (transformers 5.24 on,
    which deprecates past_key_values), else past_key_values."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def greedy_answer(model, ids: list[int], device, steps: int = ANSWER_TOKENS, chunk: int = 4096,
                  recurrent: bool = True, key_ids: list[int] | None = None) -> tuple[list[int], float | None]:
    """(greedy continuation of `ids`, key_nats(...) of `key_ids` or None). recurrent: a GLA
    student, prefilled `chunk` tokens at a time through its recurrent state (constant memory);
    else a Hugging Face causal LM with its own KV cache, prefilled in one forward."""
    x = torch.tensor([ids], device=device)
    name = _cache_name(model)
    if recurrent:
        from glaswap.models.modeling_glaswap import GLASwapCache

        cache = GLASwapCache(model.config.num_hidden_layers)
        for a in range(0, x.shape[1], chunk):
            logits = model(input_ids=x[:, a:a + chunk], **{name: cache}, use_cache=True, logits_to_keep=1).logits
    else:  # a Hugging Face causal LM with its KV cache
        out = model(input_ids=x, use_cache=True, logits_to_keep=1)
        cache, logits = out.past_key_values, out.logits
    nats = None
    if key_ids:  # read the key from a copy of the prompt's cache, then answer from the cache itself
        rest = torch.tensor([key_ids[:-1]], device=device)
        later = model(input_ids=rest, **{name: copy.deepcopy(cache)}, use_cache=True).logits if len(rest[0]) else None
        nats = key_nats(logits[:, -1:] if later is None else torch.cat([logits[:, -1:], later], 1), key_ids)
    new = []
    for _ in range(steps):
        token = logits[:, -1:].argmax(-1)
        new.append(int(token))
        logits = model(input_ids=token, **{name: cache}, use_cache=True).logits
    return new, nats


def key_nats(logits: torch.Tensor, key_ids: list[int]) -> float:
    """-log p(key | prompt) in nats: logits [1, n, V] where row i predicts key_ids[i]. A
    5-digit key drawn at random costs log(90000) = 11.4 nats to a model that only knows it is
    five digits; 0 to one that has read it back."""
    logp = torch.log_softmax(logits[0].float(), dim=-1)
    return float(-logp[torch.arange(len(key_ids), device=logp.device),
                       torch.tensor(key_ids, device=logp.device)].sum())


@torch.no_grad()
def _greedy_no_cache(model, ids, device, steps=ANSWER_TOKENS, key_ids=None):
    x = torch.tensor([ids], device=device)
    nats = None
    if key_ids:
        full = torch.tensor([ids + key_ids[:-1]], device=device)
        nats = key_nats(model(input_ids=full, use_cache=False, logits_to_keep=len(key_ids)).logits, key_ids)
    new = []
    for _ in range(steps):
        token = model(input_ids=x, use_cache=False, logits_to_keep=1).logits[:, -1:].argmax(-1)
        new.append(int(token))
        x = torch.cat([x, token], dim=1)
    return new, nats


def passkey(model_dir, lengths=(1024, 2048, 4096, 8192, 16384, 32768), depths=(0.0, 0.25, 0.5, 0.75, 1.0),
            trials: int = 2, teacher: str = "auto", seed: int = 0, out=None, device: str = "auto",
            dtype: str = "auto", trust_remote_code: bool = False, filler=None, sparse_cache: int | None = None,
            log=print) -> dict:
    """Passkey accuracy of MODEL and its teacher (teacher=None: the student alone) by length and
    depth; writes JSON and a heatmap PNG to `out` (default MODEL/eval). filler: a text file
    whose tokens fill the prompts instead of the repeated FILLER sentences (each key at its own
    seeded place in the text). sparse_cache: the student's sparse cache for this run (None: as
    saved)."""
    if trials < 1:
        raise GlaswapError(f"--trials {trials} must be at least 1")
    if not lengths or min(lengths) < 1:
        raise GlaswapError("pass --lengths with at least one length of 1 token or more")
    model_dir = Path(model_dir)
    run = open_model(model_dir, device, dtype, teacher, sparse_cache, trust_remote_code=trust_remote_code,
                     before_load=lambda tok: _filler_ids(tok, filler) if filler is not None else None,
                     writes=Path(out) if out is not None else model_dir / "eval", log=log)
    dev, dt, tok, student, teacher_model = run.device, run.dtype, run.tokenizer, run.student, run.teacher
    t_desc, text_ids = run.teacher_desc, run.prepared
    if dev.type == "cuda":
        from glaswap.decode_graph import enable_decode_graph

        enable_decode_graph(student)    # decode steps and a sparse cache's prompt blocks from CUDA graphs
    rng = np.random.default_rng(seed)
    keys = {(L, d): [str(k) for k in rng.integers(10000, 100000, size=trials)] for L in lengths for d in depths}
    # where each key's filler starts in the text (drawn after the keys: the keys do not change)
    offsets = {c: [int(o) for o in rng.integers(0, len(text_ids), size=trials)] for c in keys} if text_ids else None
    roles = ["student"] + (["teacher"] if teacher is not None else [])
    cells = []
    started = time.time()
    try:
        _run_cells(cells, student, teacher_model, tok, keys, lengths, depths, roles, dev, started, log,
                   text_ids, offsets)
    except KeyboardInterrupt:
        if not cells:
            raise
        log(f"interrupted: keeping the {len(cells)} of {len(lengths) * len(depths)} cells measured")
        _write_passkey(_result(model_dir, t_desc, lengths, depths, trials, seed, dev, dt, cells, started, False,
                               filler, student.config.sparse_cache), model_dir, out, log)
        raise
    return _write_passkey(_result(model_dir, t_desc, lengths, depths, trials, seed, dev, dt, cells, started, True,
                                  filler, student.config.sparse_cache), model_dir, out, log)


def _filler_ids(tokenizer, path) -> list[int]:
    try:
        text = read_text_file(path)
    except GlaswapError as e:
        raise GlaswapError(f"--filler: {e}") from None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < 64:
        raise GlaswapError(f"--filler {path} has {len(ids)} tokens; pass a text of at least 64")
    return ids


def _run_cells(cells, student, teacher_model, tok, keys, lengths, depths, roles, dev, started, log,
               text_ids=None, offsets=None):
    """Appends one finished cell (length, depth) after another to `cells`."""
    teacher = "teacher" in roles
    for L in lengths:
        for d in depths:
            cell = {"length": L, "depth": d, "keys": keys[(L, d)]}
            answers, nats = {r: [] for r in roles}, {r: [] for r in roles}
            cell_started = last_note = time.time()
            for n, key in enumerate(keys[(L, d)]):
                if n and time.time() - last_note > 30:   # a long cell on the CPU: say where it is
                    last_note = time.time()
                    log(f"length {L} depth {d:g}: key {n + 1} of {len(keys[(L, d)])} "
                        f"({last_note - cell_started:.0f}s in this cell)")
                ids = build_prompt(tok, L, d, key, text_ids, offsets[(L, d)][n] if offsets else 0)
                key_ids = key_tokens(tok, key)
                got = {"student": greedy_answer(student, ids, dev, key_ids=key_ids)}
                if teacher:
                    if teacher_model is None:
                        with student.attention_mode("softmax"):
                            got["teacher"] = _greedy_no_cache(student, ids, dev, key_ids=key_ids)
                    else:
                        got["teacher"] = greedy_answer(teacher_model, ids, dev, recurrent=False, key_ids=key_ids)
                for r in roles:
                    answers[r].append(tok.decode(got[r][0]))
                    nats[r].append(got[r][1])
            cell["tokens"] = len(ids)
            for r in roles:
                cell[r] = {"accuracy": float(np.mean([answer_is_key(a, k) for a, k in zip(answers[r], cell["keys"])])),
                           "key_nats": float(np.mean(nats[r])), "answers": answers[r]}
            cells.append(cell)
            log(f"length {L} depth {d:g}: " + ", ".join(f"{r} {cell[r]['accuracy']:.2f} ({cell[r]['key_nats']:.1f} nats)"
                                                         for r in roles) + f"  ({time.time() - started:.0f}s elapsed)")


def _result(model_dir, t_desc, lengths, depths, trials, seed, dev, dt, cells, started, complete: bool,
            filler, sparse_cache: int) -> dict:
    """The JSON record; `complete` is False for a run stopped early (the cells it finished)."""
    return {"model": str(model_dir), "teacher": t_desc, "lengths": list(lengths), "depths": list(depths),
            "trials": trials, "seed": seed, "sparse_cache": sparse_cache,
            "filler": str(filler) if filler is not None else None,   # None: the repeated FILLER sentences
            "device": str(dev), "dtype": str(dt).replace("torch.", ""),
            "cells": cells, "complete": complete, "seconds": round(time.time() - started, 2),
            "versions": versions()}


def _write_passkey(result: dict, model_dir: Path, out, log) -> dict:
    """passkey.json and passkey.png (atomically) and the table on the log."""
    out = Path(out) if out is not None else model_dir / "eval"
    has_plot = importlib.util.find_spec("matplotlib") is not None
    try:
        atomic_write(out / "passkey.json", lambda p: p.write_text(json.dumps(result, indent=2) + "\n"))
        if has_plot:
            atomic_write(out / "passkey.png", lambda p: plot_passkey(result, p))
    except OSError as e:
        raise GlaswapError(f"could not write the results to {out} ({e.strerror or e}); pass --out DIR "
                           f"to a writable folder")
    log(format_passkey(result))
    log(f"wrote {out / 'passkey.json'}" + (f" and {out / 'passkey.png'}" if has_plot else " (no PNG: pip install matplotlib)"))
    return result


def accuracy_grid(result: dict, role: str, field: str = "accuracy") -> np.ndarray:
    """[lengths, depths] of one role's `field` (accuracy or key_nats; NaN where an interrupted
    run has no cell, or a result written before the field existed)."""
    at = {(c["length"], c["depth"]): c[role].get(field, np.nan) for c in result["cells"]}
    return np.array([[at.get((L, d), np.nan) for d in result["depths"]] for L in result["lengths"]], dtype=float)


def _fmt_accuracy(x) -> str:
    return "-" if np.isnan(x) else f"{x:.2f}"


def _fmt_nats(x) -> str:
    return "-" if np.isnan(x) else f"{x:.1f}"


def _row_mean(row: np.ndarray) -> float:
    return float(np.mean(row[~np.isnan(row)])) if (~np.isnan(row)).any() else float("nan")


def _table(result: dict, roles: list[str], field: str, fmt) -> list[str]:
    grids = {r: accuracy_grid(result, r, field) for r in roles}
    head = ["length"] + [f"depth {d:g}" for d in result["depths"]] + ["mean"]
    rows = [head]
    for i, L in enumerate(result["lengths"]):
        cells = ["/".join(fmt(grids[r][i, j]) for r in roles) for j in range(len(result["depths"]))]
        rows.append([str(L)] + cells + ["/".join(fmt(_row_mean(grids[r][i])) for r in roles)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def format_passkey(result: dict) -> str:
    """The accuracy table and, where the cells have it, the key's nats (-log p of the key
    read back after the question: a graded view of retrieval where greedy answers are 0 or 1)."""
    roles = [r for r in ("student", "teacher") if r in result["cells"][0]]
    n = result["trials"]
    lines = [f"Passkey accuracy ({' / '.join(roles)}), {n} key{'s' if n != 1 else ''} per cell, greedy, filler: "
             + (result["filler"] if result.get("filler") else "the built-in repeated sentences")
             + ("" if result.get("complete", True) else "; interrupted, - = not measured")]
    lines += _table(result, roles, "accuracy", _fmt_accuracy)
    if any("key_nats" in c[r] for c in result["cells"] for r in roles):
        lines += ["", f"Nats of the key ({' / '.join(roles)}), mean per cell: -log p(key | prompt); "
                      f"a random 5-digit guess costs {math.log(90000):.1f}"]
        lines += _table(result, roles, "key_nats", _fmt_nats)
    return "\n".join(lines)


def plot_passkey(result: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    roles = [r for r in ("student", "teacher") if r in result["cells"][0]]
    fig, axes = plt.subplots(1, len(roles), figsize=(4.8 * len(roles), 4), dpi=120, squeeze=False,
                             constrained_layout=True)
    for ax, role in zip(axes[0], roles):
        grid = accuracy_grid(result, role)
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        ax.set_xticks(range(len(result["depths"])), [f"{d:g}" for d in result["depths"]])
        ax.set_yticks(range(len(result["lengths"])), [str(L) for L in result["lengths"]])
        ax.set_xlabel("depth of the key")
        if ax is axes[0][0]:   # the panels share their rows
            ax.set_ylabel("prompt length (tokens)")
        ax.set_title(f"{'GLA model' if role == 'student' else 'teacher'}: passkey accuracy", fontsize=10)
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                ax.text(j, i, _fmt_accuracy(grid[i, j]), ha="center", va="center",
                        color="white" if not grid[i, j] >= 0.5 else "black", fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    fig.savefig(path, format="png")
    plt.close(fig)
