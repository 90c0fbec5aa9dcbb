"""Tree plans: which nodes to draft each step, as device arrays padded to a static node budget.

A plan drives a drafter (`jspec.parts.drafters`) level by level and returns a `Proposal`:
- `StaticPlan`: a layered tree (`trees.Layout` + parent / rank / valid per slot as data). A chain and an EAGLE-1
  path list are static plans; so is any per-row tree a controller hands over in its `Decision.tree` (a
  `LayeredTree` of [B, N] arrays), which replaces the plan's own tree for that step (SAGE-style planning).
  Trees of one layout share one compiled program.
- `DynamicPlan`: EAGLE-2's dynamic beam, reranked to a node budget per row inside `jit`.
Both honour a per-row depth limit (draft levels no row needs are skipped) and draw children without replacement
from the draft distribution when the rule asks for it (`Needs.draws`), recording that distribution per node.
`StaticPlan` also takes a controller's `stop(level, aux, limit) -> limit`, called after each drafted level with
the drafter's per-node outputs that drafted it: a row may end its draft there (EESD's Cali-TS). With
`verify_nodes` it drafts in its (wide) layout and hands the target only the valid nodes, packed in order into that
many slots (a planner whose trees hold at most `verify_nodes` nodes but whose level widths vary: SAGE).
A plan picks the target's verify width per step (`verify_size`): the smallest of a few static widths that holds
every row's tree, so one program serves them all.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.core import rowkeys as RK
from jspec.core.sampling import largest
from jspec.parts.protocols import Plan, Proposal
from jspec.parts.trees import Layout, StaticTree, TreeArrays, cached_tree, chain, layered_arrays, tree_from_pool


def _padded(out, n: int):
    """A drafter level's (logp, aux, state) over its first w slots, per-node outputs zero-padded to n slots."""
    logp, aux, ds = out
    pad = lambda x: jnp.pad(x, ((0, 0), (0, n - x.shape[1])) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
    return pad(logp), jax.tree.map(pad, aux), ds


def _gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, K, ...] rows idx [B, J] -> [B, J, ...]."""
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


@struct.dataclass
class StaticPlan(Plan):
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

    @classmethod
    def from_paths(cls, tree, layout: Layout | None = None, **kw) -> "StaticPlan":
        """The plan of a tree given by name or child-rank paths (built once per tree and layout), padded to
        `layout` when given; `kw` as `of` takes them."""
        return cls.of(cached_tree(tree, layout), **kw)

    num_nodes = property(lambda self: self.layout.num_nodes)
    max_depth = property(lambda self: self.layout.max_depth)
    is_chain = property(lambda self: self.layout.is_chain)
    pending_width = 2  # the deepest accepted node when unfed (every other accepted node was fed) and the bonus

    @property
    def verify_buckets(self) -> tuple[tuple[int, int], ...]:
        """(depth, nodes) pairs: the first `nodes` nodes (BFS order) hold every node of depth <= `depth`. Depths 2,
        8, 32, ... (a factor of 4 apart: each is one more target forward in the program) and the deepest (and 0, the
        root alone, with `trim`): under a controller's depth limit the target verifies the smallest bucket that
        covers every row's limit, not the whole budget."""
        D = self.layout.max_depth
        depths = {d for d in (2 * 4 ** i for i in range(D.bit_length())) if d < D} | {D} | ({0} if self.trim else set())
        depths = sorted(depths)
        return tuple((d, self.layout.levels[d][1]) for d in depths)

    @property
    def packed_sizes(self) -> tuple[int, ...]:
        """Verify widths of a packing plan: 9 and 17 (8 and 16 drafts + the root) below `verify_nodes`, and
        `verify_nodes`. Each width is one target forward in the program. In SAGE's 13-question Spec-Bench run on
        SmolLM2, 2 of 1,496 planned trees held more than 16 drafts (besides each decode's first round, the
        25-draft initial tree), so a width of 33 bought nothing and cost 14% of SAGE's program; without the 17
        its zoo decode ran 19% slower."""
        n = self.verify_nodes
        return tuple(sorted({s for s in (9, 17) if s < n} | {n}))

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

    def with_skips(self) -> "StaticPlan":
        """Verify only as deep as some row drafted (`trim`): a step where no row drafts verifies the root alone."""
        return self.replace(trim=True)

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

    @property
    def window(self) -> int:
        """The width every level is drafted at inside the level scan: the widest level's."""
        return max(self.layout.widths)

    @property
    def scratch(self) -> int:
        """Scratch slots: the tree's nodes (target) and every level's window (draft): a level of w < `window` slots
        at offset o writes `window` slots from o, past the tree's end for the last levels."""
        fed = self.layout.levels[1:self.max_depth]  # levels 1 .. D - 1 are drafted (the deepest is not)
        return max([self.layout.num_nodes] + [s - 1 + self.window for s, _ in fed])

    def propose(self, env, drafter, ds, key, decision):
        """Drafts the tree level by level in one `lax.scan` (its body compiled once, whatever the depth): level d
        is drafted in a window of `window` slots at its first slot, the slots past its width are padding that
        the next level's window overwrites and that no node reads; per-node arrays carry `window` slots of
        padding at the end."""
        layout = self.layout
        B = env.last.shape[0]
        N, D, W = layout.num_nodes, layout.max_depth, self.window
        M = layout.max_children
        limit, stop, asks = decision.depth, env.stop, env.needs.asks
        want_q, want_aux, topk = asks.draft_probs, asks.draft_aux, asks.node_topk
        if stop is not None and limit is None:
            limit = jnp.full((B,), D, jnp.int32)
        sample = env.needs.draws and not env.ctx.sampling.greedy
        valid, t, parent, rank = self._tree(B, decision)
        logp, aux, ds = drafter.root(env, ds)
        root_logp = logp[:, 0]
        V = logp.shape[-1]
        NP, SM = N + W, self.scratch  # padded node count; the draft's scratch slots a level's mask covers
        pad = lambda x, fill=0: jnp.pad(x, ((0, 0), (0, NP - x.shape[1])) + ((0, 0),) * (x.ndim - 2),  # noqa: E731
                                        constant_values=fill)
        # per level d: its first slot, its width, its children per node; the next level's first slot and width
        starts = np.array([s for s, _ in layout.levels], np.int32)
        widths = np.array([e - s for s, e in layout.levels], np.int32)
        level_of = lambda a, d: jnp.asarray(a)[d]  # noqa: E731
        keys = RK.split(key, D)
        noise = None
        if sample:  # drawn level by level at the level's own width, as an unscanned draft would
            noise = pad(jnp.concatenate([RK.gumbel(keys[:, d], (int(widths[d]), V)) for d in range(D)], axis=1))
        anc = jnp.pad(t.ancestor, ((0, 0), (0, NP - N), (0, NP - N)))
        par_all, rank_all = pad(parent), pad(rank)
        win = lambda x, at: jax.lax.dynamic_slice_in_dim(x, at, W, axis=1)  # noqa: E731
        put = lambda x, at, v: jax.lax.dynamic_update_slice_in_dim(x, v.astype(x.dtype), at, axis=1)  # noqa: E731

        def blend(x, at, v, n):
            """x with its window at `at` replaced by v on the first n slots (the level's own)."""
            inside = (jnp.arange(W) < n).reshape((1, W) + (1,) * (x.ndim - 2))
            return put(x, at, jnp.where(inside, v, win(x, at)))

        def expand(d, logp, aux, c):
            """Level d's nodes (their distribution logp [B, W, V]) recorded; the next level's tokens chosen."""
            s, w, cs, cw = level_of(starts, d), level_of(widths, d), level_of(starts, d + 1), level_of(widths, d + 1)
            m = jnp.asarray(layout.children)[d]
            if c["q"] is not None:
                c["q"] = blend(c["q"], s, jnp.exp(logp), w)
            if topk:
                c["top"] = blend(c["top"], s, largest(jnp.exp(logp), topk)[0], w)
            if c["aux"] is not None:
                c["aux"] = jax.tree.map(lambda acc, a: blend(acc, s, a, w), c["aux"], aux)
            choice_logp = logp + win(noise, s) if sample else logp
            choice = largest(choice_logp, M)[1].astype(jnp.int32)  # [B, W, M]: a prefix holds the top m
            par = jnp.clip(win(par_all, cs) - s, 0, w - 1)
            rk = jnp.clip(win(rank_all, cs), 0, m - 1)
            kids = jnp.take_along_axis(choice.reshape(B, W * M), par * M + rk, axis=1)  # [B, W]
            c["tokens"] = blend(c["tokens"], cs, kids, cw)
            lk = jnp.take_along_axis(_gather_rows(logp, par), kids[..., None], axis=-1)[..., 0]
            ok = jnp.isfinite(lk) if c["limit"] is None else jnp.isfinite(lk) & (d + 1 <= c["limit"][:, None])
            c["valid"] = blend(c["valid"], cs, win(c["valid"], cs) & ok, cw)
            return c, kids

        def feed(d, kids, ds, c):
            """Level d + 1 drafted (its nodes sit in scratch slots one before their node ids: the root is
            committed); returns its (logp, aux), the drafter state and the carry."""
            cs, cw = level_of(starts, d + 1), level_of(widths, d + 1)
            lim = c["limit"]
            run = None if lim is None else jnp.any(lim >= d + 2)
            mask = jax.lax.dynamic_slice_in_dim(win(anc, cs), 1, SM, axis=2)  # [B, W, SM]
            depth = jnp.full((B, W), d + 1, jnp.int32)
            slot = cs - 1 + jnp.arange(W, dtype=jnp.int32)
            sizes = self.level_widths(W)
            if len(sizes) == 1:
                logp, aux, ds = drafter.level(env, ds, kids, depth, mask, cs - 1, run)
                used = cw
            else:  # feed only the window's first w slots, w the smallest width past every row's last valid node
                last = jnp.max(jnp.where(win(c["valid"], cs) & (jnp.arange(W) < cw)[None],
                                         jnp.arange(1, W + 1)[None], 0))
                pick = jnp.argmax(jnp.asarray(sizes) >= last)
                branch = lambda n: lambda ds: _padded(  # noqa: E731
                    drafter.level(env, ds, kids[:, :n], depth[:, :n], mask[:, :n], cs - 1, run), W)
                logp, aux, ds = jax.lax.switch(pick, [branch(n) for n in sizes], ds)
                used = jnp.minimum(cw, jnp.asarray(sizes)[pick])
            slots = jnp.where(jnp.arange(W) < used, slot, -1)
            if run is not None:
                slots = jnp.where(run, slots, -1)
            c["fed"] = blend(c["fed"], cs, jnp.broadcast_to(slots, (B, W)), cw)
            return logp, aux, ds, c

        def widen(x):  # the root's [B, 1, ...] outputs as a level of W slots
            return jnp.pad(x, ((0, 0), (0, W - x.shape[1])) + ((0, 0),) * (x.ndim - 2))

        logp = widen(logp)
        aux = jax.tree.map(widen, aux)
        c = {"tokens": jnp.zeros((B, NP), jnp.int32).at[:, 0].set(env.last), "valid": pad(valid, False),
             "fed": jnp.full((B, NP), -1, jnp.int32), "limit": limit,
             "q": jnp.zeros((B, NP, V), jnp.float32) if (sample or want_q) else None,
             "top": jnp.zeros((B, NP, topk), jnp.float32) if topk else None,
             "aux": None if not (want_aux and aux is not None) else jax.tree.map(
                 lambda a: jnp.zeros((B, NP) + a.shape[2:], a.dtype), aux)}

        def body(carry, d):
            logp, aux, ds, c = carry
            c, kids = expand(d, logp, aux, c)
            if stop is not None:  # `aux`: the level-d nodes' outputs that drafted level d + 1
                c["limit"] = stop(d + 1, aux, c["limit"])
            logp, aux, ds, c = feed(d, kids, ds, c)
            return (logp, aux, ds, c), None

        if D > 1:
            (logp, aux, ds, c), _ = jax.lax.scan(body, (logp, aux, ds, c), jnp.arange(D - 1))
        c, _ = expand(D - 1, logp, aux, c)  # the deepest level: recorded, its children chosen, not drafted
        cut = lambda x: None if x is None else x[:, :N]  # noqa: E731
        valid = cut(c["valid"])
        limit = c["limit"]
        valid = jnp.all(valid[:, None, :] | ~t.ancestor, axis=-1)  # a node is usable only if its whole path is
        q_all, top_all = cut(c["q"]), cut(c["top"])
        known = (t.depth < D) & valid if q_all is not None else None
        node_known = None
        if topk:
            node_known = valid & (t.depth < (D if limit is None else limit[:, None]))
        decision = decision if limit is None else decision._replace(depth=limit)
        prop = Proposal(cut(c["tokens"]), valid, t, q_all, cut(c["fed"]), root_logp, jax.tree.map(cut, c["aux"]),
                        known, decision, node_topk=top_all, node_known=node_known)
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


def root_or_whole(bare: bool, prop: Proposal, done: jax.Array, width: int):
    """`Plan.verify_size` of a plan that verifies its whole `width` or, with `bare` (`with_skips`), the root alone
    when no decoding row drafted."""
    if not bare:
        return (), None
    drafted = jnp.any(~done & jnp.any(prop.valid[:, 1:], axis=1))
    return (1, width), drafted.astype(jnp.int32)


@struct.dataclass
class DynamicPlan(Plan):
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
    bare: bool = struct.field(pytree_node=False, default=False)  # `with_skips`: a step may verify the root alone

    num_nodes = property(lambda self: self.total + 1)
    max_depth = property(lambda self: self.depth)
    is_chain = False
    pending_width = 2  # as for static trees: only beam nodes get children, and the draft fed every beam node

    @property
    def scratch(self) -> int:
        return max(self.total + 1, (self.depth - 1) * self.top_k)  # target: the tree; draft: the beam levels

    @property
    def pool_size(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k ** 2

    def with_skips(self) -> "DynamicPlan":
        return self.replace(bare=True)

    def verify_size(self, prop: Proposal, done: jax.Array) -> tuple[tuple[int, ...], jax.Array | None]:
        """With `bare`: the root alone when no decoding row drafted (every row at depth 0), else the whole tree."""
        return root_or_whole(self.bare, prop, done, self.total + 1)

    def check(self, rule) -> None:
        if rule.draws:
            raise ValueError(f"DynamicTree supports rule='q1' only (got {type(rule).__name__}): a rule that draws "
                             "children without replacement is not lossless when the kept candidates depend on their "
                             "own draft probabilities")

    def propose(self, env, drafter, ds, key, decision):
        limit, want_q = decision.depth, env.needs.asks.draft_probs
        if env.stop is not None:
            raise ValueError("DynamicTree takes no per-level stop (its levels are a beam, not one row's path)")
        if env.needs.asks.node_topk:
            raise ValueError("DynamicTree keeps no per-node draft distributions (a controller asked for node_topk)")
        B = env.last.shape[0]
        K, D = self.top_k, self.depth
        logp, _, ds = drafter.root(env, ds)
        root_logp = logp[:, 0]
        score, tok = largest(root_logp, K)  # [B, K]
        P = self.pool_size  # pool: the root's K children, then K * K candidates per later level
        put = lambda x, at, v: jax.lax.dynamic_update_slice_in_dim(x, v.astype(x.dtype), at, axis=1)  # noqa: E731
        pool = {"tok": jnp.zeros((B, P), jnp.int32).at[:, :K].set(tok),
                "score": jnp.zeros((B, P), root_logp.dtype).at[:, :K].set(score),
                "parent": jnp.full((B, P), -1, jnp.int32),
                "depth": jnp.ones((B, P), jnp.int32),
                "fed": jnp.full((B, P), -1, jnp.int32)}  # pool node -> its draft scratch slot
        slots = (D - 1) * K  # beam nodes of level l sit in scratch slots (l-1)K .. lK-1
        S = max(slots, 1)
        beam_anc = jnp.zeros((B, S + K, S), bool)  # K rows of padding: the deepest level's beam is never fed
        beam_anc = beam_anc.at[:, jnp.arange(min(K, slots)), jnp.arange(min(K, slots))].set(True)
        beam = (tok, score, jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32), (B, K)))

        def body(carry, lvl):  # level lvl's beam drafted; its K * K children scored; the next beam chosen
            (beam_tok, beam_score, beam_pool), beam_anc, pool, ds = carry
            a, b = (lvl - 1) * K, lvl * K
            run = None if limit is None else jnp.any(limit >= lvl + 1)
            depth = jnp.full((B, K), lvl, jnp.int32)
            mask = jax.lax.dynamic_slice_in_dim(beam_anc, a, K, axis=1)  # [B, K, S]
            logp, _, ds = drafter.level(env, ds, beam_tok, depth, mask, a, run)
            slot = jnp.broadcast_to(a + jnp.arange(K, dtype=jnp.int32), (B, K))
            slot = slot if run is None else jnp.where(run, slot, -1)
            pool = dict(pool, fed=pool["fed"].at[jnp.arange(B)[:, None], beam_pool].set(slot))
            cs, ct = largest(logp, K)  # [B, K, K]
            cand_score = (beam_score[:, :, None] + cs).reshape(B, K * K)
            cand_tok = ct.reshape(B, K * K).astype(jnp.int32)
            start = K + (lvl - 1) * K * K
            pool = dict(pool, tok=put(pool["tok"], start, cand_tok), score=put(pool["score"], start, cand_score),
                        parent=put(pool["parent"], start, jnp.repeat(beam_pool, K, axis=1)),
                        depth=put(pool["depth"], start, jnp.full((B, K * K), lvl + 1, jnp.int32)))
            beam_score, pick = jax.lax.top_k(cand_score, K)
            beam_tok = jnp.take_along_axis(cand_tok, pick, axis=1)
            beam_pool = (start + pick).astype(jnp.int32)
            parent_slot = a + pick // K
            new_rows = jnp.take_along_axis(beam_anc, parent_slot[:, :, None], axis=1)  # [B, K, S]
            new_rows = new_rows | (b + jnp.arange(K)[:, None] == jnp.arange(S)[None])[None]
            beam_anc = jax.lax.dynamic_update_slice_in_dim(beam_anc, new_rows, b, axis=1)
            return ((beam_tok, beam_score, beam_pool), beam_anc, pool, ds), None

        if D > 1:
            (_, _, pool, ds), _ = jax.lax.scan(body, (beam, beam_anc, pool, ds), jnp.arange(1, D))
        pool_score, pool_depth, pool_fed = pool["score"], pool["depth"], pool["fed"]
        if limit is not None:
            pool_score = jnp.where(pool_depth > limit[:, None], -jnp.inf, pool_score)
        sel, valid, tree = tree_from_pool(pool["parent"], pool_depth, pool_score, self.total, D, K)
        kids = jnp.take_along_axis(pool["tok"], sel, axis=1)
        tokens = jnp.concatenate([env.last[:, None].astype(jnp.int32), kids], axis=1)
        fed = jnp.concatenate([jnp.full((B, 1), -1, jnp.int32), jnp.take_along_axis(pool_fed, sel, axis=1)], axis=1)
        q, known = None, None
        if want_q:  # the root's distribution (the reranked nodes' own distributions are not kept)
            q = jnp.zeros((B, self.total + 1, root_logp.shape[-1]), jnp.float32).at[:, 0].set(jnp.exp(root_logp))
            known = jnp.zeros((B, self.total + 1), bool).at[:, 0].set(True)
        return Proposal(tokens, valid, tree, q, fed, root_logp, None, known, decision), ds


def best_paths(logp: jax.Array, top_k: int, total: int, limit: jax.Array | None = None):
    """DDTree's tree (`BlockTreePlan`): the `total` most probable paths under per-position log-distributions logp
    [B, G, V] (a path's score is the sum of its tokens' log-probs at their depths), over each position's `top_k`
    best tokens, no deeper than `limit` [B] (or None). Returns (tokens [B, total], valid [B, total + 1], tree),
    nodes 1 .. total best first by creation order (parents before children), node 0 the root."""
    B, G, _ = logp.shape
    K = top_k
    cand_score, cand_tok = largest(logp, K)  # [B, G, K]
    widths = [min(K, total)]
    for _ in range(1, G):
        widths.append(min(total, widths[-1] * K))
    if total > sum(widths):
        raise ValueError(f"a block tree of {total} nodes needs more candidates than {G} positions of top_k={K} give "
                         f"({sum(widths)})")
    toks, scores, parents, depths = [], [], [], []
    base = 0  # pool index of the previous level's first node
    for d, w in enumerate(widths):
        if d:  # every (kept node of level d - 1, candidate) pair scored; the w best kept
            pair = (scores[-1][:, :, None] + cand_score[:, d][:, None, :]).reshape(B, -1)
            score, pick = jax.lax.top_k(pair, w)
            tok = jnp.take_along_axis(cand_tok[:, d], pick % K, axis=1)
            parents.append((base + pick // K).astype(jnp.int32))
            base += widths[d - 1]
        else:
            score, tok = cand_score[:, 0, :w], cand_tok[:, 0, :w]
            parents.append(jnp.full((B, w), -1, jnp.int32))
        toks.append(tok.astype(jnp.int32))
        scores.append(score)
        depths.append(jnp.full((B, w), d + 1, jnp.int32))
    cat = lambda xs: jnp.concatenate(xs, axis=1)  # noqa: E731
    pool_score, pool_depth = cat(scores), cat(depths)
    if limit is not None:
        pool_score = jnp.where(pool_depth > limit[:, None], -jnp.inf, pool_score)
    sel, valid, tree = tree_from_pool(cat(parents), pool_depth, pool_score, total, G, K)
    return jnp.take_along_axis(cat(toks), sel, axis=1), valid, tree


@struct.dataclass
class BlockTreePlan(DynamicPlan):
    """DDTree (Ringel et al., arXiv 2604.12989) over a block drafter (`Drafter.block_size` > 0): the `total` most
    probable draft paths under the product of the drafter's per-position distributions, as one tree the target
    verifies in one forward.

    One block forward gives the distribution of each position 1 .. `depth` after the root given the committed text
    alone, so a node's score is the sum of its path's per-position log-probs, whatever its parent. Per position
    the `top_k` most probable tokens are candidates. Level 1 keeps them all (at most `total`); level d + 1 scores
    every (kept node of level d, candidate) pair and keeps the `total` best. A child never outscores its parent,
    so the `total` best nodes overall are among the kept ones and form a tree (`trees.tree_from_pool` takes them,
    parents before children). As for EAGLE-2's trees, the shape depends on the draft probabilities, so only the
    q = 1 rule keeps sampling exact (`check`). `depth` is at most the drafter's block_size - 1."""

    @property
    def scratch(self) -> int:
        return self.total + 1  # the target's tree; the drafter writes no scratch

    @property
    def pool_size(self) -> int:
        w = [min(self.top_k, self.total)]
        for _ in range(1, self.depth):
            w.append(min(self.total, w[-1] * self.top_k))
        return sum(w)

    def propose(self, env, drafter, ds, key, decision):
        if not drafter.block_size:
            raise ValueError(f"a block tree needs a block drafter; {type(drafter).__name__} drafts level by level")
        if env.stop is not None:
            raise ValueError("a block tree takes no per-level stop")
        if env.needs.asks.node_topk:
            raise ValueError("a block tree keeps no per-node draft distributions (a controller asked for node_topk)")
        logp, ds = drafter.block_logp(env, ds)  # [B, G, V]
        if logp.shape[1] < self.depth:
            raise ValueError(f"a block tree of depth {self.depth} needs a block of at least {self.depth + 1}; the "
                             f"drafter's is {logp.shape[1] + 1}")
        logp = logp[:, :self.depth]
        kids, valid, tree = best_paths(logp, self.top_k, self.total, decision.depth)
        B = env.last.shape[0]
        tokens = jnp.concatenate([env.last[:, None].astype(jnp.int32), kids], axis=1)
        fed = jnp.full((B, self.total + 1), -1, jnp.int32)
        q, known = None, None
        if env.needs.asks.draft_probs:  # each node's children come from its depth's distribution
            q = jnp.take_along_axis(jnp.exp(logp), jnp.minimum(tree.depth, self.depth - 1)[..., None], axis=1)
            known = valid & (tree.depth < self.depth)
        return Proposal(tokens, valid, tree, q, fed, logp[:, 0], None, known, decision), ds


@struct.dataclass
class WindowPlan(Plan):
    """A chain of `depth` drafts that the drafter draws itself, all at once (`Drafter.window`): Jacobi windows
    (`jspec.parts.drafters.jacobi`), whose tokens come from the drafter's own coupling of one round's draws with
    the next. The plan offers them as they are, with the distribution q each was drawn from (what `Residual`
    compares with), and a row's `decision.depth` (or None) cuts its chain. Nothing is fed to the drafter level by
    level: the target's verify forward over the chain is the only forward of a round."""

    depth: int = struct.field(pytree_node=False)
    bare: bool = struct.field(pytree_node=False, default=False)  # `with_skips`: a step may verify the root alone

    num_nodes = property(lambda self: self.depth + 1)
    max_depth = property(lambda self: self.depth)
    is_chain = True
    pending_width = 2

    @property
    def scratch(self) -> int:
        return self.depth + 1  # the target's chain; the drafter writes no scratch

    def with_skips(self) -> "WindowPlan":
        return self.replace(bare=True)

    def verify_size(self, prop: Proposal, done: jax.Array) -> tuple[tuple[int, ...], jax.Array | None]:
        """With `bare`: the root alone when no decoding row drafted, else the whole chain."""
        return root_or_whole(self.bare, prop, done, self.depth + 1)

    def propose(self, env, drafter, ds, key, decision):
        if env.stop is not None:
            raise ValueError("a window plan takes no per-level stop (its drafts are drawn at once)")
        if env.needs.asks.node_topk:
            raise ValueError("a window plan keeps no per-node top-k (a controller asked for node_topk)")
        B, D = env.last.shape[0], self.depth
        toks, q, ds = drafter.window(env, ds, key)
        if toks.shape != (B, D) or q.shape[:2] != (B, D):
            raise ValueError(f"the drafter's window is {toks.shape} tokens with q {q.shape}; the plan drafts "
                             f"{(B, D)}")
        tree = cached_tree(tuple(tuple(p) for p in chain(D)))
        t = TreeArrays(*(jnp.broadcast_to(jnp.asarray(a), (B,) + a.shape)
                         for a in (tree.parent, tree.depth, tree.ancestor, tree.children)))
        valid = jnp.ones((B, D + 1), bool)
        if decision.depth is not None:
            valid = jnp.arange(D + 1)[None] <= decision.depth[:, None]
        tokens = jnp.concatenate([env.last[:, None].astype(jnp.int32), toks.astype(jnp.int32)], axis=1)
        q_nodes = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, 1), (0, 0)))  # node i's child was drawn from q[i]
        known = valid & (jnp.arange(D + 1)[None] < D)
        fed = jnp.full((B, D + 1), -1, jnp.int32)
        root_logp = jnp.log(jnp.maximum(q_nodes[:, 0], 0.0))
        return Proposal(tokens, valid, t, q_nodes, fed, root_logp, None, known, decision), ds
