"""Gated linear attention in Triton: chunk-parallel training kernels and a decoding kernel.

Same contract as `gla_torch.chunk_gla_torch` / `recurrent_gla_torch` (see that file):
    q [B, T, H, K]; k, g [B, T, Hkv, K]; v [B, T, Hkv, V]; H a multiple of Hkv.
    g holds per-step log-decays (<= 0). o [B, T, H, V]; states [B, Hkv, K, V] float32
    (or [N, Hkv, K, V] with cu_seqlens, B = 1: the state restarts at each boundary).
The query heads of a group read the same KV state: k, v, g are never repeated per head.

Math per chunk of C tokens with start state h (K x V), G = in-chunk cumulative sum of g
(log2 units, fp32; by default written once per chunk by _chunk_gates_kernel and read by the
other kernels, see _Config.keep_g; with keep_g = 0 each kernel rebuilds it from g):
    o_i    = s * (q_i e^{G_i}) h + s * sum_{j<=i} P_ij v_j,  P_ij = sum_k q_ik k_jk e^{G_ik - G_jk}
    h_next = e^{G_last} h + sum_j (k_j e^{G_last - G_j})^T v_j
P is one tensor-core matmul of (q e^G)(k e^-G)^T when the chunk's total decay is below SAFE
(every factor then fits the fp32/bf16 exponent range); otherwise ("slow path", strong decays)
it is built in 16-row blocks, each factorised around its own first row, and a block still too
steep row by row with every exponent clamped to <= 0 (see _scores_slow). The choice is made
per program and per K tile, so it is uniform inside a program. C is 32 where the state is
narrow (V <= 64, K <= 128) so that trained gates mostly stay on the one-matmul path, else 64.

Kernels (grid in brackets; N = sequences, NT = chunks of a sequence, NTtot = all chunks,
S = segments of all sequences):
  forward   _chunk_gates_kernel [NK, NTtot, Hkv]  every chunk's G (keep_g = 2, the default)
            _fwd_state_kernel   [NK, NV, S*Hkv]   walks the chunks of a segment, writes every
                                                  chunk-start state
            _seg_combine_kernel [NK, NV, N*Hkv]   chains the segments (only when S > N)
            _seg_fixup_kernel   [NTtot, Hkv]      local -> true states inside segments (idem)
            _fwd_output_kernel  [NTtot, Hkv]      o for every query head of the group
  backward  _bwd_dh_kernel      [NK, NV, S*Hkv]   reverse walk, writes every dh at chunk starts
            (_seg_combine_kernel, _seg_fixup_kernel in reverse, when S > N)
            _bwd_dqkg_kernel    [NK, NTtot, Hkv]  dq (each head), dk, dg (+ dv when merge_dv)
            _bwd_dv_kernel      [NV, NTtot, Hkv]  dv (skipped when merge_dv)
  decoding  _recurrent_kernel   [NV, B*Hkv]       token by token, state in registers
The sequential passes are cut into segments (S > N) only when one walk per sequence would
leave SMs idle (few long sequences); see _Config.plan_segments.
The chunk-start states of the forward pass (bf16 for bf16 inputs, fp32 otherwise) are kept
for the backward pass instead of being recomputed.

dg needs no global pass: with dGabs_t = sum_heads q_t*dq_t - k_t*dk_t, dg_s is the reverse
in-chunk cumulative sum of dGabs from s to the chunk end plus
r_{n+1}[k] = sum_v h_{n+1}[k, v] * dh_{n+1}[k, v] (scaling the state at a chunk boundary by
e^gamma is the same as adding gamma to the next step's log-decay). _bwd_dqkg_kernel
evaluates that sum with its cancelling O(1) terms removed analytically (see there), so dg
keeps its relative precision under strong decays.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    # Triton is optional for the callers of this module (they fall back to gla_torch);
    # the try block also keeps transformers' remote-code import checker from requiring it.
    import triton
    import triton.language as tl
except ImportError:
    raise

__all__ = ["fused_chunk_gla", "fused_recurrent_gla"]

# Debug switch for the tests: when True, every buffer a kernel must fully write is allocated
# full of NaN, so a region the kernels forget shows up as NaN instead of stale zeros.
POISON = False

# Tuning hook: attribute -> value pairs that replace _Config's choices (e.g. {"warps_o": 8}).
# Runs that do not import this module themselves (glaswap distill) take them from the
# environment: GLASWAP_GLA_OVERRIDES="slow_blocks=1,warps_o=8" (integer values).
OVERRIDES: dict = {}
for _item in filter(None, os.environ.get("GLASWAP_GLA_OVERRIDES", "").split(",")):
    _key, _, _value = _item.partition("=")
    if not _value.strip().lstrip("-").isdigit():
        raise ValueError(f"GLASWAP_GLA_OVERRIDES: {_item.strip()!r} is not KEY=INTEGER")
    OVERRIDES[_key.strip()] = int(_value)

_LOG2E = tl.constexpr(1.4426950408889634)
# Largest total in-chunk decay, in log2 units (2^80 ~ e^55), for which the factorised scores
# are used: q*2^G and k*2^-G then stay within 2^-80..2^80, and even the masked upper-triangle
# products (at most 2^80 |q||k| K) stay far below the fp32/bf16 limit of 2^128.
_SAFE = tl.constexpr(80.0)


# ----------------------------------------------------------------------------------------
# Small helpers (inlined by Triton)
# ----------------------------------------------------------------------------------------

@triton.jit
def _mm(a, b, DOT_BF16: tl.constexpr, PREC: tl.constexpr):
    """a @ b with fp32 accumulation: bf16 operands for bf16 inputs, fp32 ones otherwise (fp16
    inputs use fp32 operands because the factorised decays overflow fp16's 65504)."""
    if DOT_BF16:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def _op(x, DOT_BF16: tl.constexpr):
    """A matmul operand in the dtype the dot will use: converting loop-invariant operands once
    (and keeping them at half the size in registers for bf16)."""
    if DOT_BF16:
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def _seq_bounds(i_n, cu_seqlens, chunk_offsets, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """First token, end token and first global chunk index of sequence i_n (all int64)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        eos = bos + T
        c0 = i_n.to(tl.int64) * tl.cdiv(T, BT)
    return bos, eos, c0


@triton.jit
def _chunk_coords(i_c, chunk_indices, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(sequence, chunk within the sequence) of global chunk i_c."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + 2 * i_c)
        i_t = tl.load(chunk_indices + 2 * i_c + 1)
    else:
        NT = tl.cdiv(T, BT)
        i_n = i_c // NT
        i_t = i_c % NT
    return i_n, i_t


@triton.jit
def _load_rows(ptr, t0, n_valid, stride_t, c0, n_cols, BT: tl.constexpr, BC: tl.constexpr):
    """[BT, BC] tile of a [tokens, ..] tensor: rows t0.., columns c0.. (ptr at the head).
    Rows past the sequence end and columns past the head dim read as 0, so a masked row has
    k = v = q = 0 and g = 0 (it then leaves states and cumulative gates untouched).
    The 64-bit part of the address is one scalar; per-element offsets are int32 (they stay
    below BT * stride), which keeps pointer tiles from eating registers."""
    rows = tl.arange(0, BT)
    cols = c0 + tl.arange(0, BC)
    mask = (rows < n_valid)[:, None] & (cols < n_cols)[None, :]
    base = ptr + t0 * stride_t
    return tl.load(base + (rows[:, None] * stride_t + cols[None, :]), mask=mask, other=0.0)


@triton.jit
def _store_rows(ptr, x, t0, n_valid, stride_t, c0, n_cols, BT: tl.constexpr, BC: tl.constexpr):
    rows = tl.arange(0, BT)
    cols = c0 + tl.arange(0, BC)
    mask = (rows < n_valid)[:, None] & (cols < n_cols)[None, :]
    base = ptr + t0 * stride_t
    tl.store(base + (rows[:, None] * stride_t + cols[None, :]), x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_state(ptr, k0, v0, K: tl.constexpr, V: tl.constexpr, VS: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr):
    """[BK, BV] tile of the first V columns of a row-major K x VS state at ptr, as fp32
    (with the in-kernel normaliser column V holds its state, and VS >= V + 1 is the row
    stride: the internal state buffers pad it, see _state_stride)."""
    rk = k0 + tl.arange(0, BK)
    rv = v0 + tl.arange(0, BV)
    mask = (rk < K)[:, None] & (rv < V)[None, :]
    return tl.load(ptr + rk[:, None] * VS + rv[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _store_state(ptr, x, k0, v0, K: tl.constexpr, V: tl.constexpr, VS: tl.constexpr,
                 BK: tl.constexpr, BV: tl.constexpr):
    rk = k0 + tl.arange(0, BK)
    rv = v0 + tl.arange(0, BV)
    mask = (rk < K)[:, None] & (rv < V)[None, :]
    tl.store(ptr + rk[:, None] * VS + rv[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_col(ptr, k0, K: tl.constexpr, V: tl.constexpr, VS: tl.constexpr, BK: tl.constexpr):
    """Column V (the normaliser's) of a K x VS state, rows k0.., as fp32 [BK]."""
    rk = k0 + tl.arange(0, BK)
    return tl.load(ptr + rk * VS + V, mask=rk < K, other=0.0).to(tl.float32)


@triton.jit
def _store_col(ptr, x, k0, K: tl.constexpr, V: tl.constexpr, VS: tl.constexpr, BK: tl.constexpr):
    rk = k0 + tl.arange(0, BK)
    tl.store(ptr + rk * VS + V, x.to(ptr.dtype.element_ty), mask=rk < K)


@triton.jit
def _store_den(ptr, x, t0, n_valid, stride_t, V: tl.constexpr, BT: tl.constexpr):
    """Writes [BT] into column V of a [tokens, .., V + 1] tensor (o: the normaliser)."""
    rows = tl.arange(0, BT)
    tl.store(ptr + t0 * stride_t + rows * stride_t + V, x.to(ptr.dtype.element_ty),
             mask=rows < n_valid)


@triton.jit
def _load_den_grad(ptr, t0, n_valid, stride_t, V: tl.constexpr, BT: tl.constexpr):
    """[BT] column V of a [tokens, .., V + 1] tensor (do: the gradient of the normaliser)."""
    rows = tl.arange(0, BT)
    return tl.load(ptr + t0 * stride_t + rows * stride_t + V, mask=rows < n_valid,
                   other=0.0).to(tl.float32)


@triton.jit
def _gates(gp, t0, n_valid, stride_t, c0, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """In-chunk cumulative log2-decay G [BT, BK] and its last value G_last [BK], fp32.
    Masked rows have g = 0, so the sum over all rows is G at the last valid token."""
    b_g = _load_rows(gp, t0, n_valid, stride_t, c0, K, BT, BK)
    return _cum_gates(b_g)


@triton.jit
def _cum_gates(b_g):
    """(G, G_last) of a loaded [BT, BK] tile of log-decays (any float dtype)."""
    b_g = b_g.to(tl.float32) * _LOG2E
    return tl.cumsum(b_g, axis=0), tl.sum(b_g, axis=0)


@triton.jit
def _kept_gates(Gp, t0, n_valid, stride_t, c0, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """(G, G_last) as _gates gives them, read from the kept copy (KEEP_G: fp32, log2 units,
    cumulative within each chunk; written by _chunk_gates_kernel, or by the state pass with
    keep_g = 1) instead of rebuilt from g: the in-chunk scan runs across the warps through
    shared memory, a quarter to two fifths of the instructions of the sequential passes and
    the dv kernel (SASS, sm_90). Rows past the end get G_last, as a cumulative sum over
    their zero gates would."""
    rows = tl.arange(0, BT)
    cols = c0 + tl.arange(0, BK)
    G = _load_rows(Gp, t0, n_valid, stride_t, c0, K, BT, BK).to(tl.float32)
    last = tl.minimum(n_valid, BT) - 1
    # (cols * 0 + last): the scalar test as a block, which the interpreter's mask needs
    G_last = tl.load(Gp + (t0 + tl.maximum(last, 0)) * stride_t + cols,
                     mask=(cols < K) & ((cols * 0 + last) >= 0), other=0.0).to(tl.float32)
    G = tl.where((rows < n_valid)[:, None], G, G_last[None, :])
    return G, G_last


@triton.jit
def _excl_cumsum(x, BT: tl.constexpr):
    """Exclusive cumulative sum over rows: out_s = sum_{j<s} x_j. The shift is a gather so
    the result never subtracts a large x_s from an inclusive sum."""
    rows = tl.arange(0, BT)
    prev = tl.broadcast_to(tl.maximum(rows - 1, 0)[:, None], x.shape)
    shifted = tl.where(rows[:, None] > 0, tl.gather(x, prev, axis=0), 0.0)
    return tl.cumsum(shifted, axis=0)


@triton.jit
def _block_frame(G, rows, s, SB: tl.constexpr, BT: tl.constexpr):
    """For the rows [s, s + SB) of a chunk: the mask of those rows, the reference r = G at
    row s [BK], and whether the block's own decay (r - G at its last row) stays below SAFE
    in every channel, so that 2^(r - G_j) for j inside the block fits the range."""
    in_blk = (rows >= s) & (rows < s + SB)
    r = tl.sum(tl.where((rows == s)[:, None], G, 0.0), axis=0)
    last = tl.minimum(s + SB - 1, BT - 1)
    G_end = tl.sum(tl.where((rows == last)[:, None], G, 0.0), axis=0)
    return in_blk, r, tl.max(r - G_end, axis=0) < _SAFE


@triton.jit
def _score_rows(P, b_q, b_k, G, rows, lo, hi):
    """Rows lo..hi-1 of P_ij = sum_k q_ik k_jk 2^{min(G_ik - G_jk, 0)}, one row at a time:
    no exponent is positive, so any decay underflows to 0 instead of overflowing."""
    for i in range(lo, hi):
        sel = rows == i
        # row i of q and G (written out: nested jit calls are slow under the interpreter)
        q_i = tl.sum(tl.where(sel[:, None], b_q, 0.0), axis=0)
        G_i = tl.sum(tl.where(sel[:, None], G, 0.0), axis=0)
        E = tl.exp2(tl.minimum(G_i[None, :] - G, 0.0))              # [BT(j), BK]
        p_i = tl.sum(q_i[None, :] * b_k * E, axis=1)                 # [BT(j)]
        P = tl.where(sel[:, None], p_i[None, :], P)
    return P


@triton.jit
def _block_scores(b_q, b_k, G, in_blk, r, DOT_BF16: tl.constexpr, PREC: tl.constexpr):
    """The rows in_blk of P, factorised around the block's first row r:
    (q_i 2^{G_i - r}) (k_j 2^{r - G_j}); other rows come out zero (see _scores_slow)."""
    q_f = tl.where(in_blk[:, None], b_q * tl.exp2(tl.minimum(G - r[None, :], 0.0)), 0.0)
    k_f = b_k * tl.exp2(tl.minimum(r[None, :] - G, _SAFE))
    return _mm(q_f, tl.trans(k_f), DOT_BF16, PREC)


@triton.jit
def _block_dqk(dP, b_q, b_k, G, in_blk, r, DOT_BF16: tl.constexpr, PREC: tl.constexpr):
    """The dq rows in_blk and their share of dk, in _block_scores' frame:
    dq_B = 2^{G_B - r} (dP_B @ k 2^{r - G}) and dk = 2^{r - G} (dP_B^T @ q_B 2^{G_B - r})."""
    # the factors are recomputed at each use: exps are cheaper than spilled tiles
    dP_b = tl.where(in_blk[:, None], dP, 0.0)
    dq = (tl.where(in_blk[:, None], tl.exp2(tl.minimum(G - r[None, :], 0.0)), 0.0)
          * _mm(dP_b, b_k * tl.exp2(tl.minimum(r[None, :] - G, _SAFE)), DOT_BF16, PREC))
    q_f = tl.where(in_blk[:, None], b_q * tl.exp2(tl.minimum(G - r[None, :], 0.0)), 0.0)
    dk = tl.exp2(tl.minimum(r[None, :] - G, _SAFE)) * _mm(tl.trans(dP_b), q_f, DOT_BF16, PREC)
    return dq, dk


@triton.jit
def _scores_slow(b_q, b_k, gp, t0, n_valid, stride_t, c0, K: tl.constexpr,
                 BT: tl.constexpr, BK: tl.constexpr, DOT_BF16: tl.constexpr, PREC: tl.constexpr,
                 BLOCKED: tl.constexpr):
    """P_ij = sum_k q_ik k_jk 2^{G_ik - G_jk} for one K tile whose chunk decays too much for
    one factorisation (some channel loses more than 2^SAFE over the chunk). Entries j > i
    are finite garbage that the caller masks; g is reloaded so that the fast path does not
    keep G alive in registers.
    BLOCKED (launch key slow_blocks): rows go in blocks of SB = 16, each factorised around
    its own first row r, (q_i 2^{G_i - r}) (k_j 2^{r - G_j}): both factors are <= 1 for j
    before the block and the second stays below 2^SAFE inside it. Trained gates put whole
    channels at ~0.2-0.5 a step (SmolLM2's stage-1 step time grew 2.5x as they formed): past
    2^-80 over 64 steps, not over 16. A block whose own decay is still too strong goes row
    by row. Otherwise every row goes one at a time (64 times the exps of the fast path)."""
    G, _ = _gates(gp, t0, n_valid, stride_t, c0, K, BT, BK)
    rows = tl.arange(0, BT)
    P = tl.zeros([BT, BT], dtype=tl.float32)
    if BLOCKED == 1:
        SB: tl.constexpr = 16 if BT > 16 else BT
        for blk in range(BT // SB):
            in_blk, r, ok = _block_frame(G, rows, blk * SB, SB, BT)
            if ok:
                P += _block_scores(b_q, b_k, G, in_blk, r, DOT_BF16, PREC)
            else:
                P = _score_rows(P, b_q, b_k, G, rows, blk * SB, blk * SB + SB)
    elif BLOCKED == 2:
        # The same blocks with no matmul under a runtime branch or loop (mode 1's form, dots
        # in an if in a loop, hit an illegal memory access on the H200, NOTES session 8):
        # every block's product unrolled and unconditional, a block too steep for it masked
        # out (in_blk & ok) and then redone row by row, a branch with no matmul in it. A
        # block's product only writes its own rows, so its fix-up can follow it directly.
        SB: tl.constexpr = 16 if BT > 16 else BT
        for blk in tl.static_range(BT // SB):
            in_blk, r, ok = _block_frame(G, rows, blk * SB, SB, BT)
            # (ok != 0: the interpreter cannot `&` a bool tensor with a bool scalar)
            P += _block_scores(b_q, b_k, G, in_blk & (ok != 0), r, DOT_BF16, PREC)
            if not ok:
                P = _score_rows(P, b_q, b_k, G, rows, blk * SB, blk * SB + SB)
    else:
        P = _score_rows(P, b_q, b_k, G, rows, 0, BT)
    return P


@triton.jit
def _dqk_rows(dq, dk, dP, b_q, b_k, G, rows, lo, hi):
    """The rows lo..hi-1 of dP in _dqk_slow, one at a time, every exponent clamped to <= 0."""
    for i in range(lo, hi):
        sel = rows == i
        q_i = tl.sum(tl.where(sel[:, None], b_q, 0.0), axis=0)
        G_i = tl.sum(tl.where(sel[:, None], G, 0.0), axis=0)
        dp_i = tl.sum(tl.where(sel[:, None], dP, 0.0), axis=0)      # row i of dP, [BT(j)]
        E = tl.exp2(tl.minimum(G_i[None, :] - G, 0.0))              # [BT(j), BK]
        dq_i = tl.sum(dp_i[:, None] * b_k * E, axis=0)               # [BK]
        dq = tl.where(sel[:, None], dq_i[None, :], dq)
        dk += dp_i[:, None] * q_i[None, :] * E
    return dq, dk


@triton.jit
def _dqk_slow(dP, b_q, b_k, gp, t0, n_valid, stride_t, c0, K: tl.constexpr,
              BT: tl.constexpr, BK: tl.constexpr, DOT_BF16: tl.constexpr, PREC: tl.constexpr,
              BLOCKED: tl.constexpr):
    """Intra-chunk dq_i = sum_{j<=i} dP_ij k_j 2^{G_i - G_j} and dk_j = sum_{i>=j} dP_ij q_i 2^{G_i - G_j}
    (dP must be causally masked: its zeros stand in for the mask), in the row blocks of
    _scores_slow when BLOCKED: dq_B = 2^{G_B - r} (dP_B @ k 2^{r - G}) and
    dk += 2^{r - G} (dP_B^T @ q_B 2^{G_B - r}); row by row otherwise."""
    G, _ = _gates(gp, t0, n_valid, stride_t, c0, K, BT, BK)
    rows = tl.arange(0, BT)
    dq = tl.zeros([BT, BK], dtype=tl.float32)
    dk = tl.zeros([BT, BK], dtype=tl.float32)
    if BLOCKED == 1:
        SB: tl.constexpr = 16 if BT > 16 else BT
        for blk in range(BT // SB):
            in_blk, r, ok = _block_frame(G, rows, blk * SB, SB, BT)
            if ok:
                dq_b, dk_b = _block_dqk(dP, b_q, b_k, G, in_blk, r, DOT_BF16, PREC)
                dq += dq_b
                dk += dk_b
            else:
                dq, dk = _dqk_rows(dq, dk, dP, b_q, b_k, G, rows, blk * SB, blk * SB + SB)
    elif BLOCKED == 2:
        # mode 2 of _scores_slow: unrolled, unconditional products; a steep block's dP rows
        # are masked out of them (in_blk & ok: its dk share) and its rows then redone one at a time
        SB: tl.constexpr = 16 if BT > 16 else BT
        for blk in tl.static_range(BT // SB):
            in_blk, r, ok = _block_frame(G, rows, blk * SB, SB, BT)
            dq_b, dk_b = _block_dqk(dP, b_q, b_k, G, in_blk & (ok != 0), r, DOT_BF16, PREC)
            dq += dq_b
            dk += dk_b
            if not ok:
                dq, dk = _dqk_rows(dq, dk, dP, b_q, b_k, G, rows, blk * SB, blk * SB + SB)
    else:
        dq, dk = _dqk_rows(dq, dk, dP, b_q, b_k, G, rows, 0, BT)
    return dq, dk


@triton.jit
def _score_tile(qp, kp, gp, t0, n_valid, k0, H: tl.constexpr, Hkv: tl.constexpr,
                K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, DOT_BF16: tl.constexpr,
                PREC: tl.constexpr, SLOW_BLOCKS: tl.constexpr):
    """One K tile's share of the (unmasked) scores P, factorised on tensor cores when the
    tile's decay allows it, else exact row by row; also returns the tile's q and G."""
    b_q = _load_rows(qp, t0, n_valid, H * K, k0, K, BT, BK).to(tl.float32)
    b_k = _load_rows(kp, t0, n_valid, Hkv * K, k0, K, BT, BK).to(tl.float32)
    G, G_last = _gates(gp, t0, n_valid, Hkv * K, k0, K, BT, BK)
    if tl.max(-G_last, axis=0) < _SAFE:
        p = _mm(b_q * tl.exp2(G), tl.trans(b_k * tl.exp2(-G)), DOT_BF16, PREC)
    else:
        p = _scores_slow(b_q, b_k, gp, t0, n_valid, Hkv * K, k0, K, BT, BK, DOT_BF16, PREC, SLOW_BLOCKS)
    return p, b_q, G


# ----------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------

@triton.jit
def _walk_range(seg_indices, n_seg, cu_seqlens, chunk_offsets, T, seg_len, Hkv: tl.constexpr,
                BT: tl.constexpr, SEGMENTED: tl.constexpr, IS_VARLEN: tl.constexpr):
    """What this program of a sequential pass (grid axis 2: segment x KV head) walks: its
    segment index i_sg, KV head i_h, sequence i_n, segment within the sequence i_s, the
    sequence bounds (bos, eos, c0), the sequence's chunk count NT and the chunk range
    [t_first, t_end). Unsegmented passes walk a whole sequence each (segment 0)."""
    i_sh = tl.program_id(2)
    i_sg = i_sh // Hkv
    i_h = i_sh % Hkv
    if SEGMENTED:
        if IS_VARLEN:
            i_n = tl.load(seg_indices + 2 * i_sg)
            i_s = tl.load(seg_indices + 2 * i_sg + 1)
        else:
            i_n = i_sg // n_seg
            i_s = i_sg % n_seg
    else:
        i_n = i_sg
        i_s = i_sg * 0
    bos, eos, c0 = _seq_bounds(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    NT = tl.cdiv(eos - bos, BT)
    if SEGMENTED:
        t_first = i_s * seg_len
        t_end = tl.minimum(NT, t_first + seg_len)
    else:
        t_first = NT * 0
        t_end = NT
    return i_sg, i_h, i_n, i_s, bos, eos, c0, NT, t_first, t_end


@triton.jit
def _store_dec(dec, slot, i_h, x, k0, Hkv: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    rk = k0 + tl.arange(0, BK)
    tl.store(dec + (slot * Hkv + i_h) * K + rk, x, mask=rk < K)


@triton.jit
def _chunk_gates_kernel(g, gbuf, cu_seqlens, chunk_offsets, chunk_indices, T,
                        Hkv: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                        IS_VARLEN: tl.constexpr):
    """keep_g = 2: every chunk's cumulative gates G (fp32, log2 units) into gbuf, one program
    per (K tile, chunk, KV head), before the state pass, which then reads them too."""
    i_k = tl.program_id(0)
    i_c = tl.program_id(1)
    i_h = tl.program_id(2)
    i_n, i_t = _chunk_coords(i_c, chunk_indices, T, BT, IS_VARLEN)
    bos, eos, c0 = _seq_bounds(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    t0 = bos + i_t * BT
    G, _ = _gates(g + i_h * K, t0, eos - t0, Hkv * K, i_k * BK, K, BT, BK)
    _store_rows(gbuf + i_h * K, G, t0, eos - t0, Hkv * K, i_k * BK, K, BT, BK)


@triton.jit
def _fwd_state_kernel(k, v, g, h0, ht, hbuf, dec, segend, cu_seqlens, chunk_offsets, seg_indices,
                      gbuf, T, seg_len, n_seg,
                      Hkv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      VS: tl.constexpr, VO: tl.constexpr, VU: tl.constexpr, NORM: tl.constexpr,
                      BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr,
                      STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr, SEGMENTED: tl.constexpr,
                      DOT_BF16: tl.constexpr, PREC: tl.constexpr, KEEP_G: tl.constexpr = 0):
    """Sequential over the chunks of one sequence (or of one segment of seg_len chunks), for
    one (K tile, V tile, KV head). hbuf[c0 + n + i] = state at the start of chunk i; entry NT
    is the final state.
    SEGMENTED: segment s > 0 starts from a zero state, so the states it writes are local; it
    leaves its first slot to _seg_combine_kernel, records in dec[slot] the log2 decay from
    its first chunk to each later slot, and puts its local end state in segend, from which
    the combine kernel chains the true segment starts and _seg_fixup_kernel adds
    2^dec * (true start) to the slots inside. Short walks fill the GPU when a few long
    sequences would leave most SMs idle.
    Only the last line of the loop depends on the carried state, so the next chunk's k, g, v
    are loaded one iteration ahead (by hand: the loop holds stores, which keeps Triton's
    pipeliner away) and their latency hides behind this chunk's work.
    KEEP_G = 1: the V-tile-0 programs also write each chunk's G to gbuf (fp32), which the
    other kernels then read instead of rebuilding it (_kept_gates); KEEP_G = 2: gbuf was
    written before (_chunk_gates_kernel) and this pass reads it too."""
    i_k = tl.program_id(0)
    i_v = tl.program_id(1)
    i_sg, i_h, i_n, i_s, bos, eos, c0, NT, t_first, t_end = _walk_range(
        seg_indices, n_seg, cu_seqlens, chunk_offsets, T, seg_len, Hkv, BT, SEGMENTED, IS_VARLEN)
    i_nh = i_n * Hkv + i_h
    k0 = i_k * BK
    v0 = i_v * BV

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        if i_s == 0:
            b_h += _load_state(h0 + i_nh.to(tl.int64) * K * VU, k0, v0, K, V, VU, BK, BV)
    # NORM: the normaliser's state z (column V: v's implicit column of ones), carried by
    # the V-tile-0 programs; z_next = 2^{G_last} z + sum_j k_j 2^{G_last - G_j}
    b_z = tl.zeros([BK], dtype=tl.float32)
    if NORM:
        if USE_H0:
            if i_s == 0:
                b_z += _load_col(h0 + i_nh.to(tl.int64) * K * VU, k0, K, V, VU, BK)
    b_d = tl.zeros([BK], dtype=tl.float32)                 # log2 decay since t_first
    kp = k + i_h * K
    gp = g + i_h * K
    vp = v + i_h * V
    # first chunk (all masked when the sequence is empty)
    t1 = bos + t_first * BT
    n_k = _load_rows(kp, t1, eos - t1, Hkv * K, k0, K, BT, BK)
    if KEEP_G == 2:
        Gp = gbuf + i_h * K
        n_G, n_Gl = _kept_gates(Gp, t1, eos - t1, Hkv * K, k0, K, BT, BK)
    else:
        n_g = _load_rows(gp, t1, eos - t1, Hkv * K, k0, K, BT, BK)
    n_v = _load_rows(vp, t1, eos - t1, Hkv * V, v0, V, BT, BV)
    for i_t in range(t_first, t_end):
        b_k = n_k.to(tl.float32)
        if KEEP_G == 2:
            G = n_G
            G_last = n_Gl
        else:
            b_g = n_g
        b_v = n_v
        t1 = bos + (i_t + 1) * BT                         # next chunk (masked past the end)
        n_k = _load_rows(kp, t1, eos - t1, Hkv * K, k0, K, BT, BK)
        if KEEP_G == 2:
            n_G, n_Gl = _kept_gates(Gp, t1, eos - t1, Hkv * K, k0, K, BT, BK)
        else:
            n_g = _load_rows(gp, t1, eos - t1, Hkv * K, k0, K, BT, BK)
        n_v = _load_rows(vp, t1, eos - t1, Hkv * V, v0, V, BT, BV)

        slot = c0 + i_n + i_t
        if (i_t > t_first) | (i_s == 0):
            _store_state(hbuf + (slot * Hkv + i_h) * K * VS, b_h, k0, v0, K, V, VS, BK, BV)
            if NORM:
                if i_v == 0:
                    _store_col(hbuf + (slot * Hkv + i_h) * K * VS, b_z, k0, K, V, VS, BK)
        if KEEP_G != 2:
            G, G_last = _cum_gates(b_g)
        if KEEP_G == 1:
            if i_v == 0:
                t_c = bos + i_t * BT
                _store_rows(gbuf + i_h * K, G, t_c, eos - t_c, Hkv * K, k0, K, BT, BK)
        if SEGMENTED:
            if (i_v == 0) & (i_t > t_first):
                _store_dec(dec, slot, i_h, b_d, k0, Hkv, K, BK)
            b_d += G_last
        # k decayed to the chunk end: exponent G_last - G <= 0.
        k_end = b_k * tl.exp2(G_last[None, :] - G)
        b_h = b_h * tl.exp2(G_last)[:, None] + _mm(tl.trans(k_end), b_v, DOT_BF16, PREC)
        if NORM:
            b_z = b_z * tl.exp2(G_last) + tl.sum(k_end, axis=0)
    if SEGMENTED:
        sp = segend + (i_sg * Hkv + i_h).to(tl.int64) * K * VS
        _store_state(sp, b_h, k0, v0, K, V, VS, BK, BV)
        if i_v == 0:
            _store_dec(dec, c0 + i_n + t_end, i_h, b_d, k0, Hkv, K, BK)
            if NORM:
                _store_col(sp, b_z, k0, K, V, VS, BK)
    else:
        hp = hbuf + ((c0 + i_n + NT) * Hkv + i_h) * K * VS
        _store_state(hp, b_h, k0, v0, K, V, VS, BK, BV)
        if STORE_HT:
            _store_state(ht + i_nh.to(tl.int64) * K * VU, b_h, k0, v0, K, V, VU, BK, BV)
        if NORM:
            if i_v == 0:
                _store_col(hp, b_z, k0, K, V, VS, BK)
                if STORE_HT:
                    _store_col(ht + i_nh.to(tl.int64) * K * VU, b_z, k0, K, V, VU, BK)


@triton.jit
def _seg_combine_kernel(buf, dec, segend, hfinal, cu_seqlens, chunk_offsets, seg_offsets, T,
                        seg_len, n_seg,
                        Hkv: tl.constexpr, K: tl.constexpr, V: tl.constexpr, VU: tl.constexpr,
                        BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, REVERSE: tl.constexpr,
                        STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Chains the segments of one sequence (one K tile, V tile, KV head): a walk over the
    few segments, not the chunks. Forward: the true state at the end of segment s is
    segend_s + 2^{dec[end_s]} * (true state at its start), written to buf at end_s (the
    first segment started from h0, so its end is already true); the last one is ht.
    REVERSE (dh pass): the same from the last segment down, written at each segment's first
    slot; the first segment's start is dh0.
    V: the row width of buf and segend, every column handled (with the normaliser's padded
    rows the pad columns are chained too, never read elsewhere: a mask inside an 8-column
    group would force scalar loads); VU: the width of hfinal (the caller's [.., K, VU])."""
    i_k = tl.program_id(0)
    i_v = tl.program_id(1)
    i_nh = tl.program_id(2)
    i_n = i_nh // Hkv
    i_h = i_nh % Hkv
    bos, eos, c0 = _seq_bounds(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    NT = tl.cdiv(eos - bos, BT)
    if IS_VARLEN:
        s0 = tl.load(seg_offsets + i_n)
        S = tl.load(seg_offsets + i_n + 1) - s0
    else:
        s0 = i_n * n_seg
        S = n_seg
    k0 = i_k * BK
    v0 = i_v * BV
    rk = k0 + tl.arange(0, BK)
    mk = rk < K
    base = c0 + i_n
    if REVERSE:
        b_h = _load_state(segend + ((s0 + S - 1) * Hkv + i_h).to(tl.int64) * K * V,
                          k0, v0, K, V, V, BK, BV)
        slot = base + (S - 1) * seg_len
        _store_state(buf + (slot * Hkv + i_h) * K * V, b_h, k0, v0, K, V, V, BK, BV)
        for i in range(1, S):
            slot = base + (S - 1 - i) * seg_len
            a = tl.exp2(tl.load(dec + (slot * Hkv + i_h) * K + rk, mask=mk, other=0.0))
            sp = segend + ((s0 + S - 1 - i) * Hkv + i_h).to(tl.int64) * K * V
            b_h = a[:, None] * b_h + _load_state(sp, k0, v0, K, V, V, BK, BV)
            _store_state(buf + (slot * Hkv + i_h) * K * V, b_h, k0, v0, K, V, V, BK, BV)
    else:
        b_h = _load_state(segend + (s0 * Hkv + i_h).to(tl.int64) * K * V, k0, v0, K, V, V, BK, BV)
        slot = base + tl.minimum(NT, seg_len)
        _store_state(buf + (slot * Hkv + i_h) * K * V, b_h, k0, v0, K, V, V, BK, BV)
        for s in range(1, S):
            slot = base + tl.minimum(NT, (s + 1) * seg_len)
            a = tl.exp2(tl.load(dec + (slot * Hkv + i_h) * K + rk, mask=mk, other=0.0))
            b_h = a[:, None] * b_h + _load_state(
                segend + ((s0 + s) * Hkv + i_h).to(tl.int64) * K * V, k0, v0, K, V, V, BK, BV)
            _store_state(buf + (slot * Hkv + i_h) * K * V, b_h, k0, v0, K, V, V, BK, BV)
    if STORE_FINAL:
        _store_state(hfinal + i_nh.to(tl.int64) * K * VU, b_h, k0, v0, K, VU, VU, BK, BV)


@triton.jit
def _seg_fixup_kernel(buf, dec, cu_seqlens, chunk_offsets, chunk_indices, T, seg_len,
                      Hkv: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr,
                      REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Turns the local state of one chunk slot into the true one, all chunks in parallel:
    state += 2^dec[slot] * (true state at the segment's anchor), the anchor being the
    segment's first slot (forward) or its end (REVERSE). Slots of the segment that started
    from the true state (the first forward, the last in reverse) and the anchors themselves
    are left alone."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_n, i_t = _chunk_coords(i_c, chunk_indices, T, BT, IS_VARLEN)
    bos, eos, c0 = _seq_bounds(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    NT = tl.cdiv(eos - bos, BT)
    s = i_t // seg_len
    inside = (i_t % seg_len) != 0
    if REVERSE:
        anchor = (s + 1) * seg_len
        active = inside & (anchor < NT)
    else:
        anchor = s * seg_len
        active = inside & (s > 0)
    if active:
        slot = c0 + i_n + i_t
        aslot = c0 + i_n + anchor
        for i_k in range(NK):
            rk = i_k * BK + tl.arange(0, BK)
            a = tl.exp2(tl.load(dec + (slot * Hkv + i_h) * K + rk, mask=rk < K, other=0.0))
            for i_v in range(NV):
                sp = buf + (slot * Hkv + i_h) * K * V
                ap = buf + (aslot * Hkv + i_h) * K * V
                x = (_load_state(sp, i_k * BK, i_v * BV, K, V, V, BK, BV)
                     + a[:, None] * _load_state(ap, i_k * BK, i_v * BV, K, V, V, BK, BV))
                _store_state(sp, x, i_k * BK, i_v * BV, K, V, V, BK, BV)


@triton.jit
def _fwd_output_kernel(q, k, v, g, o, hbuf, pbuf, gbuf, cu_seqlens, chunk_offsets, chunk_indices, T, scale,
                       H: tl.constexpr, Hkv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                       VS: tl.constexpr, VO: tl.constexpr, NORM: tl.constexpr,
                       BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       NK: tl.constexpr, NV: tl.constexpr, R: tl.constexpr,
                       IS_VARLEN: tl.constexpr, DOT_BF16: tl.constexpr, PREC: tl.constexpr,
                       SLOW_BLOCKS: tl.constexpr, PATH: tl.constexpr = 0,
                       STORE_P: tl.constexpr = 0, KEEP_G: tl.constexpr = 0):
    """o for one chunk and every query head of one KV group. When K fits one tile the k-side
    work (loads, 2^G, k 2^-G) is done once for the group; otherwise it is redone per head.
    NORM: column V of o gets the normaliser s * (rowsum(mask(P)) + (q 2^G) z), what a column
    of ones in v would give. STORE_P: s * mask(P) is also written to pbuf ([tokens, H, BT],
    the backward's dv reads it instead of rebuilding it)."""
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    i_n, i_t = _chunk_coords(i_c, chunk_indices, T, BT, IS_VARLEN)
    bos, eos, c0 = _seq_bounds(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    t0 = bos + i_t * BT
    n_valid = eos - t0
    hp = hbuf + ((c0 + i_n + i_t) * Hkv + i_h) * K * VS
    rows = tl.arange(0, BT)
    causal = rows[:, None] >= rows[None, :]
    kp = k + i_h * K
    gp = g + i_h * K
    vp = v + i_h * V

    if NK == 1:
        b_k = _load_rows(kp, t0, n_valid, Hkv * K, 0, K, BT, BK).to(tl.float32)
        if KEEP_G:
            G, G_last = _kept_gates(gbuf + i_h * K, t0, n_valid, Hkv * K, 0, K, BT, BK)
        else:
            G, G_last = _gates(gp, t0, n_valid, Hkv * K, 0, K, BT, BK)
        e_q = tl.exp2(G)
        fast = tl.max(-G_last, axis=0) < _SAFE
        if PATH > 0:                   # split_slow (_paths): launch 1 takes the one-matmul
            if fast != (PATH == 1):    # chunks, launch 2 the others, each compiled with one path
                return
            fast = PATH == 1
        if fast:
            k_e = _op(b_k * tl.exp2(-G), DOT_BF16)
        else:
            k_e = _op(b_k, DOT_BF16)                        # unused
        for r in range(R):
            hq = i_h * R + r
            qp = q + hq * K
            b_q = _load_rows(qp, t0, n_valid, H * K, 0, K, BT, BK).to(tl.float32)
            q_e = _op(b_q * e_q, DOT_BF16)
            if fast:
                P = _mm(q_e, tl.trans(k_e), DOT_BF16, PREC)
            else:
                P = _scores_slow(b_q, b_k, gp, t0, n_valid, Hkv * K, 0, K, BT, BK, DOT_BF16, PREC, SLOW_BLOCKS)
            P = tl.where(causal, P, 0.0)
            if STORE_P:
                _store_rows(pbuf + hq * BT, P * scale, t0, n_valid, H * BT, 0, BT, BT, BT)
            if NORM:
                z = _load_col(hp, 0, K, V, VS, BK)
                den = tl.sum(P, axis=1) + tl.sum(b_q * e_q * z[None, :], axis=1)
                _store_den(o + hq * VO, den * scale, t0, n_valid, H * VO, V, BT)
            for i_v in range(NV):
                b_v = _load_rows(vp, t0, n_valid, Hkv * V, i_v * BV, V, BT, BV)
                b_hs = _load_state(hp, 0, i_v * BV, K, V, VS, BK, BV)
                acc = _mm(P, b_v, DOT_BF16, PREC) + _mm(q_e, b_hs, DOT_BF16, PREC)
                _store_rows(o + hq * VO, acc * scale, t0, n_valid, H * VO, i_v * BV, V, BT, BV)
    else:
        for r in range(R):
            hq = i_h * R + r
            qp = q + hq * K
            P = tl.zeros([BT, BT], dtype=tl.float32)
            den = tl.zeros([BT], dtype=tl.float32)
            for i_k in range(NK):
                p, b_q, G = _score_tile(qp, kp, gp, t0, n_valid, i_k * BK, H, Hkv, K, BT, BK,
                                        DOT_BF16, PREC, SLOW_BLOCKS)
                P += p
                if NORM:
                    z = _load_col(hp, i_k * BK, K, V, VS, BK)
                    den += tl.sum(b_q * tl.exp2(G) * z[None, :], axis=1)
            P = tl.where(causal, P, 0.0)
            if STORE_P:
                _store_rows(pbuf + hq * BT, P * scale, t0, n_valid, H * BT, 0, BT, BT, BT)
            if NORM:
                _store_den(o + hq * VO, (den + tl.sum(P, axis=1)) * scale, t0, n_valid, H * VO,
                           V, BT)
            for i_v in range(NV):
                b_v = _load_rows(vp, t0, n_valid, Hkv * V, i_v * BV, V, BT, BV)
                acc = _mm(P, b_v, DOT_BF16, PREC)
                for i_k in range(NK):
                    b_q = _load_rows(qp, t0, n_valid, H * K, i_k * BK, K, BT, BK).to(tl.float32)
                    G, _ = _gates(gp, t0, n_valid, Hkv * K, i_k * BK, K, BT, BK)
                    b_hs = _load_state(hp, i_k * BK, i_v * BV, K, V, VS, BK, BV)
                    acc += _mm(b_q * tl.exp2(G), b_hs, DOT_BF16, PREC)
                _store_rows(o + hq * VO, acc * scale, t0, n_valid, H * VO, i_v * BV, V, BT, BV)


# ----------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------

@triton.jit
def _bwd_dh_kernel(q, g, do, dht, dh0, dhbuf, dec, segend, cu_seqlens, chunk_offsets, seg_indices,
                   gbuf, T, seg_len, n_seg, scale,
                   H: tl.constexpr, Hkv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   VS: tl.constexpr, VO: tl.constexpr, VU: tl.constexpr, NORM: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, R: tl.constexpr,
                   USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IS_VARLEN: tl.constexpr,
                   SEGMENTED: tl.constexpr, DOT_BF16: tl.constexpr, PREC: tl.constexpr,
                   KEEP_G: tl.constexpr = 0):
    """Reverse walk: dhbuf[c0 + n + i] = gradient of the state at the start of chunk i,
    dh_i = 2^{G_last} dh_{i+1} + s * sum_heads (q 2^G)^T do; entry NT = dht (or 0).
    SEGMENTED mirrors the forward pass: every segment but the last starts from zero at its
    end, writes its inside slots, dec[slot] = log2 decay from each slot to its end, and its
    local first-slot value into segend (see _seg_combine_kernel, _seg_fixup_kernel).
    As in the forward pass, the loads run one step ahead: g one chunk ahead, (q, do) one
    (chunk, head) pair ahead.
    NORM: the V-tile-0 programs also carry dz (the normaliser's column), fed by column V
    of do: dz_i = 2^{G_last} dz_{i+1} + s * sum_heads (q 2^G)^T do[:, V]."""
    i_k = tl.program_id(0)
    i_v = tl.program_id(1)
    i_sg, i_h, i_n, i_s, bos, eos, c0, NT, t_first, t_end = _walk_range(
        seg_indices, n_seg, cu_seqlens, chunk_offsets, T, seg_len, Hkv, BT, SEGMENTED, IS_VARLEN)
    i_nh = i_n * Hkv + i_h
    last = t_end == NT
    k0 = i_k * BK
    v0 = i_v * BV

    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        if last:
            b_dh += _load_state(dht + i_nh.to(tl.int64) * K * VU, k0, v0, K, V, VU, BK, BV)
    b_dz = tl.zeros([BK], dtype=tl.float32)
    if NORM:
        if USE_DHT:
            if last:
                b_dz += _load_col(dht + i_nh.to(tl.int64) * K * VU, k0, K, V, VU, BK)
    if last:
        hp = dhbuf + ((c0 + i_n + NT) * Hkv + i_h) * K * VS
        _store_state(hp, b_dh, k0, v0, K, V, VS, BK, BV)
        if NORM:
            if i_v == 0:
                _store_col(hp, b_dz, k0, K, V, VS, BK)
    b_d = tl.zeros([BK], dtype=tl.float32)                 # log2 decay down to t_end
    gp = g + i_h * K
    qp = q + i_h * R * K
    dop = do + i_h * R * VO
    # last chunk, first head of the group (all masked when the segment is empty)
    t_last = bos + (t_end - 1) * BT
    n_last = tl.where(t_end > t_first, eos - t_last, 0)
    if KEEP_G:                     # the kept G (and G_last), loaded at each step: fp32 tiles
        Gp = gbuf + i_h * K        # one chunk ahead cost registers (ptxas D128: 176 -> 668 B spilled)
    else:
        n_g = _load_rows(gp, t_last, n_last, Hkv * K, k0, K, BT, BK)
    n_q = _load_rows(qp, t_last, n_last, H * K, k0, K, BT, BK)
    n_do = _load_rows(dop, t_last, n_last, H * VO, v0, V, BT, BV)
    for i in range(t_end - t_first):
        i_t = t_end - 1 - i
        t0 = bos + i_t * BT
        # previous chunk's g (nothing left to load at the segment's first chunk)
        t_prev = t0 - BT
        n_prev = tl.where(i_t > t_first, eos - t_prev, 0)
        if KEEP_G:
            G, G_last = _kept_gates(Gp, t0, eos - t0, Hkv * K, k0, K, BT, BK)
        else:
            b_g = n_g
            n_g = _load_rows(gp, t_prev, n_prev, Hkv * K, k0, K, BT, BK)
            G, G_last = _cum_gates(b_g)
        e_q = tl.exp2(G)
        acc = tl.zeros([BK, BV], dtype=tl.float32)
        acc_z = tl.zeros([BK], dtype=tl.float32)
        for r in range(R):
            b_q = n_q.to(tl.float32)
            b_do = n_do
            if NORM:
                dden = _load_den_grad(dop + r * VO, t0, eos - t0, H * VO, V, BT)
                acc_z += tl.sum(b_q * e_q * dden[:, None], axis=0)
            # next (chunk, head) pair: the next head here, else the first head one chunk back
            if r + 1 < R:
                t_n = t0
                n_n = eos - t0
                r_n = r + 1
            else:
                t_n = t_prev
                n_n = n_prev
                r_n = 0
            n_q = _load_rows(qp + r_n * K, t_n, n_n, H * K, k0, K, BT, BK)
            n_do = _load_rows(dop + r_n * VO, t_n, n_n, H * VO, v0, V, BT, BV)
            acc += _mm(tl.trans(b_q * e_q), b_do, DOT_BF16, PREC)
        b_dh = b_dh * tl.exp2(G_last)[:, None] + acc * scale
        if NORM:
            b_dz = b_dz * tl.exp2(G_last) + acc_z * scale
        slot = c0 + i_n + i_t
        if SEGMENTED:
            b_d += G_last
            if i_v == 0:
                _store_dec(dec, slot, i_h, b_d, k0, Hkv, K, BK)
            write = i_t > t_first                # the first slot is the combine kernel's
        else:
            write = i_t >= 0
        if write:
            sp = dhbuf + (slot * Hkv + i_h) * K * VS
            _store_state(sp, b_dh, k0, v0, K, V, VS, BK, BV)
            if NORM:
                if i_v == 0:
                    _store_col(sp, b_dz, k0, K, V, VS, BK)
    if SEGMENTED:
        fp = segend + (i_sg * Hkv + i_h).to(tl.int64) * K * VS
        _store_state(fp, b_dh, k0, v0, K, V, VS, BK, BV)
        if NORM:
            if i_v == 0:
                _store_col(fp, b_dz, k0, K, V, VS, BK)
    elif STORE_DH0:
        fp = dh0 + i_nh.to(tl.int64) * K * VU
        _store_state(fp, b_dh, k0, v0, K, V, VU, BK, BV)
        if NORM:
            if i_v == 0:
                _store_col(fp, b_dz, k0, K, V, VU, BK)


@triton.jit
def _bwd_dqkg_kernel(q, k, v, g, do, hbuf, dhbuf, pbuf, gbuf, dq, dk, dg, dv, cu_seqlens,
                     chunk_offsets, chunk_indices, T, scale,
                     H: tl.constexpr, Hkv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                     VS: tl.constexpr, VO: tl.constexpr, NORM: tl.constexpr,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NV: tl.constexpr,
                     R: tl.constexpr, WITH_DV: tl.constexpr, IS_VARLEN: tl.constexpr,
                     DOT_BF16: tl.constexpr, PREC: tl.constexpr, SLOW_BLOCKS: tl.constexpr,
                     PATH: tl.constexpr = 0, ONE_PASS: tl.constexpr = 0, LOAD_P: tl.constexpr = 0,
                     KEEP_G: tl.constexpr = 0):
    """dq (every head of the group), dk and dg for one chunk, one K tile, one KV head; also
    dv when WITH_DV (one K tile and one V tile cover everything: the separate dv kernel,
    with its second read of q, k, g, do, is then skipped).
      dP = s * mask(do v^T), split into its diagonal d and its strictly lower part L
      dq = 2^G * (s do h_n^T + L (k 2^-G)) + d * k
      dk = 2^{G_last - G} * (v dh_{n+1}^T) + 2^-G * sum_heads L^T (q 2^G) + sum_heads d * q
      dv = (k 2^{G_last - G}) dh_{n+1} + s * sum_heads mask(P)^T do
    dg = revcumsum(q dq - k dk) + <h_{n+1}, dh_{n+1}>_v is evaluated without its O(1)
    cancelling parts, so strong decays (true dg ~ e^-20) keep their relative precision:
      * the diagonal terms q d k and k d q are equal and left out of both;
      * <h_{n+1}, dh_{n+1}> - revcumsum(k dk_inter) = 2^{G_last} <h_n, dh_{n+1}>
        + exclusive cumsum(k dk_inter): only the paths that cross step s remain.
    ONE_PASS (one query head per KV head): the inter-chunk terms are taken in the same V loop
    as dP, so each tile of v and h is loaded once instead of twice. LOAD_P: dv's s * mask(P)
    is read from pbuf (written by the forward) instead of rebuilt."""
    i_k = tl.program_id(0)
    i_c = tl.program_id(1)
    i_h = tl.program_id(2)
    i_n, i_t = _chunk_coords(i_c, chunk_indices, T, BT, IS_VARLEN)
    bos, eos, c0 = _seq_bounds(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    t0 = bos + i_t * BT
    n_valid = eos - t0
    k0 = i_k * BK
    st_n = ((c0 + i_n + i_t) * Hkv + i_h) * K * VS          # state at this chunk's start
    st_next = st_n + Hkv * K * VS                              # ... and at the next chunk's
    rows = tl.arange(0, BT)
    diag = rows[:, None] == rows[None, :]
    strict = rows[:, None] > rows[None, :]
    kp = k + i_h * K
    gp = g + i_h * K
    vp = v + i_h * V

    # Live ranges are kept short (this kernel sits at the 255-register cap): k stays in its
    # input dtype and is widened where used, and of the decay factors only G is kept;
    # 2^G and 2^-G are recomputed at each use (a few thousand exps per program are cheaper
    # than spilled tiles; ptxas, sm_90, bf16 K=V=64 at 4 warps: 1204 -> 1016 spilled bytes,
    # H200 8x2048 H32 D64 f+b 1.246 -> 1.152 ms).
    b_kr = _load_rows(kp, t0, n_valid, Hkv * K, k0, K, BT, BK)
    if KEEP_G:
        G, G_last = _kept_gates(gbuf + i_h * K, t0, n_valid, Hkv * K, k0, K, BT, BK)
    else:
        G, G_last = _gates(gp, t0, n_valid, Hkv * K, k0, K, BT, BK)
    fast = tl.max(-G_last, axis=0) < _SAFE
    if PATH > 0:                   # split_slow (_paths): launch 1 takes the one-matmul
        if fast != (PATH == 1):    # chunks, launch 2 the others, each compiled with one path
            return
        fast = PATH == 1
    if fast:
        k_e = _op(b_kr.to(tl.float32) * tl.exp2(-G), DOT_BF16)     # <= 2^SAFE
    else:
        k_e = _op(b_kr, DOT_BF16)                          # unused
    if WITH_DV:
        b_v = _load_rows(vp, t0, n_valid, Hkv * V, 0, V, BT, BV)
        b_dv = tl.zeros([BT, BV], dtype=tl.float32)

    dk_acc = tl.zeros([BT, BK], dtype=tl.float32)          # intra-chunk dk, all heads
    dg_acc = tl.zeros([BT, BK], dtype=tl.float32)          # q dq - k dk without the diagonal
    dk_inter = tl.zeros([BT, BK], dtype=tl.float32)        # v dh_{n+1}^T, before its decay
    hdh = tl.zeros([BK], dtype=tl.float32)                 # <h_n, dh_{n+1}>_v
    for r in range(R):
        hq = i_h * R + r
        b_qr = _load_rows(q + hq * K, t0, n_valid, H * K, k0, K, BT, BK)
        q_e = _op(b_qr.to(tl.float32) * tl.exp2(G), DOT_BF16)
        if WITH_DV:
            b_do = _load_rows(do + hq * VO, t0, n_valid, H * VO, 0, V, BT, BV)
            b_h = _load_state(hbuf + st_n, k0, 0, K, V, VS, BK, BV)
            dP = _mm(b_do, tl.trans(b_v), DOT_BF16, PREC)
            dq_h = _mm(b_do, tl.trans(b_h), DOT_BF16, PREC)
            if ONE_PASS:
                b_dh1 = _load_state(dhbuf + st_next, k0, 0, K, V, VS, BK, BV)
                dk_inter += _mm(b_v, tl.trans(b_dh1), DOT_BF16, PREC)
                hdh += tl.sum(b_h * b_dh1, axis=1)
                b_dv += _mm(b_kr.to(tl.float32) * tl.exp2(G_last[None, :] - G), b_dh1, DOT_BF16, PREC)
            # dv's intra part first, so that P dies before dq and dk are built
            if LOAD_P:
                P = _load_rows(pbuf + hq * BT, t0, n_valid, H * BT, 0, BT, BT, BT)
            else:
                if fast:
                    P = _mm(q_e, tl.trans(k_e), DOT_BF16, PREC)
                else:
                    P = _scores_slow(b_qr.to(tl.float32), b_kr.to(tl.float32), gp, t0, n_valid,
                                     Hkv * K, k0, K, BT, BK, DOT_BF16, PREC, SLOW_BLOCKS)
                P = tl.where(rows[:, None] >= rows[None, :], P * scale, 0.0)
            b_dv += _mm(tl.trans(P), b_do, DOT_BF16, PREC)
        else:
            dP = tl.zeros([BT, BT], dtype=tl.float32)
            dq_h = tl.zeros([BT, BK], dtype=tl.float32)
            for i_v in range(NV):
                b_do = _load_rows(do + hq * VO, t0, n_valid, H * VO, i_v * BV, V, BT, BV)
                b_vt = _load_rows(vp, t0, n_valid, Hkv * V, i_v * BV, V, BT, BV)
                b_h = _load_state(hbuf + st_n, k0, i_v * BV, K, V, VS, BK, BV)
                dP += _mm(b_do, tl.trans(b_vt), DOT_BF16, PREC)
                dq_h += _mm(b_do, tl.trans(b_h), DOT_BF16, PREC)
                if ONE_PASS:
                    b_dh1 = _load_state(dhbuf + st_next, k0, i_v * BV, K, V, VS, BK, BV)
                    dk_inter += _mm(b_vt, tl.trans(b_dh1), DOT_BF16, PREC)
                    hdh += tl.sum(b_h * b_dh1, axis=1)
        if NORM:
            # v's implicit column of ones (state column z): dP_ij += dden_i, dq_h += dden z
            dden = _load_den_grad(do + hq * VO, t0, n_valid, H * VO, V, BT)
            dP += dden[:, None]
            dq_h += dden[:, None] * _load_col(hbuf + st_n, k0, K, V, VS, BK)[None, :]
        dP = dP * scale
        d = tl.sum(tl.where(diag, dP, 0.0), axis=1)        # [BT]
        dP = tl.where(strict, dP, 0.0)
        b_q = b_qr.to(tl.float32)
        if fast:
            b_dq = (dq_h * scale + _mm(dP, k_e, DOT_BF16, PREC)) * tl.exp2(G)
            dk_low = _mm(tl.trans(dP), q_e, DOT_BF16, PREC) * tl.exp2(-G)
        else:
            dq_s, dk_low = _dqk_slow(dP, b_q, b_kr.to(tl.float32), gp, t0, n_valid, Hkv * K, k0,
                                     K, BT, BK, DOT_BF16, PREC, SLOW_BLOCKS)
            b_dq = dq_h * (tl.exp2(G) * scale) + dq_s
        b_k = b_kr.to(tl.float32)
        dg_acc += b_q * b_dq - b_k * dk_low
        dk_acc += dk_low + d[:, None] * b_q
        _store_rows(dq + hq * K, b_dq + d[:, None] * b_k, t0, n_valid, H * K, k0, K, BT, BK)

    # Inter-chunk part of dk (and dv), and <h_n, dh_{n+1}> over the whole V.
    e_end = tl.exp2(G_last[None, :] - G)                   # exponent <= 0 on both paths
    if not ONE_PASS:
        for i_v in range(NV):
            b_vt = _load_rows(vp, t0, n_valid, Hkv * V, i_v * BV, V, BT, BV)
            b_dh1 = _load_state(dhbuf + st_next, k0, i_v * BV, K, V, VS, BK, BV)
            b_h = _load_state(hbuf + st_n, k0, i_v * BV, K, V, VS, BK, BV)
            dk_inter += _mm(b_vt, tl.trans(b_dh1), DOT_BF16, PREC)
            hdh += tl.sum(b_h * b_dh1, axis=1)
            if WITH_DV:
                b_dv += _mm(b_kr.to(tl.float32) * e_end, b_dh1, DOT_BF16, PREC)
    if NORM:
        dz1 = _load_col(dhbuf + st_next, k0, K, V, VS, BK)
        dk_inter += tl.where(rows < n_valid, 1.0, 0.0)[:, None] * dz1[None, :]
        hdh += _load_col(hbuf + st_n, k0, K, V, VS, BK) * dz1
    if WITH_DV:
        _store_rows(dv + i_h * V, b_dv, t0, n_valid, Hkv * V, 0, V, BT, BV)
    dk_inter = dk_inter * e_end
    _store_rows(dk + i_h * K, dk_acc + dk_inter, t0, n_valid, Hkv * K, k0, K, BT, BK)
    b_dg = (tl.cumsum(dg_acc, axis=0, reverse=True)
            + _excl_cumsum(b_kr.to(tl.float32) * dk_inter, BT)
            + (tl.exp2(G_last) * hdh)[None, :])
    _store_rows(dg + i_h * K, b_dg, t0, n_valid, Hkv * K, k0, K, BT, BK)


@triton.jit
def _bwd_dv_kernel(q, k, g, do, dhbuf, pbuf, gbuf, dv, cu_seqlens, chunk_offsets, chunk_indices, T,
                   scale,
                   H: tl.constexpr, Hkv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   VS: tl.constexpr, VO: tl.constexpr, NORM: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, NK: tl.constexpr,
                   R: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_BF16: tl.constexpr,
                   PREC: tl.constexpr, SLOW_BLOCKS: tl.constexpr, ALL_V: tl.constexpr = 0,
                   PATH: tl.constexpr = 0, LOAD_P: tl.constexpr = 0, KEEP_G: tl.constexpr = 0):
    """dv = (k 2^{G_last - G}) dh_{n+1} + s * sum_heads mask(P)^T do, one chunk, one V tile.
    ALL_V > 0 (one query head per KV head, one K tile): one program per chunk walks ALL_V
    V tiles with P built once, instead of one program per V tile each rebuilding it.
    LOAD_P: s * mask(P) is read from pbuf (written by the forward): no q, no score matmul."""
    i_v = tl.program_id(0)
    i_c = tl.program_id(1)
    i_h = tl.program_id(2)
    i_n, i_t = _chunk_coords(i_c, chunk_indices, T, BT, IS_VARLEN)
    bos, eos, c0 = _seq_bounds(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    t0 = bos + i_t * BT
    n_valid = eos - t0
    v0 = i_v * BV
    st_next = ((c0 + i_n + i_t + 1) * Hkv + i_h) * K * VS
    rows = tl.arange(0, BT)
    causal = rows[:, None] >= rows[None, :]
    kp = k + i_h * K
    gp = g + i_h * K

    if NK == 1:
        b_k = _load_rows(kp, t0, n_valid, Hkv * K, 0, K, BT, BK).to(tl.float32)
        if KEEP_G:
            G, G_last = _kept_gates(gbuf + i_h * K, t0, n_valid, Hkv * K, 0, K, BT, BK)
        else:
            G, G_last = _gates(gp, t0, n_valid, Hkv * K, 0, K, BT, BK)
        e_q = tl.exp2(G)
        fast = tl.max(-G_last, axis=0) < _SAFE
        if PATH > 0:                   # split_slow (_paths): launch 1 takes the one-matmul
            if fast != (PATH == 1):    # chunks, launch 2 the others, each compiled with one path
                return
            fast = PATH == 1
        if fast:
            k_e = b_k * tl.exp2(-G)
            k_end = k_e * tl.exp2(G_last)[None, :]
        else:
            k_e = b_k                                       # unused
            k_end = b_k * tl.exp2(G_last[None, :] - G)
        k_e = _op(k_e, DOT_BF16)
    if ALL_V > 0:
        if LOAD_P:
            P = _op(tl.trans(_load_rows(pbuf + i_h * BT, t0, n_valid, H * BT, 0, BT, BT, BT)), DOT_BF16)
        else:
            b_q = _load_rows(q + i_h * K, t0, n_valid, H * K, 0, K, BT, BK).to(tl.float32)
            if fast:
                P = _mm(b_q * e_q, tl.trans(k_e), DOT_BF16, PREC)
            else:
                P = _scores_slow(b_q, b_k, gp, t0, n_valid, Hkv * K, 0, K, BT, BK, DOT_BF16, PREC, SLOW_BLOCKS)
            P = _op(tl.trans(tl.where(causal, P * scale, 0.0)), DOT_BF16)
        k_end = _op(k_end, DOT_BF16)
        for i_v in range(ALL_V):
            b_dh1 = _load_state(dhbuf + st_next, 0, i_v * BV, K, V, VS, BK, BV)
            b_do = _load_rows(do + i_h * VO, t0, n_valid, H * VO, i_v * BV, V, BT, BV)
            b_dv = _mm(k_end, b_dh1, DOT_BF16, PREC) + _mm(P, b_do, DOT_BF16, PREC)
            _store_rows(dv + i_h * V, b_dv, t0, n_valid, Hkv * V, i_v * BV, V, BT, BV)
    elif NK == 1:
        b_dh1 = _load_state(dhbuf + st_next, 0, v0, K, V, VS, BK, BV)
        b_dv = _mm(k_end, b_dh1, DOT_BF16, PREC)
        for r in range(R):
            hq = i_h * R + r
            if LOAD_P:
                P = _load_rows(pbuf + hq * BT, t0, n_valid, H * BT, 0, BT, BT, BT)
            else:
                b_q = _load_rows(q + hq * K, t0, n_valid, H * K, 0, K, BT, BK).to(tl.float32)
                if fast:
                    P = _mm(b_q * e_q, tl.trans(k_e), DOT_BF16, PREC)
                else:
                    P = _scores_slow(b_q, b_k, gp, t0, n_valid, Hkv * K, 0, K, BT, BK, DOT_BF16, PREC, SLOW_BLOCKS)
                P = tl.where(causal, P * scale, 0.0)
            b_do = _load_rows(do + hq * VO, t0, n_valid, H * VO, v0, V, BT, BV)
            b_dv += _mm(tl.trans(P), b_do, DOT_BF16, PREC)
    else:
        b_dv = tl.zeros([BT, BV], dtype=tl.float32)
        for i_k in range(NK):
            b_k = _load_rows(kp, t0, n_valid, Hkv * K, i_k * BK, K, BT, BK).to(tl.float32)
            G, G_last = _gates(gp, t0, n_valid, Hkv * K, i_k * BK, K, BT, BK)
            b_dh1 = _load_state(dhbuf + st_next, i_k * BK, v0, K, V, VS, BK, BV)
            b_dv += _mm(b_k * tl.exp2(G_last[None, :] - G), b_dh1, DOT_BF16, PREC)
        for r in range(R):
            hq = i_h * R + r
            qp = q + hq * K
            if LOAD_P:
                P = _load_rows(pbuf + hq * BT, t0, n_valid, H * BT, 0, BT, BT, BT).to(tl.float32)
            else:
                P = tl.zeros([BT, BT], dtype=tl.float32)
                for i_k in range(NK):
                    p, _, _ = _score_tile(qp, kp, gp, t0, n_valid, i_k * BK, H, Hkv, K, BT, BK,
                                          DOT_BF16, PREC, SLOW_BLOCKS)
                    P += p
                P = tl.where(causal, P * scale, 0.0)
            b_do = _load_rows(do + hq * VO, t0, n_valid, H * VO, v0, V, BT, BV)
            b_dv += _mm(tl.trans(P), b_do, DOT_BF16, PREC)
    if ALL_V == 0:
        _store_rows(dv + i_h * V, b_dv, t0, n_valid, Hkv * V, v0, V, BT, BV)


# ----------------------------------------------------------------------------------------
# Decoding: token by token
# ----------------------------------------------------------------------------------------

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
        b_h += _load_state(h0 + i_nh.to(tl.int64) * K * V, 0, i_v * BV, K, V, V, BK, BV)
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
        _store_state(ht + i_nh.to(tl.int64) * K * V, b_h, 0, i_v * BV, K, V, V, BK, BV)


# ----------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b). triton.cdiv is a constexpr function whose call costs ~5 us on
    the host, and a launch plan makes a dozen of them per call."""
    return -(-a // b)


def _new(shape, dtype, device):
    """Output buffer; full of NaN when POISON is set so unwritten entries are caught."""
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _check(q, k, v, g, initial_state, cu_seqlens, chunked: bool, normalizer: bool = False):
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g)):
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, T, heads, dim], got "
                             f"{getattr(x, 'shape', type(x))}")
    B, T, H, K = q.shape
    if k.shape[:2] != (B, T) or v.shape[:2] != (B, T) or g.shape[:2] != (B, T):
        raise ValueError(f"q, k, v, g must share [B, T]: got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}, {tuple(g.shape)}")
    Hkv = k.shape[2]
    if k.shape[3] != K or g.shape != k.shape or v.shape[2] != Hkv:
        raise ValueError(f"k and g must be [B, T, Hkv, K] and v [B, T, Hkv, V] with q's K: got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, g {tuple(g.shape)}, v {tuple(v.shape)}")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"the number of query heads ({H}) must be a multiple of KV heads ({Hkv})")
    V = v.shape[3]
    if not 16 <= K <= 256:
        raise ValueError(f"key head dim K={K} is outside the supported 16..256")
    if not 1 <= V <= 257:
        raise ValueError(f"value head dim V={V} is outside the supported 1..257")
    if q.dtype not in _DTYPES or any(x.dtype != q.dtype for x in (k, v, g)):
        raise ValueError(f"q, k, v, g must share one dtype among bf16/fp16/fp32: got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}, {g.dtype}")
    devices = {x.device for x in (q, k, v, g)}
    if len(devices) != 1:
        raise ValueError(f"q, k, v, g must be on one device, got {sorted(map(str, devices))}")
    if not (q.is_cuda or _interpreting()):
        raise ValueError(f"Triton GLA kernels need CUDA tensors (or TRITON_INTERPRET=1), got {q.device}")
    if T == 0 or B == 0:
        raise ValueError("empty batch or sequence")
    N = B
    if cu_seqlens is not None:
        if not chunked:
            raise ValueError("cu_seqlens is not supported by fused_recurrent_gla")
        if B != 1:
            raise ValueError(f"cu_seqlens needs B == 1 (packed sequences), got B={B}")
        if (cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2
                or cu_seqlens.dtype not in (torch.int32, torch.int64)):
            raise ValueError("cu_seqlens must be a 1-D int32/int64 tensor of N+1 cumulative lengths")
        N = cu_seqlens.numel() - 1
    VS = V + int(normalizer)
    if initial_state is not None and tuple(initial_state.shape) != (N, Hkv, K, VS):
        raise ValueError(f"initial_state must be [{N}, {Hkv}, {K}, {VS}], got {tuple(initial_state.shape)}")
    return B, T, H, Hkv, K, V, N


# A converted model calls the kernel once per layer with the same cu_seqlens tensor. Sizing
# the grid needs its values on the host, and copying them there waits for every kernel queued
# before (the launch queue drains 30 times a forward for SmolLM2). So the metadata of the last
# few cu_seqlens tensors is kept, keyed by the tensor itself (a strong reference, so its id
# cannot be reused while cached) and its version counter (bumped by any in-place change).
VARLEN_CACHE = True
_VARLEN_MEMO: dict = {}
_SEGMENT_MEMO: dict = {}
_VARLEN_MEMO_SIZE = 4


def _varlen_meta(cu_seqlens, T, BT, device):
    """chunk_offsets [N+1] (chunks before each sequence) and chunk_indices [NTtot, 2]
    (sequence, chunk within it), int32 on the device, plus the chunk total and the chunk
    count of every sequence (host list); computed once per cu_seqlens tensor (see above)."""
    if not VARLEN_CACHE:
        return _varlen_meta_uncached(cu_seqlens, T, BT, device)
    key = (id(cu_seqlens), cu_seqlens._version, T, BT, str(device))
    hit = _VARLEN_MEMO.get(key)
    if hit is not None and hit[0] is cu_seqlens:
        return hit[1]
    meta = _varlen_meta_uncached(cu_seqlens, T, BT, device)
    _remember(_VARLEN_MEMO, key, (cu_seqlens, meta))
    return meta


def _remember(memo: dict, key, value):
    """memo[key] = value, dropping the oldest entry when the memo is full."""
    if len(memo) >= _VARLEN_MEMO_SIZE:
        memo.pop(next(iter(memo)))
    memo[key] = value
    return value


def _varlen_meta_uncached(cu_seqlens, T, BT, device):
    """What _varlen_meta returns; one host sync to size the grid."""
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != T or bool((lens < 0).any()):
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at T={T}")
    n_chunks = (lens + BT - 1) // BT
    offsets = torch.zeros(len(lens) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(n_chunks, 0)
    total = int(offsets[-1])
    seq = torch.repeat_interleave(torch.arange(len(lens)), n_chunks)
    within = torch.arange(total) - torch.repeat_interleave(offsets[:-1], n_chunks)
    indices = torch.stack([seq, within], dim=1).to(torch.int32).contiguous()
    return (cu.to(device=device, dtype=torch.int32), offsets.to(device=device, dtype=torch.int32),
            indices.to(device), total, tuple(n_chunks.tolist()))


class _Segments:
    """How the sequential passes split each sequence: seg_len chunks per segment (0: one
    walk per sequence). n_seg segments per sequence (fixed length), or per-sequence counts
    through offsets [N+1] and indices [total, 2] (sequence, segment) for packed documents."""

    def __init__(self, seg_len, n_chunks, varlen, device):
        self.seg_len = int(seg_len)
        self.n_seg = 1
        self.offsets = self.indices = None
        if not self.seg_len:
            self.total = len(n_chunks)
            return
        per_seq = [max(1, -(-int(n) // self.seg_len)) for n in n_chunks]
        self.total = sum(per_seq)
        if varlen:
            counts = torch.tensor(per_seq, dtype=torch.int64)
            offsets = torch.zeros(len(per_seq) + 1, dtype=torch.int64)
            offsets[1:] = torch.cumsum(counts, 0)
            seq = torch.repeat_interleave(torch.arange(len(per_seq)), counts)
            within = torch.arange(self.total) - torch.repeat_interleave(offsets[:-1], counts)
            self.offsets = offsets.to(device=device, dtype=torch.int32)
            self.indices = torch.stack([seq, within], 1).to(torch.int32).contiguous().to(device)
        else:
            self.n_seg = per_seq[0]

    @property
    def on(self) -> bool:
        return self.seg_len > 0


def _num_sms(device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 132


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class _Config:
    """Launch parameters, one set per kernel family:
      *_seq  sequential state passes: 64x64 tiles; when (sequences x KV heads x tiles)
             walks would leave SMs idle, each sequence is cut into segments (seg_*);
      *_o    output and dv kernels: the whole K (<= 128) in one tile, so the k-side work is
             shared by the query heads of a group (dv's V tile: BV_dv);
      *_g    dq/dk/dg kernel: K tiles of 32, or 64 for bf16 with K > 64 (it keeps ~10 [C, BK]
             fp32 tensors alive: ptxas spills with wider tiles); with one K and one V tile
             it also computes dv (merge_dv).
    Entries of OVERRIDES (module level) replace the computed values, for tuning runs."""

    def __init__(self, B, T, H, Hkv, K, V, N, dtype, device, tiles=None, chunk=None, normalizer=False):
        np2 = _next_pow2
        self.BT = 64 if T >= 64 else max(16, np2(T))
        if chunk is not None:                       # private: force the chunk length (tests)
            if chunk < 16 or chunk & (chunk - 1):
                raise ValueError(f"chunk length must be a power of two >= 16, got {chunk}")
            self.BT = chunk
        if tiles is not None:                       # private: force tile sizes (tests)
            bk, bv = tiles
            self.BK_seq = self.BK_o = self.BK_g = bk
            self.BV_seq = self.BV_o = self.BV_g = bv
        else:
            self.BK_o = min(np2(K), 128)
            self.BV_o = min(max(16, np2(V)), 128 if self.BK_o <= 64 else 64)
            # 64-wide K tiles halve the recomputed do v^T at K > 64 and, at K <= 64, let the
            # dq/dk/dg kernel compute dv too (merge_dv); only bf16 operands leave the
            # registers for them (fp32 operands spill). H200: 2.33 -> 1.83 ms at 8x2048 H32 D64.
            wide = dtype == torch.bfloat16
            # Except with grouped queries and the normaliser: the head loop's and the
            # normaliser's extra tiles make the merged kernel spill 2.1 KB at 4 warps (ptxas),
            # 0.8 KB (+88 B in dv) with K tiles of 32. H200, 1x16384 H32/kv8 D64: 1.549 ->
            # 1.301 ms f+b (session 5). Not measured: K > 64 (hedgehog_pm's 128, where
            # 64-wide tiles halve the recomputed do v^T), nor either case without it.
            if normalizer and H > Hkv and K <= 64:
                wide = False
            self.BK_g = min(np2(K), 64 if wide else 32)
            self.BV_g = min(max(16, np2(V)), 64)
            self.BK_seq = min(np2(K), 64)
            self.BV_seq = min(max(16, np2(V)), 64)
        # Sequential passes: when one walk per (sequence, KV head, tile) leaves SMs idle, the
        # sequences are cut into segments of seg_len chunks walked in parallel, then chained
        # (see _seg_combine_kernel). None: chosen per call from the chunk counts; 0: never.
        self.seg_len = None
        # aim: 4 walks per SM (H200, 1x16384: 2 per SM 1.35 ms f+b at D64, 4 per SM 1.27)
        self.seg_programs = 4 * _num_sms(device)
        self.seg_min = 4                             # chunks: shorter walks cost more fix-up
        self.seg_max_walks = _num_sms(device)        # segment only below this many walks
        self.dot_bf16 = dtype == torch.bfloat16
        # fp32 inputs get exact fp32 products; fp16 inputs tf32 (10-bit mantissa, like fp16).
        self.prec = "ieee" if dtype == torch.float32 else "tf32"
        # [64, 64] fp32 tiles are 32 registers a thread at 4 warps and most kernels keep 6-12
        # of them alive, yet the sequential passes (latency chains) measured faster at 4 warps
        # than 8 at every benchmark shape on the H200 (8x2048 H32 D64: 0.42 -> 0.33 ms
        # forward). fp32 operands (fp16/fp32 inputs) spill heavily at 4 warps: 8 there.
        self.warps_seq = 4 if dtype == torch.bfloat16 else 8
        self.warps_dh = None                           # the dh pass's own, when set (tuning)
        # dv kernel: with one query head per KV head and K in one tile, one program per chunk
        # over every V tile (P built once) instead of one per V tile. H200, bf16, 8x2048 H16
        # D128: dv 0.395 -> 0.249 ms, f+b 2.09 -> 1.81 (8 warps: 0.345). fp16/fp32 operands
        # (twice the registers per tile) were not measured: they keep one program per tile.
        self.dv_all_v = 1 if dtype == torch.bfloat16 else 0
        self.stages_seq = 2
        # bf16 output kernels: 4 warps measured faster on the H200 at D = 64 and 128.
        small = self.BT * max(self.BK_o, self.BV_o) < 64 * 64
        self.warps_o = 4 if small or (dtype == torch.bfloat16 and K <= 128 and V <= 128) else 8
        # dq/dk/dg(+dv): ptxas caps it at 255 registers either way; at K, V <= 64 in bf16, 4
        # warps (2 programs per SM) beat 8 on the H200 (8x2048 H32 D64: 1.52 -> 1.40 ms f+b).
        # At K = 128 8 warps were ahead while the V loop waited on its loads (2.15 vs 2.25 ms,
        # session 5); with the loop pipelined (stages_chunk) 4 win there too (session 15,
        # kernel ms: 8x2048 H16 D128 0.779 -> 0.630, the 1B layer 1x16384 H32/kv8 K128 V64
        # +norm 1.063 -> 0.838). fp16/fp32 operands (not pipelined) keep 8 on wide tiles.
        wide_tiles = self.BT * max(self.BK_g, self.BV_g) >= 64 * 64
        self.warps_g = 8 if wide_tiles and not self.dot_bf16 else 4
        self.stages_g = None                           # the dq/dk/dg kernel's own (tuning)
        # The forward keeps s * mask(P) for the backward's dv (LOAD_P): 2 bytes a token, query
        # head and chunk column in bf16 (128 B at chunks of 64, 64 at 32: a tenth of q, k,
        # v, g and o together at D128); dv then needs no q, score matmul or exact path (ptxas, D128:
        # 255 registers, 652 B spilled -> 232, none). H200 kernel ms (session 15): 8x2048 H16
        # D128 dv 0.242 -> 0.161, output 0.218 -> 0.226, f+b 1.409 -> 1.337; the 1B layer dv
        # 0.205 -> 0.105, f+b 1.685 -> 1.600. At D64 (dv merged into dq/dk/dg) the output
        # kernel's extra store costs more than dq/dk/dg gains (1.144 -> 1.188): bf16, K > 64.
        self.keep_p = 1 if self.dot_bf16 and K > 64 else 0
        # With one query head per KV head, the inter-chunk terms in dP's V loop (ONE_PASS in
        # the kernel): v and h loaded once. H200, bf16, kernel ms (session 15): H16 D128
        # 0.594 -> 0.569 at 8x2048, 0.597 -> 0.571 at 2x8192 (ptxas: 160 -> 248 B spilled);
        # D64 (dv merged) 0.699 -> 0.702, so only at K > 64.
        self.one_pass_g = 1 if self.dot_bf16 and K > 64 else 0
        self.warps_dv = self.warps_o
        # Software-pipelined tile loops in the chunk kernels (output, dq/dk/dg, dv): the loads
        # of the next V tile or query head overlap this one's matmuls. H200, bf16, kernel ms
        # (session 14): dq/dk/dg at 8x2048 H16 D128 0.854 -> 0.772 (2 stages 0.840), f+b
        # 1.804 -> 1.708; 1x16384 H32/kv8 D64 0.900 -> 0.824; with the normaliser, the 1B
        # student's layer (1x16384 H32/kv8 K128 V64) 2.168 -> 2.106 and SmolLM2's (8x2048
        # H9/kv3) 0.741 -> 0.712; loops of one tile (D64 without GQA) compile as before.
        # Shared memory grows (D128 dv 48 -> 104 KB, D256 output 40 -> 144 KB; ptxas, sm_90)
        # but stays under the 227 KB limit up to D256. fp16/fp32 operands are twice the bytes
        # and were not measured: 1 stage.
        self.stages_chunk = 3 if dtype == torch.bfloat16 else 1
        # Register caps (ptx .maxnreg) per kernel family, None = the compiler's choice (255 at
        # most). A cap trades spills for programs per SM: 4 warps at <= 168 registers fit 3
        # programs on an SM instead of 2, 8 warps at <= 128 fit 2 instead of 1. None is set:
        # on the H200 every cap tried was slower (session 11: state pass at D128 0.28 -> 0.66 ms
        # at 128 registers; the best, dq/dk/dg at D128, -2%).
        self.regs_seq = self.regs_o = self.regs_g = self.regs_dv = None
        # Chunks whose decay rules out one factorisation: row by row (0), or 16-row blocks
        # with their products under a runtime branch in a loop (1) or unrolled (2).
        # Mode 1 hit an illegal memory access on one H200 (session 8, not seen again in
        # session 10); mode 2 has no matmul under a runtime branch and ran clean. Trained
        # gates, 8x2048 H32 D64 f+b: row by row 17.0 ms, mode 2 3.9; weak gates +2-8%.
        self.slow_blocks = 2
        # Chunk kernels in two launches, one per path (see _paths). Tuning knob, off: with all
        # three kernels split, H200 kernel ms (session 15) at 8x2048 H32 D64 1.146 -> 1.269,
        # 8x2048 H16 D128 1.618 -> 1.753 (dq/dk/dg on 8 warps then); see split_g.
        self.split_slow = 0
        # The same split for the dq/dk/dg kernel alone, on for bf16 at K > 64: on 4 warps the
        # one kernel spills 1616 bytes at D128, its one-matmul launch 160 (ptxas, sm_90).
        # H200 kernel ms (session 15): 8x2048 H16 D128 0.630 -> 0.595, the 1B layer 0.838
        # -> 0.618. Not for D64 (0.699 -> 0.788: twice the small programs), nor on 8 warps
        # (D128 0.779 -> 0.887), nor for the output and dv kernels (D128 +7% and +4%).
        self.split_g = 1 if self.dot_bf16 and K > 64 else 0
        # Each chunk's cumulative gates G written once (fp32, 4 bytes a key element), and the
        # output, dh, dq/dk/dg and dv kernels reading them instead of rebuilding them from
        # g with a scan over the chunk's rows. That scan runs across the warps through shared
        # memory (SASS instructions, sm_90, Triton 3.6, H16 D128, mode 2: state pass 1512 ->
        # 1048, dh 2464 -> 1840, dv 2496 -> 1336, dq/dk/dg 4091 -> 3515). 1: the state pass
        # writes them (its own SASS grows to 2104: the store); 2: a small parallel kernel
        # writes them first and the state pass reads them as well. H200, bf16, kernel ms per
        # f+b (session 17; off -> 1 -> 2, off as measured in session 16 where this call's
        # figure was not kept): 8x2048 H16 D128 1.313 -> 1.195 -> 1.101 (state pass 0.209 ->
        # 0.122 plus 0.053 for the gates kernel, dh 0.162 -> 0.101, dv 0.147 -> 0.120,
        # dq/dk/dg 0.571 -> 0.525, output 0.225 -> 0.181); 4x4096 H16 D128 1.341 -> 1.225 ->
        # 1.130; 8x2048 H32 D64 1.145 -> 1.128 -> 1.104; the 1B layer 1x16384 H32/kv8 K128
        # V64 +norm 1.602 -> 1.521 -> 1.505. Mode 2 for every dtype: fp16, off -> 2, 8x2048
        # H16 D128 3.650 -> 3.033, H32 D64 3.717 -> 2.999; fp32 not timed (the scan it removes
        # does not depend on the operands' dtype).
        self.keep_g = 2
        # Chunks of 32 when the state is narrow: trained gates then mostly stay on the
        # one-matmul path (a chunk of 32 factorises down to ~0.18 of the state kept a step,
        # one of 64 only to ~0.42). H200 bf16, f+b with mode 2: 8x2048 H32 D64 trained gates
        # 3.87 -> 1.19 ms, weak gates +1-12%; at D128 weak gates cost +51%, so not there.
        # Set after the warp choices above, which stay those measured at chunks of 64.
        if chunk is None and self.BT == 64 and V <= 64 and K <= 128:
            self.BT = 32
            # Re-swept at chunks of 32 (H200, session 12, kernel ms): the output kernel's
            # [32, 64] tiles run faster on 2 warps (8x2048 H32 D64 0.199 -> 0.151, GQA +norm
            # 1x16384 0.214 -> 0.148); so does dq/dk/dg with K tiles of 32 (GQA + normaliser:
            # 0.649 -> 0.472), but not with K tiles of 64 (0.699 -> 0.783). K = 128 and
            # fp16/fp32 were not measured, nor the dv kernel on 2 warps: they keep the above.
            if self.dot_bf16 and K <= 64:
                self.warps_o = 2
                # The dh pass alone on 2 warps (the state pass is slower there): session 13,
                # 4x4096 H32 D64 0.178 -> 0.155 ms, 8x2048 0.146 -> 0.144. Not with the
                # normaliser (8x2048 +norm 0.232 -> 0.282) nor at D128 (chunks of 64, not
                # this branch: 0.207 -> 0.345).
                if not normalizer:
                    self.warps_dh = 2
            if self.dot_bf16 and self.BK_g == 32:
                self.warps_g = 2
        # The sequential passes with all of V (<= 128) in one tile: half the walks, each
        # carrying a [64, 128] state. Only where the walks still fill the GPU without
        # segments: H200, bf16, kernel ms per f+b (session 14): 8x2048 H16 D128 state pass
        # 0.272 -> 0.213, dh pass 0.205 -> 0.161 (256 walks); at 4x4096 the 128 walks left
        # switch the segments on and it is slower (1.80 -> 1.96 ms, fix-up 0.11 ms). Measured
        # with one query head per KV head and without the normaliser: the rest keep 64.
        # Session 15: also where the tiles of 64 would segment anyway (walks <= SMs; long
        # enough sequences), with the state pass on 8 warps: 2x8192 H16 D128 state pass
        # 0.299 -> 0.219 ms, dh pass 0.237 -> 0.204 (on 4; 8 gave 0.217); 1x16384 state 0.320
        # -> 0.208, dh 0.247 -> 0.186. Between the two (4x4096: 256 walks of 64 unsegmented,
        # 128 of 128 segmented) session 15 kept tiles of 64.
        # Session 16 (H200, kernel ms): the state pass with the wide tile runs on 8 warps in
        # every regime (8x2048 H16 D128 0.219 -> 0.208; the dh pass stays on 4 there: 0.162,
        # 0.198 on 8). Between the regimes (4x4096: 256 walks of 64, 128 of 128) both passes
        # take the wide tile unsegmented, one walk per SM on 8 warps: state pass 0.274 ->
        # 0.207 (segmented: 0.213 plus 0.07 of fix-up), dh pass 0.210 -> 0.192 (on 4 warps
        # 0.234), f+b 1.437 -> 1.341.
        if tiles is None and self.dot_bf16 and 64 < V <= 128 and not normalizer and H == Hkv:
            def walks(bv):
                return (B if N is None else N) * Hkv * _cdiv(K, self.BK_seq) * _cdiv(V, bv)
            if walks(np2(V)) > self.seg_max_walks:
                self.BV_seq = np2(V)
                self.warps_seq, self.warps_dh = 8, 4
            elif walks(self.BV_seq) > self.seg_max_walks:
                self.BV_seq, self.seg_len = np2(V), 0
                self.warps_seq, self.warps_dh = 8, 8
            elif _cdiv(T, self.BT) > 2 * self.seg_min:
                self.BV_seq = np2(V)
                self.warps_seq, self.warps_dh = 8, 4
        # The dv kernel in one V tile of up to 128 when it reads the forward's scores (keep_p:
        # 232 registers and no spill at D128 with two tiles in a loop, 254 and none with one):
        # H200, H16 D128, dv 0.161 -> 0.147 ms at 8x2048 and 4x4096 (session 16; measured with
        # one query head per KV head only).
        self.BV_dv = None
        if self.keep_p and tiles is None and 64 < V <= 128 and K <= 128 and H == Hkv:
            self.BV_dv = np2(V)
        self.state_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        for name, value in OVERRIDES.items():
            setattr(self, name, value)
        self.NK_o, self.NV_o = _cdiv(K, self.BK_o), _cdiv(V, self.BV_o)
        self.NK_g, self.NV_g = _cdiv(K, self.BK_g), _cdiv(V, self.BV_g)
        self.NK_seq, self.NV_seq = _cdiv(K, self.BK_seq), _cdiv(V, self.BV_seq)
        self.BV_dv = self.BV_dv or self.BV_o
        if self.keep_g not in (0, 1, 2):     # another value would leave the kept buffer unwritten
            raise ValueError(f"keep_g must be 0 (off), 1 or 2, got {self.keep_g}")
        self.NV_dv = _cdiv(V, self.BV_dv)
        # dv inside the dq/dk/dg kernel when one program sees all of K and V.
        self.merge_dv = bool(OVERRIDES.get("merge_dv", True)) and self.NK_g == 1 and self.NV_g == 1

    def plan_segments(self, n_chunks, Hkv, varlen, device) -> _Segments:
        """Segments for the sequential passes, given the chunk count of every sequence.
        1x16384 H32 D64: 32 walks of 256 chunks (0.72 ms forward pass measured) become
        512 walks of 16 chunks."""
        seg_len = self.seg_len
        if seg_len is None:
            seg_len = 0
            nt_max = max(n_chunks, default=0)
            walks = len(n_chunks) * Hkv * self.NK_seq * self.NV_seq
            if walks <= self.seg_max_walks and nt_max > 2 * self.seg_min:
                per_seq = _cdiv(self.seg_programs, walks)
                seg_len = max(self.seg_min, _cdiv(nt_max, per_seq))
                if seg_len >= nt_max:
                    seg_len = 0
        if not (varlen and seg_len and VARLEN_CACHE):
            return _Segments(seg_len, n_chunks, varlen, device)
        # Packed documents upload two index tensors (a host-to-device copy waits for the
        # queue as a sync does): the same plan for every layer of a forward is built once.
        key = (tuple(n_chunks), seg_len, str(device))
        seg = _SEGMENT_MEMO.get(key)
        if seg is None:
            seg = _remember(_SEGMENT_MEMO, key, _Segments(seg_len, n_chunks, varlen, device))
        return seg


def _paths(split, one_k_tile):
    """The PATH of each launch of a chunk kernel: (0,) one launch taking both paths per
    chunk; with split (and one K tile, where the fast/exact choice is per program) two
    launches, the one-matmul chunks then the exact ones, each compiled without the other's
    code (the exact paths cost the one-matmul chunks registers and spills; ptxas, sm_90,
    Triton 3.6, bf16, bytes spilled: D128 dq/dk/dg on 4 warps 1616 -> 160 in its one-matmul
    launch (on 8 warps 134 -> 0), dv 652 -> 0, output 124 -> 0; D64 dq/dk/dg 68 -> 0)."""
    return (1, 2) if split and one_k_tile else (0,)


def _opts(warps, stages, regs):
    """Launch options; the register cap only when set (the interpreter takes no maxnreg)."""
    opts = dict(num_warps=warps, num_stages=stages)
    if regs is not None:
        opts["maxnreg"] = int(regs)
    return opts


def _forward(q, k, v, g, scale, h0, want_ht, cu_seqlens, tiles, chunk, segment, normalizer,
             for_grad=False):
    B, T, H, Hkv, K, V, N = _check(q, k, v, g, h0, cu_seqlens, chunked=True,
                                   normalizer=normalizer)
    VU = V + int(normalizer)                        # state columns (z last) and o's columns
    VS = _state_stride(V, normalizer)               # row stride of the internal state buffers
    cfg = _Config(B, T, H, Hkv, K, V, N, q.dtype, q.device, tiles, chunk, normalizer=bool(normalizer))
    if segment is not None:                         # private: force the segment length (tests)
        cfg.seg_len = int(segment)
    if cu_seqlens is not None:
        cu, offsets, indices, total, n_chunks = _varlen_meta(cu_seqlens, T, cfg.BT, q.device)
        n_entries = total + N
    else:
        cu = offsets = indices = None
        total = B * _cdiv(T, cfg.BT)
        n_entries = total + B
        n_chunks = [_cdiv(T, cfg.BT)] * B
    seg = cfg.plan_segments(n_chunks, Hkv, cu is not None, q.device)
    R = H // Hkv
    q, k, v, g = (x.contiguous() for x in (q, k, v, g))
    if h0 is not None:
        h0 = h0.contiguous()
    hbuf = _new((n_entries, Hkv, K, VS), cfg.state_dtype, q.device)
    ht = _new((N, Hkv, K, VU), torch.float32, q.device) if want_ht else None
    # With the normaliser o is a [B, T, H, V + 1] view of rows padded like the states (VS):
    # aligned rows let the kernels that write o and read its gradient use vector accesses
    # (the fused normaliser's backward hands the gradient back in the same layout).
    o = _new((B, T, H, VS), q.dtype, q.device)[..., :VU]
    # keep_p: the output kernel also writes s * mask(P) of every chunk ([tokens, H, BT], the
    # matmul operand's dtype), which the backward's dv reads instead of rebuilding it.
    pbuf = None
    if for_grad and cfg.keep_p:
        pbuf = _new((B, T, H, cfg.BT), torch.bfloat16 if cfg.dot_bf16 else torch.float32, q.device)
    # keep_g: every chunk's cumulative gates, written by the state pass (1) or by a kernel of
    # their own before it (2), read by the other kernels (forward and backward)
    gbuf = _new((B, T, Hkv, K), torch.float32, q.device) if cfg.keep_g else None
    if cfg.keep_g == 2:
        bk = min(_next_pow2(K), 64)
        _chunk_gates_kernel[(_cdiv(K, bk), total, Hkv)](
            g, gbuf, cu, offsets, indices, T, Hkv=Hkv, K=K, BT=cfg.BT, BK=bk,
            IS_VARLEN=cu is not None, num_warps=4)
    common = dict(IS_VARLEN=cu is not None, DOT_BF16=cfg.dot_bf16, PREC=cfg.prec,
                  VS=VS, VO=VS, NORM=bool(normalizer))
    dec, segend = _segment_buffers(seg, n_entries, Hkv, K, VS, q.device)
    _fwd_state_kernel[(cfg.NK_seq, cfg.NV_seq, seg.total * Hkv)](
        k, v, g, h0, ht, hbuf, dec, segend, cu, offsets, seg.indices, gbuf, T, seg.seg_len, seg.n_seg,
        Hkv=Hkv, K=K, V=V, BT=cfg.BT, BK=cfg.BK_seq, BV=cfg.BV_seq,
        USE_H0=h0 is not None, STORE_HT=want_ht, SEGMENTED=seg.on, VU=VU,
        KEEP_G=int(cfg.keep_g), **common,
        **_opts(cfg.warps_seq, cfg.stages_seq, cfg.regs_seq))
    if seg.on:
        _chain_segments(cfg, seg, hbuf, dec, segend, ht, cu, offsets, indices, T, total, N,
                        Hkv, K, VU, VS, reverse=False)
    for path in _paths(cfg.split_slow, cfg.NK_o == 1):
        _fwd_output_kernel[(total, Hkv)](
            q, k, v, g, o, hbuf, pbuf, gbuf, cu, offsets, indices, T, scale,
            H=H, Hkv=Hkv, K=K, V=V, BT=cfg.BT, BK=cfg.BK_o, BV=cfg.BV_o, NK=cfg.NK_o, NV=cfg.NV_o,
            R=R, SLOW_BLOCKS=cfg.slow_blocks, PATH=path, STORE_P=int(pbuf is not None),
            KEEP_G=int(gbuf is not None), **common,
            **_opts(cfg.warps_o, cfg.stages_chunk, cfg.regs_o))
    meta = (cfg, cu, offsets, indices, total, N, seg, bool(normalizer))
    return o, ht, hbuf, pbuf, gbuf, meta


def _row_stride(x):
    """The distance between consecutive rows (last dimension) of x when x is a row-padded
    view: unit stride in the last dimension and every other dimension laid out as in a
    contiguous tensor of rows that wide. None otherwise."""
    rs = x.stride(-1) == 1 and x.dim() >= 2 and x.stride(-2)
    if not rs or rs < x.shape[-1]:
        return None
    expect = rs
    for i in range(x.dim() - 2, -1, -1):
        if x.shape[i] > 1 and x.stride(i) != expect:
            return None
        expect *= x.shape[i]
    return rs


def _state_stride(V: int, normalizer) -> int:
    """Row stride of the internal chunk-state buffers. With the normaliser a state row is
    V + 1 wide; an odd stride (65) misaligns every row after the first, so no state tile
    load or store can use 16-byte vectors. Rows are padded to a multiple of 8 elements
    (the pad columns are never read)."""
    if not normalizer:
        return V
    return _cdiv(V + 1, 8) * 8


def _segment_buffers(seg, n_entries, Hkv, K, V, device):
    """dec (log2 decays per slot, fp32) and segend (local segment results, fp32)."""
    if not seg.on:
        return None, None
    return (_new((n_entries, Hkv, K), torch.float32, device),
            _new((seg.total, Hkv, K, V), torch.float32, device))


def _chain_segments(cfg, seg, buf, dec, segend, final, cu, offsets, indices, T, total, N,
                    Hkv, K, V, VS, reverse):
    """After a segmented pass: true states at the segment anchors, then at every slot.
    V here is the full state width (with the normaliser's column), which is also final's
    row stride; VS is the row stride of buf and segend. Both kernels walk all VS columns
    (pad included): a mask at V + 1 would split 8-column groups and force scalar loads."""
    IS_VARLEN = cu is not None
    NV = _cdiv(VS, cfg.BV_seq)
    _seg_combine_kernel[(cfg.NK_seq, NV, N * Hkv)](
        buf, dec, segend, final, cu, offsets, seg.offsets, T, seg.seg_len, seg.n_seg,
        Hkv=Hkv, K=K, V=VS, VU=V, BT=cfg.BT, BK=cfg.BK_seq, BV=cfg.BV_seq,
        REVERSE=reverse, STORE_FINAL=final is not None, IS_VARLEN=IS_VARLEN, num_warps=4)
    _seg_fixup_kernel[(total, Hkv)](
        buf, dec, cu, offsets, indices, T, seg.seg_len,
        Hkv=Hkv, K=K, V=VS, BT=cfg.BT, BK=cfg.BK_seq, BV=cfg.BV_seq, NK=cfg.NK_seq,
        NV=NV, REVERSE=reverse, IS_VARLEN=IS_VARLEN, num_warps=4)


def _backward(q, k, v, g, scale, hbuf, pbuf, gbuf, meta, do, dht, want_dh0):
    cfg, cu, offsets, indices, total, N, seg, normalizer = meta
    keep_g = int(gbuf is not None)
    B, T, H, K = q.shape
    Hkv, V = k.shape[2], v.shape[3]
    VU = V + int(normalizer)
    VS = hbuf.shape[-1]                             # the internal buffers' padded row stride
    R = H // Hkv
    VO = _row_stride(do) if normalizer else None
    if VO is None or VO % 8:                       # not the padded layout: a plain copy
        do, VO = do.contiguous(), VU
    if dht is not None:
        dht = dht.contiguous()
    dhbuf = _new(hbuf.shape, cfg.state_dtype, q.device)
    dh0 = _new((N, Hkv, K, VU), torch.float32, q.device) if want_dh0 else None
    dq = _new(q.shape, q.dtype, q.device)
    dk = _new(k.shape, k.dtype, q.device)
    dv = _new(v.shape, v.dtype, q.device)
    dg = _new(g.shape, g.dtype, q.device)
    common = dict(IS_VARLEN=cu is not None, DOT_BF16=cfg.dot_bf16, PREC=cfg.prec,
                  VS=VS, VO=VO, NORM=normalizer)
    dec, segend = _segment_buffers(seg, hbuf.shape[0], Hkv, K, VS, q.device)
    _bwd_dh_kernel[(cfg.NK_seq, cfg.NV_seq, seg.total * Hkv)](
        q, g, do, dht, dh0, dhbuf, dec, segend, cu, offsets, seg.indices, gbuf, T, seg.seg_len,
        seg.n_seg, scale,
        H=H, Hkv=Hkv, K=K, V=V, BT=cfg.BT, BK=cfg.BK_seq, BV=cfg.BV_seq, R=R,
        USE_DHT=dht is not None, STORE_DH0=want_dh0, SEGMENTED=seg.on, VU=VU, KEEP_G=keep_g,
        **common,
        **_opts(cfg.warps_dh or cfg.warps_seq, cfg.stages_seq, cfg.regs_seq))
    if seg.on:
        _chain_segments(cfg, seg, dhbuf, dec, segend, dh0, cu, offsets, indices, T, total, N,
                        Hkv, K, VU, VS, reverse=True)
    for path in _paths(cfg.split_slow or cfg.split_g, True):
        _bwd_dqkg_kernel[(cfg.NK_g, total, Hkv)](
            q, k, v, g, do, hbuf, dhbuf, pbuf, gbuf, dq, dk, dg, dv, cu, offsets, indices, T, scale,
            H=H, Hkv=Hkv, K=K, V=V, BT=cfg.BT, BK=cfg.BK_g, BV=cfg.BV_g, NV=cfg.NV_g, R=R,
            WITH_DV=cfg.merge_dv, SLOW_BLOCKS=cfg.slow_blocks, PATH=path,
            ONE_PASS=int(bool(cfg.one_pass_g) and R == 1), LOAD_P=int(pbuf is not None),
            KEEP_G=keep_g, **common,
            **_opts(cfg.warps_g, cfg.stages_g or cfg.stages_chunk, cfg.regs_g))
    if not cfg.merge_dv:
        all_v = cfg.NV_dv if cfg.dv_all_v and R == 1 and cfg.NK_o == 1 and cfg.NV_dv > 1 else 0
        for path in _paths(cfg.split_slow, cfg.NK_o == 1):
            _bwd_dv_kernel[(1 if all_v else cfg.NV_dv, total, Hkv)](
                q, k, g, do, dhbuf, pbuf, gbuf, dv, cu, offsets, indices, T, scale,
                H=H, Hkv=Hkv, K=K, V=V, BT=cfg.BT, BK=cfg.BK_o, BV=cfg.BV_dv, NK=cfg.NK_o, R=R,
                SLOW_BLOCKS=cfg.slow_blocks, ALL_V=all_v, PATH=path, LOAD_P=int(pbuf is not None),
                KEEP_G=keep_g, **common,
                **_opts(cfg.warps_dv, cfg.stages_chunk, cfg.regs_dv))
    return dq, dk, dv, dg, dh0


class _FusedChunkGLA(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, g, scale, initial_state, output_final_state, cu_seqlens, tiles,
                chunk, segment, normalizer, for_grad):
        q, k, v, g = (x.contiguous() for x in (q, k, v, g))
        o, ht, hbuf, pbuf, gbuf, meta = _forward(q, k, v, g, scale, initial_state,
                                                 output_final_state, cu_seqlens, tiles, chunk,
                                                 segment, normalizer, for_grad)
        ctx.save_for_backward(q, k, v, g, hbuf, pbuf, gbuf)
        ctx.meta = meta
        ctx.scale = scale
        ctx.has_h0 = initial_state is not None
        ctx.h0_dtype = None if initial_state is None else initial_state.dtype
        # None gradients stay None (no zero tensors to read): dht is often unused.
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, hbuf, pbuf, gbuf = ctx.saved_tensors
        if do is None:
            do = torch.zeros(q.shape[:3] + (v.shape[3] + int(ctx.meta[-1]),), dtype=q.dtype,
                             device=q.device)
        want_dh0 = ctx.has_h0 and ctx.needs_input_grad[5]
        dq, dk, dv, dg, dh0 = _backward(q, k, v, g, ctx.scale, hbuf, pbuf, gbuf, ctx.meta, do,
                                        dht, want_dh0)
        if dh0 is not None and dh0.dtype != ctx.h0_dtype:
            dh0 = dh0.to(ctx.h0_dtype)               # autograd wants the input's dtype
        return dq, dk, dv, dg, None, dh0, None, None, None, None, None, None, None


def fused_chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
                    cu_seqlens=None, normalizer=False, *, _tiles=None, _chunk=None,
                    _segment=None):
    """Chunk-parallel GLA, differentiable in q, k, v, g and initial_state.

    q [B, T, H, K]; k, g [B, T, Hkv, K]; v [B, T, Hkv, V]; g = per-step log-decays (<= 0).
    Returns (o [B, T, H, V] in q's dtype, final state [N, Hkv, K, V] float32 or None).
    cu_seqlens (int32/int64, N+1 cumulative lengths, B must be 1) packs N documents; the
    state restarts at each boundary and initial/final states are per document.
    normalizer=True computes what a column of ones appended to v would give, without the
    extra column in every V tile: o gets V + 1 columns (the last is the normaliser
    s * sum_j (q_i 2^{G_i - G_j}) k_j) and the states K x (V + 1) (the last column is the
    normaliser's state), exactly the layout of the ones-column call. That o is a view of rows
    padded to a multiple of 8 values (not contiguous; `.contiguous()` gives a plain copy): the
    backward reads a gradient handed back in the same layout (as the fused normaliser does)
    in place, and any other gradient through one copy.
    `_tiles=(BK, BV)`, `_chunk` and `_segment` are private (tests): they force the tile sizes
    of every kernel, the chunk length and the chunks per segment of the sequential passes
    (0: one walk per sequence).
    """
    _check(q, k, v, g, initial_state, cu_seqlens, chunked=True, normalizer=bool(normalizer))
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    # Buffers kept only for a backward (keep_p) are written only when one can follow.
    for_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, initial_state))
    return _FusedChunkGLA.apply(q, k, v, g, scale, initial_state, bool(output_final_state),
                                cu_seqlens, _tiles, _chunk, _segment, bool(normalizer), for_grad)


def fused_recurrent_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False):
    """Token-by-token GLA (forward only; generation, T usually 1). Same shapes as
    fused_chunk_gla without cu_seqlens. Returns (o, final state float32 or None)."""
    B, T, H, Hkv, K, V, N = _check(q, k, v, g, initial_state, None, chunked=False)
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v, g = (x.contiguous() for x in (q, k, v, g))
    h0 = None if initial_state is None else initial_state.contiguous()
    o = _new((B, T, H, V), q.dtype, q.device)
    ht = _new((B, Hkv, K, V), torch.float32, q.device) if output_final_state else None
    BK = _next_pow2(K)
    # The state tile is [K, BV] fp32 in registers: keep it at <= 8K elements.
    BV = min(max(16, _next_pow2(V)), max(16, 8192 // BK))
    _recurrent_kernel[(_cdiv(V, BV), B * Hkv)](
        q, k, v, g, o, h0, ht, T, scale,
        H=H, Hkv=Hkv, K=K, V=V, BK=BK, BV=BV, R=H // Hkv,
        USE_H0=h0 is not None, STORE_HT=bool(output_final_state),
        num_warps=4 if BK * BV <= 4096 else 8)
    return o, ht
