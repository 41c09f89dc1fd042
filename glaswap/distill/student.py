"""The student a run trains: the converted model with LoRA attached, which parameters train,
and in which device and dtype."""

from __future__ import annotations

import contextlib
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from glaswap.distill.parallel import Dist
from glaswap.distill.recipe import Recipe
from glaswap.errors import GlaswapError
from glaswap.runtime import pick_device, pick_dtype


@dataclass
class Student:
    lm: torch.nn.Module         # GLASwapForCausalLM, LoRA layers in place
    peft_model: object          # its peft wrapper; None when stage 2 has no steps
    new_names: set[str]         # gates and feature maps, the parameters conversion added
    lora_names: set[str]

    @property
    def trainable(self) -> set[str]:
        """Every parameter the run trains: what checkpoints and the final save carry."""
        return self.new_names | self.lora_names


def device_dtype(recipe: Recipe, dist: Dist):
    """The device of this process (its local GPU under torchrun) and the training dtype."""
    if recipe.train.device == "cuda" and not torch.cuda.is_available():
        raise GlaswapError("train.device is cuda but no CUDA GPU is visible; use train.device=cpu")
    device = pick_device(recipe.train.device)
    if device.type == "cuda":
        device = torch.device("cuda", dist.local_rank)
    return device, pick_dtype(recipe.train.dtype, device)


def build_student(converted: Path, recipe: Recipe, dtype) -> Student:
    """The converted model with LoRA attached from the start (its B matrices are zero, so it
    changes nothing until stage 2 trains it): the module structure never changes during a
    run, which lets FSDP shard it once. All new and LoRA parameters require grad; each
    stage's optimizer takes the ones it trains."""
    from glaswap.models.modeling_glaswap import GLASwapForCausalLM
    from glaswap.runtime import check_loaded_keys

    lm, info = GLASwapForCausalLM.from_pretrained(str(converted), dtype=dtype, output_loading_info=True)
    check_loaded_keys(info, converted)   # a run folder's config.json and weights must agree
    return prepare_student(lm, recipe)


def prepare_student(lm, recipe: Recipe) -> Student:
    """A GLASwapForCausalLM set up for training as the recipe says (build_student's model, or
    a benchmark's random one): gradient checkpointing, LoRA when stage 2 has steps, the new
    parameters in float32, and requires_grad on exactly the new and LoRA parameters."""
    if recipe.train.gradient_checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    new_names = set(lm.new_parameter_names())
    peft_model = None
    s2 = recipe.stage2
    if s2.steps > 0:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=s2.lora_rank, lora_alpha=s2.lora_alpha, lora_dropout=s2.lora_dropout,
                          target_modules=list(s2.lora_targets), bias="none")
        try:
            peft_model = get_peft_model(lm, lora)
        except ValueError as e:
            raise GlaswapError(f"stage2.lora_targets: {str(e).splitlines()[0]}")
    lora_names = set()
    for name, p in lm.named_parameters():
        if name in new_names:
            p.data = p.data.float()  # optimizer updates in float32 even when the model is bf16
        is_lora = ".lora_" in name
        if is_lora:
            lora_names.add(name)
        p.requires_grad_(name in new_names or is_lora)
    return Student(lm, peft_model, new_names, lora_names)


def keep_softmax_layers(student: Student, layers):
    """Turn `layers` of the student into the teacher's softmax attention, in place
    (GLASwapForCausalLM.keep_softmax_layers), and leave their gates and feature maps, which
    that removes, out of the parameters the run trains. Their LoRA adapters stay."""
    student.lm.keep_softmax_layers(sorted(layers))
    present = {name for name, _ in student.lm.named_parameters()}
    student.new_names = set(student.lm.new_parameter_names()) & present
    student.lora_names = student.lora_names & present


def lora_inputs_in_compute_dtype(model):
    """Stop peft from casting each LoRA layer's input to its adapter's dtype.

    peft keeps adapters in float32 when the base model is bf16 and casts the input to float32
    before them; autocast then casts it straight back to bf16 for the matmul: activation-sized
    copies in every LoRA layer, forward and backward, that change nothing. Only for steps that
    run under autocast: there the result is the same, bit for bit (a bf16 -> float32 -> bf16
    round trip is exact). Returns the number of layers changed."""
    n = 0
    for module in model.modules():
        if hasattr(module, "cast_input_dtype_enabled") and hasattr(module, "lora_A"):
            module.cast_input_dtype_enabled = False
            n += 1
    return n


def _liger_ops():
    """liger-kernel's RMSNorm and SiLU-multiply autograd functions, or the reason they cannot
    be imported (a string)."""
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except Exception as e:  # not installed, or without a working Triton
        return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    return LigerRMSNormFunction, LigerSiLUMulFunction


def fuse_layers(model) -> int:
    """Run the decoder's RMSNorms and gated MLPs on liger-kernel's fused Triton kernels (one
    kernel each way instead of PyTorch's float32 cast, square, mean, rsqrt, products and
    casts; SiLU and the product in one pass), for training on a GPU; the teacher's forward
    in stage 2 runs through the same modules. The values are Llama's (normalised in float32,
    cast back, then scaled). Only these module instances change, so a saved model's code is
    untouched. Returns the number of modules changed; without liger-kernel, 0 and a warning
    (the unfused modules are slower)."""
    from glaswap.layers.gla_attention import RMSNorm
    from glaswap.models.modeling_glaswap import MLP

    ops = _liger_ops()
    if isinstance(ops, str):
        warnings.warn(f"liger-kernel cannot be imported ({ops}): RMSNorm and the MLPs train unfused, "
                      "which is slower; install it with `pip install 'liger-kernel>=0.8.5,<0.9'`", stacklevel=2)
        return 0
    rms_fn, silu_mul_fn = ops

    def rms_forward(self, x):
        # in_place=False: the backward must not overwrite the incoming gradient, which the
        # residual stream still uses
        return rms_fn.apply(x, self.weight, self.eps, 0.0, "llama", False)

    def mlp_forward(self, x):
        return self.down_proj(silu_mul_fn.apply(self.gate_proj(x), self.up_proj(x)))

    silu = getattr(model.config, "hidden_act", None) in ("silu", "swish")
    n = 0
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.forward = types.MethodType(rms_forward, module)
            n += 1
        elif isinstance(module, MLP) and silu:
            module.forward = types.MethodType(mlp_forward, module)
            n += 1
    return n


@contextlib.contextmanager
def adapters_off(model):
    """LoRA layers pass their base layer's output through, as peft's disable_adapter() does,
    but without its side effect of toggling requires_grad: under FSDP2 that toggle lands on
    whichever parameter objects (sharded or gathered) the module holds at that moment."""
    layers = [m for m in model.modules() if hasattr(m, "_disable_adapters")]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, b in zip(layers, before):
            m._disable_adapters = b
