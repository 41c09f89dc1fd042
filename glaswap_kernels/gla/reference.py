"""Gated linear attention in plain PyTorch.

Two forms of the same function, both differentiable by autograd:

- `recurrent_gla_torch`: the token-by-token recurrence in float32. It is the ground truth
  the kernels are tested against, and the one-token step used for generation.
- `chunk_gla_torch`: the chunked form (state passed between chunks, a masked score matrix
  inside each chunk). It is what converted models run on CPU and wherever Triton is missing.

Shapes (no transposes, as the projections produce them):
    q [B, T, H, K]; k, g [B, T, Hkv, K]; v [B, T, Hkv, V]; H a multiple of Hkv.
    g holds per-step log-decays (<= 0). o [B, T, H, V]; states [B, Hkv, K, V] float32
    (or [N, Hkv, K, V] with cu_seqlens, B = 1: the state restarts at each boundary).

The recurrence, per KV head, with the query heads of a group reading the same state:
    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t
    o_t = scale * q_t S_t
"""

from __future__ import annotations

import torch

# exp() of a float32 overflows past 88; factorised scores are only used where every
# exponent stays below this, the rest of a chunk is computed element by element.
SAFE_EXP = 60.0


def _sequences(cu_seqlens, B, T):
    """(batch index, start, end) of every sequence the call covers."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    bounds = cu_seqlens.tolist()
    return [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def recurrent_gla_torch(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
                        cu_seqlens=None):
    """Token-by-token GLA in float32 (float64 if the inputs are float64)."""
    B, T, H, K = q.shape
    Hkv, V = k.shape[2], v.shape[-1]
    R = H // Hkv
    scale = K ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    seqs = _sequences(cu_seqlens, B, T)
    out = q.new_zeros(B, T, H, V, dtype=acc)
    finals = []
    for n, (b, start, end) in enumerate(seqs):
        if initial_state is not None:
            S = initial_state[n].to(acc)
        else:
            S = q.new_zeros(Hkv, K, V, dtype=acc)
        for t in range(start, end):
            decay = g[b, t].to(acc).exp()                                   # [Hkv, K]
            kv = k[b, t].to(acc)[:, :, None] * v[b, t].to(acc)[:, None, :]  # [Hkv, K, V]
            S = decay[:, :, None] * S + kv
            qt = q[b, t].to(acc).view(Hkv, R, K)
            out[b, t] = (scale * torch.einsum("hrk,hkv->hrv", qt, S)).reshape(H, V)
        finals.append(S)
    final = torch.stack(finals).float() if output_final_state else None
    return out.to(q.dtype), final


def decode_step_torch(q, k, v, g, scale, state=None):
    """One token of the recurrence for a whole batch at once (q [B, 1, H, K]): (o [B, 1, H, V]
    in q's dtype, new state [B, Hkv, K, V] float32). The same maths as recurrent_gla_torch in a
    few batched tensor ops, since that reference loops over the batch in Python."""
    B, _, H, K = q.shape
    Hkv, V = k.shape[2], v.shape[-1]
    k1, v1, g1 = k[:, 0].float(), v[:, 0].float(), g[:, 0].float()          # [B, Hkv, K or V]
    S = k1[..., :, None] * v1[..., None, :]
    if state is not None:
        S = torch.addcmul(S, g1.exp()[..., None], state)
    o = torch.matmul(q[:, 0].float().view(B, Hkv, H // Hkv, K), S) * scale  # [B, Hkv, R, V]
    return o.reshape(B, 1, H, V).to(q.dtype), S


def _chunk_scores(qe, ke, q, k, G, bad):
    """Masked intra-chunk scores A[b, n, h, r, i, j] = sum_k q_i k_j exp(G_i - G_j), j <= i.

    qe, ke are q * exp(G) and k * exp(-G) (anchored at the chunk start); they give A with one
    matmul wherever the chunk's total decay is below SAFE_EXP. Chunks flagged in `bad`
    (strong decays) are recomputed element by element, with every exponent <= 0.
    """
    C = G.shape[2]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    A = torch.einsum("bnihrk,bnjhk->bnhrij", qe, ke)
    if bad.any():
        idx = bad.nonzero(as_tuple=True)                                    # (b, n, h)
        qb = q[idx[0], idx[1], :, idx[2]]                                    # [m, C, R, K]
        kb = k[idx[0], idx[1], :, idx[2]]                                    # [m, C, K]
        Gb = G[idx[0], idx[1], :, idx[2]]                                    # [m, C, K]
        diff = (Gb[:, :, None, :] - Gb[:, None, :, :]).clamp(max=0.0)       # [m, Ci, Cj, K]
        exact = torch.einsum("mirk,mjk,mijk->mrij", qb, kb, diff.exp())
        A = A.index_put(idx, exact)
    return A.masked_fill(~causal, 0.0)


def chunk_gla_torch(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
                    cu_seqlens=None, chunk_size=64):
    """Chunked GLA in PyTorch, float32 inside; same contract as `recurrent_gla_torch`."""
    B, T, H, K = q.shape
    if cu_seqlens is not None:
        outs, finals = [], []
        bounds = cu_seqlens.tolist()
        for n in range(len(bounds) - 1):
            s, e = bounds[n], bounds[n + 1]
            h0 = None if initial_state is None else initial_state[n:n + 1]
            o, ht = chunk_gla_torch(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], scale, h0,
                                    output_final_state, None, chunk_size)
            outs.append(o)
            finals.append(ht)
        final = torch.cat(finals) if output_final_state else None
        return torch.cat(outs, dim=1), final

    Hkv, V = k.shape[2], v.shape[-1]
    R = H // Hkv
    scale = K ** -0.5 if scale is None else scale
    dtype = q.dtype
    C = chunk_size
    N = max(1, -(-T // C))
    pad = N * C - T
    # Padding at the end with k = v = 0 and g = 0 leaves the state untouched.
    qf, kf, vf, gf = (torch.nn.functional.pad(x.float(), (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
    qf = qf.view(B, N, C, Hkv, R, K)
    kf = kf.view(B, N, C, Hkv, K)
    vf = vf.view(B, N, C, Hkv, V)
    G = gf.view(B, N, C, Hkv, K).cumsum(dim=2)                               # in-chunk cumulative
    G_last = G[:, :, -1]                                                     # [B, N, Hkv, K]

    qe = qf * G.exp()[:, :, :, :, None, :]
    ke = kf * (-G).clamp(max=SAFE_EXP).exp()
    bad = (-G_last).amax(dim=-1) > SAFE_EXP                                  # [B, N, Hkv]
    A = _chunk_scores(qe, ke, qf, kf, G, bad)                                # [B, N, Hkv, R, C, C]

    # States at every chunk start: a short sequential loop over chunks.
    kd = kf * (G_last[:, :, None] - G).exp()                                 # decayed to chunk end
    chunk_kv = torch.einsum("bnjhk,bnjhv->bnhkv", kd, vf)
    S = q.new_zeros(B, Hkv, K, V, dtype=torch.float32)
    if initial_state is not None:
        S = S + initial_state.float()
    starts = []
    for n in range(N):
        starts.append(S)
        S = G_last[:, n].exp()[..., None] * S + chunk_kv[:, n]
    H0 = torch.stack(starts, dim=1)                                          # [B, N, Hkv, K, V]

    o = torch.einsum("bnihrk,bnhkv->bnihrv", qe, H0)
    o = o + torch.einsum("bnhrij,bnjhv->bnihrv", A, vf)
    o = (scale * o).reshape(B, N * C, H, V)[:, :T]
    return o.to(dtype), (S if output_final_state else None)


# ---------------------------------------------------------------------------- feature map
def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x, cos, sin):
    """RoPE as Llama applies it: x [B, T, heads, D]; cos, sin [B or 1, T, D]."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + rotate_half(x) * sin


def feature_map_torch(x, cos=None, sin=None, weight=None, softmax=True, pm=False):
    """phi(x) in front of GLA: rope(x) (when cos, sin are given), then, with softmax=True,
    softmax(rope(x) W_h) over the head dimension (W_h = weight[h], D x D; identity if None);
    pm=True: [softmax(rope(x) W_h), softmax(-rope(x) W_h)], 2D wide (hedgehog_pm).
    x [B, T, H, D]; weight [H, D, D]. The reference for feature_map_triton."""
    if cos is not None:
        x = apply_rope(x, cos, sin)
    if not softmax:
        return x
    dtype = x.dtype
    x = x.float()
    if weight is not None:
        # x W_h per head as one batched matmul over the heads ([H, B T, D] @ [H, D, E]): what
        # einsum("bthd,hde->bthe") computes, without its extra reshapes
        B, T, H, D = x.shape
        x = torch.matmul(x.permute(2, 0, 1, 3).reshape(H, B * T, D), weight.float()).view(H, B, T, -1) \
            .permute(1, 2, 0, 3)
    return (softmax_pm(x) if pm else torch.softmax(x, dim=-1)).to(dtype)


def softmax_pm(x):
    """[softmax(x), softmax(-x)] over the last dimension, twice as wide (hedgehog_pm's map): both
    halves in one softmax over x and -x side by side, one pass fewer than two softmaxes and a
    concatenation, each row's softmax the same."""
    if torch.is_grad_enabled() and x.requires_grad:
        pair = torch.stack([x, -x], dim=-2)
    else:               # written in place, without a tensor for -x
        pair = x.new_empty(*x.shape[:-1], 2, x.shape[-1])
        pair[..., 0, :] = x
        torch.neg(x, out=pair[..., 1, :])
    return torch.softmax(pair, dim=-1).flatten(-2)
