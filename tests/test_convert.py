"""`glaswap convert` on tiny random teachers of every supported architecture."""

from __future__ import annotations


import pytest
import torch
from click.testing import CliRunner
from helpers import ARCHS, read_json, run_without_glaswap, save_teacher, tiny_teacher, tree_digest

from glaswap.cli import main
from glaswap.convert import convert
from glaswap.errors import GlaswapError
from glaswap.models.modeling_glaswap import GLASwapForCausalLM

IDS = torch.tensor([[3, 17, 5, 99, 42, 8, 8, 61, 120, 2, 33, 71, 14, 90, 6, 55, 23, 101, 77, 12]])


def _load(folder):
    return GLASwapForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


@pytest.mark.compat
@pytest.mark.parametrize("arch", ARCHS)
def test_convert_reload_without_glaswap(arch, tmp_path):
    teacher = tiny_teacher(arch, tie=arch == "qwen3")
    src = save_teacher(teacher, tmp_path / "src")
    before = tree_digest(src)
    meta = convert(str(src), tmp_path / "out", report=False, log=lambda *_: None)
    assert tree_digest(src) == before, "the source checkpoint was modified"

    out = tmp_path / "out"
    for name in ("config.json", "glaswap.json", "modeling_glaswap.py", "configuration_glaswap.py",
                 "gla_attention.py", "ops.py", "gla_reference.py", "model.safetensors"):
        assert (out / name).is_file(), name
    cfg = read_json(out / "config.json")
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_glaswap.GLASwapForCausalLM"
    assert meta["source"]["path"] == str(src) and meta["options"]["gate"] == "lowrank"
    assert read_json(out / "glaswap.json")["versions"]["torch"] == torch.__version__

    model = _load(out)
    with torch.no_grad():
        # Softmax mode of the converted model is the teacher itself: same weights, same maths.
        with model.attention_mode("softmax"):
            soft = model(IDS).logits
        ref = teacher(IDS).logits
        torch.testing.assert_close(soft, ref, rtol=1e-4, atol=1e-4)
        gla = model(IDS).logits
    assert torch.isfinite(gla).all()
    torch.save({"ids": IDS, "logits": gla}, tmp_path / "expected.pt")

    code = f"""
import torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True, dtype=torch.float32).eval()
exp = torch.load({str(tmp_path / 'expected.pt')!r})
with torch.no_grad():
    got = m(exp["ids"]).logits
assert type(m).__name__ == "GLASwapForCausalLM", type(m)
diff = (got - exp["logits"]).abs().max().item()
print("maxdiff", diff)
assert diff == 0.0, diff
"""
    proc = run_without_glaswap(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "maxdiff 0.0" in proc.stdout


PLAIN_TOKENIZER = """
import sys
sys.modules["glaswap"] = sys.modules["glaswap_kernels"] = None
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained({folder!r})
print("ids", tok("hi")["input_ids"])
"""

MODEL_NEEDS_TRUST = """
import sys
sys.modules["glaswap"] = sys.modules["glaswap_kernels"] = None
from transformers import AutoModel, AutoModelForCausalLM
for auto in (AutoModelForCausalLM, AutoModel):
    try:
        m = auto.from_pretrained({folder!r})
        print(auto.__name__, "loaded without trust_remote_code as", type(m).__name__)
    except ValueError as e:
        print(auto.__name__, "refused", "trust_remote_code=True" in str(e))
print("---")
m = AutoModelForCausalLM.from_pretrained({folder!r}, trust_remote_code=True)
print("trusted", type(m).__name__, m.config.model_type)
"""


def _fresh(code: str, cwd):
    """`code` in a fresh process without glaswap, its stdin at /dev/null (nobody to answer a
    prompt); stdout and stderr together."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRUST_REMOTE_CODE_TIMEOUT")}
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], cwd=str(cwd), env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.compat
def test_tokenizer_loads_plainly_while_the_model_needs_trust_remote_code(tmp_path):
    """A converted folder's tokenizer loads with AutoTokenizer alone: no "run the custom code?
    [y/N]" prompt and no warning of a model of type '' (issue 53). The model still loads only
    with trust_remote_code=True; without it transformers refuses, never loads another class."""
    from helpers import ascii_tokenizer

    src = save_teacher(tiny_teacher("llama"), tmp_path / "src")
    ascii_tokenizer(eos_token="\x03").save_pretrained(str(src))
    out = tmp_path / "out"
    convert(str(src), out, report=False, log=lambda *_: None)

    rc, text = _fresh(PLAIN_TOKENIZER.format(folder=str(out)), tmp_path)
    assert rc == 0, text[-3000:]
    assert "ids [104, 105]" in text, text[-3000:]
    for asked in ("[y/N]", "custom code", "trust_remote_code", "model of type"):
        assert asked not in text, text[-3000:]

    rc, text = _fresh(MODEL_NEEDS_TRUST.format(folder=str(out)), tmp_path)
    assert rc == 0, text[-3000:]
    untrusted, trusted = text.split("---\n")
    assert "AutoModelForCausalLM refused True" in untrusted and "AutoModel refused True" in untrusted, text[-3000:]
    assert "loaded without trust_remote_code" not in untrusted, text[-3000:]
    assert "trusted GLASwapForCausalLM glaswap" in trusted, text[-3000:]
    assert "model of type" not in trusted, trusted[-3000:]

@pytest.mark.compat
def test_saved_code_loads_where_triton_is_missing(tmp_path):
    """transformers refuses remote code whose files import a missing package outside a try
    block; the saved kernels must import Triton inside one (ops then falls back)."""
    from transformers.dynamic_module_utils import get_imports

    from glaswap.checkpoint import write_model_code

    written = write_model_code(tmp_path)
    assert {"gla_chunk.py", "feature_map_triton.py", "normalizer_triton.py", "ops.py"} <= set(written)
    for name in written:
        required = set(get_imports(tmp_path / name))
        assert "triton" not in required, f"{name} imports triton outside a try block"


def test_new_parameters_load_back_unchanged(tmp_path):
    """from_pretrained must not re-initialise the gates or feature maps it loads."""
    src = save_teacher(tiny_teacher("llama"), tmp_path / "src")
    convert(str(src), tmp_path / "out", report=False, seed=7, log=lambda *_: None)
    model = _load(tmp_path / "out")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.gate_up.weight.normal_()
            layer.self_attn.q_map.weight.add_(0.1)
    model.save_pretrained(tmp_path / "edited")
    again = GLASwapForCausalLM.from_pretrained(str(tmp_path / "edited"), dtype=torch.float32)
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n


def test_gate_and_feature_options_recorded(tmp_path):
    src = save_teacher(tiny_teacher("qwen2"), tmp_path / "src")
    for gate in ("key", "scalar"):
        opts = {"gate": gate, "feature_map": "softmax", "use_rope": False}
        meta = convert(str(src), tmp_path / gate, options=opts, report=True, log=lambda *_: None)
        assert meta["options"]["gate"] == gate and meta["options"]["use_rope"] is False
        assert meta["step0"]["student_ppl"] > 0 and meta["step0"]["kl"] >= 0
        model = _load(tmp_path / gate)
        assert model.config.gate == gate
        names = model.new_parameter_names()
        assert all("gate_down" not in n for n in names)
        assert ("gate_proj" in " ".join(names)) == (gate == "scalar")


def test_state_per_query_head_starts_as_shared_state(tmp_path):
    """state_heads="query" gives every query head its own key map, gate and state; converted,
    they start as copies of their KV head's, so the logits equal the shared-state model's, and
    they can then differ: a change to one query head's key map changes the output."""
    src = save_teacher(tiny_teacher("llama"), tmp_path / "src")
    ids = torch.randint(0, 128, (2, 37), generator=torch.Generator().manual_seed(0))
    logits = {}
    for heads in ("kv", "query"):   # through the CLI option
        result = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / heads), "--state-heads", heads,
                                           "--no-report", "--seed", "3"])
        assert result.exit_code == 0, result.output
        model = _load(tmp_path / heads)
        assert model.config.state_heads == heads
        attn = model.model.layers[0].self_attn
        n = model.config.num_attention_heads if heads == "query" else model.config.num_key_value_heads
        assert attn.k_map.weight.shape[0] == n and attn.gate_up.out_features == n * model.config.head_dim
        with torch.no_grad():
            logits[heads] = model(ids).logits
    torch.testing.assert_close(logits["query"], logits["kv"], rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        attn.k_map.weight[1].add_(0.5 * torch.randn_like(attn.k_map.weight[1]))   # query head 1 only
        assert (model(ids).logits - logits["query"]).abs().max() > 1e-3


@pytest.mark.parametrize("options", [{"gate": "key", "feature_map": "softmax"}, {"gate": "scalar"},
                                     {"feature_map": "hedgehog_pm"}])
def test_state_per_query_head_other_gates_and_maps(tmp_path, options):
    """The same start for the key and scalar gates (the key gate repeats the raw keys over the
    group) and for hedgehog_pm (2 x head-dim state rows), on Qwen2 (biases, 2 query heads per KV head)."""
    src = save_teacher(tiny_teacher("qwen2"), tmp_path / "src")
    ids = torch.randint(0, 128, (1, 29), generator=torch.Generator().manual_seed(1))
    logits = []
    for heads in ("kv", "query"):
        convert(str(src), tmp_path / heads, options={**options, "state_heads": heads}, report=False, seed=5,
                log=lambda *_: None)
        with torch.no_grad():
            logits.append(_load(tmp_path / heads)(ids).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_out_exists_refused_then_forced(tmp_path):
    src = save_teacher(tiny_teacher("llama"), tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(GlaswapError, match="already exists"):
        convert(str(src), out, report=False, log=lambda *_: None)
    assert (out / "keep.txt").read_text() == "mine"
    convert(str(src), out, report=False, force=True, log=lambda *_: None)
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"], "temporary folders left behind"


def test_sharded_source_streams_into_sharded_output(tmp_path):
    teacher = tiny_teacher("llama", layers=4)
    src = save_teacher(teacher, tmp_path / "src", max_shard_size="150KB")
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert len(shards) >= 3, shards
    limit = 96 * 1024
    meta = convert(str(src), tmp_path / "out", report=False, max_shard_size=limit, log=lambda *_: None)
    out = tmp_path / "out"
    index = read_json(out / "model.safetensors.index.json")
    files = set(index["weight_map"].values())
    assert len(files) >= 4 and all((out / f).is_file() for f in files)
    # Never more than one output shard (plus the tensor that closes it) held in memory.
    largest = max(p.numel() * p.element_size() for p in teacher.parameters())
    assert meta["peak_buffer_bytes"] <= limit + largest
    model = _load(out)
    with torch.no_grad(), model.attention_mode("softmax"):
        torch.testing.assert_close(model(IDS).logits, teacher(IDS).logits, rtol=1e-4, atol=1e-4)


def test_failure_leaves_nothing_behind(tmp_path):
    src = save_teacher(tiny_teacher("llama", layers=4), tmp_path / "src", max_shard_size="150KB")
    shard = sorted(src.glob("*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(GlaswapError, match="corrupted or truncated"):
        convert(str(src), tmp_path / "out", report=False, log=lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


# ----------------------------------------------------------------------------- bad input
def _cli(*args):
    result = CliRunner().invoke(main, ["convert", *map(str, args)])
    assert result.exit_code != 0
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    return lines


def _one_line_error(lines, *needles):
    assert len(lines) == 1 and lines[0].startswith("Error:"), lines
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_bad_input_missing_path(tmp_path):
    _one_line_error(_cli(tmp_path / "nope", tmp_path / "out"), "does not exist")


def test_bad_input_not_a_model_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    _one_line_error(_cli(tmp_path / "empty", tmp_path / "out"), "not a model folder", "config.json")


def test_bad_input_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    _one_line_error(_cli(tmp_path / "gpt2", tmp_path / "out"), "unsupported architecture 'gpt2'", "llama")


def test_bad_input_a_converted_folder_as_source(tmp_path):
    """A glaswap folder as SOURCE (its config names a stand-in model_type) is named as such, with
    the way out, instead of as an unsupported architecture."""
    src = save_teacher(tiny_teacher("llama"), tmp_path / "src")
    convert(str(src), tmp_path / "gla", report=False, log=lambda *_: None)
    _one_line_error(_cli(tmp_path / "gla", tmp_path / "again"), "is a glaswap model already", "its teacher")
    assert not (tmp_path / "again").exists()


def test_bad_input_corrupted_safetensors(tmp_path):
    src = save_teacher(tiny_teacher("llama"), tmp_path / "src")
    (src / "model.safetensors").write_bytes(b"this is not a safetensors file" * 4)
    _one_line_error(_cli(src, tmp_path / "out"), "corrupted or truncated", "download it again")
    assert not (tmp_path / "out").exists()


def test_bad_input_truncated_safetensors(tmp_path):
    src = save_teacher(tiny_teacher("llama"), tmp_path / "src")
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[:-1000])
    _one_line_error(_cli(src, tmp_path / "out"), "corrupted or truncated")


def test_bad_input_missing_weights(tmp_path):
    src = save_teacher(tiny_teacher("llama"), tmp_path / "src")
    (src / "model.safetensors").unlink()
    _one_line_error(_cli(src, tmp_path / "out"), "has no weights")


def test_bad_input_invalid_option_values(tmp_path):
    src = save_teacher(tiny_teacher("llama"), tmp_path / "src")
    lines = _cli(src, tmp_path / "out", "--gate", "bogus")
    assert any("Invalid value for '--gate'" in line for line in lines), lines
    _one_line_error(_cli(src, tmp_path / "out", "--feature-map", "identity"), "positive feature map")
    lines = _cli(src, tmp_path / "out", "--max-shard-size", "lots")
    _one_line_error(lines, "invalid size")
    assert not (tmp_path / "out").exists()


def test_bad_input_output_exists(tmp_path):
    src = save_teacher(tiny_teacher("llama"), tmp_path / "src")
    (tmp_path / "out").mkdir()
    _one_line_error(_cli(src, tmp_path / "out"), "already exists", "--force")


# ----------------------------------------------------------------------------- real model
@pytest.mark.slow
def test_real_smollm2_converts_reloads_and_reports(tmp_path, smollm2_gla):
    """SmolLM2-135M from PyPI: converts, reloads without glaswap, finite step-0 report."""
    out, meta = smollm2_gla
    step0 = meta["step0"]
    assert step0["text"] == "built-in sample text"
    for key in ("teacher_ppl", "student_ppl", "kl"):
        assert 0 < step0[key] < float("inf"), step0
    assert step0["teacher_ppl"] < 100, "the converted model's softmax mode should be the teacher"
    cfg = read_json(out / "config.json")
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["tie_word_embeddings"]) == (30, 3, True)
    code = f"""
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained({str(out)!r})
m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True, dtype=torch.float32)
ids = tok("The river that runs through the valley is fed by snow", return_tensors="pt").input_ids
with torch.no_grad():
    logits = m(ids).logits
assert torch.isfinite(logits).all()
print("ok", tuple(logits.shape))
"""
    proc = run_without_glaswap(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ok (1," in proc.stdout
