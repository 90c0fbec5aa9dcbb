"""Flax/JAX ports of HF model families and their checkpoint conversion (both directions)."""
from ports.core.config import RopeConfig, TextConfig, text_config_from_hf, text_config_to_hf
from ports.io import hub
from ports.io.gguf import convert_gguf, gguf_to_hf_config, load_gguf, tokenizer_from_gguf
from ports.io.checkpoint import convert_hf, load, save
from ports.io.hf_checkpoint import load_hf, save_hf
from ports.model import FAMILIES, Model, family, logits, random_model
from ports.core.scanned import scan_layers, unscan_layers

__all__ = ["Model", "RopeConfig", "TextConfig", "FAMILIES", "hub", "convert_gguf", "convert_hf", "family",
           "gguf_to_hf_config", "load", "load_gguf", "load_hf", "logits", "random_model", "save", "save_hf",
           "scan_layers", "text_config_from_hf", "text_config_to_hf", "tokenizer_from_gguf", "unscan_layers"]
