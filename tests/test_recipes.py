"""Shipped recipes: `glaswap recipes` lists them, `recipes cp` copies one, `--recipe NAME`
resolves one, and a wheel install has them (built, installed and run outside the checkout)."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import REPO, tiny_recipe, unwritable_folder

from glaswap.cli import main
from glaswap.distill import load_recipe
from glaswap.distill.recipe import recipe_summary, resolve_recipe, shipped_recipes
from glaswap.errors import GlaswapError


def _one_line_error(args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert result.exit_code != 0 and len(lines) == 1 and lines[0].startswith("Error:"), result.output
    return lines[0]


def test_recipes_lists_each_shipped_recipe_on_one_line():
    result = CliRunner().invoke(main, ["recipes"])
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    shipped = shipped_recipes()
    assert len(lines) == len(shipped) >= 4
    for line, (name, path) in zip(lines, shipped.items()):
        assert line.split()[0] == name and line.endswith(recipe_summary(path)), line
    assert "smollm2-135m-demo" in shipped and "CPU" in recipe_summary(shipped["smollm2-135m-demo"])


def test_recipes_cp_copies_and_refuses_to_overwrite(tmp_path):
    shipped = shipped_recipes()["smollm2-135m-demo"]
    dest = tmp_path / "mine.yaml"
    result = CliRunner().invoke(main, ["recipes", "cp", "smollm2-135m-demo", str(dest)])
    assert result.exit_code == 0 and f"--recipe {dest}" in result.output, result.output
    copied = dest.read_text().split("\n", 1)
    assert copied[0] == f"# glaswap distill --recipe {dest}"          # it names itself
    assert copied[1] == shipped.read_text().split("\n", 1)[1]
    dest.write_text("edited\n")
    assert "already exists" in _one_line_error(["recipes", "cp", "smollm2-135m-demo", dest])
    assert dest.read_text() == "edited\n"
    result = CliRunner().invoke(main, ["recipes", "cp", "smollm2-135m-demo.yaml", str(dest), "--force"])
    assert result.exit_code == 0 and dest.read_text().split("\n", 1) == copied, result.output
    folder = tmp_path / "folder"
    folder.mkdir()
    assert CliRunner().invoke(main, ["recipes", "cp", "llama-3.2-1b", str(folder)]).exit_code == 0
    assert (folder / "llama-3.2-1b.yaml").read_text().split("\n", 1)[1] == \
        shipped_recipes()["llama-3.2-1b"].read_text().split("\n", 1)[1]
    line = _one_line_error(["recipes", "cp", "smollm3", tmp_path / "x.yaml"])
    assert "no recipe named 'smollm3'" in line and "smollm2-135m-demo" in line
    assert not (tmp_path / "x.yaml").exists()


def test_recipe_resolves_by_name_and_a_file_wins(tmp_path, monkeypatch):
    shipped = shipped_recipes()
    assert resolve_recipe("smollm2-135m") == shipped["smollm2-135m"]
    assert resolve_recipe("smollm2-135m.yaml") == shipped["smollm2-135m"]
    assert load_recipe("smollm2-135m-demo") == load_recipe(shipped["smollm2-135m-demo"])
    monkeypatch.chdir(tmp_path)
    own = tiny_recipe(tmp_path)
    Path("smollm2-135m.yaml").write_text(own.read_text())   # a file of that name, here, is the one read
    assert resolve_recipe("smollm2-135m.yaml") == Path("smollm2-135m.yaml")
    assert load_recipe("smollm2-135m.yaml").model.source == str(tmp_path / "teacher")
    assert load_recipe("smollm2-135m").model.source == "smollm2-135m"
    with pytest.raises(GlaswapError, match="recipe file sub/x.yaml does not exist; shipped recipes: "):
        resolve_recipe("sub/x.yaml")
    line = _one_line_error(["distill", "--recipe", "llama-3.2-2b"])
    assert "no recipe named 'llama-3.2-2b'" in line and ", ".join(shipped) in line, line


# ----------------------------------------------------------------------------- a wheel install
def _venv_with_these_packages(folder: Path) -> Path:
    """A virtual environment without pip or glaswap that sees this interpreter's installed
    packages (torch, transformers, ...) through a .pth file. Its own site-packages comes
    first, and the .pth files of the directories it adds are not run, so an editable glaswap
    installed here stays invisible."""
    venv.create(folder, with_pip=False, symlinks=os.name != "nt")
    python = folder / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    parents = [p for p in site.getsitepackages() + [site.getusersitepackages()] if Path(p).is_dir()]
    (Path(own) / "glaswap_test_parent.pth").write_text("".join(p + "\n" for p in parents))
    return python


def _copy_sources(dest: Path) -> Path:
    """The checkout's files without build outputs, runs or data (git's view where there is
    one): the build writes beside the sources, so it runs on a copy."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True)
    if listed.returncode == 0:
        for name in listed.stdout.splitlines():
            if (REPO / name).is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(REPO / name, dest / name)
    else:
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "runs", "out"))
    return dest


def _clean_env(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", GLASWAP_CACHE=str(tmp_path / "cache"), PIP_NO_INDEX="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def _run(cmd, cwd, env):
    proc = subprocess.run([str(c) for c in cmd], cwd=str(cwd), env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_wheel_install_lists_copies_and_distils_outside_the_checkout(tmp_path):
    """The README's commands from a wheel: build it from a copy of the sources, install it
    into a fresh environment (no network, no index), and from a folder outside the checkout
    list the recipes, copy one, and run a one-step distillation of a tiny model with a
    shipped recipe by name."""
    env = _clean_env(tmp_path)
    src = _copy_sources(tmp_path / "src")
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", wheels, src], tmp_path, env)
    (wheel,) = wheels.glob("glaswap-*.whl")
    members = zipfile.ZipFile(wheel).namelist()
    for name in shipped_recipes():
        assert f"glaswap/recipes/{name}.yaml" in members, f"the wheel lacks the recipe {name}"

    python = _venv_with_these_packages(tmp_path / "venv")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
         tmp_path, env)
    work = tmp_path / "work"
    work.mkdir()
    where = _run([python, "-c", "import glaswap, glaswap_kernels; print(glaswap.__file__); "
                                "print(glaswap_kernels.__file__)"], work, env).stdout.split()
    assert all(Path(p).is_relative_to(tmp_path / "venv") for p in where), where
    glaswap = python.parent / "glaswap"

    listed = _run([glaswap, "recipes"], work, env).stdout.splitlines()
    assert [line.split()[0] for line in listed] == list(shipped_recipes()), listed
    _run([glaswap, "recipes", "cp", "smollm2-135m-demo", "demo.yaml"], work, env)
    assert (work / "demo.yaml").read_text().split("\n", 1)[1] == \
        shipped_recipes()["smollm2-135m-demo"].read_text().split("\n", 1)[1]

    tiny = load_recipe(tiny_recipe(tmp_path))   # a tiny random Llama and token files, no network
    overrides = [f"model.source={tiny.model.source}", f"data.train=[{{path: {tiny.data.train[0].path}}}]",
                 "data.eval=[]", "data.seq_len=32", "data.heldout_fraction=0.1", "data.eval_tokens=64",
                 "stage1.steps=1", "stage1.batch_size=2", "stage2.steps=1", "stage2.batch_size=2",
                 "train.checkpoint_every=0"]
    _run([glaswap, "distill", "--recipe", "smollm2-135m-demo", *overrides, "--out", "out"], work, env)
    for name in ("model.safetensors", "config.json", "recipe.yaml", "eval.json", "adapter/adapter_config.json"):
        assert (work / "out" / name).is_file(), name
    assert load_recipe(work / "out" / "recipe.yaml").name == "smollm2-135m-demo"


def test_recipes_cp_onto_a_dangling_symlink_needs_force(tmp_path):
    link = tmp_path / "mine.yaml"
    link.symlink_to(tmp_path / "gone.yaml")
    line = _one_line_error(["recipes", "cp", "smollm2-135m-demo", link])
    assert "symbolic link" in line and "--force" in line, line
    assert link.is_symlink() and not (tmp_path / "gone.yaml").exists()
    result = CliRunner().invoke(main, ["recipes", "cp", "smollm2-135m-demo", str(link), "--force"])
    assert result.exit_code == 0 and not link.is_symlink() and link.is_file(), result.output


def test_recipes_cp_to_an_unwritable_or_impossible_destination_one_line(tmp_path):
    a_file = tmp_path / "file.txt"
    a_file.write_text("")
    unwritable = unwritable_folder(tmp_path)
    for dest in (a_file / "x.yaml", unwritable / "x.yaml"):
        line = _one_line_error(["recipes", "cp", "smollm2-135m-demo", dest])
        assert f"cannot write {dest}" in line, line
    assert a_file.read_text() == ""
