"""Trained drafters for registered real models: `<model>/<kind>/` (kind: eagle, eagle3, eesd, layer-skip), each a
config plus safetensors. Read through `jspec.models.head(model, kind)`."""
from pathlib import Path

DIR = Path(__file__).resolve().parent
