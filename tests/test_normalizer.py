"""The normaliser's division kernel against PyTorch (interpreter on CPU; bf16 on a GPU)."""

import os

import pytest
import torch

from glaswap_kernels import normalizer_triton
from glaswap_kernels.gla_ops import normalize

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [pytest.mark.skipif(not (CUDA or INTERPRETED), reason="needs CUDA or TRITON_INTERPRET=1"),
              pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(normalizer_triton, "POISON", True)


def rel(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


def check(shape, V, dtype, tol, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num = torch.randn(*shape, V, generator=gen)
    den = torch.rand(*shape, 1, generator=gen) * 3 + 0.05   # positive, as positive feature maps give
    o = torch.cat([num, den], dim=-1)
    dout = torch.randn(*shape, V, generator=gen)
    ref_o = o.double().requires_grad_()
    ref = normalize(ref_o, 1e-6, backend="torch")
    (ref * dout.double()).sum().backward()
    got_o = o.to(DEVICE, dtype).requires_grad_()
    got = normalizer_triton.fused_normalize(got_o, 1e-6)
    (got.float() * dout.to(DEVICE)).sum().backward()
    assert got.dtype == dtype and got.shape == ref.shape
    for name, a, b in (("out", got, ref), ("grad", got_o.grad, ref_o.grad)):
        assert torch.isfinite(a).all(), f"{name}: non-finite (unwritten memory?)"
        assert rel(a.cpu(), b) < tol, f"{name}: relative RMS {rel(a.cpu(), b):.1e}"


@pytest.mark.parametrize("V", [1, 16, 24, 64, 80])
def test_fused_normalize(V):
    check((2, 37, 3), V, torch.float32, 1e-6)   # 222 rows: the last block of 64 partial


def test_fused_normalize_one_row_and_bad_shape():
    check((1,), 48, torch.float32, 1e-6)
    with pytest.raises(ValueError, match="V >= 1"):
        normalizer_triton.fused_normalize(torch.ones(3, 1, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_fused_normalize_bf16():
    check((8, 2048, 32), 64, torch.bfloat16, 1e-2)
