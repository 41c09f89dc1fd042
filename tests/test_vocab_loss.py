"""Stage 2's vocabulary loss: the chunked torch path against the full logits, the choice of
implementation (stage2.loss_impl), and liger-kernel's path against torch where it imports."""

import sys

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
    with pytest.raises(GlaswapError, match="choose auto, torch, liger"):
        L.resolve_loss_impl("fast", "cpu")


@pytest.fixture
def no_liger(monkeypatch, tmp_path):
    """liger-kernel made unimportable (a None entry in sys.modules fails its import)."""
    for name in ("liger_kernel", "liger_kernel.chunked_loss", "liger_kernel.chunked_loss.jsd_loss"):
        monkeypatch.setitem(sys.modules, name, None)
    L._load_liger.cache_clear()
    yield
    L._load_liger.cache_clear()  # the next caller imports it afresh, as it really is


def _recipe(tmp_path, *overrides):
    path = tmp_path / "r.yaml"
    path.write_text("data:\n  train:\n    - path: corpus.txt\n")
    return load_recipe(path, overrides)


def test_liger_asked_for_without_liger_is_one_line(no_liger, tmp_path):
    assert L.liger_missing()
    assert L.resolve_loss_impl("auto", "cuda") == "torch"  # auto falls back without a word
    with pytest.raises(GlaswapError, match="pip install liger-kernel") as err:
        L.resolve_loss_impl("liger", "cpu")
    assert "\n" not in str(err.value)
    h_s, h_t, w, labels = _inputs()
    with pytest.raises(GlaswapError, match="pip install liger-kernel"):
        L.kd_loss(h_s, h_t, w, labels, impl="liger")
    # the recipe says so when it is read, before any model is loaded
    with pytest.raises(GlaswapError, match=r"stage2\.loss_impl: liger needs liger-kernel: pip install liger-kernel"):
        _recipe(tmp_path, "stage2.loss_impl=liger")
    assert _recipe(tmp_path).stage2.loss_impl == "auto"
    assert _recipe(tmp_path, "stage2.loss_impl=torch").stage2.loss_impl == "torch"


def test_recipe_refuses_an_unknown_loss_impl(tmp_path):
    with pytest.raises(GlaswapError, match=r"stage2\.loss_impl: choose auto, torch or liger"):
        _recipe(tmp_path, "stage2.loss_impl=fused")


@pytest.mark.parametrize("ce_weight", [0.0, 0.5])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_liger_matches_torch(ce_weight, temperature):
    """liger-kernel's fused loss (pure PyTorch off CUDA, so it runs here) gives torch's value,
    gradients (of the hidden states and of a trained head) and parts."""
    why = L.liger_missing()
    if why:
        pytest.skip(f"liger-kernel does not import: {why}")
    h_s, h_t, w, labels = _inputs()
    w.requires_grad_(True)
    got = {}
    for impl in ("torch", "liger"):
        parts = {}
        loss = L.kd_loss(h_s, h_t, w, labels, ce_weight, temperature, chunk_tokens=16, parts=parts, impl=impl)
        got[impl] = (loss, torch.autograd.grad(loss, (h_s, w)), parts)
    (loss_t, (gh_t, gw_t), parts_t), (loss_l, (gh_l, gw_l), parts_l) = got["torch"], got["liger"]
    torch.testing.assert_close(loss_l.float(), loss_t, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gh_l, gh_t, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw_l, gw_t, rtol=1e-5, atol=1e-7)
    assert set(parts_l) == set(parts_t)
    for key in parts_t:
        torch.testing.assert_close(parts_l[key].float(), parts_t[key], rtol=1e-5, atol=1e-6)
        assert not parts_l[key].requires_grad
