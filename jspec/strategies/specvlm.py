"""SpecVLM: the draft prefills on a pruned copy of the prompt's video tokens, chosen by the target's own prefill
attention (language -> video), then drafts a static tree that the target verifies over the full prompt.

`VisionPruning` is the prefill hook (`jspec.engine.strategy`): it asks the target's one prefill for the attention of the
text after the last video token, averaged over layers, heads and those queries (`attn_query_weights`; reduced per
layer, never [layers, heads, |L|, S]), selects K = int(|V| (1 - ratio)) video tokens per row (`jspec.strategies.pruning`)
and compacts the draft's prompt to them, all inside the prefill program. The draft's cache shrinks with its
prompt. Any strategy takes the hook (`SAGE(prefill=VisionPruning(0.9))`); `SpecVLM` is the paper's preset.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.strategies import pruning as PR
from jspec.parts.drafters import ModelDrafter, Prepared, Setup, TargetPrefill
from jspec.parts.plans import StaticPlan
from jspec.engine.strategy import Speculative, Strategy
from jspec.parts.protocols import PrefillHook
from jspec.parts.trees import cached_tree
from jspec.parts.rules import as_rule

MODALITIES = ("video", "image", "vision")
POSITIONS = ("original", "renumbered")

# The paper's pairs (SpecVLM Tables 1-2; shipped configs): the draft, the clip (frames and the video tokens they
# take), lambda_r and the ratio of each target, and its plan (`jspec memory --specvlm`).
PRESETS = {
    "llava-onevision-qwen2-72b": {"draft": "llava-onevision-qwen2-7b", "frames": 64, "video_tokens": 64 * 196 + 1,
                                  "top_p": 0.4, "ratio": 0.9,
                                  "memory": "jspec memory --config llava-onevision-qwen2-72b --specvlm --mesh tensor=8 "
                                          "--prompt-len 12672 --max-len 13056 --device-memory 80GB"},
    "qwen2.5-vl-32b": {"draft": "qwen2.5-vl-7b", "frames": 128, "video_tokens": 64 * 256, "top_p": 0.5,
                       "ratio": 0.9,
                       "memory": "jspec memory --config qwen2.5-vl-32b --specvlm --mesh tensor=4 --prompt-len 16512 "
                               "--max-len 16832 --device-memory 80GB"},
}
TREE_NODES = 26  # the 25-node tree and its root, verified per step
# lambda_r, stage I's share of the attention mass, by the draft's family (the paper's Tables 1-2: 0.4 on LLaVA-OV,
# 0.5 on Qwen2.5-VL; its code passes 0.4 for both); `top_p=None` picks it
TOP_P = {"qwen2_vl": 0.5, "qwen2_5_vl": 0.5}
DEFAULT_TOP_P = 0.4


def family_top_p(model_type: str) -> float:
    """The paper's lambda_r for a draft of this model type (0.4 for the LLaVA family, 0.5 for Qwen2(.5)-VL)."""
    return TOP_P.get(model_type, DEFAULT_TOP_P)


def specvlm_budget(config: str, max_len: int, video_tokens: int | None = None, ratio: float | None = None):
    """(the preset's draft or None, tokens verified per step, the draft's cache slots, a note) for planning SpecVLM
    on `config` with `max_len` cache slots: the draft's cache drops the video tokens pruning removes."""
    import os

    key = os.path.basename(str(config).rstrip("/")).removesuffix(".json").lower()
    pre = PRESETS.get(key, {})
    v = video_tokens if video_tokens is not None else pre.get("video_tokens")
    if v is None:
        raise ValueError(f"no SpecVLM preset for {config!r} (presets: {', '.join(PRESETS)}): pass --video-tokens")
    r = ratio if ratio is not None else pre.get("ratio", 0.9)
    PR.check_ratio(r)
    kept = int(np.asarray(PR.budget(int(v), float(r))))
    if int(v) > max_len:
        raise ValueError(f"{v} video tokens do not fit max-len {max_len}")
    d_len = max_len - (int(v) - kept)
    note = (f"SpecVLM: the draft keeps {kept} of {v} video tokens (ratio {r}); its cache holds {d_len} of the "
            f"target's {max_len} slots; the 25-node tree verifies {TREE_NODES} tokens per step")
    return pre.get("draft"), TREE_NODES, d_len, note


def placeholder_ids(config, modality: str) -> tuple[int, ...]:
    """The prompt token ids of `modality`'s placeholders in a model of `config`."""
    names = {"video": ("video_token_id",), "image": ("image_token_id",),
             "vision": ("image_token_id", "video_token_id")}[modality]
    ids = tuple(int(getattr(config, n)) for n in names if getattr(config, n, None) is not None)
    if not ids:
        raise ValueError(f"{getattr(config, 'model_type', type(config).__name__)} has no {modality} tokens to prune")
    return ids


def _frame_tokens(model, prompt, modality: str) -> int | None:
    """Vision tokens per frame (per temporal patch for Qwen2-VL) of the prompt's videos, when they all agree."""
    cfg = model.config
    if modality == "image":
        return None
    if cfg.model_type in ("qwen2_vl", "qwen2_5_vl"):
        grids = np.asarray(prompt.get("video_grid_thw", np.zeros((0, 3)))).reshape(-1, 3) if isinstance(prompt, dict) \
            else np.zeros((0, 3))
        per = {int(g[1] * g[2]) // cfg.vision.merge_size ** 2 for g in grids}
        return per.pop() if len(per) == 1 else None
    if getattr(cfg, "onevision", False) or getattr(cfg, "next_video", False):
        return cfg.frame_tokens
    return None


@struct.dataclass
class VisionPruning(PrefillHook):
    """Prefill hook: the draft keeps K = int(|V| (1 - ratio)) of each row's vision tokens (`jspec.strategies.pruning.select`
    with `select`, `top_p`; None: the paper's value for the draft's family, `family_top_p`), every text token, in
    order. `out.stats` reports each row's "vision_tokens", "kept_vision_tokens" and, for select="specvlm",
    "stage_one" (the tokens stage I kept; stage II kept the rest). positions: "original" (each kept token's M-RoPE ids;
    Qwen2-VL's default) or "renumbered" (0..D-1, the authors' code; LLaVA's only choice); None picks the default.
    modality: which placeholders are pruned ("video", "image", or "vision" for both). `ratio` sets the draft's
    static prompt width, so a new ratio compiles a new prefill; `top_p` is data. `prepare` fills the fields after
    `seed` from the prompts (the engine calls it)."""

    ratio: float = struct.field(pytree_node=False, default=0.9)
    top_p: Any = None
    select: str = struct.field(pytree_node=False, default="specvlm")
    positions: str | None = struct.field(pytree_node=False, default=None)
    modality: str = struct.field(pytree_node=False, default="video")
    frame_tokens: int | None = struct.field(pytree_node=False, default=None)
    seed: int = struct.field(pytree_node=False, default=0)
    target_ids: tuple = struct.field(pytree_node=False, default=())
    draft_ids: tuple = struct.field(pytree_node=False, default=())
    v_max: int = struct.field(pytree_node=False, default=0)
    width: int = struct.field(pytree_node=False, default=0)
    full_width: int = struct.field(pytree_node=False, default=0)
    draft_config: Any = struct.field(pytree_node=False, default=None)

    def __post_init__(self):
        PR.check_ratio(self.ratio)
        if self.select not in PR.SELECTORS:
            raise ValueError(f"unknown vision-token selector {self.select!r}; choose one of {PR.SELECTORS}")
        if self.positions is not None and self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS} (or None: the model's default), got "
                             f"{self.positions!r}")
        if self.modality not in MODALITIES:
            raise ValueError(f"modality must be one of {MODALITIES}, got {self.modality!r}")
        if isinstance(self.top_p, (int, float)) and not 0.0 <= float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")

    # ------------------------------------------------------------------------------------------ host side

    def prepare(self, setup: Setup, prep: Prepared) -> "VisionPruning":
        """Checks the prompts (before any compute) and fixes the static widths: raises when the prompt has no
        tokens of the modality, when the drafter does not read the prompt as a (tokens, lengths, inputs) view of
        the same vision tokens, or when its family cannot prune a prompt."""
        from ports.model import family

        if not isinstance(prep.drafter, ModelDrafter):
            raise ValueError(f"vision-token pruning prunes a draft model's prompt; the drafter "
                             f"{type(prep.drafter).__name__} reads no prompt of its own")
        model = setup.target if prep.drafter.model is None else prep.drafter.model
        fam = family(model.config.model_type)
        if fam.compact_prompt is None:
            raise ValueError(f"vision-token pruning needs a draft that reads video or images through a per-token "
                             f"layout (Qwen2-VL / Qwen2.5-VL, LLaVA-1.5 / NeXT / OneVision); the draft is "
                             f"{model.config.model_type}")
        positions = self.positions or ("original" if model.config.model_type in ("qwen2_vl", "qwen2_5_vl")
                                       else "renumbered")
        if positions == "original" and model.config.model_type not in ("qwen2_vl", "qwen2_5_vl"):
            raise ValueError(f"positions='original' keeps M-RoPE ids; {model.config.model_type} numbers a prompt by "
                             f"sequence index: use positions='renumbered'")
        t_ids = placeholder_ids(setup.target.config, self.modality)
        d_ids = placeholder_ids(model.config, self.modality)
        n_t = _counts(setup.tokens, setup.lengths, t_ids)
        if not n_t.any():
            raise ValueError(f"the prompt has no {self.modality} tokens (ids {list(t_ids)}) to prune; pruning "
                             f"applies to prompts with {self.modality}")
        d_tokens, d_lengths, d_inputs = prep.prompt
        n_d = _counts(d_tokens, d_lengths, d_ids)
        if not np.array_equal(n_t, n_d) or not d_inputs:
            raise ValueError(f"the draft's prompt has {n_d.tolist()} {self.modality} tokens per row, the target's "
                             f"{n_t.tolist()}: pruning maps the target's scores onto the draft's tokens, so the draft "
                             f"must read the same video / images through the same processor layout")
        frame_tokens = self.frame_tokens
        if self.select == "frames" and frame_tokens is None:
            frame_tokens = _frame_tokens(model, setup.prompt, self.modality)
            if frame_tokens is None:
                raise ValueError("select='frames' needs frame_tokens (vision tokens per frame) for these inputs")
        keep = np.asarray(PR.budget(n_t, self.ratio))
        width = int(np.max(np.asarray(d_lengths) - n_d + np.minimum(keep, n_d)))
        top_p = family_top_p(model.config.model_type) if self.top_p is None else self.top_p
        return self.replace(top_p=top_p, positions=positions, frame_tokens=frame_tokens, target_ids=t_ids,
                            draft_ids=d_ids, v_max=max(1, int(n_t.max())), width=max(1, width),
                            full_width=int(d_tokens.shape[1]), draft_config=model.config)

    def draft_len(self, max_len: int) -> int:
        """The draft's cache length: the full prompt's, less what pruning removed from its widest row."""
        return max_len - max(0, self.full_width - self.width)

    # ------------------------------------------------------------------------------------------ in program

    def _check_prepared(self):
        if not self.width:
            raise ValueError("VisionPruning runs after `prepare` (the engine calls it; a hand-made strategy must too)")

    def asks(self, tokens, lengths, inputs) -> dict:
        """The target prefill's query weights: 1/|L| on each row's tokens after its last vision token (L)."""
        self._check_prepared()
        T = tokens.shape[1]
        valid = jnp.arange(T)[None, :] < lengths[:, None]
        vis = jnp.isin(tokens, jnp.asarray(self.target_ids, jnp.int32)) & valid
        last = jnp.max(jnp.where(vis, jnp.arange(T)[None, :], -1), axis=1)
        after = valid & (jnp.arange(T)[None, :] > last[:, None]) & (last[:, None] >= 0)
        n = jnp.maximum(jnp.sum(after, axis=1, keepdims=True), 1)
        return {"attn_query_weights": jnp.where(after, 1.0 / n, 0.0).astype(jnp.float32)}

    def scores(self, prefill: TargetPrefill) -> tuple[jax.Array, jax.Array]:
        """(a [B, v_max]: the target's attention on each row's vision tokens in prompt order, n [B]: their count)."""
        tokens, lengths = prefill.tokens, prefill.lengths
        valid = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
        vis = jnp.isin(tokens, jnp.asarray(self.target_ids, jnp.int32)) & valid
        where = PR.keep_indices(vis, self.v_max)
        a = jnp.take_along_axis(prefill.attn, jnp.maximum(where, 0), axis=1)
        return jnp.where(where >= 0, a, 0.0), jnp.sum(vis, axis=1).astype(jnp.int32)

    def info(self, prefill: TargetPrefill) -> dict:
        """Per row: its vision tokens, those the draft kept and, for SpecVLM's selector, stage I's share of them."""
        a, n = self.scores(prefill)
        out = {"vision_tokens": n, "kept_vision_tokens": jnp.sum(self.keep(prefill), axis=1).astype(jnp.int32)}
        if self.select == "specvlm":
            out["stage_one"] = PR.stage_one(a, n, self.ratio, self.top_p)
        return out

    def keep(self, prefill: TargetPrefill) -> jax.Array:
        """[B, v_max] the vision tokens each row's draft keeps (in prompt order)."""
        a, n = self.scores(prefill)
        return PR.select(a, n, self.ratio, self.select, self.top_p, jax.random.key(self.seed), self.frame_tokens)

    def draft_prompt(self, prefill: TargetPrefill, prompt):
        """The draft's (tokens, lengths, inputs) of width `width`: its text tokens and the kept vision tokens."""
        from ports.model import family

        self._check_prepared()
        keep = self.keep(prefill)
        tokens, lengths, inputs = prompt
        T = tokens.shape[1]
        valid = jnp.arange(T)[None, :] < lengths[:, None]
        vis = jnp.isin(tokens, jnp.asarray(self.draft_ids, jnp.int32)) & valid
        rank = jnp.clip(jnp.cumsum(vis, axis=1) - 1, 0, keep.shape[1] - 1)
        stay = valid & (~vis | jnp.take_along_axis(keep, rank, axis=1))
        idx = PR.keep_indices(stay, self.width)
        new_lengths = jnp.sum(stay, axis=1).astype(lengths.dtype)
        new_tokens = jnp.where(idx >= 0, jnp.take_along_axis(tokens, jnp.maximum(idx, 0), axis=1), 0)
        compact = family(self.draft_config.model_type).compact_prompt
        return new_tokens.astype(tokens.dtype), new_lengths, compact(self.draft_config, tokens, inputs, idx, lengths,
                                                                     new_lengths, self.positions)


def _counts(tokens, lengths, ids) -> np.ndarray:
    tokens = np.asarray(tokens)
    valid = np.arange(tokens.shape[1])[None, :] < np.asarray(lengths).reshape(-1, 1)
    return (np.isin(tokens, ids) & valid).sum(axis=1)


@dataclasses.dataclass(frozen=True)
class SpecVLM(Strategy):
    """SpecVLM: a static tree drafted by `draft` prefilled on the prompt's video tokens pruned by `ratio` with
    SpecVLM's two-stage selection (or an ablation `select`: uniform, attention, random, front, middle, end,
    frames). draft=None: Self-SD (the target drafts for itself from a pruned cache; its weights are shared).
    tree: "mc_sim_7b_63" (the paper's 25-node tree) or "chain5" / any path list (the chain ablation). rule:
    "residual" (exact sampling; greedy decoding is the paper's). top_p: stage I's share of the attention mass
    (None: the paper's per family, 0.4 LLaVA, 0.5 Qwen2(.5)-VL). positions, modality, frame_tokens: see
    `VisionPruning`; seed: the random selector's."""

    draft: Any = None
    ratio: float = 0.9
    top_p: float | None = None
    select: str = "specvlm"
    tree: Any = "mc_sim_7b_63"
    positions: str | None = None
    rule: Any = "residual"
    modality: str = "video"
    frame_tokens: int | None = None
    seed: int = 0
    controller: Any = None

    def __post_init__(self):
        self.pruning()  # bad settings fail here

    def pruning(self) -> VisionPruning:
        return VisionPruning(float(self.ratio), None if self.top_p is None else float(self.top_p), self.select,
                             self.positions, self.modality, self.frame_tokens, int(self.seed))

    def parts(self) -> Speculative:
        tree = cached_tree(self.tree)
        return Speculative(ModelDrafter(self.draft), StaticPlan.of(tree), as_rule(self.rule), self.controller,
                           self.pruning())


def preset_draft(name: str) -> str:
    """The paper's draft for a shipped target config name (ValueError for one without a preset)."""
    from jspec.strategies import preset

    return preset(PRESETS, name, "SpecVLM", "pass --draft")["draft"]


__all__ = ["MODALITIES", "POSITIONS", "PRESETS", "SpecVLM", "TOP_P", "VisionPruning", "family_top_p",
           "placeholder_ids", "preset_draft", "specvlm_budget"]
