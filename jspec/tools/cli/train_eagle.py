"""Train an EAGLE-1 feature head (the LANTERN++ drafter) on a frozen target, and export it.

    jspec train eagle --target text-target --out build/eagle/text-target --steps 600
    jspec train eagle --target text-target --out build/eagle/text-target --minutes 20
    jspec train eagle --target DIR --texts chats.jsonl --out OUT --steps 2000 --lr 1e-4
    jspec train eagle --target t2i-target --out assets/zoo/jspec_zoo/t2i-eagle --seq-len 112 --batch 16
    jspec train eagle --target smollm2-135m-instruct --data build/self-data/smollm2-135m-instruct.jsonl \
        --out build/eagle/smollm2-135m-instruct --seq-len 512 --minutes 50 --ship

The head (`jspec.parts.drafters.eagle.EagleHead`): fc [2D -> D] with bias over [token embedding; target feature] and one
decoder layer of the target's family, initialised from the target's last layer (`eagle.init_head`); the target's
embedding and LM head are used frozen, never copied. The loss is LANTERN++ 2.2 / EAGLE-1's
(`jspec.tools.train.eagle`): SmoothL1 between the predicted and the target's next feature + 0.1 x the
cross-entropy of the target's LM head over both, on the generated tokens only, with EAGLE's uniform feature noise
(--noise 0.2; its scale 512 / L assumes long rows, 0 disables). AdamW (0.9, 0.95) after a per-value gradient
clip of 0.5, warmup (3% of --steps) then decay. The paper's lr 1e-4 is for 7B targets: small ones want ~1e-3.

Data: a zoo target (`jspec.tools.zoo.available()`: text-target, image-target's language model) trains on the zoo's
text chats (the tasks the zoo's text pair is trained on, T view, packed rows), weighted on the answers (the zoo's
`target_mask`), with 4 held-out batches evaluated at each checkpoint. Another target (an HF checkpoint directory)
needs --texts: JSON lines of {"text": ...} (every token weighted) or {"prompt": ..., "answer": ...} (the answer's
tokens weighted), tokenized with the directory's tokenizer; the first 5% are held out. A registered real model
(`jspec.models`, e.g. smollm2-135m-instruct) trains on the data it wrote itself (--data, `jspec.tools.self_data`: the
answers weighted, the first 5% of the records held out); --ship saves its head in bfloat16 where the package ships
it (`jspec.models.head(name, "eagle")`), with the answer tokens' counts (`token_counts.npy`) from which the
drafter's reduced vocabulary is taken. The zoo's text-to-image
target (`--target t2i-target`) trains on its own images, generated from the training scenes' captions under CFG 3,
T = 1, top-k 128 and cached (LANTERN++ trains its drafters on self-generated images), each as a conditional and an
unconditional row (`eagle_train.cfg_item`, 10% unconditional), the loss on the image tokens; the neighbour table of
the zoo VQ tokenizer's codebook is saved beside the head (`neighbours.npz`).

Everything goes to --out: orbax checkpoints (ckpt/, every --ckpt-minutes and on Ctrl-C / SIGTERM), the log
(log.jsonl: loss, vloss, ploss, top1 = the head's argmax agreeing with the target's, per --log-every window), a
loss plot (loss.png) and, at the end, the head (`eagle_io.save_head`: model.safetensors in the PyTorch EAGLE /
LANTERN layout + eagle_head.json; `eagle_io.load_head(out, target)` reads it back). A rerun with the same --out
continues from the checkpoint bit-identically (--no-resume starts over); a run stopped by its time budget or a
signal exports the head it has and says how to continue.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jspec.tools.train import trainer as jt  # noqa: E402
from jspec.parts.drafters import eagle as EG  # noqa: E402
from jspec.parts.drafters import eagle_io as IO  # noqa: E402
from jspec.tools.train import eagle as EGT  # noqa: E402


def load_target(spec: str):
    """(target, is_zoo): a shipped zoo model by name, else an HF checkpoint directory."""
    from jspec.tools import zoo

    if spec == "t2i-target":
        from jspec.tools.zoo import t2i

        return t2i.load_target(), True
    if spec in zoo.available():
        return zoo.load(spec), True
    if spec in zoo.MODEL_NAMES:
        zoo.model_dir(spec)  # raises: named but not shipped
    from jspec.tools import models

    if spec in models.REGISTRY:
        return models.load(spec)[0], False
    import ports

    if not os.path.isdir(spec):
        raise SystemExit(f"--target {spec!r} is neither a zoo model ({', '.join(zoo.available())}) nor a directory")
    return ports.load_hf(spec), False


def zoo_text_stream(batch: int, seq_len: int, seed: int, split: str = "train"):
    """start -> `fit` batches of the zoo's text chats (packed, answers weighted: the zoo's target_mask, whose
    convention is the head's: entry j counts when token j + 1 is an answer token)."""
    from jspec.tools.zoo import data as ZD

    ZD.register_described_tasks()

    def stream(start: int):
        for b in ZD.batches(split, batch, seq_len, seed, tasks=ZD.TEXT_PAIR_TASKS, view="T", pack=True, start=start):
            yield ({"input_ids": b["input_ids"], "positions": b["positions"], "segment_ids": b["segment_ids"],
                    "mask": b["target_mask"].astype(np.float32)}, int(b["next_index"]),
                   int((b["segment_ids"] > 0).sum()))
    return stream


T2I_SAMPLING = dict(cfg_scale=3.0, temperature=1.0, top_k=128)  # LANTERN++'s CFG 3, T = 1; top-k a quarter of
# the 512 codes (Lumina-mGPT's 2000 of 8192)


def t2i_items(target, n: int, seed: int, split: str, cache_dir: Path, batch: int = 64) -> list:
    """CFG training items of the zoo's text-to-image target from its own images (as LANTERN++ trains its drafters:
    images the target generated from captions, under the sampling it decodes with): [<s> caption] + prefix +
    image tokens, and the prefix alone + the same image tokens. Generated once and cached in `cache_dir`."""
    import jspec
    from jspec.tools.zoo import t2i as T

    path = cache_dir / f"selfgen-{split}-{seed}-{n}.npz"
    caps = [T.caption_ids(T.caption(T.scene(split, i, seed))) for i in range(n)]
    if path.exists():
        toks = np.load(path)["tokens"]
    else:
        out = []
        for i in range(0, n, batch):
            o = jspec.generate_image(target, caps[i:i + batch], T.GRID, T.GRID, key=jax.random.key(seed * 100003 + i),
                                     image_prefix_ids=T.image_prefix(), **T2I_SAMPLING)
            out.append(o.tokens)
            print(f"self-generated {min(i + batch, n)}/{n} {split} images", flush=True)
        toks = np.concatenate(out)
        cache_dir.mkdir(parents=True, exist_ok=True)
        np.savez(path, tokens=toks)
    prefix = T.image_prefix()
    return [EGT.cfg_item(list(c) + prefix, prefix, t) for c, t in zip(caps, toks)]


def file_items(path: str, target_dir: str) -> list:
    """Training items of a JSON-lines file ({"text"} or {"prompt", "answer"}), tokenized by the target's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    items = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            if "text" in d:
                ids = np.asarray(tok(d["text"])["input_ids"], np.int32)
                if len(ids) >= 2:
                    items.append(ids)
            else:
                p = tok(d["prompt"])["input_ids"]
                a = tok(d["answer"], add_special_tokens=False)["input_ids"]
                ids = np.asarray(p + a, np.int32)
                items.append((ids, EGT.generated_mask(len(ids), len(p))))
    if not items:
        raise SystemExit(f"{path} holds no training text")
    return items


def self_data_items(path: str) -> list:
    """Training items of a self-written data file (`jspec.tools.self_data`): each answered record's tokens, with the
    answer's entries weighted."""
    from jspec.tools import self_data as SD

    seqs, starts = SD.sequences(SD.read(path))
    if not seqs:
        raise SystemExit(f"{path} holds no answered record (write it with `jspec train self-data`)")
    return [(s, EGT.generated_mask(len(s), int(st))) for s, st in zip(seqs, starts)]


def answer_counts(items, vocab_size: int) -> np.ndarray:
    """How often each token id occurs as a weighted (answer) token of `items` [vocab_size] int64."""
    c = np.zeros(vocab_size, np.int64)
    for ids, m in items:
        np.add.at(c, ids[1:][m[:-1] > 0], 1)
    return c


def add_source_arguments(ap: argparse.ArgumentParser, kind: str) -> None:
    """The target, output and data arguments every head trainer here takes (`kind`: the shipped drafter kind)."""
    ap.add_argument("--target", required=True, help="a zoo model, a registered model or an HF checkpoint directory")
    ap.add_argument("--out", required=True, help="the run's directory: checkpoints, log, plot and the exported head")
    ap.add_argument("--texts", default=None, help="JSON lines of training text (targets outside the zoo)")
    ap.add_argument("--data", default=None, help="a registered model's self-written data (`jspec train self-data`)")
    ap.add_argument("--ship", action="store_true", help="a registered model's head: also save it (bfloat16) where the "
                                                        f"package ships it, `jspec.models.head(name, '{kind}')`")


def add_run_arguments(ap: argparse.ArgumentParser, lr: float, seq_len: int) -> None:
    """The schedule, batch and checkpoint arguments the EAGLE-3 and block-drafter trainers share."""
    ap.add_argument("--steps", type=int, default=None, help="the schedule's length")
    ap.add_argument("--minutes", type=float, default=None, help="time budget (sizes the schedule without --steps)")
    ap.add_argument("--max-steps", type=int, default=None, help="with --minutes alone: the sized schedule's cap")
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=seq_len)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--ckpt-minutes", type=float, default=3.0)
    ap.add_argument("--log-every", type=int, default=10)


def check_sources(args, is_zoo: bool) -> bool:
    """SystemExit naming what is missing for the target's data or --ship; returns whether the target is a
    registered real model."""
    from jspec.tools import models

    registered = args.target in models.REGISTRY
    if registered and not args.data:
        raise SystemExit(f"{args.target} trains on the data it writes itself: pass --data (`jspec train self-data`)")
    if not is_zoo and not registered and not args.texts:
        raise SystemExit("a target outside the zoo needs --texts (JSON lines of training text)")
    if args.ship and not registered:
        raise SystemExit(f"--ship is for a registered model ({', '.join(sorted(models.REGISTRY))})")
    return registered


def text_data(args, is_zoo: bool, registered: bool):
    """(data for `fit_head`, held-out batches, training items or None, held-out record count or None): the zoo's
    text chats for a zoo target; else the self-written data or --texts, the first 5% of the records held out."""
    if is_zoo:
        held_stream = zoo_text_stream(args.batch, args.seq_len, args.seed, "heldout")(0)
        return zoo_text_stream(args.batch, args.seq_len, args.seed), [next(held_stream)[0] for _ in range(4)], None, \
            None
    items = self_data_items(args.data) if registered else file_items(args.texts, args.target)
    cut = max(1, len(items) // 20)
    held_it = EGT.batches(items[:cut], args.batch, args.seq_len, pack=True)
    heldout = [next(held_it)[0] for _ in range(min(4, cut))]
    train_items = items[cut:] or items
    data = lambda start: EGT.batches(train_items, args.batch, args.seq_len, start, pack=True)  # noqa: E731
    return data, heldout, train_items, cut


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="jspec train eagle", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_source_arguments(ap, "eagle")
    ap.add_argument("--t2i-images", type=int, default=2048, help="t2i-target: self-generated training images")
    ap.add_argument("--neighbours", type=int, default=51, help="t2i-target: neighbours per code in the table saved "
                                                              "with the head (LANTERN's k up to this; its code "
                                                              "residual modes read k + 1)")
    ap.add_argument("--steps", type=int, default=None, help="the schedule's length")
    ap.add_argument("--minutes", type=float, default=None, help="time budget (sizes the schedule without --steps)")
    ap.add_argument("--max-steps", type=int, default=None, help="with --minutes alone: the sized schedule's cap "
                                                                  "(a fast device would otherwise run many epochs)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=None, help="warmup steps (default 3%% of --steps)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--noise", type=float, default=0.2, help="EAGLE's feature noise scale (0: none)")
    ap.add_argument("--p-w", type=float, default=0.1, help="weight of the LM-head cross-entropy term")
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--input-norm", choices=("auto", "on", "off"), default="auto",
                    help="the head's layer normalises its input (auto: Chameleon yes, as LANTERN; LLaMA no, as EAGLE)")
    ap.add_argument("--branch-scale", type=float, default=1.0,
                    help="the initial layer's output projections x this (0: the head starts as the identity on the "
                         "feature; `eagle.init_head`)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                    help="continue from the checkpoint in --out (default); --no-resume starts over")
    ap.add_argument("--ckpt-minutes", type=float, default=3.0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--export-dtype", choices=("float32", "bfloat16"), default=None,
                    help="dtype of the exported weights (default: the head's, float32)")
    args = ap.parse_args(argv)
    if args.steps is None and args.minutes is None:
        args.minutes = 20.0

    target, is_zoo = load_target(args.target)
    EG.text_parts(target)  # a clear error for targets a feature head cannot serve
    from jspec.tools import models

    registered = check_sources(args, is_zoo)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    name = f"eagle-{Path(args.target).name}"
    input_norm = {"auto": None, "on": True, "off": False}[args.input_norm]

    table = None
    if args.target == "t2i-target":
        from jspec.parts.neighbours import NeighbourTable
        from jspec.tools.zoo import t2i as T
        from ports.families import vqgan as VQ

        from jspec import images as IG

        target = IG._generating(target)
        items = t2i_items(target, args.t2i_images, args.seed, "train", out / "data")
        held = t2i_items(target, 4 * args.batch, args.seed, "heldout", out / "data")
        held_it = EGT.batches(held, args.batch, args.seq_len)
        heldout = [next(held_it)[0] for _ in range(4)]
        data = lambda start: EGT.batches(items, args.batch, args.seq_len, start)  # noqa: E731
        _, vq_params = T.load_vq()
        table = NeighbourTable.for_chameleon(target.config, VQ.codebook(vq_params), args.neighbours)
    else:
        data, heldout, train_items, cut = text_data(args, is_zoo, registered)
    cfg, _ = EG.text_parts(target)
    print(f"{name}: {cfg.model_type} target, hidden {cfg.hidden_size}, {cfg.num_layers} layers; out {out}")

    opts = EGT.LossOptions(p_w=args.p_w, noise=args.noise)
    head, meta = EGT.fit_head(target, data, out, steps=args.steps, minutes=args.minutes, lr=args.lr,
                             warmup=args.warmup, seed=args.seed, resume=args.resume, opts=opts,
                             weight_decay=args.weight_decay, heldout=heldout,
                             head=EG.init_head(target, jax.random.key(args.seed), input_norm,
                                               branch_scale=args.branch_scale),
                             log_every=args.log_every, ckpt_minutes=args.ckpt_minutes, name=name,
                             max_steps=args.max_steps,
                             argv=sys.argv[1:] if argv is None else argv)
    jt.plot_log(out / "log.jsonl", out / "loss.png", name, ylabel="loss (SmoothL1 + 0.1 CE)")
    evals = [r for r in jt.read_log(out / "log.jsonl") if "heldout_loss" in r]
    last = {k: round(v, 4) for k, v in evals[-1].items() if k.startswith("heldout")} if evals else {}
    done = jt.finished(meta)
    IO.save_head(head, str(out), table=table, target=target, dtype=args.export_dtype, extra={
        "steps": meta["step"], "total_steps": meta["total_steps"], "finished": done,
        "train_minutes": round(meta["elapsed_s"] / 60, 1), "lr": args.lr, "noise": args.noise, "heldout": last,
        "command": "jspec train eagle " + " ".join(sys.argv[1:] if argv is None else argv)})
    if args.ship:
        ship = Path(models.head_dir(args.target, "eagle"))
        IO.save_head(head, str(ship), target=target, dtype="bfloat16", extra={
            "model": args.target, "steps": meta["step"], "total_steps": meta["total_steps"], "finished": done,
            "train_minutes": round(meta["elapsed_s"] / 60, 1), "lr": args.lr, "noise": args.noise, "heldout": last,
            "train_records": len(train_items), "heldout_records": cut,
            "command": "jspec train eagle " + " ".join(sys.argv[1:] if argv is None else argv)})
        np.save(ship / IO.COUNTS_NAME, answer_counts(train_items, cfg.vocab_size))
        print(f"shipped to {ship}")
    print(f"saved the head ({head.num_params / 1e6:.2f}M params, step {meta['step']} of {meta['total_steps']}) to "
          f"{out}: held-out {last}")
    if not done:
        print("the schedule is not finished: rerun the same command to continue")


if __name__ == "__main__":
    main()
