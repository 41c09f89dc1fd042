"""The GLA attention layer that replaces a teacher's softmax attention.

It keeps the teacher's `q_proj`, `k_proj`, `v_proj`, `o_proj` (and `q_norm`, `k_norm` where the
teacher has them) under the same names, so checkpoints and LoRA targets carry over, and adds
a gate and, optionally, learned feature maps. The same module can also run the teacher's
softmax attention from the same weights (`mode = "softmax"`): distillation uses that for
teacher outputs without a second copy of the model.

This file is copied into every saved model folder: it imports only torch, transformers'
public utilities and the GLA ops, never the rest of glaswap.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from glaswap_kernels.gla_ops import (HAS_TRITON, chunk_gla, feature_map, gate_logsigmoid, normalize, recurrent_gla,
                                     rope, window_attention, window_mix, with_ones)
from glaswap_kernels.gla_torch import apply_rope

# The allowed gates and feature maps: configuration_glaswap.GLA_OPTIONS (and cli.py's choices).
LEARNED_MAPS = ("hedgehog", "hedgehog_pm")   # the maps with a per-head matrix W
MODES = ("gla", "softmax")


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


class RMSNorm(nn.Module):
    """Llama's RMSNorm: normalise in float32, scale in the input dtype."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class FeatureMap(nn.Module):
    """phi(x) applied per head to q or k before the linear attention (RoPE first, if used).

    identity: phi(x) = x (plain GLA). softmax: softmax over the head dimension. hedgehog:
    softmax(x W) with one learned W per head, initialised to the identity, so it starts as
    `softmax` and can learn to sharpen or mix dimensions (Hedgehog / LoLCATs). hedgehog_pm:
    [softmax(x W), softmax(-x W)], twice as wide: one softmax can only favour large
    components of x W, the pair also sees the most negative ones (as LoLCATs' maps do). On
    CUDA the rotation, W and softmax (both halves for hedgehog_pm) run as one Triton kernel
    each way (`gla_ops.feature_map`).
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
        self.mode = "gla"
        # Set by attention transfer: also compute the GLA output in softmax mode and keep
        # its distance to the teacher's output in `transfer_loss`.
        self.transfer = False
        self.transfer_loss = None

        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(self.hidden_size, q_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(self.hidden_size, kv_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(self.hidden_size, kv_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_dim, self.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

        # New parameters (the only ones attention transfer trains).
        if config.gate == "lowrank":
            self.gate_down = nn.Linear(self.hidden_size, config.gate_rank, bias=False)
            self.gate_up = nn.Linear(config.gate_rank, self.num_state_heads * self.head_dim, bias=True)
        elif config.gate == "scalar":
            self.gate_proj = nn.Linear(self.hidden_size, self.num_state_heads, bias=True)
        self._rope_keep = None   # rope_kept_dims as cos's dtype and device, made on first use
        self._sink_turn = None   # (cos, sin) of sink_rotation, made on first use
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
        names = [n for n, _ in self.named_parameters()
                 if n.startswith(("gate_down.", "gate_up.", "gate_proj.", "q_map.", "k_map.", "window_mix."))]
        return names

    # ----------------------------------------------------------------------------------
    def _project(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _gate(self, x, k_raw):
        """Per-step log-decays g [B, T, Hkv, feature_dim] (<= 0), in x's dtype (hedgehog_pm's
        two halves share the decay of their head dimension)."""
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
                               repeat=2 if cfg.feature_map == "hedgehog_pm" else 1, shift=self._decay_shift(),
                               backend=cfg.gla_backend)

    def _decay_shift(self):
        """1 / decay_horizon (0 without one): subtracted from every log-decay, so no decay
        exceeds exp(-1 / decay_horizon)."""
        horizon = float(self.config.decay_horizon)
        return 1.0 / horizon if horizon else 0.0

    def _start_logit(self):
        """The gate logit whose decay, after the horizon's shift, is gate_init_decay."""
        cfg = self.config
        return _logit_for_decay(cfg.gate_init_decay * math.exp(self._decay_shift()), cfg.gate_normalizer)

    def _per_state_head(self, t):
        """A [B, T, Hkv, ...] key/value tensor repeated over each group's query heads when
        every query head has its own state; unchanged otherwise."""
        R = self.num_state_heads // self.num_kv_heads
        return t.repeat_interleave(R, dim=2) if R > 1 else t

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, cu_seqlens=None, position_ids=None, **kwargs):
        if self.mode == "softmax" and self.transfer:
            # Attention transfer: this layer's gate and feature maps learn on the teacher's own
            # inputs and projections, held fixed. Without the detach each layer's loss would run
            # backward through every earlier layer too (stage 2's LoRA adapters already require
            # grad), which changes no gradient of the trained parameters but costs a full backward.
            x = hidden_states.detach()
            with torch.no_grad():
                q, k, v = self._project(x)
                out = self._softmax_attention(q, k, v, position_embeddings, attention_mask, cu_seqlens)
            gla = self._gla(x, q, k, v, position_embeddings, attention_mask, None, cu_seqlens, position_ids)
            self.transfer_loss = F.mse_loss(gla.float(), out.float())
            return out, None
        q, k, v = self._project(hidden_states)
        if self.mode == "softmax":
            out = self._softmax_attention(q, k, v, position_embeddings, attention_mask, cu_seqlens)
            return out, None
        return self._gla(hidden_states, q, k, v, position_embeddings, attention_mask,
                         past_key_values, cu_seqlens, position_ids), None

    def _softmax_attention(self, q, k, v, position_embeddings, attention_mask, cu_seqlens):
        """The teacher's attention from the same weights: SDPA, or flash varlen over packed
        documents on CUDA."""
        cos, sin = position_embeddings
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        B, T = q.shape[:2]
        if cu_seqlens is not None and attention_mask is None and _varlen_ok(q, T, self.config.sliding_window):
            # packed documents: flash attention per document rather than SDPA with a [T, T]
            # mask, which rules flash out (at 8 x 2048 the masked kernel takes twice as long,
            # and the mask is built in every layer)
            o = _varlen_causal(q, k, v, cu_seqlens, T, self.head_dim ** -0.5)
            return self.o_proj(o.reshape(B, T, -1))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        R = self.num_heads // self.num_kv_heads
        if R > 1:
            k, v = k.repeat_interleave(R, dim=1), v.repeat_interleave(R, dim=1)
        mask = _softmax_mask(B, T, q.device, attention_mask, cu_seqlens, self.config.sliding_window)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           scale=self.head_dim ** -0.5)
        o = o.transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(o)

    def _gla(self, x, q, k, v, position_embeddings, attention_mask, cache, cu_seqlens, position_ids=None):
        cfg = self.config
        B, T = q.shape[:2]
        g = self._gate(x, k)
        if cfg.window:
            exact = self._exact_inputs(q, k, v, position_embeddings,
                                       turned=bool(cfg.sinks or (cfg.sparse_cache and cache is not None)))
        k, v = self._per_state_head(k), self._per_state_head(v)
        cos, sin = position_embeddings if cfg.use_rope else (None, None)
        if cos is not None and cfg.rope_max_wavelength:
            keep = self._rope_keep
            if keep is None or keep.device != cos.device or keep.dtype != cos.dtype:
                # not a buffer: from_pretrained would leave a non-persistent one uninitialised
                keep = self._rope_keep = rope_kept_dims(cfg).to(device=cos.device, dtype=cos.dtype)
            cos, sin = cos * keep + (1 - keep), sin * keep     # unrotated pairs: cos 1, sin 0
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
                valid = attention_mask[:, -T:].bool() if attention_mask is not None and attention_mask.dim() == 2 \
                    else torch.ones(B, T, dtype=torch.bool, device=q.device)
                if position_ids is None:
                    past = cache.seen_tokens if cache is not None else 0
                    position_ids = torch.arange(past, past + T, device=q.device)[None]
                o = self._hybrid_stream(q, k, v, g, exact, scale, position_ids.expand(B, T), valid, cache)
            return self.o_proj(o.reshape(B, T, -1))
        if cu_seqlens is not None and B > 1:
            # Packed documents: the kernel takes one flat sequence with boundaries.
            q, k, v, g = (t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g))
        state = cache.recurrent_state(self.layer_idx) if cache is not None else None
        # With the normaliser, o's last column is the denominator: what a column of ones
        # appended to v returns (the state carries it as its last column too).
        if cache is not None and T == 1 and not torch.is_grad_enabled():
            o, new_state = _decode_step(q, k, with_ones(v) if cfg.normalizer else v, g, scale,
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
    # trained positions it takes values the teacher never produced (measured: the one-pass
    # loss then climbs from 8K tokens on).

    def _exact_inputs(self, q, k, v, position_embeddings, turned=True):
        """(q_r, k_r, v, q_sink, k_sink): the teacher's rotated q and k for the window; for the
        sinks and the sparse cache (None without `turned`) the unrotated q and k turned back by
        W steps, since rope_i(q) . rope_(i-W)(k) = q . rope_(-W)(k)."""
        cfg = self.config
        cos, sin = position_embeddings
        q_r, k_r = rope(q, cos, sin, cfg.gla_backend), rope(k, cos, sin, cfg.gla_backend)
        if not turned:
            return q_r, k_r, v, None, None
        turn = self._sink_turn
        if turn is None or turn[0].device != cos.device or turn[0].dtype != cos.dtype:
            turn = self._sink_turn = tuple(t.to(device=cos.device, dtype=cos.dtype) for t in sink_rotation(cfg))
        T = k.shape[1]
        k_s = rope(k, turn[0].expand(1, T, -1), turn[1].expand(1, T, -1), cfg.gla_backend)
        return q_r, k_r, v, q, k_s

    def _hybrid(self, q, k, v, g, exact, scale, cu_seqlens):
        """Whole sequences (training, scoring): [B, T, H, D] from the window op and chunk_gla."""
        cfg = self.config
        B, T = q.shape[:2]
        q_r, k_r, v_r, q_s, k_s = exact
        if cu_seqlens is not None and B > 1:
            q, k, v, g, q_r, k_r, v_r, q_s, k_s = (None if t is None else t.reshape(1, B * T, *t.shape[2:])
                                                   for t in (q, k, v, g, q_r, k_r, v_r, q_s, k_s))
        k_in, v_in = (_enter_state(t, cfg.window, cfg.sinks, cu_seqlens) for t in (k, v))
        o_lin, _ = chunk_gla(q, k_in, v_in, g, scale=scale, cu_seqlens=cu_seqlens, backend=cfg.gla_backend,
                             normalizer=True)
        o_win, lse = window_attention(q_r, k_r, v_r, cfg.window, cfg.sinks, scale=self.head_dim ** -0.5,
                                      cu_seqlens=cu_seqlens, q_sink=q_s, k_sink=k_s, backend=cfg.gla_backend)
        return self._combine(o_win, lse, o_lin).reshape(B, T, self.num_heads, -1)

    def _hybrid_stream(self, q, k, v, g, exact, scale, pos, valid, cache):
        """Continuing from a cache (prefill in chunks, decode steps) or with padding: the
        cache's window buffer (the last W tokens' rotated keys, values, feature-mapped keys
        and positions, -1 for none or padding) and sink buffer (the sinks' keys as
        _exact_inputs turns them) stand before the new tokens. With a sparse cache the new
        tokens go through in blocks of SPARSE_BLOCK, each choosing which keys leaving the
        window the cache keeps (_sparse_select)."""
        cfg = self.config
        B, T = q.shape[:2]
        M = cfg.sparse_cache if cache is not None else 0
        buf = cache.window_buffers(self.layer_idx) if cache is not None else None
        if buf is None:
            buf = empty_window_buffers(B, cfg.window, cfg.sinks, exact[1], k, M)
        state = cache.recurrent_state(self.layer_idx) if cache is not None else None
        pos = torch.where(valid, pos.long(), -1)
        step = SPARSE_BLOCK if M else T
        outs = []
        for a in range(0, T, step):
            part = slice(a, min(T, a + step))
            o, buf, state = self._stream_block(
                q[:, part], k[:, part], v[:, part], g[:, part], tuple(t if t is None else t[:, part] for t in exact),
                scale, pos[:, part], buf, state, M, cache is not None)
            outs.append(o)
        if cache is not None:
            cache.set_recurrent_state(self.layer_idx, state)
            cache.set_window_buffers(self.layer_idx, buf)
        return outs[0] if len(outs) == 1 else torch.cat(outs, 1)

    def _stream_block(self, q, k, v, g, exact, scale, pos, buf, state, M, cached):
        """One stretch of new tokens after `buf` and `state`: (o, buffers after, state after)."""
        cfg = self.config
        W, S = cfg.window, cfg.sinks
        T = q.shape[1]
        q_r, k_r, v_r, q_s, k_s = exact
        K, V = torch.cat([buf["k"], k_r], 1), torch.cat([buf["v"], v_r], 1)
        FK, P = torch.cat([buf["fk"], k], 1), torch.cat([buf["pos"], pos], 1)
        # New step t takes into the state the key that leaves the window then: index t of the
        # concatenation (W steps back), unless it is padding, empty or a sink (or, with a sparse
        # cache, kept there).
        enter = (P[:, :T] >= S)[:, :, None]                                          # [B, T, 1]
        memory = None
        if M:
            TK = torch.cat([buf["tk"], k_s], 1)
            kept, memory, state = _sparse_select(buf, state, FK[:, :T], V[:, :T], TK[:, :T], P[:, :T], g, S,
                                                  self._per_state_head)
            enter = enter & ~kept                                                    # [B, T, Hkv]
        enter = self._per_state_head(enter[..., None])                               # [B, T, Hs or 1, 1]
        k_in = FK[:, :T] * enter.to(FK.dtype)
        v_in = self._per_state_head(V[:, :T]) * enter.to(V.dtype)
        if cached and T == 1 and not torch.is_grad_enabled():
            o_lin, new_state = _decode_step(q, k_in, with_ones(v_in), g, scale, state, cfg.gla_backend)
        else:
            o_lin, new_state = chunk_gla(q, k_in, v_in, g, scale=scale, initial_state=state,
                                         output_final_state=cached, backend=cfg.gla_backend, normalizer=True)
        after = _advance_buffers(buf, K, V, FK, P, k_s, v_r, pos, W, S)
        # the sinks among the new tokens count too (each only for queries W or more later)
        o_win, lse = _window_over_buffer(q_r, q_s, K, V, P, after, pos, W, self.head_dim ** -0.5, memory=memory)
        if M:
            after.update(tk=TK[:, -W:] if T == 1 else TK[:, -W:].clone(),
                         **{n: memory[n] for n in ("mk", "mv", "mfk", "mg", "mpos")})
        return self._combine(o_win, lse, o_lin), after, new_state

    def _combine(self, o_win, lse, o_lin):
        """One output from the window's (o_win normalised, lse) and the state's (num, den):
        window_torch.window_mix_torch says how; one Triton kernel each way on CUDA."""
        return window_mix(o_win, lse, o_lin, self.window_mix(), shared=self.config.window_mix == "shared",
                          eps=self.config.normalizer_eps, backend=self.config.gla_backend)


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


def empty_window_buffers(B, W, S, k_r, fk, M=0):
    """The window and sink buffers of a cache before any token: every position -1. Keys: the
    last W tokens' rotated keys, values, feature-mapped keys and positions (k, v, fk, pos) and
    the S sinks' turned keys (_exact_inputs), values and positions (sk, sv, spos). With a
    sparse cache of M tokens also the window's turned keys (tk) and the cache's
    turned keys, values, feature-mapped keys, log-decays since each would have entered the
    state (float32) and positions (mk, mv, mfk, mg, mpos)."""
    bufs = {"k": k_r.new_zeros(B, W, *k_r.shape[2:]), "v": k_r.new_zeros(B, W, *k_r.shape[2:]),
            "fk": fk.new_zeros(B, W, *fk.shape[2:]), "pos": torch.full((B, W), -1, device=k_r.device),
            "sk": k_r.new_zeros(B, S, *k_r.shape[2:]), "sv": k_r.new_zeros(B, S, *k_r.shape[2:]),
            "spos": torch.full((B, S), -1, device=k_r.device)}
    if M:
        bufs.update(tk=k_r.new_zeros(B, W, *k_r.shape[2:]),
                    mk=k_r.new_zeros(B, M, *k_r.shape[2:]), mv=k_r.new_zeros(B, M, *k_r.shape[2:]),
                    mfk=fk.new_zeros(B, M, *fk.shape[2:]),
                    mg=torch.zeros(B, M, *fk.shape[2:], device=k_r.device),
                    mpos=torch.full((B, M, k_r.shape[2]), -1, device=k_r.device))
    return bufs


# A sparse cache chooses what it keeps once per this many new tokens: every key leaving the
# window within a block is scored against the state as it stood at the block's start.
SPARSE_BLOCK = 64


def _sparse_select(buf, state, fk, v, tk, p, g, S, rep):
    """Which tokens a sparse cache keeps (after LoLA, arXiv 2505.23666): the cache's own and
    those leaving the window in this block compete, and the M that the state recalls worst
    (largest ||v - S^T phi(k) / z^T phi(k)||^2 with every candidate in S, averaged over the
    layer's state heads) stay out of the state in every KV head, attended exactly as sinks
    are (_window_over_buffer). Keys like many others, such as repeated text, go into
    the state; a key unlike the rest, such as a number stated once, stays exact. A cache key
    that loses enters the state now with the decay it would have had since its own step.
    Returns (kept [B, T, Hkv] for the leaving rows, the cache for this block and after it,
    the state with the evicted keys added). rep: a KV-head tensor [B, N, Hkv, ...] repeated over
    each KV head's state heads (GLAAttention._per_state_head). Fixed shapes: a decode step
    stays capturable."""
    B, T, Hs, F = fk.shape
    Hkv = v.shape[2]
    M = buf["mpos"].shape[1]
    c_fk = torch.cat([buf["mfk"], fk], 1)                                          # [B, M + T, Hs, F]
    c_v = torch.cat([buf["mv"], v], 1)                                             # [B, M + T, Hkv, D]
    c_pos = torch.cat([buf["mpos"], p[:, :, None].expand(B, T, Hkv)], 1)           # [B, M + T, Hkv]
    if state is None:
        state = torch.zeros(B, Hs, F, v.shape[-1] + 1, device=v.device)
    ok = c_pos >= S                                                                # never a sink, pad or none
    vs = with_ones(rep(c_v).float())
    # Self-recall: each candidate is read back from the state with every candidate in it (the
    # cache's keys decayed as they would be, this block's at full weight), so a key like many
    # others is recalled well and a key unlike the rest poorly, even while the state is empty.
    c_w = torch.cat([buf["mg"].exp(), torch.ones_like(fk, dtype=torch.float32)], 1) * rep(ok)[..., None]
    full = state + torch.einsum("bchf,bchd->bhfd", c_fk.float() * c_w, vs)
    pred = torch.einsum("bchf,bhfd->bchd", c_fk.float(), full)
    miss = ((vs[..., :-1] - pred[..., :-1] / pred[..., -1:].clamp_min(1e-6)) ** 2).sum(-1)
    # One choice per token for all of the layer's KV heads, so each head holds every token the
    # cache keeps (choices per head would keep different digits of a number in each head)
    score = miss.mean(-1).masked_fill(~ok[..., 0], -math.inf)                       # [B, M + T]
    top, idx = (t[..., None].expand(B, M, Hkv) for t in score.topk(M, dim=1))      # [B, M, Hkv]
    live = top > -math.inf
    kept = torch.zeros_like(ok).scatter(1, idx, live)                              # [B, M + T, Hkv]
    # cache keys that lose go into the state; row t of this block would enter at step t
    out = rep(ok[:, :M] & ~kept[:, :M])                                            # [B, M, Hs]
    state = state + torch.einsum("bmhf,bmhd->bhfd", c_fk[:, :M].float() * (c_w[:, :M] * out[..., None]), vs[:, :M])
    cum = g.float().cumsum(1)                                                      # [B, T, Hs, F]
    c_g = torch.cat([buf["mg"] + cum[:, -1:], cum[:, -1:] - cum], 1)                # decay to the block's end
    idx_s = rep(idx)
    pick = lambda t, i: t.gather(1, i[..., None].expand(-1, -1, -1, t.shape[-1]))  # noqa: E731
    memory = {"mk": pick(torch.cat([buf["mk"], tk], 1), idx), "mv": pick(c_v, idx),
              "mfk": pick(c_fk, idx_s), "mg": pick(c_g, idx_s),
              "mpos": torch.where(live, c_pos.gather(1, idx), -1),
              # a key that joins in this block is seen from its own step on (it leaves the window then)
              "from": torch.where(live, idx - M, -1)}
    return kept[:, M:], memory, state


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


def _window_over_buffer(q_r, q_s, K, V, P, buf, pos, W, scale, block=256, memory=None):
    """Exact softmax of the T new queries over their last W keys in K/V [B, W + T, Hkv, D]
    (positions P, -1 = none, scored with the rotated queries q_r), over the sink buffer's
    keys (the new tokens' included) that have left the query's window, and over a sparse
    cache's keys (`memory`, _sparse_select; both scored with q_s): (o [B, T, H, D] in q's
    dtype, lse [B, T, H] float32). Plain PyTorch, query blocks of `block`, so memory stays
    O(block x (W + block))."""
    B, T, H, D = q_r.shape
    R = H // K.shape[2]
    heads = lambda t: t.float().transpose(1, 2).repeat_interleave(R, 1)          # noqa: E731  [B, H, N, D]
    spos = buf["spos"]
    # keys scored with q_s, and which queries see each: the sinks once out of the query's
    # window, a cache key from the step it left the window (its "from", -1 for older ones)
    apart = []
    if memory is not None:
        seen = (memory["mpos"] >= 0)[..., None] & (memory["from"][..., None] <= torch.arange(T, device=q_r.device))
        apart.append((heads(memory["mk"]), heads(memory["mv"]), seen.permute(0, 2, 3, 1).repeat_interleave(R, 1)))
    if spos.shape[1]:
        seen = (spos[:, None, :] >= 0) & (spos[:, None, :] <= pos[:, :, None] - W)                  # [B, T, S]
        apart.append((heads(buf["sk"]), heads(buf["sv"]), seen[:, None]))
    outs, lses = [], []
    for a in range(0, T, block):
        b = min(T, a + block)
        qb = q_r[:, a:b].float().transpose(1, 2)                                  # [B, H, n, D]
        kk = heads(K[:, a + 1:W + b])                                             # keys a+1 .. W+b-1
        vv = heads(V[:, a + 1:W + b])
        t = torch.arange(a, b, device=q_r.device)[:, None]
        j = torch.arange(a + 1, W + b, device=q_r.device)[None, :]
        in_window = (j >= t + 1) & (j <= W + t)                                    # [n, keys]
        live = P[:, a + 1:W + b] >= 0                                              # [B, keys]
        allowed = in_window[None] & (live[:, None, :] | (j == W + t)[None])        # a query sees itself
        s = scale * qb @ kk.transpose(-1, -2)
        s = s.masked_fill(~allowed[:, None], float("-inf"))
        if apart:
            qs = q_s[:, a:b].float().transpose(1, 2)
            s = torch.cat([(scale * qs @ ka.transpose(-1, -2)).masked_fill(~seen[:, :, a:b], float("-inf"))
                           for ka, _, seen in apart] + [s], -1)
            vv = torch.cat([va for _, va, _ in apart] + [vv], -2)
        lse = torch.logsumexp(s, -1)                                               # [B, H, n]
        outs.append((torch.exp(s - lse[..., None]) @ vv).transpose(1, 2))
        lses.append(lse.transpose(1, 2))
    return torch.cat(outs, 1).to(q_r.dtype), torch.cat(lses, 1)


def _advance_buffers(buf, K, V, FK, P, k_s, v_r, pos, W, S):
    """The buffers after the new tokens: the last W of the concatenation, and the sinks among
    the new tokens (keys k_s, as _exact_inputs turns them) written into their slots. After
    several new tokens the last W rows are copied, since a view would keep a whole prefill's
    keys alive; after one (a decode step) a view holds a single row more, and saves a copy."""
    last = (lambda t: t[:, -W:]) if K.shape[1] == W + 1 else (lambda t: t[:, -W:].clone())
    new = {"k": last(K), "v": last(V), "fk": last(FK), "pos": last(P)}
    if S:
        hit = pos[:, :, None] == torch.arange(S, device=pos.device)                   # [B, T, S]
        got = hit.any(1)                                                               # [B, S]
        hitf = hit.to(k_s.dtype)
        new["sk"] = torch.where(got[:, :, None, None], torch.einsum("bts,bthd->bshd", hitf, k_s), buf["sk"])
        new["sv"] = torch.where(got[:, :, None, None], torch.einsum("bts,bthd->bshd", hitf, v_r), buf["sv"])
        new["spos"] = torch.where(got, torch.arange(S, device=pos.device).expand_as(got), buf["spos"])
    else:
        new.update(sk=buf["sk"], sv=buf["sv"], spos=buf["spos"])
    return new


def _decode_step(q, k, v, g, scale, state, backend):
    """One token of generation: (o [B, 1, H, V], new state [B, Hkv, K, V] float32).

    The Triton kernel on CUDA (one launch); elsewhere a few batched tensor ops, since the
    reference recurrence in gla_torch loops over the batch in Python. Same maths as
    `recurrent_gla`: S = diag(exp(g)) S + k^T v, o = scale * q S.
    """
    if backend == "triton" or (backend == "auto" and HAS_TRITON and q.is_cuda):
        return recurrent_gla(q, k, v, g, scale=scale, initial_state=state, output_final_state=True,
                             backend=backend)
    B, _, H, K = q.shape
    Hkv, V = k.shape[2], v.shape[-1]
    k1, v1, g1 = k[:, 0].float(), v[:, 0].float(), g[:, 0].float()          # [B, Hkv, K or V]
    S = k1[..., :, None] * v1[..., None, :]
    if state is not None:
        S = torch.addcmul(S, g1.exp()[..., None], state)
    o = torch.matmul(q[:, 0].float().view(B, Hkv, H // Hkv, K), S) * scale  # [B, Hkv, R, V]
    return o.reshape(B, 1, H, V).to(q.dtype), S


def _logit_for_decay(decay, normalizer):
    """The pre-sigmoid value b with exp(logsigmoid(b) / normalizer) = decay."""
    p = decay ** normalizer
    return math.log(p / (1.0 - p))


try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
    import inspect as _inspect
    _VARLEN_ARGS = set(_inspect.signature(_varlen_attn).parameters)
except (ImportError, AttributeError, TypeError, ValueError):
    _varlen_attn, _VARLEN_ARGS = None, set()


def _varlen_ok(q, T, sliding_window):
    """Whether torch's flash varlen kernel can take this teacher attention: CUDA, fp16/bf16,
    an Ampere or newer GPU, head dim a multiple of 8 up to 256, no sliding window in reach."""
    return (_varlen_attn is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256 and not (sliding_window and T > sliding_window)
            and _cuda_major(q.device.index) >= 8)


@functools.lru_cache(maxsize=None)
def _cuda_major(index):
    return torch.cuda.get_device_capability(index)[0]


def _varlen_causal(q, k, v, cu_seqlens, T, scale):
    """Causal softmax attention inside each document of q, k, v [B, T, heads, D], the
    documents given by cu_seqlens over the flattened B*T tokens: [B*T, H, D]. max_q = T
    bounds every document (none crosses a row), so the host never reads cu_seqlens."""
    B, H, Hkv, D = q.shape[0], q.shape[2], k.shape[2], q.shape[3]
    q, k, v = (t.reshape(B * T, t.shape[2], D) for t in (q, k, v))
    extra = {}
    if Hkv != H:
        if "enable_gqa" in _VARLEN_ARGS:
            extra["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    if "window_size" in _VARLEN_ARGS:
        extra["window_size"] = (-1, 0)
    else:
        extra["is_causal"] = True
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    return _varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, T, T, scale=scale, **extra)


def _softmax_mask(B, T, device, attention_mask, cu_seqlens, sliding_window):
    """A boolean [B or 1, 1, T, T] mask where plain causal attention is not enough, else None."""
    if attention_mask is None and cu_seqlens is None and not (sliding_window and T > sliding_window):
        return None
    i = torch.arange(T, device=device)
    allowed = i[:, None] >= i[None, :]
    if sliding_window and T > sliding_window:
        allowed = allowed & (i[:, None] - i[None, :] < sliding_window)
    allowed = allowed[None, None]
    if cu_seqlens is not None:  # documents packed into the B x T blocks (flattened offsets)
        flat = torch.arange(B * T, device=device)
        doc = torch.bucketize(flat, cu_seqlens[1:-1].to(device=device, dtype=torch.long), right=True).view(B, T)
        allowed = allowed & (doc[:, :, None] == doc[:, None, :])[:, None]
    if attention_mask is not None and attention_mask.dim() == 2:
        keep = attention_mask[:, -T:].bool()
        allowed = allowed & keep[:, None, None, :]
        # A fully padded query row would give NaN; let it see itself (its output is unused).
        allowed = allowed | torch.eye(T, dtype=torch.bool, device=device)[None, None]
    return allowed
