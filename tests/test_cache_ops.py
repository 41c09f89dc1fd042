"""The hybrid cache's two ops, `ops.decode_step` and `ops.window_over_buffer`, against their
definitions: the float64 recurrence for one token, and a masked softmax written out one query
at a time. Awkward shapes: T = 1 and odd T, head dims 48 and 80, GQA, empty slots, no sinks,
a sparse cache or none. The Triton path of decode_step runs under the interpreter on CPU
(outputs poisoned by NaN) and at real sizes in bf16 on a GPU."""

import pytest
import torch

from gla_helpers import DEVICE, gpu_only, interpreter_warnings, needs_kernels, poison_outputs, rel  # noqa: F401
from glaswap_kernels import ops
from glaswap_kernels.gla.reference import recurrent_gla_torch

pytestmark = interpreter_warnings


def _decode_inputs(B, H, Hkv, K, V, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, H, K, generator=gen)
    k = torch.randn(B, 1, Hkv, K, generator=gen)
    v = torch.randn(B, 1, Hkv, V, generator=gen)
    g = torch.nn.functional.logsigmoid(torch.randn(B, 1, Hkv, K, generator=gen) + 1)
    state = torch.randn(B, Hkv, K, V, generator=gen)
    return [t.to(device, dtype) for t in (q, k, v, g)] + [state.to(device)]


@pytest.mark.parametrize("B,H,Hkv,K,V", [(1, 2, 2, 16, 16), (3, 4, 2, 48, 48), (2, 6, 2, 80, 81)])
@pytest.mark.parametrize("with_state", [True, False])
def test_decode_step_matches_the_recurrence(B, H, Hkv, K, V, with_state):
    q, k, v, g, state = _decode_inputs(B, H, Hkv, K, V, torch.float32, "cpu")
    state = state if with_state else None
    o, new = ops.decode_step(q, k, v, g, 0.3, state, backend="torch")
    o_ref, new_ref = recurrent_gla_torch(q.double(), k.double(), v.double(), g.double(), scale=0.3,
                                         initial_state=None if state is None else state.double(),
                                         output_final_state=True)
    assert rel(o, o_ref) < 1e-5 and rel(new, new_ref) < 1e-5
    assert new.dtype == torch.float32 and o.dtype == q.dtype


@needs_kernels
@pytest.mark.parametrize("B,H,Hkv,K,V", [(1, 2, 2, 16, 17), (2, 4, 2, 48, 48)])
def test_decode_step_triton_matches_torch(B, H, Hkv, K, V):
    q, k, v, g, state = _decode_inputs(B, H, Hkv, K, V, torch.float32, DEVICE)
    o, new = ops.decode_step(q, k, v, g, 0.25, state, backend="triton")
    o_ref, new_ref = ops.decode_step(q, k, v, g, 0.25, state, backend="torch")
    assert rel(o, o_ref) < 1e-4 and rel(new, new_ref) < 1e-4


@gpu_only
def test_decode_step_gpu_bf16():
    q, k, v, g, state = _decode_inputs(64, 32, 8, 128, 129, torch.bfloat16, "cuda")
    o, new = ops.decode_step(q, k, v, g, 128 ** -0.5, state)
    o_ref, new_ref = ops.decode_step(q, k, v, g, 128 ** -0.5, state, backend="torch")
    assert rel(o, o_ref) < 2e-2 and rel(new, new_ref) < 1e-3


def test_decode_step_takes_one_token():
    q, k, v, g, state = _decode_inputs(1, 2, 2, 8, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="one token"):
        ops.decode_step(q.repeat(1, 2, 1, 1), k.repeat(1, 2, 1, 1), v, g, 1.0, state)


def _buffer_inputs(B, T, H, Hkv, D, W, S, M, seed=0):
    """A cache after some tokens: the window with empty slots in row 0, sinks, sparse slots."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)                         # noqa: E731
    start = torch.tensor([W - 2, W + 5][:B] + [W + 9] * max(0, B - 2))  # first new position per row
    pos = start[:, None] + torch.arange(T)                                # [B, T]
    key_pos = torch.cat([start[:, None] - W + torch.arange(W), pos], 1)   # [B, W + T]
    key_pos = key_pos.masked_fill(key_pos < 0, -1)
    sink_pos = torch.arange(S).expand(B, S).clone()
    sink_pos[0, S // 2:] = -1                                             # row 0 has not seen them all
    mem_pos = torch.randint(0, 5, (B, M, Hkv), generator=gen)
    mem_pos[0, :1] = -1                                                   # an empty slot
    mem_from = torch.randint(-1, T, (B, M, Hkv), generator=gen)
    return dict(q_r=r(B, T, H, D), q_s=r(B, T, H, D), k=r(B, W + T, Hkv, D), v=r(B, W + T, Hkv, D),
                key_pos=key_pos, sink_k=r(B, S, Hkv, D), sink_v=r(B, S, Hkv, D), sink_pos=sink_pos,
                pos=pos, window=W, scale=D ** -0.5,
                **(dict(mem_k=r(B, M, Hkv, D), mem_v=r(B, M, Hkv, D), mem_pos=mem_pos, mem_from=mem_from)
                   if M else {}))


def _buffer_reference(x):
    """One query at a time: the keys it may see, scored and softmaxed in float64."""
    q_r, q_s = x["q_r"].double(), x["q_s"].double()
    B, T, H, D = q_r.shape
    Hkv, W = x["k"].shape[2], x["window"]
    o = torch.zeros(B, T, H, D, dtype=torch.float64)
    lse = torch.zeros(B, T, H, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            for h in range(H):
                hk = h // (H // Hkv)
                scores, values = [], []
                for j in range(t + 1, W + t + 1):                         # the window, itself included
                    if x["key_pos"][b, j] >= 0 or j == W + t:
                        scores.append(q_r[b, t, h] @ x["k"][b, j, hk].double())
                        values.append(x["v"][b, j, hk])
                for s in range(x["sink_pos"].shape[1]):
                    if 0 <= x["sink_pos"][b, s] <= x["pos"][b, t] - W:
                        scores.append(q_s[b, t, h] @ x["sink_k"][b, s, hk].double())
                        values.append(x["sink_v"][b, s, hk])
                if "mem_k" in x:
                    for m in range(x["mem_k"].shape[1]):
                        if x["mem_pos"][b, m, hk] >= 0 and x["mem_from"][b, m, hk] <= t:
                            scores.append(q_s[b, t, h] @ x["mem_k"][b, m, hk].double())
                            values.append(x["mem_v"][b, m, hk])
                s = torch.stack(scores) * x["scale"]
                lse[b, t, h] = torch.logsumexp(s, 0)
                o[b, t, h] = torch.softmax(s, 0) @ torch.stack(values).double()
    return o, lse


@pytest.mark.parametrize("B,T,H,Hkv,D,W,S,M,block", [
    (1, 1, 2, 2, 16, 4, 2, 0, 256),       # a decode step
    (3, 1, 6, 2, 48, 5, 3, 0, 256),       # decode steps of GQA rows, some buffers still filling
    (2, 1, 4, 4, 80, 3, 0, 0, 256),       # a decode step without sinks
    (2, 1, 4, 2, 16, 4, 2, 2, 256),       # a decode step with a sparse cache
    (2, 7, 4, 2, 48, 3, 3, 2, 256),       # GQA, a sparse cache
    (2, 9, 2, 1, 80, 5, 0, 3, 4),         # no sinks, query blocks smaller than T
    (1, 5, 2, 2, 16, 1, 1, 0, 2),         # window 1
])
def test_window_over_buffer_matches_its_definition(B, T, H, Hkv, D, W, S, M, block):
    x = _buffer_inputs(B, T, H, Hkv, D, W, S, M)
    o, lse = ops.window_over_buffer(**x, block=block)
    o_ref, lse_ref = _buffer_reference(x)
    assert o.shape == (B, T, H, D) and lse.dtype == torch.float32
    assert rel(o, o_ref) < 1e-5 and rel(lse, lse_ref) < 1e-6


@pytest.mark.parametrize("B,T,W,S,M,held", [
    (2, 1, 6, 2, 0, 0),         # a decode step into an empty buffer
    (2, 1, 6, 2, 0, 3),         # a decode step into a buffer still growing
    (2, 7, 6, 2, 2, 2),         # a prompt that fills the window past its end
    (1, 3, 8, 0, 0, 4),         # a prompt that leaves it short
])
def test_window_over_buffer_of_a_growing_buffer_is_the_full_one(B, T, W, S, M, held):
    """A window buffer of fewer than W rows reads as the full one whose first rows are empty."""
    x = _buffer_inputs(B, T, 4, 2, 16, W, S, M, seed=5)
    x["key_pos"][:, :W - held] = -1                       # the full buffer's empty first rows
    short = {**x, **{n: x[n][:, W - held:] for n in ("k", "v", "key_pos")}}
    want_o, want_lse = ops.window_over_buffer(**x, block=2)
    o, lse = ops.window_over_buffer(**short, block=2)
    assert rel(o, want_o) < 1e-6 and rel(lse, want_lse) < 1e-6


def test_window_over_buffer_checks_its_shapes():
    x = _buffer_inputs(1, 3, 2, 2, 16, 4, 2, 2)
    with pytest.raises(ValueError, match="window"):
        ops.window_over_buffer(**{**x, "window": 3})      # more rows than a window and the new tokens
    with pytest.raises(ValueError, match="sparse"):
        ops.window_over_buffer(**{**x, "mem_from": None})


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("B,T,H,Hkv,D,W,S", [
    (2, 7, 4, 2, 48, 3, 3),       # GQA
    (1, 5, 2, 2, 80, 4, 0),       # no sinks
    (1, 1, 2, 1, 16, 2, 1),       # one new token
])
def test_window_over_full_buffer_is_window_over_buffer(backend, B, T, H, Hkv, D, W, S):
    """After a full cache (sinks at 0 .. S-1, the window right before the new tokens) the window
    kernel over [sinks, window, new] gives what the buffer read gives."""
    x = _buffer_inputs(B, T, H, Hkv, D, W, S, 0, seed=3)
    start = torch.tensor([W + S + 4, W + S + 11][:B])
    x["pos"] = start[:, None] + torch.arange(T)
    x["key_pos"] = torch.cat([start[:, None] - W + torch.arange(W), x["pos"]], 1)
    x["sink_pos"] = torch.arange(S).expand(B, S).clone()
    want_o, want_lse = ops.window_over_buffer(**x)
    o, lse = ops.window_over_full_buffer(x["q_r"], x["q_s"], x["k"], x["v"], x["sink_k"], x["sink_v"], W, S,
                                         x["scale"], backend=backend)
    assert rel(o, want_o) < 1e-5 and rel(lse, want_lse) < 1e-5
