"""Distillation of a converted GLA model from its softmax teacher (`glaswap distill`)."""

from glaswap.distill.recipe import Recipe, load_recipe
from glaswap.distill.train import distill

__all__ = ["Recipe", "load_recipe", "distill"]
