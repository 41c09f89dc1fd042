"""The launch rules (gla.launch.LaunchConfig) as properties, not as a table of pinned values:

* every configuration the rules pick at real sizes, in every regime (dtype, head dims
  16..128 with odd and > 64 ones, V = 65, grouped queries, the normaliser, segmented or
  not, packed documents), computes what the PyTorch reference does: the regime's real-size
  choices are replayed on a tiny problem under the interpreter through the private
  `_overrides` (tiles, chunk length, paths, segments), so each rule's path really runs;
* every chosen tile configuration fits Hopper's shared memory (an estimate from the tile
  sizes and pipeline stages; test_gla_compile.py measures the compiled kernels);
* the segment plan cuts sequences only when the walks would leave SMs idle, and then into
  walks long enough to be worth their fix-up.
"""

import collections
import itertools

import pytest
import torch

from gla_helpers import interpreter_warnings, needs_kernels, poison_outputs, run_and_compare  # noqa: F401
from glaswap_kernels.gla.launch import LaunchConfig as _Config
from glaswap_kernels.utils import cdiv as _cdiv

pytestmark = interpreter_warnings
GPU = torch.device("cpu")            # _num_sms: 132 (an H100/H200) off-GPU, the target's plan
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# What a tiny replay copies from the real-size choice (everything the kernels' code
# depends on; the segment length is replayed as segmented or not).
REPLAYED = ("BT", "BK_o", "BV_o", "BK_g", "BV_g", "BK_seq", "BV_seq", "BV_dv", "dv_all_v",
            "keep_p", "one_pass_g", "split_g", "warps_seq", "warps_dh", "warps_o", "warps_dv",
            "warps_g", "stages_seq", "stages_chunk")
# real sizes: (B, T, documents) -- many walks, few long sequences (segmented), packed documents
SIZES = {"batch": (8, 2048, None), "batch4": (4, 4096, None), "long": (1, 16384, None),
         "packed": (1, 16384, [5000, 1, 3000, 63, 8320])}


def real_config(dtype, K, V, H, Hkv, norm, size):
    B, T, docs = SIZES[size]
    N = B if docs is None else len(docs)
    cfg = _Config(B, T, H, Hkv, K, V, N, DTYPES[dtype], GPU, normalizer=norm)
    chunks = [_cdiv(T, cfg.BT)] * B if docs is None else [_cdiv(n, cfg.BT) for n in docs]
    return cfg, cfg.plan_segments(chunks, Hkv, docs is not None, GPU)


# (dtype, K, V, H, Hkv, normaliser, size) at real sizes. Per head-dim class, two regimes:
# one query head per KV head without the normaliser over a batch (walks fill the GPU:
# unsegmented), and grouped queries with the normaliser over packed documents (segmented);
# plus the bf16 D128 sizes where the sequential passes change tiles and warps.
CLASSES = [("bf16", 16, 16), ("bf16", 48, 48), ("bf16", 64, 64), ("bf16", 64, 65),
           ("bf16", 80, 80), ("bf16", 96, 32), ("bf16", 128, 64), ("bf16", 128, 128), ("bf16", 32, 160),
           ("fp16", 64, 64), ("fp16", 128, 128), ("fp32", 64, 64), ("fp32", 128, 128)]
REGIMES = ([(dt, K, V, 16, 16, False, "batch") for dt, K, V in CLASSES]
           + [(dt, K, V, 32, 8, True, "packed") for dt, K, V in CLASSES]
           + [("bf16", 128, 128, 16, 16, False, size) for size in ("batch4", "long")])


def _replay_case(dtype, K, V, H, Hkv, norm, size):
    """A tiny problem that takes the real-size regime's launch choices: its tiles, chunk
    length, paths and warps, segmented (one chunk per segment) when the real plan is."""
    cfg, seg = real_config(dtype, K, V, H, Hkv, norm, size)
    overrides = {name: getattr(cfg, name) for name in REPLAYED}
    BT = cfg.BT
    seqs = [BT + 3, 1, 4] if size == "packed" else None      # two chunks in the first
    return dict(B=1, T=sum(seqs) if seqs else BT + 5, H=1 if H == Hkv else 2, Hkv=1, K=K, V=V,
                dtype=DTYPES[dtype], normalizer=norm, seqs=seqs, segment=1 if seg.on else 0,
                overrides=overrides, gate="mixed")


@needs_kernels
@pytest.mark.slow
@pytest.mark.parametrize("regime", REGIMES, ids=lambda r: "-".join(map(str, r)))
def test_every_chosen_configuration_matches_the_reference(regime):
    run_and_compare(**_replay_case(*regime))


def test_regimes_cover_the_rules_paths():
    """The replayed regimes reach every path switch of the rules: both chunk lengths, one
    and several tiles per kernel family, dv merged, over all V tiles, or per tile, the kept
    scores, the one-pass and split dq/dk/dg, wide sequential tiles, segmented or not."""
    seen = collections.defaultdict(set)
    for regime in REGIMES:
        cfg, seg = real_config(*regime)
        R1 = regime[3] == regime[4]
        seen["BT"].add(cfg.BT)
        seen["NK_g>1"].add(cfg.NK_g > 1)
        seen["NV_o>1"].add(cfg.NV_o > 1)
        seen["NV_seq>1"].add(cfg.NV_seq > 1)
        seen["BV_seq"].add(cfg.BV_seq)
        seen["merge_dv"].add(cfg.merge_dv)
        seen["all_v"].add(bool(cfg.dv_all_v and R1 and cfg.NK_o == 1 and cfg.NV_dv > 1))
        seen["keep_p"].add(cfg.keep_p)
        seen["one_pass"].add(bool(cfg.one_pass_g and R1))
        seen["split_g"].add(cfg.split_g)
        seen["segmented"].add(seg.on)
    for name, values in seen.items():
        assert len(values) >= 2, (name, values)


# A cheap stand-in for the compiler's shared-memory count: each pipeline stage holds one
# [BT, BK], [BT, BV], [BK, BV] and [BT, BT] tile of the input dtype. It tracks the compiled
# kernels (bf16 D256 output kernel at 3 stages: 144 KB measured, 147 KB estimated).
HOPPER_SMEM = 227 * 1024


def smem_estimate(BT, BK, BV, stages, itemsize):
    return stages * (BT * BK + BT * BV + BK * BV + BT * BT) * itemsize


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_chosen_tiles_fit_hopper_shared_memory(dtype):
    itemsize = DTYPES[dtype].itemsize
    dims = [16, 32, 48, 64, 65, 80, 96, 128, 192, 256]
    for K, V, (H, Hkv), norm, size in itertools.product(dims, dims + [257], [(4, 4), (8, 2)],
                                                          (False, True), SIZES):
        if K == 65:
            continue
        cfg, _ = real_config(dtype, K, V, H, Hkv, norm, size)
        for family, BK, BV, stages in (("seq", cfg.BK_seq, cfg.BV_seq, cfg.stages_seq),
                                       ("o", cfg.BK_o, cfg.BV_o, cfg.stages_chunk),
                                       ("g", cfg.BK_g, cfg.BV_g, cfg.stages_chunk),
                                       ("dv", cfg.BK_o, cfg.BV_dv, cfg.stages_chunk)):
            est = smem_estimate(cfg.BT, BK, BV, stages, itemsize)
            assert est <= HOPPER_SMEM, (dtype, K, V, H, Hkv, norm, size, family, est)


def test_chunk_and_tiles_are_powers_of_two_covering_the_head():
    for dt, T, K, V in itertools.product(DTYPES, [1, 17, 64, 2048], [16, 48, 80, 128, 256],
                                         [1, 16, 65, 128, 257]):
        cfg = _Config(1, T, 4, 4, K, V, 1, DTYPES[dt], GPU)
        assert cfg.BT in (16, 32, 64) and (cfg.BT >= T or T >= 64)
        for b in (cfg.BK_o, cfg.BV_o, cfg.BK_g, cfg.BV_g, cfg.BK_seq, cfg.BV_seq, cfg.BV_dv):
            assert b >= 16 and b & (b - 1) == 0
        assert cfg.NK_o * cfg.BK_o >= K and cfg.NV_dv * cfg.BV_dv >= V
        # dv is merged into dq/dk/dg exactly when one program sees the whole head
        assert cfg.merge_dv == (cfg.BK_g >= K and cfg.BV_g >= V)


def test_segments_only_when_walks_leave_sms_idle():
    for B, T, Hkv, K, dt, docs in itertools.product(
            [1, 2, 8], [300, 2048, 16384], [1, 3, 8, 32], [64, 128], DTYPES,
            [None, [9000, 100, 7284]]):
        if docs is not None and (B != 1 or T != 16384):
            continue
        N = B if docs is None else len(docs)
        cfg = _Config(B, T, Hkv, Hkv, K, K, N, DTYPES[dt], GPU)
        chunks = [_cdiv(T, cfg.BT)] * B if docs is None else [_cdiv(n, cfg.BT) for n in docs]
        seg = cfg.plan_segments(chunks, Hkv, docs is not None, GPU)
        walks = N * Hkv * cfg.NK_seq * cfg.NV_seq
        if walks > cfg.seg_max_walks or max(chunks) <= 2 * cfg.seg_min:
            assert not seg.on, (B, T, Hkv, K, dt, docs)
        if seg.on:
            assert cfg.seg_min <= seg.seg_len < max(chunks)
            # enough walks to fill the GPU, none shorter than seg_min chunks but the last
            assert seg.total * Hkv * cfg.NK_seq * cfg.NV_seq > walks
            if docs is not None:
                assert seg.indices.shape == (seg.total, 2) and seg.offsets.tolist()[-1] == seg.total
        elif docs is None and walks <= cfg.seg_max_walks and max(chunks) > 2 * cfg.seg_min:
            assert cfg.seg_len == 0 or _cdiv(max(chunks), _cdiv(cfg.seg_programs, walks)) >= max(chunks)


def test_overrides_replace_choices_and_unknown_names_fail():
    cfg = _Config(8, 2048, 16, 16, 128, 128, 8, torch.bfloat16, GPU,
                  overrides={"BV_seq": 64, "warps_o": 8})
    assert (cfg.BV_seq, cfg.NV_seq, cfg.warps_o) == (64, 2, 8)
    with pytest.raises(ValueError, match="unknown launch parameter 'keep_g'"):
        _Config(1, 64, 2, 2, 32, 32, 1, torch.float32, GPU, overrides={"keep_g": 1})
    with pytest.raises(ValueError, match="chunk length"):
        _Config(1, 64, 2, 2, 32, 32, 1, torch.float32, GPU, chunk=48)
