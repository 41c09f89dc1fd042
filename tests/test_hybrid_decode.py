"""A hybrid layer's decode step in one op (ops.hybrid_decode): its PyTorch reference against the
general path of hybrid_cache.stream for one token, the Triton kernel against the reference, in
place and into new buffers, and a tiny model decoding through it.

Without a GPU the kernel runs under the Triton interpreter (tests/conftest.py), so shapes stay
tiny: window 1 and odd windows, no sinks and more sinks than the window, head dims 48 and 80,
GQA, a state per query head, a leaving key that is a sink, padding or empty, a new token that
is a sink or padding, fp32 and bf16. Every comparison is a relative RMS error, and every buffer
the kernel fills starts as NaN. The `gpu` test repeats the check at the GPU recipe's sizes in
bf16 (`pytest -m gpu`).
"""

import functools

import pytest
import torch

from gla_helpers import DEVICE, gpu_only, interpreter_warnings, needs_kernels, poison_outputs, rel  # noqa: F401
from glaswap.layers.hybrid_cache import ExactInputs, HybridBuffers, SinkBuffer, StreamLayer, WindowBuffer, stream
from glaswap_kernels import ops
from glaswap_kernels.window.reference import hybrid_decode_torch, window_mix_torch

pytestmark = interpreter_warnings


def step_inputs(B=2, H=4, Hkv=2, Hs=2, D=24, F=48, W=5, S=2, dtype=torch.float32, seed=0, device="cpu",
                new_pos=None, leaving=None):
    """Random inputs of one decode step after full buffers. new_pos [B]: the new tokens'
    positions (default: past the window and sinks); leaving [B]: the positions of the keys
    leaving the window (row 0), which may be sinks (< S) or -1."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, positive=False):
        x = torch.rand(*shape, generator=gen) if positive else torch.randn(*shape, generator=gen)
        return x.to(device=device, dtype=dtype)

    pos = torch.tensor(new_pos if new_pos is not None else [W + S + 7 + 5 * b for b in range(B)])
    wp = pos[:, None] - W + torch.arange(W)
    if leaving is not None:
        wp[:, 0] = torch.tensor(leaving)
    wp = torch.where(wp < 0, -1, wp)
    sink_pos = torch.arange(S).expand(B, S).clone()
    sink_pos = torch.where(sink_pos < pos[:, None] - W + 1, sink_pos, -1)   # not yet read: empty
    return dict(
        q_r=r(B, 1, H, D), q_s=r(B, 1, H, D), q_phi=r(B, 1, H, F, positive=True),
        k_r=r(B, 1, Hkv, D), k_s=r(B, 1, Hkv, D), v=r(B, 1, Hkv, D), k_phi=r(B, 1, Hs, F, positive=True),
        g=(-0.2 * torch.rand(B, 1, Hs, F, generator=gen)).to(device=device, dtype=dtype),
        pos=pos[:, None].to(device),
        window=(r(B, W, Hkv, D), r(B, W, Hkv, D), r(B, W, Hs, F, positive=True), wp.to(device)),
        sinks=(r(B, S, Hkv, D), r(B, S, Hkv, D), sink_pos.to(device)),
        state=torch.rand(B, Hs, F, D + 1, generator=gen).to(device),
        logit=torch.randn(H, generator=gen).to(device),
        softmax_scale=D ** -0.5, gla_scale=1.0)


def general_path(x, shared):
    """hybrid_cache.stream's own answer for the step (its general path: no `mix` given)."""
    B, _, H, D = x["q_r"].shape
    Hkv, Hs = x["k_r"].shape[2], x["k_phi"].shape[2]
    W, S = x["window"][0].shape[1], x["sinks"][0].shape[1]
    R = Hs // Hkv
    per_state_head = (lambda t: t.repeat_interleave(R, dim=2)) if R > 1 else (lambda t: t)
    combine = functools.partial(window_mix_torch, logit=x["logit"], shared=shared, eps=1e-6)
    layer = StreamLayer(W, S, 0, x["gla_scale"], x["softmax_scale"], "torch", per_state_head,
                        lambda o_win, lse, o_lin: combine(o_win.float(), lse, o_lin.float()))
    exact = ExactInputs(x["q_r"], x["k_r"], x["v"], x["q_s"], x["k_s"])
    buffers = HybridBuffers(WindowBuffer(*x["window"]), SinkBuffer(*x["sinks"]))
    o, after, state = stream(layer, x["q_phi"], x["k_phi"], per_state_head(x["v"]), x["g"], exact, x["pos"],
                             buffers, x["state"], True)
    w, s = after.window, after.sinks
    return o, (w.keys, w.values, w.feature_keys, w.positions), (s.keys, s.values, s.positions), state


def assert_step(got, want, tol):
    o, window, sinks, state = got
    assert o.shape == want[0].shape and o.dtype == want[0].dtype
    assert torch.isfinite(o).all() and torch.isfinite(state).all(), "unwritten output (NaN)"
    assert rel(o.float().cpu(), want[0].float().cpu()) < tol, rel(o.float().cpu(), want[0].float().cpu())
    assert rel(state.cpu(), want[3].cpu()) < tol
    for a, b in zip((*window, *sinks), (*want[1], *want[2]), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        if a.dtype == torch.long:
            assert torch.equal(a.cpu(), b.cpu())
        elif b.numel():
            assert rel(a.float().cpu(), b.float().cpu()) < tol


CASES = {
    "gqa": {},
    "mha, head dim 48": dict(H=3, Hkv=3, Hs=3, D=48, F=96),
    "state per query head": dict(H=4, Hkv=2, Hs=4),
    "no sinks": dict(S=0),
    "more sinks than the window": dict(W=3, S=5),
    "window of one": dict(W=1, S=1),
    "head dim 80, odd window": dict(B=3, H=2, Hkv=1, Hs=1, D=80, F=80, W=7, S=3),
    "leaving: a sink, padding": dict(leaving=[1, -1]),
    "new tokens: a sink, padding": dict(new_pos=[1, -1], W=3, S=4, leaving=[-1, -1]),
}


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_reference_is_the_general_path(case, shared):
    x = step_inputs(**CASES[case], seed=len(case))
    assert_step(hybrid_decode_torch(**x, shared=shared), general_path(x, shared), 1e-6)


@needs_kernels
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(case, shared):
    x = step_inputs(**CASES[case], seed=len(case), device=DEVICE)
    want = hybrid_decode_torch(**x, shared=shared)
    assert_step(ops.hybrid_decode(**x, shared=shared, backend="triton"), want, 1e-5)


@needs_kernels
def test_kernel_bf16():
    x = step_inputs(B=2, H=6, Hkv=2, Hs=2, D=48, F=96, W=9, S=4, dtype=torch.bfloat16, device=DEVICE)
    assert_step(ops.hybrid_decode(**x, backend="triton"), hybrid_decode_torch(**x), 2e-2)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_kernels)])
def test_in_place_writes_the_given_buffers(backend):
    """In place (a decode graph's static buffers) the step writes the buffers and state it was
    given, including a window buffer that is a view of a larger one, and returns them."""
    x = step_inputs(W=4, S=2, device=DEVICE, leaving=[0, 5])
    want = hybrid_decode_torch(**x)
    wk, wv, wf, wp = x["window"]
    big = [torch.cat([t[:, :1], t], 1) for t in (wk, wv, wf, wp)]     # the window: rows 1 .. of these
    x["window"] = tuple(t[:, 1:] for t in big)
    x["sinks"] = tuple(t.clone() for t in x["sinks"])
    given = (*x["window"], *x["sinks"], x["state"])
    got = ops.hybrid_decode(**x, in_place=True, backend=backend)
    assert all(a is b for a, b in zip((*got[1], *got[2], got[3]), given))
    assert_step(got, want, 1e-5)
    for t, first in zip(big, (wk, wv, wf, wp)):
        assert torch.equal(t[:, 0], first[:, 0]), "wrote outside the view"


def test_bad_inputs():
    x = step_inputs()
    with pytest.raises(ValueError, match="one token"):
        ops.hybrid_decode(**{**x, "q_r": x["q_r"].expand(-1, 2, -1, -1)})
    with pytest.raises(ValueError, match="in place"):
        ops.hybrid_decode(**{**x, "state": None}, in_place=True)


@needs_kernels
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_model_decodes_through_it(backend, monkeypatch):
    """A tiny hybrid model (window 4, 2 sinks, hedgehog_pm, low-rank gate): a prompt longer than
    the window, then decode steps whose buffers are full, give the logits of one forward over
    the whole sequence, every step through the one op."""
    from helpers import tiny_student

    from glaswap.layers import hybrid_cache
    from glaswap.models.modeling_glaswap import GLASwapCache

    calls = []
    monkeypatch.setattr(hybrid_cache, "hybrid_decode", lambda *a, **k: calls.append(1) or ops.hybrid_decode(*a, **k))

    opts = dict(feature_map="hedgehog_pm", gate="lowrank", window=4, sinks=2, use_rope=True)
    # bf16 on the PyTorch path: on the CPU, float32 decode steps take a path of their own
    dtype = torch.bfloat16 if backend == "torch" else torch.float32
    model = tiny_student("llama", opts, layers=2).to(DEVICE, dtype)
    model.config.gla_backend = backend
    ids = torch.randint(0, 128, (2, 14), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        full = model(ids).logits
        cache = GLASwapCache(2)
        steps = [model(ids[:, :9], past_key_values=cache, use_cache=True).logits[:, -1]]
        for t in range(9, 14):
            steps.append(model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    assert rel(torch.stack(steps[1:], 1).float().cpu(), full[:, 9:].float().cpu()) < \
        (2e-2 if dtype == torch.bfloat16 else 1e-4)
    assert len(calls) == 5 * 2                                # five steps, two layers
    assert all(w.window.positions.shape[1] == 4 for w in cache.windows if w is not None)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("B", [1, 64])
def test_gpu_bf16_recipe_sizes(B):
    """SmolLM2-135M's layer with the GPU recipe's options: 9 heads, 3 KV heads, head dim 64,
    hedgehog_pm (F = 128), window 128, 4 sinks."""
    x = step_inputs(B=B, H=9, Hkv=3, Hs=3, D=64, F=128, W=128, S=4, dtype=torch.bfloat16, device="cuda")
    assert_step(ops.hybrid_decode(**x, backend="triton"), hybrid_decode_torch(**x), 2e-2)
    got = ops.hybrid_decode(**{**x, "window": tuple(t.clone() for t in x["window"]),
                               "sinks": tuple(t.clone() for t in x["sinks"]), "state": x["state"].clone()},
                            in_place=True, backend="triton")
    assert_step(got, hybrid_decode_torch(**x), 2e-2)


@needs_kernels
def test_decode_graph_steps_write_in_place():
    """Through a decode graph's static buffers ("replay": the captured step run eagerly) the
    kernel writes the buffers in place: the same logits as eager steps, from a prompt shorter
    than the window (the static buffers' empty rows) on."""
    from helpers import tiny_student

    from glaswap.decode_graph import disable_decode_graph, enable_decode_graph
    from glaswap.models.modeling_glaswap import GLASwapCache

    opts = dict(feature_map="hedgehog_pm", gate="lowrank", window=4, sinks=2, use_rope=True)
    model = tiny_student("llama", opts, layers=2).to(DEVICE)
    model.config.gla_backend = "triton"
    ids = torch.randint(0, 128, (2, 3), generator=torch.Generator().manual_seed(2)).to(DEVICE)

    def run():
        with torch.no_grad():
            cache = GLASwapCache(2)
            out = model(ids, past_key_values=cache, use_cache=True)
            logits = []
            for _ in range(8):
                out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
                logits.append(out.logits)
        return torch.cat(logits, 1)

    eager = run()
    runner = enable_decode_graph(model, backend="replay")
    replayed = run()
    disable_decode_graph(model)
    assert sorted(runner.steps) == [2]
    assert rel(replayed.cpu(), eager.cpu()) < 1e-5
