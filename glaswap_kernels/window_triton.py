"""Sliding-window softmax attention with attention sinks: Triton kernels, forward and backward.

The contract (which keys a token sees, what o and lse are) is in window_torch.py. Query
row i of a document sees two disjoint key sets, split per row so that every kernel agrees
on which pair belongs where whatever its tile sizes:

    window part:  i - W < j <= i
    sink part:    j < S  and  j <= i - W      (the sinks the window does not cover)

Forward (one program per query block of BM rows and query head): a flash-attention online
softmax in log2 space over the sink keys [0, min(S, t0 + BM - W)) and then the key blocks
of BN from t0 - W + 1 to the block's last row: O(W + S) work per block, not O(T).

Backward, two kernels:
- dq (query-major, like the forward): delta_i = rowsum(dO_i * O_i) - dlse_i (the lse
  gradient enters here: d lse_i / d s_ij = P_ij, so dS = P * (dP - delta) covers both
  outputs), dq over the same keys. It also owns the sink part's dk and dv: those keys are
  seen by every later query of the document, so a key-major program for them would walk
  O(T) query blocks while every other program walks O(W) (one straggler per document).
  Each query block instead adds its share for the S sink keys into a small float32 buffer
  [N, Hkv, S, D] with atomics (S * D values per block and head; the sums of those few
  values are the only ones whose order varies between runs).
- dk/dv (key-major: one program per key block of BN and kv head): the window part, from
  the queries i in [j, j + W) of its keys, for every query head of its group (summing the
  group in registers, so dk and dv need no atomics), plus the sink buffer for the sink keys.

Turned sinks (ROPE, the hybrid layer's case): q and k come rotated by the teacher's RoPE
tables cos, sin, and a sink that the window does not cover is scored with the unrotated
query against the unrotated key turned by a fixed rotation (turn_cos, turn_sin), as
window_torch.sink_operands defines. The kernels undo the rotation in registers: per pair of
columns RoPE multiplies by the complex number c = cos + i sin, so the unrotated query is
q_r / c (u - i w with u, w = cos, sin over cos^2 + sin^2, exact whatever the tables' scale)
and the sink key is k_r (u_j - i w_j)(turn_cos + i turn_sin). Only the query block's own
rows of cos and sin and the S sink rows are read, and the sink part's gradients go back
through the same factors into dq and dk (the transpose of a complex product is the product
by its conjugate), so the sink operands and their gradients never exist at full size
outside registers. rotate_half, the multiplication by i, is a second load of the same tile with its
halves swapped (_load_rows_rh).

GQA: the forward and dq programs take one query head each (H programs per block: more
parallel programs at short T; the G heads of a group reread the same k/v tiles, which
come from L2, not HBM); the dk/dv programs loop over the group's heads.

Tiles use plain pointer arithmetic with masks (triton_helpers._load_rows): any T, packed
documents, and head dims padded to a power of two.
"""

from __future__ import annotations

import torch

try:
    # The try block keeps transformers' remote-code import checker from requiring Triton in
    # a saved model's folder (gla_ops falls back to PyTorch without it).
    import triton
    import triton.language as tl
except ImportError:
    raise

from .gla_launch import _varlen_meta
from .triton_helpers import (_cdiv, _chunk_coords, _interpreting, _load_rows, _new, _next_pow2,
                             _store_rows)
from .window_torch import check_window_inputs

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------
# Device side
# ----------------------------------------------------------------------------------------

@triton.jit
def _doc(pid, cu, indices, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Document of block pid: (document index, first row of the block within the document,
    the document's first token (int64), its length)."""
    i_n, i_b = _chunk_coords(pid, indices, T, BT, IS_VARLEN)
    if IS_VARLEN:
        start = tl.load(cu + i_n)
        bos = start.to(tl.int64)
        n = tl.load(cu + i_n + 1) - start
    else:
        bos = i_n.to(tl.int64) * T
        n = T
    return i_n, i_b * BT, bos, n


@triton.jit
def _load_vec(ptr, t0, n_valid, H: tl.constexpr, BT: tl.constexpr):
    """[BT] float32 of a [tokens, H] tensor (lse, delta) at rows t0.. (ptr at the head)."""
    rows = tl.arange(0, BT)
    return tl.load(ptr + t0 * H + rows * H, mask=rows < n_valid, other=0.0).to(tl.float32)


@triton.jit
def _load_rows_rh(ptr, t0, n_valid, stride_t, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """rotate_half of a [BT, BD] row tile, float32: [-x2, x1] per row (halves of D), zero past D."""
    HALF: tl.constexpr = D // 2
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BD)[None, :]
    src = tl.where(cols < HALF, cols + HALF, cols - HALF)
    x = tl.load(ptr + t0 * stride_t + (rows * stride_t + src), mask=(rows < n_valid) & (cols < D), other=0.0)
    x = x.to(tl.float32)
    return tl.where(cols < HALF, -x, x)


@triton.jit
def _unrope_factors(cos, sin, r0, n_valid, TT, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """(u, w) [BT, BD] float32 of rows r0.. (token rows, taken modulo the tables' TT rows):
    x_r (u - i w) undoes x_r = x (cos + i sin) per pair of columns."""
    rows = tl.arange(0, BT)[:, None]
    cols = tl.arange(0, BD)[None, :]
    m = (rows < n_valid) & (cols < D)
    off = ((r0 + rows) % TT) * D + cols
    c = tl.load(cos + off, mask=m, other=0.0).to(tl.float32)
    s = tl.load(sin + off, mask=m, other=0.0).to(tl.float32)
    n2 = c * c + s * s
    inv = tl.where(n2 > 0, 1.0 / tl.where(n2 > 0, n2, 1.0), 0.0)
    return c * inv, s * inv


@triton.jit
def _sink_queries(qb, q_ptr, cos, sin, r0, n_valid, TT, QS: tl.constexpr, D: tl.constexpr,
                  BM: tl.constexpr, BD: tl.constexpr, ROPE: tl.constexpr):
    """The sink part's query tile: q_r (u - i w) under ROPE, else the window part's own."""
    qsb = qb
    if ROPE:
        u, w = _unrope_factors(cos, sin, r0, n_valid, TT, D, BM, BD)
        qrh = _load_rows_rh(q_ptr, r0, n_valid, QS, D, BM, BD)
        qsb = (qb.to(tl.float32) * u - qrh * w).to(qb.dtype)
    return qsb


@triton.jit
def _turn_factors(cos, sin, tc, ts, r0, n_valid, TT, D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """(a, b) [BT, BD] float32 with k_r (a + i b) = the unrotated key turned by (tc, ts)."""
    u, w = _unrope_factors(cos, sin, r0, n_valid, TT, D, BT, BD)
    cols = tl.arange(0, BD)
    tcv = tl.load(tc + cols, mask=cols < D, other=0.0)[None, :]
    tsv = tl.load(ts + cols, mask=cols < D, other=0.0)[None, :]
    return u * tcv + w * tsv, u * tsv - w * tcv


@triton.jit
def _sink_keys(k_ptr, cos, sin, tc, ts, bos, j0, n, TT, KS: tl.constexpr, D: tl.constexpr,
               BS: tl.constexpr, BD: tl.constexpr, ROPE: tl.constexpr):
    """The sink tile's keys and their rotate_half (both in k's dtype; the second is only
    meaningful under ROPE): turned from k_r's rows under ROPE, else k's rows as they are."""
    kb = _load_rows(k_ptr, bos + j0, n - j0, KS, 0, D, BS, BD)
    kh = kb
    if ROPE:
        a, b = _turn_factors(cos, sin, tc, ts, bos + j0, n - j0, TT, D, BS, BD)
        kf = kb.to(tl.float32)
        krh = _load_rows_rh(k_ptr, bos + j0, n - j0, KS, D, BS, BD)
        kh = (krh * a - kf * b).to(kb.dtype)
        kb = (kf * a + krh * b).to(kb.dtype)
    return kb, kh


@triton.jit
def _fwd_tile(qb, kb, vb, allowed, m, l, acc, scale2, PREC: tl.constexpr):
    """One key tile of the online softmax (scores in log2 units; m starts finite, so a row
    with no allowed key yet keeps alpha = 1 and p = 0 instead of NaN)."""
    s = tl.dot(qb, tl.trans(kb), input_precision=PREC) * scale2
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PREC)
    return m_new, l, acc


@triton.jit
def _window_fwd_kernel(q, k, v, o, lse, cos, sin, tc, ts, cu, indices, T, TT, scale2, W, S,
                       H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr,
                       HAS_SINKS: tl.constexpr, ROPE: tl.constexpr, IS_VARLEN: tl.constexpr,
                       PREC: tl.constexpr):
    pid, h = tl.program_id(0), tl.program_id(1)
    i_n, t0, bos, n = _doc(pid, cu, indices, T, BM, IS_VARLEN)
    hk = h // (H // HKV)
    QS: tl.constexpr = H * D
    KS: tl.constexpr = HKV * D
    k_ptr, v_ptr = k + hk * D, v + hk * D
    qb = _load_rows(q + h * D, bos + t0, n - t0, QS, 0, D, BM, BD)
    rows = (t0 + tl.arange(0, BM))[:, None]
    m = tl.full([BM], -1e30, tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    if HAS_SINKS:
        qsb = _sink_queries(qb, q + h * D, cos, sin, bos + t0, n - t0, TT, QS, D, BM, BD, ROPE)
        for j0 in range(0, tl.minimum(S, t0 + BM - W), BS):
            cols = (j0 + tl.arange(0, BS))[None, :]
            kb, kh = _sink_keys(k_ptr, cos, sin, tc, ts, bos, j0, n, TT, KS, D, BS, BD, ROPE)
            vb = _load_rows(v_ptr, bos + j0, n - j0, KS, 0, D, BS, BD)
            m, l, acc = _fwd_tile(qsb, kb, vb, (cols < S) & (cols <= rows - W), m, l, acc, scale2, PREC)
    for j0 in range(tl.maximum(t0 - W + 1, 0), tl.minimum(t0 + BM, n), BN):
        cols = (j0 + tl.arange(0, BN))[None, :]
        kb = _load_rows(k_ptr, bos + j0, n - j0, KS, 0, D, BN, BD)
        vb = _load_rows(v_ptr, bos + j0, n - j0, KS, 0, D, BN, BD)
        m, l, acc = _fwd_tile(qb, kb, vb, (cols <= rows) & (cols > rows - W), m, l, acc, scale2, PREC)
    l = tl.where(l > 0, l, 1.0)          # rows past the document end (never stored)
    _store_rows(o + h * D, acc / l[:, None], bos + t0, n - t0, QS, 0, D, BM, BD)
    r = tl.arange(0, BM)
    tl.store(lse + (bos + t0) * H + h + r * H, (m + tl.log2(l)) / 1.4426950408889634,
             mask=t0 + r < n)


@triton.jit
def _bwd_scores(qb, dob, kb, vb, lse2, delta, allowed, scale2, PREC: tl.constexpr):
    """P and dS = P * (dP - delta) of a [BM, BN] tile."""
    s = tl.dot(qb, tl.trans(kb), input_precision=PREC) * scale2
    p = tl.exp2(tl.where(allowed, s, float("-inf")) - lse2[:, None])
    dp = tl.dot(dob, tl.trans(vb), input_precision=PREC)
    return p, p * (dp - delta[:, None])


@triton.jit
def _window_bwd_dq_kernel(q, k, v, o, do, lse, dlse, delta, dq, dks, dvs, cos, sin, tc, ts, cu, indices, T, TT,
                          scale2, scale, W, S,
                          H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr,
                          HAS_SINKS: tl.constexpr, ROPE: tl.constexpr, HAS_DLSE: tl.constexpr,
                          IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    pid, h = tl.program_id(0), tl.program_id(1)
    i_n, t0, bos, n = _doc(pid, cu, indices, T, BM, IS_VARLEN)
    hk = h // (H // HKV)
    QS: tl.constexpr = H * D
    KS: tl.constexpr = HKV * D
    k_ptr, v_ptr = k + hk * D, v + hk * D
    qb = _load_rows(q + h * D, bos + t0, n - t0, QS, 0, D, BM, BD)
    dob = _load_rows(do + h * D, bos + t0, n - t0, QS, 0, D, BM, BD)
    ob = _load_rows(o + h * D, bos + t0, n - t0, QS, 0, D, BM, BD)
    lse2 = _load_vec(lse + h, bos + t0, n - t0, H, BM) * 1.4426950408889634
    dl = tl.sum(dob.to(tl.float32) * ob.to(tl.float32), 1)
    if HAS_DLSE:
        dl -= _load_vec(dlse + h, bos + t0, n - t0, H, BM)
    r = tl.arange(0, BM)
    tl.store(delta + (bos + t0) * H + h + r * H, dl, mask=t0 + r < n)
    rows = (t0 + r)[:, None]
    valid = rows < n
    dqa = tl.zeros([BM, BD], tl.float32)
    if HAS_SINKS:
        qsb = _sink_queries(qb, q + h * D, cos, sin, bos + t0, n - t0, TT, QS, D, BM, BD, ROPE)
        dcols = tl.arange(0, BD)[None, :]
        for j0 in range(0, tl.minimum(S, t0 + BM - W), BS):
            c = j0 + tl.arange(0, BS)
            cols = c[None, :]
            kb, kh = _sink_keys(k_ptr, cos, sin, tc, ts, bos, j0, n, TT, KS, D, BS, BD, ROPE)
            vb = _load_rows(v_ptr, bos + j0, n - j0, KS, 0, D, BS, BD)
            p, ds = _bwd_scores(qsb, dob, kb, vb, lse2, dl, valid & (cols < S) & (cols <= rows - W),
                                scale2, PREC)
            if ROPE:  # back through q_s = q_r (u - i w): times (u + i w)
                dqk = tl.dot(ds.to(kb.dtype), kb, input_precision=PREC)
                dqkh = tl.dot(ds.to(kb.dtype), kh, input_precision=PREC)
                u, w = _unrope_factors(cos, sin, bos + t0, n - t0, TT, D, BM, BD)
                dqa += dqk * u + dqkh * w
            else:
                dqa += tl.dot(ds.to(kb.dtype), kb, input_precision=PREC)
            # this block's share of the sink keys' dk and dv (see the header)
            dv_part = tl.dot(tl.trans(p.to(dob.dtype)), dob, input_precision=PREC)
            dk_part = tl.dot(tl.trans(ds.to(qsb.dtype)), qsb, input_precision=PREC) * scale
            offs = ((i_n * HKV + hk) * S + c)[:, None] * D + dcols
            msk = (c < S)[:, None] & (dcols < D)
            tl.atomic_add(dvs + offs, dv_part, mask=msk)
            tl.atomic_add(dks + offs, dk_part, mask=msk)
    for j0 in range(tl.maximum(t0 - W + 1, 0), tl.minimum(t0 + BM, n), BN):
        cols = (j0 + tl.arange(0, BN))[None, :]
        kb = _load_rows(k_ptr, bos + j0, n - j0, KS, 0, D, BN, BD)
        vb = _load_rows(v_ptr, bos + j0, n - j0, KS, 0, D, BN, BD)
        p, ds = _bwd_scores(qb, dob, kb, vb, lse2, dl, valid & (cols <= rows) & (cols > rows - W),
                            scale2, PREC)
        dqa += tl.dot(ds.to(kb.dtype), kb, input_precision=PREC)
    _store_rows(dq + h * D, dqa * scale, bos + t0, n - t0, QS, 0, D, BM, BD)


@triton.jit
def _window_bwd_dkv_kernel(q, k, v, do, lse, delta, dk, dv, dks, dvs, cos, sin, tc, ts, cu, indices, T, TT,
                           scale2, scale, W, S,
                           H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr,
                           HAS_SINKS: tl.constexpr, ROPE: tl.constexpr, IS_VARLEN: tl.constexpr,
                           PREC: tl.constexpr):
    pid, hk = tl.program_id(0), tl.program_id(1)
    i_n, s0, bos, n = _doc(pid, cu, indices, T, BN, IS_VARLEN)
    G: tl.constexpr = H // HKV
    QS: tl.constexpr = H * D
    KS: tl.constexpr = HKV * D
    kb = _load_rows(k + hk * D, bos + s0, n - s0, KS, 0, D, BN, BD)
    vb = _load_rows(v + hk * D, bos + s0, n - s0, KS, 0, D, BN, BD)
    c = s0 + tl.arange(0, BN)
    cols = c[:, None]                     # tiles here are transposed: keys x queries
    dka = tl.zeros([BN, BD], tl.float32)
    dva = tl.zeros([BN, BD], tl.float32)
    # the sink part's dk and dv: the dq kernel's buffers [documents, HKV, S, D], rows s0..
    sink = (i_n * HKV + hk) * S * D
    n_sink = tl.minimum(S, n) - s0
    if HAS_SINKS and ROPE:
        # loaded before the loop, so the turn's factors are not live beside the loop's tiles
        if s0 < S:
            dkb = _load_rows(dks + sink, s0, n_sink, D, 0, D, BN, BD)
            dkh = _load_rows_rh(dks + sink, s0, n_sink, D, D, BN, BD)
            dva = _load_rows(dvs + sink, s0, n_sink, D, 0, D, BN, BD)
            a, b = _turn_factors(cos, sin, tc, ts, bos + s0, n - s0, TT, D, BN, BD)
            # back through the turned key k_r (a + i b): times (a - i b); the buffer holds
            # scaled sums, dka is scaled below
            dka = (dkb * a - dkh * b) / scale
    for g in range(G):
        h = hk * G + g
        for i0 in range(s0, tl.minimum(s0 + BN - 1 + W, n), BM):
            rows = (i0 + tl.arange(0, BM))[None, :]
            qb = _load_rows(q + h * D, bos + i0, n - i0, QS, 0, D, BM, BD)
            dob = _load_rows(do + h * D, bos + i0, n - i0, QS, 0, D, BM, BD)
            lse2 = _load_vec(lse + h, bos + i0, n - i0, H, BM) * 1.4426950408889634
            dl = _load_vec(delta + h, bos + i0, n - i0, H, BM)
            allowed = (rows < n) & (cols <= rows) & (cols > rows - W)
            st = tl.dot(kb, tl.trans(qb), input_precision=PREC) * scale2
            pt = tl.exp2(tl.where(allowed, st, float("-inf")) - lse2[None, :])
            dva += tl.dot(pt.to(dob.dtype), dob, input_precision=PREC)
            dpt = tl.dot(vb, tl.trans(dob), input_precision=PREC)
            dst = pt * (dpt - dl[None, :])
            dka += tl.dot(dst.to(qb.dtype), qb, input_precision=PREC)
    dka *= scale
    if HAS_SINKS and not ROPE:
        if s0 < S:
            dka += _load_rows(dks + sink, s0, n_sink, D, 0, D, BN, BD)
            dva += _load_rows(dvs + sink, s0, n_sink, D, 0, D, BN, BD)
    _store_rows(dk + hk * D, dka, bos + s0, n - s0, KS, 0, D, BN, BD)
    _store_rows(dv + hk * D, dva, bos + s0, n - s0, KS, 0, D, BN, BD)


# ----------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------

class _Plan:
    """Tiles and launch options of one call. BM query rows and BN keys per tile in every
    kernel (the dk/dv kernel: BN keys per program, BM query rows per step; the dq kernel:
    dq_BM rows and dq_warps warps); BS keys per sink tile. `overrides` (tests, tuning runs)
    replace any attribute."""

    def __init__(self, T, D, S, dtype, overrides=None, turned=False):
        self.BD = max(16, _next_pow2(D))
        fp32 = dtype == torch.float32
        row = self.BD * (4 if fp32 else 2)              # bytes of a tile row
        # 64 x 64 tiles for 16-bit rows up to 256 bytes (D <= 128); fp32 tiles spill
        # registers at 64 rows (ptxas, sm_90: 26 KB at D64 in the backward kernels, 1 KB at
        # D32) and take 32 rows over 8 warps
        tile = 32 if fp32 or row > 256 else 64
        short = max(16, _next_pow2(T))
        self.BM = min(tile, short)
        self.BN = min(tile, short)
        self.BS = max(16, min(tile, _next_pow2(S)))
        self.warps = 8 if fp32 or row >= 256 else 4
        # three stages hide the key loads behind the dots at 16-bit D128 (0.85 against 0.96 ms
        # for W128 S4 at 8x2048 H16 on an H200); at D64 they change nothing
        self.stages = 3 if self.BD == 128 and dtype != torch.float32 else 2
        # fp32 inputs get exact fp32 products (tf32 would cost them 3 decimal digits)
        self.prec = "ieee" if dtype == torch.float32 else "tf32"
        # the dq kernel's own rows and warps: turned sinks keep RoPE factors beside its tiles,
        # which spill registers (ptxas, sm_90) at 16-bit 64-row tiles unless spread over 8
        # warps (D64) or taken 32 rows at a time (D128), and at fp32 D128 unless every tile
        # is 16 rows
        self.dq_BM, self.dq_warps = self.BM, self.warps
        if turned and S > 0:
            if not fp32:
                if self.BD <= 64:
                    self.dq_warps = 8
                else:
                    self.dq_BM = min(self.BM, 32)
            elif self.BD >= 128:
                self.BM = self.BN = self.dq_BM = min(self.BM, 16)
        for key, value in (overrides or {}).items():
            if not hasattr(self, key):
                raise ValueError(f"unknown window launch option {key!r}")
            setattr(self, key, value)


def _blocks(cu_seqlens, B, T, BT, device):
    """(cu int32 on the device or None, block indices [total, 2] or None, total blocks)."""
    if cu_seqlens is None:
        return None, None, B * _cdiv(T, BT)
    cu, _, indices, total, _ = _varlen_meta(cu_seqlens, T, BT, device)
    return cu, indices, total


class _WindowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, window, sinks, scale, cu_seqlens, plan, cos, sin, turn_cos, turn_sin):
        B, T, H, D = q.shape
        Hkv = k.shape[2]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        turned = cos is not None and sinks > 0
        tabs, TT = _tables(q, cos, sin, turn_cos, turn_sin) if turned else ((q, q, q, q), 1)
        o = _new((B, T, H, D), q.dtype, q.device)
        lse = _new((B, T, H), torch.float32, q.device)
        cu, idx, total = _blocks(cu_seqlens, B, T, plan.BM, q.device)
        _window_fwd_kernel[(total, H)](
            q, k, v, o, lse, *tabs, cu, idx, T, TT, scale * LOG2E, window, sinks,
            H=H, HKV=Hkv, D=D, BD=plan.BD, BM=plan.BM, BN=plan.BN, BS=plan.BS,
            HAS_SINKS=sinks > 0, ROPE=turned, IS_VARLEN=cu is not None, PREC=plan.prec,
            num_warps=plan.warps, num_stages=plan.stages)
        ctx.save_for_backward(q, k, v, o, lse, *tabs)
        ctx.args = (window, sinks, scale, cu_seqlens, plan, turned, TT)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, *tabs = ctx.saved_tensors
        window, sinks, scale, cu_seqlens, plan, turned, TT = ctx.args
        B, T, H, D = q.shape
        Hkv = k.shape[2]
        do = torch.zeros_like(o) if do is None else do.contiguous()
        dlse = None if dlse is None else dlse.contiguous()
        dq = _new(q.shape, q.dtype, q.device)
        dk = _new(k.shape, k.dtype, k.device)
        dv = _new(v.shape, v.dtype, v.device)
        delta = _new((B, T, H), torch.float32, q.device)
        n_docs = B if cu_seqlens is None else cu_seqlens.numel() - 1
        # the sink keys' dk and dv from the sink part (accumulated by atomics: zeros)
        dks = torch.zeros((n_docs, Hkv, max(sinks, 1), D), dtype=torch.float32, device=q.device)
        dvs = torch.zeros_like(dks)
        common = dict(H=H, HKV=Hkv, D=D, BD=plan.BD, BN=plan.BN,
                      HAS_SINKS=sinks > 0, ROPE=turned, IS_VARLEN=cu_seqlens is not None, PREC=plan.prec,
                      num_stages=plan.stages)
        cu, idx, total = _blocks(cu_seqlens, B, T, plan.dq_BM, q.device)
        _window_bwd_dq_kernel[(total, H)](
            q, k, v, o, do, lse, dlse, delta, dq, dks, dvs, *tabs, cu, idx, T, TT, scale * LOG2E, scale,
            window, sinks, BM=plan.dq_BM, BS=plan.BS, HAS_DLSE=dlse is not None, num_warps=plan.dq_warps, **common)
        cu, idx, total = _blocks(cu_seqlens, B, T, plan.BN, q.device)
        _window_bwd_dkv_kernel[(total, Hkv)](
            q, k, v, do, lse, delta, dk, dv, dks, dvs, *tabs, cu, idx, T, TT, scale * LOG2E, scale,
            window, sinks, BM=plan.BM, num_warps=plan.warps, **common)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def _tables(q, cos, sin, turn_cos, turn_sin):
    """The RoPE tables as the kernels read them: cos and sin as rows of D (row r of the
    tokens reads row r mod TT: tables of one batch row serve every row), the turn as
    float32 [D]; and TT."""
    D = q.shape[-1]
    cos, sin = cos.reshape(-1, D).contiguous(), sin.reshape(-1, D).contiguous()
    turn = [t.to(device=q.device, dtype=torch.float32).contiguous() for t in (turn_cos, turn_sin)]
    return (cos, sin, *turn), cos.shape[0]


def fused_window_attention(q, k, v, window, sinks=0, scale=None, cu_seqlens=None, sink_rope=None,
                           _overrides=None):
    """Sliding-window + sink softmax attention on the Triton kernels: (o [B, T, H, D] in q's
    dtype, lse [B, T, H] float32), differentiable through both (see window_torch for the
    contract; sink_rope = (cos, sin, turn_cos, turn_sin) turns the sink part as
    window_torch.sink_operands does). _overrides: launch options of _Plan (tests and tuning
    runs)."""
    B, T, H, Hkv, D = check_window_inputs(q, k, v, window, sinks, scale, cu_seqlens, sink_rope)
    if not (q.is_cuda or _interpreting()):
        raise ValueError(f"the Triton window kernels need CUDA tensors (or TRITON_INTERPRET=1), "
                         f"got {q.device}")
    scale = D ** -0.5 if scale is None else float(scale)
    # a window or sink count past the sequence changes nothing; clamping keeps them int32
    window, sinks = min(window, T), min(sinks, T)
    plan = _Plan(T, D, sinks, q.dtype, _overrides, turned=sink_rope is not None)
    return _WindowAttention.apply(q, k, v, window, sinks, scale, cu_seqlens, plan,
                                  *(sink_rope if sink_rope is not None else (None,) * 4))
