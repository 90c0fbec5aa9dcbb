"""`jspec bench guard`: what a round in which no row drafts costs, in AR steps.

Under `jspec.Guarded`, a round where the guard drafts nothing is the speculative program's ordinary round at width
one; this suite times it against an AR step on the same target, batch and prompt. The strategy runs with the
guard forced to depth 0 and its deferral on (`defer` 24, `Guarded`'s default: a drafter with a cache of its own
leaves those rounds' tokens unread), so every round is one without drafts. Two measurements, each a median over
`runs` interleaved rounds after a warm-up that compiles:

- **in one program** (`jspec.engine.profiling`): an AR step and a round without drafts, each repeated inside one
  compiled program at two counts, the slope (the cost table's harness, `jspec.costs`);
- **in the decode loop**: `jspec.decode` of `new` tokens, AR against the forced guard (its `decode_s`); greedy, so
  the tokens must equal AR's (checked).

Also recorded: each cache's length (the target's in AR and under the strategy, the drafter's own) and the
strategy's slots past the committed tokens (`Needs.scratch`, `Needs.per_step`). Pairs (`PAIRS`): "zoo" (the zoo's
text pair, `jspec.Chain` gamma 5, batch 4, 64-token prompts; trained by `jspec zoo`) and "smollm2" (SmolLM2-135M
with prompt lookup, batch 3, 128-token prompts; `jspec.tools.models`). The bar: a round without drafts at most
1.05 AR steps in one program.
"""
from __future__ import annotations

import statistics

import numpy as np

med = statistics.median
DEFER = 24
BAR = 1.05
PAIRS = {"zoo": "the zoo's text pair, Chain gamma 5, batch 4, 64-token prompts, 96 new tokens",
         "smollm2": "SmolLM2-135M-Instruct, prompt lookup (n-gram 3, gamma 4), batch 3, 128-token prompts, "
                    "48 new tokens"}


def _setup(pair: str, quick: bool):
    """(target, strategy, batch, prompt length, new tokens)."""
    import jspec

    if pair not in PAIRS:
        raise ValueError(f"pair must be one of {sorted(PAIRS)}, got {pair!r}")
    if quick:  # a random 2-layer LLaMA and its first layer
        import dataclasses

        import ports

        cfg = ports.TextConfig(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96,
                               num_layers=2, num_heads=2, num_kv_heads=2, head_dim=32)
        target = ports.random_model(cfg, key=0, std=0.3)
        draft = ports.Model(dataclasses.replace(cfg, num_layers=1),
                            {**target.params, "layers": target.params["layers"][:1]})
        return target, jspec.Chain(draft, gamma=3), 2, 16, 12
    if pair == "zoo":
        from jspec.tools.zoo import evaluate as ZE

        zp = ZE.load_pair("text")
        return zp.target, jspec.Chain(zp.draft, gamma=5), 4, 64, 96
    from jspec.tools import models

    target, _ = models.load("smollm2-135m-instruct")
    return target, jspec.PromptLookup(max_ngram=3, gamma=4), 3, 128, 48


def suite(runs: int, quick: bool, progress: bool = True, pair: str = "zoo") -> dict:
    import jspec
    from jspec.engine import profiling as PF
    from jspec.engine.costs import forced_depth, probe_prompt
    from jspec.tools.bench import zoo

    target, strategy, batch, prompt_len, new = _setup(pair, quick)
    prompt = probe_prompt(target.vocab_size, prompt_len, batch)
    forced = forced_depth(strategy.parts(), DEFER)
    # started as the cost table starts its programs (`jspec.engine.costs.measure`: room for 16 of the deepest
    # rounds, so the caches are as long as the table's), each slope over more repetitions than the table's (a
    # round without drafts commits one token each: 48 stay inside the cache)
    reps = (2, 6) if quick else (8, 48)
    kw = dict(max_new_tokens=16 * (forced.plan.max_depth + 1) + 2, eos_token_id=(), compile_loop=False)
    ar, st = jspec.start(target, prompt, None, **kw), jspec.start(target, prompt, forced, **kw)
    dkw = dict(max_new_tokens=new, eos_token_id=())
    tokens = {}

    def decode(name, strat):
        def run():
            out = jspec.decode(target, prompt, strategy=strat, **dkw)
            tokens[name] = np.asarray(out.tokens)
            return out.stats["decode_s"]
        return run

    cases = [zoo.Case("AR step", lambda: PF._cost("step", ar, (ar.state, None, None), reps, 1)),
             zoo.Case("round without drafts", lambda: PF._cost("sd_step", st, (st.state, None, None), reps, 1)),
             zoo.Case("AR decode", decode("AR", None)),
             zoo.Case("decode, rounds without drafts", decode("guard", forced))]
    res = zoo.interleaved(cases, runs, progress)
    r = zoo._r
    ms = {c.name: med(res[c.name]["results"]) * 1e3 for c in cases}
    rows = [dict(measured=c.name, ms=r(ms[c.name], 3), compile_s=r(res[c.name]["compile_s"], 2),
                 timed_runs_ms=[r(x * 1e3, 3) for x in res[c.name]["results"]]) for c in cases]
    ratio = lambda a, b: r(ms[a] / ms[b]) if ms[a] > 0 and ms[b] > 0 else None  # noqa: E731  (a slope can clamp to 0)
    per_run = lambda a, b: [r(x / y) if y > 0 else None  # noqa: E731
                            for x, y in zip(res[a]["results"], res[b]["results"])]
    in_program = ratio("round without drafts", "AR step")
    draft_cache = getattr(st.state.aux.draft, "cache", None)
    needs = st.parts.needs
    summary = dict(pair=pair if not quick else "quick", what=PAIRS[pair] if not quick else "a random 2-layer LLaMA",
                   in_program_ratio=in_program, in_program_runs=per_run("round without drafts", "AR step"),
                   decode_ratio=ratio("decode, rounds without drafts", "AR decode"),
                   decode_runs=per_run("decode, rounds without drafts", "AR decode"),
                   tokens_equal=bool(np.array_equal(tokens["AR"], tokens["guard"])), bar=BAR,
                   meets_bar=None if in_program is None else bool(in_program <= BAR),
                   batch=batch, prompt_len=prompt_len, new_tokens=new, defer=DEFER,
                   target_cache_ar=int(ar.state.cache.max_len), target_cache=int(st.state.cache.max_len),
                   draft_cache=None if draft_cache is None else int(draft_cache.max_len),
                   scratch=int(needs.scratch), per_step=int(needs.per_step))
    return {"rows": rows, "summary": summary}


def markdown(result: dict) -> str:
    from jspec.tools import report

    m, s = result["meta"], result["summary"]
    verdict = {True: "met", False: "not met", None: "not measured: a timing clamped to 0"}[s["meets_bar"]]
    draft = "none of its own" if s["draft_cache"] is None else f"{s['draft_cache']} slots"
    head = [f"`{m['suite']}` suite, {m['date']}, {m['device']}, jax {m['jax']}, median of {m['runs']} interleaved "
            "runs (a step: the slope inside one compiled program; a decode: its decode_s)", ""]
    rows = [{k: v for k, v in row.items() if k != "timed_runs_ms"} for row in result["rows"]]
    return "\n".join(head + report.markdown_table(rows) + [
        "", f"{s['what']}: a round without drafts costs **{s['in_program_ratio']}x** an AR step in one program "
            f"(bar <= {s['bar']}: {verdict}), **{s['decode_ratio']}x** in the decode loop; tokens equal AR's: "
            f"{s['tokens_equal']}.",
        f"Caches: the target's {s['target_cache_ar']} slots under AR, {s['target_cache']} under the strategy "
        f"(scratch {s['scratch']}); the drafter's {draft} (per step {s['per_step']}, deferral {s['defer']})."])


def run(runs: int = 3, quick: bool = False, out_dir: str = "bench_out", progress: bool = True,
        pair: str = "zoo") -> dict:
    """Run the suite on one of `PAIRS` and write `<out_dir>/guard-<pair>[-quick]-<date>.{json,md}`; returns the
    result dict."""
    from jspec.tools.bench import zoo

    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    if pair not in PAIRS:
        raise ValueError(f"pair must be one of {sorted(PAIRS)}, got {pair!r}")
    name = "guard" if quick else f"guard-{pair}"
    return zoo.save_suite({"meta": zoo.meta(name, runs, quick), **suite(runs, quick, progress, pair)}, out_dir,
                          markdown)
