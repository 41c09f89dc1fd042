"""Stage 2's vocabulary loss from hidden states: cuBLAS for the head, one Triton kernel per
chunk of logits for everything else.

The loss of N tokens, with student logits s = h_s W^T and teacher logits t = h_t W^T
(bf16 [chunk, V] each, V up to 128K), temperature T and weight c:

    total = sum_rows T^2 KL(softmax(t / T) || softmax(s / T)) + c * sum_labelled CE(s, label)

Its gradient with respect to s is known in closed form,

    d total / d s = T (softmax(s / T) - softmax(t / T)) + c (softmax(s) - onehot(label)),

so the forward computes it chunk by chunk and takes d h_s = (d s) W at once: the logits
are made once, never in float32 and never kept, and the head's own gradient (frozen in
every glaswap recipe) is computed only when the head trains. The kernel reads one row of
s and t twice: a first pass for the row's log-sum-exps (online, in log2 units) and the KL,
a second that writes d s over s in place. The backward scales the kept d h_s by the
incoming gradient.

`fused_kd_loss` is the checked entry point; glaswap.distill.losses is its caller and keeps
the pure-PyTorch form (`_torch_kd`) that the tests hold this against.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from .utils import new

_LOG2E = 1.4426950408889634
_BLOCK = 4096      # columns of a row per step; V = 128256 takes 32 steps a pass


@triton.jit
def _kd_rows_kernel(S, TL, labels, kl_out, ce_out, V, stride, scale2, T, ce_weight,
                    HAS_CE: tl.constexpr, SAME_T: tl.constexpr, BLOCK: tl.constexpr):
    """One row of logits per program. S: the student's logits, overwritten with d total / d s;
    TL: the teacher's. kl_out: T^2 KL of the row; ce_out: its cross-entropy (0 unlabelled)."""
    row = tl.program_id(0).to(tl.int64)
    s_row = S + row * stride
    t_row = TL + row * stride
    cols = tl.arange(0, BLOCK)
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    m_s = tl.full([], float("-inf"), tl.float32)   # log2-sum-exp of s / T: running max ...
    l_s = tl.full([], 0.0, tl.float32)             # ... and sum of 2^(s2 - max)
    m_t = tl.full([], float("-inf"), tl.float32)   # the same for t / T
    l_t = tl.full([], 0.0, tl.float32)
    m_r = tl.full([], float("-inf"), tl.float32)   # ... and for s itself (the cross-entropy's, T != 1)
    l_r = tl.full([], 0.0, tl.float32)
    acc = tl.full([], 0.0, tl.float32)             # sum 2^(t2 - m_t) (t2 - s2), rescaled with m_t
    for v0 in range(0, V, BLOCK):
        mask = v0 + cols < V
        s = tl.load(s_row + v0 + cols, mask=mask, other=0.0).to(tl.float32)
        t = tl.load(t_row + v0 + cols, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.where(mask, s * scale2, float("-inf"))
        t2 = tl.where(mask, t * scale2, float("-inf"))
        new_s = tl.maximum(m_s, tl.max(s2, axis=0))
        l_s = l_s * tl.exp2(m_s - new_s) + tl.sum(tl.exp2(s2 - new_s), axis=0)
        m_s = new_s
        new_t = tl.maximum(m_t, tl.max(t2, axis=0))
        e_t = tl.exp2(t2 - new_t)
        rescale = tl.exp2(m_t - new_t)
        l_t = l_t * rescale + tl.sum(e_t, axis=0)
        acc = acc * rescale + tl.sum(e_t * ((t - s) * scale2), axis=0)   # masked: e_t = 0, t - s = 0
        m_t = new_t
        if HAS_CE and not SAME_T:
            r2 = tl.where(mask, s * LOG2E, float("-inf"))
            new_r = tl.maximum(m_r, tl.max(r2, axis=0))
            l_r = l_r * tl.exp2(m_r - new_r) + tl.sum(tl.exp2(r2 - new_r), axis=0)
            m_r = new_r
    lse_s = m_s + tl.log2(l_s)
    lse_t = m_t + tl.log2(l_t)
    # KL in nats: sum p_t (log p_t - log p_s) = ln2 (acc / l_t - lse_t + lse_s), times T^2
    tl.store(kl_out + row, LN2 * (acc / l_t - lse_t + lse_s) * T * T)
    label = tl.load(labels + row).to(tl.int64)
    if HAS_CE:
        if SAME_T:
            lse_r = lse_s
        else:
            lse_r = m_r + tl.log2(l_r)
        s_label = tl.load(s_row + label, mask=label >= 0, other=0.0).to(tl.float32)
        tl.store(ce_out + row, tl.where(label >= 0, LN2 * lse_r - s_label, 0.0))
    for v0 in range(0, V, BLOCK):
        mask = v0 + cols < V
        s = tl.load(s_row + v0 + cols, mask=mask, other=0.0).to(tl.float32)
        t = tl.load(t_row + v0 + cols, mask=mask, other=0.0).to(tl.float32)
        p_s = tl.exp2(s * scale2 - lse_s)
        g = T * (p_s - tl.exp2(t * scale2 - lse_t))
        if HAS_CE:
            if SAME_T:
                p = p_s
            else:
                p = tl.exp2(s * LOG2E - lse_r)
            hard = ce_weight * (p - tl.where(v0 + cols == label, 1.0, 0.0))
            g += tl.where(label >= 0, hard, 0.0)
        tl.store(s_row + v0 + cols, g.to(S.dtype.element_ty), mask=mask)


class _FusedKD(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_s, h_t, weight, labels, ce_weight, temperature, chunk_tokens):
        n, V = h_s.shape[0], weight.shape[0]
        dev = h_s.device.type
        # the logits' dtype: autocast's where it is on (as for any matmul under it), else the inputs'
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h_s.dtype
        ctx.dtypes = h_s.dtype, weight.dtype
        with torch.autocast(dev, enabled=False):
            h_s = h_s.to(dtype)
            w = weight.to(dtype)
            h_t = h_t.to(dtype)
            grad_h = new(h_s.shape, dtype, h_s.device)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
                if ctx.needs_input_grad[2] else None
            kl = new((n,), torch.float32, h_s.device)
            ce = new((n,), torch.float32, h_s.device) if ce_weight else kl[:1]    # unused without CE
            c = min(chunk_tokens, n)
            buf_s = torch.empty(c, V, dtype=dtype, device=h_s.device)
            buf_t = torch.empty(c, V, dtype=dtype, device=h_s.device)
            labels = labels.contiguous()
            for start in range(0, n, c):
                end = min(n, start + c)
                s = torch.mm(h_s[start:end], w.t(), out=buf_s[:end - start])
                t = torch.mm(h_t[start:end], w.t(), out=buf_t[:end - start])
                _kd_rows_kernel[(end - start,)](
                    s, t, labels[start:end], kl[start:], ce[start:] if ce_weight else ce, V, s.stride(0),
                    _LOG2E / temperature, float(temperature), float(ce_weight),
                    HAS_CE=bool(ce_weight), SAME_T=temperature == 1.0, BLOCK=_BLOCK, num_warps=8)
                torch.mm(s, w, out=grad_h[start:end])            # s now holds d total / d s
                if grad_w is not None:
                    grad_w += (s.t() @ h_s[start:end]).float()
        ctx.save_for_backward(grad_h, grad_w)
        kl_sum = kl.sum()
        ce_sum = ce.sum() if ce_weight else torch.zeros_like(kl_sum)
        total = kl_sum + ce_weight * ce_sum
        ctx.mark_non_differentiable(kl_sum, ce_sum)
        return total, kl_sum, ce_sum

    @staticmethod
    def backward(ctx, d_total, _d_kl, _d_ce):
        grad_h, grad_w = ctx.saved_tensors
        dh = (grad_h * d_total.to(grad_h.dtype)).to(ctx.dtypes[0])
        dw = (grad_w * d_total).to(ctx.dtypes[1]) if grad_w is not None else None
        return dh, None, dw, None, None, None, None


def fused_kd_loss(h_student, h_teacher, weight, labels, ce_weight=0.0, temperature=1.0, chunk_tokens=4096):
    """(total, kl_sum, ce_sum) summed over the N tokens: total = T^2 KL(teacher || student)
    over every token + ce_weight x cross-entropy over tokens whose label is not -100; only
    total carries gradients (to h_student, and to weight when it requires them).

    h_student, h_teacher: [N, d] in the compute dtype (bf16 on the GPU); weight: [V, d];
    labels: [N] int64. Logits are computed chunk_tokens rows at a time."""
    if h_student.dim() != 2 or h_teacher.shape != h_student.shape:
        raise ValueError(f"hidden states must both be [N, d]; got {tuple(h_student.shape)} and "
                         f"{tuple(h_teacher.shape)}")
    if weight.dim() != 2 or weight.shape[1] != h_student.shape[1]:
        raise ValueError(f"the head must be [V, {h_student.shape[1]}]; got {tuple(weight.shape)}")
    if labels.shape != (h_student.shape[0],):
        raise ValueError(f"labels must be [{h_student.shape[0]}]; got {tuple(labels.shape)}")
    if temperature <= 0 or chunk_tokens < 1:
        raise ValueError("temperature must be > 0 and chunk_tokens >= 1")
    return _FusedKD.apply(h_student.contiguous(), h_teacher.contiguous(), weight, labels, float(ce_weight),
                            float(temperature), int(chunk_tokens))
