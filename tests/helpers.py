"""Builders shared by the tests: tiny random teachers of each supported architecture."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import yaml

ARCHS = ("llama", "mistral", "qwen2", "qwen3")
REPO = Path(__file__).resolve().parents[1]


def tiny_teacher(arch: str, seed: int = 0, layers: int = 2, vocab: int = 128, tie: bool = False):
    """A random model of `arch` small enough to run in milliseconds, with GQA and odd sizes.

    Every parameter is randomised (norm weights around 1, biases non-zero) so a tensor that
    conversion drops or misplaces changes the logits.
    """
    import transformers

    common = dict(vocab_size=vocab, hidden_size=96, intermediate_size=160, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=tie, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, head_dim=24, attention_bias=False)
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**common, head_dim=24, sliding_window=None)
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=32)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model


def save_teacher(model, folder: Path, **kwargs) -> Path:
    model.save_pretrained(str(folder), **kwargs)
    return folder


def tree_digest(folder: Path) -> str:
    """A hash of every file's name and bytes under `folder` (to prove it was not modified)."""
    h = hashlib.sha256()
    for p in sorted(Path(folder).rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def run_without_glaswap(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run Python code in a fresh process where `glaswap` and `glaswap_kernels` cannot be imported."""
    prelude = ("import sys\n"
               "sys.modules['glaswap'] = None\n"        # a None entry makes `import glaswap` fail
               "sys.modules['glaswap_kernels'] = None\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, "-c", prelude + code], cwd=str(cwd), env=env,
                          capture_output=True, text=True, timeout=600)


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def tiny_recipe(tmp_path, s1=4, s2=4, every=2, **extra):
    """A recipe for a tiny random Llama and random pre-tokenised documents (no tokenizer)."""
    src = tmp_path / "teacher"
    if not src.exists():
        save_teacher(tiny_teacher("llama", vocab=128), src)
        rng = np.random.default_rng(0)
        lens = rng.integers(5, 90, size=60)
        np.savez(tmp_path / "train.npz", ids=rng.integers(0, 128, int(lens.sum())).astype(np.uint16),
                 doc_lens=lens)
    recipe = {
        "name": "tiny",
        "model": {"source": str(src), "options": {"gate": "lowrank"}},
        "data": {"train": [{"path": str(tmp_path / "train.npz")}], "seq_len": 32, "heldout_fraction": 0.1,
                 "eval_tokens": 256},
        "stage1": {"steps": s1, "lr": 1e-2, "batch_size": 2, "warmup_steps": 1},
        "stage2": {"steps": s2, "lr": 1e-3, "batch_size": 2, "grad_accum": 2, "warmup_steps": 1, "ce_weight": 0.1},
        "train": {"device": "cpu", "checkpoint_every": every},
    }
    for key, value in extra.items():
        recipe[key].update(value)
    path = tmp_path / "tiny.yaml"
    path.write_text("# glaswap distill --recipe tiny.yaml\n" + yaml.safe_dump(recipe))
    return path


def randomise_new_parameters(model, seed: int = 0, scale: float = 0.3):
    """Move the gates and feature maps off their starting values (a converted model starts
    data-independent), so that GLA differs from softmax and every path of the layer works."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in model.new_parameter_names():
                p.add_(scale * torch.randn(p.shape, generator=gen))


def tiny_student(arch: str, options: dict, layers: int = 3):
    """A tiny random teacher's conversion with `options` (glaswap.convert.glaswap_config), its
    new parameters moved off their starting values, in eval mode."""
    from glaswap.convert import glaswap_config
    from glaswap.models.modeling_glaswap import GLASwapForCausalLM

    teacher = tiny_teacher(arch, layers=layers)
    model = GLASwapForCausalLM(glaswap_config(teacher.config.to_dict(), options))
    model.load_state_dict(teacher.state_dict(), strict=False)
    randomise_new_parameters(model)
    return model.eval()


def assert_same_cache(a, b):
    """Two GLASwapCaches hold the same tokens, states, window buffers and KV buffers (float32
    tolerances)."""
    assert a.seen_tokens == b.seen_tokens
    for x, y in zip(a.states, b.states, strict=True):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.shape == y.shape and x.dtype == y.dtype
            torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-5)
    for wa, wb in zip(a.windows, b.windows, strict=True):
        assert (wa is None) == (wb is None)
        for x, y in zip(wa.tensors() if wa else [], wb.tensors() if wb else [], strict=True):
            assert x.shape == y.shape and x.dtype == y.dtype
            torch.testing.assert_close(x, y, atol=2e-5, rtol=1e-5)
    for ka, kb in zip(a.kv, b.kv, strict=True):
        assert (ka is None) == (kb is None)
        if ka is not None:
            assert (ka.length, ka.padded) == (kb.length, kb.padded)
            for x, y in zip(ka.tensors(), kb.tensors()):
                torch.testing.assert_close(x[:, :ka.length] if x.dim() == 2 else x[:, :, :ka.length],
                                           y[:, :kb.length] if y.dim() == 2 else y[:, :, :kb.length])


def logits_and_grads_by_backend(model, ids, backends=("torch", "triton")):
    """[(logits, {name: gradient})] of mean(logits^2) forward and backward under each GLA backend."""
    results = []
    for backend in backends:
        model.config.gla_backend = backend
        model.zero_grad()
        logits = model(ids, use_cache=False).logits
        logits.float().pow(2).mean().backward()
        results.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return results


def converted_tiny(root: Path, teacher=None, tokenizer=None) -> Path:
    """root/gla: a tiny Llama (or `teacher`, saved to root/src) converted, its new parameters
    randomised, with `tokenizer` saved beside it when given."""
    from glaswap.convert import convert
    from glaswap.models.modeling_glaswap import GLASwapForCausalLM

    src = save_teacher(teacher if teacher is not None else tiny_teacher("llama"), root / "src")
    out = root / "gla"
    convert(str(src), out, report=False, log=lambda *_: None)
    model = GLASwapForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    randomise_new_parameters(model)
    model.save_pretrained(str(out))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return out


def ascii_tokenizer(**special):
    """A character-level fast tokenizer over the 128 ASCII codes (the tiny models' vocabulary);
    any other character is the unknown token "\\x00". `special`: e.g. eos_token="\\x03"."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(128)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="\x00"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="\x00", **special)


def cli(*args):
    """glaswap's CLI in-process, every argument as a string."""
    from click.testing import CliRunner

    from glaswap.cli import main
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(result, *needles) -> str:
    """The one "Error:" line a failed command ends with (after any progress lines), no
    traceback and no usage text; it holds every needle."""
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("Error:")]
    assert result.exit_code == 1 and len(errors) == 1 and lines[-1] == errors[0], result.output[-3000:]
    assert "Traceback" not in result.output and "Usage:" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def unwritable_folder(tmp_path) -> Path:
    """A folder nothing can be written into, also for root (who passes permission bits: sysfs
    refuses)."""
    if os.geteuid() == 0:
        return Path("/sys/kernel")
    folder = tmp_path / "readonly"
    folder.mkdir()
    folder.chmod(0o555)
    return folder
