"""Generation with converted models: the recurrent-state cache under Hugging Face generate(),
the CUDA-graph decode path (its buffer logic on CPU, the graph itself on a GPU), the decode
benchmark and `glaswap generate`."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from click.testing import CliRunner
import helpers
from helpers import randomise_new_parameters, run_without_glaswap, save_teacher, tiny_teacher

from glaswap.cli import main
from glaswap.convert import convert
from glaswap.decode_graph import DecodeGraph, check_decode_graph, disable_decode_graph, enable_decode_graph
from glaswap.errors import GlaswapError
from glaswap.generate import bench_model
from glaswap.models.modeling_glaswap import CACHE_NAME, GLASwapCache, GLASwapForCausalLM, cache_of
from glaswap.runtime import parse_contexts

# name: (teacher arch, tied embeddings, GLA options)
VARIANTS = {
    "llama": ("llama", False, {}),                                                  # lowrank gate, hedgehog
    "qwen3-key": ("qwen3", True, {"gate": "key", "feature_map": "softmax"}),        # q/k norms, tied
    "qwen2-scalar": ("qwen2", False, {"gate": "scalar", "feature_map": "identity", "normalizer": False}),
    "mistral-pm": ("mistral", False, {"feature_map": "hedgehog_pm"}),                # state rows 2 x head dim
    "llama-qstate": ("llama", False, {"state_heads": "query"}),                     # a state per query head
    "llama-window": ("llama", False, {"window": 4, "sinks": 2}),                    # hybrid: exact window + sinks
    "qwen3-window-mix": ("qwen3", True, {"feature_map": "hedgehog_pm", "window": 3, "window_mix": "learned"}),
    # hybrid with a sparse cache: reading with a cache differs from a whole-sequence forward
    "llama-sparse": ("llama", False, {"window": 4, "sinks": 2, "sparse_cache": 3}),
}
# the variants whose cached reading equals a whole-sequence forward
EXACT = [v for v, (_, _, opts) in VARIANTS.items() if not opts.get("sparse_cache")]
PAD = 0


def ascii_tokenizer():
    return helpers.ascii_tokenizer(pad_token="\x00", eos_token="\x03")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Converted tiny models (new parameters randomised) with a tokenizer, one per variant."""
    root = tmp_path_factory.mktemp("gen")
    out = {}
    for name, (arch, tie, options) in VARIANTS.items():
        src = save_teacher(tiny_teacher(arch, tie=tie), root / f"{name}-src")
        folder = root / name
        convert(str(src), folder, options=options, report=False, log=lambda *_: None)
        model = GLASwapForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        randomise_new_parameters(model)
        model.save_pretrained(str(folder))
        ascii_tokenizer().save_pretrained(str(folder))
        out[name] = folder
    return out


def _load(folder, dtype=torch.float32):
    return GLASwapForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()


def _prompts():
    gen = torch.Generator().manual_seed(1)
    return torch.randint(4, 128, (2, 9), generator=gen)


def _left_padded(rows):
    """Left-padded ids and attention mask of prompts of different lengths."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def _greedy(model, ids, mask=None, n=12, **kw):
    return model.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids),
                          max_new_tokens=n, do_sample=False, pad_token_id=PAD, eos_token_id=None, **kw)


# ----------------------------------------------------------------------------- recurrent cache
@pytest.mark.compat
@pytest.mark.parametrize("variant", EXACT)
def test_prefill_then_steps_match_full_forward(folders, variant):
    model = _load(folders[variant])
    ids, mask = _left_padded([list(range(5, 29)), list(range(40, 57))])    # 24 and 17 tokens
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        P = 10
        out = model(ids[:, :P], attention_mask=mask[:, :P], position_ids=pos[:, :P], use_cache=True)
        cache = cache_of(out)
        assert isinstance(cache, GLASwapCache) and cache.get_seq_length() == P
        steps = [out.logits]
        for t in range(P, ids.shape[1]):
            step = model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=pos[:, t:t + 1],
                         past_key_values=cache, use_cache=True)
            steps.append(step.logits)
    assert cache.get_seq_length() == ids.shape[1]
    inc = torch.cat(steps, dim=1)
    real = mask.bool()
    torch.testing.assert_close(inc[real], full[real], rtol=1e-4, atol=1e-4)


@pytest.mark.compat
def test_sparse_cache_prefill_choosing_every_step_matches_steps(folders, monkeypatch):
    """A sparse cache chooses once per SPARSE_BLOCK new tokens: a prefill choosing at every
    step reads a left-padded batch as decode steps do, and every slot fills."""
    from glaswap.layers import hybrid_cache

    monkeypatch.setattr(hybrid_cache, "SPARSE_BLOCK", 1)
    model = _load(folders["llama-sparse"])
    ids, mask = _left_padded([list(range(5, 29)), list(range(40, 57))])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, position_ids=pos, use_cache=True)
        P = 10                                         # a decode step's token is never padding
        out = model(ids[:, :P], attention_mask=mask[:, :P], position_ids=pos[:, :P], use_cache=True)
        steps = [out.logits]
        for t in range(P, ids.shape[1]):
            steps.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=pos[:, t:t + 1],
                               past_key_values=cache_of(out), use_cache=True).logits)
    real = mask.bool()
    torch.testing.assert_close(torch.cat(steps, 1)[real], full.logits[real], rtol=1e-4, atol=1e-4)
    for buf in cache_of(full).windows:
        assert (buf.sparse.positions >= 0).all()
    assert not torch.allclose(full.logits[real], model(ids, attention_mask=mask, use_cache=False).logits[real])


@pytest.mark.compat
@pytest.mark.parametrize("variant, mode", [("llama", "gla"), ("qwen3-key", "gla"), ("llama", "softmax"),
                                           ("llama-window", "gla"), ("qwen3-window-mix", "gla")])
def test_left_padded_forward_without_positions_matches_each_row_alone(folders, variant, mode):
    """Positions come from the attention mask: a left-padded row numbers its tokens from 0."""
    model = _load(folders[variant])
    rows = [list(range(5, 29)), list(range(40, 57)), list(range(90, 96))]
    ids, mask = _left_padded(rows)
    with torch.no_grad(), model.attention_mode(mode):
        padded = model(ids, attention_mask=mask, use_cache=False).logits
        for i, r in enumerate(rows):
            alone = model(torch.tensor([r]), use_cache=False).logits[0]
            torch.testing.assert_close(padded[i, -len(r):], alone, rtol=1e-4, atol=1e-4)


@pytest.mark.compat
@pytest.mark.parametrize("variant", ["llama", "llama-window"])
def test_left_padded_decode_without_positions_matches_each_row_alone(folders, variant):
    model = _load(folders[variant])
    rows = [list(range(5, 29)), list(range(40, 57))]
    ids, mask = _left_padded(rows)
    P = 10
    with torch.no_grad():
        out = model(ids[:, :P], attention_mask=mask[:, :P], use_cache=True)
        steps = [out.logits]
        for t in range(P, ids.shape[1]):
            steps.append(model(ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache_of(out),
                               use_cache=True).logits)
        inc = torch.cat(steps, dim=1)
        for i, r in enumerate(rows):
            alone = model(torch.tensor([r]), use_cache=False).logits[0]
            torch.testing.assert_close(inc[i, -len(r):], alone, rtol=1e-4, atol=1e-4)


def test_a_mask_of_the_wrong_width_is_refused(folders):
    model = _load(folders["llama"])
    ids = _prompts()
    with torch.no_grad():
        cache = cache_of(model(ids, use_cache=True))
        with pytest.raises(ValueError, match="attention_mask has 4 columns"):
            model(ids[:, :1], attention_mask=torch.ones(2, 4, dtype=torch.long), past_key_values=cache)


@pytest.mark.compat
@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_decode_takes_the_cache_under_either_name(folders, name):
    model = _load(folders["llama"])
    ids = _prompts()
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :5], use_cache=True)
        cache = cache_of(out)
        steps = [out.logits] + [model(ids[:, t:t + 1], use_cache=True, **{name: cache}).logits for t in range(5, 9)]
    assert cache.seen_tokens == 9
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.compat
def test_a_cache_under_a_foreign_name_is_refused(folders):
    model = _load(folders["llama"])
    ids = _prompts()
    with torch.no_grad():
        cache = cache_of(model(ids, use_cache=True))
        for kw in ({"cache_params": cache}, {"state": None}, {"my_cache": cache}):
            with pytest.raises(ValueError, match=f"not {next(iter(kw))}="):
                model(ids[:, :1], use_cache=True, **kw)
            with pytest.raises(ValueError, match=f"not {next(iter(kw))}="):
                model.model(ids[:, :1], use_cache=True, **kw)
        with pytest.raises(ValueError, match="both cache= and past_key_values="):
            model(ids[:, :1], cache=cache, past_key_values=GLASwapCache(model.config.num_hidden_layers))
        assert cache.seen_tokens == 9  # nothing ran


def test_triton_decode_step_matches_triton_prefill(folders):
    """The decode path that runs on CUDA (Triton recurrent kernel after a Triton chunk prefill),
    here under the Triton interpreter."""
    from glaswap_kernels import HAS_TRITON

    if not HAS_TRITON or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs Triton on CUDA or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = _load(folders["llama"]).to(device)
    model.config.gla_backend = "triton"
    ids = torch.randint(4, 128, (2, 12), generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :8], use_cache=True)
        steps = [out.logits]
        for t in range(8, 12):
            steps.append(model(ids[:, t:t + 1], past_key_values=cache_of(out), use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant, rows", [("llama", 1), ("mistral-pm", 2), ("llama-qstate", 1)])
def test_cache_states_are_constant_size(folders, variant, rows):
    model = _load(folders[variant])
    cfg = model.config
    sizes = []
    with torch.no_grad():
        for T in (5, 50):
            cache = cache_of(model(torch.randint(0, 128, (1, T)), use_cache=True))
            sizes.append([tuple(s.shape) for s in cache.states])
    heads = cfg.num_attention_heads if cfg.state_heads == "query" else cfg.num_key_value_heads
    assert heads < cfg.num_attention_heads or variant == "llama-qstate"
    assert sizes[0] == sizes[1] == [(1, heads, rows * cfg.head_dim, cfg.head_dim + 1)] * 2


def test_hybrid_cache_is_constant_size(folders):
    """The window buffers hold the last `window` tokens and the sinks whatever the context,
    in memory of that size (less while fewer tokens have been read)."""
    model = _load(folders["llama-window"])
    cfg = model.config
    shapes = []
    with torch.no_grad():
        for T in (3, 50, 60):
            cache = cache_of(model(torch.randint(0, 128, (1, T)), use_cache=True))
            shapes.append([[tuple(t.shape) for t in w.tensors()] for w in cache.windows])
            # and own only that: a view into the prefill's keys would keep all T of them alive
            for w in cache.windows:
                for k, t in enumerate(w.tensors()):
                    assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), (T, k)
            pos = cache.windows[0].window.positions[0].tolist()
            assert pos == list(range(max(0, T - cfg.window), T))
            assert cache.windows[0].sinks.positions[0].tolist() == list(range(min(T, cfg.sinks)))
            # decode steps keep at most one row more than the window
            for _ in range(3):
                cache = cache_of(model(torch.randint(0, 128, (1, 1)), past_key_values=cache, use_cache=True))
            for w in cache.windows:
                for t in w.window.tensors():
                    rows = t.shape[1]
                    assert t.untyped_storage().nbytes() <= t.numel() * t.element_size() * (rows + 1) // rows
    assert shapes[0] != shapes[1] == shapes[2]
    buf = cache.windows[0]
    assert tuple(buf.window.keys.shape) == (1, cfg.window, cfg.num_key_value_heads, cfg.head_dim)
    assert tuple(buf.sinks.keys.shape) == (1, cfg.sinks, cfg.num_key_value_heads, cfg.head_dim)


@pytest.mark.compat
@pytest.mark.parametrize("variant", EXACT)
def test_greedy_same_tokens_with_and_without_cache(folders, variant):
    model = _load(folders[variant])
    ids = _prompts()
    with_cache = _greedy(model, ids, use_cache=True)
    without = _greedy(model, ids, use_cache=False)
    assert with_cache.shape == (2, 9 + 12)
    assert torch.equal(with_cache, without)


@pytest.mark.compat
@pytest.mark.parametrize("variant", ["llama", "qwen3-key", "llama-window", "qwen3-window-mix", "llama-sparse"])
def test_left_padded_batch_matches_each_row_alone(folders, variant):
    model = _load(folders[variant])
    rows = [[7, 33, 91, 12, 5, 60, 61, 2, 99], [44, 18, 70], [3, 3, 120, 8, 17]]
    ids, mask = _left_padded(rows)
    batch = _greedy(model, ids, mask)
    for i, r in enumerate(rows):
        alone = _greedy(model, torch.tensor([r]))
        assert torch.equal(batch[i, ids.shape[1]:], alone[0, len(r):]), i


@pytest.mark.compat
@pytest.mark.parametrize("variant", ["llama", "llama-window"])
def test_beam_search_reorders_the_cache(folders, variant):
    model = _load(folders[variant])
    ids, mask = _left_padded([[7, 33, 91, 12, 5], [44, 18, 70]])
    kw = dict(num_beams=3, num_return_sequences=2, n=8)
    with_cache = _greedy(model, ids, mask, use_cache=True, **kw)
    without = _greedy(model, ids, mask, use_cache=False, **kw)
    assert with_cache.shape == (4, 5 + 8) and torch.equal(with_cache, without)


@pytest.mark.compat
def test_rolling_back_the_cache_fails_clearly(folders):
    model = _load(folders["llama"])
    cache = GLASwapCache(model.config.num_hidden_layers)
    cache.crop(0)  # a no-op is fine
    with pytest.raises(ValueError, match="cannot be rolled back"):
        cache.crop(-2)
    # Newer transformers refuses an uncroppable cache itself, before asking it to crop.
    with pytest.raises(ValueError, match="cannot be rolled back|requires a cache that can be cropped"):
        _greedy(model, _prompts()[:1], prompt_lookup_num_tokens=2,
                **{CACHE_NAME: GLASwapCache(model.config.num_hidden_layers)})


@pytest.mark.compat
@pytest.mark.parametrize("variant", ["llama", "llama-window"])
def test_generate_after_loading_without_glaswap(folders, tmp_path, variant):
    folder = folders[variant]
    model = _load(folder)
    ids, mask = _left_padded([[7, 33, 91, 12, 5, 60, 61], [44, 18, 70]])
    expected = _greedy(model, ids, mask)
    torch.save({"ids": ids, "mask": mask, "expected": expected}, tmp_path / "case.pt")
    code = f"""
import torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True, dtype=torch.float32).eval()
case = torch.load({str(tmp_path / 'case.pt')!r})
kw = dict(attention_mask=case["mask"], max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
cached = m.generate(case["ids"], use_cache=True, **kw)
uncached = m.generate(case["ids"], use_cache=False, **kw)
print("cache", type(m(case["ids"], use_cache=True).past_key_values).__name__)
print("same", torch.equal(cached, case["expected"]), torch.equal(uncached, case["expected"]))
"""
    proc = run_without_glaswap(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cache GLASwapCache" in proc.stdout
    assert "same True True" in proc.stdout, proc.stdout


# ----------------------------------------------------------------------------- decode graph (buffer logic)
@pytest.fixture
def general_path(monkeypatch):
    """Eager decode steps through the general path (stream), not the CPU one (cache.rings), so
    that the graph's static buffers, which take the general path's operations, compare exactly."""
    from glaswap.layers.gla_attention import GLAAttention

    monkeypatch.setattr(GLAAttention, "_cpu_decode", lambda *args: None)


@pytest.mark.parametrize("variant", ["llama", "qwen2-scalar", "llama-window", "qwen3-window-mix", "llama-sparse"])
def test_static_buffer_decode_matches_eager(folders, variant, general_path):
    """The graph path's static buffers, run eagerly ("replay"): the same logits, exactly."""
    model = _load(folders[variant])
    ids, mask = _left_padded([[7, 33, 91, 12, 5, 60, 61], [44, 18, 70]])
    kw = dict(output_logits=True, return_dict_in_generate=True)
    eager = _greedy(model, ids, mask, **kw)
    runner = enable_decode_graph(model, backend="replay")
    replayed = _greedy(model, ids, mask, **kw)
    assert sorted(runner.steps) == [2]
    assert torch.equal(eager.sequences, replayed.sequences)
    for a, b in zip(eager.logits, replayed.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    beams = _greedy(model, ids, mask, num_beams=3, n=6)     # reorder_cache gives the runner new tensors
    disable_decode_graph(model)
    assert torch.equal(beams, _greedy(model, ids, mask, num_beams=3, n=6))


@pytest.mark.parametrize("variant", ["llama", "llama-window", "llama-sparse"])
def test_static_buffer_decode_keeps_interleaved_caches_apart(folders, variant, general_path):
    model = _load(folders[variant])
    prompts = [torch.tensor([[5, 9, 77, 3]]), torch.tensor([[100, 2, 31, 64, 8, 8]])]

    def run(steps=6):
        with torch.no_grad():
            caches, tokens, logits = [], [], []
            for p in prompts:
                out = model(p, use_cache=True)
                caches.append(cache_of(out))
                tokens.append(out.logits[:, -1:].argmax(-1))
            for _ in range(steps):
                for i in range(2):      # alternate: each step hands the buffers to the other cache
                    out = model(tokens[i], past_key_values=caches[i], use_cache=True)
                    tokens[i] = out.logits[:, -1:].argmax(-1)
                    logits.append(out.logits)
        return torch.cat(logits), caches

    eager, eager_caches = run()
    enable_decode_graph(model, backend="replay")
    replayed, replay_caches = run()
    torch.testing.assert_close(replayed, eager, rtol=0, atol=1e-6)
    for a, b in zip(eager_caches, replay_caches):
        assert a.seen_tokens == b.seen_tokens
        for sa, sb in zip(a.states, b.states):
            torch.testing.assert_close(sb, sa, rtol=0, atol=1e-6)
        for wa, wb in zip(a.windows, b.windows):
            for ta, tb in zip(wa.tensors() if wa is not None else [], wb.tensors() if wb is not None else [],
                              strict=True):
                torch.testing.assert_close(tb, ta, rtol=0, atol=1e-6)


def _read_in_two_calls(model, ids, keep, steps=4):
    """Logits of a prompt read with a cache in two calls (two full sparse blocks and a rest, then
    one and a rest), then greedy decode steps; and the cache."""
    from glaswap.layers.hybrid_cache import SPARSE_BLOCK

    cut = 2 * SPARSE_BLOCK + 3
    cache = GLASwapCache(model.config.num_hidden_layers)
    with torch.no_grad():
        out = [model(ids[:, :cut], past_key_values=cache, use_cache=True, logits_to_keep=keep).logits,
               model(ids[:, cut:], past_key_values=cache, use_cache=True, logits_to_keep=keep).logits]
        for _ in range(steps):
            out.append(model(out[-1][:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits)
    return out, cache


@pytest.mark.parametrize("keep", [0, 1])
def test_sparse_cache_prompt_blocks_through_the_graph_match_eager(folders, keep):
    """A sparse cache's prompt blocks through the block graph ("replay"): the same logits (all
    rows, or the last), the same cache, the same decode steps after, as an eager forward."""
    from glaswap.layers.hybrid_cache import SPARSE_BLOCK

    model = _load(folders["llama-sparse"])
    ids = torch.randint(3, 120, (2, 3 * SPARSE_BLOCK + 10), generator=torch.Generator().manual_seed(0))
    eager, eager_cache = _read_in_two_calls(model, ids, keep)
    runner = enable_decode_graph(model, backend="replay")
    graphed, graph_cache = _read_in_two_calls(model, ids, keep)
    assert sorted(runner.blocks) == [2] and sorted(runner.steps) == [2]
    assert [t.shape for t in graphed] == [t.shape for t in eager]
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
    assert graph_cache.seen_tokens == eager_cache.seen_tokens == ids.shape[1] + 4
    for sa, sb in zip(eager_cache.states, graph_cache.states):
        torch.testing.assert_close(sb, sa, rtol=0, atol=1e-5)
    for wa, wb in zip(eager_cache.windows, graph_cache.windows):
        for ta, tb in zip(wa.tensors(), wb.tensors(), strict=True):
            torch.testing.assert_close(tb, ta, rtol=0, atol=1e-5)


def test_static_buffer_decode_recaptures_when_weights_move(folders):
    model = _load(folders["llama"])
    ids = _prompts()
    runner = enable_decode_graph(model, backend="replay")
    _greedy(model, ids, n=3)
    old = runner.fingerprint
    model.to(torch.float64)
    replayed = _greedy(model, ids.clone(), n=6, output_logits=True, return_dict_in_generate=True)
    assert runner.fingerprint != old
    disable_decode_graph(model)
    eager = _greedy(model, ids.clone(), n=6, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(replayed.sequences, eager.sequences)
    for a, b in zip(eager.logits, replayed.logits):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-9)


def test_failed_capture_falls_back_to_eager(folders, monkeypatch):
    import glaswap.decode_graph as runner_module

    model = _load(folders["llama"])
    ids = _prompts()
    eager = _greedy(model, ids)

    def broken(*args, **kwargs):
        raise RuntimeError("capture refused")

    monkeypatch.setattr(runner_module, "_StaticStep", broken)
    runner = enable_decode_graph(model, backend="replay")
    with pytest.warns(UserWarning, match="decoding eagerly .RuntimeError: capture refused"):
        assert torch.equal(_greedy(model, ids), eager)
    assert runner.failed == "RuntimeError: capture refused"
    with torch.no_grad():
        assert not runner.accepts(ids[:, :1], None, GLASwapCache(2))
    enable_decode_graph(model, backend="replay", strict=True)
    with pytest.raises(RuntimeError, match="capture refused"):
        _greedy(model, ids)


def test_graph_check_compares_the_two_paths(folders):
    model = _load(folders["qwen3-key"])
    res = check_decode_graph(model, _prompts(), steps=5, backend="replay")
    assert res["steps"] == 5 and res["same_argmax"] and res["max_abs_diff"] < 1e-6 < res["max_abs_logit"]
    assert model.decode_runner is None                      # left as it was found


def test_decode_graph_only_takes_what_it_can_serve(folders):
    model = _load(folders["llama"])
    runner = DecodeGraph(model, backend="replay")
    one, cache = torch.tensor([[4]]), GLASwapCache(2)
    with torch.no_grad():
        assert runner.accepts(one, None, cache)
        assert not runner.accepts(torch.tensor([[4, 5]]), None, cache)      # a prefill
        assert not runner.accepts(one, None, None)                           # no cache
        assert not runner.accepts_prefill(torch.zeros(1, 64, dtype=torch.long), None, None, cache)  # no sparse cache
        with model.attention_mode("softmax"):
            assert not runner.accepts(one, None, cache)
    assert not runner.accepts(one, None, cache)                              # gradients on
    with pytest.raises(ValueError, match="backend"):
        DecodeGraph(model, backend="bogus")


def test_prompt_blocks_only_where_a_sparse_cache_reads_whole_blocks(folders):
    from glaswap.layers.hybrid_cache import SPARSE_BLOCK

    model = _load(folders["llama-sparse"])
    runner = DecodeGraph(model, backend="replay")
    block, cache = torch.zeros(1, SPARSE_BLOCK, dtype=torch.long), GLASwapCache(2)
    with torch.no_grad():
        assert runner.accepts_prefill(block, None, None, cache)
        assert runner.accepts_prefill(block, None, torch.ones_like(block), cache)
        assert not runner.accepts_prefill(block[:, 1:], None, None, cache)             # under a block
        padded = torch.ones_like(block)
        padded[0, 0] = 0
        assert not runner.accepts_prefill(block, None, padded, cache)                   # padding
        assert not runner.accepts_prefill(block, None, None, None)                      # no cache
    assert not runner.accepts_prefill(block, None, None, cache)                         # gradients on


# ----------------------------------------------------------------------------- decode graph on a GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["llama", "llama-window", "llama-sparse"])
def test_cuda_graph_decode_matches_eager_on_gpu(folders, dtype, variant):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = _load(folders[variant], dtype).cuda()
    ids, mask = _left_padded([[7, 33, 91, 12, 5, 60, 61], [44, 18, 70]])
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(output_logits=True, return_dict_in_generate=True, n=16)
    eager = _greedy(model, ids, mask, **kw)
    runner = enable_decode_graph(model)
    graphed = _greedy(model, ids, mask, **kw)
    again = _greedy(model, ids, mask, **kw)                  # replays the graph captured above
    assert sorted(runner.steps) == [2]
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for run in (graphed, again):
        assert torch.equal(run.sequences, eager.sequences)
        for a, b in zip(eager.logits, run.logits):
            torch.testing.assert_close(b, a, rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_prompt_blocks_match_eager_on_gpu(folders, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from glaswap.layers.hybrid_cache import SPARSE_BLOCK

    model = _load(folders["llama-sparse"], dtype).cuda()
    ids = torch.randint(3, 120, (2, 3 * SPARSE_BLOCK + 10), generator=torch.Generator().manual_seed(0)).cuda()
    eager, _ = _read_in_two_calls(model, ids, 0)
    runner = enable_decode_graph(model, strict=True)
    graphed, _ = _read_in_two_calls(model, ids, 0)
    again, _ = _read_in_two_calls(model, ids, 0)               # replays the graphs captured above
    assert sorted(runner.blocks) == [2]
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for run in (graphed, again):
        for a, b in zip(eager, run):
            torch.testing.assert_close(b.float(), a.float(), rtol=tol, atol=tol)


@pytest.mark.gpu
def test_gpu_static_cache_teacher_graph_decodes_what_the_dynamic_cache_does():
    """The fair teacher baseline: a static KV cache replayed from a CUDA graph continues the
    same greedy sequence as Hugging Face's dynamic cache (fp32; bf16 runs the same graph)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from glaswap.generate import time_decode, time_decode_static

    prompt = torch.randint(4, 128, (2, 300), generator=torch.Generator().manual_seed(3)).cuda()
    teacher = tiny_teacher("llama").cuda().eval()
    dynamic = time_decode(teacher, prompt, 6)
    static = time_decode_static(teacher, prompt, 6, graph=True)
    assert static["graph"] and static["last_token"] == dynamic["last_token"], (static, dynamic)
    static = time_decode_static(teacher.to(torch.bfloat16), prompt, 6, graph=True)
    assert static["graph"] and static["ms_per_step"] > 0


@pytest.mark.gpu
def test_gpu_decode_memory_is_flat_in_context(folders):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from glaswap.generate import bench_decode

    model = _load(folders["llama"], torch.bfloat16).cuda()
    rows = bench_decode(model, None, contexts=[256, 4096], new_tokens=8, graph="on", log=lambda *_: None)
    assert all("graph_error" not in r for r in rows) and rows[0]["graph_check"]["same_argmax"], rows
    peaks = [r["student_graph"]["peak_gib"] for r in rows]
    assert abs(peaks[1] - peaks[0]) < 0.01, peaks


# ----------------------------------------------------------------------------- bench and CLI
@pytest.mark.parametrize("variant", ["llama", "llama-window"])
def test_bench_on_cpu_writes_table_json_and_png(folders, tmp_path, variant):
    lines = []
    res = bench_model(folders[variant], contexts=[8, 40], new_tokens=3, out=tmp_path / "b", log=lines.append)
    rows = res["rows"]
    assert [r["context"] for r in rows] == [8, 40]
    for r in rows:
        for who in ("student", "student_eager", "teacher", "teacher_static"):
            assert r[who]["ms_per_step"] > 0 and r[who]["tokens_per_s"] > 0
            assert r[who]["peak_gib"] is None                       # measured on CUDA only
        # the static cache decodes the same tokens as the dynamic one; speedup is against the faster
        assert r["teacher_static"]["last_token"] == r["teacher"]["last_token"] and not r["teacher_static"]["graph"]
        best = max(r["teacher"]["tokens_per_s"], r["teacher_static"]["tokens_per_s"])
        assert r["speedup"] == pytest.approx(r["student"]["tokens_per_s"] / best)
    assert "student_graph" not in rows[0]                           # no graph path on CPU
    text = "\n".join(lines)
    assert "GLA ms/tok" in text and "teacher ms/tok" in text and "static ms/tok" in text
    saved = json.loads((tmp_path / "b" / "decode_bench.json").read_text())
    assert saved["rows"][1]["context"] == 40
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "b" / "decode_bench.png").read_bytes()[:4] == b"\x89PNG"
    else:  # plots are an extra (glaswap[plots])
        assert not (tmp_path / "b" / "decode_bench.png").exists() and "no PNG" in res["outputs"]["png"]


def test_parse_contexts():
    assert parse_contexts("1024, 4K,16k") == [1024, 4096, 16384]
    with pytest.raises(GlaswapError, match="invalid context"):
        parse_contexts("1024,lots")
    with pytest.raises(GlaswapError, match="at least 1"):
        parse_contexts("0")


def _cli(*args):
    return CliRunner().invoke(main, ["generate", *map(str, args)])


def test_cli_generate_streams_text(folders):
    result = _cli(folders["llama"], "--prompt", "the river", "--max-new-tokens", "6")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("the river")
    assert "6 tokens in" in result.output


def test_cli_generate_sampling_is_seeded(folders):
    args = (folders["llama"], "--prompt", "snow", "--max-new-tokens", "8", "--temperature", "1.5")
    a, b, c = (_cli(*args, "--seed", seed).output.rsplit("\n[", 1)[0] for seed in ("3", "3", "4"))
    assert a.startswith("snow") and a == b and a != c


def test_cli_generate_bench(folders, tmp_path):
    result = _cli(folders["llama"], "--bench", "--contexts", "8,16", "--new-tokens", "2", "--out", tmp_path)
    assert result.exit_code == 0, result.output
    assert "speedup" in result.output and (tmp_path / "decode_bench.json").is_file()


@pytest.mark.parametrize("args, needle", [
    (("--prompt", "  "), "prompt is empty"),
    (("--bench", "--contexts", "8,x"), "invalid context"),
    (("--prompt", "hi", "--graph", "on"), "needs a CUDA GPU"),
    (("--bench", "--teacher", "self"), "no KV cache"),
])
def test_cli_generate_bad_input(folders, args, needle):
    if "--graph" in args and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    result = _cli(folders["llama"], *args)
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert result.exit_code != 0 and len(lines) == 1 and lines[0].startswith("Error:"), result.output
    assert needle in lines[0]


def test_cli_generate_not_a_glaswap_model(tmp_path):
    src = save_teacher(tiny_teacher("llama"), tmp_path / "plain")
    result = _cli(src, "--prompt", "hi")
    assert result.exit_code != 0 and result.output.strip().startswith("Error:")
    assert "not a glaswap model" in result.output and len(result.output.strip().splitlines()) == 1


def test_cli_generate_without_prompt(folders):
    result = _cli(folders["llama"], "--max-new-tokens", "3")
    assert result.exit_code != 0 and "--prompt" in result.output


# ----------------------------------------------------------------------------- the random-model benchmark
def test_bench_random_model(tmp_path, monkeypatch):
    """What benchmarks/bench_generate.py runs without a model folder: a random tiny Llama
    against its conversion, the table logged and decode_bench.json written."""
    monkeypatch.syspath_prepend(str(helpers.REPO / "benchmarks"))
    from random_models import bench_random

    lines = []
    bench_random("tiny", contexts=[8, 16], new_tokens=2, dtype="float32", out=tmp_path / "out", log=lines.append)
    output = "\n".join(lines)
    table = output[output.index("context"):]
    assert "speedup" in table and len([line for line in table.splitlines() if line.strip()]) >= 3, output
    assert json.loads((tmp_path / "out" / "decode_bench.json").read_text())["rows"][0]["context"] == 8


def test_decode_memory_parts(tmp_path, monkeypatch):
    """benchmarks/decode_memory.py's accounting of a mixed cache: the softmax layer's KV (keys
    and values, their slots' flags and positions apart), the hybrid layers' states and windows,
    each in bytes as the cache holds them; without CUDA the script stops with one line."""
    monkeypatch.syspath_prepend(str(helpers.REPO / "benchmarks"))
    from decode_memory import GIB, cache_parts, main
    from random_models import random_models

    student, _ = random_models("tiny", torch.float32, torch.device("cpu"), tmp_path,
                               options={"window": 4, "sinks": 1, "softmax_layers": [1]})
    with torch.no_grad():
        cache = cache_of(student(input_ids=torch.randint(0, 256, (1, 40)), use_cache=True, logits_to_keep=1))
    parts = cache_parts(cache)
    cfg = student.config
    kv = cache.kv[1]
    assert parts["kv_tokens"] == 40 and parts["kv_slots"] == [kv.capacity] and kv.capacity >= 40
    assert parts["kv"] * GIB == 2 * kv.capacity * cfg.num_key_value_heads * cfg.head_dim * 4
    assert parts["kv_slot_meta"] * GIB == kv.capacity * (1 + 8)          # bool flag, long position
    assert parts["states"] * GIB == cache.states[0].numel() * 4 and cache.states[1] is None
    assert parts["windows"] > 0
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA"):
            main([])


# ----------------------------------------------------------------------------- real model
@pytest.mark.slow
def test_real_smollm2_generates_the_same_with_and_without_cache(smollm2_gla):
    from transformers import AutoTokenizer

    folder, _ = smollm2_gla
    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)
    tok.pad_token = tok.pad_token or tok.eos_token
    model = _load(folder)
    enc = tok(["The river that runs through the valley", "Testing is how"], return_tensors="pt",
              padding=True, padding_side="left")
    kw = dict(attention_mask=enc.attention_mask, max_new_tokens=8, do_sample=False,
              pad_token_id=tok.pad_token_id)
    cached = model.generate(enc.input_ids, use_cache=True, **kw)
    assert torch.equal(cached, model.generate(enc.input_ids, use_cache=False, **kw))
    with torch.no_grad():
        ids = cached[:1]
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :10], use_cache=True)
        steps = [out.logits] + [model(ids[:, t:t + 1], past_key_values=cache_of(out),
                                      use_cache=True).logits for t in range(10, ids.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-3, atol=1e-3)


def test_cli_sparse_cache(folders):
    """--sparse-cache sets a hybrid model's cache for the run; a pure GLA model refuses it in one line."""
    result = _cli(folders["llama-window"], "--prompt", "the river", "--max-new-tokens", "4", "--sparse-cache", "2")
    assert result.exit_code == 0, result.output
    result = _cli(folders["llama"], "--prompt", "the river", "--sparse-cache", "2")
    assert result.exit_code != 0 and "is pure GLA" in result.output and "--sparse-cache" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("variant", ["llama-window", "qwen3-window-mix"])
def test_prompts_read_into_a_cache_take_the_window_kernel(folders, variant, monkeypatch):
    """A prompt into an empty cache, and one after a full cache (chat turns), read through the
    whole-sequence window kernel, never the buffer read, and give the whole-sequence logits
    and the buffers a token-by-token read leaves."""
    from glaswap.layers import gla_attention, hybrid_cache

    model = _load(folders[variant])
    ids = torch.tensor([[(7 * i + 3) % 120 + 1 for i in range(40)]])
    cuts = [(0, 13), (13, 14), (14, 31), (31, 40)]          # a prompt, a decode step, two more prompts
    with torch.no_grad():
        whole = model(ids, use_cache=False).logits
        slow = model(ids[:, :1], use_cache=True)
        for t in range(1, ids.shape[1]):
            slow = model(ids[:, t:t + 1], past_key_values=cache_of(slow), use_cache=True)
        real = hybrid_cache.window_over_buffer

        def decode_only(q_r, *args, **kwargs):
            assert q_r.shape[1] == 1, "a prompt went through the buffer read"
            return real(q_r, *args, **kwargs)

        monkeypatch.setattr(hybrid_cache, "window_over_buffer", decode_only)
        orders = []     # how each prompt stands to the cache is found once per call, not per layer
        monkeypatch.setattr(gla_attention, "prompt_order",
                            lambda *a: orders.append(hybrid_cache.prompt_order(*a)) or orders[-1])
        cache, logits = None, []
        for a, b in cuts:
            out = model(ids[:, a:b], past_key_values=cache, use_cache=True)
            cache = cache_of(out)
            logits.append(out.logits)
    assert orders == ["empty", "full", "full"]
    torch.testing.assert_close(torch.cat(logits, 1), whole, rtol=1e-4, atol=1e-4)
    for mine, theirs in zip(cache.windows, cache_of(slow).windows):
        for x, y in zip(mine.tensors(), theirs.tensors()):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    for x, y in zip(cache.states, cache_of(slow).states):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
