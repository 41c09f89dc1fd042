"""The decode benchmark with no model to download: a Llama of a known shape with random
weights is the teacher, and its conversion the student (bench_generate.py without MODEL).

Random weights time the same kernels as trained ones: decode and prefill cost depends on the
shapes, not on the values.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from glaswap.generate import CPU_CONTEXTS, DEFAULT_CONTEXTS, bench_decode, write_bench
from glaswap.runtime import load_student, pick_device, pick_dtype

RANDOM_SHAPES = {
    # SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json)
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                    rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                    max_position_embeddings=65536, bos_token_id=1, eos_token_id=2),
    # a few-millisecond model to check the benchmark itself on a CPU
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                 max_position_embeddings=65536, bos_token_id=1, eos_token_id=2),
}


def random_models(shape: str, dtype, device, workdir: Path, seed: int = 0, options: dict | None = None):
    """(GLA student, teacher): a Llama of RANDOM_SHAPES[shape] with random weights (the
    teacher), saved to `workdir` and converted by glaswap.convert with `options` (the student)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from glaswap.convert import convert

    torch.manual_seed(seed)
    teacher = LlamaForCausalLM(LlamaConfig(**RANDOM_SHAPES[shape])).to(torch.bfloat16)
    teacher.save_pretrained(str(workdir / "teacher"))
    convert(str(workdir / "teacher"), workdir / "gla", options=options, report=False, dtype="bfloat16",
            log=lambda *_: None)
    student = load_student(workdir / "gla", device, dtype)
    return student, teacher.to(device=device, dtype=dtype).eval()


def bench_random(shape: str = "smollm2", contexts=None, batch_size: int = 1, new_tokens: int = 64,
                 graph: str = "auto", device: str = "auto", dtype: str = "auto", teacher: bool = True, out=None,
                 options: dict | None = None, log=print) -> dict:
    """glaswap.generate's decode benchmark on a random Llama of RANDOM_SHAPES[shape] against its
    conversion (with convert's `options`); decode_bench.json and .png go to `out` when it is given."""
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    if contexts is None:
        contexts = DEFAULT_CONTEXTS if dev.type == "cuda" else CPU_CONTEXTS
    with tempfile.TemporaryDirectory(prefix="glaswap-bench-") as tmp:
        started = time.time()
        student, teacher_model = random_models(shape, dt, dev, Path(tmp), options=options)
        log(f"built and converted a random {shape}-shaped Llama in {time.time() - started:.0f} s")
        rows = bench_decode(student, teacher_model if teacher else None, contexts, batch_size, new_tokens, graph,
                            log=log)
    extra = {"model": f"random {shape}", "options": options or {}, "device": str(dev),
             "dtype": str(dt).replace("torch.", "")}
    if out is not None:
        paths = write_bench(rows, Path(out), f"random {shape}: decode, batch {batch_size}", extra)
        log(f"wrote {paths['json']} and {paths['png']}")
        extra["outputs"] = paths
    return {"rows": rows, **extra}
