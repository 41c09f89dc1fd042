"""Test setup shared by the whole suite.

Triton interpreter (for the Triton kernel tests on machines without a GPU):
TRITON_INTERPRET=1 must be in the environment before any @triton.jit function is defined,
so it is set here, at import time of the first conftest, when CUDA is not available.
"""

import os


def _cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_interpreter_bf16_dot():
    """Triton 3.6-3.9's interpreter multiplies the raw uint16 bit patterns of bf16 tl.dot
    operands (it stores bf16 as uint16). Upcast them to float32 first; bf16 -> fp32 is exact
    (the bf16 bits are the top half of the fp32 bits)."""
    try:
        import numpy as np
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "_bf16_upcast", False):
        return

    def upcast(handle):
        if handle.get_element_ty() == tl.bfloat16:
            data = (np.asarray(handle.data).astype(np.uint32) << 16).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, upcast(a), upcast(b), d, input_precision, max_num_imprecise_acc)

    create_dot._bf16_upcast = True
    builder.create_dot = create_dot

    # The interpreter also casts float32 -> bf16 by truncating the mantissa (biased, twice
    # the error of the GPU's round-to-nearest-even), which overstates bf16 errors; round
    # to nearest even like the hardware does.
    original_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
            data = (rounded >> np.uint32(16)).astype(np.uint16)
            return interpreter.TensorHandle(data, tl.bfloat16)
        return original_cast(self, src, dst_type)

    builder.cast_impl = cast_impl


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_bf16_dot()


# ----------------------------------------------------------------------------- shared models
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_gla(tmp_path_factory):
    """SmolLM2-135M (from PyPI, cached in glaswap's cache) converted once per test session."""
    from glaswap.convert import convert

    out = tmp_path_factory.mktemp("smollm2") / "gla"
    meta = convert("smollm2-135m", out, log=lambda *_: None)
    return out, meta
