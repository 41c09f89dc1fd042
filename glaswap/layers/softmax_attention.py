"""The teacher's softmax attention, computed from a GLA layer's own q/k/v projections.

Distillation reads the teacher's outputs from the same weights (the layer's "softmax" and
"transfer" modes) rather than from a second copy of the model: SDPA, or torch's flash varlen
kernel over packed documents on CUDA. A softmax layer of a mixed model (config.softmax_layers)
runs it in every mode, and reads with a cache through a `KVBuffer` (cached_softmax_attention).

Past the teacher's trained positions a softmax layer would meet RoPE distances the teacher
never saw. With a `DistanceCap` of L (config.softmax_max_distance), a key L or more tokens back
is scored as if it stood exactly L back (capped distances, after ReRoPE): q . rope_(-L)(k), a score the teacher has
produced. Up to L tokens back nothing changes, so a cap at the teacher's positions leaves
every context it was trained on exactly as it was.

This file is copied into every saved model folder: it imports only torch and the GLA ops.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from glaswap_kernels.ops import apply_rope, window_attention

try:
    from torch.nn.attention.bias import causal_lower_right
except ImportError:     # older torch: an explicit mask instead
    causal_lower_right = None


def softmax_attention(q, k, v, position_embeddings, attention_mask=None, cu_seqlens=None, sliding_window=None,
                      cap: DistanceCap | None = None, position_ids=None, backend="auto"):
    """Causal softmax attention of q [B, T, H, D] over k, v [B, T, Hkv, D], RoPE applied here,
    scale D^-0.5: [B, T, H * D]. cap: scores keys cap.distance or more back as if they stood
    cap.distance back (it applies only where T exceeds it and there is no sliding window)."""
    cos, sin = position_embeddings
    B, T, H, D = q.shape
    if cap is not None and cap.applies(T, sliding_window):
        if attention_mask is None:
            # the window kernel with every older key a "sink": scored by q . rope_(-L)(k)
            turn_cos, turn_sin = (t.to(device=q.device, dtype=q.dtype).expand(1, T, -1) for t in cap.turn_back())
            o, _ = window_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, cap.distance, T,
                                    scale=D ** -0.5, cu_seqlens=cu_seqlens, q_sink=q,
                                    k_sink=apply_rope(k, turn_cos, turn_sin), backend=backend)
            return o.reshape(B, T, -1)
        # padding: through the cache's path, which masks each key
        valid = attention_mask[:, -T:].bool() if attention_mask.dim() == 2 else None
        o, _ = cached_softmax_attention(q, k, v, position_embeddings, None, valid, None, None, position_ids, cap)
        return o
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cu_seqlens is not None and attention_mask is None and varlen_ok(q, T, sliding_window):
        # packed documents: flash attention per document rather than SDPA with a [T, T]
        # mask, which rules flash out and is built in every layer
        return varlen_causal(q, k, v, cu_seqlens, T, D ** -0.5).reshape(B, T, -1)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    R = H // k.shape[1]
    if R > 1:
        k, v = k.repeat_interleave(R, dim=1), v.repeat_interleave(R, dim=1)
    mask = softmax_mask(B, T, q.device, attention_mask, cu_seqlens, sliding_window)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=D ** -0.5)
    return o.transpose(1, 2).reshape(B, T, -1)


try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
    import inspect as _inspect
    _VARLEN_ARGS = set(_inspect.signature(_varlen_attn).parameters)
except (ImportError, AttributeError, TypeError, ValueError):
    _varlen_attn, _VARLEN_ARGS = None, set()


def varlen_ok(q, T, sliding_window):
    """Whether torch's flash varlen kernel can take this teacher attention: CUDA, fp16/bf16,
    an Ampere or newer GPU, head dim a multiple of 8 up to 256, no sliding window in reach."""
    return (_varlen_attn is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256 and not (sliding_window and T > sliding_window)
            and _cuda_major(q.device.index) >= 8)


@functools.lru_cache(maxsize=None)
def _cuda_major(index):
    return torch.cuda.get_device_capability(index)[0]


def varlen_causal(q, k, v, cu_seqlens, T, scale):
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


def softmax_mask(B, T, device, attention_mask, cu_seqlens, sliding_window):
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


@dataclass(frozen=True)
class DistanceCap:
    """A softmax layer's distance cap: keys `distance` or more tokens back are scored as if they
    stood `distance` back. inv_freq [head_dim / 2 or fewer] float32, on the layer's device, and
    scaling: the teacher's RoPE (gla_attention.rope_inv_freq). Nothing here copies from the
    host, so a decode step stays capturable in a CUDA graph."""
    distance: int
    inv_freq: torch.Tensor
    scaling: float
    head_dim: int

    def applies(self, span, sliding_window=None) -> bool:
        """Whether any key can lie `distance` back within `span` tokens (a teacher with a
        sliding window never reaches further than it, so it keeps its own attention)."""
        return bool(self.distance) and span > self.distance and not sliding_window

    def _angles(self, positions):
        """[..., head_dim] rotation angles at `positions`, zero for pairs RoPE leaves alone."""
        angle = positions.float()[..., None] * self.inv_freq
        pad = self.head_dim // 2 - angle.shape[-1]
        if pad > 0:
            angle = torch.cat([angle, angle.new_zeros(*angle.shape[:-1], pad)], -1)
        return torch.cat([angle, angle], -1)

    def _at_distance(self):
        return self._angles(self.inv_freq.new_full((), float(self.distance)))

    def turn_back(self):
        """(cos, sin) [head_dim] float32 with apply_rope(k, cos, sin) = rope_(-L)(k), times the
        RoPE attention scaling that the teacher's q and k each carry."""
        angle = self._at_distance()
        return angle.cos() * self.scaling ** 2, -angle.sin() * self.scaling ** 2

    def far_queries(self, q):
        """q [B, T, heads, D] (unrotated) turned forward by L, times the scaling, as [B, heads,
        T, D]: its dot product with an unrotated key times the scaling is the capped score."""
        angle = self._at_distance()
        c, s = (angle.cos() * self.scaling).to(q.dtype), (angle.sin() * self.scaling).to(q.dtype)
        T = q.shape[1]
        return apply_rope(q, c.expand(1, T, -1), s.expand(1, T, -1)).transpose(1, 2)

    def unrotate(self, keys, positions):
        """Rotated keys [B, Hkv, S, D] at positions [B, S] turned back to their unrotated form
        (still times the scaling)."""
        angle = self._angles(positions.clamp_min(0))                   # [B, S, D]
        c, s = angle.cos().to(keys.dtype), (-angle.sin()).to(keys.dtype)
        return apply_rope(keys.transpose(1, 2), c, s).transpose(1, 2)


# A KV buffer grows by whole blocks of this many slots, and by at least a quarter of its size,
# so that decoding token by token copies it only now and then.
KV_STEP = 256


def _blocks(n):
    return -(-n // KV_STEP) * KV_STEP


@dataclass
class KVBuffer:
    """A softmax layer's KV cache: the rotated keys and the values [B, Hkv, capacity, D], of
    which the first `length` slots are written; `valid` [B, capacity], True where a slot
    holds a real token (False for padding and for slots not written yet), so that a left-padded
    row never attends to its padding; `positions` [B, capacity] long, each slot's RoPE position
    (what a distance cap needs to turn a key back). Slot order is token order. `padded`:
    whether any padding was ever written (when not, the attention needs no mask beyond
    causality)."""
    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    length: int
    padded: bool = False

    @classmethod
    def empty(cls, batch, heads, dim, like, capacity):
        """No tokens yet; `like` gives the dtype and device."""
        zeros = like.new_zeros(batch, heads, capacity, dim)
        return cls(zeros, zeros.clone(), torch.zeros(batch, capacity, dtype=torch.bool, device=like.device),
                   torch.zeros(batch, capacity, dtype=torch.long, device=like.device), 0)

    @property
    def capacity(self):
        return self.keys.shape[2]

    def tensors(self):
        return [self.keys, self.values, self.valid, self.positions]

    def map(self, fn):
        """The buffer with fn applied to each tensor (each has the batch as dimension 0)."""
        return KVBuffer(fn(self.keys), fn(self.values), fn(self.valid), fn(self.positions), self.length, self.padded)

    def resized(self, capacity, keep=None):
        """A copy in new tensors of `capacity` slots holding the last `keep` (default: all)
        written tokens."""
        keep = self.length if keep is None else min(keep, self.length)
        B, H, _, D = self.keys.shape
        out = KVBuffer.empty(B, H, D, self.keys, capacity)
        a = self.length - keep
        for mine, theirs in zip(out.tensors(), self.tensors()):
            if mine.dim() == 4:
                mine[:, :, :keep] = theirs[:, :, a:self.length]
            else:
                mine[:, :keep] = theirs[:, a:self.length]
        return dataclasses.replace(out, length=keep, padded=self.padded)

    def with_room(self, tokens):
        """This buffer if `tokens` more fit, else a larger copy."""
        need = self.length + tokens
        if need <= self.capacity:
            return self
        return self.resized(_blocks(max(need, self.capacity + self.capacity // 4)))


def cached_softmax_attention(q, k, v, position_embeddings, kv: KVBuffer | None, valid_new=None, sliding_window=None,
                             write_at=None, position_ids=None, cap: DistanceCap | None = None):
    """Causal softmax attention of T new tokens after those in `kv` (None: none), RoPE applied
    here, scale D^-0.5: (output [B, T, H * D], the buffer after). q [B, T, H, D]; k, v
    [B, T, Hkv, D]; valid_new [B, T] bool, False for padding (None: no padding); position_ids
    [B or 1, T], the new tokens' RoPE positions (None: those after the buffer's length); cap:
    the layer's DistanceCap, if any.

    Eagerly (write_at None) the buffer grows as needed and its length counts the new tokens;
    without padding no mask is built (one new token reads every key, several take SDPA's
    causal kernels). For a captured decode graph, write_at (a long tensor [1] on the device)
    is the slot of the first new token: the buffer is written in place at fixed shapes, every
    slot is read under the mask, and its length is left to the caller (the graph replays the
    same call)."""
    cos, sin = position_embeddings
    q_plain, k_plain, v_plain = q, k, v
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)          # [B, heads, T, D]
    if kv is None:
        kv = KVBuffer.empty(B, Hkv, D, k, _blocks(T))
    past = kv.length
    # eagerly, with no padding ever and every key inside the teacher's window: causality alone
    unmasked = write_at is None and valid_new is None and not kv.padded \
        and not (sliding_window and past + T > sliding_window)
    padded = kv.padded or valid_new is not None       # a given mask counts as padding (no host sync)
    if valid_new is None:
        valid_new = torch.ones(B, T, dtype=torch.bool, device=q.device)
    if write_at is None:
        kv = kv.with_room(T)
        slots = torch.arange(past, past + T, device=q.device)
        width = past + T
    else:
        slots = write_at + torch.arange(T, device=q.device)
        width = kv.capacity
    if position_ids is None:
        position_ids = (slots if write_at is None else write_at + torch.arange(T, device=q.device))[None]
    kv.keys.index_copy_(2, slots, k.to(kv.keys.dtype))
    kv.values.index_copy_(2, slots, v.to(kv.values.dtype))
    kv.valid.index_copy_(1, slots, valid_new.bool())
    kv.positions.index_copy_(1, slots, position_ids.expand(B, T).long())
    if cap is not None and cap.applies(width, sliding_window) and past == 0 and unmasked:
        # a prompt into an empty cache: the whole-sequence path (the window kernel)
        o = softmax_attention(q_plain, k_plain, v_plain, position_embeddings, cap=cap).view(B, T, H, D).transpose(1, 2)
    elif cap is not None and cap.applies(width, sliding_window):
        j = torch.arange(width, device=q.device)
        # causal over real keys; a padded query sees itself, so no row is empty
        allowed = ((j[None, :] <= slots[:, None])[None] & kv.valid[:, None, :width]) \
            | (j[None, :] == slots[:, None])[None]
        o = _capped_attention(q, cap.far_queries(q_plain), kv.keys[:, :, :width], kv.values[:, :, :width], cap,
                              kv.positions[:, slots], kv.positions[:, :width], allowed, D ** -0.5)
    elif unmasked and (past == 0 or T == 1 or causal_lower_right is not None):
        keys, values = (k, v) if past == 0 else (kv.keys[:, :, :width], kv.values[:, :, :width])
        o = _grouped_sdpa(q, keys, values, None, D ** -0.5)
    else:
        j = torch.arange(width, device=q.device)
        allowed = j[None, :] <= slots[:, None]                                     # [T, width]
        if sliding_window:
            allowed = allowed & (slots[:, None] - j[None, :] < sliding_window)
        # a padded query sees itself, so no row is empty (its output is never used)
        allowed = (allowed[None] & kv.valid[:, None, :width]) | (j[None, :] == slots[:, None])[None]
        o = _grouped_sdpa(q, kv.keys[:, :, :width], kv.values[:, :, :width], allowed, D ** -0.5)
    if write_at is None:
        kv = dataclasses.replace(kv, length=width, padded=padded)
        if sliding_window and kv.length >= 2 * sliding_window + KV_STEP:
            # keys further back than the window are never read again
            kv = kv.resized(_blocks(2 * sliding_window), keep=sliding_window - 1)
    return o.transpose(1, 2).reshape(B, T, H * D), kv


# Keys a capped layer turns back at a time, as a number of elements (a few MB at most).
CAP_PIECE = 1 << 22


def _capped_attention(q, q_far, keys, values, cap, q_pos, k_pos, allowed, scale):
    """Softmax of q [B, H, T, D] (rotated) over keys [B, Hkv, S, D] (rotated) where a key is less
    than `cap.distance` positions back, else of q_far (DistanceCap.far_queries) over the key
    turned back to its unrotated form: the capped score. q_pos [B, T], k_pos [B, S]: positions;
    allowed [B, T, S] bool. Query blocks keep the scores within about 2^26 numbers; keys are
    turned back a slice at a time, so no unrotated copy of the whole cache is ever held.
    Returns [B, H, T, D]."""
    B, H, T, D = q.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    R = H // Hkv
    block = max(1, min(T, (1 << 26) // max(1, B * H * S)))
    piece = max(16, CAP_PIECE // max(1, B * Hkv * D))
    outs = []
    for a in range(0, T, block):
        b = min(T, a + block)
        n = b - a
        q_near, q_away = (x[:, :, a:b].reshape(B, Hkv, R * n, D) for x in (q, q_far))
        s = torch.empty(B, Hkv, R, n, S, dtype=torch.float32, device=q.device)
        for c in range(0, S, piece):
            e = min(S, c + piece)
            part = keys[:, :, c:e]
            near = (q_near @ part.transpose(-1, -2)).view(B, Hkv, R, n, e - c)
            far = (q_away @ cap.unrotate(part, k_pos[:, c:e]).transpose(-1, -2)).view(B, Hkv, R, n, e - c)
            close = (q_pos[:, a:b, None] - k_pos[:, None, c:e]) < cap.distance    # [B, n, e - c]
            s[..., c:e] = torch.where(close[:, None, None], near, far)
        s = (s * scale).masked_fill_(~allowed[:, None, None, a:b], float("-inf"))
        p = torch.softmax(s, -1).to(values.dtype)
        outs.append((p.view(B, Hkv, R * n, S) @ values).view(B, H, n, D))
    return torch.cat(outs, 2)


def _grouped_sdpa(q, k, v, allowed, scale):
    """SDPA of q [B, H, T, D] over k, v [B, Hkv, S, D]: the T queries are the last T of the S
    keys' tokens. allowed: [B, T, S] bool, or None for causal attention alone. Where there is a
    mask or one query, each group's R query heads read as R * T rows, without copying k and v
    per query head. Returns [B, H, T, D]."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    R = H // Hkv
    if allowed is None and T == 1:     # one new token reads every key
        return F.scaled_dot_product_attention(q.reshape(B, Hkv, R, D), k, v, scale=scale).reshape(B, H, 1, D)
    if allowed is None:
        if R > 1:
            k, v = k.repeat_interleave(R, dim=1), v.repeat_interleave(R, dim=1)
        causal = dict(is_causal=True) if S == T else dict(attn_mask=causal_lower_right(T, S))
        return F.scaled_dot_product_attention(q, k, v, scale=scale, **causal)
    qg = q.reshape(B, Hkv, R * T, D)
    mask = allowed[:, None, None].expand(B, 1, R, T, S).reshape(B, 1, R * T, S)
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale).reshape(B, H, T, D)
