"""Reading and writing checkpoints without holding two copies of the weights.

- `open_tensors(source)`: the source's tensors, one at a time, shard by shard.
- `ShardWriter`: safetensors output shards of bounded size plus the index, written as the
  tensors arrive.
- `output_folder(out, force)`: a temporary folder renamed onto OUT only when everything is
  written, so a failure never leaves a half-written OUT.
- `write_model_code(folder)`: the modeling files a saved model needs, with glaswap's imports
  made relative so the folder loads with `trust_remote_code=True` and no glaswap installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from glaswap.errors import GlaswapError
from glaswap.runtime import umasked

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


# --------------------------------------------------------------------------- reading
class FolderTensors:
    """Tensors of a Hugging Face folder (safetensors, or .bin as a fallback), shard by shard."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.shards = self._find_shards()
        self._check_shards()

    def _find_shards(self):
        f = self.folder
        for index, single in ((SAFE_INDEX, "model.safetensors"), (BIN_INDEX, "pytorch_model.bin")):
            if (f / index).is_file():
                try:
                    weight_map = json.loads((f / index).read_text())["weight_map"]
                except (OSError, ValueError, KeyError) as e:
                    raise GlaswapError(f"{f / index} is unreadable ({e}); restore it from the original checkpoint")
                files = sorted(set(weight_map.values()))
                missing = [n for n in files if not (f / n).is_file()]
                if missing:
                    raise GlaswapError(f"{f} is missing weight shard {missing[0]} listed in {index}; "
                                       f"download the complete checkpoint")
                return [f / n for n in files]
            if (f / single).is_file():
                return [f / single]
        raise GlaswapError(f"{f} has no weights (model.safetensors or pytorch_model.bin); "
                           f"download the weights next to config.json")

    def _check_shards(self):
        """Read every header up front: a truncated file fails before anything is written."""
        for shard in self.shards:
            if shard.suffix != ".safetensors":
                continue
            try:
                with safe_open(str(shard), framework="pt") as fh:
                    fh.keys()
            except (SafetensorError, OSError) as e:
                raise GlaswapError(f"{shard} is corrupted or truncated ({e}); download it again")

    def __iter__(self):
        for shard in self.shards:
            if shard.suffix == ".safetensors":
                try:
                    with safe_open(str(shard), framework="pt") as fh:
                        for name in fh.keys():
                            yield name, fh.get_tensor(name)
                except SafetensorError as e:
                    raise GlaswapError(f"{shard} is corrupted or truncated ({e}); download it again")
            else:
                try:
                    state = torch.load(shard, map_location="cpu", weights_only=True, mmap=True)
                except Exception as e:
                    raise GlaswapError(f"{shard} could not be read ({type(e).__name__}: {e}); download it again")
                for name in list(state):
                    yield name, state.pop(name)


class GGUFTensors:
    """A GGUF checkpoint, dequantised by transformers (GGUF files are small: held at once)."""

    def __init__(self, path: Path):
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                         dtype=torch.float32)
        except Exception as e:
            raise GlaswapError(f"{path} could not be read as a GGUF model ({type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}); check the file")
        self.config = model.config.to_dict()
        self.config.pop("quantization_config", None)
        self.state = model.state_dict()

    def __iter__(self):
        for name in list(self.state):
            yield name, self.state.pop(name)


# --------------------------------------------------------------------------- writing
def parse_size(text) -> int:
    """'2GB', '500MB', '300KB' or a number of bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise GlaswapError(f"invalid size {text!r}; write it like 2GB, 500MB or 300KB")
    unit = (m.group(2) or "B").upper().replace("I", "")
    return int(float(m.group(1)) * {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}[unit])


class ShardWriter:
    """Collects tensors and writes a safetensors shard whenever `max_bytes` would be exceeded."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder = folder
        self.max_bytes = max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.peak_bytes = 0          # most bytes ever held here: the streaming test reads it
        self.files: list[dict[str, int]] = []
        self.total_bytes = 0

    def add(self, name, tensor):
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.pending_bytes)

    def _flush(self):
        if not self.pending:
            return
        path = self.folder / f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append({name: t.numel() * t.element_size() for name, t in self.pending.items()})
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def close(self):
        self._flush()
        n = len(self.files)
        if n == 1:
            os.replace(self.folder / "model-00001.safetensors", self.folder / "model.safetensors")
            return ["model.safetensors"]
        names = []
        weight_map = {}
        for i, tensors in enumerate(self.files, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            os.replace(self.folder / f"model-{i:05d}.safetensors", self.folder / final)
            names.append(final)
            weight_map.update({t: final for t in tensors})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return names


@contextmanager
def output_folder(out: Path, force: bool = False):
    """Yield a temporary folder beside OUT; on success it replaces OUT, on failure it vanishes."""
    out = Path(out)
    if out.exists() and not force:
        raise GlaswapError(f"{out} already exists; choose another output folder or pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise GlaswapError(f"{out} exists and is not a folder; choose another output path")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        _open_modes(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, trash / out.name)
        os.replace(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, out)


def _open_modes(folder: Path):
    """Folders 0755 and files 0644 (less the umask) throughout, as open() and mkdir() make them:
    mkdtemp, and safetensors' own atomic writes, leave 0700 and 0600, which others and
    containers cannot read."""
    dir_mode, file_mode = umasked(0o777), umasked(0o666)
    os.chmod(folder, dir_mode)
    for root, dirs, files in os.walk(folder):
        for name in dirs:
            os.chmod(os.path.join(root, name), dir_mode)
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), file_mode)


# --------------------------------------------------------------------------- model code
_PKG = Path(__file__).resolve().parent
# (file to copy, name in the saved folder). Kernels first: the layer imports them.
CODE_FILES = [
    ("glaswap_kernels/gla_torch.py", "gla_torch.py"),
    ("glaswap_kernels/triton_helpers.py", "triton_helpers.py"),
    ("glaswap_kernels/gla_scores.py", "gla_scores.py"),
    ("glaswap_kernels/gla_chunk_fwd.py", "gla_chunk_fwd.py"),
    ("glaswap_kernels/gla_chunk_bwd.py", "gla_chunk_bwd.py"),
    ("glaswap_kernels/gla_state.py", "gla_state.py"),
    ("glaswap_kernels/gla_recurrent.py", "gla_recurrent.py"),
    ("glaswap_kernels/gla_launch.py", "gla_launch.py"),
    ("glaswap_kernels/gla_triton.py", "gla_triton.py"),
    ("glaswap_kernels/feature_map_triton.py", "feature_map_triton.py"),
    ("glaswap_kernels/normalizer_triton.py", "normalizer_triton.py"),
    ("glaswap_kernels/gate_triton.py", "gate_triton.py"),
    ("glaswap_kernels/gla_ops.py", "gla_ops.py"),
    ("glaswap/layers/gla_attention.py", "gla_attention.py"),
    ("glaswap/models/configuration_glaswap.py", "configuration_glaswap.py"),
    ("glaswap/models/modeling_glaswap.py", "modeling_glaswap.py"),
]
_IMPORT = re.compile(r"^from (glaswap_kernels|glaswap\.layers|glaswap\.models)\.(\w+) import", re.MULTILINE)

AUTO_MAP = {
    "AutoConfig": "configuration_glaswap.GLASwapConfig",
    "AutoModel": "modeling_glaswap.GLASwapModel",
    "AutoModelForCausalLM": "modeling_glaswap.GLASwapForCausalLM",
}


def _package_file(rel):
    """Where a CODE_FILES entry lives in the installed (or editable) packages."""
    import glaswap_kernels

    top, name = rel.split("/", 1)
    base = Path(glaswap_kernels.__file__).resolve().parent if top == "glaswap_kernels" else _PKG
    return base / name


def write_model_code(folder: Path):
    """Copy the modeling files into `folder`, turning glaswap's imports into relative ones."""
    written = []
    for rel, name in CODE_FILES:
        src = _package_file(rel)
        if not src.is_file():
            continue  # the kernel files may be absent in a source checkout without kernels
        text = _IMPORT.sub(lambda m: f"from .{m.group(2)} import", src.read_text())
        (folder / name).write_text(text)
        written.append(name)
    return written
