"""What the GLA kernel tests share: inputs of several decay regimes, the comparison against
the float64 recurrence (interpreter sizes) or the float32 chunked form (GPU sizes), and a
recorder of kernel launches.

Every comparison is a relative RMS error, ||x - ref|| / ||ref||, for the output, the final
state and every gradient (q, k, v, g, initial state) of loss = (o*do).sum() + (ht*dht).sum().
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from glaswap_kernels import utils as triton_helpers
from glaswap_kernels.gla import chunk as gla_triton
from glaswap_kernels.gla.chunk import fused_chunk_gla
from glaswap_kernels.gla.reference import chunk_gla_torch, recurrent_gla_torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernels = pytest.mark.skipif(not (CUDA or INTERPRETED),
                                   reason="needs CUDA or TRITON_INTERPRET=1")
gpu_only = pytest.mark.skipif(not CUDA, reason="needs CUDA")
# the interpreter's own warning, and numpy's on the one-matmul path's scores above the
# diagonal, which may overflow by design and are masked (gla_scores._FAST)
interpreter_warnings = [
    pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered in matmul:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")]

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    """Buffers the kernels must fill start as NaN, so unwritten memory fails the test (autouse
    in every test module that imports it)."""
    monkeypatch.setattr(triton_helpers, "POISON", True)


def rel(x, ref):
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def gates(shape, kind, gen):
    """Per-step log-decays (<= 0) of several regimes."""
    if kind == "seed":            # the benchmark's gates: logsigmoid(N(0,1)) / 16
        return F.logsigmoid(torch.randn(shape, generator=gen)) / 16
    if kind == "normal":
        return F.logsigmoid(torch.randn(shape, generator=gen) + 1.0)
    if kind == "strong":          # about -20 per step: everything forgotten at once
        return -20.0 + 0.5 * torch.rand(shape, generator=gen)
    if kind == "weak":            # about -1e-4: nothing forgotten within the test
        return -1e-4 * torch.rand(shape, generator=gen)
    if kind == "mixed":           # strong and weak channels side by side in every chunk
        strong = torch.rand(shape[-1], generator=gen) < 0.3
        return torch.where(strong, -20.0 * torch.rand(shape, generator=gen),
                           F.logsigmoid(torch.randn(shape, generator=gen)) / 4)
    if kind == "patchy":          # weak everywhere but rows 40-44 (-40 a step): one chunk,
        g = F.logsigmoid(torch.randn(shape, generator=gen) + 1.0)   # of 32 or 64, is exact
        g[:, 40:45] = -40.0
        return g
    if kind == "steep":
        # 40% of channels keep 0.03-0.08 of their state a step: past 2^-160 over a chunk of
        # 64 (the blocked path, 16-row blocks mostly factorised) but not over one of 32 (one
        # matmul around the chunk's midpoint, where an anchor at its start would not do)
        fast = torch.rand(shape[-1], generator=gen) < 0.4
        return torch.where(fast, -2.5 - torch.rand(shape, generator=gen),
                           F.logsigmoid(torch.randn(shape, generator=gen) + 1.0))
    if kind in ("trained", "bursty"):
        # What distillation learns: 40% of channels keep only 0.14-0.5 of their state a step
        # (past 2^-80 over a 64-token chunk, not over a 16-row block); bursty adds three steps
        # of -40 on every channel, so that row blocks of one tile take both exact paths.
        fast = torch.rand(shape[-1], generator=gen) < 0.4
        g = torch.where(fast, -0.7 - 1.3 * torch.rand(shape, generator=gen),
                        F.logsigmoid(torch.randn(shape, generator=gen) + 1.0))
        if kind == "bursty":
            g[:, [5, 70, 71]] = -40.0
        return g
    raise ValueError(kind)


def make_inputs(B, T, H, Hkv, K, V, gate="normal", h0=False, seqs=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    N = B if seqs is None else len(seqs)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, Hkv, K, generator=gen)
    v = torch.randn(B, T, Hkv, V, generator=gen)
    g = gates((B, T, Hkv, K), gate, gen)
    s0 = torch.randn(N, Hkv, K, V, generator=gen) if h0 else None
    cu = None
    if seqs is not None:
        assert B == 1 and sum(seqs) == T
        cu = torch.tensor([0] + list(torch.tensor(seqs).cumsum(0)), dtype=torch.int32)
    do = torch.randn(B, T, H, V, generator=gen)
    dht = torch.randn(N, Hkv, K, V, generator=gen)
    return (q, k, v, g), s0, cu, do, dht


def run_and_compare(B, T, H, Hkv, K, V, dtype=torch.float32, gate="normal", h0=True,
                    final=True, seqs=None, tiles=None, chunk=None, scale=None, tol=None,
                    segment=None, normalizer=False, overrides=None):
    """Forward + backward of fused_chunk_gla against recurrent_gla_torch in float64 on the
    same (dtype-rounded) data. Returns the dict of relative errors after asserting them.
    normalizer=True: the kernel's implicit column of ones against the reference run on v
    with a real column of ones appended (o, states, do and dht have V + 1 columns).
    tiles, chunk, segment, overrides: fused_chunk_gla's private keywords."""
    VS = V + int(normalizer)
    (q, k, v, g), s0, cu, do, dht = make_inputs(B, T, H, Hkv, K, VS, gate, h0, seqs)
    v = v[..., :V].contiguous()
    xs = [x.to(dtype).to(DEVICE).requires_grad_() for x in (q, k, v, g)]
    s0_t = None if s0 is None else s0.to(DEVICE).clone().requires_grad_()
    cu_t = None if cu is None else cu.to(DEVICE)
    o, ht = fused_chunk_gla(*xs, scale=scale, initial_state=s0_t, output_final_state=final,
                            cu_seqlens=cu_t, normalizer=normalizer, _tiles=tiles, _chunk=chunk,
                            _segment=segment, _overrides=overrides)
    assert o.dtype == dtype and o.shape == (B, T, H, VS)
    loss = (o.double() * do.to(DEVICE).double()).sum()
    if final:
        assert ht.dtype == torch.float32 and ht.shape == dht.shape
        loss = loss + (ht.double() * dht.to(DEVICE).double()).sum()
    else:
        assert ht is None
    loss.backward()

    refs = [x.detach().double().requires_grad_() for x in xs]
    s0_r = None if s0 is None else s0.to(DEVICE).double().detach().requires_grad_()
    q_r, k_r, v_r, g_r = refs
    if normalizer:
        v_r = torch.cat([v_r, torch.ones_like(v_r[..., :1])], dim=-1)
    o_r, ht_r = recurrent_gla_torch(q_r, k_r, v_r, g_r, scale=scale, initial_state=s0_r,
                                    output_final_state=True, cu_seqlens=cu_t)
    loss_r = (o_r * do.to(DEVICE).double()).sum()
    if final:
        loss_r = loss_r + (ht_r.double() * dht.to(DEVICE).double()).sum()
    loss_r.backward()

    err = {"o": rel(o, o_r)}
    if final:
        err["ht"] = rel(ht, ht_r)
    for name, x, r in zip(("dq", "dk", "dv", "dg"), xs, refs):
        assert x.grad.dtype == dtype
        err[name] = rel(x.grad, r.grad)
    if s0 is not None:
        assert s0_t.grad.dtype == torch.float32
        err["dh0"] = rel(s0_t.grad, s0_r.grad)
    limit = TOL[dtype] if tol is None else tol
    bad = {n: e for n, e in err.items() if not e <= limit}      # also catches NaN
    assert not bad, f"relative errors above {limit}: {bad} (all: {err})"
    return err


def gpu_compare(B, T, H, Hkv, K, V, seqs=None, backward=True, tol=2e-2, normalizer=False,
                 trained=False, steep=False, overrides=None):
    """bf16 kernels against the float32 chunked torch form (itself tested against the
    recurrence) on the same bf16-rounded data; normalizer: the in-kernel normaliser against
    the reference on v with a column of ones; trained: 40% of the channels keep 0.14-0.5 of
    their state a step, as distillation learns (chunks of 64 decay 2^-80..2^-160: one matmul
    around the midpoint); steep: 0.03-0.08 (chunks of 64 take the blocked path, chunks of
    32 the midpoint one)."""
    torch.manual_seed(0)
    dev = "cuda"
    q = torch.randn(B, T, H, K, device=dev).bfloat16()
    k = torch.randn(B, T, Hkv, K, device=dev).bfloat16()
    v = torch.randn(B, T, Hkv, V, device=dev).bfloat16()
    g = F.logsigmoid(torch.randn(B, T, Hkv, K, device=dev)) / 16
    if trained:
        g = torch.where(torch.rand(K, device=dev) < 0.4, -0.7 - 1.3 * torch.rand_like(g), g)
    if steep:
        g = torch.where(torch.rand(K, device=dev) < 0.4, -2.5 - torch.rand_like(g), g)
    g = g.bfloat16()
    N = B if seqs is None else len(seqs)
    cu = None if seqs is None else torch.tensor([0] + list(torch.tensor(seqs).cumsum(0)),
                                                dtype=torch.int32, device=dev)
    s0 = torch.randn(N, Hkv, K, V + int(normalizer), device=dev)
    xs = [x.clone().requires_grad_(backward) for x in (q, k, v, g)]
    rs = [x.float().requires_grad_(backward) for x in (q, k, v, g)]
    s0a = s0.clone().requires_grad_(backward)
    s0b = s0.clone().requires_grad_(backward)
    o, ht = fused_chunk_gla(*xs, initial_state=s0a, output_final_state=True, cu_seqlens=cu,
                            normalizer=normalizer, _overrides=overrides)
    v_r = torch.cat([rs[2], torch.ones_like(rs[2][..., :1])], -1) if normalizer else rs[2]
    o_r, ht_r = chunk_gla_torch(rs[0], rs[1], v_r, rs[3], initial_state=s0b,
                                output_final_state=True, cu_seqlens=cu)
    errs = {"o": rel(o, o_r), "ht": rel(ht, ht_r)}
    if backward:
        do = torch.randn_like(o_r)
        dht = torch.randn_like(ht_r)
        ((o.float() * do).sum() + (ht * dht).sum()).backward()
        ((o_r * do).sum() + (ht_r * dht).sum()).backward()
        for n, a, b in zip(("dq", "dk", "dv", "dg"), xs, rs):
            errs[n] = rel(a.grad, b.grad)
        errs["dh0"] = rel(s0a.grad, s0b.grad)
    bad = {n: e for n, e in errs.items() if not e <= tol}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errs})"


def record_launches(monkeypatch, name, module=gla_triton):
    """Kernel `name` (as `module` launches it) runs as usual; the returned list gets (grid,
    keyword arguments) of each of its launches."""
    launches = []
    real = getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, kwargs))
                return real[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(module, name, Spy())
    return launches
