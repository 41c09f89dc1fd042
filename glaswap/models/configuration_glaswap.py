"""Hugging Face config of a glaswap GLA model: the teacher's shape plus the GLA options
(gla_options.GLA_OPTIONS, their one definition).

Copied into every saved model folder, where glaswap may not be installed: it imports only
transformers and the copied gla_options.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from glaswap.models.gla_options import BEFORE_OPTION, GLA_OPTIONS, check_gla_options, parse_softmax_layers


# The model_type a saved config.json names, in place of "glaswap". AutoTokenizer reads the
# folder's config with AutoConfig first, and AutoConfig asks "Do you wish to run the custom
# code? [y/N]" for a type transformers does not know when auto_map names a config class
# (then, answered no, warns of a model of type ''). For a type it knows it does not ask, so
# the tokenizer loads plainly. This type has a config class in transformers but no model
# class under any AutoModel*, so the model still loads only with trust_remote_code=True
# (auto_map) and without it fails as before, never as some other architecture. Loaded by
# this class the config is "glaswap" again; a folder saved as "glaswap" still loads.
SAVED_MODEL_TYPE = "t5_gemma_module"


def written_by_glaswap(config: dict) -> bool:
    """Whether a config.json dict is a glaswap model's: SAVED_MODEL_TYPE with auto_map naming
    this config class, or "glaswap" (folders saved before SAVED_MODEL_TYPE)."""
    auto_map = config.get("auto_map")
    return config.get("model_type") == "glaswap" or (
        config.get("model_type") == SAVED_MODEL_TYPE and isinstance(auto_map, dict)
        and auto_map.get("AutoConfig") == "configuration_glaswap.GLASwapConfig")


class GLASwapConfig(PretrainedConfig):
    """The teacher's shape (the arguments below) and the GLA options, which come as keyword
    arguments named in GLA_OPTIONS (each left out takes its default)."""
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
        **kwargs,
    ):
        kwargs.pop("model_type", None)   # the class's, not config.json's SAVED_MODEL_TYPE
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
        # Every saved config.json carries transformers_version; one from before an option
        # existed gets the value it was made with, not a new model's default.
        saved = "transformers_version" in kwargs
        gla = {name: kwargs.pop(name, BEFORE_OPTION.get(name, opt.default) if saved else opt.default)
               for name, opt in GLA_OPTIONS.items()}
        # the same validation as convert's options, so a config.json edited by hand cannot
        # hold what convert would refuse (NaN, a negative epsilon, a window past the positions)
        positions = max_position_embeddings if isinstance(max_position_embeddings, int) else None
        check_gla_options(gla, max_positions=positions)
        # a model holds explicit layers (sorted, each once, inside it): auto:N is distill's to resolve
        gla["softmax_layers"] = parse_softmax_layers(gla["softmax_layers"], self.num_hidden_layers)
        for name, value in gla.items():
            setattr(self, name, value)
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    def gla_options(self):
        return {k: getattr(self, k) for k in GLA_OPTIONS}

    def to_dict(self):
        out = super().to_dict()
        out["model_type"] = SAVED_MODEL_TYPE     # what config.json names (see SAVED_MODEL_TYPE)
        return out

    @classmethod
    def get_config_dict(cls, *args, **kwargs):
        config_dict, kwargs = super().get_config_dict(*args, **kwargs)
        if config_dict.get("model_type") == SAVED_MODEL_TYPE:   # ours: no "model of type" warning
            config_dict = dict(config_dict, model_type=cls.model_type)
        return config_dict, kwargs
