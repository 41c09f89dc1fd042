"""`glaswap eval`: what a converted model costs in quality, next to its teacher.

Student (GLA) and teacher read identical windows of the same token ids: sliding-window
perplexity where every token is scored at most once (context N, stride S; with S < N the
first N - S tokens of a window are context only). The student is also run "stateful": it
reads each document in one pass, carrying its recurrent state from chunk to chunk, and is
scored on the very same tokens; a teacher cannot do that beyond its context window.

Figures: token perplexity and bits per byte, per file and overall, mean KL(teacher ||
student) per token, and the mean loss at each position of the window (also drawn as a PNG).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from glaswap.errors import GlaswapError
from glaswap.longcontext import (by_absolute_position, format_by_position, one_pass_nll, plot_absolute,
                                 teacher_positions)
from glaswap.runtime import atomic_write, open_model, read_text_file, versions
from glaswap.scoring import perplexity, token_kl, token_nll

ROLES = ("student", "teacher", "stateful")


# --------------------------------------------------------------------------- windows
def windows(n: int, context: int, stride: int, align_last: bool = False) -> list[tuple[int, int, int]]:
    """(begin, end, first scored token) of each window over n tokens.

    Window w reads tokens [begin, end) and scores tokens [first, end): those no earlier
    window scored. A token is predicted from the tokens before it in its window, so the
    first token of the document, and with stride == context the first token of every
    window, is never scored. `align_last`: the last window ends at n with a full context,
    as lm-eval's rolling windows do, instead of starting a stride after the one before.
    """
    out, begin, prev_end = [], 0, 0
    while True:
        end = min(begin + context, n)
        if align_last and end == n:
            begin = max(0, n - context)
        first = max(prev_end, begin + 1)
        if first < end:
            out.append((begin, end, first))
        prev_end = end
        if end >= n:
            return out
        begin += stride


def token_bytes(text: str, tokenizer, ids, offsets) -> np.ndarray:
    """UTF-8 bytes each token accounts for: from the end of the previous token to its end
    (so whitespace between tokens belongs to the next one and the bytes add up)."""
    if offsets is None:  # a slow tokenizer: decode token by token (close, not exact, for SentencePiece)
        return np.array([len(tokenizer.decode([i]).encode()) for i in ids], dtype=np.int64)
    cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    width = 1 + (cps >= 0x80).astype(np.int64) + (cps >= 0x800) + (cps >= 0x10000)
    cum = np.concatenate([[0], np.cumsum(width)])                          # byte offset of each char
    ends = np.maximum.accumulate(np.array([e for _, e in offsets], dtype=np.int64))
    return np.diff(np.concatenate([[0], cum[ends]]))


def bos_token_id(tokenizer) -> int:
    """The token lm-eval puts before a text: BOS, or EOS where the tokenizer has no BOS."""
    for token_id in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return token_id
    raise GlaswapError("the tokenizer has neither a BOS nor an EOS token to put first; run without --bos")


class Document:
    """One text file as token ids, with what each token is worth in bytes and where it is scored.

    bos: the ids start with bos_token_id(tokenizer), and every token of the text is scored,
    as lm-eval's loglikelihood_rolling does with max_length = context: a window holds
    context + 1 ids, the model predicts each of the last `context` from the ids before it
    (its first id, and with stride < context more of them, scored by an earlier window or
    BOS, are context only), the next window starts `stride` later, and the last one is
    aligned to the end."""

    def __init__(self, path, text, tokenizer, max_tokens, context, stride, bos=False):
        self.path = str(path)
        fast = getattr(tokenizer, "is_fast", False)
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=fast)
        ids = enc["input_ids"]
        offsets = enc.get("offset_mapping") if fast else None
        if max_tokens:
            ids = ids[:max_tokens]
            offsets = offsets[:max_tokens] if offsets is not None else None
        if len(ids) < 2 - bos:
            raise GlaswapError(f"{path} has fewer than {2 - bos} tokens; nothing to score, pass a longer text")
        nbytes = token_bytes(text, tokenizer, ids, offsets)
        if bos:
            ids, nbytes = [bos_token_id(tokenizer)] + list(ids), np.concatenate([[0], nbytes])
        self.ids = torch.tensor(ids, dtype=torch.long)
        self.bytes = nbytes
        self.windows = windows(len(ids), context + 1, stride, align_last=True) if bos else \
            windows(len(ids), context, stride)
        n = len(ids)
        self.scored = np.zeros(n, dtype=bool)
        self.position = np.full(n, -1, dtype=np.int64)     # position of each scored token in its window
        for begin, end, first in self.windows:
            self.scored[first:end] = True
            self.position[first:end] = np.arange(first - begin, end - begin)
        self.nll = {role: np.full(n, np.nan) for role in ROLES}
        self.kl = np.full(n, np.nan)

    def __len__(self):
        return len(self.ids)


# --------------------------------------------------------------------------- scoring
@torch.no_grad()
def _score_windows(docs, student, teacher, batch_size, device, bar):
    """Student and teacher on identical windows, batch_size windows at a time (right-padded:
    attention is causal, so padding after a window cannot change its tokens)."""
    jobs = [(d, w) for d in docs for w in d.windows]
    for i in range(0, len(jobs), batch_size):
        batch = jobs[i:i + batch_size]
        width = max(end - begin for _, (begin, end, _) in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for r, (d, (begin, end, _)) in enumerate(batch):
            ids[r, :end - begin] = d.ids[begin:end]
        ids = ids.to(device)
        s_logits = student(input_ids=ids, use_cache=False).logits
        bar.update(ids.numel())
        if teacher is None:
            with student.attention_mode("softmax"):
                t_logits = student(input_ids=ids, use_cache=False).logits
        else:
            t_logits = teacher(input_ids=ids, use_cache=False).logits
        bar.update(ids.numel())
        for r, (d, (begin, end, first)) in enumerate(batch):
            rows = slice(first - 1 - begin, end - 1 - begin)      # logits at j - 1 predict token j
            target = ids[r, first - begin:end - begin]
            s, t = s_logits[r, rows], t_logits[r, rows]
            d.nll["student"][first:end] = token_nll(s, target).cpu().numpy()
            d.nll["teacher"][first:end] = token_nll(t, target).cpu().numpy()
            d.kl[first:end] = token_kl(t, s).cpu().numpy()


# The stateful column reads a document in calls of at least context x batch tokens. On a GPU
# each call is bound by its launches more than by its tokens, so calls are made as long as
# the logits of one allow: about this many numbers (4 GiB in float32).
STATEFUL_LOGITS = 2 ** 30


def stateful_chunk(context: int, batch_size: int, vocab: int, device) -> int:
    """Tokens per call of the stateful column: context x batch_size, and on CUDA up to
    STATEFUL_LOGITS // vocab (the prompt is read through the kernels, so a longer call costs
    its tokens, not another round of launches)."""
    chunk = context * batch_size
    if torch.device(device).type == "cuda":
        chunk = max(chunk, STATEFUL_LOGITS // max(1, vocab))
    return chunk


@torch.no_grad()
def _score_stateful(docs, student, chunk, device, bar):
    """The student reads each document once, chunk by chunk, its recurrent state carried over."""
    from glaswap.models.modeling_glaswap import GLASwapCache

    bar.set_postfix_str("one pass", refresh=False)
    for d in docs:
        cache = GLASwapCache(student.config.num_hidden_layers)
        nll = np.full(len(d), np.nan)
        last = None                                    # the previous chunk's last logits row
        for begin in range(0, len(d), chunk):
            ids = d.ids[begin:begin + chunk][None].to(device)
            logits = student(input_ids=ids, past_key_values=cache, use_cache=True).logits[0]
            if last is not None:
                logits = torch.cat([last, logits])
                preds, targets = logits[:-1], d.ids[begin:begin + ids.shape[1]]
                nll[begin:begin + ids.shape[1]] = token_nll(preds, targets.to(device)).cpu().numpy()
            else:
                nll[1:ids.shape[1]] = token_nll(logits[:-1], ids[0, 1:]).cpu().numpy()
            last = logits[-1:]
            bar.update(ids.shape[1])
        d.onepass = nll
        d.nll["stateful"][d.scored] = nll[d.scored]


def _score_teacher_one_pass(docs, student, teacher, device, bar) -> tuple[list[np.ndarray], int]:
    """The teacher reads each document's first `max positions` tokens in one forward pass."""
    limit = teacher_positions(teacher, student)
    bar.set_postfix_str("teacher, one pass", refresh=False)
    out = []
    for d in docs:
        ids = d.ids[:limit]
        if teacher is None:
            with student.attention_mode("softmax"):
                nll = one_pass_nll(student, ids, device)
        else:
            nll = one_pass_nll(teacher, ids, device)
        out.append(np.concatenate([nll, np.full(len(d) - len(ids), np.nan)]))
        bar.update(len(ids))
    return out, limit


def _summary(nll_sum, tokens, nbytes):
    return {"nll": nll_sum / max(tokens, 1), "ppl": perplexity(nll_sum, tokens),
            "bpb": nll_sum / math.log(2) / max(nbytes, 1)}


def _file_figures(d: Document) -> dict:
    m = d.scored
    tokens, nbytes = int(m.sum()), int(d.bytes[m].sum())
    out = {"path": d.path, "tokens": tokens, "bytes": nbytes, "windows": len(d.windows)}
    for role in ROLES:
        out[role] = _summary(float(d.nll[role][m].sum()), tokens, nbytes)
    out["kl"] = float(d.kl[m].mean())
    return out


def _overall(docs) -> dict:
    tokens = sum(int(d.scored.sum()) for d in docs)
    nbytes = sum(int(d.bytes[d.scored].sum()) for d in docs)
    out = {"tokens": tokens, "bytes": nbytes}
    for role in ROLES:
        out[role] = _summary(sum(float(d.nll[role][d.scored].sum()) for d in docs), tokens, nbytes)
    out["kl"] = sum(float(d.kl[d.scored].sum()) for d in docs) / max(tokens, 1)
    return out


def _by_position(docs, context) -> dict:
    count = np.zeros(context, dtype=np.int64)
    sums = {role: np.zeros(context) for role in ROLES}
    for d in docs:
        pos = d.position[d.scored]
        np.add.at(count, pos, 1)
        for role in ROLES:
            np.add.at(sums[role], pos, d.nll[role][d.scored])
    out = {"position": list(range(context)), "count": count.tolist()}
    for role in ROLES:
        mean = np.where(count > 0, sums[role] / np.maximum(count, 1), np.nan)
        out[role] = [None if np.isnan(x) else float(x) for x in mean]
    return out


# --------------------------------------------------------------------------- entry point
def evaluate(model_dir, texts, teacher: str = "auto", context: int = 512, stride: int | None = None,
             max_tokens: int | None = None, batch_size: int = 1, out=None, device: str = "auto",
             dtype: str = "auto", progress: bool = True, trust_remote_code: bool = False, log=print,
             bos: bool = False, by_position: bool = False, first_bin: int = 1024,
             sparse_cache: int | None = None) -> dict:
    """Evaluate a glaswap model against its teacher on text files; returns every figure.

    teacher: "auto" (the source recorded in glaswap.json), "self" (the model's own softmax
    attention: the teacher before distillation, no second model loaded) or a path to a
    Hugging Face folder or .gguf file. max_tokens: use at most this many tokens of each file.
    bos: put BOS first and score every token, as lm-eval's loglikelihood_rolling does with
    max_length = context (see Document).
    Writes a JSON file and a PNG of the loss by position to `out` (default MODEL/eval).
    by_position: also read each document in one pass with the teacher (up to its positions) and
    report both models' loss in doubling bins of absolute position, the first `first_bin` wide
    (glaswap.longcontext), with its own PNG.
    trust_remote_code: run Python code that the tokenizer's or the teacher's folder ships.
    """
    from tqdm.auto import tqdm

    model_dir = Path(model_dir)
    stride = context if stride is None else stride
    if context < 2:
        raise GlaswapError(f"--context {context} is too small; use at least 2 tokens")
    if not 1 <= stride <= context:
        raise GlaswapError(f"--stride {stride} must be between 1 and the context ({context})")
    if batch_size < 1:
        raise GlaswapError(f"--batch-size {batch_size} must be at least 1")
    if max_tokens is not None and max_tokens < 2:
        raise GlaswapError(f"--max-tokens {max_tokens} is too small; use at least 2")
    if not texts:
        raise GlaswapError("no text files given; pass --text FILE [FILE ...]")
    if first_bin < 1:
        raise GlaswapError(f"--first-bin {first_bin} must be at least 1 token")
    contents = [(p, read_text_file(p)) for p in texts]   # all bad input is reported before any loading
    out = Path(out) if out is not None else model_dir / "eval"

    def documents(tok):
        return [Document(p, text, tok, max_tokens, context, stride, bos) for p, text in contents]

    started = time.time()
    run = open_model(model_dir, device, dtype, teacher, sparse_cache, trust_remote_code=trust_remote_code,
                     before_load=documents, writes=out, log=log)
    dev, dt, student, teacher_model, docs = run.device, run.dtype, run.student, run.teacher, run.prepared
    if dev.type == "cuda" and student.config.window and student.config.sparse_cache:
        from glaswap.decode_graph import enable_decode_graph

        enable_decode_graph(student)    # the stateful column's sparse-cache blocks from a CUDA graph

    window_tokens = sum(end - begin for d in docs for begin, end, _ in d.windows)
    one_pass = sum(len(d) for d in docs)
    total = 2 * window_tokens + one_pass * (2 if by_position else 1)
    log(f"scoring {window_tokens:,} tokens in windows of {context} (model and teacher), then {one_pass:,} in one pass "
        f"({'model and teacher' if by_position else 'model'}): {total:,} tokens read in all")
    t0 = time.time()
    parts = {}

    def timed(part, tokens, fn, *args):
        """fn(*args), its wall time and tokens read kept under `part` (the GPU finished first)."""
        begin = time.time()
        out = fn(*args)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        took = time.time() - begin
        parts[part] = {"tokens": tokens, "seconds": round(took, 3), "tokens_per_second": round(tokens / max(took, 1e-9), 1)}
        return out

    with tqdm(total=total, unit="tok", unit_scale=True, disable=not progress, dynamic_ncols=True,
              desc="tokens read") as bar:
        timed("windows", 2 * window_tokens, _score_windows, docs, student, teacher_model, batch_size, dev, bar)
        timed("stateful", one_pass, _score_stateful, docs, student,
              stateful_chunk(context, batch_size, student.config.vocab_size, dev), dev, bar)
        if by_position:
            teacher_nll, limit = timed("teacher_one_pass", one_pass, _score_teacher_one_pass, docs, student,
                                       teacher_model, dev, bar)
    seconds = time.time() - t0

    result = {
        "model": str(model_dir),
        "teacher": run.teacher_desc,
        "settings": {"context": context, "stride": stride, "max_tokens": max_tokens, "batch_size": batch_size,
                     "device": str(dev), "dtype": str(dt).replace("torch.", ""), "bos": bos},
        "files": [_file_figures(d) for d in docs],
        "overall": _overall(docs),
        "by_position": _by_position(docs, context + bos),   # with bos a window predicts `context` tokens
        "by_absolute_position": by_absolute_position(docs, first_bin, teacher_nll, limit) if by_position else None,
        "seconds": round(seconds, 2),
        "tokens_per_second": round(total / max(seconds, 1e-9), 1),
        "speed": parts,      # windows: model and teacher together; stateful: the model alone
        "load_seconds": round(t0 - started, 2),
    }
    result["versions"] = versions()
    name = _run_name(docs, context, stride, out) + ("-bos" if bos else "")
    has_plot = importlib.util.find_spec("matplotlib") is not None
    result["outputs"] = {"json": str(out / f"{name}.json"),
                         "png": str(out / f"{name}.png") if has_plot else "(no PNG: pip install matplotlib)"}
    if by_position and has_plot:
        result["outputs"]["positions_png"] = str(out / f"{name}-positions.png")
    _write_outputs(result, out, name, has_plot)
    log(format_table(result))
    if by_position:
        log(format_by_position(result["by_absolute_position"]))
    written = [p for k, p in result["outputs"].items() if not p.startswith("(")]
    log(f"wrote {', '.join(written[:-1])} and {written[-1]}" if len(written) > 1 else f"wrote {written[0]}")
    return result


def _run_name(docs, context, stride, out: Path):
    """eval-<first file>[-and-N-more]-context<C>[-stride<S>]; when `out` already holds that name
    for other files (two files of one name in two folders), a short hash of their paths follows,
    so one result never overwrites another's."""
    more = f"-and-{len(docs) - 1}-more" if len(docs) > 1 else ""
    name = f"eval-{Path(docs[0].path).stem}{more}-context{context}" + (f"-stride{stride}" if stride != context else "")
    paths = [str(Path(d.path).resolve()) for d in docs]
    try:
        earlier = json.loads((out / f"{name}.json").read_text())
        same = [str(Path(f["path"]).resolve()) for f in earlier.get("files", [])] == paths
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        same = True   # nothing there (or unreadable): the plain name
    if not same:
        name += "-" + hashlib.sha1("\n".join(paths).encode()).hexdigest()[:6]
    return name


# --------------------------------------------------------------------------- output
def format_table(result: dict) -> str:
    rows = [("file", "tokens", "teacher ppl", "student ppl", "stateful ppl", "teacher bpb", "student bpb",
             "stateful bpb", "KL")]

    def row(name, f):
        return (name, str(f["tokens"]), f"{f['teacher']['ppl']:.2f}", f"{f['student']['ppl']:.2f}",
                f"{f['stateful']['ppl']:.2f}", f"{f['teacher']['bpb']:.3f}", f"{f['student']['bpb']:.3f}",
                f"{f['stateful']['bpb']:.3f}", f"{f['kl']:.3f}")

    for f in result["files"]:
        rows.append(row(Path(f["path"]).name, f))
    if len(result["files"]) > 1:
        rows.append(row("all", result["overall"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    s = result["settings"]
    teacher = result["teacher"].get("spec", "?")
    lines.append(f"context {s['context']}, stride {s['stride']}{', BOS first' if s.get('bos') else ''}, "
                 f"teacher {teacher}; stateful = the model reading "
                 f"each file in one pass; KL = mean KL(teacher || model) per token, nats")
    speed = result.get("speed") or {}
    if "windows" in speed and "stateful" in speed:
        w, st = speed["windows"]["tokens_per_second"], speed["stateful"]["tokens_per_second"]
        lines.append(f"read {w:,.0f} tokens/s in windows (model and teacher), {st:,.0f} tokens/s stateful "
                     f"({st / max(w, 1e-9):.2f}x)")
    return "\n".join(lines)


def _write_outputs(result, out: Path, name: str, plot: bool = True):
    try:
        atomic_write(out / f"{name}.json",
                      lambda p: p.write_text(json.dumps(result, indent=2, allow_nan=False) + "\n"))
        if plot:
            atomic_write(out / f"{name}.png", lambda p: plot_by_position(result, p))
            if result.get("by_absolute_position"):
                title = (f"{Path(result['model']).name}: loss by absolute position "
                         f"({result['overall']['tokens']} tokens)")
                atomic_write(out / f"{name}-positions.png",
                             lambda p: plot_absolute(result["by_absolute_position"], title, p))
    except OSError as e:
        raise GlaswapError(f"could not write the results to {out} ({e.strerror or e}); pass --out DIR "
                           f"to a writable folder")


def plot_by_position(result: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pos = result["by_position"]
    count = np.array(pos["count"], dtype=float)
    # Bins of `width` positions (token-weighted means): single positions hold few tokens each.
    width = max(1, len(count) // 64)
    starts = np.arange(0, len(count), width)
    n = np.add.reduceat(count, starts)
    centre = starts + (np.minimum(starts + width, len(count)) - 1 - starts) / 2
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    labels = {"teacher": "teacher (windowed)", "student": "GLA model (windowed)",
              "stateful": "GLA model (stateful, whole document)"}
    for role, style in (("teacher", "-"), ("student", "-"), ("stateful", "--")):
        loss = np.array([0.0 if y is None else y for y in pos[role]])
        sums = np.add.reduceat(loss * count, starts)
        ok = n > 0
        ax.plot(centre[ok], sums[ok] / n[ok], style, label=labels[role], linewidth=1.2)
    s = result["settings"]
    ax.set_xlabel("position in the context window (tokens)" + (f", bins of {width}" if width > 1 else ""))
    ax.set_ylabel("mean loss (nats / token)")
    ax.set_title(f"{Path(result['model']).name}: loss by position (context {s['context']}, stride {s['stride']}, "
                 f"{result['overall']['tokens']} tokens)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)
