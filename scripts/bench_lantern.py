"""LANTERN / LANTERN++ on the zoo's text-to-image pair: step compression, latency speedup and image quality for AR,
EAGLE-1 (static trees, exact), EAGLE-2 (dynamic tree, exact), LANTERN (additive delta) and LANTERN++ (k x lambda),
as LANTERN++'s Tables 1-5 measure them, and whether the paper's claims hold on our numbers.

    python scripts/bench_lantern.py            # writes bench_out/lantern-zoo.{json,md,png} and -grid.png
    python scripts/bench_lantern.py --prompts 64 --runs 2 --quality 64
    python scripts/bench_lantern.py --grid --prompts 16 --quality 48 --runs 1   # -> lantern-zoo-grid-points.*

`--grid` runs the paper's grid points the main run leaves out (Tables 3-5): lambda 20 (and 10 beside it) at every k,
delta 1e-4 / 2e-4 / 5e-4 at every k, the original tree at lambda 10 and 20 and at k = 5, 20, 50, and LANTERN's
additive delta on EAGLE-2's dynamic tree (the paper's LANTERN baseline), with AR, EAGLE-1 and LANTERN++ k10 lambda
3 as references measured in the same run.

Setup: the zoo's t2i-target (a 4-layer Chameleon, 8 x 8 codes of the t2i-vq tokenizer, 73 generated tokens per
image with the end-of-row and end-of-image tokens) and its EAGLE-1 head (assets/zoo/jspec_zoo/t2i-eagle, trained on the
target's own images by `jspec train eagle`), held-out scene captions, CFG 3, temperature 1, top-k 128 (a
quarter of the 512 codes, as Lumina-mGPT's 2000 of 8192). Each method decodes the prompts as one batch, once to
compile and `--runs` timed rounds interleaved over the methods (median decode time, the prefill outside it);
step compression S is tokens per target step (accepted drafts + 1, the forced grammar tokens included as
Lumina's count does) pooled over every image a method generated (its timed rounds and its quality images), with
a standard error, AR = 1; a claim about S is called within the noise when two rows differ by less than twice
their combined standard error. Quality, on `--quality` images per method: caption
consistency (the zoo's image target answers colour / shape / position questions about each generated image; exact
match against the caption's scene) and a zoo-FID (Frechet distance between the image target's vision features of
the generated images and of the scenes rendered).
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
from jspec import images as IG  # noqa: E402
from jspec.parts.drafters import eagle_io as IO  # noqa: E402
from jspec.tools.zoo import t2i as T  # noqa: E402

SAMPLING = dict(cfg_scale=3.0, temperature=1.0, top_k=128)
EXT, ORIG = "naive_extend_57", "mc_sim_7b_63"
# the paper's numbers beside ours (Lumina-mGPT-7B-768, Table 2; Table 1's step compression for the dynamic tree)
PAPER = {"EAGLE-1": dict(S=2.94, speedup=2.10, FID=29.22), "LANTERN++ k10 lam2": dict(S=3.19, speedup=2.28, FID=30.11),
         "LANTERN++ k10 lam3": dict(S=3.63, speedup=2.56, FID=33.91), "AR": dict(S=1.0, speedup=1.0, FID=28.93)}


def methods(head, table, quick: bool) -> dict:
    """name -> (strategy or None for AR, measure quality)."""
    P, L = jspec.LanternPP, jspec.Lantern
    m = {"AR": (None, True),
         "EAGLE-1": (P(head, table, k=0, lam=1.0, tree=EXT), True),
         "EAGLE-1 orig. tree": (P(head, table, k=0, lam=1.0, tree=ORIG), False),
         "EAGLE-2 dynamic": (P(head, table, k=0, lam=1.0, tree="dynamic"), True)}
    for d in ((0.01, 0.05) if quick else (0.002, 0.01, 0.05, 0.2)):
        m[f"LANTERN k10 delta{d:g}"] = (L(head, table, k=10, delta=d, tree=EXT), True)
    for k in ((10,) if quick else (5, 10, 20, 50)):
        for lam in ((2.0, 3.0) if quick else (2.0, 3.0, 5.0, 10.0)):
            m[f"LANTERN++ k{k} lam{lam:g}"] = (P(head, table, k=k, lam=lam, tree=EXT), k == 10)
    if not quick:
        for lam in (2.0, 3.0, 5.0):
            m[f"LANTERN++ k10 lam{lam:g} orig. tree"] = (P(head, table, k=10, lam=lam, tree=ORIG), False)
        m["LANTERN++ k10 lam3 dynamic"] = (P(head, table, k=10, lam=3.0, tree="dynamic"), False)
    return m


def grid_methods(head, table) -> dict:
    """The paper's grid points missing from `methods` (module docstring); quality on the k = 10 points only."""
    P, L = jspec.LanternPP, jspec.Lantern
    m = {"AR": (None, True), "EAGLE-1": (P(head, table, k=0, lam=1.0, tree=EXT), True),
         "LANTERN++ k10 lam3": (P(head, table, k=10, lam=3.0, tree=EXT), True)}
    for k in (5, 10, 20, 50):
        for lam in (10.0, 20.0):
            m[f"LANTERN++ k{k} lam{lam:g}"] = (P(head, table, k=k, lam=lam, tree=EXT), k == 10 and lam == 20)
    for k in (5, 10, 20, 50):
        for d in (1e-4, 2e-4, 5e-4):
            m[f"LANTERN k{k} delta{d:g}"] = (L(head, table, k=k, delta=d, tree=EXT), k == 10)
    for lam in (10.0, 20.0):
        m[f"LANTERN++ k10 lam{lam:g} orig. tree"] = (P(head, table, k=10, lam=lam, tree=ORIG), False)
    for k in (5, 20, 50):
        m[f"LANTERN++ k{k} lam3"] = (P(head, table, k=k, lam=3.0, tree=EXT), False)
        m[f"LANTERN++ k{k} lam3 orig. tree"] = (P(head, table, k=k, lam=3.0, tree=ORIG), False)
    for d in (0.01, 0.05):
        m[f"LANTERN k10 delta{d:g} dynamic"] = (L(head, table, k=10, delta=d, tree="dynamic"), False)
    return m


def generate(target, caps, strategy, key, decoder=None):
    return jspec.generate_image(target, caps, T.GRID, T.GRID, strategy=strategy, key=key, decoder=decoder,
                                image_prefix_ids=T.image_prefix(), **SAMPLING)


TOKENS_AFTER_PREFILL = T.GRID * (T.GRID + 1) + 1 - 1.0  # an image's tokens; the first comes from the prefill


def pooled_s(steps: list[float]) -> tuple[float, float]:
    """S pooled over images (total tokens / total target steps) and its standard error (delta method over the
    images' step counts)."""
    st = np.asarray(steps, np.float64)
    s = TOKENS_AFTER_PREFILL / st.mean()
    se = s * st.std(ddof=1) / st.mean() / np.sqrt(st.size) if st.size > 1 else float("nan")
    return float(s), float(se)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64, help="held-out captions decoded as one batch per method")
    ap.add_argument("--quality", type=int, default=128, help="images per method for consistency and zoo-FID")
    ap.add_argument("--runs", type=int, default=2, help="timed rounds (median)")
    ap.add_argument("--head", default=str(ROOT / "assets/zoo/jspec_zoo/t2i-eagle"))
    ap.add_argument("--out", default=str(ROOT / "bench_out"))
    ap.add_argument("--quick", action="store_true", help="a few settings only")
    ap.add_argument("--grid", action="store_true", help="the paper's grid points the main run leaves out (docstring)")
    ap.add_argument("--rejudge", action="store_true",
                    help="re-check the claims of the saved run (lantern-zoo.json; with --grid the grid points') without "
                         "decoding, and rewrite its .json / .md")
    args = ap.parse_args(argv)
    if args.rejudge:
        return rejudge(Path(args.out), args.grid)

    target = IG._generating(T.load_target())
    vq_cfg, vq_params = T.load_vq()
    head, table = IO.load_drafter(args.head, target)
    if table is None:
        raise SystemExit(f"{args.head} has no neighbour table (neighbours.npz)")
    scenes = [T.scene("heldout", i) for i in range(max(args.prompts, args.quality))]
    caps = [T.caption_ids(T.caption(s)) for s in scenes]
    todo = grid_methods(head, table) if args.grid else methods(head, table, args.quick)
    res = {name: {"decode_s": []} for name in todo}
    steps = {name: [] for name in todo}  # target steps per generated image, pooled over every batch of a method

    print(f"timing {len(todo)} methods on {args.prompts} prompts, {args.runs} runs", flush=True)
    batch = caps[:args.prompts]
    for r in range(args.runs + 1):  # round 0 compiles
        for name, (strat, _) in todo.items():
            t0 = time.perf_counter()
            out = generate(target, batch, strat, jax.random.key(1000 + r))
            if r == 0:
                print(f"  {name}: {time.perf_counter() - t0:.1f} s (compile included)", flush=True)
            if r:
                res[name]["decode_s"].append(float(out.stats["decode_s"]))
                steps[name] += ([float(x) for x in np.asarray(out.stats["steps"])] if strat is not None
                                else [TOKENS_AFTER_PREFILL] * len(batch))
        print(f"round {r} done", flush=True)
    ar_s = float(np.median(res["AR"]["decode_s"]))
    for name, v in res.items():
        v["decode_s"] = float(np.median(v["decode_s"]))
        v["speedup"] = ar_s / v["decode_s"]

    print(f"quality on {args.quality} images per method", flush=True)
    asker = T.Asker.load()
    qs = T.questions(scenes[:args.quality], per_scene=3)
    real = np.stack([T.render(s) for s in scenes[:args.quality]])
    real_feats = asker.features(real)
    res["rendered"] = {"consistency": asker.ask(None, qs)["all"]}
    grid_images = {}
    for name, (strat, want) in todo.items():
        if not want:
            continue
        imgs = []
        for i in range(0, args.quality, args.prompts):
            o = generate(target, caps[i:i + args.prompts][:args.quality - i], strat, jax.random.key(7 + i),
                         (vq_cfg, vq_params))
            imgs.append(o.images)
            if strat is not None:
                steps[name] += [float(x) for x in np.asarray(o.stats["steps"])]
        imgs = np.concatenate(imgs)[:args.quality]
        a = asker.ask(imgs, qs)
        res[name].update(consistency=a["all"], questions=int(a["n"]), **{f"consistency_{t.removeprefix('vqa_')}": a[t]
                                                  for t in T.ASK_TASKS if t in a})
        res[name]["zoo_fid"] = T.frechet_distance(asker.features(imgs), real_feats)
        grid_images[name] = imgs[:6]
    for name in todo:
        res[name]["S"], res[name]["S_se"] = pooled_s(steps[name]) if todo[name][0] is not None else (1.0, 0.0)
        res[name]["S_images"] = len(steps[name])
    for name, (strat, want) in todo.items():
        if not want:
            continue
        print(f"{name}: S {res[name]['S']:.2f} +- {res[name]['S_se']:.2f}, speedup {res[name]['speedup']:.2f}, "
              f"consistency {res[name]['consistency']:.3f}, zoo-FID {res[name]['zoo_fid']:.2f}", flush=True)

    stem = "lantern-zoo-grid-points" if args.grid else "lantern-zoo"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(dict(results=res), indent=2))  # the numbers first, then claims
    claims = judge_grid(res) if args.grid else judge(res)
    meta = dict(date=time.strftime("%Y-%m-%d"), device=jax.devices()[0].device_kind, jax=jax.__version__,
                prompts=args.prompts, quality=args.quality, runs=args.runs, sampling=SAMPLING,
                command="python scripts/bench_lantern.py " + " ".join(sys.argv[1:] if argv is None else argv))
    (out_dir / f"{stem}.json").write_text(json.dumps(dict(meta=meta, results=res, claims=claims, paper=PAPER),
                                                     indent=2))
    (out_dir / f"{stem}.md").write_text(markdown(res, claims, meta))
    plot(res, out_dir / f"{stem}.png")
    if not args.grid:
        image_grid(grid_images, real[:6], [T.caption(s) for s in scenes[:6]], out_dir / "lantern-zoo-grid.png")
    print(markdown(res, claims, meta))
    return res


def judge(res: dict) -> list[dict]:
    """The paper's claims, checked on our numbers."""
    g = lambda n, k: res.get(n, {}).get(k)  # noqa: E731
    out = []
    def noise(a: str, b: str) -> str:
        """' (within the noise)' when rows a and b's S differ by less than twice their combined standard error."""
        se = float(np.hypot(g(a, "S_se") or 0.0, g(b, "S_se") or 0.0))
        return " (within the noise)" if abs(g(a, "S") - g(b, "S")) < 2 * se else ""

    e1, e2 = g("EAGLE-1", "S"), g("EAGLE-2 dynamic", "S")
    out.append(dict(claim="EAGLE-2's dynamic tree compresses fewer steps than EAGLE-1's static tree on image tokens",
                    holds=bool(e2 < e1), detail=f"S {e2:.2f} vs {e1:.2f}{noise('EAGLE-2 dynamic', 'EAGLE-1')}"))
    lpp = {lam: g(f"LANTERN++ k10 lam{lam}", "S") for lam in (2, 3)}
    cons = {lam: g(f"LANTERN++ k10 lam{lam}", "consistency") for lam in (2, 3)}
    ar_c = g("AR", "consistency")
    out.append(dict(claim="LANTERN++ (k = 10, lambda = 2-3) compresses more steps than EAGLE-1",
                    holds=bool(all(v is not None and v > e1 for v in lpp.values())),
                    detail=f"S lambda 2: {lpp[2]:.2f}{noise('LANTERN++ k10 lam2', 'EAGLE-1')}, lambda 3: "
                           f"{lpp[3]:.2f}{noise('LANTERN++ k10 lam3', 'EAGLE-1')}; EAGLE-1 {e1:.2f}"))
    n_q = max(int(res.get("AR", {}).get("questions", 0)), 1)
    se = float(np.sqrt(2 * ar_c * (1 - ar_c) / n_q)) if n_q > 1 else float("nan")  # of a difference of two rows
    out.append(dict(claim="... with quality close to AR (caption consistency within 0.05 of AR's, either way)",
                    holds=bool(all(c is not None and abs(c - ar_c) <= 0.05 for c in cons.values())),
                    detail=f"consistency lambda 2: {cons[2]:.3f} ({cons[2] - ar_c:+.3f}), lambda 3: {cons[3]:.3f} "
                           f"({cons[3] - ar_c:+.3f}); AR {ar_c:.3f}" +
                           (f"; s.e. of a difference {se:.3f}" if np.isfinite(se) else "")))
    # multiplicative vs additive at equal quality: each LANTERN point against the LANTERN++ points at least as good
    pts_l = [(v["consistency"], v["S"], n) for n, v in res.items() if n.startswith("LANTERN k") and "consistency" in v]
    pts_p = [(v["consistency"], v["S"], n) for n, v in res.items() if n.startswith("LANTERN++ k10 lam")
             and "consistency" in v]
    wins = []
    for c, s, n in pts_l:
        better = [sp for cp, sp, _ in pts_p if cp >= c - 0.02]
        if better:
            wins.append(max(better) >= s)
    out.append(dict(claim="the multiplicative bound compresses more steps than the additive one at equal quality "
                          "(each delta point vs the lambda points of consistency >= its own - 0.02)",
                    holds=bool(all(wins)) if wins else None,
                    detail=f"{sum(wins)} of {len(wins)} delta points beaten" if wins else
                    "no lambda point reached a delta point's consistency: not comparable at this size"))
    return out


def rejudge(out_dir: Path, grid: bool = False) -> dict:
    """The claims of a saved run, checked again by today's `judge` / `judge_grid` (the numbers are not touched)."""
    stem = "lantern-zoo-grid-points" if grid else "lantern-zoo"
    path = out_dir / f"{stem}.json"
    saved = json.loads(path.read_text())
    res, meta = saved["results"], saved["meta"]
    for v in res.values():  # runs before the question count was saved: 3 questions per quality image
        if "consistency" in v:
            v.setdefault("questions", 3 * int(meta["quality"]))
    saved["claims"] = judge_grid(res) if grid else judge(res)
    path.write_text(json.dumps(saved, indent=2))
    (out_dir / f"{stem}.md").write_text(markdown(res, saved["claims"], meta))
    print(markdown(res, saved["claims"], meta))
    return res


def judge_grid(res: dict) -> list[dict]:
    """The claims the grid points bear on, checked on our numbers (same run)."""
    g = lambda n, k: res.get(n, {}).get(k)  # noqa: E731

    def gap(a: str, b: str) -> str:
        d, se = g(a, "S") - g(b, "S"), float(np.hypot(g(a, "S_se") or 0.0, g(b, "S_se") or 0.0))
        return f"{d:+.2f} ({d / se:+.1f} s.e.)" if se else f"{d:+.2f}"

    def beyond(a: str, b: str) -> bool:
        """a's S above b's by more than twice their combined standard error."""
        return g(a, "S") - g(b, "S") > 2 * float(np.hypot(g(a, "S_se") or 0.0, g(b, "S_se") or 0.0))

    def claim(text: str, pairs: list[tuple[str, str]], labels: list[str]) -> dict:
        """Holds when every pair's gap is beyond the noise; the detail says when only the direction holds."""
        up = [g(a, "S") > g(b, "S") for a, b in pairs]
        sure = all(beyond(a, b) for a, b in pairs)
        note = "" if sure or not all(up) else " (direction only: within the noise)"
        return dict(claim=text, holds=bool(sure),
                    detail="; ".join(f"{lab}: {gap(a, b)}" for lab, (a, b) in zip(labels, pairs)) + note)

    ks = (5, 10, 20, 50)
    ext, orig = "LANTERN++ k{k} lam3", "LANTERN++ k{k} lam3 orig. tree"
    return [
        claim("S grows from lambda 10 to 20 at every k (Tables 3-4)",
              [(f"LANTERN++ k{k} lam20", f"LANTERN++ k{k} lam10") for k in ks], [f"k{k}" for k in ks]),
        claim("S grows with delta from 1e-4 to 5e-4 at every k (Table 3)",
              [(f"LANTERN k{k} delta0.0005", f"LANTERN k{k} delta0.0001") for k in ks], [f"k{k}" for k in ks]),
        claim("the extended tree compresses more steps than the original at every k (lambda 3)",
              [(ext.format(k=k), orig.format(k=k)) for k in (5, 20, 50)], [f"k{k}" for k in (5, 20, 50)]),
        claim("LANTERN++ (static tree, lambda 3) compresses more steps than LANTERN on EAGLE-2's dynamic tree "
              "(delta 0.01 / 0.05)", [("LANTERN++ k10 lam3", f"LANTERN k10 delta{d:g} dynamic") for d in (0.01, 0.05)],
              [f"delta {d:g}" for d in (0.01, 0.05)]),
    ]


def markdown(res: dict, claims: list, meta: dict) -> str:
    lines = [f"LANTERN / LANTERN++ on the zoo text-to-image pair ({meta['date']}, {meta['device']}, jax {meta['jax']};"
             f" {meta['prompts']} prompts per batch, median of {meta['runs']} runs; quality on {meta['quality']} "
             f"images; `{meta['command']}`)", "",
             "| method | step compression S (+- s.e.) | latency speedup | caption consistency | zoo-FID | "
             "paper S / speedup / FID |",
             "|---|---|---|---|---|---|"]
    for name, v in res.items():
        if name == "rendered":
            continue
        p = PAPER.get(name)
        ps = f"{p['S']:.2f} / {p['speedup']:.2f} / {p['FID']:.2f}" if p else ""
        c = f"{v['consistency']:.3f}" if "consistency" in v else ""
        f = f"{v['zoo_fid']:.2f}" if "zoo_fid" in v else ""
        se = f" +- {v['S_se']:.2f}" if v.get("S_se") else ""
        lines.append(f"| {name} | {v['S']:.2f}{se} | {v['speedup']:.2f}x | {c} | {f} | {ps} |")
    lines += ["", f"Rendered scenes (the judge's ceiling): caption consistency {res['rendered']['consistency']:.3f}.",
              "", "| the paper's claim | holds here | numbers |", "|---|---|---|"]
    verdict = {True: "yes", False: "no", None: "not measured"}
    lines += [f"| {c['claim']} | {verdict[c['holds']]} | {c['detail']} |" for c in claims]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in res if n != "rendered"]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    ax = axes[0]
    y = np.arange(len(names))
    ax.barh(y - 0.2, [res[n]["S"] for n in names], 0.4, xerr=[2 * res[n].get("S_se", 0.0) for n in names],
            label="step compression S (+- 2 s.e.)")
    ax.barh(y + 0.2, [res[n]["speedup"] for n in names], 0.4, label="latency speedup")
    ax.set_yticks(y, names, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=0.5)
    ax.legend()
    ax.set_title("tokens per target step and wall-time speedup over AR")
    ax = axes[1]
    for prefix, marker in (("LANTERN++ k10", "o"), ("LANTERN k", "s"), ("EAGLE", "^"), ("AR", "*")):
        pts = [(res[n]["consistency"], res[n]["S"], n) for n in names if n.startswith(prefix) and "consistency" in res[n]
               and not (prefix == "LANTERN k" and n.startswith("LANTERN++"))]
        if pts:
            ax.scatter([p[1] for p in pts], [p[0] for p in pts], marker=marker, label=prefix)
            for c, s, n in pts:
                ax.annotate(n.split(" ")[-1], (s, c), fontsize=7)
    ax.set_xlabel("step compression S")
    ax.set_ylabel("caption consistency (image target's exact match)")
    ax.set_title("speed vs quality")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def image_grid(images: dict, real: np.ndarray, captions: list[str], path: Path) -> None:
    """Rows: captions; columns: the rendered scene, then each method's image for that caption."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = ["rendered"] + [n for n in ("AR", "EAGLE-1", "LANTERN++ k10 lam2", "LANTERN++ k10 lam3",
                                       "LANTERN k10 delta0.05") if n in images]
    fig, axes = plt.subplots(len(real), len(cols), figsize=(1.9 * len(cols), 2.0 * len(real)))
    for r in range(len(real)):
        for c, name in enumerate(cols):
            ax = axes[r, c]
            ax.imshow(real[r] if name == "rendered" else images[name][r])
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(name, fontsize=7)
            if c == 0:
                ax.set_ylabel(captions[r][:40], fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
