"""`jspec.decode` and the strategy dataclasses."""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jspec import guidance as G
from jspec import loop
from jspec import profiling as P
from jspec import sampling as S
from jspec import sharding as SH
from jspec import speculative as SD
from jspec.prompts import normalize_prompt, round_up
from jspec.trees import StaticTree, build_tree, chain


@dataclasses.dataclass(frozen=True)
class AR:
    """Plain autoregressive decoding with the target alone (the baseline every strategy must reproduce)."""

    def check(self, target) -> None:
        pass


def _check_draft(target, draft) -> None:
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise ValueError(f"draft and target vocabularies differ: target vocab_size={tv}, draft vocab_size={dv}; "
                         "speculative decoding needs one shared tokenizer")


@dataclasses.dataclass(frozen=True)
class Tree:
    """Static-tree speculative decoding with a separate draft model.

    tree: a named tree ("mc_sim_7b_63" = EAGLE-1/SpecVLM/SAGE initial tree, "naive_extend_57" = LANTERN++'s,
    "chain5") or a list of child-rank paths. rule: "residual" (default, min(1, p/q) acceptance over children
    drawn without replacement) or "q1" (EAGLE-2's q = 1 rule over the draft's top-ranked children: also exact,
    see `verify.stochastic`). controller: an optional `speculative.Controller` that limits the draft depth per
    row and step.
    """

    draft: Any
    tree: Any = "mc_sim_7b_63"
    rule: str = "residual"
    controller: Any = None

    def static_tree(self) -> StaticTree:
        paths = self.tree if isinstance(self.tree, str) else tuple(tuple(p) for p in self.tree)
        return _cached_tree(paths)

    def policy(self):
        return SD.StaticPolicy(self.static_tree(), draw=self.rule == "residual")

    def check(self, target) -> None:
        _check_draft(target, self.draft)
        if self.rule not in ("residual", "q1"):
            raise ValueError(f"unknown verification rule {self.rule!r}; use 'residual' or 'q1'")
        self.static_tree()


@dataclasses.dataclass(frozen=True)
class Chain(Tree):
    """Chain speculative decoding: the draft proposes `gamma` tokens per step, the target verifies them at once."""

    gamma: int = 5

    def __init__(self, draft, gamma: int = 5, rule: str = "residual", controller=None):
        if not isinstance(gamma, (int, np.integer)) or not 1 <= gamma <= 64:
            raise ValueError(f"gamma must be an integer in [1, 64], got {gamma!r}")
        object.__setattr__(self, "draft", draft)
        object.__setattr__(self, "gamma", int(gamma))
        object.__setattr__(self, "tree", tuple(tuple(p) for p in chain(int(gamma))))
        object.__setattr__(self, "rule", rule)
        object.__setattr__(self, "controller", controller)


@dataclasses.dataclass(frozen=True)
class DynamicTree:
    """EAGLE-2 dynamic-tree speculative decoding with a separate draft model (see `speculative.DynamicPolicy`).

    depth: deepest draft level; top_k: children per expanded node and nodes expanded per level; total: draft
    nodes kept per step after reranking. Sampling uses the q = 1 rule, the lossless one for trees whose shape
    depends on the drafted tokens ("residual" would not be: a candidate is kept or dropped according to its own
    draft probability, so the kept siblings are not a plain without-replacement draw).
    """

    draft: Any
    depth: int = 6
    top_k: int = 10
    total: int = 60
    rule: str = "q1"
    controller: Any = None

    def policy(self):
        return SD.DynamicPolicy(int(self.depth), int(self.top_k), int(self.total))

    def check(self, target) -> None:
        _check_draft(target, self.draft)
        for name in ("depth", "top_k", "total"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"DynamicTree {name} must be a positive integer, got {v!r}")
        if self.depth > 64 or self.top_k > 64:
            raise ValueError(f"DynamicTree depth and top_k must be <= 64, got depth={self.depth}, top_k={self.top_k}")
        pool = self.policy().pool_size
        if self.total > pool:
            raise ValueError(f"DynamicTree total={self.total} exceeds the {pool} candidates that depth={self.depth}, "
                             f"top_k={self.top_k} produce (top_k + (depth - 1) * top_k**2)")
        if self.rule != "q1":
            raise ValueError(f"DynamicTree supports rule='q1' only (got {self.rule!r}): the residual rule is not "
                             "lossless when the kept candidates depend on their own draft probabilities")


@functools.lru_cache(maxsize=64)
def _cached_tree(paths) -> StaticTree:
    return build_tree(paths if isinstance(paths, str) else [list(p) for p in paths])


@dataclasses.dataclass
class DecodeOutput:
    tokens: np.ndarray  # [B, max_new_tokens] int32, padded after each row's end
    lengths: np.ndarray  # [B] generated tokens per row (EOS included)
    stats: dict[str, Any]


@functools.lru_cache(maxsize=1)
def _default_key() -> jax.Array:
    """jax.random.key(0), made once (keys are immutable; making one is a device op)."""
    return jax.random.key(0)


def _eos_ids(target, eos_token_id) -> tuple[int, ...]:
    if eos_token_id is None:
        return tuple(getattr(target.config, "eos_token_ids", ()) or ())
    if isinstance(eos_token_id, (int, np.integer)):
        return (int(eos_token_id),)
    return tuple(int(e) for e in eos_token_id)


def _pad_id(target, eos: tuple[int, ...]) -> int:
    pad = getattr(target.config, "pad_token_id", None)
    if pad is not None:
        return int(pad)
    return eos[0] if eos else 0


@functools.partial(jax.jit, static_argnames=("ctx", "max_len"))
def _prefill_ar(ctx, max_len, target, tokens, lengths, inputs, key, sp):
    cache = SH.constrain(ctx.placement, loop.new_cache_for(target, tokens.shape[0], max_len))
    logits, _, cache = loop.prefill(target, tokens, lengths, cache, inputs)
    cache = SH.constrain(ctx.placement, cache)
    k_first, k_loop = jax.random.split(key)
    first = S.sample(k_first, logits, ctx.sampling, sp)
    return loop.start_state(ctx, first, cache, k_loop, sp)


@functools.partial(jax.jit, static_argnames=("ctx",), donate_argnames=("state",))
def _decode_ar(ctx, target, state):
    return loop.run_loop(ctx, lambda s: loop.ar_step(ctx, target, s), state)


@functools.partial(jax.jit, static_argnames=("ctx", "max_len", "width", "max_depth", "controller"))
def _prefill_sd(ctx, max_len, width, max_depth, controller, target, draft, tokens, lengths, inputs, d_tokens,
                d_lengths, d_inputs, key, sp):
    state = _prefill_ar.__wrapped__(ctx, max_len, target, tokens, lengths, inputs, key, sp)
    ds = SD.init_draft(draft, d_tokens, d_lengths, max_len, state.last, width, d_inputs)
    ds = ds.replace(cache=SH.constrain(ctx.placement, ds.cache, replicated=True))
    return state.replace(aux=SD.init_sd_state(ds, controller, max_depth))


@functools.partial(jax.jit, static_argnames=("ctx", "policy", "rule", "controller"), donate_argnames=("state",))
def _decode_sd(ctx, policy, rule, controller, target, draft, state):
    return loop.run_loop(ctx, lambda s: SD.sd_step(ctx, policy, rule, controller, target, draft, s), state)


class Started(NamedTuple):
    """A decode after its prefill: what the decode loop runs on (`state` is consumed by it)."""

    ctx: loop.StepContext
    policy: Any          # None for AR
    rule: Any
    controller: Any
    target: Any          # as run: sharded / guided when asked
    draft: Any
    state: loop.DecodeState
    pad: int
    prefill_s: float

    def loop_call(self, state: loop.DecodeState | None = None) -> tuple[Any, tuple]:
        """(the jitted decode loop, its arguments) from `state` (default: this start's own): what `run` calls, for
        tools that lower or trace it (`jspec.profiling.op_costs`)."""
        state = self.state if state is None else state
        if self.policy is None:
            return _decode_ar, (self.ctx, self.target, state)
        return _decode_sd, (self.ctx, self.policy, self.rule, self.controller, self.target, self.draft, state)

    def run(self, state: loop.DecodeState | None = None) -> loop.DecodeState:
        """The fused decode loop (AR or speculative) from `state` (default: this start's own), consumed."""
        fn, args = self.loop_call(state)
        return fn(*args)


def start(target, prompt, strategy=None, max_new_tokens: int = 64, temperature: float = 0.0, top_k=None,
          top_p=None, key=None, eos_token_id=None, max_cache_len: int | None = None, draft_prompt=None,
          guidance: G.CFG | None = None, constraint=None, mesh=None, rules=None) -> Started:
    """`decode`'s checks, setup and prefill (same arguments): the state its loop starts from, for tools that time
    or step the loop themselves (`jspec.profiling`)."""
    strategy = AR() if strategy is None else strategy
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    strategy.check(target)
    speculative = not isinstance(strategy, AR)
    tokens, lengths, inputs = _model_prompt(target, prompt, "")
    if draft_prompt is not None and not speculative:
        raise ValueError("draft_prompt needs a speculative strategy (Chain, Tree, DynamicTree)")
    if draft_prompt is not None:
        d_tokens, d_lengths, d_inputs = _model_prompt(strategy.draft, draft_prompt, "draft ")
        if d_tokens.shape[0] != tokens.shape[0]:
            raise ValueError(f"draft_prompt has {d_tokens.shape[0]} rows, the prompt has {tokens.shape[0]}")
    elif speculative:
        d_tokens, d_lengths, d_inputs = _draft_view(target, strategy.draft, prompt, tokens, lengths, inputs)
    else:
        d_tokens, d_lengths, d_inputs = tokens, lengths, {}
    sampling_cfg, sp = S.make_sampling(temperature, top_k, top_p)
    eos = _eos_ids(target, eos_token_id)
    policy = strategy.policy() if speculative else None
    run_target, run_draft = target, strategy.draft if speculative else None
    placement = None
    if mesh is not None:
        placement = SH.Placement(mesh, tuple(SH.rules_table(rules).items()))
        run_target = SH.shard(target, mesh, rules)
        run_draft = SH.replicate(run_draft, mesh) if speculative else None
    longest, width = int(max(lengths.max(), d_lengths.max())), max(tokens.shape[1], d_tokens.shape[1])
    if guidance is not None or constraint is not None:
        if inputs or d_inputs:
            raise ValueError("guidance / constraint take token prompts only (no image inputs)")
        run_target = G.guide(run_target, lengths, guidance, constraint)
        if speculative:
            run_draft = G.guide(run_draft, d_lengths, guidance, constraint)
        ends = [run_target] + ([run_draft] if speculative else [])
        longest = int(max(int(np.max(np.asarray(m.prompt_end))) for m in ends))
        width = max(width, run_target.uncond.shape[1])
    # scratch slots beyond the committed tokens: the tree's nodes (target), the catch-up feed + tree (draft)
    per_step = 1 if policy is None else policy.scratch + policy.max_depth + 1
    need = longest + max_new_tokens + per_step
    if max_cache_len is not None and need > max_cache_len:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} + {per_step} "
                         f"scratch slots needs a cache of {need}, longer than max_cache_len={max_cache_len}")
    max_len = max(round_up(width + max_new_tokens + per_step, 64), need)
    ctx = loop.StepContext(max_new=max_new_tokens, max_steps=max_new_tokens - 1,
                           out_len=max_new_tokens + per_step, eos=eos, sampling=sampling_cfg, placement=placement)
    key = _default_key() if key is None else key
    t0 = time.perf_counter()
    # host arrays go to the jitted prefill as they are: it moves them in one go (a jnp.asarray each costs a dispatch)
    if policy is None:
        state = _prefill_ar(ctx, max_len, run_target, tokens, lengths, inputs, key, sp)
    else:
        state = _prefill_sd(ctx, max_len, policy.pending_width, policy.max_depth, strategy.controller, run_target,
                            run_draft, tokens, lengths, inputs, d_tokens, d_lengths, d_inputs, key, sp)
    jax.block_until_ready(state.out)
    rule, controller = (strategy.rule, strategy.controller) if speculative else (None, None)
    return Started(ctx, policy, rule, controller, run_target, run_draft, state, _pad_id(target, eos),
                   time.perf_counter() - t0)


def decode(target, prompt, strategy=None, max_new_tokens: int = 64, temperature: float = 0.0, top_k=None,
           top_p=None, key=None, eos_token_id=None, max_cache_len: int | None = None, draft_prompt=None,
           profile: bool | str = False, guidance: G.CFG | None = None, constraint=None, mesh=None,
           rules=None) -> DecodeOutput:
    """Generate up to `max_new_tokens` per row with `strategy` (default `AR()`); see DESIGN.md for the contract.

    Greedy when temperature is 0. `eos_token_id=None` uses the checkpoint's EOS ids (pass `()` to never stop).
    `max_cache_len` caps the KV cache; a prompt that does not fit with the new tokens raises ValueError.
    `draft_prompt` (speculative strategies): the draft's own view of each row's prompt (same batch size, e.g. a
    pruned or text-only version); the draft continues it with the committed tokens. Default: the target's prompt.
    `profile=True` runs the speculative loop phase by phase with a host sync after each and adds the summed
    "draft_s", "verify_s", "other_s" (the rule and the commit) to the stats (AR: step by step, "step_s"), timed
    alike so that they compare (same tokens, slower: use it to measure, not to serve). `profile="program"` runs
    the fused loop and adds the same keys timed inside one program instead, plus the whole step "step_s" for
    speculative strategies (`jspec.profiling.in_program_costs`: per step, times the loop's steps; no dispatch or
    sync in them).
    `guidance=jspec.CFG(scale, uncond_prompt)`: classifier-free guidance; `constraint` (e.g. `jspec.ImageGrammar`):
    a mask on the logits of each generated position. Both apply to the target and the draft alike, in every
    strategy (see `jspec.guidance`).
    `mesh` (e.g. `jspec.make_mesh(tensor=8)`): shard the target over it by the logical axis `rules` (default
    `jspec.sharding.DEFAULT_RULES`; a dict overrides entries), replicate the draft; same tokens as one device.
    """
    if profile not in (False, True, "host", "program"):
        raise ValueError(f"profile must be False, True (or 'host') or 'program', got {profile!r}")
    r = start(target, prompt, strategy, max_new_tokens, temperature, top_k, top_p, key, eos_token_id, max_cache_len,
              draft_prompt, guidance, constraint, mesh, rules)
    ctx, policy, state = r.ctx, r.policy, r.state
    t1 = time.perf_counter()
    phases, per_step = {}, {}
    if profile == "program":
        per_step = P.in_program_costs(ctx, policy, r.rule, r.controller, r.target, r.draft, state)
        t1 = time.perf_counter()
    if profile in (True, "host"):
        state, phases = (P.host_timed_ar(ctx, r.target, state) if policy is None else
                         P.host_timed_sd(ctx, policy, r.rule, r.controller, r.target, r.draft, state))
    else:
        state = r.run(state)
    out, n_out, steps, accepted, drafted = jax.device_get(
        (state.out, state.n_out, state.step, state.accepted, state.drafted))
    t2 = time.perf_counter()
    phases.update({k: v * int(steps) for k, v in per_step.items()})
    return _finish(out, n_out, int(steps), accepted, drafted, max_new_tokens, r.pad,
                   {"prefill_s": r.prefill_s, "decode_s": t2 - t1, **phases})


def _model_prompt(model, prompt, who: str):
    """(tokens, lengths, modality inputs as device arrays) of a prompt for `model`, checked on the host."""
    tokens, lengths, extra = normalize_prompt(prompt, model.config.vocab_size)
    fam = model.family
    if extra and fam.prompt_embeds is None:
        raise ValueError(f"{who}model_type {model.config.model_type!r} takes text only; got inputs {sorted(extra)}")
    if fam.prepare_inputs is not None:
        extra = fam.prepare_inputs(model.config, tokens, lengths, extra)
    return tokens, lengths, {k: jnp.asarray(v) for k, v in extra.items()}


def _draft_view(target, draft, prompt, tokens, lengths, inputs):
    """The draft's default prompt: a draft that reads images prepares the raw prompt itself (its own tower and
    layout); a text-only draft gets the prompt without the image / video placeholder tokens."""
    if not inputs:
        return tokens, lengths, inputs
    if draft.family.prompt_embeds is not None:
        try:
            return _model_prompt(draft, prompt, "draft ")
        except ValueError as e:
            raise ValueError(f"the draft cannot read the target's prompt: it was prepared for another model ({e}); "
                             "pass draft_prompt= built with the draft's own processor") from e
    placeholders = [t for t in (getattr(target.config, "image_token_id", None),
                                getattr(target.config, "video_token_id", None)) if t is not None]
    rows = [tokens[b, :lengths[b]] for b in range(tokens.shape[0])]
    d_tokens, d_lengths, _ = normalize_prompt([r[~np.isin(r, placeholders)] for r in rows], draft.config.vocab_size)
    return d_tokens, d_lengths, {}


def _finish(out, n_out, steps, accepted, drafted, max_new, pad, timings) -> DecodeOutput:
    B = out.shape[0]
    tokens = np.full((B, max_new), pad, np.int32)
    for b in range(B):
        tokens[b, :n_out[b]] = out[b, :n_out[b]]
    accepted = np.asarray(accepted[:, :steps], np.int32)
    row_steps = (accepted > 0).sum(axis=1)
    acc_sum = accepted.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_acc = np.where(row_steps > 0, acc_sum / np.maximum(row_steps, 1), np.nan)
        drafted_accepted = np.maximum(acc_sum - row_steps, 0)
        acc_rate = np.where(drafted > 0, drafted_accepted / np.maximum(drafted, 1), np.nan)
    stats = {"steps": row_steps, "accepted": accepted, "mean_accepted": mean_acc,
             "mean_accepted_no_bonus": mean_acc - 1.0, "drafted": np.asarray(drafted),
             "acceptance_rate": acc_rate, **timings}
    return DecodeOutput(tokens=tokens, lengths=np.asarray(n_out, np.int32), stats=stats)
