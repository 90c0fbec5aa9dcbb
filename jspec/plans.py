"""Tree plans: which nodes to draft each step, as device arrays padded to a static node budget.

A plan drives a drafter (`jspec.drafters`) level by level and returns a `Proposal`:
- `StaticPlan`: a layered tree (`trees.Layout` + parent / rank / valid per slot as data). A chain and an EAGLE-1
  path list are static plans; so is any per-row tree a controller hands over in its `Decision.tree` (a
  `LayeredTree` of [B, N] arrays), which replaces the plan's own tree for that step (SAGE-style planning).
  Trees of one layout share one compiled program.
- `DynamicPlan`: EAGLE-2's dynamic beam, reranked to a node budget per row inside `jit`.
Both honour a per-row depth limit (draft levels no row needs are skipped) and draw children without replacement
from the draft distribution when the rule asks for it (`draw`), recording that distribution per node.
`StaticPlan` also takes a controller's `stop(level, aux, limit) -> limit`, called after each drafted level with
the drafter's per-node outputs that drafted it: a row may end its draft there (EESD's Cali-TS). With
`verify_nodes` it drafts in its (wide) layout and hands the target only the valid nodes, packed in order into that
many slots (a planner whose trees hold at most `verify_nodes` nodes but whose level widths vary: SAGE).
A plan picks the target's verify width per step (`verify_size`): the smallest of a few static widths that holds
every row's tree, so one program serves them all.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec import rowkeys as RK
from jspec.trees import Layout, StaticTree, TreeArrays, layered_arrays, tree_from_pool


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
    decision: Any = None  # the controller's Decision this proposal followed
    limit: jax.Array | None = None  # [B] the depth limit each row drafted to (after any controller stop)
    node_topk: jax.Array | None = None  # [B, N, k] the k largest draft probabilities at each node, when asked
    node_known: jax.Array | None = None  # [B, N] bool: node_topk exists there (the node's level was drafted)


class LayeredTree(NamedTuple):
    """Per-row trees over a plan's layout: parent, rank [B, N] int32 and valid [B, N] bool (see `trees.Layout`)."""

    parent: jax.Array
    rank: jax.Array
    valid: jax.Array


def _fed_levels(fed: jax.Array, start: int, slots, run) -> jax.Array:
    """`fed` with nodes start.. marked as fed at `slots` when the level's forward ran (`run` None: always)."""
    slots = jnp.asarray(slots, jnp.int32)
    if run is not None:
        slots = jnp.where(run, slots, -1)
    return fed.at[:, start:start + slots.shape[-1]].set(jnp.broadcast_to(slots, (fed.shape[0], slots.shape[-1])))


def _padded(out, n: int):
    """A drafter level's (logp, aux, state) over its first w slots, per-node outputs zero-padded to n slots."""
    logp, aux, ds = out
    pad = lambda x: jnp.pad(x, ((0, 0), (0, n - x.shape[1])) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
    return pad(logp), jax.tree.map(pad, aux), ds


def _gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, K, ...] rows idx [B, J] -> [B, J, ...]."""
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


@struct.dataclass
class StaticPlan:
    """A layered tree per step: the plan's own (`parent`, `rank`, `valid` host arrays: data, not compile-time
    constants) or the controller's per-row `Decision.tree`."""

    parent: Any  # [N]
    rank: Any  # [N]
    valid: Any  # [N]
    ancestor: Any  # [N, N]
    children: Any  # [N, M]
    layout: Layout = struct.field(pytree_node=False)
    verify_nodes: int = struct.field(pytree_node=False, default=0)  # > 0: pack the valid nodes into this many
    level_buckets: bool = struct.field(pytree_node=False, default=False)  # draft only a level's used prefix
    trim: bool = struct.field(pytree_node=False, default=False)  # verify only as deep as some row drafted

    def level_widths(self, n: int) -> tuple[int, ...]:
        """The widths a level of n slots may be drafted at: n alone, or with `level_buckets` 4, 8, 16, ... below n
        too (per-row trees that use a prefix of each level's slots, as SAGE's planner lays them out)."""
        if not self.level_buckets:
            return (n,)
        return tuple(sorted({w for w in (2 ** i for i in range(2, n.bit_length())) if w < n} | {n}))

    @classmethod
    def of(cls, tree: StaticTree, verify_nodes: int = 0, level_buckets: bool = False,
           trim: bool = False) -> "StaticPlan":
        if verify_nodes and not tree.valid.sum() <= verify_nodes <= tree.layout.num_nodes:
            raise ValueError(f"verify_nodes={verify_nodes} must hold the plan's own tree ({int(tree.valid.sum())} "
                             f"nodes with the root) and fit its layout ({tree.layout.num_nodes} slots)")
        return cls(tree.parent, tree.rank, tree.valid, tree.ancestor, tree.children, tree.layout, int(verify_nodes),
                   bool(level_buckets), bool(trim))

    num_nodes = property(lambda self: self.layout.num_nodes)
    max_depth = property(lambda self: self.layout.max_depth)
    is_chain = property(lambda self: self.layout.is_chain)
    scratch = property(lambda self: self.layout.num_nodes)  # target: the tree; draft: its levels
    pending_width = 2  # the deepest accepted node when unfed (every other accepted node was fed) and the bonus

    def check(self, rule) -> None:
        pass

    @property
    def verify_buckets(self) -> tuple[tuple[int, int], ...]:
        """(depth, nodes) pairs: the first `nodes` nodes (BFS order) hold every node of depth <= `depth`. Depths 1,
        2, 4, 8, ... and the deepest (and 0, the root alone, with `trim`): under a controller's depth limit the target
        verifies the smallest bucket that covers every row's limit, not the whole budget."""
        D = self.layout.max_depth
        depths = {d for d in (2 ** i for i in range(D.bit_length())) if d < D} | {D} | ({0} if self.trim else set())
        depths = sorted(depths)
        return tuple((d, self.layout.levels[d][1]) for d in depths)

    @property
    def packed_sizes(self) -> tuple[int, ...]:
        """Verify widths of a packing plan: 9, 17, 33, ... (a power of two drafts + the root) up to `verify_nodes`."""
        n = self.verify_nodes
        return tuple(sorted({s for s in (2 ** i + 1 for i in range(3, n.bit_length())) if s < n} | {n}))

    def verify_size(self, prop: Proposal, done: jax.Array) -> tuple[tuple[int, ...], jax.Array | None]:
        """(static widths, index of the one to verify this step, or None for the whole proposal): a packing plan
        takes the smallest width that holds every decoding row's nodes; a layered one the smallest depth bucket that
        covers every row's depth limit, or with `trim` every row's deepest valid node (a drafter that often drafts
        less than the tree, such as prompt lookup, then verifies only what it drafted)."""
        if self.verify_nodes:
            need = jnp.max(jnp.where(done, 1, jnp.sum(prop.valid, axis=1)))
            sizes = self.packed_sizes
        else:
            if self.trim:
                need = jnp.max(jnp.where(done, 0, jnp.max(jnp.where(prop.valid, prop.tree.depth, 0), axis=1)))
            elif prop.decision is None or prop.decision.depth is None:
                return (), None
            else:
                need = jnp.max(jnp.where(done, 1, prop.decision.depth))
            depths = jnp.asarray([d for d, _ in self.verify_buckets])
            sizes = tuple(n for _, n in self.verify_buckets)
            return sizes, jnp.argmax(depths >= need)
        return sizes, jnp.argmax(jnp.asarray(sizes) >= need)

    def _tree(self, B: int, decision):
        if decision is not None and decision.tree is not None:
            t = decision.tree
            valid, arrays = layered_arrays(t.parent.astype(jnp.int32), t.rank.astype(jnp.int32), t.valid,
                                           self.layout)
            return valid, arrays, arrays.parent, t.rank.astype(jnp.int32)
        b = lambda a: jnp.broadcast_to(jnp.asarray(a), (B,) + jnp.shape(a))
        depth = np.concatenate([np.full(e - s, d, np.int32) for d, (s, e) in enumerate(self.layout.levels)])
        arrays = TreeArrays(b(self.parent), b(depth), b(self.ancestor), b(self.children))
        return b(self.valid), arrays, arrays.parent, b(self.rank)

    stops = True  # takes a controller's per-level `stop`
    node_outputs = True  # can hand each node's top-k draft probabilities to the controller (`Asks.node_topk`)

    def propose(self, env, drafter, ds, key, limit, draw: bool, want_q: bool, want_aux: bool, stop=None,
                topk: int = 0):
        layout = self.layout
        B = env.last.shape[0]
        N, D = layout.num_nodes, layout.max_depth
        if stop is not None and limit is None:
            limit = jnp.full((B,), D, jnp.int32)
        sample = draw and not env.ctx.sampling.greedy
        valid, t, parent, rank = self._tree(B, env.decision)
        logp, aux, ds = drafter.root(env, ds)
        root_logp = logp[:, 0]
        tokens = jnp.zeros((B, N), jnp.int32).at[:, 0].set(env.last)
        V = logp.shape[-1]
        q_all = jnp.zeros((B, N, V), jnp.float32) if (sample or want_q) else None
        aux_all = None
        top_all = jnp.zeros((B, N, topk), jnp.float32) if topk else None
        fed = jnp.full((B, N), -1, jnp.int32)
        keys = RK.split(key, D)
        for d in range(D):
            (s, e), (cs, ce) = layout.levels[d], layout.levels[d + 1]
            m = layout.children[d]
            if q_all is not None:
                q_all = q_all.at[:, s:e].set(jnp.exp(logp))
            if topk:
                top_all = top_all.at[:, s:e].set(jax.lax.top_k(jnp.exp(logp), topk)[0])
            if want_aux and aux is not None:
                if aux_all is None:
                    aux_all = jax.tree.map(lambda a: jnp.zeros((B, N) + a.shape[2:], a.dtype), aux)
                aux_all = jax.tree.map(lambda acc, a: acc.at[:, s:e].set(a), aux_all, aux)
            choice_logp = logp + RK.gumbel(keys[:, d], logp.shape[1:]) if sample else logp
            choice = jax.lax.top_k(choice_logp, m)[1].astype(jnp.int32)  # [B, e - s, m]
            par = jnp.clip(parent[:, cs:ce] - s, 0, e - s - 1)
            rk = jnp.clip(rank[:, cs:ce], 0, m - 1)
            kids = jnp.take_along_axis(choice.reshape(B, (e - s) * m), par * m + rk, axis=1)  # [B, ce - cs]
            tokens = tokens.at[:, cs:ce].set(kids)
            lk = jnp.take_along_axis(_gather_rows(logp, par), kids[..., None], axis=-1)[..., 0]
            ok = jnp.isfinite(lk) if limit is None else jnp.isfinite(lk) & (d + 1 <= limit[:, None])
            valid = valid.at[:, cs:ce].set(valid[:, cs:ce] & ok)
            if stop is not None and d + 1 < D:  # `aux`: the level-d nodes' outputs that drafted level d + 1
                limit = stop(d + 1, aux, limit)
            if d + 1 < D:
                # level d+1 nodes: node i sits in scratch slot i - 1 (the root is committed)
                mask = t.ancestor[:, cs:ce, 1:ce]
                run = None if limit is None else jnp.any(limit >= d + 2)
                depth = jnp.full((B, ce - cs), d + 1, jnp.int32)
                slots = np.arange(cs - 1, ce - 1)
                widths = self.level_widths(ce - cs)
                if len(widths) == 1:
                    logp, aux, ds = drafter.level(env, ds, kids, depth, mask, cs - 1, run)
                else:  # feed only the level's first w slots, w the smallest width past every row's last valid node
                    last = jnp.max(jnp.where(valid[:, cs:ce], jnp.arange(1, ce - cs + 1)[None], 0))
                    pick = jnp.argmax(jnp.asarray(widths) >= last)
                    branch = lambda w: lambda ds: _padded(  # noqa: E731
                        drafter.level(env, ds, kids[:, :w], depth[:, :w], mask[:, :w, :cs - 1 + w], cs - 1, run),
                        ce - cs)
                    logp, aux, ds = jax.lax.switch(pick, [branch(w) for w in widths], ds)
                    slots = jnp.where(jnp.arange(ce - cs) < jnp.asarray(widths)[pick], slots, -1)
                fed = _fed_levels(fed, cs, slots, run)
        valid = jnp.all(valid[:, None, :] | ~t.ancestor, axis=-1)  # a node is usable only if its whole path is
        known = (t.depth < D) & valid if q_all is not None else None
        node_known = None
        if topk:
            node_known = valid & (t.depth < (D if limit is None else limit[:, None]))
        prop = Proposal(tokens, valid, t, q_all, fed, root_logp, aux_all, known, limit=limit, node_topk=top_all,
                        node_known=node_known)
        return (pack(prop, self.verify_nodes) if self.verify_nodes else prop), ds


def pack(prop: Proposal, n: int) -> Proposal:
    """The proposal's valid nodes moved, in node order, into its first `n` slots (a row with more keeps its first
    `n`: parents come before children, so the kept nodes stay a tree); the slots after them are unusable padding.
    Parent, children and ancestor ids are renumbered; per-node arrays move with their nodes."""
    B, N = prop.tokens.shape
    rows = jnp.arange(B)[:, None]
    order = jnp.argsort(~prop.valid, axis=1, stable=True)[:, :n].astype(jnp.int32)  # valid slots first
    keep = jnp.arange(n)[None] < jnp.sum(prop.valid, axis=1, keepdims=True)
    new_id = jnp.full((B, N), -1, jnp.int32).at[rows, order].set(
        jnp.where(keep, jnp.arange(n, dtype=jnp.int32)[None], -1))
    renumber = lambda ids: jnp.where(ids >= 0, jnp.take_along_axis(  # noqa: E731
        new_id, jnp.maximum(ids, 0).reshape(B, -1), axis=1).reshape(ids.shape), -1)
    g = lambda x: None if x is None else _gather_rows(x, order)  # noqa: E731
    t = prop.tree
    parent = jnp.where(keep, renumber(g(t.parent)), -1)
    anc = jnp.take_along_axis(g(t.ancestor), order[:, None, :], axis=2) & keep[:, None, :] & keep[:, :, None]
    anc = anc | jnp.eye(n, dtype=bool)[None]
    children = jnp.where(keep[:, :, None], renumber(g(t.children)), -1)
    tree = TreeArrays(parent, g(t.depth), anc, children)
    return prop._replace(tokens=g(prop.tokens), valid=keep, tree=tree, q=g(prop.q), fed=g(prop.fed),
                         aux=jax.tree.map(g, prop.aux), known=None if prop.known is None else g(prop.known) & keep,
                         node_topk=g(prop.node_topk),
                         node_known=None if prop.node_known is None else g(prop.node_known) & keep)


@struct.dataclass
class DynamicPlan:
    """EAGLE-2's dynamic tree, per row inside `jit`.

    Level 1 = the root's top_k draft tokens. Each later level expands the `top_k` best nodes of the level above
    (the beam, by cumulative draft log-prob) into top_k children each, one draft forward per level. All
    candidates are then reranked by cumulative log-prob and the best `total` become the tree (parents before
    children). `depth` is the deepest draft level (depth - 1 draft forwards after the root's). Its shape depends
    on the drafted tokens, so only rules that accept whatever tokens are offered (`Q1`) keep it exact.
    """

    depth: int = struct.field(pytree_node=False)
    top_k: int = struct.field(pytree_node=False)
    total: int = struct.field(pytree_node=False)

    num_nodes = property(lambda self: self.total + 1)
    max_depth = property(lambda self: self.depth)
    is_chain = False
    pending_width = 2  # as for static trees: only beam nodes get children, and the draft fed every beam node
    stops = False
    node_outputs = False

    @property
    def scratch(self) -> int:
        return max(self.total + 1, (self.depth - 1) * self.top_k)  # target: the tree; draft: the beam levels

    @property
    def pool_size(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k ** 2

    def check(self, rule) -> None:
        if rule.draws:
            raise ValueError(f"DynamicTree supports rule='q1' only (got {type(rule).__name__}): a rule that draws "
                             "children without replacement is not lossless when the kept candidates depend on their "
                             "own draft probabilities")

    def verify_size(self, prop: Proposal, done: jax.Array):
        return (), None

    def propose(self, env, drafter, ds, key, limit, draw: bool, want_q: bool, want_aux: bool, stop=None,
                topk: int = 0):
        if stop is not None:
            raise ValueError("DynamicTree takes no per-level stop (its levels are a beam, not one row's path)")
        if topk:
            raise ValueError("DynamicTree keeps no per-node draft distributions (a controller asked for node_topk)")
        B = env.last.shape[0]
        K, D = self.top_k, self.depth
        logp, _, ds = drafter.root(env, ds)
        root_logp = logp[:, 0]
        score, tok = jax.lax.top_k(root_logp, K)  # [B, K]
        pool_tok, pool_score = [tok], [score]
        pool_parent = [jnp.full((B, K), -1, jnp.int32)]
        pool_depth = [jnp.ones((B, K), jnp.int32)]
        beam_tok, beam_score, beam_pool = tok, score, jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K))
        pool_fed = jnp.full((B, self.pool_size), -1, jnp.int32)  # pool node -> its draft scratch slot
        slots = (D - 1) * K  # beam nodes of level l sit in scratch slots (l-1)K .. lK-1
        beam_anc = jnp.zeros((B, max(slots, 1), max(slots, 1)), bool)
        beam_anc = beam_anc.at[:, jnp.arange(min(K, slots)), jnp.arange(min(K, slots))].set(True)
        for lvl in range(1, D):
            a, b = (lvl - 1) * K, lvl * K
            run = None if limit is None else jnp.any(limit >= lvl + 1)
            depth = jnp.full((B, K), lvl, jnp.int32)
            logp, _, ds = drafter.level(env, ds, beam_tok, depth, beam_anc[:, a:b, :b], a, run)
            slot = jnp.broadcast_to(jnp.arange(a, b, dtype=jnp.int32), (B, K))
            slot = slot if run is None else jnp.where(run, slot, -1)
            pool_fed = pool_fed.at[jnp.arange(B)[:, None], beam_pool].set(slot)
            cs, ct = jax.lax.top_k(logp, K)  # [B, K, K]
            cand_score = (beam_score[:, :, None] + cs).reshape(B, K * K)
            cand_tok = ct.reshape(B, K * K).astype(jnp.int32)
            start = K + (lvl - 1) * K * K
            pool_tok.append(cand_tok)
            pool_score.append(cand_score)
            pool_parent.append(jnp.repeat(beam_pool, K, axis=1))
            pool_depth.append(jnp.full((B, K * K), lvl + 1, jnp.int32))
            if lvl + 1 < D:
                beam_score, pick = jax.lax.top_k(cand_score, K)
                beam_tok = jnp.take_along_axis(cand_tok, pick, axis=1)
                beam_pool = (start + pick).astype(jnp.int32)
                parent_slot = a + pick // K
                new_rows = jnp.take_along_axis(beam_anc, parent_slot[:, :, None], axis=1)  # [B, K, slots]
                new_rows = new_rows | jax.nn.one_hot(b + jnp.arange(K), slots, dtype=bool)[None]
                beam_anc = beam_anc.at[:, b:b + K].set(new_rows)
        pool_score = jnp.concatenate(pool_score, axis=1)
        pool_depth = jnp.concatenate(pool_depth, axis=1)
        if limit is not None:
            pool_score = jnp.where(pool_depth > limit[:, None], -jnp.inf, pool_score)
        sel, valid, tree = tree_from_pool(jnp.concatenate(pool_parent, axis=1), pool_depth, pool_score,
                                          self.total, D, K)
        kids = jnp.take_along_axis(jnp.concatenate(pool_tok, axis=1), sel, axis=1)
        tokens = jnp.concatenate([env.last[:, None].astype(jnp.int32), kids], axis=1)
        fed = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), jnp.take_along_axis(pool_fed, sel, axis=1)], axis=1)
        q, known = None, None
        if want_q:  # the root's distribution (the reranked nodes' own distributions are not kept)
            q = jnp.zeros((B, self.total + 1, root_logp.shape[-1]), jnp.float32).at[:, 0].set(jnp.exp(root_logp))
            known = jnp.zeros((B, self.total + 1), bool).at[:, 0].set(True)
        return Proposal(tokens, valid, tree, q, fed, root_logp, None, known), ds
