"""Hybrid GLA layers (config.window, sinks, window_mix): the layer against a direct O(T^2)
form of its definition, the teacher reproduced on documents no longer than the window,
packed documents, the Triton path, attention transfer, and conversion's options.

The cache paths (prefill in chunks, decode steps, left padding, beam search, loading
without glaswap) run in test_generate.py's variants "llama-window" and "qwen3-window-mix".
"""

from __future__ import annotations

import os

import pytest
import torch
from click.testing import CliRunner
from helpers import logits_and_grads_by_backend, randomise_new_parameters, read_json, save_teacher, tiny_teacher

from glaswap.cli import main
from glaswap.convert import glaswap_config
from glaswap.layers.gla_attention import rope_kept_dims
from glaswap.models.modeling_glaswap import GLASwapForCausalLM
from glaswap_kernels.ops import apply_rope

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def hybrid_student(options, arch="llama", layers=1, seed=0):
    teacher = tiny_teacher(arch, layers=layers)
    torch.manual_seed(seed)
    student = GLASwapForCausalLM(glaswap_config(teacher.config.to_dict(), options))
    student.load_state_dict(teacher.state_dict(), strict=False)
    return teacher, student.eval()


def reference_attention(attn, x, cos, sin, cos_w, sin_w):
    """The hybrid layer's output written out from its definition, one query at a time:
    exact exp-scores over the window and the sinks (a sink outside the window scored as if it
    stood W tokens back: the teacher's RoPE at positions i and i - W, cos_w and sin_w being
    its rotation at position W), phi(q_i) diag(decays) phi(k_j) over the keys that have
    entered the state (j >= S, j <= i - W; decays from step j + W + 1 to i)."""
    cfg = attn.config
    W, S = cfg.window, cfg.sinks
    B, T, _ = x.shape
    q, k, v = attn._project(x)
    g = attn._gate(x, k).float()                                   # [B, T, Hkv, F]
    qr, kr = apply_rope(q, cos, sin).float(), apply_rope(k, cos, sin).float()
    keep = attn._rope_keep if attn._rope_keep is not None else 1.0
    c2, s2 = (cos * keep + (1 - keep), sin * keep) if cfg.rope_max_wavelength else (cos, sin)
    fq, fk = attn.q_map(q, c2, s2, "torch").float(), attn.k_map(k, c2, s2, "torch").float()
    H, R = attn.num_heads, attn.num_heads // attn.num_kv_heads
    c = attn.window_mix.logit.float()
    cum = torch.cumsum(g, 1)                                        # sum of g up to each step
    out = torch.zeros(B, T, H, attn.head_dim)
    for b in range(B):
        for h in range(H):
            kv = h // R
            for i in range(T):
                win = [j for j in range(i + 1) if j > i - W or j < S]
                # a sink outside the window: q rotated to position i, k to position i - W
                cb = min(b, cos.shape[0] - 1)                          # cos, sin: [B or 1, T, D]
                q_at = apply_rope(q[b, i, h][None, None, None].float(), cos[cb:cb + 1, i:i + 1], sin[cb:cb + 1, i:i + 1])
                k_at = [apply_rope(k[b, j, kv][None, None, None].float(), *_back(cos, sin, cb, i, cos_w, sin_w))
                        for j in win]
                e = torch.stack([torch.exp((qr[b, i, h] @ kr[b, j, kv] if j > i - W else (q_at * k_at[n]).sum())
                                           * attn.head_dim ** -0.5) for n, j in enumerate(win)])
                o_win = (e[:, None] * v[b, win, kv].float()).sum(0) / e.sum()
                lin = [j for j in range(S, i - W + 1)]
                if not lin:
                    out[b, i, h] = o_win
                    continue
                a = torch.stack([(fq[b, i, h] * fk[b, j, kv] * torch.exp(cum[b, i, kv] - cum[b, j + W, kv])).sum()
                                 for j in lin])
                num, den = (a[:, None] * v[b, lin, kv].float()).sum(0), a.sum()
                if cfg.window_mix == "shared":
                    ew = e.sum()
                    out[b, i, h] = (ew * o_win + c[h].exp() * num) / (ew + c[h].exp() * den)
                else:
                    lam = torch.sigmoid(c[h])
                    out[b, i, h] = (1 - lam) * o_win + lam * num / den
    return attn.o_proj(out.reshape(B, T, -1))


def _back(cos, sin, b, i, cos_w, sin_w):
    """cos, sin of position i - W from those of i and of W: cos(a - b), sin(a - b)."""
    c, s = cos[b:b + 1, i:i + 1], sin[b:b + 1, i:i + 1]
    return c * cos_w + s * sin_w, s * cos_w - c * sin_w


@pytest.mark.parametrize("options", [
    {"window": 3, "sinks": 2},
    {"window": 4, "sinks": 0, "window_mix": "learned"},
    {"window": 2, "sinks": 1, "feature_map": "hedgehog_pm", "rope_max_wavelength": 16.0},
])
def test_layer_matches_its_definition(options):
    _, student = hybrid_student(options)
    randomise_new_parameters(student)
    attn = student.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 11, student.config.hidden_size, generator=gen)
    pos = torch.arange(11)[None]
    cos, sin = student.model.rotary_emb(x, pos)
    cos_w, sin_w = student.model.rotary_emb(x, torch.tensor([[attn.config.window]]))
    with torch.no_grad():
        got, _ = attn(x, position_embeddings=(cos, sin))
        want = reference_attention(attn, x, cos, sin, cos_w, sin_w)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_gla_rotation_is_worked_out_once_a_forward(monkeypatch):
    """Every layer of a forward takes the same GLA-path rotation: the first works it out, and the
    forward lets go of it at its end; the logits are those of a rotation worked out per layer."""
    from glaswap.layers import gla_attention

    _, student = hybrid_student({"window": 2, "sinks": 1, "rope_max_wavelength": 16.0}, layers=3)
    randomise_new_parameters(student)
    student = student.to(torch.bfloat16)     # not the CPU's float32 path, which rotates in its own way
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    calls = []
    kept = gla_attention.GLAAttention._kept_dims
    monkeypatch.setattr(gla_attention.GLAAttention, "_kept_dims", lambda self, like: calls.append(1) or kept(self, like))
    with torch.no_grad():
        once = student(ids).logits
        assert len(calls) == 1 and gla_attention._ROTATION.last is None

        class Forgetful:            # a memo that never holds: each layer works the rotation out
            last = property(lambda self: None, lambda self, value: None)

        monkeypatch.setattr(gla_attention, "_ROTATION", Forgetful())
        every = student(ids).logits
    assert len(calls) == 1 + 3
    torch.testing.assert_close(once, every, rtol=0, atol=0)


@pytest.mark.parametrize("mix", ["shared", "learned"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_step0_reproduces_the_teacher_within_the_window(arch, mix):
    """A document no longer than the window gets exactly the teacher's attention (sinks too)."""
    teacher, student = hybrid_student({"window": 12, "sinks": 2, "window_mix": mix}, arch=arch, layers=2)
    randomise_new_parameters(student)                  # whatever the gates and maps have learned
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = teacher(ids).logits
        got = student(ids, use_cache=False).logits
        longer = student(torch.cat([ids, ids], 1), use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (longer[:, 12:] - teacher(torch.cat([ids, ids], 1)).logits[:, 12:]).abs().max() > 1e-3


def test_packed_documents_match_each_document_alone():
    _, student = hybrid_student({"window": 3, "sinks": 1})
    randomise_new_parameters(student)
    gen = torch.Generator().manual_seed(4)
    docs = [torch.randint(0, 128, (n,), generator=gen) for n in (7, 2, 9)]
    ids = torch.cat(docs)[None]
    cu = torch.tensor([0, 7, 9, 18], dtype=torch.int32)
    with torch.no_grad():
        packed = student(ids, cu_seqlens=cu, use_cache=False).logits[0]
        for d, a in zip(docs, (0, 7, 9)):
            alone = student(d[None], use_cache=False).logits[0]
            torch.testing.assert_close(packed[a:a + len(d)], alone, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not (torch.cuda.is_available() or INTERPRETED), reason="needs CUDA or TRITON_INTERPRET=1")
def test_triton_path_matches_torch_path():
    """The window kernels and the GLA kernels under a hybrid layer: logits and every gradient."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _, student = hybrid_student({"window": 4, "sinks": 2})
    randomise_new_parameters(student)
    student = student.to(device)
    ids = torch.randint(0, 128, (1, 19), generator=torch.Generator().manual_seed(3)).to(device)
    results = logits_and_grads_by_backend(student, ids)
    (ref, ref_grads), (got, grads) = results
    assert (got - ref).norm() / ref.norm() < 1e-5
    for name, g in ref_grads.items():
        assert torch.isfinite(grads[name]).all(), name
        assert (grads[name] - g).norm() <= 1e-4 * g.norm() + 1e-12, name


def test_attention_transfer_trains_the_mix():
    """Stage 1 matches the whole hybrid layer to the teacher's: the mix logit gets a gradient."""
    _, student = hybrid_student({"window": 2, "sinks": 1}, layers=2)
    randomise_new_parameters(student)
    assert any(n.endswith("window_mix.logit") for n in student.new_parameter_names())
    student.set_attention_mode("transfer")
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(5))
    out = student.model(input_ids=ids, use_cache=False)
    torch.stack(out.transfer_losses).mean().backward()
    grad = student.model.layers[0].self_attn.window_mix.logit.grad
    assert grad is not None and grad.abs().sum() > 0


def test_convert_records_the_window(tmp_path):
    src = save_teacher(tiny_teacher("llama"), tmp_path / "src")
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out"), "--window", "8", "--sinks", "4",
                                  "--window-mix", "learned", "--no-report"])
    assert r.exit_code == 0, r.output
    cfg = read_json(tmp_path / "out" / "config.json")
    assert (cfg["window"], cfg["sinks"], cfg["window_mix"]) == (8, 4, "learned")


@pytest.mark.parametrize("args, needle", [
    (["--sinks", "4"], "sinks need a window"),
    (["--window", "8", "--feature-map", "identity", "--no-normalizer"], "a window needs the normalizer"),
    (["--window", "-1"], "-1"),
])
def test_convert_refuses_bad_window_options(tmp_path, args, needle):
    src = save_teacher(tiny_teacher("llama"), tmp_path / "src")
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "out"), "--no-report", *args])
    assert r.exit_code != 0 and needle in r.output, r.output
    assert "Traceback" not in r.output
    assert not (tmp_path / "out").exists()


def test_distill_trains_a_hybrid_and_its_adapter_carries_the_mix(tmp_path):
    """A hybrid recipe through both stages: the mix logits train, peft saves them with the
    gates and maps, and the adapter on the rebuilt base gives the distilled model's logits."""
    import json
    import shlex

    from helpers import tiny_recipe
    from peft import PeftModel

    from glaswap.distill.recipe import load_recipe
    from glaswap.distill.train import distill

    recipe = tiny_recipe(tmp_path, s1=3, s2=2, model={"options": {"gate": "lowrank", "window": 3, "sinks": 1}})
    out = tmp_path / "out"
    distill(load_recipe(recipe), out=out, log=lambda *a, **k: None)
    adapter = out / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert "self_attn.window_mix" in config["modules_to_save"]
    base = json.loads((adapter / "glaswap_base.json").read_text())
    assert "--window 3" in base["command"] and "--sinks 1" in base["command"]
    r = CliRunner().invoke(main, shlex.split(base["command"])[1:])
    assert r.exit_code == 0, r.output
    merged = GLASwapForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert merged.config.window == 3 and merged.config.sinks == 1
    assert merged.model.layers[0].self_attn.window_mix.logit.abs().max() > 0     # trained off its start
    ids = (torch.arange(40)[None] * 7) % 128
    with torch.no_grad():
        want = merged(ids).logits
        peft_model = PeftModel.from_pretrained(
            GLASwapForCausalLM.from_pretrained(base["path"], dtype=torch.float32), str(adapter)).eval()
        torch.testing.assert_close(peft_model(ids).logits, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mix", ["shared", "learned"])
def test_exact_part_does_not_depend_on_absolute_position(mix):
    """The last query of two documents with the same sinks and the same last W tokens, one
    short and one long: its exact part (window op output and lse) is the same, since a sink
    outside the window is scored at distance W whatever its true distance (with the true
    distance, past a teacher's trained positions, it scores as the teacher never did)."""
    from glaswap_kernels.ops import window_attention
    _, student = hybrid_student({"window": 4, "sinks": 2, "window_mix": mix})
    attn = student.model.layers[0].self_attn
    gen = torch.Generator().manual_seed(5)
    hidden = student.config.hidden_size
    sinks, last = torch.randn(2, hidden, generator=gen), torch.randn(4, hidden, generator=gen)
    results = []
    for filler in (3, 300):
        x = torch.cat([sinks, torch.randn(filler, hidden, generator=gen), last])[None]
        cos, sin = student.model.rotary_emb(x, torch.arange(x.shape[1])[None])
        with torch.no_grad():
            q, k, v = attn._project(x)
            e = attn._exact_inputs(q, k, v, (cos, sin))
            o, lse = window_attention(e.q_rotated, e.k_rotated, e.values, 4, 2, scale=attn.head_dim ** -0.5,
                                      q_sink=e.q_plain, k_sink=e.k_turned)
        results.append((o[0, -1], lse[0, -1]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gpu_teacher_on_packed_documents_takes_flash_varlen(arch, monkeypatch):
    """The teacher (softmax mode, bf16) over packed documents runs torch's flash varlen kernel
    and gives what SDPA with the block-diagonal causal mask gives."""
    from glaswap.layers import softmax_attention as sa

    _, student = hybrid_student({}, arch=arch, layers=2)
    student = student.to("cuda", torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 128, (2, 300), generator=gen).cuda()
    cu = torch.tensor([0, 37, 300, 301, 450, 600], dtype=torch.int32)   # a 1-token document too
    calls = []
    real = sa.varlen_causal
    monkeypatch.setattr(sa, "varlen_causal", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad(), student.attention_mode("softmax"):
        flash = student(ids, cu_seqlens=cu, use_cache=False).logits.float()
        assert len(calls) == 2
        monkeypatch.setattr(sa, "varlen_ok", lambda *a: False)
        masked = student(ids, cu_seqlens=cu, use_cache=False).logits.float()
    err = ((flash - masked).norm() / masked.norm()).item()
    assert err < 1e-2, err


# ----------------------------------------------------------------------------- sparse cache
def reference_sparse_cache(attn, x, cos, sin, cos_w, sin_w, M):
    """The hybrid layer read with a sparse cache of M tokens, choosing at every step
    (SPARSE_BLOCK = 1), written out one query at a time: the token leaving the window and the
    cached ones compete on ||v - num / den||^2 averaged over the KV heads, read back from each
    head's state before the step with every candidate added to it; the M largest stay cached
    in every head, scored exactly as sinks outside
    the window are; the rest are in the state with decays from the step each left the window."""
    cfg = attn.config
    W, S = cfg.window, cfg.sinks
    B, T, _ = x.shape
    q, k, v = attn._project(x)
    g = attn._gate(x, k).float()
    qr, kr = apply_rope(q, cos, sin).float(), apply_rope(k, cos, sin).float()
    keep = rope_kept_dims(cfg)                  # the GLA path leaves the slow RoPE pairs unrotated
    keep = 1.0 if keep is None else keep.to(cos.dtype)
    c2, s2 = cos * keep + (1 - keep), sin * keep
    fq, fk = attn.q_map(q, c2, s2, "torch").float(), attn.k_map(k, c2, s2, "torch").float()
    H, Hkv = attn.num_heads, attn.num_kv_heads
    R = H // Hkv
    c = attn.window_mix.logit.float()
    cum = torch.cumsum(g, 1)
    vf = v.float()

    def state(b, kv, members, i):          # num [D], den after step i of the keys in `members`
        if i < 0 or not members:
            return torch.zeros(fk.shape[-1], v.shape[-1] + 1)
        rows = [torch.exp(cum[b, i, kv] - cum[b, u + W, kv])[:, None] * fk[b, u, kv][:, None]
                * torch.cat([vf[b, u, kv], torch.ones(1)])[None] for u in members]
        return torch.stack(rows).sum(0)

    def turned_score(b, h, i, j):
        cb = min(b, cos.shape[0] - 1)
        q_at = apply_rope(q[b, i, h][None, None, None].float(), cos[cb:cb + 1, i:i + 1], sin[cb:cb + 1, i:i + 1])
        k_at = apply_rope(k[b, j, h // R][None, None, None].float(), *_back(cos, sin, cb, i, cos_w, sin_w))
        return (q_at * k_at).sum()

    out = torch.zeros(B, T, H, attn.head_dim)
    for b in range(B):
        cached, in_state = [], []                # one choice per token for every KV head
        for i in range(T):
            j = i - W
            candidates = cached + ([j] if j >= S else [])
            miss = torch.zeros(len(candidates))
            for kv in range(Hkv):
                # the state before the step with every candidate in it: cached keys decayed from
                # the step each left the window, the leaving key at full weight
                st = state(b, kv, in_state + cached, i - 1)
                if j >= S:
                    st = st + fk[b, j, kv][:, None] * torch.cat([vf[b, j, kv], torch.ones(1)])[None]
                for n, u in enumerate(candidates):
                    p = fk[b, u, kv] @ st
                    miss[n] += ((vf[b, u, kv] - p[:-1] / p[-1].clamp_min(1e-6)) ** 2).sum() / Hkv
            order = sorted(range(len(candidates)), key=lambda n: -miss[n])
            cached = [candidates[n] for n in order[:M]]
            in_state += [candidates[n] for n in order[M:]]
            for kv in range(Hkv):
                for h in range(kv * R, kv * R + R):
                    exact = [(j2, qr[b, i, h] @ kr[b, j2, kv]) for j2 in range(max(0, i - W + 1), i + 1)]
                    exact += [(j2, turned_score(b, h, i, j2)) for j2 in range(min(S, i - W + 1))]
                    exact += [(j2, turned_score(b, h, i, j2)) for j2 in cached]
                    e = torch.stack([torch.exp(s * attn.head_dim ** -0.5) for _, s in exact])
                    vv = torch.stack([vf[b, j2, kv] for j2, _ in exact])
                    o_win = (e[:, None] * vv).sum(0) / e.sum()
                    lin = fq[b, i, h] @ state(b, kv, in_state, i)
                    num, den = lin[:-1], lin[-1]
                    if cfg.window_mix == "shared":
                        ew = e.sum()
                        out[b, i, h] = (ew * o_win + c[h].exp() * num) / (ew + c[h].exp() * den)
                    else:
                        lam = torch.sigmoid(c[h])
                        out[b, i, h] = (1 - lam) * o_win + (lam * num / den if in_state else lam * o_win)
    return attn.o_proj(out.reshape(B, T, -1))


@pytest.mark.parametrize("options", [
    {"window": 3, "sinks": 2, "sparse_cache": 2},
    {"window": 2, "sinks": 0, "sparse_cache": 3, "feature_map": "hedgehog_pm"},
])
def test_sparse_cache_matches_its_definition(options, monkeypatch):
    """A one-call prefill choosing at every step (SPARSE_BLOCK = 1) against the definition."""
    from glaswap.layers import hybrid_cache as hc
    from glaswap.models.modeling_glaswap import GLASwapCache

    monkeypatch.setattr(hc, "SPARSE_BLOCK", 1)
    _, student = hybrid_student(options, arch="qwen3")       # GQA: two query heads per KV head
    randomise_new_parameters(student)
    attn = student.model.layers[0].self_attn
    x = torch.randn(2, 13, student.config.hidden_size, generator=torch.Generator().manual_seed(6))
    cos, sin = student.model.rotary_emb(x, torch.arange(13)[None])
    cos_w, sin_w = student.model.rotary_emb(x, torch.tensor([[attn.config.window]]))
    with torch.no_grad():
        cache = GLASwapCache(1)
        got, _ = attn(x, position_embeddings=(cos, sin), past_key_values=cache)
        want = reference_sparse_cache(attn, x, cos, sin, cos_w, sin_w, options["sparse_cache"])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (cache.window_buffers(0).sparse.positions >= 0).all()    # 13 tokens: every slot holds a key


def test_sparse_cache_keeps_the_key_stated_once(monkeypatch):
    """Repeated text goes into the state; a token stated once among it stays in the cache. In
    the first layer a repeated token has one value, which any state of it recalls exactly."""
    from glaswap.layers import hybrid_cache as hc
    from glaswap.models.modeling_glaswap import GLASwapCache

    monkeypatch.setattr(hc, "SPARSE_BLOCK", 8)
    _, student = hybrid_student({"window": 4, "sinks": 1, "sparse_cache": 2})
    randomise_new_parameters(student)
    ids = torch.tensor([[1] + [11] * 30 + [99] + [11] * 60])
    with torch.no_grad():
        cache = GLASwapCache(1)
        student(input_ids=ids, past_key_values=cache, use_cache=True)
    buf = cache.window_buffers(0)
    assert (buf.sparse.positions == 31).any(1).all(), buf.sparse.positions   # every KV head kept it
    assert buf.window.positions.min() > 31 + 4                            # long out of the window


def test_sparse_cache_needs_a_window():
    from glaswap.models.gla_options import check_gla_options
    with pytest.raises(ValueError, match="sparse cache needs a window"):
        check_gla_options({"sparse_cache": 4})
    with pytest.raises(ValueError, match="whole number"):
        check_gla_options({"window": 4, "sparse_cache": -1})


# --------------------------------------------------------------- buffers that grow as they fill
def _positional_student(options, positions, layers=2):
    """hybrid_student's with `positions` as max_position_embeddings, gates off their start."""
    teacher = tiny_teacher("llama", layers=layers)
    torch.manual_seed(0)
    student = GLASwapForCausalLM(glaswap_config({**teacher.config.to_dict(), "max_position_embeddings": positions},
                                                options))
    student.load_state_dict(teacher.state_dict(), strict=False)
    randomise_new_parameters(student)
    return student.eval()


def _buffer_bytes(cache):
    return sum(t.numel() * t.element_size() for w in cache.windows if w is not None for t in w.tensors())


def _static_cache(model, batch):
    """A cache whose buffers start at their full sizes, as a captured decode graph's do."""
    from glaswap.layers.gla_attention import feature_dim, state_heads
    from glaswap.layers.hybrid_cache import HybridBuffers
    from glaswap.models.modeling_glaswap import GLASwapCache

    cfg = model.config
    cache = GLASwapCache(cfg.num_hidden_layers)
    keys = torch.zeros(1, 1, cfg.num_key_value_heads, cfg.head_dim)
    features = torch.zeros(1, 1, state_heads(cfg), feature_dim(cfg))
    cache.windows = [HybridBuffers.empty(batch, cfg.window, cfg.sinks, cfg.sparse_cache, keys, features, static=True)
                     for _ in range(cfg.num_hidden_layers)]
    return cache


def test_a_short_prompt_takes_buffer_memory_for_its_own_tokens():
    """A window, sinks and sparse cache as long as the model's positions: a 10-token prompt and a
    few decode steps allocate rows for those tokens, not for 4096."""
    W = 4096
    model = _positional_student({"window": W, "sinks": W, "sparse_cache": W}, W)
    ids = torch.randint(3, 120, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        for _ in range(3):
            model(ids[:, :1], past_key_values=cache, use_cache=True)
    assert all(t.shape[1] <= 13 for w in cache.windows for t in w.tensors())
    full = _buffer_bytes(_static_cache(model, 2))
    assert _buffer_bytes(cache) <= full * 13 // W, (_buffer_bytes(cache), full)


@pytest.mark.parametrize("sparse", [0, 512])
def test_cached_reads_across_a_filling_window_match_a_full_buffer(sparse):
    """Window = max_position_embeddings: prompts and decode steps that fill the window buffer
    row by row, through W - 1, W and W + 1 tokens and past a whole window more, give the
    whole-sequence logits (no sparse cache), and with a sparse cache those of a cache whose
    buffers start at full size, as they did before they grew; and the buffers end full."""
    from glaswap.decode_graph import disable_decode_graph, enable_decode_graph
    from glaswap.models.modeling_glaswap import GLASwapCache

    W = 512
    model = _positional_student({"window": W, "sinks": 3, "sparse_cache": sparse}, W)
    T = 2 * W + 70
    ids = torch.randint(3, 120, (2, T), generator=torch.Generator().manual_seed(2))
    cuts = [0, 5, 6, W - 3, W - 2, W - 1, W, W + 1, W + 2, W + 70, 2 * W - 1, 2 * W + 1, T]

    def read(cache, grows=True):
        out = []
        for a, b in zip(cuts, cuts[1:]):
            out.append(model(ids[:, a:b], past_key_values=cache, use_cache=True).logits)
            rows = {w.window.keys.shape[1] for w in cache.windows}
            assert rows == {min(W, b) if grows else W}, (b, rows)
        return torch.cat(out, 1), cache

    def prompt_then_steps(steps=4, prompt=20):
        cache = GLASwapCache(model.config.num_hidden_layers)
        model(ids[:, :prompt], past_key_values=cache, use_cache=True)
        return torch.cat([model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits
                          for t in range(prompt, prompt + steps)], 1)

    with torch.no_grad():
        grown, cache = read(GLASwapCache(model.config.num_hidden_layers))
        want = model(ids, use_cache=False).logits if not sparse else read(_static_cache(model, 2), grows=False)[0]
        torch.testing.assert_close(grown, want, rtol=1e-4, atol=1e-4)
        for w in cache.windows:
            assert w.window.keys.shape[1] == W and w.sinks.keys.shape[1] == 3
            assert w.sparse is None or w.sparse.keys.shape[1] == sparse
        # decode steps after a short prompt through the graph's full-size static buffers
        eager = prompt_then_steps()
        enable_decode_graph(model, backend="replay")
        try:
            graphed = prompt_then_steps()
        finally:
            disable_decode_graph(model)
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("held", [0, 2, 4])
def test_one_token_writes_its_sink_slot_as_a_prompt_does(held):
    """_sinks_after's one-token path (a decode step) equals its general path: that token read
    with a padding token after it. Rows at a sink position, past the sinks, and padding; a sink
    buffer still growing (held < S) and a full one."""
    from glaswap.layers.hybrid_cache import ExactInputs, SinkBuffer, _sinks_after

    B, S, Hkv, D = 4, 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    sinks = SinkBuffer(torch.randn(B, held, Hkv, D, generator=gen), torch.randn(B, held, Hkv, D, generator=gen),
                       torch.tensor([list(range(held)), [-1] * held, list(range(held)), [-1] * held]).view(B, held))
    pos = torch.tensor([[held], [1], [9], [-1]])
    new = ExactInputs(*(torch.randn(B, 2, h, D, generator=gen) for h in (3, Hkv, Hkv, 3, Hkv)))
    one = _sinks_after(sinks, new.rows(slice(0, 1)), pos, S)
    both = _sinks_after(sinks, new, torch.cat([pos, torch.full_like(pos, -1)], 1), S)
    n = one.positions.shape[1]
    assert n == min(S, held + 1)
    for a, b in zip(one.tensors(), both.tensors()):
        assert torch.equal(a, b[:, :n])


@pytest.mark.parametrize("options", [{"window": 4, "sinks": 0}, {"window": 4, "sinks": 3, "gate": "scalar"}])
def test_a_state_per_query_head_reads_a_prompt_into_a_cache(options):
    """state_heads="query" with GQA: a padded prompt read into a cache, in one call and in two,
    gives the whole forward's logits, and its decode steps those of the longer prompt."""
    from glaswap.models.modeling_glaswap import cache_of

    _, student = hybrid_student({**options, "state_heads": "query"}, arch="qwen3", layers=2)
    randomise_new_parameters(student)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, student.config.vocab_size, (2, 11), generator=gen)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        full = student(input_ids=ids, attention_mask=mask).logits
        whole = student(input_ids=ids[:, :9], attention_mask=mask[:, :9], use_cache=True)
        first = student(input_ids=ids[:, :5], attention_mask=mask[:, :5], use_cache=True)
        second = student(input_ids=ids[:, 5:9], attention_mask=mask[:, :9], past_key_values=cache_of(first),
                         use_cache=True)
        cache, steps = cache_of(whole), []
        for t in (9, 10):
            steps.append(student(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], past_key_values=cache,
                                 use_cache=True).logits)
    keep = mask[:, :9].bool()
    torch.testing.assert_close(whole.logits[keep], full[:, :9][keep], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1)[keep], full[:, :9][keep],
                               atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 9:], atol=2e-5, rtol=1e-5)
