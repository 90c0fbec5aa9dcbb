"""Choose the draft vocabulary of a registered model's shipped EAGLE head: tokens per step and wall time of its chain
against jspec AR, for draft vocabularies of the N tokens most frequent in the head's training answers.

    python scripts/probe_eagle_vocab.py                                  # SmolLM2, N = 4k, 8k, 16k and all; gamma 3, 4
    python scripts/probe_eagle_vocab.py --sizes 8192 0 --gammas 4 --prompts 6 --runs 3
    python scripts/probe_eagle_vocab.py --ship 8192                      # also name N in the shipped eagle_head.json
    python scripts/probe_eagle_vocab.py --sizes 8192 --gammas 2 3 --eagle3 2 3 --stem eagle-heads   # beside EAGLE-3

The prompts are the self-written records the head was held out from (`jspec train eagle --data` holds out the
first 5%), none from Spec-Bench, so the choice is not fitted to the benchmark. Greedy, batch 1, each prompt once
per run, runs interleaved (every configuration, then the next run), medians over runs of the summed wall time.
`--eagle3 G ...` adds the shipped EAGLE-3 head's chains (its own draft vocabulary; its training held out the same
first 5% of its file). Writes bench_out/<stem>-<model>.{json,md} (stem "eagle-vocab"); every configuration's
greedy tokens are checked against AR's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402


def held_out_prompts(path: str, n: int) -> list[np.ndarray]:
    """The first n answered records' prompts (chat template applied, as written) of a self-written data file."""
    from jspec.tools import self_data as SD

    seqs, starts = SD.sequences(SD.read(path))
    cut = max(1, len(seqs) // 20)  # what `jspec train eagle` holds out
    if n > cut:
        raise SystemExit(f"only {cut} held-out records in {path}")
    return [s[:st] for s, st in zip(seqs[:n], starts[:n])]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--data", default=None, help="default: build/self-data/<model>.jsonl")
    ap.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192, 16384, 0], help="0: the whole vocabulary")
    ap.add_argument("--gammas", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--eagle3", type=int, nargs="*", default=[], help="also the shipped EAGLE-3 head's chains, these "
                                                                     "depths")
    ap.add_argument("--stem", default="eagle-vocab", help="the results files' name before -<model>")
    ap.add_argument("--ship", type=int, default=None, help="write this size into the shipped head's eagle_head.json")
    ap.add_argument("--out", default=str(ROOT / "bench_out"))
    args = ap.parse_args(argv)

    import jspec
    from jspec.tools import models
    from jspec.parts.drafters import eagle_io as IO

    model, tok = models.load(args.model)
    head = models.head(args.model, "eagle", model, draft_vocab=None)
    d = models.head_dir(args.model, "eagle")
    counts = np.load(os.path.join(d, IO.COUNTS_NAME))
    prompts = held_out_prompts(args.data or str(ROOT / "build" / "self-data" / f"{args.model}.jsonl"), args.prompts)
    eos = tuple(np.atleast_1d(tok.eos_token_id).tolist())
    configs = {"ar": None}
    for n in args.sizes:
        h = head.with_vocab(IO.frequent_tokens(counts, n)) if n else head
        for g in args.gammas:
            configs[f"chain g={g}, vocab {n or 'all'}"] = (jspec.Chain(h, gamma=g), n, g, "eagle")
    if args.eagle3:
        h3 = models.head(args.model, "eagle3", model)
        for g in args.eagle3:
            configs[f"EAGLE-3 chain g={g}"] = (jspec.Eagle3(h3, tree="chain", depth=g), h3.draft_vocab_size, g,
                                               "eagle3")

    def once(strategy):
        walls, toks, acc = 0.0, [], []
        for p in prompts:
            t = time.perf_counter()
            out = jspec.decode(model, p, None if strategy is None else strategy[0], max_new_tokens=args.max_new,
                               eos_token_id=eos, pad_prompt_to=128)
            walls += time.perf_counter() - t
            toks.append(out.tokens[0, :int(out.lengths[0])])
            acc.append(float(out.stats["mean_accepted"][0]) if strategy is not None else 1.0)
        return walls, toks, acc

    for name, s in configs.items():  # compile every program first
        print(f"warm-up: {name}", flush=True)
        once(s)
    walls = {name: [] for name in configs}
    res = {}
    for r in range(args.runs):
        for name, s in configs.items():
            w, toks, acc = once(s)
            walls[name].append(w)
            res[name] = (toks, acc)
            print(f"run {r + 1}: {name}: {w:.2f} s", flush=True)
    ar_wall = statistics.median(walls["ar"])
    ar_toks = res["ar"][0]
    rows = []
    for name, s in configs.items():
        toks, acc = res[name]
        w = statistics.median(walls[name])
        rows.append({"config": name, "head": None if s is None else s[3], "vocab": None if s is None else (s[1] or "all"),
                     "gamma": None if s is None else s[2], "tau": round(float(np.mean(acc)), 3),
                     "wall_s": round(w, 3), "speedup": round(ar_wall / w, 3),
                     "equal_to_ar": f"{sum(np.array_equal(a, b) for a, b in zip(toks, ar_toks))}/{len(toks)}",
                     "coverage": None if s is None or not s[1] or s[3] != "eagle" else
                     round(float(np.sort(counts)[::-1][:s[1]].sum() / counts.sum()), 4)})
    meta = {"model": args.model, "prompts": args.prompts, "max_new_tokens": args.max_new, "runs": args.runs,
            "date": time.strftime("%Y-%m-%d"), "head": json.load(open(os.path.join(d, IO.CONFIG_NAME)))}
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{args.stem}-{args.model}")
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    cols = ["config", "tau", "wall_s", "speedup", "coverage", "equal_to_ar"]
    lines = [f"# EAGLE heads' chains and draft vocabularies, {args.model}, {meta['date']}", "",
             f"{args.prompts} held-out self-written prompts, greedy, batch 1, up to {args.max_new} new tokens, medians "
             f"of {args.runs} interleaved runs; coverage = the vocabulary's share of the training answers' tokens.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join("" if r[c] is None else str(r[c]) for c in cols) + " |" for r in rows]
    Path(stem + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[4:]))
    print(f"wrote {stem}.json, {stem}.md")
    if args.ship is not None:
        path = os.path.join(d, IO.CONFIG_NAME)
        with open(path) as f:
            cfg = json.load(f)
        cfg["draft_vocab"] = args.ship or None
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)
        print(f"{path}: draft_vocab = {cfg['draft_vocab']}")


if __name__ == "__main__":
    main()
