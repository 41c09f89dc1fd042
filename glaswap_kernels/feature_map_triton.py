"""A fused Triton kernel for the feature map in front of GLA: RoPE, per-head matrix, softmax.

    phi(x) = softmax(rope(x) W_h)     over the head dimension, one D x D matrix W_h per head

It is what `gla.reference.feature_map_torch` computes (the Hedgehog map of LoLCATs; W = identity
gives the plain softmax map), in one pass over x forward and one backward. With pm=True it
writes [softmax(rope(x) W_h), softmax(-rope(x) W_h)] (2D wide, the hedgehog_pm map) from the
same product rope(x) W_h: one kernel, one x read and one dW for both halves instead of two
calls, a cat and a negated W. Done in
PyTorch the same map is ~10 element-wise passes over a [B, T, H, D] tensor forward and
~20 backward (casts to float32 and back, the rotation's slices, the einsum's layout copies,
softmax), which cost a 1B student step more time than the GLA kernels themselves
(benchmarks/README.md).

Shapes: x [B, T, H, D] (D even, as RoPE needs); cos, sin [B or 1, T, D]; W [H, D, D] float32,
rows the input dimension. The output has x's dtype. Arithmetic is float32; the two matmuls
take bf16 operands for bf16 inputs (as autocast would) and float32 ones otherwise.
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

# The output buffers are NaN-filled when utils.POISON is set (tests).
from .utils import cdiv, mm, new, next_pow2

# Launch settings (benchmarks/bench_feature_map.py --set KEY=VALUE tries others): BN rows
# per block; warps; stages, the software pipelining depth (1 keeps float32 D = 128 within
# shared memory).
LAUNCH = dict(BN=64, warps=4, stages=1)


@triton.jit
def _dot(a, b, DOT_BF16: tl.constexpr):
    """bf16 operands for bf16 inputs (as autocast would), exact float32 products otherwise."""
    return mm(a, b, DOT_BF16, "ieee")


@triton.jit
def _rotated(x, cos, sin, rows, c, N, T, stride_x, stride_cb, stride_ct, i_h,
             D: tl.constexpr, D2: tl.constexpr, ROPE: tl.constexpr):
    """The two halves of rope(x) for a block of rows of head i_h, float32, zero outside."""
    m = (rows < N)[:, None] & (c < D2)[None, :]
    px = x + rows[:, None] * stride_x + i_h * D + c[None, :]
    x1 = tl.load(px, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(px + D2, mask=m, other=0.0).to(tl.float32)
    if ROPE:
        pc = (rows // T)[:, None] * stride_cb + (rows % T)[:, None] * stride_ct + c[None, :]
        c1 = tl.load(cos + pc, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(cos + pc + D2, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(sin + pc, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(sin + pc + D2, mask=m, other=0.0).to(tl.float32)
        # rope(x) = x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1]
        return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, c1, c2, s1, s2
    else:
        return x1, x2, x1, x1, x1, x1


@triton.jit
def _softmax(y, e, D: tl.constexpr):
    """Row softmax over the first D columns (0 past them)."""
    y = tl.where((e < D)[None, :], y, float("-inf"))
    y = tl.exp(y - tl.max(y, axis=1)[:, None])
    return y / tl.sum(y, axis=1)[:, None]


@triton.jit
def _logits(r1, r2, w, i_h, stride_wh, c, e, D: tl.constexpr, D2: tl.constexpr, DOT_BF16: tl.constexpr):
    """r W_h of a block (columns past D are 0), and W_h's two row halves."""
    wm = (c < D2)[:, None] & (e < D)[None, :]
    pw = w + i_h * stride_wh + c[:, None] * D + e[None, :]
    w1 = tl.load(pw, mask=wm, other=0.0)
    w2 = tl.load(pw + D2 * D, mask=wm, other=0.0)
    return _dot(r1, w1, DOT_BF16) + _dot(r2, w2, DOT_BF16), w1, w2


@triton.jit
def _fm_fwd_kernel(x, cos, sin, w, out, N, T, stride_x, stride_cb, stride_ct, stride_wh,
                   D: tl.constexpr, D2: tl.constexpr, BD2: tl.constexpr, BD: tl.constexpr,
                   BN: tl.constexpr, ROPE: tl.constexpr, PM: tl.constexpr, DOT_BF16: tl.constexpr):
    """out rows are (1 + PM) * D wide per head: softmax(y), then (PM) softmax(-y)."""
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    rows = i_n.to(tl.int64) * BN + tl.arange(0, BN)
    c = tl.arange(0, BD2)
    e = tl.arange(0, BD)
    r1, r2, _, _, _, _ = _rotated(x, cos, sin, rows, c, N, T, stride_x, stride_cb, stride_ct, i_h,
                                  D, D2, ROPE)
    y, _, _ = _logits(r1, r2, w, i_h, stride_wh, c, e, D, D2, DOT_BF16)
    m = (rows < N)[:, None] & (e < D)[None, :]
    po = out + rows[:, None] * (stride_x * (1 + PM)) + i_h * (D * (1 + PM)) + e[None, :]
    tl.store(po, _softmax(y, e, D).to(out.dtype.element_ty), mask=m)
    if PM:
        tl.store(po + D, _softmax(-y, e, D).to(out.dtype.element_ty), mask=m)


@triton.jit
def _fm_bwd_kernel(x, cos, sin, w, dout, dx, rbuf, dybuf, N, T, stride_x, stride_cb, stride_ct,
                   stride_wh,
                   D: tl.constexpr, D2: tl.constexpr, BD2: tl.constexpr, BD: tl.constexpr,
                   BN: tl.constexpr, ROPE: tl.constexpr, PM: tl.constexpr, DW: tl.constexpr,
                   DOT_BF16: tl.constexpr):
    """Program (i_n, i_h) recomputes and differentiates a block of rows of head i_h.
    DW: it also stores rope(x) and dy = d(xW) to rbuf, dybuf, and the host computes
    dW_h = sum_rows rope(x)^T dy as one batched matmul (dW accumulated in the kernel instead
    made it spill and run slower).
    PM: dout has both halves; dy = d(xW) is the first half's softmax backward minus the
    second's (the second half is softmax(-y)), so everything after dy is shared."""
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    c = tl.arange(0, BD2)
    e = tl.arange(0, BD)
    rows = i_n.to(tl.int64) * BN + tl.arange(0, BN)
    r1, r2, c1, c2, s1, s2 = _rotated(x, cos, sin, rows, c, N, T, stride_x, stride_cb, stride_ct,
                                      i_h, D, D2, ROPE)
    y, w1, w2 = _logits(r1, r2, w, i_h, stride_wh, c, e, D, D2, DOT_BF16)
    m = (rows < N)[:, None] & (e < D)[None, :]
    pdo = dout + rows[:, None] * (stride_x * (1 + PM)) + i_h * (D * (1 + PM)) + e[None, :]
    p = _softmax(y, e, D)
    do = tl.load(pdo, mask=m, other=0.0).to(tl.float32)
    dy = p * (do - tl.sum(p * do, axis=1)[:, None])      # softmax backward; 0 on padding
    if PM:
        p = _softmax(-y, e, D)
        do = tl.load(pdo + D, mask=m, other=0.0).to(tl.float32)
        dy -= p * (do - tl.sum(p * do, axis=1)[:, None])
    mh = (rows < N)[:, None] & (c < D2)[None, :]
    if DW:
        pr = rbuf + rows[:, None] * stride_x + i_h * D + c[None, :]
        tl.store(pr, r1.to(rbuf.dtype.element_ty), mask=mh)
        tl.store(pr + D2, r2.to(rbuf.dtype.element_ty), mask=mh)
        tl.store(dybuf + rows[:, None] * stride_x + i_h * D + e[None, :],
                 dy.to(dybuf.dtype.element_ty), mask=m)
    dr1 = _dot(dy, tl.trans(w1), DOT_BF16)
    dr2 = _dot(dy, tl.trans(w2), DOT_BF16)
    if ROPE:  # the rotation's transpose
        dx1 = dr1 * c1 + dr2 * s2
        dx2 = dr2 * c2 - dr1 * s1
    else:
        dx1, dx2 = dr1, dr2
    pdx = dx + rows[:, None] * stride_x + i_h * D + c[None, :]
    tl.store(pdx, dx1.to(dx.dtype.element_ty), mask=mh)
    tl.store(pdx + D2, dx2.to(dx.dtype.element_ty), mask=mh)


def _launch_shape(D):
    D2 = D // 2
    return D2, max(16, next_pow2(D2)), max(16, next_pow2(D))


class _FusedFeatureMap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, w, need_dw, pm):
        B, T, H, D = x.shape
        N = B * T
        D2, BD2, BD = _launch_shape(D)
        rope = cos is not None
        if rope:
            cos, sin = (t.expand(B, T, D) for t in (cos, sin))
            if cos.stride(-1) != 1 or sin.stride() != cos.stride():
                cos, sin = cos.contiguous(), sin.contiguous()
            stride_cb, stride_ct = cos.stride(0), cos.stride(1)
        else:
            cos = sin = x
            stride_cb = stride_ct = 0
        out = new((B, T, H, D * (1 + pm)), x.dtype, x.device)
        BN = LAUNCH["BN"]
        _fm_fwd_kernel[(cdiv(N, BN), H)](
            x, cos, sin, w, out, N, T, H * D, stride_cb, stride_ct, w.stride(0),
            D=D, D2=D2, BD2=BD2, BD=BD, BN=BN, ROPE=rope, PM=pm, DOT_BF16=x.dtype == torch.bfloat16,
            num_warps=LAUNCH["warps"], num_stages=LAUNCH["stages"])
        ctx.save_for_backward(x, cos, sin, w)
        ctx.meta = (rope, stride_cb, stride_ct, need_dw, pm)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, cos, sin, w = ctx.saved_tensors
        rope, stride_cb, stride_ct, need_dw, pm = ctx.meta
        B, T, H, D = x.shape
        N = B * T
        D2, BD2, BD = _launch_shape(D)
        dout = dout.contiguous()
        BN = LAUNCH["BN"]
        dx = new(x.shape, x.dtype, x.device)
        rbuf, dybuf = (new(x.shape, x.dtype, x.device) for _ in range(2)) if need_dw else (x, x)
        _fm_bwd_kernel[(cdiv(N, BN), H)](
            x, cos, sin, w, dout, dx, rbuf, dybuf, N, T, H * D, stride_cb, stride_ct, w.stride(0),
            D=D, D2=D2, BD2=BD2, BD=BD, BN=BN, ROPE=rope, PM=pm, DW=need_dw,
            DOT_BF16=x.dtype == torch.bfloat16, num_warps=LAUNCH["warps"], num_stages=LAUNCH["stages"])
        dw = None
        if need_dw:  # [H, D, N] @ [H, N, D], float32 accumulation inside the matmul
            dw = torch.bmm(rbuf.view(N, H, D).permute(1, 2, 0), dybuf.view(N, H, D).transpose(0, 1))
            dw = dw.float()
        return dx, None, None, dw, None, None


def fused_feature_map(x, cos=None, sin=None, weight=None, pm=False):
    """softmax(rope(x) W_h) over the last dimension: x [B, T, H, D]; cos, sin [B or 1, T, D]
    or None (no rotation); weight [H, D, D] (float32, differentiable) or None (identity: the
    plain softmax map). Returns [B, T, H, D] in x's dtype; with pm=True [B, T, H, 2D]:
    [softmax(rope(x) W_h), softmax(-rope(x) W_h)]."""
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ValueError(f"fused_feature_map wants x [B, T, H, D] with D even, got {tuple(x.shape)}")
    B, T, H, D = x.shape
    if (cos is None) != (sin is None):
        raise ValueError("fused_feature_map: give both cos and sin, or neither")
    if cos is not None and (cos.shape[-2:] != (T, D) or cos.dim() != 3 or cos.shape[0] not in (1, B)):
        raise ValueError(f"fused_feature_map: cos/sin must be [B or 1, T, D] = [{B}, {T}, {D}], "
                         f"got {tuple(cos.shape)}")
    need_dw = weight is not None and weight.requires_grad
    if weight is None:
        w = torch.eye(D, device=x.device, dtype=torch.float32)[None]
        w = w.expand(H, D, D)  # stride 0 over heads: one identity for all
    else:
        if weight.shape != (H, D, D):
            raise ValueError(f"fused_feature_map: weight must be [H, D, D] = [{H}, {D}, {D}], "
                             f"got {tuple(weight.shape)}")
        w = weight.float()
    if w.stride(-1) != 1 or w.stride(-2) != D:
        w = w.contiguous()
    return _FusedFeatureMap.apply(x.contiguous(), cos, sin, w, need_dw, bool(pm))
