"""glaswap: convert pretrained Llama-family models to Gated Linear Attention, distil and evaluate them."""

__version__ = "0.1.0"

# True when the CLI turned the fast tokenizer's parallelism off by default (for the forks of data
# loaders) rather than the user: a command that encodes in bulk, without forking, may turn it on.
tokenizers_parallelism_defaulted = False
