"""GLA decoding: token by token, the state in registers (generation, T usually 1).

    S_t = diag(e^{g_t}) S_{t-1} + k_t^T v_t,    o_t = s q_t S_t
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    raise

from ..utils import cdiv, load_state, new, next_pow2, store_state
from .launch import check_gla_inputs


@triton.jit
def _recurrent_kernel(q, k, v, g, o, h0, ht, T, scale,
                      H: tl.constexpr, Hkv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, R: tl.constexpr,
                      USE_H0: tl.constexpr, STORE_HT: tl.constexpr):
    """S_t = diag(e^{g_t}) S_{t-1} + k_t^T v_t; o_t = s q_t S_t for each head of the group.
    One program per (V tile, batch, KV head); the whole K is one tile."""
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1)
    i_n = i_nh // Hkv
    i_h = i_nh % Hkv
    rk = tl.arange(0, BK)
    rv = i_v * BV + tl.arange(0, BV)
    mk = rk < K
    mv = rv < V
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += load_state(h0 + i_nh.to(tl.int64) * K * V, 0, i_v * BV, K, V, V, BK, BV)
    for t in range(T):
        row = i_n.to(tl.int64) * T + t
        b_k = tl.load(k + row * Hkv * K + i_h * K + rk, mask=mk, other=0.0).to(tl.float32)
        b_g = tl.load(g + row * Hkv * K + i_h * K + rk, mask=mk, other=0.0).to(tl.float32)
        b_v = tl.load(v + row * Hkv * V + i_h * V + rv, mask=mv, other=0.0).to(tl.float32)
        b_h = b_h * tl.exp(b_g)[:, None] + b_k[:, None] * b_v[None, :]
        for r in range(R):
            hq = i_h * R + r
            b_q = tl.load(q + row * H * K + hq * K + rk, mask=mk, other=0.0).to(tl.float32)
            b_o = tl.sum(b_q[:, None] * b_h, axis=0) * scale
            tl.store(o + row * H * V + hq * V + rv, b_o.to(o.dtype.element_ty), mask=mv)
    if STORE_HT:
        store_state(ht + i_nh.to(tl.int64) * K * V, b_h, 0, i_v * BV, K, V, V, BK, BV)


def fused_recurrent_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
    """Token-by-token GLA (forward only; generation, T usually 1). Same shapes as
    fused_chunk_gla without cu_seqlens. Returns (o, final state float32 or None)."""
    B, T, H, Hkv, K, V, N = check_gla_inputs(q, k, v, g, initial_state, None, chunked=False)
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v, g = (x.contiguous() for x in (q, k, v, g))
    h0 = None if initial_state is None else initial_state.contiguous()
    o = new((B, T, H, V), q.dtype, q.device)
    ht = new((B, Hkv, K, V), torch.float32, q.device) if output_final_state else None
    BK = next_pow2(K)
    # The state tile is [K, BV] fp32 in registers: keep it at <= 8K elements.
    BV = min(max(16, next_pow2(V)), max(16, 8192 // BK))
    _recurrent_kernel[(cdiv(V, BV), B * Hkv)](
        q, k, v, g, o, h0, ht, T, scale,
        H=H, Hkv=Hkv, K=K, V=V, BK=BK, BV=BV, R=H // Hkv,
        USE_H0=h0 is not None, STORE_HT=bool(output_final_state),
        num_warps=4 if BK * BV <= 4096 else 8)
    return o, ht
