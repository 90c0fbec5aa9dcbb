"""Weights of jspec's synthetic zoo: one folder per model in Hugging Face layout (config.json, model.safetensors,
tokenizer files) or per trained head. Read through `jspec.tools.zoo`; written by scripts/train_zoo.py."""
from pathlib import Path

DIR = Path(__file__).resolve().parent
