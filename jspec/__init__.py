"""jspec: speculative decoding for LLMs, LVLMs and visual AR generators in JAX."""
from jspec.api import AR, DecodeOutput, decode

__all__ = ["AR", "DecodeOutput", "decode"]
__version__ = "0.1.0"
