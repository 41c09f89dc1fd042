"""Hugging Face model classes of a glaswap GLA model.

The decoder is the teacher's (Llama, Mistral, Qwen2, Qwen3: embeddings, RMSNorms, gated MLP,
biases, q/k norms, tied embeddings) with every softmax attention replaced by `GLAAttention`,
except in the layers config.softmax_layers lists, which keep the teacher's attention (a mixed
model). Weight names match the teacher's, so a converted checkpoint is the teacher's tensors
plus the new gate and feature-map tensors of the GLA layers.

Copied into every saved model folder next to the layer and the kernels; loading with
`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)` needs no glaswap.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from contextlib import contextmanager
from typing import Protocol

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from glaswap.layers.gla_attention import (MODES, GLAAttention, RMSNorm, bare_linear, clear_rotation_memo,
                                          rope_inv_freq)
from glaswap.layers.softmax_attention import KVBuffer
from glaswap.models.configuration_glaswap import GLASwapConfig
from glaswap.models.gla_options import parse_softmax_layers
from glaswap_kernels.ops import silu_mul

# The transformers releases (major, minor), inclusive, this code is tested with. A saved folder
# is used without glaswap's install pins, so the code itself says when it runs outside them.
TESTED_TRANSFORMERS = ((5, 17), (5, 24))
# The keyword transformers hands the cache to forward() under, and the output field it reads it
# back from: `cache` in releases whose outputs have that field, `past_key_values` before.
CACHE_NAME = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"
# Keywords other models take a cache under. One of them here means a caller meant to pass a
# state that this model would otherwise drop, decoding without it.
FOREIGN_CACHE_NAMES = ("cache_params", "state", "mems", "past_buckets_states", "layer_past", "past",
                       "past_key_value", "cache_state", "recurrent_state")
_version_warned = False


def transformers_version_problem(version: str | None = None) -> str | None:
    """One line when `version` (default: the installed transformers) is outside TESTED_TRANSFORMERS."""
    version = version or transformers.__version__
    m = re.match(r"(\d+)\.(\d+)", version)
    (lo_major, lo_minor), (hi_major, hi_minor) = TESTED_TRANSFORMERS
    if m and (lo_major, lo_minor) <= (int(m[1]), int(m[2])) <= (hi_major, hi_minor):
        return None
    return (f"this glaswap model code is tested with transformers {lo_major}.{lo_minor} to {hi_major}.{hi_minor} "
            f"and runs under transformers {version}; if outputs look wrong, install a tested release: "
            f"pip install 'transformers>={lo_major}.{lo_minor},<{hi_major}.{hi_minor + 1}'")


def warn_untested_transformers():
    """Warn once per process when the installed transformers is outside the tested range."""
    global _version_warned
    problem = transformers_version_problem()
    if problem and not _version_warned:
        _version_warned = True
        warnings.warn(problem, stacklevel=3)


def cache_of(output):
    """The cache a forward returned, read under the field name of the installed transformers."""
    return getattr(output, CACHE_NAME)


def pick_cache(past_key_values, cache, kwargs):
    """The cache passed under either name; a ValueError for two different ones or a foreign name."""
    foreign = [k for k, v in kwargs.items() if k in FOREIGN_CACHE_NAMES or isinstance(v, Cache)]
    if foreign:
        raise ValueError(f"glaswap models take their cache as cache= or past_key_values=, not {foreign[0]}=; "
                         f"pass it under one of those names")
    if past_key_values is not None and cache is not None and past_key_values is not cache:
        raise ValueError("both cache= and past_key_values= were passed, with different caches; pass one")
    return cache if cache is not None else past_key_values


def positions_from_mask(attention_mask, past, T):
    """Position of each of the T new tokens from a [B, past + T] (or [B, T]) 0/1 mask: the count
    of real tokens before it, so a left-padded row numbers its tokens as it would unpadded (what
    generate() computes). Padding gets position 0; it never reaches the state."""
    width = attention_mask.shape[1]
    if width == past + T:
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
    if width == T:  # the mask of the new tokens only: earlier tokens are taken as unpadded
        return past + (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    raise ValueError(f"attention_mask has {width} columns but the input has {T} tokens after {past} cached ones; "
                     f"pass a mask of {past + T} (or {T}) columns, or position_ids")


class GLASwapCache(Cache):
    """Recurrent state per GLA layer ([B, state heads, K, V] float32; the state heads are the
    KV heads unless state_heads="query"), the number of tokens seen, for hybrid layers
    (config.window) buffers per layer: the last `window` tokens' keys and values and the first
    `sinks` tokens' (hybrid_cache.HybridBuffers), and for the softmax layers of a mixed model
    (config.softmax_layers) a KV cache each (softmax_attention.KVBuffer), with a per-row mask
    of which keys are real tokens, not padding.

    A hybrid layer's buffers grow with the first tokens up to their configured sizes and stay
    there; only the softmax layers' KV grows with the whole context. transformers'
    `Cache.get_seq_length()` raises when every layer is linear, so the count is kept here.

    While decode steps run on the CPU, `rings` holds the hybrid layers' buffers in the form
    those steps read and write in place (hybrid_cache.DecodeRings), and their states are the
    rings' own, updated in place; reading `windows` turns the rings back into HybridBuffers.
    """

    is_compileable = False

    def __init__(self, num_layers=0):
        super().__init__(layers=[])
        self.states = [None] * num_layers
        self.windows = [None] * num_layers
        self.kv = [None] * num_layers
        # While decode steps run on the CPU, the hybrid layers' buffers as those steps keep them
        # (hybrid_cache.DecodeRings); `windows` turns them back into HybridBuffers when read.
        self.rings = None
        self.seen_tokens = 0
        # Set only on a captured decode graph's own cache (decode_graph): the slot its softmax
        # layers write the new token to, a device tensor, so the graph replays at fixed shapes.
        self.kv_write_at = None
        self._order = None       # (seen_tokens, new tokens, prompt_order's answer) of this call

    def prompt_order(self, new_tokens, compute):
        """How this call's prompt stands to the cache (hybrid_cache.prompt_order): computed by
        the first hybrid layer, `compute()`, and reused by the others, whose positions and
        buffers' positions are the same, so a prompt costs one host sync, not one per layer."""
        key = (self.seen_tokens, new_tokens)
        if self._order is None or self._order[:2] != key:
            self._order = (*key, compute())
        return self._order[2]

    @property
    def windows(self):
        """Per layer its HybridBuffers (None for the layers without)."""
        if self.rings is not None:
            rings, self.rings = self.rings, None
            for i in rings.layers:
                self._windows[i] = rings.buffers(i)
        return self._windows

    @windows.setter
    def windows(self, value):
        self.rings = None
        self._windows = value

    def recurrent_state(self, layer_idx):
        return self.states[layer_idx]

    def set_recurrent_state(self, layer_idx, state):
        self.states[layer_idx] = state

    def window_buffers(self, layer_idx):
        return self.windows[layer_idx] if layer_idx < len(self.windows) else None

    def set_window_buffers(self, layer_idx, buffers):
        while len(self.windows) <= layer_idx:
            self.windows.append(None)
        self.windows[layer_idx] = buffers

    def kv_buffer(self, layer_idx) -> KVBuffer | None:
        return self.kv[layer_idx] if layer_idx < len(self.kv) else None

    def set_kv_buffer(self, layer_idx, buffer: KVBuffer):
        while len(self.kv) <= layer_idx:
            self.kv.append(None)
        self.kv[layer_idx] = buffer

    def _map_batch(self, fn):
        """Apply fn to every per-row tensor (the batch is dimension 0 of each)."""
        self.states = [fn(s) if s is not None else None for s in self.states]
        self.windows = [w.map(fn) if w is not None else None for w in self.windows]
        self.kv = [b.map(fn) if b is not None else None for b in self.kv]

    def get_seq_length(self, layer_idx=0):
        return self.seen_tokens

    def get_mask_sizes(self, query_length, layer_idx=0):
        return self.seen_tokens + query_length, 0

    @property
    def batch_size(self):
        return next((t.shape[0] for t in self.states + [b.keys if b is not None else None for b in self.kv]
                     if t is not None), -1)

    @property
    def is_croppable(self):
        return False  # a recurrent state cannot be rolled back to an earlier token (a KV cache could)

    def crop(self, tokens_to_remove):
        if tokens_to_remove:
            raise ValueError("a glaswap cache is a recurrent state and cannot be rolled back: assisted, "
                             "speculative and contrastive decoding are not supported; use greedy, sampling "
                             "or beam search")

    def reorder_cache(self, beam_idx):
        self._map_batch(lambda s: s.index_select(0, beam_idx.to(s.device)))

    def batch_repeat_interleave(self, repeats):
        self._map_batch(lambda s: s.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices):
        self._map_batch(lambda s: s[indices])

    def reset(self):
        self.states = [None] * len(self.states)
        self.windows = [None] * len(self.states)
        self.kv = [None] * len(self.states)
        self.seen_tokens = 0
        self._order = None

    def __len__(self):
        return len(self.states)

    def __repr__(self):
        return f"GLASwapCache(layers={len(self.states)}, seen_tokens={self.seen_tokens})"


class RotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        inv_freq, self.attention_scaling = self.compute_inv_freq()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def compute_inv_freq(self):
        """(inverse frequencies, attention scaling) for the config's RoPE type."""
        return rope_inv_freq(self.config)

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = position_ids[:, :, None].float() * self.inv_freq.float().to(x.device)[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]
        self.silu = config.hidden_act in ("silu", "swish")

    def forward(self, x):
        if self.silu:       # one kernel on CUDA when no gradient is wanted
            # a bare gate_proj's output is fresh and seen by no hook: the CPU may work in it,
            # sparing two tensors of the intermediate size that a long prompt would allocate anew
            return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x),
                                           overwrite=bare_linear(self.gate_proj) and bare_linear(self.up_proj)))
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = GLAAttention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None,
                cu_seqlens=None, position_ids=None):
        """(hidden states, the attention's transfer loss or None). In "transfer" mode the loss
        leaves through the layer's output, so wrappers that hook module outputs (FSDP's
        backward hooks) see the gradient that flows back."""
        residual = hidden_states
        h, transfer_loss = self.self_attn(self.input_layernorm(hidden_states), position_embeddings=position_embeddings,
                                          attention_mask=attention_mask, past_key_values=past_key_values,
                                          cu_seqlens=cu_seqlens, position_ids=position_ids)
        hidden_states = residual + h
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, transfer_loss


def positions_from_cu_seqlens(cu_seqlens, B, T, device):
    """Position of each token in its document, for B blocks of T tokens flattened by cu_seqlens."""
    idx = torch.arange(B * T, device=device)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    doc = torch.bucketize(idx, cu[1:], right=True)
    return (idx - cu[doc]).view(B, T)


class GLASwapPreTrainedModel(PreTrainedModel):
    config_class = GLASwapConfig
    config: GLASwapConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DecoderLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, GLAAttention):
            module.reset_new_parameters()
        elif isinstance(module, nn.Linear):
            if getattr(module, "_glaswap_new", False):
                return
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, RotaryEmbedding):
            # A non-persistent buffer: from_pretrained leaves it uninitialised otherwise.
            module.inv_freq.copy_(module.compute_inv_freq()[0])

    def __init__(self, config, *args, **kwargs):
        warn_untested_transformers()
        super().__init__(config, *args, **kwargs)

    @classmethod
    def _supports_default_dynamic_cache(cls):
        return False  # the recurrent cache is made by forward() itself


class GLASwapModel(GLASwapPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, cu_seqlens=None, cache=None, **kwargs):
        past_key_values = pick_cache(past_key_values, cache, kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        B, T = inputs_embeds.shape[:2]
        gla_mode = all(layer.self_attn.mode == "gla" for layer in self.layers)
        if use_cache and past_key_values is None and gla_mode:
            past_key_values = GLASwapCache(len(self.layers))
        if past_key_values is not None and not isinstance(past_key_values, GLASwapCache):
            raise ValueError("glaswap models keep a recurrent state: pass a GLASwapCache (or none)")
        if past_key_values is not None and not gla_mode:
            raise ValueError("softmax (teacher) mode has no KV cache; call it with use_cache=False")
        past = past_key_values.seen_tokens if past_key_values is not None else 0
        if position_ids is None:
            if cu_seqlens is not None:  # positions restart with every packed document
                position_ids = positions_from_cu_seqlens(cu_seqlens, B, T, inputs_embeds.device)
            elif attention_mask is not None and attention_mask.dim() == 2:
                position_ids = positions_from_mask(attention_mask, past, T).to(inputs_embeds.device)
            else:
                position_ids = torch.arange(past, past + T, device=inputs_embeds.device)[None]
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        if past_key_values is not None and T == 1 and not torch.is_grad_enabled():
            # A decode step: the new token is never padding (generate() appends a 1 for every
            # row), earlier padding never reached the state, and a softmax layer's KV cache
            # marks its padded keys itself, so the mask is not needed; skipping the check below
            # also saves a host-device sync per token.
            attention_mask = None
        elif attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # no padding: skip the masking work

        hidden_states = inputs_embeds
        transfer_losses = []
        for layer in self.layers:
            if self.gradient_checkpointing and self.training:
                hidden_states, loss = self._gradient_checkpointing_func(
                    layer.__call__, hidden_states, position_embeddings, attention_mask, past_key_values,
                    cu_seqlens, position_ids)
            else:
                hidden_states, loss = layer(hidden_states, position_embeddings, attention_mask, past_key_values,
                                            cu_seqlens, position_ids)
            if loss is not None:   # "transfer" mode
                transfer_losses.append(loss)
        clear_rotation_memo()
        if past_key_values is not None:
            past_key_values.seen_tokens += T
        out = BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), **{CACHE_NAME: past_key_values})
        if transfer_losses:
            out.transfer_losses = transfer_losses
        return out


class DecodeRunner(Protocol):
    """A fast path GLASwapForCausalLM.forward hands calls to (`model.decode_runner`), such as a
    captured CUDA graph of the whole step. The model asks first, then hands over; a runner that
    takes a call must leave `cache` as the eager forward would (states, buffers, seen_tokens)."""

    def accepts(self, input_ids, inputs_embeds, cache) -> bool:
        """Whether it can serve this call as one decode step (one new token per row)."""

    def step(self, input_ids, position_ids, cache) -> torch.Tensor | None:
        """Logits [B, 1, vocab], advancing `cache` by one token; None, cache untouched, to
        have the model run the step eagerly."""

    def accepts_prefill(self, input_ids, inputs_embeds, attention_mask, cache) -> bool:
        """Whether it can read this prompt into `cache` (a new GLASwapCache when none was given)."""

    def prefill(self, input_ids, position_ids, cache, logits_to_keep=0) -> torch.Tensor | None:
        """The last hidden states [B, rows, hidden] (at least the last `logits_to_keep` rows, an
        int above 0; else all), advancing `cache` over the prompt; None, cache untouched, to
        have the model read it eagerly."""


class GLASwapForCausalLM(GLASwapPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config):
        super().__init__(config)
        self.model = GLASwapModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # A DecodeRunner (below) that serves the calls it can, such as glaswap's CUDA-graph
        # runner; None runs every call eagerly.
        self.decode_runner: DecodeRunner | None = None
        self.post_init()

    def set_attention_mode(self, mode):
        """'gla' (the student), 'softmax' (the teacher, from the same weights) or 'transfer'
        (the teacher's outputs, each layer's GLA distance to them in `transfer_losses`)."""
        if mode not in MODES:
            raise ValueError(f"unknown attention mode {mode!r}; choose one of {', '.join(MODES)}")
        for layer in self.model.layers:
            layer.self_attn.mode = mode

    @contextmanager
    def attention_mode(self, mode):
        before = [layer.self_attn.mode for layer in self.model.layers]
        self.set_attention_mode(mode)
        try:
            yield self
        finally:
            for layer, m in zip(self.model.layers, before):
                layer.self_attn.mode = m

    def new_parameter_names(self):
        """Names of the parameters conversion added (gates, feature maps); softmax layers have none."""
        names = []
        for i, layer in enumerate(self.model.layers):
            names += [f"model.layers.{i}.self_attn.{n}" for n in layer.self_attn.new_parameter_names()]
        return names

    def keep_softmax_layers(self, layers) -> list[str]:
        """Turn the GLA layers `layers` (indices from 0) into softmax layers in place: their
        gates, feature maps and window mix are deleted, and config.softmax_layers becomes the
        sorted union of the layers it held and these. Returns the names of the deleted
        parameters (as new_parameter_names gave them), for the caller to drop from its sets of
        trained parameters and from any optimizer holding them.

        Works on the plain model and after peft has attached LoRA in place (get_peft_model):
        LoRA wraps only the teacher's projections, which stay, and a modules_to_save wrapper
        around a deleted module goes with it. Call it before the model is sharded (FSDP) or
        compiled, and before any optimizer is built over the deleted parameters."""
        chosen = parse_softmax_layers(list(layers), self.config.num_hidden_layers)
        before = set(self.new_parameter_names())
        for i in chosen:
            self.model.layers[i].self_attn.make_softmax()
        self.config.softmax_layers = sorted(set(self.config.softmax_layers) | set(chosen))
        return sorted(before - set(self.new_parameter_names()))

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, cu_seqlens=None,
                cache=None, **kwargs):
        past_key_values = pick_cache(past_key_values, cache, kwargs)
        runner = self.decode_runner
        if runner is not None and labels is None and runner.accepts(input_ids, inputs_embeds, past_key_values):
            if position_ids is None and attention_mask is not None and attention_mask.dim() == 2:
                position_ids = positions_from_mask(attention_mask, past_key_values.seen_tokens, 1)
            logits = runner.step(input_ids, position_ids, past_key_values)  # None: it could not, run eagerly
            if logits is not None:
                return CausalLMOutputWithPast(logits=logits, **{CACHE_NAME: past_key_values})
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        if runner is not None and labels is None:
            # a prompt with no cache given gets one here, so that the runner can fill it
            target = GLASwapCache(len(self.model.layers)) if use_cache and past_key_values is None \
                else past_key_values
            if runner.accepts_prefill(input_ids, inputs_embeds, attention_mask, target):
                hidden = runner.prefill(input_ids, position_ids, target, logits_to_keep)  # None: run eagerly
                if hidden is not None:
                    return CausalLMOutputWithPast(logits=self.lm_head(hidden[:, keep, :]), **{CACHE_NAME: target})
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                         use_cache=use_cache, cu_seqlens=cu_seqlens)
        hidden = out.last_hidden_state
        logits = self.lm_head(hidden[:, keep, :])
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_NAME: cache_of(out)})
