"""The CUDA-graph decode runner: a GLASwapForCausalLM's decode steps, and a sparse cache's
prompt blocks, replayed from captured CUDA graphs.

Decoding one token with a GLA model is a fixed amount of work whatever the context: every
layer updates a [Hkv, K, V] state. At small batch the step is bound by Python and kernel
launches (hundreds of small kernels), not by the GPU, so on CUDA the whole step can be
captured once as a CUDA graph and replayed per token (`DecodeGraph`). A model with a sparse
cache also reads a prompt in blocks of SPARSE_BLOCK tokens (each block chooses what the cache
keeps), equally bound by launches: those blocks replay a graph of their own. The eager path
stays the fallback and is what runs on CPU.

The softmax layers of a mixed model (config.softmax_layers) read a KV cache that grows with
the context. A graph holds it in static buffers of a fixed capacity with a mask of the slots
written so far, and writes each new token at a slot given by a device tensor; when the
context outgrows the capacity, the step is captured again with more room.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref

import torch

from glaswap.errors import GlaswapError
from glaswap.layers.gla_attention import feature_dim, state_heads
from glaswap.layers.hybrid_cache import SPARSE_BLOCK, HybridBuffers
from glaswap.layers.softmax_attention import KV_STEP, KVBuffer
from glaswap.models.modeling_glaswap import GLASwapCache, cache_of


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
    """One warm-up stream per device for every capture: cuBLAS keeps a workspace for each
    stream it has run on, so a new stream per capture would leak one each."""
    key = torch.device(dev).index if torch.device(dev).index is not None else torch.cuda.current_device()
    if key not in _WARMUP_STREAMS:
        _WARMUP_STREAMS[key] = torch.cuda.Stream(dev)
    return _WARMUP_STREAMS[key]


def kv_length(cache) -> int:
    """Tokens in the softmax layers' KV buffers of `cache` (0 without any)."""
    return max((b.length for b in cache.kv if b is not None), default=0)


def kv_capacity(needed: int) -> int:
    """Static KV slots for a graph that must hold `needed` tokens: room for a sixteenth more (at
    least KV_STEP) before it is captured again, so spare slots stay a small part of the cache."""
    return -(-(needed + max(KV_STEP, needed // 16)) // KV_STEP) * KV_STEP


def _shares(a: KVBuffer | None, b: KVBuffer | None) -> bool:
    return a is not None and b is not None and a.keys is b.keys


class _StaticStep:
    """One forward of `tokens` new tokens (1: a decode step; SPARSE_BLOCK: a block of a prompt)
    for a fixed batch size, reading and writing only static buffers. `out`: the logits of a
    decode step, the last hidden states of a block (the caller keeps the rows it needs).
    Softmax layers get static KV buffers of `capacity` slots. Those of `kv_from` (the cache
    about to be adopted) become the static buffers: taken as they are where they have room,
    else moved one layer at a time into new ones, so a cache's KV is never held twice."""

    def __init__(self, model, batch_size, backend, tokens=1, capacity=0, kv_from=None):
        cfg = model.config
        dev = model.lm_head.weight.device
        v_dim = cfg.head_dim + (1 if cfg.normalizer else 0)        # the normaliser's column of ones
        softmax = set(cfg.softmax_layers)
        gla = [i not in softmax for i in range(cfg.num_hidden_layers)]
        self.model = model
        self.ids = torch.zeros(batch_size, tokens, dtype=torch.long, device=dev)
        self.pos = torch.zeros(batch_size, tokens, dtype=torch.long, device=dev)
        self.states = [torch.zeros(batch_size, state_heads(cfg), feature_dim(cfg), v_dim,
                                   dtype=torch.float32, device=dev) if g else None for g in gla]
        # Hybrid layers: their window, sink and sparse buffers are static too, at their full sizes.
        self.windows = [self._empty_window(cfg, batch_size, dev) if cfg.window and g else None for g in gla]
        like = torch.zeros(1, dtype=self._dtype(), device=dev)
        self.kv = [None if g else KVBuffer.empty(batch_size, cfg.num_key_value_heads, cfg.head_dim, like, capacity)
                   if kv_from is None else self._take(kv_from, i, batch_size, cfg.num_key_value_heads, cfg.head_dim,
                                                kv_length(kv_from) + tokens, capacity, like)
                   for i, g in enumerate(gla)]
        self.capacity = min((b.capacity for b in self.kv if b is not None), default=capacity)
        # the slot of the first new token; capturing writes there, past the tokens taken over
        self.write_at = torch.full((1,), kv_length(kv_from) if kv_from is not None else 0, dtype=torch.long,
                                   device=dev)
        self.cache = GLASwapCache(cfg.num_hidden_layers)
        self.cache.kv_write_at = self.write_at
        self.out = None
        self.owner = None                                          # weakref to the cache aliasing self.states
        self._capture(backend, dev)

    def _dtype(self):
        return self.model.model.layers[0].self_attn.q_proj.weight.dtype

    def release(self):
        """Drop the graph and every reference to the buffers (a cache aliasing them keeps its own)."""
        self.graph = self.cache = self.out = None
        self.states, self.windows, self.kv = [], [], []

    @staticmethod
    def _take(cache, i, batch_size, heads, dim, needed, capacity, like):
        """Softmax layer i's static KV buffer, from `cache`'s: its own tensors when they have
        the `needed` slots for this batch size, else new ones of `capacity` slots holding
        its tokens, which `cache` then points at, so its old tensors are freed before the next
        layer's are made."""
        src = cache.kv_buffer(i)
        if src is None or src.keys.shape[0] != batch_size:
            return KVBuffer.empty(batch_size, heads, dim, like, capacity)
        if src.capacity < needed:
            src = src.resized(capacity)
            cache.set_kv_buffer(i, src)
        return dataclasses.replace(src, length=0, padded=False)

    def _empty_window(self, cfg, batch_size, dev):
        dtype = self._dtype()
        k_r = torch.zeros(1, 1, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=dev)
        fk = torch.zeros(1, 1, state_heads(cfg), feature_dim(cfg), dtype=dtype, device=dev)
        return HybridBuffers.empty(batch_size, cfg.window, cfg.sinks, cfg.sparse_cache, k_r, fk, static=True)

    def _alias(self, cache, length=0, padded=False):
        """Point `cache` at the static buffers; its KV buffers hold `length` tokens (`padded`:
        some of them padding)."""
        cache.states = list(self.states)
        cache.windows = [w.map(lambda t: t) if w is not None else None for w in self.windows]
        cache.kv = [dataclasses.replace(b, length=length, padded=padded) if b is not None else None for b in self.kv]

    def _aliases(self, cache) -> bool:
        def same(mine, theirs):
            return mine is None or (theirs is not None and all(a is b for a, b in zip(theirs.tensors(),
                                                                                     mine.tensors())))
        return (len(cache.states) == len(self.states) and len(cache.kv) == len(self.kv)
                and all(s is b for s, b in zip(cache.states, self.states))
                and all(same(w, c) for w, c in zip(self.windows, cache.windows))
                and all(same(b, c) for b, c in zip(self.kv, cache.kv)))

    def _run(self):
        self._alias(self.cache)
        hidden = self.model.model(input_ids=self.ids, position_ids=self.pos, past_key_values=self.cache,
                                  use_cache=True).last_hidden_state
        out = self.model.lm_head(hidden) if self.ids.shape[1] == 1 else hidden
        if self.out is None:                                       # first (warm-up) run, outside capture
            self.out = torch.empty_like(out)
        self.out.copy_(out)
        for buf, new in zip(self.states, self.cache.states):
            if buf is not None:
                buf.copy_(new)
        # the softmax layers wrote their KV buffers in place
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
        """Make `cache`'s states (and window and KV buffers) the static buffers, copying its
        values in, unless they already are. Its KV must fit the capacity."""
        if self._aliases(cache):
            return
        previous = self.owner() if self.owner is not None else None
        if previous is not None and previous is not cache:     # another cache keeps its own copy
            if any(s is b for s, b in zip(previous.states, self.states) if b is not None):
                previous.states = [b.clone() if b is not None else None for b in self.states]
                previous.windows = [w.map(torch.clone) if w is not None else None for w in self.windows]
            # an eager call after the graph's steps may have written the KV buffers in place
            previous.kv = [b.map(torch.clone) if b is not None and _shares(b, mine) else b
                           for b, mine in zip(previous.kv, self.kv)]
        for buf, s in zip(self.states, cache.states):
            if buf is None:
                continue
            if s is None:
                buf.zero_()
            else:
                buf.copy_(s)
        length = kv_length(cache)
        for i, buf in enumerate(self.kv):
            if buf is None:
                continue
            src = cache.kv_buffer(i)
            n = src.length if src is not None else 0
            if n != length:
                raise ValueError(f"softmax layer {i} holds {n} tokens, others {length}: not one context")
            if _shares(src, buf):
                continue                                           # already in place
            buf.valid.zero_()
            if n:
                for mine, theirs in zip(buf.tensors(), src.tensors()):
                    mine[:, :, :n].copy_(theirs[:, :, :n]) if mine.dim() == 4 else mine[:, :n].copy_(theirs[:, :n])
        cfg = self.model.config
        for i, buf in enumerate(self.windows):
            if buf is None:
                continue
            src = cache.window_buffers(i)
            if src is None:
                buf.clear_()
            else:                           # an eager cache's buffers grow: at full size here
                buf.copy_(src.sized(cfg.window, cfg.sinks, cfg.sparse_cache))
        self._alias(cache, length, any(b.padded for b in cache.kv if b is not None))
        self.owner = weakref.ref(cache)

    def advance(self, cache, tokens):
        """After a replay that wrote `tokens` new tokens: the cache counts them."""
        cache.seen_tokens += tokens
        cache.kv = [dataclasses.replace(b, length=b.length + tokens) if b is not None else None for b in cache.kv]


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
    ends the same. A mixed model's softmax layers read static KV buffers, and a step is
    captured again, with a quarter more room, when the context outgrows them. backend
    "replay" re-runs the step eagerly instead of replaying a graph (CPU tests).
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

    def _static(self, table, batch_size, tokens, kv_needed=0, cache=None):
        """The static step of `table` for this batch size, captured on first use, and again with
        more KV slots when its softmax layers must hold more than `kv_needed` tokens, its KV
        buffers taken over from `cache`'s; None when it cannot be captured (then the failure is
        recorded and the caller runs eagerly)."""
        fingerprint = self._fingerprint()
        if fingerprint != self.fingerprint:
            self.steps.clear()
            self.blocks.clear()
            self.fingerprint = fingerprint
        mixed = bool(self.model.config.softmax_layers)
        static = table.get(batch_size)
        if static is not None and mixed and static.capacity < kv_needed:
            del table[batch_size]           # the caches aliasing it keep its buffers until adopted anew
            static.release()
            static = None
        if static is None:
            try:
                capacity = kv_capacity(kv_needed) if mixed else 0
                static = table[batch_size] = _StaticStep(self.model, batch_size, self.backend, tokens, capacity,
                                                         kv_from=cache if mixed else None)
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
            length = kv_length(cache)
            static = self._static(self.steps, input_ids.shape[0], 1, length + 1, cache)
            if static is None:
                return None
            static.adopt(cache)
            static.ids.copy_(input_ids)
            if position_ids is None:
                static.pos.fill_(cache.seen_tokens)
            else:
                static.pos.copy_(position_ids[:, -1:])
            static.write_at.fill_(length)
            static.graph.replay()
            static.advance(cache, 1)
            return static.out.clone()

    def prefill(self, input_ids, position_ids, cache, logits_to_keep=0):
        """The last hidden states [B, rows, hidden] of a prompt read into `cache`: at least the
        last `logits_to_keep` rows (an int above 0), else all. None (cache untouched) when the
        block graph cannot be captured, so the caller reads the prompt eagerly."""
        with torch.inference_mode(False), torch.no_grad():
            B, T = input_ids.shape
            length = kv_length(cache)
            full = T - T % SPARSE_BLOCK
            static = self._static(self.blocks, B, SPARSE_BLOCK, length + full, cache)
            if static is None:
                return None
            if position_ids is None:
                position_ids = torch.arange(cache.seen_tokens, cache.seen_tokens + T, device=input_ids.device)[None]
            want = logits_to_keep if isinstance(logits_to_keep, int) and logits_to_keep > 0 else T
            static.adopt(cache)
            hidden = []
            for a in range(0, full, SPARSE_BLOCK):
                static.ids.copy_(input_ids[:, a:a + SPARSE_BLOCK])
                static.pos.copy_(position_ids[:, a:a + SPARSE_BLOCK])
                static.write_at.fill_(length + a)
                static.graph.replay()
                static.advance(cache, SPARSE_BLOCK)
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
    """Whether to decode from CUDA graphs for --graph auto (on CUDA), on or off."""
    if graph not in ("auto", "on", "off"):
        raise GlaswapError(f"invalid --graph {graph!r}; choose auto, on or off")
    if graph == "on" and device.type != "cuda":
        raise GlaswapError("CUDA-graph decoding needs a CUDA GPU; use --graph off (or auto) on CPU")
    return graph == "on" or (graph == "auto" and device.type == "cuda")


@torch.no_grad()
def check_decode_graph(model, prompt, steps: int = 8, backend: str = "cuda") -> dict:
    """Decode `steps` tokens after `prompt` eagerly and through the graph path from copies of
    the same cache (the graph path fed the eager tokens); how far apart are the logits?"""
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    eager_cache = cache_of(out)
    graph_cache = GLASwapCache(len(eager_cache))
    graph_cache.states = [s.clone() if s is not None else None for s in eager_cache.states]
    graph_cache.windows = [w.map(torch.clone) if w is not None else None for w in eager_cache.windows]
    graph_cache.kv = [b.map(torch.clone) if b is not None else None for b in eager_cache.kv]
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
