"""Drafters: who proposes tokens, and with which distribution.

A drafter is a pytree object (its models' params and any numbers are leaves). The engine calls it on the host
once per decode (`check`, `prepare`) and on the device inside the jitted step:

- `check(target)`: raise ValueError before any compute (e.g. a vocabulary that differs from the target's).
- `map_models(fn)`: the drafter with `fn` applied to every model it runs (placement on a mesh, image mode).
- `prepare(setup: Setup) -> Prepared`: the drafter as it will run (guided, replicated) and its prompt, a pytree
  of host or device arrays handed to `init` inside the prefill program, with the cache extent it needs.
- optional `prefill_asks(tokens, lengths, inputs) -> dict`: forward options for the target's prefill whose
  by-products `init` reads (e.g. `{"hidden_layers": (N,)}`: an early-exit drafter's prompt states at layer N).
- `init(env, prefill: TargetPrefill, prompt, max_len) -> state`: prefill; `prefill` holds the target prefill's
  by-products (logits, requested hidden states and attention, its cache).
- `root(env, state) -> (logp [B, 1, V], aux, state)`: the distribution after the newest committed token
  (`env.last`), after reading whatever committed tokens the drafter has not seen.
- `level(env, state, tokens [B, K], depth [B, K], mask [B, K, S], offset, run) -> (logp [B, K, V], aux, state)`:
  one tree level: K new nodes at `depth` below the root (the drafter places them at its own positions), written
  at scratch offsets offset.. past the committed tokens, each seeing the committed tokens and the scratch slots
  its `mask` row allows (S >= offset + K; nothing past offset + K is set); `run` (a traced bool or None) lets a
  level no row needs be skipped. `offset` is traced (a plan drafts its levels in a loop), and a level may carry
  padding nodes past the tree's: they may write scratch slots up to the plan's `scratch`, which later levels
  overwrite and no node reads.
- `commit(env, state, catchup: Catchup) -> state`: the state after verification accepted a path; the committed
  tokens are the path's (`catchup.prop.tokens` along `catchup.path`, root first), so a drafter that reads the
  generated text keeps it from here (`jspec.parts.drafters.ngram`, prompt lookup).
- optional class attribute `borrows_cache = True`, with `lend(state, cache) -> state` and `give_back(state) ->
  (state, cache)`: the drafter drafts in the target's own cache (layer skipping, `layer_skip.SkipDrafter`). It
  is lent for the draft only and may be written past the committed length only, where the verify writes next.
- optional class attribute `verify_logits = True`: the drafter reads the target's logits after every node of the
  proposal from verification (`Catchup.logits` [B, N, V], as the rule read them: guided and constrained where the
  target is), not only along the accepted path: a Jacobi window takes its next drafts from them
  (`jspec.parts.drafters.jacobi`), so a round needs no forward besides the verify.
- optional `window(env, state, key) -> (tokens [B, G], q [B, G, V], state)`: a drafter that draws a whole chain
  itself, with the distribution each token was drawn from, for `jspec.parts.plans.WindowPlan` (which calls no
  `root` or `level`).
- optional class attribute `verify_hidden = True`: the drafter reads the target's hidden states at the accepted
  path's nodes from verification (`Catchup.hidden`): the last layer's (an EAGLE-1 feature head), or those of the
  layers `verify_layers(num_layers)` names, concatenated (an EAGLE-3 head's low, middle and high layers).

logp is the log of the distribution the plan ranks and draws children from (the sampler's processed distribution
when sampling, the plain softmax when greedy); aux is a per-node pytree [B, K, ...] of the drafter's own
(e.g. per-view probabilities of a multi-view drafter, for its controller) or None.
`env` is a `DraftEnv`: the static step context, sampling params, the target (as run), its cache at the step's
start (read only: a drafter that writes it borrows it), the controller's decision for this step, the tokens
generated so far (`out`, `n_out`) and the strategy's `Needs` (`needs`: the plan's depth and scratch, to size buffers at `init`; what the controller asks).
A drafter subclasses `Drafter` (`jspec.parts.protocols`), whose optional hooks (`check`, `map_models`,
`prefill_asks`, `verify_hidden`, `verify_layers`) do nothing by default. A drafter that reads the committed text
into a cache of its own subclasses `FeedDrafter` (`jspec.parts.drafters.feed`), which implements `init`, `root`,
`catch_up` and `commit` over its model's `read_prompt` and `forward`.
"""
from jspec.parts.protocols import Catchup, DraftEnv, Drafter, Prepared, Setup, TargetPrefill
from jspec.parts.drafters.feed import FeedDrafter, FeedState
from jspec.parts.drafters.model import ModelDrafter

__all__ = ["Catchup", "DraftEnv", "Drafter", "FeedDrafter", "FeedState", "ModelDrafter", "Prepared", "Setup",
           "TargetPrefill"]
