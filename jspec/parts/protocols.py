"""The part protocols and every type they exchange, in one place.

A speculative strategy (`jspec.Speculative`) is five parts the engine composes, each a pytree object (its arrays and
numbers are leaves, so new values do not recompile; everything else is the static key):

- `Drafter`: who proposes tokens, and with which distribution (`jspec.parts.drafters` says what each method does);
- `Plan`: the tree policy, which nodes to draft each step as device arrays padded to a static node budget, driving
  the drafter level by level into a `Proposal` (`jspec.parts.plans`);
- `Rule`: the acceptance rule, which drafted path the target accepts and the token after it (`Verdict`;
  its base and its walks are in `jspec.parts.rules`);
- `Controller`: what to draft next step, learned from what acceptance said (`Decision` before a step, `Record`
  after it; `jspec.parts.controllers`);
- `PrefillHook`: an optional pass over the target prefill's by-products (`TargetPrefill`) that picks the drafter's
  prompt (SpecVLM's pruning).

The engine hands a drafter a `DraftEnv` each step and a `Catchup` after acceptance; on the host it prepares a
drafter from a `Setup` into a `Prepared`. `Needs` is what the strategy's programs compute beyond the basics, worked
out once from its parts. Each base below holds the protocol's defaults; each field says its contract.
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jspec.parts.trees import TreeArrays


class DraftEnv(NamedTuple):
    ctx: Any  # loop.StepContext
    sp: Any  # sampling.SamplingParams
    target: Any
    tcache: Any  # the target's KV cache at the step's start (committed tokens before `last`)
    last: jax.Array  # [B] the newest committed token (the tree's root)
    decision: Any = None  # controllers.Decision of this step
    needs: Any = None  # the strategy's `Needs` (plan depth and scratch, what the controller and rule ask for)
    out: jax.Array | None = None  # [B, out_len] the tokens generated so far: each row's first n_out, `last` the newest
    n_out: jax.Array | None = None  # [B] int32
    stop: Any = None  # the controller's per-level `stop(level, aux, limit) -> limit` this step (None: never stops)


class Setup(NamedTuple):
    """Host-side facts a drafter prepares from (before any compute)."""

    target: Any  # the target as given (unsharded, unguided)
    prompt: Any  # the user's prompt, as given
    tokens: Any  # [B, T] the target's prompt tokens (right padded)
    lengths: Any  # [B]
    inputs: dict  # the target's modality inputs
    draft_prompt: Any  # the user's draft_prompt= or None
    mesh: Any
    guidance: Any
    constraint: Any


class Prepared(NamedTuple):
    drafter: Any  # as it runs (guided, placed)
    prompt: Any  # handed to `init`
    longest: int  # the longest prompt it caches
    width: int  # its prompt arrays' width
    stats: dict | None = None  # host-side numbers of the preparation (e.g. a captioner's seconds) for `out.stats`


class TargetPrefill(NamedTuple):
    """The target prefill's by-products, handed to the prefill hook and the drafter's `init`."""

    logits: jax.Array  # [B, V] at each row's last prompt token
    hidden: tuple  # hidden states the hook and the drafter asked for, each [B, T, D], in the order of `layers`
    attn: jax.Array | None  # [B, S] attention over prompt slots when the hook asked (`attn_query_weights`)
    tokens: jax.Array  # [B, T]
    lengths: jax.Array  # [B]
    cache: Any  # the target's cache after the prefill
    layers: tuple = ()  # the layer index of each entry of `hidden`

    def hidden_at(self, layer: int) -> jax.Array:
        """The residual stream after the target's first `layer` layers, [B, T, D] (it must have been asked for)."""
        if layer not in self.layers:
            raise ValueError(f"the target prefill kept hidden states of layers {self.layers}, not {layer}")
        return self.hidden[self.layers.index(layer)]


class Catchup(NamedTuple):
    """What a step decided, for the drafter's `commit`."""

    prop: Any  # the step's Proposal
    path: jax.Array  # [B, D+1] node ids of the accepted path by depth
    new: jax.Array  # [B, D+1] [accepted drafts..., bonus, 0...]
    accepted: jax.Array  # [B] drafts accepted (bonus excluded)
    active: jax.Array  # [B] the row was decoding this step
    is_chain: bool  # the plan's nodes sit in depth order (accepted scratch entries are already a prefix)
    hidden: jax.Array | None = None  # [B, D+1, (streams,) n * D_model] the target's residual streams at the
    # drafter's `verify_layers` (concatenated on the last axis, in that order) at the accepted path's nodes (root
    # first), for a drafter with `verify_hidden = True`
    fed: jax.Array | None = None  # [B, D] int32: the draft scratch offset holding the K/V of the accepted path's
    # node at depth 1..D (-1 where the drafter did not feed it), or None where the plan records none
    logits: jax.Array | None = None  # [B, N, V] the target's logits after every node of the proposal, as the rule
    # read them (guided and constrained where the target is), for a drafter with `verify_logits = True`; only the
    # nodes in `prop.valid` are sure to be computed (a trimmed verify, or a round where none drafted, leaves zeros past its width)


class Drafter:
    """Base of drafters (the protocol: `jspec.parts.drafters`). A drafter subclasses it (as a `flax.struct` dataclass)
    and defines `prepare`, `init`, `root`, `level` and `commit`; the optional hooks default to doing nothing."""

    verify_hidden = False  # reads the target's hidden states at the accepted nodes (`Catchup.hidden`)
    block_size = 0  # > 0: a block drafter, whose draft positions 1 .. block_size - 1 come from one forward; it
    # defines `block_logp(env, state) -> (log-distributions [B, block_size - 1, V] of the positions after
    # `env.last`, each given the committed text alone; state)`, what block trees draft from
    borrows_cache = False  # drafts in the target's own KV cache: it defines `lend(state, cache) -> state` (the
    # state the plan drafts from, holding the cache; written past the committed length only, where the verify
    # writes next) and `give_back(state) -> (state without the cache, the cache as the draft left it)`
    verify_logits = False  # reads the target's logits at every verified node (`Catchup.logits`)

    def check(self, target) -> None:
        """ValueError before any compute when the drafter cannot serve `target` (default: nothing to check)."""

    def map_models(self, fn) -> "Drafter":
        """The drafter with `fn` applied to every model it runs (default: it runs none of its own)."""
        return self

    def verify_layers(self, num_layers: int) -> tuple[int, ...]:
        """With `verify_hidden`: the target layers i (the residual stream after its first i of `num_layers`
        layers) whose states `Catchup.hidden` concatenates, in that order (default: the last layer's)."""
        return (num_layers,)

    def prefill_asks(self, tokens, lengths, inputs) -> dict:
        """Forward options of the target's prefill whose by-products `init` reads (default: none)."""
        return {}

    def prepare(self, setup: Setup) -> Prepared:
        raise NotImplementedError(f"{type(self).__name__} defines no `prepare`")

    def init(self, env: DraftEnv, prefill: TargetPrefill, prompt, max_len: int):
        raise NotImplementedError(f"{type(self).__name__} defines no `init`")

    def root(self, env: DraftEnv, state):
        raise NotImplementedError(f"{type(self).__name__} defines no `root`")

    def level(self, env: DraftEnv, state, tokens, depth, mask, offset, run):
        raise NotImplementedError(f"{type(self).__name__} defines no `level`")

    def commit(self, env: DraftEnv, state, catchup: Catchup):
        raise NotImplementedError(f"{type(self).__name__} defines no `commit`")

    def window(self, env: DraftEnv, state, key: jax.Array):
        """A drafter that draws its whole chain itself (`jspec.parts.plans.WindowPlan`): (tokens [B, G] after
        `env.last`, q [B, G, V] the distribution each token was drawn from given everything before this call and
        the earlier tokens of the chain, the state). `key`: [B] row keys of this round."""
        raise NotImplementedError(f"{type(self).__name__} draws no window of its own (use a level-by-level plan)")

    def catch_up(self, env: DraftEnv, state):
        """The state after a step in which no row drafts (every row at depth 0): the next step's root must start
        where it would have (default: `root`, its distribution unused, which XLA then does not compute; a
        `jspec.parts.drafters.feed.FeedDrafter` leaves the token unread for its next `root`)."""
        return self.root(env, state)[2]


def when(pred: jax.Array, fn, x):
    """`fn(x)` where the traced bool `pred` holds, else `x` (`fn` keeps `x`'s structure): a loop of zero or one
    trips, which updates `x`'s buffers in place, where a `lax.cond` whose branch writes into a cache it returns
    has XLA:CPU copy the cache in and out."""
    return jax.lax.while_loop(lambda c: c[0], lambda c: (jnp.zeros((), bool), fn(c[1])), (pred, x))[1]


def run_level(run, go, state):
    """`go(state) -> (outputs, state)` for a drafter's `level`, skipped where the traced bool `run` is False (no row
    needs the level): then the outputs are zeros of their shapes and the state comes back as it was. `run` None
    always runs it."""
    if run is None:
        return go(state)
    zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(go, state)[0])
    return when(run, lambda c: go(c[1]), (zeros, state))  # in place: the state holds the drafter's cache


class Proposal(NamedTuple):
    """A drafted tree for every row. Node 0 is the root (`last`)."""

    tokens: jax.Array  # [B, N]
    valid: jax.Array  # [B, N] nodes the verifier may accept
    tree: TreeArrays  # [B, ...]
    q: jax.Array | None  # [B, N, V] distribution each node's children were drawn from (when drawn or asked)
    fed: jax.Array | None  # [B, N] int32: the draft scratch offset holding node i's K/V, -1 where not fed
    root_logp: jax.Array  # [B, V] the drafter's log-distribution at the root
    aux: Any = None  # the drafter's per-node outputs [B, N, ...] when asked
    known: jax.Array | None = None  # [B, N] bool: q exists at the node (its level was drafted)
    decision: Any = None  # the controller's Decision this proposal followed; its `depth` [B] (or None: no limit)
    # is the depth each row drafted to, after any per-level stop
    node_topk: jax.Array | None = None  # [B, N, k] the k largest draft probabilities at each node, when asked
    node_known: jax.Array | None = None  # [B, N] bool: node_topk exists there (the node's level was drafted)


class LayeredTree(NamedTuple):
    """Per-row trees over a plan's layout: parent, rank [B, N] int32 and valid [B, N] bool (see `trees.Layout`)."""

    parent: jax.Array
    rank: jax.Array
    valid: jax.Array


class Plan:
    """Base of tree plans: `propose` drafts a step's tree with a drafter; `num_nodes`, `max_depth`, `scratch` and
    `is_chain` are static. Optional hooks and flags default to: no check against the rule, one verify width,
    no per-level stops (`stops`), no per-node outputs (`node_outputs`), a catch-up feed of 2 tokens."""

    pending_width = 2  # committed tokens the drafter may not have read yet at a step's start, `last` included
    stops = False  # takes a controller's per-level `stop`
    node_outputs = False  # can hand each node's top-k draft probabilities to the controller (`Asks.node_topk`)

    @property
    def num_nodes(self) -> int:
        """Node slots of a step's proposal, the root included (static)."""
        raise NotImplementedError(f"{type(self).__name__} declares no `num_nodes`")

    @property
    def max_depth(self) -> int:
        """The deepest level a step drafts (static)."""
        raise NotImplementedError(f"{type(self).__name__} declares no `max_depth`")

    @property
    def scratch(self) -> int:
        """Cache slots past the committed tokens a step's drafts may write (static; drafters size buffers by it)."""
        raise NotImplementedError(f"{type(self).__name__} declares no `scratch`")

    @property
    def is_chain(self) -> bool:
        """Whether every node has at most one child, so accepted scratch entries are already a prefix (static)."""
        raise NotImplementedError(f"{type(self).__name__} declares no `is_chain`")

    def check(self, rule) -> None:
        """ValueError when the plan cannot run under `rule` (default: any rule)."""

    def verify_size(self, prop: "Proposal", done: jax.Array) -> tuple[tuple[int, ...], jax.Array | None]:
        """(static widths, index of the one the target verifies this step), or ((), None): the whole proposal."""
        return (), None

    def with_skips(self) -> "Plan":
        """The plan for steps where rows may draft nothing (depth 0: a `speculate=False` row, a controller that
        `skips`): its verify widths then include the root alone, so a step where no row drafts verifies one token
        (default: the plan as it is, verifying its whole width)."""
        return self

    def propose(self, env, drafter, ds, key, decision) -> tuple["Proposal", Any]:
        """(this step's tree, the drafter's state): drafted with `drafter` from its state `ds`. `decision.depth`
        [B] (or None) limits each row's depth; `env.needs` says what to keep (`draws`: the rule draws children when
        sampling; `asks.draft_probs` / `draft_aux` / `node_topk`); `env.stop` (or None) may lower a row's limit
        after any level (plans with `stops`). The proposal's `decision` is `decision` with the depths drafted to."""
        raise NotImplementedError(f"{type(self).__name__} defines no `propose`")


class Verdict(NamedTuple):
    path: jax.Array  # [B, D+1] node ids of the accepted path by depth (entries past `accepted` are 0)
    accepted: jax.Array  # [B] drafts accepted (bonus excluded)
    bonus: jax.Array  # [B] the token after the accepted path


@dataclasses.dataclass(frozen=True)
class Asks:
    """What a controller reads from each step beyond the basics of `Record` (all off by default: nothing is
    computed that no one reads)."""

    target_logits: bool = False  # the target's logits at the accepted path's nodes
    draft_probs: bool = False  # the drafter's distribution at the accepted path's nodes
    draft_aux: bool = False  # the drafter's own per-node outputs (e.g. per-view probabilities) along the path
    root_topk: int = 0  # the drafter's k largest root probabilities
    node_topk: int = 0  # the drafter's k largest probabilities at every drafted node (plans with `node_outputs`)
    hidden: bool = False  # the target's last hidden state at the node the bonus token follows


class Decision(NamedTuple):
    """A controller's plan for one step (fields it does not set stay None)."""

    depth: jax.Array | None = None  # [B] int32 depth limit (clipped to [1, plan depth]; [0, ...] for a controller
    # that `skips`: 0 drafts nothing, the row's step is an AR step)
    weights: jax.Array | None = None  # [B, m] ensemble weights of a multi-view drafter
    tree: Any = None  # a per-row tree for plans that take one (`LayeredTree` arrays [B, N])
    info: dict | None = None  # per-row numbers [B, ...] to keep per step in `out.stats` under their names


class Record(NamedTuple):
    """What one step did, per row. Arrays by depth have D+1 entries: node j of the accepted path (j = 0 the root)
    is the position whose target distribution decided token j+1 of `tokens`."""

    accepted: jax.Array  # [B] drafts accepted (bonus excluded)
    committed: jax.Array  # [B] tokens committed this step (after EOS / max_new_tokens cuts; 0 for finished rows)
    active: jax.Array  # [B] the row was decoding this step
    depth: jax.Array  # [B] the depth limit the step ran with
    drafted: jax.Array  # [B] draft nodes offered to the target
    path: jax.Array  # [B, D+1] node ids of the accepted path (entries past `accepted` are 0)
    on_path: jax.Array  # [B, N] bool: per-node verdict (node accepted; the root included)
    tokens: jax.Array  # [B, D+1] [accepted drafts..., bonus, 0...]
    target_logits: jax.Array | None = None  # [B, D+1, V] when asked
    draft_probs: jax.Array | None = None  # [B, D+1, V] when asked (zero past the drafted depth)
    draft_known: jax.Array | None = None  # [B, D+1] bool: draft_probs exist there (the node's level was drafted)
    draft_aux: Any = None  # the drafter's aux gathered along the path [B, D+1, ...] when asked
    root_topk: jax.Array | None = None  # [B, k] when asked
    node_topk: jax.Array | None = None  # [B, N, k] when asked (every node of the drafted tree)
    node_known: jax.Array | None = None  # [B, N] bool: node_topk exists there
    hidden: jax.Array | None = None  # [B, D_model] when asked


class Controller:
    """Base of controllers: the protocol's defaults (no state, no decision, nothing observed; no `start`, no
    per-level `stop`, nothing to check). A controller that ends drafts level by level sets `stops = True`."""

    asks = Asks()
    stops = False
    skips = False  # may decide depth 0 for a row (no draft: the row's step is an AR step)
    defers = 0  # rounds without drafts a drafter may leave unread before it catches up (widens its pending feed)

    def init(self, batch: int, max_depth: int) -> Any:
        return None

    def decide(self, state, key) -> Decision:
        return Decision()

    def observe(self, state, record: Record):
        return state

    def start(self, state, prefill):
        return state

    def stop(self, state, level, aux, limit, key):
        return limit

    def check(self, target, drafter) -> None:
        pass


def asks_of(controller) -> Asks:
    return getattr(controller, "asks", Asks()) if controller is not None else Asks()


class PrefillHook:
    """Base of prefill hooks (the protocol: the module docstring). A hook defines `draft_prompt`; `asks` defaults
    to no forward options, `prepare` to the hook as it is, `draft_len` to the drafter's cache as long as the
    target's."""

    def asks(self, tokens, lengths, inputs) -> dict:
        return {}

    def draft_prompt(self, prefill, prompt):
        raise NotImplementedError(f"{type(self).__name__} defines no `draft_prompt`")

    def prepare(self, setup, prepared) -> "PrefillHook":
        return self

    def draft_len(self, max_len: int) -> int:
        return max_len

    def info(self, prefill) -> dict:
        """Per-row facts of what the hook did, name -> [B, ...] arrays, put into `out.stats` (in program)."""
        return {}


class Needs(NamedTuple):
    """What a speculative strategy's programs compute beyond the basics, worked out once from its parts
    (`Speculative.needs`): the engine, the plan and the drafters read it instead of asking each part."""

    asks: Asks  # what the controller reads from each step (`Record` fields, per-node top-k)
    draws: bool  # the rule draws children from the draft distribution when sampling (drafts record it)
    hidden: bool  # the verify forward returns the target's last hidden states (read by the controller or drafter)
    prefill_hidden: bool  # the target's prefill keeps its last hidden states (the controller starts from them)
    stops: bool  # the controller may end a row's draft after any level (`Controller.stop`)
    depth: int  # the plan's deepest level
    scratch: int  # the plan's scratch slots past the committed tokens (drafters size per-step buffers by it)
    pending_width: int  # committed tokens a drafter may not have read at a step's start, `last` included
    per_step: int  # cache slots a step may use past the committed tokens: the scratch and the catch-up feed
    defer: int = 0  # rounds without drafts whose tokens a drafter may leave unread (the controller's `defers`)
