"""OUT/adapter: the run's result as a peft adapter that stands on its own.

The LoRA matrices and the trained gates and feature maps (as peft `modules_to_save`) are in
peft's own files, so `PeftModel.from_pretrained(base, OUT/adapter)` gives the distilled model.
The base is the run's converted (step-0) model, which the run deletes; it is rebuilt exactly
by `glaswap convert` with the recorded source, options, seed and dtype
(`glaswap_base.json`, and the folder's README). `base_model_name_or_path` names the folder
that command writes, OUT.base, so `AutoPeftModelForCausalLM` finds it once it is built.
"""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path

from glaswap.distill.checkpoints import copy_state
from glaswap.models.gla_options import GLA_OPTIONS

def new_modules(new_names) -> list[str]:
    """The modules holding the new parameters, as peft `modules_to_save` names: the path inside
    a decoder layer ("self_attn.q_map"), which peft matches as a suffix in every layer and
    which no teacher module ends with (the MLP's gate_proj is "mlp.gate_proj")."""
    out = set()
    for name in new_names:                         # model.layers.3.self_attn.q_map.weight
        module = name.rsplit(".", 1)[0].split(".")
        out.add(".".join(module[3:]))              # self_attn.q_map
    return sorted(out)


def adapter_model(student, trained: dict):
    """The student rebuilt as the peft model to save: the run's LoRA config plus the new
    modules as `modules_to_save`, holding the trained tensors. Merging it gives the distilled
    model. Built on the student's own model (LoRA layers removed first): one copy in memory."""
    from peft import get_peft_model

    config = copy.deepcopy(student.peft_model.peft_config["default"])
    config.modules_to_save = new_modules(student.new_names) or None
    config.task_type = "CAUSAL_LM"       # what AutoPeftModelForCausalLM and PeftModel dispatch on
    lm = student.peft_model.unload()     # the converted model, LoRA layers taken out
    copy_state(lm, {n: trained[n] for n in student.new_names})   # the wrappers copy these
    peft_model = get_peft_model(lm, config)
    copy_state(lm, {n: trained[n] for n in student.lora_names})
    return peft_model


def base_record(source: str, meta: dict, out) -> dict:
    """How to rebuild the converted model (glaswap.json's content `meta`) that the adapter of
    OUT applies to, at OUT.base (an absolute path: peft resolves it from the working folder)."""
    out = Path(out).resolve()
    base = out.with_name(out.name + ".base")
    src = Path(source).expanduser()
    source = str(src.resolve()) if src.exists() else source
    options = meta["options"]
    cmd = ["glaswap", "convert", source, str(base)]
    cli_complete = True
    for key, value in options.items():
        opt = GLA_OPTIONS[key]
        if opt.type is bool and opt.flag:
            cmd.append(opt.flags[0] if value else opt.flags[1])
        elif opt.flag and opt.type is list:   # softmax_layers: 3,9,15, left out when empty
            if value:
                cmd += [opt.flag, ",".join(map(str, value))]
        elif opt.flag:
            cmd += [opt.flag, str(value)]
        elif key != "gla_backend" and value != opt.default:   # the backend picks kernels, not weights
            cli_complete = False             # an option only recipes and the Python API set
    cmd += ["--dtype", meta["dtype"], "--seed", str(meta["seed"]), "--no-report"]
    python = (f"from glaswap.convert import convert; convert({source!r}, {str(base)!r}, "
              f"options={options!r}, dtype={meta['dtype']!r}, seed={meta['seed']}, report=False)")
    return {"path": str(base), "source": source, "source_resolved": meta["source"], "options": options,
            "dtype": meta["dtype"], "seed": meta["seed"], "converted_with": meta.get("versions", {}),
            "command": shlex.join(cmd) if cli_complete else None, "python": python}


def save_adapter(peft_model, folder: Path, base: dict):
    """peft's files, with `base_model_name_or_path` set to the rebuilt base, and the record."""
    peft_model.peft_config["default"].base_model_name_or_path = base["path"]
    # save_embedding_layers=False: a run never resizes the vocabulary, and peft's check for
    # that would read the base's config, which does not exist until it is rebuilt
    peft_model.save_pretrained(str(folder), save_embedding_layers=False)
    (folder / "glaswap_base.json").write_text(json.dumps(base, indent=2) + "\n")
    rebuild = base["command"] or f'python -c "{base["python"]}"'
    (folder / "README.md").write_text(f"""# glaswap distillation adapter

LoRA (peft) and the trained gates and feature maps (peft `modules_to_save`) of a glaswap
distillation. The folder above holds the same model with both merged into the weights.

The base is the converted (step-0) model of the run. The same source, options, seed and dtype
convert to the same weights; rebuild it at the path `adapter_config.json` names:

    {rebuild}

then load either way (`glaswap` need not be installed):

    from transformers import AutoModelForCausalLM
    from peft import AutoPeftModelForCausalLM, PeftModel
    base = AutoModelForCausalLM.from_pretrained({base["path"]!r}, trust_remote_code=True)
    model = PeftModel.from_pretrained(base, "adapter")    # this folder
    model = AutoPeftModelForCausalLM.from_pretrained("adapter", trust_remote_code=True)

A base converted elsewhere works the same: pass it to `PeftModel.from_pretrained`, or edit
`base_model_name_or_path`. `glaswap_base.json` has the source, options, seed and dtype.
""")
