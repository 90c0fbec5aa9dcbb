"""jspec: speculative decoding for LLMs, LVLMs and visual AR generators in JAX."""
import os

# jspec reads tokenizers and processors with transformers, never its PyTorch models: without PyTorch installed,
# transformers' "PyTorch was not found" advisory would read as an error
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from jspec.api import DecodeConfig, DecodeOutput, decode, start
from jspec.streaming import Stream, stream
from jspec.images import ImageOutput, ModelCaptioner, generate_image
from jspec import costs
from jspec.core.guidance import CFG, ImageGrammar
from jspec.core.sharding import make_mesh, shard
from jspec.engine.strategy import Speculative, Strategy
from jspec.parts.protocols import PrefillHook
from jspec.parts.controllers.calibration import CaliTS
from jspec.parts.controllers.draft_length import BetaTS, FixedK
from jspec.parts.neighbours import NeighbourTable
from jspec.parts.drafters.tokens import TokenDrafter
from jspec.strategies.standard import AR, Chain, DynamicTree, Tree
from jspec.strategies.prompt_lookup import PromptLookup
from jspec.strategies.guarded import Guarded
from jspec.strategies.dflash import DFlash
from jspec.strategies.eesd import EESD
from jspec.strategies.eagle3 import Eagle3
from jspec.strategies.lantern import Lantern, LanternPP
from jspec.strategies.sage import SAGE
from jspec.strategies.sjd import SJD
from jspec.strategies.specvlm import SpecVLM, VisionPruning
from jspec.strategies.tabed import TABED

__all__ = ["Stream", "stream", "AR", "BetaTS", "CFG", "CaliTS", "Chain", "DecodeConfig", "DecodeOutput", "DFlash",
           "DynamicTree", "EESD", "Eagle3", "FixedK", "Guarded", "ImageGrammar", "ImageOutput", "Lantern", "LanternPP",
           "NeighbourTable", "PrefillHook", "PromptLookup", "SAGE", "SJD", "SpecVLM", "Speculative", "TABED", "ModelCaptioner",
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
