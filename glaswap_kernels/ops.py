"""One entry point per GLA form, choosing the implementation.

`chunk_gla` (prefill and training) and `recurrent_gla` (token-by-token, for generation)
run glaswap's Triton kernels on CUDA when Triton imports, and the PyTorch forms everywhere
else. Both forms take and return the same shapes; see `gla.reference` for the contract.
`window_attention` (exact softmax over a sliding window plus sinks) and `window_mix` (its
combination with the GLA state's output) dispatch the same way; see `window.reference` for their
contracts. So does `rope`, the teacher's rotation of q and k for the window part.
`decode_step` (one generated token for a batch) and `window_over_buffer` (the window part
of a cached hybrid layer's new tokens) are the hybrid cache's two steps; a prompt read after a
full cache takes `window_over_full_buffer`, the window kernel itself.
"""

from __future__ import annotations

import torch

from .gla.reference import (apply_rope, chunk_gla_torch, decode_step_torch, feature_map_torch, recurrent_gla_torch,
                             softmax_pm)
from .window.reference import hybrid_decode_torch, window_attention_torch, window_mix_torch, window_over_buffer_torch

try:  # Triton is optional: a saved model must load on machines without it.
    from .feature_map_triton import fused_feature_map
    from .gate_triton import fused_gate
    from .gla.chunk import fused_chunk_gla
    from .gla.recurrent import fused_recurrent_gla
    from .normalizer_triton import fused_normalize
    from .rmsnorm_triton import fused_rms_norm
    from .silu_mul_triton import fused_silu_mul
    from .rope_triton import fused_rope
    from .utils import interpreting
    from .window.decode import fused_hybrid_decode
    from .window.mix import fused_window_mix
    from .window.triton import fused_window_attention
    HAS_TRITON = True
except Exception:  # ImportError, or a Triton too old for the kernels
    fused_chunk_gla = fused_recurrent_gla = fused_feature_map = fused_normalize = fused_gate = fused_rms_norm = fused_silu_mul = None
    fused_window_attention = fused_window_mix = fused_rope = interpreting = fused_hybrid_decode = None
    HAS_TRITON = False

BACKENDS = ("auto", "triton", "torch")


def _use_triton(x, backend):
    if backend not in BACKENDS:
        raise ValueError(f"unknown GLA backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "torch" or (backend == "auto" and not x.is_cuda):   # auto: Triton on CUDA only
        return False
    ok = HAS_TRITON and (x.is_cuda or interpreting())
    if backend == "triton" and not ok:
        raise RuntimeError("the Triton GLA kernels need Triton and a CUDA tensor (or TRITON_INTERPRET=1)")
    return ok


def with_ones(v):
    """v with a column of ones appended: GLA on it returns the normaliser as column V."""
    return torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)


def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, backend="auto", normalizer=False):
    """Chunked GLA over whole sequences: returns (o [B, T, H, V], final state or None).
    normalizer=True: o gets a last column, sum_j (q_i decay_ij) k_j * scale (what a column of
    ones appended to v gives), and the states are K x (V + 1)."""
    if _use_triton(q, backend):
        # The kernels compute the normaliser themselves: a column of ones in v would add a
        # V tile (doubling them at V = 64).
        return fused_chunk_gla(q, k, v, g, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                               normalizer=normalizer)
    return chunk_gla_torch(q, k, with_ones(v) if normalizer else v, g, scale=scale,
                           initial_state=initial_state, output_final_state=output_final_state,
                           cu_seqlens=cu_seqlens)


def feature_map(x, cos=None, sin=None, weight=None, softmax=True, backend="auto", pm=False):
    """phi(x) = softmax(rope(x) W_h) over the head dimension (see gla.reference.feature_map_torch;
    pm=True: both softmax(+-rope(x) W_h), 2D wide): one fused Triton kernel each way on CUDA,
    PyTorch elsewhere and for the identity map."""
    if softmax and x.shape[-1] % 2 == 0 and _use_triton(x, backend):
        return fused_feature_map(x, cos, sin, weight, pm=pm)
    return feature_map_torch(x, cos, sin, weight, softmax=softmax, pm=pm)


def normalize(o, eps=1e-6, backend="auto"):
    """o [..., V + 1] from a normalizer=True call -> num / (den + eps), [..., V] in o's dtype."""
    if _use_triton(o, backend):
        return fused_normalize(o, eps)
    num, den = o[..., :-1], o[..., -1:]
    return num / (den.float() + eps).to(num.dtype)


def rms_norm(x, weight, eps=1e-6, backend="auto"):
    """Llama's RMSNorm: weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), normalised in float32.
    One Triton kernel on CUDA where no gradient is wanted (inference); PyTorch's ops otherwise."""
    wants_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if not wants_grad and _use_triton(x, backend):
        return fused_rms_norm(x, weight, eps)
    dtype = x.dtype
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def silu_mul(a, b, overwrite=False, backend="auto"):
    """The gated MLP's silu(a) * b: one Triton kernel on CUDA where no gradient is wanted.
    overwrite: a is a fresh tensor that no one else holds, so PyTorch's ops may work in it
    (sparing two tensors of its size) where no gradient is wanted."""
    wants_grad = torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)
    if not wants_grad and a.shape == b.shape and a.dtype == b.dtype and _use_triton(a, backend):
        return fused_silu_mul(a, b)
    if overwrite and not wants_grad:
        return torch.nn.functional.silu(a, inplace=True).mul_(b)
    return torch.nn.functional.silu(a) * b


def gate_logsigmoid(x, normalizer, repeat=1, shift=0.0, backend="auto"):
    """Gate logits x [..., D] -> log-decays logsigmoid(x) / normalizer - shift (float32 maths,
    x's dtype), repeated `repeat` times along the last dimension: [..., repeat * D]."""
    if _use_triton(x, backend):
        return fused_gate(x, normalizer, repeat, shift)
    if torch.is_grad_enabled() and x.requires_grad:
        g = (torch.nn.functional.logsigmoid(x.float()) / normalizer - shift).to(x.dtype)
    else:       # the same operations in place, sparing two tensors of x's size
        g = torch.nn.functional.logsigmoid(x.float()).div_(normalizer).sub_(shift).to(x.dtype)
    return torch.cat([g] * repeat, dim=-1) if repeat > 1 else g


def _recurrent_on_triton(q, k, v, backend):
    """The Triton recurrence has no backward: with gradients the PyTorch form runs."""
    return _use_triton(q, backend) and not (q.requires_grad or k.requires_grad or v.requires_grad)


def recurrent_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
                  backend="auto"):
    """Token-by-token GLA (a decode step when T = 1): returns (o, final state or None)."""
    if _recurrent_on_triton(q, k, v, backend):
        return fused_recurrent_gla(q, k, v, g, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state)
    return recurrent_gla_torch(q, k, v, g, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state)


def decode_step(q, k, v, g, scale, state=None, backend="auto"):
    """One token of generation, q [B, 1, H, K]: (o [B, 1, H, V], new state [B, Hkv, K, V]
    float32). The Triton recurrent kernel on CUDA (one launch); elsewhere a few batched tensor
    ops (gla.reference.decode_step_torch): S = diag(exp(g)) S + k^T v, o = scale * q S."""
    if q.shape[1] != 1 or k.shape[1] != 1:
        raise ValueError(f"decode_step takes one token; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if _recurrent_on_triton(q, k, v, backend):
        return fused_recurrent_gla(q, k, v, g, scale=scale, initial_state=state, output_final_state=True)
    return decode_step_torch(q, k, v, g, scale, state)


def hybrid_decode(q_r, q_s, q_phi, k_r, k_s, v, k_phi, g, pos, window, sinks, state, logit, softmax_scale, gla_scale,
                  shared=True, eps=1e-6, in_place=False, backend="auto"):
    """A hybrid layer's decode step after full buffers (window.reference.hybrid_decode_torch's
    contract): (o [B, 1, H, D], window, sinks, state after the step). One Triton launch on
    CUDA. With `in_place` the step is written into the given buffers and state (a captured
    decode graph's static ones), which are returned; otherwise into new tensors."""
    if q_r.shape[1] != 1 or window[0].shape[1] < 1 or (in_place and state is None):
        raise ValueError(f"hybrid_decode takes one token after a window of at least one row (in place: and a "
                         f"state); got q {tuple(q_r.shape)}, window {tuple(window[0].shape)}")
    if _use_triton(q_r, backend):
        return fused_hybrid_decode(q_r, q_s, q_phi, k_r, k_s, v, k_phi, g, pos, window, sinks, state, logit,
                                   softmax_scale, gla_scale, shared, eps, inplace=in_place)
    o, win, sink, new_state = hybrid_decode_torch(q_r, q_s, q_phi, k_r, k_s, v, k_phi, g, pos, window, sinks, state,
                                                  logit, softmax_scale, gla_scale, shared, eps)
    if not in_place:
        return o, win, sink, new_state
    for mine, new in zip((*window, *sinks, state), (*win, *sink, new_state)):
        mine.copy_(new)
    return o, window, sinks, state


def window_over_buffer(q_r, q_s, k, v, key_pos, sink_k, sink_v, sink_pos, pos, window, scale,
                       mem_k=None, mem_v=None, mem_pos=None, mem_from=None, block=256):
    """Exact softmax of a cached hybrid layer's new queries over its window buffer, sinks and
    sparse cache: (o [B, T, H, D], lse [B, T, H] float32). The contract and the maths are
    window.reference.window_over_buffer_torch's; it runs in PyTorch on every device, in query
    blocks of `block`."""
    if (mem_k is None) != (mem_from is None) or not q_r.shape[1] <= k.shape[1] <= window + q_r.shape[1]:
        raise ValueError(f"window_over_buffer wants k [B, window + T, Hkv, D] (or a window buffer of fewer "
                         f"rows, the missing ones empty) and the sparse cache's four "
                         f"tensors or none; got k {tuple(k.shape)}, window {window}, T {q_r.shape[1]}")
    return window_over_buffer_torch(q_r, q_s, k, v, key_pos, sink_k, sink_v, sink_pos, pos, window, scale,
                                    mem_k, mem_v, mem_pos, mem_from, block)


def window_over_full_buffer(q_r, q_s, k, v, sink_k, sink_v, window, sinks, scale, backend="auto"):
    """window_over_buffer's (o, lse) where no sparse cache is kept and the cache is full and in
    order: its sinks hold positions 0 .. S-1, its window buffer the W positions right before the
    new tokens, and nothing is padded. k, v [B, W + T, Hkv, D] (the window buffer, then the new
    tokens) and the sinks as window_over_buffer takes them. Then it is the window kernel over
    [sinks, window buffer, new tokens] with the prefix's queries left out: every new query lies
    more than W rows after the sinks, so it scores them with q_s and their turned keys, and sees
    the last W rows (itself included), exactly window_over_buffer's contract."""
    B, T = q_r.shape[:2]
    prefix = sinks + window
    if k.shape[1] != window + T or sink_k.shape[1] != sinks:
        raise ValueError(f"window_over_full_buffer wants k [B, window + T, Hkv, D] and sink_k [B, sinks, Hkv, D]; got "
                         f"k {tuple(k.shape)}, sink_k {tuple(sink_k.shape)}, window {window}, sinks {sinks}, T {T}")
    zeros = q_r.new_zeros(B, prefix, *q_r.shape[2:])   # the prefix's queries: their rows are dropped
    keys, values = torch.cat([sink_k, k], 1), torch.cat([sink_v, v], 1)
    q_sink = torch.cat([zeros, q_s], 1) if sinks else None
    o, lse = window_attention(torch.cat([zeros, q_r], 1), keys, values, window, sinks, scale=scale,
                              q_sink=q_sink, k_sink=keys if sinks else None, backend=backend)
    return o[:, prefix:], lse[:, prefix:]


def window_attention(q, k, v, window, sinks=0, scale=None, cu_seqlens=None, q_sink=None, k_sink=None,
                     backend="auto"):
    """Softmax attention of each token over its last `window` tokens and its document's
    first `sinks`: (o [B, T, H, D] in q's dtype, lse [B, T, H] float32, natural log),
    both differentiable. q [B, T, H, D], k and v [B, T, Hkv, D]; cu_seqlens [N+1] packs
    documents (B == 1). scale defaults to 1/sqrt(D). q_sink and k_sink (shaped as q and k)
    score the sinks the window does not cover (default: q and k). Both implementations check
    the inputs (window.reference.check_window_inputs)."""
    if _use_triton(q, backend):
        return fused_window_attention(q, k, v, window, sinks, scale=scale, cu_seqlens=cu_seqlens,
                                      q_sink=q_sink, k_sink=k_sink)
    return window_attention_torch(q, k, v, window, sinks, scale=scale, cu_seqlens=cu_seqlens,
                                  q_sink=q_sink, k_sink=k_sink)


def window_mix(o_win, lse, o_lin, logit, shared=True, eps=1e-6, backend="auto"):
    """The hybrid layer's output from the window's (o_win, lse) and the GLA state's
    o_lin = [num, den] (chunk_gla with normalizer=True); logit [H] weighs the state's part
    (window.reference.window_mix_torch): one fused Triton kernel each way on CUDA."""
    if o_lin.shape[-1] != o_win.shape[-1] + 1 or lse.shape != o_win.shape[:-1] or logit.shape != o_win.shape[-2:-1]:
        raise ValueError(f"window_mix wants o_win [..., H, D], lse [..., H], o_lin [..., H, D + 1], logit [H]; got "
                         f"{tuple(o_win.shape)}, {tuple(lse.shape)}, {tuple(o_lin.shape)}, {tuple(logit.shape)}")
    if _use_triton(o_win, backend):
        return fused_window_mix(o_win, lse, o_lin, logit, shared, eps)
    return window_mix_torch(o_win, lse, o_lin, logit, shared, eps)


def rope(x, cos, sin, backend="auto"):
    """RoPE as the teacher applies it (gla.reference.apply_rope): x [B, T, heads, D], cos and sin
    [B or 1, T, D]; one Triton kernel each way on CUDA."""
    if _use_triton(x, backend):
        return fused_rope(x, cos, sin)
    return apply_rope(x, cos, sin)
