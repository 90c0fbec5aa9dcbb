"""Spec-Bench on a real model: jspec's strategies and transformers' baselines on the field's shared question set.

    jspec bench spec-bench                                         # every category, 2 questions each, greedy
    jspec bench spec-bench --categories summarization rag --questions 10 --runs 3
    jspec bench spec-bench --temperature 1 --strategies ar pld
    jspec bench spec-bench --strategies ar pld-4 pld-4-bf16    # a "-bf16" method runs bfloat16 weights

The questions are Spec-Bench's 480 (`jspec/tools/bench/data/spec_bench`, Apache-2.0), asked through the model's chat
template; a second turn (MT-bench's categories) is asked after jspec AR's first answer, the same prompt for every
method. Batch 1, as Spec-Bench decodes (`--batch B`: B turns at a time as one ragged batch, the summary then
overall only). Each method decodes each turn once per run; runs are interleaved (every
method once per turn, then the next run), and every timed call is warm (each prompt width's programs are compiled
before the first run, by a prefill whose decode loop is compiled but not run). A call's wall time includes its
prefill, as Spec-Bench's does.

It writes Spec-Bench's answer JSONL per method (`question_id`, `category`, `choices[0].turns / new_tokens /
wall_time / accept_lengths`: Spec-Bench's `evaluation/speed.py` reads it), and a summary (JSON, markdown and a
plot): per category and overall, mean accepted tokens per target step (the bonus included), tokens/s, the step's
cost in AR steps (decode loop time per target step, prefill excluded), the wall speedup over jspec AR (the median over runs of the ratio of the category's total times),
and whether every greedy answer equals jspec AR's (with the same weights: a "-bf16" method against "ar-bf16", which
then runs too; its speedup is still over float32 "ar").
"""
from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

import numpy as np

from jspec.tools import report
from jspec.tools.self_data import chat_ids

QUESTIONS = Path(__file__).resolve().parent / "data" / "spec_bench" / "question.jsonl"
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
CATEGORIES = MT_BENCH + ("translation", "summarization", "qa", "math_reasoning", "rag")


def strategies() -> dict:
    """The jspec methods this bench knows that need no trained drafter, by name."""
    import jspec

    base = {"ar": jspec.AR(),
            "pld": jspec.PromptLookup(max_ngram=3, gamma=10),  # Spec-Bench's PLD: window 3, 10 candidates
            "pld-4": jspec.PromptLookup(max_ngram=3, gamma=4),  # shorter copies: cheaper verifies on a CPU
            # copies as long as the match is: 2 drafts after a 1- or 2-token match, 8 after a 3-token one
            "pld-m": jspec.PromptLookup(max_ngram=3, gamma=8, depths=(2, 2, 8)),
            "pld-tree": jspec.PromptLookup(max_ngram=3, gamma=4, branches=3)}
    return {**base, **{f"{name}{BF16}": s for name, s in base.items()}}


BF16 = "-bf16"  # a method name with this suffix runs the model with bfloat16 weights

# methods over a trained drafter the package ships for the model (`jspec.models.head`): name -> (drafter kind,
# strategy from the loaded head)
HEAD_METHODS = {
    "eesd": ("eesd", lambda h: _jspec().EESD(h, k_max=8)),  # Beta-TS draft lengths up to 8
    "eesd-cali": ("eesd", lambda h: _jspec().EESD(h, controller="cali", k_max=8)),
    **{f"eesd-k{k}": ("eesd", lambda h, k=k: _jspec().EESD(h, controller=k, k_max=k)) for k in (2, 3, 4, 6, 8)},
    "sage-eesd": ("eesd", lambda h: _jspec().SAGE(h)),  # SAGE's trees over the early-exit drafter
    # the target with the searched layers skipped, drafting in its own cache as Draft & Verify does; self-sd-own:
    # the reduced model as a separate draft model with a cache of its own
    "self-sd": ("layer-skip", lambda m: _jspec().Chain(_layer_skip().SkipDrafter.of(m), gamma=4)),
    "self-sd-own": ("layer-skip", lambda m: _jspec().Chain(m, gamma=4)),
    # EAGLE-1's feature head over the shipped draft vocabulary: chains, EAGLE-1's static tree, EAGLE-2's dynamic
    # tree, SAGE's trees
    **{f"eagle-c{g}": ("eagle", lambda h, g=g: _jspec().Chain(h, gamma=g)) for g in (2, 3, 4, 5, 6, 8)},
    "eagle-tree": ("eagle", lambda h: _jspec().Tree(h, tree="mc_sim_7b_63")),
    "eagle2": ("eagle", lambda h: _jspec().DynamicTree(h, depth=5, top_k=4, total=12)),
    "sage-eagle": ("eagle", lambda h: _jspec().SAGE(h)),
    # EAGLE-3's head (its own draft vocabulary): chains, EAGLE-1's static tree, the dynamic tree of eagle2, SAGE
    **{f"eagle3-c{g}": ("eagle3", lambda h, g=g: _jspec().Eagle3(h, tree="chain", depth=g)) for g in (2, 3, 4, 6)},
    "eagle3-tree": ("eagle3", lambda h: _jspec().Eagle3(h, tree="mc_sim_7b_63")),
    "eagle3": ("eagle3", lambda h: _jspec().Eagle3(h, depth=5, top_k=4, total=12)),
    "sage-eagle3": ("eagle3", lambda h: _jspec().SAGE(h)),
    # the block drafter (DFlash): a chain of its whole block, chains of fewer drafts, DDTree over its positions
    "dflash-chain": ("dflash", lambda h: _jspec().DFlash(h)),
    **{f"dflash-c{g}": ("dflash", lambda h, g=g: _jspec().DFlash(h, depth=g)) for g in (3, 4, 5)},
    "dflash-tree": ("dflash", lambda h: _jspec().DFlash(h, tree="ddtree", top_k=4, total=24)),
}


def _jspec():
    import jspec

    return jspec


def _layer_skip():
    from jspec.parts.drafters import layer_skip

    return layer_skip


GUARD, DEPTH = "+guard", "+depth"  # NAME+guard: the method under `jspec.Guarded` (NAME+guard-rR: at rate R);
# NAME+depthK: every round at depth K
RATE = re.compile(r"\+guard-r(0?\.\d+|1(\.0*)?|0)$")


def guard_of(name: str) -> tuple[str, str | None, int | None]:
    """(the base method's name, "guard" / "depth" / None, the fixed depth K of NAME+depthK or None)."""
    if name.endswith(GUARD):
        return name[:-len(GUARD)], "guard", None
    if RATE.search(name):
        return name[:RATE.search(name).start()], "guard", None
    base, sep, k = name.rpartition(DEPTH)
    if sep and k.isdigit():
        return base, "depth", int(k)
    return name, None, None


def guarded(name: str, strategy):
    """`strategy` as the method `name` runs it: under the guard (+guard), at a fixed depth inside the guard's own
    program (+depthK: what the guard could have chosen every round), or as it is."""
    import jspec
    from jspec.engine.costs import CostTable

    _, kind, k = guard_of(name)
    if kind == "guard":
        rate = RATE.search(name)
        return jspec.Guarded(strategy) if rate is None else jspec.Guarded(strategy, rate=float(rate.group(1)))
    if kind == "depth":
        D = strategy.parts().plan.max_depth
        if not 1 <= k <= D:
            raise ValueError(f"{name}: the method drafts to depth {D} at most, so K must be in 1 .. {D}")
        return jspec.Guarded(strategy, costs=CostTable.flat(D), force=k)
    return strategy


def head_method(name: str) -> tuple[str, object] | None:
    """(drafter kind, builder) of a trained-drafter method name (a "-bf16" one too, and NAME@HEAD, the method over
    a head of its kind read from a directory HEAD rather than the one shipped), or None."""
    base = guard_of(name.partition("@")[0])[0]
    return HEAD_METHODS.get(base[:-len(BF16)] if base.endswith(BF16) else base)


def head_label(name: str) -> tuple[str, str | None]:
    """(the method's label in results, the head directory it names or None): NAME@DIR -> NAME@basename(DIR)."""
    base, at, d = name.partition("@")
    return (f"{base}@{os.path.basename(os.path.normpath(d))}", d) if at else (name, None)


def dtype_of(method: str) -> str:
    return "bfloat16" if guard_of(method.partition("@")[0])[0].endswith(BF16) else "float32"


def reference_of(method: str) -> str:
    """The AR run whose greedy tokens `method`'s must equal: AR with the same weights."""
    return "ar" + BF16 if dtype_of(method) == "bfloat16" else "ar"


HF_METHODS = {"hf": {}, "hf-pld": {"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": 3}}


def load_questions(categories=CATEGORIES, per_category: int | None = None) -> list[dict]:
    """Spec-Bench's questions of `categories`, the first `per_category` of each (all when None), in file order."""
    unknown = sorted(set(categories) - set(CATEGORIES))
    if unknown:
        raise ValueError(f"unknown Spec-Bench categories {unknown}; they are {', '.join(CATEGORIES)}")
    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    out, seen = [], {c: 0 for c in categories}
    for q in rows:
        c = q["category"]
        if c in seen and (per_category is None or seen[c] < per_category):
            seen[c] += 1
            out.append(q)
    return out


PLAN_STATS = ("depth", "width", "nodes", "alpha", "speculated")  # a controller's per-step decision (`out.stats`), when it has one


def _row(out, b: int, wall: float, loop: float) -> tuple:
    """Row b of a decode as `Runner` returns it: (tokens, accept lengths: the prefill's token then each target
    step's, wall seconds, decode-loop seconds, tokens drafted, the controller's per-step plan or None)."""
    steps = int(out.stats["steps"][b])
    plan = {k: [float(v) for v in np.asarray(out.stats[k], np.float64)[b, :steps]] for k in PLAN_STATS
            if k in out.stats and np.ndim(out.stats[k]) == 2}
    return (out.tokens[b, :int(out.lengths[b])], [1] + out.stats["accepted"][b, :steps].tolist(), wall, loop,
            int(out.stats["drafted"][b]), plan or None)


class Runner:
    """Decodes one prompt with one method; returns (tokens, accept lengths per step or None, wall seconds, the
    decode loop's seconds without the prefill or None, tokens drafted or None, the controller's per-step plan or
    None: {stat: one value per target step} of `PLAN_STATS` (EESD's draft length K as "depth"; SAGE's tree depth,
    width, nodes and confidence alpha))."""

    def __init__(self, model, tokenizer, max_new_tokens: int, temperature: float, pad_to: int, hf=None,
                 models: dict | None = None, ignore_eos: bool = False):
        self.model, self.tok, self.N, self.T, self.pad_to, self.hf = model, tokenizer, max_new_tokens, temperature, \
            pad_to, hf
        self.models = models or {"float32": model}  # by weight dtype
        # ignore_eos: every answer is exactly max_new_tokens long (EESD's protocol); EOS is then an ordinary token
        self.eos = () if ignore_eos else tuple(np.atleast_1d(tokenizer.eos_token_id).tolist())

    def jspec(self, strategy, ids: np.ndarray, seed: int, dtype: str = "float32"):
        import jax

        import jspec

        t = time.perf_counter()
        out = jspec.decode(self.models[dtype], ids, strategy, max_new_tokens=self.N, temperature=self.T,
                           key=jax.random.key(seed), eos_token_id=self.eos, pad_prompt_to=self.pad_to)
        wall = time.perf_counter() - t
        return _row(out, 0, wall, float(out.stats["decode_s"]))

    def compile(self, strategy, rows, dtype: str = "float32") -> None:
        """Compiles what `jspec` (one row) or `jspec_rows` (a list) runs for prompts of these widths, without
        decoding: the prefill runs once and the decode loop is only compiled (`api.start`)."""
        import jax

        from jspec import api

        st = api.start(self.models[dtype], rows, strategy, max_new_tokens=self.N, temperature=self.T,
                       key=jax.random.key(0), eos_token_id=self.eos, pad_prompt_to=self.pad_to)
        if st.ahead is not None:
            st.ahead.wait()
        else:
            fn, args = st.loop_call()
            fn.lower(*args).compile()

    def jspec_rows(self, strategy, rows: list[np.ndarray], seed: int, dtype: str = "float32") -> list[tuple]:
        """`rows` decoded together as one ragged batch; per row, `jspec`'s tuple with the batch's wall and
        decode-loop seconds split evenly over the rows (their sums are the batch's)."""
        import jax

        import jspec

        t = time.perf_counter()
        out = jspec.decode(self.models[dtype], list(rows), strategy, max_new_tokens=self.N, temperature=self.T,
                           key=jax.random.key(seed), eos_token_id=self.eos, pad_prompt_to=self.pad_to)
        wall = (time.perf_counter() - t) / len(rows)
        return [_row(out, b, wall, float(out.stats["decode_s"]) / len(rows)) for b in range(len(rows))]

    def transformers(self, kw: dict, ids: np.ndarray, seed: int):
        import torch

        gen = dict(max_new_tokens=self.N, eos_token_id=list(self.eos), pad_token_id=self.eos[0], **kw)
        gen.update(do_sample=True, temperature=self.T, top_k=0, top_p=1.0) if self.T > 0 else \
            gen.update(do_sample=False)
        torch.manual_seed(seed)
        t = time.perf_counter()
        with torch.no_grad():
            o = self.hf.generate(torch.tensor(ids[None]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 **gen)
        wall = time.perf_counter() - t
        toks = o[0, len(ids):].numpy()
        stop = np.flatnonzero(np.isin(toks, self.eos))
        return toks[:stop[0] + 1] if stop.size else toks, None, wall, None, None, None


def _warm(runner: Runner, methods: dict, widths: list[int], progress) -> None:
    """Compiles each method's programs for every prompt width the questions need (a dummy prompt per width)."""
    for w in widths:
        ids = (np.arange(w) % 500 + 100).astype(np.int32)
        for name, s in methods.items():
            progress(f"compile {name} width {w}")
            runner.compile(s, ids, dtype_of(name))


def _warm_batches(runner: Runner, methods: dict, chunks: list, pad_to: int, progress) -> None:
    """Compiles each method's programs for every (rows, padded width) the batches need (dummy prompts)."""
    for n, w in sorted({(len(c), max(-(-len(ids) // pad_to) * pad_to for _, _, ids in c)) for c in chunks}):
        ids = (np.arange(w) % 500 + 100).astype(np.int32)
        for name, s in methods.items():
            progress(f"compile {name}, {n} rows of width {w}")
            runner.compile(s, [ids] * n, dtype_of(name))


def run(model_name: str = "smollm2-135m-instruct", categories=CATEGORIES, questions: int | None = 2,
        strategies_: tuple = ("ar", "pld", "pld-4", "pld-m", "pld-tree"), hf_methods: tuple = ("hf", "hf-pld"),
        max_new_tokens: int = 256, temperature: float = 0.0, runs: int = 1, second_turn: bool = True,
        pad_to: int = 16, out_dir: str = "bench_out", progress: bool = True, batch: int = 1,
        ignore_eos: bool = False) -> dict:
    """Run the bench (see the module docstring); returns the summary and writes the files it lists. batch > 1:
    the turns are decoded `batch` at a time, in order, as ragged batches (jspec methods only). ignore_eos: every
    answer runs to `max_new_tokens` (jspec methods only)."""
    import jax
    from tqdm import tqdm

    import jspec
    from jspec.tools.bench import zoo as BENCH
    from jspec.core import compilation
    from jspec.tools import models

    known = strategies()
    bad = [s for s in strategies_ if guard_of(s)[0] not in known and head_method(s) is None] + [
        h for h in hf_methods if h not in HF_METHODS]
    if bad:
        raise ValueError(f"unknown methods {bad}; jspec: {', '.join(known)}; over a trained drafter: "
                         f"{', '.join(HEAD_METHODS)}; transformers: {', '.join(HF_METHODS)}")
    shipped = {k for _, k in models.heads(model_name)}
    missing = [s for s in strategies_ if head_method(s) and "@" not in s and head_method(s)[0] not in shipped]
    if missing:
        raise ValueError(f"{missing} need a trained drafter that is not shipped for {model_name} "
                         f"(shipped: {sorted(shipped) or 'none'})")
    labelled = [head_label(s) for s in strategies_ if "@" in s]
    head_dirs = dict(labelled)
    absent = [d for _, d in labelled if not os.path.isdir(d)]
    if absent:
        raise ValueError(f"no head directory at {absent}")
    if len(head_dirs) < len(labelled):
        raise ValueError(f"two head directories share a name (a method's label): {[d for _, d in labelled]}")
    strategies_ = tuple(head_label(s)[0] for s in strategies_)
    if "ar" not in strategies_:
        strategies_ = ("ar",) + tuple(strategies_)
    if any(m.endswith(BF16) for m in strategies_) and "ar" + BF16 not in strategies_:
        strategies_ = ("ar" + BF16,) + tuple(strategies_)
    if runs < 1 or max_new_tokens < 1 or batch < 1:
        raise ValueError(f"runs, max_new_tokens and batch must be >= 1, got {runs}, {max_new_tokens}, {batch}")
    if batch > 1 and hf_methods:
        raise ValueError(f"the transformers baselines {list(hf_methods)} decode batch 1 only: pass --baselines none "
                         f"with --batch {batch}")
    if ignore_eos and hf_methods:
        raise ValueError(f"the transformers baselines {list(hf_methods)} stop at EOS: pass --baselines none with "
                         f"--ignore-eos")
    qs = load_questions(categories, questions)
    say = (lambda m: tqdm.write(m)) if progress else (lambda m: None)
    compilation.enable_cache()
    model, tok = models.load(model_name)
    by_dtype = {"float32": model}
    if any(m.endswith(BF16) for m in strategies_):
        by_dtype["bfloat16"] = models.load(model_name, dtype="bfloat16")[0]
    hf = None
    if hf_methods:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        hf = BENCH._hf_from(model, model_name)
    runner = Runner(model, tok, max_new_tokens, temperature, pad_to, hf, by_dtype, ignore_eos)
    methods = {}
    for s in strategies_:
        if guard_of(s)[0] in known:
            methods[s] = guarded(s, known[guard_of(s)[0]])
        else:
            kind, build = head_method(s)
            target = by_dtype[dtype_of(s)]
            methods[s] = guarded(s, build(models.load_head_dir(head_dirs[s], kind, target) if s in head_dirs else
                                          models.head(model_name, kind, target)))

    # first turns (and, from jspec AR's answers, second turns): the prompts every method answers
    turns = []  # (question index, turn, ids)
    for i, q in enumerate(qs):
        turns.append((i, 0, chat_ids(tok, [{"role": "user", "content": q["turns"][0]}])))
    widths = sorted({-(-len(ids) // pad_to) * pad_to for _, _, ids in turns})
    if batch == 1:
        _warm(runner, methods, widths, say)
    if second_turn:
        for i, q in enumerate(qs):
            if len(q["turns"]) > 1:
                first = runner.jspec(methods["ar"], turns[i][2], i)[0]
                answer = tok.decode(first, skip_special_tokens=True)
                msgs = [{"role": "user", "content": q["turns"][0]}, {"role": "assistant", "content": answer},
                        {"role": "user", "content": q["turns"][1]}]
                turns.append((i, 1, chat_ids(tok, msgs)))
        more = sorted({-(-len(ids) // pad_to) * pad_to for _, _, ids in turns} - set(widths))
        if batch == 1:
            _warm(runner, methods, more, say)
    chunks = [turns[j:j + batch] for j in range(0, len(turns), batch)]
    if batch > 1:
        _warm_batches(runner, methods, chunks, pad_to, say)
    names = list(methods) + list(hf_methods)
    res = {m: {} for m in names}  # method -> (q, turn) -> list over runs of (tokens, acc, wall)
    bar = tqdm(total=runs * len(chunks) * len(names), desc="spec-bench", unit="call", disable=not progress)
    for r in range(runs):
        for chunk in chunks:
            for m in names:
                seed = 1000 * chunk[0][0] + chunk[0][1]
                if batch > 1:
                    outs = runner.jspec_rows(methods[m], [ids for _, _, ids in chunk], seed, dtype_of(m))
                else:
                    outs = [runner.jspec(methods[m], chunk[0][2], seed, dtype_of(m)) if m in methods else
                            runner.transformers(HF_METHODS[m], chunk[0][2], seed)]
                for (i, t, _), out in zip(chunk, outs):
                    res[m].setdefault((i, t), []).append(out)
                bar.update()
    bar.close()

    stamp = time.strftime("%Y-%m-%d")
    tags = (f"-B{batch}" if batch > 1 else "") + (f"-N{max_new_tokens}" if ignore_eos else "")
    stem = fresh_dir(os.path.join(out_dir, f"spec-bench-{model_name}-T{temperature:g}{tags}-{stamp}"))
    files = [_write_answers(os.path.join(stem, f"{m}.jsonl"), m, qs, res[m], tok, model_name) for m in names]
    summary = summarize(qs, turns, res, methods, hf_methods, temperature, overall_only=batch > 1)
    summary["meta"] = {**BENCH.meta("spec-bench", runs, False), "model": model_name, "max_new_tokens": max_new_tokens,
                       "temperature": temperature, "questions_per_category": questions, "pad_prompt_to": pad_to,
                       "turns": len(turns), "batch": batch, "ignore_eos": ignore_eos, "jspec": jspec.__version__,
                       "jax_backend": jax.default_backend()}
    md = markdown(summary)
    files += [report.write_json(os.path.join(stem, "summary.json"), summary),
              report.write_text(os.path.join(stem, "summary.md"), md)]
    png = plot(summary, os.path.join(stem, "speedup.png"))
    summary["files"] = files + ([png] if png else [])
    summary["markdown"] = md
    return summary


def fresh_dir(stem: str) -> str:
    """`stem`, or `stem-2`, `stem-3`, ... when an earlier run wrote there: a run never overwrites another's files.
    Creates it."""
    path, i = stem, 1
    while os.path.exists(path):
        i += 1
        path = f"{stem}-{i}"
    os.makedirs(path)
    return path


def _write_answers(path: str, method: str, qs: list, res: dict, tok, model_name: str) -> str:
    """Spec-Bench's answer file: one line per question with every turn's text, new tokens, wall time (the median
    run's) and accept lengths."""
    with open(path, "w") as f:
        for i, q in enumerate(qs):
            turns, new, wall, acc, plan = [], [], [], [], {}
            for t in range(len(q["turns"])):
                outs = res.get((i, t))
                if not outs:
                    continue
                walls = [o[2] for o in outs]
                med = outs[int(np.argsort(walls)[len(walls) // 2])]
                toks, a = med[:2]
                turns.append(tok.decode(toks, skip_special_tokens=True))
                new.append(int(len(toks)))
                wall.append(float(np.median(walls)))
                acc.extend(a or [])
                for k, v in (med[5] if len(med) > 5 and med[5] else {}).items():  # aligned with accept_lengths
                    plan.setdefault(k, []).extend([None] + [x if np.isfinite(x) else None for x in v])
            f.write(json.dumps({"question_id": q["question_id"], "category": q["category"], "model_id":
                                f"{model_name}-{method}", "choices": [{"index": 0, "turns": turns, "new_tokens": new,
                                                                        "wall_time": wall, "accept_lengths": acc,
                                                                        **({"plan": plan} if plan else {})}],
                                "tstamp": time.time()}) + "\n")
    return path


def summarize(qs, turns, res, methods, hf_methods, temperature, overall_only: bool = False) -> dict:
    """Per category and overall, per method: mean accepted tokens per step, tokens/s, step cost in AR steps,
    speedup over jspec AR (median over runs of the total-time ratio), greedy answers equal to AR. overall_only:
    the overall group alone (batched runs, whose rows share a batch's time evenly: only the sums over every turn
    are measured times)."""
    groups = {} if overall_only else {c: [k for k in turns if qs[k[0]]["category"] == c]
                                      for c in dict.fromkeys(q["category"] for q in qs)}
    if any(c in MT_BENCH for c in groups):
        groups["mt_bench"] = [k for k in turns if qs[k[0]]["category"] in MT_BENCH]
    groups["overall"] = list(turns)
    rows = []
    for g, keys in groups.items():
        keys = [(i, t) for i, t, _ in keys]
        ar = res["ar"]
        n_runs = len(ar[keys[0]])
        ar_wall = [sum(ar[k][r][2] for k in keys) for r in range(n_runs)]
        ar_steps = sum(len(ar[k][0][1]) - 1 for k in keys)
        ar_loop = [sum(ar[k][r][3] for k in keys) for r in range(n_runs)]
        for m in list(methods) + list(hf_methods):
            out = res[m]
            wall = [sum(out[k][r][2] for k in keys) for r in range(n_runs)]
            toks = sum(len(out[k][0][0]) for k in keys)
            acc = [a for k in keys for a in (out[k][0][1] or [])]
            row = {"group": g, "method": m, "turns": len(keys), "new_tokens": toks,
                   "tokens_s": round(toks / float(np.median(wall)), 1),
                   "speedup_vs_ar": round(float(np.median([a / w for a, w in zip(ar_wall, wall)])), 3),
                   "mean_accepted": round(float(np.mean(acc)), 3) if acc else None}
            if acc:  # one target step of this method (decode loop, no prefill), in jspec AR steps
                loop = [sum(out[k][r][3] for k in keys) for r in range(n_runs)]
                steps = sum(len(out[k][0][1]) - 1 for k in keys)
                row["step_cost_ar_steps"] = round((np.median(loop) / steps) / (np.median(ar_loop) / ar_steps), 3)
                drafted = [out[k][0][4] for k in keys if len(out[k][0]) > 4 and out[k][0][4] is not None]
                if drafted and m != "ar" and steps:  # a controller's draft length, on average
                    row["drafts_per_step"] = round(sum(drafted) / steps, 2)
                row.update(plan_summary([out[k][0] for k in keys]))
            if temperature == 0:  # against AR with the same weights (bf16 methods: bf16 AR)
                ref = res[reference_of(m)] if m in methods else ar
                row["equal_to_ar"] = f"{sum(np.array_equal(out[k][0][0], ref[k][0][0]) for k in keys)}/{len(keys)}"
            rows.append(row)
    return {"rows": regret(rows)}


def regret(rows: list[dict]) -> list[dict]:
    """Each guarded method's row (NAME+guard) with, in its group: the unguarded method's speedup, the share of it
    the guard kept, and the best fixed choice in hindsight (AR, the method as it is, NAME+depthK where run) with the
    guard's speedup over it."""
    by = {(r["group"], r["method"]): r for r in rows}
    for r in rows:
        base, kind, _ = guard_of(r["method"])
        if kind != "guard":
            continue
        g = r["group"]
        fixed = {"ar": 1.0}
        fixed.update({m: x["speedup_vs_ar"] for (gg, m), x in by.items()
                      if gg == g and (m == base or (guard_of(m)[0] == base and guard_of(m)[1] == "depth"))})
        best = max(fixed, key=fixed.get)
        r["hindsight_best"] = best
        r["hindsight_speedup"] = fixed[best]
        r["vs_hindsight"] = round(r["speedup_vs_ar"] / fixed[best], 3)
        if base in fixed:
            r["unguarded_speedup"] = fixed[base]
    return rows


def plan_summary(outs: list) -> dict:
    """A controller's decisions over the given runner outputs: mean planned depth (EESD's K, SAGE's tree depth),
    width and nodes, and the Pearson r between SAGE's confidence alpha and the drafts accepted at that step (its
    claim: confident steps plan deeper trees and accept more). Empty for methods without a controller."""
    plans = [(o[5], o[1][1:]) for o in outs if len(o) > 5 and o[5]]
    if not plans:
        return {}
    row = {}
    for k, name in (("depth", "planned_depth"), ("width", "tree_width"), ("nodes", "tree_nodes"),
                    ("speculated", "speculated_share")):
        v = [x for p, _ in plans for x in p.get(k, [])]
        if v:
            row[name] = round(float(np.mean(v)), 2)
    pairs = [(al, a - 1) for p, acc in plans for al, a in zip(p.get("alpha", []), acc) if np.isfinite(al)]
    if len(pairs) > 2:
        al, ac = np.asarray(pairs, np.float64).T
        if al.std() > 0 and ac.std() > 0:
            row["alpha_accept_r"] = round(float(np.corrcoef(al, ac)[0, 1]), 3)
    return row


def markdown(summary: dict) -> str:
    rows = summary["rows"]
    cols = ["group", "method", "turns", "mean_accepted", "drafts_per_step", "planned_depth", "speculated_share",
            "tree_width", "tree_nodes", "alpha_accept_r", "step_cost_ar_steps", "tokens_s", "speedup_vs_ar",
            "unguarded_speedup", "hindsight_best", "hindsight_speedup", "vs_hindsight", "equal_to_ar"]
    return "\n".join(report.markdown_table(rows, [c for c in cols if any(c in r for r in rows)], missing="-"))


def plot(summary: dict, path: str) -> str | None:
    """Speedup over jspec AR per category, one bar per method."""
    meta = summary.get("meta", {})
    return report.bar_chart(path, [r for r in summary["rows"] if r["method"] != "ar"], "group", "method",
                            "speedup_vs_ar", "wall speedup over jspec AR",
                            f"Spec-Bench, {meta.get('model', '')}, T={meta.get('temperature', '')}, "
                            f"{meta.get('device', '')}")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a `jspec fetch` name")
    ap.add_argument("--categories", nargs="+", default=list(CATEGORIES), choices=CATEGORIES, metavar="CATEGORY")
    ap.add_argument("--questions", type=int, default=2, help="questions per category (0: all)")
    ap.add_argument("--strategies", nargs="+", default=["ar", "pld", "pld-4", "pld-m", "pld-tree"],
                    help="jspec methods: ar, pld (gamma 10), pld-4 (gamma 4), pld-m (8 drafts after a 3-token match, "
                         "2 after a shorter one), pld-tree (3 branches of 4); over the "
                         "model's shipped trained drafter: eesd (Beta-TS), eesd-cali, eesd-k2/3/4/6/8 (fixed K), "
                         "sage-eesd; self-sd (layer skipping, a chain of 4, in the target's cache; self-sd-own: with a cache of its own); eagle-c2/3/4/5/6/8 (the EAGLE head's chains), "
                         "eagle-tree (EAGLE-1's tree), eagle2 (EAGLE-2's dynamic tree), sage-eagle; "
                         "eagle3-c2/3/4/6, eagle3-tree, eagle3 (dynamic tree), sage-eagle3 (an EAGLE-3 head); "
                         "dflash-chain, dflash-c3/4/5, dflash-tree (a block drafter's chains and DDTree); each "
                         "also with bfloat16 weights as NAME-bf16, and over a head of its kind in a directory as "
                         "NAME@DIR; NAME+guard runs it under jspec.Guarded (NAME+guard-rR: at rate R), "
                         "NAME+depthK every round at depth K "
                         "(the guard's fixed choices: the summary compares the guard with the best in hindsight)")
    ap.add_argument("--baselines", nargs="*", default=list(HF_METHODS), help="transformers baselines: hf (generate), "
                                                                              "hf-pld (its prompt lookup); none: omit")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--runs", type=int, default=1, help="interleaved timed runs (medians)")
    ap.add_argument("--first-turn-only", action="store_true")
    ap.add_argument("--pad-to", type=int, default=16, help="prompt widths padded to a multiple of this (programs "
                                                           "shared by nearby lengths; the default is decode's own: "
                                                           "a wider one compiles fewer programs and prefills more "
                                                           "padding rows for every method)")
    ap.add_argument("--batch", type=int, default=1, help="turns decoded together as one ragged batch (jspec methods "
                                                         "only; the summary then reports the overall group)")
    ap.add_argument("--ignore-eos", action="store_true", help="decode exactly --max-new-tokens per answer, EOS "
                                                              "included (EESD's protocol; jspec methods only)")
    ap.add_argument("--out", default="bench_out")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="jspec bench spec-bench", description=__doc__.split("\n")[0])
    add_arguments(ap)
    a = ap.parse_args(argv)
    return run(a.model, tuple(a.categories), a.questions or None, tuple(a.strategies),
               tuple(b for b in a.baselines if b != "none"), a.max_new_tokens, a.temperature, a.runs,
               not a.first_turn_only, a.pad_to, a.out, batch=a.batch, ignore_eos=a.ignore_eos)
