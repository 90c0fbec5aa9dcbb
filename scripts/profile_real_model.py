"""What a step of the real model costs on this machine (the numbers of docs/real-model.md, "What a step costs" and
"Where a step's time goes"). Needs `jspec fetch smollm2-135m-instruct`.

    python scripts/profile_real_model.py --widths     # a k-token forward against the cache, in AR steps
    python scripts/profile_real_model.py --loops      # decode loop ms per step: AR, prompt lookup trimmed / 5 or 11 wide
    python scripts/profile_real_model.py --ops        # the AR and prompt-lookup loops by XLA operation
    python scripts/profile_real_model.py --matmul     # matmuls of 1-16 rows on 30 layers' gate/up weights
    python scripts/profile_real_model.py --widths --loops --dtype bfloat16   # the same with bf16 weights

Medians of repeated warm calls; this machine is shared, so compare numbers taken in one run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jspec  # noqa: E402
import ports  # noqa: E402
from jspec import api  # noqa: E402
from jspec.core import prefill as PR
from jspec.tools import models
from jspec.engine import profiling
from ports.core import cache as kvc  # noqa: E402

NAME = "smollm2-135m-instruct"


def _median_ms(fn, *args, reps: int = 15) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t)
    return 1e3 * float(np.median(ts))


def widths(model, slots: int = 1024, prompt: int = 300) -> None:
    cache = PR.new_cache_for(model, 1, slots)
    ids = np.random.default_rng(0).integers(100, 4000, (1, prompt)).astype(np.int32)
    _, _, cache = PR.prefill(model, jnp.asarray(ids), jnp.asarray([prompt]), cache, {})

    @jax.jit
    def forward(params, cache, toks):
        k = toks.shape[1]
        pos = kvc.positions(cache, jnp.broadcast_to(jnp.arange(k), (1, k)))
        mask = jnp.tril(jnp.ones((1, k, k), bool)) if k > 1 else None
        return ports.Model(model.config, params, model.hf_config).forward(toks, pos, cache, mask).logits

    base = None
    for k in (1, 2, 3, 5, 8, 11):
        ms = _median_ms(forward, model.params, cache, jnp.asarray(np.arange(k)[None] + 500, jnp.int32))
        base = base or ms
        print(f"k={k:2d}: {ms:6.1f} ms, {ms / base:.2f} AR steps (a {slots}-slot cache, not donated)")
    nbytes = sum(a.nbytes for a in jax.tree.leaves(model.params))
    print(f"weights {nbytes / 1e6:.0f} MB: {nbytes / 29e9 * 1e3:.1f} ms at 29 GB/s")


def loops(model, prompt: int = 300) -> None:
    from jspec.parts.drafters.ngram import NgramDrafter
    from jspec.parts.plans import StaticPlan
    from jspec.engine.strategy import Speculative
    from jspec.parts.rules import as_rule

    ids = np.random.default_rng(0).integers(100, 4000, prompt).astype(np.int32)
    pl = jspec.PromptLookup(3, 10)
    wide = Speculative(NgramDrafter(3, 1), StaticPlan.from_paths(pl.tree), as_rule("residual"))
    wide5 = Speculative(NgramDrafter(3, 1), StaticPlan.from_paths(jspec.PromptLookup(3, 4).tree), as_rule("residual"))
    for name, s in (("AR", jspec.AR()), ("PromptLookup gamma=10, trimmed", pl), ("the same, 11 wide", wide),
                    ("PromptLookup gamma=4", jspec.PromptLookup(3, 4)), ("gamma=4, always 5 wide", wide5)):
        jspec.decode(model, ids, s, max_new_tokens=128, eos_token_id=())
        outs = [jspec.decode(model, ids, s, max_new_tokens=128, eos_token_id=()) for _ in range(3)]
        dec = float(np.median([o.stats["decode_s"] for o in outs]))
        steps = int(outs[0].stats["steps"][0])
        print(f"{name}: {steps} steps, {1e3 * dec / steps:.1f} ms per step, decode {dec:.2f} s")


def ops(model, top: int = 14, prompt: int = 300) -> None:
    ids = np.random.default_rng(0).integers(100, 4000, prompt).astype(np.int32)
    for name, s in (("AR", jspec.AR()), ("PromptLookup gamma=4", jspec.PromptLookup(3, 4))):
        r = profiling.op_costs(api.start(model, ids, s, max_new_tokens=64, eos_token_id=()), top=top)
        print(f"{name}: {r['steps']} steps, {r['total_us_per_step']:.0f} us per step summed over instructions")
        for o in r["ops"]:
            print(f"  {o['us_per_step']:8.0f} us  x{o['per_step']:.0f}  {o['op']:28s} {o['shape'][:70]}")


def matmul(d: int = 576, f: int = 3072, layers: int = 30) -> None:
    w = jnp.asarray(np.random.default_rng(0).normal(size=(d, f)).astype(np.float32))
    ws = [w + i for i in range(layers)]
    wts = [jnp.asarray(np.asarray(x).T.copy()) for x in ws]
    ynn = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
    kinds = {"x @ W": (jax.jit(lambda x, ws: sum(jnp.dot(x, w) for w in ws)), ws),
             "W [out, in]": (jax.jit(lambda x, ws: sum(jnp.einsum("md,nd->mn", x, w) for w in ws)), wts),
             "YNNPACK dot": (jax.jit(lambda x, ws: sum(jnp.dot(x, w) for w in ws), compiler_options=ynn), ws),
             "a gemv per row": (jax.jit(lambda x, ws: sum(jnp.stack([jnp.dot(r, w) for r in x]) for w in ws)), ws)}
    print(f"{layers} matrices of {d} x {f} ({layers * d * f * 4 / 1e6:.0f} MB), ms per call:")
    for m in (1, 2, 4, 8, 11, 16):
        x = jnp.ones((m, d), jnp.float32)
        print(f"rows {m:2d}: " + ", ".join(f"{k} {_median_ms(fn, x, w):.2f}" for k, (fn, w) in kinds.items()))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag in ("--widths", "--loops", "--ops", "--matmul"):
        ap.add_argument(flag, action="store_true")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="the model's weights")
    ap.add_argument("--prompt", type=int, default=300, help="--loops / --ops: the random prompt's length")
    a = ap.parse_args(argv)
    if not (a.widths or a.loops or a.ops or a.matmul):
        a.widths = a.loops = a.ops = a.matmul = True
    if a.matmul:
        matmul()
    if a.widths or a.loops or a.ops:
        model, _ = models.load(NAME, dtype=a.dtype)
        if a.widths:
            widths(model)
        if a.loops:
            loops(model, prompt=a.prompt)
        if a.ops:
            ops(model, prompt=a.prompt)


if __name__ == "__main__":
    main()
