"""A hybrid layer's decode step in one Triton kernel: the state update, the window and sinks'
softmax, their mix, and the buffers after the new token.

The contract is reference.hybrid_decode_torch's: one new token per row after a cache whose
window buffer holds W rows and whose sink buffer holds S (full, in order, the oldest row
first). Per row it
- takes the key leaving the window (row 0) into the GLA state, unless it is a sink, padding
  or empty, after decaying the state by the new token's gate;
- reads the state with the new query's feature map ([num, den] per query head);
- scores the new query against the window after the new token (rows 1 .. W-1, then the new
  key, which it always sees) and the sinks W or more positions back;
- mixes the two as window_mix does, and writes the window shifted by one row with the new
  token last, the new token into its sink slot if it is a sink, and the state.

One program per batch row walks its KV heads: the positions are shared by a row's heads, and
a program that owns the whole row can shift its buffers in place (all of a head's rows are
loaded before any is stored; a barrier orders the two within the program). The outputs may
therefore be the inputs (a captured decode graph's static buffers) or new tensors.
"""

from __future__ import annotations

import torch

try:
    # The try block keeps transformers' remote-code import checker from requiring Triton in
    # a saved model's folder (ops falls back to PyTorch without it).
    import triton
    import triton.language as tl
except ImportError:
    raise

from ..utils import new, next_pow2

LOG2E = 1.4426950408889634


@triton.jit
def _rows(ptr, stride_row, first, n_rows, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    """[BR, BC] fp32 tile: rows first .. first + n_rows - 1 (row stride stride_row), columns
    below n_cols; the rest 0."""
    r = tl.arange(0, BR)
    c = tl.arange(0, BC)
    mask = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    return tl.load(ptr + (first + r)[:, None] * stride_row + c[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _vec(ptr, n, BC: tl.constexpr):
    c = tl.arange(0, BC)
    return tl.load(ptr + c, mask=c < n, other=0.0).to(tl.float32)


@triton.jit
def _store_rows(ptr, x, stride_row, n_rows, n_cols, BR: tl.constexpr, BC: tl.constexpr):
    r = tl.arange(0, BR)
    c = tl.arange(0, BC)
    mask = (r < n_rows)[:, None] & (c < n_cols)[None, :]
    tl.store(ptr + r[:, None] * stride_row + c[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _hybrid_decode_kernel(
        q_r, q_s, q_phi, k_r, k_s, v, k_phi, g, pos,
        wk, wv, wf, wp, sk, sv, sp, state, logit,
        o, wk_out, wv_out, wf_out, wp_out, sk_out, sv_out, sp_out, state_out,
        s_wk, s_wf, s_wp, s_sk, s_sp, s_wk_out, s_wf_out, s_wp_out, s_sk_out, s_sp_out,
        softmax_scale2, gla_scale, eps,
        H: tl.constexpr, HKV: tl.constexpr, HS: tl.constexpr, D: tl.constexpr, F: tl.constexpr,
        W: tl.constexpr, S: tl.constexpr, SHARED: tl.constexpr,
        BD: tl.constexpr, BF: tl.constexpr, BW: tl.constexpr, BS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    G: tl.constexpr = H // HKV          # query heads per KV head
    R: tl.constexpr = HS // HKV         # state heads per KV head
    Q: tl.constexpr = H // HS           # query heads per state head
    V1: tl.constexpr = D + 1            # the state's row: D values and the normaliser

    rw = tl.arange(0, BW)
    rs = tl.arange(0, BS)
    cd = tl.arange(0, BD)
    cf = tl.arange(0, BF)
    p_new = tl.load(pos + b)
    leaving = tl.load(wp + b * s_wp)
    enter = (leaving >= S).to(tl.float32)
    # the window's positions after the step: rows 1 .. W-1, then the new token
    win_pos = tl.load(wp + b * s_wp + rw + 1, mask=rw < W - 1, other=-1)
    win_pos = tl.where(rw == W - 1, p_new, win_pos)
    win_ok = (win_pos >= 0) | (rw == W - 1)
    is_sink = (p_new >= 0) & (p_new < S)
    sink_pos = tl.load(sp + b * s_sp + rs, mask=rs < S, other=-1)
    sink_pos = tl.where(is_sink & (rs == p_new), p_new, sink_pos)
    sink_ok = (sink_pos >= 0) & (sink_pos <= p_new - W) & (rs < S)
    last = (rw == W - 1)[:, None]
    new_sink = (is_sink & (rs == p_new))[:, None]

    for hk in range(HKV):
        # the window's keys and values after the step, and the sinks', as [rows, D] tiles
        kw = _rows(wk + b * s_wk + hk * D, HKV * D, 1, W - 1, D, BW, BD)
        vw = _rows(wv + b * s_wk + hk * D, HKV * D, 1, W - 1, D, BW, BD)
        kn = _vec(k_r + (b * HKV + hk) * D, D, BD)
        vn = _vec(v + (b * HKV + hk) * D, D, BD)
        kw = tl.where(last, kn[None, :], kw)
        vw = tl.where(last, vn[None, :], vw)
        ks = _rows(sk + b * s_sk + hk * D, HKV * D, 0, S, D, BS, BD)
        vs = _rows(sv + b * s_sk + hk * D, HKV * D, 0, S, D, BS, BD)
        ksn = _vec(k_s + (b * HKV + hk) * D, D, BD)
        ks = tl.where(new_sink, ksn[None, :], ks)
        vs = tl.where(new_sink, vn[None, :], vs)
        v_old = _vec(wv + b * s_wk + hk * D, D, BD)           # row 0: the value leaving the window
        for r in range(R):
            hs = hk * R + r
            # the state after the step: decayed by the new token's gate, plus the leaving key
            st_ptr = state + (b * HS + hs) * F * V1
            num = tl.load(st_ptr + cf[:, None] * V1 + cd[None, :], mask=(cf < F)[:, None] & (cd < D)[None, :],
                          other=0.0)
            den = tl.load(st_ptr + cf * V1 + D, mask=cf < F, other=0.0)
            decay = tl.exp(_vec(g + (b * HS + hs) * F, F, BF))
            f_old = _vec(wf + b * s_wf + hs * F, F, BF) * enter
            num = decay[:, None] * num + f_old[:, None] * v_old[None, :]
            den = decay * den + f_old
            st_out = state_out + (b * HS + hs) * F * V1
            tl.store(st_out + cf[:, None] * V1 + cd[None, :], num, mask=(cf < F)[:, None] & (cd < D)[None, :])
            tl.store(st_out + cf * V1 + D, den, mask=cf < F)
            for i in range(Q):
                h = hs * Q + i
                phi = _vec(q_phi + (b * H + h) * F, F, BF)
                o_num = tl.sum(phi[:, None] * num, 0) * gla_scale              # [BD]
                o_den = tl.sum(phi * den, 0) * gla_scale
                qr = _vec(q_r + (b * H + h) * D, D, BD)
                qs = _vec(q_s + (b * H + h) * D, D, BD)
                s_w = tl.sum(qr[None, :] * kw, 1) * softmax_scale2                # log2 space
                s_w = tl.where(win_ok, s_w, float("-inf"))
                s_s = tl.sum(qs[None, :] * ks, 1) * softmax_scale2
                s_s = tl.where(sink_ok, s_s, float("-inf"))
                m = tl.maximum(tl.max(s_w, 0), tl.max(s_s, 0))                  # finite: the new key
                p_w = tl.exp2(s_w - m)
                p_s = tl.exp2(s_s - m)
                l = tl.sum(p_w, 0) + tl.sum(p_s, 0)
                o_win = (tl.sum(p_w[:, None] * vw, 0) + tl.sum(p_s[:, None] * vs, 0)) / l
                c = tl.load(logit + h).to(tl.float32)
                if SHARED:
                    lse = (m + tl.log2(l)) / LOG2E
                    share = tl.sigmoid(c + tl.log(tl.maximum(o_den, 1e-30)) - lse)
                else:
                    share = tl.sigmoid(c)
                share = tl.where(o_den > 0, share, 0.0)
                out = o_win + share * (o_num / (o_den + eps) - o_win)
                tl.store(o + (b * H + h) * D + cd, out.to(o.dtype.element_ty), mask=cd < D)
        tl.debug_barrier()      # every row of this head read before any is written (in place)
        _store_rows(wk_out + b * s_wk_out + hk * D, kw, HKV * D, W, D, BW, BD)
        _store_rows(wv_out + b * s_wk_out + hk * D, vw, HKV * D, W, D, BW, BD)
        _store_rows(sk_out + b * s_sk_out + hk * D, ks, HKV * D, S, D, BS, BD)
        _store_rows(sv_out + b * s_sk_out + hk * D, vs, HKV * D, S, D, BS, BD)
        # the feature-mapped keys after the step, per state head of this KV head
        for r in range(R):
            hs = hk * R + r
            fw = _rows(wf + b * s_wf + hs * F, HS * F, 1, W - 1, F, BW, BF)
            fn = _vec(k_phi + (b * HS + hs) * F, F, BF)
            fw = tl.where(last, fn[None, :], fw)
            tl.debug_barrier()
            _store_rows(wf_out + b * s_wf_out + hs * F, fw, HS * F, W, F, BW, BF)
    tl.debug_barrier()
    tl.store(wp_out + b * s_wp_out + rw, win_pos, mask=rw < W)
    tl.store(sp_out + b * s_sp_out + rs, sink_pos, mask=rs < S)


def _rows_of(t):
    """The batch stride of a [B, rows, heads, D] buffer whose rows are each contiguous [heads, D]
    and follow one another (a view of the last rows of a larger buffer is fine)."""
    if t.stride(-1) != 1 or t.stride(-2) != t.shape[-1] or t.stride(1) != t.shape[-1] * t.shape[-2]:
        raise ValueError(f"hybrid decode buffers need contiguous rows; got strides {t.stride()}")
    return t.stride(0)


def _output(like):
    """A new contiguous buffer of like's shape for the kernel to fill (poisoned in tests)."""
    return new(like.shape, like.dtype, like.device)


def fused_hybrid_decode(q_r, q_s, q_phi, k_r, k_s, v, k_phi, g, pos, window, sinks, state, logit, softmax_scale,
                        gla_scale, shared=True, eps=1e-6, inplace=False):
    """reference.hybrid_decode_torch's step in one kernel launch. With `inplace` the window and
    sink buffers and the state (which must then be given) are updated where they are, and
    returned; otherwise new tensors hold them after the step."""
    B, _, H, D = q_r.shape
    Hkv, Hs, F = k_r.shape[2], k_phi.shape[2], k_phi.shape[-1]
    wk, wv, wf, wp = window
    sk, sv, sp = sinks
    W, S = wk.shape[1], sk.shape[1]
    if W < 1 or H % Hs or Hs % Hkv:
        raise ValueError(f"fused_hybrid_decode: window {W}, heads {H}, state heads {Hs}, KV heads {Hkv}")
    if state is None:
        if inplace:
            raise ValueError("fused_hybrid_decode in place needs a state")
        state = torch.zeros(B, Hs, F, D + 1, dtype=torch.float32, device=q_r.device)
    q_r, q_s, q_phi, k_r, k_s, v, k_phi, g = (t.contiguous() for t in (q_r, q_s, q_phi, k_r, k_s, v, k_phi, g))
    pos = pos.reshape(B).contiguous()
    if not state.is_contiguous() or state.dtype != torch.float32:
        raise ValueError("fused_hybrid_decode needs a contiguous float32 state")
    if inplace:
        out_window, out_sinks, out_state = window, sinks, state
    else:
        out_window = tuple(_output(t) for t in window)
        out_sinks = tuple(_output(t) for t in sinks)
        out_state = _output(state)
    for t in (wp, sp, out_window[3], out_sinks[2]):
        if t.stride(-1) != 1:
            raise ValueError("hybrid decode positions need contiguous rows")
    o = new((B, 1, H, D), q_r.dtype, q_r.device)
    _hybrid_decode_kernel[(B,)](
        q_r, q_s, q_phi, k_r, k_s, v, k_phi, g, pos,
        wk, wv, wf, wp, sk, sv, sp, state, logit.float().contiguous(),
        o, *out_window, *out_sinks, out_state,
        _rows_of(wk), _rows_of(wf), wp.stride(0), _rows_of(sk) if S else 0, sp.stride(0) if S else 0,
        _rows_of(out_window[0]), _rows_of(out_window[2]), out_window[3].stride(0),
        _rows_of(out_sinks[0]) if S else 0, out_sinks[2].stride(0) if S else 0,
        softmax_scale * 1.4426950408889634, gla_scale, eps,
        H=H, HKV=Hkv, HS=Hs, D=D, F=F, W=W, S=S, SHARED=shared,
        BD=next_pow2(D), BF=next_pow2(F), BW=next_pow2(W), BS=max(next_pow2(S), 1),
        num_warps=8)      # a head's window tiles and state in registers at once
    return o, out_window, out_sinks, out_state
