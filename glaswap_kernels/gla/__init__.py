"""Gated linear attention, one file per part of the op (the layout of flash-linear-attention's
`fla/ops/gla`):

    reference.py   the PyTorch forms (chunked and token by token): the contract, the ground
                   truth of the tests, and what runs where Triton is missing
    chunk.py       fused_chunk_gla: the autograd Function and the host side of the chunk kernels
    chunk_fwd.py   the chunk-parallel forward kernels (cumulative gates, output)
    state.py       the sequential passes (chunk-start states and their gradients, segments)
    chunk_bwd.py   the chunk-parallel backward kernels (dq, dk, dg, dv)
    scores.py      the in-chunk gate and score helpers those kernels share
    launch.py      input checks and the launch rules (tiles, warps, stages, paths)
    recurrent.py   fused_recurrent_gla: the decoding kernel

Only reference.py imports without Triton; glaswap_kernels.ops picks the implementation.
"""

from .reference import chunk_gla_torch, recurrent_gla_torch

__all__ = ["chunk_gla_torch", "recurrent_gla_torch"]
