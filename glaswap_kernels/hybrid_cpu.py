"""A hybrid layer's attention over whole sequences on the CPU, without gradients: the exact
window with its sinks, the GLA state over the keys that have left the window, and their mix
in one computation (`hybrid_attention_cpu`).

The references (window.reference, gla.reference) go a block of queries at a time through
their own layouts and hand the window's output and log-normaliser to window_mix_torch. On a
CPU their many small operations, the copies between layouts and the extra passes over the
scores cost more than the arithmetic. Here the queries are laid out once in blocks of C
tokens, [B, Hkv, blocks, C G, D] (row c G + g: token c of the block, query head g of the KV
head's group):

- window: block n's queries attend to the keys n C - W + 1 .. n C + C - 1, an unfolded view of
  the keys padded in front by W - 1 rows, through PyTorch's fused CPU attention with each
  block as one head: it reads the overlapping views in place, never writes the scores out, and
  returns the window's log-normaliser lse beside its output.
- the rest, from the first token that has more (token W: a sink outside its window; the
  state): one softmax per query row over a few columns, lse, the sinks' scores s_i (with q_s
  and k_s, window.reference says why) and, with the shared mix, the state's c + log den, gives
  each part's share of (e^lse o_win + sum_i e^s_i v_i + e^c num) / (e^lse + sum_i e^s_i + e^c den),
  window_mix_torch's shared mix of the window with its sinks and the state (whose value is
  num / (den + eps)). With the learned mix the softmax has no state column, and the parts mix
  with sigmoid(c) where den > 0.
- state: GLA over the keys that have left the window, in chunks of whole query blocks, as
  gla.reference's chunked form computes it. Key j >= S enters at step j + W; chunks that end
  before step W + S take none and are skipped.

Where a chunk's decay is too strong for the factorised scores (gla.reference.SAFE_EXP) the
references run instead. Spans of `span` tokens bound the memory of the state's scores and of
the masks on long inputs, the state passing from one span to the next.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .gla.reference import SAFE_EXP, chunk_gla_torch
from .ops import with_ones
from .window.reference import window_attention_torch, window_mix_torch

# (output, logsumexp) of PyTorch's fused CPU attention: it reads overlapping, strided keys in
# place, never forms the scores, and its logsumexp lets the sinks and the state join afterwards
_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def hybrid_attention_cpu(q_r, q_s, k_r, k_s, v, phi_q, phi_k, g, window, sinks, logit, shared=True, scale=None,
                         gla_scale=1.0, eps=1e-6, block=32, chunk=32, span=512):
    """(o [B, T, H, D] float32, final state [B, Hkv, F, D + 1] float32) of a hybrid layer
    reading T tokens from scratch, with one state per KV head:

        window_mix_torch(*window_attention_torch(q_r, k_r, v, window, sinks, scale, q_sink=q_s,
                                                 k_sink=k_s in the sinks' rows),
                         chunk_gla_torch(phi_q, k_in, [v_in, 1], g, gla_scale), logit, shared, eps)

    where k_in, v_in are phi_k and v moved `window` steps later, zero where the source is
    among the first `sinks` tokens (GLAAttention's _enter_state); the state is chunk_gla's.
    q_r, q_s [B, T, H, D]; k_r, v [B, T, Hkv, D]; k_s [B, min(sinks, T), Hkv, D]; phi_q
    [B, T, H, F]; phi_k [B, T, Hkv, F]; g [B, T, Hkv, F / R] (log-decays, <= 0): the decays of each
    of phi's R equal parts, which gate_logsigmoid's repeat would make a copy each; logit [H]. scale
    defaults to 1/sqrt(D). Float32 maths. block: tokens per query block C; chunk: per GLA chunk, rounded
    down to whole blocks; span: per pass, rounded down to whole chunks."""
    B, T, H, D = q_r.shape
    Hkv, Fd, Dg = k_r.shape[2], phi_q.shape[-1], g.shape[-1]
    W, S = window, sinks
    scale = D ** -0.5 if scale is None else float(scale)
    G = H // Hkv
    C = min(block, T)
    CG = max(C, min(chunk, -(-T // C) * C) // C * C)            # GLA chunk: whole blocks
    Tp = -(-T // CG) * CG
    span = max(CG, span // CG * CG)
    f32 = torch.float32
    q_r, q_s, k_r, k_s, v, phi_q, phi_k, g, logit = (t if t.dtype == f32 else t.float()
                                                     for t in (q_r, q_s, k_r, k_s, v, phi_q, phi_k, g, logit))

    P, L = W - 1, C + W - 1
    # tokens before W see every earlier key, no sink outside their window and an empty state:
    # their output is causal attention, one call that skips the keys after each query, where
    # the blocks' windows would score (and mask) W - 1 padding rows in front of each
    head = min(W // CG * CG, T)
    first = min(W + S, T) // CG * CG                            # the first chunk into which a key enters
    Gc = enter = None
    if T > W + S:
        # log-decays summed within each chunk from `first` on
        Gc = g.new_empty(B, Hkv, Tp - first, Dg)
        Gc[:, :, :T - first] = g[:, first:].transpose(1, 2)
        Gc[:, :, T - first:] = 0
        Gc = Gc.view(B, Hkv, -1, CG, Dg).cumsum_(3)
        if bool(Gc[:, :, :, -1].amin() < -SAFE_EXP):
            return _by_references(q_r, q_s, k_r, k_s, v, phi_q, phi_k, g, W, S, logit, shared, scale, gla_scale,
                                  eps)
        # what enters the state at step t: phi_k and [v, 1] of token t - W, for t - W >= S
        enter = phi_k.new_empty(B, Hkv, Tp - first, Fd + D + 1)
        enter[:, :, :W + S - first] = 0
        enter[:, :, T - first:] = 0
        rows = enter[:, :, W + S - first:T - first]
        rows[..., :Fd] = phi_k[:, S:T - W].transpose(1, 2)
        rows[..., Fd:Fd + D] = v[:, S:T - W].transpose(1, 2)
        rows[..., Fd + D] = 1
    # keys and values [B, Hkv, rows, D], token t in row t + pad: the blocks' windows reach back
    # W - 1 tokens before `head`, and forward to Tp. Read in place where neither needs a row of
    # zeros, for one row (several would not flatten into the attention's heads without a copy).
    pad = max(0, P - head)
    if pad or Tp > T or B > 1:
        keys = k_r.new_zeros(B, Hkv, pad + Tp, D)
        keys[:, :, pad:pad + T] = k_r.transpose(1, 2)
        values = v.new_zeros(B, Hkv, pad + Tp, D)
        values[:, :, pad:pad + T] = v.transpose(1, 2)
    else:
        keys, values = k_r.transpose(1, 2), v.transpose(1, 2)
    ns = k_s.shape[1]
    if S:
        sink_keys = k_r.new_zeros(B, Hkv, 1, D, S)              # sinks beyond T stay zero (masked)
        torch.mul(k_s.permute(0, 2, 3, 1), scale, out=sink_keys[:, :, 0, :, :ns])
        sink_values = v.new_zeros(B, Hkv, 1, S, D)
        sink_values[:, :, 0, :ns] = v[:, :ns].transpose(1, 2)

    o = q_r.new_empty(B, Tp, H, D)
    state = q_r.new_zeros(B, Hkv, Fd, D + 1)
    if head:
        o[:, :head] = F.scaled_dot_product_attention(
            q_r[:, :head].transpose(1, 2), k_r[:, :head].transpose(1, 2), v[:, :head].transpose(1, 2),
            is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2)
    for a in range(head, Tp, span) if head < T else ():
        b = min(Tp, a + span)
        n = (b - a) // C                                        # blocks in this span
        # the window: block n's C G query rows against its L keys, an unfolded view of the padded
        # keys (read in place, blocks overlapping) as the heads of one fused attention call
        qb = _blocks(q_r, a, b, C, Hkv).flatten(0, 1)            # [B Hkv, n, C G, D]
        reach = slice(a - P + pad, b + pad)
        window_keys = keys[:, :, reach].unfold(2, L, C).transpose(-1, -2).flatten(0, 1)
        window_values = values[:, :, reach].unfold(2, L, C).transpose(-1, -2).flatten(0, 1)
        out, lse = _attention(qb, window_keys, window_values, attn_mask=_window_mask(W, C, G, a // C, n),
                              scale=scale)
        out, lse = out.unflatten(0, (B, Hkv)), lse.unflatten(0, (B, Hkv))
        lin = None
        if enter is not None and b > first:
            lin = _state_part(phi_q, enter, Gc, state, max(a, first), b, first, C, CG, Hkv, Fd, D, gla_scale)
            start = (max(a, first) - a) // C                    # the span's first block with a state part
            num, den = lin[..., :D], lin[..., D:]
        # only tokens from W on see a sink outside their window, and the state is empty before
        # `first`: earlier blocks keep the window's output as it is
        m = min(n, max(0, W - a) // C, start if lin is not None else n)
        if m < n and (S or lin is not None):
            # the window as one column of score lse beside the sinks' and, with the shared mix, the
            # state's (score c + log den, value num / (den + eps)): one softmax over those columns
            # gives each part's share of window_mix_torch's output
            s = out.new_empty(B, Hkv, n - m, C * G, 1 + S + int(shared))
            s[..., 0] = lse[:, :, m:]
            if S:
                torch.add(_blocks(q_s, a + m * C, b, C, Hkv) @ sink_keys,
                          _sink_bias(W, S, ns, C, G, a + m * C, b), out=s[..., 1:1 + S])
            if shared:
                column = s[..., 1 + S]
                column.fill_(float("-inf"))
                if lin is not None:
                    # den is 0 (log -inf) until a key has entered, never negative
                    torch.add(den.log(), _per_row(logit, Hkv, C), out=s[:, :, start - m:, :, 1 + S:])
            p = torch.softmax(s, -1)
            tail = out[:, :, m:]
            tail.mul_(p[..., :1])
            if S:
                tail.add_(p[..., 1:1 + S] @ sink_values)
            if lin is not None:
                o_state = num / (den + eps)
                if shared:
                    tail[:, :, start - m:].addcmul_(p[..., 1 + S:][:, :, start - m:], o_state)
                else:
                    share = torch.where(den > 0, _per_row(torch.sigmoid(logit), Hkv, C), 0.0)
                    tail[:, :, start - m:].lerp_(o_state, share)
        o[:, a:b].view(B, n, C, Hkv, G, D).copy_(out.view(B, Hkv, n, C, G, D).permute(0, 2, 3, 1, 4, 5))
    return o[:, :T], state


def _blocks(x, a, b, C, Hkv, factor=None):
    """Rows a .. b - 1 of x [B, T, Hkv G, X] (any strides) as [B, Hkv, blocks, C G, X] float32,
    times factor [B, Hkv, b - a, 1, X / R] if given (on each of X's R equal parts), rows past T zero."""
    B, T = x.shape[:2]
    G = x.shape[2] // Hkv
    out = x.new_empty(B, Hkv, (b - a) // C, C, G, x.shape[-1], dtype=torch.float32)
    rows = out.view(B, Hkv, b - a, G, -1)
    end = min(b, T)
    if end < b:
        rows[:, :, end - a:] = 0
    src = x[:, a:end].unflatten(2, (Hkv, G)).transpose(1, 2)
    if factor is None:
        rows[:, :, :end - a] = src
    else:
        parts = (x.shape[-1] // factor.shape[-1], -1)
        torch.mul(src.unflatten(-1, parts), factor[:, :, :end - a, :, None],
                  out=rows[:, :, :end - a].unflatten(-1, parts))
    return out.view(B, Hkv, (b - a) // C, C * G, -1)


def _state_part(phi_q, enter, Gc, state, a, b, first, C, CG, Hkv, Fd, D, gla_scale):
    """The GLA part [num, den] [B, Hkv, blocks, C G, D + 1] of rows a .. b - 1 (whole chunks from
    `first` on), as chunk_gla_torch computes it; `state` enters at row a and leaves, updated in
    place, at row b."""
    B = phi_q.shape[0]
    G = phi_q.shape[2] // Hkv
    m = (b - a) // CG                                            # chunks
    i, j = (a - first) // CG, (b - first) // CG
    Gs = Gc[:, :, i:j]                                           # [B, Hkv, m, CG, Dg]
    parts = (Fd // Gs.shape[-1], -1)                             # F's parts, each decaying as Gs
    e = enter.view(B, Hkv, -1, CG, enter.shape[-1])[:, :, i:j]
    k, vv = e[..., :Fd], e[..., Fd:]                             # [B, Hkv, m, CG, F], [.., D + 1]
    # decays from the chunk's start: exp(G) for the queries, exp(-G) for the keys (at most
    # e^SAFE_EXP), exp(G_last - G) = exp(G_last) exp(-G) to the chunk's end
    up = Gs.exp()
    qe = _blocks(phi_q, a, b, C, Hkv, up.view(B, Hkv, m * CG, 1, -1)).view(B, Hkv, m, CG * G, Fd)
    if gla_scale != 1.0:
        qe.mul_(gla_scale)
    ke = (k.unflatten(-1, parts) * up.reciprocal_()[..., None, :]).flatten(-2)
    scores = qe @ ke.transpose(-1, -2)                           # [B, Hkv, m, CG G, CG]
    scores.view(B, Hkv, m, CG, G, CG).masked_fill_(_later(CG), 0.0)
    decay = Gs[:, :, :, -1:].exp()                               # [B, Hkv, m, 1, Dg]
    ke.unflatten(-1, parts).mul_(decay[..., None, :])
    chunk_kv = ke.transpose(-1, -2) @ vv                         # [.., F, D + 1]
    starts = chunk_kv.new_empty(chunk_kv.shape)
    starts[:, :, 0] = state
    # per part of F: [B, Hkv, m, R, Dg, D + 1] and its decays [B, Hkv, m, 1, Dg, 1]
    kv_parts, start_parts = chunk_kv.unflatten(3, parts), starts.unflatten(3, parts)
    decay = decay.transpose(-1, -2)[:, :, :, None]
    for c in range(1, m):
        torch.addcmul(kv_parts[:, :, c - 1], decay[:, :, c - 1], start_parts[:, :, c - 1], out=start_parts[:, :, c])
    torch.addcmul(kv_parts[:, :, m - 1], decay[:, :, m - 1], start_parts[:, :, m - 1], out=state.unflatten(2, parts))
    lin = torch.baddbmm(qe.flatten(0, 2) @ starts.flatten(0, 2), scores.flatten(0, 2), vv.flatten(0, 2))
    return lin.view(B, Hkv, (b - a) // C, C * G, D + 1)


def _per_row(per_head, Hkv, C):
    """A per-query-head [H] value as a column [Hkv, 1, C G, 1] of the block rows."""
    G = per_head.shape[0] // Hkv
    return per_head.view(Hkv, 1, 1, G, 1).expand(Hkv, 1, C, G, 1).reshape(Hkv, 1, C * G, 1)


@functools.lru_cache(maxsize=32)
def _window_mask(W, C, G, n0, n):
    """The additive mask of blocks n0 .. n0 + n - 1 over their window keys: 0 where row c G + g
    (token c of the block) sees key l of the block's C + W - 1, -inf elsewhere. [1, n, C G, L],
    or [C G, L] where every block is past the first h, whose windows reach before token 0 and
    which all see as the same mask. The same for every layer."""
    h = -(-(W - 1) // C)
    steady = n0 >= h
    blocks = torch.arange(n0, n0 + (1 if steady else n)).view(-1, 1, 1)
    i = blocks * C + torch.arange(C).view(1, C, 1)               # the query's token
    j = blocks * C - (W - 1) + torch.arange(C + W - 1)           # the key's
    seen = (j >= 0) & (j <= i) & (i - j < W)
    mask = torch.zeros(seen.shape).masked_fill_(~seen, float("-inf"))
    mask = mask[:, :, None].expand(-1, C, G, C + W - 1).reshape(-1, C * G, C + W - 1)
    return mask[0] if steady else mask[None]


def _sink_bias(W, S, ns, C, G, t0, t1):
    """[1, 1, blocks, C G, S] for tokens t0 .. t1 - 1: 0 where the token scores sink s (one of
    the ns there are, outside its window), -inf elsewhere. Past token W + S - 1 every token
    sees every sink, so those spans share one cached tensor."""
    steady = W + S - 1
    if t0 > steady:
        t0, t1 = steady, steady + t1 - t0
    return _sink_bias_at(W, S, ns, C, G, t0, t1)


@functools.lru_cache(maxsize=32)
def _sink_bias_at(W, S, ns, C, G, t0, t1):
    t = torch.arange(t0, t1).view(-1, 1)
    s = torch.arange(S)
    seen = (s < ns) & (t - s >= W)
    bias = torch.zeros(seen.shape).masked_fill_(~seen, float("-inf"))
    return bias.view(-1, C, 1, S).expand(-1, C, G, S).reshape(1, 1, -1, C * G, S)


@functools.lru_cache(maxsize=8)
def _later(C):
    """[C, 1, C] bool: key j after query i within a chunk."""
    return torch.ones(C, C, dtype=torch.bool).triu(1)[:, None]


def _by_references(q_r, q_s, k_r, k_s, v, phi_q, phi_k, g, W, S, logit, shared, scale, gla_scale, eps):
    """hybrid_attention_cpu's result from the references themselves."""
    B, T = q_r.shape[:2]
    g = g.repeat(1, 1, 1, phi_q.shape[-1] // g.shape[-1])
    k_sink = None
    if S:
        k_sink = torch.zeros_like(k_r)
        k_sink[:, :k_s.shape[1]] = k_s
    o_win, lse = window_attention_torch(q_r, k_r, v, W, S, scale=scale, q_sink=q_s if S else None, k_sink=k_sink)
    pad = [0, 0, 0, 0, W + S, 0]
    k_in = F.pad(phi_k[:, S:T - W], pad) if T > W + S else torch.zeros_like(phi_k)
    v_in = F.pad(v[:, S:T - W], pad) if T > W + S else torch.zeros_like(v)
    o_lin, state = chunk_gla_torch(phi_q, k_in, with_ones(v_in), g, scale=gla_scale, output_final_state=True)
    return window_mix_torch(o_win, lse, o_lin, logit, shared, eps).float(), state
