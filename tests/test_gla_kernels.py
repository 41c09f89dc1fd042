"""Triton GLA kernels against the float64 token-by-token reference, at awkward shapes.

Without a GPU these run under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 and fixes its bf16 arithmetic), so shapes stay tiny: odd lengths and
T = 1, head dims 48/80/65, grouped queries, packed documents, strong and mixed decays, the
in-kernel normaliser, segmented sequential passes. Every buffer the kernels must write
starts as NaN. test_gla_gpu.py repeats the checks at real sizes on a GPU.
"""

import collections
import math

import pytest
import torch

from gla_helpers import (DEVICE, make_inputs, needs_kernels, poison_outputs,  # noqa: F401
                         interpreter_warnings, record_launches, rel, run_and_compare)
from glaswap_kernels import utils
from glaswap_kernels.gla import chunk as gla_triton, launch as gla_launch, recurrent as gla_recurrent
from glaswap_kernels.gla.reference import chunk_gla_torch, recurrent_gla_torch

fused_chunk_gla = gla_triton.fused_chunk_gla
fused_recurrent_gla = gla_recurrent.fused_recurrent_gla
pytestmark = interpreter_warnings


@needs_kernels
@pytest.mark.parametrize("T", [1, 15, 63, 64, 200])
def test_lengths(T):
    run_and_compare(B=2, T=T, H=2, Hkv=2, K=32, V=32)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtypes(dtype):
    run_and_compare(B=1, T=100, H=4, Hkv=2, K=32, V=48, dtype=dtype, gate="seed")


@needs_kernels
@pytest.mark.parametrize("K,V", [(48, 48), (80, 80), (64, 65), (16, 1)])
def test_head_dims(K, V):
    run_and_compare(B=1, T=70, H=2, Hkv=1, K=K, V=V)


@needs_kernels
@pytest.mark.parametrize("H,Hkv", [(4, 2), (6, 2), (4, 1)])
def test_gqa(H, Hkv):
    run_and_compare(B=2, T=40, H=H, Hkv=Hkv, K=32, V=32)


@needs_kernels
@pytest.mark.parametrize("h0,final", [(False, False), (True, False), (False, True)])
def test_state_options(h0, final):
    run_and_compare(B=1, T=90, H=2, Hkv=1, K=32, V=16, h0=h0, final=final)


@needs_kernels
@pytest.mark.parametrize("gate", ["strong", "weak", "mixed"])
def test_decay_regimes(gate):
    # strong: every chunk takes the exact (row by row) path; mixed: strong and weak channels
    # share a chunk; weak: nearly no decay, the factorised path at its most benign.
    run_and_compare(B=1, T=80, H=2, Hkv=1, K=32, V=32, gate=gate)


@needs_kernels
@pytest.mark.parametrize("gate", ["trained", "bursty", "strong"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_learned_strong_decays(gate, dtype):
    # chunks of 64 whose decay rules out one factorisation: 16-row blocks factorised around
    # their own first row (trained), some blocks row by row (bursty), every block row by
    # row (strong); GQA
    run_and_compare(B=1, T=150, H=4, Hkv=2, K=32, V=32, gate=gate, dtype=dtype)


@needs_kernels
@pytest.mark.parametrize("gate,chunk,path", [("trained", 64, "midpoint"), ("steep", 32, "midpoint"),
                                             ("steep", 64, "blocked")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decay_paths(gate, chunk, path, dtype):
    # the one-matmul path factorises around each channel's midpoint: chunks whose decay is past
    # an anchor at the chunk's start (2^-80) but within 2^-160 take it; steeper ones the blocked
    # path. Checked on data that lands in each regime.
    T = 2 * chunk
    (_, _, _, g), *_ = make_inputs(1, T, 4, 2, 32, 32, gate)
    total = (-g).reshape(1, 2, chunk, 2, 32).sum(2).amax(-1) / math.log(2)  # [1, chunks, Hkv], log2
    if path == "midpoint":
        assert (total > 80).all() and (total < 160).all(), total
    else:
        assert (total > 160).all(), total
    run_and_compare(B=1, T=T, H=4, Hkv=2, K=32, V=32, gate=gate, dtype=dtype, chunk=chunk)


@needs_kernels
def test_learned_strong_decays_tiles_varlen_normalizer():
    # the same through the K-tiled kernels (3 tiles of 16), packed documents and the normaliser
    run_and_compare(B=1, T=150, H=2, Hkv=1, K=48, V=40, gate="trained", tiles=(16, 16),
                    seqs=[70, 1, 79], normalizer=True)


@needs_kernels
def test_decay_regimes_bf16():
    err = run_and_compare(B=1, T=80, H=2, Hkv=1, K=32, V=32, gate="mixed", dtype=torch.bfloat16)
    assert all(e == e for e in err.values())


@needs_kernels
def test_varlen():
    # three packed documents of uneven lengths, one of a single token, chunks never straddle
    err = run_and_compare(B=1, T=150, H=4, Hkv=2, K=32, V=32, seqs=[70, 1, 79])
    assert "dh0" in err and "ht" in err


@needs_kernels
def test_varlen_strong_decays_and_tiles():
    # chunks of 16 so that each document spans several chunks (and the exact path stays cheap)
    run_and_compare(B=1, T=70, H=2, Hkv=1, K=48, V=24, seqs=[20, 49, 1], gate="mixed",
                    tiles=(16, 16), chunk=16)


@needs_kernels
@pytest.mark.parametrize("gate", ["normal", "mixed"])
def test_multi_tile(gate):
    # K=48 and V=40 as 3 tiles of 16 each: runtime loops over K and V tiles in every kernel.
    run_and_compare(B=1, T=50, H=4, Hkv=2, K=48, V=40, gate=gate, tiles=(16, 16), chunk=32)


@needs_kernels
def test_small_chunks_long_sequence():
    # many chunks per sequence with the default tiles, GQA, strong and weak channels
    run_and_compare(B=1, T=120, H=4, Hkv=2, K=32, V=32, gate="mixed", chunk=16)


@needs_kernels
@pytest.mark.parametrize("segment", [1, 3])
def test_segmented_sequential_passes(segment):
    # the state and dh passes cut into segments of `segment` chunks (the last one shorter),
    # chained by the combine kernel and fixed up in parallel; initial state, dht, GQA
    run_and_compare(B=2, T=150, H=4, Hkv=2, K=32, V=32, gate="mixed", chunk=16, segment=segment)


@needs_kernels
def test_segmented_varlen_with_empty_document():
    # documents of 5, 1, 0 and 5 chunks: per-document segment counts, an empty document
    run_and_compare(B=1, T=150, H=4, Hkv=2, K=32, V=32, seqs=[70, 1, 0, 79], chunk=16,
                    segment=2)


@needs_kernels
def test_segmented_multi_tile_bf16():
    run_and_compare(B=1, T=100, H=2, Hkv=1, K=48, V=24, dtype=torch.bfloat16, gate="mixed",
                    tiles=(16, 16), chunk=16, segment=2)


@needs_kernels
def test_varlen_metadata_cached_per_tensor(monkeypatch):
    """Every layer of a model passes the same cu_seqlens: its metadata is built (one host
    sync) once, and rebuilt when the tensor changes in place or another tensor comes."""
    calls = []
    real = utils._varlen_meta_uncached
    monkeypatch.setattr(utils, "_varlen_meta_uncached", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(utils, "_VARLEN_MEMO", {})
    monkeypatch.setattr(gla_launch, "_SEGMENT_MEMO", {})
    (q, k, v, g), _, cu, _, _ = make_inputs(1, 90, 2, 1, 16, 16, seqs=[40, 50])
    cu = cu.to(DEVICE)
    xs = [x.to(DEVICE) for x in (q, k, v, g)]
    first = fused_chunk_gla(*xs, cu_seqlens=cu, output_final_state=True, _chunk=16, _segment=1)
    again = fused_chunk_gla(*xs, cu_seqlens=cu, output_final_state=True, _chunk=16, _segment=1)
    assert len(calls) == 1 and torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    cu[1] = 70                                       # in place: the documents are now 70 + 20
    moved = fused_chunk_gla(*xs, cu_seqlens=cu, output_final_state=True, _chunk=16, _segment=1)
    ref = recurrent_gla_torch(*[x.double() for x in xs], cu_seqlens=cu, output_final_state=True)
    assert len(calls) == 2 and rel(moved[0], ref[0]) < 1e-4 and rel(moved[1], ref[1]) < 1e-4
    fused_chunk_gla(*xs, cu_seqlens=cu.clone(), _chunk=16)   # an equal but new tensor
    assert len(calls) == 3


@needs_kernels
@pytest.mark.parametrize("case", ["plain", "gqa_varlen", "segmented_tiles", "bf16"])
def test_in_kernel_normalizer(case):
    """normalizer=True equals a column of ones appended to v: output, normaliser, states
    and every gradient (the ones themselves get none)."""
    kw = {"plain": dict(B=2, T=70, H=2, Hkv=2, K=32, V=24),
          "gqa_varlen": dict(B=1, T=150, H=4, Hkv=2, K=32, V=32, seqs=[70, 1, 0, 79],
                             chunk=16, segment=2, gate="mixed"),
          "segmented_tiles": dict(B=1, T=100, H=2, Hkv=1, K=48, V=40, tiles=(16, 16), chunk=16,
                                  segment=3, gate="mixed"),
          "bf16": dict(B=1, T=90, H=4, Hkv=2, K=64, V=64, dtype=torch.bfloat16, chunk=32,
                       segment=1)}[case]
    err = run_and_compare(normalizer=True, **kw)
    assert "dh0" in err and "ht" in err


@needs_kernels
def test_ops_normalizer_dispatch():
    """ops.chunk_gla(normalizer=True): the Triton path (the in-kernel normaliser) matches
    the PyTorch path (a column of ones), outputs, final state and gradients."""
    from glaswap_kernels import ops
    (q, k, v, g), s0, _, do, dht = make_inputs(1, 40, 4, 2, 16, 17, h0=True)
    v = v[..., :16]
    outs = []
    for backend in ("torch", "triton"):
        xs = [x.clone().to(DEVICE).requires_grad_() for x in (q, k, v, g, s0)]
        o, ht = ops.chunk_gla(*xs[:4], initial_state=xs[4], output_final_state=True,
                                  backend=backend, normalizer=True)
        assert o.shape[-1] == 17 and ht.shape[-1] == 17
        ((o * do.to(DEVICE)).sum() + (ht * dht.to(DEVICE)).sum()).backward()
        outs.append([o, ht] + [x.grad for x in xs])
    for a, b in zip(*outs):
        assert rel(a, b) < 1e-4


@needs_kernels
def test_normalizer_chain_keeps_padded_rows(monkeypatch):
    """chunk_gla(normalizer=True) then normalize, as the layer runs them: the Triton chain
    matches PyTorch's, o comes out as a view of rows padded to 8 values, and the gradient
    reaches the GLA backward in that layout (read in place, not copied to V + 1 rows)."""
    from glaswap_kernels import ops
    seen = []
    backward = gla_triton._backward

    def spy(q, k, v, g, scale, hbuf, pbuf, gbuf, meta, do, *rest):
        seen.append(do.stride())
        return backward(q, k, v, g, scale, hbuf, pbuf, gbuf, meta, do, *rest)
    monkeypatch.setattr(gla_triton, "_backward", spy)
    (q, k, v, g), _, _, _, _ = make_inputs(2, 40, 4, 2, 16, 16)
    v = v.abs()                                    # keep the normaliser away from 0
    q, k = q.abs(), k.abs()
    dy = torch.randn(2, 40, 4, 16)
    outs = []
    for backend in ("torch", "triton"):
        xs = [x.clone().to(DEVICE).requires_grad_() for x in (q, k, v, g)]
        o, _ = ops.chunk_gla(*xs, backend=backend, normalizer=True)
        if backend == "triton":
            assert o.shape[-1] == 17 and o.stride(-2) == 24, o.stride()
        y = ops.normalize(o, 1e-6, backend=backend)
        (y * dy.to(DEVICE)).sum().backward()
        outs.append([y] + [x.grad for x in xs])
    for a, b in zip(*outs):
        assert torch.isfinite(a).all() and rel(a, b) < 1e-4
    assert seen and seen[-1][-2] == 24, seen


@needs_kernels
@pytest.mark.parametrize("gate", ["normal", "bursty"])
def test_dv_all_v_tuning_path(monkeypatch, gate):
    """dv_all_v=1 (the bf16 default; forced here for the interpreter's fp32): the dv kernel as
    one program per chunk over both V tiles, P built once (fast and exact paths), gives the
    same output and gradients, with packed documents and the normaliser too."""
    launches = record_launches(monkeypatch, "_bwd_dv_kernel")
    # K = V = 80: the dv kernel sees all of K in one tile and V in two of 64
    ov = {"dv_all_v": 1}
    run_and_compare(B=1, T=100, H=2, Hkv=2, K=80, V=80, gate=gate, overrides=ov)
    run_and_compare(B=1, T=100, H=2, Hkv=2, K=80, V=80, gate=gate, seqs=[37, 63], normalizer=True,
                    overrides=ov)
    assert launches and all(grid[0] == 1 and kw["ALL_V"] == 2 for grid, kw in launches), launches


@needs_kernels
def test_split_g_default_splits_only_dqkg(monkeypatch):
    """bf16 at K > 64: dq/dk/dg runs as two launches by default (one-matmul chunks, then
    exact ones; outputs start as NaN), the output and dv kernels as one. Patchy gates so both
    launches have chunks; one K tile and two (each K tile decides its own path)."""
    kernels = ("_fwd_output_kernel", "_bwd_dqkg_kernel", "_bwd_dv_kernel")
    launches = {name: record_launches(monkeypatch, name) for name in kernels}
    run_and_compare(B=1, T=100, H=2, Hkv=2, K=80, V=48, gate="patchy", dtype=torch.bfloat16)
    run_and_compare(B=1, T=90, H=4, Hkv=2, K=72, V=40, gate="patchy", dtype=torch.bfloat16,
                    seqs=[30, 60], normalizer=True)
    paths = collections.Counter(kw["PATH"] for _, kw in launches["_bwd_dqkg_kernel"])
    assert paths == {1: 2, 2: 2}, paths
    assert len(launches["_fwd_output_kernel"]) == len(launches["_bwd_dv_kernel"]) == 2, launches


@needs_kernels
def test_one_pass_dqkg(monkeypatch):
    """one_pass_g=1 (the default for bf16 at K > 64, forced here for fp32 and D <= 64 too):
    with one query head per KV head the dq/dk/dg kernel takes the inter-chunk terms in dP's
    V loop. dv merged (one K and V tile), several V tiles, the normaliser with packed
    documents, both paths of the split; grouped queries keep two loops."""
    ov = {"one_pass_g": 1}
    launches = record_launches(monkeypatch, "_bwd_dqkg_kernel")
    run_and_compare(B=2, T=100, H=2, Hkv=2, K=32, V=32, gate="patchy", overrides=ov)    # dv merged
    run_and_compare(B=1, T=100, H=2, Hkv=2, K=48, V=40, gate="mixed", tiles=(16, 16),
                    overrides=ov)                                                      # 3 V tiles
    run_and_compare(B=1, T=150, H=2, Hkv=2, K=80, V=48, gate="patchy", seqs=[30, 120],
                    normalizer=True, dtype=torch.bfloat16, overrides=ov)               # split
    run_and_compare(B=1, T=70, H=4, Hkv=2, K=32, V=32, overrides=ov)                   # R = 2
    flags = [(kw["ONE_PASS"], kw["H"] // kw["Hkv"]) for _, kw in launches]
    assert flags.count((1, 1)) >= 4 and (0, 2) in flags and (1, 2) not in flags, flags


@needs_kernels
def test_keep_p_dv_reads_the_forward_scores(monkeypatch):
    """keep_p=1 (the default for bf16 at K > 64, forced here for fp32 and D <= 64 too): the
    output kernel writes s * mask(P) and the dv paths read it (dv over all V tiles, per V tile
    with grouped queries, several K tiles, dv merged into dq/dk/dg), exact-path chunks
    included; the buffer starts as NaN, so a chunk the forward skipped fails. Without
    gradients (no_grad) nothing is written."""
    ov = {"keep_p": 1}
    names = ("_fwd_output_kernel", "_bwd_dqkg_kernel", "_bwd_dv_kernel")
    launches = {name: record_launches(monkeypatch, name) for name in names}
    run_and_compare(B=1, T=100, H=2, Hkv=2, K=80, V=80, gate="patchy", dtype=torch.bfloat16,
                    overrides=ov)                                           # one V tile
    assert [grid[0] for grid, _ in launches["_bwd_dv_kernel"]] == [1]
    run_and_compare(B=1, T=100, H=2, Hkv=2, K=80, V=80, gate="patchy", dtype=torch.bfloat16,
                    overrides=dict(ov, BV_dv=64))                           # all V
    assert launches["_bwd_dv_kernel"][-1][1]["ALL_V"] == 2
    run_and_compare(B=1, T=150, H=4, Hkv=2, K=32, V=80, gate="patchy", seqs=[30, 120],
                    normalizer=True, overrides=ov)                          # one K tile, R = 2
    run_and_compare(B=1, T=100, H=2, Hkv=1, K=48, V=40, gate="mixed", tiles=(16, 16),
                    overrides=ov)                                           # K tiles
    run_and_compare(B=2, T=70, H=2, Hkv=2, K=32, V=32, gate="patchy", overrides=ov)  # dv merged
    flags = collections.Counter((name, kw.get("STORE_P", kw.get("LOAD_P")))
                                for name in names for _, kw in launches[name])
    # dq/dk/dg: the bf16 K = 80 case runs in two launches (split_g)
    assert flags[("_fwd_output_kernel", 1)] == 5 and flags[("_bwd_dqkg_kernel", 1)] == 7, flags
    assert flags[("_bwd_dv_kernel", 1)] == 4 and flags[("_bwd_dv_kernel", 0)] == 0, flags
    launches["_fwd_output_kernel"].clear()
    (q, k, v, g), _, _, _, _ = make_inputs(1, 40, 2, 2, 16, 16)
    with torch.no_grad():
        fused_chunk_gla(*(x.to(DEVICE).requires_grad_() for x in (q, k, v, g)))
    assert [kw["STORE_P"] for _, kw in launches["_fwd_output_kernel"]] == [0]


@needs_kernels
def test_kernels_read_the_kept_gates(monkeypatch):
    """Every chunk's cumulative gates are written once per call, by _chunk_gates_kernel, and
    the state, output, dh, dq/dk/dg and dv kernels read them (their buffer starts as NaN, so
    a chunk left unwritten fails): dv merged; bf16 with both paths of the split and dv in one
    V tile; grouped queries with the normaliser, packed documents (one of a single token) and
    segmented sequential passes; several K tiles (the gates kernel runs one program per K
    tile of 64 at most)."""
    writer = record_launches(monkeypatch, "_chunk_gates_kernel")
    run_and_compare(B=2, T=100, H=2, Hkv=2, K=32, V=32, gate="patchy")                 # dv merged
    run_and_compare(B=1, T=100, H=2, Hkv=2, K=80, V=80, gate="patchy", dtype=torch.bfloat16)
    run_and_compare(B=1, T=150, H=4, Hkv=2, K=32, V=40, gate="mixed", seqs=[30, 1, 119],
                    normalizer=True, segment=2)
    run_and_compare(B=1, T=100, H=2, Hkv=1, K=48, V=40, gate="mixed", tiles=(16, 16), segment=3)
    assert [grid[0] for grid, _ in writer] == [1, 2, 1, 1], writer


@needs_kernels
def test_custom_scale():
    run_and_compare(B=1, T=30, H=2, Hkv=1, K=16, V=16, scale=0.3)


@needs_kernels
def test_only_final_state_used():
    """The output unused (do is None in backward) and no initial state."""
    (q, k, v, g), _, _, _, dht = make_inputs(1, 40, 2, 1, 16, 16)
    xs = [x.to(DEVICE).requires_grad_() for x in (q, k, v, g)]
    _, ht = fused_chunk_gla(*xs, output_final_state=True)
    (ht * dht.to(DEVICE)).sum().backward()
    refs = [x.detach().double().requires_grad_() for x in xs]
    _, ht_r = recurrent_gla_torch(*refs, output_final_state=True)
    (ht_r * dht.to(DEVICE)).sum().backward()
    for x, r in zip(xs, refs):
        if r.grad is None:                   # q does not reach the final state
            assert not x.grad.any()
        else:
            assert rel(x.grad, r.grad) < 1e-4


@needs_kernels
def test_initial_state_gradient_keeps_its_dtype():
    (q, k, v, g), s0, _, do, _ = make_inputs(1, 20, 2, 1, 16, 16, h0=True)
    s0 = s0.to(DEVICE, torch.bfloat16).requires_grad_()
    o, _ = fused_chunk_gla(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), g.to(DEVICE),
                           initial_state=s0)
    (o * do.to(DEVICE)).sum().backward()
    assert s0.grad.dtype == torch.bfloat16 and torch.isfinite(s0.grad).all()


@needs_kernels
def test_no_grad_forward_matches_chunked_torch():
    (q, k, v, g), s0, _, _, _ = make_inputs(2, 50, 4, 2, 32, 32, h0=True)
    q, k, v, g, s0 = (x.to(DEVICE) for x in (q, k, v, g, s0))
    with torch.no_grad():
        o, ht = fused_chunk_gla(q, k, v, g, initial_state=s0, output_final_state=True)
        o_r, ht_r = chunk_gla_torch(q, k, v, g, initial_state=s0, output_final_state=True)
    assert rel(o, o_r) < 1e-5 and rel(ht, ht_r) < 1e-5


@needs_kernels
@pytest.mark.parametrize("T,H,Hkv,K,V", [(1, 4, 2, 32, 65), (9, 6, 2, 48, 16), (5, 2, 2, 80, 80)])
def test_fused_recurrent(T, H, Hkv, K, V):
    (q, k, v, g), s0, _, _, _ = make_inputs(2, T, H, Hkv, K, V, h0=True)
    q, k, v, g, s0 = (x.to(DEVICE) for x in (q, k, v, g, s0))
    o, ht = fused_recurrent_gla(q, k, v, g, initial_state=s0, output_final_state=True)
    o_r, ht_r = recurrent_gla_torch(q.double(), k.double(), v.double(), g.double(),
                                    initial_state=s0.double(), output_final_state=True)
    assert rel(o, o_r) < 1e-5 and rel(ht, ht_r) < 1e-5
    o2, ht2 = fused_recurrent_gla(q, k, v, g)
    assert ht2 is None and rel(o2, recurrent_gla_torch(q, k, v, g)[0]) < 1e-5


@needs_kernels
def test_fused_recurrent_continues_chunked_state():
    """Prefill with the chunk kernel, then decode token by token from its final state."""
    (q, k, v, g), _, _, _, _ = make_inputs(1, 37, 4, 2, 32, 32)
    q, k, v, g = (x.to(DEVICE) for x in (q, k, v, g))
    with torch.no_grad():
        _, h = fused_chunk_gla(q[:, :33], k[:, :33], v[:, :33], g[:, :33], output_final_state=True)
        outs = []
        for t in range(33, 37):
            o_t, h = fused_recurrent_gla(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1],
                                         g[:, t:t + 1], initial_state=h, output_final_state=True)
            outs.append(o_t)
        o_r, h_r = recurrent_gla_torch(q, k, v, g, output_final_state=True)
    assert rel(torch.cat(outs, 1), o_r[:, 33:]) < 1e-5 and rel(h, h_r) < 1e-5


def _small(B=1, T=4, H=2, Hkv=2, K=16, V=16):
    return tuple(x.to(DEVICE) for x in (torch.randn(B, T, H, K), torch.randn(B, T, Hkv, K),
                                          torch.randn(B, T, Hkv, V), -torch.rand(B, T, Hkv, K)))


@pytest.mark.parametrize("case,match", [
    ("ndim", "4-D"),
    ("shape", "share"),
    ("heads", "multiple"),
    ("varlen_batch", "B == 1"),
    ("dtype", "dtype"),
    ("head_dim", "K="),
    ("h0", "initial_state"),
])
def test_input_errors(case, match):
    q, k, v, g = _small()
    kwargs = {}
    if case == "ndim":
        q = q[0]
    elif case == "shape":
        g = g[:, :3]
    elif case == "heads":
        q, k, v, g = _small(H=3, Hkv=2)
    elif case == "varlen_batch":
        q, k, v, g = _small(B=2)
        kwargs["cu_seqlens"] = torch.tensor([0, 2, 4], dtype=torch.int32, device=DEVICE)
    elif case == "dtype":
        v = v.double()
    elif case == "head_dim":
        q, k, v, g = _small(K=8)
    elif case == "h0":
        kwargs["initial_state"] = torch.zeros(1, 2, 16, 15, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        fused_chunk_gla(q, k, v, g, **kwargs)


def test_recurrent_input_errors():
    q, k, v, g = _small(H=3, Hkv=2)
    with pytest.raises(ValueError, match="multiple"):
        fused_recurrent_gla(q, k, v, g)


@needs_kernels
def test_bad_cu_seqlens():
    q, k, v, g = _small(T=6)
    with pytest.raises(ValueError, match="cu_seqlens"):
        fused_chunk_gla(q, k, v, g, cu_seqlens=torch.tensor([0, 4, 5], dtype=torch.int32,
                                                            device=DEVICE))


def test_kernel_files_are_self_contained(tmp_path):
    """glaswap_kernels/ is copied flat into saved model folders (glaswap.checkpoint.CODE_FILES):
    no kernel file imports glaswap, every one is copied under a name of its own or is a declared
    training-only kernel, and in the copy every import of glaswap's code is one of a sibling
    that was written."""
    import re
    from pathlib import Path

    from glaswap.checkpoint import CODE_FILES, TRAINING_ONLY_KERNELS, write_model_code
    sources, names = [rel for rel, _ in CODE_FILES], [name for _, name in CODE_FILES]
    assert len(set(names)) == len(names) and not set(sources) & TRAINING_ONLY_KERNELS
    root = Path(gla_triton.__file__).parents[1]                # glaswap_kernels/
    for path in root.rglob("*.py"):
        src = path.read_text()
        assert not re.search(r"^\s*(import glaswap\b|from glaswap[ .])", src, re.M), path
        rel = "glaswap_kernels/" + path.relative_to(root).as_posix()
        if path.name != "__init__.py":
            assert rel in set(sources) | TRAINING_ONLY_KERNELS, rel
    written = write_model_code(tmp_path)
    assert written == names
    for name in written:
        text = (tmp_path / name).read_text()
        assert not re.search(r"^\s*(from \.\.|import glaswap|from glaswap)", text, re.M), name
        for sibling in re.findall(r"^\s*from \.([\w.]*) import", text, re.M):
            assert f"{sibling}.py" in written, (name, sibling)
