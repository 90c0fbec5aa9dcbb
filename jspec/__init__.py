"""jspec: speculative decoding for LLMs, LVLMs and visual AR generators in JAX."""
from jspec.api import AR, Chain, DecodeOutput, DynamicTree, Tree, decode
from jspec.guidance import CFG, ImageGrammar
from jspec.imagegen import ImageOutput, generate_image
from jspec.sharding import make_mesh, shard

__all__ = ["AR", "CFG", "Chain", "DecodeOutput", "DynamicTree", "ImageGrammar", "ImageOutput", "Tree", "decode",
           "generate_image", "make_mesh", "shard"]
__version__ = "0.1.0"
