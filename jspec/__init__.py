"""jspec: speculative decoding for LLMs, LVLMs and visual AR generators in JAX."""
from jspec.api import AR, Chain, DecodeOutput, DynamicTree, Tree, decode

__all__ = ["AR", "Chain", "DecodeOutput", "DynamicTree", "Tree", "decode"]
__version__ = "0.1.0"
