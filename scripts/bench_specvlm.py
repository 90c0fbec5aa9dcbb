"""SpecVLM on the zoo's video pair: tau and speedup against the pruning ratio for SpecVLM's selection and its
ablations (the paper's Fig. 2b, 6, 7, 8 and Tables 4-5), Std.-SD and Self-SD, the static tree and the chain, and the
draft's time per step against pruning and clip length (Table 6's shape).

    python scripts/bench_specvlm.py                  # writes bench_out/specvlm-zoo.{json,md,png}
    python scripts/bench_specvlm.py --runs 5 --prompts 8 --max-new 128
    python scripts/bench_specvlm.py --draft video-draft-weak   # a draft below the ceiling -> specvlm-zoo-weak-draft.*

Prompts: held-out clips with the detailed-description question (the paper's VDC setting: long answers) and, with
`--qa`, the short video QA questions. Each case decodes the prompts as one batch (greedy, EOS honoured) once to
compile, then `--runs` interleaved timed rounds (median of decode-only time; the target's prefill, the pruning and
the draft's prefill are excluded, as in the paper). tau is accepted drafts per target step without the bonus (the
paper's), tau + 1 with it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jspec  # noqa: E402
from jspec.tools.bench import zoo as bench  # noqa: E402
from jspec.strategies.specvlm import family_top_p  # noqa: E402

RATIOS = (0.0, 0.3, 0.6, 0.8, 0.9, 0.95)
ABLATIONS = ("uniform", "attention", "front", "middle", "end", "frames")
CLIP_REPEATS = (1, 2, 3)  # Table 6's shape: the clip's frames each shown 1x, 2x, 3x (288 .. 864 video tokens; the
# zoo models' 1024 positions hold no 4x clip)


def load_pair(draft: str = "video-draft"):
    from jspec.tools import zoo

    missing = [n for n in ("video-target", draft) if n not in zoo.available()]
    if missing:
        raise SystemExit(f"the zoo has no {missing}: train them (scripts/train_zoo.py, README 'Zoo models')")
    return zoo.load("video-target"), zoo.load(draft)


def prompts(n: int, qa: bool):
    from jspec.tools.zoo import video as ZV

    tasks = ZV.QA_TASKS if qa else ("video_describe",)
    exs = ZV.eval_set(n, tasks=tasks)
    return ZV.VideoEncoder().prompts(exs), exs


def long_prompt(exs, repeat: int) -> dict:
    """The examples' prompts with each frame shown `repeat` times (a clip `repeat` times as long, same content)."""
    from jspec.tools.zoo import video as ZV

    enc = ZV.VideoEncoder()
    rows, px, grids = [], [], []
    for ex in exs:
        fr = np.repeat(ZV.frames_of(ex.clip), repeat, axis=0)
        p, g = ZV.video_pixels(fr)
        ids = enc.prompt_ids(ex)
        n = int(np.sum(ids == ZV.VIDEO_ID))
        first = int(np.flatnonzero(ids == ZV.VIDEO_ID)[0])
        rows.append(np.concatenate([ids[:first], [ZV.VIDEO_ID] * (n * repeat), ids[first + n:]]))
        px.append(p)
        grids.append(g)
    return {"input_ids": rows, "pixel_values_videos": np.concatenate(px), "video_grid_thw": np.stack(grids),
            "second_per_grid_ts": np.full(len(rows), ZV.SECONDS_PER_GROUP, np.float32)}


def cases(draft, quick: bool = False) -> list[tuple[str, dict, object]]:
    """(name, its settings, strategy): AR; the unpruned tree and chain; SpecVLM and SD-Rand over the ratios; the
    other selectors at 0.9 (and 0.6); the chain under pruning; Self-SD unpruned and at 0.9. `quick`: a few of
    them (a smoke run)."""
    S = jspec.SpecVLM
    out = [("AR", {}, None)]
    if quick:
        return out + [("SpecVLM r=0.0", dict(select="specvlm", ratio=0.0, draft="std", tree="tree"), S(draft, ratio=0.0)),
                      ("SpecVLM r=0.9", dict(select="specvlm", ratio=0.9, draft="std", tree="tree"), S(draft, ratio=0.9)),
                      ("SD-Rand r=0.9", dict(select="random", ratio=0.9, draft="std", tree="tree"),
                       S(draft, ratio=0.9, select="random")),
                      ("SD-frames r=0.9", dict(select="frames", ratio=0.9, draft="std", tree="tree"),
                       S(draft, ratio=0.9, select="frames")),
                      ("SpecVLM-Chain r=0.9", dict(select="specvlm", ratio=0.9, draft="std", tree="chain"),
                       S(draft, ratio=0.9, tree="chain5")),
                      ("Self-SD r=0.0", dict(select="specvlm", ratio=0.0, draft="self", tree="tree"), S(None, ratio=0.0)),
                      ("Self-SD r=0.9", dict(select="specvlm", ratio=0.9, draft="self", tree="tree"), S(None, ratio=0.9))]
    for r in RATIOS:
        out.append((f"SpecVLM r={r}", dict(select="specvlm", ratio=r, draft="std", tree="tree"), S(draft, ratio=r)))
        if r > 0:
            out.append((f"SD-Rand r={r}", dict(select="random", ratio=r, draft="std", tree="tree"),
                        S(draft, ratio=r, select="random")))
    for sel in ABLATIONS:
        for r in (0.6, 0.9):
            out.append((f"SD-{sel} r={r}", dict(select=sel, ratio=r, draft="std", tree="tree"),
                        S(draft, ratio=r, select=sel)))
    for r in (0.6, 0.9):  # stage I's share of the mass: the authors' code (0.4) and one small enough that stage II
        for top_p in (0.4, 0.1):  # keeps most of the budget (the default is the paper's 0.5 for Qwen2.5-VL)
            out.append((f"SpecVLM r={r} top_p={top_p}", dict(select="specvlm", ratio=r, draft="std", tree="tree",
                                                             top_p=top_p), S(draft, ratio=r, top_p=top_p)))
    for r in (0.0, 0.9):
        out.append((f"{'SD' if r == 0 else 'SpecVLM'}-Chain r={r}", dict(select="specvlm", ratio=r, draft="std",
                                                                         tree="chain"), S(draft, ratio=r, tree="chain5")))
        out.append((f"Self-SD r={r}", dict(select="specvlm", ratio=r, draft="self", tree="tree"), S(None, ratio=r)))
    return out


def video_id() -> int:
    from jspec.tools.zoo import video as ZV

    return ZV.VIDEO_ID


def tau(out) -> float:
    return float(np.nanmean(np.asarray(out.stats["mean_accepted_no_bonus"], float)))


def draft_phase(target, prompt, strategy, max_new: int, runs: int) -> dict:
    """Median per-step draft / verify milliseconds (the loop run phase by phase, host-synced: `profile=True`)."""
    outs = [jspec.decode(target, prompt, strategy, max_new_tokens=max_new, profile=True) for _ in range(runs + 1)][1:]
    steps = [int(np.asarray(o.stats["steps"]).max()) for o in outs]
    return {k: float(np.median([o.stats[f"{k}_s"] / s for o, s in zip(outs, steps)])) * 1e3
            for k in ("draft", "verify", "other")}


def clip_study(target, draft, exs, max_new: int, runs: int, repeats=CLIP_REPEATS) -> list[dict]:
    """The draft's decode time per token alone (AR on its own prompt), unpruned and pruned 90% by SpecVLM's
    selection (kept tokens from the target's prefill attention), against the clip length."""
    from jspec.strategies.specvlm import VisionPruning
    from jspec.tools.zoo import video as ZV
    from ports.families import qwen2_vl as QW

    out = []
    for rep in repeats:
        prompt = long_prompt(exs, rep)
        n_vid = int(np.sum(np.asarray(prompt["input_ids"][0]) == ZV.VIDEO_ID))
        keep = pruned_keep(target, draft, prompt, VisionPruning(0.9))
        pruned = QW.prune_prompt(draft.config, prompt, keep, positions="original")
        row = {"repeat": rep, "video_tokens": n_vid}
        for name, p in (("full", prompt), ("pruned", pruned)):
            outs = [jspec.decode(draft, p, max_new_tokens=max_new, eos_token_id=()) for _ in range(runs + 1)][1:]
            row[f"{name}_ms_per_token"] = float(np.median([o.stats["decode_s"] / max(1, int(o.lengths.max()))
                                                           for o in outs])) * 1e3
        out.append(row)
        print(f"clip x{rep} ({n_vid} video tokens): draft per token {row['full_ms_per_token']:.2f} ms unpruned, "
              f"{row['pruned_ms_per_token']:.2f} ms pruned 90%")
    return out


CLIP_TAU_CASES = (("SpecVLM r=0.0", dict(ratio=0.0)), ("SpecVLM r=0.9", dict(ratio=0.9)),
                  ("SD-Rand r=0.9", dict(ratio=0.9, select="random")))


def clip_tau(target, draft, exs, max_new: int, repeats=CLIP_REPEATS) -> list[dict]:
    """tau against the clip length (each frame shown `repeat` times: the same content, `repeat` times the video
    tokens): the unpruned tree, SpecVLM and random pruning at 0.9, each checked against AR on the same prompt."""
    from jspec.tools.zoo import video as ZV

    out = []
    for rep in repeats:
        prompt = long_prompt(exs, rep)
        ar = jspec.decode(target, prompt, max_new_tokens=max_new)
        row = {"repeat": rep, "video_tokens": int(np.sum(np.asarray(prompt["input_ids"][0]) == ZV.VIDEO_ID)),
               "mean_len": float(np.mean(ar.lengths))}
        for name, kw in CLIP_TAU_CASES:
            o = jspec.decode(target, prompt, jspec.SpecVLM(draft, **kw), max_new_tokens=max_new)
            row[name] = {"tau": tau(o), "same_as_ar": bool(np.array_equal(o.tokens, ar.tokens)),
                         "kept": float(np.mean(o.stats["kept_vision_tokens"]))}
        out.append(row)
        print(f"clip x{rep} ({row['video_tokens']} video tokens): tau " +
              ", ".join(f"{n} {row[n]['tau']:.2f}" for n, _ in CLIP_TAU_CASES))
    return out


def pruned_keep(target, draft, prompt, hook) -> np.ndarray:
    """[B, T] the video tokens SpecVLM's hook keeps for `prompt` (one target prefill, as decoding runs it)."""
    import jax.numpy as jnp

    from jspec.core import prefill as PR
    from jspec.parts.drafters import Setup, TargetPrefill
    from jspec.parts.drafters.model import ModelDrafter
    from ports.core.prompts import model_prompt

    tokens, lengths, inputs = model_prompt(target, prompt, "")
    setup = Setup(target, prompt, tokens, lengths, inputs, None, None, None, None)
    hook = hook.prepare(setup, ModelDrafter(draft).prepare(setup))
    cache = PR.new_cache_for(target, tokens.shape[0], tokens.shape[1])
    asks = hook.asks(jnp.asarray(tokens), jnp.asarray(lengths), inputs)
    logits, fo, cache = PR.prefill(target, jnp.asarray(tokens), jnp.asarray(lengths), cache,
                                     jax.tree.map(jnp.asarray, inputs), **asks)
    keep = np.asarray(hook.keep(TargetPrefill(logits, fo.hidden, fo.attn, jnp.asarray(tokens),
                                              jnp.asarray(lengths), cache)))
    out = np.zeros(tokens.shape, bool)
    for b in range(tokens.shape[0]):
        vid = np.flatnonzero(np.isin(tokens[b, :lengths[b]], hook.target_ids))
        out[b, vid] = keep[b, :len(vid)]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--qa", action="store_true", help="the short video QA questions instead of descriptions")
    ap.add_argument("--quick", action="store_true", help="a smoke run: a few cases, short clips study")
    ap.add_argument("--clip-tau-only", action="store_true",
                    help="only tau against the clip length (frames repeated), to OUT-clip-tau.json")
    ap.add_argument("--draft", default="video-draft", choices=("video-draft", "video-draft-weak"),
                    help="the draft: the shipped one, or video-draft-weak (trained briefly: below the ceiling)")
    ap.add_argument("--out", default=None, help="results path without suffix (default bench_out/specvlm-zoo, "
                    "with -weak-draft for video-draft-weak)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = str(ROOT / "bench_out" / ("specvlm-zoo" + ("-weak-draft" if args.draft != "video-draft"
                                                                         else "")))
    target, draft = load_pair(args.draft)
    prompt, exs = prompts(args.prompts, args.qa)
    if args.clip_tau_only:
        taus = clip_tau(target, draft, exs, args.max_new)
        meta = {**bench.meta("specvlm-clip-tau", 0, False), "prompts": args.prompts, "max_new": args.max_new,
                "scenario": "qa" if args.qa else "describe", "draft": args.draft}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out + "-clip-tau.json").write_text(json.dumps({"meta": meta, "clip_tau": taus}, indent=1))
        print(f"wrote {args.out}-clip-tau.json")
        return
    todo = cases(draft, args.quick)
    t0 = time.perf_counter()
    res = bench.interleaved([bench.Case(n, (lambda s=s: jspec.decode(target, prompt, s, max_new_tokens=args.max_new)))
                             for n, _, s in todo], args.runs)
    dec = {n: float(np.median([o.stats["decode_s"] for o in res[n]["results"]])) for n, _, _ in todo}
    ar = res["AR"]["first"]
    ar_tok_s = float(np.sum(ar.lengths)) / dec["AR"]
    rows = []
    for n, settings, s in todo:
        out = res[n]["first"]
        tok_s = float(np.sum(out.lengths)) / dec[n]
        row = {"case": n, **settings, "tau": tau(out), "tau_bonus": tau(out) + 1, "tok_s": tok_s,
               "speedup": tok_s / ar_tok_s, "same_as_ar": bool(np.array_equal(out.tokens, ar.tokens)),
               "compile_s": res[n]["compile_s"], "mean_len": float(np.mean(out.lengths))}
        if "kept_vision_tokens" in out.stats:  # how the draft's video tokens were chosen, per row
            row["kept"] = float(np.mean(out.stats["kept_vision_tokens"]))
            if "stage_one" in out.stats:
                row["stage_one"] = float(np.mean(out.stats["stage_one"]))
                row["top_p"] = float(family_top_p((draft or target).config.model_type) if s.top_p is None else s.top_p)
        rows.append(row)
        print(f"{n:24s} tau {row['tau']:.2f} (+1 {row['tau_bonus']:.2f})  {tok_s:7.1f} tok/s  x{row['speedup']:.2f}"
              f"{'' if row['same_as_ar'] else '  DIFFERS FROM AR'}")
    phases = {}
    for n, _, s in todo:
        if n in ("SpecVLM r=0.0", "SpecVLM r=0.9", "Self-SD r=0.0", "Self-SD r=0.9"):
            phases[n] = draft_phase(target, prompt, s, args.max_new, args.runs)
            print(f"{n:24s} per step: draft {phases[n]['draft']:.2f} ms, verify {phases[n]['verify']:.2f} ms")
    reps = CLIP_REPEATS[:2] if args.quick else CLIP_REPEATS
    clips = clip_study(target, draft, exs[:4], 32, args.runs, reps)
    taus = clip_tau(target, draft, exs, args.max_new, reps)
    meta = {**bench.meta("specvlm", args.runs, False), "prompts": args.prompts, "max_new": args.max_new,
            "scenario": "qa" if args.qa else "describe", "draft": args.draft, "wall_s": time.perf_counter() - t0,
            "video_tokens": int(np.sum(np.asarray(prompt["input_ids"][0]) == video_id())),
            "prompt_tokens": [int(x) for x in np.asarray(prompt["attention_mask"]).sum(1)]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows, "phases": phases, "clips": clips,
                                                    "clip_tau": taus}, indent=1))
    Path(args.out + ".md").write_text(markdown(meta, rows, phases, clips, taus))
    plot(rows, phases, clips, args.out + ".png", taus)
    print(f"wrote {args.out}.json / .md / .png")


def markdown(meta, rows, phases, clips, taus=()) -> str:
    lines = [f"SpecVLM on the zoo video pair (draft {meta.get('draft', 'video-draft')}; {meta['scenario']}, "
             f"{meta['prompts']} held-out clips of "
             f"{meta['video_tokens']} video tokens, prompts of {min(meta['prompt_tokens'])}-{max(meta['prompt_tokens'])} "
             f"tokens, up to {meta['max_new']} new tokens, greedy; {meta['date']}, {meta['device']}, jax {meta['jax']}, "
             f"median of {meta['runs']} runs)", "",
             "| case | selector | ratio | draft | tree | top_p | kept | stage I | tau | tau + 1 | tok/s (decode) | "
             "speedup | same as AR |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda r, k, fmt: format(r[k], fmt) if k in r else ""  # noqa: E731
    for r in rows:
        lines.append(f"| {r['case']} | {r.get('select', '')} | {r.get('ratio', '')} | {r.get('draft', '')} | "
                     f"{r.get('tree', '')} | {f(r, 'top_p', 'g')} | {f(r, 'kept', '.1f')} | {f(r, 'stage_one', '.1f')} | "
                     f"{r['tau']:.2f} | {r['tau_bonus']:.2f} | {r['tok_s']:.0f} | "
                     f"{r['speedup']:.2f} | {'yes' if r['same_as_ar'] else 'NO'} |")
    lines += ["", "kept: the draft's video tokens per row (mean); stage I: those SpecVLM's stage I chose by attention "
              "mass (top_p), the rest are stage II's uniform stride. top_p is the paper's per family unless named."]
    lines += ["", "Per decode step (the loop run phase by phase, host-synced), ms:", "",
              "| case | draft | verify | other |", "|---|---|---|---|"]
    for n, p in phases.items():
        lines.append(f"| {n} | {p['draft']:.2f} | {p['verify']:.2f} | {p['other']:.2f} |")
    lines += ["", "The draft alone, decode time per token against the clip length (frames repeated), ms:", "",
              "| clip | video tokens | unpruned | pruned 90% |", "|---|---|---|---|"]
    for c in clips:
        lines.append(f"| x{c['repeat']} | {c['video_tokens']} | {c['full_ms_per_token']:.2f} | "
                     f"{c['pruned_ms_per_token']:.2f} |")
    if taus:
        names = [n for n, _ in CLIP_TAU_CASES]
        lines += ["", f"tau against the clip length (frames repeated; all {meta['prompts']} clips, up to "
                  f"{meta['max_new']} new tokens; in brackets the video tokens the draft keeps, and whether the "
                  "tokens equal AR's on the same prompt):", "",
                  "| clip | video tokens | answer tokens | " + " | ".join(names) + " |",
                  "|---|---|---|" + "---|" * len(names)]
        for t in taus:
            lines.append(f"| x{t['repeat']} | {t['video_tokens']} | {t['mean_len']:.1f} | " + " | ".join(
                f"{t[n]['tau']:.2f} ({t[n]['kept']:.0f}, {'= AR' if t[n]['same_as_ar'] else 'DIFFERS'})"
                for n in names) + " |")
    return "\n".join(lines) + "\n"


def plot(rows, phases, clips, path: str, taus=()) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4 if taus else 3, figsize=(21 if taus else 16, 4.8))
    for key, ax, label in (("tau", axes[0], "accepted drafts per step (tau)"),
                           ("speedup", axes[1], "decode speedup over AR")):
        for sel, style in (("specvlm", "o-"), ("random", "s--")):
            pts = sorted((r["ratio"], r[key]) for r in rows if r.get("select") == sel and r.get("tree") == "tree"
                         and r.get("draft") == "std" and "top_p=" not in r["case"])
            if sel == "random":  # r = 0 prunes nothing: the unpruned tree is both curves' start
                pts = [(0.0, next(r[key] for r in rows if r["case"] == "SpecVLM r=0.0"))] + pts
            ax.plot(*zip(*pts), style, label="SpecVLM" if sel == "specvlm" else "SD-Rand")
        for sel in ABLATIONS:
            pts = sorted((r["ratio"], r[key]) for r in rows if r.get("select") == sel)
            if pts:
                ax.plot(*zip(*pts), "x", label=f"SD-{sel}")
        ax.set_xlabel("pruning ratio r")
        ax.set_title(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    ax = axes[2]
    reps = [c["video_tokens"] for c in clips]
    ax.plot(reps, [c["full_ms_per_token"] for c in clips], "o-", label="draft, unpruned")
    ax.plot(reps, [c["pruned_ms_per_token"] for c in clips], "s-", label="draft, pruned 90%")
    ax.set_xlabel("video tokens in the clip")
    ax.set_ylabel("ms per decoded token")
    ax.set_title("the draft's per-token time vs clip length")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if taus:
        ax = axes[3]
        for (name, _), style in zip(CLIP_TAU_CASES, ("o-", "s-", "^--")):
            ax.plot([t["video_tokens"] for t in taus], [t[name]["tau"] for t in taus], style, label=name)
        ax.set_xlabel("video tokens in the clip (frames repeated)")
        ax.set_title("tau vs clip length")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
