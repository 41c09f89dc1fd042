"""GLA chunk forward, the parallel kernels: every chunk's cumulative gates, then its output.

    _chunk_gates_kernel [NK, NTtot, Hkv]  G = in-chunk cumsum of g (fp32, log2), kept for
                                          every other kernel (forward and backward)
    _fwd_output_kernel  [NTtot, Hkv]      o = s (q 2^G) h + s mask(P) v for each query head
                                          of the group, given the chunk-start state h

The chunk-start states come from the sequential pass in state.py, which runs between.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:
    raise

from ..utils import (chunk_coords, load_col, load_rows, load_state, mm, op, seq_bounds, store_den,
                     store_rows)
from .scores import anchor, gates, is_fast, kept_gates, score_tile, scores_slow


@triton.jit
def _chunk_gates_kernel(g, gbuf, cu_seqlens, chunk_offsets, chunk_indices, T,
                        Hkv: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                        IS_VARLEN: tl.constexpr):
    """Every chunk's cumulative gates G (fp32, log2 units) into gbuf, one program per
    (K tile, chunk, KV head), before the state pass, which reads them too."""
    i_k = tl.program_id(0)
    i_c = tl.program_id(1)
    i_h = tl.program_id(2)
    i_n, i_t = chunk_coords(i_c, chunk_indices, T, BT, IS_VARLEN)
    bos, eos, c0 = seq_bounds(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    t0 = bos + i_t * BT
    G, _ = gates(g + i_h * K, t0, eos - t0, Hkv * K, i_k * BK, K, BT, BK)
    store_rows(gbuf + i_h * K, G, t0, eos - t0, Hkv * K, i_k * BK, K, BT, BK)


@triton.jit
def _fwd_output_kernel(q, k, v, g, o, hbuf, pbuf, gbuf, cu_seqlens, chunk_offsets, chunk_indices, T, scale,
                       H: tl.constexpr, Hkv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       VS: tl.constexpr, VO: tl.constexpr, NORM: tl.constexpr,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       NK: tl.constexpr, NV: tl.constexpr, R: tl.constexpr,
                       IS_VARLEN: tl.constexpr, DOT_BF16: tl.constexpr, PREC: tl.constexpr,
                       STORE_P: tl.constexpr):
    """o for one chunk and every query head of one KV group. When K fits one tile the k-side
    work (loads, 2^G, k 2^-G) is done once for the group; otherwise it is redone per head.
    NORM: column V of o gets the normaliser s * (rowsum(mask(P)) + (q 2^G) z), what a column
    of ones in v would give. STORE_P: s * mask(P) is also written to pbuf ([tokens, H, BT],
    the backward's dv reads it instead of rebuilding it)."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_n, i_t = chunk_coords(i_c, chunk_indices, T, BT, IS_VARLEN)
    bos, eos, c0 = seq_bounds(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    t0 = bos + i_t * BT
    n_valid = eos - t0
    hp = hbuf + ((c0 + i_n + i_t) * Hkv + i_h) * K * VS
    rows = tl.arange(0, BT)
    causal = rows[:, None] >= rows[None, :]
    kp = k + i_h * K
    gp = g + i_h * K
    vp = v + i_h * V

    if NK == 1:
        b_k = load_rows(kp, t0, n_valid, Hkv * K, 0, K, BT, BK).to(tl.float32)
        G, G_last = kept_gates(gbuf + i_h * K, t0, n_valid, Hkv * K, 0, K, BT, BK)
        # q 2^{G-a} serves the scores and, with 2^a moved onto the state's rows, q 2^G h
        a = anchor(G_last)
        e_q = tl.exp2(G - a[None, :])
        e_a = tl.exp2(a)
        fast = is_fast(G_last)
        if fast:
            k_e = op(b_k * tl.exp2(a[None, :] - G), DOT_BF16)
        else:
            k_e = op(b_k, DOT_BF16)                         # unused
        for r in range(R):
            hq = i_h * R + r
            qp = q + hq * K
            b_q = load_rows(qp, t0, n_valid, H * K, 0, K, BT, BK).to(tl.float32)
            q_e = op(b_q * e_q, DOT_BF16)
            if fast:
                P = mm(q_e, tl.trans(k_e), DOT_BF16, PREC)
            else:
                P = scores_slow(b_q, b_k, gp, t0, n_valid, Hkv * K, 0, K, BT, BK, DOT_BF16, PREC)
            P = tl.where(causal, P, 0.0)
            if STORE_P:
                store_rows(pbuf + hq * BT, P * scale, t0, n_valid, H * BT, 0, BT, BT, BT)
            if NORM:
                z = load_col(hp, 0, K, V, VS, BK)
                den = tl.sum(P, axis=1) + tl.sum(b_q * e_q * (z * e_a)[None, :], axis=1)
                store_den(o + hq * VO, den * scale, t0, n_valid, H * VO, V, BT)
            for i_v in range(NV):
                b_v = load_rows(vp, t0, n_valid, Hkv * V, i_v * BV, V, BT, BV)
                b_hs = load_state(hp, 0, i_v * BV, K, V, VS, BK, BV) * e_a[:, None]
                acc = mm(P, b_v, DOT_BF16, PREC) + mm(q_e, b_hs, DOT_BF16, PREC)
                store_rows(o + hq * VO, acc * scale, t0, n_valid, H * VO, i_v * BV, V, BT, BV)
    else:
        for r in range(R):
            hq = i_h * R + r
            qp = q + hq * K
            P = tl.zeros([BT, BT], dtype=tl.float32)
            den = tl.zeros([BT], dtype=tl.float32)
            for i_k in range(NK):
                p, b_q, G = score_tile(qp, kp, gp, t0, n_valid, i_k * BK, H, Hkv, K, BT, BK,
                                       DOT_BF16, PREC)
                P += p
                if NORM:
                    z = load_col(hp, i_k * BK, K, V, VS, BK)
                    den += tl.sum(b_q * tl.exp2(G) * z[None, :], axis=1)
            P = tl.where(causal, P, 0.0)
            if STORE_P:
                store_rows(pbuf + hq * BT, P * scale, t0, n_valid, H * BT, 0, BT, BT, BT)
            if NORM:
                store_den(o + hq * VO, (den + tl.sum(P, axis=1)) * scale, t0, n_valid, H * VO,
                          V, BT)
            for i_v in range(NV):
                b_v = load_rows(vp, t0, n_valid, Hkv * V, i_v * BV, V, BT, BV)
                acc = mm(P, b_v, DOT_BF16, PREC)
                for i_k in range(NK):
                    b_q = load_rows(qp, t0, n_valid, H * K, i_k * BK, K, BT, BK).to(tl.float32)
                    G, _ = gates(gp, t0, n_valid, Hkv * K, i_k * BK, K, BT, BK)
                    b_hs = load_state(hp, i_k * BK, i_v * BV, K, V, VS, BK, BV)
                    acc += mm(b_q * tl.exp2(G), b_hs, DOT_BF16, PREC)
                store_rows(o + hq * VO, acc * scale, t0, n_valid, H * VO, i_v * BV, V, BT, BV)
