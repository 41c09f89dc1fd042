"""What a hybrid layer keeps between calls, and how new tokens are read through it.

A hybrid layer (config.window) attends exactly to each token's last W tokens and its
document's first S tokens (the sinks); every older key reaches it through the GLA state,
which it enters once it leaves the window. Reading with a cache (a prompt in one or more
calls, decode steps), a layer keeps:
- `WindowBuffer`: the last W tokens' rotated keys, values, feature-mapped keys, positions;
- `SinkBuffer`: the S sinks' keys turned back by W steps (`ExactInputs`), values, positions;
- `SparseBuffer` (config.sparse_cache = M): M older keys that the state recalls worst, kept
  out of it and attended exactly, as the sinks are.
Position -1 marks an empty slot or padding. `stream` reads new tokens after these buffers
and a state, and returns the buffers and state after them.

The buffers grow with what they hold, up to W, S and M rows: a window, sinks or sparse cache
as long as the model's positions costs nothing until a context fills it. A window buffer of
L < W rows stands for W rows whose first W - L are empty; a sink buffer of fewer than S rows
(slot = position) and a sparse buffer of fewer than M for ones whose missing slots are empty.
A captured decode graph needs fixed shapes and takes them at full size (`static`, `sized`).
Decode steps on the CPU keep the buffers in another form while they run (`DecodeRings`), one
that a token reads and writes in place, and turn them back into these when anything else reads
them.

This file is copied into every saved model folder: it imports only torch and the GLA ops.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from glaswap_kernels.ops import chunk_gla, decode_step, hybrid_decode, window_attention, window_over_buffer, \
    window_over_full_buffer, with_ones

# A sparse cache chooses what it keeps once per this many new tokens: every key leaving the
# window within a block is scored against the state as it stood at the block's start.
SPARSE_BLOCK = 64


class TensorGroup:
    """A dataclass of tensors (and of other groups): iterate, copy or map them all at once."""

    def tensors(self) -> list[torch.Tensor]:
        out = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, TensorGroup):
                out += value.tensors()
            elif value is not None:
                out.append(value)
        return out

    def map(self, fn):
        """A group of the same shape with fn applied to every tensor."""
        changed = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            changed[f.name] = value.map(fn) if isinstance(value, TensorGroup) else \
                None if value is None else fn(value)
        return type(self)(**changed)

    def copy_(self, other):
        """Copy other's tensors into this group's, in place (same shapes)."""
        for mine, theirs in zip(self.tensors(), other.tensors(), strict=True):
            mine.copy_(theirs)


@dataclass
class WindowBuffer(TensorGroup):
    keys: torch.Tensor                          # [B, W, Hkv, D] rotated
    values: torch.Tensor                        # [B, W, Hkv, D]
    feature_keys: torch.Tensor                  # [B, W, Hs, F] phi(k), what enters the state
    positions: torch.Tensor                     # [B, W] long
    turned_keys: torch.Tensor | None = None     # [B, W, Hkv, D] as the sparse cache scores them


@dataclass
class SinkBuffer(TensorGroup):
    keys: torch.Tensor                          # [B, S, Hkv, D] turned back by W steps
    values: torch.Tensor                        # [B, S, Hkv, D]
    positions: torch.Tensor                     # [B, S] long


@dataclass
class SparseBuffer(TensorGroup):
    keys: torch.Tensor                          # [B, M, Hkv, D] turned back by W steps
    values: torch.Tensor                        # [B, M, Hkv, D]
    feature_keys: torch.Tensor                  # [B, M, Hs, F]
    log_decay: torch.Tensor                     # [B, M, Hs, F] float32, since each would have entered the state
    positions: torch.Tensor                     # [B, M, Hkv] long


@dataclass
class HybridBuffers(TensorGroup):
    window: WindowBuffer
    sinks: SinkBuffer
    sparse: SparseBuffer | None = None

    @classmethod
    def empty(cls, batch, window, sinks, sparse, keys_like, features_like, static=False):
        """Buffers before any token: no rows, to grow as tokens arrive, or with `static` W, S
        and M empty rows, the fixed shapes a captured graph reads. keys_like: a [.., .., Hkv, D]
        tensor of the keys' dtype and device; features_like: a [.., .., Hs, F] tensor of phi(k)'s."""
        with_sparse = bool(sparse)
        if not static:
            window, sinks, sparse = 0, 0, 0
        dev = keys_like.device
        kv = lambda n: keys_like.new_zeros(batch, n, *keys_like.shape[2:])       # noqa: E731
        feats = lambda n: features_like.new_zeros(batch, n, *features_like.shape[2:])  # noqa: E731
        none = lambda *shape: torch.full(shape, -1, device=dev)                 # noqa: E731
        win = WindowBuffer(kv(window), kv(window), feats(window), none(batch, window),
                           kv(window) if with_sparse else None)
        sparse_buf = None
        if with_sparse:
            sparse_buf = SparseBuffer(kv(sparse), kv(sparse), feats(sparse),
                                      torch.zeros(batch, sparse, *features_like.shape[2:], device=dev),
                                      none(batch, sparse, keys_like.shape[2]))
        return cls(win, SinkBuffer(kv(sinks), kv(sinks), none(batch, sinks)), sparse_buf)

    def clear_(self):
        """Every slot empty, in place (the fixed buffers of a captured graph)."""
        for t in self.tensors():
            t.fill_(_empty_value(t))

    def sized(self, window, sinks, sparse) -> HybridBuffers:
        """The same buffers at W, S and M rows (at least as many as they hold), the missing rows
        empty: at the front of the window, after the sinks' and the sparse cache's slots."""
        return HybridBuffers(_grown(self.window, window, True), _grown(self.sinks, sinks, False),
                             None if self.sparse is None else _grown(self.sparse, sparse, False))


def _empty_value(t):
    """What an empty slot holds: position -1, zeros elsewhere."""
    return -1 if t.dtype == torch.long else 0


def _grown(group: TensorGroup, rows, front):
    """group with empty rows added before (front) or after its own, up to `rows`."""
    return group.map(lambda t: _pad_rows(t, rows - t.shape[1], front, _empty_value(t)))


def _pad_rows(t, n, front, fill):
    """t [B, rows, ...] with n more rows of `fill` before (front) or after its rows."""
    if n <= 0:
        return t
    pad = t.new_full((t.shape[0], n, *t.shape[2:]), fill)
    return torch.cat([pad, t] if front else [t, pad], 1)


@dataclass
class ExactInputs:
    """What the exact softmax part reads: the teacher's rotated queries and keys and the values
    for the window; for the sinks and the sparse cache the unrotated queries and the keys turned
    back by W steps, since rope_i(q) . rope_(i-W)(k) = q . rope_(-W)(k) (None when unused)."""
    q_rotated: torch.Tensor
    k_rotated: torch.Tensor
    values: torch.Tensor
    q_plain: torch.Tensor | None
    k_turned: torch.Tensor | None

    def rows(self, part: slice) -> ExactInputs:
        return ExactInputs(*(None if t is None else t[:, part] for t in
                             (self.q_rotated, self.k_rotated, self.values, self.q_plain, self.k_turned)))


@dataclass
class StreamLayer:
    """What `stream` needs from the layer that calls it."""
    window: int
    sinks: int
    sparse: int                 # sparse-cache slots, 0 for none
    scale: float                # the GLA part's query scale
    softmax_scale: float        # the window's, the teacher's own
    backend: str
    per_state_head: object      # [B, N, Hkv, ...] -> [B, N, Hs, ...] (GLAAttention._per_state_head)
    combine: object             # (o_win, lse, o_lin) -> o (GLAAttention._combine)
    mix: tuple | None = None    # what combine mixes with, (logit [H], shared, eps), for the one-step path
    in_place: bool = False      # the buffers and state are a decode graph's static ones: decode steps
    #                             write them where they are


def stream(layer: StreamLayer, q, k, v, g, exact: ExactInputs, pos, buffers: HybridBuffers, state, cached: bool,
           order=None):
    """New tokens after `buffers` and `state`: (o [B, T, H, D], buffers after, state after).
    q, k: feature-mapped; v, g: per state head; pos: [B, T] long, -1 for padding; order:
    prompt_order's answer for a prompt read into a cache (None: the general path). With a
    sparse cache the tokens go through in blocks of SPARSE_BLOCK, each choosing which keys
    leaving the window the cache keeps (`sparse_select`)."""
    T = q.shape[1]
    step = SPARSE_BLOCK if layer.sparse else T
    if not cached or T == 1 or layer.sparse:
        order = None
    outs = []
    for a in range(0, T, step):
        part = slice(a, min(T, a + step))
        o, buffers, state = _stream_block(layer, q[:, part], k[:, part], v[:, part], g[:, part],
                                          exact.rows(part), pos[:, part], buffers, state, cached, order)
        outs.append(o)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 1)), buffers, state


def prompt_order(buffers: HybridBuffers, state, pos, W, S):
    """How a prompt (no sparse cache) stands to the cache, for the window part's fast paths:
    "empty" (nothing read yet, positions 0 .. T-1), "full" (sinks at 0 .. S-1, the window buffer
    the W positions right before the prompt, which follows on in order), else None (padding,
    a cache still filling up, positions out of order). One host sync."""
    B, T = pos.shape
    first = pos[:, :1]
    in_order = (pos == first + torch.arange(T, device=pos.device)).all()
    win, sinks = buffers.window.positions, buffers.sinks.positions
    empty = (first == 0).all() & (win < 0).all() & (sinks < 0).all()
    full = torch.zeros((), dtype=torch.bool, device=pos.device)
    if win.shape[1] == W and sinks.shape[1] == S:        # buffers still growing are not full
        full = (first >= W + S).all() & (win == first - W + torch.arange(W, device=pos.device)).all() \
            & (sinks == torch.arange(S, device=pos.device)).all()
    in_order, empty, full = torch.stack([in_order, empty, full]).tolist()
    if not in_order:
        return None
    return "empty" if empty and state is None else "full" if full else None


def _stream_block(layer, q, k, v, g, exact, pos, before, state, cached, order=None):
    """One stretch of new tokens: (o, buffers after, state after). order: prompt_order's."""
    W, S = layer.window, layer.sinks
    T = q.shape[1]
    win = before.window
    held = win.positions.shape[1]
    if T == 1 and cached and layer.mix is not None and not layer.sparse and held == W \
            and before.sinks.positions.shape[1] == S and not torch.is_grad_enabled():
        # a decode step after full buffers: the state update, the window's softmax, the mix and
        # the buffers after it in one op (one kernel on CUDA)
        logit, shared, eps = layer.mix
        sinks = before.sinks
        q_s = exact.q_plain if exact.q_plain is not None else exact.q_rotated    # unread without sinks
        k_s = exact.k_turned if exact.k_turned is not None else exact.k_rotated
        o, window, sinks, state = hybrid_decode(
            exact.q_rotated, q_s, q, exact.k_rotated, k_s, exact.values, k, g, pos,
            (win.keys, win.values, win.feature_keys, win.positions), (sinks.keys, sinks.values, sinks.positions),
            state, logit, layer.softmax_scale, layer.scale, shared, eps,
            in_place=layer.in_place and state is not None, backend=layer.backend)
        return o, HybridBuffers(WindowBuffer(*window), SinkBuffer(*sinks)), state
    # A buffer of fewer than W rows stands for W whose first ones are empty. As many of those
    # as the new tokens need stand in front, so that row t of the concatenation is still the
    # key that leaves the window at new step t (an empty row: none leaves).
    front = min(W - held, T)

    def rows(buffer, new, fill=0):
        return torch.cat([_pad_rows(buffer, front, True, fill), new], 1)

    keys = rows(win.keys, exact.k_rotated)                             # [B, front + held + T, Hkv, D]
    values = rows(win.values, exact.values)
    feature_keys = rows(win.feature_keys, k)
    key_pos = rows(win.positions, pos, -1)
    # New step t takes into the state the key that leaves the window then: index t of the
    # concatenation (W steps back), unless it is padding, empty or a sink (or, with a sparse
    # cache, kept there).
    enter = (key_pos[:, :T] >= S)[:, :, None]                          # [B, T, 1]
    sparse, visible_from, turned = None, None, None
    if layer.sparse:
        turned = rows(win.turned_keys, exact.k_turned)
        # the cache grows by the rows that can leave the window, never past M
        slots = min(layer.sparse, before.sparse.positions.shape[1] + T - front)
        kept, sparse, visible_from, state = sparse_select(
            before.sparse, state, feature_keys[:, :T], values[:, :T], turned[:, :T], key_pos[:, :T], g, S,
            layer.per_state_head, slots)
        enter = enter & ~kept                                          # [B, T, Hkv]
    # [B, T, 1, 1], or with a sparse cache one mask per KV head, repeated per state head
    enter = layer.per_state_head(enter[..., None]) if layer.sparse else enter[..., None]
    k_in = feature_keys[:, :T] * enter.to(feature_keys.dtype)
    if cached and T == 1 and not torch.is_grad_enabled():
        # the state adds k_in v^T: with k_in zero where nothing enters, v needs no mask
        o_lin, state = decode_step(q, k_in, with_ones(layer.per_state_head(values[:, :T])), g, layer.scale, state,
                                   layer.backend)
    else:
        v_in = layer.per_state_head(values[:, :T]) * enter.to(values.dtype)
        o_lin, state = chunk_gla(q, k_in, v_in, g, scale=layer.scale, initial_state=state,
                                 output_final_state=cached, backend=layer.backend, normalizer=True)
    after = HybridBuffers(_last_rows(keys, values, feature_keys, key_pos, turned, min(W, held + T)),
                          _sinks_after(before.sinks, exact, pos, S), sparse)
    if order == "empty":     # the prompt alone: the whole-sequence window kernel
        o_win, lse = window_attention(exact.q_rotated, exact.k_rotated, exact.values, W, S, scale=layer.softmax_scale,
                                      q_sink=exact.q_plain, k_sink=exact.k_turned, backend=layer.backend)
        return layer.combine(o_win, lse, o_lin), after, state
    if order == "full":      # the window kernel over [sinks, window buffer, prompt]
        o_win, lse = window_over_full_buffer(exact.q_rotated, exact.q_plain, keys, values, before.sinks.keys,
                                             before.sinks.values, W, S, layer.softmax_scale, layer.backend)
        return layer.combine(o_win, lse, o_lin), after, state
    # the sinks among the new tokens count too (each only for queries W or more later)
    o_win, lse = window_over_buffer(
        exact.q_rotated, exact.q_plain, keys, values, key_pos, after.sinks.keys, after.sinks.values,
        after.sinks.positions, pos, W, layer.softmax_scale,
        *((sparse.keys, sparse.values, sparse.positions, visible_from) if sparse is not None else ()))
    return layer.combine(o_win, lse, o_lin), after, state


def _last_rows(keys, values, feature_keys, key_pos, turned, n):
    """The window after the new tokens: the last n rows (W, or all there are while fewer).
    Where more than one row drops they are copied, since a view would keep a whole prefill's
    keys alive; after a decode step a view holds a single row more, and saves a copy."""
    last = (lambda t: t[:, -n:]) if keys.shape[1] <= n + 1 else (lambda t: t[:, -n:].clone())
    return WindowBuffer(last(keys), last(values), last(feature_keys), last(key_pos),
                        None if turned is None else last(turned))


def _sinks_after(sinks: SinkBuffer, exact: ExactInputs, pos, S):
    """The sink buffer with the sinks among the new tokens written into their slots. It grows
    with the tokens read, up to S slots: a token's position never exceeds the count of tokens
    read before it (positions count the real tokens, padding has none), so it has its slot."""
    if not S:
        return sinks
    n = min(S, sinks.positions.shape[1] + pos.shape[1])
    if n > sinks.positions.shape[1]:
        sinks = _grown(sinks, n, False)
    slots = torch.arange(n, device=pos.device)
    if pos.shape[1] == 1:
        # One new token (a decode step): it fills its own slot, if any; the same as the
        # general path below, in a few operations.
        got = (pos == slots)[:, :, None, None]                         # [B, S, 1, 1]
        return SinkBuffer(torch.where(got, exact.k_turned, sinks.keys), torch.where(got, exact.values, sinks.values),
                          torch.where(pos == slots, slots, sinks.positions))
    hit = pos[:, :, None] == slots                                     # [B, T, S]
    got = hit.any(1)                                                   # [B, S]
    weights = hit.to(exact.k_turned.dtype)
    keys = torch.einsum("bts,bthd->bshd", weights, exact.k_turned)
    values = torch.einsum("bts,bthd->bshd", weights, exact.values)
    return SinkBuffer(torch.where(got[:, :, None, None], keys, sinks.keys),
                      torch.where(got[:, :, None, None], values, sinks.values),
                      torch.where(got, slots.expand_as(got), sinks.positions))


def sparse_select(cache: SparseBuffer, state, feature_keys, values, turned_keys, key_pos, g, S, per_state_head,
                  slots=None):
    """Which tokens a sparse cache keeps (after LoLA, arXiv 2505.23666). The cache's own keys and
    those leaving the window in this block compete, and the M that the state recalls worst
    (largest ||v - S^T phi(k) / z^T phi(k)||^2 with every candidate in S, averaged over the
    layer's state heads) stay out of the state in every KV head, attended exactly as sinks
    are. Keys like many others, such as repeated text, go into the state; a key unlike the
    rest, such as a number stated once, stays exact. A cache key that loses enters the state
    now with the decay it would have had since its own step.

    Returns (kept [B, T, Hkv] for the leaving rows, the cache after this block, of `slots` rows
    (default: as many as before), visible_from [B, slots, Hkv]: the block row from which each
    kept key is attended (negative: from before the block, -1 for an empty slot), the state with
    the evicted keys added). Fixed shapes at fixed slots: a decode step stays capturable."""
    B, T, Hs, F = feature_keys.shape
    Hkv = values.shape[2]
    M = cache.positions.shape[1]
    slots = M if slots is None else slots
    cand_fk = torch.cat([cache.feature_keys, feature_keys], 1)                      # [B, M + T, Hs, F]
    cand_v = torch.cat([cache.values, values], 1)                                   # [B, M + T, Hkv, D]
    cand_pos = torch.cat([cache.positions, key_pos[:, :, None].expand(B, T, Hkv)], 1)   # [B, M + T, Hkv]
    if state is None:
        state = torch.zeros(B, Hs, F, values.shape[-1] + 1, device=values.device)
    ok = cand_pos >= S                                                             # never a sink, pad or none
    vs = with_ones(per_state_head(cand_v).float())
    # Self-recall: each candidate is read back from the state with every candidate in it (the
    # cache's keys decayed as they would be, this block's at full weight), so a key like many
    # others is recalled well and a key unlike the rest poorly, even while the state is empty.
    weight = torch.cat([cache.log_decay.exp(), torch.ones_like(feature_keys, dtype=torch.float32)], 1) \
        * per_state_head(ok)[..., None]
    full = state + torch.einsum("bchf,bchd->bhfd", cand_fk.float() * weight, vs)
    pred = torch.einsum("bchf,bhfd->bchd", cand_fk.float(), full)
    miss = ((vs[..., :-1] - pred[..., :-1] / pred[..., -1:].clamp_min(1e-6)) ** 2).sum(-1)
    # One choice per token for all of the layer's KV heads, so each head holds every token the
    # cache keeps (choices per head would keep different digits of a number in each head)
    score = miss.mean(-1).masked_fill(~ok[..., 0], -math.inf)                       # [B, M + T]
    top, idx = (t[..., None].expand(B, slots, Hkv) for t in score.topk(slots, dim=1))  # [B, slots, Hkv]
    live = top > -math.inf
    kept = torch.zeros_like(ok).scatter(1, idx, live)                              # [B, M + T, Hkv]
    # cache keys that lose go into the state; row t of this block would enter at step t
    evicted = per_state_head(ok[:, :M] & ~kept[:, :M])                            # [B, M, Hs]
    state = state + torch.einsum("bmhf,bmhd->bhfd",
                                 cand_fk[:, :M].float() * (weight[:, :M] * evicted[..., None]), vs[:, :M])
    cum = g.float().cumsum(1)                                                      # [B, T, Hs, F]
    cand_decay = torch.cat([cache.log_decay + cum[:, -1:], cum[:, -1:] - cum], 1)  # decay to the block's end
    idx_state = per_state_head(idx)

    def pick(t, i):
        return t.gather(1, i[..., None].expand(-1, -1, -1, t.shape[-1]))

    after = SparseBuffer(pick(torch.cat([cache.keys, turned_keys], 1), idx), pick(cand_v, idx),
                         pick(cand_fk, idx_state), pick(cand_decay, idx_state),
                         torch.where(live, cand_pos.gather(1, idx), -1))
    # a key that joins in this block is seen from its own step on (it leaves the window then)
    visible_from = torch.where(live, idx - M, -1)
    return kept[:, M:], after, visible_from, state


# ------------------------------------------------------------------ decode steps on the CPU
class DecodeRings:
    """The hybrid layers' buffers and states as a decode step on the CPU reads them (GLAAttention's
    `_cpu_decode`): what `stream` does for one new token per row, in a few tensor operations
    per layer, each writing in place. Made from the layers' HybridBuffers (`start`), held by the
    cache in their place while decode steps run, and turned back into them (`buffers`) when
    anything else reads them.

    A layer's keys and values stand in N = S + W slots, the S sinks then a ring of the W window
    slots (`LayerRing`): the new token takes the slot of the key that leaves the window, so a
    step copies no buffer. A key is 2D + 1 wide, [rope(k), 0, 1] in a window slot and [0, k
    turned back by W steps, 1] in a sink slot, so that one product with the query's [rope(q), q,
    b] scores both (ExactInputs says why a sink outside the window takes the unrotated query)
    and adds b, a query head's bias, to every score.

    What follows from the positions alone is the same in every layer, so it is worked out once
    per step, on the host (`step`): the slot written, which slots the new query sees, whether the
    key leaving the window enters the state, and the step's rotations as one matrix.

    Decode steps only: a row whose new token is a sink (position < S) is left to `stream`
    (`step` returns None), which then reads the buffers back."""

    def __init__(self, window, sinks, positions, held, rotation, key_scale):
        self.window, self.sinks = window, sinks
        self.positions = positions        # per row, the position in each of the N slots, -1: none
        self.held = held                  # window rows held, up to W
        self.next = held % window         # the window slot the next token takes
        # window slots of any row that hold no token (empty, or padding): the query must not see them
        self.empty = sum(p < 0 for row in positions for p in row[sinks:])
        self.sinks_full = all(p >= 0 for row in positions for p in row[:sinks])   # no step fills a sink slot
        self.rotation = rotation          # _Rotation: the step's rotation matrix from its (cos, sin)
        self.key_scale = key_scale
        self.layers = {}                  # layer index -> LayerRing
        self.consts = {}                  # layer index -> what the layer works out once for these rings
        self.work = None                  # the buffers a layer's step writes and reads again, set by the layers
        self._key, self._step = None, None
        self._index = None
        # made under torch.inference_mode, the rings' tensors take no in-place write outside it
        self.inference = torch.is_inference_mode_enabled()

    @classmethod
    def start(cls, hybrid, windows, states, window, sinks, gla_keep, gla_rope, softmax_scale):
        """Rings for the hybrid layers (indices `hybrid`), from their HybridBuffers (windows[i])
        and states; each ring owns a copy of its state, which takes the state's place in `states`
        (a None state, none yet, a zero one). None where these buffers do not fit: a layer
        without buffers, or whose buffers hold other positions than the rest (a step that some
        layers have read and others not), a sparse cache, dtypes other than float32, sinks still
        to fill. gla_keep: rope_kept_dims (None: all); gla_rope: whether the GLA path rotates at
        all; softmax_scale: the window's, which the ring's keys carry."""
        if not hybrid or any(windows[i] is None for i in hybrid):
            return None
        first = windows[hybrid[0]]
        win_pos, sink_pos = first.window.positions, first.sinks.positions
        held = win_pos.shape[1]
        for b in (windows[i] for i in hybrid):
            if (b.sparse is not None or b.window.keys.dtype != torch.float32 or b.sinks.positions.shape[1] != sinks
                    or held > window or not torch.equal(b.window.positions, win_pos)
                    or not torch.equal(b.sinks.positions, sink_pos)):
                return None
        positions = [s + w + [-1] * (window - held) for s, w in zip(sink_pos.tolist(), win_pos.tolist())]
        rings = cls(window, sinks, positions, held, _Rotation(first.window.keys, gla_keep, gla_rope), softmax_scale)
        for i in hybrid:
            ring = rings.layers[i] = LayerRing(windows[i], states[i], window, sinks, softmax_scale)
            states[i] = ring.state
        return rings

    def step(self, cache, position_ids, position_embeddings):
        """The plan of the cache's next decode step, made by the first layer that asks and
        shared by the rest; None, before any layer has read the step, where it is the general
        path's: a row's new token is a sink, a state in the cache is not its ring's (put there
        from outside), or the rings were made in or out of inference mode and the step runs in
        the other. position_ids [B or 1, 1]; position_embeddings: the teacher's (cos, sin) at
        them."""
        key = cache.seen_tokens
        if key == self._key:
            return self._step
        W, S = self.window, self.sinks
        rows = len(self.positions)
        new = position_ids.view(-1).tolist()
        if len(new) == 1:
            new = new * rows
        states = cache.states
        if len(new) != rows or min(new) < S or not all(states[i] is r.state for i, r in self.layers.items()) \
                or torch.is_inference_mode_enabled() != self.inference:
            return None
        w = self.next
        col = S + w
        leaving = [row[col] for row in self.positions]
        for row, p in zip(self.positions, new):
            row[col] = p
        self.empty -= sum(p < 0 for p in leaving)
        self.next, self.held = (w + 1) % W, min(W, self.held + 1)
        # the key leaving the window enters the state unless it is a sink, padding or none
        enters = [p >= S for p in leaving]
        enter = None if all(enters) else False if not any(enters) else \
            torch.tensor(enters, dtype=torch.float32).view(rows, 1, 1, 1)
        # a sink is seen from its slot once W or more positions back (before that, in the window)
        mask = None
        if self.empty or not self.sinks_full or min(new) < W + S - 1:
            seen = [[0 <= p <= q - W for p in row[:S]] + [p >= 0 for p in row[S:]] + [True]
                    for row, q in zip(self.positions, new)]
            if not all(map(all, seen)):
                mask = torch.zeros(rows, 1, 1, S + W + 1).masked_fill_(
                    ~torch.tensor(seen).view(rows, 1, 1, S + W + 1), float("-inf"))
        rotation = self.rotation(*position_embeddings).expand(rows, -1, -1)
        self._key, self._step = key, DecodeStep(w, enter, mask, rotation, rotation[..., :rotation.shape[1]])
        return self._step

    def index(self, i):
        """torch.tensor([i]), made once for the layers that ask in turn (a softmax layer's slot)."""
        if self._index is None or self._index[0] != i:
            self._index = (i, torch.tensor([i]))
        return self._index[1]

    def buffers(self, layer_idx) -> HybridBuffers:
        """Layer layer_idx's HybridBuffers as `stream` would hold them after the same tokens."""
        ring, W, S = self.layers[layer_idx], self.window, self.sinks
        D = ring.keys.shape[-1] // 2
        order = list(range(self.held)) if self.held < W else [(self.next + i) % W for i in range(W)]
        idx = torch.tensor(order)

        def rows(t):           # [B, heads, slots, ...] -> [B, slots, heads, ...], its own copy
            return t.transpose(1, 2).contiguous()

        keys = ring.keys / self.key_scale
        win = WindowBuffer(rows(keys[:, :, S:S + W, :D].index_select(2, idx)),
                           rows(ring.values[:, :, S:S + W, :D].index_select(2, idx)),
                           rows(ring.features.index_select(2, idx)),
                           torch.tensor([[row[S + j] for j in order] for row in self.positions], dtype=torch.long))
        sinks = SinkBuffer(rows(keys[:, :, :S, D:2 * D]), rows(ring.values[:, :, :S, :D]),
                           torch.tensor([row[:S] for row in self.positions], dtype=torch.long))
        return HybridBuffers(win, sinks)


class LayerRing:
    """One hybrid layer's slots (DecodeRings): keys [B, Hkv, N + 1, 2D + 1], the rotated and the
    turned ones times the window's softmax scale, then a column of ones, their last row zero (it
    gives the GLA state's column of the scores its place, `GLAAttention._hybrid_decode`);
    values [B, Hkv, N + 1, D + 1], a column of ones (the normaliser's column, which the state
    takes in with each key) and the last row zero; features [B, Hs, W, F], phi(k) of the window
    slots, what enters the state; and the state [B, Hs, F, D + 1], this ring's own, updated in
    place."""

    def __init__(self, buffers: HybridBuffers, state, window, sinks, key_scale):
        win, sink = buffers.window, buffers.sinks
        B, held, Hkv, D = win.keys.shape
        S, N = sinks, sinks + window
        f = win.feature_keys
        self.sinks = sinks
        self.keys = win.keys.new_zeros(B, Hkv, N + 1, 2 * D + 1)
        self.keys[:, :, S:S + held, :D] = win.keys.transpose(1, 2) * key_scale
        self.keys[:, :, :S, D:2 * D] = sink.keys.transpose(1, 2) * key_scale
        self.keys[:, :, :N, 2 * D] = 1
        self.values = win.values.new_zeros(B, Hkv, N + 1, D + 1)
        self.values[:, :, :N, D] = 1
        self.values[:, :, S:S + held, :D] = win.values.transpose(1, 2)
        self.values[:, :, :S, :D] = sink.values.transpose(1, 2)
        self.features = f.new_zeros(B, f.shape[2], window, f.shape[3])
        self.features[:, :, :held] = f.transpose(1, 2)
        self.state = f.new_zeros(B, f.shape[2], f.shape[3], D + 1) if state is None else state.clone()
        self.keys_t = self.keys.transpose(-1, -2)           # [B, Hkv, 2D + 1, N + 1], what the query multiplies
        self.values_zero = self.values.view(B * Hkv, N + 1, D + 1)[..., :D]
        # per window slot, the views a step reads and writes (`slot`), made in one call each
        win = slice(S, S + window)
        self.slots = list(zip(self.keys[:, :, win, :D].unbind(2), self.values[:, :, win, :D].unbind(2),
                              self.features[:, :, :, None].unbind(2), self.features[..., None].unbind(2),
                              self.values[:, :, win, None].unbind(2)))

    def slot(self, w):
        """The views of window slot w: (key [B, Hkv, D], value [B, Hkv, D], phi(k) [B, Hs, 1, F]) to
        write the new token to, then (phi(k) [B, Hs, F, 1], [v, 1] [B, Hkv, 1, D + 1]) of the key
        there before it."""
        return self.slots[w]


@dataclass
class DecodeStep:
    """DecodeRings.step's plan of one decode step."""
    slot: int                          # the window slot the new token takes
    enter: torch.Tensor | bool | None  # [B, 1, 1, 1] float, the rows whose leaving key enters the state;
    #                                    None: every row's; False: none
    mask: torch.Tensor | None          # [B, 1, 1, N + 1] float, -inf where the query does not see a slot;
    #                                    None: it sees every slot
    rotation: torch.Tensor             # [B, D, 3D + 1]: x [.., D] times it is [rope(x), x, 0, the GLA
    #                                    path's rotation of x]
    rope: torch.Tensor                 # [B, D, D]: x times it is rope(x)


class _Rotation:
    """A decode step's rotations as one matrix (DecodeStep.rotation): each is linear in x, a
    cos on the diagonal and a sin where rotate_half moves a dimension."""

    def __init__(self, like, gla_keep, gla_rope):
        D = like.shape[-1]
        half = D // 2
        self.eye = torch.eye(D, dtype=like.dtype, device=like.device)
        self.half_turn = torch.zeros(D, D, dtype=like.dtype, device=like.device)   # x @ it = rotate_half(x)
        self.half_turn[torch.arange(half, D), torch.arange(half)] = -1
        self.half_turn[torch.arange(half), torch.arange(half, D)] = 1
        self.zero = torch.zeros(D, 1, dtype=like.dtype, device=like.device)
        self.gla_keep = None if gla_keep is None else gla_keep.to(like.device)
        self.gla_rope = gla_rope

    def __call__(self, cos, sin):
        """[B or 1, D, 3D + 1] from cos, sin [B or 1, 1, D]."""
        rope = torch.addcmul(self.eye * cos, self.half_turn, sin)                  # [B or 1, D, D]
        if not self.gla_rope:
            gla = self.eye.expand_as(rope)
        elif self.gla_keep is None:
            gla = rope
        else:       # the pairs the GLA path leaves unrotated: cos 1, sin 0
            gla = torch.where(self.gla_keep, rope, self.eye)
        return torch.cat([rope, self.eye.expand_as(rope), self.zero.expand(rope.shape[0], -1, -1), gla], -1)
