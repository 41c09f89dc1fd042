"""glaswap among the other packages: the transformers releases a saved folder runs under, an
install without Triton or matplotlib, file modes others can read, and what the sdist carries.

The tests marked `compat` are the fast set CI also runs against the newest transformers on
PyPI (.ci/run's second job): convert, load without glaswap, forward, generate, cached decode.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import warnings

import pytest
import torch
from helpers import REPO, converted_tiny, run_without_glaswap, save_teacher, tiny_recipe, tiny_teacher

import glaswap.models.modeling_glaswap as modeling
from glaswap.convert import convert
from glaswap.models.modeling_glaswap import GLASwapForCausalLM, transformers_version_problem
from glaswap.runtime import atomic_write, umasked


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A converted tiny Llama whose gates and feature maps are randomised (so decoding does real work)."""
    return converted_tiny(tmp_path_factory.mktemp("compat"))


def _case(folder, tmp_path):
    """Logits and greedy tokens of the folder's model in this process, saved for a subprocess."""
    model = GLASwapForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.randint(4, 128, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                            pad_token_id=0, eos_token_id=None)
    torch.save({"ids": ids, "logits": logits, "tokens": tokens}, tmp_path / "case.pt")
    return tmp_path / "case.pt"


# ----------------------------------------------------------------------------- saved folders
LOAD_AND_CHECK = """
import sys, warnings
import torch
from transformers import AutoModelForCausalLM
warnings.simplefilter("always")
m = AutoModelForCausalLM.from_pretrained({folder!r}, trust_remote_code=True, dtype=torch.float32).eval()
cache_name = sys.modules[type(m).__module__].CACHE_NAME
case = torch.load({case!r})
ids = case["ids"]
with torch.no_grad():
    full = m(ids, use_cache=False).logits
    print("forward", torch.allclose(full, case["logits"], rtol=1e-5, atol=1e-5))
    out = m(ids[:, :4], use_cache=True)
    cache = getattr(out, cache_name)
    steps = [out.logits] + [m(ids[:, t:t + 1], use_cache=True, **{{cache_name: cache}}).logits for t in range(4, 11)]
    print("decode", torch.allclose(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-4), cache.seen_tokens)
kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
cached = m.generate(ids, use_cache=True, **kw)
uncached = m.generate(ids, use_cache=False, **kw)
print("generate", torch.equal(cached, case["tokens"]), torch.equal(uncached, case["tokens"]))
"""


@pytest.mark.compat
def test_saved_folder_runs_without_glaswap(folder, tmp_path):
    """Forward, cached decode (under the cache keyword of the installed transformers) and
    generate with and without the cache agree with glaswap's own run of the same weights."""
    code = LOAD_AND_CHECK.format(folder=str(folder), case=str(_case(folder, tmp_path)))
    proc = run_without_glaswap(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "forward True" in proc.stdout, proc.stdout
    assert "decode True 11" in proc.stdout, proc.stdout
    assert "generate True True" in proc.stdout, proc.stdout
    # The code speaks the installed transformers' cache name: no deprecation of the old one.
    assert "past_key_values` is deprecated" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.compat
def test_generate_with_a_given_cache_keeps_its_state(folder):
    """generate() hands a cache passed by the caller to forward() (under `cache=` from
    transformers 5.24): the state must advance, or every step would decode from nothing."""
    model = GLASwapForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = torch.randint(4, 128, (1, 7), generator=torch.Generator().manual_seed(4))
    cache = modeling.GLASwapCache(model.config.num_hidden_layers)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0,
              eos_token_id=None)
    with_cache = model.generate(ids, use_cache=True, **{modeling.CACHE_NAME: cache}, **kw)
    assert cache.seen_tokens == 7 + 6 - 1  # the last token is sampled, never fed back
    assert torch.equal(with_cache, model.generate(ids, use_cache=False, **kw))


def test_the_tested_transformers_range_is_the_pinned_one():
    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = next(d for d in deps if re.match(r"transformers\b", d))
    (lo_major, lo_minor), (hi_major, hi_minor) = modeling.TESTED_TRANSFORMERS
    assert pin == f"transformers>={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1}"


def test_an_untested_transformers_is_named_once(monkeypatch):
    lo, hi = (".".join(map(str, v)) for v in modeling.TESTED_TRANSFORMERS)
    for inside in (f"{lo}.0", f"{hi}.3", f"{hi}.0.dev0"):
        assert transformers_version_problem(inside) is None, inside
    below = transformers_version_problem("4.57.1")
    assert f"tested with transformers {lo} to {hi}" in below and "4.57.1" in below and "pip install" in below
    assert transformers_version_problem("6.0.0") is not None
    major, minor = modeling.TESTED_TRANSFORMERS[1]
    assert transformers_version_problem(f"{major}.{minor + 1}.0") is not None

    monkeypatch.setattr(modeling.transformers, "__version__", "9.1.0")
    monkeypatch.setattr(modeling, "_version_warned", False)
    from glaswap.models.configuration_glaswap import GLASwapConfig

    cfg = GLASwapConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GLASwapForCausalLM(cfg)
        GLASwapForCausalLM(cfg)
    named = [w for w in caught if "transformers 9.1.0" in str(w.message)]
    assert len(named) == 1, [str(w.message) for w in caught]


# ----------------------------------------------------------------------------- optional packages
HIDE = """
import importlib.machinery, sys
class _Hidden(importlib.machinery.PathFinder):
    # What an install without these packages looks like: import fails, find_spec gives None.
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.split(".")[0] in {names!r} else super().find_spec(name, path, target)
sys.meta_path = [_Hidden if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


def _run_hiding(names, code, cwd):
    """Run code in a fresh process (glaswap importable from this checkout) where `names` are not installed."""
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / ".shim"), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-c", HIDE.format(names=set(names)) + code], cwd=str(cwd), env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.compat
def test_without_triton_glaswap_and_a_saved_folder_run_on_pytorch(folder, tmp_path):
    case = _case(folder, tmp_path)
    code = f"""
import torch
import glaswap.cli, glaswap_kernels
from glaswap.runtime import load_student
from transformers import AutoModelForCausalLM
print("has_triton", glaswap_kernels.HAS_TRITON)
case = torch.load({str(case)!r})
with torch.no_grad():
    mine = load_student({str(folder)!r}, torch.device("cpu"), torch.float32)(case["ids"]).logits
    saved = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True, dtype=torch.float32)
    theirs = saved.eval()(case["ids"]).logits
print("same", torch.allclose(mine, case["logits"], rtol=1e-5, atol=1e-5),
      torch.allclose(theirs, case["logits"], rtol=1e-5, atol=1e-5))
print("triton imported", "triton" in sys.modules)
"""
    proc = _run_hiding(["triton"], "import sys\n" + code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "has_triton False" in proc.stdout and "same True True" in proc.stdout, proc.stdout
    assert "triton imported False" in proc.stdout, proc.stdout


def test_without_matplotlib_results_are_written_and_the_png_is_named_skipped(tmp_path):
    code = f"""
from pathlib import Path
from glaswap.generate import write_bench
rows = [{{"context": 8, "student": {{"tokens_per_s": 1.0, "peak_gib": None}}}}]
paths = write_bench(rows, Path({str(tmp_path)!r}), "t")
print("paths", paths)
"""
    proc = _run_hiding(["matplotlib"], code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "decode_bench.json").is_file() and not (tmp_path / "decode_bench.png").exists()
    assert "no PNG: pip install matplotlib" in proc.stdout, proc.stdout


def test_without_matplotlib_distill_finishes_without_the_loss_png(tmp_path):
    recipe = tiny_recipe(tmp_path, s1=2, s2=2)
    code = f"""
from pathlib import Path
from glaswap.distill import distill, load_recipe
distill(load_recipe({str(recipe)!r}), out=Path({str(tmp_path / 'out')!r}), log=lambda *a, **k: None)
"""
    proc = _run_hiding(["matplotlib"], code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out" / "model.safetensors").is_file() and not (tmp_path / "out" / "loss.png").exists()


# ----------------------------------------------------------------------------- files
@pytest.fixture
def umask022():
    before = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(before)


def _mode(path):
    return os.stat(path).st_mode & 0o777


def test_atomic_write_gives_a_file_others_can_read(tmp_path, umask022):
    atomic_write(tmp_path / "a" / "x.json", lambda p: p.write_text("{}"))
    assert _mode(tmp_path / "a" / "x.json") == 0o644
    os.umask(0o077)  # a private umask stays private
    atomic_write(tmp_path / "y.json", lambda p: p.write_text("{}"))
    assert _mode(tmp_path / "y.json") == 0o600
    assert umasked(0o777) == 0o700


def test_converted_folder_is_readable_by_others(tmp_path, umask022):
    src = save_teacher(tiny_teacher("llama"), tmp_path / "src")
    out = tmp_path / "gla"
    convert(str(src), out, report=False, log=lambda *_: None)
    assert _mode(out) == 0o755
    files = [p for p in out.rglob("*") if p.is_file()]
    assert files and {p.name: _mode(p) for p in files} == {p.name: 0o644 for p in files}
    convert(str(src), out, force=True, report=False, log=lambda *_: None)  # replacing keeps the modes
    assert _mode(out) == 0o755


def test_sdist_carries_license_and_test_helpers(tmp_path):
    """The sdist (built from the tracked files) has the LICENSE, the SPDX licence field, the
    Linux-only Triton requirement, and the tests' shared setup and builders."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip("the SPDX licence field needs setuptools >= 77 (the build itself fetches it)")
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    src = tmp_path / "src"
    for rel in tracked.stdout.split():
        if (REPO / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((REPO / rel).read_bytes())
    build = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                            "print(b.build_sdist(sys.argv[1]))", str(tmp_path / "dist")],
                           cwd=src, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    sdist = tmp_path / "dist" / build.stdout.split()[-1]
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        pkg_info = tar.extractfile(next(n for n in tar.getnames() if n.endswith("/PKG-INFO"))).read().decode()
    for needed in ("LICENSE", "tests/conftest.py", "tests/helpers.py", "tests/gla_helpers.py",
                   "tests/test_compat.py", "glaswap_kernels/ops.py"):
        assert needed in names, needed
    assert "License-Expression: Apache-2.0" in pkg_info
    assert re.search(r"Requires-Dist: triton.*; platform_system == \"Linux\"", pkg_info), pkg_info
    assert re.search(r'Requires-Dist: matplotlib.*; extra == "plots"', pkg_info), pkg_info
