"""Stage-2 distillation throughput on 1..N GPUs (run under torchrun).

    torchrun --standalone --nproc-per-node 1 benchmarks/bench_scaling.py
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_scaling.py [--layout fsdp]

Llama-3.2-1B shape with random weights, LoRA r=8 on q/k/v/o, every process running glaswap's
stage-2 step (teacher forward in softmax mode, student forward/backward, KL, AdamW) on its own
8 x 2048 tokens, through the same `Dist` layer `glaswap distill` uses. Prints the global
tokens/s on rank 0; the speed-up is the ratio of two runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_distill import SHAPES  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=["ddp", "fsdp"], default="ddp")
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig

    from glaswap.convert import glaswap_config
    from glaswap.distill.parallel import setup_distributed
    from glaswap.distill.recipe import Stage2
    from glaswap.distill.student import lora_inputs_in_compute_dtype
    from glaswap.distill.losses import kd_step
    from glaswap.models.modeling_glaswap import GLASwapForCausalLM

    dist = setup_distributed(args.layout)
    device = torch.device("cuda", dist.local_rank)
    torch.manual_seed(0)  # the same random model on every process
    lm = GLASwapForCausalLM(glaswap_config(LlamaConfig(**SHAPES[args.shape]).to_dict()))
    new = set(lm.new_parameter_names())
    get_peft_model(lm, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    if dist.mode != "fsdp":
        lm.to(torch.bfloat16)
    for name, p in lm.named_parameters():
        trainable = name in new or ".lora_" in name
        if trainable:
            p.data = p.data.float()
        p.requires_grad_(trainable)
    lora_inputs_in_compute_dtype(lm)  # as glaswap distill does for autocast steps
    dist.wrap(lm, device, torch.bfloat16)
    params = [p for p in lm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    gen = torch.Generator(device="cpu").manual_seed(1000 + dist.rank)
    vocab = SHAPES[args.shape]["vocab_size"]

    def step():
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = kd_step(lm, {"input_ids": ids, "cu_seqlens": None}, Stage2())
        loss.backward()
        dist.sync_grads(params)
        opt.step()
        lm.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    tokens = dist.world * args.batch * args.seq
    if dist.is_main:
        print(json.dumps({"world": dist.world, "layout": dist.mode, "shape": args.shape, "step_ms": round(ms, 1),
                          "global_tokens_per_s": round(tokens / ms * 1e3),
                          "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)}))
    if dist.world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
