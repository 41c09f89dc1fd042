"""Teacher-versus-student figures from one model held in memory once.

A converted model is the teacher when its attention runs in softmax mode and the student in
GLA mode, so perplexity of both and KL(teacher || student) come from the same weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from glaswap.sample_text import SAMPLE_TEXT


@torch.no_grad()
def token_losses(model, ids, mode, attention_mask=None):
    """Per-token next-token NLL [B, T-1] (float32) and log-probs, in the given attention mode."""
    with model.attention_mode(mode):
        logits = model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits.float()
    logp = F.log_softmax(logits[:, :-1], dim=-1)
    nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return nll, logp


@torch.no_grad()
def compare(model, ids) -> dict:
    """Teacher and student perplexity and mean KL(teacher || student) per token on `ids` [B, T]."""
    t_nll, t_logp = token_losses(model, ids, "softmax")
    s_nll, s_logp = token_losses(model, ids, "gla")
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)
    return {"tokens": int(t_nll.numel()),
            "teacher_ppl": math.exp(t_nll.mean().item()),
            "student_ppl": math.exp(min(s_nll.mean().item(), 700.0)),
            "kl": kl.mean().item()}


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def sample_ids(tokenizer, vocab_size, n_seq=4, seq_len=256, seed=0):
    """Token ids of the built-in sample text, or seeded random ids where there is no tokenizer."""
    if tokenizer is not None:
        ids = tokenizer(SAMPLE_TEXT, return_tensors="pt").input_ids[0]
        seq_len = min(seq_len, len(ids) // n_seq)
        return ids[: n_seq * seq_len].view(n_seq, seq_len), "built-in sample text"
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n_seq, seq_len), generator=gen), "random tokens (no tokenizer)"


def step0_report(folder, config, log=print) -> dict:
    from transformers import AutoTokenizer

    from glaswap.models.modeling_glaswap import GLASwapForCausalLM

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    n_params = _param_count(config)
    if not cuda and n_params * 4 * 1.3 > _available_memory():
        log("step-0 report skipped: the model does not fit in this machine's memory in float32")
        return {"skipped": "model larger than available memory"}
    model = GLASwapForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    if cuda:
        model.cuda()
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)
    except Exception:
        tok = None
    ids, what = sample_ids(tok, config.vocab_size)
    res = compare(model, ids.to(model.device))
    res["text"] = what
    log(f"step 0 on {res['tokens']} tokens of {what}: teacher ppl {res['teacher_ppl']:.2f}, "
        f"converted ppl {res['student_ppl']:.2f}, KL(teacher||converted) {res['kl']:.3f} nats/token")
    return res


def _param_count(config) -> int:
    d, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    att = d * config.head_dim * (config.num_attention_heads * 2 + config.num_key_value_heads * 2)
    mlp = 3 * d * config.intermediate_size
    return L * (att + mlp) + V * d * (1 if config.tie_word_embeddings else 2)
