"""RoPE as one Triton kernel each way: the hybrid layer's exact window part rotates q and k
as the teacher does (gla.reference.apply_rope, the reference).

    rope(x) = x cos + rotate_half(x) sin,   rotate_half([x1, x2]) = [-x2, x1]

per head of x [B, T, heads, D], with cos, sin [B or 1, T, D]. In PyTorch that is a cat and
four elementwise passes each way over x; here one read and one write. The backward is the
transpose of the same rotation:

    dx1 = cos1 dy1 + sin2 dy2,   dx2 = cos2 dy2 - sin1 dy1

One program per token rotates every head of it, so cos and sin are read once per token.
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

from .utils import new, next_pow2  # new: NaN under POISON


@triton.jit
def _rope_kernel(x, cos, sin, y, T, stride_cb, stride_ct, H: tl.constexpr, D: tl.constexpr,
                 HALF: tl.constexpr, BH: tl.constexpr, BHALF: tl.constexpr, BWD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                     # token b * T + t
    b, t = row // T, row % T
    heads = tl.arange(0, BH)[:, None]
    cols = tl.arange(0, BHALF)[None, :]
    m = (heads < H) & (cols < HALF)
    base = row * (H * D) + heads * D + cols
    x1 = tl.load(x + base, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x + base + HALF, mask=m, other=0.0).to(tl.float32)
    cs = b * stride_cb + t * stride_ct + cols
    cm = cols < HALF
    c1 = tl.load(cos + cs, mask=cm, other=0.0).to(tl.float32)
    c2 = tl.load(cos + cs + HALF, mask=cm, other=0.0).to(tl.float32)
    s1 = tl.load(sin + cs, mask=cm, other=0.0).to(tl.float32)
    s2 = tl.load(sin + cs + HALF, mask=cm, other=0.0).to(tl.float32)
    if BWD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(y + base, y1.to(y.dtype.element_ty), mask=m)
    tl.store(y + base + HALF, y2.to(y.dtype.element_ty), mask=m)


def _launch(x, cos, sin, bwd):
    B, T, H, D = x.shape
    y = new(x.shape, x.dtype, x.device)
    _rope_kernel[(B * T,)](x, cos, sin, y, T, cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1),
                           H=H, D=D, HALF=D // 2, BH=next_pow2(H), BHALF=max(16, next_pow2(D // 2)), BWD=bwd,
                           num_warps=4 if H * D <= 4096 else 8)
    return y


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _launch(dy.contiguous(), cos, sin, True), None, None


def fused_rope(x, cos, sin):
    """rope(x) for x [B, T, heads, D] (D even) and cos, sin [B or 1, T, D], in x's dtype
    (float32 maths); differentiable in x."""
    B, T, H, D = x.shape
    if D % 2 or cos.shape != sin.shape or cos.dim() != 3 or cos.shape[1:] != (T, D) or cos.shape[0] not in (1, B):
        raise ValueError(f"rope wants x [B, T, heads, D] with D even and cos, sin [B or 1, T, D]; got "
                         f"{tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    cos, sin = cos.contiguous(), sin.contiguous()
    return _Rope.apply(x.contiguous(), cos, sin)
