"""Generation with a converted model: streamed text (`glaswap generate`) and the decode
benchmark (`glaswap generate --bench`): prefill and decode time and memory of the GLA model,
eager and from CUDA graphs (glaswap.decode_graph), against its teacher's KV cache.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import time
from pathlib import Path

import torch

from glaswap.decode_graph import check_decode_graph, disable_decode_graph, enable_decode_graph, want_graph
from glaswap.errors import GlaswapError
from glaswap.models.modeling_glaswap import CACHE_NAME, cache_of
from glaswap.runtime import atomic_write, open_model, pick_device, versions

DEFAULT_CONTEXTS = (1024, 4096, 16384, 32768)
CPU_CONTEXTS = (64, 256)


# --------------------------------------------------------------------------- text generation
def generate_text(model_dir, prompt: str, max_new_tokens: int = 128, temperature: float = 0.0, seed: int = 0,
                  device: str = "auto", graph: str = "auto", stream: bool = True, trust_remote_code: bool = False,
                  sparse_cache: int | None = None, log=print) -> dict:
    """Generate from a prompt with the recurrent-state cache, streaming the text to stdout.
    trust_remote_code: run Python code that the tokenizer's folder ships."""
    from transformers import GenerationConfig, TextStreamer

    if not prompt or not prompt.strip():
        raise GlaswapError("the prompt is empty; pass --prompt TEXT")
    if max_new_tokens < 1:
        raise GlaswapError(f"--max-new-tokens {max_new_tokens} must be at least 1")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise GlaswapError(f"--temperature {temperature} must be a finite number >= 0 (0 is greedy)")
    use_graph = want_graph(graph, pick_device(device))
    run = open_model(model_dir, device, sparse_cache=sparse_cache, trust_remote_code=trust_remote_code, log=log)
    dev, tok, model = run.device, run.tokenizer, run.student
    runner = enable_decode_graph(model) if use_graph else None
    ids = tok(prompt, return_tensors="pt").to(dev)
    eos = model.generation_config.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                              temperature=temperature if temperature > 0 else None, top_k=None, top_p=None,
                              eos_token_id=eos, pad_token_id=pad)
    streamer = TextStreamer(tok, skip_prompt=True) if stream else None
    if stream:
        print(prompt, end="", flush=True)
    torch.manual_seed(seed)
    started = time.perf_counter()
    out = model.generate(**ids, generation_config=config, streamer=streamer)
    seconds = time.perf_counter() - started
    new = out[0, ids["input_ids"].shape[1]:]
    return {"text": tok.decode(new, skip_special_tokens=True), "new_tokens": int(new.numel()),
            "seconds": seconds, "tokens_per_second": new.numel() / max(seconds, 1e-9),
            "device": str(dev), "cuda_graph": runner is not None and runner.failed is None}


# --------------------------------------------------------------------------- decode benchmark
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device):
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _warm_prefill(model, prompt):
    """Read the prompt once untimed, as a process serving prompts of this length has: the
    first call of a length compiles and tunes kernels for it, which the timed read then
    does not count."""
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    del out
    _free(prompt.device)
    _sync(prompt.device)


@torch.no_grad()
def time_decode(model, prompt, new_tokens: int, warmup: int = 2) -> dict:
    """Prefill `prompt` [B, T], then time `new_tokens` greedy single-token steps.

    Works for a glaswap model (recurrent state) and any Hugging Face causal LM (its usual
    KV cache). Peak memory is measured over the decode steps only (weights, the cache, the
    step's temporaries); the prefill's own peak is reported apart, its time that of a second
    read of the prompt (the first, untimed, compiles the kernels for its length).
    `last_token`: each row's last greedy token, which any two ways of decoding the same model
    must agree on.
    """
    device = prompt.device
    _warm_prefill(model, prompt)
    _reset_peak(device)
    t0 = time.perf_counter()
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    cache = cache_of(out)
    token = out.logits[:, -1:].argmax(-1)
    _sync(device)
    prefill_s = time.perf_counter() - t0
    prefill_peak = _peak_gib(device)
    del out
    _reset_peak(device)
    for _ in range(warmup):
        token = model(input_ids=token, **{CACHE_NAME: cache}, use_cache=True).logits[:, -1:].argmax(-1)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        token = model(input_ids=token, **{CACHE_NAME: cache}, use_cache=True).logits[:, -1:].argmax(-1)
    _sync(device)
    seconds = time.perf_counter() - t0
    peak = _peak_gib(device)
    B = prompt.shape[0]
    last = token[:, 0].tolist()
    del cache, token
    _free(device)
    return _decode_result(B, seconds / new_tokens, peak, prefill_s, prefill_peak, last)


def _decode_result(batch, step_s, peak, prefill_s, prefill_peak, last, **extra) -> dict:
    ms = 1000 * step_s
    return {"ms_per_step": ms, "tokens_per_s": batch * 1000 / ms, "peak_gib": peak, "prefill_s": prefill_s,
            "prefill_peak_gib": prefill_peak, "last_token": last, **extra}


@torch.no_grad()
def time_decode_static(model, prompt, new_tokens: int, warmup: int = 2, graph: bool = True) -> dict:
    """A Hugging Face causal LM decoding as a user would run it for speed: a static KV cache
    (transformers' StaticCache, allocated once for the prompt and every new token) and, on
    CUDA with `graph`, each step replayed from one captured CUDA graph, which also feeds the
    step's token and position back into its inputs. Same measurements as `time_decode`."""
    from transformers import StaticCache

    device = prompt.device
    B, T = prompt.shape
    _warm_prefill(model, prompt)
    _reset_peak(device)
    t0 = time.perf_counter()
    # The prompt is read as usual (a static cache's full-length mask would make SDPA's prefill
    # quadratic in memory), then its keys and values are written into the static cache.
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1:].argmax(-1)
    cache = StaticCache(config=model.config, max_cache_len=T + warmup + new_tokens + 1)
    positions = {"cache_position": torch.arange(T, device=device)}
    for i, layer in enumerate(cache_of(out).layers):
        cache.update(layer.keys, layer.values, i, positions)
    _sync(device)
    prefill_s = time.perf_counter() - t0
    prefill_peak = _peak_gib(device)
    del out
    _free(device)
    _reset_peak(device)
    step_token, position = token.clone(), torch.tensor([T], device=device)

    def step():  # one token: its logits, then the next step's inputs in place
        nxt = model(input_ids=step_token, **{CACHE_NAME: cache}, cache_position=position,
                    use_cache=True).logits[:, -1:].argmax(-1)
        step_token.copy_(nxt)
        position.add_(1)

    replay, graphed = step, graph and device.type == "cuda"
    if graphed:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # capture needs its allocations warmed up off the main stream
            for _ in range(warmup):
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            step()
        replay = captured.replay
    else:
        for _ in range(warmup):
            step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        replay()
    _sync(device)
    seconds = time.perf_counter() - t0
    peak = _peak_gib(device)
    last = step_token[:, 0].tolist()
    del cache, replay
    _free(device)
    return _decode_result(B, seconds / new_tokens, peak, prefill_s, prefill_peak, last, graph=graphed)


def bench_decode(student, teacher=None, contexts=DEFAULT_CONTEXTS, batch_size: int = 1, new_tokens: int = 32,
                 graph: str = "auto", seed: int = 0, log=print) -> list[dict]:
    """Decode speed and memory of the GLA model (eager, and CUDA-graph on CUDA) and of the teacher
    with Hugging Face's dynamic KV cache and with a static one (CUDA-graph on CUDA), after a
    prefill of `context` random tokens, at each context. `speedup` is against the faster teacher."""
    device = student.lm_head.weight.device
    use_graph = want_graph(graph, device)
    student.set_attention_mode("gla")
    # Compile the kernels (Triton JIT, cuBLAS heuristics) before anything is timed.
    warm = torch.randint(0, student.config.vocab_size, (batch_size, 64)).to(device)
    for model in (student, teacher):
        if model is not None:
            time_decode(model, warm, 2, warmup=1)
    graph_check = None
    if use_graph:  # the graph path must compute what the eager path computes
        try:
            graph_check = check_decode_graph(student, warm)
        except Exception as e:  # report it and measure the eager path alone
            log(f"CUDA-graph decode failed ({type(e).__name__}: {e}); timing the eager path only")
            use_graph, graph_check = False, {"error": f"{type(e).__name__}: {e}"}
    if use_graph:
        log(f"CUDA-graph decode check: max |logit difference| vs eager {graph_check['max_abs_diff']:.3g} "
            f"(logits up to {graph_check['max_abs_logit']:.3g}), same next tokens: "
            f"{'yes' if graph_check['same_argmax'] else 'NO'}")
    rows = []
    for ctx in contexts:
        gen = torch.Generator().manual_seed(seed + ctx)
        prompt = torch.randint(0, student.config.vocab_size, (batch_size, ctx), generator=gen).to(device)
        row = {"context": ctx, "batch_size": batch_size, "new_tokens": new_tokens, "graph_check": graph_check}
        disable_decode_graph(student)
        row["student_eager"] = time_decode(student, prompt, new_tokens)
        row["student"] = row["student_eager"]
        if use_graph:
            enable_decode_graph(student, strict=True)
            try:
                row["student"] = row["student_graph"] = time_decode(student, prompt, new_tokens)
            except Exception as e:  # keep the eager figures; say why the graph path failed
                row["graph_error"] = f"{type(e).__name__}: {e}"
                log(f"CUDA-graph decode failed at context {ctx}: {row['graph_error']}")
            finally:
                disable_decode_graph(student)
        if teacher is not None:
            row["teacher"] = time_decode(teacher, prompt, new_tokens)
            try:
                row["teacher_static"] = time_decode_static(teacher, prompt, new_tokens)
            except Exception as e:  # a model whose cache cannot be static: the dynamic cache stays the baseline
                row["static_error"] = f"{type(e).__name__}: {e}"
                log(f"the teacher's static-cache decode failed at context {ctx}: {row['static_error']}")
                _free(device)
            best = max((row[k] for k in ("teacher", "teacher_static") if k in row), key=lambda t: t["tokens_per_s"])
            row["speedup"] = row["student"]["tokens_per_s"] / best["tokens_per_s"]
        rows.append(row)
        log(format_bench([row], header=not rows[:-1]))
    return rows


def format_bench(rows, header=True) -> str:
    """The benchmark table; tok/s counts every row of the batch, peaks are while decoding;
    speedup is against the faster of the teacher's two caches."""
    def gib(x):
        return "n/a" if x is None else f"{x:.2f}"

    cols = ("context", "GLA ms/tok", "tok/s", "peak GiB", "eager ms/tok", "prefill s", "eager prefill s",
            "teacher ms/tok", "peak GiB", "prefill s", "static ms/tok", "peak GiB", "speedup")
    lines = ["  ".join(f"{c:>{max(len(c), 8)}}" for c in cols)] if header else []
    for r in rows:
        s, e, t, st = r["student"], r["student_eager"], r.get("teacher"), r.get("teacher_static")
        cells = [str(r["context"]), f"{s['ms_per_step']:.2f}", f"{s['tokens_per_s']:.1f}", gib(s["peak_gib"]),
                 f"{e['ms_per_step']:.2f}", f"{s['prefill_s']:.3f}", f"{e['prefill_s']:.3f}"]
        cells += [f"{t['ms_per_step']:.2f}", gib(t["peak_gib"]), f"{t['prefill_s']:.3f}"] if t else ["-"] * 3
        cells += [f"{st['ms_per_step']:.2f}", gib(st["peak_gib"])] if st else ["-"] * 2
        cells += [f"{r['speedup']:.2f}x" if "speedup" in r else "-"]
        lines.append("  ".join(f"{c:>{max(len(h), 8)}}" for c, h in zip(cells, cols)))
    return "\n".join(lines)


def _context_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def plot_bench(rows, path: Path, title: str):
    """Decode tokens/s by context (and, on CUDA, peak memory), the contexts as tick labels;
    the eager line only where it differs from the graph's (on CUDA)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctx = [r["context"] for r in rows]
    memory = bool(rows) and rows[0]["student"]["peak_gib"] is not None
    fig, axes = plt.subplots(1, 2 if memory else 1, figsize=(10 if memory else 5.5, 4), dpi=120, squeeze=False)
    ax1 = axes[0][0]
    ax1.plot(ctx, [r["student"]["tokens_per_s"] for r in rows], "o-", color="C0", label="GLA model")
    if any(r["student_eager"]["tokens_per_s"] != r["student"]["tokens_per_s"] for r in rows):
        ax1.plot(ctx, [r["student_eager"]["tokens_per_s"] for r in rows], "o:", color="C1", label="GLA model (eager)")
    dynamic_label = "teacher (dynamic KV cache)"
    if rows and "teacher" in rows[0]:
        ax1.plot(ctx, [r["teacher"]["tokens_per_s"] for r in rows], "s-", color="C2", label=dynamic_label)
    static = [r for r in rows if "teacher_static" in r]
    static_ctx = [r["context"] for r in static]
    if static:
        graphed = ", CUDA graph" if static[0]["teacher_static"]["graph"] else ""
        ax1.plot(static_ctx, [r["teacher_static"]["tokens_per_s"] for r in static], "s--", color="C3",
                 label=f"teacher (static KV cache{graphed})")
    ax1.set_ylabel("decode tokens / s")
    ax1.set_ylim(bottom=0)
    if memory:
        ax2 = axes[0][1]
        ax2.plot(ctx, [r["student"]["peak_gib"] for r in rows], "o-", color="C0", label="GLA model")
        if "teacher" in rows[0]:
            ax2.plot(ctx, [r["teacher"]["peak_gib"] for r in rows], "s-", color="C2", label=dynamic_label)
        if static:
            ax2.plot(static_ctx, [r["teacher_static"]["peak_gib"] for r in static], "s--", color="C3",
                     label="teacher (static KV cache)")
        ax2.set_ylabel("peak memory while decoding (GiB)")
        ax2.set_ylim(bottom=0)
    for ax in axes[0]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ctx, [_context_label(c) for c in ctx])
        ax.minorticks_off()
        ax.set_xlabel("context (tokens)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(title if memory else f"{title} (peak memory is measured on CUDA only)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def write_bench(rows, out: Path, title: str, extra: dict | None = None) -> dict:
    """decode_bench.json and decode_bench.png in `out`, each written atomically."""
    result = {"rows": rows, **(extra or {})}
    paths = {"json": out / "decode_bench.json", "png": out / "decode_bench.png"}
    if importlib.util.find_spec("matplotlib") is None:   # e.g. a GPU box running from a source checkout
        paths["png"] = None
    try:
        atomic_write(paths["json"], lambda p: p.write_text(json.dumps(result, indent=2) + "\n"))
        if paths["png"] is not None:
            atomic_write(paths["png"], lambda p: plot_bench(rows, p, title))
    except OSError as e:
        raise GlaswapError(f"could not write the benchmark to {out} ({e.strerror or e}); pass --out DIR "
                           f"to a writable folder")
    return {k: str(v) if v is not None else "(no PNG: pip install matplotlib)" for k, v in paths.items()}


def bench_model(model_dir, teacher: str = "auto", contexts=None, batch_size: int = 1, new_tokens: int = 32,
                graph: str = "auto", device: str = "auto", dtype: str = "auto", out=None,
                trust_remote_code: bool = False, sparse_cache: int | None = None, log=print) -> dict:
    """`glaswap generate --bench`: the model folder against its teacher (or --teacher PATH / none).
    trust_remote_code: run Python code that the teacher's folder ships."""
    if batch_size < 1 or new_tokens < 1:
        raise GlaswapError("--batch-size and --new-tokens must be at least 1")
    if teacher == "self":
        raise GlaswapError("--teacher self has no KV cache to benchmark; pass auto, a PATH or none")
    out = Path(out) if out is not None else Path(model_dir) / "eval"
    run = open_model(model_dir, device, dtype, teacher=None if teacher == "none" else teacher,
                     sparse_cache=sparse_cache, tokenizer=False, trust_remote_code=trust_remote_code, writes=out,
                     log=log)
    if contexts is None:
        contexts = DEFAULT_CONTEXTS if run.device.type == "cuda" else CPU_CONTEXTS
    dtype_name = str(run.dtype).replace("torch.", "")
    log(f"decode benchmark on {run.device} ({dtype_name}), batch {batch_size}, {new_tokens} timed steps per context")
    rows = bench_decode(run.student, run.teacher, contexts, batch_size, new_tokens, graph, log=log)
    extra = {"model": str(model_dir), "teacher": run.teacher_desc, "device": str(run.device), "dtype": dtype_name,
             "versions": versions()}
    extra["outputs"] = write_bench(rows, out, f"{Path(model_dir).name}: decode, batch {batch_size}", extra)
    log(f"wrote {extra['outputs']['json']} and {extra['outputs']['png']}")
    return {"rows": rows, **extra}
