"""Compiles every kernel launch of the GLA kernels for a GPU target without a GPU, and reports
registers, spills, shared memory and load widths per launch (Triton + ptxas).

The host code of fused_chunk_gla (forward + backward), fused_recurrent_gla, the layer
kernels and the hybrid layer's window, mix and RoPE kernels runs on CPU tensors with every
launch recorded instead of run; each recorded launch is then compiled for sm_<arch>. Needs TRITON_INTERPRET unset (the interpreter never
compiles), so the tests run it in a subprocess:

    python tests/gla_compile_report.py '{"cases": [...], "layer_cases": [...], "overrides": {}}'

prints ROWS <json>. benchmarks/bench_kernels.py --ptxas-report prints the same table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

PTXAS_CASES = [
    # (dtype, B, T, H, Hkv, K, V, documents[, in-kernel normaliser])
    ("bf16", 2, 2048, 32, 32, 64, 64, None),
    ("bf16", 2, 2048, 16, 16, 128, 128, None),
    ("bf16", 2, 2048, 32, 8, 64, 64, None),
    ("bf16", 1, 4096, 32, 32, 64, 65, [1000, 3000, 96]),
    ("fp16", 1, 1024, 8, 4, 80, 48, None),
    ("fp32", 1, 1024, 8, 8, 256, 257, None),
    ("bf16", 1, 4096, 32, 8, 64, 64, [1000, 3000, 96], True),
    ("bf16", 2, 2048, 16, 16, 128, 128, None, True),
]


# The layer's smaller kernels: (dtype, tokens, heads, head dim, hedgehog_pm) for the feature
# map (forward, backward with dW), the normaliser and the gate at the same sizes.
PTXAS_LAYER_CASES = [
    ("bf16", 256, 32, 64, False),
    ("bf16", 256, 32, 64, True),
    ("bf16", 256, 16, 128, False),
]


# The hybrid layer's kernels: (dtype, B, T, H, Hkv, D, window, sinks, split sink operands) for
# the window op (forward, dq and dk/dv), with the mix and RoPE kernels at the same sizes.
PTXAS_WINDOW_CASES = [
    ("bf16", 2, 2048, 32, 8, 64, 128, 4, True),
    ("bf16", 2, 2048, 32, 8, 64, 128, 0, False),
    ("bf16", 2, 2048, 16, 16, 128, 128, 4, True),
    ("fp32", 1, 512, 4, 2, 80, 64, 4, False),
    ("fp32", 1, 512, 4, 2, 64, 64, 4, True),
]


class _Ctx:
    """A stand-in for autograd's ctx, to run an autograd.Function's forward and backward by hand."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def set_materialize_grads(self, value):
        pass


def ptxas_report(cases=PTXAS_CASES, arch=90, out=sys.stdout, layer_cases=PTXAS_LAYER_CASES,
                 overrides=None, window_cases=PTXAS_WINDOW_CASES):
    """Runs the host code of fused_chunk_gla (forward + backward) and fused_recurrent_gla on
    CPU tensors, and of the feature-map, normaliser and gate kernels (`layer_cases`), with
    every kernel launch recorded instead of run, compiles each recorded launch for
    sm_<arch> with Triton and ptxas, and prints registers, spills and shared memory. Needs no
    GPU and TRITON_INTERPRET unset. `overrides`: launch-rule overrides (as --set).
    `window_cases`: the window, mix and RoPE kernels of a hybrid layer. Returns the rows
    (dicts)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("the compile report needs TRITON_INTERPRET unset")
    import re
    import shutil
    import tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from glaswap_kernels import feature_map_triton, gate_triton, normalizer_triton, rope_triton, utils
    from glaswap_kernels.gla import chunk as gla_triton, launch as gla_launch, recurrent as gla_recurrent
    from glaswap_kernels.window import mix as window_mix_triton, triton as window_triton
    tdt = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
           torch.int32: "i32", torch.int64: "i64"}
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}   # the cases' names
    calls = []

    class Recorder:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((self.fn, grid, args, kwargs))

    saved = {}
    for mod in (gla_triton, gla_recurrent, feature_map_triton, normalizer_triton, gate_triton,
                window_triton, window_mix_triton, rope_triton):
        for name in dir(mod):
            obj = getattr(mod, name)
            if isinstance(obj, JITFunction) and name.endswith("_kernel"):
                saved[(mod, name)] = obj
                setattr(mod, name, Recorder(obj))
    saved_interp = gla_launch.interpreting
    gla_launch.interpreting = lambda: True           # accept CPU tensors: nothing launches
    try:
        for case in cases:
            dt, B, T, H, Hkv, K, V, docs = case[:8]
            norm = bool(case[8]) if len(case) > 8 else False
            dtype = dtypes[dt]
            N = B if docs is None else len(docs)
            q = torch.zeros(B, T, H, K, dtype=dtype)
            k = torch.zeros(B, T, Hkv, K, dtype=dtype)
            v = torch.zeros(B, T, Hkv, V, dtype=dtype)
            cu = None
            if docs is not None:
                cu = torch.tensor([0] + [sum(docs[:i + 1]) for i in range(len(docs))],
                                  dtype=torch.int32)
            h0 = torch.zeros(N, Hkv, K, V + norm)
            o, ht, hbuf, pbuf, gbuf, meta = gla_triton._forward(q, k, v, k, K ** -0.5, h0, True, cu,
                                                                None, None, None, norm,
                                                                for_grad=True, overrides=overrides)
            gla_triton._backward(q, k, v, k, K ** -0.5, hbuf, pbuf, gbuf, meta, o, ht, True)
            if docs is None and not norm:
                gla_recurrent.fused_recurrent_gla(q[:, :1], k[:, :1], v[:, :1], k[:, :1],
                                                  initial_state=h0, output_final_state=True)
        for dt, T, H, D, pm in layer_cases:
            dtype = dtypes[dt]
            x, cs = torch.zeros(1, T, H, D, dtype=dtype), torch.zeros(1, T, D)
            for fn, args, grad in (
                    (feature_map_triton._FusedFeatureMap, (x, cs, cs, torch.zeros(H, D, D), True, pm),
                     torch.zeros(1, T, H, D * (1 + pm), dtype=dtype)),
                    # o as fused_chunk_gla returns it: rows padded to 8 values
                    (normalizer_triton._Normalize,
                     (torch.zeros(1, T, H, utils.state_stride(D, True), dtype=dtype)[..., :D + 1],
                      1e-6), x),
                    (gate_triton._Gate, (x, 16.0, 1 / 2048, 1 + pm), torch.zeros(1, T, H, D * (1 + pm), dtype=dtype))):
                ctx = _Ctx()
                fn.forward(ctx, *args)
                fn.backward(ctx, grad)
        for dt, B, T, H, Hkv, D, W, S, split in window_cases:
            dtype = dtypes[dt]
            q, k = torch.zeros(B, T, H, D, dtype=dtype), torch.zeros(B, T, Hkv, D, dtype=dtype)
            plan = window_triton._Plan(T, D, S, dtype)
            ctx = _Ctx()
            o, lse = window_triton._WindowAttention.forward(ctx, q, k, k, W, S, D ** -0.5, None, plan,
                                                            q if split else None, k if split else None)
            window_triton._WindowAttention.backward(ctx, o, lse)
            o_lin = torch.zeros(B, T, H, utils.state_stride(D, True), dtype=dtype)[..., :D + 1]
            ctx = _Ctx()
            window_mix_triton._WindowMix.forward(ctx, o, lse, o_lin, torch.zeros(H), True, 1e-6)
            window_mix_triton._WindowMix.backward(ctx, o)
            ctx = _Ctx()
            cs = torch.zeros(1, T, D)
            rope_triton._Rope.forward(ctx, q, cs, cs)
            rope_triton._Rope.backward(ctx, q)
    finally:
        for (mod, name), obj in saved.items():
            setattr(mod, name, obj)
        gla_launch.interpreting = saved_interp

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = os.path.join(bin_dir, "ptxas")
    if not os.path.exists(ptxas):
        ptxas = shutil.which("ptxas")
    # Triton 3.9 without a GPU writes PTX for its newest bundled assembler (PTX 9.4, CUDA
    # 13), which the older `ptxas` beside it rejects ("Unsupported .version"): try both.
    assemblers = [a for a in (ptxas, os.path.join(bin_dir, "ptxas-blackwell"))
                  if a and os.path.exists(a)]
    target = GPUTarget("cuda", arch, 32)
    rows, seen = [], set()
    for fn, grid, args, kwargs in calls:
        signature, constexprs, attrs = {}, {}, {}
        for i, param in enumerate(fn.params):
            if param.is_constexpr:
                signature[param.name] = "constexpr"
                constexprs[param.name] = kwargs[param.name]
                continue
            value = args[i]
            if value is None or (isinstance(value, int) and value == 1):
                signature[param.name] = "constexpr"      # as Triton specialises at launch
                constexprs[param.name] = value
            elif isinstance(value, torch.Tensor):
                signature[param.name] = "*" + tdt[value.dtype]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(value, int):
                signature[param.name] = "i32" if abs(value) < 2 ** 31 else "i64"
                if value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                signature[param.name] = "fp32"
        options = {"num_warps": kwargs.get("num_warps", 4),
                   "num_stages": kwargs.get("num_stages", 3)}
        key = (fn.__name__, str(sorted(signature.items())), str(sorted(constexprs.items())),
               str(options))
        if key in seen:
            continue
        seen.add(key)
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                  options=options)
        regs = spills = None
        if assemblers:
            with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                f.write(compiled.asm["ptx"])
            for assembler in assemblers:
                res = subprocess.run([assembler, "-v", f"--gpu-name=sm_{arch}a", f.name, "-o",
                                      os.devnull], capture_output=True, text=True)
                if res.returncode == 0:
                    break
            os.unlink(f.name)
            m = re.search(r"Used (\d+) registers", res.stderr)
            regs = int(m.group(1)) if m else None
            m = re.search(r"(\d+) bytes spill stores", res.stderr)
            spills = int(m.group(1)) if m else None
        # global loads by vector width (1, 2, 4 registers): scalar loads of a tile mean its
        # rows were not provably 16-byte aligned (e.g. an odd row stride)
        ptx = compiled.asm["ptx"]
        loads = {w: len(re.findall(rf"\bld\.global(?:\.[a-z]+)*\.v{w}[.a-z0-9]*\s", ptx)) for w in (2, 4)}
        loads[1] = len(re.findall(r"\bld\.global[.a-z0-9]*\s", ptx)) - loads[2] - loads[4]
        # pipelined loops (num_stages > 1) load their tiles with asynchronous copies into
        # shared memory instead: 16, 8 or 4 bytes each
        for width, size in ((4, "0x10"), (2, "0x8"), (1, "0x4")):
            loads[width] += len(re.findall(rf"\bcp\.async\.c[ag]\.shared\.global[^;]*,\s*{size}\b", ptx))
        shown = {k: v for k, v in constexprs.items()
                 if k in ("K", "V", "BT", "BK", "BV", "R", "NK", "NV", "WITH_DV", "ALL_V", "IS_VARLEN",
                          "DOT_BF16", "NORM", "SEGMENTED", "D", "PM", "DW", "PATH", "ONE_PASS",
                          "STORE_P", "LOAD_P", "HAS_SINKS", "SPLIT", "SHARED", "BWD")}
        row = dict(kernel=fn.__name__, grid=str(grid), regs=regs, spill_bytes=spills,
                   smem=compiled.metadata.shared, loads_x1=loads[1], loads_x2=loads[2],
                   loads_x4=loads[4], **options, **shown)
        rows.append(row)
        print(f"{fn.__name__:20s} warps={options['num_warps']} stages={options['num_stages']} "
              f"regs={regs} spill={spills} smem={row['smem']:6d} "
              f"ld x1/x2/x4={loads[1]}/{loads[2]}/{loads[4]}  {shown}", file=out)
    return rows


if __name__ == "__main__":
    spec = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
    rows = ptxas_report([tuple(c) for c in spec.get("cases", PTXAS_CASES)], out=sys.stderr,
                        layer_cases=[tuple(c) for c in spec.get("layer_cases", PTXAS_LAYER_CASES)],
                        overrides=spec.get("overrides"),
                        window_cases=[tuple(c) for c in spec.get("window_cases", PTXAS_WINDOW_CASES)])
    print("ROWS", json.dumps(rows))
