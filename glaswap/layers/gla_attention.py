"""The GLA attention layer that replaces a teacher's softmax attention.

It keeps the teacher's `q_proj`, `k_proj`, `v_proj`, `o_proj` (and `q_norm`, `k_norm` where the
teacher has them) under the same names, so checkpoints and LoRA targets carry over, and adds
a gate and, optionally, learned feature maps. The same module can also run the teacher's
softmax attention from the same weights (`mode = "softmax"`, softmax_attention.py):
distillation uses that for teacher outputs without a second copy of the model. A hybrid
layer's cache and reading through it live in hybrid_cache.py. A softmax layer of a mixed
model (config.softmax_layers, `is_softmax`) is the teacher's attention in every mode, with no
new parameters and a KV cache.

This file is copied into every saved model folder: it imports only torch, transformers'
public utilities, the other files of glaswap.layers and the GLA ops, never the rest of glaswap.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from glaswap.layers.hybrid_cache import (DecodeRings, ExactInputs, HybridBuffers, SinkBuffer, StreamLayer,
                                         WindowBuffer, prompt_order, stream)
from glaswap.layers.softmax_attention import DistanceCap, KVBuffer, cached_softmax_attention, softmax_attention
from glaswap_kernels.hybrid_cpu import hybrid_attention_cpu
from glaswap_kernels.ops import (chunk_gla, decode_step, feature_map, gate_logsigmoid, normalize, rms_norm, rope,
                                 softmax_pm, window_attention, window_mix, with_ones)

# The allowed gates and feature maps: gla_options.GLA_OPTIONS.
LEARNED_MAPS = ("hedgehog", "hedgehog_pm")   # the maps with a per-head matrix W
# gla: the student. softmax: the teacher's attention from the same weights. transfer: the
# teacher's output, with the GLA output's distance to it (attention transfer, distillation's
# stage 1; GLAAttention.forward returns it).
MODES = ("gla", "softmax", "transfer")
# The modules conversion adds to a GLA layer; a softmax layer has none of them.
NEW_MODULES = ("gate_down", "gate_up", "gate_proj", "q_map", "k_map", "window_mix")


def feature_dim(config):
    """Width of phi(q) and phi(k), hence of the gate and of the recurrent state's rows."""
    return config.head_dim * (2 if config.feature_map == "hedgehog_pm" else 1)


def state_heads(config):
    """Number of recurrent states per layer: one per KV head (query heads of a group share
    it), or one per query head with state_heads="query"."""
    if config.state_heads == "query":
        return config.num_attention_heads
    return config.num_key_value_heads


def rope_inv_freq(config):
    """(inverse frequencies [head_dim / 2 or fewer], attention scaling) of the config's RoPE."""
    rope = dict(config.rope_parameters)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        dim = int(config.head_dim * rope.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # llama3, linear, yarn, ...

    return ROPE_INIT_FUNCTIONS[rope_type](config, None)


def rope_kept_dims(config):
    """Which of the head's dimensions the GLA path rotates: bool [head_dim], or None for all.

    A pair whose wavelength exceeds the training length never turns through a full circle in
    training, so past that length it shows the feature maps angles they never saw, and the
    model's loss climbs with absolute position. Pairs with wavelength <= rope_max_wavelength
    have shown every angle in training; the rest stay unrotated (angle 0 at every position)."""
    if not config.use_rope or not config.rope_max_wavelength:
        return None
    inv_freq, _ = rope_inv_freq(config)
    keep = (2 * math.pi / inv_freq) <= config.rope_max_wavelength
    half = config.head_dim // 2
    keep = torch.cat([keep, keep.new_zeros(half - keep.numel())]) if keep.numel() < half else keep
    return torch.cat([keep, keep])                    # rotate_half pairs dimension j with j + D/2


class _RotationMemo:
    """The last forward's GLA-path rotation (GLAAttention._gla_rotation): (position_embeddings,
    config, (cos, sin)). The model's forward clears it when its layers are done."""
    last = None


_ROTATION = _RotationMemo()


def clear_rotation_memo():
    _ROTATION.last = None


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in float32, scale in the input dtype."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)       # one kernel on CUDA when no gradient is wanted


class FeatureMap(nn.Module):
    """phi(x) applied per head to q or k before the linear attention (RoPE first, if used).

    identity: phi(x) = x (plain GLA). softmax: softmax over the head dimension. hedgehog:
    softmax(x W) with one learned W per head, initialised to the identity, so it starts as
    `softmax` and can learn to sharpen or mix dimensions (Hedgehog / LoLCATs). hedgehog_pm:
    [softmax(x W), softmax(-x W)], twice as wide: one softmax can only favour large
    components of x W, the pair also sees the most negative ones (as LoLCATs' maps do). On
    CUDA the rotation, W and softmax (both halves for hedgehog_pm) run as one Triton kernel
    each way (`ops.feature_map`).
    """

    def __init__(self, kind, heads, dim):
        super().__init__()
        self.kind = kind
        if kind in LEARNED_MAPS:
            self.weight = nn.Parameter(torch.eye(dim).repeat(heads, 1, 1))

    def forward(self, x, cos=None, sin=None, backend="auto"):
        return feature_map(x, cos, sin, getattr(self, "weight", None), softmax=self.kind != "identity",
                           backend=backend, pm=self.kind == "hedgehog_pm")


class WindowMix(nn.Module):
    """One logit per query head weighing the GLA state's part against the exact window's
    (config.window_mix): for "shared", the log-weight of the state's phi(q).phi(k) sums beside
    the window's exp-scores; for "learned", the logit of the state's share of the output."""

    def __init__(self, heads):
        super().__init__()
        self.logit = nn.Parameter(torch.zeros(heads))

    def forward(self):
        # read through forward(), so that peft's modules_to_save wrapper serves its trained copy
        return self.logit.float()


class GLAAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        # States per layer (= num_kv_heads unless state_heads="query"): keys, values and
        # gates are per state head; each KV head is repeated over its query heads if needed.
        self.num_state_heads = state_heads(config)
        self.mode = "gla"   # one of MODES
        # The teacher's exact attention in every mode (config.softmax_layers): no new parameters.
        self.is_softmax = layer_idx in config.softmax_layers

        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(self.hidden_size, q_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(self.hidden_size, kv_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(self.hidden_size, kv_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_dim, self.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self._rope_keep = None   # rope_kept_dims as cos's dtype and device, made on first use
        self._sink_turn = None   # (cos, sin) of sink_rotation, made on first use
        self._cap = None         # a softmax layer's DistanceCap, made on first use
        if self.is_softmax:
            return

        # New parameters (the only ones attention transfer trains).
        if config.gate == "lowrank":
            self.gate_down = nn.Linear(self.hidden_size, config.gate_rank, bias=False)
            self.gate_up = nn.Linear(config.gate_rank, self.num_state_heads * self.head_dim, bias=True)
        elif config.gate == "scalar":
            self.gate_proj = nn.Linear(self.hidden_size, self.num_state_heads, bias=True)
        if config.window:
            self.window_mix = WindowMix(self.num_heads)
        self.q_map = FeatureMap(config.feature_map, self.num_heads, self.head_dim)
        self.k_map = FeatureMap(config.feature_map, self.num_state_heads, self.head_dim)
        for m in (getattr(self, n, None) for n in ("gate_down", "gate_up", "gate_proj")):
            if m is not None:
                m._glaswap_new = True  # initialised by reset_new_parameters, not as a plain Linear
        self.reset_new_parameters()

    @torch.no_grad()
    def reset_new_parameters(self):
        """Initialise the gate so every step starts with the decay `gate_init_decay`.

        The low-rank gate's up projection starts at zero (the gate is data-independent at
        step 0, like a LoRA B matrix), its bias gives the starting decay; the down
        projection is small and random so gradients reach it once `gate_up` moves.
        """
        if self.is_softmax:
            return
        cfg = self.config
        bias = self._start_logit()
        if cfg.gate == "lowrank":
            nn.init.normal_(self.gate_down.weight, std=self.hidden_size ** -0.5)
            self.gate_up.weight.zero_()
            self.gate_up.bias.fill_(bias)
        elif cfg.gate == "scalar":
            self.gate_proj.weight.zero_()
            self.gate_proj.bias.fill_(bias)
        if cfg.window:
            self.window_mix.logit.zero_()
        if cfg.feature_map in LEARNED_MAPS:
            for m in (self.q_map, self.k_map):
                m.weight.copy_(torch.eye(self.head_dim).repeat(m.weight.shape[0], 1, 1))

    def new_parameter_names(self):
        prefixes = tuple(m + "." for m in NEW_MODULES)
        return [n for n, _ in self.named_parameters() if n.startswith(prefixes)]

    def make_softmax(self):
        """Turn this GLA layer into a softmax layer in place: its new modules are deleted (and
        with them any wrapper peft put around them), the teacher's projections stay as they are
        (LoRA layers on them included). The config's softmax_layers is the caller's to update."""
        for name in NEW_MODULES:
            if hasattr(self, name):
                delattr(self, name)
        self.is_softmax = True

    # ----------------------------------------------------------------------------------
    def _project(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _gate(self, x, k_raw, repeat=True):
        """Per-step log-decays g [B, T, Hkv, feature_dim] (<= 0), in x's dtype (hedgehog_pm's
        two halves share the decay of their head dimension; without `repeat`, that decay once:
        [B, T, Hkv, head_dim])."""
        cfg = self.config
        B, T, _ = x.shape
        Hs = self.num_state_heads
        if cfg.gate == "lowrank":
            logits = self.gate_up(self.gate_down(x)).view(B, T, Hs, self.head_dim)
        elif cfg.gate == "scalar":
            logits = self.gate_proj(x).view(B, T, Hs, 1).expand(B, T, Hs, self.head_dim)
        else:  # key: reuse the key projection (before RoPE), shifted to the starting decay
            logits = self._per_state_head(k_raw) + self._start_logit()
        # logsigmoid(logits) / gate_normalizer in float32, stored in x's dtype; one Triton
        # kernel each way on CUDA (writing both halves for hedgehog_pm).
        return gate_logsigmoid(logits.to(x.dtype), cfg.gate_normalizer,
                               repeat=2 if repeat and cfg.feature_map == "hedgehog_pm" else 1,
                               shift=self._decay_shift(),
                               backend=cfg.gla_backend)

    def _decay_shift(self):
        """1 / decay_horizon (0 without one): subtracted from every log-decay, so no decay
        exceeds exp(-1 / decay_horizon)."""
        horizon = float(self.config.decay_horizon)
        return 1.0 / horizon if horizon else 0.0

    def _start_logit(self):
        """The gate logit whose decay, after the horizon's shift, is gate_init_decay."""
        cfg = self.config
        return logit_for_decay(cfg.gate_init_decay * math.exp(self._decay_shift()), cfg.gate_normalizer)

    def _per_state_head(self, t):
        """A [B, T, Hkv, ...] key/value tensor repeated over each group's query heads when
        every query head has its own state; unchanged otherwise."""
        R = self.num_state_heads // self.num_kv_heads
        return t.repeat_interleave(R, dim=2) if R > 1 else t

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, cu_seqlens=None, position_ids=None, **kwargs):
        """(output [B, T, hidden], transfer loss): the loss is the GLA output's MSE to the
        teacher's in "transfer" mode, None otherwise."""
        if past_key_values is not None and hidden_states.shape[1] == 1 and hidden_states.is_cpu:
            out = self._cpu_decode(hidden_states, position_embeddings, attention_mask, past_key_values, cu_seqlens,
                                   position_ids)
            if out is not None:
                return out, None
        if self.is_softmax:
            return self._softmax_layer(hidden_states, position_embeddings, attention_mask, past_key_values,
                                       cu_seqlens, position_ids), None
        if self.mode == "transfer":
            # Attention transfer: this layer's gate and feature maps learn on the teacher's own
            # inputs and projections, held fixed. Without the detach each layer's loss would run
            # backward through every earlier layer too (stage 2's LoRA adapters already require
            # grad), which changes no gradient of the trained parameters but costs a full backward.
            x = hidden_states.detach()
            with torch.no_grad():
                q, k, v = self._project(x)
                out = self._teacher(q, k, v, position_embeddings, attention_mask, cu_seqlens)
            gla = self._gla(x, q, k, v, position_embeddings, attention_mask, None, cu_seqlens, position_ids)
            return out, F.mse_loss(gla.float(), out.float())
        q, k, v = self._project(hidden_states)
        if self.mode == "softmax":
            return self._teacher(q, k, v, position_embeddings, attention_mask, cu_seqlens), None
        return self._gla(hidden_states, q, k, v, position_embeddings, attention_mask,
                         past_key_values, cu_seqlens, position_ids), None

    def _softmax_layer(self, x, position_embeddings, attention_mask, cache, cu_seqlens, position_ids=None):
        """A softmax layer's output in every mode: the teacher's attention with the layer's
        distance cap, through the cache's KVBuffer when there is one. In "transfer" mode it has
        nothing to learn, so it runs without gradients."""
        cfg = self.config
        with torch.no_grad() if self.mode == "transfer" else contextlib.nullcontext():
            q, k, v = self._project(x.detach() if self.mode == "transfer" else x)
            cap = self._distance_cap(q.device)
            if cache is None:
                return self.o_proj(softmax_attention(q, k, v, position_embeddings, attention_mask, cu_seqlens,
                                                     cfg.sliding_window, cap, position_ids, cfg.gla_backend))
        T = q.shape[1]
        valid = attention_mask[:, -T:].bool() if attention_mask is not None and attention_mask.dim() == 2 else None
        o, kv = cached_softmax_attention(q, k, v, position_embeddings, cache.kv_buffer(self.layer_idx), valid,
                                         cfg.sliding_window, cache.kv_write_at, position_ids, cap)
        cache.set_kv_buffer(self.layer_idx, kv)
        return self.o_proj(o)

    def _distance_cap(self, device) -> DistanceCap:
        """The softmax layer's DistanceCap (softmax_max_distance; 0: the teacher's positions),
        made once per device."""
        cfg = self.config
        distance = int(cfg.softmax_max_distance or cfg.max_position_embeddings)
        cap = self._cap
        if cap is None or cap.inv_freq.device != device or cap.distance != distance:
            inv_freq, scaling = rope_inv_freq(cfg)
            cap = self._cap = DistanceCap(distance, inv_freq.float().to(device), float(scaling), cfg.head_dim)
        return cap

    def _teacher(self, q, k, v, position_embeddings, attention_mask, cu_seqlens):
        o = softmax_attention(q, k, v, position_embeddings, attention_mask, cu_seqlens, self.config.sliding_window)
        return self.o_proj(o)

    def _gla(self, x, q, k, v, position_embeddings, attention_mask, cache, cu_seqlens, position_ids=None):
        cfg = self.config
        B, T = q.shape[:2]
        if cfg.window and x.is_cpu:
            o = self._cpu_prefill(x, q, k, v, position_embeddings, attention_mask, cache, cu_seqlens, position_ids)
            if o is not None:
                return self.o_proj(o.reshape(B, T, -1))
        g = self._gate(x, k)
        if cfg.window:
            exact = self._exact_inputs(q, k, v, position_embeddings,
                                       turned=bool(cfg.sinks or (cfg.sparse_cache and cache is not None)))
        k, v = self._per_state_head(k), self._per_state_head(v)
        cos, sin = self._gla_rotation(position_embeddings)
        q = self.q_map(q, cos, sin, cfg.gla_backend)
        k = self.k_map(k, cos, sin, cfg.gla_backend)
        if attention_mask is not None and attention_mask.dim() == 2:
            # Padded positions must not touch the state: no key, no value, no decay.
            keep = attention_mask[:, -T:].to(v.dtype)[:, :, None, None]
            k, v, g = k * keep, v * keep, g * keep
        scale = self.head_dim ** -0.5 if cfg.feature_map == "identity" else 1.0
        if cfg.window:
            if cache is None and attention_mask is None:
                o = self._hybrid(q, k, v, g, exact, scale, cu_seqlens)
            else:
                o = self._stream(q, k, v, g, exact, scale, attention_mask, cache, position_ids)
            return self.o_proj(o.reshape(B, T, -1))
        if cu_seqlens is not None and B > 1:
            # Packed documents: the kernel takes one flat sequence with boundaries.
            q, k, v, g = (t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g))
        state = cache.recurrent_state(self.layer_idx) if cache is not None else None
        # With the normaliser, o's last column is the denominator: what a column of ones
        # appended to v returns (the state carries it as its last column too).
        if cache is not None and T == 1 and not torch.is_grad_enabled():
            o, new_state = decode_step(q, k, with_ones(v) if cfg.normalizer else v, g, scale,
                                       state, cfg.gla_backend)
        else:
            o, new_state = chunk_gla(q, k, v, g, scale=scale, initial_state=state,
                                     output_final_state=cache is not None, cu_seqlens=cu_seqlens,
                                     backend=cfg.gla_backend, normalizer=cfg.normalizer)
        if cache is not None:
            cache.set_recurrent_state(self.layer_idx, new_state)
        o = o.reshape(B, T, *o.shape[2:])
        if cfg.normalizer:
            o = normalize(o, cfg.normalizer_eps, cfg.gla_backend)
        return self.o_proj(o.reshape(B, T, -1))

    # ---------------------------------------------------------------- hybrid: window + state
    # Token i sees keys j > i - W (its window) and j < S (its document's sinks) exactly; every
    # other earlier key j enters the GLA state at step j + W, once it has left the window, and
    # decays from there on. So the two parts never count a key twice, and a document no longer
    # than the window gets exactly the teacher's attention. A sink outside the window is
    # scored as if it stood W tokens back, where it was when it left the window: with its
    # true distance the score would depend on absolute position, and past the teacher's
    # trained positions it would take values the teacher never produced.

    def _exact_inputs(self, q, k, v, position_embeddings, turned=True) -> ExactInputs:
        """The softmax part's inputs; the turned ones (sinks, sparse cache) only with `turned`."""
        cfg = self.config
        cos, sin = position_embeddings
        q_r, k_r = rope(q, cos, sin, cfg.gla_backend), rope(k, cos, sin, cfg.gla_backend)
        if not turned:
            return ExactInputs(q_r, k_r, v, None, None)
        return ExactInputs(q_r, k_r, v, q, self._turned(k, cos))

    def _turned(self, k, like):
        """k [B, N, Hkv, D] turned back by W steps (sink_rotation), in like's dtype and device."""
        turn = self._sink_turn
        if turn is None or turn[0].device != like.device or turn[0].dtype != like.dtype:
            turn = self._sink_turn = tuple(t.to(device=like.device, dtype=like.dtype)
                                           for t in sink_rotation(self.config))
        N = k.shape[1]
        return rope(k, turn[0].expand(1, N, -1), turn[1].expand(1, N, -1), self.config.gla_backend)

    def _gla_rotation(self, position_embeddings):
        """(cos, sin) of the GLA path's rotation (rope_kept_dims), (None, None) without RoPE. The
        same in every layer of a forward: the first layer works it out, the rest take it from
        _ROTATION (the model hands each layer the same position_embeddings tuple)."""
        cfg = self.config
        cos, sin = position_embeddings if cfg.use_rope else (None, None)
        if cos is None or not cfg.rope_max_wavelength:
            return cos, sin
        memo = _ROTATION.last
        if memo is not None and memo[0] is position_embeddings and memo[1] is cfg:
            return memo[2]
        keep = self._kept_dims(cos)
        out = cos * keep + (1 - keep), sin * keep              # unrotated pairs: cos 1, sin 0
        _ROTATION.last = (position_embeddings, cfg, out)
        return out

    def _kept_dims(self, like):
        """rope_kept_dims (config.rope_max_wavelength set) as 1 and 0 in like's dtype and device."""
        keep = self._rope_keep
        if keep is None or keep.device != like.device or keep.dtype != like.dtype:
            # not a buffer: from_pretrained would leave a non-persistent one uninitialised
            keep = self._rope_keep = rope_kept_dims(self.config).to(device=like.device, dtype=like.dtype)
        return keep

    def _hybrid(self, q, k, v, g, exact: ExactInputs, scale, cu_seqlens):
        """Whole sequences (training, scoring): [B, T, H, D] from the window op and chunk_gla."""
        cfg = self.config
        B, T = q.shape[:2]
        q_r, k_r, v_r, q_s, k_s = exact.q_rotated, exact.k_rotated, exact.values, exact.q_plain, exact.k_turned
        if cu_seqlens is not None and B > 1:
            q, k, v, g, q_r, k_r, v_r, q_s, k_s = (None if t is None else t.reshape(1, B * T, *t.shape[2:])
                                                   for t in (q, k, v, g, q_r, k_r, v_r, q_s, k_s))
        k_in, v_in = (_enter_state(t, cfg.window, cfg.sinks, cu_seqlens) for t in (k, v))
        o_lin, _ = chunk_gla(q, k_in, v_in, g, scale=scale, cu_seqlens=cu_seqlens, backend=cfg.gla_backend,
                             normalizer=True)
        o_win, lse = window_attention(q_r, k_r, v_r, cfg.window, cfg.sinks, scale=self.head_dim ** -0.5,
                                      cu_seqlens=cu_seqlens, q_sink=q_s, k_sink=k_s, backend=cfg.gla_backend)
        return self._combine(o_win, lse, o_lin).reshape(B, T, self.num_heads, -1)

    def _stream(self, q, k, v, g, exact, scale, attention_mask, cache, position_ids):
        """Continuing from a cache (a prompt in chunks, decode steps), or with padding: the
        layer's HybridBuffers stand before the new tokens (hybrid_cache.stream)."""
        cfg = self.config
        B, T = q.shape[:2]
        if position_ids is None:
            past = cache.seen_tokens if cache is not None else 0
            position_ids = torch.arange(past, past + T, device=q.device)[None]
        pos = position_ids.expand(B, T).long()
        if attention_mask is not None and attention_mask.dim() == 2:
            pos = torch.where(attention_mask[:, -T:].bool(), pos, -1)
        sparse = cfg.sparse_cache if cache is not None else 0
        buffers = cache.window_buffers(self.layer_idx) if cache is not None else None
        if buffers is None:
            buffers = HybridBuffers.empty(B, cfg.window, cfg.sinks, sparse, exact.k_rotated, k)
        state = cache.recurrent_state(self.layer_idx) if cache is not None else None
        layer = StreamLayer(cfg.window, cfg.sinks, sparse, scale, self.head_dim ** -0.5, cfg.gla_backend,
                            self._per_state_head, self._combine,
                            mix=(self.window_mix(), cfg.window_mix == "shared", cfg.normalizer_eps),
                            in_place=cache is not None and cache.kv_write_at is not None)
        order = None
        if cache is not None and T > 1 and not sparse:   # once per call, for every hybrid layer
            order = cache.prompt_order(T, lambda: prompt_order(buffers, state, pos, cfg.window, cfg.sinks))
        o, buffers, state = stream(layer, q, k, v, g, exact, pos, buffers, state, cache is not None, order)
        if cache is not None:
            cache.set_recurrent_state(self.layer_idx, state)
            cache.set_window_buffers(self.layer_idx, buffers)
        return o

    # ---------------------------------------------------------------- prompts on the CPU
    # Without gradients, the CPU reads whole sequences, and prompts into an empty cache, through
    # hybrid_attention_cpu: the window, the state and their mix in a few products over blocks of
    # queries, where _hybrid and _stream take the references' many small operations and layouts.

    def _cpu_prefill(self, x, q, k, v, position_embeddings, attention_mask, cache, cu_seqlens, position_ids):
        """_hybrid's output [B, T, H, D] for whole sequences, or _stream's for a prompt read into an
        empty cache, whose buffers and state it writes; None where the general path runs:
        gradients, dtypes other than float32 (autocast too), padding, packed documents, a state
        per query head, the Triton backend, a sparse cache, a cache that holds tokens already,
        positions other than 0 .. T - 1."""
        cfg = self.config
        # generate() passes a mask of ones with every prompt: that is no mask
        masked = attention_mask is not None and not (attention_mask.dim() == 2 and bool(attention_mask.all()))
        if torch.is_grad_enabled() or x.dtype != torch.float32 or torch.is_autocast_enabled("cpu") \
                or masked or cu_seqlens is not None \
                or self.num_state_heads != self.num_kv_heads or cfg.gla_backend == "triton":
            return None
        B, T = q.shape[:2]
        W, S = cfg.window, cfg.sinks
        if cache is not None:
            if cfg.sparse_cache or cache.window_buffers(self.layer_idx) is not None \
                    or cache.recurrent_state(self.layer_idx) is not None:
                return None
            if position_ids is None:
                position_ids = torch.arange(cache.seen_tokens, cache.seen_tokens + T)[None]
            pos = position_ids.expand(B, T).long()
            # the answer _stream would take from its empty buffers; once per call, for every layer
            order = cache.prompt_order(T, lambda: prompt_order(HybridBuffers.empty(B, W, S, 0, k, k), None, pos,
                                                                W, S))
            if order != "empty":
                return None
        q_r, k_r, phi_q, phi_k = self._rotations_and_maps(q, k, position_embeddings)
        k_s = self._turned(k[:, :S], q_r)
        o, state = hybrid_attention_cpu(q_r, q, k_r, k_s, v, phi_q, phi_k, self._gate(x, k, repeat=False), W, S,
                                        self.window_mix(), shared=cfg.window_mix == "shared",
                                        scale=self.head_dim ** -0.5, eps=cfg.normalizer_eps)
        if cache is not None:
            # the buffers in tensors of their own, not views that would keep the prompt's alive
            own = lambda t: t.clone(memory_format=torch.contiguous_format)     # noqa: E731
            n = min(W, T)
            window = WindowBuffer(own(k_r[:, T - n:]), own(v[:, T - n:]), own(phi_k[:, T - n:]), own(pos[:, T - n:]))
            sinks = SinkBuffer(k_s, own(v[:, :S]), own(pos[:, :S]))
            cache.set_window_buffers(self.layer_idx, HybridBuffers(window, sinks))
            cache.set_recurrent_state(self.layer_idx, state)
        return o

    def _rotations_and_maps(self, q, k, position_embeddings):
        """(rope(q), rope(k), phi(q), phi(k)) for _cpu_prefill, [B, T, heads, D or F]: the GLA
        path's rotation is the teacher's on the pairs it keeps (rope_kept_dims) and none on the
        rest. Plain feature maps run on q's and k's heads side by side, head-major ([B, heads, T,
        D], returned as transposed views: hybrid_attention_cpu reads any strides), where the
        rotation and each head's product with W are one pass each over contiguous rows; maps
        that peft wraps run their forward."""
        cfg = self.config
        B, T, H, D = q.shape
        cos, sin = position_embeddings
        if not self._plain_maps():
            qk = torch.cat([q, k], 2)                                          # [B, T, H + Hkv, D]
            r = rope(qk, cos, sin, cfg.gla_backend)
            gla_cos, gla_sin = self._gla_rotation(position_embeddings)
            return (r[:, :, :H], r[:, :, H:], self.q_map(q, gla_cos, gla_sin, cfg.gla_backend),
                    self.k_map(k, gla_cos, gla_sin, cfg.gla_backend))
        x = q.new_empty(B, H + k.shape[2], T, D)
        x[:, :H] = q.transpose(1, 2)
        x[:, H:] = k.transpose(1, 2)
        r = _rope_head_major(x, cos, sin)
        if cfg.use_rope and cfg.rope_max_wavelength:
            u = torch.where(self._kept_dims(cos) > 0, r, x)
        else:
            u = r if cfg.use_rope else x
        if cfg.feature_map == "identity":
            phi = u
        else:
            if cfg.feature_map in LEARNED_MAPS:
                u = torch.matmul(u, torch.cat([self.q_map.weight, self.k_map.weight]).detach().float())
            phi = softmax_pm(u) if cfg.feature_map == "hedgehog_pm" else torch.softmax(u, -1)
        r, phi = r.transpose(1, 2), phi.transpose(1, 2)
        return r[:, :, :H], r[:, :, H:], phi[:, :, :H], phi[:, :, H:]

    def _plain_maps(self) -> bool:
        """Whether q's and k's feature maps are FeatureMaps as they are (not wrapped by peft's
        modules_to_save), so that their weights can be read directly."""
        return type(self.q_map) is FeatureMap and type(self.k_map) is FeatureMap

    # ---------------------------------------------------------------- decode steps on the CPU
    # On the CPU a decode step of a small model is paced by Python's work per tensor operation
    # more than by the arithmetic, and the general path (stream) takes the buffers apart and
    # rebuilds them for every token. The cache's DecodeRings keep each hybrid layer's buffers in
    # the form one token reads and writes in place, and these methods take a step in a few
    # operations a layer, each writing into buffers made once (_DecodeWork). CUDA never comes
    # here: it runs the Triton kernels, in a captured graph.

    def _cpu_decode(self, x, position_embeddings, attention_mask, cache, cu_seqlens, position_ids):
        """This layer's output for one new token per row on the CPU, through cache.rings; None
        where the general path runs instead: gradients, a padding mask, packed documents, dtypes
        other than float32 (autocast too), no window, a sparse cache, a new token that is a
        sink, a captured decode graph's own cache (kv_write_at: its buffers stay where the graph
        reads them)."""
        if self.mode != "gla" or torch.is_grad_enabled() or position_ids is None or cu_seqlens is not None \
                or x.dtype != torch.float32 or (attention_mask is not None and attention_mask.dim() == 2) \
                or cache.kv_write_at is not None or torch.is_autocast_enabled("cpu"):
            return None
        rings = cache.rings
        if rings is None:
            rings = cache.rings = self._start_rings(cache, position_ids)
            if rings is None:
                return None
        step = rings.step(cache, position_ids, position_embeddings)
        if step is None:
            return None
        if self.is_softmax:
            return self._softmax_decode(x, step, cache, rings, position_ids)
        return self._hybrid_decode(x, rings.layers[self.layer_idx], step,
                                   rings.consts.get(self.layer_idx) or self._decode_consts(rings))

    def _start_rings(self, cache, position_ids):
        """DecodeRings from the cache's buffers, or None where they do not apply."""
        cfg = self.config
        if not cfg.window or cfg.sparse_cache or cfg.gla_backend == "triton" or cfg.feature_map == "identity" \
                or min(position_ids.view(-1).tolist()) < cfg.sinks:
            return None
        hybrid = [i for i in range(cfg.num_hidden_layers) if i not in cfg.softmax_layers]
        return DecodeRings.start(hybrid, cache.windows, cache.states, cfg.window, cfg.sinks, rope_kept_dims(cfg),
                                 cfg.use_rope, self.head_dim ** -0.5)

    def _hybrid_decode(self, x, ring, step, c):
        """_stream's output for one token per row, the ring and its state updated in place."""
        w, state = c.work, ring.state
        logits = self._decode_projections(x, c, w)
        # [B, H + Hkv, 3D + 1]: [rope(x), x, the query head's score bias, the GLA path's rotation]
        torch.baddbmm(c.score_bias, w.qk_heads, step.rotation, out=w.r)
        self._decode_features(w, c)                          # phi [B, H + Hs, 1, F]
        # _gate's decay: exp(logsigmoid(logits) / gate_normalizer - shift)
        torch.exp(torch.add(c.neg_shift, F.logsigmoid(logits), alpha=c.inv_norm), out=w.decay)
        # the state takes in the key leaving the window, the one in the slot the new token takes
        k_new, v_new, f_new, f_old, v_old = ring.slot(step.slot)
        c.state_rows.mul_(w.decay_rows)
        if step.enter is not False:
            if step.enter is not None:
                f_old = f_old * step.enter
            if c.repeat > 1:
                v_old = v_old.repeat_interleave(c.repeat, 1)
            state.addcmul_(f_old, v_old)
        torch.mul(w.k_rope, c.key_scale, out=k_new)
        v_new.copy_(w.v_heads)
        f_new.copy_(w.phi_k)
        torch.matmul(w.phi_q, state, out=w.o_lin)            # [num, den] per query head
        if c.shared:
            # the window's scores, then the state as one more key (window_mix_torch's shared mix):
            # score c + log den, value num / (den + eps). Every score takes -c (c.score_bias), the
            # same softmax; den is never negative (the feature maps are not), and at 0 the
            # state's share is 0.
            torch.matmul(w.q2, ring.keys_t, out=w.scores)    # [B, Hkv, G, N + 1], the last column 0
            if step.mask is not None:
                w.scores.add_(step.mask)
            torch.log(w.den, out=w.score_state)
            torch.softmax(w.scores, -1, out=w.p)
            torch.bmm(w.p_rows, ring.values_zero, out=w.pv_rows)
            torch.addcmul(w.pv, w.p_state, w.num / (w.den + c.eps), out=w.o)
        else:
            s = torch.matmul(w.q2, ring.keys_t)[..., :-1]
            if step.mask is not None:
                s = s + step.mask[..., :-1]
            o_win = torch.bmm(torch.softmax(s, -1).flatten(0, 1), ring.values_zero[:, :-1]).view(w.pv.shape)
            torch.lerp(o_win, w.num / (w.den + c.eps), torch.where(w.den > 0, c.share, 0.0), out=w.o)
        return F.linear(w.o_flat, *c.o_proj) if c.direct else self.o_proj(w.o_flat)

    def _decode_projections(self, x, c, w):
        """A decode step's projections of x [B, 1, hidden]: q and k into w.qk, v into w.v; returns
        the gate's logits (None for a softmax layer). Bare nn.Linear layers (c.direct) are
        multiplied by their weights into the work buffers; others (LoRA, hooked, with q/k norms)
        run their forward."""
        if c.direct:
            x2 = x.view(w.rows)
            _product(x2, *c.q_proj, w.q)
            _product(x2, *c.k_proj, w.k)
            _product(x2, *c.v_proj, w.v)
            if c.gate == "lowrank":
                _product(_product(x2, *c.gate_down, w.gate_down), *c.gate_up, w.gate)
            elif c.gate == "scalar":
                _product(x2, *c.gate_proj, w.gate)
            return w.gate_logits if c.gate in ("lowrank", "scalar") else \
                self._key_gate(w.k_raw, c) if c.gate == "key" else None
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)                     # [B, 1, heads D]
        if c.qk_norm:
            B, D = x.shape[0], self.head_dim
            q, k = self.q_norm(q.view(B, 1, -1, D)).view(B, 1, -1), self.k_norm(k.view(B, 1, -1, D)).view(B, 1, -1)
        torch.cat([q, k], -1, out=w.qk_row)
        w.v_row.copy_(v)
        if c.gate == "lowrank":
            return self.gate_up(self.gate_down(x))
        if c.gate == "scalar":
            return self.gate_proj(x)
        return self._key_gate(w.k_raw, c) if c.gate == "key" else None

    def _key_gate(self, k, c):
        """The "key" gate's logits from k [B, 1, Hkv, D]: the key, shifted to the starting decay."""
        return self._per_state_head(k) + c.start_logit

    def _decode_features(self, w, c):
        """phi of the GLA path's rotation of q's and k's heads into w.phi [B, H + Hs, 1, F]: q's
        maps, then k's per state head."""
        u = w.gla if c.map_heads is None else w.gla[:, c.map_heads]
        if not c.plain_maps:        # maps wrapped by peft (modules_to_save): through their forward
            H = self.num_heads
            phi = torch.cat([self.q_map(u[:, :H].transpose(1, 2)), self.k_map(u[:, H:].transpose(1, 2))], 2)
            w.phi.copy_(phi.transpose(1, 2))
            return
        if c.map_weight is not None:
            u = torch.matmul(u, c.map_weight, out=w.mapped)
        if c.pm:
            torch.cat([torch.softmax(u, -1), torch.softmax(-u, -1)], -1, out=w.phi)
        else:
            torch.softmax(u, -1, out=w.phi)

    def _decode_consts(self, rings):
        """What this layer's decode steps read that stays as it is while the rings live: the
        config, the weights' views and the new parameters as they stand when the rings are made."""
        cfg = self.config
        H, Hkv, Hs, D = self.num_heads, self.num_kv_heads, self.num_state_heads, self.head_dim
        c = _DecodeConsts()
        c.qk_norm = cfg.qk_norm
        c.gate = None if self.is_softmax else cfg.gate                 # "lowrank", "scalar" or "key"
        c.work = rings.work = rings.work or _DecodeWork(self, rings)
        linears = ("q_proj", "k_proj", "v_proj", "o_proj") + \
            {"lowrank": ("gate_down", "gate_up"), "scalar": ("gate_proj",)}.get(c.gate, ())
        c.direct = not c.qk_norm and all(bare_linear(getattr(self, n)) for n in linears)
        if c.direct:
            for n in linears:       # (W^T, bias): what _product multiplies by
                m = getattr(self, n)
                setattr(c, n, (m.weight.t(), m.bias) if n != "o_proj" else (m.weight, m.bias))
        if self.is_softmax:
            # how many keys the cache may hold before the distance cap applies (0: never); None
            # with a sliding window, left to the general path
            c.distance = None if cfg.sliding_window else int(cfg.softmax_max_distance or cfg.max_position_embeddings)
        else:
            ring = rings.layers[self.layer_idx]
            c.plain_maps = self._plain_maps()
            c.map_weight = None
            if c.plain_maps and cfg.feature_map in LEARNED_MAPS:
                c.map_weight = torch.cat([self.q_map.weight, self.k_map.weight]).detach().float()  # [H + Hs, D, D]
            # with a state per query head, k's map takes each KV head once per query head of its group
            c.map_heads = None if Hs == Hkv else \
                torch.tensor(list(range(H)) + [H + h // (Hs // Hkv) for h in range(Hs)])
            c.pm = cfg.feature_map == "hedgehog_pm"
            c.start_logit = self._start_logit()
            c.inv_norm = 1.0 / cfg.gate_normalizer
            c.neg_shift = torch.tensor(-self._decay_shift())
            # hedgehog_pm's two halves of phi share the decay of their head dimension
            c.state_rows = ring.state.view(ring.state.shape[0], Hs, 2, D, D + 1) if c.pm and c.gate != "scalar" \
                else ring.state
            c.repeat = Hs // Hkv
            c.key_scale = rings.key_scale
            c.shared = cfg.window_mix == "shared"
            logit = self.window_mix().detach()
            c.share = torch.sigmoid(logit).view(Hkv, H // Hkv, 1)
            # added to the rotations (_hybrid_decode): -c in every score of query head h, for the
            # shared mix
            c.score_bias = torch.zeros(1, H + Hkv, 3 * D + 1)
            if c.shared:
                c.score_bias[0, :H, 2 * D] = -logit
            c.eps = cfg.normalizer_eps
        rings.consts[self.layer_idx] = c
        return c

    def _softmax_decode(self, x, step, cache, rings, position_ids):
        """A softmax layer's step: cached_softmax_attention for one token where no padding was
        ever written, the distance cap is not reached and there is no sliding window; q and k
        rotated by the step's matrix."""
        c = rings.consts.get(self.layer_idx) or self._decode_consts(rings)
        kv = cache.kv_buffer(self.layer_idx)
        if kv is None or kv.padded or c.distance is None or (c.distance and kv.length >= c.distance):
            return None
        w = c.work
        self._decode_projections(x, c, w)
        torch.bmm(w.qk_heads, step.rope, out=w.qk_rope)                                # [B, H + Hkv, D]
        kv = kv.with_room(1)
        at = rings.index(kv.length)
        kv.keys.index_copy_(2, at, w.k_rope_slot)
        kv.values.index_copy_(2, at, w.v_slot)
        kv.valid.index_fill_(1, at, True)
        kv.positions[:, kv.length] = position_ids.view(-1)
        width = kv.length + 1
        o = F.scaled_dot_product_attention(w.q_rope, kv.keys[:, :, :width], kv.values[:, :, :width],
                                           scale=self.head_dim ** -0.5)
        cache.set_kv_buffer(self.layer_idx, KVBuffer(kv.keys, kv.values, kv.valid, kv.positions, width))
        o = o.view(w.o_flat.shape)
        return F.linear(o, *c.o_proj) if c.direct else self.o_proj(o)

    def _combine(self, o_win, lse, o_lin):
        """One output from the window's (o_win normalised, lse) and the state's (num, den):
        the window_mix op says how; one Triton kernel each way on CUDA."""
        return window_mix(o_win, lse, o_lin, self.window_mix(), shared=self.config.window_mix == "shared",
                          eps=self.config.normalizer_eps, backend=self.config.gla_backend)


class _DecodeConsts:
    """A layer's constants for its CPU decode steps (DecodeRings.consts), set by the layer."""


class _DecodeWork:
    """The buffers a CPU decode step writes its products into and reads back, with their views
    made once; every layer of the rings takes its step in the same ones (DecodeRings.work),
    one layer at a time."""

    def __init__(self, layer, rings):
        cfg = layer.config
        B = len(rings.positions)
        H, Hkv, Hs, D, F = layer.num_heads, layer.num_kv_heads, layer.num_state_heads, layer.head_dim, \
            feature_dim(cfg)
        G, N1 = H // Hkv, rings.sinks + rings.window + 1
        new = rings.rotation.eye.new_empty
        self.rows = (B, cfg.hidden_size)
        # the projections: q and k side by side, as heads [B, H + Hkv, D]
        self.qk = new(B, (H + Hkv) * D)
        self.q, self.k = self.qk[:, :H * D], self.qk[:, H * D:]
        self.qk_row = self.qk.view(B, 1, -1)
        self.qk_heads = self.qk.view(B, H + Hkv, D)
        self.k_raw = self.k.view(B, 1, Hkv, D)
        self.v = new(B, Hkv * D)
        self.v_row = self.v.view(B, 1, -1)
        self.v_heads = self.v.view(B, Hkv, D)
        self.v_slot = self.v_heads[:, :, None]                         # [B, Hkv, 1, D]
        self.o = new(B, Hkv, G, D)
        self.o_flat = self.o.view(B, 1, H * D)
        # a softmax layer's rotated q and k
        self.qk_rope = new(B, H + Hkv, D)
        self.q_rope = self.qk_rope[:, :H].view(B, Hkv, G, D)
        self.k_rope_slot = self.qk_rope[:, H:, None]                  # [B, Hkv, 1, D]
        # a hybrid layer's
        self.r = new(B, H + Hkv, 3 * D + 1)
        self.q2 = self.r[:, :H, :2 * D + 1].view(B, Hkv, G, 2 * D + 1)  # [rope(q), q, score bias]
        self.k_rope = self.r[:, H:, :D]
        self.gla = self.r[:, :, None, 2 * D + 1:]                      # [B, H + Hkv, 1, D]
        self.mapped = new(B, H + Hs, 1, D)
        self.phi = new(B, H + Hs, 1, F)
        self.phi_q = self.phi[:, :H].view(B, Hs, H // Hs, F)
        self.phi_k = self.phi[:, H:]
        self.o_lin = new(B, Hs, H // Hs, D + 1)
        self.num = self.o_lin.view(B, Hkv, G, D + 1)[..., :D]
        self.den = self.o_lin.view(B, Hkv, G, D + 1)[..., D:]
        self.scores = new(B, Hkv, G, N1)
        self.score_state = self.scores[..., N1 - 1:]
        self.p = new(B, Hkv, G, N1)
        self.p_rows = self.p.view(B * Hkv, G, N1)
        self.p_state = self.p[..., N1 - 1:]
        self.pv = new(B, Hkv, G, D)
        self.pv_rows = self.pv.view(B * Hkv, G, D)
        # the gate: its logits (where a projection gives them) and the decay, of the logits'
        # shape, whose rows scale the state's rows
        self.gate_down = new(B, cfg.gate_rank)
        if cfg.gate == "scalar":
            self.gate_logits, self.decay = new(B, 1, Hs), new(B, 1, Hs)
            self.decay_rows = self.decay.view(B, Hs, 1, 1)
        else:
            self.gate_logits = new(B, 1, Hs * D)
            self.decay = new(B, 1, Hs * D) if cfg.gate == "lowrank" else new(B, 1, Hs, D)   # "key": k's shape
            pm = cfg.feature_map == "hedgehog_pm"
            self.decay_rows = self.decay.view(B, Hs, 1, D, 1) if pm else self.decay.view(B, Hs, D, 1)
        self.gate = self.gate_logits.view(B, -1)


def _product(x, weight_t, bias, out):
    """x [B, in] times a linear layer's W^T [in, out], plus its bias, into `out` [B, out]."""
    return torch.mm(x, weight_t, out=out) if bias is None else torch.addmm(bias, x, weight_t, out=out)


def bare_linear(m) -> bool:
    """Whether m is an nn.Linear as it is, that no hook watches: a decode step may then take its
    product from the weight directly, and its output is a fresh tensor that no one else holds (a
    LoRA layer or a hooked module runs its forward)."""
    hooks = nn.modules.module
    return type(m) is nn.Linear and not (m._forward_hooks or m._forward_pre_hooks or hooks._global_forward_hooks
                                         or hooks._global_forward_pre_hooks)


def _rope_head_major(x, cos, sin):
    """apply_rope(x, cos, sin) for x [B, heads, T, D] (cos, sin [B or 1, T, D]) in half-width
    products and sums: x1 cos1 - x2 sin1 and x2 cos2 + x1 sin2 are what x cos + rotate_half(x)
    sin rounds to, element by element, in fewer passes and without rotate_half's copy."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty_like(x)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos[..., :half], out=o1)
    o1.sub_(x2 * sin[..., :half])
    torch.mul(x2, cos[..., half:], out=o2)
    o2.add_(x1 * sin[..., half:])
    return out


def sink_rotation(config):
    """(cos, sin) [head_dim] float32 that turn an unrotated key back by `window` steps with
    the teacher's RoPE (rope(k, cos, sin) = rope_(-W)(k)), times the RoPE attention scaling
    that the teacher's q and k each carry."""
    inv_freq, scaling = rope_inv_freq(config)
    half = config.head_dim // 2
    angle = config.window * inv_freq.float()
    angle = torch.cat([angle, angle.new_zeros(half - angle.numel())]) if angle.numel() < half else angle
    angle = torch.cat([angle, angle])
    return angle.cos() * scaling ** 2, -angle.sin() * scaling ** 2


def _enter_state(x, W, S, cu_seqlens):
    """x [B, T, ...] moved W steps later within each document, zero where the source is before
    the document's start or among its first S tokens (those stay in the window's sinks).
    A shift by padding, not a gather: its backward is a slice, not a scatter."""
    B, T = x.shape[:2]
    if W >= T or (W + S >= T and cu_seqlens is None):   # nothing leaves a window in time
        return torch.zeros_like(x)
    pad = [0, 0] * (x.dim() - 2)
    if cu_seqlens is None:   # one document per row: sources S .. T - W - 1 land at W + S ..
        return F.pad(x[:, S:T - W], pad + [W + S, 0])
    t = torch.arange(T, device=x.device)
    cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    start = cu[torch.bucketize(t, cu[1:], right=True)]
    ok = (t - W - start >= S).to(x.dtype).view(1, T, *([1] * (x.dim() - 2)))
    return F.pad(x[:, :T - W], pad + [W, 0]) * ok


def logit_for_decay(decay, normalizer):
    """The pre-sigmoid value b with exp(logsigmoid(b) / normalizer) = decay."""
    p = decay ** normalizer
    return math.log(p / (1.0 - p))
