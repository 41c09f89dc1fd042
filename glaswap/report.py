"""Teacher-versus-student figures from one model held in memory once.

A converted model is the teacher when its attention runs in softmax mode and the student in
GLA mode, so perplexity of both and KL(teacher || student) come from the same weights.
"""

from __future__ import annotations

import torch

from glaswap.runtime import pick_device, pick_dtype, tokenizer_from
from glaswap.sample_text import SAMPLE_TEXT
from glaswap.scoring import teacher_and_student, token_kl, token_nll


@torch.no_grad()
def _next_token_logits(model, ids, mode):
    """Logits [B, T-1, V] at every position that has a next token, in the given attention mode."""
    with model.attention_mode(mode):
        return model(input_ids=ids, use_cache=False).logits[:, :-1]


@torch.no_grad()
def compare(model, ids) -> dict:
    """Teacher and student perplexity and mean KL(teacher || student) per token on `ids` [B, T]."""
    t_logits = _next_token_logits(model, ids, "softmax")
    s_logits = _next_token_logits(model, ids, "gla")
    t_nll, s_nll = token_nll(t_logits, ids[:, 1:]), token_nll(s_logits, ids[:, 1:])
    kl = token_kl(t_logits, s_logits)
    return {**teacher_and_student(t_nll.double().sum().item(), s_nll.double().sum().item(), t_nll.numel()),
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


def step0_report(folder, config, log=print, trust_remote_code: bool = False) -> dict:
    from glaswap.models.modeling_glaswap import GLASwapForCausalLM

    device = pick_device("auto")
    dtype = pick_dtype("auto", device)
    n_params = _param_count(config)
    if device.type == "cpu" and n_params * 4 * 1.3 > _available_memory():
        log("step-0 report skipped: the model does not fit in this machine's memory in float32")
        return {"skipped": "model larger than available memory"}
    model = GLASwapForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    try:
        tok = tokenizer_from(folder, trust_remote_code)
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
