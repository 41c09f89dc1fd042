"""Benchmark glaswap's GLA Triton kernels against SDPA flash attention (and optionally fla).

Prints one table: for each shape, forward and forward+backward median times (ms) of
glaswap's fused_chunk_gla and of torch SDPA (flash backend, causal), the ratio SDPA/glaswap
(> 1: glaswap is faster) and the fraction of the memory-traffic floor that glaswap reaches.
Before timing, every shape is checked in bf16 against the float32 chunked PyTorch form
(relative RMS of o, dq, dk, dv, dg) and marked pass/fail.

    python benchmarks/bench_kernels.py                 # full table
    python benchmarks/bench_kernels.py --quick         # 4 shapes, fewer repetitions
    python benchmarks/bench_kernels.py --only glaswap --json out.json
    python benchmarks/bench_kernels.py --set warps_g=4 --set BK_g=64   # tuning overrides
    python benchmarks/bench_kernels.py --compare-fla DIR012:fused_chunk_gla --compare-fla DIR060
    python benchmarks/bench_kernels.py --ptxas-report  # no GPU: registers/spills per kernel

--compare-fla DIR[:FUNCTION] (repeatable): DIR holds an unpacked `flash-linear-attention==0.1.2`
(use FUNCTION fused_chunk_gla: the seed's algorithm) or `fla-core==0.6.0` (chunk_gla, the
default), e.g. `pip install --no-deps --target DIR fla-core==0.6.0` plus einops. Each is
imported in its own subprocess with DIR first on sys.path, so it never mixes with glaswap.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
DRY_RUN_BYTES_PER_S = 4.3e12      # the floor's bandwidth in a --dry-run (no GPU to measure)
DRY_RUN = False                   # --dry-run: CPU, Triton interpreter, tiny shapes
FLA_TIMEOUT = 900                 # seconds per fla release (--fla-timeout)
# The fwd+bwd ms, bf16 on one H200, of the fused-chunk kernel glaswap's kernels started from:
# the speed target is a third of these. Quoted figures, not measured by this script.
SEED_FB_MS = {"8x2048 H32 D64": 3.39, "4x4096 H32 D64": 3.93, "2x8192 H32 D64": 5.01,
              "1x16384 H32 D64": 7.24, "8x2048 H16 D128": 3.53, "4x4096 H16 D128": 4.03,
              "2x8192 H16 D128": 5.14, "1x16384 H16 D128": 7.43}


# Launch-rule overrides for tuning runs (--set KEY=VALUE): handed to every fused_chunk_gla
# call through its private `_overrides` keyword (an attribute of gla.launch.LaunchConfig each).
OVERRIDES: dict = {}


def kernel_modules(*names):
    """glaswap_kernels' modules `names`; without glaswap installed, this checkout's
    glaswap_kernels/ loaded as the package."""
    import importlib
    try:
        import glaswap_kernels  # noqa: F401
    except ImportError:
        import importlib.util
        root = os.path.join(os.path.dirname(HERE), "glaswap_kernels")
        spec = importlib.util.spec_from_file_location(
            "glaswap_kernels", os.path.join(root, "__init__.py"), submodule_search_locations=[root])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules["glaswap_kernels"] = pkg
        spec.loader.exec_module(pkg)
    return tuple(importlib.import_module(f"glaswap_kernels.{n}") for n in names)


def _import_kernels():
    return kernel_modules("gla.reference", "gla.chunk")


# ----------------------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------------------

def shapes(quick: bool):
    """Dicts with B, T, H, Hkv, K, V, seqs (document lengths for packed varlen, or None)."""
    if DRY_RUN:                   # tiny shapes to exercise this script on CPU
        return [dict(name="1x100 H2 D16", B=1, T=100, H=2, Hkv=2, K=16, V=16, seqs=None),
                dict(name="1x100 H4/kv2 K16 V17 varlen", B=1, T=100, H=4, Hkv=2, K=16, V=17,
                     seqs=[60, 1, 39]),
                dict(name="1x100 H4/kv2 D16 +norm", B=1, T=100, H=4, Hkv=2, K=16, V=16,
                     seqs=None, norm=True)]
    out = []
    bts = [(8, 2048), (1, 16384)] if quick else [(8, 2048), (4, 4096), (2, 8192), (1, 16384)]
    for H, D in [(32, 64), (16, 128)]:
        for B, T in bts:
            out.append(dict(name=f"{B}x{T} H{H} D{D}", B=B, T=T, H=H, Hkv=H, K=D, V=D, seqs=None))
    if quick:
        return out
    for B, T in [(8, 2048), (1, 16384)]:
        out.append(dict(name=f"{B}x{T} H32/kv8 D64 gqa", B=B, T=T, H=32, Hkv=8, K=64, V=64,
                        seqs=None))
    docs = [4096, 1000, 3000, 31, 2048, 5000, 1, 1208]            # 8 documents, 16384 tokens
    out.append(dict(name="1x16384 H32 D64 varlen8", B=1, T=16384, H=32, Hkv=32, K=64, V=64,
                    seqs=docs))
    out.append(dict(name="8x2048 H32 K64 V65", B=8, T=2048, H=32, Hkv=32, K=64, V=65, seqs=None))
    # the normaliser computed in the kernels instead of a 65th column of ones (same output)
    out.append(dict(name="8x2048 H32 D64 +norm", B=8, T=2048, H=32, Hkv=32, K=64, V=64,
                    seqs=None, norm=True))
    out.append(dict(name="1x16384 H32/kv8 D64 +norm", B=1, T=16384, H=32, Hkv=8, K=64, V=64,
                    seqs=None, norm=True))
    return out


def copy_bandwidth(device) -> float:
    """This device's memory bandwidth in bytes per second, as a large device-to-device copy
    reaches it (bytes read + bytes written over the median time): the floor's rate, measured
    rather than assumed, since devices differ (an H100 SXM reads 3.35 TB/s, an H200 4.8)."""
    if device != "cuda":
        return DRY_RUN_BYTES_PER_S
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / (ms * 1e-3)


def floor_bytes(s, backward: bool) -> int:
    """Bytes a perfect kernel must move in bf16: forward reads q, k, v, g and writes o;
    backward reads q, k, v, g, do and writes dq, dk, dv, dg."""
    n = s["B"] * s["T"]
    q = n * s["H"] * s["K"]
    k = g = n * s["Hkv"] * s["K"]
    v = n * s["Hkv"] * s["V"]
    o = n * s["H"] * (s["V"] + s.get("norm", False))
    fwd = q + k + v + g + o
    bwd = (q + k + v + g + o) + (q + k + v + g)
    return 2 * (fwd + (bwd if backward else 0))


def gates_like(kind, shape, device, gen):
    """Per-step log-decays. seed: the seed benchmark's logsigmoid(N(0,1)) / 16 (weak: every
    chunk takes the one-matmul path); steep: logsigmoid(N(0,1)), 40% of steps keep less than
    0.37 of the state. trained: what distillation learns (SmolLM2's stage 1
    slowed 2.5x as its gates formed): 40% of channels keep 0.14-0.5 of their state a step,
    2^-80..2^-160 lost over a 64-token chunk (past an anchor at the chunk's start, within the
    midpoint anchor's reach: gla_scores)."""
    if kind == "seed":
        return F.logsigmoid(torch.randn(shape, device=device, generator=gen)) / 16
    if kind == "steep":       # steep gates: logsigmoid(N(0,1)) on every channel
        return F.logsigmoid(torch.randn(shape, device=device, generator=gen))
    if kind == "trained":
        strong = torch.rand(shape[-1], device=device, generator=gen) < 0.4
        fast = -0.7 - 1.3 * torch.rand(shape, device=device, generator=gen)
        return torch.where(strong, fast, F.logsigmoid(torch.randn(shape, device=device, generator=gen) + 1.0))
    raise ValueError(f"unknown gates {kind!r}")


def make_inputs(s, n_sets, device, dtype=torch.bfloat16, seed=0):
    """n_sets independent input sets (timing rotates through them so L2 does not flatter)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    sets = []
    for _ in range(n_sets):
        B, T, H, Hkv, K, V = (s[x] for x in ("B", "T", "H", "Hkv", "K", "V"))
        q = torch.randn(B, T, H, K, device=device, generator=gen).to(dtype)
        k = torch.randn(B, T, Hkv, K, device=device, generator=gen).to(dtype)
        v = torch.randn(B, T, Hkv, V, device=device, generator=gen).to(dtype)
        g = gates_like(s.get("gates", "seed"), (B, T, Hkv, K), device, gen).to(dtype)
        do = torch.randn(B, T, H, V + s.get("norm", False), device=device, generator=gen).to(dtype)
        sets.append((q, k, v, g, do))
    cu = None
    if s["seqs"] is not None:
        bounds = [0]
        for n in s["seqs"]:
            bounds.append(bounds[-1] + n)
        cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    return sets, cu


# ----------------------------------------------------------------------------------------
# Correctness
# ----------------------------------------------------------------------------------------

def rel(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def check(s, gla_torch, gla_triton, device, tol=2e-2):
    """bf16 kernels vs the float32 chunked torch form on the same bf16 values."""
    sets, cu = make_inputs(s, 1, device, seed=123)
    (q, k, v, g, do), = sets
    xs = [x.clone().requires_grad_() for x in (q, k, v, g)]
    rs = [x.float().requires_grad_() for x in (q, k, v, g)]
    norm = s.get("norm", False)
    o, _ = gla_triton.fused_chunk_gla(*xs, cu_seqlens=cu, normalizer=norm, _overrides=OVERRIDES)
    q_r, k_r, v_r, g_r = rs
    if norm:                                  # the reference: a real column of ones
        v_r = torch.cat([v_r, torch.ones_like(v_r[..., :1])], dim=-1)
    o_r, _ = gla_torch.chunk_gla_torch(q_r, k_r, v_r, g_r, cu_seqlens=cu)
    grads = torch.autograd.grad(o, xs, do)
    grads_r = torch.autograd.grad(o_r, rs, do.float())
    errs = {"o": rel(o, o_r)}
    for name, a, b in zip(("dq", "dk", "dv", "dg"), grads, grads_r):
        errs[name] = rel(a, b)
    ok = all(e <= tol for e in errs.values())                # NaN fails too
    return ok, errs


# ----------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------

def bench(fn, quick):
    if DRY_RUN:
        import time
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100,
                                   return_mode="median")


def _rotating(sets):
    """Three input sets in turn, so that L2 does not hold the last call's inputs."""
    state = {"i": 0}

    def nxt():
        state["i"] = (state["i"] + 1) % len(sets)
        return sets[state["i"]]
    return nxt


def time_glaswap(s, gla_triton, device, quick):
    norm = s.get("norm", False)
    sets, cu = make_inputs(s, 3, device)
    grad_sets = [tuple(x.clone().requires_grad_() for x in st[:4]) + (st[4],) for st in sets]
    nxt_f, nxt_b = _rotating(sets), _rotating(grad_sets)

    def fwd():
        q, k, v, g, _ = nxt_f()
        with torch.no_grad():
            gla_triton.fused_chunk_gla(q, k, v, g, cu_seqlens=cu, normalizer=norm,
                                       _overrides=OVERRIDES)

    def fwd_bwd():
        q, k, v, g, do = nxt_b()
        o, _ = gla_triton.fused_chunk_gla(q, k, v, g, cu_seqlens=cu, normalizer=norm,
                                          _overrides=OVERRIDES)
        torch.autograd.grad(o, (q, k, v, g), do)

    return bench(fwd, quick), bench(fwd_bwd, quick)


def time_sdpa(s, device, quick):
    """Causal flash attention on [B, H, T, D]; None where it does not apply."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = SDPBackend.MATH if DRY_RUN else SDPBackend.FLASH_ATTENTION
    if s["seqs"] is not None or s["K"] != s["V"] or s.get("norm"):
        return None, None             # packed documents / V != K: no like-for-like SDPA call
    B, T, H, Hkv, D = s["B"], s["T"], s["H"], s["Hkv"], s["K"]
    gen = torch.Generator(device=device).manual_seed(0)
    sets = []
    for _ in range(3):
        q = torch.randn(B, H, T, D, device=device, generator=gen, dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, T, D, device=device, generator=gen, dtype=torch.bfloat16)
        v = torch.randn(B, Hkv, T, D, device=device, generator=gen, dtype=torch.bfloat16)
        do = torch.randn(B, H, T, D, device=device, generator=gen, dtype=torch.bfloat16)
        sets.append((q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do))
    nxt = _rotating(sets)
    gqa = dict(enable_gqa=True) if Hkv != H else {}

    def fwd():
        q, k, v, _ = nxt()
        with torch.no_grad(), sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)

    def fwd_bwd():
        q, k, v, do = nxt()
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        torch.autograd.grad(o, (q, k, v), do)

    try:
        return bench(fwd, quick), bench(fwd_bwd, quick)
    except RuntimeError as err:       # e.g. no flash kernel for GQA on this torch
        print(f"  sdpa {s['name']}: {str(err).splitlines()[0][:100]}", file=sys.stderr)
        return None, None


# ----------------------------------------------------------------------------------------
# fla, in a subprocess
# ----------------------------------------------------------------------------------------

def _import_fla(fla_dir):
    """fla's ops without fla/__init__.py: that file imports fla's layers and models, which
    need transformers/datasets versions the benchmark machine may not have."""
    import re
    import types
    sys.path.insert(0, fla_dir)
    root = os.path.join(fla_dir, "fla")
    with open(os.path.join(root, "__init__.py")) as f:
        m = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", f.read())
    pkg = types.ModuleType("fla")
    pkg.__path__ = [root]
    pkg.__version__ = m.group(1) if m else "?"
    sys.modules["fla"] = pkg
    import fla.ops.gla as fla_gla
    return fla_gla, pkg.__version__


def with_gates(shape_list, kinds):
    """Every shape once per gate regime (named with the regime unless it is seed)."""
    return [dict(base, gates=kind, name=base["name"] + ("" if kind == "seed" else f" [{kind}]"))
            for base in shape_list for kind in kinds]


def fla_worker(spec, quick, kinds=("seed",), match=None):
    """Runs in the subprocess: times fla's GLA at every shape and gate regime (those whose
    name contains one of `match`, if given), prints one JSON line per shape.
    spec = DIR or DIR:FUNCTION (default chunk_gla, else fused_chunk_gla)."""
    import inspect
    fla_dir, _, label = spec.partition(":")
    fla_gla, version = _import_fla(fla_dir)
    label = label or ("chunk_gla" if hasattr(fla_gla, "chunk_gla") else "fused_chunk_gla")
    fn = getattr(fla_gla, label)
    params = inspect.signature(fn).parameters
    # Releases with a head_first argument are called in their native [B, H, T, D] layout
    # (head_first=False padded the wrong axis in 0.1.x); newer ones take [B, T, H, D].
    head_first = "head_first" in params
    extra = {"head_first": True} if head_first else {}
    device = "cpu" if DRY_RUN else "cuda"
    results = {}
    for s in with_gates(shapes(quick), kinds):
        key = s["name"]
        if match and not any(m in key for m in match):
            continue
        if (s["Hkv"] != s["H"] or s.get("norm")
                or (s["seqs"] is not None and (head_first or "cu_seqlens" not in params))):
            results[key] = None
            continue
        try:
            sets, cu = make_inputs(s, 3, device)
            if head_first:
                sets = [tuple(x.transpose(1, 2).contiguous() for x in st) for st in sets]
            grad_sets = [tuple(x.clone().requires_grad_() for x in st[:4]) + (st[4],)
                         for st in sets]
            kw = dict(extra)
            if cu is not None:
                kw["cu_seqlens"] = cu.long()
            nxt_f, nxt_b = _rotating(sets), _rotating(grad_sets)

            def fwd():
                q, k, v, g, _ = nxt_f()
                with torch.no_grad():
                    fn(q, k, v, g, **kw)

            def fwd_bwd():
                q, k, v, g, do = nxt_b()
                o = fn(q, k, v, g, **kw)[0]
                torch.autograd.grad(o, (q, k, v, g), do)

            results[key] = (bench(fwd, quick), bench(fwd_bwd, quick))
        except Exception as err:  # noqa: BLE001 - report and go on with the other shapes
            print(f"  fla {key}: {type(err).__name__}: {str(err)[:120]}", file=sys.stderr)
            results[key] = None
        # one line per shape, so that a run cut short by the timeout still reports
        print("FLA_JSON " + json.dumps({"label": f"fla {version} {label}", "results": results}),
              flush=True)


def run_fla(fla_dir, quick, kinds=("seed",), match=None):
    cmd = [sys.executable, os.path.abspath(__file__), "--_fla-worker", fla_dir,
           "--gates", ",".join(kinds)]
    for m in match or []:
        cmd += ["--match", m]
    fla_dir = fla_dir.partition(":")[0]
    if quick:
        cmd.append("--quick")
    if DRY_RUN:
        cmd.append("--dry-run")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([fla_dir, os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=FLA_TIMEOUT)
        out, err, status = proc.stdout, proc.stderr, f"exit {proc.returncode}"
    except subprocess.TimeoutExpired as exc:      # keep the shapes it finished
        out, err, status = exc.stdout or "", exc.stderr or "", f"timed out after {FLA_TIMEOUT} s"
        out, err = (x.decode() if isinstance(x, bytes) else x for x in (out, err))
    sys.stderr.write(err[-3000:])
    last = None
    for line in out.splitlines():
        if line.startswith("FLA_JSON "):
            last = json.loads(line[len("FLA_JSON "):])
    if last is None or status != "exit 0":
        print(f"fla comparison {fla_dir}: {status}; {len(last['results']) if last else 0} "
              f"shapes measured", file=sys.stderr)
    return last


# ----------------------------------------------------------------------------------------
# Compile report: every kernel compiled for a GPU target without a GPU (registers, spills)
# ----------------------------------------------------------------------------------------

def ptxas_report(overrides=None):
    """The compile report of tests/gla_compile_report.py (every kernel launch compiled for
    sm_90 without a GPU: registers, spills, shared memory), on its default cases."""
    import importlib.util
    path = os.path.join(os.path.dirname(HERE), "tests", "gla_compile_report.py")
    spec = importlib.util.spec_from_file_location("gla_compile_report", path)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    _import_kernels()
    return report.ptxas_report(overrides=overrides)


# ----------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------

def bench_device(dry_run: bool):
    """"cpu" under --dry-run (the Triton interpreter, with the tests' bf16 fix), "cuda", or None
    (said on stderr) without a GPU."""
    if dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        # the tests' conftest fixes the interpreter's bf16 arithmetic; reuse it
        import importlib.util
        spec = importlib.util.spec_from_file_location(
            "_glaswap_test_conftest", os.path.join(os.path.dirname(HERE), "tests", "conftest.py"))
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
        return "cpu"
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (or --dry-run)", file=sys.stderr)
        return None
    return "cuda"


def _parse_sets(items):
    out = {}
    for item in items or []:
        key, _, value = item.partition("=")
        try:
            out[key] = int(value)
        except ValueError:
            out[key] = value
    return out


def _fmt(x, spec="7.3f"):
    return f"{x:{spec}}" if x is not None else " " * (int(spec.split(".")[0]) - 3) + "n/a"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["glaswap", "sdpa"])
    ap.add_argument("--quick", action="store_true", help="4 shapes, fewer repetitions")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--compare-fla", metavar="DIR[:FN]", action="append",
                    help="folder with an unpacked fla release (repeatable)")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="override a launch rule's choice: an attribute of gla.launch.LaunchConfig "
                         "(tuning), passed as fused_chunk_gla(..., _overrides=...)")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness checks")
    ap.add_argument("--dry-run", action="store_true",
                    help="test this script on CPU (Triton interpreter, tiny shapes, rough timer)")
    ap.add_argument("--ptxas-report", action="store_true",
                    help="no GPU needed: compile every kernel for sm_90, print registers/spills")
    ap.add_argument("--fla-timeout", type=int, default=900, help="seconds per fla release")
    ap.add_argument("--match", action="append", metavar="TEXT",
                    help="only the shapes whose name contains TEXT (repeatable)")
    ap.add_argument("--gates", default="seed",
                    help="comma-separated gate regimes, each a set of rows: seed (weak decays, the "
                         "seed benchmark's), trained (strong channels, as distillation learns) "
                         "and/or steep (logsigmoid(N(0,1)) everywhere)")
    ap.add_argument("--_fla-worker", dest="fla_worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    global DRY_RUN, FLA_TIMEOUT
    DRY_RUN = args.dry_run
    FLA_TIMEOUT = args.fla_timeout
    if args.ptxas_report:
        OVERRIDES.update(_parse_sets(args.set))
        rows = ptxas_report(overrides=OVERRIDES)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return 0

    kinds = args.gates.split(",")
    if args.fla_worker:
        fla_worker(args.fla_worker, args.quick, kinds, args.match)
        return 0
    device = bench_device(DRY_RUN)
    if device is None:
        return 2
    gla_torch, gla_triton = _import_kernels()
    OVERRIDES.update(_parse_sets(args.set))
    import triton
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    bandwidth = copy_bandwidth(device)
    print(f"# {device_name} | torch {torch.__version__} | triton "
          f"{triton.__version__} | overrides {OVERRIDES or '-'} | copy bandwidth {bandwidth / 1e12:.2f} TB/s")

    flas = [r for r in (run_fla(spec, args.quick, kinds, args.match) for spec in args.compare_fla or [])
            if r]
    if not args.compare_fla:
        print("# fla comparison skipped (no --compare-fla DIR given)")

    rows = []
    for s in with_gates(shapes(args.quick), kinds):
        if args.match and not any(m in s["name"] for m in args.match):
            continue
        row = {"shape": s["name"], "floor_fwd_ms": floor_bytes(s, False) / bandwidth * 1e3,
               "floor_fb_ms": floor_bytes(s, True) / bandwidth * 1e3}
        if args.only != "sdpa":
            if not args.no_check:
                ok, errs = check(s, gla_torch, gla_triton, device)
                row["check"] = "pass" if ok else "FAIL"
                row["errors"] = errs
                if not ok:
                    print(f"  CHECK FAILED {s['name']}: {errs}", file=sys.stderr)
            row["glaswap_fwd"], row["glaswap_fb"] = time_glaswap(s, gla_triton, device, args.quick)
        if args.only != "glaswap":
            row["sdpa_fwd"], row["sdpa_fb"] = time_sdpa(s, device, args.quick)
        for i, fla in enumerate(flas):
            r = fla["results"].get(s["name"])
            row[f"fla{i}_fwd"], row[f"fla{i}_fb"] = r if r else (None, None)
        rows.append(row)
        torch.cuda.empty_cache()

    # One table.
    head = (f"{'shape':38s} {'check':5s} | {'gla fwd':>7s} {'gla f+b':>7s} | {'sdpa fwd':>8s} "
            f"{'sdpa f+b':>8s} | {'x sdpa f':>8s} {'x sdpa fb':>9s} | {'floor f':>7s} {'floor fb':>8s}"
            f" | {'x seed':>6s}")
    for i, _ in enumerate(flas):
        head += f" | {f'fla{i} fwd':>8s} {f'fla{i} f+b':>8s} {'x fla':>6s}"
    print(head)
    print("-" * len(head))
    for r in rows:
        gf, gb = r.get("glaswap_fwd"), r.get("glaswap_fb")
        sf, sb = r.get("sdpa_fwd"), r.get("sdpa_fb")
        ratio_f = sf / gf if gf and sf else None
        ratio_b = sb / gb if gb and sb else None
        frac_f = r["floor_fwd_ms"] / gf if gf else None
        frac_b = r["floor_fb_ms"] / gb if gb else None
        line = (f"{r['shape']:38s} {r.get('check', '-'):5s} | {_fmt(gf)} {_fmt(gb)} | "
                f"{_fmt(sf, '8.3f')} {_fmt(sb, '8.3f')} | {_fmt(ratio_f, '8.2f')} "
                f"{_fmt(ratio_b, '9.2f')} | {_fmt(frac_f, '7.0%')} {_fmt(frac_b, '8.0%')}"
                f" | {_fmt(SEED_FB_MS[r['shape']] / gb if gb and r['shape'] in SEED_FB_MS else None, '6.2f')}")
        for i, _ in enumerate(flas):
            ff, fb = r.get(f"fla{i}_fwd"), r.get(f"fla{i}_fb")
            line += (f" | {_fmt(ff, '8.3f')} {_fmt(fb, '8.3f')} "
                     f"{_fmt(fb / gb if fb and gb else None, '6.2f')}")
        print(line)
    print("# times: median ms (triton.testing.do_bench, 3 rotating input sets); x sdpa = SDPA "
          "time / glaswap time; floor = memory-traffic floor at the "
          f"measured copy bandwidth ({bandwidth / 1e12:.2f} TB/s) / glaswap time; "
          "x seed = the seed README's f+b ms (H200) / glaswap f+b (target >= 3)")
    for i, fla in enumerate(flas):
        print(f"# fla{i} columns: {fla['label']}; x fla = fla f+b / glaswap f+b")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device_name, "copy_bytes_per_s": bandwidth, "torch": torch.__version__,
                       "triton": triton.__version__, "overrides": OVERRIDES,
                       "fla": [f["label"] for f in flas], "rows": rows}, f, indent=1)
    return 0 if all(r.get("check", "pass") == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
