"""Distillation losses: each stage's loss of a batch, and the KL they rest on.

The vocabulary projection is the largest tensor of a step (tokens x vocabulary, 128K words
for Llama 3), so stage 2's loss never holds all of its logits at once. Two implementations
give the same value:

- torch: a chunk of tokens at a time from the final hidden states, each chunk under
  activation checkpointing (only the hidden states stay in memory; the backward computes
  the chunk's logits again). Runs anywhere.
- triton: glaswap's fused loss (`glaswap_kernels.kd_loss_triton`): per chunk, both logits
  from cuBLAS in bf16 and one Triton kernel for the log-sum-exps, the KL, the cross-entropy
  and their gradient in closed form, written over the student's logits; the gradient of the
  hidden states is taken in the forward, so the logits are made once, and the head's only
  when the head trains.

`stage2.loss_impl` picks one; auto takes triton for CUDA tensors.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from glaswap.distill.student import adapters_off
from glaswap.errors import GlaswapError

LOSS_IMPLS = ("auto", "torch", "triton")


def next_token_labels(input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Flat [B*T] next-token targets, -100 where the next token starts another document or block."""
    B, T = input_ids.shape
    flat = input_ids.reshape(-1)
    labels = torch.full_like(flat, -100)
    labels[:-1] = flat[1:]
    ends = torch.arange(T, B * T + 1, T, device=flat.device) if cu_seqlens is None else cu_seqlens[1:].long()
    labels[(ends - 1).to(flat.device)] = -100
    return labels


def _chunk_loss(h_s, h_t, weight, labels, ce_weight: float, temperature: float):
    """Summed KL(teacher || student) and cross-entropy (zero when unweighted) of one chunk."""
    logits_s = (h_s @ weight.t()).float()
    with torch.no_grad():
        logp_t = F.log_softmax((h_t @ weight.t()).float() / temperature, dim=-1)
    logp_s = F.log_softmax(logits_s / temperature, dim=-1)
    kl = (logp_t.exp() * (logp_t - logp_s)).sum() * temperature ** 2
    if ce_weight:
        ce = F.cross_entropy(logits_s, labels, ignore_index=-100, reduction="sum")
    else:
        ce = torch.zeros_like(kl)
    return kl, ce


def _torch_kd(h_student, h_teacher, weight, labels, ce_weight, temperature, chunk_tokens, parts):
    """kd_loss by the torch path: checkpointed chunks of chunk_tokens tokens."""
    n = h_student.shape[0]
    kl_sum = h_student.new_zeros((), dtype=torch.float32)
    ce_sum = h_student.new_zeros((), dtype=torch.float32)
    for start in range(0, n, chunk_tokens):
        end = min(n, start + chunk_tokens)
        args = (h_student[start:end], h_teacher[start:end].detach(), weight, labels[start:end],
                ce_weight, temperature)
        if torch.is_grad_enabled() and h_student.requires_grad:
            kl, ce = checkpoint(_chunk_loss, *args, use_reentrant=False)
        else:
            kl, ce = _chunk_loss(*args)
        kl_sum, ce_sum = kl_sum + kl, ce_sum + ce
    if parts is not None:
        parts["kl"] = kl_sum.detach() / n
        if ce_weight:
            parts["ce"] = ce_sum.detach() / n
    total = kl_sum + ce_weight * ce_sum if ce_weight else kl_sum
    return total / n


@functools.cache
def _load_triton():
    """(glaswap's fused loss, None), or (None, why Triton's kernel cannot run)."""
    try:
        from glaswap_kernels.kd_loss_triton import fused_kd_loss
    except Exception as e:  # no Triton, or one too old for the kernel
        return None, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    return fused_kd_loss, None


def _interpreting() -> bool:
    """Whether Triton runs its interpreter (called once _load_triton found Triton)."""
    from glaswap_kernels.utils import interpreting
    return interpreting()


def resolve_loss_impl(impl: str, device) -> str:
    """"torch" or "triton" for `stage2.loss_impl` = impl and tensors on `device`."""
    if impl not in LOSS_IMPLS:
        raise GlaswapError(f"stage2.loss_impl is {impl!r}; choose {', '.join(LOSS_IMPLS)}")
    on_gpu = torch.device(device).type == "cuda"
    if impl == "torch" or (impl == "auto" and not on_gpu):
        return "torch"
    why = _load_triton()[1]
    if impl == "triton" and (why or not (on_gpu or _interpreting())):
        raise GlaswapError(f"stage2.loss_impl is triton but {why or 'the tensors are not on a GPU'}; "
                           "set stage2.loss_impl=torch")
    return "torch" if why else "triton"


def _triton_kd(h_student, h_teacher, weight, labels, ce_weight, temperature, chunk_tokens, parts):
    """kd_loss by glaswap's fused Triton loss, chunks of chunk_tokens tokens."""
    n = h_student.shape[0]
    total, kl, ce = _load_triton()[0](h_student, h_teacher.detach(), weight, labels, ce_weight, temperature,
                                      chunk_tokens)
    if parts is not None:
        parts["kl"] = kl / n
        if ce_weight:
            parts["ce"] = ce / n
    return total / n


def kd_loss(h_student, h_teacher, lm_head_weight, labels, ce_weight=0.0, temperature=1.0, chunk_tokens=4096,
            parts: dict | None = None, impl: str = "auto"):
    """Mean over tokens of KL(teacher || student) (+ ce_weight * cross-entropy) from hidden states.

    h_student [N, d] carries gradients, h_teacher [N, d] does not; lm_head_weight [V, d] (the
    teacher's and the student's). The KL, at temperature T, is scaled by T^2 and covers every
    token; the cross-entropy skips labels of -100. `parts`, when given, receives the two terms
    apart (detached means over the same tokens, the cross-entropy unweighted and only when
    ce_weight is set), for the metrics log. `impl`: auto, torch or triton (module docstring);
    without gradients to compute it is always torch, whose forward alone is the cheaper.
    """
    use = resolve_loss_impl(impl, h_student.device)
    grads = torch.is_grad_enabled() and h_student.requires_grad
    if use == "triton" and grads:
        return _triton_kd(h_student, h_teacher, lm_head_weight, labels, ce_weight, temperature, chunk_tokens, parts)
    return _torch_kd(h_student, h_teacher, lm_head_weight, labels, ce_weight, temperature, chunk_tokens, parts)


@torch.no_grad()
def kl_sum(h_student, h_teacher, lm_head_weight, chunk_tokens=4096) -> torch.Tensor:
    """Summed KL(teacher || student) over the rows of two [N, d] final hidden states, the
    logits made chunk_tokens rows at a time (a float32 scalar; no gradients)."""
    total = h_student.new_zeros((), dtype=torch.float32)
    for start in range(0, h_student.shape[0], chunk_tokens):
        end = start + chunk_tokens
        total = total + _chunk_loss(h_student[start:end], h_teacher[start:end], lm_head_weight, None, 0.0, 1.0)[0]
    return total


def transfer_step(lm, batch):
    """Stage 1: mean over layers of the MSE between GLA and softmax attention outputs."""
    out = lm.model(input_ids=batch["input_ids"], cu_seqlens=batch["cu_seqlens"], use_cache=False)
    losses = getattr(out, "transfer_losses", None)
    if not losses:
        raise GlaswapError("every layer is the teacher's softmax attention, so attention transfer has nothing to "
                           "train; set stage1.steps: 0")
    return torch.stack(losses).mean()


def kd_step(lm, batch, cfg):
    """Stage 2: teacher hidden states (adapters off, softmax) then the student's, KL on logits.
    With a cross-entropy weight the two terms also come back apart, for the metrics log."""
    ids, cu = batch["input_ids"], batch["cu_seqlens"]
    with torch.no_grad(), adapters_off(lm), lm.attention_mode("softmax"):
        h_t = lm.model(input_ids=ids, cu_seqlens=cu, use_cache=False).last_hidden_state
    h_s = lm.model(input_ids=ids, cu_seqlens=cu, use_cache=False).last_hidden_state
    labels = next_token_labels(ids, cu)
    parts = {}
    loss = kd_loss(h_s.flatten(0, 1), h_t.flatten(0, 1), lm.lm_head.weight, labels, cfg.ce_weight,
                   cfg.kd_temperature, cfg.loss_chunk_tokens, parts=parts, impl=cfg.loss_impl)
    return (loss, parts) if cfg.ce_weight else loss
