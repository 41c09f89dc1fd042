"""What the commands share: devices and dtypes, opening a glaswap model with its teacher and its
tokenizer, reading text files, writing a file atomically, and the versions recorded beside
every result."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import tempfile
from dataclasses import dataclass
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
    if not isinstance(cfg, dict) or not isinstance(meta, dict):
        raise GlaswapError(f"{path} is not a glaswap model (config.json or glaswap.json is not a JSON object); "
                           f"convert it again")
    from glaswap.models.configuration_glaswap import written_by_glaswap

    if not written_by_glaswap(cfg):
        raise GlaswapError(f"{path} is not a glaswap model (config.json model_type is "
                           f"{cfg.get('model_type')!r}); convert it first with glaswap convert")
    return meta


def load_student(model_dir, device, dtype, sparse_cache: int | None = None):
    """A saved glaswap folder on `device`; sparse_cache: the hybrid layers' sparse cache for
    this run (config.sparse_cache; None: as saved)."""
    from glaswap.models.modeling_glaswap import GLASwapForCausalLM

    from glaswap.models.configuration_glaswap import GLASwapConfig
    from glaswap.models.gla_options import position_bound_problem

    if sparse_cache is not None and sparse_cache < 0:
        raise GlaswapError(f"--sparse-cache {sparse_cache} must be >= 0 (0: none)")
    try:
        config = GLASwapConfig.from_pretrained(str(model_dir))
    except ValueError as e:   # GLASwapConfig's own validation of the values
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise GlaswapError(f"{Path(model_dir) / 'config.json'} holds a value glaswap cannot use ({first}); "
                           f"restore it, or convert the model again")
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise GlaswapError(f"{model_dir} could not be loaded ({type(e).__name__}: {first}); convert it again")
    if sparse_cache is not None:
        if sparse_cache and not config.window:
            raise GlaswapError(f"{model_dir} is pure GLA: a sparse cache needs hybrid layers (convert with --window); "
                               f"drop --sparse-cache")
        problem = position_bound_problem("--sparse-cache", sparse_cache, config.max_position_embeddings)
        if problem:
            raise GlaswapError(problem)
    try:
        model, info = GLASwapForCausalLM.from_pretrained(str(model_dir), config=config, dtype=dtype,
                                                         output_loading_info=True)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise GlaswapError(f"{model_dir} could not be loaded ({type(e).__name__}: {first}); convert it again")
    check_loaded_keys(info, model_dir)
    check_finite_weights(model, model_dir)
    if sparse_cache is not None:
        model.config.sparse_cache = sparse_cache
    return model.to(device).eval()


def check_loaded_keys(info: dict, where):
    """One line when the weights and config.json do not describe the same model: transformers
    initialises a missing weight at random and drops an unexpected one, each with a warning
    that glaswap mutes (a config.json of fewer layers than the weights would score a model cut
    short)."""
    missing, unexpected = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    if not missing and not unexpected:
        return
    parts = []
    for what, keys in (("missing from the weights", missing), ("in the weights but not in config.json", unexpected)):
        if keys:
            more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
            parts.append(f"{len(keys)} {what}: {', '.join(keys[:3])}{more}")
    raise GlaswapError(f"{where}: config.json and the weights disagree ({'; '.join(parts)}); restore the "
                       f"folder's config.json, or convert the model again")


def check_finite_weights(model, where):
    """One line naming the first parameter holding NaN or infinity (a diverged training run)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point() and not torch.isfinite(p).all():
                raise GlaswapError(f"{where} has non-finite weights ({name} holds NaN or infinity); it cannot be "
                                   f"used: distil it again with a lower learning rate")


def remote_code_in(folder) -> str | None:
    """The file that names Python code of `folder`'s own for its tokenizer, or None."""
    cfg_file = Path(folder) / "tokenizer_config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError):
        return None
    return cfg_file.name if isinstance(cfg, dict) and cfg.get("auto_map") else None


def tokenizer_from(folder, trust_remote_code: bool = False, **kwargs):
    """AutoTokenizer of `folder`. Python code shipped in the folder runs only with
    trust_remote_code (the user's --trust-remote-code): a model folder is data."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust_remote_code, **kwargs)


def load_tokenizer(model_dir, trust_remote_code: bool = False):
    try:
        tok = tokenizer_from(model_dir, trust_remote_code)
    except Exception as e:
        if not trust_remote_code and remote_code_in(model_dir):
            raise GlaswapError(f"the tokenizer of {model_dir} needs Python code of its own (auto_map in "
                               f"tokenizer_config.json); pass --trust-remote-code if you trust that code")
        raise GlaswapError(f"{model_dir} has no usable tokenizer ({type(e).__name__}); copy the tokenizer files "
                           f"of the source model into it")
    tok.model_max_length = 1 << 60  # whole documents are tokenised at once; windows come later
    return tok


def teacher_source(model_dir, meta: dict, teacher: str):
    """(kind, path, description) of the teacher: "self", or a folder / .gguf to load."""
    from glaswap.sources import EMBEDDED, resolve_source

    if teacher == "self":
        return "self", None, {"spec": "self", "kind": "self",
                              "note": "the model's own softmax attention (the teacher before distillation)"}
    if teacher == "auto":
        recorded = meta.get("source") or {}
        if not recorded.get("spec"):
            raise GlaswapError(f"{model_dir}/glaswap.json records no source model; pass --teacher PATH "
                               f"or --teacher self")
        path = Path(recorded.get("path") or "")
        # Only an absolute path says which files were converted: a relative one depends on
        # where convert ran, and could name anything from here.
        if path.is_absolute() and path.exists():
            kind = "gguf" if path.is_file() else "folder"
            check_fingerprint(recorded, kind, path)
            return kind, path, dict(recorded)
        if recorded["spec"] not in EMBEDDED and recorded.get("origin") != "hub":
            where = f"{path}, which no longer exists" if path.is_absolute() else f"as the relative path {path}"
            raise GlaswapError(f"glaswap.json records the source model {where}; pass --teacher PATH "
                               f"or --teacher self")
        try:
            src = resolve_source(recorded["spec"])
        except GlaswapError as e:
            raise GlaswapError(f"the source model recorded in glaswap.json is not available ({e}); "
                               f"pass --teacher PATH or --teacher self")
        check_fingerprint(recorded, src.kind, src.path)
        return src.kind, src.path, src.describe()
    src = resolve_source(teacher)
    if src.kind == "folder" and (src.path / "glaswap.json").is_file():
        raise GlaswapError(f"{teacher} is a glaswap model; --teacher takes the original model (a Hugging Face "
                           f"folder or .gguf file) or self")
    return src.kind, src.path, src.describe()


# Reading every byte of a many-GB checkpoint would cost more than the command that checks it,
# so each weight file is hashed by its size, its safetensors header (every tensor's name,
# dtype, shape and offsets) and its first and last FINGERPRINT_EDGE bytes: another model, or
# other weights of the same shapes, differ there.
FINGERPRINT_EDGE = 4 << 20
FINGERPRINT_METHOD = ("sha256 over each weight file's name, size, safetensors header, first and last 4 MiB")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def _weight_files(kind: str, path: Path) -> list[Path]:
    if kind == "gguf":
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def source_fingerprint(kind: str, path) -> dict:
    """What identifies a teacher's weights (FINGERPRINT_METHOD): {"method", "files": {name:
    size}, "sha256"}."""
    path = Path(path)
    digest = hashlib.sha256()
    files = {}
    for f in _weight_files(kind, path):
        size = f.stat().st_size
        files[f.name] = size
        digest.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            head = fh.read(FINGERPRINT_EDGE)
            digest.update(head)
            if f.suffix == ".safetensors" and len(head) >= 8:
                header_len = int.from_bytes(head[:8], "little")
                if 8 + header_len > len(head) and header_len < size:   # a header longer than the edge
                    fh.seek(len(head))
                    digest.update(fh.read(8 + header_len - len(head)))
            if size > FINGERPRINT_EDGE:
                fh.seek(max(len(head), size - FINGERPRINT_EDGE))
                digest.update(fh.read())
    return {"method": FINGERPRINT_METHOD, "files": files, "sha256": digest.hexdigest()}


def check_fingerprint(recorded: dict, kind: str, path: Path):
    """One line when the teacher found at `path` is not the one glaswap.json's source was
    converted from. A source recorded before fingerprints existed is not checked."""
    expected = recorded.get("fingerprint")
    if not isinstance(expected, dict) or expected.get("method") != FINGERPRINT_METHOD:
        return
    try:
        found = source_fingerprint(kind, path)
    except OSError as e:
        raise GlaswapError(f"the teacher at {path} cannot be read ({e.strerror or e}); check its permissions, "
                           f"or pass --teacher PATH")
    if found == expected:
        return
    was, now = expected.get("files") or {}, found["files"]
    if set(was) != set(now):
        why = f"its weight files are {', '.join(sorted(now)) or 'none'}, not {', '.join(sorted(was))}"
    else:
        changed = next((n for n in sorted(now) if now[n] != was[n]), None)
        why = (f"{changed} is {now[changed]:,} bytes, not {was[changed]:,}" if changed else
               "its weights differ in content")
    raise GlaswapError(f"the teacher at {path} is not the model this was converted from ({why}); pass "
                       f"--teacher {path} to score against it anyway")


def load_teacher(kind, path, device, dtype, trust_remote_code: bool = False):
    """The teacher model. Code shipped in its folder runs only with trust_remote_code."""
    from transformers import AutoModelForCausalLM

    try:
        if kind == "gguf":
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, trust_remote_code=trust_remote_code)
    except Exception as e:
        if kind != "gguf" and not trust_remote_code and _config_has_auto_map(path):
            raise GlaswapError(f"the teacher {path} needs Python code of its own (auto_map in config.json); "
                               f"pass --trust-remote-code if you trust that code")
        first = str(e).splitlines()[0] if str(e) else ""
        raise GlaswapError(f"the teacher {path} could not be loaded ({type(e).__name__}: {first}); pass "
                           f"--teacher PATH to another copy or --teacher self")
    return model.to(device).eval()


def _config_has_auto_map(folder) -> bool:
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and bool(cfg.get("auto_map"))


@dataclass
class Opened:
    """A glaswap model opened for a command (`open_model`)."""
    folder: Path
    meta: dict                              # its glaswap.json
    device: torch.device
    dtype: torch.dtype
    tokenizer: object | None                # None where the command asked for none
    student: torch.nn.Module                # in GLA mode
    teacher: torch.nn.Module | None         # None without one, and for "self" (the student's softmax mode)
    teacher_desc: dict | None               # teacher_source's description; None without a teacher
    prepared: object = None                 # what before_load returned


def open_model(model_dir, device: str = "auto", dtype: str = "auto", teacher: str | None = None,
               sparse_cache: int | None = None, tokenizer: bool = True, trust_remote_code: bool = False,
               before_load=None, writes=None, log=print) -> Opened:
    """Check MODEL's folder, pick the device and dtype, load its tokenizer, the student and the
    teacher: None (no teacher), "self" (no second model: the student's own softmax attention),
    "auto" (the source recorded in glaswap.json) or a folder / .gguf file.

    What needs no weights is checked before any are loaded, so a bad option costs no loading:
    the folder, the teacher's source, the device, then `before_load(tokenizer)`, where a
    command reads its own input with the tokenizer (the texts it will score, say; what it
    returns is `prepared`). writes: the folder the command will write its results to, checked
    (check_writable) before anything loads. trust_remote_code: run Python code that the
    tokenizer's or the teacher's folder ships."""
    folder = Path(model_dir)
    meta = check_model_folder(folder)
    kind = path = desc = None
    if teacher is not None:
        kind, path, desc = teacher_source(folder, meta, teacher)
    if writes is not None:
        check_writable(writes)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    tok = load_tokenizer(folder, trust_remote_code) if tokenizer else None
    prepared = before_load(tok) if before_load is not None else None
    student = load_student(folder, dev, dt, sparse_cache)
    student.set_attention_mode("gla")
    teacher_model = None
    if kind not in (None, "self"):
        log(f"loading teacher {desc.get('spec', path)}")
        teacher_model = load_teacher(kind, path, dev, dt, trust_remote_code)
        # both read the same token ids: another vocabulary would score other tokens
        if teacher_model.config.vocab_size != student.config.vocab_size:
            raise GlaswapError(f"the teacher's vocabulary ({teacher_model.config.vocab_size}) differs from the "
                               f"model's ({student.config.vocab_size}); pass the model it was converted from")
    return Opened(folder, meta, dev, dt, tok, student, teacher_model, desc, prepared)


# --------------------------------------------------------------------------- reading
def decode_text(data: bytes, what, binary_fix: str = "pass a UTF-8 text file",
                encoding_fix: str = "convert it to UTF-8 first") -> str:
    """`data` as UTF-8 text, or a one-line error naming `what` for binary data (NUL bytes) or
    another encoding. The fixes end those lines: what to do differs between commands."""
    if b"\0" in data:
        raise GlaswapError(f"{what} is a binary file (it has NUL bytes); {binary_fix}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GlaswapError(f"{what} is not UTF-8 text (bad byte at offset {e.start}); {encoding_fix}")


def read_text_file(path) -> str:
    """A file's text, or a one-line error for a missing, unreadable, empty or binary file."""
    path = Path(path)
    if not path.exists():
        raise GlaswapError(f"{path} does not exist; pass a UTF-8 text file")
    if path.is_dir():
        raise GlaswapError(f"{path} is a folder; pass UTF-8 text files")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise GlaswapError(f"{path} cannot be read ({e.strerror or e}); check its permissions")
    if not data.strip():
        raise GlaswapError(f"{path} is empty; pass a file with text in it")
    return decode_text(data, path)


def parse_contexts(text: str, option: str = "--contexts", noun: str = "context") -> list[int]:
    """'1024,4K,16k' -> [1024, 4096, 16384]; `option` and `noun` name the flag and what it
    lists in the errors."""
    out = []
    for part in str(text).split(","):
        part = part.strip().lower()
        mult = 1024 if part.endswith("k") else 1
        try:
            value = int(part[:-1] if mult > 1 else part) * mult
        except ValueError:
            raise GlaswapError(f"invalid {noun} {part!r} in {option}; write them like 1024,4K,16K")
        if value < 1:
            raise GlaswapError(f"invalid {noun} {value} in {option}; {noun}s must be at least 1 token")
        out.append(value)
    return out


# --------------------------------------------------------------------------- writing
WRITE_ERRORS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
                errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
                errno.EPERM: "permission denied"}


def write_error(e: BaseException, out) -> GlaswapError | None:
    """A one-line error for an OSError (or a library's error wrapping one) that means OUT
    cannot be written: no space, a read-only file system, no permission. None otherwise."""
    code = getattr(e, "errno", None)
    if code in (errno.EACCES, errno.EPERM) and getattr(e, "filename", None):
        # a file we could not read (a source) is not a problem of OUT's
        failed, target = Path(e.filename).resolve(), Path(out).resolve()
        if not (target.is_relative_to(failed) or failed.is_relative_to(target.parent)):
            return None
    if code not in WRITE_ERRORS:
        text = str(e)  # safetensors and torch wrap the OS error in their own exception
        code = next((c for c in (errno.ENOSPC, errno.EDQUOT) if f"os error {c})" in text), None)
    if code is None:
        return None
    return GlaswapError(f"cannot write {out} ({WRITE_ERRORS[code]}); free some space or choose a writable folder")


def check_writable(out, option: str = "--out"):
    """One line, before any work, when the results could not be written to folder `out`: it is
    a file, or it (or the nearest folder above it that exists, where it would be made) takes no
    new file. A command that computes for minutes must not fail only at the end."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise GlaswapError(f"{option} {out} is a file; pass a folder for the results")
    probe = out
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        raise GlaswapError(f"{option} {out} cannot be made: {probe} is a file; pass a writable folder")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".glaswap-write-check.", dir=probe)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        reason = WRITE_ERRORS.get(e.errno, e.strerror or str(e))
        raise GlaswapError(f"cannot write the results to {out} ({reason}); pass {option} DIR to a writable folder")


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
