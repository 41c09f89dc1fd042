"""The README's two set-up commands stay true: CI runs the test one, the main job's recipe exists."""

import re

from helpers import REPO

from glaswap.distill import load_recipe


def _commands():
    text = (REPO / "README.md").read_text()
    return [line.strip() for line in re.findall(r"```bash\n(.*?)```", text, re.S)[:2]]


def test_ci_runs_the_readme_test_command():
    main_job, tests = _commands()
    assert "pytest" in tests and "glaswap distill" in main_job
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert tests in ci, "the README's test command must be a line of .ci/run"


def test_readme_recipes_exist_and_validate():
    text = (REPO / "README.md").read_text()
    for name in sorted(set(re.findall(r"recipes/([a-z0-9][\w.-]*\.yaml)", text))):
        load_recipe(REPO / "recipes" / name)
