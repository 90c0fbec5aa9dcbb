"""TABED on the zoo image pair: block efficiency of each drafting view and ensemble (the paper's Table 1 rows M, T,
C, P, MT, MT*, MTCP, MTCP*) over first-turn prompts (captions and VQA), two-image prompts, five-image OOD stories
and second turns; the expected speedup of Eq. (1) from the measured T_q / T_p and from the paper's; wall-time
speedups over AR measured in the same run; the captioner's time; and whether the paper's orderings hold.

    python scripts/bench_tabed.py                       # writes bench_out/tabed-zoo.{json,md,png}; 128 tokens
    python scripts/bench_tabed.py --prompts 24 --runs 3 --max-new 96

Each scenario's prompts decode as one ragged batch (greedy, gamma 5, EOS honoured; each row equals decoding it
alone), once to compile and then `--runs` timed rounds interleaved over the methods (median decode time; the
prefill and the captioning are outside it). tau is the paper's block efficiency: tokens committed per target step
(1 + accepted drafts), pooled over every block of every prompt.
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

import numpy as np  # noqa: E402

import jspec  # noqa: E402
from jspec.tools.bench import zoo as bench  # noqa: E402
from jspec.strategies.tabed import METHODS, TABED, TQ_TP, block_efficiency, expected_speedup  # noqa: E402

SCENARIOS = ("first turn", "two images", "OOD", "second turn")
# The paper's Table 1 / 10 (68M draft -> LLaVA-1.5-7B): first-turn average, OOD = mean of PororoSV and VIST, second
# turn average; "two images" are part of its first-turn average (IEdit, MagicBrush, Spot-the-Diff).
PAPER_BASIS = ("first turn", "two images", "second turn")  # the paper's averages: its benchmarks and turns, no OOD
PAPER = {"M": (2.24, None, 1.175, 2.00), "T": (2.23, None, 2.05, 2.28), "C": (2.29, None, 2.09, 2.30),
         "P": (2.23, None, 2.08, 2.25), "MT": (2.31, None, 1.925, 2.25), "MT*": (2.31, None, 2.03, 2.27),
         "MTCP": (2.32, None, 2.115, 2.31), "MTCP*": (2.32, None, 2.125, 2.32)}
NEWLINE = "\n"


def scenario_prompts(pair, n: int) -> dict:
    from jspec.tools.zoo import evaluate as ZE

    exs = ZE.scenario_examples("image", n)
    first = [e for pair_ in zip(exs["caption"][:n // 2 + n % 2], exs["vqa"]) for e in pair_][:n]
    groups = {"first turn": first, "two images": exs["two_image"], "OOD": exs["ood"], "second turn": exs["second_turn"]}
    return {k: ZE.batch_prompt(pair.encoder, v) for k, v in groups.items()}


def step_ratio(pair, prompt, max_new: int, runs: int) -> float:
    """T_q / T_p on this machine: the draft's decode time per token over the target's (AR, same prompts)."""
    per = {}
    for name, model in (("q", pair.draft), ("p", pair.target)):
        outs = [jspec.decode(model, prompt, max_new_tokens=max_new, eos_token_id=()) for _ in range(runs + 1)][1:]
        per[name] = float(np.median([o.stats["decode_s"] for o in outs])) / max_new
    return per["q"] / per["p"]


def phase_ms(pair, prompt, strategy, max_new: int) -> dict:
    """Draft and verify time per step (ms; the loop run phase by phase, host-synced, after a compile run)."""
    jspec.decode(pair.target, prompt, strategy, max_new_tokens=max_new, profile=True)
    out = jspec.decode(pair.target, prompt, strategy, max_new_tokens=max_new, profile=True)
    steps = max(int(out.stats["steps"].max()), 1)
    return {k: 1e3 * out.stats[f"{k}_s"] / steps for k in ("draft", "verify", "other")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts per scenario")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "tabed-zoo"))
    args = ap.parse_args(argv)
    from jspec.tools.zoo import evaluate as ZE

    pair = ZE.load_pair("image")
    newline = pair.encoder.text_ids(NEWLINE)[0]
    cap = ZE.captioner(pair)
    prompts = scenario_prompts(pair, args.prompts)
    t0 = time.perf_counter()
    strategies = {name: TABED.method(name, pair.draft, gamma=args.gamma, newline_id=newline, captioner=cap)
                  for name in METHODS}
    rows = {}
    for sc, prompt in prompts.items():
        cases = [bench.Case("AR", lambda p=prompt: jspec.decode(pair.target, p, max_new_tokens=args.max_new))]
        cases += [bench.Case(n, lambda p=prompt, s=s: jspec.decode(pair.target, p, s, max_new_tokens=args.max_new))
                  for n, s in strategies.items()]
        print(f"{sc}: {len(prompt['input_ids'])} prompts")
        res = bench.interleaved(cases, args.runs)
        ar = res["AR"]["first"]
        ar_s = float(np.median([o.stats["decode_s"] for o in res["AR"]["results"]]))
        for n in strategies:
            out = res[n]["first"]
            dec = float(np.median([o.stats["decode_s"] for o in res[n]["results"]]))
            same = all(np.array_equal(out.tokens[b, :out.lengths[b]], ar.tokens[b, :ar.lengths[b]])
                       for b in range(len(ar.lengths)))
            w = out.stats.get("weights")
            rows.setdefault(n, {})[sc] = {
                "tau": block_efficiency(out), "speedup": ar_s / dec, "same_as_ar": bool(same),
                "caption_s": float(np.median([o.stats.get("caption_s", 0.0) for o in res[n]["results"]])),
                "mean_weights": None if w is None else np.mean(w[:, 1:].reshape(-1, w.shape[-1]), axis=0).tolist()}
            r = rows[n][sc]
            print(f"  {n:6s} tau {r['tau']:.2f}  x{r['speedup']:.2f} wall{'' if same else '  DIFFERS FROM AR'}")
    ratio = step_ratio(pair, prompts["first turn"], 32, args.runs)
    phases = {n: phase_ms(pair, prompts["first turn"], strategies[n], args.max_new) for n in ("M", "MT", "MTCP")}
    for n, per in rows.items():
        per["average"] = {"tau": float(np.mean([per[s]["tau"] for s in SCENARIOS]))}
        per["paper_average"] = {"tau": float(np.mean([per[s]["tau"] for s in PAPER_BASIS]))}
        for v in per.values():
            v["eq1_here"] = expected_speedup(v["tau"], args.gamma, ratio)
            v["eq1_paper"] = expected_speedup(v["tau"], args.gamma, TQ_TP[("7b", "68m")])
    claims = orderings(rows)
    meta = {**bench.meta("tabed", args.runs, False), "prompts": args.prompts, "max_new": args.max_new,
            "gamma": args.gamma, "tq_tp_here": ratio, "tq_tp_paper": TQ_TP[("7b", "68m")],
            "wall_s": time.perf_counter() - t0}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows, "claims": claims, "phases": phases},
                                                   indent=1))
    Path(args.out + ".md").write_text(markdown(meta, rows, claims, phases))
    plot(rows, args.out + ".png")
    print(Path(args.out + ".md").read_text())


def orderings(rows) -> list[tuple[str, bool, str]]:
    """The paper's orderings, checked on our taus: (claim, holds, the numbers)."""
    t = lambda n, s: rows[n][s]["tau"]  # noqa: E731
    avg = lambda n: rows[n]["average"]["tau"]  # noqa: E731
    pav = lambda n: rows[n]["paper_average"]["tau"]  # noqa: E731
    singles, ensembles = ("M", "T", "C", "P"), ("MT", "MT*", "MTCP", "MTCP*")
    gap = {s: t("MT*", s) - t("MT", s) for s in SCENARIOS}
    best = max(METHODS, key=avg)
    return [
        ("ensembles beat single views on average", min(avg(e) for e in ensembles) > max(avg(s) for s in singles),
         f"ensembles {min(avg(e) for e in ensembles):.3f}-{max(avg(e) for e in ensembles):.3f}, single views "
         f"{min(avg(s) for s in singles):.3f}-{max(avg(s) for s in singles):.3f}"),
        ("M collapses on OOD (below T there)", t("M", "OOD") < t("T", "OOD"),
         f"M {t('M', 'OOD'):.3f} vs T {t('T', 'OOD'):.3f} on OOD"),
        ("T beats M on second turns", t("T", "second turn") > t("M", "second turn"),
         f"T {t('T', 'second turn'):.3f} vs M {t('M', 'second turn'):.3f}"),
        ("MT* >= MT on average", avg("MT*") >= avg("MT"), f"MT* {avg('MT*'):.3f} vs MT {avg('MT'):.3f}"),
        ("MT*'s largest gain over MT is on OOD", max(gap, key=gap.get) == "OOD",
         ", ".join(f"{s} {g:+.3f}" for s, g in gap.items())),
        ("MTCP* is best on average", best == "MTCP*", f"best: {best} {avg(best):.3f}; MTCP* {avg('MTCP*'):.3f}"),
        ("MT* >= MT on the paper's basis (benchmarks and turns, no OOD)", pav("MT*") >= pav("MT"),
         f"MT* {pav('MT*'):.3f} vs MT {pav('MT'):.3f}"),
        ("MT* beats every single view on the paper's basis", pav("MT*") > max(pav(s) for s in singles),
         f"MT* {pav('MT*'):.3f}; best single view {max(singles, key=pav)} {max(pav(s) for s in singles):.3f}"),
        ("MT* or MTCP* is best on the paper's basis", max(METHODS, key=pav) in ("MT*", "MTCP*"),
         "order: " + " > ".join(f"{n} {pav(n):.3f}" for n in sorted(METHODS, key=pav, reverse=True))),
    ]


def markdown(meta, rows, claims, phases) -> str:
    head = (f"TABED on the zoo image pair ({meta['prompts']} held-out prompts per scenario in one ragged batch, up to "
            f"{meta['max_new']} new tokens, greedy, gamma {meta['gamma']}; {meta['date']}, {meta['device']}, jax "
            f"{meta['jax']}, median of {meta['runs']} runs). tau: tokens per target step (1 + accepted drafts), "
            f"pooled over blocks; the paper's Table 1 value beside it (68M draft -> LLaVA-1.5-7B; its two-image sets "
            f"are in its first-turn average).")
    lines = [head, "", "| method | " + " | ".join(f"{s} tau (paper)" for s in SCENARIOS) +
             " | average | paper's basis (no OOD) | same as AR |", "|---" * (len(SCENARIOS) + 4) + "|"]
    for n, per in rows.items():
        cells = []
        for i, s in enumerate(SCENARIOS):
            p = PAPER[n][i]
            cells.append(f"{per[s]['tau']:.2f}" + ("" if p is None else f" ({p:.2f})"))
        same = all(per[s]["same_as_ar"] for s in SCENARIOS)
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {per['average']['tau']:.3f} | "
                     f"{per['paper_average']['tau']:.3f} | {'yes' if same else 'NO'} |")
    lines += ["", f"Expected speedup, Eq. (1) = tau / (gamma T_q/T_p + 1): with T_q/T_p = {meta['tq_tp_here']:.3f} "
              f"measured here (draft vs target decode time per token) and with the paper's {meta['tq_tp_paper']} "
              "(A6000, 68M -> 7B); and the wall-time decode speedup over AR measured in the same run:", "",
              "| method | Eq. 1 (here) | Eq. 1 (paper's ratio) | " + " | ".join(f"wall {s}" for s in SCENARIOS) +
              " | captioning s |", "|---" * (len(SCENARIOS) + 4) + "|"]
    for n, per in rows.items():
        cap = max(per[s]["caption_s"] for s in SCENARIOS)
        lines.append(f"| {n} | {per['average']['eq1_here']:.2f} | {per['average']['eq1_paper']:.2f} | " +
                     " | ".join(f"{per[s]['speedup']:.2f}x" for s in SCENARIOS) + f" | {cap:.2f} |")
    lines += ["", "Per decode step on the first-turn batch (ms; phase by phase, host-synced): what 1, 2 and 4 views "
              "cost the draft here (the paper's Remark 3 has them cost about one view on its GPU):", "",
              "| views | draft | verify | other |", "|---|---|---|---|"]
    for n, p in phases.items():
        lines.append(f"| {n} | {p['draft']:.2f} | {p['verify']:.2f} | {p['other']:.2f} |")
    lines += ["", "Mean weights the adaptive policies chose after the first block (views in order):", ""]
    for n in ("MT*", "MTCP*"):
        lines.append(f"- {n}: " + "; ".join(f"{s}: " + ", ".join(f"{w:.2f}" for w in rows[n][s]["mean_weights"])
                                           for s in SCENARIOS))
    lines += ["", "The paper's orderings on these numbers:", ""]
    lines += [f"- {c}: {'holds' if ok else 'does not hold'} ({why})" for c, ok, why in claims]
    return "\n".join(lines) + "\n"


def plot(rows, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        xs = np.arange(len(SCENARIOS) + 1) + i * width
        ax.bar(xs, [rows[n][s]["tau"] for s in SCENARIOS] + [rows[n]["average"]["tau"]], width, label=n,
               hatch="//" if n.endswith("*") else None)
    ax.set_xticks(np.arange(len(SCENARIOS) + 1) + 0.4 - width / 2)
    ax.set_xticklabels(list(SCENARIOS) + ["average"])
    ax.set_ylabel("tokens per target step (tau)")
    ax.set_ylim(1.0, None)
    ax.set_title("TABED on the zoo image pair: block efficiency by drafting view / ensemble")
    ax.legend(ncol=4, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
