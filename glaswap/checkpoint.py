"""Reading and writing checkpoints without holding two copies of the weights.

- `open_tensors(source)`: the source's tensors, one at a time, shard by shard.
- `ShardWriter`: safetensors output shards of bounded size plus the index, written as the
  tensors arrive.
- `output_folder(out, force)`: a temporary folder renamed onto OUT only when everything is
  written, so a failure never leaves a half-written OUT; `check_out_path` refuses an OUT
  whose writing or replacement would touch what the user did not ask to replace.
- `exclusive_lock(path)`: one process at a time (a distillation's run folder).
- `write_model_code(folder)`: the modeling files a saved model needs, with glaswap's imports
  made relative so the folder loads with `trust_remote_code=True` and no glaswap installed.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import glob
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
from glaswap.runtime import umasked, write_error
from glaswap.sources import readable_by_all

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


def check_out_path(out, sources: list[tuple[str, object]] = ()):
    """Refuse an OUT that writing or replacing (--force) would turn against the user's files:
    the current folder, the home folder, / (or a folder holding one of them), a folder inside
    a source, or one holding a source. `sources` are (what, path) pairs; paths that do not
    exist (hub ids, embedded names) are skipped."""
    target = Path(out).expanduser().resolve()
    for place, name in ((Path.cwd(), "the current folder"), (Path.home(), "your home folder"),
                        (Path("/"), "the file system root")):
        if place.resolve().is_relative_to(target):
            raise GlaswapError(f"OUT {out} is or holds {name}; glaswap writes OUT as a new folder "
                               f"(and --force replaces it), choose a new folder")
    for what, path in sources:
        if path is None or not Path(path).expanduser().exists():
            continue
        src = Path(path).expanduser().resolve()
        if src.is_relative_to(target):
            raise GlaswapError(f"{what} {path} is inside OUT {out}; replacing OUT would delete it, "
                               f"choose an OUT outside it")
        if target.is_relative_to(src):
            raise GlaswapError(f"OUT {out} is inside {what} {path}; glaswap never writes into its inputs, "
                               f"choose an OUT outside it")


@contextmanager
def exclusive_lock(path: Path, busy: str):
    """Hold an exclusive flock on `path` for the block's life; GlaswapError(busy) at once when
    another process holds it. The kernel releases the lock of a killed process."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise GlaswapError(busy)
        # The holder before us removes the file as it ends: lock the file that is there now.
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:
        path.unlink(missing_ok=True)   # before unlocking, so no one takes a lock on a file about to go
        os.close(fd)


def _held(lock: Path) -> bool:
    """Whether a live process holds the flock on `lock`."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _clean_stale_temps(out: Path):
    """Remove the temporary folders of earlier writers of OUT that were killed: a live writer
    holds the lock file beside its folder, so a folder without a held lock is stale."""
    name = glob.escape(out.name)
    for lock in out.parent.glob(f".{name}.tmp-*.lock"):
        if not _held(lock):
            folder = lock.with_suffix("")
            shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(folder.with_name(folder.name + ".old"), ignore_errors=True)
            lock.unlink(missing_ok=True)
    for folder in out.parent.glob(f".{name}.tmp-*"):
        live = folder.with_name(folder.name.removesuffix(".old") + ".lock")
        if folder.is_dir() and not live.exists():
            shutil.rmtree(folder, ignore_errors=True)


def _new_temp(out: Path) -> tuple[int, Path]:
    """(locked fd, folder): a fresh temporary folder beside OUT and the lock that marks it live.
    The lock file is locked under a name the cleaner ignores, then renamed into place."""
    fd, first = tempfile.mkstemp(prefix=f".{out.name}.lock-", dir=out.parent)
    fcntl.flock(fd, fcntl.LOCK_EX)
    folder = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    readable_by_all(folder)   # it becomes OUT
    os.rename(first, folder.with_name(folder.name + ".lock"))
    return fd, folder


def rename_noreplace(src: Path, dst: Path):
    """Rename `src` to `dst`; FileExistsError when `dst` exists, even as an empty folder (which
    a plain rename would replace). renameat2 makes the check and the rename one step."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is not None:
        at_fdcwd, rename_noreplace_flag = -100, 1
        if renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), rename_noreplace_flag) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL):   # EINVAL: a file system without the flag
            raise OSError(code, os.strerror(code), str(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


@contextmanager
def output_folder(out: Path, force: bool = False):
    """Yield a temporary folder beside OUT; on success it becomes OUT, on failure it vanishes.
    Without `force` an OUT that appeared in the meantime is left as it is (and refused)."""
    out = Path(out)
    if out.exists() and not force:
        raise GlaswapError(f"{out} already exists; choose another output folder or pass --force to replace it")
    if out.exists() and not out.is_dir():
        raise GlaswapError(f"{out} exists and is not a folder; choose another output path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _clean_stale_temps(out)
        lock, tmp = _new_temp(out)
    except OSError as e:
        raise write_error(e, out) or e
    lock_file = tmp.with_name(tmp.name + ".lock")
    try:
        yield tmp
        _open_modes(tmp)
        if force and out.exists():
            trash = tmp.with_name(tmp.name + ".old")
            os.replace(out, trash)
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            try:
                rename_noreplace(tmp, out)
            except FileExistsError:
                raise GlaswapError(f"{out} appeared while glaswap was writing it and was left as it is; "
                                   f"move it away and run again, or pass --force to replace it")
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        err = write_error(e, out) if isinstance(e, Exception) else None
        if err is not None:
            raise err from e
        raise
    finally:
        lock_file.unlink(missing_ok=True)
        os.close(lock)


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
# (file to copy, name in the saved folder). Kernels first: the layer imports them. The saved
# folder is flat: a kernel file of an op's subpackage gets the op's name in front
# (glaswap_kernels/gla/chunk_fwd.py -> gla_chunk_fwd.py), and every name is unique.
CODE_FILES = [
    ("glaswap_kernels/utils.py", "kernel_utils.py"),
    ("glaswap_kernels/gla/reference.py", "gla_reference.py"),
    ("glaswap_kernels/gla/scores.py", "gla_scores.py"),
    ("glaswap_kernels/gla/chunk_fwd.py", "gla_chunk_fwd.py"),
    ("glaswap_kernels/gla/chunk_bwd.py", "gla_chunk_bwd.py"),
    ("glaswap_kernels/gla/state.py", "gla_state.py"),
    ("glaswap_kernels/gla/recurrent.py", "gla_recurrent.py"),
    ("glaswap_kernels/gla/launch.py", "gla_launch.py"),
    ("glaswap_kernels/gla/chunk.py", "gla_chunk.py"),
    ("glaswap_kernels/feature_map_triton.py", "feature_map_triton.py"),
    ("glaswap_kernels/normalizer_triton.py", "normalizer_triton.py"),
    ("glaswap_kernels/rmsnorm_triton.py", "rmsnorm_triton.py"),
    ("glaswap_kernels/silu_mul_triton.py", "silu_mul_triton.py"),
    ("glaswap_kernels/gate_triton.py", "gate_triton.py"),
    ("glaswap_kernels/window/reference.py", "window_reference.py"),
    ("glaswap_kernels/window/triton.py", "window_triton.py"),
    ("glaswap_kernels/window/mix.py", "window_mix.py"),
    ("glaswap_kernels/window/decode.py", "window_decode.py"),
    ("glaswap_kernels/hybrid_cpu.py", "hybrid_cpu.py"),
    ("glaswap_kernels/rope_triton.py", "rope_triton.py"),
    ("glaswap_kernels/ops.py", "ops.py"),
    ("glaswap/layers/softmax_attention.py", "softmax_attention.py"),
    ("glaswap/layers/hybrid_cache.py", "hybrid_cache.py"),
    ("glaswap/layers/gla_attention.py", "gla_attention.py"),
    ("glaswap/models/gla_options.py", "gla_options.py"),
    ("glaswap/models/configuration_glaswap.py", "configuration_glaswap.py"),
    ("glaswap/models/modeling_glaswap.py", "modeling_glaswap.py"),
]
# Kernels that only training runs (stage 2's vocabulary loss): saved folders go without them.
TRAINING_ONLY_KERNELS = {"glaswap_kernels/kd_loss_triton.py"}
# A `from X import` line (indented too: the Triton imports sit in try blocks). X is absolute
# (glaswap_kernels.gla.chunk) or relative (.launch, ..utils, .gla.reference).
_IMPORT = re.compile(r"^(?P<indent>[ \t]*)from[ \t]+(?P<dots>\.*)(?P<name>[\w.]*)[ \t]+import\b", re.MULTILINE)


def _module(rel):
    """glaswap_kernels/gla/chunk.py -> glaswap_kernels.gla.chunk."""
    return rel[:-len(".py")].replace("/", ".")


# every copied module by its dotted name -> its module name in the saved folder
_FLAT = {_module(rel): name[:-len(".py")] for rel, name in CODE_FILES}


def _flat_imports(rel, text):
    """text (the source of CODE_FILES entry rel) with every import of glaswap's modules, absolute
    or relative to rel's package, turned into `from .<name in the saved folder> import`. An
    import of one of them that is not copied is an error: the saved folder would not load."""
    package = _module(rel).split(".")[:-1]

    def flat(m):
        dots, name = m.group("dots"), m.group("name")
        if dots:
            up = len(dots) - 1
            if not name or up >= len(package):
                raise ValueError(f"{rel}: `{m.group(0).strip()}` names no module the saved folder can hold")
            target = ".".join(package[:len(package) - up] + name.split("."))
        elif name.split(".")[0] in ("glaswap", "glaswap_kernels"):
            target = name
        else:
            return m.group(0)                   # torch, triton, transformers, ...
        if target not in _FLAT:
            raise ValueError(f"{rel} imports {target}, which saved model folders do not copy "
                             f"(glaswap.checkpoint.CODE_FILES)")
        return f"{m.group('indent')}from .{_FLAT[target]} import"

    return _IMPORT.sub(flat, text)


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
    """Copy the modeling files into `folder`, flat, turning glaswap's imports into imports of
    the copied siblings (`from .gla_chunk import ...`)."""
    written = []
    for rel, name in CODE_FILES:
        src = _package_file(rel)
        if not src.is_file():
            continue  # the kernel files may be absent in a source checkout without kernels
        text = _flat_imports(rel, src.read_text())
        (folder / name).write_text(text)
        written.append(name)
    return written
