"""glaswap: convert pretrained Llama-family models to Gated Linear Attention, distil and evaluate them."""

__version__ = "0.1.0"
