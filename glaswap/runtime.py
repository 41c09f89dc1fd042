"""What the commands share: devices and dtypes, loading a glaswap model, its teacher and its
tokenizer, writing a file atomically, and the versions recorded beside every result."""

from __future__ import annotations

import json
import os
import platform
import tempfile
from pathlib import Path

import torch

import glaswap
from glaswap.errors import GlaswapError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------- devices and dtypes
def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise GlaswapError(f"invalid --device {device!r}; choose auto, cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GlaswapError("--device cuda was asked for but no CUDA GPU is available; use --device cpu")
    return dev


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA and float32 on the CPU for "auto", else the named dtype."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return dtype_named(dtype)


def dtype_named(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise GlaswapError(f"invalid dtype {name!r}; choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


# --------------------------------------------------------------------------- loading
def check_model_folder(model_dir) -> dict:
    """The folder's glaswap.json, or a one-line error when it is not a glaswap model."""
    path = Path(model_dir)
    if not path.exists():
        raise GlaswapError(f"{path} does not exist; pass a folder written by glaswap convert or distill")
    if not path.is_dir():
        raise GlaswapError(f"{path} is not a folder; pass a folder written by glaswap convert or distill")
    meta_file, cfg_file = path / "glaswap.json", path / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
        meta = json.loads(meta_file.read_text())
    except FileNotFoundError as e:
        raise GlaswapError(f"{path} is not a glaswap model (no {Path(e.filename).name}); pass a folder written "
                           f"by glaswap convert or distill")
    except (OSError, ValueError) as e:
        raise GlaswapError(f"{path} is not a readable glaswap model ({type(e).__name__}: {e}); convert it again")
    if cfg.get("model_type") != "glaswap":
        raise GlaswapError(f"{path} is not a glaswap model (config.json model_type is "
                           f"{cfg.get('model_type')!r}); convert it first with glaswap convert")
    return meta


def load_student(model_dir, device, dtype):
    from glaswap.models.modeling_glaswap import GLASwapForCausalLM

    try:
        model = GLASwapForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise GlaswapError(f"{model_dir} could not be loaded ({type(e).__name__}: {first}); convert it again")
    return model.to(device).eval()


def load_tokenizer(model_dir):
    from transformers import AutoTokenizer

    try:
        # trust_remote_code only silences the question transformers asks because config.json
        # maps the model classes to the folder's code; no tokenizer code is taken from it.
        tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=True)
    except Exception as e:
        raise GlaswapError(f"{model_dir} has no usable tokenizer ({type(e).__name__}); copy the tokenizer files "
                           f"of the source model into it")
    tok.model_max_length = 1 << 60  # whole documents are tokenised at once; windows come later
    return tok


def teacher_source(model_dir, meta: dict, teacher: str):
    """(kind, path, description) of the teacher: "self", or a folder / .gguf to load."""
    from glaswap.sources import resolve_source

    if teacher == "self":
        return "self", None, {"spec": "self", "kind": "self",
                              "note": "the model's own softmax attention (the teacher before distillation)"}
    if teacher == "auto":
        recorded = meta.get("source") or {}
        path = Path(recorded.get("path", ""))
        if recorded.get("path") and path.exists():
            kind = "gguf" if path.is_file() else "folder"
            return kind, path, dict(recorded)
        if not recorded.get("spec"):
            raise GlaswapError(f"{model_dir}/glaswap.json records no source model; pass --teacher PATH "
                               f"or --teacher self")
        try:
            src = resolve_source(recorded["spec"])
        except GlaswapError as e:
            raise GlaswapError(f"the source model recorded in glaswap.json is not available ({e}); "
                               f"pass --teacher PATH or --teacher self")
        return src.kind, src.path, src.describe()
    src = resolve_source(teacher)
    if src.kind == "folder" and (src.path / "glaswap.json").is_file():
        raise GlaswapError(f"{teacher} is a glaswap model; --teacher takes the original model (a Hugging Face "
                           f"folder or .gguf file) or self")
    return src.kind, src.path, src.describe()


def load_teacher(kind, path, device, dtype):
    from transformers import AutoModelForCausalLM

    try:
        if kind == "gguf":
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise GlaswapError(f"the teacher {path} could not be loaded ({type(e).__name__}: {first}); pass "
                           f"--teacher PATH to another copy or --teacher self")
    return model.to(device).eval()


# --------------------------------------------------------------------------- writing
def umasked(mode: int) -> int:
    """`mode` less the process umask: what open() and mkdir() give (0644 and 0755 under the usual
    umask 022), where mkstemp and mkdtemp give 0600 and 0700, unreadable to others and containers."""
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def atomic_write(path: Path, write):
    """write(tmp_path) then rename onto path, so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, umasked(0o666))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def versions() -> dict:
    out = {"glaswap": glaswap.__version__, "python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("transformers", "triton", "safetensors", "peft"):
        try:
            out[pkg] = __import__(pkg).__version__
        except Exception:
            out[pkg] = None
    return out
