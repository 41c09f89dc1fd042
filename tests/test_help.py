"""What a newcomer reads first: `glaswap --help` answers at once and lists every command with a
whole summary, and a recipe copied with `recipes cp` names its own file in the command its
header opens with."""

import subprocess
import sys

from click.testing import CliRunner

from glaswap.cli import main


def test_help_shows_whole_summaries():
    r = CliRunner().invoke(main, ["--help"], terminal_width=80)
    assert r.exit_code == 0, r.output
    listed = r.output.split("Commands:", 1)[1].strip().splitlines()
    assert {line.split()[0] for line in listed} == set(main.commands)
    for line in listed:
        assert not line.rstrip().endswith("..."), line
        assert len(line) <= 80, line


def test_copied_recipe_names_itself(tmp_path):
    dest = tmp_path / "mine.yaml"
    r = CliRunner().invoke(main, ["recipes", "cp", "smollm2-135m-demo", str(dest)])
    assert r.exit_code == 0, r.output
    first = dest.read_text().splitlines()[0]
    assert first == f"# glaswap distill --recipe {dest}", first
    assert f"--recipe {dest}" in r.output


def test_the_cli_starts_without_torch_or_transformers():
    """`glaswap --help` (and a mistyped command) answers at once: the heavy imports wait for
    the command that needs them."""
    code = "import sys, glaswap.cli; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
