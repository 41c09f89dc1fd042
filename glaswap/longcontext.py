"""Loss by absolute position: does a converted model keep working past its training length?

`glaswap eval --by-position` reads each document in one pass with the student (its recurrent
state carried from chunk to chunk) and with the teacher (up to the teacher's maximum
positions), and reports the mean loss in doubling bins of absolute position: 0-1K, 1K-2K,
2K-4K, ... Both models' windowed losses on the same tokens stand beside it: a one-pass loss
above the windowed one means that more context hurts, and the teacher's two columns show how
much of a gap between the models lies inside a window and how much in the use of longer
context.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from glaswap.scoring import token_nll


def position_bins(n: int, first: int = 1024) -> list[tuple[int, int]]:
    """[lo, hi) bins over n positions: [0, first), [first, 2 first), [2 first, 4 first), ...,
    the last one cut at n."""
    if first < 1:
        raise ValueError("the first bin needs at least one position")
    bins, lo, hi = [], 0, first
    while lo < n:
        bins.append((lo, min(hi, n)))
        lo, hi = hi, 2 * hi
    return bins


def bin_label(lo: int, hi: int) -> str:
    def short(x):
        if x and x % 1024 == 0:
            return f"{x // 1024}K"
        return f"{x / 1024:.0f}K" if x >= 10240 else str(x)   # a last bin cut at n: 64K-99K
    return f"{short(lo)}-{short(hi)}"


def bin_means(nlls: list[np.ndarray], bins) -> list[tuple[float | None, int]]:
    """(mean of the finite values, their count) per bin, pooled over documents by absolute
    position; NaN marks an unscored token."""
    out = []
    for lo, hi in bins:
        vals = np.concatenate([x[lo:hi] for x in nlls]) if nlls else np.array([])
        vals = vals[np.isfinite(vals)]
        out.append((float(vals.mean()) if vals.size else None, int(vals.size)))
    return out


@torch.no_grad()
def one_pass_nll(model, ids: torch.Tensor, device, rows: int = 1024) -> np.ndarray:
    """Per-token NLL of one forward pass over `ids` [T] (NaN for token 0). The vocabulary
    projection runs `rows` positions at a time, so the full logits never exist at once."""
    x = ids[None].to(device)
    nll = np.full(len(ids), np.nan)
    if not (hasattr(model, "model") and hasattr(model, "lm_head")):   # not a *ForCausalLM layout
        logits = model(input_ids=x, use_cache=False).logits[0, :-1]
        nll[1:] = token_nll(logits, x[0, 1:]).cpu().numpy()
        return nll
    hidden = model.model(input_ids=x, use_cache=False).last_hidden_state[0]
    for a in range(0, len(ids) - 1, rows):
        b = min(a + rows, len(ids) - 1)
        logits = model.lm_head(hidden[a:b])
        nll[a + 1:b + 1] = token_nll(logits, x[0, a + 1:b + 1]).cpu().numpy()
    return nll


def teacher_positions(teacher_model, student) -> int:
    """How many positions the teacher was trained for (the student's copy for "self")."""
    cfg = (teacher_model if teacher_model is not None else student).config
    return int(getattr(cfg, "max_position_embeddings", 0) or 0) or 1 << 62


def by_absolute_position(docs, first_bin: int, teacher_nll: list[np.ndarray], teacher_max: int) -> dict:
    """The figures of `--by-position`: per bin, the student's and the teacher's one-pass and
    windowed loss, over every token of every document (windowed: those scored)."""
    n = max(len(d) for d in docs)
    bins = position_bins(n, first_bin)
    one = bin_means([d.onepass for d in docs], bins)
    tea = bin_means(teacher_nll, bins)
    win, t_win = (bin_means([np.where(d.scored, d.nll[role], np.nan) for d in docs], bins)
                  for role in ("student", "teacher"))
    rows = []
    for (lo, hi), (o, no), (w, nw), (t, nt), (tw, _) in zip(bins, one, win, tea, t_win):
        rows.append({"lo": lo, "hi": hi, "label": bin_label(lo, hi), "tokens": no, "student_one_pass": o,
                     "student_windowed": w, "windowed_tokens": nw, "teacher_one_pass": t, "teacher_tokens": nt,
                     "teacher_windowed": tw})
    return {"first_bin": first_bin, "teacher_positions": teacher_max, "bins": rows}


def format_by_position(fig: dict) -> str:
    head = ("positions", "tokens", "student one-pass", "student windowed", "teacher one-pass", "teacher windowed",
            "ppl ratio")
    rows = [head]

    def f(x):
        return "-" if x is None else f"{x:.3f}"

    for r in fig["bins"]:
        o, t = r["student_one_pass"], r["teacher_one_pass"]
        # the same tokens only: in a bin that straddles the teacher's positions it reads fewer
        same = o is not None and t is not None and r.get("teacher_tokens", r["tokens"]) == r["tokens"]
        ratio = f"{math.exp(o - t):.3f}" if same else "-"
        rows.append((r["label"], str(r["tokens"]), f(o), f(r["student_windowed"]), f(t), f(r["teacher_windowed"]),
                     ratio))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.append(f"mean loss (nats/token) by absolute position; one-pass = each document read once from its "
                 f"start; the teacher reads at most its {fig['teacher_positions']} positions; "
                 f"ppl ratio = student / teacher one-pass, where both read every token of the bin")
    return "\n".join(lines)


def plot_absolute(fig: dict, title: str, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = fig["bins"]
    x = np.arange(len(bins))   # one slot per bin: the doubling bins are evenly spaced, as on a log axis
    p, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for key, label, style in (("student_one_pass", "GLA model, one pass", "o-"),
                              ("student_windowed", "GLA model, windowed", "s--"),
                              ("teacher_one_pass", "teacher, one pass", "^-"),
                              ("teacher_windowed", "teacher, windowed", "v--")):
        y = np.array([np.nan if r[key] is None else r[key] for r in bins])
        ok = np.isfinite(y)
        if ok.any():
            ax.plot(x[ok], y[ok], style, label=label, linewidth=1.2)
    limit = fig["teacher_positions"]
    for i, r in enumerate(bins):   # the teacher's last position, placed inside its bin
        if r["lo"] <= limit < r["hi"]:
            ax.axvline(i - 0.5 + (limit - r["lo"]) / (r["hi"] - r["lo"]), color="grey", linewidth=0.8, linestyle=":")
    ax.set_xticks(x, [r["label"] for r in bins], fontsize=8, rotation=30, ha="right")
    ax.set_xlabel("absolute position (bins; dotted: the teacher's positions)")
    ax.set_ylabel("mean loss (nats / token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    p.tight_layout()
    p.savefig(path, format="png")
    plt.close(p)
