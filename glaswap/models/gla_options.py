"""The GLA options: the one definition of each (GLA_OPTIONS) and their one validation
(check_gla_options).

The config's arguments (configuration_glaswap), `glaswap convert`'s flags and the adapter's
rebuild command come from GLA_OPTIONS, check_gla_options validates every place that takes
options (the config, convert, recipes), and tests/test_options.py holds the README's table to
it. Copied into every saved model folder beside the config, and imported by the CLI as it
starts: it imports only the standard library.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Option:
    """One GLA option: its config key, value type, default (a new model's), one-line help (the
    CLI's and the README table's), allowed values, and a check of one value of the right type,
    which returns what is expected of it when the value is wrong (None when it is fine)."""
    name: str
    type: type                      # bool, int, float, str, or list (of layer indices)
    default: Any
    help: str
    choices: tuple | None = None
    check: Callable[[Any], str | None] | None = None
    flag: str | None = None         # glaswap convert's flag (a switch also gets --no-...); None: recipes and Python only

    @property
    def flags(self) -> tuple[str, ...]:
        """The flag's spellings on glaswap convert: ("--x",), ("--x", "--no-x") for a switch, or ()."""
        if self.flag is None:
            return ()
        return (self.flag, "--no-" + self.flag[2:]) if self.type is bool else (self.flag,)


def _whole(low):
    return lambda v: None if v >= low else f"expected a whole number >= {low}"


GLA_OPTIONS = {o.name: o for o in (
    Option("gate", str, "lowrank", "lowrank: GLA's data-dependent gate, logsigmoid(W2 W1 x + b) / 16 (two small new "
           "matrices per layer, starting data-independent); key: derived from k_proj (no new parameters, the least "
           "free); scalar: one data-dependent decay per KV head (the cheapest).",
           choices=("lowrank", "key", "scalar"), flag="--gate"),
    Option("gate_rank", int, 16, "Rank of the lowrank gate.", check=_whole(1), flag="--gate-rank"),
    Option("gate_normalizer", float, 16.0, "The gate's log-decays are divided by this (GLA's 16), which keeps the "
           "decays near 1.", check=lambda v: None if v > 0 else "expected > 0"),
    Option("gate_init_decay", float, 0.98, "Per-step decay at step 0: a memory of about 1/(1 - d) tokens.",
           check=lambda v: None if 0 < v < 1 else "expected 0 < decay < 1", flag="--gate-init-decay"),
    Option("feature_map", str, "hedgehog", "phi applied to q and k. identity: plain GLA; softmax: over the head "
           "dimension; hedgehog: softmax(xW), a learned per-head W starting at the identity, which attention "
           "transfer can shape; hedgehog_pm: [softmax(xW), softmax(-xW)], twice the feature width and state, "
           "distils better.",
           choices=("identity", "softmax", "hedgehog", "hedgehog_pm"), flag="--feature-map"),
    Option("normalizer", bool, True, "Divide by the linear-attention denominator (needs softmax, hedgehog or "
           "hedgehog_pm); without it the outputs are far from the teacher's.", flag="--normalizer"),
    Option("normalizer_eps", float, 1e-6, "Added to the linear-attention denominator before dividing by it.",
           check=lambda v: None if v > 0 else "expected > 0"),
    Option("use_rope", bool, True, "Keep RoPE on q and k before the feature map.", flag="--rope"),
    # The slow pairs never turn through a full circle inside the training length, so past it
    # they would show the feature maps angles training never did, and the loss of a document
    # read in one pass would climb with position. 2048 is the shipped GPU recipe's length.
    Option("rope_max_wavelength", float, 2048.0, "Rotate only the RoPE pairs whose wavelength is at most this many "
           "tokens: the length you will train at (distill uses its data.seq_len); slower pairs stay unrotated, "
           "which keeps the model working past that length. 0: rotate every pair.",
           check=lambda v: None if v >= 0 else "expected >= 0 (0: every pair)", flag="--rope-max-wavelength"),
    # The state's sums stop growing within about the horizon, so a document read past the
    # training length keeps them at sizes training saw (and, in a hybrid, the state does not
    # come to outweigh the exact window).
    Option("decay_horizon", float, 0.0, "Bound every per-step decay by exp(-1/H): the state forgets by a factor e "
           "at least every H tokens, so its sums stop growing within about H tokens (the length you will train "
           "at; distill uses data.seq_len for hybrid layers). 0: no bound.",
           check=lambda v: None if v >= 0 else "expected >= 0 (0: no bound)", flag="--decay-horizon"),
    Option("state_heads", str, "kv", "kv: the query heads of a GQA group share one recurrent state; query: one "
           "state per query head, with its own key feature map and gate (R times the state and its kernel work).",
           choices=("kv", "query"), flag="--state-heads"),
    Option("gla_backend", str, "auto", "Kernels of the GLA path: triton, torch, or auto (Triton for CUDA tensors "
           "where it imports, else torch).", choices=("auto", "triton", "torch")),
    Option("window", int, 0, "Hybrid layers: each token also attends with the teacher's exact softmax to its last "
           "W tokens (itself included); older ones reach it through the GLA state. Memory stays constant in "
           "context. 0: pure GLA.", check=_whole(0), flag="--window"),
    Option("sinks", int, 0, "With --window: the first S tokens of each document stay in every token's exact "
           "attention and out of the state; a sink outside a token's window is scored as if it stood W tokens "
           "back.", check=_whole(0), flag="--sinks"),
    Option("window_mix", str, "shared", "shared: one softmax normaliser over the window's scores and the state's "
           "sums (the state's weighted by a learned per-head factor); learned: a learned per-head mix of the two "
           "outputs.", choices=("shared", "learned"), flag="--window-mix"),
    # Whole-sequence forwards (training, windowed scoring) have no sparse cache.
    Option("sparse_cache", int, 0, "With --window, reading with a cache (prefill, decoding): each layer keeps this "
           "many older tokens out of the state, those the state recalls worst (after LoLA, arXiv 2505.23666), "
           "attended exactly; eval, passkey and generate take --sparse-cache to change it. 0: none.",
           check=_whole(0), flag="--sparse-cache"),
    Option("softmax_layers", list, [], "Decoder layers (from 0) that keep the teacher's own attention: exact softmax "
           "over the whole context with a KV cache, no new parameters, no attention transfer; e.g. 3,9,15, or by rule: "
           "even:N (N spread evenly over the depth), last:N (the last N). Recipes also take auto:N, N layers that "
           "distill chooses by measurement after attention transfer.",
           check=lambda v: _layers_problem(v), flag="--softmax-layers"),
    # RoPE distances past the teacher's positions break its attention (as they break the teacher).
    Option("softmax_max_distance", int, 0, "Softmax layers score a key this many or more tokens back as if it stood "
           "exactly this far back (capped distances, after ReRoPE), so past the teacher's positions they meet no "
           "RoPE distance it never saw. 0: the teacher's max_position_embeddings, which leaves every context it "
           "was trained on as it was.", check=_whole(0), flag="--softmax-max-distance"),
)}

# What a config.json written before an option existed was made with, where that is not the
# option's default (a new model's): such a file lacks the key.
BEFORE_OPTION = {"rope_max_wavelength": 0.0}


def decay_bound(horizon: float) -> float:
    """The largest per-step decay that decay_horizon allows: exp(-1 / horizon), 1 without one.
    gate_init_decay must lie below it."""
    return math.exp(-1.0 / horizon) if horizon else 1.0


AUTO_HINT = "set model.options.softmax_layers: auto:{n} in a recipe (distill picks them after attention transfer)"


def _auto_count(value):
    """N of an "auto:N" string (an int, or a problem string when malformed), else None."""
    if not isinstance(value, str) or not value.strip().lower().startswith("auto"):
        return None
    m = re.fullmatch(r"auto:(\d+)", value.strip().lower())
    if not m:
        return "expected auto:N with a whole number N >= 1, or layer indices such as 3,9,15"
    if int(m[1]) < 1:
        return "auto:N needs N >= 1, the number of layers distill keeps as softmax attention"
    return int(m[1])


RULES = ("even", "last")   # softmax_layers placed by rule, resolved once the layer count is known


def _rule(value):
    """(rule, N) of an "even:N" or "last:N" string (a problem string when N is malformed or 0),
    else None."""
    if not isinstance(value, str):
        return None
    m = re.fullmatch(rf"({'|'.join(RULES)})(?::(.*))?", value.strip().lower())
    if not m:
        return None
    if m[2] is None or not re.fullmatch(r"\d+", m[2].strip()) or int(m[2]) < 1:
        return f"expected {m[1]}:N with a whole number N >= 1, the number of layers kept as softmax attention"
    return m[1], int(m[2])


def rule_layers(rule: str, n: int, num_layers: int) -> list[int]:
    """The layers of a rule: even spreads n over the depth (the middle of each of n equal
    stretches), last takes the last n."""
    if rule == "last":
        return list(range(num_layers - n, num_layers))
    return [int(math.floor((i + 0.5) * num_layers / n)) for i in range(n)]


def _layer_list(value):
    """The layer indices of an explicit list (a list of ints, or text like "3,9,15" or
    "[3, 9, 15]"), in the order given; a problem string when it is not one."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
        items = [t.strip() for t in text.split(",")] if text.strip() else []
        if not all(re.fullmatch(r"-?\d+", t) for t in items):
            return "expected whole-number layer indices such as 3,9,15"
        return [int(t) for t in items]
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return "expected whole-number layer indices such as 3,9,15"
        return list(value)
    return "expected layer indices such as 3,9,15 (a list or comma-separated text)"


def _layers_problem(value, num_layers=None) -> str | None:
    """What is wrong with a softmax_layers value, else None; "auto:N" is fine here (recipes
    take it). With num_layers, the indices must also lie in the model."""
    auto = _auto_count(value)
    if auto is not None:
        return auto if isinstance(auto, str) else None
    rule = _rule(value)
    if rule is not None:
        if isinstance(rule, str):
            return rule
        if num_layers is not None and rule[1] > num_layers:
            return f"{rule[0]}:{rule[1]} asks for more layers than the model's {num_layers}"
        return None
    layers = _layer_list(value)
    if isinstance(layers, str):
        return layers
    negative = [i for i in layers if i < 0]
    if negative:
        return f"layer {negative[0]} is negative: layers count from 0"
    twice = sorted({i for i in layers if layers.count(i) > 1})
    if twice:
        return f"layer {twice[0]} is listed twice: list each layer once"
    if num_layers is not None:
        outside = [i for i in layers if i >= num_layers]
        if outside:
            return (f"layer {outside[0]} is out of range: the model has {num_layers} layers, "
                    f"0 to {num_layers - 1}")
    return None


def parse_auto(value) -> int | None:
    """N for a softmax_layers value "auto:N" (N >= 1); None for any value that is not auto
    (an explicit list). A ValueError, one line, for auto:0 and malformed auto."""
    auto = _auto_count(value)
    if isinstance(auto, str):
        raise ValueError(f"invalid softmax_layers {value!r}; {auto}")
    return auto


def parse_softmax_layers(value, num_layers: int) -> list[int]:
    """An explicit softmax_layers value (a list, text like "3,9,15", or a rule, even:N or
    last:N) as the sorted layer indices of a model of num_layers layers. A ValueError, one
    line naming the problem and the fix, for anything else: auto:N (which only distill
    resolves), repeated, negative, out-of-range or non-integer indices."""
    auto = parse_auto(value)
    if auto is not None:
        raise ValueError(f"softmax_layers {value!r} is chosen by measurement, which convert and a model config "
                         f"cannot do: {AUTO_HINT.format(n=auto)}")
    problem = _layers_problem(value, num_layers)
    if problem:
        raise ValueError(f"invalid softmax_layers {value!r}; {problem}")
    rule = _rule(value)
    if rule is not None:
        return rule_layers(*rule, num_layers)
    return sorted(_layer_list(value))


def _value_problem(opt: Option, value) -> str | None:
    """What is expected of `value` for `opt` when it is wrong, else None."""
    if opt.choices is not None:
        return None if value in opt.choices else f"choose one of {', '.join(map(str, opt.choices))}"
    if opt.type is bool:
        return None if isinstance(value, bool) else "expected true or false"
    if opt.type is list:
        return opt.check(value)
    if isinstance(value, bool):
        return "expected a whole number" if opt.type is int else "expected a number"
    if opt.type is int and not isinstance(value, int):
        return "expected a whole number"
    if opt.type is float and not isinstance(value, (int, float)):
        return "expected a number"
    if opt.type is float and not math.isfinite(value):
        return "expected a finite number"
    return opt.check(value) if opt.check else None


# Options that size what a layer holds per token of context: none can usefully exceed the
# positions the teacher was trained on, and a buffer is allocated at its full size.
POSITION_BOUNDED = ("window", "sinks", "sparse_cache")


def check_gla_options(opts, max_positions: int | None = None):
    """Raise ValueError, one line naming the problem and the fix, for invalid GLA option values
    (each given value, then how they go together with the defaults of the rest). max_positions:
    the model's max_position_embeddings, which bounds window, sinks and sparse_cache."""
    for name, value in opts.items():
        if name not in GLA_OPTIONS:
            raise ValueError(f"unknown GLA option {name!r}; known: {', '.join(GLA_OPTIONS)}")
        problem = _value_problem(GLA_OPTIONS[name], value)
        if problem:
            raise ValueError(f"invalid {name} {value!r}; {problem}")
    merged = {name: opt.default for name, opt in GLA_OPTIONS.items()} | dict(opts)
    if merged["normalizer"] and merged["feature_map"] == "identity":
        raise ValueError("normalizer needs a positive feature map (softmax, hedgehog or hedgehog_pm); change feature_map "
                         "or turn the normalizer off")
    horizon = merged["decay_horizon"]
    if not merged["gate_init_decay"] < decay_bound(horizon):
        raise ValueError(f"gate_init_decay {merged['gate_init_decay']} is not below exp(-1/decay_horizon) = "
                         f"{decay_bound(horizon):.6f}; lower gate_init_decay or raise decay_horizon")
    if merged["sinks"] and not merged["window"]:
        raise ValueError("sinks need a window: set window >= 1, or sinks to 0")
    if merged["sparse_cache"] and not merged["window"]:
        raise ValueError("a sparse cache needs a window (it is attended with the window's softmax): set window >= 1, "
                         "or sparse_cache to 0")
    if merged["window"] and not merged["normalizer"]:
        raise ValueError("a window needs the normalizer (it shares the softmax's normalisation); turn the "
                         "normalizer on, or set window to 0")
    if max_positions is not None:
        for name in POSITION_BOUNDED:
            problem = position_bound_problem(name, merged[name], max_positions)
            if problem:
                raise ValueError(problem)


def position_bound_problem(name: str, value: int, max_positions: int) -> str | None:
    """The one-line refusal of a window, sinks or sparse_cache value beyond the model's
    positions, else None."""
    if value <= max_positions:
        return None
    return (f"{name} {value} is beyond the model's {max_positions} positions (max_position_embeddings); "
            f"use at most {max_positions}")
