"""What the GLA kernels launch: input checks and the launch rules (the packed-sequence metadata
is glaswap_kernels/utils.py's varlen_meta).

`LaunchConfig` is the table of launch rules (tiles, warps, pipelining stages, which path each
kernel takes) for one call; `plan_segments` decides how the sequential passes split long
sequences. Each rule says why in one line; the measurements behind them live in
benchmarks/README.md. Tuning runs (benchmarks/bench_kernels.py --set KEY=VALUE) replace
chosen values through fused_chunk_gla's private `_overrides`.
"""

from __future__ import annotations

import torch

from ..utils import cdiv, interpreting, next_pow2, num_sms, remember

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_gla_inputs(q, k, v, g, initial_state, cu_seqlens, chunked: bool, normalizer: bool = False):
    """Shapes, dtypes and devices of a GLA kernel call, one-line ValueErrors (the values of
    cu_seqlens are checked where they are read: varlen_meta). Returns (B, T, H, Hkv, K, V, N)."""
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
    if not (q.is_cuda or interpreting()):
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


# Segment plans of packed documents, by chunk counts (see LaunchConfig.plan_segments).
_SEGMENT_MEMO: dict = {}


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


class LaunchConfig:
    """The launch rules of one fused_chunk_gla call. Kernel families: *_seq the sequential
    state passes (state.py), *_o the output kernel (and the dv kernel's K tile), *_g the
    dq/dk/dg kernel, *_dv the dv kernel. `tiles`, `chunk` (tests) force the tile sizes and
    the chunk length; `overrides` (tuning runs) replace any chosen attribute."""

    def __init__(self, B, T, H, Hkv, K, V, N, dtype, device, tiles=None, chunk=None,
                 normalizer=False, overrides=None):
        np2 = next_pow2
        bf16 = dtype == torch.bfloat16
        gqa = H > Hkv
        sms = num_sms(device)
        self.dot_bf16 = bf16
        # fp32 inputs get exact fp32 products; fp16 inputs tf32 (10-bit mantissa, like fp16)
        self.prec = "ieee" if dtype == torch.float32 else "tf32"
        # bf16 inputs keep bf16 chunk states for the backward (half the bytes), others fp32
        self.state_dtype = torch.bfloat16 if bf16 else torch.float32

        # Chunks of 64 (one chunk, a power of two >= 16, for shorter sequences).
        BT = 64 if T >= 64 else max(16, np2(T))
        if chunk is not None:
            if chunk < 16 or chunk & (chunk - 1):
                raise ValueError(f"chunk length must be a power of two >= 16, got {chunk}")
            BT = chunk
        self.BT = BT
        if tiles is not None:
            self.BK_seq = self.BK_o = self.BK_g = tiles[0]
            self.BV_seq = self.BV_o = self.BV_g = tiles[1]
        else:
            # the whole K (<= 128) in one tile: the k-side work is shared by a query group
            self.BK_o = min(np2(K), 128)
            self.BV_o = min(max(16, np2(V)), 128 if self.BK_o <= 64 else 64)
            # K tiles of 64 halve the recomputed do v^T, for bf16 operands only (fp32 ones
            # spill), and not with grouped queries plus the normaliser at K <= 64 (spills)
            wide = bf16 and not (normalizer and gqa and K <= 64)
            self.BK_g = min(np2(K), 64 if wide else 32)
            self.BV_g = min(max(16, np2(V)), 64)
            # 64 x 64 state tiles: a walk's carried state stays in registers
            self.BK_seq = min(np2(K), 64)
            self.BV_seq = min(max(16, np2(V)), 64)
        self.BV_dv = self.BV_o

        # Warps, chosen at chunks of 64.
        # sequential passes: latency chains, faster on 4 warps; fp32 operands spill there
        self.warps_seq = self.warps_dh = 4 if bf16 else 8
        self.stages_seq = 2
        # output and dv: 4 warps for small tiles and for bf16 up to D128, else 8
        small = BT * max(self.BK_o, self.BV_o) < 64 * 64
        self.warps_o = self.warps_dv = 4 if small or (bf16 and K <= 128 and V <= 128) else 8
        # dq/dk/dg sits at the 255-register cap: 4 warps (2 programs per SM), 8 for fp32
        # operands on wide tiles
        wide_tiles = BT * max(self.BK_g, self.BV_g) >= 64 * 64
        self.warps_g = 8 if wide_tiles and not bf16 else 4
        # tile loops software-pipelined for bf16 (fp32 operands: twice the shared memory)
        self.stages_chunk = 3 if bf16 else 1

        # Paths. dv_all_v: one dv program walks every V tile with P built once (bf16, one
        # query head per KV head and one K tile: see _backward).
        self.dv_all_v = int(bf16)
        # bf16 at K > 64: keep_p, the forward keeps s * mask(P) for dv (no q, score matmul
        # or exact path there); one_pass_g, dq/dk/dg takes the inter-chunk terms in dP's V
        # loop (v and h loaded once); split_g, dq/dk/dg in two launches, one per path (the
        # one-matmul launch then compiles without the exact path's spills). Slower at D64.
        self.keep_p = self.one_pass_g = self.split_g = int(bf16 and K > 64)

        # Chunks of 32 when the state is narrow: more gates stay on the one-matmul path (32
        # steps factorise down to ~0.03 kept a step, 64 only to ~0.18).
        if chunk is None and BT == 64 and V <= 64 and K <= 128:
            self.BT = 32
            if bf16 and K <= 64:
                self.warps_o = 2                    # [32, 64] tiles run faster on 2 warps
                if not normalizer:
                    self.warps_dh = 2               # so does the dh pass, bar the normaliser's
            if bf16 and self.BK_g == 32:
                self.warps_g = 2                    # and dq/dk/dg with K tiles of 32

        # Segments of the sequential passes (plan_segments): aim at 4 walks per SM, walks
        # of at least seg_min chunks (shorter ones cost more fix-up), only below one walk
        # per SM; seg_len None: chosen per call, 0: never.
        self.seg_len = None
        self.seg_programs = 4 * sms
        self.seg_min = 4
        self.seg_max_walks = sms
        # bf16 wide V (<= 128), one query head per KV head, no normaliser: the sequential
        # passes carry all of V in one tile (half the walks) while the walks still fill the
        # GPU, or where tiles of 64 would segment anyway; in between (tiles of 64 fill it,
        # tiles of 128 would not) one unsegmented walk per SM on 8 warps wins.
        if tiles is None and bf16 and 64 < V <= 128 and not normalizer and not gqa:
            def walks(bv):
                return (B if N is None else N) * Hkv * cdiv(K, self.BK_seq) * cdiv(V, bv)
            if walks(np2(V)) > self.seg_max_walks:
                self.BV_seq, self.warps_seq, self.warps_dh = np2(V), 8, 4
            elif walks(self.BV_seq) > self.seg_max_walks:
                self.BV_seq, self.seg_len, self.warps_seq, self.warps_dh = np2(V), 0, 8, 8
            elif cdiv(T, self.BT) > 2 * self.seg_min:
                self.BV_seq, self.warps_seq, self.warps_dh = np2(V), 8, 4
        # dv reading the kept scores fits one V tile of up to 128 without spilling
        if self.keep_p and tiles is None and 64 < V <= 128 and K <= 128 and not gqa:
            self.BV_dv = np2(V)

        for name, value in (overrides or {}).items():
            if not hasattr(self, name):
                raise ValueError(f"unknown launch parameter {name!r}")
            setattr(self, name, value)
        self.NK_o, self.NV_o = cdiv(K, self.BK_o), cdiv(V, self.BV_o)
        self.NK_g, self.NV_g = cdiv(K, self.BK_g), cdiv(V, self.BV_g)
        self.NK_seq, self.NV_seq = cdiv(K, self.BK_seq), cdiv(V, self.BV_seq)
        self.NV_dv = cdiv(V, self.BV_dv)
        # dv inside the dq/dk/dg kernel when one program sees all of K and V (no second
        # read of q, k, g, do)
        self.merge_dv = self.NK_g == 1 and self.NV_g == 1

    def plan_segments(self, n_chunks, Hkv, varlen, device) -> _Segments:
        """Segments for the sequential passes, given the chunk count of every sequence: when
        the walks (sequences x KV heads x state tiles) leave SMs idle, each sequence is cut
        so that about seg_programs walks run."""
        seg_len = self.seg_len
        if seg_len is None:
            seg_len = 0
            nt_max = max(n_chunks, default=0)
            walks = len(n_chunks) * Hkv * self.NK_seq * self.NV_seq
            if walks <= self.seg_max_walks and nt_max > 2 * self.seg_min:
                per_seq = cdiv(self.seg_programs, walks)
                seg_len = max(self.seg_min, cdiv(nt_max, per_seq))
                if seg_len >= nt_max:
                    seg_len = 0
        if not (varlen and seg_len):
            return _Segments(seg_len, n_chunks, varlen, device)
        # Packed documents upload two index tensors (a host-to-device copy waits for the
        # queue as a sync does): the same plan for every layer of a forward is built once.
        key = (tuple(n_chunks), seg_len, str(device))
        seg = _SEGMENT_MEMO.get(key)
        if seg is None:
            seg = remember(_SEGMENT_MEMO, key, _Segments(seg_len, n_chunks, varlen, device))
        return seg
