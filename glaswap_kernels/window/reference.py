"""Exact softmax attention over a sliding window plus attention sinks: input checks and the
plain PyTorch reference.

Token i of a document attends with softmax(scale * q_i . k_j) to the keys j with

    i - window < j <= i          (the last `window` tokens, itself included)
    or j < min(sinks, i + 1)     (the first `sinks` tokens of its document)

each key counted once. Positions and sinks restart at every document start of a packed
batch (`cu_seqlens`, B == 1). A sink that the window does not cover (j <= i - window) is
scored as scale * q_sink_i . k_sink_j, with q_sink and k_sink defaulting to q and k: the
hybrid layer passes its unrotated queries and sink keys rotated to a fixed distance, so a
sink's score does not depend on how far back it lies (past a teacher's trained positions a
true RoPE distance gives scores the teacher never produced). The op returns the normalised output o [B, T, H, D] in q's
dtype and lse [B, T, H] float32 = log sum_j exp(scale * q_i . k_j) over the allowed keys:
a caller that mixes the window with another attention part (the GLA state) re-weights o by
exp(lse), so lse is an output with a gradient of its own.

The reference computes in float32, a block of queries at a time against the keys they can
reach: for tests and for machines without Triton.
"""

from __future__ import annotations

import math

import torch

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_window_inputs(q, k, v, window, sinks, scale, cu_seqlens, q_sink=None, k_sink=None):
    """Shapes, dtypes and arguments of window_attention; one-line ValueErrors. The values of
    cu_seqlens (host data) are checked where they are read: window_bounds, or the kernels'
    launch metadata."""
    if (q_sink is None) != (k_sink is None):
        raise ValueError("q_sink and k_sink go together: give both or neither")
    for name, x, like in (("q_sink", q_sink, q), ("k_sink", k_sink, k)):
        if x is not None and (not isinstance(x, torch.Tensor) or x.shape != like.shape or x.dtype != like.dtype
                              or x.device != like.device):
            raise ValueError(f"{name} must match {'q' if like is q else 'k'} in shape, dtype and device, got "
                             f"{getattr(x, 'shape', type(x))}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, T, heads, D], got "
                             f"{getattr(x, 'shape', type(x))}")
    B, T, H, D = q.shape
    if k.shape != v.shape or k.shape[:2] != (B, T) or k.shape[3] != D:
        raise ValueError(f"k and v must both be [B, T, Hkv, D] with q's B, T and D: got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    Hkv = k.shape[2]
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"the number of query heads ({H}) must be a multiple of KV heads ({Hkv})")
    if not 1 <= D <= 256:
        raise ValueError(f"head dim D={D} is outside the supported 1..256")
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype among fp32/bf16/fp16: got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if B == 0 or T == 0:
        raise ValueError("empty batch or sequence")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1 (the query itself counts), got {window!r}")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"sinks must be an int >= 0, got {sinks!r}")
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or None (1/sqrt(D)), got {scale!r}")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.ndim != 1 \
                or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError("cu_seqlens must be a 1-D int32/int64 tensor of N+1 document offsets")
        if B != 1:
            raise ValueError(f"cu_seqlens needs B == 1 (packed documents), got B={B}")
    return B, T, H, Hkv, D


def window_bounds(cu_seqlens, B, T):
    """[(batch row, first token, end token)] of every document (host ints)."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = [int(x) for x in cu_seqlens.detach().cpu().tolist()]
    if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at T={T}")
    return [(0, a, b) for a, b in zip(cu, cu[1:])]


def window_attention_torch(q, k, v, window, sinks=0, scale=None, cu_seqlens=None, q_sink=None, k_sink=None,
                           block=256):
    """(o [B, T, H, D] in q's dtype, lse [B, T, H] float32); differentiable in q, k, v (and
    q_sink, k_sink) through both outputs (autograd on float32 maths). Queries go `block` rows
    at a time against their window's keys and the sinks before it: memory O(T (W + S + block)),
    so a whole long document can be read on a CPU."""
    B, T, H, Hkv, D = check_window_inputs(q, k, v, window, sinks, scale, cu_seqlens, q_sink, k_sink)
    scale = D ** -0.5 if scale is None else float(scale)
    group = H // Hkv
    heads = lambda x: x.float().transpose(0, 1)                             # [n, h, D] -> [h, n, D]  # noqa: E731
    outs, lses = [], []
    for b, start, end in window_bounds(cu_seqlens, B, T):
        for a in range(start, end, block):                     # query rows a .. e - 1 (absolute)
            e = min(end, a + block)
            lo = max(start, a - window + 1)                    # the first key any row's window reaches
            cols = torch.cat([torch.arange(start, min(start + sinks, lo), device=q.device),
                              torch.arange(lo, e, device=q.device)])
            i = torch.arange(a, e, device=q.device)[:, None] - start       # positions in the document
            j = cols[None, :] - start
            in_window, sink = (j <= i) & (i - j < window), (j < sinks) & (j <= i - window)
            kd = heads(k[b, cols]).repeat_interleave(group, 0)
            s = scale * heads(q[b, a:e]) @ kd.transpose(1, 2)              # [H, rows, keys]
            if q_sink is not None and sinks:
                ks = heads(k_sink[b, cols]).repeat_interleave(group, 0)
                s = torch.where(sink, scale * heads(q_sink[b, a:e]) @ ks.transpose(1, 2), s)
            s = s.masked_fill(~(in_window | sink), float("-inf"))
            lse = torch.logsumexp(s, dim=-1)                                # [H, rows]
            p = torch.exp(s - lse[..., None])
            outs.append((p @ heads(v[b, cols]).repeat_interleave(group, 0)).transpose(0, 1))
            lses.append(lse.transpose(0, 1))
    o, lse = torch.cat(outs), torch.cat(lses)                  # every row of every document, in order
    return o.view(B, T, H, D).to(q.dtype), lse.view(B, T, H)


def window_mix_torch(o_win, lse, o_lin, logit, shared=True, eps=1e-6):
    """One output from the window's (o_win normalised, lse) and the GLA state's
    o_lin = [num, den] (chunk_gla with normalizer=True), in o_win's dtype:

        shared:  (e^lse o_win + e^c num) / (e^lse + e^c den): the state's share of the output
                 is sigmoid(c + log den - lse), one normaliser over both parts
        learned: the state's share is sigmoid(c), a per-head mix of the two normalised parts

    c = logit [H]; the share is 0 where den == 0 (nothing has entered the state yet). The
    reference for window/mix.py."""
    num, den = o_lin[..., :-1].float(), o_lin[..., -1].float()
    logit = logit.float()
    if shared:
        share = torch.sigmoid(logit + torch.log(den.clamp_min(1e-30)) - lse)
    else:
        share = torch.sigmoid(logit).expand_as(den)
    share = torch.where(den > 0, share, torch.zeros_like(share))
    o_state = num / (den + eps)[..., None]
    o = o_win.float() + share[..., None] * (o_state - o_win.float())
    return o.to(o_win.dtype)


def window_over_buffer_torch(q_r, q_s, k, v, key_pos, sink_k, sink_v, sink_pos, pos, window, scale,
                             mem_k=None, mem_v=None, mem_pos=None, mem_from=None, block=256):
    """Exact softmax of T new queries over a cache's buffers, as the hybrid layer streams.

    q_r, q_s [B, T, H, D]: the queries rotated (scoring the window) and as the sinks and the
    sparse cache are scored. k, v [B, window + T, Hkv, D]: the window buffer followed by the
    new tokens, at key_pos [B, window + T] (-1 = empty slot). Query t sees the keys at rows
    t + 1 .. window + t (itself always), the sinks (sink_k, sink_v [B, S, Hkv, D] at sink_pos
    [B, S], -1 = none) once they are `window` or more positions back (pos [B, T]: the queries'
    positions), and the sparse cache's keys (mem_k, mem_v [B, M, Hkv, D] at mem_pos [B, M, Hkv])
    from query mem_from [B, M, Hkv] on. Returns (o [B, T, H, D] in q_r's dtype, lse [B, T, H]
    float32). Query blocks of `block`, so memory stays O(block x (window + block))."""
    B, T, H, D = q_r.shape
    R = H // k.shape[2]
    W = window
    heads = lambda t: t.float().transpose(1, 2).repeat_interleave(R, 1)          # noqa: E731  [B, H, N, D]
    # keys scored with q_s, and which queries see each
    apart = []
    if mem_k is not None:
        t_new = torch.arange(T, device=q_r.device)
        seen = (mem_pos >= 0)[..., None] & (mem_from[..., None] <= t_new)        # [B, M, Hkv, T]
        apart.append((heads(mem_k), heads(mem_v), seen.permute(0, 2, 3, 1).repeat_interleave(R, 1)))
    if sink_pos.shape[1]:
        seen = (sink_pos[:, None, :] >= 0) & (sink_pos[:, None, :] <= pos[:, :, None] - W)   # [B, T, S]
        apart.append((heads(sink_k), heads(sink_v), seen[:, None]))
    outs, lses = [], []
    for a in range(0, T, block):
        b = min(T, a + block)
        qb = q_r[:, a:b].float().transpose(1, 2)                                  # [B, H, n, D]
        kk = heads(k[:, a + 1:W + b])                                             # keys a+1 .. W+b-1
        vv = heads(v[:, a + 1:W + b])
        t = torch.arange(a, b, device=q_r.device)[:, None]
        j = torch.arange(a + 1, W + b, device=q_r.device)[None, :]
        in_window = (j >= t + 1) & (j <= W + t)                                    # [n, keys]
        live = key_pos[:, a + 1:W + b] >= 0                                        # [B, keys]
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
