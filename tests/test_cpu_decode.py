"""Decode steps on the CPU through the cache's DecodeRings (GLAAttention._cpu_decode): the same
logits, states and buffers as the general path (stream, cached_softmax_attention), while the
window and the sinks fill and after, with left padding, beside softmax layers, with a prompt
read in between; and the cases it leaves to the general path."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_cache, tiny_student

from glaswap.layers.gla_attention import GLAAttention
from glaswap.models.modeling_glaswap import cache_of

# (teacher arch, GLA options)
CASES = {
    "sinks": ("llama", {"window": 4, "sinks": 2}),
    "no-sinks-learned-mix": ("llama", {"window": 3, "sinks": 0, "window_mix": "learned"}),
    "qwen3-qk-norms": ("qwen3", {"window": 5, "sinks": 1}),
    "state-per-query-head": ("qwen3", {"window": 4, "sinks": 3, "state_heads": "query", "gate": "scalar"}),
    "hedgehog-pm-key-gate": ("llama", {"window": 4, "sinks": 2, "feature_map": "hedgehog_pm", "gate": "key"}),
    "softmax-map-all-rotated": ("llama", {"window": 6, "sinks": 2, "feature_map": "softmax",
                                          "rope_max_wavelength": 0}),
    "no-gla-rope": ("llama", {"window": 4, "sinks": 2, "use_rope": False, "feature_map": "softmax"}),
    "softmax-layers": ("llama", {"window": 3, "sinks": 1, "softmax_layers": [1]}),
    "qkv-bias-softmax-layers": ("qwen2", {"window": 4, "sinks": 2, "softmax_layers": [0, 2]}),
}
# (rows, prompt length, left padding of the last row): a 1-token prompt (the sinks fill by
# decode steps, which the general path takes), shorter than the window, longer, padded
PROMPTS = [(1, 1, 0), (1, 3, 0), (2, 7, 2), (1, 9, 0)]
STEPS = 11


class Taken:
    """Counts the layers' steps through the CPU path (hybrid and softmax layers apart)."""

    def __init__(self, monkeypatch):
        self.hybrid = self.softmax = 0
        hybrid, softmax = GLAAttention._hybrid_decode, GLAAttention._softmax_decode

        def count_hybrid(*args):
            self.hybrid += 1
            return hybrid(*args)

        def count_softmax(*args):
            out = softmax(*args)
            self.softmax += out is not None
            return out

        monkeypatch.setattr(GLAAttention, "_hybrid_decode", count_hybrid)
        monkeypatch.setattr(GLAAttention, "_softmax_decode", count_softmax)


def _decode(model, ids, mask, steps=STEPS):
    """Logits [B, steps + 1, vocab] of greedy decode steps after the prompt (as generate() calls
    them, with the growing mask), and the cache."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        cache, logits = cache_of(out), [out.logits[:, -1]]
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            out = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            token = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits, 1), cache


def _general(model, monkeypatch, *args, **kwargs):
    """What _decode gives through the general path alone."""
    with monkeypatch.context() as m:
        m.setattr(GLAAttention, "_cpu_decode", lambda *a: None)
        return _decode(model, *args, **kwargs)


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_decode_steps_match_the_general_path(case, monkeypatch):
    """Every decode step whose new tokens are no sinks takes the CPU path in every hybrid layer
    (and in the softmax layers where no padding was written); the logits, the states, the
    buffers turned back and the KV buffers are the general path's."""
    arch, options = CASES[case]
    model = tiny_student(arch, options)
    cfg = model.config
    hybrid = cfg.num_hidden_layers - len(cfg.softmax_layers)
    gen = torch.Generator().manual_seed(0)
    for B, T, pad in PROMPTS:
        ids = torch.randint(1, cfg.vocab_size, (B, T), generator=gen)
        mask = torch.ones(B, T, dtype=torch.long)
        mask[-1, :pad] = 0
        taken = Taken(monkeypatch)
        got, cache = _decode(model, ids, mask)
        # step j's new token of row b stands at position (real tokens of b) + j
        fast = sum(min(T - (pad if b == B - 1 else 0) for b in range(B)) + j >= cfg.sinks for j in range(STEPS))
        assert taken.hybrid == hybrid * fast, (B, T, pad)
        assert taken.softmax == (len(cfg.softmax_layers) * fast if not pad else 0)
        want, general = _general(model, monkeypatch, ids, mask)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        assert_same_cache(cache, general)


def test_cpu_decode_leaves_a_sparse_cache_to_the_general_path(monkeypatch):
    model = tiny_student("llama", {"window": 4, "sinks": 1, "sparse_cache": 2, "softmax_layers": [1]})
    ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    taken = Taken(monkeypatch)
    _decode(model, ids, torch.ones_like(ids))
    assert taken.hybrid == taken.softmax == 0


def test_prompts_and_decode_steps_in_turn_match_the_whole_sequence(monkeypatch):
    """Decode steps (the CPU path), a prompt of several tokens (the general path, which reads the
    buffers back), decode steps again: the whole sequence's logits."""
    model = tiny_student("llama", {"window": 4, "sinks": 2, "softmax_layers": [2]})
    ids = torch.randint(1, 128, (1, 24), generator=torch.Generator().manual_seed(0))
    cuts = [(0, 5)] + [(t, t + 1) for t in range(5, 11)] + [(11, 17)] + [(t, t + 1) for t in range(17, 24)]
    taken = Taken(monkeypatch)
    with torch.no_grad():
        whole = model(ids, use_cache=False).logits
        cache, logits = None, []
        for a, b in cuts:
            out = model(ids[:, a:b], past_key_values=cache, use_cache=True)
            cache = cache_of(out)
            logits.append(out.logits)
    assert taken.hybrid == 2 * 13 and taken.softmax == 13
    torch.testing.assert_close(torch.cat(logits, 1), whole, atol=2e-5, rtol=1e-5)


def test_cpu_decode_runs_hooked_projections_and_outside_states(monkeypatch):
    """A forward hook on a projection still fires (the layer runs the module, not its weight);
    a state put in the cache from outside sends the step to the general path, exactly."""
    model = tiny_student("llama", {"window": 3, "sinks": 1})
    ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    want, _ = _general(model, monkeypatch, ids, torch.ones_like(ids))
    calls = []
    handle = model.model.layers[1].self_attn.q_proj.register_forward_hook(lambda *a: calls.append(1))
    taken = Taken(monkeypatch)
    got, _ = _decode(model, ids, torch.ones_like(ids))
    handle.remove()
    assert len(calls) == STEPS + 1 and taken.hybrid == 3 * STEPS
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)

    taken = Taken(monkeypatch)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache, logits = cache_of(out), [out.logits[:, -1]]
        for j in range(STEPS):
            if j == 4:
                cache.states = [None if s is None else s.clone() for s in cache.states]
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    assert taken.hybrid == 3 * (STEPS - 1)              # step 4 went the general way, then rings again
    torch.testing.assert_close(torch.stack(logits, 1), want, atol=2e-5, rtol=1e-5)


def test_cpu_decode_steps_after_inference_mode(monkeypatch):
    """Rings made under torch.inference_mode hold inference tensors, which take no in-place write
    outside it: a step outside goes the general way once, then through new rings."""
    model = tiny_student("llama", {"window": 3, "sinks": 1})
    ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    want, _ = _general(model, monkeypatch, ids, torch.ones_like(ids), steps=6)
    taken = Taken(monkeypatch)
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        cache, logits = cache_of(out), [out.logits[:, -1]]
        for _ in range(3):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    with torch.no_grad():
        for _ in range(3):
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    assert taken.hybrid == 3 * 5
    torch.testing.assert_close(torch.stack(logits, 1), want, atol=2e-5, rtol=1e-5)
