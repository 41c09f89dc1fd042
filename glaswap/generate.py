"""Generation with a converted model: streamed text, a CUDA-graph decode path, a decode benchmark.

Decoding one token with a GLA model is a fixed amount of work whatever the context: every
layer updates a [Hkv, K, V] state. At small batch the step is bound by Python and kernel
launches (hundreds of small kernels), not by the GPU, so on CUDA the whole step can be
captured once as a CUDA graph and replayed per token (`DecodeGraph`). A model with a sparse
cache also reads a prompt in blocks of SPARSE_BLOCK tokens (each block chooses what the cache
keeps), equally bound by launches: those blocks replay a graph of their own. The eager path
stays the fallback and is what runs on CPU.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import time
import warnings
import weakref
import tempfile
from pathlib import Path

import torch

from glaswap.errors import GlaswapError
from glaswap.layers.gla_attention import feature_dim, state_heads
from glaswap.layers.hybrid_cache import SPARSE_BLOCK, HybridBuffers
from glaswap.models.modeling_glaswap import CACHE_NAME, GLASwapCache, cache_of
from glaswap.runtime import (atomic_write, check_model_folder, load_student, load_teacher, load_tokenizer,
                             pick_device, pick_dtype, teacher_source, versions)

DEFAULT_CONTEXTS = (1024, 4096, 16384, 32768)
CPU_CONTEXTS = (64, 256)
RANDOM_SHAPES = {
    # SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json)
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                    rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                    max_position_embeddings=65536, bos_token_id=1, eos_token_id=2),
    # a few-millisecond model to check the benchmark itself on a CPU
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                 max_position_embeddings=65536, bos_token_id=1, eos_token_id=2),
}


# --------------------------------------------------------------------------- CUDA graph decode
class _ReplayGraph:
    """Stands in for torch.cuda.CUDAGraph where there is none (CPU tests): replay re-runs the
    captured function on the same static buffers, so the buffer logic is tested exactly."""

    def capture(self, fn):
        self.fn = fn
        fn()

    def replay(self):
        self.fn()


_WARMUP_STREAMS: dict = {}


def _warmup_stream(dev):
    """One warm-up stream per device for every capture: cuBLAS keeps a workspace (32 MiB on
    Hopper) for each stream it has run on, so a new stream per capture would leak one each."""
    key = torch.device(dev).index if torch.device(dev).index is not None else torch.cuda.current_device()
    if key not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[key] = torch.cuda.Stream(dev)
    return _WARMUP_STREAMS[key]


class _StaticStep:
    """One forward of `tokens` new tokens (1: a decode step; SPARSE_BLOCK: a block of a prompt)
    for a fixed batch size, reading and writing only static buffers. `out`: the logits of a
    decode step, the last hidden states of a block (the caller keeps the rows it needs)."""

    def __init__(self, model, batch_size, backend, tokens=1):
        cfg = model.config
        dev = model.lm_head.weight.device
        v_dim = cfg.head_dim + (1 if cfg.normalizer else 0)        # the normaliser's column of ones
        self.model = model
        self.ids = torch.zeros(batch_size, tokens, dtype=torch.long, device=dev)
        self.pos = torch.zeros(batch_size, tokens, dtype=torch.long, device=dev)
        self.states = [torch.zeros(batch_size, state_heads(cfg), feature_dim(cfg), v_dim,
                                   dtype=torch.float32, device=dev) for _ in range(cfg.num_hidden_layers)]
        # Hybrid layers: their window and sink buffers are static too (fixed size, like the state).
        self.windows = [self._empty_window(cfg, batch_size, dev) if cfg.window else None
                        for _ in range(cfg.num_hidden_layers)]
        self.cache = GLASwapCache(cfg.num_hidden_layers)
        self.out = None
        self.owner = None                                          # weakref to the cache aliasing self.states
        self._capture(backend, dev)

    def _empty_window(self, cfg, batch_size, dev):
        dtype = self.model.model.layers[0].self_attn.q_proj.weight.dtype
        k_r = torch.zeros(1, 1, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=dev)
        fk = torch.zeros(1, 1, state_heads(cfg), feature_dim(cfg), dtype=dtype, device=dev)
        return HybridBuffers.empty(batch_size, cfg.window, cfg.sinks, cfg.sparse_cache, k_r, fk)

    def _alias(self, cache):
        """Point `cache` at the static buffers."""
        cache.states = list(self.states)
        cache.windows = [w.map(lambda t: t) if w is not None else None for w in self.windows]

    def _aliases(self, cache) -> bool:
        return (len(cache.states) == len(self.states) and all(s is b for s, b in zip(cache.states, self.states))
                and all(w is None or (c is not None and all(a is b for a, b in zip(c.tensors(), w.tensors())))
                        for w, c in zip(self.windows, cache.windows)))

    def _run(self):
        self._alias(self.cache)
        hidden = self.model.model(input_ids=self.ids, position_ids=self.pos, past_key_values=self.cache,
                                  use_cache=True).last_hidden_state
        out = self.model.lm_head(hidden) if self.ids.shape[1] == 1 else hidden
        if self.out is None:                                       # first (warm-up) run, outside capture
            self.out = torch.empty_like(out)
        self.out.copy_(out)
        for buf, new in zip(self.states, self.cache.states):
            buf.copy_(new)
        for buf, new in zip(self.windows, self.cache.windows):
            if buf is not None:
                buf.copy_(new)
        self._alias(self.cache)

    def _capture(self, backend, dev):
        if backend == "replay":
            self.graph = _ReplayGraph()
            self.graph.capture(self._run)
            return
        # Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), then capture.
        stream = _warmup_stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run()
        torch.cuda.current_stream(dev).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._run()

    def adopt(self, cache):
        """Make `cache`'s states (and window buffers) the static buffers, copying its values in,
        unless they already are."""
        if self._aliases(cache):
            return
        previous = self.owner() if self.owner is not None else None
        if previous is not None and previous is not cache and any(
                s is b for s, b in zip(previous.states, self.states)):
            previous.states = [b.clone() for b in self.states]    # another cache keeps its own copy
            previous.windows = [w.map(torch.clone) if w is not None else None for w in self.windows]
        for buf, s in zip(self.states, cache.states):
            if s is None:
                buf.zero_()
            else:
                buf.copy_(s)
        empty = None
        for i, buf in enumerate(self.windows):
            if buf is None:
                continue
            src = cache.window_buffers(i)
            if src is None:
                positions = buf.window.positions
                empty = empty or self._empty_window(self.model.config, positions.shape[0], positions.device)
                src = empty
            buf.copy_(src)
        self._alias(cache)
        self.owner = weakref.ref(cache)


class DecodeGraph:
    """Single-token decode steps of a GLASwapForCausalLM replayed from a captured CUDA graph.

    Installed as `model.decode_runner` (see `enable_decode_graph`), it takes over the
    forward calls it can serve: one new token per row, a GLASwapCache, no gradients, GLA
    mode. One graph per batch size, captured on first use. While a cache is being decoded,
    its state tensors *are* the graph's static buffers (overwritten at every step); a
    cache that was decoded earlier gets a private copy when another cache takes over.
    A model with a sparse cache also reads prompts of SPARSE_BLOCK tokens or more through a
    graph of one block (`prefill`): the full blocks replay it, a shorter rest runs eagerly.
    The blocks are the ones an eager forward of the same call would choose in, so the cache
    ends the same. backend "replay" re-runs the step eagerly instead of replaying a graph
    (CPU tests).
    """

    def __init__(self, model, backend="cuda", strict=False):
        if backend not in ("cuda", "replay"):
            raise ValueError(f"unknown DecodeGraph backend {backend!r}; choose cuda or replay")
        self.model = model
        self.backend = backend
        self.strict = strict        # raise when capturing fails instead of falling back to eager
        self.steps: dict[int, _StaticStep] = {}      # decode steps, by batch size
        self.blocks: dict[int, _StaticStep] = {}     # prompt blocks of a sparse cache, by batch size
        self.fingerprint = self._fingerprint()
        self.failed = None          # why capturing a decode step failed; the model then decodes eagerly
        self.block_failed = None    # the same for prompt blocks

    def _fingerprint(self):
        """Where the weights live: a graph replays fixed addresses, so a move means recapture."""
        m = self.model
        params = (m.model.embed_tokens.weight, m.lm_head.weight, m.model.layers[0].self_attn.q_proj.weight,
                  m.model.layers[-1].mlp.down_proj.weight)
        return tuple((p.data_ptr(), p.dtype, p.device) for p in params)

    def _servable(self, input_ids, inputs_embeds, cache) -> bool:
        return (input_ids is not None and inputs_embeds is None and input_ids.dim() == 2
                and isinstance(cache, GLASwapCache) and not torch.is_grad_enabled() and not self.model.training
                and (self.backend != "cuda" or input_ids.is_cuda)
                and all(layer.self_attn.mode == "gla" for layer in self.model.model.layers))

    def accepts(self, input_ids, inputs_embeds, cache) -> bool:
        return (self.failed is None and self._servable(input_ids, inputs_embeds, cache)
                and input_ids.shape[1] == 1)

    def accepts_prefill(self, input_ids, inputs_embeds, attention_mask, cache) -> bool:
        """A prompt of at least one full block for a sparse cache, without padding."""
        cfg = self.model.config
        return (self.block_failed is None and bool(cfg.window and cfg.sparse_cache)
                and self._servable(input_ids, inputs_embeds, cache) and input_ids.shape[1] >= SPARSE_BLOCK
                and (attention_mask is None or bool(attention_mask.all())))     # the one host sync, last

    def _static(self, table, batch_size, tokens):
        """The static step of `table` for this batch size, captured on first use; None when it
        cannot be captured (then the failure is recorded and the caller runs eagerly)."""
        fingerprint = self._fingerprint()
        if fingerprint != self.fingerprint:
            self.steps.clear()
            self.blocks.clear()
            self.fingerprint = fingerprint
        static = table.get(batch_size)
        if static is None:
            try:
                static = table[batch_size] = _StaticStep(self.model, batch_size, self.backend, tokens)
            except Exception as e:
                if self.strict:
                    raise
                why = f"{type(e).__name__}: {e}"
                if tokens == 1:
                    self.failed = why
                    warnings.warn(f"glaswap: CUDA-graph decoding is off, decoding eagerly ({why})")
                else:
                    self.block_failed = why
                    warnings.warn(f"glaswap: CUDA-graph prompt blocks are off, reading prompts eagerly ({why})")
                return None
        return static

    def step(self, input_ids, position_ids, cache):
        """Logits [B, 1, vocab] of the next token, advancing `cache` by one token; None (cache
        untouched) when the graph cannot be captured, so the caller runs the step eagerly."""
        with torch.inference_mode(False), torch.no_grad():   # static buffers must be normal tensors
            static = self._static(self.steps, input_ids.shape[0], 1)
            if static is None:
                return None
            static.adopt(cache)
            static.ids.copy_(input_ids)
            if position_ids is None:
                static.pos.fill_(cache.seen_tokens)
            else:
                static.pos.copy_(position_ids[:, -1:])
            static.graph.replay()
            cache.seen_tokens += 1
            return static.out.clone()

    def prefill(self, input_ids, position_ids, cache, logits_to_keep=0):
        """The last hidden states [B, rows, hidden] of a prompt read into `cache`: at least the
        last `logits_to_keep` rows (an int above 0), else all. None (cache untouched) when the
        block graph cannot be captured, so the caller reads the prompt eagerly."""
        with torch.inference_mode(False), torch.no_grad():
            B, T = input_ids.shape
            static = self._static(self.blocks, B, SPARSE_BLOCK)
            if static is None:
                return None
            if position_ids is None:
                position_ids = torch.arange(cache.seen_tokens, cache.seen_tokens + T, device=input_ids.device)[None]
            want = logits_to_keep if isinstance(logits_to_keep, int) and logits_to_keep > 0 else T
            full = T - T % SPARSE_BLOCK
            static.adopt(cache)
            hidden = []
            for a in range(0, full, SPARSE_BLOCK):
                static.ids.copy_(input_ids[:, a:a + SPARSE_BLOCK])
                static.pos.copy_(position_ids[:, a:a + SPARSE_BLOCK])
                static.graph.replay()
                cache.seen_tokens += SPARSE_BLOCK
                if a + SPARSE_BLOCK > T - want:
                    hidden.append(static.out.clone())
            if full < T:   # the rest, shorter than a block: one eager block, as a whole forward ends
                hidden.append(self.model.model(input_ids=input_ids[:, full:], position_ids=position_ids[:, full:],
                                               past_key_values=cache, use_cache=True).last_hidden_state)
            return torch.cat(hidden, 1)


def enable_decode_graph(model, backend="cuda", strict=False) -> DecodeGraph:
    """Serve the model's single-token decode steps (generate() included) from CUDA graphs."""
    model.decode_runner = DecodeGraph(model, backend, strict)
    return model.decode_runner


def disable_decode_graph(model):
    model.decode_runner = None


def want_graph(graph: str, device: torch.device) -> bool:
    if graph not in ("auto", "on", "off"):
        raise GlaswapError(f"invalid --graph {graph!r}; choose auto, on or off")
    if graph == "on" and device.type != "cuda":
        raise GlaswapError("CUDA-graph decoding needs a CUDA GPU; use --graph off (or auto) on CPU")
    return graph == "on" or (graph == "auto" and device.type == "cuda")


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
    if temperature < 0:
        raise GlaswapError(f"--temperature {temperature} must be >= 0 (0 is greedy)")
    check_model_folder(model_dir)
    dev = pick_device(device)
    use_graph = want_graph(graph, dev)
    tok = load_tokenizer(model_dir, trust_remote_code)
    model = load_student(model_dir, dev, pick_dtype("auto", dev), sparse_cache)
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


@torch.no_grad()
def time_decode(model, prompt, new_tokens: int, warmup: int = 2) -> dict:
    """Prefill `prompt` [B, T], then time `new_tokens` greedy single-token steps.

    Works for a glaswap model (recurrent state) and any Hugging Face causal LM (its usual
    KV cache). Peak memory is measured over the decode steps only (weights, the cache, the
    step's temporaries); the prefill's own peak is reported apart.
    """
    device = prompt.device
    _free(device)
    _sync(device)
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
    del cache, token
    _free(device)
    ms = 1000 * seconds / new_tokens
    return {"ms_per_step": ms, "tokens_per_s": B * 1000 / ms, "peak_gib": peak, "prefill_s": prefill_s,
            "prefill_peak_gib": prefill_peak}


@torch.no_grad()
def check_decode_graph(model, prompt, steps: int = 8, backend: str = "cuda") -> dict:
    """Decode `steps` tokens after `prompt` eagerly and through the graph path from copies of
    the same cache (the graph path fed the eager tokens); how far apart are the logits?"""
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    eager_cache = cache_of(out)
    graph_cache = GLASwapCache(len(eager_cache))
    graph_cache.states = [s.clone() for s in eager_cache.states]
    graph_cache.windows = [w.map(torch.clone) if w is not None else None for w in eager_cache.windows]
    graph_cache.seen_tokens = eager_cache.seen_tokens
    token = out.logits[:, -1:].argmax(-1)
    previous = model.decode_runner
    tokens, eager = [], []
    try:
        disable_decode_graph(model)
        for _ in range(steps):
            tokens.append(token)
            eager.append(model(input_ids=token, past_key_values=eager_cache, use_cache=True).logits.float())
            token = eager[-1][:, -1:].argmax(-1)
        enable_decode_graph(model, backend, strict=True)
        graph = [model(input_ids=t, past_key_values=graph_cache, use_cache=True).logits.float() for t in tokens]
    finally:
        model.decode_runner = previous
    diff = max((a - b).abs().max().item() for a, b in zip(eager, graph))
    same = all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(eager, graph))
    scale = max(a.abs().max().item() for a in eager)
    return {"steps": steps, "max_abs_diff": diff, "max_abs_logit": scale, "same_argmax": same}


def bench_decode(student, teacher=None, contexts=DEFAULT_CONTEXTS, batch_size: int = 1, new_tokens: int = 32,
                 graph: str = "auto", seed: int = 0, log=print) -> list[dict]:
    """Decode speed and memory of the GLA model (eager, and CUDA-graph on CUDA) and of the teacher
    with its KV cache, after a prefill of `context` random tokens, at each context."""
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
            row["speedup"] = row["student"]["tokens_per_s"] / row["teacher"]["tokens_per_s"]
        rows.append(row)
        log(format_bench([row], header=not rows[:-1]))
    return rows


def format_bench(rows, header=True) -> str:
    """The benchmark table; tok/s counts every row of the batch, peaks are while decoding."""
    def gib(x):
        return "n/a" if x is None else f"{x:.2f}"

    cols = ("context", "GLA ms/tok", "tok/s", "peak GiB", "eager ms/tok", "prefill s", "eager prefill s",
            "teacher ms/tok", "tok/s", "peak GiB", "prefill s", "speedup")
    lines = ["  ".join(f"{c:>{max(len(c), 8)}}" for c in cols)] if header else []
    for r in rows:
        s, e, t = r["student"], r["student_eager"], r.get("teacher")
        cells = [str(r["context"]), f"{s['ms_per_step']:.2f}", f"{s['tokens_per_s']:.1f}", gib(s["peak_gib"]),
                 f"{e['ms_per_step']:.2f}", f"{s['prefill_s']:.3f}", f"{e['prefill_s']:.3f}"]
        if t is not None:
            cells += [f"{t['ms_per_step']:.2f}", f"{t['tokens_per_s']:.1f}", gib(t["peak_gib"]),
                      f"{t['prefill_s']:.3f}", f"{r['speedup']:.2f}x"]
        else:
            cells += ["-"] * 5
        lines.append("  ".join(f"{c:>{max(len(h), 8)}}" for c, h in zip(cells, cols)))
    return "\n".join(lines)


def parse_contexts(text: str) -> list[int]:
    """'1024,4K,16k' -> [1024, 4096, 16384]."""
    out = []
    for part in str(text).split(","):
        part = part.strip().lower()
        mult = 1024 if part.endswith("k") else 1
        try:
            value = int(part[:-1] if mult > 1 else part) * mult
        except ValueError:
            raise GlaswapError(f"invalid context {part!r} in --contexts; write them like 1024,4K,16K")
        if value < 1:
            raise GlaswapError(f"invalid context {value} in --contexts; contexts must be at least 1 token")
        out.append(value)
    return out


def plot_bench(rows, path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctx = [r["context"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4), dpi=120)
    ax1.plot(ctx, [r["student"]["tokens_per_s"] for r in rows], "o-", label="GLA model")
    ax1.plot(ctx, [r["student_eager"]["tokens_per_s"] for r in rows], "o:", label="GLA model (eager)")
    if rows and "teacher" in rows[0]:
        ax1.plot(ctx, [r["teacher"]["tokens_per_s"] for r in rows], "s-", label="teacher (KV cache)")
    ax1.set_ylabel("decode tokens / s")
    if rows and rows[0]["student"]["peak_gib"] is not None:
        ax2.plot(ctx, [r["student"]["peak_gib"] for r in rows], "o-", label="GLA model")
        if "teacher" in rows[0]:
            ax2.plot(ctx, [r["teacher"]["peak_gib"] for r in rows], "s-", label="teacher (KV cache)")
        ax2.set_ylabel("peak memory while decoding (GiB)")
    else:
        ax2.text(0.5, 0.5, "peak memory is measured on CUDA only", ha="center", va="center",
                 transform=ax2.transAxes)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(title, fontsize=10)
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
    meta = check_model_folder(model_dir)
    dev = pick_device(device)
    if contexts is None:
        contexts = DEFAULT_CONTEXTS if dev.type == "cuda" else CPU_CONTEXTS
    if batch_size < 1 or new_tokens < 1:
        raise GlaswapError("--batch-size and --new-tokens must be at least 1")
    dtype = pick_dtype(dtype, dev)
    student = load_student(model_dir, dev, dtype, sparse_cache)
    teacher_model, t_desc = None, None
    if teacher != "none":
        kind, path, t_desc = teacher_source(model_dir, meta, teacher)
        if kind == "self":
            raise GlaswapError("--teacher self has no KV cache to benchmark; pass auto, a PATH or none")
        log(f"loading teacher {t_desc.get('spec', path)}")
        teacher_model = load_teacher(kind, path, dev, dtype, trust_remote_code)
    log(f"decode benchmark on {dev} ({str(dtype).replace('torch.', '')}), batch {batch_size}, "
        f"{new_tokens} timed steps per context")
    rows = bench_decode(student, teacher_model, contexts, batch_size, new_tokens, graph, log=log)
    extra = {"model": str(model_dir), "teacher": t_desc, "device": str(dev),
             "dtype": str(dtype).replace("torch.", ""), "versions": versions()}
    out = Path(out) if out is not None else Path(model_dir) / "eval"
    extra["outputs"] = write_bench(rows, out, f"{Path(model_dir).name}: decode, batch {batch_size}", extra)
    log(f"wrote {extra['outputs']['json']} and {extra['outputs']['png']}")
    return {"rows": rows, **extra}


def random_models(shape: str, dtype, device, workdir: Path, seed: int = 0, options: dict | None = None):
    """(GLA student, teacher): a Llama of RANDOM_SHAPES[shape] with random weights (the
    teacher), saved to `workdir` and converted by glaswap.convert with `options` (the student)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from glaswap.convert import convert

    torch.manual_seed(seed)
    teacher = LlamaForCausalLM(LlamaConfig(**RANDOM_SHAPES[shape])).to(torch.bfloat16)
    teacher.save_pretrained(str(workdir / "teacher"))
    convert(str(workdir / "teacher"), workdir / "gla", options=options, report=False, dtype="bfloat16",
            log=lambda *_: None)
    student = load_student(workdir / "gla", device, dtype)
    return student, teacher.to(device=device, dtype=dtype).eval()


def bench_random(shape: str = "smollm2", contexts=None, batch_size: int = 1, new_tokens: int = 64,
                 graph: str = "auto", device: str = "auto", dtype: str = "auto", teacher: bool = True, out=None,
                 options: dict | None = None, log=print) -> dict:
    """The decode benchmark with no model to download: a random Llama of RANDOM_SHAPES[shape]
    against its conversion (with convert's `options`); decode_bench.json and .png go to `out`
    when it is given."""
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    if contexts is None:
        contexts = DEFAULT_CONTEXTS if dev.type == "cuda" else CPU_CONTEXTS
    with tempfile.TemporaryDirectory(prefix="glaswap-bench-") as tmp:
        started = time.time()
        student, teacher_model = random_models(shape, dt, dev, Path(tmp), options=options)
        log(f"built and converted a random {shape}-shaped Llama in {time.time() - started:.0f} s")
        rows = bench_decode(student, teacher_model if teacher else None, contexts, batch_size, new_tokens, graph,
                            log=log)
    extra = {"model": f"random {shape}", "options": options or {}, "device": str(dev),
             "dtype": str(dt).replace("torch.", "")}
    if out is not None:
        paths = write_bench(rows, Path(out), f"random {shape}: decode, batch {batch_size}", extra)
        log(f"wrote {paths['json']} and {paths['png']}")
        extra["outputs"] = paths
    return {"rows": rows, **extra}
