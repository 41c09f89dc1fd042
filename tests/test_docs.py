"""The README's set-up commands and recipes stay true: CI runs the test command, every recipe it
names exists and validates, and every shipped recipe is in the README."""

import re

from helpers import REPO

from glaswap.distill import load_recipe

RECIPE = r"recipes/([a-z0-9][\w.-]*\.yaml)"


def _readme():
    return (REPO / "README.md").read_text()


def _commands():
    return [line.strip() for line in re.findall(r"```bash\n(.*?)```", _readme(), re.S)[:2]]


def test_ci_runs_the_readme_test_command():
    main_job, tests = _commands()
    assert "pytest" in tests and "glaswap distill" in main_job
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert tests in ci, "the README's test command must be a line of .ci/run"


def test_main_job_recipe_validates():
    main_job, _ = _commands()
    names = re.findall(RECIPE, main_job)
    assert len(names) == 1, f"the README's main job must name one recipe: {main_job!r}"
    load_recipe(REPO / "recipes" / names[0])


def test_readme_recipes_exist_and_validate():
    names = sorted(set(re.findall(RECIPE, _readme())))
    assert names, "the README names no recipe"
    for name in names:
        assert (REPO / "recipes" / name).is_file(), f"the README names recipes/{name}, which does not exist"
        load_recipe(REPO / "recipes" / name)


def test_every_shipped_recipe_is_in_the_readme():
    shipped = sorted(p.name for p in (REPO / "recipes").glob("*.yaml"))
    assert shipped, "no recipe found in recipes/"
    named = set(re.findall(RECIPE, _readme()))
    missing = [name for name in shipped if name not in named]
    assert not missing, f"recipes not described in the README: {missing}"
