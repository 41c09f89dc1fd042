"""A hybrid layer's attention over whole sequences on the CPU, without gradients: the exact
window with its sinks, the GLA state over the keys that have left the window, and their mix
in one computation (`hybrid_attention_cpu`).

The references (window.reference, gla.reference) go a block of queries at a time through
their own layouts and hand the window's output and log-normaliser to window_mix_torch. On a
CPU their many small operations, the copies between layouts and the extra passes over the
scores (logsumexp, then softmax) cost more than the arithmetic. Here the queries are laid out
once in blocks of C tokens, [B, Hkv, blocks, C G, D] (row c G + g: token c of the block,
query head g of the KV head's group), and each product covers every block of a span at once:

- window: block n's queries score the keys n C - W + 1 .. n C + C - 1 (an unfolded view of the
  keys padded in front by W - 1 rows, read in place one KV head at a time), the sinks (with
  q_s and k_s, window.reference says why) and, with the shared mix, the state as one more key
  of score c + log den and value num / (den + eps). One softmax over those columns gives the
  mixed output:
  (e^lse o_win + e^c num) / (e^lse + e^c den) is window_mix_torch's shared mix, and the
  window's log-normaliser is never formed. With the learned mix the softmax has no state
  column, and the parts mix with sigmoid(c) where den > 0.
- state: GLA over the keys that have left the window, in chunks of whole query blocks, as
  gla.reference's chunked form computes it. Key j >= S enters at step j + W; chunks that end
  before step W + S take none and are skipped.

Where a chunk's decay is too strong for the factorised scores (gla.reference.SAFE_EXP) the
references run instead. Spans of `span` tokens bound the scores' memory on long inputs, the
state passing from one span to the next.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .gla.reference import SAFE_EXP, chunk_gla_torch
from .ops import with_ones
from .window.reference import window_attention_torch, window_mix_torch


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
    [B, T, H, F]; phi_k, g [B, T, Hkv, F] (g: log-decays, <= 0); logit [H]. scale defaults to
    1/sqrt(D). Float32 maths. block: tokens per query block C; chunk: per GLA chunk, rounded
    down to whole blocks; span: per pass, rounded down to whole chunks."""
    B, T, H, D = q_r.shape
    Hkv, Fd = k_r.shape[2], phi_q.shape[-1]
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
    first = min(W + S, T) // CG * CG                            # the first chunk into which a key enters
    Gc = enter = None
    if T > W + S:
        # log-decays summed within each chunk from `first` on
        Gc = g.new_zeros(B, Hkv, Tp - first, Fd)
        Gc[:, :, :T - first] = g[:, first:].transpose(1, 2)
        Gc = Gc.view(B, Hkv, -1, CG, Fd).cumsum_(3)
        if bool(Gc[:, :, :, -1].amin() < -SAFE_EXP):
            return _by_references(q_r, q_s, k_r, k_s, v, phi_q, phi_k, g, W, S, logit, shared, scale, gla_scale,
                                  eps)
        # what enters the state at step t: phi_k and [v, 1] of token t - W, for t - W >= S
        enter = phi_k.new_zeros(B, Hkv, Tp - first, Fd + D + 1)
        rows = enter[:, :, W + S - first:T - first]
        rows[..., :Fd] = phi_k[:, S:T - W].transpose(1, 2)
        rows[..., Fd:Fd + D] = v[:, S:T - W].transpose(1, 2)
        rows[..., Fd + D] = 1
    # keys (times the scale) and values padded in front by W - 1 rows: block n's window is their
    # rows n C .. n C + L - 1
    keys = k_r.new_zeros(B, Hkv, P + Tp, D)
    torch.mul(k_r.transpose(1, 2), scale, out=keys[:, :, P:P + T])
    values = v.new_zeros(B, Hkv, P + Tp, D)
    values[:, :, P:P + T] = v.transpose(1, 2)
    ns = k_s.shape[1]
    if S:
        sink_keys = k_r.new_zeros(B, Hkv, S, D)                 # sinks beyond T stay zero (masked)
        torch.mul(k_s.transpose(1, 2), scale, out=sink_keys[:, :, :ns])
        sink_values = v.new_zeros(B, Hkv, S, D)
        sink_values[:, :, :ns] = v[:, :ns].transpose(1, 2)

    o = q_r.new_empty(B, Tp, H, D)
    state = q_r.new_zeros(B, Hkv, Fd, D + 1)
    head, steady = _window_bias(W, S, C, ns, shared)
    for a in range(0, Tp, span):
        b = min(Tp, a + span)
        n = (b - a) // C                                        # blocks in this span
        qb = _blocks(q_r, a, b, C, Hkv)                          # [B, Hkv, n, C G, D]
        # block n's window keys are rows n C .. n C + L - 1 of `keys`: one view, [B, Hkv, n, D, L]
        # (and [.., L, D] of `values`), whose blocks overlap, so that a product over all of
        # (B, Hkv, n) at once would copy them; one KV head at a time, they are read in place
        window_keys = keys[:, :, a:b + P].unfold(2, L, C)
        window_values = values[:, :, a:b + P].unfold(2, L, C).transpose(-1, -2)
        # the scores' columns: the sinks, the window's keys, the state (shared mix)
        s = qb.new_empty(B, Hkv, n, C * G, S + L + int(shared))
        qs = _blocks(q_s, a, b, C, Hkv) if S else None
        for i in range(B):
            for h in range(Hkv):
                if S:
                    s[i, h, :, :, :S] = qs[i, h] @ sink_keys[i, h].t()
                s[i, h, :, :, S:S + L] = torch.bmm(qb[i, h], window_keys[i, h])
        lin = None
        if enter is not None and b > first:
            lin = _state_part(phi_q, enter, Gc, state, max(a, first), b, first, C, CG, Hkv, Fd, D, gla_scale)
            start = (max(a, first) - a) // C                    # the span's first block with a state part
            num, den = lin[..., :D], lin[..., D:]
        if shared:
            column = s[..., S + L:]
            column.fill_(float("-inf"))
            if lin is not None:
                # score c + log den; den is 0 (log -inf) until a key has entered, never negative
                torch.add(den.log(), _per_row(logit, Hkv, C), out=column[:, :, start:])
        s = s.view(B, Hkv, n, C, G, -1)
        m = len(head) - a // C                                  # the span's blocks that take `head`
        if m > 0:
            s[:, :, :m] += head[a // C:b // C]
        if m < n:
            s[:, :, max(m, 0):] += steady
        p = torch.softmax(s, -1).view(B, Hkv, n, C * G, -1)
        out = qb.new_empty(B, Hkv, n, C * G, D)
        for i in range(B):
            for h in range(Hkv):
                pw = p[i, h, :, :, S:S + L]
                if S:
                    torch.baddbmm(p[i, h, :, :, :S] @ sink_values[i, h], pw, window_values[i, h], out=out[i, h])
                else:
                    torch.bmm(pw, window_values[i, h], out=out[i, h])
        if lin is not None:
            o_state = num / (den + eps)
            if shared:
                out[:, :, start:].addcmul_(p[:, :, start:, :, -1:], o_state)
            else:
                share = torch.where(den > 0, _per_row(torch.sigmoid(logit), Hkv, C), 0.0)
                out[:, :, start:].lerp_(o_state, share)
        o[:, a:b].view(B, n, C, Hkv, G, D).copy_(out.view(B, Hkv, n, C, G, D).permute(0, 2, 3, 1, 4, 5))
    return o[:, :T], state


def _blocks(x, a, b, C, Hkv, factor=None):
    """Rows a .. b - 1 of x [B, T, Hkv G, X] (any strides) as [B, Hkv, blocks, C G, X] float32,
    times factor [B, Hkv, b - a, 1, X] if given, rows past T zero."""
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
        torch.mul(src, factor[:, :, :end - a], out=rows[:, :, :end - a])
    return out.view(B, Hkv, (b - a) // C, C * G, -1)


def _state_part(phi_q, enter, Gc, state, a, b, first, C, CG, Hkv, Fd, D, gla_scale):
    """The GLA part [num, den] [B, Hkv, blocks, C G, D + 1] of rows a .. b - 1 (whole chunks from
    `first` on), as chunk_gla_torch computes it; `state` enters at row a and leaves, updated in
    place, at row b."""
    B = phi_q.shape[0]
    G = phi_q.shape[2] // Hkv
    m = (b - a) // CG                                            # chunks
    i, j = (a - first) // CG, (b - first) // CG
    Gs = Gc[:, :, i:j]                                           # [B, Hkv, m, CG, F]
    e = enter.view(B, Hkv, -1, CG, enter.shape[-1])[:, :, i:j]
    k, vv = e[..., :Fd], e[..., Fd:]                             # [B, Hkv, m, CG, F], [.., D + 1]
    # decays from the chunk's start: exp(G) for the queries, exp(-G) for the keys (at most
    # e^SAFE_EXP), exp(G_last - G) = exp(G_last) exp(-G) to the chunk's end
    up = Gs.exp()
    qe = _blocks(phi_q, a, b, C, Hkv, up.view(B, Hkv, m * CG, 1, Fd)).view(B, Hkv, m, CG * G, Fd)
    if gla_scale != 1.0:
        qe.mul_(gla_scale)
    ke = k * up.reciprocal_()
    scores = qe @ ke.transpose(-1, -2)                           # [B, Hkv, m, CG G, CG]
    scores.view(B, Hkv, m, CG, G, CG).masked_fill_(_later(CG), 0.0)
    decay = Gs[:, :, :, -1:].exp()                               # [B, Hkv, m, 1, F]
    chunk_kv = ke.mul_(decay).transpose(-1, -2) @ vv             # [.., F, D + 1]
    decay = decay.transpose(-1, -2)
    starts = chunk_kv.new_empty(chunk_kv.shape)
    starts[:, :, 0] = state
    for c in range(1, m):
        torch.addcmul(chunk_kv[:, :, c - 1], decay[:, :, c - 1], starts[:, :, c - 1], out=starts[:, :, c])
    torch.addcmul(chunk_kv[:, :, m - 1], decay[:, :, m - 1], starts[:, :, m - 1], out=state)
    lin = torch.baddbmm(qe.flatten(0, 2) @ starts.flatten(0, 2), scores.flatten(0, 2), vv.flatten(0, 2))
    return lin.view(B, Hkv, (b - a) // C, C * G, D + 1)


def _per_row(per_head, Hkv, C):
    """A per-query-head [H] value as a column [Hkv, 1, C G, 1] of the block rows."""
    G = per_head.shape[0] // Hkv
    return per_head.view(Hkv, 1, 1, G, 1).expand(Hkv, 1, C, G, 1).reshape(Hkv, 1, C * G, 1)


@functools.lru_cache(maxsize=32)
def _window_bias(W, S, C, ns, state_column):
    """(head [h, C, 1, columns], steady [C, 1, columns]): 0 where token c of a block sees the
    column (the sinks, the block's C + W - 1 window keys, the state), -inf elsewhere; ns: the
    sinks there are. The first h blocks hold tokens that see part of the window's keys or not
    every sink; every later block sees as `steady` does. The same for every layer."""
    h = -(-(W + S - 1) // C)
    n = torch.arange(h + 1).view(-1, 1, 1)
    i = n * C + torch.arange(C).view(1, C, 1)                    # the query's token
    j = n * C - (W - 1) + torch.arange(C + W - 1)                # the key's
    s = torch.arange(S)
    seen = [((s < ns) & (i - s >= W)).expand(h + 1, C, S),       # sinks out of the window
            (j >= 0) & (j <= i) & (i - j < W)]
    if state_column:
        seen.append(torch.ones(h + 1, C, 1, dtype=torch.bool))
    seen = torch.cat(seen, -1)
    bias = torch.zeros(seen.shape).masked_fill_(~seen, float("-inf"))[:, :, None]
    return bias[:h], bias[h]


@functools.lru_cache(maxsize=8)
def _later(C):
    """[C, 1, C] bool: key j after query i within a chunk."""
    return torch.ones(C, C, dtype=torch.bool).triu(1)[:, None]


def _by_references(q_r, q_s, k_r, k_s, v, phi_q, phi_k, g, W, S, logit, shared, scale, gla_scale, eps):
    """hybrid_attention_cpu's result from the references themselves."""
    B, T = q_r.shape[:2]
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
