"""Mixed models (convert --softmax-layers): layers that keep the teacher's attention beside GLA
and hybrid layers, their KV caches, the decode graph over them, saved folders, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from helpers import randomise_new_parameters, read_json, run_without_glaswap, save_teacher, tiny_teacher

import glaswap.decode_graph as decode_graph
import glaswap.layers.softmax_attention as softmax_attention
from glaswap.cli import main
from glaswap.convert import convert, glaswap_config
from glaswap.decode_graph import check_decode_graph, disable_decode_graph, enable_decode_graph
from glaswap.models.gla_options import parse_auto, parse_softmax_layers
from glaswap.models.modeling_glaswap import GLASwapCache, GLASwapForCausalLM

LAYERS = 4
# name: (teacher arch, GLA options)
VARIANTS = {
    "llama": ("llama", {"softmax_layers": [1, 3]}),
    "qwen3": ("qwen3", {"softmax_layers": [0, 2], "gate": "scalar"}),                # q/k norms
    "window": ("llama", {"softmax_layers": [2], "window": 3, "sinks": 1}),           # hybrid beside softmax
    "sparse": ("llama", {"softmax_layers": [0, 3], "window": 3, "sinks": 1, "sparse_cache": 2}),
    "mistral-sliding": ("mistral", {"softmax_layers": [1, 2]}),                    # the teacher's sliding window
    "capped": ("llama", {"softmax_layers": [1, 3], "softmax_max_distance": 4}),    # distances past 4 capped
    "capped-window": ("llama", {"softmax_layers": [0, 2], "window": 3, "sinks": 1, "softmax_max_distance": 5}),
}
EXACT = [v for v, (_, opts) in VARIANTS.items() if not opts.get("sparse_cache")]


def _teacher(arch, seed=0):
    return tiny_teacher(arch, seed=seed, layers=LAYERS)


def _student(variant, seed=0):
    arch, options = VARIANTS[variant]
    teacher = _teacher(arch, seed)
    cfg = teacher.config.to_dict()
    if variant == "mistral-sliding":
        cfg["sliding_window"] = 5
    model = GLASwapForCausalLM(glaswap_config(cfg, options))
    missing, unexpected = model.load_state_dict(teacher.state_dict(), strict=False)
    assert not unexpected and set(missing) == set(model.new_parameter_names())
    randomise_new_parameters(model)
    return model.eval()


def _left_padded(rows, width=None):
    width = width or max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask


def _ids(B, T, seed=1):
    return torch.randint(1, 128, (B, T), generator=torch.Generator().manual_seed(seed))


def _kv_contents(cache, layer):
    b = cache.kv[layer]
    return b.keys[:, :, :b.length], b.values[:, :, :b.length], b.valid[:, :b.length]


# ----------------------------------------------------------------------------- the option
def test_parse_softmax_layers_and_auto():
    assert parse_softmax_layers("9, 3,15", 16) == [3, 9, 15]
    assert parse_softmax_layers([2, 0], 3) == [0, 2] and parse_softmax_layers("", 3) == []
    assert parse_softmax_layers("[1, 2]", 3) == [1, 2]                 # a list printed as text
    assert parse_auto("auto:6") == 6 and parse_auto([1, 2]) is None and parse_auto("3,9") is None
    for bad, needle in [("auto:0", "N >= 1"), ("auto:x", "auto:N with a whole number"), ("auto", "auto:N"),
                        ("auto:-2", "auto:N")]:
        with pytest.raises(ValueError, match=needle):
            parse_auto(bad)
    for bad, needle in [("1,1", "layer 1 is listed twice"), ("-1", "negative"), ("3,16", "layer 16 is out of range"),
                        ("1.5", "whole-number"), ([True], "whole-number"), ("a,b", "whole-number"),
                        ("auto:4", "in a recipe"), ("auto:0", "N >= 1"), ("even:0", "even:N with a whole number"),
                        ("last", "last:N with a whole number"), ("even:17", "more layers than the model's 16")]:
        with pytest.raises(ValueError, match=needle):
            parse_softmax_layers(bad, 16)


def test_placements_by_rule():
    """even:N spreads N layers over the depth (the middle of each of N equal stretches), last:N
    takes the last N; every count from 1 to the depth gives N distinct layers in range."""
    assert parse_softmax_layers("even:6", 30) == [2, 7, 12, 17, 22, 27]
    assert parse_softmax_layers("last:6", 30) == [24, 25, 26, 27, 28, 29]
    assert parse_softmax_layers("EVEN:1", 30) == [15] and parse_softmax_layers("even:4", 16) == [2, 6, 10, 14]
    for layers in (1, 2, 7, 30):
        for n in range(1, layers + 1):
            for rule in ("even", "last"):
                got = parse_softmax_layers(f"{rule}:{n}", layers)
                assert len(set(got)) == n and got == sorted(got) and 0 <= got[0] and got[-1] < layers
    assert parse_auto("even:6") is None


def test_config_records_sorted_layers_and_checks_the_range():
    from glaswap.models.configuration_glaswap import GLASwapConfig

    cfg = GLASwapConfig(num_hidden_layers=6, softmax_layers="5,1")
    assert cfg.softmax_layers == [1, 5] and cfg.to_dict()["softmax_layers"] == [1, 5]
    assert GLASwapConfig(**cfg.to_dict()).softmax_layers == [1, 5]
    with pytest.raises(ValueError, match="layer 6 is out of range: the model has 6 layers, 0 to 5"):
        GLASwapConfig(num_hidden_layers=6, softmax_layers=[6])
    with pytest.raises(ValueError, match="distill picks them after attention transfer"):
        GLASwapConfig(softmax_layers="auto:2")


@pytest.fixture(scope="module")
def teacher_folder(tmp_path_factory):
    return save_teacher(_teacher("llama"), tmp_path_factory.mktemp("teacher") / "src")


@pytest.mark.parametrize("value, needle", [
    ("1,7", "layer 7 is out of range: the model has 4 layers, 0 to 3"),
    ("1,1", "layer 1 is listed twice"),
    ("-1", "negative"),
    ("1,x", "whole-number layer indices"),
    ("auto:0", "auto:N needs N >= 1"),
    ("auto:2", "set model.options.softmax_layers: auto:2 in a recipe (distill picks them after attention transfer)"),
    ("even:5", "even:5 asks for more layers than the model's 4"),
])
def test_bad_softmax_layers_on_convert_get_one_line(teacher_folder, tmp_path, value, needle):
    r = CliRunner().invoke(main, ["convert", str(teacher_folder), str(tmp_path / "out"), "--no-report",
                                  "--softmax-layers", value])
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert r.exit_code != 0 and len(lines) == 1 and needle in lines[0], r.output
    assert "Traceback" not in r.output and not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- layers and weights
@pytest.fixture(scope="module")
def mixed_folder(tmp_path_factory, teacher_folder):
    """A tiny Llama converted through the CLI with softmax layers 1 and 3 (distances capped at 6,
    so a saved folder's own code reads past the cap), new parameters randomised."""
    out = tmp_path_factory.mktemp("mixed") / "gla"
    r = CliRunner().invoke(main, ["convert", str(teacher_folder), str(out), "--no-report",
                                  "--softmax-layers", "3,1", "--window", "3", "--softmax-max-distance", "6"])
    assert r.exit_code == 0, r.output
    model = GLASwapForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    randomise_new_parameters(model)
    model.save_pretrained(str(out))
    return out


def test_a_rule_is_resolved_once_the_layers_are_known(teacher_folder, tmp_path):
    """convert --softmax-layers last:2 and even:2 record the layers themselves; a recipe takes
    the rule as it is (distill converts with it)."""
    from glaswap.distill import load_recipe

    for rule, layers in (("last:2", [2, 3]), ("even:2", [1, 3])):
        out = tmp_path / rule.replace(":", "")
        r = CliRunner().invoke(main, ["convert", str(teacher_folder), str(out), "--no-report",
                                      "--softmax-layers", rule])
        assert r.exit_code == 0, r.output
        assert read_json(out / "config.json")["softmax_layers"] == layers
    recipe = load_recipe("smollm2-135m-demo", ["model.options.softmax_layers=even:6"])
    assert recipe.model.options["softmax_layers"] == "even:6"


def test_convert_writes_the_teachers_tensors_alone_for_softmax_layers(mixed_folder, teacher_folder):
    from safetensors import safe_open

    assert read_json(mixed_folder / "config.json")["softmax_layers"] == [1, 3]
    assert read_json(mixed_folder / "glaswap.json")["options"]["softmax_layers"] == [1, 3]
    with safe_open(str(mixed_folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    with safe_open(str(teacher_folder / "model.safetensors"), "pt") as f:
        teacher = {n for n in f.keys() if n.startswith(("model.layers.1.", "model.layers.3."))}
    for i in (1, 3):
        assert {n for n in names if n.startswith(f"model.layers.{i}.")} == \
            {n for n in teacher if n.startswith(f"model.layers.{i}.")}
    assert any(n.startswith("model.layers.0.self_attn.gate_") for n in names)
    model = GLASwapForCausalLM.from_pretrained(str(mixed_folder), dtype=torch.float32)
    assert [layer.self_attn.is_softmax for layer in model.model.layers] == [False, True, False, True]
    assert not any(".layers.1." in n or ".layers.3." in n for n in model.new_parameter_names())


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_every_layer_softmax_is_the_teacher(arch):
    teacher = _teacher(arch)
    model = GLASwapForCausalLM(glaswap_config(teacher.config.to_dict(), {"softmax_layers": list(range(LAYERS))}))
    model.load_state_dict(teacher.state_dict(), strict=False)
    model.eval()
    assert model.new_parameter_names() == []
    ids = _ids(2, 11)
    with torch.no_grad():
        ref = teacher(ids).logits
        torch.testing.assert_close(model(ids).logits, ref, rtol=1e-5, atol=1e-5)
        cache = GLASwapCache(LAYERS)
        parts = [model(ids[:, :4], past_key_values=cache, use_cache=True).logits]
        parts += [model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(4, 11)]
    torch.testing.assert_close(torch.cat(parts, 1), ref, rtol=1e-5, atol=1e-5)


def test_softmax_layers_in_every_mode_and_transfer():
    model = _student("llama")
    ids = _ids(2, 9)
    with torch.no_grad():
        gla = model(ids).logits
        with model.attention_mode("softmax"):
            teacher = model(ids).logits
        with model.attention_mode("transfer"):
            out = model.model(input_ids=ids)
    # GLA layers 0 and 2 give a transfer loss; the softmax layers none
    assert len(out.transfer_losses) == 2
    torch.testing.assert_close(model.lm_head(out.last_hidden_state), teacher)
    assert not torch.allclose(gla, teacher)


def test_keep_softmax_layers_equals_converting_with_them():
    teacher = _teacher("llama")
    plain = GLASwapForCausalLM(glaswap_config(teacher.config.to_dict(), {"softmax_layers": [3]}))
    plain.load_state_dict(teacher.state_dict(), strict=False)
    randomise_new_parameters(plain)
    mixed = GLASwapForCausalLM(glaswap_config(teacher.config.to_dict(), {"softmax_layers": [1, 3]}))
    mixed.load_state_dict(plain.state_dict(), strict=False)
    removed = plain.keep_softmax_layers([1])
    assert removed and all(n.startswith("model.layers.1.self_attn.") for n in removed)
    assert plain.config.softmax_layers == [1, 3]
    assert plain.new_parameter_names() == mixed.new_parameter_names()
    assert set(plain.state_dict()) == set(mixed.state_dict())
    ids = _ids(1, 8)
    with torch.no_grad():
        torch.testing.assert_close(plain.eval()(ids).logits, mixed.eval()(ids).logits)
    with pytest.raises(ValueError, match="out of range"):
        plain.keep_softmax_layers([4])


def test_keep_softmax_layers_under_peft_lora():
    """As distill's Student has it: LoRA attached in place on q/k/v/o, then layers turned."""
    from peft import LoraConfig, get_peft_model

    model = _student("llama")
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    removed = model.keep_softmax_layers([0])
    assert removed and not any(n in dict(model.named_parameters()) for n in removed)
    assert model.config.softmax_layers == [0, 1, 3]
    attn = model.model.layers[0].self_attn
    assert attn.is_softmax and hasattr(attn.q_proj, "lora_A") and not hasattr(attn, "q_map")
    ids = _ids(2, 7)
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert attn.q_proj.lora_B["default"].weight.grad is not None


# ----------------------------------------------------------------------------- caches
@pytest.mark.parametrize("variant", EXACT)
@pytest.mark.parametrize("padded", [False, True])
def test_mixed_cache_over_several_calls_equals_a_full_forward(variant, padded, monkeypatch):
    # a small growth step: the KV buffers grow (and a sliding window trims) within the test
    monkeypatch.setattr(softmax_attention, "KV_STEP", 4)
    model = _student(variant)
    T = 22
    if padded:
        ids, mask = _left_padded([_ids(1, T, 2)[0].tolist(), _ids(1, T - 6, 3)[0].tolist()], T)
    else:
        ids, mask = _ids(2, T), torch.ones(2, T, dtype=torch.long)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        whole = GLASwapCache(LAYERS)
        model(ids, attention_mask=mask, past_key_values=whole, use_cache=True)
        cache, parts, a = GLASwapCache(LAYERS), [], 0
        for size in (8, 1, 5, 1, 1, 6):
            parts.append(model(ids[:, a:a + size], attention_mask=mask[:, :a + size], past_key_values=cache,
                               use_cache=True).logits)
            a += size
    assert a == T and cache.seen_tokens == T
    real = mask.bool()
    torch.testing.assert_close(torch.cat(parts, 1)[real], full[real], rtol=1e-5, atol=1e-5)
    sliding = variant == "mistral-sliding"
    for i in model.config.softmax_layers:
        if sliding:     # trimmed to what the window still reads: compare the newest keys
            n = min(cache.kv[i].length, whole.kv[i].length)
            got = [t[..., -n:, :] if t.dim() == 4 else t[:, -n:] for t in _kv_contents(cache, i)]
            want = [t[..., -n:, :] if t.dim() == 4 else t[:, -n:] for t in _kv_contents(whole, i)]
            assert n >= model.config.sliding_window - 1
        else:
            got, want = _kv_contents(cache, i), _kv_contents(whole, i)
            assert torch.equal(got[2], real)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for i in range(LAYERS):
        assert (cache.kv[i] is None) == (i not in model.config.softmax_layers)
        assert (cache.states[i] is None) == (i in model.config.softmax_layers)


@pytest.mark.parametrize("variant", ["llama", "window", "sparse", "capped"])
def test_left_padded_generate_matches_each_row_alone(variant):
    model = _student(variant)
    rows = [[7, 33, 91, 12, 5, 60, 61], [44, 18, 70]]
    ids, mask = _left_padded(rows)
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    batch = model.generate(ids, attention_mask=mask, **kw)
    for i, r in enumerate(rows):
        alone = model.generate(torch.tensor([r]), attention_mask=torch.ones(1, len(r), dtype=torch.long), **kw)
        assert torch.equal(batch[i, ids.shape[1]:], alone[0, len(r):]), i
    beams = model.generate(ids, attention_mask=mask, num_beams=3, **kw)      # reorder_cache maps the KV
    assert beams.shape == batch.shape


def test_cache_batch_operations_map_the_kv():
    model = _student("window")
    with torch.no_grad():
        cache = model(_ids(2, 6), use_cache=True).past_key_values
    keys = cache.kv[2].keys.clone()
    cache.batch_repeat_interleave(2)
    assert cache.kv[2].keys.shape[0] == 4 and torch.equal(cache.kv[2].keys[1], keys[0])
    cache.reorder_cache(torch.tensor([3, 2, 1, 0]))
    assert torch.equal(cache.kv[2].keys[0], keys[1]) and cache.kv[2].valid.shape[0] == 4
    cache.batch_select_indices(torch.tensor([0, 2]))
    assert cache.batch_size == 2 and cache.kv[2].length == 6
    cache.reset()
    assert cache.kv == [None] * LAYERS and cache.seen_tokens == 0


def test_decode_memory_grows_only_in_the_softmax_layers():
    model = _student("window")
    with torch.no_grad():
        cache = model(_ids(1, 5), use_cache=True).past_key_values
        sizes = []
        for t in range(300):
            model(_ids(1, 1, t), past_key_values=cache, use_cache=True)
            if t in (0, 299):
                sizes.append(([s.numel() for s in cache.states if s is not None],
                              [sum(t.numel() for t in w.tensors()) for w in cache.windows if w is not None],
                              cache.kv[2].length))
    assert sizes[0][:2] == sizes[1][:2] and (sizes[0][2], sizes[1][2]) == (6, 305)


# ----------------------------------------------------------------------------- decode graph
@pytest.mark.parametrize("variant", ["llama", "window", "sparse", "mistral-sliding", "capped", "capped-window"])
def test_graph_decode_of_a_mixed_model_matches_eager(variant, monkeypatch):
    """The graph path's static buffers, run eagerly ("replay"), captured again as the KV grows."""
    monkeypatch.setattr(decode_graph, "KV_STEP", 4)
    monkeypatch.setattr(softmax_attention, "KV_STEP", 4)    # eager buffers as small, so they run full
    model = _student(variant)
    ids, mask = _left_padded([[7, 33, 91, 12, 5, 60, 61], [44, 18, 70]])
    kw = dict(max_new_tokens=14, do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
              return_dict_in_generate=True)
    eager = model.generate(ids, attention_mask=mask, **kw)
    runner = enable_decode_graph(model, backend="replay", strict=True)
    captured = []
    real_static = decode_graph._StaticStep

    def counting(*args, **kwargs):
        captured.append(kwargs.get("capacity", args[4] if len(args) > 4 else 0))
        return real_static(*args, **kwargs)

    monkeypatch.setattr(decode_graph, "_StaticStep", counting)
    replayed = model.generate(ids, attention_mask=mask, **kw)
    assert runner.failed is None and len(captured) >= 2 and captured == sorted(captured)
    assert torch.equal(eager.sequences, replayed.sequences)
    for a, b in zip(eager.logits, replayed.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    check = check_decode_graph(model, _ids(2, 9), backend="replay")
    assert check["same_argmax"] and check["max_abs_diff"] < 1e-5
    disable_decode_graph(model)


def test_graph_decode_takes_over_the_eager_kv_without_a_second_copy(monkeypatch):
    """The first graph step uses the eager cache's KV tensors where they have room, and where
    they have none moves them into larger static buffers, after which the cache holds only
    those: no softmax layer's keys are ever held twice."""
    import weakref

    monkeypatch.setattr(softmax_attention, "KV_STEP", 4)
    monkeypatch.setattr(decode_graph, "KV_STEP", 4)
    model = _student("llama")
    layer = model.config.softmax_layers[0]
    with torch.no_grad():
        out = model(_ids(1, 9), use_cache=True)              # the prompt, eagerly
        cache = out.past_key_values
        runner = enable_decode_graph(model, backend="replay", strict=True)
        roomy = cache.kv_buffer(layer)
        assert roomy.capacity > roomy.length                 # 12 slots for 9 tokens
        keys = roomy.keys
        nxt = out.logits[:, -1:].argmax(-1)
        model(nxt, past_key_values=cache, use_cache=True)
        static = runner.steps[1]
        assert static.kv[layer].keys is keys and cache.kv_buffer(layer).keys is keys   # taken as it was
        old = weakref.ref(keys)
        del keys, roomy, static
        for _ in range(8):                                   # past its 12 slots: moved into new ones
            nxt = model(nxt, past_key_values=cache, use_cache=True).logits.argmax(-1)
        static = runner.steps[1]
        assert static.capacity >= 18 and cache.kv_buffer(layer).keys is static.kv[layer].keys
        assert old() is None and cache.kv_buffer(layer).length == 18
    disable_decode_graph(model)


def test_graph_prompt_blocks_of_a_mixed_sparse_model_match_eager():
    from glaswap.layers.hybrid_cache import SPARSE_BLOCK

    model = _student("sparse")
    ids = _ids(1, SPARSE_BLOCK * 2 + 5)
    with torch.no_grad():
        eager = model(ids, use_cache=True)
        enable_decode_graph(model, backend="replay", strict=True)
        graph = model(ids, use_cache=True)
        disable_decode_graph(model)
    torch.testing.assert_close(graph.logits, eager.logits, rtol=0, atol=1e-5)
    for i in model.config.softmax_layers:
        for g, e in zip(_kv_contents(graph.past_key_values, i), _kv_contents(eager.past_key_values, i)):
            torch.testing.assert_close(g, e, rtol=0, atol=1e-5)


def test_graph_keeps_interleaved_mixed_caches_apart():
    model = _student("llama")
    a_ids, b_ids = _ids(1, 6, 4), _ids(1, 9, 5)
    with torch.no_grad():
        def decode(runner_on):
            if runner_on:
                enable_decode_graph(model, backend="replay", strict=True)
            a = model(a_ids, use_cache=True).past_key_values
            b = model(b_ids, use_cache=True).past_key_values
            out = []
            for t in range(5):
                for cache in (a, b):
                    out.append(model(_ids(1, 1, 10 + t), past_key_values=cache, use_cache=True).logits)
            disable_decode_graph(model)
            return torch.cat(out)
        torch.testing.assert_close(decode(True), decode(False), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- saved folders
@pytest.mark.compat
def test_saved_mixed_folder_loads_and_generates_without_glaswap(mixed_folder, tmp_path):
    model = GLASwapForCausalLM.from_pretrained(str(mixed_folder), dtype=torch.float32).eval()
    rows = [[7, 33, 91, 12, 5, 60, 61], [44, 18, 70]]
    ids, mask = _left_padded(rows)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = model.generate(ids, attention_mask=mask, **kw)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    torch.save({"ids": ids, "mask": mask, "expected": expected, "logits": logits}, tmp_path / "case.pt")
    code = f"""
import torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained({str(mixed_folder)!r}, trust_remote_code=True, dtype=torch.float32).eval()
case = torch.load({str(tmp_path / 'case.pt')!r})
kw = dict(attention_mask=case["mask"], max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
print("layers", m.config.softmax_layers, [l.self_attn.is_softmax for l in m.model.layers])
with torch.no_grad():
    cache = m(case["ids"], attention_mask=case["mask"], use_cache=True).past_key_values
    print("diff", (m(case["ids"], attention_mask=case["mask"]).logits - case["logits"]).abs().max().item())
print("kv", [b is not None for b in cache.kv])
print("same", torch.equal(m.generate(case["ids"], **kw), case["expected"]))
"""
    proc = run_without_glaswap(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layers [1, 3] [False, True, False, True]" in proc.stdout
    assert "diff 0.0" in proc.stdout and "kv [False, True, False, True]" in proc.stdout
    assert "same True" in proc.stdout, proc.stdout


def test_config_json_holds_the_layers_as_a_list(mixed_folder):
    config = json.loads((mixed_folder / "config.json").read_text())
    assert config["softmax_layers"] == [1, 3] and config["softmax_max_distance"] == 6


def test_glaswap_generate_runs_a_mixed_model(mixed_folder, tmp_path):
    import helpers

    helpers.ascii_tokenizer(pad_token="\x00", eos_token="\x03").save_pretrained(str(mixed_folder))
    r = CliRunner().invoke(main, ["generate", str(mixed_folder), "--prompt", "the river", "--max-new-tokens", "5"])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("the river") and "5 tokens in" in r.output


# ----------------------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", ["llama", "window", "sparse", "capped"])
def test_cuda_graph_decode_of_a_mixed_model_matches_eager_on_gpu(variant, dtype, monkeypatch):
    """Captured CUDA graphs, captured again as the KV outgrows them, against eager decoding;
    then a bench row: decode memory grows only with the softmax layers' KV."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setattr(decode_graph, "KV_STEP", 8)
    model = _student(variant).to("cuda", dtype)
    ids, mask = _left_padded([[7, 33, 91, 12, 5, 60, 61], [44, 18, 70]])
    ids, mask = ids.cuda(), mask.cuda()
    kw = dict(max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
              return_dict_in_generate=True)
    eager = model.generate(ids, attention_mask=mask, **kw)
    runner = enable_decode_graph(model, strict=True)
    graphed = model.generate(ids, attention_mask=mask, **kw)
    again = model.generate(ids, attention_mask=mask, **kw)
    assert runner.failed is None and runner.steps[2].capacity >= ids.shape[1] + 40
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for run in (graphed, again):
        assert torch.equal(run.sequences, eager.sequences)
        for a, b in zip(eager.logits, run.logits):
            torch.testing.assert_close(b.float(), a.float(), rtol=tol, atol=tol)
    disable_decode_graph(model)
    from glaswap.generate import bench_decode

    rows = bench_decode(model, None, contexts=[256, 4096], new_tokens=8, graph="on", log=lambda *_: None)
    assert all("graph_error" not in r for r in rows) and rows[0]["graph_check"]["same_argmax"], rows
