"""The teacher's softmax attention, computed from a GLA layer's own q/k/v projections.

Distillation reads the teacher's outputs from the same weights (the layer's "softmax" and
"transfer" modes) rather than from a second copy of the model: SDPA, or torch's flash varlen
kernel over packed documents on CUDA.

This file is copied into every saved model folder: it imports only torch and the GLA ops.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from glaswap_kernels.ops import apply_rope


def softmax_attention(q, k, v, position_embeddings, attention_mask=None, cu_seqlens=None, sliding_window=None):
    """Causal softmax attention of q [B, T, H, D] over k, v [B, T, Hkv, D], RoPE applied here,
    scale D^-0.5: [B, T, H * D]."""
    cos, sin = position_embeddings
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    B, T, H, D = q.shape
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
