"""Hugging Face config of a glaswap GLA model: the teacher's shape plus the GLA options.

Copied into every saved model folder; imports nothing from glaswap.
"""

from __future__ import annotations

import math

from transformers import PretrainedConfig

GLA_OPTIONS = {
    # name: (default, allowed values or a type)
    "gate": ("lowrank", ("lowrank", "key", "scalar")),
    "gate_rank": (16, int),
    "gate_normalizer": (16.0, float),
    "gate_init_decay": (0.98, float),
    "feature_map": ("hedgehog", ("identity", "softmax", "hedgehog", "hedgehog_pm")),
    "normalizer": (True, bool),
    "normalizer_eps": (1e-6, float),
    "use_rope": (True, bool),
    # RoPE on the GLA path only for the pairs of dimensions whose wavelength (2 pi / frequency)
    # is at most this many tokens; the slower pairs stay unrotated. 0: rotate every pair.
    "rope_max_wavelength": (0.0, float),
    # Every per-step decay is at most exp(-1 / decay_horizon): a key's weight in the state falls
    # by e at least every decay_horizon tokens, so the state's sums stop growing within about
    # that many tokens (the length you train at keeps longer reads inside what training saw).
    # 0: no bound.
    "decay_horizon": (0.0, float),
    # kv: the query heads of a GQA group share one state (the teacher's KV heads); query: each
    # query head keeps its own state, with its own key feature map and gate (R times the memory).
    "state_heads": ("kv", ("kv", "query")),
    "gla_backend": ("auto", ("auto", "triton", "torch")),
    # Hybrid layers: each token also attends with the teacher's exact softmax (its q, k, RoPE and
    # scale) to its last `window` tokens and its document's first `sinks`; older tokens reach it
    # through the GLA state only. 0: pure GLA.
    "window": (0, int),
    "sinks": (0, int),
    # How the two parts combine. shared: one normaliser over the window's exp-scores and the
    # state's phi(q).phi(k) sums (a learned per-head weight on the state's); learned: a learned
    # per-head mix of the two normalised outputs.
    "window_mix": ("shared", ("shared", "learned")),
    # Hybrid layers read with a cache (prefill, decoding): each KV head also keeps, at constant
    # size, the `sparse_cache` older keys that its state recalls worst (a number or a name
    # stated once, where repeated text is recalled well) out of the state, and attends to them
    # exactly, as to the sinks. Whole-sequence forwards (training, windowed scoring) have
    # none. 0: none.
    "sparse_cache": (0, int),
}


def decay_bound(horizon: float) -> float:
    """The largest per-step decay that decay_horizon allows: exp(-1 / horizon), 1 without one.
    gate_init_decay must lie below it."""
    return math.exp(-1.0 / horizon) if horizon else 1.0


def check_gla_options(opts):
    """Raise ValueError with one line per problem for invalid GLA option values."""
    for name, value in opts.items():
        if name not in GLA_OPTIONS:
            raise ValueError(f"unknown GLA option {name!r}; known: {', '.join(GLA_OPTIONS)}")
        default, allowed = GLA_OPTIONS[name]
        if isinstance(allowed, tuple):
            if value not in allowed:
                raise ValueError(f"invalid {name} {value!r}; choose one of {', '.join(map(str, allowed))}")
        elif allowed is bool:
            if not isinstance(value, bool):
                raise ValueError(f"invalid {name} {value!r}; expected true or false")
        elif not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"invalid {name} {value!r}; expected a number")
    merged = {k: v[0] for k, v in GLA_OPTIONS.items()} | dict(opts)
    if merged["normalizer"] and merged["feature_map"] == "identity":
        raise ValueError("normalizer needs a positive feature map (softmax, hedgehog or hedgehog_pm); change feature_map "
                         "or turn the normalizer off")
    if not 0.0 < float(merged["gate_init_decay"]) < 1.0:
        raise ValueError(f"invalid gate_init_decay {merged['gate_init_decay']!r}; expected 0 < decay < 1")
    if float(merged["rope_max_wavelength"]) < 0:
        raise ValueError(f"invalid rope_max_wavelength {merged['rope_max_wavelength']!r}; expected >= 0 (0: every pair)")
    horizon = float(merged["decay_horizon"])
    if horizon < 0:
        raise ValueError(f"invalid decay_horizon {merged['decay_horizon']!r}; expected >= 0 (0: no bound)")
    if not float(merged["gate_init_decay"]) < decay_bound(horizon):
        raise ValueError(f"gate_init_decay {merged['gate_init_decay']} is not below exp(-1/decay_horizon) = "
                         f"{decay_bound(horizon):.6f}; lower gate_init_decay or raise decay_horizon")
    for name in ("window", "sinks", "sparse_cache"):
        if isinstance(merged[name], bool) or not isinstance(merged[name], int) or merged[name] < 0:
            raise ValueError(f"invalid {name} {merged[name]!r}; expected a whole number >= 0")
    if merged["sinks"] and not merged["window"]:
        raise ValueError("sinks need a window: set window >= 1, or sinks to 0")
    if merged["sparse_cache"] and not merged["window"]:
        raise ValueError("a sparse cache needs a window (it is attended with the window's softmax): set window >= 1, "
                         "or sparse_cache to 0")
    if merged["window"] and not merged["normalizer"]:
        raise ValueError("a window needs the normalizer (it shares the softmax's normalisation); turn the "
                         "normalizer on, or set window to 0")
    if int(merged["gate_rank"]) < 1 or float(merged["gate_normalizer"]) <= 0:
        raise ValueError("gate_rank must be >= 1 and gate_normalizer > 0")


class GLASwapConfig(PretrainedConfig):
    model_type = "glaswap"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(
        self,
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=None,
        head_dim=None,
        hidden_act="silu",
        max_position_embeddings=4096,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        rope_parameters=None,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        sliding_window=None,
        tie_word_embeddings=False,
        pad_token_id=None,
        bos_token_id=1,
        eos_token_id=2,
        source_model_type="llama",
        gate="lowrank",
        gate_rank=16,
        gate_normalizer=16.0,
        gate_init_decay=0.98,
        feature_map="hedgehog",
        normalizer=True,
        normalizer_eps=1e-6,
        use_rope=True,
        rope_max_wavelength=0.0,
        decay_horizon=0.0,
        state_heads="kv",
        gla_backend="auto",
        window=0,
        sinks=0,
        window_mix="shared",
        sparse_cache=0,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.rope_parameters = dict(rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
        self.qkv_bias = qkv_bias
        self.o_bias = o_bias
        self.mlp_bias = mlp_bias
        self.qk_norm = qk_norm
        self.sliding_window = sliding_window
        self.source_model_type = source_model_type
        self.gate = gate
        self.gate_rank = gate_rank
        self.gate_normalizer = gate_normalizer
        self.gate_init_decay = gate_init_decay
        self.feature_map = feature_map
        self.normalizer = normalizer
        self.normalizer_eps = normalizer_eps
        self.use_rope = use_rope
        self.rope_max_wavelength = rope_max_wavelength
        self.decay_horizon = decay_horizon
        self.state_heads = state_heads
        self.gla_backend = gla_backend
        self.window = window
        self.sinks = sinks
        self.window_mix = window_mix
        self.sparse_cache = sparse_cache
        check_gla_options({k: getattr(self, k) for k in GLA_OPTIONS})
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    def gla_options(self):
        return {k: getattr(self, k) for k in GLA_OPTIONS}
