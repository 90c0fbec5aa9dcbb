"""The benchmark harness behind `jspec bench`: named suites, medians, ratios, tables, plots.

Suites:
  ar   greedy AR tokens/s, jspec vs transformers `generate`, same weights, fixed output length (EOS ignored), on
       the zoo text target (when shipped) and a ~106M-parameter random LLaMA, batch 1 and 8.
  sd   per strategy (AR, Chain at several gammas, Tree with each shipped static tree, DynamicTree) on a
       target/draft pair, per scenario: mean accepted length (incl. bonus), block efficiency (tokens per target
       step), tokens/s, wall and decode-loop speedup over jspec AR, the speedup predicted from the measured tau
       and step times (tau x AR step / SD step, both timed inside one program, `jspec.engine.profiling.in_program_costs`,
       in the same round as the measurement it is compared with: the decode loop's excess over it is the engine's
       overhead), the phases (draft, verify, rule-and-commit) timed
       alike and the prediction from their sum, the fused loop's time per step beside them, and transformers'
       assisted generation (same pair, constant gamma) for chain rows.
       Pairs: the zoo text pair (when shipped) on held-out prompts, and a random pair (the target's layers after
       the first damped, the draft = its first layer) with random prompts.
  gpu  in bfloat16 on a lent GPU: `ar` with 7B-shaped random weights and the zoo text target against the HBM
       floor (parameter bytes / measured copy bandwidth) and transformers on the same GPU; `sd` on a 7B-shaped
       damped pair (throughput, transformers' assisted generation beside it) and, in float32, on the zoo pairs
       (acceptance; SD must give AR's tokens there).
       Its parts (GPU_PARTS) run apart with `pairs=`, to fit a run into a lease's time limits.
Every figure is a median over `runs` interleaved runs after a warm-up (compile time reported apart); every speed
is also a ratio to a baseline measured in the same run. `quick=True` shrinks everything to finish in well under
3 minutes on a 2-core CPU (the smoke test's setting; its numbers mean nothing).
"""
from __future__ import annotations

import dataclasses
import math
import os
import statistics
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jspec.core import provenance as PV
from jspec.tools import report

SUITES = ("ar", "sd", "gpu")
med = statistics.median


# ------------------------------------------------------------------------------------------------ models


def random_llama(layers: int = 8, vocab: int = 32000, hidden: int = 768, mlp: int = 2048, heads: int = 12,
                 kv_heads: int | None = None, dtype=jnp.float32, seed: int = 0):
    import ports

    cfg = ports.TextConfig(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
                           num_layers=layers, num_heads=heads, num_kv_heads=kv_heads or heads,
                           head_dim=hidden // heads, eos_token_ids=())
    return ports.random_model(cfg, key=seed, std=0.05, dtype=dtype)


def damped_pair(layers: int = 8, damp: float = 0.05, **shape):
    """A random target whose layers after the first are damped, and the draft = its first layer (same embeddings
    and head): they agree often but not always."""
    import ports

    target = random_llama(layers, **shape)
    params = dict(target.params)
    params["layers"] = [dict(p) for p in params["layers"]]
    for p in params["layers"][1:]:
        p["wo"] = p["wo"] * damp
        p["w_down"] = p["w_down"] * damp
    target = ports.Model(target.config, params)
    draft = ports.Model(dataclasses.replace(target.config, num_layers=1), dict(params, layers=params["layers"][:1]))
    return target, draft


def zoo_text_pair(dtype=None):
    """(target, draft) of the shipped zoo text pair (float32 unless `dtype`), or None when it is not shipped."""
    try:
        from jspec.tools import zoo

        return zoo.load("text-target", dtype), zoo.load("text-draft", dtype)
    except (ImportError, AttributeError, ValueError, FileNotFoundError, OSError):
        return None


def zoo_pairs(n: int) -> dict:
    """The shipped zoo pairs with n held-out prompts per evaluation scenario (`jspec.tools.zoo.evaluate`): name ->
    (target, draft, {scenario: prompts}, eos, max_new). Text-pair prompts are token rows; image-pair prompts are
    processor-style mappings (the draft reads the image: TABED's M view)."""
    from jspec.tools import zoo
    from jspec.tools.zoo import evaluate as ZE

    out = {}
    for name, models in ZE.PAIRS.items():
        if not set(models) <= set(zoo.available()):
            continue
        pair = ZE.load_pair(name)
        scen = {}
        for sc, exs in ZE.scenario_examples(name, n).items():
            ps = [pair.encoder.prompt(ex) for ex in exs]
            scen[sc] = [p["input_ids"][0] for p in ps] if name == "text" else ps
        out[f"zoo {name}"] = (pair.target, pair.draft, scen, None, 96)
    return out


# ------------------------------------------------------------------------------------------------ timing


@dataclasses.dataclass
class Case:
    name: str
    run: Callable[[], Any]  # one full measured call; returns what `check` compares across runs
    meta: dict = dataclasses.field(default_factory=dict)


def interleaved(cases: list[Case], runs: int, progress: bool = True, deadline: float | None = None
                ) -> dict[str, dict]:
    """Warm up every case (compile time = its first call), then time `runs` rounds, every case once per round,
    so a noisy machine's drifts hit all cases alike. Returns per case: first result, compile_s, wall list.
    `deadline` (a `time.time()`): a case whose warm-up, or a round, would likely end after it (judged by the
    slowest warm-up / the last round so far) is left out; the cases that ran come back, with fewer rounds."""
    from tqdm import tqdm

    out = {}
    bar = tqdm(total=len(cases) * (runs + 1), desc="bench", unit="run", disable=not progress, leave=False)
    late = lambda need: deadline is not None and time.time() + need > deadline  # noqa: E731
    for c in cases:
        if out and late(max(o["compile_s"] for o in out.values())):
            break
        t = time.perf_counter()
        first = c.run()
        out[c.name] = {"first": first, "compile_s": time.perf_counter() - t, "wall": [], "results": []}
        bar.update()
    cases = [c for c in cases if c.name in out]
    last = 0.0
    for _ in range(runs):
        if late(last):
            break
        t_round = time.perf_counter()
        for c in cases:
            t = time.perf_counter()
            res = c.run()
            out[c.name]["wall"].append(time.perf_counter() - t)
            out[c.name]["results"].append(res)
            bar.update()
        last = time.perf_counter() - t_round
    bar.close()
    return out


def _ratio(a, b) -> float:
    return float(a / b) if b else float("nan")


def _r(x, n=3):
    return None if x is None else (round(float(x), n) if math.isfinite(float(x)) else float("nan"))


# ------------------------------------------------------------------------------------------------ transformers


_WORKDIR: list[str] = []  # the running suite's scratch directory (removed when `run` returns)


def _torch_device() -> str:
    """Where transformers runs: the GPU when JAX runs on one and torch sees it, else the CPU."""
    import torch

    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def _hf_from(model, name: str):
    """The model as a transformers model in the model's dtype (f32 or bf16) on `_torch_device()`, through an HF
    checkpoint in the suite's scratch directory (removed once loaded)."""
    import shutil

    import torch
    import transformers

    import ports

    bf16 = model.dtype == jnp.bfloat16
    path = tempfile.mkdtemp(prefix=name + "-", dir=_WORKDIR[-1] if _WORKDIR else None)
    ports.save_hf(model, path, dtype=jnp.bfloat16 if bf16 else np.float32)
    # a model that reads images (LLaVA) loads as transformers' image-text-to-text class
    auto = (transformers.AutoModelForImageTextToText if model.family.prompt_embeds is not None else
            transformers.AutoModelForCausalLM)
    hf = auto.from_pretrained(path, dtype=torch.bfloat16 if bf16 else torch.float32)
    hf = hf.to(_torch_device()).eval()
    shutil.rmtree(path, ignore_errors=True)
    return hf


def _free_torch() -> None:
    import gc
    import sys

    if "torch" not in sys.modules:  # nothing of torch's to free (and importing it takes seconds)
        return
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _transformers_usable(dtype) -> bool:
    """transformers baselines run in f32 on CPU and in any dtype on a GPU (bf16 on a CPU would be a straw man)."""
    return dtype == jnp.float32 or _torch_device() == "cuda"


def _hf_generate(hf, rows: list, new_tokens: int | None, assistant=None, gamma: int = 0,
                 eos=None) -> list[np.ndarray]:
    """Greedy generate row by row (batch 1, the setting assisted generation supports). A row is a token array or a
    processor-style mapping (input_ids [1, T], pixel_values, ...: an image pair's prompt, which the assistant
    reads too)."""
    import torch

    outs = []
    for r in rows:
        inputs = {}
        if isinstance(r, dict):
            inputs = {k: torch.tensor(np.asarray(v)).to(hf.device) for k, v in r.items() if k != "input_ids"}
            r = np.asarray(r["input_ids"])[0]
        kw = dict(do_sample=False, pad_token_id=0, max_new_tokens=new_tokens)
        if eos is None:
            kw["min_new_tokens"] = new_tokens
        else:
            kw["eos_token_id"] = list(eos)
        if assistant is not None:
            assistant.generation_config.num_assistant_tokens = gamma
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            assistant.generation_config.assistant_confidence_threshold = 0.0
            kw["assistant_model"] = assistant
        with torch.no_grad():
            o = hf.generate(torch.tensor(np.asarray(r)[None]).to(hf.device), **inputs, **kw)
        outs.append(o[0, len(r):].cpu().numpy())
    return outs


# ------------------------------------------------------------------------------------------------ suites


def suite_ar(runs: int, quick: bool, progress: bool, with_transformers: bool = True, dtype=jnp.float32,
             big: dict | None = None, zoo: bool = True) -> dict:
    """Greedy AR throughput, jspec vs transformers, fixed output length (`zoo=False`: the random LLaMA only)."""
    import jspec

    N, P = (8, 16) if quick else (128, 128)
    models = {"random LLaMA": random_llama(**(big or ({"layers": 1, "vocab": 512, "hidden": 64, "mlp": 128,
                                                       "heads": 4} if quick else {})), dtype=dtype)}
    pair = None if quick or not zoo else zoo_text_pair(dtype)
    if pair is not None:
        models = {"zoo text-target": pair[0], **models}
    rows = []
    for mname, model in models.items():
        hf = _hf_from(model, "t") if with_transformers and _transformers_usable(dtype) else None
        for B in ((1, 2) if quick else (1, 8)):
            prompt = np.random.default_rng(0).integers(4, model.vocab_size, (B, P))
            cases = [Case("jspec", lambda: jspec.decode(model, prompt, max_new_tokens=N, eos_token_id=()).tokens)]
            if hf is not None:
                import torch

                torch.set_num_threads(os.cpu_count() or 1)

                def hf_run(hf=hf, prompt=prompt):
                    with torch.no_grad():
                        o = hf.generate(torch.tensor(prompt).to(hf.device), do_sample=False, pad_token_id=0,
                                        max_new_tokens=N, min_new_tokens=N)
                    return o[:, P:].cpu().numpy()

                cases.append(Case("transformers", hf_run))
            res = interleaved(cases, runs, progress)
            j = res["jspec"]
            row = dict(model=mname, params_m=_r(model.num_params / 1e6, 1), batch=B, new_tokens=N,
                       jspec_tok_s=_r(B * N / med(j["wall"]), 1), jspec_compile_s=_r(j["compile_s"], 2))
            if hf is not None:
                h = res["transformers"]
                row.update(transformers_tok_s=_r(B * N / med(h["wall"]), 1),
                           jspec_over_transformers=_r(med(h["wall"]) / med(j["wall"])),
                           same_tokens=bool(np.array_equal(j["first"], h["first"])))
            rows.append(row)
        del hf
        _free_torch()
    return {"rows": rows}


def sd_strategies(draft, quick: bool) -> list[tuple[str, Any, int]]:
    import jspec

    if quick:
        return [("AR", jspec.AR(), 0), ("Chain g=3", jspec.Chain(draft, gamma=3), 3),
                ("Tree [[0],[1],[0,0]]", jspec.Tree(draft, tree=[[0], [1], [0, 0]]), 0),
                ("DynamicTree 3x3/6", jspec.DynamicTree(draft, depth=3, top_k=3, total=6), 0)]
    return [("AR", jspec.AR(), 0), ("Chain g=3", jspec.Chain(draft, gamma=3), 3),
            ("Chain g=5", jspec.Chain(draft, gamma=5), 5), ("Chain g=7", jspec.Chain(draft, gamma=7), 7),
            ("Tree mc_sim_7b_63", jspec.Tree(draft, tree="mc_sim_7b_63"), 0),
            ("Tree naive_extend_57", jspec.Tree(draft, tree="naive_extend_57"), 0),
            ("DynamicTree 6x10/60", jspec.DynamicTree(draft, depth=6, top_k=10, total=60), 0)]


PHASE_KEYS = ("step_s", "draft_s", "verify_s", "other_s")


def _decode_rows(target, rows, strategy, N, eos):
    """Decode each prompt alone (batch 1); returns the tokens and the summed stats a speedup needs ("row_steps":
    each prompt's decode-loop steps; "drafted": the draft tokens proposed)."""
    import jspec

    toks, tot = [], {"tokens": 0, "steps": 0, "decode_s": 0.0, "row_steps": [], "drafted": 0}
    for r in rows:
        o = jspec.decode(target, _as_prompt(r), strategy=strategy, max_new_tokens=N, eos_token_id=eos)
        toks.append(o.tokens[0, :o.lengths[0]])
        tot["tokens"] += int(o.lengths[0])
        tot["steps"] += int(o.stats["steps"][0]) + 1  # + the token sampled at prefill
        tot["decode_s"] += float(o.stats["decode_s"])
        tot["row_steps"].append(int(o.stats["steps"][0]))
        tot["drafted"] += int(np.sum(o.stats["drafted"]))
    return toks, tot


def _as_prompt(r):
    return r if isinstance(r, dict) else [r]


def _profile_rows(target, rows, strategy, N, eos, row_steps) -> dict[str, float]:
    """Per-step costs timed inside one program from each prompt's post-prefill state (`jspec.engine.profiling.
    in_program_costs`, AR: "step_s"; SD: the phases and the whole step), times that prompt's loop steps, summed:
    what the decode loops would cost without the engine's overhead."""
    from jspec import api
    from jspec.engine import profiling as PF

    tot = dict.fromkeys(PHASE_KEYS, 0.0)
    for r, n in zip(rows, row_steps):
        s = api.start(target, _as_prompt(r), strategy, max_new_tokens=N, eos_token_id=eos)
        for k, v in PF.in_program_costs(s, runs=1).items():
            tot[k] += v * n
    return tot


def suite_sd(runs: int, quick: bool, progress: bool, with_transformers: bool = True, pairs: dict | None = None,
             n_prompts: int = 8, only: tuple[str, ...] = (), strategies: tuple[str, ...] = ()) -> dict:
    """Speculative strategies per pair and scenario; see the module docstring. `only`: the pair names to run
    (e.g. ("zoo text",); default all); `strategies`: the strategy names to run (default all; AR always)."""
    if pairs is None:
        pairs = {} if quick else zoo_pairs(n_prompts)
        shape = dict(layers=2, vocab=512, hidden=64, mlp=128, heads=4) if quick else {}
        t, d = damped_pair(**shape)
        rng = np.random.default_rng(1)
        P, n = (12, 2) if quick else (128, 2)
        pairs["random damped"] = (t, d, {"random": [rng.integers(0, t.vocab_size, P) for _ in range(n)]}, (),
                                  8 if quick else 64)
    unknown = [p for p in only if p not in pairs]
    if unknown:
        raise ValueError(f"unknown pair(s) {unknown}; this install has {sorted(pairs)}")
    rows, hf_rows = [], []
    for pname, (target, draft, scenarios, eos, N) in pairs.items():
        if only and pname not in only:
            continue
        for scen, prompts in scenarios.items():
            # each XLA:CPU executable maps ~1000 memory regions; a whole suite's programs in one process passed the
            # kernel's vm.max_map_count (65530) and crashed the JIT, so every scenario starts from an empty cache
            # (compile time is measured per case on its first run anyway)
            jax.clear_caches()
            strats = [st for st in sd_strategies(draft, quick)
                      if not strategies or st[0] == "AR" or st[0] in strategies]
            # each strategy's timed decodes, then its in-program profile (the prediction), in every round: the
            # prediction and the measurement of a round come from the same minute of a host whose speed drifts
            row_steps: dict[str, list] = {}

            def timed(name, s):
                toks, tot = _decode_rows(target, prompts, s, N, eos)
                row_steps[name] = tot["row_steps"]
                return toks, tot

            cases = []
            for name, s, _ in strats:
                cases.append(Case(name, (lambda name=name, s=s: timed(name, s))))
                cases.append(Case(name + " [profile]",
                                  (lambda name=name, s=s: _profile_rows(target, prompts, s, N, eos, row_steps[name]))))
            res = interleaved(cases, runs, progress)
            ar = res["AR"]
            ar_toks = ar["first"][0]
            ar_decodes = [r[1]["decode_s"] for r in ar["results"]]
            ar_decode = med(ar_decodes)
            ar_steps = max(ar["first"][1]["steps"] - len(prompts), 1)
            ar_step_runs = [p["step_s"] / ar_steps for p in res["AR [profile]"]["results"]]
            ar_step = med(ar_step_runs)
            for name, s, gamma in strats:
                c = res[name]
                toks, tot = c["first"]
                same = all(np.array_equal(a, b) for a, b in zip(toks, ar_toks))
                decodes = [r[1]["decode_s"] for r in c["results"]]
                decode = med(decodes)
                steps_loop = max(tot["steps"] - len(prompts), 1)
                tau = (tot["tokens"] - len(prompts)) / steps_loop  # tokens per decode-loop step (bonus incl.)
                row = dict(pair=pname, scenario=scen, strategy=name, gamma=gamma, prompts=len(prompts),
                           mean_accepted=_r(tau), block_efficiency=_r(tot["tokens"] / tot["steps"]),
                           tok_s=_r(tot["tokens"] / med(c["wall"]), 1), wall_speedup=_r(_ratio(med(ar["wall"]),
                                                                                             med(c["wall"]))),
                           decode_speedup=_r(_ratio(ar_decode, decode)), compile_s=_r(c["compile_s"], 2),
                           same_tokens_as_ar=bool(same), tokens_before_divergence=_r(_agreed(toks, ar_toks), 1))
                if name == "AR":
                    row.update(step_ms=_r(ar_step * 1e3, 2), loop_step_ms=_r(ar_decode / ar_steps * 1e3, 2))
                else:
                    profs = res[name + " [profile]"]["results"]
                    per = {k: med(p[k] for p in profs) / steps_loop for k in PHASE_KEYS}
                    phases = per["draft_s"] + per["verify_s"] + per["other_s"]
                    # round by round: (AR decode / SD decode) over (tau x AR step / SD step) of the same round
                    predicted = [tau * a * steps_loop / p["step_s"] for a, p in zip(ar_step_runs, profs)]
                    measured = [_ratio(a, d) for a, d in zip(ar_decodes, decodes)]
                    row.update(draft_ms=_r(per["draft_s"] * 1e3, 2), verify_ms=_r(per["verify_s"] * 1e3, 2),
                               other_ms=_r(per["other_s"] * 1e3, 2), step_ms=_r(per["step_s"] * 1e3, 2),
                               loop_step_ms=_r(decode / steps_loop * 1e3, 2),
                               step_over_phases=_r(_ratio(per["step_s"], phases)),
                               predicted_from_phases=_r(tau * ar_step / phases),
                               predicted_speedup=_r(med(predicted)),
                               measured_over_predicted=_r(med(m / p for m, p in zip(measured, predicted))))
                rows.append(row)
            if with_transformers:
                hf_rows += _assisted(target, draft, prompts, strats, res, runs, N, eos, pname, scen)
    return {"rows": rows, "transformers": hf_rows}


def _agreed(toks: list, ref: list) -> float:
    """Mean over prompts of how many leading tokens equal the reference's (its length where all do): greedy SD
    in bf16 can flip a near-tie that AR resolves the other way, and this says how early."""
    out = []
    for a, b in zip(toks, ref):
        n = min(len(a), len(b))
        diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
        out.append(int(diff[0]) if len(diff) else n)
    return float(np.mean(out))


def _assisted(target, draft, prompts, strategies, res, runs, N, eos, pname, scen) -> list[dict]:
    """transformers greedy generate and assisted generation (constant gamma) on the same pair and prompts."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    hf_t, hf_d = _hf_from(target, "t"), _hf_from(draft, "d")
    hf_eos = None if eos == () else (eos if eos is not None else tuple(target.config.eos_token_ids))
    chains = [(n, g) for n, _, g in strategies if g]
    cases = [Case("transformers AR", lambda: _hf_generate(hf_t, prompts, N, eos=hf_eos))]
    cases += [Case(f"transformers assisted g={g}", (lambda g=g: _hf_generate(hf_t, prompts, N, hf_d, g, hf_eos)))
              for _, g in chains]
    hres = interleaved(cases, runs, progress=False)
    del hf_t, hf_d
    _free_torch()
    ar_jspec = res["AR"]["first"][0]
    base = med(hres["transformers AR"]["wall"])
    out = []
    for c in cases:
        h = hres[c.name]
        same = all(np.array_equal(a, b[:len(a)]) and len(a) == len(b) for a, b in zip(h["first"], ar_jspec))
        row = dict(pair=pname, scenario=scen, strategy=c.name, wall_s=_r(med(h["wall"])),
                   speedup_over_transformers_ar=_r(base / med(h["wall"])), same_tokens_as_jspec=bool(same))
        jname = "AR" if c.name == "transformers AR" else next(n for n, g in chains if c.name.endswith(f"g={g}"))
        row["jspec_over_transformers"] = _r(med(h["wall"]) / med(res[jname]["wall"]))
        out.append(row)
    return out


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Measured device memory bandwidth (read + write of a buffer), median of 5."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    f(x).block_until_ready()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * nbytes / med(times) / 1e9


GPU_PARTS = ("ar", "random damped 7B", "zoo text", "zoo image")


def suite_gpu(runs: int, quick: bool, progress: bool, allow_cpu: bool = False, with_transformers: bool = True,
              parts: tuple[str, ...] = (), zoo: bool = True) -> dict:
    """In bfloat16 on a GPU: `ar` with 7B-shaped random weights (and the zoo text target unless `zoo=False`)
    against the HBM floor and transformers `generate`; `sd` on a 7B-shaped damped pair (throughput, with
    transformers' assisted generation) and on the zoo pairs in float32 (acceptance). `parts` (default all) picks
    from GPU_PARTS, to split a run across calls (`jspec bench gpu`, `jspec.tools.bench.gpu`, runs the `ar` part)."""
    if jax.default_backend() == "cpu" and not allow_cpu:
        raise RuntimeError("the gpu suite needs a GPU/TPU backend (jax.default_backend() is 'cpu')")
    unknown = [p for p in parts if p not in GPU_PARTS]
    if unknown:
        raise ValueError(f"unknown part(s) {unknown} of the gpu suite; it has {list(GPU_PARTS)}")
    want = (lambda part: not parts or part in parts)
    shape = (dict(layers=2, vocab=512, hidden=64, mlp=128, heads=4) if quick else
             dict(layers=32, vocab=32000, hidden=4096, mlp=11008, heads=32))
    bw = copy_bandwidth_gbs(1 << 24 if quick else 1 << 30)
    out: dict[str, Any] = {"rows": [], "sd": [], "transformers": [], "bandwidth_gbs": _r(bw, 1)}
    if want("ar"):
        out["rows"] = suite_ar(runs, quick, progress, with_transformers, dtype=jnp.bfloat16, big=shape,
                               zoo=zoo)["rows"]
        for row in out["rows"]:
            floor_ms = row["params_m"] * 1e6 * 2 / (bw * 1e9) * 1e3
            row.update(floor_ms_per_token=_r(floor_ms), ms_per_token=_r(1e3 * row["batch"] / row["jspec_tok_s"]),
                       x_floor=_r(1e3 * row["batch"] / row["jspec_tok_s"] / floor_ms))
    pairs = {}
    if want("random damped 7B"):
        t, d = damped_pair(dtype=jnp.bfloat16, **shape)
        rng = np.random.default_rng(1)
        P, n, N = (12, 1, 8) if quick else (128, 1, 64)
        pairs["random damped 7B"] = (t, d, {"random": [rng.integers(0, t.vocab_size, P) for _ in range(n)]}, (), N)
    if not quick and (want("zoo text") or want("zoo image")):
        pairs.update({k: v for k, v in zoo_pairs(4).items() if want(k)})
    if pairs:
        # the 7B programs take ~20 s each to compile: the chain gammas that matter, one static and the dynamic tree
        sd = suite_sd(runs, quick, progress, with_transformers and _transformers_usable(jnp.bfloat16), pairs=pairs,
                      strategies=() if quick else ("Chain g=3", "Chain g=5", "Tree mc_sim_7b_63",
                                                   "DynamicTree 6x10/60"))
        out.update(sd=sd["rows"], transformers=sd["transformers"])
    return out


# ------------------------------------------------------------------------------------------------ output


def slope_table(result: dict) -> list[str]:
    """A suite timed by in-program slopes (`moe`, `hybrid`): its header line and its rows as a table (the per-run
    columns left out)."""
    from jspec.tools import report

    m = result["meta"]
    out = [f"`{m['suite']}` suite, {m['date']}, {m['device']}, jax {m['jax']}, median of {m['runs']} interleaved runs "
           "(each a slope inside one compiled program)", ""]
    return out + report.markdown_table([{k: v for k, v in row.items() if not k.endswith("_runs_ms")}
                                        for row in result["rows"]])


def save_suite(result: dict, out_dir: str, markdown) -> dict:
    """`result` (with its `meta`) written as `<out_dir>/<suite>[-quick]-<date>.{json,md}` (`markdown(result)` the
    second); returns it with "files"."""
    from jspec.tools import report

    m = result["meta"]
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{m['suite']}{'-quick' if m['quick'] else ''}-{m['date']}")
    report.write_json(stem + ".json", result)
    report.write_text(stem + ".md", markdown(result))
    return {**result, "files": [stem + ".json", stem + ".md"]}


def meta(suite: str, runs: int, quick: bool) -> dict:
    m = dict(suite=suite, date=time.strftime("%Y-%m-%d"), runs=runs, quick=quick, jax=jax.__version__,
             backend=jax.default_backend(), device=PV.device_model(), cpus=os.cpu_count(),
             provenance=PV.provenance())
    try:
        import torch
        import transformers

        m.update(torch=torch.__version__, transformers=transformers.__version__)
    except ImportError:
        pass
    return m


def markdown(result: dict) -> str:
    """Markdown tables of a suite result (one per list of rows)."""
    out = [f"`{result['meta']['suite']}` suite, {result['meta']['date']}, {result['meta']['device']}, "
           f"jax {result['meta']['jax']}, median of {result['meta']['runs']} runs"]
    for key in ("rows", "sd", "transformers"):
        if result.get(key):
            out += ["", *report.markdown_table(result[key])]
    return "\n".join(out)


def plot(result: dict, path: str) -> str | None:
    """A bar chart of the suite's speed ratios; None when matplotlib is missing."""
    suite = result["meta"]["suite"]
    rows = result["rows"]
    if not rows:
        return None
    if suite == "sd":
        return _plot_sd(result, path)
    long = [{"row": f"{r['model']}\nbatch {r['batch']}", "impl": impl, "tok_s": r.get(key, 0)} for r in rows
            for impl, key in (("jspec tok/s", "jspec_tok_s"), ("transformers tok/s", "transformers_tok_s"))
            if key == "jspec_tok_s" or any(key in q for q in rows)]
    return report.bar_chart(path, long, "row", "impl", "tok_s", "tokens / s",
                            f"jspec bench {suite}, {result['meta']['device']}", ref=None)


def run(suite: str, runs: int = 3, quick: bool = False, out_dir: str = "bench_out", progress: bool = True,
        with_transformers: bool = True, allow_cpu: bool = False, pairs: tuple[str, ...] = ()) -> dict:
    """Run one suite and write `<out_dir>/<suite>[-quick]-<date>.{json,md,png}`; returns the result dict."""
    if suite not in SUITES:
        raise ValueError(f"unknown bench suite {suite!r}; available: {', '.join(SUITES)}")
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    if pairs and suite == "ar":
        raise ValueError(f"--pair selects pairs of the sd suite (or parts of the gpu suite), not of {suite!r}")
    with tempfile.TemporaryDirectory() as work:
        _WORKDIR.append(work)
        try:
            if suite == "ar":
                result = suite_ar(runs, quick, progress, with_transformers)
            elif suite == "sd":
                result = suite_sd(runs, quick, progress, with_transformers, only=tuple(pairs))
            else:
                result = suite_gpu(runs, quick, progress, allow_cpu, with_transformers, parts=tuple(pairs))
        finally:
            _WORKDIR.pop()
    result = {"meta": meta(suite, runs, quick), **result}
    os.makedirs(out_dir, exist_ok=True)
    tag = "".join("-" + p.replace(" ", "-") for p in pairs)
    stem = os.path.join(out_dir, f"{suite}{tag}{'-quick' if quick else ''}-{result['meta']['date']}")
    report.write_json(stem + ".json", result)
    report.write_text(stem + ".md", markdown(result))
    result["files"] = [stem + ".json", stem + ".md"] + ([stem + ".png"] if plot(result, stem + ".png") else [])
    if suite == "gpu" and result["sd"] and plot({"meta": {**result["meta"], "suite": "sd"}, "rows": result["sd"]},
                                                stem + "-sd.png"):
        result["files"].append(stem + "-sd.png")
    return result


def _plot_sd(result: dict, path: str) -> str | None:
    """One panel per pair: decode speedup over jspec AR per scenario (bars: strategies; dots: predicted)."""
    rows = [r for r in result["rows"] if r["strategy"] != "AR"]
    pairs = list(dict.fromkeys(r["pair"] for r in rows))
    with report.figure(path, len(pairs), 1, figsize=(9, 2.8 * len(pairs)), dpi=120,
                       title=f"jspec bench sd, {result['meta']['device']}") as fa:
        if fa is None:
            return None
        for ax, pair in zip(fa[1][:, 0], pairs):
            pr = [r for r in rows if r["pair"] == pair]
            scen, vals = report.pivot(pr, "scenario", "strategy", "decode_speedup")
            _, pred = report.pivot(pr, "scenario", "strategy", "predicted_speedup")
            report.grouped_bars(ax, scen, vals, "speedup over AR", dots=pred, rotation=0,
                                title=f"{pair} (dots: predicted from in-program step times)")
    return path