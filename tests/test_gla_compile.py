"""The GLA kernels compiled for Hopper (sm_90) without a GPU: Triton + ptxas on every launch
the host code makes (tests/gla_compile_report.py), which catches type and layout errors the
interpreter never sees and checks registers, spills, shared memory and load widths.

Marked `compile` (and `slow`): pyproject's default run leaves them out; run them with
`pytest -m compile tests/test_gla_compile.py`.
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
pytestmark = [pytest.mark.slow, pytest.mark.compile]
HOPPER_SMEM = 227 * 1024


def compile_report(cases, layer_cases, overrides=None, window_cases=()):
    """gla_compile_report's rows for these cases (with launch-rule overrides), from a
    subprocess: TRITON_INTERPRET must be unset there."""
    spec = json.dumps({"cases": cases, "layer_cases": layer_cases, "overrides": overrides or {},
                       "window_cases": list(window_cases)})
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    res = subprocess.run([sys.executable, os.path.join(HERE, "gla_compile_report.py"), spec],
                         capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.split("ROWS ", 1)[1])


def test_kernels_compile_for_hopper():
    """Every kernel of a few configurations builds for sm_90, ptxas assembles each, and the
    normaliser's padded rows load as 16-byte vectors."""
    cases = [("bf16", 1, 512, 4, 2, 64, 64, [100, 300, 112]),
             ("fp32", 1, 512, 4, 4, 80, 65, None),
             ("fp16", 1, 256, 2, 2, 256, 257, None),
             ("bf16", 1, 8192, 4, 2, 64, 64, [5000, 3192], True)]      # segmented, normaliser
    layer_cases = [("bf16", 128, 4, 64, True), ("fp32", 128, 2, 48, False)]   # feature map, normaliser, gate
    rows = compile_report(cases, layer_cases)
    names = {r["kernel"] for r in rows}
    assert names >= {"_chunk_gates_kernel", "_fwd_state_kernel", "_fwd_output_kernel",
                     "_bwd_dh_kernel", "_bwd_dqkg_kernel", "_bwd_dv_kernel", "_seg_combine_kernel",
                     "_seg_fixup_kernel", "_recurrent_kernel", "_fm_fwd_kernel", "_fm_bwd_kernel",
                     "_normalize_fwd_kernel", "_normalize_bwd_kernel", "_gate_fwd_kernel",
                     "_gate_bwd_kernel"}, names
    # ptxas assembled every kernel (Triton 3.9 writes PTX that only its newer bundled
    # assembler accepts; a rejected file used to leave these empty without failing)
    assert all(r["regs"] is not None for r in rows), [r for r in rows if r["regs"] is None][:2]
    # The normaliser's chunk states are rows padded to 8 values and o / do row-padded views,
    # so its tiles load as 16-byte vectors (with the odd stride V + 1 = 65 they were scalar
    # loads); what scalar loads remain are mostly index and column loads.
    for r in rows:
        if r.get("NORM") and r["kernel"] in ("_fwd_output_kernel", "_bwd_dqkg_kernel", "_bwd_dv_kernel"):
            assert r["loads_x1"] <= 32 and r["loads_x4"] >= 12, r
        if r["kernel"] in ("_seg_combine_kernel", "_seg_fixup_kernel") and r["V"] % 8 == 0:
            assert r["loads_x1"] <= 16 and r["loads_x4"] >= 8, r


def test_pipelined_chunk_kernels_fit_hopper_shared_memory():
    """bf16 chunk kernels run their tile loops in 3 pipeline stages, which multiplies their
    shared memory: at the largest head dims, with grouped queries and the normaliser, every
    launch must stay within sm_90's 227 KB a program, or it would fail on the GPU with "out
    of resources" (the interpreter never sees this)."""
    cases = [("bf16", 1, 256, 2, 2, 256, 256, None, True),
             ("bf16", 1, 256, 4, 2, 256, 256, None),
             ("bf16", 1, 256, 6, 3, 128, 64, None, True)]
    rows = compile_report(cases, [])
    chunk = [r for r in rows if r["kernel"] in ("_fwd_output_kernel", "_bwd_dqkg_kernel", "_bwd_dv_kernel")]
    assert chunk and all(r["num_stages"] == 3 for r in chunk), chunk
    assert max(r["smem"] for r in chunk) > 100 * 1024      # the stages are really there
    assert all(r["smem"] <= HOPPER_SMEM for r in rows), [(r["kernel"], r["smem"]) for r in rows]


def test_split_dqkg_compiles_without_the_exact_path():
    """bf16 at K > 64 builds dq/dk/dg twice (PATH 1 and 2, early returns in both), and the
    one-matmul launch, which holds none of the exact path's code, spills less than the
    combined kernel (split_g off)."""
    case = [("bf16", 1, 256, 2, 2, 128, 128, None)]
    split = {r["PATH"]: r for r in compile_report(case, []) if r["kernel"] == "_bwd_dqkg_kernel"}
    whole = [r for r in compile_report(case, [], {"split_g": 0}) if r["kernel"] == "_bwd_dqkg_kernel"]
    assert set(split) == {1, 2} and all(r["regs"] is not None for r in split.values()), split
    assert [r["PATH"] for r in whole] == [0], whole
    assert split[1]["spill_bytes"] < whole[0]["spill_bytes"], (split, whole)


def test_dv_all_v_compiles_for_hopper():
    """The dv kernel over all V tiles (one program per chunk over both V tiles of 64) builds
    for sm_90 at D128; by default bf16 D128 reads the forward's scores and takes V = 128 in
    one tile instead."""
    case = [("bf16", 1, 256, 2, 2, 128, 128, None)]
    dv = [r for r in compile_report(case, [], {"BV_dv": 64}) if r["kernel"] == "_bwd_dv_kernel"]
    assert dv and dv[0]["ALL_V"] == 2 and dv[0]["grid"].startswith("(1,"), dv
    assert dv[0]["regs"] is not None, dv
    dv = [r for r in compile_report(case, [], {}) if r["kernel"] == "_bwd_dv_kernel"]
    assert dv and dv[0]["ALL_V"] == 0 and dv[0]["grid"].startswith("(1,"), dv
    assert dv[0]["LOAD_P"] == 1 and dv[0]["regs"] is not None, dv


def test_hybrid_kernels_compile_for_hopper():
    """The hybrid layer's kernels (the window op with and without split sink operands, the
    mix, RoPE) build for sm_90 at the recipes' head dims and at D 80 in float32, ptxas
    assembles each without spilling, and each fits a program's shared memory."""
    cases = [("bf16", 1, 512, 8, 2, 64, 128, 4, True), ("bf16", 1, 512, 8, 2, 64, 64, 0, False),
             ("bf16", 1, 512, 4, 4, 128, 128, 4, True), ("fp32", 1, 256, 4, 2, 80, 16, 4, False),
             ("fp32", 1, 256, 4, 2, 64, 16, 4, True), ("fp32", 1, 256, 4, 2, 64, 16, 4, False)]
    rows = compile_report([], [], window_cases=cases)
    names = {r["kernel"] for r in rows}
    assert names == {"_window_fwd_kernel", "_window_bwd_dq_kernel", "_window_bwd_dkv_kernel",
                     "_mix_fwd_kernel", "_mix_bwd_kernel", "_rope_kernel"}, names
    assert {r.get("SPLIT") for r in rows if r["kernel"] == "_window_bwd_dq_kernel"} == {True, False}
    assert all(r["regs"] is not None and r["spill_bytes"] == 0 for r in rows), \
        [(r["kernel"], r["regs"], r["spill_bytes"]) for r in rows]
    assert all(r["smem"] <= HOPPER_SMEM for r in rows), [(r["kernel"], r["smem"]) for r in rows]
