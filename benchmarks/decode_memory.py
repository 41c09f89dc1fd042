"""Where a GLA model's decode memory goes, by context: weights, the softmax layers' KV buffers
(and their spare slots), states, windows, and what the allocator holds that no Python tensor
does, eagerly and from CUDA graphs.

    python benchmarks/decode_memory.py                                   # 8 softmax layers, 2K and 32K
    python benchmarks/decode_memory.py --softmax-layers none --contexts 2K,16K,32K

A Llama of SmolLM2-135M's shape with random weights is converted with the GPU recipe's hybrid
options (window 128, 4 sinks) and the given softmax layers; only the student stays on the card.
For each context and each way of decoding: a prompt of random tokens read into a cache, then
`--steps` greedy single-token steps. Reported in GiB: allocated after the prompt, allocated
after the steps and their peak (torch.cuda.max_memory_allocated, reset after the prompt), the
cache's parts, and the allocation that no live tensor accounts for (cuBLAS's workspace, a
captured graph's private pool, anything else held outside Python). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from random_models import random_models  # noqa: E402

GIB = 2 ** 30


def _bytes(t) -> int:
    return t.numel() * t.element_size() if torch.is_tensor(t) else 0


def cache_parts(cache) -> dict:
    """GiB held by each part of a GLASwapCache, and the KV buffers' slots."""
    kv = [b for b in cache.kv if b is not None]
    windows = sum(_bytes(t) for w in cache.windows if w is not None for t in w.tensors())
    return {"kv": sum(_bytes(b.keys) + _bytes(b.values) for b in kv) / GIB,
            "kv_slot_meta": sum(_bytes(b.valid) + _bytes(b.positions) for b in kv) / GIB,
            "kv_slots": sorted({b.capacity for b in kv}),
            "kv_tokens": max((b.length for b in kv), default=0),
            "states": sum(_bytes(s) for s in cache.states if s is not None) / GIB,
            "windows": windows / GIB}


def live_tensor_gib() -> float:
    """GiB of CUDA storage that live Python tensors hold, each storage counted once."""
    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if torch.is_tensor(obj) and obj.is_cuda:
                storage = obj.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        except Exception:      # objects that only look like tensors
            pass
    return total / GIB


@torch.no_grad()
def measure(model, context: int, steps: int, graph: bool, seed: int = 0) -> dict:
    from glaswap.decode_graph import disable_decode_graph, enable_decode_graph
    from glaswap.generate import CACHE_NAME, cache_of

    (enable_decode_graph if graph else disable_decode_graph)(model)
    gen = torch.Generator().manual_seed(seed + context)
    prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=gen).cuda()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    cache, token = cache_of(out), out.logits[:, -1:].argmax(-1)
    del out
    torch.cuda.synchronize()
    row = {"context": context, "graph": graph, "after_prompt": torch.cuda.memory_allocated() / GIB,
           "prompt_peak": torch.cuda.max_memory_allocated() / GIB, "cache_after_prompt": cache_parts(cache)}
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        token = model(input_ids=token, **{CACHE_NAME: cache}, use_cache=True).logits[:, -1:].argmax(-1)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated() / GIB
    row.update(decoding=allocated, decoding_peak=torch.cuda.max_memory_allocated() / GIB,
               cache=cache_parts(cache), outside_tensors=allocated - live_tensor_gib())
    del cache, token
    disable_decode_graph(model)
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="2K,32K", help="prompt lengths, comma-separated (K = 1024)")
    p.add_argument("--softmax-layers", default="2,7,14,17,18,20,23,24",
                   help="layers kept as softmax attention, comma-separated, or none")
    p.add_argument("--steps", type=int, default=34, help="decode steps after each prompt")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    from glaswap.errors import GlaswapError
    from glaswap.runtime import parse_contexts

    try:
        contexts = parse_contexts(args.contexts)
    except GlaswapError as e:
        sys.exit(str(e))
    try:
        layers = [] if args.softmax_layers.strip().lower() == "none" else \
            [int(x) for x in args.softmax_layers.split(",") if x.strip()]
    except ValueError:
        sys.exit(f"invalid --softmax-layers {args.softmax_layers!r}; write layer numbers like 2,7,14 or none")
    if not torch.cuda.is_available():
        sys.exit("decode_memory.py measures the CUDA allocator: run it on a machine with a CUDA GPU")
    options = {"window": 128, "sinks": 4, "softmax_layers": layers}
    with tempfile.TemporaryDirectory(prefix="glaswap-mem-") as tmp:
        try:      # convert checks the layers (in range, not repeated)
            student, teacher = random_models("smollm2", torch.bfloat16, torch.device("cuda"), Path(tmp),
                                             options=options)
        except GlaswapError as e:
            sys.exit(str(e))
    del teacher
    gc.collect()
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated() / GIB
    print(f"{torch.cuda.get_device_name()}: weights and buffers {weights:.3f} GiB; softmax layers {layers or 'none'}")
    rows = []
    for context in contexts:
        for graph in (False, True):
            row = measure(student, context, args.steps, graph)
            rows.append(row)
            c = row["cache"]
            print(f"{context:>6} {'graph' if graph else 'eager'}: after prompt {row['after_prompt']:.3f}, "
                  f"decoding {row['decoding']:.3f} (peak {row['decoding_peak']:.3f}); KV {c['kv']:.3f} in "
                  f"{c['kv_slots']} slots for {c['kv_tokens']} tokens, slot meta {c['kv_slot_meta']:.4f}, "
                  f"states {c['states']:.4f}, windows {c['windows']:.4f}; outside tensors "
                  f"{row['outside_tensors']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "weights": weights,
                                         "softmax_layers": layers, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
