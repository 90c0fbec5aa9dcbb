"""Speculative Jacobi decoding (jspec.SJD: SJD and MC-SJD) on the zoo's text-to-image pair beside AR, EAGLE-1 and
LANTERN++, and on the zoo's text pair beside AR and a draft-model chain: tokens per target step, wall time against AR
measured in the same run, the window length's effect, and image quality against AR's images from the same keys.

    python scripts/bench_sjd.py                       # writes bench_out/sjd-zoo.{json,md}
    python scripts/bench_sjd.py --prompts 16 --runs 3 --quality 32 --windows 4,8,16

Setup as scripts/bench_lantern.py: t2i-target (a 4-layer Chameleon, 8 x 8 codes, 73 generated tokens per image with
the end-of-row and end-of-image tokens), held-out scene captions as one batch, CFG 3, temperature 1, top-k 128.
Every method decodes once to compile, then `--runs` timed rounds interleaved over the methods (the order rotated
each round); decode time is the median (the prefill outside it), its ratio to AR's median of the same rounds is the
speedup. Tokens per target step S pools every image a method generated (accepted drafts + 1, the forced grammar
tokens included); its standard error is the delta method's over the images' step counts. Quality on `--quality`
images per method, every method with the same keys: caption consistency (the zoo's image target answers colour /
shape / position questions about each image) and zoo-FID (Frechet distance of the image target's vision features
to the rendered scenes'), as bench_lantern.py measures them. The text pair: the zoo evaluation's held-out prompts
(`jspec.tools.zoo.evaluate`), greedy and at temperature 1, S and wall time against AR in the same rounds.
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
from jspec.core.provenance import provenance  # noqa: E402
from jspec import images as IG  # noqa: E402
from jspec.parts.drafters import eagle_io as IO  # noqa: E402
from jspec.tools.zoo import t2i as T  # noqa: E402

SAMPLING = dict(cfg_scale=3.0, temperature=1.0, top_k=128)
EXT = "naive_extend_57"
IMAGE_TOKENS = T.GRID * (T.GRID + 1) + 1 - 1.0  # an image's tokens after the prefill's


def image_methods(head, table, windows) -> dict:
    """name -> (strategy or None for AR, measure quality)."""
    m = {"AR": (None, True), "EAGLE-1 (exact)": (jspec.LanternPP(head, table, k=0, lam=1.0, tree=EXT), False),
         "LANTERN++ k10 lam3": (jspec.LanternPP(head, table, k=10, lam=3.0, tree=EXT), True)}
    for w in windows:
        q = w == max(windows)
        m[f"SJD w{w}"] = (jspec.SJD(window=w, coupling="independent"), q)
        m[f"MC-SJD w{w}"] = (jspec.SJD(window=w, coupling="maximal"), q)
    m[f"MC-SJD w{max(windows)} uniform init"] = (jspec.SJD(window=max(windows), init="uniform"), False)
    return m


def pooled_s(steps, tokens: float) -> tuple[float, float]:
    st = np.asarray(steps, np.float64)
    s = tokens / st.mean()
    se = s * st.std(ddof=1) / st.mean() / np.sqrt(st.size) if st.size > 1 else float("nan")
    return float(s), float(se)


def timed_rounds(todo: dict, call, runs: int, label: str) -> tuple[dict, dict]:
    """Round 0 compiles; then `runs` rounds over every method, the order rotated each round. Returns
    ({name: [decode_s per round]}, {name: [target steps per row, pooled]})."""
    times = {n: [] for n in todo}
    steps = {n: [] for n in todo}
    names = list(todo)
    for r in range(runs + 1):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            out = call(todo[name][0], jax.random.key(1000 + r))
            if r == 0:
                print(f"  [{label}] {name}: {time.perf_counter() - t0:.1f} s (compile included)", flush=True)
                continue
            times[name].append(float(out.stats["decode_s"]))
            steps[name] += [float(x) for x in np.asarray(out.stats["steps"])]
        print(f"  [{label}] round {r} done", flush=True)
    return times, steps


def summarise(times: dict, steps: dict, tokens: float) -> dict:
    ar = np.asarray(times["AR"])
    res = {}
    for name in times:
        t = np.asarray(times[name])
        res[name] = dict(decode_s=float(np.median(t)), decode_s_runs=[float(x) for x in t],
                         speedup=float(np.median(ar) / np.median(t)),
                         speedup_per_round=[float(a / b) for a, b in zip(ar, t)])
        res[name]["S"], res[name]["S_se"] = (1.0, 0.0) if name == "AR" else pooled_s(steps[name], tokens)
    return res


def run_images(args, windows) -> dict:
    target = IG._generating(T.load_target())
    vq = T.load_vq()
    head, table = IO.load_drafter(str(T.weights_dir("t2i-eagle")), target)
    scenes = [T.scene("heldout", i) for i in range(max(args.prompts, args.quality))]
    caps = [T.caption_ids(T.caption(s)) for s in scenes]
    todo = image_methods(head, table, windows)

    def call(strat, key, caps=caps[:args.prompts], decoder=None):
        return jspec.generate_image(target, caps, T.GRID, T.GRID, strategy=strat, key=key, decoder=decoder,
                                    image_prefix_ids=T.image_prefix(), **SAMPLING)

    print(f"images: {len(todo)} methods, {args.prompts} prompts, {args.runs} runs", flush=True)
    times, steps = timed_rounds(todo, call, args.runs, "t2i")
    res = summarise(times, steps, IMAGE_TOKENS)
    if args.quality:
        asker = T.Asker.load()
        qs = T.questions(scenes[:args.quality], per_scene=3)
        real_feats = asker.features(np.stack([T.render(s) for s in scenes[:args.quality]]))
        res["rendered"] = {"consistency": asker.ask(None, qs)["all"]}
        for name, (strat, want) in todo.items():
            if not want:
                continue
            imgs = []
            for i in range(0, args.quality, args.prompts):  # the same keys for every method
                o = call(strat, jax.random.key(7 + i), caps[i:i + args.prompts][:args.quality - i], vq)
                imgs.append(o.images)
            imgs = np.concatenate(imgs)[:args.quality]
            a = asker.ask(imgs, qs)
            res[name].update(consistency=float(a["all"]), questions=int(a["n"]),
                             zoo_fid=float(T.frechet_distance(asker.features(imgs), real_feats)))
            print(f"  [t2i] {name}: consistency {res[name]['consistency']:.3f}, zoo-FID {res[name]['zoo_fid']:.2f}",
                  flush=True)
    return res


def run_steps(args) -> dict:
    """Tokens per target step only (no timing), SJD against MC-SJD on `--steps-images` held-out captions per method
    (batches of `--prompts`, the same keys for every method), at the windows of `--steps-windows`."""
    target = IG._generating(T.load_target())
    caps = [T.caption_ids(T.caption(T.scene("heldout", 500 + i))) for i in range(args.steps_images)]
    res = {}
    for w in [int(x) for x in args.steps_windows.split(",")]:
        for name, strat in ((f"SJD w{w}", jspec.SJD(window=w, coupling="independent")),
                            (f"MC-SJD w{w}", jspec.SJD(window=w)),
                            (f"MC-SJD w{w} uniform init", jspec.SJD(window=w, init="uniform"))):
            steps = []
            for i in range(0, len(caps), args.prompts):
                o = jspec.generate_image(target, caps[i:i + args.prompts], T.GRID, T.GRID, strategy=strat,
                                         key=jax.random.key(77 + i), image_prefix_ids=T.image_prefix(), **SAMPLING)
                steps += [float(x) for x in np.asarray(o.stats["steps"])]
            s, se = pooled_s(steps, IMAGE_TOKENS)
            res[name] = dict(S=s, S_se=se, images=len(steps))
            print(f"  [steps] {name}: S {s:.2f} +- {se:.2f} over {len(steps)} images", flush=True)
    return res


def run_text(args, windows) -> dict:
    from jspec.tools.bench.zoo import zoo_pairs

    pairs = zoo_pairs(args.text_prompts)
    if "zoo text" not in pairs:
        return {}
    target, draft, scen, _, max_new = pairs["zoo text"]
    prompts = [p for ps in scen.values() for p in ps][:args.text_prompts]
    out = {}
    for temp in (0.0, 1.0):
        todo = {"AR": (None,), "Chain text-draft gamma 5": (jspec.Chain(draft, gamma=5),)}
        for w in windows:
            todo[f"SJD w{w}"] = (jspec.SJD(window=w, coupling="independent"),)
            todo[f"MC-SJD w{w}"] = (jspec.SJD(window=w),)

        def call(strat, key):
            return jspec.decode(target, prompts, strategy=strat, max_new_tokens=max_new, temperature=temp, key=key,
                                eos_token_id=())
        times, steps = timed_rounds(todo, call, args.runs, f"text T={temp:g}")
        out[f"T={temp:g}"] = summarise(times, steps, max_new - 1.0)
    out["meta"] = dict(prompts=len(prompts), max_new_tokens=max_new)
    return out


def markdown(res: dict) -> str:
    lines = []
    if res.get("steps"):
        lines += ["### tokens per target step, SJD against MC-SJD (zoo t2i pair)", "",
                  "| method | S (+- s.e.) | images |", "|---|---|---|"]
        lines += [f"| {n} | {r['S']:.2f} +- {r['S_se']:.2f} | {r['images']} |" for n, r in res["steps"].items()]
        lines.append("")
    for title, block, quality in (("text-to-image (zoo t2i pair, CFG 3, T 1, top-k 128)", res["images"], True),
                                  ("text (zoo text pair), greedy", res["text"].get("T=0", {}), False),
                                  ("text (zoo text pair), T 1", res["text"].get("T=1", {}), False)):
        if not block:
            continue
        lines += [f"### {title}", "", "| method | tokens per target step S (+- s.e.) | decode s (median) | wall vs AR |"
                  + (" caption consistency | zoo-FID |" if quality else ""),
                  "|---|---|---|---|" + ("---|---|" if quality else "")]
        for name, r in block.items():
            if "S" not in r:
                continue
            row = f"| {name} | {r['S']:.2f} +- {r['S_se']:.2f} | {r['decode_s']:.3f} | {r['speedup']:.2f}x |"
            if quality:
                row += (f" {r['consistency']:.3f} | {r['zoo_fid']:.2f} |" if "consistency" in r else " | |")
            lines.append(row)
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--quality", type=int, default=32, help="images per quality-scored method (0: none)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--windows", default="4,8,16")
    ap.add_argument("--text-prompts", type=int, default=8)
    ap.add_argument("--no-text", action="store_true")
    ap.add_argument("--steps-images", type=int, default=0,
                    help="also (or with --runs 0, only) tokens per step of SJD and MC-SJD over this many images")
    ap.add_argument("--steps-windows", default="16,32")
    ap.add_argument("--out", default=str(ROOT / "bench_out"))
    args = ap.parse_args(argv)
    windows = [int(w) for w in args.windows.split(",")]
    timed = args.runs > 0
    res = {"images": run_images(args, windows) if timed else {},
           "text": {} if args.no_text or not timed else run_text(args, windows)}
    if args.steps_images:
        res["steps"] = run_steps(args)
    stem = "sjd-zoo" if timed else "sjd-zoo-steps"
    res["meta"] = dict(provenance=provenance(), prompts=args.prompts, quality=args.quality, runs=args.runs,
                       windows=windows, sampling=SAMPLING,
                       command="python scripts/bench_sjd.py " + " ".join(sys.argv[1:] if argv is None else argv))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=2))
    (out / f"{stem}.md").write_text(markdown(res))
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
