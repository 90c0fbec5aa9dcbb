"""jspec: speculative decoding for LLMs, LVLMs and visual AR generators in JAX."""
from jspec.api import DecodeOutput, decode
from jspec.guidance import CFG, ImageGrammar
from jspec.imagegen import ImageOutput, generate_image
from jspec.sharding import make_mesh, shard
from jspec.strategy import AR, Chain, DynamicTree, Speculative, Strategy, Tree

__all__ = ["AR", "CFG", "Chain", "DecodeOutput", "DynamicTree", "ImageGrammar", "ImageOutput", "Speculative",
           "Strategy", "Tree", "decode", "generate_image", "make_mesh", "shard"]
__version__ = "0.1.0"
