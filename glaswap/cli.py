"""glaswap's command line: thin Click commands over importable functions."""

from __future__ import annotations

import functools
import os
import sys

import click

from glaswap.errors import GlaswapError


def _friendly(fn):
    """Turn GlaswapError (and a few common OS errors) into a one-line message and exit 1."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except GlaswapError as e:
            raise click.ClickException(str(e))
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="glaswap")
def main():
    """Convert pretrained Llama-family models to Gated Linear Attention, distil and evaluate them."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@main.command()
@click.argument("source")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--gate", type=click.Choice(["lowrank", "key", "scalar"]), default="lowrank", show_default=True,
              help="lowrank: GLA's data-dependent gate (new params); key: derived from k_proj (no new params); "
                   "scalar: one decay per KV head.")
@click.option("--gate-rank", type=click.IntRange(1), default=16, show_default=True)
@click.option("--gate-init-decay", type=click.FloatRange(0, 1, min_open=True, max_open=True), default=0.98,
              show_default=True, help="Per-step decay at step 0.")
@click.option("--feature-map", type=click.Choice(["identity", "softmax", "hedgehog"]), default="hedgehog",
              show_default=True)
@click.option("--normalizer/--no-normalizer", default=True, show_default=True,
              help="Divide by the linear-attention denominator (needs softmax or hedgehog).")
@click.option("--rope/--no-rope", default=True, show_default=True, help="Keep RoPE on q and k.")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]), default="auto",
              show_default=True, help="Weights dtype (auto: the source's; bfloat16 for GGUF).")
@click.option("--max-shard-size", default="2GB", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the new parameters.")
@click.option("--report/--no-report", default=True, show_default=True,
              help="Teacher vs converted perplexity on sample text at the end.")
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
@_friendly
def convert(source, out, gate, gate_rank, gate_init_decay, feature_map, normalizer, rope, dtype, max_shard_size,
            seed, report, force):
    """Convert SOURCE (a model folder, a .gguf file, a hub id, or smollm2-135m) into a GLA model in OUT."""
    from glaswap.convert import convert as run

    options = {"gate": gate, "gate_rank": gate_rank, "gate_init_decay": gate_init_decay,
               "feature_map": feature_map, "normalizer": normalizer, "use_rope": rope}
    run(source, out, options=options, force=force, dtype=dtype, max_shard_size=max_shard_size, report=report,
        seed=seed, log=click.echo)


if __name__ == "__main__":
    main()
