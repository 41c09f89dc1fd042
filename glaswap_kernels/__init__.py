"""glaswap's GLA kernels: Triton fused-chunk kernels with PyTorch fallbacks (import name `glaswap_kernels`)."""

from .ops import HAS_TRITON, chunk_gla, recurrent_gla
from .gla.reference import chunk_gla_torch, recurrent_gla_torch

__all__ = ["HAS_TRITON", "chunk_gla", "recurrent_gla", "chunk_gla_torch", "recurrent_gla_torch"]
