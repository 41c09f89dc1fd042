"""The README's set-up commands and recipes stay true: CI runs the test command, every recipe it
names is shipped and validates, and every shipped recipe is in the README's table."""

import re

from helpers import REPO

from glaswap.distill import load_recipe
from glaswap.distill.recipe import shipped_recipes

RECIPE = r"--recipe ([a-z0-9][\w.-]*)"   # a name, or a file of the user's own (ends in .yaml)


def _readme():
    return (REPO / "README.md").read_text()


def _commands():
    return [line.strip() for line in re.findall(r"```bash\n(.*?)```", _readme(), re.S)[:2]]


def _shipped_names(text):
    return sorted({name for name in re.findall(RECIPE, text) if not name.endswith(".yaml")})


def test_ci_runs_the_readme_test_command():
    main_job, tests = _commands()
    assert "pytest" in tests and "glaswap distill" in main_job
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert tests in ci, "the README's test command must be a line of .ci/run"


def test_main_job_recipe_validates():
    main_job, _ = _commands()
    names = _shipped_names(main_job)
    assert len(names) == 1, f"the README's main job must name one shipped recipe: {main_job!r}"
    assert names[0] in shipped_recipes()
    load_recipe(names[0])


def test_readme_recipes_exist_and_validate():
    names = _shipped_names(_readme())
    assert names, "the README names no recipe"
    for name in names:
        assert name in shipped_recipes(), f"the README runs --recipe {name}, which glaswap does not ship"
        load_recipe(name)


def test_every_shipped_recipe_is_in_the_readme():
    shipped = sorted(shipped_recipes())
    assert shipped, "no recipe found in glaswap/recipes/"
    table = _readme().split("The shipped recipes:", 1)[1].strip().split("\n\n", 1)[0]
    described = sorted(re.findall(r"^\| `([a-z0-9][\w.-]*)` \|", table, re.M))
    assert described == shipped, f"the README's table of shipped recipes: {described}, shipped: {shipped}"
