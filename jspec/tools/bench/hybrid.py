"""`jspec bench hybrid`: what a verify costs on a hybrid (linear-attention) target, by draft depth and tree size,
beside an attention-only target of the same width, and what it keeps per node for the commit.

Two tiny random `qwen3_5_text` models built with `ports` (hidden 256, 8 layers, float32; the hybrid's layers
three linear-attention to one full-attention, the other's all full attention, same heads and MLP): the same
model but for the token mixer. A one-layer `qwen3` draft (same vocabulary) proposes. For each, timed inside one
compiled program (`jspec.engine.profiling`: the phase repeated n times in a loop, at two n, the slope): an AR step,
and the verify phase and the accept phase (the verdict and the commit: for the hybrid, the recurrent state advanced
along the accepted path) of a Chain of depth 1, 3 and 7, and of static trees of 8, 16 and 32 nodes. Every figure
is a median over `runs` interleaved rounds, each timing every case once (after a warm-up that compiles).

Reported per case: ms of each model and hybrid / attention-only; and the bytes the hybrid's verify keeps per node
for the commit (`jspec.tools.memory.recurrent_verify_bytes`) beside the bytes a state per node would take.

And a long prompt's prefill on the hybrid (2,048 tokens; 256 with --quick), jspec's chunked form beside
transformers' forward of the same weights (`save_hf`, then transformers' own loader; its torch reference kernels):
median wall seconds over `runs` after a warm-up (each side in a fresh subprocess), and its working memory: XLA's
temporary bytes of jspec's compiled program, the peak of the bytes transformers' ops hold during a call.
"""
from __future__ import annotations

import statistics

import numpy as np

med = statistics.median
CHAINS = (1, 3, 7)
TREES = {8: "chain8", 16: "wide16", 32: "wide32"}


def shapes(quick: bool) -> dict:
    if quick:
        return dict(hidden=64, layers=4, heads=2, kv=1, head_dim=32, vocab=256, lin_heads=(2, 4), lin_dims=(16, 16),
                    mlp=128, prompt=24)
    return dict(hidden=256, layers=8, heads=4, kv=2, head_dim=64, vocab=2048, lin_heads=(4, 8), lin_dims=(32, 32),
                mlp=512, prompt=96)


def models(sh: dict, seed: int = 0):
    """(hybrid target, attention-only target, qwen3 draft), random float32 weights."""
    import jax.numpy as jnp

    import ports
    from ports.families import qwen3 as Q3
    from ports.families import qwen3_5 as Q5

    common = dict(model_type="qwen3_5_text", vocab_size=sh["vocab"], hidden_size=sh["hidden"],
                  intermediate_size=sh["mlp"], num_hidden_layers=sh["layers"], num_attention_heads=sh["heads"],
                  num_key_value_heads=sh["kv"], head_dim=sh["head_dim"], linear_num_key_heads=sh["lin_heads"][0],
                  linear_num_value_heads=sh["lin_heads"][1], linear_key_head_dim=sh["lin_dims"][0],
                  linear_value_head_dim=sh["lin_dims"][1], max_position_embeddings=4096)
    hybrid = Q5.config_from_hf(common)
    dense = Q5.config_from_hf({**common, "layer_types": ["full_attention"] * sh["layers"]})
    draft = Q3.config_from_hf(dict(model_type="qwen3", vocab_size=sh["vocab"], hidden_size=sh["hidden"] // 2,
                                   intermediate_size=sh["mlp"] // 2, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=32, tie_word_embeddings=True))
    make = lambda c, k: ports.random_model(c, key=k, dtype=jnp.float32, std=0.05)  # noqa: E731
    return make(hybrid, seed), make(dense, seed), make(draft, seed + 1)


def tree_of(name: str) -> list:
    """A static tree of child-rank paths: `chainN` (one path of N - 1 drafts) or `wideN` (root + 3 children, each
    with 3 children, ... breadth first, N nodes with the root)."""
    n = int(name.lstrip("chainwide"))
    if name.startswith("chain"):
        return [[0] * d for d in range(1, n)]
    paths, frontier = [], [[]]
    while len(paths) < n - 1:
        nxt = []
        for p in frontier:
            for r in range(3):
                if len(paths) < n - 1:
                    paths.append(p + [r])
                    nxt.append(p + [r])
        frontier = nxt
    return paths


class _Phases:
    """One target's started decodes (AR, and a strategy per case) and their in-program costs."""

    def __init__(self, target, draft, prompt, reps, cases: dict):
        import jspec
        from jspec import api
        from jspec.engine import profiling as PF

        self.PF, self.reps = PF, reps
        kw = dict(max_new_tokens=64, eos_token_id=(), compile_loop=False)
        self.ar = api.start(target, [prompt], None, **kw)
        self.started = {}
        for name, kind in cases.items():
            strat = (jspec.Chain(draft, gamma=kind) if isinstance(kind, int)
                     else jspec.Tree(draft, tree=tree_of(kind)))
            s = api.start(target, [prompt], strat, **kw)
            c0, c1, c2 = PF._carries(s)
            self.started[name] = (s, (c2[0], c1[1], c2[2]), c2)

    def ar_step(self) -> float:
        return self.PF._cost("step", self.ar, (self.ar.state, None, None), self.reps, 1)

    def phase(self, name: str, which: str) -> float:
        s, verify_carry, accept_carry = self.started[name]
        return self.PF._cost(which, s, verify_carry if which == "verify" else accept_carry, self.reps, 1)


def _probe(kind: str, directory: str, T: int, runs: int) -> dict:
    """In this process: load the checkpoint in `directory`, prefill T tokens once (warm-up), then `runs` more (their
    median seconds); and the prefill's working memory: jspec's XLA temporaries of the compiled program, transformers'
    peak of the bytes its ops hold during one call (torch's profiler: each op's own allocations minus frees, in
    order)."""
    import time

    ids = np.random.default_rng(0).integers(0, 256, (1, T))
    out = {}
    if kind == "jspec":
        import jax
        import jax.numpy as jnp

        import ports
        from jspec.core import prefill as PR

        model = ports.load_hf(directory)
        fn = jax.jit(lambda t: PR.prefill(model, t, jnp.asarray([T]), PR.new_cache_for(model, 1, T))[0])
        tokens = jnp.asarray(ids, jnp.int32)
        compiled = fn.lower(tokens).compile()
        out["working_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
        call = lambda: jax.block_until_ready(compiled(tokens))  # noqa: E731
        call()
    else:
        import torch
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
        x = torch.tensor(ids)

        def call():
            with torch.no_grad():
                return model(x).logits

        call()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            call()
        held, most = 0, 0  # each op's own allocations minus frees (children apart), and the frees between ops
        for e in sorted(prof.events(), key=lambda e: e.time_range.start):
            held += e.self_cpu_memory_usage
            most = max(most, held)
        out["working_bytes"] = int(most)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    out.update(seconds=med(times), runs_s=times)
    return out


def prefill_vs_transformers(model, T: int, runs: int) -> dict:
    """`_probe` of jspec and of transformers, each in a fresh subprocess, over `model` saved as an HF checkpoint."""
    import json
    import subprocess
    import sys
    import tempfile

    import ports

    with tempfile.TemporaryDirectory() as d:
        ports.save_hf(model, d)
        out = {}
        for kind in ("jspec", "transformers"):
            proc = subprocess.run([sys.executable, "-m", "jspec.tools.bench.hybrid", "--probe", kind, d, str(T),
                                   str(runs)], capture_output=True, text=True, timeout=1800)
            if proc.returncode:
                raise RuntimeError(f"the {kind} prefill probe failed: {proc.stderr[-2000:]}")
            out[kind] = json.loads(proc.stdout.strip().splitlines()[-1])
    return dict(tokens=T, **out)


def suite(runs: int, quick: bool, progress: bool = True) -> dict:
    import jax.numpy as jnp

    from jspec.tools import memory as MEM
    from jspec.tools.bench import zoo

    sh = shapes(quick)
    hybrid, dense, draft = models(sh)
    prompt = np.random.default_rng(0).integers(0, sh["vocab"], sh["prompt"])
    reps = (2, 6) if quick else (4, 16)
    cases = {f"chain {d}": d for d in CHAINS}
    cases.update({f"tree {n}": name for n, name in TREES.items()})
    timed = {"hybrid": _Phases(hybrid, draft, prompt, reps, cases), "attention": _Phases(dense, draft, prompt, reps,
                                                                                        cases)}
    measured = [zoo.Case(f"{m} ar_step", t.ar_step) for m, t in timed.items()]
    for case in cases:
        for which in ("verify", "accept"):
            for m, t in timed.items():
                measured.append(zoo.Case(f"{m} {case} {which}", lambda t=t, c=case, w=which: t.phase(c, w)))
    res = zoo.interleaved(measured, runs, progress)
    ms = {c.name: med(res[c.name]["results"]) * 1e3 for c in measured}
    r = zoo._r
    ratio = lambda a, b: r(ms[a] / ms[b]) if ms[a] > 0 and ms[b] > 0 else None  # noqa: E731  (a slope can clamp to 0)
    text = hybrid.config
    rows = [dict(case="AR step", nodes=1, hybrid_ms=r(ms["hybrid ar_step"]), attention_ms=r(ms["attention ar_step"]),
                 ratio=ratio("hybrid ar_step", "attention ar_step"))]
    for case in cases:
        nodes = cases[case] + 1 if isinstance(cases[case], int) else int(case.split()[1])
        for which in ("verify", "accept"):
            a, b = f"hybrid {case} {which}", f"attention {case} {which}"
            rows.append(dict(case=f"{case} {which}", nodes=nodes, hybrid_ms=r(ms[a]), attention_ms=r(ms[b]),
                             ratio=ratio(a, b), hybrid_runs_ms=[r(x * 1e3) for x in res[a]["results"]],
                             attention_runs_ms=[r(x * 1e3) for x in res[b]["results"]]))
    per_node = MEM.recurrent_verify_bytes(text, 1, 1, jnp.dtype(jnp.float32))
    state = len(text.linear_layers) * text.linear_value_heads * text.linear_key_dim * text.linear_value_dim * 4
    prefill = prefill_vs_transformers(hybrid, 256 if quick else 2048, runs)
    return {"shape": sh, "rows": rows, "prefill": prefill,
            "memory": dict(linear_layers=len(text.linear_layers), verify_bytes_per_node=per_node,
                           state_bytes_per_node=state,
                           trees={n: per_node * n for n in (8, 16, 32)}),
            "compile_s": {c.name: r(res[c.name]["compile_s"], 2) for c in measured}}


def markdown(result: dict) -> str:
    from jspec.tools.bench import zoo

    mem = result["memory"]
    out = zoo.slope_table(result)
    out += ["", f"Kept per node for the commit over the {mem['linear_layers']} linear layers: "
                f"{mem['verify_bytes_per_node']} bytes (a state per node would be {mem['state_bytes_per_node']})."]
    pf = result["prefill"]
    j, t = pf["jspec"], pf["transformers"]
    out += ["", f"Prefill of {pf['tokens']} tokens (hybrid): jspec {j['seconds'] * 1e3:.1f} ms, transformers "
                f"{t['seconds'] * 1e3:.1f} ms; working memory jspec {j['working_bytes'] / 2 ** 20:.1f} MiB (XLA's "
                f"temporaries), transformers {t['working_bytes'] / 2 ** 20:.1f} MiB (peak held by its ops)."]
    return "\n".join(out)


def run(runs: int = 3, quick: bool = False, out_dir: str = "bench_out", progress: bool = True) -> dict:
    """Run the suite and write `<out_dir>/hybrid[-quick]-<date>.{json,md}`; returns the result dict."""
    from jspec.tools.bench import zoo

    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    return zoo.save_suite({"meta": zoo.meta("hybrid", runs, quick), **suite(runs, quick, progress)}, out_dir,
                          markdown)


if __name__ == "__main__":  # the prefill probe's subprocess: --probe KIND DIR TOKENS RUNS
    import json
    import sys

    if sys.argv[1:2] != ["--probe"] or len(sys.argv) != 6:
        raise SystemExit("usage: python -m jspec.tools.bench.hybrid --probe jspec|transformers DIR TOKENS RUNS")
    print(json.dumps(_probe(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))))
