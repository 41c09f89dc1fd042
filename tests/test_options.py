"""GLA_OPTIONS is the one definition of the GLA options: the config's arguments, convert's flags,
the adapter's rebuild command and the README's table all follow it."""

import ast
import json
import re
import shlex

import click
import pytest
from helpers import REPO

from glaswap.cli import convert as convert_command
from glaswap.distill.adapter import base_record
from glaswap.models.configuration_glaswap import GLASwapConfig
from glaswap.models.gla_options import GLA_OPTIONS, check_gla_options

CONFIG_FILE = REPO / "glaswap" / "models" / "configuration_glaswap.py"


def _readme_options():
    """{option name: (values cell, help cell)} of the README's convert options table, in order."""
    text = (REPO / "README.md").read_text()
    table = re.search(r"^\| option \| values \| what it trades \|\n\|---\|---\|---\|\n((?:\|.*\n)+)", text, re.M)
    assert table, "the README's table of convert options (| option | values | what it trades |) is missing"
    by_cell = {f"`{'/'.join(o.flags)}`" if o.flag else f"`{o.name}` (no flag)": o.name for o in GLA_OPTIONS.values()}
    rows = {}
    for line in table.group(1).splitlines():
        first, values, help_ = (cell.strip() for cell in line.strip().strip("|").split("|"))
        if first in by_cell:
            rows[by_cell[first]] = (values, help_)
        else:
            assert not re.fullmatch(r"`\w+`.*", first), f"README options row {first}: not a GLA option's flag or name"
    return rows


def _readme_default(opt, cell):
    if opt.choices:
        listed = re.findall(r"`([^`]+)`( \(default\))?", cell)
        assert [c for c, _ in listed] == list(opt.choices), (opt.name, cell)
        (default,) = [c for c, marked in listed if marked]
        return default
    if opt.type is bool:
        assert cell in ("on", "off"), (opt.name, cell)
        return cell == "on"
    if opt.type is list:
        assert cell == "none", (opt.name, cell)
        return []
    return opt.type(float(cell))


def test_readme_table_is_gla_options():
    rows = _readme_options()
    assert list(rows) == list(GLA_OPTIONS), "the README's options table must list GLA_OPTIONS, in its order"
    for name, (values, help_) in rows.items():
        opt = GLA_OPTIONS[name]
        assert _readme_default(opt, values) == opt.default, f"README default of {name}: {values}"
        assert help_ == opt.help, f"README text of {name} must be GLA_OPTIONS' help:\n{help_}\n{opt.help}"


def test_each_option_is_well_formed_and_its_default_valid():
    check_gla_options({name: opt.default for name, opt in GLA_OPTIONS.items()})
    for name, opt in GLA_OPTIONS.items():
        assert opt.name == name and opt.type in (bool, int, float, str, list), name
        assert opt.help and "\n" not in opt.help and "|" not in opt.help, name     # one line, a table cell
        assert (opt.choices is not None) == (opt.type is str), name
        assert opt.flag is None or re.fullmatch(r"--[a-z][a-z-]*", opt.flag), name
    assert GLASwapConfig().gla_options() == {name: opt.default for name, opt in GLA_OPTIONS.items()}


def test_convert_flags_come_from_gla_options():
    params = {p.name: p for p in convert_command.params}
    for name, opt in GLA_OPTIONS.items():
        if opt.flag is None:
            assert name not in params, name
            continue
        p = params[name]
        assert p.opts == [opt.flag] and p.default == opt.default and p.help == opt.help, name
        if opt.type is bool:
            assert p.secondary_opts == [opt.flags[1]], name
        elif opt.choices:
            assert isinstance(p.type, click.Choice) and tuple(p.type.choices) == opt.choices, name
    assert params["use_rope"].opts == ["--rope"] and params["use_rope"].secondary_opts == ["--no-rope"]


@pytest.mark.parametrize("bad, message", [
    (["--gate-rank", "0"], "invalid gate_rank 0; expected a whole number >= 1"),
    (["--gate-init-decay", "1"], "invalid gate_init_decay 1.0; expected 0 < decay < 1"),
    (["--rope-max-wavelength", "-1"], "invalid rope_max_wavelength -1.0; expected >= 0"),
    (["--sparse-cache", "4"], "a sparse cache needs a window"),
    (["--softmax-layers", "2,2"], "invalid softmax_layers [2, 2]; layer 2 is listed twice"),
    (["--softmax-layers", "auto:4"], "set model.options.softmax_layers: auto:4 in a recipe"),
    (["--softmax-layers", "auto:0"], "auto:N needs N >= 1"),
])
def test_convert_flags_are_checked_by_check_gla_options(tmp_path, bad, message):
    from click.testing import CliRunner

    from glaswap.cli import main

    r = CliRunner().invoke(main, ["convert", str(tmp_path / "nowhere"), str(tmp_path / "out"), *bad])
    lines = [line for line in r.output.splitlines() if line.strip()]
    assert r.exit_code != 0 and len(lines) == 1 and message in lines[0], r.output


def test_base_record_command_gives_back_the_options(tmp_path):
    """Every option with a flag, away from its default, survives the adapter's rebuild command."""
    options = {"gate": "scalar", "gate_rank": 4, "gate_init_decay": 0.9, "feature_map": "hedgehog_pm",
               "normalizer": True, "use_rope": False, "rope_max_wavelength": 512.0, "decay_horizon": 100.0,
               "state_heads": "query", "window": 8, "sinks": 2, "window_mix": "learned", "sparse_cache": 4,
               "softmax_layers": [1, 3], "softmax_max_distance": 4096}
    assert set(options) == {n for n, o in GLA_OPTIONS.items() if o.flag}
    full = {name: opt.default for name, opt in GLA_OPTIONS.items()} | options
    meta = {"options": full, "dtype": "float32", "seed": 3, "source": {}}
    record = base_record("some-model", meta, tmp_path / "out")
    args = shlex.split(record["command"])[2:]
    ctx = convert_command.make_context("convert", args)
    assert {name: ctx.params[name] for name in options} == options
    off = base_record("some-model", {**meta, "options": full | {"normalizer": False, "feature_map": "identity",
                                                                 "window": 0, "sinks": 0, "sparse_cache": 0}},
                      tmp_path / "out")
    assert "--no-normalizer" in shlex.split(off["command"])
    # an option without a flag, away from its default: no command, the Python call only
    assert base_record("some-model", {**meta, "options": full | {"gate_normalizer": 8.0}},
                       tmp_path / "out")["command"] is None


def test_rope_max_wavelength_has_one_default_and_old_folders_keep_theirs(tmp_path):
    assert GLA_OPTIONS["rope_max_wavelength"].default == 2048.0
    assert GLASwapConfig().rope_max_wavelength == 2048.0
    assert convert_command.make_context("convert", ["src", "out"]).params["rope_max_wavelength"] == 2048.0
    GLASwapConfig(rope_max_wavelength=64.0).save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert all(name in saved for name in GLA_OPTIONS)              # a config.json carries every option
    assert GLASwapConfig.from_pretrained(str(tmp_path)).rope_max_wavelength == 64.0
    # written before the option existed: every pair rotated, as that model was made
    del saved["rope_max_wavelength"]
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert GLASwapConfig.from_pretrained(str(tmp_path)).rope_max_wavelength == 0.0


def test_config_takes_gla_options_as_keywords_and_checks_them():
    cfg = GLASwapConfig(window=4, sinks=2, gate="key")
    assert (cfg.window, cfg.sinks, cfg.gate) == (4, 2, "key")
    assert GLASwapConfig(**cfg.to_dict()).gla_options() == cfg.gla_options()
    with pytest.raises(ValueError, match="sinks need a window"):
        GLASwapConfig(sinks=2)
    with pytest.raises(ValueError, match="invalid gate 'bogus'; choose one of lowrank, key, scalar"):
        GLASwapConfig(gate="bogus")


def test_configuration_file_imports_only_what_a_saved_folder_has():
    """It is copied into saved model folders and loaded there without glaswap (or click), with
    the options file beside it; that file, which the CLI imports as it starts, takes only the
    standard library."""
    from glaswap.checkpoint import CODE_FILES

    assert ("glaswap/models/gla_options.py", "gla_options.py") in CODE_FILES
    stdlib = {"__future__", "math", "re", "dataclasses", "typing"}
    for path, allowed in ((CONFIG_FILE, stdlib | {"transformers", "torch", "glaswap.models.gla_options"}),
                          (CONFIG_FILE.parent / "gla_options.py", stdlib)):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name in allowed or name.split(".")[0] in allowed, f"{path.name} imports {name}"
