"""The PyTorch chunked GLA (the CPU path of every converted model) against the token-by-token recurrence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glaswap_kernels import chunk_gla_torch, recurrent_gla_torch


def rel_rms(x, ref):
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def make(B, T, H, Hkv, K, V, decay_scale=1.0, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, Hkv, K, generator=gen)
    v = torch.randn(B, T, Hkv, V, generator=gen)
    g = F.logsigmoid(torch.randn(B, T, Hkv, K, generator=gen)) * decay_scale
    return [t.to(dtype).requires_grad_() for t in (q, k, v, g)]


CASES = [  # B, T, H, Hkv, K, V, decay scale, chunk
    (1, 1, 2, 1, 16, 16, 1.0, 64),       # T = 1
    (2, 37, 4, 2, 48, 48, 1.0, 16),      # T not a multiple of the chunk, head dim 48, GQA
    (1, 70, 6, 2, 16, 17, 0.05, 32),     # weak decays, V not a power of two
    (1, 50, 2, 2, 8, 8, 30.0, 16),       # strong decays (log-decay ~ -20 per step): exact path
    (2, 65, 3, 1, 80, 16, 1.0, 64),      # head dim 80, all query heads on one KV head
]


@pytest.mark.parametrize("B,T,H,Hkv,K,V,scale_g,C", CASES)
def test_chunk_matches_recurrence_outputs_and_grads(B, T, H, Hkv, K, V, scale_g, C):
    q, k, v, g = make(B, T, H, Hkv, K, V, scale_g)
    h0 = torch.randn(B, Hkv, K, V, requires_grad=True)
    do, dht = torch.randn(B, T, H, V), torch.randn(B, Hkv, K, V)

    def run(fn, **kw):
        o, ht = fn(q, k, v, g, initial_state=h0, output_final_state=True, **kw)
        grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), (q, k, v, g, h0))
        return (o, ht, *grads)

    ref = run(recurrent_gla_torch)
    got = run(chunk_gla_torch, chunk_size=C)
    for name, a, b in zip(("o", "ht", "dq", "dk", "dv", "dg", "dh0"), got, ref):
        assert torch.isfinite(a).all(), name
        assert rel_rms(a, b) < 1e-4, (name, rel_rms(a, b))


def test_packed_documents_reset_the_state():
    cu = torch.tensor([0, 1, 20, 45, 80])
    q, k, v, g = make(1, 80, 4, 2, 16, 16)
    o, ht = chunk_gla_torch(q, k, v, g, output_final_state=True, cu_seqlens=cu, chunk_size=16)
    assert ht.shape == (4, 2, 16, 16)
    for n in range(4):
        s, e = cu[n].item(), cu[n + 1].item()
        o_n, ht_n = recurrent_gla_torch(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], output_final_state=True)
        assert rel_rms(o[:, s:e], o_n) < 1e-5
        assert rel_rms(ht[n:n + 1], ht_n) < 1e-5


def test_bf16_inputs_give_bf16_outputs_close_to_fp32():
    q, k, v, g = make(1, 40, 2, 1, 16, 16, dtype=torch.bfloat16)
    o, _ = chunk_gla_torch(q, k, v, g)
    ref, _ = recurrent_gla_torch(q.float(), k.float(), v.float(), g.float())
    assert o.dtype == torch.bfloat16 and rel_rms(o, ref) < 1e-2


@pytest.mark.parametrize("B,T,H,D,pm", [(1, 1, 9, 64, False), (2, 37, 3, 48, False), (2, 5, 4, 16, True)])
def test_feature_map_is_its_einsum(B, T, H, D, pm):
    """feature_map_torch's per-head matmul is softmax(einsum("bthd,hde->bthe", rope(x), W)), with
    its gradients."""
    from glaswap_kernels.gla.reference import apply_rope, feature_map_torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, H, D, generator=gen, requires_grad=True)
    w = (torch.eye(D) + 0.3 * torch.randn(H, D, D, generator=gen)).requires_grad_()
    angle = torch.randn(1, T, D // 2, generator=gen).repeat(1, 1, 2)
    cos, sin = angle.cos(), angle.sin()
    got = feature_map_torch(x, cos, sin, w, pm=pm)
    xw = torch.einsum("bthd,hde->bthe", apply_rope(x, cos, sin), w)
    want = torch.cat([xw.softmax(-1), (-xw).softmax(-1)], -1) if pm else xw.softmax(-1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    dout = torch.randn(want.shape, generator=gen)
    grads = torch.autograd.grad(got, (x, w), dout)
    for a, b in zip(grads, torch.autograd.grad(want, (x, w), dout)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
