"""Why greedy SD's tokens differ from greedy AR's in bf16 on a GPU, and whether they do in f32.

    python -m jspec.tools.bench.numerics [--pairs 'random damped 7B,zoo text'] [--out bench_out]
    python -m jspec.tools.bench.numerics --quick          # CPU smoke run, tiny random pair (its numbers mean nothing)

For the pairs of the `gpu` bench suite (`jspec/tools/bench/zoo.py`): the random damped pair in its 7B shape (rows decoded one
at a time, batch 1, as the suite does) and the zoo text pair (one batch of held-out prompts from every evaluation
scenario; `zoo image` on request), greedy AR and greedy SD (Chain g=3, g=5, Tree mc_sim_7b_63, DynamicTree
6x10/60) with `jspec.decode`, in three numeric variants of the same weights (every weight is bf16-representable:
the random pair is made in bf16, the zoo stores bf16):
  bf16         params and activations in bf16 (dots accumulate in f32), as the gpu suite ran;
  f32          params cast to f32, JAX's default matmul precision: on an H100 that is TF32 (10-bit mantissa);
  f32-highest  f32 with `jax.default_matmul_precision("highest")` (true f32 dots). `--highest auto` (default)
               runs it only for AR and the strategies whose f32 tokens differ from AR's, and only off the CPU
               (where default precision is already true f32).
Per (pair, variant, strategy): how many rows' tokens differ from AR's (same variant) and, for each such row, at
the first divergence position j: the target's logits there recomputed by a plain full forward, teacher-forced
over the prompt + the variant's AR tokens before j (`ports.logits`), once with the f32 weights at highest
precision (the reference) and once with the bf16 model. Reported: the reference top-2 margin, the bf16 resolution
at the top logit (the spacing of bf16 numbers there, 2^(floor(log2|x|) - 7)), their ratio ("margin in bf16 ulps"),
the bf16 model's own margin, which token each forward picks (AR's, SD's or another), and where the margin falls in
the distribution over every generated position (the baseline, with the bf16-vs-f32 perturbation of the top-2 gap
there: the size of the noise bf16 puts on a decision).

Why bf16 can differ at all: an SD step verifies several tokens in one target forward, a k-row matmul / attention
with different reduction shapes (and XLA kernels, tilings, summation order) than AR's one-row step. In exact
arithmetic the logits are the same; in bf16 they differ in the last bits, and the KV entries written by the two
paths differ too, so a position whose top-2 logits are within bf16 rounding can go either way.

Writes <out>/gpu-numerics[-<pairs>][-quick]-<date>.{json,md,png} (device kind, jax version, variants, date; the
pairs are named in the file name when --pairs picks other than the default) and prints the tables. 
Budget on an H100: the 7B programs take ~15-25 s each to compile (32 unrolled layers): five strategies x two
variants + two teacher-forced forwards ~ 4 min; the zoo text pair ~1 min; total ~5-6 min, ~1.5 min more when
f32-highest runs (auto: only where f32 differs). `--layers 8` cuts the 7B pair's compile time by about 4x.
Runs without installing jspec (PYTHONPATH=. from the repo root): beyond jax and numpy it needs what jspec imports
(tqdm, safetensors, transformers for the zoo tokenizers) and matplotlib for the plot (skipped when missing).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", ".9")  # the 7B pair holds bf16 + f32 weights (~41 GB)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jspec.core import provenance as PV  # noqa: E402
from jspec.tools import report  # noqa: E402

PAIRS = ("random damped 7B", "zoo text", "zoo image")
ALIASES = {"random": "random damped 7B", "random damped": "random damped 7B", "7b": "random damped 7B",
           "text": "zoo text", "image": "zoo image"}
DEFAULT_PAIRS = ("random damped 7B", "zoo text")
STRATEGIES = ("AR", "Chain g=3", "Chain g=5", "Tree mc_sim_7b_63", "DynamicTree 6x10/60")
VARIANTS = ("bf16", "f32", "f32-highest")
SHAPE_7B = dict(layers=32, vocab=32000, hidden=4096, mlp=11008, heads=32)
SHAPE_QUICK = dict(layers=2, vocab=512, hidden=64, mlp=128, heads=4)
BF16_MANTISSA_BITS = 7  # stored fraction bits: numbers in [2^e, 2^(e+1)) are 2^(e-7) apart
BF16_MIN_SPACING = 2.0 ** -133  # subnormal spacing (2^-126 * 2^-7)


# ------------------------------------------------------------------------------------------------ pure helpers


def bf16_resolution(x) -> np.ndarray:
    """The spacing of bfloat16 numbers at magnitude |x|: 2^(floor(log2|x|) - 7) (one ulp of a bf16 number there);
    2^-133 (the subnormal spacing) at 0 and below 2^-126."""
    a = np.abs(np.asarray(x, np.float64))
    _, e = np.frexp(a)  # a = m * 2^e with m in [0.5, 1): floor(log2 a) = e - 1
    res = np.ldexp(1.0, (e - 1 - BF16_MANTISSA_BITS).astype(np.int32))
    return np.where(a > 0, np.maximum(res, BF16_MIN_SPACING), BF16_MIN_SPACING)


def first_divergence(a, b) -> int | None:
    """The first index where token rows a and b differ (the shorter length when one is a strict prefix of the
    other); None when they are equal."""
    a, b = np.asarray(a).ravel(), np.asarray(b).ravel()
    n = min(len(a), len(b))
    d = np.flatnonzero(a[:n] != b[:n])
    if len(d):
        return int(d[0])
    return None if len(a) == len(b) else n


def top2(logits) -> tuple[int, int, float, float]:
    """(argmax, runner-up, their values) of a 1-D logit row (ties: the lower index first, as argmax)."""
    x = np.asarray(logits, np.float64)
    i1 = int(np.argmax(x))
    y = x.copy()
    y[i1] = -np.inf
    i2 = int(np.argmax(y))
    return i1, i2, float(x[i1]), float(x[i2])


def margins(logits) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Row-wise over [..., V]: (top-1 index, top-2 index, top-1 value, top-1 - top-2)."""
    x = np.asarray(logits, np.float32)
    i1 = np.argmax(x, axis=-1)
    v1 = np.take_along_axis(x, i1[..., None], -1)[..., 0]
    y = x.copy()
    np.put_along_axis(y, i1[..., None], -np.inf, -1)
    i2 = np.argmax(y, axis=-1)
    v2 = np.take_along_axis(x, i2[..., None], -1)[..., 0]
    return i1, i2, v1, v1 - v2


def pick(logits, ar_tok, sd_tok) -> str:
    """Which token a forward's argmax is: 'AR' (AR's token), 'SD' (SD's) or 'other'."""
    i = int(np.argmax(np.asarray(logits)))
    return "AR" if i == ar_tok else "SD" if i == sd_tok else "other"


def divergence_record(ref_logits, bf_logits, ar_tok: int, sd_tok: int, baseline_ulps=None) -> dict:
    """The numbers at one first divergence: `ref_logits` (f32 weights, highest precision) and `bf_logits` (the bf16
    model) are the [V] logits predicting the diverging token, teacher-forced on the common prefix."""
    r1, r2, v1, v2 = top2(ref_logits)
    res = float(bf16_resolution(v1))
    margin = v1 - v2
    _, _, w1, w2 = top2(bf_logits)
    ref, bf = np.asarray(ref_logits, np.float64), np.asarray(bf_logits, np.float64)
    gap_ref = float(ref[ar_tok] - ref[sd_tok])
    gap_bf = float(bf[ar_tok] - bf[sd_tok])
    out = dict(ar_token=int(ar_tok), sd_token=int(sd_tok), ref_top1=r1, ref_top2=r2, ref_top_logit=_f(v1),
               ref_margin=_f(margin), bf16_resolution=res, margin_bf16_ulps=_f(margin / res),
               ar_sd_are_ref_top2=bool({r1, r2} == {int(ar_tok), int(sd_tok)}),
               ref_gap_ar_minus_sd=_f(gap_ref), ref_gap_bf16_ulps=_f(abs(gap_ref) / res),
               bf16_margin=_f(w1 - w2), bf16_margin_ulps=_f((w1 - w2) / float(bf16_resolution(w1))),
               bf16_gap_ar_minus_sd=_f(gap_bf), gap_perturbation=_f(abs(gap_bf - gap_ref)),
               ref_picks=pick(ref, ar_tok, sd_tok), bf16_picks=pick(bf, ar_tok, sd_tok))
    if baseline_ulps is not None and len(baseline_ulps):
        out["margin_percentile"] = _f(100.0 * float(np.mean(np.asarray(baseline_ulps) <= margin / res)), 2)
    return out


def _f(x, n: int = 6):
    x = float(x)
    return x if not math.isfinite(x) else float(f"{x:.{n}g}")


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# ------------------------------------------------------------------------------------------------ pairs


@dataclasses.dataclass
class NumericsPair:
    name: str
    target: Any
    draft: Any
    rows: list          # prompt token rows (1-D int arrays, unpadded)
    labels: list        # a label per row (scenario)
    inputs: dict        # modality inputs of the whole batch (pixel_values), {} for text
    eos: Any            # eos_token_id for jspec.decode (() = never stop; None = the checkpoint's)
    new_tokens: int
    batch1: bool        # decode the rows one at a time (the gpu suite's batch 1) instead of as one batch

    def prompt(self, rows=None):
        rows = self.rows if rows is None else rows
        return {"input_ids": list(rows), **self.inputs} if self.inputs else list(rows)


def build_pair(name: str, quick: bool, n_prompts: int, new_tokens: int, layers: int | None) -> NumericsPair:
    from jspec.tools.bench import zoo as BENCH

    if name == "random damped 7B":
        shape = dict(SHAPE_QUICK if quick else SHAPE_7B)
        if layers:
            shape["layers"] = layers
        t, d = BENCH.damped_pair(dtype=jnp.bfloat16, **shape)  # as `bench.suite_gpu` makes it
        rng = np.random.default_rng(1)  # the suite's seed: row 0 is the prompt of the recorded gpu run
        P = 12 if quick else 128
        rows = [rng.integers(0, t.vocab_size, P).astype(np.int32) for _ in range(n_prompts)]
        return NumericsPair(name, t, d, rows, ["random"] * len(rows), {}, (), new_tokens, batch1=True)
    from jspec.tools.zoo import evaluate as ZE

    kind = name.split()[-1]
    pair = ZE.load_pair(kind)
    scen = ZE.scenario_examples(kind, max(1, math.ceil(n_prompts / (6 if kind == "image" else 5))))
    exs, labels = [], []
    for k in range(max(len(v) for v in scen.values())):  # round-robin over scenarios
        for sc, v in scen.items():
            if k < len(v) and len(exs) < n_prompts:
                exs.append(v[k])
                labels.append(sc)
    bp = ZE.batch_prompt(pair.encoder, exs)
    rows = [np.asarray(r, np.int32) for r in bp["input_ids"]]
    inputs = {k: v for k, v in bp.items() if k != "input_ids"}
    return NumericsPair(name, pair.target, pair.draft, rows, labels, inputs, None, new_tokens, batch1=False)


def cast_models(models, dtype):
    """The models with floating leaves cast to dtype; a leaf shared between models (the damped pair's draft shares
    the target's embeddings, head and first layer) is cast once and stays shared."""
    memo: dict = {}

    def c(a):
        if not jnp.issubdtype(a.dtype, jnp.floating) or a.dtype == dtype:
            return a
        if id(a) not in memo:
            memo[id(a)] = (a, a.astype(dtype))
        return memo[id(a)][1]

    return [jax.tree.map(c, m) for m in models]


def precision(variant: str):
    return jax.default_matmul_precision("highest") if variant == "f32-highest" else contextlib.nullcontext()


def strategies(draft, quick: bool, names: tuple[str, ...] | None = None) -> list[tuple[str, Any]]:
    """The gpu suite's strategies (`bench.sd_strategies`; --quick: its small set), restricted to `names`."""
    from jspec.tools.bench import zoo as BENCH

    table = [(n, s) for n, s, _ in BENCH.sd_strategies(draft, quick) if quick or n in STRATEGIES]
    unknown = [n for n in names or () if n not in dict(table)]
    if unknown:
        raise ValueError(f"unknown strategy name(s) {unknown}; this run has {[n for n, _ in table]}")
    return [(n, s) for n, s in table if names is None or n in names]


# ------------------------------------------------------------------------------------------------ measuring


def decode_variant(pair: NumericsPair, target, draft, variant: str, names, quick: bool, log) -> dict:
    """name -> {tokens: [per-row arrays], seconds (first call: compile included), mean_accepted}."""
    import jspec

    out = {}
    for name, strat in strategies(draft, quick, names):
        t0 = time.perf_counter()
        toks, acc = [], []
        groups = [[r] for r in pair.rows] if pair.batch1 else [pair.rows]
        with precision(variant):
            for g in groups:
                o = jspec.decode(target, pair.prompt(g), strategy=strat, max_new_tokens=pair.new_tokens,
                                 eos_token_id=pair.eos)
                toks += [np.asarray(o.tokens[b, :o.lengths[b]]) for b in range(len(g))]
                acc += list(np.asarray(o.stats["mean_accepted"], np.float64))
        dt = time.perf_counter() - t0
        out[name] = dict(tokens=toks, seconds=dt, mean_accepted=float(np.nanmean(acc)) if acc else float("nan"))
        log(f"  {pair.name} | {variant} | {name}: {dt:.1f} s, tau {out[name]['mean_accepted']:.2f}")
    return out


def teacher_forced(model, pair: NumericsPair, gens: list, variant: str) -> list[np.ndarray]:
    """Per row, the [len(gen), V] float32 logits that predict each generated token, from one full forward over the
    prompt + the generated tokens (right-padded to a multiple of 64 with 0: causal, so padding changes nothing
    before it)."""
    import ports

    image_id = getattr(pair.target.config, "image_token_id", None)
    # a generated image placeholder would ask the forward for an image: stop the row before it
    gens = [g if image_id is None or image_id not in g else g[:int(np.flatnonzero(g == image_id)[0])]
            for g in gens]
    seqs = [np.concatenate([p, g]).astype(np.int32) for p, g in zip(pair.rows, gens)]
    T = round_up(max(len(s) for s in seqs), 64)
    toks = np.zeros((len(seqs), T), np.int32)
    for b, s in enumerate(seqs):
        toks[b, :len(s)] = s
    with precision(variant):
        lg = ports.logits(model, {"input_ids": toks, **pair.inputs} if pair.inputs else toks)
    # the logits at position t predict token t + 1: generated token j of row b is predicted at len(prompt) - 1 + j
    return [np.asarray(lg[b, len(p) - 1:len(p) - 1 + len(g)], np.float32)
            for b, (p, g) in enumerate(zip(pair.rows, gens))]


def baseline(ref: list, bf: list, ar: list) -> tuple[dict, np.ndarray]:
    """Over every generated position of a variant's AR rows: the reference margin in bf16 ulps (returned, for
    percentiles), the bf16-vs-f32 perturbation of the reference top-2 gap, and whether each teacher-forced
    forward's argmax is AR's token (a check on the position bookkeeping: ~1.0 in f32)."""
    R = np.concatenate([r for r in ref if len(r)])
    Bf = np.concatenate([b for b in bf if len(b)])
    A = np.concatenate([np.asarray(a[:len(r)]) for a, r in zip(ar, ref) if len(r)])
    i1, i2, v1, m = margins(R)
    ulps = m / bf16_resolution(v1)
    idx = np.arange(len(R))
    gap_bf = Bf[idx, i1] - Bf[idx, i2]
    pert = np.abs(gap_bf - m)
    pert_ulps = pert / bf16_resolution(v1)
    q = lambda x, p: _f(np.percentile(x, p))
    stats = dict(positions=int(len(R)), ref_argmax_is_ar=_f(np.mean(i1 == A), 4),
                 bf16_argmax_is_ar=_f(np.mean(np.argmax(Bf, -1) == A), 4),
                 margin_ulps_p1=q(ulps, 1), margin_ulps_p5=q(ulps, 5), margin_ulps_median=q(ulps, 50),
                 frac_margin_below_1ulp=_f(np.mean(ulps < 1), 4), frac_margin_below_4ulp=_f(np.mean(ulps < 4), 4),
                 perturbation_median=q(pert, 50), perturbation_p99=q(pert, 99),
                 perturbation_ulps_median=q(pert_ulps, 50), perturbation_ulps_p99=q(pert_ulps, 99),
                 top_logit_median=q(np.abs(v1), 50))
    return stats, ulps


def analyse_variant(pair: NumericsPair, v: str, res: dict, ref_model, bf_model) -> tuple[list, list, dict, dict]:
    """The rows, first-divergence records, baseline and histogram data of one variant's decodes `res`."""
    ar = res["AR"]["tokens"]
    # teacher-forced logits of this variant's AR rows: the reference (f32 weights, highest) and the bf16 model
    ref = teacher_forced(ref_model, pair, ar, "f32-highest")
    bfl = teacher_forced(bf_model, pair, ar, "bf16")
    base, base_ulps = baseline(ref, bfl, ar)
    hist = {"baseline_ulps": base_ulps, "divergence_ulps": []}
    rows, divs = [], []
    for sname, r in res.items():
        if sname == "AR":
            continue
        sd = r["tokens"]
        firsts = [first_divergence(a, s) for a, s in zip(ar, sd)]
        recs = []
        for b, j in enumerate(firsts):
            if j is None:
                continue
            rec = dict(pair=pair.name, variant=v, strategy=sname, row=b, label=pair.labels[b], position=j,
                       ar_len=int(len(ar[b])), sd_len=int(len(sd[b])))
            if j < min(len(ar[b]), len(sd[b]), len(ref[b])):  # (else: one row ended; nothing to compare)
                rec.update(divergence_record(ref[b][j], bfl[b][j], int(ar[b][j]), int(sd[b][j]), base_ulps))
                hist["divergence_ulps"].append(rec["margin_bf16_ulps"])
            recs.append(rec)
        divs += recs
        m = [x for x in recs if "ref_margin" in x]
        ulps = [x["margin_bf16_ulps"] for x in m]
        rows.append(dict(pair=pair.name, variant=v, strategy=sname, rows=len(ar), rows_differ=len(recs),
                         same_tokens_as_ar=not recs, first_divergences=[x["position"] for x in recs],
                         tau=_f(r["mean_accepted"], 4), decode_s=_f(r["seconds"], 3),
                         median_margin_ulps=_f(np.median(ulps)) if ulps else None,
                         max_margin_ulps=_f(np.max(ulps)) if ulps else None,
                         within_noise=sum(x["ref_margin"] <= base["perturbation_p99"] for x in m) if m else None,
                         ref_picks_ar=sum(x["ref_picks"] == "AR" for x in m) if m else None))
    return rows, divs, base, hist


def run_pair(name: str, args, log) -> dict:
    t_pair = time.perf_counter()
    pair = build_pair(name, args.quick, args.prompts, args.new_tokens, args.layers)
    bf_models = cast_models([pair.target, pair.draft], jnp.bfloat16)
    f32_models = cast_models([pair.target, pair.draft], jnp.float32)
    pair.target, pair.draft = bf_models  # (only its config is read from here on)
    log(f"{name}: {len(pair.rows)} rows, {pair.new_tokens} new tokens, target {bf_models[0].num_params / 1e6:.1f}M "
        f"params, batch {'1 (rows apart)' if pair.batch1 else len(pair.rows)}")
    models = {"bf16": bf_models, "f32": f32_models}
    runs: dict[str, dict] = {}
    for v in [v for v in args.variants if v != "f32-highest"]:
        runs[v] = decode_variant(pair, *models[v], v, args.strategies, args.quick, log)
    names = ()
    if "f32-highest" in args.variants or args.highest == "always":
        names = args.strategies
    elif args.highest == "auto" and "f32" in runs and jax.default_backend() != "cpu":
        f32_ar = runs["f32"]["AR"]["tokens"]
        differ = [n for n, r in runs["f32"].items() if n != "AR" and _rows_differ(r["tokens"], f32_ar)]
        names = ("AR", *differ) if differ else ()
    if names is None or names:
        log(f"  f32-highest for {'every strategy' if names is None else list(names)}")
        runs["f32-highest"] = decode_variant(pair, *f32_models, "f32-highest", names, args.quick, log)

    t_tf = time.perf_counter()
    rows, divs, bases, hist = [], [], {}, {}
    for v, res in runs.items():
        r, d, bases[v], hist[v] = analyse_variant(pair, v, res, f32_models[0], bf_models[0])
        rows += r
        divs += d
    log(f"  teacher-forced forwards: {time.perf_counter() - t_tf:.1f} s; pair: {time.perf_counter() - t_pair:.1f} s")
    bf_ar = runs["bf16"]["AR"]["tokens"] if "bf16" in runs else None
    ar_rows = [dict(pair=name, variant=v, strategy="AR", rows=len(r["AR"]["tokens"]),
                    decode_s=_f(r["AR"]["seconds"], 3),
                    rows_equal_bf16_ar=None if v == "bf16" or bf_ar is None else
                    sum(first_divergence(a, b) is None for a, b in zip(r["AR"]["tokens"], bf_ar)))
               for v, r in runs.items()]
    out = dict(pair=name, rows=rows, ar=ar_rows, divergences=divs,
               baselines=[dict(pair=name, variant=v, **b) for v, b in bases.items()],
               hist={v: {k: [float(x) for x in np.asarray(h[k])] for k in h} for v, h in hist.items()},
               params_m=_f(bf_models[0].num_params / 1e6, 5), new_tokens=pair.new_tokens,
               batch=1 if pair.batch1 else len(pair.rows), seconds=_f(time.perf_counter() - t_pair, 4))
    del bf_models, f32_models, models, runs
    jax.clear_caches()
    return out


def _rows_differ(toks, ref) -> bool:
    return any(first_divergence(a, b) is not None for a, b in zip(toks, ref))


# ------------------------------------------------------------------------------------------------ output


def table(rows: list[dict], cols: list[str]) -> str:
    return "\n".join(report.markdown_table(rows, cols))


SUMMARY_COLS = ["pair", "variant", "strategy", "rows", "rows_differ", "first_divergences", "tau", "median_margin_ulps",
                "max_margin_ulps", "within_noise", "ref_picks_ar", "decode_s"]
DIV_COLS = ["pair", "variant", "strategy", "row", "label", "position", "ar_token", "sd_token", "ref_top_logit",
            "ref_margin", "bf16_resolution", "margin_bf16_ulps", "margin_percentile", "ar_sd_are_ref_top2",
            "bf16_margin_ulps", "gap_perturbation", "ref_picks", "bf16_picks"]
BASE_COLS = ["pair", "variant", "positions", "ref_argmax_is_ar", "bf16_argmax_is_ar", "margin_ulps_p1",
             "margin_ulps_p5", "margin_ulps_median", "frac_margin_below_1ulp", "frac_margin_below_4ulp",
             "perturbation_median", "perturbation_p99", "perturbation_ulps_p99", "top_logit_median"]


def verdicts(result: dict) -> list[str]:
    out = []
    for p in result["pairs"]:
        for v in dict.fromkeys(r["variant"] for r in p["rows"]):
            rs = [r for r in p["rows"] if r["variant"] == v]
            n_diff = sum(r["rows_differ"] for r in rs)
            line = (f"- {p['pair']}, {v}: {'every' if not n_diff else 'not every'} strategy gives AR's tokens "
                    f"({n_diff} of {sum(r['rows'] for r in rs)} strategy-rows differ)")
            ds = [d for d in result["divergences"]
                  if d["pair"] == p["pair"] and d["variant"] == v and "ref_margin" in d]
            if ds:
                base = next(b for b in result["baselines"] if b["pair"] == p["pair"] and b["variant"] == v)
                ulps = [d["margin_bf16_ulps"] for d in ds]
                line += (f"; at the {len(ds)} first divergences the f32 top-2 margin is {min(ulps):.3g}-"
                         f"{max(ulps):.3g} bf16 ulps (median {np.median(ulps):.3g}; over all positions: median "
                         f"{base['margin_ulps_median']}, {100 * base['frac_margin_below_1ulp']:.2g}% below 1 ulp), "
                         f"{sum(d['ref_margin'] <= base['perturbation_p99'] for d in ds)} within the bf16 "
                         f"perturbation's p99 ({base['perturbation_p99']}), AR's and SD's tokens are the reference "
                         f"top-2 in {sum(d['ar_sd_are_ref_top2'] for d in ds)}; the f32 reference picks AR's token "
                         f"in {sum(d['ref_picks'] == 'AR' for d in ds)}, SD's in "
                         f"{sum(d['ref_picks'] == 'SD' for d in ds)}")
            out.append(line)
    return out


def markdown(result: dict) -> str:
    m = result["meta"]
    out = [f"# SD vs AR token numerics, {m['date']}", "",
           f"{m['device_kind']} ({m['backend']}), jax {m['jax']}, variants {', '.join(m['variants'])} "
           f"(f32 = JAX's default matmul precision, `jax_default_matmul_precision` = "
           f"`{m['default_matmul_precision']}`: TF32 dots on Ampere/Hopper GPUs, true f32 on a CPU; "
           f"f32-highest = true f32 dots){', quick smoke run: numbers mean nothing' if m['quick'] else ''}. "
           f"Margins: top-1 minus top-2 logit of a plain full forward, teacher-forced on the variant's AR tokens, "
           f"with the f32 weights at highest precision; 'ulps' = margin / bf16 spacing at the top logit "
           f"(2^(floor(log2|x|) - 7)). 'within_noise': divergences whose reference margin is at most the p99 over "
           f"all positions of |bf16 gap - f32 gap| of the top-2 (the bf16 model's perturbation of a decision). "
           f"Total {m['seconds']} s.", "", "## Verdicts", "", *verdicts(result), "", "## Per strategy", "",
           table(result["rows"], SUMMARY_COLS), "", "## AR per variant", "",
           table(result["ar"], ["pair", "variant", "rows", "decode_s", "rows_equal_bf16_ar"]), "",
           "## First divergences", ""]
    out.append(table(result["divergences"], DIV_COLS) if result["divergences"] else "none")
    out += ["", "## Baseline: every generated position of the variant's AR rows", "",
            table(result["baselines"], BASE_COLS)]
    return "\n".join(out) + "\n"


def plot(result: dict, path: str) -> str | None:
    """Per pair: the reference margin in bf16 ulps (log scale) at every generated position (density, grey) and at
    the first divergences (counts, per variant)."""
    pairs = result["pairs"]
    if not pairs:
        return None
    m = result["meta"]
    lo = lambda x: np.log10(np.maximum(np.asarray(x, np.float64), 1e-3))  # noqa: E731
    bins = np.linspace(-3, 5, 49)
    with report.figure(path, 1, len(pairs), figsize=(5.2 * len(pairs), 3.4), dpi=120,
                       title=f"SD vs AR first divergences, {m['device_kind']}, jax {m['jax']}") as fa:
        if fa is None:
            return None
        for ax, p in zip(fa[1][0], pairs):
            base = p["hist"].get("bf16") or next(iter(p["hist"].values()), {})
            if base.get("baseline_ulps"):
                ax.hist(lo(base["baseline_ulps"]), bins, density=True, histtype="step", color="gray",
                        label="all positions (density)")
            ax2 = ax.twinx()
            for v, h in p["hist"].items():
                if h["divergence_ulps"]:
                    ax2.hist(lo(h["divergence_ulps"]), bins, alpha=0.6, label=f"first divergences, {v}")
            ax.axvline(0.0, color="k", lw=0.8, ls="--", label="1 bf16 ulp")
            b = next((x for x in result["baselines"] if x["pair"] == p["pair"] and x["variant"] == "bf16"), None)
            if b and b["perturbation_ulps_p99"] and b["perturbation_ulps_p99"] > 0:
                ax.axvline(math.log10(b["perturbation_ulps_p99"]), color="r", lw=0.8, ls=":",
                           label="p99 bf16-vs-f32 perturbation")
            ax.set_xlabel("log10(top-2 margin / bf16 spacing at top logit)")
            ax.set_ylabel("density")
            ax2.set_ylabel("divergences")
            ax.set_title(p["pair"], fontsize=9)
            h1, l1 = ax.get_legend_handles_labels()
            h2, l2 = ax2.get_legend_handles_labels()
            ax.legend(h1 + h2, l1 + l2, fontsize=6, loc="upper right")
    return path


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", default=None,
                    help=f"comma-separated from {list(PAIRS)} (aliases: random, text, image); default "
                         f"{', '.join(DEFAULT_PAIRS)} (--quick: the tiny random pair)")
    ap.add_argument("--variants", default="bf16,f32", help=f"comma-separated from {list(VARIANTS)}")
    ap.add_argument("--highest", choices=("auto", "always", "never"), default="auto",
                    help="f32-highest: auto = only AR + the strategies whose f32 tokens differ, off the CPU")
    ap.add_argument("--prompts", type=int, default=None, help="rows per pair (default: 4 random, 15 zoo; quick 3)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 64 (quick 16)")
    ap.add_argument("--layers", type=int, default=None, help="layers of the random damped pair (default 32)")
    ap.add_argument("--strategies", default=None,
                    help=f"comma-separated strategy names (AR always runs); default {', '.join(STRATEGIES[1:])} "
                         f"(--quick: the bench's small set: Chain g=3, Tree [[0],[1],[0,0]], DynamicTree 3x3/6)")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: tiny random pair, small strategies")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    if args.pairs is None:
        args.pairs = ("random damped 7B",) if args.quick else DEFAULT_PAIRS
    else:
        args.pairs = tuple(ALIASES.get(p.strip().lower(), p.strip()) for p in args.pairs.split(",") if p.strip())
    bad = [p for p in args.pairs if p not in PAIRS]
    if bad:
        ap.error(f"unknown pair(s) {bad}; choose from {list(PAIRS)}")
    args.strategies = None if args.strategies is None else (
        "AR", *(n.strip() for n in args.strategies.split(",") if n.strip() and n.strip() != "AR"))
    args.variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants:
        ap.error(f"unknown variant(s) {bad}; choose from {list(VARIANTS)}")
    return args


def write(args, pairs: list, t0: float, argv) -> dict:
    """The result so far (every finished pair), written to <out>/gpu-numerics[-<pairs>][-quick]-<date>.*."""
    dev = jax.devices()[0]
    meta = dict(date=time.strftime("%Y-%m-%d"), device_kind=dev.device_kind, device=PV.device_model(),
                provenance=PV.provenance(),
                backend=jax.default_backend(), jax=jax.__version__, cpus=os.cpu_count(),
                variants=list(dict.fromkeys(r["variant"] for p in pairs for r in p["ar"])) or list(args.variants),
                highest=args.highest, quick=args.quick, pairs_done=[p["pair"] for p in pairs],
                pairs_asked=list(args.pairs), default_matmul_precision=str(getattr(jax.config, "jax_default_matmul_precision", None)),
                seconds=_f(time.perf_counter() - t0, 4), argv=list(sys.argv[1:] if argv is None else argv))
    result = dict(meta=meta, pairs=pairs, rows=[r for p in pairs for r in p["rows"]],
                  ar=[r for p in pairs for r in p["ar"]], divergences=[d for p in pairs for d in p["divergences"]],
                  baselines=[b for p in pairs for b in p["baselines"]])
    os.makedirs(args.out, exist_ok=True)
    # a run of a non-default set of pairs is tagged with them, so that runs split across calls do not overwrite
    default = ("random damped 7B",) if args.quick else DEFAULT_PAIRS
    short = {"random damped 7B": "random", "zoo text": "text", "zoo image": "image"}
    tag = "" if args.pairs == default else "".join("-" + short[p] for p in args.pairs)
    stem = os.path.join(args.out, f"gpu-numerics{tag}{'-quick' if args.quick else ''}-{meta['date']}")
    report.write_json(stem + ".json", result, indent=1)
    result["markdown"] = markdown(result)
    report.write_text(stem + ".md", result["markdown"])
    result["files"] = [stem + ".json", stem + ".md"] + ([stem + ".png"] if plot(result, stem + ".png") else [])
    return result


def main(argv=None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    log = lambda s: print(s, flush=True)
    dev = jax.devices()[0]
    log(f"device {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, pairs {list(args.pairs)}, "
        f"variants {list(args.variants)}")
    pairs = []
    for name in args.pairs:
        n = args.prompts or (3 if args.quick else 4 if name.startswith("random") else 15)
        a = argparse.Namespace(**{**vars(args), "prompts": n,
                                  "new_tokens": args.new_tokens or (16 if args.quick else 64)})
        pairs.append(run_pair(name, a, log))
        result = write(args, pairs, t0, argv)  # after every pair: a run cut short keeps what it finished
    log("\n" + result["markdown"])
    log("wrote " + ", ".join(result["files"]))
    return result


if __name__ == "__main__":
    main()
