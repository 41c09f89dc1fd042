"""Helpers shared by glaswap's Triton kernels: tile loads and stores, the matmul, host utilities.

Every kernel file imports these; Triton inlines the `@triton.jit` ones into each kernel.
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
    stride: the internal state buffers pad it, see gla/launch.py's _state_stride)."""
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


# ----------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------

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


def _num_sms(device) -> int:
    """SMs of a CUDA device; 132 (an H100/H200's) elsewhere, so launch plans made on the
    interpreter or for a test are those of the GPU the kernels target."""
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 132


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
