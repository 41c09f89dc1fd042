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

from ..gla.reference import decode_step_torch

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
                           block=None):
    """(o [B, T, H, D] in q's dtype, lse [B, T, H] float32); differentiable in q, k, v (and
    q_sink, k_sink) through both outputs (autograd on float32 maths). Queries go `block` rows
    at a time (default: the window, within 32 .. 256) against their window's keys and the sinks
    before it: memory O(T (W + S + block)), so a whole long document can be read on a CPU. A KV
    head's query heads are scored as one matrix, never by copying its keys."""
    B, T, H, Hkv, D = check_window_inputs(q, k, v, window, sinks, scale, cu_seqlens, q_sink, k_sink)
    scale = D ** -0.5 if scale is None else float(scale)
    G = H // Hkv
    block = block or max(32, min(256, window))
    # [n, H, D] -> [Hkv, G n, D]: the G query heads of each KV head (repeat_interleave's order)
    queries = lambda x, n: x.float().view(n, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * n, D)  # noqa: E731
    keys = lambda x: x.float().transpose(0, 1)                                  # noqa: E731  [Hkv, n, D]
    outs, lses = [], []
    for b, start, end in window_bounds(cu_seqlens, B, T):
        for a in range(start, end, block):                     # query rows a .. e - 1 (absolute)
            e = min(end, a + block)
            n = e - a
            lo = max(start, a - window + 1)                    # the first key any row's window reaches
            front = max(0, min(start + sinks, lo) - start)     # sinks before that
            cols = torch.cat([torch.arange(start, start + front, device=q.device),
                              torch.arange(lo, e, device=q.device)])
            n_sink = front + max(0, min(start + sinks, e) - lo)   # the columns that are sinks come first
            i = torch.arange(a, e, device=q.device)[:, None] - start       # positions in the document
            j = cols[None, :] - start
            in_window, sink = (j <= i) & (i - j < window), (j < sinks) & (j <= i - window)
            s = ((scale * queries(q[b, a:e], n)) @ keys(k[b, cols]).transpose(1, 2)).view(Hkv, G, n, -1)
            if q_sink is not None and n_sink:
                # a sink outside a row's window is scored with q_sink and k_sink
                ss = (scale * queries(q_sink[b, a:e], n)) @ keys(k_sink[b, cols[:n_sink]]).transpose(1, 2)
                s = torch.cat([torch.where(sink[:, :n_sink], ss.view(Hkv, G, n, -1), s[..., :n_sink]),
                               s[..., n_sink:]], -1)
            s = s.masked_fill(~(in_window | sink), float("-inf"))
            lse = torch.logsumexp(s, dim=-1)                                # [Hkv, G, n]
            o = torch.softmax(s, dim=-1).view(Hkv, G * n, -1) @ keys(v[b, cols])
            outs.append(o.view(Hkv, G, n, D).permute(2, 0, 1, 3).reshape(n, H, D))
            lses.append(lse.permute(2, 0, 1).reshape(n, H))
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
    new tokens, at key_pos [B, window + T] (-1 = empty slot); a buffer still growing may have
    L < window rows, standing for `window` whose first window - L are empty. Query t sees the
    keys at rows t + 1 .. window + t (itself always), the sinks (sink_k, sink_v [B, S, Hkv, D] at sink_pos
    [B, S], -1 = none) once they are `window` or more positions back (pos [B, T]: the queries'
    positions), and the sparse cache's keys (mem_k, mem_v [B, M, Hkv, D] at mem_pos [B, M, Hkv])
    from query mem_from [B, M, Hkv] on. Returns (o [B, T, H, D] in q_r's dtype, lse [B, T, H]
    float32). Query blocks of `block`, so memory stays O(block x (window + block))."""
    B, T, H, D = q_r.shape
    Hkv = k.shape[2]
    G, W = H // Hkv, window
    L = k.shape[1] - T                      # the buffer's rows; row r stands at r + W - L of a full one
    if T == 1 and mem_k is None:
        a = max(0, L + 1 - W)
        return _one_query(q_r, q_s, k[:, a:], v[:, a:], key_pos[:, a:], sink_k, sink_v, sink_pos, pos, W, scale)
    # a KV head's G query heads are scored as one matrix: [B, n, H, D] -> [B, Hkv, G n, D]
    queries = lambda x: x.float().view(B, -1, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, -1, D)  # noqa: E731
    keys = lambda x: x.float().transpose(1, 2)                                 # noqa: E731  [B, Hkv, N, D]
    # keys scored with q_s, as [B, Hkv, N, D] with which queries see each: [B, Hkv or 1, T, N]
    apart = []
    if mem_k is not None:
        t_new = torch.arange(T, device=q_r.device)
        seen = (mem_pos >= 0)[..., None] & (mem_from[..., None] <= t_new)        # [B, M, Hkv, T]
        apart.append((keys(mem_k), keys(mem_v), seen.permute(0, 2, 3, 1)))
    if sink_pos.shape[1]:
        seen = (sink_pos[:, None, :] >= 0) & (sink_pos[:, None, :] <= pos[:, :, None] - W)   # [B, T, S]
        apart.append((keys(sink_k), keys(sink_v), seen[:, None]))
    outs, lses = [], []
    for a in range(0, T, block):
        b = min(T, a + block)
        n = b - a
        lo = max(0, a + 1 + L - W)
        kk, vv = keys(k[:, lo:L + b]), keys(v[:, lo:L + b])                        # keys lo .. L+b-1
        t = torch.arange(a, b, device=q_r.device)[:, None]
        j = torch.arange(lo, L + b, device=q_r.device)[None, :]
        in_window = (j >= t + 1 + L - W) & (j <= L + t)                            # [n, keys]
        live = key_pos[:, lo:L + b] >= 0                                           # [B, keys]
        allowed = in_window[None] & (live[:, None, :] | (j == L + t)[None])        # a query sees itself
        s = (scale * queries(q_r[:, a:b]) @ kk.transpose(-1, -2)).view(B, Hkv, G, n, -1)
        s = s.masked_fill(~allowed[:, None, None], float("-inf"))
        if apart:
            qs = scale * queries(q_s[:, a:b])
            s = torch.cat([(qs @ ka.transpose(-1, -2)).view(B, Hkv, G, n, -1)
                           .masked_fill(~seen[:, :, None, a:b], float("-inf")) for ka, _, seen in apart] + [s], -1)
            vv = torch.cat([va for _, va, _ in apart] + [vv], -2)
        lse = torch.logsumexp(s, -1)                                               # [B, Hkv, G, n]
        o = torch.softmax(s, -1).view(B, Hkv, G * n, -1) @ vv                      # [B, Hkv, G n, D]
        outs.append(o.view(B, Hkv, G, n, D).permute(0, 3, 1, 2, 4).reshape(B, n, H, D))
        lses.append(lse.permute(0, 3, 1, 2).reshape(B, n, H))
    return torch.cat(outs, 1).to(q_r.dtype), torch.cat(lses, 1)


def _one_query(q_r, q_s, k, v, key_pos, sink_k, sink_v, sink_pos, pos, window, scale):
    """window_over_buffer_torch for one new query (a decode step, no sparse cache), in few
    operations: it sees the rows of k, v [B, W or fewer, Hkv, D] that are live (itself, the
    last, always) and the sinks `window` or more positions back."""
    B, _, H, D = q_r.shape
    W, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    ok = (key_pos >= 0) | (torch.arange(W, device=key_pos.device) == W - 1)    # [B, W]
    s = (scale * q_r.float().view(B, Hkv, G, D)) @ k.float().permute(0, 2, 3, 1)   # [B, Hkv, G, W]
    if sink_pos.shape[1]:
        seen = (sink_pos >= 0) & (sink_pos <= pos - window)                      # [B, S]
        s_sink = (scale * q_s.float().view(B, Hkv, G, D)) @ sink_k.float().permute(0, 2, 3, 1)
        s, v, ok = torch.cat([s_sink, s], -1), torch.cat([sink_v, v], 1), torch.cat([seen, ok], 1)
    s = s.masked_fill(~ok[:, None, None], float("-inf"))
    lse = torch.logsumexp(s, -1)                                                 # [B, Hkv, G]
    o = torch.softmax(s, -1) @ v.float().transpose(1, 2)                          # [B, Hkv, G, D]
    return o.reshape(B, 1, H, D).to(q_r.dtype), lse.reshape(B, 1, H)


def hybrid_decode_torch(q_r, q_s, q_phi, k_r, k_s, v, k_phi, g, pos, window, sinks, state, logit, softmax_scale,
                        gla_scale, shared=True, eps=1e-6):
    """A hybrid layer's decode step, one new token per row, after a cache whose buffers are
    full: window = (keys, values, feature keys, positions) of W rows [B, W, Hkv, D] (feature keys
    [B, W, Hs, F], positions [B, W], -1 for none), oldest first; sinks = (keys turned back by W
    steps, values, positions) of S rows, slot = position. The new token: q_r, q_s [B, 1, H, D]
    (rotated, plain), q_phi [B, 1, H, F] (its query's feature map), k_r, k_s, v [B, 1, Hkv, D]
    (rotated key, turned key, value), k_phi [B, 1, Hs, F], g [B, 1, Hs, F] (log-decays), pos
    [B, 1] long. state [B, Hs, F, D + 1] float32 (the last column the normaliser's) or None.
    logit [H]: window_mix's c.

    The step, as hybrid_cache.stream takes it for one token:
    - the key leaving the window (row 0) enters the state unless it is a sink, padding or
      none, after the state decays by g: S = exp(g) S + phi(k_old) [v_old, 1];
    - o_lin = gla_scale * q_phi S per query head ([num, den]);
    - the query sees the window after the step (rows 1 .. W-1, then itself, always) and the
      sinks W or more positions back (a new token that is a sink is written to its slot);
    - window_mix_torch mixes the two.

    Returns (o [B, 1, H, D] in q_r's dtype, the window after the step (its rows 1 .. W-1, then
    the new token), the sinks after it, the state after it): new tensors. The reference for
    window/decode.py, computed in float32 throughout."""
    wk, wv, wf, wp = window
    sk, sv, sp = sinks
    B, _, H, D = q_r.shape
    Hkv, Hs = k_r.shape[2], k_phi.shape[2]
    W, S = wk.shape[1], sk.shape[1]
    p_new = pos.reshape(B, 1).long()
    enter = (wp[:, 0] >= S).float()[:, None, None]                                   # [B, 1, 1]
    f_old = wf[:, 0].float() * enter                                                  # [B, Hs, F]
    v_old = torch.cat([wv[:, 0].float(), wv.new_ones(B, Hkv, 1, dtype=torch.float32)], -1)
    v_old = v_old.repeat_interleave(Hs // Hkv, 1)                                     # [B, Hs, D + 1]
    o_lin, state = decode_step_torch(q_phi.float(), f_old[:, None], v_old[:, None], g, gla_scale, state)
    # the buffers after the step
    win = tuple(torch.cat([t[:, 1:], new.to(t.dtype)], 1)
                for t, new in ((wk, k_r), (wv, v), (wf, k_phi), (wp, p_new)))
    is_sink = (p_new >= 0) & (p_new < S) & (torch.arange(S, device=sp.device) == p_new)   # [B, S]
    sink = (torch.where(is_sink[..., None, None], k_s.to(sk.dtype), sk),
            torch.where(is_sink[..., None, None], v.to(sv.dtype), sv),
            torch.where(is_sink, p_new, sp))
    o_win, lse = _one_query(q_r.float(), q_s.float(), win[0], win[1], win[3], sink[0], sink[1], sink[2], p_new, W,
                            softmax_scale)
    o = window_mix_torch(o_win, lse, o_lin, logit, shared=shared, eps=eps)
    return o.to(q_r.dtype), win, sink, state
