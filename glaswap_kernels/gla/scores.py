"""In-chunk gates and scores of GLA, shared by the chunk kernels (forward and backward).

For a chunk of BT tokens, G = the in-chunk cumulative sum of the log-decays g, in log2 units
(fp32), and the causal scores are

    P_ij = sum_k q_ik k_jk 2^{G_ik - G_jk}      (j <= i)

P is one tensor-core matmul of (q 2^{G-a})(k 2^{a-G})^T, anchored at the midpoint a ~ G_last / 2
of each channel's in-chunk decay, when the chunk's total decay stays below _FAST = 2 _SAFE:
every factor is then within 2^-SAFE..2^SAFE, so the one-matmul path covers twice the decay
that an anchor at the chunk's start would. A chunk that decays more ("slow path", steep
gates) is built in 16-row blocks, each factorised around its own first row, and a block still
too steep row by row with every exponent clamped to <= 0.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:
    raise

from ..utils import load_rows, mm

_LOG2E = tl.constexpr(1.4426950408889634)
# Largest exponent, in log2 units (2^80 ~ e^55), that one factor of a factorised score may
# carry: factors stay within 2^-80..2^80, far inside the fp32/bf16 range of 2^+-126. It bounds
# the anchor (below) and the decay of a 16-row block on the slow path.
_SAFE = tl.constexpr(80.0)
# Largest total in-chunk decay (log2) of the one-matmul path, 2 SAFE: with the midpoint anchor
# each factor spans half of it. Entries above the diagonal (j > i) then reach up to
# 2^FAST |q||k| and may overflow to inf; every caller masks them out with tl.where first.
_FAST = tl.constexpr(160.0)


@triton.jit
def anchor(G_last):
    """The per-channel anchor of the factorised scores [BK]: the midpoint of the chunk's
    decay on the one-matmul path, rounded down to an integer so that scaling by 2^a is exact,
    and floored at -SAFE so that 2^{G-a} (<= 2^SAFE) and 2^a (>= 2^-SAFE) stay finite on
    the other paths too (q 2^G = (q 2^{G-a}) 2^a in every path)."""
    return tl.maximum(tl.floor(0.5 * G_last), -_SAFE)


@triton.jit
def is_fast(G_last):
    """Whether a tile's chunk takes the one-matmul path (a scalar, uniform in the program)."""
    return tl.max(-G_last, axis=0) < _FAST


@triton.jit
def gates(gp, t0, n_valid, stride_t, c0, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """In-chunk cumulative log2-decay G [BT, BK] and its last value G_last [BK], fp32.
    Masked rows have g = 0, so the sum over all rows is G at the last valid token."""
    b_g = load_rows(gp, t0, n_valid, stride_t, c0, K, BT, BK)
    return _cum_gates(b_g)


@triton.jit
def _cum_gates(b_g):
    """(G, G_last) of a loaded [BT, BK] tile of log-decays (any float dtype)."""
    b_g = b_g.to(tl.float32) * _LOG2E
    return tl.cumsum(b_g, axis=0), tl.sum(b_g, axis=0)


@triton.jit
def kept_gates(Gp, t0, n_valid, stride_t, c0, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """(G, G_last) as gates gives them, read from the copy _chunk_gates_kernel keeps (fp32,
    log2 units, cumulative within each chunk) instead of rebuilt from g: the in-chunk scan
    runs across the warps through shared memory, a large share of the instructions of the
    sequential passes and the dv kernel. Rows past the end get G_last, as a cumulative sum
    over their zero gates would."""
    rows = tl.arange(0, BT)
    cols = c0 + tl.arange(0, BK)
    G = load_rows(Gp, t0, n_valid, stride_t, c0, K, BT, BK).to(tl.float32)
    last = tl.minimum(n_valid, BT) - 1
    # (cols * 0 + last): the scalar test as a block, which the interpreter's mask needs
    G_last = tl.load(Gp + (t0 + tl.maximum(last, 0)) * stride_t + cols,
                     mask=(cols < K) & ((cols * 0 + last) >= 0), other=0.0).to(tl.float32)
    G = tl.where((rows < n_valid)[:, None], G, G_last[None, :])
    return G, G_last


@triton.jit
def excl_cumsum(x, BT: tl.constexpr):
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
    (q_i 2^{G_i - r}) (k_j 2^{r - G_j}); other rows come out zero (see scores_slow)."""
    q_f = tl.where(in_blk[:, None], b_q * tl.exp2(tl.minimum(G - r[None, :], 0.0)), 0.0)
    k_f = b_k * tl.exp2(tl.minimum(r[None, :] - G, _SAFE))
    return mm(q_f, tl.trans(k_f), DOT_BF16, PREC)


@triton.jit
def scores_slow(b_q, b_k, gp, t0, n_valid, stride_t, c0, K: tl.constexpr,
                BT: tl.constexpr, BK: tl.constexpr, DOT_BF16: tl.constexpr, PREC: tl.constexpr):
    """P_ij = sum_k q_ik k_jk 2^{G_ik - G_jk} for one K tile whose chunk decays too much for
    one factorisation (some channel loses more than 2^SAFE over the chunk). Entries j > i
    are finite garbage that the caller masks; g is reloaded so that the fast path does not
    keep G alive in registers.
    Rows go in blocks of SB = 16, each factorised around its own first row r,
    (q_i 2^{G_i - r}) (k_j 2^{r - G_j}): both factors are <= 1 for j before the block and
    the second stays below 2^SAFE inside it (trained gates put whole channels at ~0.2-0.5 a
    step: past 2^-80 over 64 steps, not over 16). Every block's product is unrolled and
    unconditional (a matmul under a runtime branch in a loop hit an illegal memory access on
    an H200); a block too steep for it is masked out of it (in_blk & ok) and redone row by
    row, a branch with no matmul in it. A block's product only writes its own rows, so its
    fix-up can follow it directly."""
    G, _ = gates(gp, t0, n_valid, stride_t, c0, K, BT, BK)
    rows = tl.arange(0, BT)
    P = tl.zeros([BT, BT], dtype=tl.float32)
    SB: tl.constexpr = 16 if BT > 16 else BT
    for blk in tl.static_range(BT // SB):
        in_blk, r, ok = _block_frame(G, rows, blk * SB, SB, BT)
        # (ok != 0: the interpreter cannot `&` a bool tensor with a bool scalar)
        P += _block_scores(b_q, b_k, G, in_blk & (ok != 0), r, DOT_BF16, PREC)
        if not ok:
            P = _score_rows(P, b_q, b_k, G, rows, blk * SB, blk * SB + SB)
    return P


@triton.jit
def _dqk_rows(dq, dk, dP, b_q, b_k, G, rows, lo, hi):
    """The rows lo..hi-1 of dP in dqk_slow, one at a time, every exponent clamped to <= 0."""
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
def _block_dqk(dP, b_q, b_k, G, in_blk, r, DOT_BF16: tl.constexpr, PREC: tl.constexpr):
    """The dq rows in_blk and their share of dk, in _block_scores' frame:
    dq_B = 2^{G_B - r} (dP_B @ k 2^{r - G}) and dk = 2^{r - G} (dP_B^T @ q_B 2^{G_B - r})."""
    # the factors are recomputed at each use: exps are cheaper than spilled tiles
    dP_b = tl.where(in_blk[:, None], dP, 0.0)
    dq = (tl.where(in_blk[:, None], tl.exp2(tl.minimum(G - r[None, :], 0.0)), 0.0)
          * mm(dP_b, b_k * tl.exp2(tl.minimum(r[None, :] - G, _SAFE)), DOT_BF16, PREC))
    q_f = tl.where(in_blk[:, None], b_q * tl.exp2(tl.minimum(G - r[None, :], 0.0)), 0.0)
    dk = tl.exp2(tl.minimum(r[None, :] - G, _SAFE)) * mm(tl.trans(dP_b), q_f, DOT_BF16, PREC)
    return dq, dk


@triton.jit
def dqk_slow(dP, b_q, b_k, gp, t0, n_valid, stride_t, c0, K: tl.constexpr,
             BT: tl.constexpr, BK: tl.constexpr, DOT_BF16: tl.constexpr, PREC: tl.constexpr):
    """Intra-chunk dq_i = sum_{j<=i} dP_ij k_j 2^{G_i - G_j} and dk_j = sum_{i>=j} dP_ij q_i 2^{G_i - G_j}
    (dP must be causally masked: its zeros stand in for the mask), in the row blocks of
    scores_slow: dq_B = 2^{G_B - r} (dP_B @ k 2^{r - G}) and dk += 2^{r - G} (dP_B^T @ q_B 2^{G_B - r});
    a steep block's dP rows are masked out of the products (its dk share too) and redone
    one at a time."""
    G, _ = gates(gp, t0, n_valid, stride_t, c0, K, BT, BK)
    rows = tl.arange(0, BT)
    dq = tl.zeros([BT, BK], dtype=tl.float32)
    dk = tl.zeros([BT, BK], dtype=tl.float32)
    SB: tl.constexpr = 16 if BT > 16 else BT
    for blk in tl.static_range(BT // SB):
        in_blk, r, ok = _block_frame(G, rows, blk * SB, SB, BT)
        dq_b, dk_b = _block_dqk(dP, b_q, b_k, G, in_blk & (ok != 0), r, DOT_BF16, PREC)
        dq += dq_b
        dk += dk_b
        if not ok:
            dq, dk = _dqk_rows(dq, dk, dP, b_q, b_k, G, rows, blk * SB, blk * SB + SB)
    return dq, dk


@triton.jit
def score_tile(qp, kp, gp, t0, n_valid, k0, H: tl.constexpr, Hkv: tl.constexpr,
               K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, DOT_BF16: tl.constexpr,
               PREC: tl.constexpr):
    """One K tile's share of the scores P (entries above the diagonal are garbage for the
    caller to mask), factorised on tensor cores around the midpoint anchor when the tile's
    decay allows it, else in blocks (scores_slow); also returns the tile's q and G."""
    b_q = load_rows(qp, t0, n_valid, H * K, k0, K, BT, BK).to(tl.float32)
    b_k = load_rows(kp, t0, n_valid, Hkv * K, k0, K, BT, BK).to(tl.float32)
    G, G_last = gates(gp, t0, n_valid, Hkv * K, k0, K, BT, BK)
    if is_fast(G_last):
        a = anchor(G_last)[None, :]
        p = mm(b_q * tl.exp2(G - a), tl.trans(b_k * tl.exp2(a - G)), DOT_BF16, PREC)
    else:
        p = scores_slow(b_q, b_k, gp, t0, n_valid, Hkv * K, k0, K, BT, BK, DOT_BF16, PREC)
    return p, b_q, G
