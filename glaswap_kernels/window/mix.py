"""The hybrid layer's mix of its two attention parts as one Triton kernel each way.

A hybrid layer has, per query row and head, the exact window's normalised output o_win with
its log-normaliser lse, and the GLA state's numerator and denominator o_lin = [num, den]
(chunk_gla with normalizer=True). Its output (reference.window_mix_torch, the reference)
is

    share = sigmoid(c + log den - lse)    shared: one normaliser over e^lse and e^c den
          = sigmoid(c)                    learned: a per-head mix
          = 0 where den == 0              (nothing in the state yet)
    o = o_win + share * (num / (den + eps) - o_win)

with c one logit per head. In PyTorch that is about ten passes over [tokens, H, D] float32
tensors forward and twenty backward; here it is one read of o_win and o_lin forward, and one
read of those and the incoming gradient backward, which writes d o_win, d o_lin (with the
row padding fused_chunk_gla's backward reads without a copy), d lse and a per-row dz that
the host sums per head for dc:

    d o_win = do (1 - share)             d num = do share / (den + eps)
    d share = sum_d do (o_state - o_win) dz = d share * share (1 - share)
    d den   = -share / (den + eps) * sum_d do o_state  (+ dz / den when shared)
    d lse   = -dz (shared)                d c   = sum over rows of dz
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

from ..utils import cdiv, new, next_pow2, row_stride, state_stride  # new: NaN under POISON

_ROWS = 32


@triton.jit
def _mix_load(o_win, lse, o_lin, logit, rows, cols, n_rows, eps, H: tl.constexpr, D: tl.constexpr,
              RS: tl.constexpr, SHARED: tl.constexpr):
    """The rows' o_win, num [BR, BD], den, share, 1 / (den + eps) [BR] in float32."""
    live = rows < n_rows
    m = live[:, None] & (cols < D)[None, :]
    ow = tl.load(o_win + rows[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
    num = tl.load(o_lin + rows[:, None] * RS + cols[None, :], mask=m, other=0.0).to(tl.float32)
    den = tl.load(o_lin + rows * RS + D, mask=live, other=0.0).to(tl.float32)
    c = tl.load(logit + rows % H, mask=live, other=0.0).to(tl.float32)
    if SHARED:
        z = c + tl.log(tl.maximum(den, 1e-30)) - tl.load(lse + rows, mask=live, other=0.0)
    else:
        z = c
    share = tl.where(den > 0, tl.sigmoid(z), 0.0)
    inv = 1.0 / (den + eps)
    return ow, num, den, share, inv, m


@triton.jit
def _mix_fwd_kernel(o_win, lse, o_lin, logit, out, n_rows, eps, H: tl.constexpr, D: tl.constexpr,
                    RS: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, SHARED: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    ow, num, den, share, inv, m = _mix_load(o_win, lse, o_lin, logit, rows, cols, n_rows, eps, H, D, RS,
                                            SHARED)
    o = ow + share[:, None] * (num * inv[:, None] - ow)
    tl.store(out + rows[:, None] * D + cols[None, :], o.to(out.dtype.element_ty), mask=m)


@triton.jit
def _mix_bwd_kernel(o_win, lse, o_lin, logit, do, d_win, d_lse, d_lin, dz_rows, n_rows, eps,
                    H: tl.constexpr, D: tl.constexpr, RS: tl.constexpr, RD: tl.constexpr, BD: tl.constexpr,
                    BR: tl.constexpr, SHARED: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    live = rows < n_rows
    ow, num, den, share, inv, m = _mix_load(o_win, lse, o_lin, logit, rows, cols, n_rows, eps, H, D, RS,
                                            SHARED)
    dy = tl.load(do + rows[:, None] * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
    o_state = num * inv[:, None]
    dz = tl.sum(dy * (o_state - ow), axis=1) * share * (1.0 - share)
    dden = -share * inv * tl.sum(dy * o_state, axis=1)
    if SHARED:
        dden += tl.where(den > 1e-30, dz / tl.maximum(den, 1e-30), 0.0)
        tl.store(d_lse + rows, -dz, mask=live)
    tl.store(d_win + rows[:, None] * D + cols[None, :], (dy * (1.0 - share)[:, None]).to(d_win.dtype.element_ty),
             mask=m)
    tl.store(d_lin + rows[:, None] * RD + cols[None, :], (dy * (share * inv)[:, None]).to(d_lin.dtype.element_ty),
             mask=m)
    tl.store(d_lin + rows * RD + D, dden.to(d_lin.dtype.element_ty), mask=live)
    tl.store(dz_rows + rows, dz, mask=live)


class _WindowMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o_win, lse, o_lin, logit, shared, eps):
        H, D = o_win.shape[-2:]
        o_win, lse, logit = o_win.contiguous(), lse.contiguous(), logit.float().contiguous()
        rs = row_stride(o_lin)                   # fused_chunk_gla's o: rows padded to 8 values
        if rs is None:
            o_lin, rs = o_lin.contiguous(), D + 1
        rows = o_win.numel() // D
        out = new(o_win.shape, o_win.dtype, o_win.device)
        BD = max(16, next_pow2(D))
        _mix_fwd_kernel[(cdiv(rows, _ROWS),)](o_win, lse, o_lin, logit, out, rows, eps, H=H, D=D, RS=rs, BD=BD,
                                              BR=_ROWS, SHARED=shared, num_warps=4)
        ctx.save_for_backward(o_win, lse, o_lin, logit)
        ctx.shared, ctx.eps, ctx.rs = shared, eps, rs
        return out

    @staticmethod
    def backward(ctx, dout):
        o_win, lse, o_lin, logit = ctx.saved_tensors
        H, D = o_win.shape[-2:]
        rows = o_win.numel() // D
        dev = o_win.device
        d_win = new(o_win.shape, o_win.dtype, dev)
        d_lse = new(lse.shape, torch.float32, dev) if ctx.shared else None
        # d o_lin in the rows fused_chunk_gla pads its o to, so its backward reads it as is
        rd = state_stride(D, True)
        d_lin = new(o_lin.shape[:-1] + (rd,), o_lin.dtype, dev)[..., :D + 1]
        dz = new((rows,), torch.float32, dev)
        BD = max(16, next_pow2(D))
        _mix_bwd_kernel[(cdiv(rows, _ROWS),)](o_win, lse, o_lin, logit, dout.contiguous(), d_win,
                                              d_lse if ctx.shared else dz, d_lin, dz, rows, ctx.eps, H=H, D=D,
                                              RS=ctx.rs, RD=rd, BD=BD, BR=_ROWS, SHARED=ctx.shared,
                                              num_warps=4)
        d_logit = dz.view(-1, H).sum(0)
        return d_win, d_lse, d_lin, d_logit, None, None


def fused_window_mix(o_win, lse, o_lin, logit, shared=True, eps=1e-6):
    """o_win [..., H, D], lse [..., H] float32, o_lin [..., H, D + 1], logit [H] -> the hybrid
    output [..., H, D] in o_win's dtype (see the module docstring), float32 maths."""
    return _WindowMix.apply(o_win, lse, o_lin, logit, bool(shared), float(eps))
