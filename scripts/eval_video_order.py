"""Does the zoo video target read the order of the frames? Held-out video QA answered on the clip, on the clip
played backwards, on its frames shuffled and on blank frames.

A question is order-sensitive for the model when its answer on the clip is right and its answer on the reversed
clip differs (where a shape moves to and from, which way, what appears or leaves, counts at the start or end).
Shuffled frames keep every shape and place but not the order, so on those questions a model without order
information answers the forward and the backward story equally often: that is chance here. Order-free questions
(does something move, which shape moves, how many move) stay answerable from shuffled frames.

    python scripts/eval_video_order.py                 # 240 questions; writes bench_out/video-order.{json,md}
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def measure(n: int, seed: int = 0) -> dict:
    import jax.numpy as jnp

    import ports
    from jspec.tools.zoo import video as ZV

    target = ports.load_hf(str(ROOT / "assets" / "zoo" / "jspec_zoo" / "video-target"), jnp.float32)
    exs = ZV.eval_set(n, seed)
    enc = ZV.VideoEncoder()
    ans = {}
    for variant in ("clip", ZV.ORDER_CONTROL, "shuffled", "blank"):
        ans[variant] = ZV.answers(target, exs, variant, encoder=enc)
        print(f"{variant}: {np.mean([a == e.answer for a, e in zip(ans[variant], exs)]):.3f}", flush=True)
    ref = [e.answer for e in exs]
    right = np.array([a == r for a, r in zip(ans["clip"], ref)])
    sensitive = right & np.array([a != b for a, b in zip(ans["clip"], ans[ZV.ORDER_CONTROL])])
    free = right & ~sensitive

    def rate(variant, mask, against):
        return float(np.mean([ans[variant][i] == against[i] for i in np.flatnonzero(mask)])) if mask.any() else None

    out = {"questions": n, "exact_match": {v: float(np.mean([a == r for a, r in zip(ans[v], ref)])) for v in ans},
           "order_sensitive": int(sensitive.sum()), "order_free": int(free.sum())}
    for v in ("shuffled", "blank"):
        out[v] = {"sensitive_forward": rate(v, sensitive, ans["clip"]),
                  "sensitive_backward": rate(v, sensitive, ans[ZV.ORDER_CONTROL]),
                  "free_forward": rate(v, free, ans["clip"])}
    by_task = {}
    for t in sorted({e.task for e in exs}):
        m = np.array([e.task == t for e in exs])
        by_task[t] = {"questions": int(m.sum()), "order_sensitive": int((sensitive & m).sum()),
                      **{v: float(np.mean([ans[v][i] == ref[i] for i in np.flatnonzero(m)])) for v in ans}}
    out["by_task"] = by_task
    return out


def table(r: dict) -> str:
    em = r["exact_match"]
    lines = [f"The zoo video target on {r['questions']} held-out video QA questions (greedy, exact match).", "",
             "| frames | exact match |", "|---|---|"]
    lines += [f"| {v} | {em[v]:.3f} |" for v in em]
    pct = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    lines += ["", f"Of the questions the target answers right on the clip, {r['order_sensitive']} are order-sensitive "
              f"(another answer when the clip runs backwards) and {r['order_free']} order-free.", "",
              "| frames | order-sensitive: forward answer | order-sensitive: backward answer "
              "| order-free: same answer |", "|---|---|---|---|"]
    for v in ("shuffled", "blank"):
        x = r[v]
        lines.append(f"| {v} | {pct(x['sensitive_forward'])} | {pct(x['sensitive_backward'])} | "
                     f"{pct(x['free_forward'])} |")
    lines += ["", "| task | questions | order-sensitive | clip | reversed | shuffled | blank |",
              "|---|---|---|---|---|---|---|"]
    for t, x in r["by_task"].items():
        lines.append(f"| {t} | {x['questions']} | {x['order_sensitive']} | {x['clip']:.3f} | {x['reversed']:.3f} | "
                     f"{x['shuffled']:.3f} | {x['blank']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=240)
    ap.add_argument("--out", default=str(ROOT / "bench_out" / "video-order"))
    a = ap.parse_args(argv)
    r = measure(a.n)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(r, indent=1))
    Path(a.out + ".md").write_text(table(r))
    print(table(r))


if __name__ == "__main__":
    main()
