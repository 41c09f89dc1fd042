"""Long-context probes: `glaswap eval --by-position` and `glaswap passkey`, and the RoPE
handling that keeps a converted model working past its training length."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from helpers import converted_tiny, tiny_teacher
from test_eval import ascii_tokenizer, sample_text

import glaswap.passkey as passkey_mod
from glaswap.cli import main
from glaswap.errors import GlaswapError
from glaswap.evaluate import evaluate
from glaswap.layers.gla_attention import rope_kept_dims
from glaswap.longcontext import bin_label, bin_means, position_bins
from glaswap.models.configuration_glaswap import GLASwapConfig
from glaswap.models.modeling_glaswap import GLASwapForCausalLM
from glaswap.passkey import (accuracy_grid, answer_is_key, build_prompt, format_passkey, key_nats, key_tokens,
                             parse_depths)

QUIET = dict(progress=False, log=lambda *_: None)
TEACHER_POSITIONS = 160


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny converted Llama (new parameters randomised) whose teacher has 160 positions."""
    teacher = tiny_teacher("llama")
    teacher.config.max_position_embeddings = TEACHER_POSITIONS
    return converted_tiny(tmp_path_factory.mktemp("long"), teacher, ascii_tokenizer())


# ----------------------------------------------------------------------------- arithmetic
def test_position_bins_double_from_the_first():
    assert position_bins(5000, 1024) == [(0, 1024), (1024, 2048), (2048, 4096), (4096, 5000)]
    assert position_bins(1024, 1024) == [(0, 1024)]
    assert position_bins(1, 1024) == [(0, 1)]
    assert position_bins(10, 2) == [(0, 2), (2, 4), (4, 8), (8, 10)]
    assert [bin_label(*b) for b in position_bins(4096, 1024)] == ["0-1K", "1K-2K", "2K-4K"]
    with pytest.raises(ValueError):
        position_bins(10, 0)


def test_bin_means_pool_documents_and_skip_unscored_tokens():
    a = np.array([np.nan, 1.0, 2.0, 3.0, 4.0])
    b = np.array([np.nan, 3.0, np.nan])
    got = bin_means([a, b], [(0, 2), (2, 4), (4, 8)])
    assert got == [((1.0 + 3.0) / 2, 2), ((2.0 + 3.0) / 2, 2), (4.0, 1)]
    assert bin_means([b], [(2, 4)]) == [(None, 0)]


def test_passkey_scoring_takes_the_first_number():
    assert answer_is_key(" 12345. Remember", "12345")
    assert not answer_is_key(" 1234 5", "12345")
    assert not answer_is_key(" 123456", "12345")
    assert not answer_is_key(" the key", "12345")
    assert not answer_is_key(" 99999 or 12345", "12345")
    assert parse_depths("0, 0.5,1") == [0.0, 0.5, 1.0]
    for bad in ("a,b", "1.5", ""):
        with pytest.raises(GlaswapError, match="depths"):
            parse_depths(bad)


def test_passkey_prompt_puts_the_key_at_its_depth():
    tok = ascii_tokenizer()
    for depth in (0.0, 0.5, 1.0):
        ids = build_prompt(tok, 600, depth, "31415")
        text = "".join(map(chr, ids))
        assert len(ids) <= 600 and len(ids) > 600 - 100
        assert text.count("31415") == 2 and text.endswith("The pass key is")
        at = text.index("The pass key is 31415") / len(text)
        assert abs(at - depth) < 0.2, (depth, at)
    assert "".join(map(chr, build_prompt(tok, 600, 0.0, "31415"))).index("31415") < 120
    with pytest.raises(GlaswapError, match="at least"):
        build_prompt(tok, 50, 0.5, "31415")


def test_passkey_prompt_from_a_text_keeps_its_tokens_in_order_around_the_key():
    tok = ascii_tokenizer()
    text = [ord(c) for c in "abcdefghij" * 3]                    # 30 tokens, taken from offset 25 on, wrapping
    for depth in (0.0, 0.5, 1.0):
        ids = build_prompt(tok, 400, depth, "27182", text_ids=text, offset=25)
        intro = tok(passkey_mod.INTRO)["input_ids"]
        needle = tok(passkey_mod.NEEDLE.format(key="27182"), add_special_tokens=False)["input_ids"]
        question = tok(passkey_mod.QUESTION, add_special_tokens=False)["input_ids"]
        assert len(ids) == 400 and ids[:len(intro)] == intro and ids[-len(question):] == question
        filler = ids[len(intro):len(ids) - len(question)]
        at = next(i for i in range(len(filler)) if filler[i:i + len(needle)] == needle)
        rest = filler[:at] + filler[at + len(needle):]
        assert rest == [text[(25 + i) % 30] for i in range(len(rest))]          # the text, in order, unbroken
        assert at == round(depth * len(rest))


def test_cli_passkey_with_a_filler_text(folder, tmp_path):
    text = tmp_path / "filler.txt"
    text.write_text("Of that forbidden tree, whose mortal taste brought death into the world. " * 20)
    r = CliRunner().invoke(main, ["passkey", str(folder), "--lengths", "200", "--depths", "0.5", "--trials", "2",
                                  "--no-teacher", "--filler", str(text), "--out", str(tmp_path / "p")])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "p" / "passkey.json").read_text())
    assert res["filler"] == str(text) and res["cells"][0]["tokens"] == 200 and "filler" in r.output
    for bad, needle in ((tmp_path / "none.txt", "--filler: " + str(tmp_path / "none.txt") + " does not exist"), (tmp_path / "short.txt", "at least 64")):
        if bad.name == "short.txt":
            bad.write_text("too short")
        r = CliRunner().invoke(main, ["passkey", str(folder), "--lengths", "200", "--no-teacher", "--filler", str(bad)])
        assert r.exit_code != 0 and needle in r.output and "Traceback" not in r.output


def test_passkey_table_and_grid_from_a_hand_made_result():
    cells = [{"length": L, "depth": d, "student": {"accuracy": acc}, "teacher": {"accuracy": 1.0}}
             for L, d, acc in ((64, 0.0, 1.0), (64, 1.0, 0.5), (128, 0.0, 0.0), (128, 1.0, 0.5))]
    result = {"lengths": [64, 128], "depths": [0.0, 1.0], "trials": 2, "cells": cells}
    assert accuracy_grid(result, "student").tolist() == [[1.0, 0.5], [0.0, 0.5]]
    table = format_passkey(result)
    assert "1.00/1.00" in table and "0.00/1.00" in table and "0.75/1.00" in table  # mean of row 64
    assert "nats" not in table                      # a result without key nats shows accuracy alone
    for c, nats in zip(cells, (0.5, 2.0, 11.0, 7.0)):
        c["student"]["key_nats"], c["teacher"]["key_nats"] = nats, 0.25
    table = format_passkey(result)
    assert accuracy_grid(result, "student", "key_nats").tolist() == [[0.5, 2.0], [11.0, 7.0]]
    assert "Nats of the key" in table and "11.0/0.2" in table and "1.2/0.2" in table  # mean of row 64: 1.25


def test_key_nats_by_hand():
    V = 10
    flat = torch.zeros(1, 3, V)                     # uniform: each digit costs log 10
    assert key_nats(flat, [1, 2, 3]) == pytest.approx(3 * math.log(V))
    sure = torch.full((1, 2, V), -30.0)
    sure[0, 0, 4] = sure[0, 1, 7] = 30.0           # certain of 4 then 7
    assert key_nats(sure, [4, 7]) == pytest.approx(0.0, abs=1e-6)
    assert key_nats(sure, [7, 4]) == pytest.approx(120.0, rel=1e-3)   # certain of the wrong digits


# ----------------------------------------------------------------------------- eval --by-position
def test_by_position_bins_match_independent_one_pass_losses(folder, tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text(sample_text(400, seed=3), encoding="utf-8")
    res = evaluate(folder, [text], teacher="self", context=64, out=tmp_path / "o", by_position=True, first_bin=32,
                   **QUIET)
    fig = res["by_absolute_position"]
    assert [(b["lo"], b["hi"]) for b in fig["bins"]] == [(0, 32), (32, 64), (64, 128), (128, 256), (256, 400)]
    assert fig["teacher_positions"] == TEACHER_POSITIONS

    ids = torch.tensor([[ord(c) if ord(c) < 128 else 0 for c in text.read_text()]])
    model = GLASwapForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        student = F.cross_entropy(model(input_ids=ids).logits[0, :-1], ids[0, 1:], reduction="none")
        with model.attention_mode("softmax"):
            t_ids = ids[:, :TEACHER_POSITIONS]
            teacher = F.cross_entropy(model(input_ids=t_ids).logits[0, :-1], t_ids[0, 1:], reduction="none")
    student = torch.cat([torch.tensor([float("nan")]), student]).numpy()
    teacher = torch.cat([torch.tensor([float("nan")]), teacher]).numpy()
    for b in fig["bins"]:
        lo, hi = b["lo"], b["hi"]
        assert b["student_one_pass"] == pytest.approx(np.nanmean(student[lo:hi]), abs=1e-4)
        if lo < TEACHER_POSITIONS:
            assert b["teacher_one_pass"] == pytest.approx(np.nanmean(teacher[lo:min(hi, TEACHER_POSITIONS)]), abs=1e-4)
        else:
            assert b["teacher_one_pass"] is None and b["teacher_tokens"] == 0
    # windowed: windows of 64 restart the state, so past 64 the two columns differ
    assert fig["bins"][0]["student_windowed"] == pytest.approx(fig["bins"][0]["student_one_pass"], abs=1e-4)
    assert fig["bins"][3]["student_windowed"] != pytest.approx(fig["bins"][3]["student_one_pass"], abs=1e-4)
    # the teacher's windowed column: the same windows of 64, so one-pass up to 64 tokens
    assert fig["bins"][0]["teacher_windowed"] == pytest.approx(fig["bins"][0]["teacher_one_pass"], abs=1e-4)
    with torch.no_grad(), model.attention_mode("softmax"):
        w = ids[:, 64:128]                          # the second window starts a new context at token 64
        tail = F.cross_entropy(model(input_ids=w).logits[0, :-1], w[0, 1:], reduction="none")
    assert fig["bins"][2]["teacher_windowed"] == pytest.approx(tail.mean().item(), abs=1e-4)
    assert fig["bins"][2]["teacher_windowed"] != pytest.approx(fig["bins"][2]["teacher_one_pass"], abs=1e-4)
    png = tmp_path / "o" / (json.loads(json.dumps(res["outputs"]))["positions_png"].split("/")[-1])
    assert png.read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((tmp_path / "o" / res["outputs"]["json"].split("/")[-1]).read_text())
    assert saved["by_absolute_position"]["bins"][-1]["hi"] == 400


def test_cli_eval_by_position_prints_the_bins(folder, tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text(sample_text(300, seed=4), encoding="utf-8")
    r = CliRunner().invoke(main, ["eval", str(folder), "--text", str(text), "--teacher", "self", "--context", "64",
                                  "--by-position", "--first-bin", "64", "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert "student one-pass" in r.output and "0-64" in r.output and "128-256" in r.output
    r = CliRunner().invoke(main, ["eval", str(folder), "--text", str(text), "--by-position", "--first-bin", "0"])
    assert r.exit_code != 0 and "first-bin" in r.output and "Traceback" not in r.output


# ----------------------------------------------------------------------------- passkey
def test_cli_passkey_writes_table_json_and_heatmap(folder, tmp_path):
    r = CliRunner().invoke(main, ["passkey", str(folder), "--lengths", "200,300", "--depths", "0,1", "--trials", "2",
                                  "--teacher", "self", "--out", str(tmp_path / "p")])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "p" / "passkey.json").read_text())
    assert [(c["length"], c["depth"]) for c in res["cells"]] == [(200, 0.0), (200, 1.0), (300, 0.0), (300, 1.0)]
    assert res["sparse_cache"] == 0
    for c in res["cells"]:
        assert c["tokens"] <= c["length"]
        for role in ("student", "teacher"):
            # the random model's answers are scored as they are: the accuracy is what they give
            expect = np.mean([answer_is_key(a, k) for a, k in zip(c[role]["answers"], c["keys"])])
            assert c[role]["accuracy"] == expect and len(c[role]["answers"]) == 2
            assert math.isfinite(c[role]["key_nats"]) and c[role]["key_nats"] > 0
    assert "Nats of the key" in r.output
    assert (tmp_path / "p" / "passkey.png").read_bytes()[:4] == b"\x89PNG"
    again = CliRunner().invoke(main, ["passkey", str(folder), "--lengths", "200,300", "--depths", "0,1",
                                      "--trials", "2", "--teacher", "self", "--out", str(tmp_path / "q")])
    assert again.exit_code == 0, again.output       # seeded: the same keys again
    assert json.loads((tmp_path / "q" / "passkey.json").read_text())["cells"][0]["keys"] == res["cells"][0]["keys"]


def test_cli_passkey_interrupted_keeps_the_cells_it_finished(folder, tmp_path, monkeypatch):
    import glaswap.passkey as P

    calls = []
    real = P.greedy_answer

    def answer_then_stop(*args, **kwargs):      # Ctrl-C during the third cell
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(P, "greedy_answer", answer_then_stop)
    r = CliRunner().invoke(main, ["passkey", str(folder), "--lengths", "200,300", "--depths", "0,1", "--trials", "1",
                                  "--no-teacher", "--out", str(tmp_path / "p")])
    assert r.exit_code == 130 and "interrupted" in r.output, r.output
    res = json.loads((tmp_path / "p" / "passkey.json").read_text())
    assert res["complete"] is False
    assert [(c["length"], c["depth"]) for c in res["cells"]] == [(200, 0.0), (200, 1.0)]
    assert (tmp_path / "p" / "passkey.png").read_bytes()[:4] == b"\x89PNG"
    grid = accuracy_grid(res, "student")
    assert np.isnan(grid[1]).all() and not np.isnan(grid[0]).any()
    assert "-" in format_passkey(res).splitlines()[4]          # the row of 300 tokens, not measured (after the caption)


def test_passkey_student_answers_match_a_plain_greedy_loop(folder):
    """The chunked recurrent prefill answers as one full forward per step would."""
    from glaswap.passkey import _greedy_no_cache, greedy_answer

    model = GLASwapForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tok = ascii_tokenizer()
    ids, key = build_prompt(tok, 260, 0.5, "27182"), key_tokens(tok, "27182")
    new, nats = greedy_answer(model, ids, torch.device("cpu"), steps=5, chunk=64, key_ids=key)
    new_full, nats_full = _greedy_no_cache(model, ids, torch.device("cpu"), steps=5, key_ids=key)
    assert new == new_full
    assert nats == pytest.approx(nats_full, rel=1e-4) and nats > 0
    assert greedy_answer(model, ids, torch.device("cpu"), steps=5, chunk=64) == (new, None)


def test_passkey_key_nats_through_a_kv_cache_match_one_forward():
    """The teacher's path (its own KV cache, copied to read the key) scores the key as one full
    forward over prompt and key does, and still answers from the prompt's end."""
    from glaswap.passkey import _greedy_no_cache, greedy_answer

    teacher = tiny_teacher("llama").eval()
    tok = ascii_tokenizer()
    ids, key = build_prompt(tok, 200, 0.25, "31415"), key_tokens(tok, "31415")
    new, nats = greedy_answer(teacher, ids, torch.device("cpu"), steps=4, recurrent=False, key_ids=key)
    new_full, nats_full = _greedy_no_cache(teacher, ids, torch.device("cpu"), steps=4, key_ids=key)
    assert new == new_full and nats == pytest.approx(nats_full, rel=1e-4)
    with torch.no_grad():
        logits = teacher(input_ids=torch.tensor([ids + key[:-1]])).logits[:, -len(key):]
    assert nats == pytest.approx(float(-torch.log_softmax(logits[0].double(), -1)[range(len(key)), key].sum()), rel=1e-4)


def test_cli_passkey_bad_lengths_are_one_line(folder):
    r = CliRunner().invoke(main, ["passkey", str(folder), "--lengths", "lots"])
    assert r.exit_code != 0 and "invalid" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(main, ["passkey", str(folder), "--lengths", "20", "--no-teacher"])
    assert r.exit_code != 0 and "longer --lengths" in r.output


# ----------------------------------------------------------------------------- RoPE on the GLA path
def test_rope_kept_dims_keep_the_pairs_that_turn_within_the_wavelength():
    cfg = GLASwapConfig(hidden_size=576, num_attention_heads=9, head_dim=64, rope_max_wavelength=2048.0,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e5})
    keep = rope_kept_dims(cfg)
    inv_freq = 1.0 / (1e5 ** (torch.arange(0, 64, 2).float() / 64))
    expect = (2 * math.pi / inv_freq) <= 2048
    assert keep[:32].tolist() == expect.tolist() and keep[32:].tolist() == expect.tolist()
    assert 0 < int(expect.sum()) < 32
    cfg.rope_max_wavelength = 0.0
    assert rope_kept_dims(cfg) is None


def test_slow_pairs_stay_unrotated_on_the_gla_path(folder):
    """With rope_max_wavelength, the GLA path computes what it would with the slow pairs'
    frequencies set to zero (angle 0 at every position)."""
    plain = GLASwapForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    opt = GLASwapForCausalLM.from_pretrained(str(folder), dtype=torch.float32, rope_max_wavelength=40.0).eval()
    zeroed = GLASwapForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    keep = rope_kept_dims(opt.config)
    assert 0 < int(keep.sum()) < keep.numel()
    ids = torch.randint(0, 128, (1, 50), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        zeroed.model.rotary_emb.inv_freq.mul_(keep[: keep.numel() // 2].float())
        got, want, full = (m(input_ids=ids).logits for m in (opt, zeroed, plain))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - full).abs().max() > 1e-3                  # the option changes the model


# ----------------------------------------------------------------------------- the decay horizon
@pytest.mark.parametrize("gate", ["lowrank", "key", "scalar"])
def test_decay_horizon_bounds_every_decay_and_keeps_the_starting_one(gate):
    """With decay_horizon H no per-step decay exceeds exp(-1/H), whatever the gate's logits,
    and a converted layer still starts at gate_init_decay."""
    from glaswap.layers.gla_attention import GLAAttention

    cfg = GLASwapConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, gate=gate,
                        gate_init_decay=0.99, decay_horizon=200.0, gla_backend="torch")
    layer = GLAAttention(cfg, layer_idx=0)
    x = torch.randn(2, 7, 64)
    k_raw = layer._project(x)[1]
    g = layer._gate(x, k_raw)
    if gate != "key":   # the key gate's logits depend on the keys from step 0
        torch.testing.assert_close(g.exp(), torch.full_like(g, 0.99))
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(50.0)    # logits far above 0: the decays press against the bound
        g = layer._gate(x + 10, layer._project(x + 10)[1])
    assert (g <= -1 / 200 + 1e-7).all() and g.max() > -1 / 200 - 1e-4


def test_decay_horizon_checks():
    with pytest.raises(ValueError, match="not below exp"):
        GLASwapConfig(gate_init_decay=0.995, decay_horizon=100.0)
    with pytest.raises(ValueError, match="decay_horizon"):
        GLASwapConfig(decay_horizon=-1.0)
    assert GLASwapConfig(gate_init_decay=0.99, decay_horizon=256.0).decay_horizon == 256.0


# ----------------------------------------------------------------------------- the real demo model
@pytest.mark.slow
def test_demo_model_keeps_its_loss_past_the_training_length(tmp_path):
    """The README's main job as shipped (SmolLM2 distilled on 256-token sequences), then
    Paradise Lost, never trained on, read in one pass to 8x the training length: past the
    training length each bin's one-pass loss stays within 0.1 nats of the windowed loss on the
    same tokens (with every RoPE pair rotated, rope_max_wavelength=0, the one-pass loss climbs
    to 0.4 nats above the windowed one by the 1K-2K bin); and a passkey at 16x the training
    length."""
    from test_eval import milton

    from glaswap.distill import distill, load_recipe

    recipe = load_recipe("smollm2-135m-demo", ["data.eval_tokens=1024"])
    assert recipe.model.options["rope_max_wavelength"] == recipe.data.seq_len == 256
    distill(recipe, out=tmp_path / "demo", log=lambda *a, **k: None)
    text = milton(tmp_path, "paradiselost.txt")
    res = evaluate(tmp_path / "demo", [text], context=256, max_tokens=2048, by_position=True, first_bin=256,
                   out=tmp_path / "eval", **QUIET)
    bins = res["by_absolute_position"]["bins"]
    assert [b["label"] for b in bins] == ["0-256", "256-512", "512-1K", "1K-2K"]
    for b in bins[1:]:
        assert b["student_one_pass"] <= b["student_windowed"] + 0.1, bins
    overall = res["overall"]
    assert overall["stateful"]["ppl"] <= overall["student"]["ppl"] * 1.05, overall
    # A key stated at the start of a 4K prompt (16x the training length), read back through a
    # 64-slot sparse cache: the recipe's decay horizon keeps the state's sums from outweighing
    # the cache (the key's nats about 2; about 8 without the horizon, 24 without the cache).
    pk = passkey_mod.passkey(tmp_path / "demo", lengths=(4096,), depths=(0.0,), trials=2, teacher=None,
                             sparse_cache=64, out=tmp_path / "pk", log=lambda *_: None)
    assert pk["cells"][0]["student"]["key_nats"] < 5, pk["cells"]
