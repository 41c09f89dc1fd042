"""Whole sequences, and prompts read into an empty cache, on the CPU without gradients
(GLAAttention._cpu_prefill through glaswap_kernels.hybrid_cpu): the kernel against the
references it stands for at awkward shapes; the model's logits, buffers and states against the
general path's (_hybrid, _stream), and decode steps after; the cases it leaves to the general
path."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_cache, tiny_student

import glaswap.layers.gla_attention as gla_attention
import glaswap_kernels.hybrid_cpu as hybrid_cpu
from glaswap.layers.gla_attention import FeatureMap, GLAAttention, _enter_state
from glaswap.models.modeling_glaswap import cache_of
from glaswap_kernels.gla.reference import chunk_gla_torch
from glaswap_kernels.hybrid_cpu import hybrid_attention_cpu
from glaswap_kernels.ops import with_ones
from glaswap_kernels.window.reference import window_attention_torch, window_mix_torch


# ------------------------------------------------------------------------------ the kernel
def _inputs(B, T, H, Hkv, D, W, S, pm=False, decay=0.2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    F = 2 * D if pm else D
    r = lambda *shape: torch.randn(*shape, generator=gen)                  # noqa: E731
    return dict(q_r=r(B, T, H, D), q_s=r(B, T, H, D), k_r=r(B, T, Hkv, D), k_s=r(B, min(S, T), Hkv, D),
                v=r(B, T, Hkv, D), phi_q=torch.softmax(r(B, T, H, F), -1), phi_k=torch.softmax(r(B, T, Hkv, F), -1),
                g=-decay * torch.rand(B, T, Hkv, F, generator=gen), logit=r(H))


def _reference(x, W, S, shared, scale=None, gla_scale=1.0, eps=1e-6):
    """What hybrid_attention_cpu stands for: the window op, chunk_gla over the keys that have
    left the window (the layer's _enter_state) and the mix, all three the PyTorch references."""
    k_sink = None
    if S:
        k_sink = torch.zeros_like(x["k_r"])
        k_sink[:, :x["k_s"].shape[1]] = x["k_s"]
    o_win, lse = window_attention_torch(x["q_r"], x["k_r"], x["v"], W, S, scale=scale,
                                        q_sink=x["q_s"] if S else None, k_sink=k_sink)
    k_in, v_in = (_enter_state(x[n], W, S, None) for n in ("phi_k", "v"))
    o_lin, state = chunk_gla_torch(x["phi_q"], k_in, with_ones(v_in), x["g"], scale=gla_scale,
                                   output_final_state=True)
    return window_mix_torch(o_win, lse, o_lin, x["logit"], shared, eps), state


def _kernel(x, W, S, shared, **kwargs):
    return hybrid_attention_cpu(x["q_r"], x["q_s"], x["k_r"], x["k_s"], x["v"], x["phi_q"], x["phi_k"], x["g"], W, S,
                                x["logit"], shared=shared, **kwargs)


# (B, T, H, Hkv, D, window, sinks): one token; T = W - 1, W, W + 1, W + S, W + S + 1; odd T over
# several blocks; MHA without sinks; more sinks than the window; fewer tokens than sinks; W = 1;
# the shape of a 135M model's layer (smollm2-135m) over several spans
SHAPES = [(1, 1, 4, 2, 16, 4, 2), (2, 7, 4, 2, 48, 8, 2), (1, 8, 4, 2, 48, 8, 2), (1, 9, 4, 2, 48, 8, 2),
          (1, 10, 4, 2, 80, 8, 2), (1, 11, 4, 2, 80, 8, 2), (2, 77, 6, 3, 48, 16, 3), (1, 100, 4, 4, 80, 20, 0),
          (1, 130, 8, 2, 16, 5, 7), (1, 3, 4, 2, 16, 4, 5), (1, 61, 4, 1, 16, 1, 1), (1, 1100, 9, 3, 64, 64, 4)]
# the defaults, and blocks, chunks and spans small enough that every shape takes several
SIZES = [{}, {"block": 4, "chunk": 8, "span": 16}, {"block": 3, "chunk": 3, "span": 9}]


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_the_references(shape, sizes):
    B, T, H, Hkv, D, W, S = shape
    for shared in (True, False):
        for pm in (False, True):
            x = _inputs(B, T, H, Hkv, D, W, S, pm=pm)
            want_o, want_state = _reference(x, W, S, shared)
            o, state = _kernel(x, W, S, shared, **sizes)
            assert o.shape == want_o.shape and state.shape == want_state.shape
            torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("decay", [0.2, 8.0])
@pytest.mark.parametrize("shape", [SHAPES[6], SHAPES[8], SHAPES[-1]])
def test_kernel_takes_one_decay_for_equal_parts(shape, decay):
    """hedgehog_pm's g once per head dimension, [B, T, Hkv, F / 2]: the result of its repeat over
    both halves of phi (a strong decay takes the references' path, which repeats it)."""
    B, T, H, Hkv, D, W, S = shape
    x = _inputs(B, T, H, Hkv, D, W, S, pm=True, decay=decay)
    x["g"] = x["g"][..., :D].contiguous()
    want_o, want_state = _reference(dict(x, g=x["g"].repeat(1, 1, 1, 2)), W, S, True)
    for sizes in SIZES[:2]:
        o, state = _kernel(x, W, S, True, **sizes)
        torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-6)


def test_kernel_scales_and_converts():
    """A scale for the window and one for the state; bfloat16 inputs computed in float32."""
    x = _inputs(1, 40, 4, 2, 16, 6, 2)
    want_o, want_state = _reference(x, 6, 2, True, scale=0.3, gla_scale=0.25)
    o, state = _kernel(x, 6, 2, True, scale=0.3, gla_scale=0.25, block=4, chunk=8)
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-6)
    half = {n: t.bfloat16() for n, t in x.items()}
    want_o, _ = _reference({n: t.float() for n, t in half.items()}, 6, 2, True)
    o, _ = _kernel(half, 6, 2, True)
    assert o.dtype == torch.float32
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)


def test_kernel_leaves_strong_decays_to_the_references(monkeypatch):
    """A chunk whose decay passes SAFE_EXP: the references' own result (element by element)."""
    x = _inputs(1, 50, 4, 2, 16, 4, 1, decay=8.0)
    calls = []
    by_references = hybrid_cpu._by_references
    monkeypatch.setattr(hybrid_cpu, "_by_references", lambda *a: calls.append(1) or by_references(*a))
    want_o, want_state = _reference(x, 4, 1, True)
    o, state = _kernel(x, 4, 1, True)
    assert calls
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------- the model
CASES = {
    "sinks": ("llama", {"window": 4, "sinks": 2}),
    "no-sinks-learned-mix": ("llama", {"window": 3, "sinks": 0, "window_mix": "learned"}),
    "qwen3-qk-norms": ("qwen3", {"window": 5, "sinks": 1}),
    "hedgehog-pm-key-gate": ("llama", {"window": 4, "sinks": 2, "feature_map": "hedgehog_pm", "gate": "key"}),
    "softmax-map-scalar-gate": ("llama", {"window": 6, "sinks": 3, "feature_map": "softmax", "gate": "scalar",
                                          "rope_max_wavelength": 0}),
    "no-gla-rope": ("llama", {"window": 4, "sinks": 2, "use_rope": False, "feature_map": "softmax"}),
    "softmax-layers": ("qwen2", {"window": 3, "sinks": 1, "softmax_layers": [1]}),
}


class Taken:
    """Counts the hybrid layers' calls that the kernel served."""

    def __init__(self, monkeypatch):
        self.calls = 0
        kernel = gla_attention.hybrid_attention_cpu

        def count(*args, **kwargs):
            self.calls += 1
            return kernel(*args, **kwargs)

        monkeypatch.setattr(gla_attention, "hybrid_attention_cpu", count)


def _general(monkeypatch, fn):
    """fn() with _cpu_prefill declining every call."""
    with monkeypatch.context() as m:
        m.setattr(GLAAttention, "_cpu_prefill", lambda *a: None)
        return fn()


def _prompt_then_steps(model, ids, steps=6):
    """Logits of the prompt and of greedy decode steps after it, and the cache."""
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache, logits = cache_of(out), [out.logits]
        for _ in range(steps):
            out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
            logits.append(out.logits)
    return torch.cat(logits, 1), cache


def _case(case):
    """CASES[case]'s tiny student, its config, and how many of its layers are hybrid."""
    arch, options = CASES[case]
    model = tiny_student(arch, options)
    cfg = model.config
    return model, cfg, cfg.num_hidden_layers - len(cfg.softmax_layers)


@pytest.mark.parametrize("case", list(CASES))
def test_whole_sequences_match_the_general_path(case, monkeypatch):
    model, cfg, hybrid = _case(case)
    W, S = cfg.window, cfg.sinks
    gen = torch.Generator().manual_seed(0)
    for B, T in [(1, 1), (2, W - 1), (1, W), (1, W + S + 1), (2, 37)]:
        ids = torch.randint(1, cfg.vocab_size, (B, T), generator=gen)
        taken = Taken(monkeypatch)
        with torch.no_grad():
            got = model(ids, use_cache=False).logits
            want = _general(monkeypatch, lambda: model(ids, use_cache=False).logits)
        assert taken.calls == hybrid
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_prompts_into_an_empty_cache_match_the_general_path(case, monkeypatch):
    """The prompt's logits, every layer's buffers and state, and decode steps after (the CPU
    decode path, reading those buffers) are the general path's."""
    model, cfg, hybrid = _case(case)
    W, S = cfg.window, cfg.sinks
    gen = torch.Generator().manual_seed(1)
    for B, T in [(1, 1), (1, max(1, S - 1)), (2, W), (1, W + S + 1), (2, 29)]:
        ids = torch.randint(1, cfg.vocab_size, (B, T), generator=gen)
        taken = Taken(monkeypatch)
        got, cache = _prompt_then_steps(model, ids)
        assert taken.calls == hybrid
        want, general = _general(monkeypatch, lambda: _prompt_then_steps(model, ids))
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        assert_same_cache(cache, general)


def test_wrapped_feature_maps_run_their_forward(monkeypatch):
    """Maps that are not plain FeatureMaps (peft's wrappers, say) are called as modules."""
    model = tiny_student("llama", {"window": 4, "sinks": 2, "feature_map": "hedgehog_pm"})
    calls = []

    class Wrapped(FeatureMap):
        def forward(self, *args):
            calls.append(1)
            return super().forward(*args)

    for layer in model.model.layers:
        layer.self_attn.q_map.__class__ = Wrapped
    ids = torch.randint(1, 128, (2, 13), generator=torch.Generator().manual_seed(4))
    taken = Taken(monkeypatch)
    got, cache = _prompt_then_steps(model, ids, steps=2)
    assert taken.calls == 3 and calls
    want, general = _general(monkeypatch, lambda: _prompt_then_steps(model, ids, steps=2))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert_same_cache(cache, general)


def test_the_general_path_takes_what_the_kernel_declines(monkeypatch):
    """Gradients, padding, packed documents, a cache that holds tokens already, positions that do
    not start at 0, a state per query head, a sparse cache, bfloat16: no call reaches the kernel."""
    model = tiny_student("llama", {"window": 4, "sinks": 2})
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    taken = Taken(monkeypatch)
    model(ids, use_cache=False)                                                  # gradients on
    with torch.no_grad():
        model(ids, attention_mask=mask, use_cache=True)
        model(ids[:1], cu_seqlens=torch.tensor([0, 5, 12]), use_cache=False)
        model(ids, position_ids=torch.arange(3, 15)[None], use_cache=True)
    assert taken.calls == 0
    with torch.no_grad():
        cache = cache_of(model(ids[:, :7], use_cache=True))                       # kernel, 3 layers
        model(ids[:, 7:], past_key_values=cache, use_cache=True)                   # general path
    assert taken.calls == 3
    for options in ({"state_heads": "query"}, {"sparse_cache": 2}):
        other = tiny_student("llama", {"window": 4, "sinks": 2, **options})
        with torch.no_grad():
            other(ids, use_cache=True)
    with torch.no_grad():
        model.to(torch.bfloat16)(ids, use_cache=False)
    assert taken.calls == 3


def test_a_prompt_in_two_calls_matches_the_whole_prompt(monkeypatch):
    """The kernel's buffers and state carry on through the general path's second call."""
    model = tiny_student("llama", {"window": 4, "sinks": 2, "softmax_layers": [2]})
    ids = torch.randint(1, 128, (1, 23), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = model(ids, use_cache=False).logits
        first = model(ids[:, :10], use_cache=True)
        second = model(ids[:, 10:], past_key_values=cache_of(first), use_cache=True)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), whole, atol=2e-5, rtol=1e-5)


def test_a_mask_of_ones_is_no_mask(monkeypatch):
    """generate() passes a mask of ones with every prompt: the kernel takes it, with the
    unmasked call's logits."""
    model = tiny_student("llama", {"window": 4, "sinks": 2})
    ids = torch.randint(1, 128, (2, 11), generator=torch.Generator().manual_seed(5))
    taken = Taken(monkeypatch)
    with torch.no_grad():
        got = model(ids, attention_mask=torch.ones_like(ids), use_cache=True).logits
    assert taken.calls == 3
    with torch.no_grad():
        want = _general(monkeypatch, lambda: model(ids, use_cache=True).logits)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
