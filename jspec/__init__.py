"""jspec: speculative decoding for LLMs, LVLMs and visual AR generators in JAX."""
import os

# jspec reads tokenizers and processors with transformers, never its PyTorch models: without PyTorch installed,
# transformers' "PyTorch was not found" advisory would read as an error
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from jspec.api import DecodeConfig, DecodeOutput, decode, start
from jspec.engine.streaming import Stream, stream
from jspec.parts.controllers.calibration import CaliTS
from jspec.parts.controllers.draft_length import BetaTS, FixedK
from jspec.engine.guidance import CFG, ImageGrammar
from jspec.methods.imagegen import ImageOutput, generate_image
from jspec.engine.sharding import make_mesh, shard
from jspec.engine import costs
from jspec.engine.strategy import (AR, Chain, DynamicTree, Guarded, PrefillHook, PromptLookup, Speculative, Strategy,
                                   Tree)
from jspec.methods.dflash import DFlash
from jspec.methods.eesd import EESD
from jspec.methods.eagle3 import Eagle3
from jspec.methods.lantern import Lantern, LanternPP
from jspec.parts.neighbours import NeighbourTable
from jspec.parts.drafters.tokens import TokenDrafter
from jspec.methods.sage import SAGE
from jspec.methods.sjd import SJD
from jspec.methods.specvlm import SpecVLM, VisionPruning
from jspec.methods.tabed import TABED, ModelCaptioner

__all__ = ["Stream", "stream", "AR", "BetaTS", "CFG", "CaliTS", "Chain", "DecodeConfig", "DecodeOutput", "DFlash", "DynamicTree", "EESD", "Eagle3", "FixedK", "Guarded", "ImageGrammar", "ImageOutput", "Lantern", "LanternPP", "NeighbourTable", "PrefillHook", "PromptLookup", "SAGE", "SJD", "SpecVLM", "Speculative", "TABED", "ModelCaptioner",
           "Strategy", "TokenDrafter", "Tree", "VisionPruning", "costs", "decode", "generate_image", "make_mesh", "shard",
           "start"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """`jspec.models` (the registry of real checkpoints: fetch / load / head) loads on first use, so `import jspec`
    loads nothing under `jspec.tools`."""
    if name == "models":
        import importlib

        return importlib.import_module("jspec.tools.models")
    raise AttributeError(f"module 'jspec' has no attribute {name!r}")
