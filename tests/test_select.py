"""softmax_layers auto:N: choosing the layers by the KL they remove as softmax attention, the
recipe's checks, and a tiny run that chooses, records and resumes its choice."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import randomise_new_parameters, tiny_recipe, tiny_teacher
from safetensors.torch import load_file

from glaswap.cli import main
from glaswap.convert import glaswap_config
from glaswap.distill import data as D
from glaswap.distill import distill, load_recipe
from glaswap.distill import select as S
from glaswap.distill.loop import Interrupted
from glaswap.errors import GlaswapError
from glaswap.models.modeling_glaswap import GLASwapForCausalLM


def _quiet(*_args, **_kwargs):
    pass


def _blocks(doc_lens, seq_len, seed=0):
    rng = np.random.default_rng(seed)
    lens = np.asarray(doc_lens, dtype=np.int64)
    return D.PackedBlocks(D.Tokens(rng.integers(0, 128, int(lens.sum())).astype(np.uint32), lens), seq_len)


def _planted(layers=4, copier=2, options=None):
    """A converted tiny Llama whose attention matters in one layer only: every other layer's
    o_proj is scaled to ~0, so its output (softmax or GLA) hardly reaches the residual
    stream, while the `copier` layer's softmax attention, which reads every earlier token,
    is the only way the teacher's predictions depend on tokens beyond the window."""
    teacher = tiny_teacher("llama", layers=layers)
    lm = GLASwapForCausalLM(glaswap_config(teacher.config.to_dict(), options or {}))
    lm.load_state_dict(teacher.state_dict(), strict=False)
    randomise_new_parameters(lm)
    with torch.no_grad():
        for i, layer in enumerate(lm.model.layers):
            layer.self_attn.o_proj.weight.mul_(4.0 if i == copier else 1e-3)
    return lm.eval()


@pytest.mark.parametrize("copier", [0, 2])
def test_the_planted_layer_ranks_first(copier):
    lm = _planted(copier=copier, options={"window": 8, "sinks": 2})
    blocks = _blocks([64] * 6, 64)
    ranking = S.rank_layers(lm, blocks, n_sequences=3, batch_size=2, device=torch.device("cpu"),
                            dtype=torch.float32)
    rows = ranking["layers"]
    assert [r["layer"] for r in rows] == [0, 1, 2, 3]
    assert rows[copier]["rank"] == 1 and S.top_layers(ranking, 1) == [copier]
    others = max(abs(r["drop"]) for r in rows if r["layer"] != copier)
    assert ranking["baseline_kl"] > 1e-3 and rows[copier]["drop"] > 50 * others, ranking
    # with that layer softmax the student is nearly the teacher
    assert rows[copier]["kl"] < 0.02 * ranking["baseline_kl"], ranking
    # counted from window + sinks = 10, but at least half the 64-token block in
    assert ranking["counted_from_position"] == 32 and ranking["tokens"] == 3 * 32
    assert ranking["sequences"] == 3 and ranking["seq_len"] == 64
    assert not lm.training and all(layer.self_attn.mode == "gla" for layer in lm.model.layers)


def test_reusing_the_lower_layers_changes_no_figure(monkeypatch):
    """Each pass takes the layers below the restored one from the all-GLA pass: the same KL
    as running every layer again."""
    lm = _planted(copier=1, options={"window": 8})
    blocks = _blocks([40, 24] * 3, 64)
    fast = S.rank_layers(lm, blocks, 3, 2, torch.device("cpu"), torch.float32)
    monkeypatch.setattr(S, "_reuse_below", lambda *_args: S.contextlib.nullcontext())
    full = S.rank_layers(lm, blocks, 3, 2, torch.device("cpu"), torch.float32)
    assert [r["kl"] for r in fast["layers"]] == [r["kl"] for r in full["layers"]]
    assert fast["baseline_kl"] == full["baseline_kl"] and fast["tokens"] == full["tokens"] > 0
    assert all("forward" not in vars(m) for m in lm.model.layers)


def test_copies_repeat_text_from_beyond_the_window():
    """Planted copies: the same tokens as a source earlier in the same document, every copied
    token further from its source than the window and its sinks reach; the copy mask covers
    the positions that predict a copied token, and three quarters of the text stay natural."""
    class Config:
        window, sinks = 16, 2

    rng = np.random.default_rng(0)
    blocks = _blocks([700, 324], 1024)         # two documents in one block
    ids, _ = blocks.block(0)
    pos = S._positions(blocks, 0)
    start = S.counted_from(Config, 1024)
    new, copy, near = S.plant_copies(ids, pos, start, Config, 8, rng)
    changed = np.nonzero(new != ids)[0]
    assert copy.sum() > 0 and len(changed) > 0
    counted = pos >= start
    assert (counted & ~near).sum() >= 0.75 * counted.sum()
    doc = np.cumsum(pos == 0)
    for q in np.nonzero(copy)[0]:              # q predicts new[q + 1], a copy of an earlier token
        assert near[q] and counted[q]
        sources = [p for p in range(q - Config.window - 1) if doc[p] == doc[q] and new[p] == new[q + 1]
                   and new[p - 1] == new[q] and pos[p] >= Config.sinks]
        assert sources, q
    # only the copies changed the text, and nothing outside a copy
    assert np.isin(changed, np.nonzero(near)[0]).all()
    # blocks too short for a copy keep their text
    short = _blocks([64], 64)
    same, c, _ = S.plant_copies(short.block(0)[0], S._positions(short, 0), 32, Config, 8, rng)
    assert np.array_equal(same, short.block(0)[0]) and not c.any()


def test_greedy_steps_reuse_lower_layers_and_lower_the_kl(monkeypatch):
    """With keep = 2 the second step tries the other layers on top of the first; the figures
    equal those of running every layer in every pass, the KL falls step by step, and ranks
    follow the order chosen."""
    lm = _planted(layers=4, copier=1, options={"window": 8})
    blocks = _blocks([256] * 3, 256)
    fast = S.rank_layers(lm, blocks, 3, 2, torch.device("cpu"), torch.float32, keep=2, span=8)
    monkeypatch.setattr(S, "_reuse_below", lambda *_args: S.contextlib.nullcontext())
    full = S.rank_layers(lm, blocks, 3, 2, torch.device("cpu"), torch.float32, keep=2, span=8)
    assert fast["steps"] == full["steps"] and fast["layers"] == full["layers"]
    assert fast["copy_tokens"] > 0 and fast["tokens"] > 0
    steps = fast["steps"]
    assert steps[0]["layer"] == 1 and len({s["layer"] for s in steps}) == 2
    assert fast["baseline_kl"] > steps[0]["kl"] >= steps[1]["kl"] - 1e-9
    ranks = {r["layer"]: r["rank"] for r in fast["layers"]}
    assert [ranks[s["layer"]] for s in steps] == [1, 2] and sorted(ranks.values()) == [1, 2, 3, 4]
    assert S.top_layers(fast, 2) == sorted(s["layer"] for s in steps)
    # a layer's score alone: the shares of the all-GLA KL it removes, natural and copies
    r = fast["layers"][1]
    assert r["score"] == pytest.approx(r["drop"] / fast["baseline_kl"] + r["drop_copy"] / fast["baseline_kl_copy"])


def test_positions_are_counted_within_documents():
    class Config:
        window, sinks = 4, 2

    assert S.counted_from(Config, 2048) == 256           # a few hundred tokens in
    assert S.counted_from(Config, 32) == 16              # half of a short block
    Config.window = 300
    assert S.counted_from(Config, 2048) == 302           # past the window and its sinks
    Config.window = 0
    assert S.counted_from(Config, 2048) == 256           # pure GLA: no sinks without a window

    # blocks of 32: [0, 32) one document; [32, 64) documents of 10 and 22; [64, 96) of 20
    # then one that runs on; [96, 128) the rest of it (restarting at the block)
    blocks = _blocks([32, 10, 22, 20, 44], 32)
    counts = [int((S._positions(blocks, i) >= 12).sum()) for i in range(len(blocks))]
    assert counts == [20, 10, 8, 20]
    assert S.pick_blocks(blocks, 2, 12) == [0, 3] and S.pick_blocks(blocks, 9, 40) == []
    # the ranking counts the same positions
    lm = _planted(layers=2, copier=1)
    ranking = S.rank_layers(lm, blocks, 4, 3, torch.device("cpu"), torch.float32)
    assert ranking["counted_from_position"] == 16 and ranking["tokens"] == 16 + 6 + 4 + 16


def test_the_budget_keeps_the_selection_under_a_fifth_of_the_recipe():
    demo = load_recipe("smollm2-135m-demo")
    n = S.sequences_for_budget(demo, num_layers=30)
    s1, s2 = demo.stage1, demo.stage2
    train = (s1.steps * s1.batch_size + s2.steps * s2.batch_size) * S.TRAIN_PASSES
    cost = S.selection_passes(30) * n
    assert 1 <= n and cost / (cost + train) <= S.SHARE
    six = S.sequences_for_budget(demo, num_layers=30, keep=6)   # six greedy steps: fewer blocks
    assert 1 <= six <= n and (S.selection_passes(30, 6) * six / (S.selection_passes(30, 6) * six + train)
                              <= S.SHARE or six == 1)
    gpu = load_recipe("smollm2-135m")
    assert S.sequences_for_budget(gpu, num_layers=30) == S.MAX_SEQUENCES
    short = load_recipe("smollm2-135m-demo", ["stage1.steps=1", "stage2.steps=0"])
    assert S.sequences_for_budget(short, num_layers=30) == 1   # at least one block, whatever it costs


def test_the_plot_highlights_the_chosen_layers(tmp_path):
    pytest.importorskip("matplotlib")
    lm = _planted(copier=2)
    ranking = S.rank_layers(lm, _blocks([64] * 2, 64), 2, 2, torch.device("cpu"), torch.float32)
    ranking["chosen"] = S.top_layers(ranking, 2)
    S.write_ranking(tmp_path, ranking)
    assert S.read_ranking(tmp_path) == json.loads(json.dumps(ranking))
    assert (tmp_path / "ranking.png").stat().st_size > 1000
    assert not (tmp_path / "ranking.json.tmp").exists()


# ----------------------------------------------------------------------------- in a recipe
def _auto_recipe(tmp_path, n=1, **extra):
    path = tiny_recipe(tmp_path, s1=3, s2=2, every=1, **extra)
    return path, [f"model.options.softmax_layers=auto:{n}"]


def test_auto_chooses_records_and_resumes(tmp_path, monkeypatch):
    path, over = _auto_recipe(tmp_path)
    lines = []
    ref = distill(load_recipe(path, over), out=tmp_path / "ref", log=lines.append)
    out = tmp_path / "ref"
    ranking = json.loads((out / "ranking.json").read_text())
    assert (out / "ranking.png").is_file() or not S.importlib.util.find_spec("matplotlib")
    chosen = ranking["chosen"]
    assert len(chosen) == 1 and ranking["n"] == 1 and len(ranking["layers"]) == 2
    assert sorted(r["rank"] for r in ranking["layers"]) == [1, 2]
    assert ranking["tokens"] > 0 and ranking["seconds"] > 0 and 0 < ranking["share_of_run"] < 1
    assert ranking["data"] == "evaluation" and ranking["counted_from_position"] == 16
    assert any(line.startswith(f"softmax layers {chosen} of 2") for line in lines), lines
    # the saved model and its records name the layers
    config = json.loads((out / "config.json").read_text())
    assert config["softmax_layers"] == chosen
    saved = GLASwapForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert saved.config.softmax_layers == chosen
    assert not any(f"layers.{chosen[0]}.self_attn.gate" in n for n in load_file(str(out / "model.safetensors")))
    resolved = load_recipe(out / "recipe.yaml")
    assert resolved.model.options["softmax_layers"] == chosen
    assert (out / "recipe.yaml").read_text().startswith("# model.options.softmax_layers: chosen by auto:1")
    assert ref["distill"]["softmax_selection"]["layers"] == chosen
    assert json.loads((out / "glaswap.json").read_text())["options"]["softmax_layers"] == chosen
    base = json.loads((out / "adapter" / "glaswap_base.json").read_text())
    assert base["options"]["softmax_layers"] == chosen
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["layers"] for r in records if r.get("event") == "softmax_selection"] == [chosen]

    # interrupted in stage 2, then resumed: the recorded choice, never measured again
    with pytest.raises(Interrupted):
        distill(load_recipe(path, over), out=tmp_path / "run", log=_quiet, stop_after=(2, 1))
    state = json.loads((tmp_path / "run.run" / "checkpoints" / "stage2" / "state.json").read_text())
    assert state["softmax_layers"] == chosen

    def refuse(*_args, **_kwargs):
        raise AssertionError("a resumed run measured the layers again")

    monkeypatch.setattr(S, "rank_layers", refuse)
    distill(load_recipe(path, over), out=tmp_path / "run", resume=True, log=_quiet)
    a, b = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "run" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    again = json.loads((tmp_path / "run" / "ranking.json").read_text())
    assert again["chosen"] == chosen and again["share_of_run"] is None
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("event") == "softmax_selection" for r in records) == 1


def test_ranking_on_blocks_longer_than_training(tmp_path):
    """stage1.select_seq_len ranks on evaluation blocks of that length (the budget counts them
    as that many times a training block); the default, 0, leaves the recipe's hash as it was."""
    from glaswap.distill.recipe import training_hash

    path, over = _auto_recipe(tmp_path)
    plain = load_recipe(path, over)
    longer = load_recipe(path, [*over, "stage1.select_seq_len=64"])
    assert S.selection_seq_len(plain) == 32 and S.selection_seq_len(longer) == 64
    assert S.sequences_for_budget(longer, 2) <= S.sequences_for_budget(plain, 2)
    assert training_hash(plain) == training_hash(load_recipe(path, [*over, "stage1.select_seq_len=0"]))
    assert training_hash(plain) != training_hash(longer)
    distill(longer, out=tmp_path / "out", log=_quiet)
    ranking = json.loads((tmp_path / "out" / "ranking.json").read_text())
    assert ranking["seq_len"] == 64 and ranking["data"] == "evaluation" and ranking["tokens"] > 0
    with pytest.raises(GlaswapError, match="stage1.select_seq_len"):
        load_recipe(path, [*over, "stage1.select_seq_len=8"])
    too_long = load_recipe(path, [*over, "stage1.select_seq_len=100000"])
    with pytest.raises(GlaswapError, match="stage1.select_seq_len=100000 is longer than the evaluation text"):
        distill(too_long, out=tmp_path / "out2", log=_quiet)
    assert not (tmp_path / "out2").exists() and not (tmp_path / "out2.run").exists()   # refused before training


def _cli_error(args, after_conversion=False):
    """The one error line of a refused `glaswap distill`; `after_conversion`: once the layer
    count is known, after convert's progress lines."""
    result = CliRunner().invoke(main, ["distill", *map(str, args)])
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error:")]
    assert result.exit_code != 0 and len(errors) == 1 and errors[0] == lines[-1], result.output
    assert after_conversion or len(lines) == 1, result.output
    return lines[-1]


def test_auto_out_of_range_is_one_line(tmp_path):
    path = tiny_recipe(tmp_path)
    line = _cli_error(["--recipe", path, "model.options.softmax_layers=auto:0", "--out", tmp_path / "a"])
    assert "recipe key model.options.softmax_layers: invalid softmax_layers 'auto:0'" in line, line
    for n in (2, 5):   # the tiny model has 2 layers: known once it is converted
        line = _cli_error(["--recipe", path, f"model.options.softmax_layers=auto:{n}", "--out", tmp_path / "b"],
                          after_conversion=True)
        assert f"auto:{n} asks for {n} softmax layers of the model's 2; choose N from 1 to 1" in line, line
        assert not (tmp_path / "b.run").exists() and not (tmp_path / "b").exists()
    line = _cli_error(["--recipe", path, "model.options.softmax_layers=auto:1", "train.distributed=fsdp"])
    assert "auto:N needs train.distributed ddp or auto" in line
    with pytest.raises(GlaswapError, match="model.options.softmax_layers"):
        load_recipe(path, ["model.options.softmax_layers=auto:x"])
