"""Training-step speed of a GLA student against its softmax teacher (run on a GPU).

For each model shape (SmolLM2-135M, Llama-3.2-1B; random weights, bf16, LoRA r=8 on
q/k/v/o) and each batch (8 x 2048, 1 x 16384 tokens) it times, with CUDA events:
  teacher   the teacher's LoRA step with SDPA (forward, cross-entropy, backward, AdamW)
  student   the same step for the converted GLA model (Triton kernels)
  distill   glaswap's stage-2 step: teacher forward (adapters off, softmax) + student
            forward/backward + KL on logits + AdamW (one row per --loss-impls entry and
            --layers entry: the student's RMSNorms and MLPs fused as glaswap distill runs
            them on a GPU, or eager)
and prints one table: median ms, tokens/s, peak GiB, and student/teacher speed ratio. The
three steps are timed in interleaved rounds (see `measure`).

    PYTHONPATH=<folder with glaswap and glaswap_kernels> python benchmarks/bench_distill.py
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

SHAPES = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                         max_position_embeddings=32768),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192},
                         max_position_embeddings=131072),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192},
                         max_position_embeddings=131072),
}
BATCHES = [(8, 2048), (1, 16384)]


def build(shape: str, peft_casts: bool = False, options: dict | None = None,
          lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")):
    """Teacher and student with LoRA r=8 on `lora_targets`, set up as `glaswap distill` sets
    them up (peft's float32 casts of LoRA inputs skipped unless `peft_casts`); `options` are
    GLA options for the student (e.g. {"feature_map": "hedgehog_pm"})."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from glaswap.convert import glaswap_config
    from glaswap.models.modeling_glaswap import GLASwapForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPES[shape], attn_implementation="sdpa")
    teacher = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
    student = GLASwapForCausalLM(glaswap_config(cfg.to_dict(), options))
    student.load_state_dict(teacher.state_dict(), strict=False)
    student = student.to(device="cuda", dtype=torch.bfloat16)
    new = set(student.new_parameter_names())
    lora = dict(r=8, lora_alpha=16, target_modules=list(lora_targets), lora_dropout=0.0)
    teacher = get_peft_model(teacher, LoraConfig(**lora))
    peft_student = get_peft_model(student, LoraConfig(**lora))
    for name, p in student.named_parameters():
        if name in new:
            p.data = p.data.float()
            p.requires_grad_(True)
    if not peft_casts:  # every step runs under autocast, as in glaswap distill
        from glaswap.distill.student import lora_inputs_in_compute_dtype
        lora_inputs_in_compute_dtype(teacher)
        lora_inputs_in_compute_dtype(student)
    return teacher, student, peft_student


def ce_step(model, ids, opt):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=ids, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def set_fused(student, fused: bool):
    """The student's RMSNorms and MLPs on liger-kernel's fused kernels (as `glaswap distill`
    sets them up on a GPU), or back on their PyTorch forward."""
    from glaswap.distill.student import fuse_layers
    from glaswap.layers.gla_attention import RMSNorm
    from glaswap.models.modeling_glaswap import MLP
    if fused:
        return fuse_layers(student)
    for m in student.modules():
        if isinstance(m, (RMSNorm, MLP)):
            m.__dict__.pop("forward", None)
    return 0


def distill_step(student, ids, opt, loss_impl="auto"):
    from glaswap.distill.losses import kd_step
    from glaswap.distill.recipe import Stage2

    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = kd_step(student, {"input_ids": ids, "cu_seqlens": None}, Stage2(loss_impl=loss_impl))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def time_once(fn):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def measure(steps: dict, reps: int, interleave: bool = True) -> dict:
    """name -> (median ms, peak GiB) for each step function. Every step is warmed up (3 runs)
    with its peak memory recorded; then, by default, timed in rounds of one run of each,
    so that drift (clocks, allocator state) hits all of them alike: timed in separate runs,
    one step can come out 5-15% apart from itself. A step that runs out of memory gets NaN."""
    peaks = {}
    for name, fn in steps.items():
        torch.cuda.reset_peak_memory_stats()
        try:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() / 2**30
        except torch.OutOfMemoryError:
            peaks[name] = float("nan")
        torch.cuda.empty_cache()
    runnable = [name for name in steps if peaks[name] == peaks[name]]
    times = {name: [] for name in runnable}
    if interleave:
        for _ in range(reps):
            for name in runnable:
                times[name].append(time_once(steps[name]))
    else:
        for name in runnable:
            times[name] = [time_once(steps[name]) for _ in range(reps)]
    return {name: (statistics.median(times[name]) if name in times else float("nan"), peaks[name])
            for name in steps}


def apply_overrides(items):
    """`--set KEY=VALUE` items: the feature map's launch keys (GLA kernel launch rules are
    tuned per call with bench_kernels.py --set, which reaches fused_chunk_gla's _overrides)."""
    from glaswap_kernels import feature_map_triton
    for item in items or []:
        key, _, value = item.partition("=")
        if key not in feature_map_triton.LAUNCH:
            raise SystemExit(f"--set {key}: not a feature-map launch key ({', '.join(feature_map_triton.LAUNCH)}); "
                             "tune GLA kernel launches with bench_kernels.py --set")
        feature_map_triton.LAUNCH[key] = int(value) if value.lstrip("-").isdigit() else value


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="smollm2-135m,llama-3.2-1b",
                    help=f"comma-separated, of {', '.join(SHAPES)} (8B: bench_scaling.py, sharded)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json")
    ap.add_argument("--sequential", action="store_true",
                    help="time each step's runs back to back instead of in interleaved rounds")
    ap.add_argument("--option", action="append", metavar="KEY=VALUE", default=[],
                    help="a GLA option of the student, e.g. feature_map=hedgehog_pm")
    ap.add_argument("--peft-casts", action="store_true",
                    help="keep peft's float32 casts of LoRA inputs (glaswap distill skips them under autocast)")
    ap.add_argument("--layers", default="fused",
                    help="the distill step's RMSNorm and MLP: fused, eager, or both (fused,eager): one row each")
    ap.add_argument("--loss-impls", default="auto",
                    help="stage2.loss_impl of the distill step, comma-separated: one row each (e.g. triton,torch)")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="feature-map launch key, as in bench_feature_map.py "
                         "(e.g. BN=64)")
    args = ap.parse_args()
    apply_overrides(args.set)
    from glaswap.distill.recipe import parse_override   # KEY=VALUE read as recipe overrides are
    options = {".".join(key): value for key, value in map(parse_override, args.option)}
    rows = []
    for shape in args.shapes.split(","):
        teacher, student, peft_student = build(shape, args.peft_casts, options)
        opt_t = torch.optim.AdamW([p for p in teacher.parameters() if p.requires_grad], lr=1e-5)
        opt_s = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-5)
        for B, T in BATCHES:
            ids = torch.randint(0, SHAPES[shape]["vocab_size"], (B, T), device="cuda")
            steps = {"teacher": lambda: ce_step(teacher, ids, opt_t),
                     "student": lambda: (set_fused(student, False), ce_step(peft_student, ids, opt_s))}
            impls, layers = args.loss_impls.split(","), args.layers.split(",")
            for impl in impls:
                for lay in layers:
                    name = "distill" + (f":{impl}" if len(impls) > 1 else "") + (f":{lay}" if len(layers) > 1 else "")

                    def step(impl=impl, fused=lay == "fused"):
                        set_fused(student, fused)
                        distill_step(student, ids, opt_s, impl)
                    steps[name] = step
            for name, (ms, peak) in measure(steps, args.reps, not args.sequential).items():
                rows.append(dict(shape=shape, B=B, T=T, step=name, ms=ms, tok_s=B * T / ms * 1e3, peak_gib=peak))
                print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
        del teacher, student, peft_student, opt_t, opt_s
        torch.cuda.empty_cache()
    print(f"\n{'shape':14} {'B x T':>10} {'step':14} {'ms':>8} {'tok/s':>9} {'GiB':>6} {'vs teacher':>10}")
    for r in rows:
        base = next(x for x in rows if x["shape"] == r["shape"] and x["T"] == r["T"] and x["step"] == "teacher")
        print(f"{r['shape']:14} {r['B']:>3} x {r['T']:<5} {r['step']:14} {r['ms']:8.1f} {r['tok_s']:9,.0f} "
              f"{r['peak_gib']:6.1f} {base['ms'] / r['ms']:9.2f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
