"""The kernels around the GLA kernel in a converted model, against their PyTorch forms:
the fused feature map (RoPE, per-head matrix, softmax), the normaliser's division, the gate,
and the inference-only RMSNorm and SiLU product.

Under the Triton interpreter on CPU at tiny shapes; the `gpu` tests repeat them at a 1B
model's shapes in bf16. Outputs and gradients are compared by relative RMS; the kernels'
buffers start as NaN so a row or column they forget to write fails.
"""

import os

import pytest
import torch

from glaswap_kernels import feature_map_triton, gate_triton, normalizer_triton, utils as triton_helpers
from glaswap_kernels.ops import gate_logsigmoid, normalize
from glaswap_kernels.gla.reference import feature_map_torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [pytest.mark.skipif(not (CUDA or INTERPRETED), reason="needs CUDA or TRITON_INTERPRET=1"),
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(triton_helpers, "POISON", True)  # the buffers of every kernel file


def rel(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def rope_tables(B, T, D, gen):
    """cos, sin [B, T, D]. Llama's tables repeat one half (cat(freqs, freqs)); these angles
    differ in every column, so a kernel that mixes up the halves' cos or sin fails."""
    ang = 6.3 * torch.rand(B, T, D, generator=gen, dtype=torch.float64)
    return ang.cos().float(), ang.sin().float()


def run(x, cos, sin, w, do, fn, pm=False):
    x = x.clone().requires_grad_(True)
    w = None if w is None else w.clone().requires_grad_(True)
    y = fn(x, cos, sin, w, pm=pm)
    (y.float() * do).sum().backward()
    return y, x.grad, None if w is None else w.grad


def check(B, T, H, D, rope=True, weight=True, dtype=torch.float32, cos_batch=None, seed=0, tol=None,
          pm=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, D, generator=gen)
    w = torch.eye(D).repeat(H, 1, 1) + 0.3 * torch.randn(H, D, D, generator=gen) if weight else None
    cos, sin = rope_tables(cos_batch or B, T, D, gen) if rope else (None, None)
    do = torch.randn(B, T, H, D * (2 if pm else 1), generator=gen)
    ref = run(x.double(), *(None if t is None else t.double() for t in (cos, sin, w)), do.double(),
              feature_map_torch, pm)
    to = lambda t: None if t is None else t.to(DEVICE)
    got = run(x.to(DEVICE, dtype), to(cos), to(sin), to(w), do.to(DEVICE),
              feature_map_triton.fused_feature_map, pm)
    tol = tol or {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    names = ("phi", "dx", "dW")
    for name, a, b in zip(names, got, ref):
        if b is None:
            assert a is None
            continue
        assert a.shape == b.shape and a.dtype == (dtype if name != "dW" else torch.float32)
        assert torch.isfinite(a).all(), f"{name}: non-finite values (unwritten memory?)"
        err = rel(a.cpu(), b)
        assert err < tol, f"{name}: relative RMS {err:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("D", [16, 24, 48, 64, 80])
def test_fused_feature_map_head_dims(D):
    check(2, 37, 3, D)  # 74 rows: one full block of 64 and a partial one


def test_fused_feature_map_one_token_and_broadcast_rope():
    check(1, 1, 2, 32)
    check(3, 5, 2, 32, cos_batch=1)  # cos/sin [1, T, D] shared by the batch


@pytest.mark.parametrize("rope,weight", [(False, True), (True, False), (False, False)])
def test_fused_feature_map_without_rope_or_weight(rope, weight):
    check(2, 21, 2, 48, rope=rope, weight=weight)


@pytest.mark.parametrize("D", [24, 64])
def test_fused_feature_map_dw(D):
    """dW from the stored rope(x) and dy (one batched matmul), over several row blocks."""
    check(1, 197, 8, D, seed=2)
    check(2, 5, 3, D, rope=False)


def test_fused_feature_map_bf16():
    check(2, 70, 2, 64, dtype=torch.bfloat16)


@pytest.mark.parametrize("D", [24, 48, 64])
def test_fused_feature_map_pm(D):
    """hedgehog_pm's [softmax(y), softmax(-y)] from one kernel, 2D wide: both halves and the dx
    and dW they share, against the float64 reference; with several row blocks too."""
    check(2, 37, 3, D, pm=True)
    check(1, 1, 2, D, pm=True, cos_batch=1)        # one token
    check(1, 197, 4, D, pm=True, rope=False, seed=1)


def test_fused_feature_map_pm_bf16():
    check(2, 70, 2, 64, dtype=torch.bfloat16, pm=True)


def test_fused_feature_map_frozen_weight_and_errors():
    x = torch.randn(1, 4, 2, 16, device=DEVICE, requires_grad=True)
    w = torch.eye(16).repeat(2, 1, 1).to(DEVICE)  # no grad: dW is not computed
    y = feature_map_triton.fused_feature_map(x, None, None, w)
    y.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    with pytest.raises(ValueError, match="D even"):
        feature_map_triton.fused_feature_map(torch.randn(1, 2, 2, 15, device=DEVICE))
    with pytest.raises(ValueError, match=r"weight must be \[H, D, D\]"):
        feature_map_triton.fused_feature_map(x, None, None, torch.randn(3, 16, 16, device=DEVICE))
    with pytest.raises(ValueError, match="cos/sin"):
        feature_map_triton.fused_feature_map(x, torch.randn(1, 5, 16), torch.randn(1, 5, 16))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_fused_feature_map_bf16_real_size():
    # Llama-3.2-1B queries for 2 x 2048 tokens, and its keys (8 KV heads).
    check(2, 2048, 32, 64, dtype=torch.bfloat16, cos_batch=1)
    check(2, 2048, 8, 64, dtype=torch.bfloat16)
    check(1, 4096, 16, 128, dtype=torch.bfloat16)
    check(2, 2048, 32, 64, dtype=torch.bfloat16, cos_batch=1, pm=True)   # hedgehog_pm


@pytest.mark.parametrize("feature_map", ["hedgehog", "hedgehog_pm"])
def test_layer_triton_path_matches_torch_path(feature_map):
    """A whole converted model (hedgehog maps, low-rank gate, normaliser, GQA, head dim 24):
    the Triton path (fused feature map, GLA kernels, fused normaliser) against the PyTorch
    path, logits and the gradient of every parameter. hedgehog_pm: K = 48, V = 24."""
    from glaswap.convert import glaswap_config
    from glaswap.models.modeling_glaswap import GLASwapForCausalLM
    from helpers import logits_and_grads_by_backend, tiny_teacher

    teacher = tiny_teacher("llama", layers=1)
    torch.manual_seed(0)
    student = GLASwapForCausalLM(glaswap_config(teacher.config.to_dict(), {"feature_map": feature_map}))
    student.load_state_dict(teacher.state_dict(), strict=False)
    with torch.no_grad():  # move the new parameters off their identity/zero start
        for name, p in student.named_parameters():
            if "map" in name or "gate" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    student = student.to(DEVICE)
    ids = torch.randint(0, 128, (2, 21), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    results = logits_and_grads_by_backend(student, ids)
    (ref_logits, ref_grads), (logits, grads) = results
    assert rel(logits.cpu(), ref_logits.cpu()) < 1e-5
    for name, g in ref_grads.items():
        assert torch.isfinite(grads[name]).all(), name
        assert rel(grads[name].cpu(), g.cpu()) < 1e-4, name


# ------------------------------------------------------------------ normaliser division
def check_normalize(shape, V, dtype, tol, seed=0, padded=False):
    """padded: o is a view of rows padded to 8 values (fused_chunk_gla's layout), which the
    kernel reads in place."""
    gen = torch.Generator().manual_seed(seed)
    num = torch.randn(*shape, V, generator=gen)
    den = torch.rand(*shape, 1, generator=gen) * 3 + 0.05   # positive, as positive feature maps give
    o = torch.cat([num, den], dim=-1)
    dout = torch.randn(*shape, V, generator=gen)
    ref_o = o.double().requires_grad_()
    ref = normalize(ref_o, 1e-6, backend="torch")
    (ref * dout.double()).sum().backward()
    if padded:
        buf = torch.full((*shape, -(-(V + 1) // 8) * 8), float("nan"), device=DEVICE, dtype=dtype)
        buf[..., :V + 1] = o.to(DEVICE, dtype)
        got_o = buf[..., :V + 1].detach().requires_grad_()
        assert not got_o.is_contiguous() or (V + 1) % 8 == 0
    else:
        got_o = o.to(DEVICE, dtype).requires_grad_()
    got = normalizer_triton.fused_normalize(got_o, 1e-6)
    (got.float() * dout.to(DEVICE)).sum().backward()
    assert got.dtype == dtype and got.shape == ref.shape
    for name, a, b in (("out", got, ref), ("grad", got_o.grad, ref_o.grad)):
        assert torch.isfinite(a).all(), f"{name}: non-finite (unwritten memory?)"
        assert rel(a.cpu(), b) < tol, f"{name}: relative RMS {rel(a.cpu(), b):.1e}"


@pytest.mark.parametrize("V", [1, 16, 24, 64, 80])
def test_fused_normalize(V):
    check_normalize((2, 37, 3), V, torch.float32, 1e-6)   # 222 rows: the last block of 64 partial


@pytest.mark.parametrize("V", [16, 64])
def test_fused_normalize_padded_rows(V):
    check_normalize((2, 37, 3), V, torch.float32, 1e-6, padded=True)


def test_fused_normalize_one_row_and_bad_shape():
    check_normalize((1,), 48, torch.float32, 1e-6)
    with pytest.raises(ValueError, match="V >= 1"):
        normalizer_triton.fused_normalize(torch.ones(3, 1, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_fused_normalize_bf16():
    check_normalize((8, 2048, 32), 64, torch.bfloat16, 1e-2)


# ------------------------------------------------------------------ gate activation
def check_gate(x, repeat, tol, normalizer=16.0, seed=0, shift=0.0):
    """fused_gate on x (any float dtype, on DEVICE) against the torch path on x.double():
    output and dx for a random upstream gradient. Returns (y, dx) for further checks."""
    gen = torch.Generator().manual_seed(seed)
    dy = torch.randn(*x.shape[:-1], repeat * x.shape[-1], generator=gen)
    ref_x = x.detach().cpu().double().requires_grad_()
    ref = gate_logsigmoid(ref_x, normalizer, repeat, shift=shift, backend="torch")
    (ref * dy.double()).sum().backward()
    got_x = x.detach().to(DEVICE).requires_grad_()
    got = gate_triton.fused_gate(got_x, normalizer, repeat, shift)
    (got.float() * dy.to(DEVICE)).sum().backward()
    assert got.dtype == x.dtype and got.shape == ref.shape and got_x.grad.dtype == x.dtype
    for name, a, b in (("out", got, ref), ("grad", got_x.grad, ref_x.grad)):
        assert torch.isfinite(a).all(), f"{name}: non-finite (unwritten memory?)"
        assert rel(a.cpu(), b) < tol, f"{name}: relative RMS {rel(a.cpu(), b):.1e}"
    return got, got_x.grad


def gate_logits(shape, dtype, seed=0):
    # Spread 3: the linear (x << 0), curved and saturated (x >> 0) parts of logsigmoid.
    return (3 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(DEVICE, dtype)


@pytest.mark.parametrize("repeat", [1, 2])
@pytest.mark.parametrize("D", [48, 64, 80])
def test_fused_gate(D, repeat):
    check_gate(gate_logits((2, 37, 3, D), torch.float32), repeat, 1e-6)  # 222 rows: last block partial


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_gate_half(dtype):
    check_gate(gate_logits((2, 37, 3, 48), dtype), 2, 1e-2)
    check_gate(gate_logits((1, 5, 2, 64), dtype), 1, 1e-2)


def test_fused_gate_one_row_and_strided_input():
    check_gate(gate_logits((1, 80), torch.float32), 2, 1e-6, normalizer=1.0)
    check_gate(gate_logits((7, 5), torch.float32), 1, 1e-6)  # D = 5: mostly mask
    # The scalar gate's logits: one per head, expanded over D (stride 0).
    check_gate(gate_logits((2, 9, 3, 1), torch.float32).expand(2, 9, 3, 24), 2, 1e-6)


def test_fused_gate_shift():
    """decay_horizon's shift: every log-decay lies at or below -shift, the gradient unchanged."""
    x = gate_logits((2, 37, 3, 48), torch.float32)
    y, dx = check_gate(x, 2, 1e-6, shift=1 / 256)
    y0, dx0 = check_gate(x, 2, 1e-6)
    assert (y <= -1 / 256).all() and y.max() > -1 / 256 - 1e-4   # saturated logits sit at the bound
    torch.testing.assert_close(y, y0 - 1 / 256) and torch.testing.assert_close(dx, dx0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_gate_extreme_logits(dtype):
    vals = torch.tensor([-1e4, -50.0, -1.0, 0.0, 1.0, 50.0, 1e4])
    x = vals.repeat(3, 4, 1).to(DEVICE, dtype)   # D = 7
    y, dx = check_gate(x, 2, 1e-6 if dtype == torch.float32 else 1e-2, normalizer=8.0)
    assert (y <= 0).all(), "a log-decay above 0"
    y, dx = y.float().cpu(), dx.float().cpu()
    assert y[..., -1].eq(0).all() and dx[..., -1].eq(0).all()        # x = 1e4: no decay, no gradient
    assert torch.allclose(y[..., 0], torch.tensor(-1e4 / 8).to(dtype).float())  # x = -1e4: x / n


def test_fused_gate_bad_inputs():
    x = torch.randn(2, 3, 16, device=DEVICE)
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        gate_triton.fused_gate(torch.ones(2, 16, dtype=torch.int32, device=DEVICE), 16.0)
    with pytest.raises(ValueError, match="normalizer > 0"):
        gate_triton.fused_gate(x, 0.0)
    with pytest.raises(ValueError, match="repeat 1 or 2"):
        gate_triton.fused_gate(x, 16.0, repeat=3)
    with pytest.raises(ValueError, match="shift >= 0"):
        gate_triton.fused_gate(x, 16.0, shift=-0.1)
    # The dispatcher routes backend="triton" here.
    y = gate_logsigmoid(x, 16.0, 2, backend="triton")
    assert rel(y.cpu(), gate_logsigmoid(x, 16.0, 2, backend="torch").cpu()) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("repeat, shift", [(1, 0.0), (2, 0.0), (2, 1 / 2048)])
def test_gpu_fused_gate_bf16(repeat, shift):
    # A 1B model's gate: 8 x 2048 tokens, 8 KV heads of 64 (hedgehog_pm: repeat 2), with and
    # without a decay horizon's shift.
    check_gate(gate_logits((8, 2048, 8, 64), torch.bfloat16), repeat, 1e-2, shift=shift)


# ------------------------------------------------------------------ RMSNorm (inference)
def check_rms_norm(shape, dtype, weight_dtype=None, tol=1e-6, seed=0):
    """fused_rms_norm against ops.rms_norm's PyTorch form on the same inputs (Llama's: normalised
    in float32, cast to x's dtype, scaled in the promoted dtype)."""
    from glaswap_kernels import rmsnorm_triton
    from glaswap_kernels.ops import rms_norm

    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(*shape, generator=gen)).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(DEVICE, weight_dtype or dtype)
    with torch.no_grad():
        want = rms_norm(x, w, 1e-5, backend="torch")
        got = rmsnorm_triton.fused_rms_norm(x, w, 1e-5)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.isfinite(got).all(), "unwritten rows (NaN)"
    assert rel(got.cpu(), want.cpu()) < tol, rel(got.cpu(), want.cpu())


@pytest.mark.parametrize("shape", [(1, 1, 96), (2, 37, 96), (5, 80), (3, 576)])
def test_fused_rms_norm(shape):
    check_rms_norm(shape, torch.float32)


def test_fused_rms_norm_bf16_and_promotion():
    check_rms_norm((2, 7, 48), torch.bfloat16, tol=1e-2)
    check_rms_norm((2, 7, 48), torch.bfloat16, weight_dtype=torch.float32, tol=1e-2)   # a float32 output


def test_rms_norm_module_trains_through_pytorch():
    """The RMSNorm module takes the kernel only where no gradient is wanted: under autograd its
    weight still gets one, and both paths give the same values."""
    from glaswap.layers.gla_attention import RMSNorm

    norm = RMSNorm(40, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(40, generator=torch.Generator().manual_seed(1)).to(DEVICE))
    x = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    y = norm(x)
    y.sum().backward()
    assert norm.weight.grad is not None and torch.isfinite(norm.weight.grad).all()
    with torch.no_grad():
        assert rel(norm(x).cpu(), y.detach().cpu()) < 1e-6
    with pytest.raises(ValueError, match="weight"):
        from glaswap_kernels import rmsnorm_triton
        rmsnorm_triton.fused_rms_norm(x, norm.weight[:-1])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_fused_rms_norm_bf16():
    check_rms_norm((64, 1, 576), torch.bfloat16, tol=1e-2)
    check_rms_norm((4, 2048, 2048), torch.bfloat16, tol=1e-2)


# ------------------------------------------------------------------ SiLU * up (inference)
@pytest.mark.parametrize("shape,dtype,tol", [((3, 1, 160), torch.float32, 1e-6), ((2, 7, 1537), torch.float32, 1e-6),
                                             ((2, 5, 96), torch.bfloat16, 1e-2)])
def test_fused_silu_mul(shape, dtype, tol):
    """fused_silu_mul against PyTorch's silu(a) * b, over a last block that is partly full."""
    from glaswap_kernels import silu_mul_triton

    gen = torch.Generator().manual_seed(0)
    a, b = ((3 * torch.randn(*shape, generator=gen)).to(DEVICE, dtype) for _ in range(2))
    want = torch.nn.functional.silu(a) * b
    got = silu_mul_triton.fused_silu_mul(a, b)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert rel(got.cpu(), want.cpu()) < tol
    with pytest.raises(ValueError, match="one shape"):
        silu_mul_triton.fused_silu_mul(a, b[..., :-1])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_fused_silu_mul_bf16():
    from glaswap_kernels import silu_mul_triton

    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(64, 1, 1536, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    assert rel(silu_mul_triton.fused_silu_mul(a, b).cpu(), (torch.nn.functional.silu(a) * b).cpu()) < 1e-2
