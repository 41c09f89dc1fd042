"""Exact softmax attention over a sliding window plus attention sinks, and the hybrid
layer's mix of it with the GLA state's output:

    reference.py   the contract, the input checks and the PyTorch forms (window attention,
                   the mix, the cached layer's window over its buffers)
    triton.py      fused_window_attention: the Triton kernels, forward and backward
    mix.py         fused_window_mix: the mix as one Triton kernel each way

Only reference.py imports without Triton; glaswap_kernels.ops picks the implementation.
"""

from .reference import window_attention_torch, window_mix_torch, window_over_buffer_torch

__all__ = ["window_attention_torch", "window_mix_torch", "window_over_buffer_torch"]
