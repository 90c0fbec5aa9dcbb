"""`jspec.decode`: checks, setup, prefill, the fused decode loop, and the output (strategies: `jspec.strategies`;
what a strategy is to the engine: `jspec.engine.strategy`)."""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from jspec.core import compilation as CJ
from jspec.core.config import DecodeConfig, max_positions
from jspec.core import guidance as GD
from jspec.engine import loop
from jspec.core import prefill as PR
from jspec.engine import profiling as PF
from jspec.core import rowkeys as RK
from jspec.core import sampling as SM
from jspec.core import sharding as SH
from jspec.engine import step as SD
from jspec.parts.drafters import Setup, TargetPrefill
from ports.core.prompts import model_prompt, round_up
from jspec.engine.strategy import Speculative, Static, merge, split
from jspec.strategies.standard import AR

log = logging.getLogger(__name__)


@dataclasses.dataclass
class DecodeOutput:
    tokens: np.ndarray  # [B, max_new_tokens] int32, padded after each row's end
    lengths: np.ndarray  # [B] generated tokens per row (EOS included)
    stats: dict[str, Any]


@functools.lru_cache(maxsize=1)
def _default_key() -> jax.Array:
    """jax.random.key(0), made once (keys are immutable; making one is a device op)."""
    return jax.random.key(0)


def eos_ids(target, eos_token_id) -> tuple[int, ...]:
    if eos_token_id is None:
        return tuple(getattr(target.config, "eos_token_ids", ()) or ())
    if isinstance(eos_token_id, (int, np.integer)):
        return (int(eos_token_id),)
    return tuple(int(e) for e in eos_token_id)


def _check_call(target, lengths, max_new_tokens, eos, key) -> None:
    """Bad arguments named before any compile: positions past the model's, EOS ids outside its vocabulary, a key
    that is not a JAX PRNG key."""
    mpe = max_positions(target)
    if mpe and int(lengths.max()) + max_new_tokens > mpe:
        raise ValueError(f"prompt of {int(lengths.max())} tokens + max_new_tokens={max_new_tokens} runs past the "
                         f"model's max_position_embeddings={mpe}")
    V = getattr(target, "vocab_size", None)
    bad = [e for e in eos if e < 0 or (V is not None and e >= V)]
    if bad:
        raise ValueError(f"eos_token_id {bad} outside the model vocabulary [0, {V})")
    if key is not None:
        dt, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
        typed = dt is not None and jax.dtypes.issubdtype(dt, jax.dtypes.prng_key)
        legacy = dt == np.uint32 and shape is not None and shape[-1:] == (2,)
        if not (typed or legacy):
            raise ValueError(f"key must be a JAX PRNG key (jax.random.key(seed)), got {type(key).__name__} "
                             f"{getattr(key, 'dtype', '')}".rstrip())
        B = len(lengths)
        if (shape if typed else shape[:-1]) not in ((), (B,)):
            raise ValueError(f"key must be one PRNG key or one per row ({B} rows), got keys of shape "
                             f"{tuple(shape if typed else shape[:-1])}")


def _pad_id(target, eos: tuple[int, ...]) -> int:
    pad = getattr(target.config, "pad_token_id", None)
    if pad is not None:
        return int(pad)
    return eos[0] if eos else 0


def _target_prefill(ctx, max_len, target, tokens, lengths, inputs, key, sp, asks=None):
    cache = SH.constrain(ctx.placement, PR.new_cache_for(target, tokens.shape[0], max_len))
    logits, fo, cache = PR.prefill(target, tokens, lengths, cache, inputs, chunk=ctx.prefill_chunk,
                                     **(asks or {}))
    cache = SH.constrain(ctx.placement, cache)
    keys = RK.split(RK.for_rows(key, tokens.shape[0]), 2)  # one key per row from here on
    first = SM.sample(keys[:, 0], logits, ctx.sampling, sp)
    k_loop = keys[:, 1]
    return loop.start_state(ctx, first, cache, k_loop, sp), logits, fo


@CJ.jit(options=CJ.PREFILL, static_argnames=("ctx", "max_len"))
def _prefill_ar(ctx, max_len, target, tokens, lengths, inputs, key, sp):
    return _target_prefill(ctx, max_len, target, tokens, lengths, inputs, key, sp)[0]


@functools.partial(jax.jit, static_argnames=("ctx",), donate_argnames=("state",))
def _decode_ar(ctx, target, state):
    return loop.run_loop(ctx, lambda s: loop.ar_step(ctx, target, s), state)


def _prefill_asks(parts, tokens, lengths, inputs, target_layers: int) -> dict:
    """The forward options of the target's prefill: the prefill hook's and the drafter's, merged (hidden layers
    united; any other option asked by both must agree), and the last layer's hidden states when the controller
    reads the target's hidden state (`Asks.hidden`: it starts from the prompt's)."""
    asks: dict = {}
    if parts.needs.prefill_hidden:
        asks["hidden_layers"] = (target_layers,)
    for ask in (None if parts.prefill is None else parts.prefill.asks, parts.drafter.prefill_asks):
        if ask is None:
            continue
        for k, v in ask(tokens, lengths, inputs).items():
            if k == "hidden_layers":
                asks[k] = tuple(sorted(set(asks.get(k, ())) | set(v)))
            elif k in asks and asks[k] is not v:
                raise ValueError(f"the prefill hook and the drafter both set the prefill option {k!r}")
            else:
                asks[k] = v
    return asks


@CJ.jit(options=CJ.PREFILL, static_argnames=("ctx", "max_len", "d_len", "static"))
def _prefill_sd(ctx, max_len, d_len, static, dyn, target, tokens, lengths, inputs, d_prompt, key, sp, speculate=None):
    parts = merge(static, dyn)
    asks = _prefill_asks(parts, tokens, lengths, inputs, target.kv_layout[0])
    state, logits, fo = _target_prefill(ctx, max_len, target, tokens, lengths, inputs, key, sp, asks)
    prefill = TargetPrefill(logits, fo.hidden, fo.attn, tokens, lengths, state.cache,
                            tuple(asks.get("hidden_layers", ())))
    return SD.sd_start(ctx, parts, target, state, prefill, d_prompt, d_len, speculate)


@functools.partial(jax.jit, static_argnames=("ctx", "static"), donate_argnames=("state",))
def _decode_sd(ctx, static, dyn, target, state):
    parts = merge(static, dyn)
    return loop.run_loop(ctx, lambda s: SD.sd_step(ctx, parts, target, s), state)


class Started(NamedTuple):
    """A decode after its prefill: what the decode loop runs on (`state` is consumed by it)."""

    ctx: loop.StepContext
    parts: Speculative | None  # the strategy's parts as run (drafter guided / placed); None for AR
    static: Static | None  # `split(parts)`: the jit key and the dynamic leaves
    dyn: list | None
    target: Any          # as run: sharded / guided when asked
    state: loop.DecodeState
    pad: int
    prefill_s: float
    prep_stats: dict | None = None  # the drafter's host-side preparation numbers (`Prepared.stats`)
    ahead: CJ.Ahead | None = None  # the decode loop compiling beside the prefill (`start(compile_loop=True)`)
    idle_guard: int | None = None  # a `Guarded` that cannot draft here (`Guarded.drafts`), run as AR: its plan's depth

    @property
    def depth(self) -> int:
        """The deepest draft position of the strategy's plan (0 for AR)."""
        return self.parts.plan.max_depth if self.parts is not None else (self.idle_guard or 0)

    def loop_call(self, state: loop.DecodeState | None = None) -> tuple[Any, tuple]:
        """(the jitted decode loop, its arguments) from `state` (default: this start's own): what `run` calls, for
        tools that lower or trace it (`jspec.engine.profiling.op_costs`). Waits for the loop's compile ahead, if any."""
        if self.ahead is not None:
            self.ahead.wait()
        state = self.state if state is None else state
        if self.parts is None:
            return _decode_ar, (self.ctx, self.target, state)
        return _decode_sd, (self.ctx, self.static, self.dyn, self.target, state)

    def run(self, state: loop.DecodeState | None = None) -> loop.DecodeState:
        """The fused decode loop (AR or speculative) from `state` (default: this start's own), consumed."""
        fn, args = self.loop_call(state)
        return fn(*args)


def start(target, prompt, strategy=None, config: DecodeConfig | None = None, **settings) -> Started:
    """`decode`'s checks, setup and prefill: the state its loop starts from, for tools that time or step the loop
    themselves (`jspec.engine.profiling`). The settings come as a `DecodeConfig`, or as `decode`'s keywords (not
    both). With `config.compile_loop` (and no mesh) the fused decode loop is lowered first and compiled on a
    background thread while the prefill compiles and, off the CPU, runs (`Started.run` waits for it): a first call
    no longer pays the two compiles one after the other."""
    if config is None:
        config = DecodeConfig(**settings)
    elif settings:
        raise ValueError(f"start takes a DecodeConfig or keywords, not both (got {sorted(settings)} beside config)")
    c = config
    max_new_tokens, key, mesh, draft_prompt = c.max_new_tokens, c.key, c.mesh, c.draft_prompt
    guidance, constraint = c.guidance, c.constraint
    strategy = AR() if strategy is None else strategy
    if not callable(getattr(strategy, "resolve", None)):
        raise ValueError(f"strategy must be a jspec strategy (AR, Chain, Tree, DynamicTree, Speculative, ...), got "
                         f"{type(strategy).__name__}")
    strategy.check(target)
    tokens, lengths, inputs = model_prompt(target, prompt, "", int(c.pad_prompt_to))
    # the parts it runs here: a strategy may measure first (the guard's costs, once per shape) or run as AR
    parts, idle_guard = strategy.resolve(target, len(lengths), int(lengths.max()), start)
    SH.check_same_everywhere("prompts", tokens, lengths)
    if draft_prompt is not None and parts is None and idle_guard is None:
        raise ValueError("draft_prompt needs a speculative strategy (Chain, Tree, DynamicTree, ...)")
    speculate = _speculate_mask(c.speculate, len(lengths))
    if parts is not None and (speculate is not None or (parts.controller is not None and parts.controller.skips)):
        parts = parts.replace(plan=parts.plan.with_skips())  # a step where no row drafts verifies one token
    sampling_cfg, sp = SM.make_sampling(c.temperature, c.top_k, c.top_p)
    eos = eos_ids(target, c.eos_token_id)
    _check_call(target, lengths, max_new_tokens, eos, key)
    run_target, placement = target, None
    if mesh is not None:
        placement = SH.Placement(mesh, tuple(SH.rules_table(c.rules).items()))
        run_target = SH.shard(target, mesh, c.rules)
    longest, width = int(lengths.max()), tokens.shape[1]
    if guidance is not None or constraint is not None:
        if inputs:
            raise ValueError("guidance / constraint take token prompts only (no image inputs)")
        run_target = GD.guide(run_target, lengths, guidance, constraint)
        longest = int(np.max(np.asarray(run_target.prompt_end)))
        width = max(width, run_target.uncond.shape[1])
    d_prompt, prep_stats = None, None
    if parts is not None:
        setup = Setup(target, prompt, tokens, lengths, inputs, draft_prompt, mesh, guidance, constraint)
        prep = parts.drafter.prepare(setup)
        parts, d_prompt, prep_stats = parts.replace(drafter=prep.drafter), prep.prompt, prep.stats
        if parts.prefill is not None:  # host-side facts of the prompts (checks, static widths)
            parts = parts.replace(prefill=parts.prefill.prepare(setup, prep))
        longest, width = max(longest, prep.longest), max(width, prep.width)
    # slots past the committed tokens: the verify's nodes (the target's cache), the catch-up feed and the drafts'
    # windows (the drafter's): each cache is as long as its own writes need, so a round without drafts reads no more
    # of the target's cache than an AR step does
    per_step = 1 if parts is None else parts.needs.per_step
    need = longest + max_new_tokens + per_step
    if c.max_cache_len is not None and need > c.max_cache_len:
        raise ValueError(f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} + {per_step} "
                         f"scratch slots needs a cache of {need}, longer than max_cache_len={c.max_cache_len}")
    d_len = max(round_up(width + max_new_tokens + per_step, 64), need)
    own = 1 if parts is None else max(parts.needs.scratch, 1)
    max_len = max(round_up(width + max_new_tokens + own, 64), longest + max_new_tokens + own)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("%s: %d rows, prompt width %d, cache %d slots (drafter's %d), %d new tokens; %s",
                  type(strategy).__name__, tokens.shape[0], tokens.shape[1], max_len, d_len, max_new_tokens,
                  _shape_text(parts))
    ctx = loop.StepContext(max_new=max_new_tokens, max_steps=max_new_tokens - 1,
                           out_len=max_new_tokens + per_step, eos=eos, sampling=sampling_cfg, placement=placement,
                           prefill_chunk=c.chunk if c.chunk and tokens.shape[1] > c.chunk else None)
    key = _default_key() if key is None else key
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)  # a raw uint32 key (jax.random.PRNGKey)
    t0 = time.perf_counter()
    # host arrays go to the jitted prefill as they are: it moves them in one go (a jnp.asarray each costs a dispatch)
    static = dyn = None
    if parts is None:
        prefill, args = _prefill_ar, (ctx, max_len, run_target, tokens, lengths, inputs, key, sp)
    else:
        static, dyn = split(parts)
        prefill, args = _prefill_sd, (ctx, max_len, d_len, static, dyn, run_target, tokens, lengths, inputs, d_prompt,
                                      key, sp, speculate)
    ahead = None
    if c.loop_ahead and placement is None:  # (a mesh's shardings would have to be spelled out for the lowering)
        shapes = prefill.trace(*args).out_info  # the call below reuses this trace
        ahead = CJ.Ahead(_decode_ar, (ctx, run_target, shapes)) if parts is None else \
            CJ.Ahead(_decode_sd, (ctx, static, dyn, run_target, shapes))
    try:
        if ahead is not None and jax.default_backend() == "cpu":
            # the CPU runs the programs on all its cores: compile both at once, then run the prefill alone
            prefill.lower(*args).compile()
            ahead.wait()
        state = prefill(*args)
        jax.block_until_ready(state.out)
    except Exception:
        if ahead is not None:  # leave no compile running behind an error
            ahead.wait()
        raise
    return Started(ctx, parts, static, dyn, run_target, state, _pad_id(target, eos), time.perf_counter() - t0,
                   prep_stats, ahead, idle_guard)


def _speculate_mask(mask, batch: int) -> np.ndarray | None:
    """`speculate=` as [B] bools, or None (every row speculates); a mask of another shape or type is refused."""
    if mask is None:
        return None
    m = np.asarray(mask)
    if m.shape != (batch,) or m.dtype != np.bool_:
        raise ValueError(f"speculate must be one bool per row ([{batch}] bools: False rows decode as AR), got "
                         f"{m.dtype} of shape {m.shape}")
    return m


def _shape_text(parts) -> str:
    """The static shape a speculative strategy compiles for (DEBUG log)."""
    if parts is None:
        return "autoregressive"
    plan = parts.plan
    return (f"{type(parts.drafter).__name__} drafts a {type(plan).__name__} of depth {plan.max_depth} "
            f"({plan.scratch} scratch slots), rule {type(parts.rule).__name__}, controller "
            f"{type(parts.controller).__name__ if parts.controller is not None else 'none'}")


def decode(target, prompt, strategy=None, **settings) -> DecodeOutput:
    """Generate up to `max_new_tokens` per row with `strategy` (default `AR()`); see DESIGN.md for the contract.

    Greedy when temperature is 0. `eos_token_id=None` uses the checkpoint's EOS ids (pass `()` to never stop).
    `key`: one PRNG key (row b draws from fold_in(key, b)) or one key per row ([B] keys): every random draw of a
    row (its samples, drafts, acceptance tests, controller choices) comes from its own key, so a row's sampled
    tokens stay the same when other rows are added to or removed from its batch.
    `max_cache_len` caps the KV cache; a prompt that does not fit with the new tokens raises ValueError.
    `draft_prompt` (speculative strategies): the draft's own view of each row's prompt (same batch size, e.g. a
    pruned or text-only version); the draft continues it with the committed tokens. Default: the target's prompt.
    `profile=True` runs the speculative loop phase by phase with a host sync after each and adds the summed
    "draft_s", "verify_s", "other_s" (the rule and the commit) to the stats (AR: step by step, "step_s"), timed
    alike so that they compare (same tokens, slower: use it to measure, not to serve). `profile="program"` runs
    the fused loop and adds the same keys timed inside one program instead, plus the whole step "step_s" for
    speculative strategies (`jspec.engine.profiling.in_program_costs`: per step, times the loop's steps; no dispatch or
    sync in them).
    `guidance=jspec.CFG(scale, uncond_prompt)`: classifier-free guidance; `constraint` (e.g. `jspec.ImageGrammar`):
    a mask on the logits of each generated position. Both apply to the target and the draft alike, in every
    strategy (see `jspec.core.guidance`).
    `mesh` (e.g. `jspec.make_mesh(tensor=8)`): shard the target over it by the logical axis `rules` (default
    `jspec.core.sharding.DEFAULT_RULES`; a dict overrides entries), replicate the draft; same tokens as one device.
    `prefill_chunk`: the target's prefill fills the cache this many prompt tokens at a time, so that its
    activations are bounded by the chunk rather than the prompt (same logits and tokens); "auto" (default) is
    `DEFAULT_PREFILL_CHUNK` tokens, None one pass. Chunks of `ports.core.layers.BLOCKWISE_MIN` tokens or more attend
    blockwise. Guided prompts (CFG) are prefilled in one pass.
    `pad_prompt_to`: the prompt's width is padded up to a multiple of this (default 16), so that prompts of nearby
    lengths share compiled programs (a benchmark over many prompt lengths passes e.g. 128).
    `speculate`: [B] bools; a row marked False drafts nothing and takes AR steps inside the same batch (its tokens
    are AR's: greedy the same tokens, sampled the same distribution), and the verify width follows only the rows
    that speculate. None (default): every row speculates.
    The keywords are `jspec.DecodeConfig`'s fields (declared there once; this signature is made from them),
    checked when it is made, before any compute; `start` takes the same keywords or a config.
    """
    try:
        config = DecodeConfig(**settings)
    except TypeError:
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(DecodeConfig)})
        raise TypeError(f"decode() got unknown keyword(s) {unknown}: its settings are jspec.DecodeConfig's fields "
                        f"({', '.join(f.name for f in dataclasses.fields(DecodeConfig))})") from None
    profile, max_new_tokens = config.profile, config.max_new_tokens
    r = start(target, prompt, strategy, config)
    state = r.state
    t1 = time.perf_counter()
    phases, per_step = {}, {}
    if profile == "program":
        per_step = PF.in_program_costs(r)
        t1 = time.perf_counter()
    if profile in (True, "host"):
        state, phases = PF.host_timed(r)
    else:
        state = r.run(state)
    out, n_out, steps, accepted, drafted, (decided, prefilled) = SH.host_get(
        (state.out, state.n_out, state.step, state.accepted, state.drafted, aux_stats(state, r)))
    t2 = time.perf_counter()
    phases.update({k: v * int(steps) for k, v in per_step.items()})
    decided = {k: v[:, :int(steps)] for k, v in decided.items()}
    if log.isEnabledFor(logging.INFO):
        new = int(np.sum(n_out))
        log.info("%s: %d rows, %d new tokens in %d steps; prefill %.3f s (with any compile), decode loop %.3f s "
                 "(%.1f tokens/s)", type(strategy or AR()).__name__, len(n_out), new, int(steps), r.prefill_s,
                 t2 - t1, new / max(t2 - t1, 1e-9))
    return finish(out, n_out, int(steps), accepted, drafted, max_new_tokens, r.pad,
                   {"prefill_s": r.prefill_s, "decode_s": t2 - t1, **(r.prep_stats or {}), **prefilled,
                    **decided, **phases},
                   depth=r.depth)


def aux_stats(state, r: Started) -> tuple[dict, dict]:
    """(per-step decisions [B, max_steps, ...], the prefill hook's per-row facts) of the decode state of `r`, as
    arrays. A guard run as AR (`Started.idle_guard`) decided depth 0 at every step."""
    if r.parts is None:
        if r.idle_guard is None:
            return {}, {}
        zeros = np.zeros(state.accepted.shape, np.int32)
        return {"depth": zeros, "speculated": zeros.astype(bool)}, {}
    return state.aux.decided, state.aux.prefilled


def finish(out, n_out, steps, accepted, drafted, max_new, pad, timings, depth: int = 0) -> DecodeOutput:
    """The output and its stats (README "Metrics" defines each) from the loop's end state; `depth`: the plan's
    deepest draft position (0 for AR)."""
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
        # EESD Eq. 11-12: v_d = accepted drafts / drafts (the acceptance rate), r_d = accepted drafts / tokens
        r_d = np.where(drafted > 0, drafted_accepted / np.maximum(np.asarray(n_out), 1), np.nan)
        hm = np.where(acc_rate + r_d > 0, 200.0 * acc_rate * r_d / (acc_rate + r_d),
                      np.where(drafted > 0, 0.0, np.nan))
    reached = np.maximum(accepted - 1, 0)[:, :, None] >= np.arange(1, depth + 1)[None, None]  # [B, steps, D]
    per_pos = reached.sum(axis=1).astype(np.int32)
    with np.errstate(invalid="ignore", divide="ignore"):
        rate_pos = np.where(row_steps[:, None] > 0, per_pos / np.maximum(row_steps, 1)[:, None], np.nan)
    if "speculated" in timings:  # the guard's choice per step: the share of each row's rounds that drafted
        spec = np.asarray(timings["speculated"], bool)[:, :steps]
        with np.errstate(invalid="ignore", divide="ignore"):
            timings = {**timings, "speculated_share": np.where(row_steps > 0, (spec & (accepted > 0)).sum(1) /
                                                               np.maximum(row_steps, 1), np.nan)}
    stats = {"steps": row_steps, "accepted": accepted, "mean_accepted": mean_acc,
             "accepted_per_position": per_pos, "acceptance_per_position": rate_pos,
             "mean_accepted_no_bonus": mean_acc - 1.0, "drafted": np.asarray(drafted),
             "accepted_drafts": drafted_accepted, "acceptance_rate": acc_rate, "r_d": r_d, "hm": hm, **timings}
    return DecodeOutput(tokens=tokens, lengths=np.asarray(n_out, np.int32), stats=stats)


def _with_settings(fn, leading: tuple[str, ...]):
    """`fn`'s signature with `DecodeConfig`'s fields as its keyword-only parameters (after `leading` ones), so that
    `help` and `inspect.signature` name every setting where they are declared once."""
    import inspect

    sig = inspect.signature(fn)
    own = [p for name, p in sig.parameters.items() if name in leading]
    fields = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
              for f in dataclasses.fields(DecodeConfig)]
    fn.__signature__ = sig.replace(parameters=own + fields)
    return fn


_with_settings(decode, ("target", "prompt", "strategy"))
