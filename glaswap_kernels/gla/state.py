"""GLA's sequential passes over the chunks: the chunk-start states and their gradients.

    _fwd_state_kernel   [NK, NV, S*Hkv]  walks the chunks of a segment, writes every
                                         chunk-start state h (and the final state)
    _bwd_dh_kernel      [NK, NV, S*Hkv]  the reverse walk, writes every dh at chunk starts
    _seg_combine_kernel [NK, NV, N*Hkv]  chains the segments of each sequence
    _seg_fixup_kernel   [NTtot, Hkv]     local -> true states inside the segments

These are the only sequential parts of the chunk algorithm. A pass walks one sequence per
(K tile, V tile, KV head); when that leaves SMs idle (few long sequences) every sequence is
cut into S segments walked in parallel from a zero state, then the combine and fix-up
kernels add the missing 2^decay * (true start) terms (launch.LaunchConfig.plan_segments).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:
    raise

from ..utils import (chunk_coords, load_col, load_den_grad, load_rows, load_state, mm, seq_bounds,
                     store_col, store_state)
from .scores import kept_gates


@triton.jit
def _walk_range(seg_indices, n_seg, cu_seqlens, chunk_offsets, T, seg_len, Hkv: tl.constexpr,
                BT: tl.constexpr, SEGMENTED: tl.constexpr, IS_VARLEN: tl.constexpr):
    """What this program of a sequential pass (grid axis 2: segment x KV head) walks: its
    segment index i_sg, KV head i_h, sequence i_n, segment within the sequence i_s, the
    sequence bounds (bos, eos, c0), the sequence's chunk count NT and the chunk range
    [t_first, t_end). Unsegmented passes walk a whole sequence each (segment 0)."""
    i_sh = tl.program_id(2)
    i_sg = i_sh // Hkv
    i_h = i_sh % Hkv
    if SEGMENTED:
        if IS_VARLEN:
            i_n = tl.load(seg_indices + 2 * i_sg)
            i_s = tl.load(seg_indices + 2 * i_sg + 1)
        else:
            i_n = i_sg // n_seg
            i_s = i_sg % n_seg
    else:
        i_n = i_sg
        i_s = i_sg * 0
    bos, eos, c0 = seq_bounds(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    NT = tl.cdiv(eos - bos, BT)
    if SEGMENTED:
        t_first = i_s * seg_len
        t_end = tl.minimum(NT, t_first + seg_len)
    else:
        t_first = NT * 0
        t_end = NT
    return i_sg, i_h, i_n, i_s, bos, eos, c0, NT, t_first, t_end


@triton.jit
def _store_dec(dec, slot, i_h, x, k0, Hkv: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    rk = k0 + tl.arange(0, BK)
    tl.store(dec + (slot * Hkv + i_h) * K + rk, x, mask=rk < K)


@triton.jit(do_not_specialize=["seg_len", "n_seg"])
def _fwd_state_kernel(k, v, h0, ht, hbuf, dec, segend, cu_seqlens, chunk_offsets, seg_indices,
                      gbuf, T, seg_len, n_seg,
                      Hkv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      VS: tl.constexpr, VO: tl.constexpr, VU: tl.constexpr, NORM: tl.constexpr,
                      BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr,
                      STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr, SEGMENTED: tl.constexpr,
                      DOT_BF16: tl.constexpr, PREC: tl.constexpr):
    """Sequential over the chunks of one sequence (or of one segment of seg_len chunks), for
    one (K tile, V tile, KV head). hbuf[c0 + n + i] = state at the start of chunk i; entry NT
    is the final state.
    SEGMENTED: segment s > 0 starts from a zero state, so the states it writes are local; it
    leaves its first slot to _seg_combine_kernel, records in dec[slot] the log2 decay from
    its first chunk to each later slot, and puts its local end state in segend, from which
    the combine kernel chains the true segment starts and _seg_fixup_kernel adds
    2^dec * (true start) to the slots inside. Short walks fill the GPU when a few long
    sequences would leave most SMs idle.
    Only the last line of the loop depends on the carried state, so the next chunk's k, g, v
    are loaded one iteration ahead (by hand: the loop holds stores, which keeps Triton's
    pipeliner away) and their latency hides behind this chunk's work. G comes from gbuf
    (_chunk_gates_kernel), not from g: no in-chunk scan on the latency chain."""
    i_k = tl.program_id(0)
    i_v = tl.program_id(1)
    i_sg, i_h, i_n, i_s, bos, eos, c0, NT, t_first, t_end = _walk_range(
        seg_indices, n_seg, cu_seqlens, chunk_offsets, T, seg_len, Hkv, BT, SEGMENTED, IS_VARLEN)
    i_nh = i_n * Hkv + i_h
    k0 = i_k * BK
    v0 = i_v * BV

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        if i_s == 0:
            b_h += load_state(h0 + i_nh.to(tl.int64) * K * VU, k0, v0, K, V, VU, BK, BV)
    # NORM: the normaliser's state z (column V: v's implicit column of ones), carried by
    # the V-tile-0 programs; z_next = 2^{G_last} z + sum_j k_j 2^{G_last - G_j}
    b_z = tl.zeros([BK], dtype=tl.float32)
    if NORM:
        if USE_H0:
            if i_s == 0:
                b_z += load_col(h0 + i_nh.to(tl.int64) * K * VU, k0, K, V, VU, BK)
    b_d = tl.zeros([BK], dtype=tl.float32)                 # log2 decay since t_first
    kp = k + i_h * K
    Gp = gbuf + i_h * K
    vp = v + i_h * V
    # first chunk (all masked when the sequence is empty)
    t1 = bos + t_first * BT
    n_k = load_rows(kp, t1, eos - t1, Hkv * K, k0, K, BT, BK)
    n_G, n_Gl = kept_gates(Gp, t1, eos - t1, Hkv * K, k0, K, BT, BK)
    n_v = load_rows(vp, t1, eos - t1, Hkv * V, v0, V, BT, BV)
    for i_t in range(t_first, t_end):
        b_k = n_k.to(tl.float32)
        G = n_G
        G_last = n_Gl
        b_v = n_v
        t1 = bos + (i_t + 1) * BT                         # next chunk (masked past the end)
        n_k = load_rows(kp, t1, eos - t1, Hkv * K, k0, K, BT, BK)
        n_G, n_Gl = kept_gates(Gp, t1, eos - t1, Hkv * K, k0, K, BT, BK)
        n_v = load_rows(vp, t1, eos - t1, Hkv * V, v0, V, BT, BV)

        slot = c0 + i_n + i_t
        if (i_t > t_first) | (i_s == 0):
            store_state(hbuf + (slot * Hkv + i_h) * K * VS, b_h, k0, v0, K, V, VS, BK, BV)
            if NORM:
                if i_v == 0:
                    store_col(hbuf + (slot * Hkv + i_h) * K * VS, b_z, k0, K, V, VS, BK)
        if SEGMENTED:
            if (i_v == 0) & (i_t > t_first):
                _store_dec(dec, slot, i_h, b_d, k0, Hkv, K, BK)
            b_d += G_last
        # k decayed to the chunk end: exponent G_last - G <= 0.
        k_end = b_k * tl.exp2(G_last[None, :] - G)
        b_h = b_h * tl.exp2(G_last)[:, None] + mm(tl.trans(k_end), b_v, DOT_BF16, PREC)
        if NORM:
            b_z = b_z * tl.exp2(G_last) + tl.sum(k_end, axis=0)
    if SEGMENTED:
        sp = segend + (i_sg * Hkv + i_h).to(tl.int64) * K * VS
        store_state(sp, b_h, k0, v0, K, V, VS, BK, BV)
        if i_v == 0:
            _store_dec(dec, c0 + i_n + t_end, i_h, b_d, k0, Hkv, K, BK)
            if NORM:
                store_col(sp, b_z, k0, K, V, VS, BK)
    else:
        hp = hbuf + ((c0 + i_n + NT) * Hkv + i_h) * K * VS
        store_state(hp, b_h, k0, v0, K, V, VS, BK, BV)
        if STORE_HT:
            store_state(ht + i_nh.to(tl.int64) * K * VU, b_h, k0, v0, K, V, VU, BK, BV)
        if NORM:
            if i_v == 0:
                store_col(hp, b_z, k0, K, V, VS, BK)
                if STORE_HT:
                    store_col(ht + i_nh.to(tl.int64) * K * VU, b_z, k0, K, V, VU, BK)


@triton.jit(do_not_specialize=["seg_len", "n_seg"])
def _bwd_dh_kernel(q, do, dht, dh0, dhbuf, dec, segend, cu_seqlens, chunk_offsets, seg_indices,
                   gbuf, T, seg_len, n_seg, scale,
                   H: tl.constexpr, Hkv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   VS: tl.constexpr, VO: tl.constexpr, VU: tl.constexpr, NORM: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, R: tl.constexpr,
                   USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr,
                   SEGMENTED: tl.constexpr, DOT_BF16: tl.constexpr, PREC: tl.constexpr):
    """Reverse walk: dhbuf[c0 + n + i] = gradient of the state at the start of chunk i,
    dh_i = 2^{G_last} dh_{i+1} + s * sum_heads (q 2^G)^T do; entry NT = dht (or 0).
    SEGMENTED mirrors the forward pass: every segment but the last starts from zero at its
    end, writes its inside slots, dec[slot] = log2 decay from each slot to its end, and its
    local first-slot value into segend (see _seg_combine_kernel, _seg_fixup_kernel).
    As in the forward pass, the loads run one step ahead: (q, do) one (chunk, head) pair
    ahead; the kept G is loaded at each step (fp32 tiles one chunk ahead cost registers
    and spills).
    NORM: the V-tile-0 programs also carry dz (the normaliser's column), fed by column V
    of do: dz_i = 2^{G_last} dz_{i+1} + s * sum_heads (q 2^G)^T do[:, V]."""
    i_k = tl.program_id(0)
    i_v = tl.program_id(1)
    i_sg, i_h, i_n, i_s, bos, eos, c0, NT, t_first, t_end = _walk_range(
        seg_indices, n_seg, cu_seqlens, chunk_offsets, T, seg_len, Hkv, BT, SEGMENTED, IS_VARLEN)
    i_nh = i_n * Hkv + i_h
    last = t_end == NT
    k0 = i_k * BK
    v0 = i_v * BV

    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        if last:
            b_dh += load_state(dht + i_nh.to(tl.int64) * K * VU, k0, v0, K, V, VU, BK, BV)
    b_dz = tl.zeros([BK], dtype=tl.float32)
    if NORM:
        if USE_DHT:
            if last:
                b_dz += load_col(dht + i_nh.to(tl.int64) * K * VU, k0, K, V, VU, BK)
    if last:
        hp = dhbuf + ((c0 + i_n + NT) * Hkv + i_h) * K * VS
        store_state(hp, b_dh, k0, v0, K, V, VS, BK, BV)
        if NORM:
            if i_v == 0:
                store_col(hp, b_dz, k0, K, V, VS, BK)
    b_d = tl.zeros([BK], dtype=tl.float32)                 # log2 decay down to t_end
    Gp = gbuf + i_h * K
    qp = q + i_h * R * K
    dop = do + i_h * R * VO
    # last chunk, first head of the group (all masked when the segment is empty)
    t_last = bos + (t_end - 1) * BT
    n_last = tl.where(t_end > t_first, eos - t_last, 0)
    n_q = load_rows(qp, t_last, n_last, H * K, k0, K, BT, BK)
    n_do = load_rows(dop, t_last, n_last, H * VO, v0, V, BT, BV)
    for i in range(t_end - t_first):
        i_t = t_end - 1 - i
        t0 = bos + i_t * BT
        # previous chunk (nothing left to load at the segment's first chunk)
        t_prev = t0 - BT
        n_prev = tl.where(i_t > t_first, eos - t_prev, 0)
        G, G_last = kept_gates(Gp, t0, eos - t0, Hkv * K, k0, K, BT, BK)
        e_q = tl.exp2(G)
        acc = tl.zeros([BK, BV], dtype=tl.float32)
        acc_z = tl.zeros([BK], dtype=tl.float32)
        for r in range(R):
            b_q = n_q.to(tl.float32)
            b_do = n_do
            if NORM:
                dden = load_den_grad(dop + r * VO, t0, eos - t0, H * VO, V, BT)
                acc_z += tl.sum(b_q * e_q * dden[:, None], axis=0)
            # next (chunk, head) pair: the next head here, else the first head one chunk back
            if r + 1 < R:
                t_n = t0
                n_n = eos - t0
                r_n = r + 1
            else:
                t_n = t_prev
                n_n = n_prev
                r_n = 0
            n_q = load_rows(qp + r_n * K, t_n, n_n, H * K, k0, K, BT, BK)
            n_do = load_rows(dop + r_n * VO, t_n, n_n, H * VO, v0, V, BT, BV)
            acc += mm(tl.trans(b_q * e_q), b_do, DOT_BF16, PREC)
        b_dh = b_dh * tl.exp2(G_last)[:, None] + acc * scale
        if NORM:
            b_dz = b_dz * tl.exp2(G_last) + acc_z * scale
        slot = c0 + i_n + i_t
        if SEGMENTED:
            b_d += G_last
            if i_v == 0:
                _store_dec(dec, slot, i_h, b_d, k0, Hkv, K, BK)
            write = i_t > t_first                # the first slot is the combine kernel's
        else:
            write = i_t >= 0
        if write:
            sp = dhbuf + (slot * Hkv + i_h) * K * VS
            store_state(sp, b_dh, k0, v0, K, V, VS, BK, BV)
            if NORM:
                if i_v == 0:
                    store_col(sp, b_dz, k0, K, V, VS, BK)
    if SEGMENTED:
        fp = segend + (i_sg * Hkv + i_h).to(tl.int64) * K * VS
        store_state(fp, b_dh, k0, v0, K, V, VS, BK, BV)
        if NORM:
            if i_v == 0:
                store_col(fp, b_dz, k0, K, V, VS, BK)
    elif STORE_DH0:
        fp = dh0 + i_nh.to(tl.int64) * K * VU
        store_state(fp, b_dh, k0, v0, K, V, VU, BK, BV)
        if NORM:
            if i_v == 0:
                store_col(fp, b_dz, k0, K, V, VU, BK)


@triton.jit(do_not_specialize=["seg_len", "n_seg"])
def _seg_combine_kernel(buf, dec, segend, hfinal, cu_seqlens, chunk_offsets, seg_offsets, T,
                        seg_len, n_seg,
                        Hkv: tl.constexpr, K: tl.constexpr, V: tl.constexpr, VU: tl.constexpr,
                        BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, REVERSE: tl.constexpr,
                        STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Chains the segments of one sequence (one K tile, V tile, KV head): a walk over the
    few segments, not the chunks. Forward: the true state at the end of segment s is
    segend_s + 2^{dec[end_s]} * (true state at its start), written to buf at end_s (the
    first segment started from h0, so its end is already true); the last one is ht.
    REVERSE (dh pass): the same from the last segment down, written at each segment's first
    slot; the first segment's start is dh0.
    V: the row width of buf and segend, every column handled (with the normaliser's padded
    rows the pad columns are chained too, never read elsewhere: a mask inside an 8-column
    group would force scalar loads); VU: the width of hfinal (the caller's [.., K, VU])."""
    i_k = tl.program_id(0)
    i_v = tl.program_id(1)
    i_nh = tl.program_id(2)
    i_n = i_nh // Hkv
    i_h = i_nh % Hkv
    bos, eos, c0 = seq_bounds(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    NT = tl.cdiv(eos - bos, BT)
    if IS_VARLEN:
        s0 = tl.load(seg_offsets + i_n)
        S = tl.load(seg_offsets + i_n + 1) - s0
    else:
        s0 = i_n * n_seg
        S = n_seg
    k0 = i_k * BK
    v0 = i_v * BV
    rk = k0 + tl.arange(0, BK)
    mk = rk < K
    base = c0 + i_n
    if REVERSE:
        b_h = load_state(segend + ((s0 + S - 1) * Hkv + i_h).to(tl.int64) * K * V,
                         k0, v0, K, V, V, BK, BV)
        slot = base + (S - 1) * seg_len
        store_state(buf + (slot * Hkv + i_h) * K * V, b_h, k0, v0, K, V, V, BK, BV)
        for i in range(1, S):
            slot = base + (S - 1 - i) * seg_len
            a = tl.exp2(tl.load(dec + (slot * Hkv + i_h) * K + rk, mask=mk, other=0.0))
            sp = segend + ((s0 + S - 1 - i) * Hkv + i_h).to(tl.int64) * K * V
            b_h = a[:, None] * b_h + load_state(sp, k0, v0, K, V, V, BK, BV)
            store_state(buf + (slot * Hkv + i_h) * K * V, b_h, k0, v0, K, V, V, BK, BV)
    else:
        b_h = load_state(segend + (s0 * Hkv + i_h).to(tl.int64) * K * V, k0, v0, K, V, V, BK, BV)
        slot = base + tl.minimum(NT, seg_len)
        store_state(buf + (slot * Hkv + i_h) * K * V, b_h, k0, v0, K, V, V, BK, BV)
        for s in range(1, S):
            slot = base + tl.minimum(NT, (s + 1) * seg_len)
            a = tl.exp2(tl.load(dec + (slot * Hkv + i_h) * K + rk, mask=mk, other=0.0))
            b_h = a[:, None] * b_h + load_state(
                segend + ((s0 + s) * Hkv + i_h).to(tl.int64) * K * V, k0, v0, K, V, V, BK, BV)
            store_state(buf + (slot * Hkv + i_h) * K * V, b_h, k0, v0, K, V, V, BK, BV)
    if STORE_FINAL:
        store_state(hfinal + i_nh.to(tl.int64) * K * VU, b_h, k0, v0, K, VU, VU, BK, BV)


@triton.jit(do_not_specialize=["seg_len"])
def _seg_fixup_kernel(buf, dec, cu_seqlens, chunk_offsets, chunk_indices, T, seg_len,
                      Hkv: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr,
                      REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Turns the local state of one chunk slot into the true one, all chunks in parallel:
    state += 2^dec[slot] * (true state at the segment's anchor), the anchor being the
    segment's first slot (forward) or its end (REVERSE). Slots of the segment that started
    from the true state (the first forward, the last in reverse) and the anchors themselves
    are left alone."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_n, i_t = chunk_coords(i_c, chunk_indices, T, BT, IS_VARLEN)
    bos, eos, c0 = seq_bounds(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    NT = tl.cdiv(eos - bos, BT)
    s = i_t // seg_len
    inside = (i_t % seg_len) != 0
    if REVERSE:
        anchor = (s + 1) * seg_len
        active = inside & (anchor < NT)
    else:
        anchor = s * seg_len
        active = inside & (s > 0)
    if active:
        slot = c0 + i_n + i_t
        aslot = c0 + i_n + anchor
        for i_k in range(NK):
            rk = i_k * BK + tl.arange(0, BK)
            a = tl.exp2(tl.load(dec + (slot * Hkv + i_h) * K + rk, mask=rk < K, other=0.0))
            for i_v in range(NV):
                sp = buf + (slot * Hkv + i_h) * K * V
                ap = buf + (aslot * Hkv + i_h) * K * V
                x = (load_state(sp, i_k * BK, i_v * BV, K, V, V, BK, BV)
                     + a[:, None] * load_state(ap, i_k * BK, i_v * BV, K, V, V, BK, BV))
                store_state(sp, x, i_k * BK, i_v * BV, K, V, V, BK, BV)
