"""Flax/JAX ports of HF model families and their checkpoint conversion (both directions)."""
from ports.config import RopeConfig, TextConfig, text_config_from_hf, text_config_to_hf
from ports.model import (FAMILIES, Model, convert_hf, family, load, load_hf, logits, random_model, save,
                         save_hf)

__all__ = ["Model", "RopeConfig", "TextConfig", "FAMILIES", "convert_hf", "family", "load", "load_hf", "logits",
           "random_model", "save", "save_hf", "text_config_from_hf", "text_config_to_hf"]
