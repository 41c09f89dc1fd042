"""Gated linear attention in Triton, the chunked form: fused_chunk_gla, its autograd Function and
the host side of the chunk kernels (decoding is recurrent.py's fused_recurrent_gla).

Same contract as `reference.chunk_gla_torch` / `recurrent_gla_torch` (see that file):
    q [B, T, H, K]; k, g [B, T, Hkv, K]; v [B, T, Hkv, V]; H a multiple of Hkv.
    g holds per-step log-decays (<= 0). o [B, T, H, V]; states [B, Hkv, K, V] float32
    (or [N, Hkv, K, V] with cu_seqlens, B = 1: the state restarts at each boundary).
The query heads of a group read the same KV state: k, v, g are never repeated per head.

Math per chunk of C tokens with start state h (K x V), G = in-chunk cumulative sum of g
(log2 units, fp32; written once per chunk by _chunk_gates_kernel and read by the other
kernels):
    o_i    = s * (q_i e^{G_i}) h + s * sum_{j<=i} P_ij v_j,  P_ij = sum_k q_ik k_jk e^{G_ik - G_jk}
    h_next = e^{G_last} h + sum_j (k_j e^{G_last - G_j})^T v_j
P is one tensor-core matmul of (q e^{G-a})(k e^{a-G})^T, anchored at the midpoint a of each
channel's in-chunk decay, when the chunk's total decay is below FAST (each factor then spans
half of it and fits the fp32/bf16 exponent range); otherwise ("slow path", steep decays) it is
built in 16-row blocks, each factorised around its own first row, and a block still too
steep row by row with every exponent clamped to <= 0 (see scores.py). The choice is made per
program and per K tile, so it is uniform inside a program. C is 32 where the state is narrow
(V <= 64, K <= 128), else 64.

Kernels (grid in brackets; N = sequences, NT = chunks of a sequence, NTtot = all chunks,
S = segments of all sequences), by file:
  forward   _chunk_gates_kernel [NK, NTtot, Hkv]  every chunk's G              chunk_fwd.py
            _fwd_state_kernel   [NK, NV, S*Hkv]   walks the chunks of a segment, state.py
                                                  writes every chunk-start state
            _seg_combine_kernel [NK, NV, N*Hkv]   chains the segments (only when S > N)
            _seg_fixup_kernel   [NTtot, Hkv]      local -> true states inside segments (idem)
            _fwd_output_kernel  [NTtot, Hkv]      o for every query head of the group
  backward  _bwd_dh_kernel      [NK, NV, S*Hkv]   reverse walk, every dh at chunk starts
            (_seg_combine_kernel, _seg_fixup_kernel in reverse, when S > N)
            _bwd_dqkg_kernel    [NK, NTtot, Hkv]  dq (each head), dk, dg (+ dv   chunk_bwd.py
                                                  when one K and V tile cover the head)
            _bwd_dv_kernel      [NV, NTtot, Hkv]  dv (otherwise)
  decoding  _recurrent_kernel   [NV, B*Hkv]       token by token, state in       recurrent.py
                                                  registers
The in-chunk gate and score helpers are in scores.py, the tile loads and the matmul in
glaswap_kernels/utils.py, the launch rules (tiles, warps, stages, paths) in launch.LaunchConfig.
The sequential passes are cut into segments (S > N) only when one walk per sequence would
leave SMs idle (few long sequences); see LaunchConfig.plan_segments.
The chunk-start states of the forward pass (bf16 for bf16 inputs, fp32 otherwise) are kept
for the backward pass instead of being recomputed.

dg needs no global pass: a reverse in-chunk cumulative sum plus one term per chunk boundary
(chunk_bwd.py's docstring gives the derivation).
"""

from __future__ import annotations

import torch

from ..utils import cdiv, new, next_pow2, row_stride, state_stride, varlen_meta
from .chunk_bwd import _bwd_dqkg_kernel, _bwd_dv_kernel
from .chunk_fwd import _chunk_gates_kernel, _fwd_output_kernel
from .launch import LaunchConfig, check_gla_inputs
from .state import _bwd_dh_kernel, _fwd_state_kernel, _seg_combine_kernel, _seg_fixup_kernel

__all__ = ["fused_chunk_gla"]


def _forward(q, k, v, g, scale, h0, want_ht, cu_seqlens, tiles, chunk, segment, normalizer,
             for_grad=False, overrides=None):
    # the inputs were checked once, by fused_chunk_gla
    B, T, H, K = q.shape
    Hkv, V = k.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    VU = V + int(normalizer)                        # state columns (z last) and o's columns
    VS = state_stride(V, normalizer)                # row stride of the internal state buffers
    cfg = LaunchConfig(B, T, H, Hkv, K, V, N, q.dtype, q.device, tiles, chunk,
                       normalizer=bool(normalizer), overrides=overrides)
    if segment is not None:                         # private: force the segment length (tests)
        cfg.seg_len = int(segment)
    if cu_seqlens is not None:
        cu, offsets, indices, total, n_chunks = varlen_meta(cu_seqlens, T, cfg.BT, q.device)
        n_entries = total + N
    else:
        cu = offsets = indices = None
        total = B * cdiv(T, cfg.BT)
        n_entries = total + B
        n_chunks = [cdiv(T, cfg.BT)] * B
    seg = cfg.plan_segments(n_chunks, Hkv, cu is not None, q.device)
    R = H // Hkv
    q, k, v, g = (x.contiguous() for x in (q, k, v, g))
    if h0 is not None:
        h0 = h0.contiguous()
    hbuf = new((n_entries, Hkv, K, VS), cfg.state_dtype, q.device)
    ht = new((N, Hkv, K, VU), torch.float32, q.device) if want_ht else None
    # With the normaliser o is a [B, T, H, V + 1] view of rows padded like the states (VS):
    # aligned rows let the kernels that write o and read its gradient use vector accesses
    # (the fused normaliser's backward hands the gradient back in the same layout).
    o = new((B, T, H, VS), q.dtype, q.device)[..., :VU]
    # keep_p: the output kernel also writes s * mask(P) of every chunk ([tokens, H, BT], the
    # matmul operand's dtype), which the backward's dv reads instead of rebuilding it.
    pbuf = None
    if for_grad and cfg.keep_p:
        pbuf = new((B, T, H, cfg.BT), torch.bfloat16 if cfg.dot_bf16 else torch.float32, q.device)
    # every chunk's cumulative gates, read by the other kernels (forward and backward)
    gbuf = new((B, T, Hkv, K), torch.float32, q.device)
    bk = min(next_pow2(K), 64)
    _chunk_gates_kernel[(cdiv(K, bk), total, Hkv)](
        g, gbuf, cu, offsets, indices, T, Hkv=Hkv, K=K, BT=cfg.BT, BK=bk,
        IS_VARLEN=cu is not None, num_warps=4)
    common = dict(IS_VARLEN=cu is not None, DOT_BF16=cfg.dot_bf16, PREC=cfg.prec,
                  VS=VS, VO=VS, NORM=bool(normalizer))
    dec, segend = _segment_buffers(seg, n_entries, Hkv, K, VS, q.device)
    _fwd_state_kernel[(cfg.NK_seq, cfg.NV_seq, seg.total * Hkv)](
        k, v, h0, ht, hbuf, dec, segend, cu, offsets, seg.indices, gbuf, T, seg.seg_len, seg.n_seg,
        Hkv=Hkv, K=K, V=V, BT=cfg.BT, BK=cfg.BK_seq, BV=cfg.BV_seq,
        USE_H0=h0 is not None, STORE_HT=want_ht, SEGMENTED=seg.on, VU=VU, **common,
        num_warps=cfg.warps_seq, num_stages=cfg.stages_seq)
    if seg.on:
        _chain_segments(cfg, seg, hbuf, dec, segend, ht, cu, offsets, indices, T, total, N,
                        Hkv, K, VU, VS, reverse=False)
    _fwd_output_kernel[(total, Hkv)](
        q, k, v, g, o, hbuf, pbuf, gbuf, cu, offsets, indices, T, scale,
        H=H, Hkv=Hkv, K=K, V=V, BT=cfg.BT, BK=cfg.BK_o, BV=cfg.BV_o, NK=cfg.NK_o, NV=cfg.NV_o,
        R=R, STORE_P=int(pbuf is not None), **common,
        num_warps=cfg.warps_o, num_stages=cfg.stages_chunk)
    meta = (cfg, cu, offsets, indices, total, N, seg, bool(normalizer))
    return o, ht, hbuf, pbuf, gbuf, meta


def _segment_buffers(seg, n_entries, Hkv, K, V, device):
    """dec (log2 decays per slot, fp32) and segend (local segment results, fp32)."""
    if not seg.on:
        return None, None
    return (new((n_entries, Hkv, K), torch.float32, device),
            new((seg.total, Hkv, K, V), torch.float32, device))


def _chain_segments(cfg, seg, buf, dec, segend, final, cu, offsets, indices, T, total, N,
                    Hkv, K, V, VS, reverse):
    """After a segmented pass: true states at the segment anchors, then at every slot.
    V here is the full state width (with the normaliser's column), which is also final's
    row stride; VS is the row stride of buf and segend. Both kernels walk all VS columns
    (pad included): a mask at V + 1 would split 8-column groups and force scalar loads."""
    IS_VARLEN = cu is not None
    NV = cdiv(VS, cfg.BV_seq)
    _seg_combine_kernel[(cfg.NK_seq, NV, N * Hkv)](
        buf, dec, segend, final, cu, offsets, seg.offsets, T, seg.seg_len, seg.n_seg,
        Hkv=Hkv, K=K, V=VS, VU=V, BT=cfg.BT, BK=cfg.BK_seq, BV=cfg.BV_seq,
        REVERSE=reverse, STORE_FINAL=final is not None, IS_VARLEN=IS_VARLEN, num_warps=4)
    _seg_fixup_kernel[(total, Hkv)](
        buf, dec, cu, offsets, indices, T, seg.seg_len,
        Hkv=Hkv, K=K, V=VS, BT=cfg.BT, BK=cfg.BK_seq, BV=cfg.BV_seq, NK=cfg.NK_seq,
        NV=NV, REVERSE=reverse, IS_VARLEN=IS_VARLEN, num_warps=4)


def _backward(q, k, v, g, scale, hbuf, pbuf, gbuf, meta, do, dht, want_dh0):
    cfg, cu, offsets, indices, total, N, seg, normalizer = meta
    B, T, H, K = q.shape
    Hkv, V = k.shape[2], v.shape[3]
    VU = V + int(normalizer)
    VS = hbuf.shape[-1]                             # the internal buffers' padded row stride
    R = H // Hkv
    VO = row_stride(do) if normalizer else None
    if VO is None or VO % 8:                       # not the padded layout: a plain copy
        do, VO = do.contiguous(), VU
    if dht is not None:
        dht = dht.contiguous()
    dhbuf = new(hbuf.shape, cfg.state_dtype, q.device)
    dh0 = new((N, Hkv, K, VU), torch.float32, q.device) if want_dh0 else None
    dq = new(q.shape, q.dtype, q.device)
    dk = new(k.shape, k.dtype, q.device)
    dv = new(v.shape, v.dtype, q.device)
    dg = new(g.shape, g.dtype, q.device)
    common = dict(IS_VARLEN=cu is not None, DOT_BF16=cfg.dot_bf16, PREC=cfg.prec,
                  VS=VS, VO=VO, NORM=normalizer)
    dec, segend = _segment_buffers(seg, hbuf.shape[0], Hkv, K, VS, q.device)
    _bwd_dh_kernel[(cfg.NK_seq, cfg.NV_seq, seg.total * Hkv)](
        q, do, dht, dh0, dhbuf, dec, segend, cu, offsets, seg.indices, gbuf, T, seg.seg_len,
        seg.n_seg, scale,
        H=H, Hkv=Hkv, K=K, V=V, BT=cfg.BT, BK=cfg.BK_seq, BV=cfg.BV_seq, R=R,
        USE_DHT=dht is not None, STORE_DH0=want_dh0, SEGMENTED=seg.on, VU=VU, **common,
        num_warps=cfg.warps_dh, num_stages=cfg.stages_seq)
    if seg.on:
        _chain_segments(cfg, seg, dhbuf, dec, segend, dh0, cu, offsets, indices, T, total, N,
                        Hkv, K, VU, VS, reverse=True)
    # split_g: the one-matmul chunks (PATH 1) and the others (PATH 2) in two launches
    for path in ((1, 2) if cfg.split_g else (0,)):
        _bwd_dqkg_kernel[(cfg.NK_g, total, Hkv)](
            q, k, v, g, do, hbuf, dhbuf, pbuf, gbuf, dq, dk, dg, dv, cu, offsets, indices, T, scale,
            H=H, Hkv=Hkv, K=K, V=V, BT=cfg.BT, BK=cfg.BK_g, BV=cfg.BV_g, NV=cfg.NV_g, R=R,
            WITH_DV=cfg.merge_dv, PATH=path, ONE_PASS=int(bool(cfg.one_pass_g) and R == 1),
            LOAD_P=int(pbuf is not None), **common,
            num_warps=cfg.warps_g, num_stages=cfg.stages_chunk)
    if not cfg.merge_dv:
        all_v = cfg.NV_dv if cfg.dv_all_v and R == 1 and cfg.NK_o == 1 and cfg.NV_dv > 1 else 0
        _bwd_dv_kernel[(1 if all_v else cfg.NV_dv, total, Hkv)](
            q, k, g, do, dhbuf, pbuf, gbuf, dv, cu, offsets, indices, T, scale,
            H=H, Hkv=Hkv, K=K, V=V, BT=cfg.BT, BK=cfg.BK_o, BV=cfg.BV_dv, NK=cfg.NK_o, R=R,
            ALL_V=all_v, LOAD_P=int(pbuf is not None), **common,
            num_warps=cfg.warps_dv, num_stages=cfg.stages_chunk)
    return dq, dk, dv, dg, dh0


class _FusedChunkGLA(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, tiles,
                chunk, segment, normalizer, for_grad, overrides):
        q, k, v, g = (x.contiguous() for x in (q, k, v, g))
        o, ht, hbuf, pbuf, gbuf, meta = _forward(q, k, v, g, scale, initial_state,
                                                 output_final_state, cu_seqlens, tiles, chunk,
                                                 segment, normalizer, for_grad, overrides)
        ctx.save_for_backward(q, k, v, g, hbuf, pbuf, gbuf)
        ctx.meta = meta
        ctx.scale = scale
        ctx.has_h0 = initial_state is not None
        ctx.h0_dtype = None if initial_state is None else initial_state.dtype
        # None gradients stay None (no zero tensors to read): dht is often unused.
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, hbuf, pbuf, gbuf = ctx.saved_tensors
        if do is None:
            do = torch.zeros(q.shape[:3] + (v.shape[3] + int(ctx.meta[-1]),), dtype=q.dtype,
                             device=q.device)
        want_dh0 = ctx.has_h0 and ctx.needs_input_grad[5]
        dq, dk, dv, dg, dh0 = _backward(q, k, v, g, ctx.scale, hbuf, pbuf, gbuf, ctx.meta, do,
                                        dht, want_dh0)
        if dh0 is not None and dh0.dtype != ctx.h0_dtype:
            dh0 = dh0.to(ctx.h0_dtype)               # autograd wants the input's dtype
        return dq, dk, dv, dg, None, dh0, None, None, None, None, None, None, None, None


def fused_chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
                    cu_seqlens=None, normalizer=False, *, _tiles=None, _chunk=None,
                    _segment=None, _overrides=None):
    """Chunk-parallel GLA, differentiable in q, k, v, g and initial_state.

    q [B, T, H, K]; k, g [B, T, Hkv, K]; v [B, T, Hkv, V]; g = per-step log-decays (<= 0).
    Returns (o [B, T, H, V] in q's dtype, final state [N, Hkv, K, V] float32 or None).
    cu_seqlens (int32/int64, N+1 cumulative lengths, B must be 1) packs N documents; the
    state restarts at each boundary and initial/final states are per document.
    normalizer=True computes what a column of ones appended to v would give, without the
    extra column in every V tile: o gets V + 1 columns (the last is the normaliser
    s * sum_j (q_i 2^{G_i - G_j}) k_j) and the states K x (V + 1) (the last column is the
    normaliser's state), exactly the layout of the ones-column call. That o is a view of rows
    padded to a multiple of 8 values (not contiguous; `.contiguous()` gives a plain copy): the
    backward reads a gradient handed back in the same layout (as the fused normaliser does)
    in place, and any other gradient through one copy.
    The keywords are private. `_tiles=(BK, BV)`, `_chunk` and `_segment` (tests) force the
    tile sizes of every kernel, the chunk length and the chunks per segment of the
    sequential passes (0: one walk per sequence); `_overrides` (tuning runs, a dict such as
    {"warps_o": 8}) replaces attributes the launch rules chose (launch.LaunchConfig).
    """
    check_gla_inputs(q, k, v, g, initial_state, cu_seqlens, chunked=True, normalizer=bool(normalizer))
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    # Buffers kept only for a backward (keep_p) are written only when one can follow.
    for_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, initial_state))
    return _FusedChunkGLA.apply(q, k, v, g, scale, initial_state, bool(output_final_state),
                                cu_seqlens, _tiles, _chunk, _segment, bool(normalizer), for_grad,
                                _overrides)
