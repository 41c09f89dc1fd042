"""Stage 2's vocabulary loss on one GPU: glaswap's torch and Triton paths against liger-kernel.

The loss is glaswap's `kd_loss`: mean over tokens of T^2 KL(teacher || student) plus
ce_weight x the next-token cross-entropy, from final hidden states and the shared lm_head.
At the Llama-3.2-1B shape (hidden 2048, vocabulary 128256, bf16 hidden states and head) it
times forward+backward (median of --reps after --warmup calls, CUDA events) and measures
the peak memory above the inputs of:

  torch@C   glaswap's torch path, loss_chunk_tokens C (each chunk checkpointed)
  triton@C  glaswap's Triton path (glaswap_kernels.kd_loss_triton): cuBLAS logits, one
            kernel for the loss and its gradient, chunks of C tokens
  liger@C   liger-kernel's chunked fused linear JSD at beta 0 (forward KL) with its hard
            cross-entropy, chunks of C tokens, torch.compile'd, extended to glaswap's loss
            (every token's KL, in float32, over all tokens)
  liger-triton  liger-kernel's Triton fused linear JSD (KL only) plus, when ce_weight > 0,
            its fused linear cross-entropy: not a glaswap path, a row to see whether it would
            win (without autocast: it takes float32 logits from the GEMM itself)

Each row is first checked against the same loss in float32 (relative error of the loss,
relative RMS error of the gradient of the student's hidden states, and of the head with
--train-head). Steps run under bf16 autocast, as `glaswap distill` runs them on CUDA
(--no-autocast: without). Then, unless --no-layers, liger's fused RMSNorm and SwiGLU
against the PyTorch forms at the same shape.

    python benchmarks/bench_vocab_loss.py                      # both batches, ce_weight 0 and 0.5
    python benchmarks/bench_vocab_loss.py --batches 1x16384 --ce-weights 0 --json out.json
    python benchmarks/bench_vocab_loss.py --dry-run   # CPU, tiny sizes, Triton interpreter: tests the script
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HIDDEN, VOCAB, INTERMEDIATE = 2048, 128256, 8192   # Llama-3.2-1B
RMS_EPS = 1e-5
DEVICE = "cuda"                   # --dry-run: "cpu", with tiny sizes


def time_ms(fn, warmup, reps):
    """Median milliseconds of fn() over reps calls, after warmup calls."""
    if DEVICE == "cpu":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_gib(fn, tensors):
    """GiB allocated at the peak of one fn() above what was allocated before it."""
    for t in tensors:
        t.grad = None
    if DEVICE == "cpu":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 30


def rel(x, ref):
    """Relative RMS error of x against ref (for a scalar: the relative error)."""
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


# ----------------------------------------------------------------------------- the loss
def loss_inputs(batch, seq, train_head, seed=0):
    """bf16 student and teacher hidden states (the student a perturbed teacher), a head whose
    logits have a standard deviation of about 3, and next-token labels with -100 at the end
    of each sequence, as stage 2 builds them."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    n = batch * seq
    h_t = torch.randn(n, HIDDEN, device=DEVICE, generator=g)
    h_s = h_t + 0.3 * torch.randn(n, HIDDEN, device=DEVICE, generator=g)
    w = torch.randn(VOCAB, HIDDEN, device=DEVICE, generator=g) * (3.0 / HIDDEN ** 0.5)
    labels = torch.randint(0, VOCAB, (n,), device=DEVICE, generator=g)
    labels[seq - 1::seq] = -100
    return (h_s.bfloat16().requires_grad_(), h_t.bfloat16(), w.bfloat16().requires_grad_(train_head), labels)


def _liger_chunked():
    """liger-kernel's chunked fused linear JSD, made to give glaswap's loss exactly.

    At beta 0 liger's JSD is KL(teacher || student). Liger leaves the KL of tokens labelled
    -100 out and takes the log-softmax in the logits' dtype; glaswap keeps every token's KL
    and takes it in float32, so the per-chunk KL gets no labels and float32 logits. The
    cross-entropy still skips unlabelled tokens."""
    from liger_kernel.chunked_loss.jsd_loss import LigerFusedLinearJSDFunction

    class EveryTokenKL(LigerFusedLinearJSDFunction):
        @staticmethod
        def distillation_loss_fn(student_logits, teacher_logits, beta=0.0, target=None, ignore_index=-100):
            return LigerFusedLinearJSDFunction.distillation_loss_fn(student_logits.float(), teacher_logits.float(),
                                                                    beta=beta)
    return EveryTokenKL


def liger_kd(h_s, h_t, w, labels, ce_weight, temperature, chunk):
    """glaswap's kd_loss (mean over all tokens) through liger's chunked function."""
    loss = _liger_chunked().apply(h_s, w, h_t, w, labels, None, None, float(ce_weight), float(temperature) ** 2,
                                  0.0, -100, float(temperature), h_s.is_cuda, chunk, False)
    return loss * (labels != -100).sum().clamp_min(1) / h_s.shape[0]  # liger divides by labelled tokens


def liger_triton_kd(h_s, h_t, w, labels, ce_weight, temperature):
    """glaswap's loss from liger-kernel's Triton ops: the fused linear JSD at beta 0 without
    labels (KL over every token, divided by all tokens) and the fused linear cross-entropy."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy, liger_fused_linear_jsd
    loss = liger_fused_linear_jsd(h_s, w, h_t, w, None, 0.0, -100, temperature) * temperature ** 2
    if ce_weight:
        ce = liger_fused_linear_cross_entropy(h_s, w, labels, ignore_index=-100, reduction="sum")
        loss = loss + ce_weight * ce / h_s.shape[0]
    return loss


def loss_rows(args, liger_ok):
    from glaswap.distill.losses import kd_loss
    rows = []
    autocast = DEVICE == "cuda" and not args.no_autocast
    for shape in args.batches:
        batch, seq = (int(x) for x in shape.split("x"))
        h_s, h_t, w, labels = loss_inputs(batch, seq, args.train_head)
        trained = [h_s] + ([w] if args.train_head else [])
        for ce_weight in args.ce_weights:
            # the float32 reference: the same loss on float32 copies, torch path, no autocast
            ref_in = [t.detach().float().requires_grad_(t.requires_grad) for t in (h_s, h_t, w)]
            ref_loss = kd_loss(ref_in[0], ref_in[1], ref_in[2], labels, ce_weight, args.temperature, 2048,
                               impl="torch")
            ref_grads = torch.autograd.grad(ref_loss, [t for t in ref_in if t.requires_grad])
            del ref_in
            variants = [(f"torch@{c}", "torch", c) for c in args.torch_chunks]
            variants += [(f"triton@{c}", "triton", c) for c in args.triton_chunks]
            if liger_ok:
                variants += [(f"liger@{c}", "liger", c) for c in args.liger_chunks]
                variants += [("liger-triton", "liger-triton", 0)]
            for name, impl, chunk in variants:
                def step():
                    for t in trained:
                        t.grad = None
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast and impl != "liger-triton"):
                        if impl == "liger-triton":
                            loss = liger_triton_kd(h_s, h_t, w, labels, ce_weight, args.temperature)
                        elif impl == "liger":
                            loss = liger_kd(h_s, h_t, w, labels, ce_weight, args.temperature, chunk)
                        else:
                            loss = kd_loss(h_s, h_t, w, labels, ce_weight, args.temperature, chunk, impl=impl)
                    loss.backward()
                    return loss

                try:
                    loss = step()  # compiles where it compiles; also the values checked
                except Exception as e:  # one failing variant (out of memory, an op refused) leaves the rest
                    why = f"{type(e).__name__}: {str(e).splitlines()[0]}"
                    print(f"{shape:>8} {ce_weight:4g} {name:>12} | failed: {why}", flush=True)
                    torch.cuda.empty_cache()
                    continue
                grads = [t.grad.clone() for t in trained]
                row = {"batch": shape, "ce_weight": ce_weight, "impl": name,
                       "loss": loss.item(), "loss_rel_err": rel(loss.detach(), ref_loss.detach()),
                       "grad_h_rel_err": rel(grads[0], ref_grads[0])}
                if args.train_head:
                    row["grad_w_rel_err"] = rel(grads[1], ref_grads[1])
                row["ms"] = time_ms(step, args.warmup, args.reps)
                row["peak_gib"] = peak_gib(step, trained)
                rows.append(row)
                print_loss_row(row, rows)
            del ref_loss, ref_grads
        del h_s, h_t, w, labels
        torch.cuda.empty_cache()
    return rows


def print_loss_row(row, rows):
    base = next((r for r in rows if r["batch"] == row["batch"] and r["ce_weight"] == row["ce_weight"]), row)
    head = f" {row['grad_w_rel_err']:9.2e}" if "grad_w_rel_err" in row else ""
    # bf16 logits alone put a few percent of error into the gradient when student and teacher
    # are close; a row is as good as the first (torch) row when its errors are no worse
    slack = {"loss_rel_err": 1e-4, "grad_h_rel_err": 1e-3, "grad_w_rel_err": 1e-3}
    ok = all(row[k] <= 1.5 * base[k] + slack[k] for k in slack if k in row)
    print(f"{row['batch']:>8} {row['ce_weight']:4g} {row['impl']:>12} | {row['ms']:8.2f} {base['ms'] / row['ms']:6.2f}x"
          f" {row['peak_gib']:7.2f} | {row['loss']:10.5f} {row['loss_rel_err']:9.2e} {row['grad_h_rel_err']:9.2e}"
          f"{head} {'as torch' if ok else 'WORSE'}", flush=True)


# ----------------------------------------------------------------------------- RMSNorm, SwiGLU
def rms_norm_torch(x, w):
    """Llama's RMSNorm as transformers computes it: in float32, cast back, then the weight."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_EPS)).to(x.dtype)


def swiglu_torch(a, b):
    return F.silu(a) * b


def layer_rows(args):
    from liger_kernel.transformers.functional import liger_rms_norm, liger_swiglu
    n = max(int(b) * int(s) for b, s in (x.split("x") for x in args.batches))
    g = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(n, HIDDEN, device=DEVICE, generator=g).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(HIDDEN, device=DEVICE, generator=g)).bfloat16()  # frozen, as under LoRA
    a = torch.randn(n, INTERMEDIATE, device=DEVICE, generator=g).bfloat16().requires_grad_()
    b = torch.randn(n, INTERMEDIATE, device=DEVICE, generator=g).bfloat16().requires_grad_()
    ops = {
        f"RMSNorm [{n}, {HIDDEN}]": ((x,), (w,), rms_norm_torch,
                                     lambda x, w: liger_rms_norm(x, w, RMS_EPS, in_place=False)),
        f"SwiGLU [{n}, {INTERMEDIATE}]": ((a, b), (), swiglu_torch, liger_swiglu),
    }
    rows = []
    for op, (inputs, fixed, torch_fn, liger_fn) in ops.items():
        dy = torch.randn(n, inputs[0].shape[1], device=DEVICE, generator=g).bfloat16()
        ref_in = [t.detach().float().requires_grad_() for t in inputs]
        ref_out = torch_fn(*ref_in, *[t.float() for t in fixed])
        ref_grads = torch.autograd.grad(ref_out, ref_in, dy.float())
        impls = [("torch", torch_fn), ("liger", liger_fn)]
        if DEVICE == "cuda":  # inductor on the CPU needs a C++ compiler: the dry run leaves it out
            impls.insert(1, ("torch.compile", torch.compile(torch_fn)))
        for name, fn in impls:
            def step():
                for t in inputs:
                    t.grad = None
                out = fn(*inputs, *fixed)
                out.backward(dy)
                return out
            try:
                out = step()
            except Exception as e:  # e.g. a kernel the Triton interpreter cannot run (--dry-run)
                print(f"{op:>22} {name:>13} | failed: {type(e).__name__}: {str(e).splitlines()[0]}", flush=True)
                continue
            errs = [rel(out.detach(), ref_out.detach())] + [rel(t.grad, r) for t, r in zip(inputs, ref_grads)]
            row = {"op": op, "impl": name, "ms": time_ms(step, args.warmup, 4 * args.reps), "max_rel_err": max(errs)}
            rows.append(row)
            base = next(r for r in rows if r["op"] == op)
            print(f"{op:>22} {name:>13} | {row['ms']:8.3f} {base['ms'] / row['ms']:6.2f}x | {row['max_rel_err']:9.2e}",
                  flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=lambda s: s.split(","), default=["8x2048", "1x16384"],
                    help="BxT shapes, comma-separated (default 8x2048,1x16384)")
    ap.add_argument("--ce-weights", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.5])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--torch-chunks", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 8192])
    ap.add_argument("--triton-chunks", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 4096, 8192])
    ap.add_argument("--liger-chunks", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096])
    ap.add_argument("--train-head", action="store_true", help="the head trains too (its gradient checked and timed)")
    ap.add_argument("--no-autocast", action="store_true")
    ap.add_argument("--no-layers", action="store_true", help="skip RMSNorm and SwiGLU")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes, Triton interpreter: tests the script")
    args = ap.parse_args(argv)
    if args.dry_run:
        global DEVICE, HIDDEN, VOCAB, INTERMEDIATE
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before liger-kernel defines its kernels
        DEVICE, HIDDEN, VOCAB, INTERMEDIATE = "cpu", 64, 1000, 256
        args.batches, args.torch_chunks, args.liger_chunks = ["2x64"], [32, 64], [32]
        args.triton_chunks = [48]
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return 2
    try:
        import liger_kernel  # noqa: F401  (optional: the comparison rows)
        why = None
    except Exception as e:
        why = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    import triton
    versions = f"torch {torch.__version__}, triton {triton.__version__}"
    if why:
        print(f"# liger-kernel does not import ({why}): torch rows only", flush=True)
    else:
        import importlib.metadata
        versions += f", liger-kernel {importlib.metadata.version('liger-kernel')}"
    device_name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (dry run)"
    print(f"# {device_name}, {versions}; hidden {HIDDEN}, vocabulary {VOCAB}, bf16, "
          f"T={args.temperature:g}, autocast {'bf16' if DEVICE == 'cuda' and not args.no_autocast else 'off'}")
    print("# ms: forward+backward median; x: the first row's ms / this row's; peak: GiB above the inputs;"
          " errors against float32; 'as torch': errors no worse than the first row's")
    head = " grad_w err" if args.train_head else ""
    print(f"{'batch':>8} {'ce':>4} {'impl':>12} | {'ms':>8} {'x':>7} {'peak':>7} | {'loss':>10} {'loss err':>9}"
          f" {'grad_h err':>9}{head}")
    # liger's chunks compile once per chunk shape and weights, each static (as in a training run,
    # which has one of each): no dynamic-shape recompile, and room for every variant here
    torch._dynamo.config.automatic_dynamic_shapes = False
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    result = {"device": device_name, "versions": versions, "loss": loss_rows(args, not why)}
    if not args.no_layers and not why:
        print(f"\n{'op':>22} {'impl':>13} | {'f+b ms':>8} {'x':>7} | {'max err':>9}")
        result["layers"] = layer_rows(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
