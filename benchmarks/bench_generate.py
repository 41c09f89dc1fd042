"""Decode speed and memory of a GLA model against its softmax teacher (KV cache), by context.

    python benchmarks/bench_generate.py                      # SmolLM2-135M shape, random weights
    python benchmarks/bench_generate.py MODEL_DIR            # a folder written by glaswap convert/distill
    python benchmarks/bench_generate.py --contexts 1K,4K,16K,32K --batch-size 8 --out bench/

Without MODEL_DIR it needs no download: a Llama with SmolLM2-135M's shape (30 layers,
hidden 576, 9 heads / 3 KV heads, head dim 64, vocab 49152, tied embeddings) gets random
weights, is saved to a temporary folder and converted; that Llama is the teacher. For each
context: prefill that many random tokens (timed too), then time single-token greedy decode
steps (GLA: CUDA-graph replay on CUDA, and eager; teacher: Hugging Face with its KV cache).
Peak memory is torch.cuda.max_memory_allocated over the decode steps. `--option KEY=VALUE`
converts the random model with convert's options, e.g. the GPU recipe's hybrid with a sparse
cache, whose prompts are read in blocks (graph-replayed on CUDA):

    python benchmarks/bench_generate.py --option window=128 --option sinks=4 --option sparse_cache=64

The benchmark itself is `bench_random` of benchmarks/random_models.py (random weights) and
`glaswap.generate.bench_model` (a folder); this script only reads the arguments and prints
what the machine runs.

Runs from the repo root without glaswap installed: the repo root is put on sys.path and,
when `glaswap_kernels` is not importable (no install), the checkout's glaswap_kernels/ is
loaded under that name.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _ensure_kernels_package():
    """Make `import glaswap_kernels` work from a source checkout."""
    try:
        import glaswap_kernels  # noqa: F401
        return
    except ImportError:
        pass
    spec = importlib.util.spec_from_file_location("glaswap_kernels", REPO / "glaswap_kernels" / "__init__.py",
                                                  submodule_search_locations=[str(REPO / "glaswap_kernels")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["glaswap_kernels"] = module
    spec.loader.exec_module(module)


_ensure_kernels_package()

import torch  # noqa: E402


def main(argv=None):
    from glaswap.distill.recipe import parse_override
    from glaswap.errors import GlaswapError
    from random_models import RANDOM_SHAPES, bench_random

    from glaswap.generate import bench_model
    from glaswap.runtime import DTYPES, parse_contexts, pick_device

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="a glaswap model folder (default: random SmolLM2-135M shape)")
    ap.add_argument("--contexts", default=None, help="e.g. 1K,4K,16K,32K (default; 64,256 on CPU)")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=64, help="timed decode steps per context")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on CUDA, else float32")
    ap.add_argument("--graph", choices=["auto", "on", "off"], default="auto", help="CUDA-graph decode (auto: on CUDA)")
    ap.add_argument("--shape", choices=sorted(RANDOM_SHAPES), default="smollm2", help="model shape without MODEL")
    ap.add_argument("--no-teacher", action="store_true", help="time the GLA model only")
    ap.add_argument("--option", action="append", metavar="KEY=VALUE", default=[],
                    help="a convert option for the random model, e.g. --option window=128 --option sparse_cache=64")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None, help="also write decode_bench.json and .png here")
    args = ap.parse_args(argv)

    try:
        device = pick_device(args.device)
        dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
        contexts = parse_contexts(args.contexts) if args.contexts else None
        _describe(device, dtype_name, args)
        options = {".".join(key): value for key, value in map(parse_override, args.option)}
        if args.model and options:
            raise GlaswapError("--option converts the random model; a MODEL folder keeps its own options")
        if args.model:
            bench_model(args.model, teacher="none" if args.no_teacher else "auto", contexts=contexts,
                        batch_size=args.batch_size, new_tokens=args.new_tokens, graph=args.graph,
                        device=str(device), dtype=dtype_name, out=args.out or Path(args.model) / "eval")
        else:
            bench_random(args.shape, contexts, args.batch_size, args.new_tokens, args.graph, device=str(device),
                         dtype=dtype_name, teacher=not args.no_teacher, out=args.out, options=options)
        return 0
    except GlaswapError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1


def _describe(device, dtype_name, args):
    import transformers

    from glaswap_kernels import HAS_TRITON

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    print(f"device {name}, {dtype_name}, batch {args.batch_size}, {args.new_tokens} timed steps; torch "
          f"{torch.__version__}, triton {triton_version} (GLA Triton kernels: "
          f"{'yes' if HAS_TRITON and device.type == 'cuda' else 'no'}), transformers {transformers.__version__}")


if __name__ == "__main__":
    sys.exit(main())
