"""How well logits predict text: the per-token NLL, KL(teacher || student) and perplexity
that `glaswap eval`, the evaluations during `glaswap distill` and convert's step-0 report all use.

Logits are upcast to float32 before the log-softmax: in bf16 it would lose the small
differences between teacher and student that these figures are about.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def token_nll(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "none") -> torch.Tensor:
    """Negative log-likelihood of `targets` [...] under `logits` [..., V], float32: per token
    (shaped like targets), or with reduction="sum" their sum as F.cross_entropy adds it up."""
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction=reduction)
    return nll.view(targets.shape) if reduction == "none" else nll


def token_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per token [...] of logits [..., V], float32, in nats."""
    t_logp = F.log_softmax(teacher_logits.float(), dim=-1)
    s_logp = F.log_softmax(student_logits.float(), dim=-1)
    return (t_logp.exp() * (t_logp - s_logp)).sum(-1)


def perplexity(nll_sum: float, tokens: int) -> float:
    """exp of the mean NLL per token. The mean is capped at 700 nats, where exp would overflow
    a float: a diverged student still gets a figure (about 1e304) instead of an error."""
    return math.exp(min(nll_sum / max(tokens, 1), 700.0))


def teacher_and_student(teacher_nll_sum: float, student_nll_sum: float, tokens) -> dict:
    """The figures of a teacher-against-student comparison on the same `tokens` tokens."""
    return {"tokens": int(tokens), "teacher_ppl": perplexity(teacher_nll_sum, tokens),
            "student_ppl": perplexity(student_nll_sum, tokens)}
