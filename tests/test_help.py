"""What a newcomer reads first: `glaswap --help` lists every command with a whole summary, and
a recipe copied with `recipes cp` names its own file in the command its header opens with."""

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
