"""The GLA gate's activation as one Triton kernel each way.

The layer turns gate logits x [..., D] into per-step log-decays

    g = logsigmoid(x) / n - s        (n = gate_normalizer > 0, s >= 0; g <= -s)

and, for the hedgehog_pm feature map, repeats them along the last dimension (both halves of
the feature share their head dimension's decay). In PyTorch that is a cast, logsigmoid, a
division, a cast back and a cat forward, and about as many passes backward, each over an
activation-sized tensor. Here it is one pass forward (read D columns, write repeat * D) and
one backward (read x and the repeat * D incoming gradient columns, write D):

    logsigmoid(x) = min(x, 0) - log1p(exp(-|x|))      (no overflow for any x)
    d x = (sum over the repeats of d g) * sigmoid(-x) / n

all in float32, stored in x's dtype.
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

from .utils import cdiv, new, next_pow2  # new: NaN-filled under POISON

_ROWS = 64
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _load_x(x, rows, cols, n_rows, D: tl.constexpr):
    """x [rows, BD] in float32, e = exp(-|x|) in (0, 1], and the mask."""
    m = (rows < n_rows)[:, None] & (cols < D)[None, :]
    xf = tl.load(x + rows[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
    return xf, tl.exp(-tl.abs(xf)), m


@triton.jit
def _gate_fwd_kernel(x, y, n_rows, n, s, D: tl.constexpr, R: tl.constexpr, BD: tl.constexpr,
                     BR: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    xf, e, m = _load_x(x, rows, cols, n_rows, D)
    # log1p(e) without libdevice: log(u) * e / (u - 1) with u = 1 + e corrects the rounding
    # of u (Goldberg); where u rounds to 1, log1p(e) = e to float32 precision. It is >= 0,
    # so g is never positive, and -0-ish (not above 0) for large positive x.
    u = 1.0 + e
    l1p = tl.where(u == 1.0, e, tl.log(u) * e / tl.where(u == 1.0, 1.0, u - 1.0))
    g = ((tl.minimum(xf, 0.0) - l1p) / n - s).to(y.dtype.element_ty)
    for r in tl.static_range(R):  # hedgehog_pm: the same decays in each half
        tl.store(y + rows[:, None] * (R * D) + r * D + cols[None, :], g, mask=m)


@triton.jit
def _gate_bwd_kernel(x, dy, dx, n_rows, n, D: tl.constexpr, R: tl.constexpr, BD: tl.constexpr,
                     BR: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    xf, e, m = _load_x(x, rows, cols, n_rows, D)
    dg = tl.zeros((BR, BD), dtype=tl.float32)
    for r in tl.static_range(R):
        dg += tl.load(dy + rows[:, None] * (R * D) + r * D + cols[None, :], mask=m,
                      other=0.0).to(tl.float32)
    # sigmoid(-x) from e = exp(-|x|) <= 1: no exp(+|x|) to overflow at x = 1e4.
    sig = tl.where(xf >= 0, e, 1.0) / (1.0 + e)
    tl.store(dx + rows[:, None] * D + cols[None, :], (dg * sig / n).to(dx.dtype.element_ty),
             mask=m)


def _launch(kernel, x, *bufs, scalars, R):
    D = x.shape[-1]
    rows = x.numel() // D
    if rows:  # an empty grid is not launched
        kernel[(cdiv(rows, _ROWS),)](x, *bufs, rows, *scalars, D=D, R=R, BD=max(16, next_pow2(D)),
                                     BR=_ROWS, num_warps=4)


class _Gate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n, s, R):
        y = new(x.shape[:-1] + (R * x.shape[-1],), x.dtype, x.device)
        _launch(_gate_fwd_kernel, x, y, scalars=(n, s), R=R)
        ctx.save_for_backward(x)
        ctx.n, ctx.R = n, R
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dx = new(x.shape, x.dtype, x.device)
        _launch(_gate_bwd_kernel, x, dy.contiguous(), dx, scalars=(ctx.n,), R=ctx.R)
        return dx, None, None, None


def fused_gate(x, normalizer, repeat=1, shift=0.0):
    """x [..., D] gate logits -> logsigmoid(x) / normalizer - shift, [..., repeat * D] in x's
    dtype (repeat = 2 writes it twice along the last dimension), computed in float32."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _DTYPES or x.ndim < 1 or x.shape[-1] < 1:
        raise ValueError(f"fused_gate wants a float32/float16/bfloat16 tensor [..., D] with D >= 1, "
                         f"got {getattr(x, 'dtype', type(x))} {tuple(getattr(x, 'shape', ()))}")
    if not float(normalizer) > 0:  # also refuses NaN
        raise ValueError(f"fused_gate wants normalizer > 0, got {normalizer}")
    if not float(shift) >= 0:
        raise ValueError(f"fused_gate wants shift >= 0, got {shift}")
    if repeat not in (1, 2):
        raise ValueError(f"fused_gate wants repeat 1 or 2, got {repeat!r}")
    return _Gate.apply(x.contiguous(), float(normalizer), float(shift), int(repeat))
