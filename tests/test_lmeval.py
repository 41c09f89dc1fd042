"""lm-evaluation-harness on a saved glaswap folder: the README's `lm_eval` command, on a local
loglikelihood_rolling task, gives the log-likelihood `glaswap eval --bos` gives on the same
tokens (and without --bos, glaswap's own convention, it does not)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import helpers
from helpers import converted_tiny

from click.testing import CliRunner

from glaswap.cli import main
from glaswap.evaluate import evaluate, windows

CONTEXT = 32   # lm-eval's max_length; documents below span several windows and a partial last one
DOCS = [
    "The river that runs through the valley turns the mill wheel, and the children of the village "
    "watch it from the bridge in the snow. Café naïve → 光.",
    "Of the mill and the snow, the valley keeps no record but the river's own.",
    "A short one.",
    "x",
]


def ascii_tokenizer():
    return helpers.ascii_tokenizer(bos_token="\x02", eos_token="\x03")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny converted Llama with moved gates and feature maps (so GLA differs from softmax)."""
    return converted_tiny(tmp_path_factory.mktemp("lmeval"), tokenizer=ascii_tokenizer())


def _lm_eval(folder, tmp_path) -> tuple[list[float], float]:
    """Each document's log-likelihood, and bits per byte over them all, from the `lm_eval`
    command line on a local task."""
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "glaswap_rolling.yaml").write_text(f"""task: glaswap_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
""")
    out = tmp_path / "lm_eval_out"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
           f"pretrained={folder},trust_remote_code=True,dtype=float32,max_length={CONTEXT}",
           "--tasks", "glaswap_rolling", "--include_path", str(tasks), "--device", "cpu", "--batch_size", "2",
           "--log_samples", "--output_path", str(out)]
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (samples,) = out.rglob("samples_glaswap_rolling_*.jsonl")
    rows = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda r: r["doc_id"])
    assert [r["doc"]["text"] for r in rows] == DOCS
    (results,) = out.rglob("results_*.json")
    bpb = json.loads(results.read_text())["results"]["glaswap_rolling"]["bits_per_byte,none"]
    return [float(np.ravel(r["filtered_resps"])[0]) for r in rows], bpb


@pytest.mark.parametrize("n, context, stride", [(1, 32, 32), (33, 32, 32), (34, 32, 32), (200, 32, 32),
                                                (200, 32, 7), (65, 32, 1)])
def test_bos_windows_score_every_text_token_once(n, context, stride):
    """With BOS first (id 0 here), a window holds context + 1 ids and predicts up to `context`
    of them; the last window ends at the end with a full context, as lm-eval's do."""
    ids = n + 1
    ws = windows(ids, context + 1, stride, align_last=True)
    seen = np.zeros(ids, dtype=int)
    for begin, end, first in ws:
        assert end - begin <= context + 1 and begin + 1 <= first < end
        seen[first:end] += 1
    assert seen[0] == 0 and (seen[1:] == 1).all()
    assert ws[-1][1] == ids and ws[-1][0] == max(0, ids - context - 1)


def test_eval_bos_flag(folder, tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text(DOCS[0], encoding="utf-8")
    result = CliRunner().invoke(main, ["eval", str(folder), "--text", str(text), "--teacher", "self", "--bos",
                                       "--context", str(CONTEXT), "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "BOS first" in result.output
    (path,) = (tmp_path / "o").glob("eval-doc-context32-bos.json")
    res = json.loads(path.read_text())
    assert res["settings"]["bos"] is True and res["files"][0]["tokens"] == len(DOCS[0])
    assert res["by_position"]["count"][CONTEXT] > 0      # a full window predicts its last id from 32 before it


def test_lm_eval_agrees_with_glaswap_eval_bos(folder, tmp_path):
    pytest.importorskip("lm_eval", reason="lm-eval is in the test extra: pip install -e '.[test]'")
    lm_eval_ll, lm_eval_bpb = _lm_eval(folder, tmp_path)
    files = []
    for i, doc in enumerate(DOCS):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_text(doc, encoding="utf-8")

    def glaswap_ll(files, **kw):
        res = evaluate(folder, files, teacher="self", context=CONTEXT, out=tmp_path / "eval", progress=False,
                       log=lambda *_: None, **kw)
        return [-f["student"]["nll"] * f["tokens"] for f in res["files"]], res

    ll, res = glaswap_ll(files, bos=True)
    assert [f["tokens"] for f in res["files"]] == [len(d) for d in DOCS]        # every character is scored
    assert [f["bytes"] for f in res["files"]] == [len(d.encode()) for d in DOCS]
    total, reference = sum(ll), sum(lm_eval_ll)
    assert abs(total - reference) <= 1e-4 * abs(reference), (total, reference, ll, lm_eval_ll)
    np.testing.assert_allclose(ll, lm_eval_ll, rtol=1e-4)
    print(f"total log-likelihood: glaswap {total:.6f}, lm-eval {reference:.6f}")
    assert res["overall"]["student"]["bpb"] == pytest.approx(lm_eval_bpb, rel=1e-4)
    # glaswap's own convention (no BOS, the first token of each window unscored) is another
    # figure (on the documents of 2 tokens or more, the ones it can score)
    plain, _ = glaswap_ll(files[:3])
    assert abs(sum(plain) - sum(lm_eval_ll[:3])) > 1e-2 * abs(sum(lm_eval_ll[:3])), (plain, lm_eval_ll)
