"""Figures that would be wrong without a word, sizes that would be unbounded, and bad input that
would cost work or name the wrong option: each refused in one line (issue 52, sections 2-4).

Tiny random Llamas; a folder a test edits is its own copy."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
import helpers
from helpers import cli, converted_tiny, one_line_error, save_teacher, tiny_teacher

from glaswap.convert import convert
from glaswap.errors import GlaswapError
from glaswap.evaluate import evaluate
from glaswap.models.configuration_glaswap import GLASwapConfig
from glaswap.models.gla_options import check_gla_options
from glaswap.runtime import FINGERPRINT_EDGE, load_tokenizer, source_fingerprint

TEXT = "The quick brown fox jumps over the lazy dog. " * 8


def _quiet(*_a, **_k):
    pass




@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(folder, its teacher folder, a text file): a tiny converted Llama with an ASCII tokenizer."""
    root = tmp_path_factory.mktemp("reliability")
    folder = converted_tiny(root, tokenizer=helpers.ascii_tokenizer(eos_token="\x03"))
    text = root / "text.txt"
    text.write_text(TEXT)
    return folder, root / "src", text


def _copy(folder: Path, dest: Path, **config) -> Path:
    """A copy of `folder` with `config` written into its config.json."""
    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(config)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def _eval_args(folder, text, out, *more):
    return ("eval", folder, "--text", text, "--context", 16, "--max-tokens", 48, "--out", out, *more)


# ----------------------------------------------------------------------------- the teacher's fingerprint
def test_eval_refuses_another_teacher_at_the_recorded_path(tmp_path):
    folder = converted_tiny(tmp_path, tokenizer=helpers.ascii_tokenizer(eos_token="\x03"))
    src = tmp_path / "src"
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    meta = json.loads((folder / "glaswap.json").read_text())
    assert meta["source"]["fingerprint"]["files"] == {"model.safetensors": (src / "model.safetensors").stat().st_size}
    assert cli(*_eval_args(folder, text, tmp_path / "ev")).exit_code == 0

    save_teacher(tiny_teacher("llama", seed=1), src)          # same shapes, other weights
    one_line_error(cli(*_eval_args(folder, text, tmp_path / "ev")),
                   f"the teacher at {src} is not the model this was converted from", f"--teacher {src}")
    one_line_error(cli("passkey", folder, "--lengths", 64, "--depths", 0, "--trials", 1, "--out", tmp_path / "pk"),
                   "is not the model this was converted from")
    # named explicitly, it is the user's choice
    assert cli(*_eval_args(folder, text, tmp_path / "ev", "--teacher", src)).exit_code == 0

    # a folder converted before fingerprints were recorded is not checked
    meta["source"].pop("fingerprint")
    (folder / "glaswap.json").write_text(json.dumps(meta))
    assert cli(*_eval_args(folder, text, tmp_path / "ev")).exit_code == 0


def test_fingerprint_sees_size_header_and_ends(tmp_path):
    gguf = tmp_path / "model.gguf"
    data = bytearray(b"GGUF" + bytes(3 * FINGERPRINT_EDGE))
    gguf.write_bytes(data)
    first = source_fingerprint("gguf", gguf)
    assert first["files"] == {"model.gguf": len(data)}
    data[-1] = 7                                               # the last bytes
    gguf.write_bytes(data)
    assert source_fingerprint("gguf", gguf)["sha256"] != first["sha256"]
    gguf.write_bytes(data + b"x")                              # the size
    assert source_fingerprint("gguf", gguf)["sha256"] != first["sha256"]

    folder = save_teacher(tiny_teacher("llama"), tmp_path / "t")
    a = source_fingerprint("folder", folder)
    (folder / "model-00002.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    b = source_fingerprint("folder", folder)
    assert set(b["files"]) == {"model.safetensors", "model-00002.safetensors"} and b["sha256"] != a["sha256"]


# ----------------------------------------------------------------------------- config.json against the weights
@pytest.mark.parametrize("config, needles", [
    ({"num_hidden_layers": 1}, ("config.json and the weights disagree", "in the weights but not in config.json",
                                "model.layers.1.")),
    ({"window": 4}, ("config.json and the weights disagree", "missing from the weights", "window_mix")),
])
def test_config_that_disagrees_with_the_weights(converted, tmp_path, config, needles):
    folder, src, text = converted
    bad = _copy(folder, tmp_path / "gla", **config)
    one_line_error(cli(*_eval_args(bad, text, tmp_path / "ev", "--teacher", "self")), *needles)


@pytest.mark.parametrize("config, needles", [
    ({"normalizer_eps": -1}, ("normalizer_eps -1", "expected > 0")),
    ({"normalizer_eps": float("nan")}, ("normalizer_eps nan", "finite")),
    ({"gate_normalizer": float("nan")}, ("gate_normalizer nan", "finite")),
    ({"rope_max_wavelength": float("nan")}, ("rope_max_wavelength nan", "finite")),
    ({"decay_horizon": float("inf")}, ("decay_horizon inf", "finite")),
    ({"window": 100000000, "sinks": 1}, ("window 100000000", "512 positions", "at most 512")),
    ({"window": 4, "sparse_cache": 513}, ("sparse_cache 513", "512 positions")),
])
def test_config_values_out_of_range(converted, tmp_path, config, needles):
    folder, src, text = converted
    bad = _copy(folder, tmp_path / "gla", **config)
    one_line_error(cli(*_eval_args(bad, text, tmp_path / "ev", "--teacher", "self")), "config.json", *needles)


def test_options_are_finite_and_bounded_by_positions():
    for name in ("gate_normalizer", "gate_init_decay", "normalizer_eps", "rope_max_wavelength", "decay_horizon"):
        for value in (float("nan"), float("inf")):
            with pytest.raises(ValueError, match=f"invalid {name}"):
                check_gla_options({name: value})
    check_gla_options({"window": 512, "sinks": 512}, max_positions=512)
    with pytest.raises(ValueError, match="sinks 513 is beyond the model's 512 positions"):
        check_gla_options({"window": 4, "sinks": 513}, max_positions=512)
    with pytest.raises(ValueError, match="window 513"):
        GLASwapConfig(window=513, max_position_embeddings=512)


@pytest.mark.parametrize("flags, needles", [
    (("--rope-max-wavelength", "nan"), ("rope_max_wavelength nan", "finite")),
    (("--decay-horizon", "inf"), ("decay_horizon inf", "finite")),
    (("--window", 100000000, "--sinks", 1), ("window 100000000", "512 positions")),
    (("--window", 8, "--sinks", 1, "--sparse-cache", 100000000), ("sparse_cache 100000000", "512 positions")),
])
def test_convert_refuses_nan_and_sizes_past_the_positions(converted, tmp_path, flags, needles):
    folder, src, text = converted
    one_line_error(cli("convert", src, tmp_path / "out", "--no-report", *flags), *needles)
    assert not (tmp_path / "out").exists()


def test_eval_sparse_cache_past_the_positions(tmp_path):
    src = save_teacher(tiny_teacher("llama"), tmp_path / "src")
    folder = tmp_path / "gla"
    convert(str(src), folder, options={"window": 4}, report=False, log=_quiet)
    helpers.ascii_tokenizer(eos_token="\x03").save_pretrained(str(folder))
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    for flag in (("--sparse-cache", 513), ("--sparse-cache", 100000)):
        one_line_error(cli(*_eval_args(folder, text, tmp_path / "ev", "--teacher", "self", *flag)),
                       f"--sparse-cache {flag[1]} is beyond the model's 512 positions", "at most 512")
    assert cli(*_eval_args(folder, text, tmp_path / "ev", "--teacher", "self", "--sparse-cache", 8)).exit_code == 0


# ----------------------------------------------------------------------------- generate, passkey
@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_generate_temperature_must_be_finite(converted, value):
    folder, src, text = converted
    one_line_error(cli("generate", folder, "--prompt", "The", "--max-new-tokens", 2, "--graph", "off",
                       "--temperature", value), f"--temperature {value}", ">= 0")


def test_passkey_lengths_error_names_lengths(converted, tmp_path):
    folder, src, text = converted
    line = one_line_error(cli("passkey", folder, "--lengths", 0, "--out", tmp_path / "pk"), "--lengths")
    assert "--contexts" not in line


# ----------------------------------------------------------------------------- the destination, before any work
def test_unwritable_out_is_refused_before_loading(converted, tmp_path, monkeypatch):
    folder, src, text = converted
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")

    def no_loading(*_a, **_k):
        raise AssertionError("a model was loaded before the destination was checked")

    monkeypatch.setattr("glaswap.runtime.load_student", no_loading)
    with pytest.raises(GlaswapError, match="a-file is a file"):
        evaluate(folder, [text], teacher="self", context=16, out=blocker / "sub", progress=False, log=_quiet)
    with pytest.raises(GlaswapError, match="is a file; pass a folder"):
        evaluate(folder, [text], teacher="self", context=16, out=blocker, progress=False, log=_quiet)
    one_line_error(cli("passkey", folder, "--lengths", 64, "--no-teacher", "--out", blocker / "sub"), "a-file")
    one_line_error(cli("generate", folder, "--bench", "--teacher", "none", "--out", blocker / "sub"), "a-file")
    one_line_error(cli("eval", folder, "--tasks", "piqa", "--limit", 2, "--teacher", "self", "--out", blocker / "sub"),
                   "a-file")

    def read_only(*_a, **_k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr("glaswap.runtime.tempfile.mkstemp", read_only)
    one_line_error(cli(*_eval_args(folder, text, tmp_path / "ro", "--teacher", "self")),
                   "cannot write the results to", "read-only", "--out DIR")
    one_line_error(cli("passkey", folder, "--lengths", 64, "--no-teacher", "--out", tmp_path / "ro"), "read-only")


# ----------------------------------------------------------------------------- a tokenizer with code of its own
def test_convert_copies_the_tokenizer_code_with_trust_remote_code(tmp_path):
    teacher = save_teacher(tiny_teacher("llama"), tmp_path / "teacher")
    helpers.ascii_tokenizer(eos_token="\x03").save_pretrained(str(teacher))
    cfg = json.loads((teacher / "tokenizer_config.json").read_text())
    cfg["auto_map"] = {"AutoTokenizer": [None, "own_tokenizer.OwnTokenizer"]}
    cfg.pop("tokenizer_class", None)          # transformers has no class of its own to fall back on
    (teacher / "tokenizer_config.json").write_text(json.dumps(cfg))
    (teacher / "own_tokenizer.py").write_text("from transformers import PreTrainedTokenizerFast\n\n\n"
                                              "class OwnTokenizer(PreTrainedTokenizerFast):\n    pass\n")

    convert(str(teacher), tmp_path / "plain", report=False, log=_quiet)
    assert not (tmp_path / "plain" / "own_tokenizer.py").exists()      # no consent: no code copied

    convert(str(teacher), tmp_path / "gla", report=False, trust_remote_code=True, log=_quiet)
    assert (tmp_path / "gla" / "own_tokenizer.py").read_text() == (teacher / "own_tokenizer.py").read_text()
    tok = load_tokenizer(tmp_path / "gla", trust_remote_code=True)
    assert type(tok).__name__ == "OwnTokenizer" and tok("ab")["input_ids"] == [97, 98]
