"""`jspec bench moe`: whether an MoE decode step costs what the experts it uses cost, not what the experts it stores
would.

A small random Qwen3-MoE-style model built with `ports` (64 experts, top 4, float32) against the same model with a
dense `qwen3` MLP as wide as its 4 chosen experts: same attention, embeddings and head, so the two differ only in
the feed-forward block. Two sizes (`SIZES`): "beyond-cache" (hidden 512, 8 layers, experts 256 wide: the dense
model's 92 MB of weights, like every real model's, do not fit a CPU's last-level cache) and "in-cache" (hidden 256,
4 layers, experts 128 wide: the dense model's 15 MB sit in a 32 MB L3 and are timed from it, while the MoE's
experts, 109 MB, come from memory, so that size measures the cache as much as the experts). Each model
decodes from one ~64-token prompt (batch 1), and two costs are timed inside one compiled program
(`jspec.engine.profiling`: the work repeated n times in a loop, at two n, the slope): an AR decode step, and the
verify phase of a Chain with gamma 7 (a target forward over 8 tokens: the last committed token and 7 drafts; the
draft is the model's own first layer, whose cost is not in the verify). Every figure is a median over `runs`
interleaved rounds, each round timing the MoE model and the dense one alternately (after a warm-up that
compiles).

Reported: step ms of each, MoE / dense for the AR step and for the 8-token verify, and the experts the verify
wakes: 8 tokens x top 4 = 32 token-expert pairs per sparse layer, and how many distinct experts those are, read
from the router on the verify's own tokens (the proposal the timed verify checks, in the context of the prompt).
The issue's bar (#105): an AR step at most 1.5x the dense model's.
"""
from __future__ import annotations

import dataclasses
import statistics

import numpy as np


med = statistics.median
GAMMA = 7  # verify of GAMMA + 1 tokens


SIZES = {"beyond-cache": dict(hidden=512, layers=8, moe_width=256), "in-cache": dict(hidden=256, layers=4, moe_width=128)}


def shapes(quick: bool, size: str = "beyond-cache") -> dict:
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    if quick:
        return dict(hidden=64, layers=1, experts=8, top_k=2, moe_width=32, vocab=256, heads=2, prompt=12)
    return dict(**SIZES[size], experts=64, top_k=4, vocab=2048, heads=4, prompt=64)


def last_level_cache_mb() -> float | None:
    """The CPU's last-level cache in MB (Linux sysfs), or None where it is not known (not a CPU, or no sysfs)."""
    import glob

    sizes = []
    for f in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        s = open(f).read().strip()
        mult = {"K": 1 / 1024, "M": 1.0, "G": 1024.0}.get(s[-1:])
        if mult:
            sizes.append(float(s[:-1]) * mult)
    return max(sizes) if sizes else None


def models(sh: dict, seed: int = 0):
    """(MoE model, dense model as wide as top_k experts), same attention / embedding shapes, random f32 weights."""
    import jax.numpy as jnp

    import ports
    from ports.families import qwen3 as Q3

    common = dict(vocab_size=sh["vocab"], hidden_size=sh["hidden"], num_layers=sh["layers"],
                  num_heads=sh["heads"], num_kv_heads=sh["heads"], head_dim=sh["hidden"] // sh["heads"],
                  max_position_embeddings=1024, eos_token_ids=())
    wide = sh["top_k"] * sh["moe_width"]
    moe_cfg = Q3.Qwen3Config(model_type="qwen3_moe", intermediate_size=wide, num_experts=sh["experts"],
                             num_experts_per_tok=sh["top_k"], moe_intermediate_size=sh["moe_width"],
                             norm_topk_prob=True, **common)
    dense_cfg = Q3.Qwen3Config(model_type="qwen3", intermediate_size=wide, **common)
    moe = ports.random_model(moe_cfg, key=seed, dtype=jnp.float32, std=0.05)
    dense = ports.random_model(dense_cfg, key=seed, dtype=jnp.float32, std=0.05)
    assert all(moe_cfg.is_sparse(i) for i in range(sh["layers"]))
    return moe, dense


def first_layer(model):
    """The model cut to its first layer (same embeddings and head): the Chain's draft."""
    import ports

    p = model.params
    return ports.Model(dataclasses.replace(model.config, num_layers=1), {**p, "layers": p["layers"][:1]})


class _Timed:
    """One model's started decodes (AR, and Chain gamma 7) and their in-program costs."""

    def __init__(self, model, prompt, reps):
        import jspec
        from jspec import api
        from jspec.engine import profiling as PF

        kw = dict(max_new_tokens=4 * (GAMMA + 1), eos_token_id=(), compile_loop=False)
        self.PF, self.reps = PF, reps
        self.ar = api.start(model, [prompt], None, **kw)
        self.sd = api.start(model, [prompt], jspec.Chain(first_layer(model), gamma=GAMMA), **kw)
        c0, c1, c2 = PF._carries(self.sd)
        self.verify_carry = (c1[0], c1[1], c2[2])
        self.proposal = np.asarray(c1[1].tokens)[0]  # the tokens the timed verify checks

    def ar_step(self) -> float:
        return self.PF._cost("step", self.ar, (self.ar.state, None, None), self.reps, 1)

    def verify(self) -> float:
        return self.PF._cost("verify", self.sd, self.verify_carry, self.reps, 1)


def experts_woken(model, prompt, proposal) -> list[dict]:
    """Per sparse layer: the token-expert pairs of the proposal's tokens (routed after the prompt, as the verify
    routes them) and the distinct experts they name, read from `ports.core.moe.route` run eagerly."""
    import jax

    import ports
    from ports.core import moe as M

    seen: list[np.ndarray] = []
    orig = M.route

    def recording(x, router, top_k, norm):
        w, e = orig(x, router, top_k, norm)
        seen.append(np.asarray(e))
        return w, e

    M.route = recording
    try:
        with jax.disable_jit():
            ports.logits(model, np.concatenate([np.asarray(prompt), proposal])[None])
    finally:
        M.route = orig
    n = len(proposal)
    out = []
    for layer, e in enumerate(seen):
        tail = e.reshape(-1, e.shape[-1])[-n:]  # the proposal's rows
        out.append(dict(layer=layer, tokens=n, pairs=int(tail.size), distinct_experts=int(len(np.unique(tail)))))
    return out


def suite(runs: int, quick: bool, progress: bool = True, size: str = "beyond-cache") -> dict:
    import jax

    from jspec.tools.bench import zoo

    sh = shapes(quick, size)
    moe, dense = models(sh)
    prompt = np.random.default_rng(0).integers(0, sh["vocab"], sh["prompt"])
    reps = (2, 6) if quick else (4, 16)
    timed = {"MoE": _Timed(moe, prompt, reps), "dense": _Timed(dense, prompt, reps)}
    cases = []
    for what in ("ar_step", "verify"):  # within a round: MoE, dense, MoE, dense
        for name, t in timed.items():
            cases.append(zoo.Case(f"{name} {what}", getattr(t, what)))
    res = zoo.interleaved(cases, runs, progress)
    ms = {c.name: med(res[c.name]["results"]) * 1e3 for c in cases}
    compile_s = {c.name: res[c.name]["compile_s"] for c in cases}
    woken = experts_woken(moe, prompt, timed["MoE"].proposal)
    distinct = [w["distinct_experts"] for w in woken]
    r = zoo._r
    rows = []
    for name, m in (("MoE", moe), ("dense", dense)):
        cfg = m.config
        rows.append(dict(model=name, params_m=r(m.num_params / 1e6, 2),
                         ffn=(f"{cfg.num_experts} experts x {cfg.moe_intermediate_size}, top {cfg.num_experts_per_tok}"
                              if name == "MoE" else f"dense {cfg.intermediate_size}"),
                         ar_step_ms=r(ms[f"{name} ar_step"], 3), verify_8_ms=r(ms[f"{name} verify"], 3),
                         ar_runs_ms=[r(x * 1e3, 3) for x in res[f"{name} ar_step"]["results"]],
                         verify_runs_ms=[r(x * 1e3, 3) for x in res[f"{name} verify"]["results"]]))
    ratio = lambda a, b: r(ms[a] / ms[b]) if ms[a] > 0 and ms[b] > 0 else None  # noqa: E731  (a slope can clamp to 0)
    summary = dict(ar_step_ratio=ratio("MoE ar_step", "dense ar_step"),
                   verify_ratio=ratio("MoE verify", "dense verify"),
                   verify_tokens=GAMMA + 1, top_k=sh["top_k"], experts=sh["experts"],
                   verify_pairs=(GAMMA + 1) * sh["top_k"],
                   distinct_experts_mean=r(float(np.mean(distinct)), 2), distinct_experts_min=min(distinct),
                   distinct_experts_max=max(distinct), bar_ar_step_ratio=1.5, size=None if quick else size,
                   dense_weights_mb=r(dense.num_params * 4 / 2**20, 1), moe_weights_mb=r(moe.num_params * 4 / 2**20, 1),
                   last_level_cache_mb=last_level_cache_mb() if jax.default_backend() == "cpu" else None,
                   meets_bar=None if ms["dense ar_step"] <= 0 else bool(ms["MoE ar_step"] / ms["dense ar_step"] <= 1.5))
    return {"shape": sh, "rows": rows, "summary": summary, "experts_woken": woken,
            "compile_s": {k: r(v, 2) for k, v in compile_s.items()}}


def markdown(result: dict) -> str:
    from jspec.tools.bench import zoo

    s = result["summary"]
    out = zoo.slope_table(result)
    out += ["", f"MoE / dense: AR step **{s['ar_step_ratio']}x**, {s['verify_tokens']}-token verify "
                f"**{s['verify_ratio']}x** (bar: AR step <= {s['bar_ar_step_ratio']}x: "
                f"{ {True: 'met', False: 'not met', None: 'not measured: a timing clamped to 0'}[s['meets_bar']]}).",
            f"Verify: {s['verify_tokens']} tokens x top {s['top_k']} = {s['verify_pairs']} token-expert pairs per "
            f"layer, waking {s['distinct_experts_min']}-{s['distinct_experts_max']} distinct experts of "
            f"{s['experts']} (mean {s['distinct_experts_mean']} over the {len(result['experts_woken'])} sparse "
            "layers).",
            f"Weights (float32): dense {s['dense_weights_mb']} MB, MoE {s['moe_weights_mb']} MB; the CPU's last-level "
            f"cache: {s['last_level_cache_mb']} MB."]
    return "\n".join(out)


def run(runs: int = 3, quick: bool = False, out_dir: str = "bench_out", progress: bool = True,
        size: str = "beyond-cache") -> dict:
    """Run the suite at one of `SIZES` and write `<out_dir>/moe[-quick | -in-cache]-<date>.{json,md}`; returns the
    result dict."""
    from jspec.tools.bench import zoo

    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    shapes(quick, size)
    name = "moe" if quick or size == "beyond-cache" else f"moe-{size}"
    return zoo.save_suite({"meta": zoo.meta(name, runs, quick), **suite(runs, quick, progress, size)}, out_dir,
                          markdown)

