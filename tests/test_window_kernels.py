"""Sliding-window + sink softmax attention: the PyTorch reference against a direct masked
softmax and plain causal attention, and the Triton kernels against the reference.

Without a GPU the kernels run under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 and fixes its bf16 arithmetic), so shapes stay tiny: odd T, T = 1,
T < window, window = 1, sinks 0 and 4 (and more sinks than one sink tile), head dims 48
and 80, GQA, packed documents shorter than the window and of one token, fp32, fp16 and
bf16. Every comparison is a relative RMS error of o, lse and dq, dk, dv of
loss = (o * do).sum() + (lse * dlse).sum(); every buffer the kernels fill starts as NaN.
The `gpu` tests repeat the checks at real sizes in bf16 (`pytest -m gpu`).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from gla_helpers import (DEVICE, gpu_only, interpreter_warnings, needs_kernels,  # noqa: F401
                         poison_outputs, rel)
from glaswap_kernels import ops
from glaswap_kernels.window.reference import window_attention_torch
from glaswap_kernels.window.triton import fused_window_attention

pytestmark = interpreter_warnings
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _cu(seqs, device="cpu"):
    bounds = [0]
    for n in seqs:
        bounds.append(bounds[-1] + n)
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def make_inputs(B, T, H, Hkv, D, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, T, h, D, generator=gen) for h in (H, Hkv, Hkv, H))
    dlse = torch.randn(B, T, H, generator=gen)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, do)] + [dlse.to(device)]


def direct(q, k, v, window, sinks, scale, seqs, q_sink=None, k_sink=None):
    """Token by token: the allowed keys of each query listed explicitly, float64; a sink
    outside the window is scored with q_sink and k_sink when given."""
    B, T, H, D = q.shape
    group = H // k.shape[2]
    o = torch.zeros(B, T, H, D, dtype=torch.float64)
    lse = torch.zeros(B, T, H, dtype=torch.float64)
    docs = [(b, 0, T) for b in range(B)] if seqs is None else \
        [(0, s, s + n) for s, n in zip(_cu(seqs).tolist(), seqs)]
    for b, start, end in docs:
        for i in range(end - start):
            keys = sorted(set(range(max(0, i - window + 1), i + 1)) | set(range(min(sinks, i + 1))))
            for h in range(H):
                kk = k[b, [start + j for j in keys], h // group].double()
                vv = v[b, [start + j for j in keys], h // group].double()
                s = scale * kk @ q[b, start + i, h].double()
                if q_sink is not None:
                    for n_key, j in enumerate(keys):
                        if j <= i - window:          # a sink the window does not cover
                            s[n_key] = scale * k_sink[b, start + j, h // group].double() @ \
                                q_sink[b, start + i, h].double()
                lse[b, start + i, h] = torch.logsumexp(s, 0)
                o[b, start + i, h] = torch.softmax(s, 0) @ vv
    return o, lse


# ----------------------------------------------------------------------------- the reference

@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("T,window,sinks,seqs", [(13, 4, 0, None), (13, 4, 3, None), (9, 1, 2, None),
                                                 (17, 3, 2, [5, 1, 11]), (6, 10, 8, None)])
@pytest.mark.parametrize("block", [256, 4])
def test_reference_matches_direct_softmax(T, window, sinks, seqs, split, block):
    B = 1 if seqs else 2
    q, k, v, *_ = make_inputs(B, T, 4, 2, 8)
    sink = make_inputs(B, T, 4, 2, 8, seed=5)[:2] if split else (None, None)
    cu = _cu(seqs) if seqs else None
    o, lse = window_attention_torch(q, k, v, window, sinks, scale=0.7, cu_seqlens=cu, q_sink=sink[0], k_sink=sink[1],
                                    block=block)
    o_d, lse_d = direct(q, k, v, window, sinks, 0.7, seqs, *sink)
    assert rel(o, o_d) < 1e-6 and rel(lse, lse_d) < 1e-6
    if split and sinks and window < T:       # the sink part's scores come from q_sink, k_sink
        assert rel(o, window_attention_torch(q, k, v, window, sinks, scale=0.7, cu_seqlens=cu)[0]) > 1e-3


@pytest.mark.parametrize("window", [24, 100])
def test_reference_full_window_is_causal_attention(window):
    # window >= T, no sinks: plain causal softmax attention (GQA through repeated kv heads)
    q, k, v, *_ = make_inputs(2, 24, 4, 2, 16)
    o, lse = window_attention_torch(q, k, v, window)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.repeat_interleave(2, 2).transpose(1, 2),
                                         v.repeat_interleave(2, 2).transpose(1, 2), is_causal=True)
    assert rel(o, ref.transpose(1, 2)) < 1e-6
    s = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(2, 2)) / 4.0
    s = s.masked_fill(~torch.ones(24, 24, dtype=torch.bool).tril(), float("-inf"))
    assert rel(lse, torch.logsumexp(s, -1).transpose(1, 2)) < 1e-6


def test_reference_window_one_is_the_value_itself():
    q, k, v, *_ = make_inputs(1, 11, 2, 2, 8)
    o, lse = window_attention_torch(q, k, v, 1, scale=0.5)
    assert rel(o, v) < 1e-6
    assert rel(lse, 0.5 * (q * k).sum(-1)) < 1e-6


# ----------------------------------------------------------------------------- the kernels

def compare(B, T, H, Hkv, D, window, sinks, seqs=None, dtype=torch.float32, tiles=None,
            grads=("o", "lse"), tol=None, scale=None, device=DEVICE, split=False):
    """Kernels vs the float32 reference on the same (rounded) inputs; returns the errors.
    split: the sink part scored with its own q_sink and k_sink (their gradients checked too)."""
    q, k, v, do, dlse = make_inputs(B, T, H, Hkv, D, dtype, device)
    ins = (q, k, v) + (tuple(make_inputs(B, T, H, Hkv, D, dtype, device, seed=5)[:2]) if split else ())
    cu = _cu(seqs, device) if seqs else None
    xs = [x.clone().requires_grad_() for x in ins]
    rs = [x.float().requires_grad_() for x in ins]
    sk = lambda t: dict(q_sink=t[3], k_sink=t[4]) if split else {}  # noqa: E731
    o, lse = fused_window_attention(*xs[:3], window, sinks, scale=scale, cu_seqlens=cu, _overrides=tiles, **sk(xs))
    o_r, lse_r = window_attention_torch(*rs[:3], window, sinks, scale=scale, cu_seqlens=cu, **sk(rs))
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert o.shape == (B, T, H, D) and lse.shape == (B, T, H)
    errs = {"o": rel(o, o_r), "lse": rel(lse, lse_r)}
    outs = [(o, do), (lse, dlse)] if grads == ("o", "lse") else \
        [(o, do)] if grads == ("o",) else [(lse, dlse)]
    refs = [(o_r, do.float()), (lse_r, dlse)] if grads == ("o", "lse") else \
        [(o_r, do.float())] if grads == ("o",) else [(lse_r, dlse)]
    got = torch.autograd.grad([x for x, _ in outs], xs, [g for _, g in outs])
    # lse alone does not depend on v: its reference gradient is None, the kernels' zeros
    want = torch.autograd.grad([x for x, _ in refs], rs, [g for _, g in refs], allow_unused=True)
    for name, a, b in zip(("dq", "dk", "dv", "dq_sink", "dk_sink"), got, want):
        assert a.dtype == dtype
        if b is None:
            assert not a.any(), name
            continue
        errs[name] = rel(a, b)
    tol = TOL[dtype] if tol is None else tol
    # lse comes from fp32-accumulated products of the same rounded q and k in every dtype
    bad = {n: e for n, e in errs.items() if not e <= (min(tol, 1e-4) if n == "lse" else tol)}
    # (not e <= tol: NaN fails too)
    assert not bad, f"errors above {tol}: {bad} (all: {errs})"
    return errs


@needs_kernels
@pytest.mark.parametrize("T", [1, 37, 130])
def test_lengths(T):
    compare(B=2, T=T, H=2, Hkv=1, D=32, window=8, sinks=4)


@needs_kernels
@pytest.mark.parametrize("window,sinks", [(1, 0), (1, 4), (5, 0), (5, 4), (64, 4)])
def test_windows_and_sinks(window, sinks):
    # window 64 > T = 37: everything before the query is in the window (sinks change nothing)
    compare(B=1, T=37, H=2, Hkv=1, D=32, window=window, sinks=sinks)


@needs_kernels
@pytest.mark.parametrize("T,seqs", [(45, None), (70, [9, 1, 40, 20])])
def test_every_older_key_a_sink(T, seqs):
    # a softmax layer's distance cap: sinks = T, so each key W or more back takes the split
    # scores (full causal attention in two regions, many sink tiles per query block)
    compare(B=1 if seqs else 2, T=T, H=4, Hkv=2, D=48, window=7, sinks=T, seqs=seqs, split=True,
            tiles=dict(BM=16, BN=16, BS=16))


@needs_kernels
@pytest.mark.parametrize("T,seqs,tiles", [(1, None, None), (37, None, None), (130, None, None),
                                          (60, [5, 1, 37, 6, 1, 10], dict(BM=16, BN=16))])
def test_split_sinks(T, seqs, tiles):
    # the sink part from q_sink and k_sink: dq and dk take the window part only, dq_sink all
    # of the sink part, dk_sink each document's first S rows and zero elsewhere
    compare(B=1 if seqs else 2, T=T, H=4, Hkv=2, D=32, window=6, sinks=4, seqs=seqs, tiles=tiles, split=True)


@needs_kernels
def test_split_sinks_bf16_and_gqa_tiles():
    compare(B=1, T=60, H=4, Hkv=2, D=16, window=5, sinks=20, tiles=dict(BM=16, BN=16, BS=16), split=True)
    compare(B=2, T=130, H=4, Hkv=2, D=80, window=64, sinks=4, dtype=torch.bfloat16, split=True)


@needs_kernels
@pytest.mark.parametrize("D", [48, 80])
def test_head_dims(D):
    compare(B=1, T=37, H=2, Hkv=2, D=D, window=6, sinks=4)


@needs_kernels
def test_gqa_small_tiles():
    # tiles of 16: the window spans several key blocks, dk/dv programs walk several query
    # blocks for each of the group's heads, and 20 sinks fill two sink tiles
    compare(B=1, T=70, H=4, Hkv=2, D=32, window=20, sinks=4, tiles=dict(BM=16, BN=16))
    compare(B=1, T=60, H=4, Hkv=2, D=16, window=5, sinks=20, tiles=dict(BM=16, BN=16, BS=16))


@needs_kernels
@pytest.mark.parametrize("sinks", [0, 4])
def test_varlen(sinks):
    # documents shorter than the window, one of a single token, one spanning several tiles
    compare(B=1, T=60, H=4, Hkv=2, D=32, window=8, sinks=sinks, seqs=[5, 1, 37, 6, 1, 10],
            tiles=dict(BM=16, BN=16))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes(dtype):
    compare(B=1, T=45, H=4, Hkv=2, D=48, window=7, sinks=4, seqs=[20, 1, 24], dtype=dtype,
            tiles=dict(BM=16, BN=16))


@needs_kernels
def test_bf16_default_tiles():
    # the launch plan's own tiles (64) at a padded head dim, GQA, a window of a whole tile
    compare(B=2, T=130, H=4, Hkv=2, D=80, window=64, sinks=4, dtype=torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("grads", [("o",), ("lse",)])
def test_one_output_gradient(grads):
    # autograd hands None for the output without a gradient
    compare(B=1, T=37, H=2, Hkv=1, D=32, window=6, sinks=4, grads=grads, scale=0.3)


@needs_kernels
def test_dispatch_and_backends():
    q, k, v, *_ = make_inputs(1, 20, 2, 1, 16, device=DEVICE)
    o_t, lse_t = ops.window_attention(q, k, v, 4, 2, backend="triton")
    o_r, lse_r = ops.window_attention(q, k, v, 4, 2, backend="torch")
    assert rel(o_t, o_r) < 1e-5 and rel(lse_t, lse_r) < 1e-5
    with pytest.raises(ValueError, match="backend"):
        ops.window_attention(q, k, v, 4, backend="cuda")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernels)])
def test_bad_inputs(backend):
    q, k, v, *_ = make_inputs(1, 8, 4, 2, 16, device=DEVICE)
    call = lambda *a, **kw: ops.window_attention(*a, backend=backend, **kw)  # noqa: E731
    cases = [((q, k, v, 0), {}, "window"), ((q, k, v, True), {}, "window"),
             ((q, k, v, 2.0), {}, "window"), ((q, k, v, 4, -1), {}, "sinks"),
             ((q, k[:, :5], v[:, :5], 4), {}, "k and v"), ((q, k, v[..., :8], 4), {}, "k and v"),
             ((q[:, :, :3], k, v, 4), {}, "multiple"), ((q, k.half(), v.half(), 4), {}, "dtype"),
             ((q[0], k, v, 4), {}, "4-D"), ((q, k, v, 4), {"scale": math.inf}, "scale"),
             ((q.repeat(2, 1, 1, 1), k.repeat(2, 1, 1, 1), v.repeat(2, 1, 1, 1), 4),
              {"cu_seqlens": _cu([8], DEVICE)}, "B == 1"),
             ((q, k, v, 4), {"cu_seqlens": _cu([8], DEVICE).float()}, "cu_seqlens"),
             ((q, k, v, 4), {"cu_seqlens": _cu([3, 4], DEVICE)}, "cu_seqlens"),
             ((q, k, v, 4, 2), {"q_sink": q}, "together"),
             ((q, k, v, 4, 2), {"q_sink": q, "k_sink": k[:, :4]}, "k_sink must match")]
    for args, kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            call(*args, **kwargs)


# ----------------------------------------------------------------------------- the mix

def mix_inputs(shape, H, D, dtype, device, padded, seed=0):
    """o_win, lse, o_lin (den > 0 but for a few rows, and in padded rows as fused_chunk_gla
    returns them when padded), logit, do."""
    gen = torch.Generator().manual_seed(seed)
    o_win = torch.randn(*shape, H, D, generator=gen)
    lse = 3 * torch.randn(*shape, H, generator=gen)
    num = torch.randn(*shape, H, D, generator=gen)
    den = torch.rand(*shape, H, generator=gen) * 5 + 0.05
    den.view(-1)[::7] = 0                                   # rows with nothing in the state yet
    o_lin = torch.cat([num, den[..., None]], -1)
    if padded:   # a row-padded view (stride D + 8 > D + 1), as the chunk kernels write it
        o_lin = F.pad(o_lin, (0, 7))[..., :D + 1]
    logit = torch.randn(H, generator=gen)
    do = torch.randn(*shape, H, D, generator=gen)
    to = lambda x, dt=dtype: x.to(device=device, dtype=dt)
    return to(o_win), to(lse, torch.float32), to(o_lin), to(logit, torch.float32), to(do)


def check_mix(shape, H, D, shared, dtype=torch.float32, padded=False, device=DEVICE, tol=None):
    from glaswap_kernels.window.mix import fused_window_mix
    from glaswap_kernels.window.reference import window_mix_torch
    o_win, lse, o_lin, logit, do = mix_inputs(shape, H, D, dtype, device, padded)
    xs = [x.clone().requires_grad_() for x in (o_win, lse, o_lin, logit)]
    rs = [x.detach().double().requires_grad_() for x in (o_win, lse, o_lin, logit)]
    o = fused_window_mix(*xs, shared=shared)
    o_r = window_mix_torch(*rs, shared=shared)
    assert o.dtype == dtype and o.shape == o_win.shape
    got = torch.autograd.grad(o, xs, do, allow_unused=True)
    want = torch.autograd.grad(o_r, rs, do.double(), allow_unused=True)
    errs = {"o": rel(o, o_r)}
    for name, a, b in zip(("d_win", "d_lse", "d_lin", "d_logit"), got, want):
        if b is None or not b.any():     # lse does not enter the learned mix
            assert a is None or not a.any(), name
            continue
        errs[name] = rel(a, b)
    tol = TOL[dtype] if tol is None else tol
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"errors above {tol}: {bad} (all: {errs})"
    return errs


@needs_kernels
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("shape,H,D", [((1, 1), 2, 48), ((2, 37), 3, 64), ((1, 19), 2, 80)])
def test_mix_kernel_matches_reference(shape, H, D, shared):
    check_mix(shape, H, D, shared)


@needs_kernels
def test_mix_kernel_reads_padded_rows_and_bf16():
    check_mix((2, 9), 4, 64, True, padded=True)
    check_mix((2, 9), 4, 64, True, dtype=torch.bfloat16)


def test_mix_reference_shared_form_is_one_normaliser():
    """shared: (e^lse o_win + e^c num) / (e^lse + e^c den), written out."""
    from glaswap_kernels.window.reference import window_mix_torch
    o_win, lse, o_lin, logit, _ = mix_inputs((2, 5), 3, 8, torch.float64, "cpu", False)
    num, den = o_lin[..., :-1], o_lin[..., -1]
    c = logit.double()
    want = (lse.exp()[..., None] * o_win + c.exp()[:, None] * num) / (lse.exp() + c.exp() * den)[..., None]
    got = window_mix_torch(o_win, lse.double(), o_lin, logit.double(), shared=True, eps=1e-12)
    live = den > 0
    assert torch.allclose(got[live], want[live], rtol=1e-5, atol=1e-6)   # float32 maths
    assert torch.equal(got[~live], o_win[~live])          # an empty state leaves the window alone


def test_mix_bad_shapes():
    o_win, lse, o_lin, logit, _ = mix_inputs((1, 4), 2, 8, torch.float32, "cpu", False)
    with pytest.raises(ValueError, match="window_mix wants"):
        ops.window_mix(o_win, lse, o_lin[..., :-1], logit)


# ----------------------------------------------------------------------------- the rotation

def check_rope(B, T, H, D, cos_batch, dtype=torch.float32, device=DEVICE, tol=None, seed=0):
    """fused_rope against gla_torch.apply_rope in float64: y and dx, cos/sin of batch 1 or B."""
    from glaswap_kernels.gla.reference import apply_rope
    from glaswap_kernels.rope_triton import fused_rope
    gen = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(B, T, H, D, generator=gen) for _ in range(2))
    ang = torch.randn(cos_batch, T, D // 2, generator=gen) * 3
    ang = torch.cat([ang, ang], -1)                       # Llama's layout: both halves alike
    cos, sin = ang.cos() * 1.1, ang.sin() * 1.1           # with an attention scaling
    xs = x.to(device=device, dtype=dtype).requires_grad_()
    y = fused_rope(xs, cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype))
    (dx,) = torch.autograd.grad(y, xs, dy.to(device=device, dtype=dtype))
    xr = x.double().requires_grad_()
    yr = apply_rope(xr, cos.double(), sin.double())
    (dxr,) = torch.autograd.grad(yr, xr, dy.double())
    assert y.dtype == dtype and y.shape == x.shape
    tol = TOL[dtype] if tol is None else tol
    errs = {"y": rel(y.cpu(), yr), "dx": rel(dx.cpu(), dxr)}
    assert all(e <= tol for e in errs.values()), errs


@needs_kernels
@pytest.mark.parametrize("B,T,H,D,cos_batch", [(1, 1, 3, 48, 1), (2, 37, 4, 64, 1), (2, 19, 2, 80, 2),
                                               (1, 5, 9, 16, 1)])
def test_rope_kernel_matches_reference(B, T, H, D, cos_batch):
    check_rope(B, T, H, D, cos_batch)


@needs_kernels
def test_rope_kernel_bf16():
    check_rope(2, 9, 4, 64, 1, dtype=torch.bfloat16)


def test_rope_bad_shapes():
    x = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="rope wants"):
        from glaswap_kernels.rope_triton import fused_rope
        fused_rope(x, torch.ones(1, 4, 6), torch.ones(1, 4, 6))


# ----------------------------------------------------------------------------- GPU sizes

gpu = pytest.mark.gpu


@gpu
@gpu_only
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("window", [64, 128])
def test_gpu_bf16(D, window):
    compare(B=2, T=2048, H=16, Hkv=4, D=D, window=window, sinks=4, dtype=torch.bfloat16)
    compare(B=2, T=2048, H=16, Hkv=4, D=D, window=window, sinks=4, dtype=torch.bfloat16, split=True)


@gpu
@gpu_only
def test_gpu_bf16_varlen():
    compare(B=1, T=8192, H=16, Hkv=4, D=64, window=64, sinks=4, dtype=torch.bfloat16,
            seqs=[4096, 1000, 31, 1, 3000, 64], split=True)


@gpu
@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_other_dtypes(dtype):
    compare(B=1, T=2048, H=8, Hkv=2, D=80, window=100, sinks=4, dtype=dtype)


@gpu
@gpu_only
@pytest.mark.parametrize("shared", [True, False])
def test_gpu_mix_bf16(shared):
    check_mix((8, 2048), 32, 64, shared, dtype=torch.bfloat16, padded=True)


@gpu
@gpu_only
def test_gpu_rope_bf16():
    check_rope(8, 2048, 32, 64, 1, dtype=torch.bfloat16)
    check_rope(1, 4096, 8, 128, 1, dtype=torch.bfloat16)
