"""Stage 2's vocabulary loss: the chunked torch path against the full logits, the choice of
implementation (stage2.loss_impl), glaswap's Triton kernel (under the interpreter here, at
real size in bf16 with `-m gpu`) against the torch path."""

import os

import pytest
import torch
import torch.nn.functional as F

from glaswap.distill import losses as L
from glaswap.distill.recipe import load_recipe
from glaswap.errors import GlaswapError


def _inputs(n=37, d=8, vocab=29, dtype=torch.float64, seed=0):
    """Student and teacher hidden states, a head and labels with -100 rows (n is no multiple
    of the chunks the tests use, so the last chunk is short)."""
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(n, d, generator=g, dtype=dtype, requires_grad=True)
    h_t = (h_s.detach() + 0.5 * torch.randn(n, d, generator=g, dtype=dtype))
    w = torch.randn(vocab, d, generator=g, dtype=dtype)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[[0, 11, 12, n - 1]] = -100
    return h_s, h_t, w, labels


def _full_logits(h_s, h_t, w, labels, ce_weight, temperature):
    """The loss from the whole [N, V] logits at once: KL over every token, times T^2, plus the
    weighted cross-entropy over labelled tokens, both divided by all N tokens."""
    n = h_s.shape[0]
    p_t = torch.softmax(h_t @ w.t() / temperature, dim=-1)
    logp_s = torch.log_softmax(h_s @ w.t() / temperature, dim=-1)
    kl = (p_t * (p_t.log() - logp_s)).sum() * temperature ** 2 / n
    ce = F.cross_entropy(h_s @ w.t(), labels, ignore_index=-100, reduction="sum") / n
    return kl + ce_weight * ce, kl, ce


@pytest.mark.parametrize("ce_weight", [0.0, 0.5])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_torch_path_matches_full_logits(ce_weight, temperature):
    h_s, h_t, w, labels = _inputs()
    parts = {}
    loss = L.kd_loss(h_s, h_t, w, labels, ce_weight, temperature, chunk_tokens=16, parts=parts, impl="torch")
    (grad,) = torch.autograd.grad(loss, h_s)
    want, kl, ce = _full_logits(h_s, h_t, w, labels, ce_weight, temperature)
    (want_grad,) = torch.autograd.grad(want, h_s)
    torch.testing.assert_close(loss, want.float(), rtol=1e-6, atol=1e-6)  # the torch path computes in float32
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-7)
    assert set(parts) == ({"kl", "ce"} if ce_weight else {"kl"})
    torch.testing.assert_close(parts["kl"], kl.detach().float(), rtol=1e-6, atol=1e-6)
    if ce_weight:
        torch.testing.assert_close(parts["ce"], ce.detach().float(), rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # the forward alone (no checkpointing) gives the same value
        torch.testing.assert_close(L.kd_loss(h_s, h_t, w, labels, ce_weight, temperature, 16, impl="torch"), loss)


def test_auto_takes_torch_on_the_cpu():
    assert L.resolve_loss_impl("auto", torch.device("cpu")) == "torch"
    assert L.resolve_loss_impl("torch", "cuda") == "torch"
    with pytest.raises(GlaswapError, match="choose auto, torch, triton"):
        L.resolve_loss_impl("fast", "cpu")


def _recipe(tmp_path, *overrides):
    path = tmp_path / "r.yaml"
    path.write_text("data:\n  train:\n    - path: corpus.txt\n")
    return load_recipe(path, overrides)


def test_recipe_reads_the_loss_impl(tmp_path):
    assert _recipe(tmp_path).stage2.loss_impl == "auto"
    assert _recipe(tmp_path, "stage2.loss_impl=triton").stage2.loss_impl == "triton"
    assert _recipe(tmp_path, "stage2.loss_impl=torch").stage2.loss_impl == "torch"


def test_recipe_refuses_an_unknown_loss_impl(tmp_path):
    with pytest.raises(GlaswapError, match=r"stage2\.loss_impl: choose auto, torch or triton"):
        _recipe(tmp_path, "stage2.loss_impl=fused")


# ----------------------------------------------------------------------------- Triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ce_weight,temperature,head", [(0.0, 1.0, False), (0.5, 1.0, True), (0.0, 2.0, True),
                                                        (0.5, 2.0, False)])
def test_triton_path_matches_torch(monkeypatch, dtype, ce_weight, temperature, head):
    """The fused kernel's loss, parts and gradients (hidden states; the head when it trains)
    against the torch path on the same inputs, with rows of several column blocks (the last
    one partial), a short last chunk and unlabelled rows; every buffer the kernel fills
    starts as NaN."""
    from glaswap_kernels import kd_loss_triton, utils as triton_helpers
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    monkeypatch.setattr(triton_helpers, "POISON", True)
    monkeypatch.setattr(kd_loss_triton, "_BLOCK", 16)   # 45 columns: blocks of 16, 16 and 13
    h_s, h_t, w, labels = _inputs(vocab=45, dtype=dtype)
    w.requires_grad_(head)
    wanted = (h_s, w) if head else (h_s,)
    got = {}
    for impl in ("torch", "triton"):
        parts = {}
        loss = L.kd_loss(h_s, h_t, w, labels, ce_weight, temperature, chunk_tokens=16, parts=parts, impl=impl)
        got[impl] = (loss, torch.autograd.grad(loss, wanted), parts)
    (loss_t, grads_t, parts_t), (loss_k, grads_k, parts_k) = got["torch"], got["triton"]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert abs(loss_k.item() - loss_t.item()) <= tol * abs(loss_t.item())
    for g_k, g_t in zip(grads_k, grads_t):
        assert g_k.dtype == g_t.dtype and torch.isfinite(g_k).all()
        assert ((g_k.double() - g_t.double()).norm() / g_t.double().norm()).item() <= tol
    assert set(parts_k) == set(parts_t)
    for key in parts_t:
        assert abs(parts_k[key].item() - parts_t[key].item()) <= tol * abs(parts_t[key].item())
        assert not parts_k[key].requires_grad


def test_triton_asked_for_off_the_gpu_is_one_line(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(GlaswapError, match="not on a GPU; set stage2.loss_impl=torch") as err:
        L.resolve_loss_impl("triton", "cpu")
    assert "\n" not in str(err.value)
    assert L.resolve_loss_impl("auto", "cpu") == "torch"


def test_triton_loss_refuses_mismatched_shapes():
    from glaswap_kernels.kd_loss_triton import fused_kd_loss
    h_s, h_t, w, labels = _inputs()
    with pytest.raises(ValueError, match="head must be"):
        fused_kd_loss(h_s, h_t, w[:, :3], labels)
    with pytest.raises(ValueError, match="labels must be"):
        fused_kd_loss(h_s, h_t, w, labels[:-1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ce_weight", [0.0, 0.5])
def test_triton_path_at_llama_vocabulary_on_the_gpu(ce_weight):
    """At Llama 3's 128,256 words, bf16 under autocast as stage 2 runs: the kernel's loss
    and gradient against the torch path's (both from bf16 logits), 4,999 tokens in chunks
    of 2,048."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, d, vocab = 4999, 2048, 128256
    h_t = torch.randn(n, d, device="cuda", generator=g)
    h_s = (h_t + 0.3 * torch.randn(n, d, device="cuda", generator=g)).bfloat16().requires_grad_()
    w = (torch.randn(vocab, d, device="cuda", generator=g) * (3.0 / d ** 0.5)).bfloat16()
    labels = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    labels[::97] = -100
    got = {}
    for impl in ("torch", "triton"):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = L.kd_loss(h_s, h_t.bfloat16(), w, labels, ce_weight, 1.0, 2048, impl=impl)
        got[impl] = (loss.float(), torch.autograd.grad(loss, h_s)[0])
    (loss_t, g_t), (loss_k, g_k) = got["torch"], got["triton"]
    assert abs(loss_k.item() - loss_t.item()) <= 1e-3 * abs(loss_t.item())
    assert ((g_k.float() - g_t.float()).norm() / g_t.float().norm()).item() <= 2e-2
