"""The GLA kernels on a GPU at real sizes, mostly bf16 (skipped without CUDA; `gpu` marker,
left out of the default run: `pytest -m gpu tests/test_gla_gpu.py`).

The interpreter cannot prove GPU correctness (layouts, races, bf16 dots, Triton bugs that
only show on Hopper), so the interpreter-sized checks of test_gla_kernels.py are repeated
here at the sizes the launch rules were chosen for: D64 and D128, trained and steep gates,
chunks of 64 with trained gates, the normaliser, odd head dims, packed documents, fp16 and
fp32, strong decays and a long forward.
"""

import pytest
import torch

from gla_helpers import gpu_compare, gpu_only, poison_outputs, run_and_compare  # noqa: F401
from glaswap_kernels.gla.launch import LaunchConfig as _Config

gpu = pytest.mark.gpu


@gpu
@gpu_only
@pytest.mark.parametrize("Hkv", [4, 16])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_bf16(Hkv, D):
    gpu_compare(B=2, T=4096, H=16, Hkv=Hkv, K=D, V=D)


@gpu
@gpu_only
def test_gpu_bf16_wide_sequential_tiles():
    # 8 sequences x 16 heads x 2 K tiles = 256 walks: the state and dh passes take all of
    # V = 128 in one tile, at real size
    cfg = _Config(8, 1024, 16, 16, 128, 128, 8, torch.bfloat16, torch.device("cuda"))
    assert cfg.BV_seq == 128 or 8 * 16 * 2 <= cfg.seg_max_walks
    gpu_compare(B=8, T=1024, H=16, Hkv=16, K=128, V=128)
    # 4 x 16 x 2 walks of 128 leave SMs idle, 256 of 64 would not: 128 wide, unsegmented,
    # both passes on 8 warps
    cfg = _Config(4, 1024, 16, 16, 128, 128, 4, torch.bfloat16, torch.device("cuda"))
    assert (cfg.BV_seq, cfg.seg_len, cfg.warps_dh) == (128, 0, 8) or not 128 <= cfg.seg_max_walks < 256
    gpu_compare(B=4, T=1024, H=16, Hkv=16, K=128, V=128)
    # 1 x 16 x 2 x 2 walks of 64-wide tiles segment anyway: 128 wide, segmented, 8 warps
    cfg = _Config(1, 8192, 16, 16, 128, 128, 1, torch.bfloat16, torch.device("cuda"))
    assert cfg.BV_seq == 128 and cfg.warps_seq == 8 or 64 > cfg.seg_max_walks
    gpu_compare(B=1, T=8192, H=16, Hkv=16, K=128, V=128)


@gpu
@gpu_only
def test_gpu_bf16_keep_p_at_d64():
    # dv from the forward's scores (the default for bf16 at K > 64) forced at D64 too: weak
    # gates (nearly every chunk on the one-matmul path) and trained ones (most chunks exact)
    # at D128 and D64, and GQA with the normaliser at K128 V64 (the 1B student's layer)
    ov = {"keep_p": 1}
    gpu_compare(B=2, T=2048, H=16, Hkv=16, K=128, V=128, overrides=ov)
    gpu_compare(B=2, T=2048, H=16, Hkv=16, K=128, V=128, trained=True, overrides=ov)
    gpu_compare(B=2, T=2048, H=32, Hkv=32, K=64, V=64, trained=True, overrides=ov)
    gpu_compare(B=1, T=4096, H=16, Hkv=4, K=128, V=64, trained=True, normalizer=True, overrides=ov)


@gpu
@gpu_only
def test_gpu_bf16_slow_paths():
    # the blocked slow path at real size: 8x2048 H32 D64 with weak gates is where a matmul
    # under a runtime branch in a loop once hit an illegal memory access in dq/dk/dg. Trained
    # gates take the midpoint-anchored matmul, steep ones at D128 (chunks of 64) the blocked
    # path, at D64 (chunks of 32) the midpoint one again
    gpu_compare(B=8, T=2048, H=32, Hkv=32, K=64, V=64)
    gpu_compare(B=2, T=2048, H=32, Hkv=32, K=64, V=64, trained=True)
    gpu_compare(B=2, T=2048, H=16, Hkv=4, K=128, V=64, trained=True)
    gpu_compare(B=2, T=2048, H=16, Hkv=16, K=128, V=128, trained=True)
    gpu_compare(B=2, T=2048, H=16, Hkv=16, K=128, V=128, steep=True)
    gpu_compare(B=2, T=2048, H=32, Hkv=32, K=64, V=64, steep=True)


@gpu
@gpu_only
def test_gpu_bf16_chunk64_trained():
    # the default picks chunks of 32 at these widths; at 64 trained gates take the midpoint
    # matmul and steep ones the blocked path, both checked here
    ov = {"BT": 64}
    gpu_compare(B=2, T=2048, H=32, Hkv=32, K=64, V=64, trained=True, overrides=ov)
    gpu_compare(B=2, T=2048, H=16, Hkv=4, K=128, V=64, trained=True, normalizer=True, overrides=ov)
    gpu_compare(B=2, T=2048, H=32, Hkv=32, K=64, V=64, steep=True, overrides=ov)
    gpu_compare(B=2, T=2048, H=16, Hkv=4, K=128, V=64, steep=True, normalizer=True, overrides=ov)


@gpu
@gpu_only
def test_gpu_bf16_normalizer():
    gpu_compare(B=2, T=4096, H=16, Hkv=4, K=64, V=64, normalizer=True)
    gpu_compare(B=1, T=3000, H=8, Hkv=8, K=128, V=128, normalizer=True)
    gpu_compare(B=1, T=16384, H=16, Hkv=4, K=64, V=64, seqs=[5000, 1, 3000, 8383],
                 normalizer=True)


@gpu
@gpu_only
def test_gpu_bf16_odd_dims():
    gpu_compare(B=2, T=1000, H=8, Hkv=2, K=80, V=65)
    gpu_compare(B=1, T=777, H=4, Hkv=4, K=256, V=257)


@gpu
@gpu_only
def test_gpu_bf16_varlen():
    gpu_compare(B=1, T=16384, H=16, Hkv=4, K=64, V=64,
                 seqs=[5000, 1, 3000, 63, 64, 8256])


@gpu
@gpu_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_gpu_other_dtypes(dtype):
    """Smaller real-GPU run in fp16/fp32 against the float64 recurrence (tf32/ieee dots)."""
    run_and_compare(B=1, T=300, H=4, Hkv=2, K=64, V=64, dtype=dtype, gate="mixed")


@gpu
@gpu_only
def test_gpu_strong_decays():
    run_and_compare(B=1, T=300, H=4, Hkv=2, K=64, V=64, dtype=torch.bfloat16, gate="strong")
    run_and_compare(B=1, T=300, H=4, Hkv=2, K=128, V=128, dtype=torch.float32, gate="mixed")


@gpu
@gpu_only
@pytest.mark.slow
def test_gpu_long_forward():
    gpu_compare(B=1, T=100000, H=16, Hkv=4, K=64, V=64, backward=False)
