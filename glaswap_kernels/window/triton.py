"""Sliding-window softmax attention with attention sinks: Triton kernels, forward and backward.

The contract (which keys a token sees, what o and lse are) is in reference.py. Query
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

Split sinks (SPLIT): the sink part is scored with its own queries and keys, q_sink and k_sink
(reference.py's contract); dq then gets the window part, dq_sink the sink part, and the sink
buffer's dk goes to k_sink's first S rows of each document instead of k's.

GQA: the forward and dq programs take one query head each (H programs per block: more
parallel programs at short T; the G heads of a group reread the same k/v tiles, which
come from L2, not HBM); the dk/dv programs loop over the group's heads.

Tiles use plain pointer arithmetic with masks (utils.load_rows): any T, packed
documents, and head dims padded to a power of two.
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

from ..utils import (cdiv, chunk_coords, interpreting, load_rows, new, next_pow2, store_rows,
                     varlen_meta)
from .reference import check_window_inputs

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------
# Device side
# ----------------------------------------------------------------------------------------

@triton.jit
def _doc(pid, cu, indices, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Document of block pid: (document index, first row of the block within the document,
    the document's first token (int64), its length)."""
    i_n, i_b = chunk_coords(pid, indices, T, BT, IS_VARLEN)
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
def _sink_operands(qb, k_ptr, qs, ks, h, hk, bos, t0, n, QS: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                   BM: tl.constexpr, SPLIT: tl.constexpr):
    """The sink part's query tile and key pointer: q_sink's and k_sink's when SPLIT, else the
    window part's own."""
    qsb = qb
    ks_ptr = k_ptr
    if SPLIT:
        qsb = load_rows(qs + h * D, bos + t0, n - t0, QS, 0, D, BM, BD)
        ks_ptr = ks + hk * D
    return qsb, ks_ptr


@triton.jit
def _fwd_block(qb, k_ptr, v_ptr, bos, j0, n, KS, allowed, m, l, acc, scale2,
               D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, PREC: tl.constexpr):
    """One key block of the online softmax (scores in log2 units; m starts finite, so a row
    with no allowed key yet keeps alpha = 1 and p = 0 instead of NaN)."""
    kb = load_rows(k_ptr, bos + j0, n - j0, KS, 0, D, BN, BD)
    vb = load_rows(v_ptr, bos + j0, n - j0, KS, 0, D, BN, BD)
    s = tl.dot(qb, tl.trans(kb), input_precision=PREC) * scale2
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb, input_precision=PREC)
    return m_new, l, acc


@triton.jit
def _window_fwd_kernel(q, k, v, qs, ks, o, lse, cu, indices, T, scale2, W, S,
                       H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr,
                       HAS_SINKS: tl.constexpr, SPLIT: tl.constexpr, IS_VARLEN: tl.constexpr,
                       PREC: tl.constexpr):
    pid, h = tl.program_id(0), tl.program_id(1)
    i_n, t0, bos, n = _doc(pid, cu, indices, T, BM, IS_VARLEN)
    hk = h // (H // HKV)
    QS: tl.constexpr = H * D
    KS: tl.constexpr = HKV * D
    k_ptr, v_ptr = k + hk * D, v + hk * D
    qb = load_rows(q + h * D, bos + t0, n - t0, QS, 0, D, BM, BD)
    rows = (t0 + tl.arange(0, BM))[:, None]
    m = tl.full([BM], -1e30, tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, BD], tl.float32)
    if HAS_SINKS:
        qsb, ks_ptr = _sink_operands(qb, k_ptr, qs, ks, h, hk, bos, t0, n, QS, D, BD, BM, SPLIT)
        for j0 in range(0, tl.minimum(S, t0 + BM - W), BS):
            cols = (j0 + tl.arange(0, BS))[None, :]
            allowed = (cols < S) & (cols <= rows - W)
            m, l, acc = _fwd_block(qsb, ks_ptr, v_ptr, bos, j0, n, KS, allowed, m, l, acc,
                                   scale2, D, BD, BS, PREC)
    for j0 in range(tl.maximum(t0 - W + 1, 0), tl.minimum(t0 + BM, n), BN):
        cols = (j0 + tl.arange(0, BN))[None, :]
        allowed = (cols <= rows) & (cols > rows - W)
        m, l, acc = _fwd_block(qb, k_ptr, v_ptr, bos, j0, n, KS, allowed, m, l, acc,
                               scale2, D, BD, BN, PREC)
    l = tl.where(l > 0, l, 1.0)          # rows past the document end (never stored)
    store_rows(o + h * D, acc / l[:, None], bos + t0, n - t0, QS, 0, D, BM, BD)
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
def _window_bwd_dq_kernel(q, k, v, qs, ks, o, do, lse, dlse, delta, dq, dqs, dks, dvs, cu, indices, T,
                          scale2, scale, W, S,
                          H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                          BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr,
                          HAS_SINKS: tl.constexpr, SPLIT: tl.constexpr, HAS_DLSE: tl.constexpr,
                          IS_VARLEN: tl.constexpr, PREC: tl.constexpr):
    pid, h = tl.program_id(0), tl.program_id(1)
    i_n, t0, bos, n = _doc(pid, cu, indices, T, BM, IS_VARLEN)
    hk = h // (H // HKV)
    QS: tl.constexpr = H * D
    KS: tl.constexpr = HKV * D
    k_ptr, v_ptr = k + hk * D, v + hk * D
    qb = load_rows(q + h * D, bos + t0, n - t0, QS, 0, D, BM, BD)
    dob = load_rows(do + h * D, bos + t0, n - t0, QS, 0, D, BM, BD)
    ob = load_rows(o + h * D, bos + t0, n - t0, QS, 0, D, BM, BD)
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
        qsb, ks_ptr = _sink_operands(qb, k_ptr, qs, ks, h, hk, bos, t0, n, QS, D, BD, BM, SPLIT)
        dqsa = tl.zeros([BM, BD], tl.float32)
        dcols = tl.arange(0, BD)[None, :]
        for j0 in range(0, tl.minimum(S, t0 + BM - W), BS):
            c = j0 + tl.arange(0, BS)
            cols = c[None, :]
            kb = load_rows(ks_ptr, bos + j0, n - j0, KS, 0, D, BS, BD)
            vb = load_rows(v_ptr, bos + j0, n - j0, KS, 0, D, BS, BD)
            p, ds = _bwd_scores(qsb, dob, kb, vb, lse2, dl, valid & (cols < S) & (cols <= rows - W),
                                scale2, PREC)
            dqsa += tl.dot(ds.to(kb.dtype), kb, input_precision=PREC)
            # this block's share of the sink keys' dk and dv (see the header)
            dv_part = tl.dot(tl.trans(p.to(dob.dtype)), dob, input_precision=PREC)
            dk_part = tl.dot(tl.trans(ds.to(qsb.dtype)), qsb, input_precision=PREC) * scale
            offs = ((i_n * HKV + hk) * S + c)[:, None] * D + dcols
            msk = (c < S)[:, None] & (dcols < D)
            tl.atomic_add(dvs + offs, dv_part, mask=msk)
            tl.atomic_add(dks + offs, dk_part, mask=msk)
        if SPLIT:
            store_rows(dqs + h * D, dqsa * scale, bos + t0, n - t0, QS, 0, D, BM, BD)
        else:
            dqa += dqsa
    for j0 in range(tl.maximum(t0 - W + 1, 0), tl.minimum(t0 + BM, n), BN):
        cols = (j0 + tl.arange(0, BN))[None, :]
        kb = load_rows(k_ptr, bos + j0, n - j0, KS, 0, D, BN, BD)
        vb = load_rows(v_ptr, bos + j0, n - j0, KS, 0, D, BN, BD)
        p, ds = _bwd_scores(qb, dob, kb, vb, lse2, dl, valid & (cols <= rows) & (cols > rows - W),
                            scale2, PREC)
        dqa += tl.dot(ds.to(kb.dtype), kb, input_precision=PREC)
    store_rows(dq + h * D, dqa * scale, bos + t0, n - t0, QS, 0, D, BM, BD)


@triton.jit
def _window_bwd_dkv_kernel(q, k, v, do, lse, delta, dk, dv, dks, dvs, cu, indices, T,
                           scale2, scale, W, S,
                           H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr,
                           HAS_SINKS: tl.constexpr, SPLIT: tl.constexpr, IS_VARLEN: tl.constexpr,
                           PREC: tl.constexpr):
    pid, hk = tl.program_id(0), tl.program_id(1)
    i_n, s0, bos, n = _doc(pid, cu, indices, T, BN, IS_VARLEN)
    G: tl.constexpr = H // HKV
    QS: tl.constexpr = H * D
    KS: tl.constexpr = HKV * D
    kb = load_rows(k + hk * D, bos + s0, n - s0, KS, 0, D, BN, BD)
    vb = load_rows(v + hk * D, bos + s0, n - s0, KS, 0, D, BN, BD)
    c = s0 + tl.arange(0, BN)
    cols = c[:, None]                     # tiles here are transposed: keys x queries
    dka = tl.zeros([BN, BD], tl.float32)
    dva = tl.zeros([BN, BD], tl.float32)
    for g in range(G):
        h = hk * G + g
        for i0 in range(s0, tl.minimum(s0 + BN - 1 + W, n), BM):
            rows = (i0 + tl.arange(0, BM))[None, :]
            qb = load_rows(q + h * D, bos + i0, n - i0, QS, 0, D, BM, BD)
            dob = load_rows(do + h * D, bos + i0, n - i0, QS, 0, D, BM, BD)
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
    if HAS_SINKS:
        if s0 < S:
            dcols = tl.arange(0, BD)[None, :]
            offs = ((i_n * HKV + hk) * S + c)[:, None] * D + dcols
            msk = (c < S)[:, None] & (c < n)[:, None] & (dcols < D)
            if not SPLIT:              # split: the sink keys' dk belongs to k_sink
                dka += tl.load(dks + offs, mask=msk, other=0.0)
            dva += tl.load(dvs + offs, mask=msk, other=0.0)
    store_rows(dk + hk * D, dka, bos + s0, n - s0, KS, 0, D, BN, BD)
    store_rows(dv + hk * D, dva, bos + s0, n - s0, KS, 0, D, BN, BD)


# ----------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------

class _Plan:
    """Tiles and launch options of one call. BM query rows and BN keys per tile in every
    kernel (the dk/dv kernel: BN keys per program, BM query rows per step); BS keys per
    sink tile. `overrides` (tests, tuning runs) replace any attribute."""

    def __init__(self, T, D, S, dtype, overrides=None):
        self.BD = max(16, next_pow2(D))
        fp32 = dtype == torch.float32
        row = self.BD * (4 if fp32 else 2)              # bytes of a tile row
        # 64 x 64 tiles for 16-bit rows up to 256 bytes (D <= 128); fp32 tiles spill
        # registers at 64 rows (ptxas, sm_90: 26 KB at D64 in the backward kernels, 1 KB at
        # D32) and take 32 rows over 8 warps
        tile = 32 if fp32 or row > 256 else 64
        short = max(16, next_pow2(T))
        self.BM = min(tile, short)
        self.BN = min(tile, short)
        self.BS = max(16, min(tile, next_pow2(S)))
        self.warps = 8 if fp32 or row >= 256 else 4
        # three stages hide the key loads behind the dots at 16-bit D128 (0.85 against 0.96 ms
        # for W128 S4 at 8x2048 H16 on an H200); at D64 they change nothing
        self.stages = 3 if self.BD == 128 and not fp32 else 2
        # fp32 inputs get exact fp32 products (tf32 would cost them 3 decimal digits)
        self.prec = "ieee" if fp32 else "tf32"
        for key, value in (overrides or {}).items():
            if not hasattr(self, key):
                raise ValueError(f"unknown window launch option {key!r}")
            setattr(self, key, value)


def _blocks(cu_seqlens, B, T, BT, device):
    """(cu int32 on the device or None, block indices [total, 2] or None, total blocks)."""
    if cu_seqlens is None:
        return None, None, B * cdiv(T, BT)
    cu, _, indices, total, _ = varlen_meta(cu_seqlens, T, BT, device)
    return cu, indices, total


class _WindowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, window, sinks, scale, cu_seqlens, plan, q_sink, k_sink):
        B, T, H, D = q.shape
        Hkv = k.shape[2]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        split = q_sink is not None and sinks > 0
        qs, ks = (q_sink.contiguous(), k_sink.contiguous()) if split else (q, k)
        o = new((B, T, H, D), q.dtype, q.device)
        lse = new((B, T, H), torch.float32, q.device)
        cu, idx, total = _blocks(cu_seqlens, B, T, plan.BM, q.device)
        _window_fwd_kernel[(total, H)](
            q, k, v, qs, ks, o, lse, cu, idx, T, scale * LOG2E, window, sinks,
            H=H, HKV=Hkv, D=D, BD=plan.BD, BM=plan.BM, BN=plan.BN, BS=plan.BS,
            HAS_SINKS=sinks > 0, SPLIT=split, IS_VARLEN=cu is not None, PREC=plan.prec,
            num_warps=plan.warps, num_stages=plan.stages)
        ctx.save_for_backward(q, k, v, qs, ks, o, lse)
        ctx.args = (window, sinks, scale, cu_seqlens, plan, split, q_sink is not None)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, qs, ks, o, lse = ctx.saved_tensors
        window, sinks, scale, cu_seqlens, plan, split, given = ctx.args
        B, T, H, D = q.shape
        Hkv = k.shape[2]
        do = torch.zeros_like(o) if do is None else do.contiguous()
        dlse = None if dlse is None else dlse.contiguous()
        dq = new(q.shape, q.dtype, q.device)
        dk = new(k.shape, k.dtype, k.device)
        dv = new(v.shape, v.dtype, v.device)
        dqs = new(q.shape, q.dtype, q.device) if split else dq
        delta = new((B, T, H), torch.float32, q.device)
        n_docs = B if cu_seqlens is None else cu_seqlens.numel() - 1
        # the sink keys' dk and dv from the sink part (accumulated by atomics: zeros)
        dks = torch.zeros((n_docs, Hkv, max(sinks, 1), D), dtype=torch.float32, device=q.device)
        dvs = torch.zeros_like(dks)
        common = dict(H=H, HKV=Hkv, D=D, BD=plan.BD, BM=plan.BM, BN=plan.BN,
                      HAS_SINKS=sinks > 0, SPLIT=split, IS_VARLEN=cu_seqlens is not None, PREC=plan.prec,
                      num_warps=plan.warps, num_stages=plan.stages)
        cu, idx, total = _blocks(cu_seqlens, B, T, plan.BM, q.device)
        _window_bwd_dq_kernel[(total, H)](
            q, k, v, qs, ks, o, do, lse, dlse, delta, dq, dqs, dks, dvs, cu, idx, T, scale * LOG2E, scale,
            window, sinks, BS=plan.BS, HAS_DLSE=dlse is not None, **common)
        cu, idx, total = _blocks(cu_seqlens, B, T, plan.BN, q.device)
        _window_bwd_dkv_kernel[(total, Hkv)](
            q, k, v, do, lse, delta, dk, dv, dks, dvs, cu, idx, T, scale * LOG2E, scale,
            window, sinks, **common)
        if not given:
            return dq, dk, dv, None, None, None, None, None, None, None
        if not split:   # no sink part (sinks = 0): q_sink and k_sink take no gradient
            return dq, dk, dv, None, None, None, None, None, torch.zeros_like(q), torch.zeros_like(k)
        return dq, dk, dv, None, None, None, None, None, dqs, _sink_rows(dks, cu_seqlens, B, T, sinks, k.dtype)


def _sink_rows(dks, cu_seqlens, B, T, S, dtype):
    """The sink buffer [documents, Hkv, S, D] (float32) as a gradient of k_sink [B, T, Hkv, D]:
    each document's first S rows (fewer in a shorter document), zero elsewhere."""
    N, Hkv, _, D = dks.shape
    j = torch.arange(S, device=dks.device)
    if cu_seqlens is None:
        start = torch.arange(N, device=dks.device) * T
        ok = (j < T).expand(N, S)
    else:
        cu = cu_seqlens.to(device=dks.device, dtype=torch.long)
        start = cu[:-1]
        ok = j[None, :] < (cu[1:] - cu[:-1])[:, None]
    rows = torch.where(ok, start[:, None] + j, B * T)              # row B * T: a discard row
    # built in k's dtype: only the S rows a document are converted, not all B * T
    out = torch.zeros(B * T + 1, Hkv, D, dtype=dtype, device=dks.device)
    out.index_copy_(0, rows.reshape(-1), dks.transpose(1, 2).reshape(N * S, Hkv, D).to(dtype))
    return out[:B * T].view(B, T, Hkv, D)


def fused_window_attention(q, k, v, window, sinks=0, scale=None, cu_seqlens=None, q_sink=None, k_sink=None,
                           _overrides=None):
    """Sliding-window + sink softmax attention on the Triton kernels: (o [B, T, H, D] in q's
    dtype, lse [B, T, H] float32), differentiable through both (see reference.py for the
    contract; q_sink and k_sink score the sink part). _overrides: launch options of _Plan
    (tests and tuning runs)."""
    B, T, H, Hkv, D = check_window_inputs(q, k, v, window, sinks, scale, cu_seqlens, q_sink, k_sink)
    if not (q.is_cuda or interpreting()):
        raise ValueError(f"the Triton window kernels need CUDA tensors (or TRITON_INTERPRET=1), "
                         f"got {q.device}")
    scale = D ** -0.5 if scale is None else float(scale)
    # a window or sink count past the sequence changes nothing; clamping keeps them int32
    window, sinks = min(window, T), min(sinks, T)
    plan = _Plan(T, D, sinks, q.dtype, _overrides)
    return _WindowAttention.apply(q, k, v, window, sinks, scale, cu_seqlens, plan, q_sink, k_sink)
