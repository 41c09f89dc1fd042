"""Helpers shared by glaswap's Triton kernels, of every op: tile loads and stores and the matmul
(device side), and on the host the buffers, sizes, row strides, packed-sequence metadata and
whether Triton runs in its interpreter (`interpreting`, the one reader of TRITON_INTERPRET).

The kernel files import these by name; Triton inlines the `@triton.jit` ones into each kernel.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    # Triton is optional for the callers of the kernel files (ops falls back to the references);
    # the try block also keeps transformers' remote-code import checker from requiring it.
    import triton
    import triton.language as tl
except ImportError:
    raise

# Debug switch for the tests: when True, every buffer a kernel must fully write is allocated
# full of NaN, so a region the kernels forget shows up as NaN instead of stale zeros.
POISON = False


# ----------------------------------------------------------------------------------------
# Device side (inlined by Triton)
# ----------------------------------------------------------------------------------------

@triton.jit
def mm(a, b, DOT_BF16: tl.constexpr, PREC: tl.constexpr):
    """a @ b with fp32 accumulation: bf16 operands for bf16 inputs, fp32 ones otherwise (fp16
    inputs use fp32 operands because the factorised decays overflow fp16's 65504)."""
    if DOT_BF16:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


@triton.jit
def op(x, DOT_BF16: tl.constexpr):
    """A matmul operand in the dtype the dot will use: converting loop-invariant operands once
    (and keeping them at half the size in registers for bf16)."""
    if DOT_BF16:
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def seq_bounds(i_n, cu_seqlens, chunk_offsets, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
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
def chunk_coords(i_c, chunk_indices, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
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
def load_rows(ptr, t0, n_valid, stride_t, c0, n_cols, BT: tl.constexpr, BC: tl.constexpr):
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
def store_rows(ptr, x, t0, n_valid, stride_t, c0, n_cols, BT: tl.constexpr, BC: tl.constexpr):
    rows = tl.arange(0, BT)
    cols = c0 + tl.arange(0, BC)
    mask = (rows < n_valid)[:, None] & (cols < n_cols)[None, :]
    base = ptr + t0 * stride_t
    tl.store(base + (rows[:, None] * stride_t + cols[None, :]), x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_state(ptr, k0, v0, K: tl.constexpr, V: tl.constexpr, VS: tl.constexpr,
               BK: tl.constexpr, BV: tl.constexpr):
    """[BK, BV] tile of the first V columns of a row-major K x VS state at ptr, as fp32
    (with the in-kernel normaliser column V holds its state, and VS >= V + 1 is the row
    stride: the internal state buffers pad it, see state_stride below)."""
    rk = k0 + tl.arange(0, BK)
    rv = v0 + tl.arange(0, BV)
    mask = (rk < K)[:, None] & (rv < V)[None, :]
    return tl.load(ptr + rk[:, None] * VS + rv[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_state(ptr, x, k0, v0, K: tl.constexpr, V: tl.constexpr, VS: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr):
    rk = k0 + tl.arange(0, BK)
    rv = v0 + tl.arange(0, BV)
    mask = (rk < K)[:, None] & (rv < V)[None, :]
    tl.store(ptr + rk[:, None] * VS + rv[None, :], x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_col(ptr, k0, K: tl.constexpr, V: tl.constexpr, VS: tl.constexpr, BK: tl.constexpr):
    """Column V (the normaliser's) of a K x VS state, rows k0.., as fp32 [BK]."""
    rk = k0 + tl.arange(0, BK)
    return tl.load(ptr + rk * VS + V, mask=rk < K, other=0.0).to(tl.float32)


@triton.jit
def store_col(ptr, x, k0, K: tl.constexpr, V: tl.constexpr, VS: tl.constexpr, BK: tl.constexpr):
    rk = k0 + tl.arange(0, BK)
    tl.store(ptr + rk * VS + V, x.to(ptr.dtype.element_ty), mask=rk < K)


@triton.jit
def store_den(ptr, x, t0, n_valid, stride_t, V: tl.constexpr, BT: tl.constexpr):
    """Writes [BT] into column V of a [tokens, .., V + 1] tensor (o: the normaliser)."""
    rows = tl.arange(0, BT)
    tl.store(ptr + t0 * stride_t + rows * stride_t + V, x.to(ptr.dtype.element_ty),
             mask=rows < n_valid)


@triton.jit
def load_den_grad(ptr, t0, n_valid, stride_t, V: tl.constexpr, BT: tl.constexpr):
    """[BT] column V of a [tokens, .., V + 1] tensor (do: the gradient of the normaliser)."""
    rows = tl.arange(0, BT)
    return tl.load(ptr + t0 * stride_t + rows * stride_t + V, mask=rows < n_valid,
                   other=0.0).to(tl.float32)


# ----------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------

def interpreting() -> bool:
    """Whether Triton runs its interpreter (TRITON_INTERPRET=1: the kernels run on CPU tensors).
    The one place glaswap reads that variable."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Host-side ceil(a / b). triton.cdiv is a constexpr function whose call costs ~5 us on
    the host, and a launch plan makes a dozen of them per call."""
    return -(-a // b)


def new(shape, dtype, device):
    """Output buffer; full of NaN (integers: -7) when POISON is set so unwritten entries are caught."""
    if POISON:
        return torch.full(shape, float("nan") if dtype.is_floating_point else -7, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def row_stride(x):
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


def state_stride(V: int, normalizer) -> int:
    """Row stride of the internal chunk-state buffers. With the normaliser a state row is
    V + 1 wide; an odd stride (65) misaligns every row after the first, so no state tile
    load or store can use 16-byte vectors. Rows are padded to a multiple of 8 elements
    (the pad columns are never read)."""
    if not normalizer:
        return V
    return cdiv(V + 1, 8) * 8


# A converted model calls the kernels once per layer with the same cu_seqlens tensor. Sizing
# the grid needs its values on the host, and copying them there waits for every kernel queued
# before (the launch queue drains once per layer). So the metadata of the last few cu_seqlens
# tensors is kept, keyed by the tensor itself (a strong reference, so its id cannot be reused
# while cached) and its version counter (bumped by any in-place change).
_VARLEN_MEMO: dict = {}
_MEMO_SIZE = 4


def remember(memo: dict, key, value):
    """memo[key] = value, dropping the oldest entry when the memo is full."""
    if len(memo) >= _MEMO_SIZE:
        memo.pop(next(iter(memo)))
    memo[key] = value
    return value


def varlen_meta(cu_seqlens, T, BT, device):
    """chunk_offsets [N+1] (chunks before each sequence) and chunk_indices [NTtot, 2]
    (sequence, chunk within it), int32 on the device, plus the chunk total and the chunk
    count of every sequence (host list); computed once per cu_seqlens tensor (see above)."""
    key = (id(cu_seqlens), cu_seqlens._version, T, BT, str(device))
    hit = _VARLEN_MEMO.get(key)
    if hit is not None and hit[0] is cu_seqlens:
        return hit[1]
    meta = _varlen_meta_uncached(cu_seqlens, T, BT, device)
    remember(_VARLEN_MEMO, key, (cu_seqlens, meta))
    return meta


def _varlen_meta_uncached(cu_seqlens, T, BT, device):
    """What varlen_meta returns; one host sync to size the grid."""
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


def num_sms(device) -> int:
    """SMs of a CUDA device; 132 (an H100/H200's) elsewhere, so launch plans made on the
    interpreter or for a test are those of the GPU the kernels target."""
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 132


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
