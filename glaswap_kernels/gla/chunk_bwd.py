"""GLA chunk backward, the parallel kernels (after the reverse state pass of state.py).

    _bwd_dqkg_kernel [NK, NTtot, Hkv]  dq (each head of the group), dk, dg; also dv when one
                                       K tile and one V tile cover the whole head
    _bwd_dv_kernel   [NV, NTtot, Hkv]  dv, when not computed by the kernel above

dg needs no global pass: with dGabs_t = sum_heads q_t*dq_t - k_t*dk_t, dg_s is the reverse
in-chunk cumulative sum of dGabs from s to the chunk end plus
r_{n+1}[k] = sum_v h_{n+1}[k, v] * dh_{n+1}[k, v] (scaling the state at a chunk boundary by
e^gamma is the same as adding gamma to the next step's log-decay). _bwd_dqkg_kernel
evaluates that sum with its cancelling O(1) terms removed analytically (see there), so dg
keeps its relative precision under strong decays.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:
    raise

from ..utils import (chunk_coords, load_col, load_den_grad, load_rows, load_state, mm, op, seq_bounds,
                     store_rows)
from .scores import anchor, dqk_slow, excl_cumsum, gates, is_fast, kept_gates, score_tile, scores_slow


@triton.jit
def _bwd_dqkg_kernel(q, k, v, g, do, hbuf, dhbuf, pbuf, gbuf, dq, dk, dg, dv, cu_seqlens,
                     chunk_offsets, chunk_indices, T, scale,
                     H: tl.constexpr, Hkv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     VS: tl.constexpr, VO: tl.constexpr, NORM: tl.constexpr,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                     R: tl.constexpr, WITH_DV: tl.constexpr, IS_VARLEN: tl.constexpr,
                     DOT_BF16: tl.constexpr, PREC: tl.constexpr, PATH: tl.constexpr,
                     ONE_PASS: tl.constexpr, LOAD_P: tl.constexpr):
    """dq (every head of the group), dk and dg for one chunk, one K tile, one KV head; also
    dv when WITH_DV (one K tile and one V tile cover everything: the separate dv kernel,
    with its second read of q, k, g, do, is then skipped).
      dP = s * mask(do v^T), split into its diagonal d and its strictly lower part L
      dq = 2^G * (s do h_n^T + L (k 2^-G)) + d * k
      dk = 2^{G_last - G} * (v dh_{n+1}^T) + 2^-G * sum_heads L^T (q 2^G) + sum_heads d * q
      dv = (k 2^{G_last - G}) dh_{n+1} + s * sum_heads mask(P)^T do
    dg = revcumsum(q dq - k dk) + <h_{n+1}, dh_{n+1}>_v is evaluated without its O(1)
    cancelling parts, so strong decays (true dg ~ e^-20) keep their relative precision:
      * the diagonal terms q d k and k d q are equal and left out of both;
      * <h_{n+1}, dh_{n+1}> - revcumsum(k dk_inter) = 2^{G_last} <h_n, dh_{n+1}>
        + exclusive cumsum(k dk_inter): only the paths that cross step s remain.
    ONE_PASS (one query head per KV head): the inter-chunk terms are taken in the same V loop
    as dP, so each tile of v and h is loaded once instead of twice. LOAD_P: dv's s * mask(P)
    is read from pbuf (written by the forward) instead of rebuilt.
    PATH 0: one launch, each chunk takes its own path; 1 and 2 (launch.LaunchConfig.split_g):
    two launches, the one-matmul chunks then the others, each compiled without the other's
    code (the exact path costs the one-matmul chunks registers and spills)."""
    i_k = tl.program_id(0)
    i_c = tl.program_id(1)
    i_h = tl.program_id(2)
    i_n, i_t = chunk_coords(i_c, chunk_indices, T, BT, IS_VARLEN)
    bos, eos, c0 = seq_bounds(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    t0 = bos + i_t * BT
    n_valid = eos - t0
    k0 = i_k * BK
    st_n = ((c0 + i_n + i_t) * Hkv + i_h) * K * VS          # state at this chunk's start
    st_next = st_n + Hkv * K * VS                              # ... and at the next chunk's
    rows = tl.arange(0, BT)
    diag = rows[:, None] == rows[None, :]
    strict = rows[:, None] > rows[None, :]
    kp = k + i_h * K
    gp = g + i_h * K
    vp = v + i_h * V

    # Live ranges are kept short (this kernel sits at the 255-register cap): k stays in its
    # input dtype and is widened where used, and of the decay factors only G is kept;
    # 2^G and 2^-G are recomputed at each use (a few thousand exps per program are cheaper
    # than spilled tiles).
    b_kr = load_rows(kp, t0, n_valid, Hkv * K, k0, K, BT, BK)
    G, G_last = kept_gates(gbuf + i_h * K, t0, n_valid, Hkv * K, k0, K, BT, BK)
    a = anchor(G_last)             # the one-matmul path's factors are 2^{G-a} and 2^{a-G}
    fast = is_fast(G_last)
    if PATH > 0:                   # launch 1 takes the one-matmul chunks, launch 2 the
        if fast != (PATH == 1):    # others, each compiled with one path
            return
        fast = PATH == 1
    if fast:
        k_e = op(b_kr.to(tl.float32) * tl.exp2(a[None, :] - G), DOT_BF16)      # <= 2^SAFE
    else:
        k_e = op(b_kr, DOT_BF16)                           # unused
    if WITH_DV:
        b_v = load_rows(vp, t0, n_valid, Hkv * V, 0, V, BT, BV)
        b_dv = tl.zeros([BT, BV], dtype=tl.float32)

    dk_acc = tl.zeros([BT, BK], dtype=tl.float32)          # intra-chunk dk, all heads
    dg_acc = tl.zeros([BT, BK], dtype=tl.float32)          # q dq - k dk without the diagonal
    dk_inter = tl.zeros([BT, BK], dtype=tl.float32)        # v dh_{n+1}^T, before its decay
    hdh = tl.zeros([BK], dtype=tl.float32)                 # <h_n, dh_{n+1}>_v
    for r in range(R):
        hq = i_h * R + r
        b_qr = load_rows(q + hq * K, t0, n_valid, H * K, k0, K, BT, BK)
        q_e = op(b_qr.to(tl.float32) * tl.exp2(G - a[None, :]), DOT_BF16)
        if WITH_DV:
            b_do = load_rows(do + hq * VO, t0, n_valid, H * VO, 0, V, BT, BV)
            b_h = load_state(hbuf + st_n, k0, 0, K, V, VS, BK, BV)
            dP = mm(b_do, tl.trans(b_v), DOT_BF16, PREC)
            dq_h = mm(b_do, tl.trans(b_h), DOT_BF16, PREC)
            if ONE_PASS:
                b_dh1 = load_state(dhbuf + st_next, k0, 0, K, V, VS, BK, BV)
                dk_inter += mm(b_v, tl.trans(b_dh1), DOT_BF16, PREC)
                hdh += tl.sum(b_h * b_dh1, axis=1)
                b_dv += mm(b_kr.to(tl.float32) * tl.exp2(G_last[None, :] - G), b_dh1, DOT_BF16, PREC)
            # dv's intra part first, so that P dies before dq and dk are built
            if LOAD_P:
                P = load_rows(pbuf + hq * BT, t0, n_valid, H * BT, 0, BT, BT, BT)
            else:
                if fast:
                    P = mm(q_e, tl.trans(k_e), DOT_BF16, PREC)
                else:
                    P = scores_slow(b_qr.to(tl.float32), b_kr.to(tl.float32), gp, t0, n_valid,
                                    Hkv * K, k0, K, BT, BK, DOT_BF16, PREC)
                P = tl.where(rows[:, None] >= rows[None, :], P * scale, 0.0)
            b_dv += mm(tl.trans(P), b_do, DOT_BF16, PREC)
        else:
            dP = tl.zeros([BT, BT], dtype=tl.float32)
            dq_h = tl.zeros([BT, BK], dtype=tl.float32)
            for i_v in range(NV):
                b_do = load_rows(do + hq * VO, t0, n_valid, H * VO, i_v * BV, V, BT, BV)
                b_vt = load_rows(vp, t0, n_valid, Hkv * V, i_v * BV, V, BT, BV)
                b_h = load_state(hbuf + st_n, k0, i_v * BV, K, V, VS, BK, BV)
                dP += mm(b_do, tl.trans(b_vt), DOT_BF16, PREC)
                dq_h += mm(b_do, tl.trans(b_h), DOT_BF16, PREC)
                if ONE_PASS:
                    b_dh1 = load_state(dhbuf + st_next, k0, i_v * BV, K, V, VS, BK, BV)
                    dk_inter += mm(b_vt, tl.trans(b_dh1), DOT_BF16, PREC)
                    hdh += tl.sum(b_h * b_dh1, axis=1)
        if NORM:
            # v's implicit column of ones (state column z): dP_ij += dden_i, dq_h += dden z
            dden = load_den_grad(do + hq * VO, t0, n_valid, H * VO, V, BT)
            dP += dden[:, None]
            dq_h += dden[:, None] * load_col(hbuf + st_n, k0, K, V, VS, BK)[None, :]
        dP = dP * scale
        d = tl.sum(tl.where(diag, dP, 0.0), axis=1)        # [BT]
        dP = tl.where(strict, dP, 0.0)
        b_q = b_qr.to(tl.float32)
        if fast:
            b_dq = ((dq_h * (tl.exp2(a) * scale)[None, :] + mm(dP, k_e, DOT_BF16, PREC))
                    * tl.exp2(G - a[None, :]))
            dk_low = mm(tl.trans(dP), q_e, DOT_BF16, PREC) * tl.exp2(a[None, :] - G)
        else:
            dq_s, dk_low = dqk_slow(dP, b_q, b_kr.to(tl.float32), gp, t0, n_valid, Hkv * K, k0,
                                    K, BT, BK, DOT_BF16, PREC)
            b_dq = dq_h * (tl.exp2(G) * scale) + dq_s
        b_k = b_kr.to(tl.float32)
        dg_acc += b_q * b_dq - b_k * dk_low
        dk_acc += dk_low + d[:, None] * b_q
        store_rows(dq + hq * K, b_dq + d[:, None] * b_k, t0, n_valid, H * K, k0, K, BT, BK)

    # Inter-chunk part of dk (and dv), and <h_n, dh_{n+1}> over the whole V.
    e_end = tl.exp2(G_last[None, :] - G)                   # exponent <= 0 on both paths
    if not ONE_PASS:
        for i_v in range(NV):
            b_vt = load_rows(vp, t0, n_valid, Hkv * V, i_v * BV, V, BT, BV)
            b_dh1 = load_state(dhbuf + st_next, k0, i_v * BV, K, V, VS, BK, BV)
            b_h = load_state(hbuf + st_n, k0, i_v * BV, K, V, VS, BK, BV)
            dk_inter += mm(b_vt, tl.trans(b_dh1), DOT_BF16, PREC)
            hdh += tl.sum(b_h * b_dh1, axis=1)
            if WITH_DV:
                b_dv += mm(b_kr.to(tl.float32) * e_end, b_dh1, DOT_BF16, PREC)
    if NORM:
        dz1 = load_col(dhbuf + st_next, k0, K, V, VS, BK)
        dk_inter += tl.where(rows < n_valid, 1.0, 0.0)[:, None] * dz1[None, :]
        hdh += load_col(hbuf + st_n, k0, K, V, VS, BK) * dz1
    if WITH_DV:
        store_rows(dv + i_h * V, b_dv, t0, n_valid, Hkv * V, 0, V, BT, BV)
    dk_inter = dk_inter * e_end
    store_rows(dk + i_h * K, dk_acc + dk_inter, t0, n_valid, Hkv * K, k0, K, BT, BK)
    b_dg = (tl.cumsum(dg_acc, axis=0, reverse=True)
            + excl_cumsum(b_kr.to(tl.float32) * dk_inter, BT)
            + (tl.exp2(G_last) * hdh)[None, :])
    store_rows(dg + i_h * K, b_dg, t0, n_valid, Hkv * K, k0, K, BT, BK)


@triton.jit
def _bwd_dv_kernel(q, k, g, do, dhbuf, pbuf, gbuf, dv, cu_seqlens, chunk_offsets, chunk_indices, T,
                   scale,
                   H: tl.constexpr, Hkv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   VS: tl.constexpr, VO: tl.constexpr, NORM: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr,
                   R: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_BF16: tl.constexpr,
                   PREC: tl.constexpr, ALL_V: tl.constexpr, LOAD_P: tl.constexpr):
    """dv = (k 2^{G_last - G}) dh_{n+1} + s * sum_heads mask(P)^T do, one chunk, one V tile.
    ALL_V > 0 (one query head per KV head, one K tile): one program per chunk walks ALL_V
    V tiles with P built once, instead of one program per V tile each rebuilding it.
    LOAD_P: s * mask(P) is read from pbuf (written by the forward): no q, no score matmul."""
    i_v = tl.program_id(0)
    i_c = tl.program_id(1)
    i_h = tl.program_id(2)
    i_n, i_t = chunk_coords(i_c, chunk_indices, T, BT, IS_VARLEN)
    bos, eos, c0 = seq_bounds(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    t0 = bos + i_t * BT
    n_valid = eos - t0
    v0 = i_v * BV
    st_next = ((c0 + i_n + i_t + 1) * Hkv + i_h) * K * VS
    rows = tl.arange(0, BT)
    causal = rows[:, None] >= rows[None, :]
    kp = k + i_h * K
    gp = g + i_h * K

    if NK == 1:
        b_k = load_rows(kp, t0, n_valid, Hkv * K, 0, K, BT, BK).to(tl.float32)
        G, G_last = kept_gates(gbuf + i_h * K, t0, n_valid, Hkv * K, 0, K, BT, BK)
        a = anchor(G_last)
        e_q = tl.exp2(G - a[None, :])
        fast = is_fast(G_last)
        if fast:
            k_e = b_k * tl.exp2(a[None, :] - G)
            k_end = k_e * tl.exp2(G_last - a)[None, :]
        else:
            k_e = b_k                                       # unused
            k_end = b_k * tl.exp2(G_last[None, :] - G)
        k_e = op(k_e, DOT_BF16)
    if ALL_V > 0:
        if LOAD_P:
            P = op(tl.trans(load_rows(pbuf + i_h * BT, t0, n_valid, H * BT, 0, BT, BT, BT)), DOT_BF16)
        else:
            b_q = load_rows(q + i_h * K, t0, n_valid, H * K, 0, K, BT, BK).to(tl.float32)
            if fast:
                P = mm(b_q * e_q, tl.trans(k_e), DOT_BF16, PREC)
            else:
                P = scores_slow(b_q, b_k, gp, t0, n_valid, Hkv * K, 0, K, BT, BK, DOT_BF16, PREC)
            P = op(tl.trans(tl.where(causal, P * scale, 0.0)), DOT_BF16)
        k_end = op(k_end, DOT_BF16)
        for i_v in range(ALL_V):
            b_dh1 = load_state(dhbuf + st_next, 0, i_v * BV, K, V, VS, BK, BV)
            b_do = load_rows(do + i_h * VO, t0, n_valid, H * VO, i_v * BV, V, BT, BV)
            b_dv = mm(k_end, b_dh1, DOT_BF16, PREC) + mm(P, b_do, DOT_BF16, PREC)
            store_rows(dv + i_h * V, b_dv, t0, n_valid, Hkv * V, i_v * BV, V, BT, BV)
    elif NK == 1:
        b_dh1 = load_state(dhbuf + st_next, 0, v0, K, V, VS, BK, BV)
        b_dv = mm(k_end, b_dh1, DOT_BF16, PREC)
        for r in range(R):
            hq = i_h * R + r
            if LOAD_P:
                P = load_rows(pbuf + hq * BT, t0, n_valid, H * BT, 0, BT, BT, BT)
            else:
                b_q = load_rows(q + hq * K, t0, n_valid, H * K, 0, K, BT, BK).to(tl.float32)
                if fast:
                    P = mm(b_q * e_q, tl.trans(k_e), DOT_BF16, PREC)
                else:
                    P = scores_slow(b_q, b_k, gp, t0, n_valid, Hkv * K, 0, K, BT, BK, DOT_BF16, PREC)
                P = tl.where(causal, P * scale, 0.0)
            b_do = load_rows(do + hq * VO, t0, n_valid, H * VO, v0, V, BT, BV)
            b_dv += mm(tl.trans(P), b_do, DOT_BF16, PREC)
    else:
        b_dv = tl.zeros([BT, BV], dtype=tl.float32)
        for i_k in range(NK):
            b_k = load_rows(kp, t0, n_valid, Hkv * K, i_k * BK, K, BT, BK).to(tl.float32)
            G, G_last = gates(gp, t0, n_valid, Hkv * K, i_k * BK, K, BT, BK)
            b_dh1 = load_state(dhbuf + st_next, i_k * BK, v0, K, V, VS, BK, BV)
            b_dv += mm(b_k * tl.exp2(G_last[None, :] - G), b_dh1, DOT_BF16, PREC)
        for r in range(R):
            hq = i_h * R + r
            qp = q + hq * K
            if LOAD_P:
                P = load_rows(pbuf + hq * BT, t0, n_valid, H * BT, 0, BT, BT, BT).to(tl.float32)
            else:
                P = tl.zeros([BT, BT], dtype=tl.float32)
                for i_k in range(NK):
                    p, _, _ = score_tile(qp, kp, gp, t0, n_valid, i_k * BK, H, Hkv, K, BT, BK,
                                         DOT_BF16, PREC)
                    P += p
                P = tl.where(causal, P * scale, 0.0)
            b_do = load_rows(do + hq * VO, t0, n_valid, H * VO, v0, V, BT, BV)
            b_dv += mm(tl.trans(P), b_do, DOT_BF16, PREC)
    if ALL_V == 0:
        store_rows(dv + i_h * V, b_dv, t0, n_valid, Hkv * V, v0, V, BT, BV)
