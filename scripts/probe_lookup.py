"""Can an image target's tower features support the VQA lookup? A diagnostic for issue 8.

The image target shipped until 2026-11-24 (image-target-base) answered "What colour is the circle?" on multi-object
scenes at about chance among the scene's colours. This trains a fresh 2-layer attention model (pre-LN, learned
positions, d=128, 4 heads) to do the lookup on the target's own frozen image features (tower + projector, the 9
tokens the LM reads), with the question given as the LM's own input embeddings, and reports its accuracy on
scenes of another seed, grouped by objects in the scene:

    python scripts/probe_lookup.py                      # the question's tokens, then the assistant token (2 hops)
    python scripts/probe_lookup.py --layout word        # the shape word alone right after the image (1 hop)

Shape scenes from the train split, one question per scene about a shape that occurs once; the answer is one of the
world's colours (a 10-way head on the last position). If this model reaches ~1.0 in a few hundred steps, the
features carry the answer and the lookup is easy to learn in isolation: what the LLaVA LM lacks is training signal
for it, not information.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

TEMPLATES = ("What colour is the {}?", "Tell me the colour of the {}.", "Which colour is the {}?")
Q_LEN = 12   # question slots (padded with the pad embedding)


def dataset(n: int, seed: int, layout: str, features, embed: np.ndarray, tok):
    """(image features [n, 9, D], question embeddings [n, Q, D], answer class [n], index of the query position in
    the question [n], objects in the scene [n], number of classes)."""
    from jspec.tools.zoo import data as ZD
    from jspec.tools.zoo import tokenizer as TK
    from jspec.tools.zoo import world as ZW

    colours = sorted(ZW.COLOURS)
    rng = random.Random(seed)
    scenes, qs, ys, last, objs = [], [], [], [], []
    while len(scenes) < n:
        s = ZW.random_shapes(rng)
        if s.split() != "train":
            continue
        o = rng.choice(s.objects)
        if [x.shape for x in s.objects].count(o.shape) != 1:
            continue
        if layout == "word":
            ids = tok(" " + o.shape, add_special_tokens=False)["input_ids"]
        else:
            ids = [TK.USER_ID] + tok(rng.choice(TEMPLATES).format(o.shape), add_special_tokens=False)["input_ids"]
            ids = ids + [TK.ASSISTANT_ID]
        last.append(len(ids) - 1)
        qs.append(embed[ids + [TK.PAD_ID] * (Q_LEN - len(ids))])
        scenes.append(s)
        ys.append(colours.index(o.colour))
        objs.append(len(s.objects))
    pv = np.stack([ZD.pixels(s, 60) for s in scenes])
    x = np.concatenate([np.asarray(features(jnp.asarray(pv[i:i + 256]))) for i in range(0, n, 256)])
    return x, np.stack(qs), np.array(ys), np.array(last), np.array(objs), len(colours)


def init(key, d_in: int, d: int, n_pos: int, n_out: int, layers: int = 2) -> dict:
    ks = iter(jax.random.split(key, 4 + 6 * layers))
    dense = lambda shape: jax.random.normal(next(ks), shape) / np.sqrt(shape[0])  # noqa: E731
    p = {"inp": dense((d_in, d)), "pos": jax.random.normal(next(ks), (n_pos, d)) * 0.02, "out": dense((d, n_out))}
    p["layers"] = [{"q": dense((d, d)), "k": dense((d, d)), "v": dense((d, d)), "o": dense((d, d)),
                    "up": dense((d, 4 * d)), "down": dense((4 * d, d))} for _ in range(layers)]
    return p


def _norm(x):
    return (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-5)


def forward(p, img, q, last, heads: int = 4):
    """Class logits at the query position (image tokens first, then the question; causal attention)."""
    x = jnp.concatenate([img, q], 1) @ p["inp"] + p["pos"]
    B, T, d = x.shape
    causal = jnp.tril(jnp.ones((T, T), bool))
    split = lambda a: a.reshape(B, T, heads, d // heads)  # noqa: E731
    for lp in p["layers"]:
        h = _norm(x)
        s = jnp.einsum("bthd,bshd->bhts", split(h @ lp["q"]), split(h @ lp["k"])) / np.sqrt(d // heads)
        a = jax.nn.softmax(jnp.where(causal, s, -1e9), -1)
        x = x + jnp.einsum("bhts,bshd->bthd", a, split(h @ lp["v"])).reshape(B, T, d) @ lp["o"]
        x = x + jax.nn.gelu(_norm(x) @ lp["up"]) @ lp["down"]
    return _norm(x[jnp.arange(B), img.shape[1] + last]) @ p["out"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", choices=("question", "word"), default="question")
    ap.add_argument("--train", type=int, default=20000, help="training scenes (sampled with replacement)")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0, help="the probe model's initialisation (the data stay the same)")
    ap.add_argument("--target", default=None,
                    help="an exported image target directory (default: the shipped one; the README's numbers were "
                         "measured on build/stages/image-target-base, the target shipped until 2026-11-24)")
    args = ap.parse_args(argv)

    import ports
    from jspec.tools import zoo
    from ports import llava

    target = zoo.load("image-target") if args.target is None else ports.load_hf(args.target, jnp.float32)
    tok = zoo.load_tokenizer("image-target")
    cfg, params = target.config, target.params
    features = jax.jit(lambda pv: llava.image_features(cfg, params, pv)[1])
    embed = np.asarray(params["lm"]["embed"])
    t0 = time.perf_counter()
    x, q, y, last, _, n_cls = dataset(args.train, 0, args.layout, features, embed, tok)
    xe, qe, ye, laste, objs, _ = dataset(2000, 1, args.layout, features, embed, tok)
    print(f"features of {len(y)} + {len(ye)} scenes: {time.perf_counter() - t0:.0f} s; layout {args.layout}")

    p = init(jax.random.key(args.seed), x.shape[-1], 128, x.shape[1] + Q_LEN, n_cls)
    tx = optax.adamw(args.lr, weight_decay=0.01)
    opt = tx.init(p)

    def loss(p, img, q, last, y):
        logp = jax.nn.log_softmax(forward(p, img, q, last))
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], 1))

    @jax.jit
    def step(p, opt, img, q, last, y):
        val, g = jax.value_and_grad(loss)(p, img, q, last, y)
        upd, opt = tx.update(g, opt, p)
        return optax.apply_updates(p, upd), opt, val

    pred_fn = jax.jit(lambda p, img, q, last: jnp.argmax(forward(p, img, q, last), -1))
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for it in range(args.steps + 1):
        i = rng.integers(0, len(y), args.batch)
        p, opt, val = step(p, opt, x[i], q[i], last[i], y[i])
        if it % args.every == 0:
            hit = np.asarray(pred_fn(p, xe, qe, laste)) == ye
            by = " ".join(f"{k}: {hit[objs == k].mean():.3f}" for k in sorted(set(objs)))
            print(f"step {it} ({time.perf_counter() - t0:.0f} s, {it * args.batch} examples): loss {float(val):.3f}; "
                  f"accuracy by objects in the scene {by}", flush=True)


if __name__ == "__main__":
    main()
