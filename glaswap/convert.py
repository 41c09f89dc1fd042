"""`glaswap convert`: a Llama-family checkpoint in, a GLA model folder out.

The source's tensors are streamed shard by shard into output shards (never two copies of
the weights in memory), the new gate and feature-map tensors are added per GLA layer (a
softmax layer, config.softmax_layers, keeps the teacher's tensors alone), and the
folder gets a config with `auto_map`, the modeling code, the tokenizer and `glaswap.json`.
Everything is written to a temporary folder that becomes OUT only at the end.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from glaswap.checkpoint import AUTO_MAP, FolderTensors, GGUFTensors, ShardWriter, check_out_path, output_folder, \
    parse_size, write_model_code
from glaswap.errors import GlaswapError
from glaswap.layers.gla_attention import GLAAttention
from glaswap.models.configuration_glaswap import GLASwapConfig, written_by_glaswap
from glaswap.models.gla_options import check_gla_options, parse_auto, parse_softmax_layers
from glaswap.models.modeling_glaswap import GLASwapForCausalLM
from glaswap.runtime import DTYPES, dtype_named, source_fingerprint, versions
from glaswap.sources import Source, resolve_source

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")


def glaswap_config(src: dict, options: dict | None = None) -> GLASwapConfig:
    """The GLA model config for a teacher config (a config.json dict) and GLA options."""
    model_type = src.get("model_type")
    if model_type not in SUPPORTED:
        raise GlaswapError(f"unsupported architecture {model_type!r}; glaswap converts "
                           f"{', '.join(SUPPORTED)} checkpoints")
    options = dict(options or {})
    _check_options(options, src.get("max_position_embeddings", 4096))
    if "softmax_layers" in options:
        try:
            options["softmax_layers"] = parse_softmax_layers(options["softmax_layers"], src["num_hidden_layers"])
        except ValueError as e:
            raise GlaswapError(str(e))
    heads = src["num_attention_heads"]
    head_dim = src.get("head_dim") or src["hidden_size"] // heads
    rope = src.get("rope_parameters") or dict(src.get("rope_scaling") or {})
    rope.setdefault("rope_theta", src.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.pop("type", "default"))
    if rope["rope_type"] == "dynamic":
        raise GlaswapError("dynamic RoPE scaling is not supported; convert a checkpoint with default, "
                           "linear, llama3 or yarn RoPE")
    attention_bias = bool(src.get("attention_bias", False))
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias = o_bias = attention_bias
    sliding = None
    if model_type == "mistral":
        sliding = src.get("sliding_window")
    elif src.get("use_sliding_window"):
        raise GlaswapError(f"{model_type} with use_sliding_window is not supported; convert a checkpoint "
                           f"with full attention")
    return GLASwapConfig(
        vocab_size=src["vocab_size"], hidden_size=src["hidden_size"],
        intermediate_size=src["intermediate_size"], num_hidden_layers=src["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=src.get("num_key_value_heads") or heads,
        head_dim=head_dim, hidden_act=src.get("hidden_act", "silu"),
        max_position_embeddings=src.get("max_position_embeddings", 4096),
        initializer_range=src.get("initializer_range", 0.02), rms_norm_eps=src.get("rms_norm_eps", 1e-6),
        rope_parameters=rope, qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=bool(src.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3", sliding_window=sliding,
        tie_word_embeddings=bool(src.get("tie_word_embeddings", False)),
        pad_token_id=src.get("pad_token_id"), bos_token_id=src.get("bos_token_id"),
        eos_token_id=src.get("eos_token_id"), source_model_type=model_type, **options)


def _check_options(options: dict, max_positions=None):
    """check_gla_options, its message as a GlaswapError (before anything is read or written).
    softmax_layers auto:N, which recipes take, is refused here: convert cannot measure.
    max_positions: the teacher's max_position_embeddings, once its config is read."""
    try:
        check_gla_options(options, max_positions if isinstance(max_positions, int) else None)
        if parse_auto(options.get("softmax_layers")) is not None:
            parse_softmax_layers(options["softmax_layers"], 0)      # raises, saying that distill chooses
    except ValueError as e:
        raise GlaswapError(str(e))


def new_layer_tensors(config: GLASwapConfig, layer_idx: int, seed: int) -> dict[str, torch.Tensor]:
    """Initial values of the parameters conversion adds to one layer (seeded per layer)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 100003 + layer_idx)
        layer = GLAAttention(config, layer_idx)
    prefix = f"model.layers.{layer_idx}.self_attn."
    return {prefix + n: p.detach() for n, p in layer.named_parameters() if n in layer.new_parameter_names()}


def expected_keys(config: GLASwapConfig) -> tuple[dict[str, torch.Size], set[str]]:
    """(shape of each teacher tensor the model needs, tensors conversion adds), from a model on
    the meta device."""
    with torch.device("meta"):
        model = GLASwapForCausalLM(config)
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    new = set(model.new_parameter_names())
    return {k: v for k, v in shapes.items() if k not in new}, new


def _config_from(src_config: dict, options: dict, source: str) -> GLASwapConfig:
    """glaswap_config, with a one-line error for a config.json that lacks a setting or holds
    one of the wrong type."""
    try:
        return glaswap_config(src_config, options)
    except KeyError as e:
        raise GlaswapError(f"the config.json of {source} has no {e.args[0]!r}; restore it from the original "
                           f"checkpoint")
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise GlaswapError(f"the config.json of {source} holds a value glaswap cannot use ({e}); restore it "
                           f"from the original checkpoint")


def _out_dtype(requested: str, src: Source, src_config: dict):
    if requested != "auto":
        return dtype_named(requested)
    if src.kind == "gguf":
        return torch.bfloat16  # dequantised GGUF weights fit bf16; fp32 would double the folder
    name = src_config.get("dtype") or src_config.get("torch_dtype")
    return DTYPES.get(name)  # None: keep each tensor's stored dtype


def convert(source: str, out, *, options: dict | None = None, force: bool = False, dtype: str = "auto",
            max_shard_size="2GB", report: bool = True, seed: int = 0, trust_remote_code: bool = False,
            log=print) -> dict:
    """Convert SOURCE into a GLA model folder OUT; returns what was written to glaswap.json.
    trust_remote_code: let the step-0 report run Python code that the tokenizer ships."""
    out = Path(out)
    check_out_path(out)
    options = dict(options or {})
    _check_options(options)
    if out.exists() and not force:
        raise GlaswapError(f"{out} already exists; choose another output folder or pass --force to replace it")
    max_bytes = parse_size(max_shard_size)
    src = resolve_source(source)
    check_out_path(out, [("SOURCE", src.path)])

    started = time.time()
    tensors = GGUFTensors(src.path) if src.kind == "gguf" else FolderTensors(src.path)
    src_config = tensors.config if src.kind == "gguf" else src.config
    if written_by_glaswap(src_config):
        raise GlaswapError(f"{src.spec} is a glaswap model already; convert its teacher, which its glaswap.json "
                           f"names under source")
    config = _config_from(src_config, options, src.spec)
    out_dtype = _out_dtype(dtype, src, src_config)
    needed, new = expected_keys(config)
    log(f"converting {src.spec} ({config.source_model_type}, {config.num_hidden_layers} layers, "
        f"{config.num_attention_heads} heads / {config.num_key_value_heads} KV heads, head dim {config.head_dim})")

    with output_folder(out, force=force) as tmp:
        writer = ShardWriter(tmp, max_bytes)
        seen, stored_dtype = set(), None
        for name, tensor in tensors:
            if name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if name not in needed:
                raise GlaswapError(f"the source has a tensor glaswap does not expect ({name}); this "
                                   f"{config.source_model_type} variant is not supported")
            if tensor.shape != needed[name]:
                raise GlaswapError(f"the source's {name} has shape {list(tensor.shape)} but its config.json "
                                   f"implies {list(needed[name])}; the weights and config.json do not belong "
                                   f"together")
            writer.add(name, tensor.to(out_dtype) if out_dtype is not None else tensor)
            seen.add(name)
            stored_dtype = stored_dtype or tensor.dtype
        missing = sorted(set(needed) - seen)
        if missing:
            raise GlaswapError(f"the source checkpoint lacks {missing[0]} ({len(missing)} tensors missing); "
                               f"download the complete checkpoint")
        new_dtype = out_dtype or stored_dtype
        for i in range(config.num_hidden_layers):
            for name, tensor in new_layer_tensors(config, i, seed).items():
                writer.add(name, tensor.to(new_dtype))
        shards = writer.close()

        config.architectures = ["GLASwapForCausalLM"]
        config.auto_map = dict(AUTO_MAP)
        if out_dtype is not None:
            config.dtype = out_dtype
        config.save_pretrained(tmp)
        code = write_model_code(tmp)
        _write_tokenizer(src, tmp, trust_remote_code)
        meta = {
            "format": 1,
            # the fingerprint lets eval and the others tell the teacher later found at this
            # path from the one converted
            "source": dict(src.describe(), fingerprint=source_fingerprint(src.kind, src.path)),
            "options": config.gla_options(),
            "dtype": str(out_dtype or new_dtype).replace("torch.", ""),
            "seed": seed,
            "versions": versions(),
            "files": {"weights": shards, "code": code},
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "convert_seconds": round(time.time() - started, 1),
        }
        if report:
            meta["step0"] = _step0_report(tmp, config, log, trust_remote_code)
        (tmp / "glaswap.json").write_text(json.dumps(meta, indent=2) + "\n")
    log(f"wrote {out} ({len(shards)} weight file{'s' if len(shards) > 1 else ''}, "
        f"{writer.total_bytes / 2**20:.0f} MiB) in {time.time() - started:.0f} s")
    meta["peak_buffer_bytes"] = writer.peak_bytes
    return meta


def _write_tokenizer(src: Source, folder: Path, trust_remote_code: bool = False):
    """The source's tokenizer files; with trust_remote_code also the Python modules in the
    source folder that its tokenizer_config.json auto_map names, without which the copy would
    not load."""
    if src.kind == "folder":
        for name in TOKENIZER_FILES:
            if (src.path / name).is_file():
                shutil.copyfile(src.path / name, folder / name)
        if trust_remote_code:
            for rel in _tokenizer_code_files(src.path):
                (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src.path / rel, folder / rel)
        return
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(src.path.parent), gguf_file=src.path.name)
    except Exception as e:
        raise GlaswapError(f"could not read the tokenizer from {src.path} ({type(e).__name__}); check the file")
    tok.save_pretrained(str(folder))


def _tokenizer_code_files(folder: Path) -> list[str]:
    """The files (relative to `folder`) of the modules that tokenizer_config.json's auto_map
    names as "module.Class" in the folder itself; a class of another repository
    ("repo--module.Class") is not the folder's to copy."""
    try:
        auto_map = json.loads((folder / "tokenizer_config.json").read_text()).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return []
    if not isinstance(auto_map, dict):
        return []
    out = []
    for value in auto_map.values():
        for ref in value if isinstance(value, (list, tuple)) else [value]:
            if not isinstance(ref, str) or "--" in ref or "." not in ref:
                continue
            rel = ref.rsplit(".", 1)[0].replace(".", "/") + ".py"
            path = folder / rel
            if ".." not in Path(rel).parts and path.is_file() and path.resolve().is_relative_to(folder.resolve()) \
                    and rel not in out:
                out.append(rel)
    return out


def _step0_report(folder: Path, config: GLASwapConfig, log, trust_remote_code: bool) -> dict:
    """Teacher and converted perplexity (and KL) on a few sample sequences."""
    from glaswap.report import step0_report

    return step0_report(folder, config, log, trust_remote_code)
