"""A softmax layer's distance cap (softmax_max_distance = L): a key L or more tokens back is
scored as if it stood exactly L back. The whole-sequence path (the window op with every older
key a sink) and the cached path (KVBuffer, prompts in pieces, decode steps) against a direct
computation that places each key at its capped distance; mixed models with a cap are also
checked over caches, padding and the decode graph in test_softmax_layers.py."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_teacher

from glaswap.convert import glaswap_config
from glaswap.errors import GlaswapError
import glaswap.layers.softmax_attention as softmax_attention_module
from glaswap.layers.softmax_attention import DistanceCap, cached_softmax_attention, softmax_attention
from glaswap.models.modeling_glaswap import GLASwapForCausalLM
from glaswap_kernels.ops import apply_rope


def rel(a, b):
    return ((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt().clamp_min(1e-12)).item()


def _freqs(D, theta=10000.0):
    return 1.0 / theta ** (torch.arange(0, D, 2).float() / D)


def _table(positions, inv_freq, scaling):
    """(cos, sin) [1, n, D] as a teacher's rotary embedding gives them, times its scaling."""
    angle = positions.float()[:, None] * inv_freq
    emb = torch.cat([angle, angle], -1)
    return (emb.cos() * scaling)[None], (emb.sin() * scaling)[None]


def direct(q, k, v, inv_freq, scaling, L):
    """Query i with each key j placed at position i - min(i - j, L): [B, T, H * D]."""
    B, T, H, D = q.shape
    R = H // k.shape[2]
    out = torch.zeros(B, T, H, D)
    for i in range(T):
        at = i - (i - torch.arange(i + 1)).clamp(max=L)
        kr = apply_rope(k[:, :i + 1], *_table(at, inv_freq, scaling)).repeat_interleave(R, 2)
        qr = apply_rope(q[:, i:i + 1], *_table(torch.tensor([i]), inv_freq, scaling))[:, 0]
        s = torch.einsum("bhd,bjhd->bhj", qr, kr) * D ** -0.5
        out[:, i] = torch.einsum("bhj,bjhd->bhd", s.softmax(-1), v[:, :i + 1].repeat_interleave(R, 2))
    return out.reshape(B, T, H * D)


def _inputs(B, T, H, Hkv, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, T, h, D, generator=g) for h in (H, Hkv, Hkv)]


SHAPES = [  # B, T, H, Hkv, D, L
    (2, 37, 4, 2, 16, 8),      # GQA, odd T
    (1, 20, 2, 1, 48, 1),      # every earlier key at distance 1
    (1, 1, 2, 2, 16, 4),       # T = 1
    (1, 50, 6, 3, 80, 49),     # only the first key capped
]


@pytest.mark.parametrize("B,T,H,Hkv,D,L", SHAPES)
@pytest.mark.parametrize("scaling", [1.0, 1.3])
def test_whole_sequence_and_cached_paths_match_the_direct_scores(B, T, H, Hkv, D, L, scaling):
    q, k, v = _inputs(B, T, H, Hkv, D)
    inv = _freqs(D)
    cap = DistanceCap(L, inv, scaling, D)
    pe = _table(torch.arange(T), inv, scaling)
    want = direct(q, k, v, inv, scaling, L)
    whole = softmax_attention(q, k, v, pe, cap=cap, backend="torch")
    cached, kv = cached_softmax_attention(q, k, v, pe, None, cap=cap)
    assert rel(whole, want) < 1e-5 and rel(cached, want) < 1e-5
    assert kv.length == T and kv.positions[:, :T].tolist() == [list(range(T))] * B


@pytest.mark.parametrize("piece", [None, 1])
def test_cached_pieces_and_decode_steps_match_the_direct_scores(piece, monkeypatch):
    """piece 1: the cached keys are turned back in slices of 16 (the fewest), so scores are
    assembled across slices, as they are past a few million key elements."""
    if piece is not None:
        monkeypatch.setattr(softmax_attention_module, "CAP_PIECE", piece)
    B, T, H, Hkv, D, L = 2, 41, 4, 2, 32, 6
    q, k, v = _inputs(B, T, H, Hkv, D, seed=3)
    inv = _freqs(D)
    cap = DistanceCap(L, inv, 1.0, D)
    kv, outs = None, []
    for a, b in [(0, 4), (4, 5), (5, 19), (19, 20), (20, 21), (21, 41)]:   # prompts and decode steps
        pos = torch.arange(a, b)
        o, kv = cached_softmax_attention(q[:, a:b], k[:, a:b], v[:, a:b], _table(pos, inv, 1.0), kv,
                                         position_ids=pos[None], cap=cap)
        outs.append(o)
    assert rel(torch.cat(outs, 1), direct(q, k, v, inv, 1.0, L)) < 1e-5


def test_a_cap_beyond_the_context_is_the_teachers_attention():
    q, k, v = _inputs(1, 30, 4, 2, 16)
    inv = _freqs(16)
    pe = _table(torch.arange(30), inv, 1.0)
    plain = softmax_attention(q, k, v, pe)
    for cap in (DistanceCap(30, inv, 1.0, 16), DistanceCap(0, inv, 1.0, 16)):
        torch.testing.assert_close(softmax_attention(q, k, v, pe, cap=cap), plain)
        torch.testing.assert_close(cached_softmax_attention(q, k, v, pe, None, cap=cap)[0], plain)


def test_packed_documents_restart_their_distances():
    """cu_seqlens: each document is capped within itself, as if read alone."""
    T, H, Hkv, D, L = 33, 4, 2, 16, 5
    q, k, v = _inputs(1, T, H, Hkv, D, seed=7)
    inv = _freqs(D)
    cap = DistanceCap(L, inv, 1.0, D)
    cu = torch.tensor([0, 12, 13, 33])
    pos = torch.cat([torch.arange(12), torch.arange(1), torch.arange(20)])
    got = softmax_attention(q, k, v, _table(pos, inv, 1.0), cu_seqlens=cu, cap=cap, backend="torch")
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        want = direct(q[:, a:b], k[:, a:b], v[:, a:b], inv, 1.0, L)
        assert rel(got[:, a:b], want) < 1e-5


def test_a_mixed_model_uses_its_cap_only_past_it():
    """softmax_max_distance 0 caps at the teacher's positions; a cap changes nothing up to it
    and changes the output past it."""
    teacher = tiny_teacher("llama", layers=2)
    cfg = teacher.config.to_dict()
    plain = GLASwapForCausalLM(glaswap_config(cfg, {"softmax_layers": [0, 1]})).eval()
    capped = GLASwapForCausalLM(glaswap_config(cfg, {"softmax_layers": [0, 1], "softmax_max_distance": 6})).eval()
    for m in (plain, capped):
        m.load_state_dict(teacher.state_dict(), strict=False)
    assert plain.config.softmax_max_distance == 0
    assert plain.model.layers[0].self_attn._distance_cap(torch.device("cpu")).distance == cfg["max_position_embeddings"]
    ids = torch.randint(1, 100, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = teacher(ids).logits
        torch.testing.assert_close(plain(ids).logits, want, rtol=1e-4, atol=1e-4)
        short, long = capped(ids[:, :7]).logits, capped(ids).logits
    torch.testing.assert_close(short, want[:, :7], rtol=1e-4, atol=1e-4)    # every distance below 6
    assert not torch.allclose(long[:, 7:], want[:, 7:], rtol=1e-3, atol=1e-3)


def test_a_negative_cap_gets_one_line():
    teacher = tiny_teacher("llama", layers=2)
    with pytest.raises(GlaswapError, match="invalid softmax_max_distance -1; expected a whole number >= 0"):
        glaswap_config(teacher.config.to_dict(), {"softmax_layers": [0], "softmax_max_distance": -1})
