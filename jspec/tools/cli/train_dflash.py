"""Train a block drafter (DFlash) on a frozen target from its cached features, and save it.

    jspec train dflash --target smollm2-135m-instruct --data build/self-data/smollm2-135m-instruct.jsonl \
        --out build/dflash/smollm2-135m-instruct --layers 2 --block 16 --draft-vocab 8192 --minutes 60 --ship

The head (`jspec.parts.drafters.dflash`): --layers Qwen3 decoder layers (the target's widths and RoPE) over
fc([h_a; h_b; ...]), the target's residual streams at --target-layers (default one per draft layer, evenly spaced,
as DFlash picks them), projected; the target's token embedding and LM head (over the --draft-vocab tokens the
training answers use most; 0: every token). One forward drafts a block: the newest token and --block - 1 mask
positions, each fed the target's embedding of --mask-token (default the embedding's last row).

First the target runs once over every training sequence and its states at those layers go to a memory-mapped
store (--features, default OUT/features; reused when it holds the same target, layers and text). Training then
reads only the store: --anchors random anchors a sequence, each the start of a block supervised by the text's
next tokens, position k weighted exp(-(k - 1) / --gamma) (default the authors' 7 for blocks of 16). AdamW after a
global-norm clip of 1, warmup (3%) then cosine decay.

Data: a registered model's self-written text (--data, `jspec train self-data`), answers supervised; or --texts
(JSON lines) for an HF checkpoint directory. The first 5% of the records are held out: their loss, top-1 per
position and greedy acceptance (accept_k: blocks whose first k drafts are right; tau = 1 + sum_k accept_k) are
logged at each checkpoint.

Everything goes to --out: orbax checkpoints (ckpt/), log.jsonl, loss.png, acceptance.png and the head
(`dflash_io.save_head`: the DFlash authors' layout, config.json + model.safetensors). A rerun with the same --out
continues from the checkpoint bit-identically (--no-resume starts over). --ship also saves a registered model's
head (bfloat16) where `jspec.models.head(name, "dflash")` finds it.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jax  # noqa: E402

from jspec.parts.drafters import dflash as DF  # noqa: E402
from jspec.parts.drafters import dflash_io as IO  # noqa: E402
from jspec.parts.drafters import eagle_io as EIO  # noqa: E402
from jspec.tools.cli import train_eagle as TE  # noqa: E402
from jspec.tools.train import dflash as DT  # noqa: E402
from jspec.tools.train import trainer as jt  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="jspec train dflash", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    TE.add_source_arguments(ap, "dflash")
    ap.add_argument("--layers", type=int, default=2, help="the head's decoder layers")
    ap.add_argument("--block", type=int, default=16, help="the anchor and block - 1 draft positions")
    ap.add_argument("--target-layers", type=int, nargs="+", default=None,
                    help="the target streams the context reads (id i: after the target's first i layers)")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="the answers' most frequent tokens (0: all)")
    ap.add_argument("--anchors", type=int, default=8, help="blocks per training sequence")
    ap.add_argument("--gamma", type=float, default=None, help="position k weighs exp(-(k - 1) / gamma)")
    ap.add_argument("--features", default=None, help="the feature store's directory (default OUT/features)")
    ap.add_argument("--mask-token", type=int, default=None,
                    help="the token id whose embedding feeds the mask positions (default the embedding's last row)")
    TE.add_run_arguments(ap, lr=6e-4, seq_len=512)
    args = ap.parse_args(argv)
    if args.steps is None and args.minutes is None:
        args.minutes = 20.0
    target, is_zoo = TE.load_target(args.target)
    cfg, _ = DF.text_parts(target)
    if is_zoo and not args.texts:
        raise SystemExit("a zoo target trains a block drafter on --texts (JSON lines of text it wrote)")
    from jspec.tools import models

    registered = args.target in models.REGISTRY
    if registered and not args.data:
        raise SystemExit(f"{args.target} trains on the data it writes itself: pass --data (`jspec train self-data`)")
    if not registered and not args.texts:
        raise SystemExit("a target outside the registry needs --texts (JSON lines of training text)")
    if args.ship and not registered:
        raise SystemExit(f"--ship is for a registered model ({', '.join(sorted(models.REGISTRY))})")
    items = TE.self_data_items(args.data) if registered else TE.file_items(args.texts, args.target)
    items = [(ids[:args.seq_len], m[:args.seq_len]) for ids, m in items]
    if len(items) < 2:
        raise SystemExit(f"{len(items)} record: training needs at least 2 (the first 5%, at least one, are held out "
                         "and never trained on)")
    cut = max(1, len(items) // 20)
    train_records = list(range(cut, len(items)))
    vocab = None
    if args.draft_vocab:
        vocab = EIO.frequent_tokens(TE.answer_counts(items[cut:], cfg.vocab_size), args.draft_vocab)
    head = DT.start_head(target, jax.random.key(args.seed), args.layers, args.block, args.target_layers, vocab,
                         mask_token=args.mask_token)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    name = f"dflash-{Path(args.target).name}"
    print(f"{name}: {cfg.model_type} target, {cfg.num_layers} layers; head of {args.layers} layers over target "
          f"layers {list(head.target_layers)}, block {args.block}, draft vocabulary {head.draft_vocab_size}; "
          f"{len(items)} records ({cut} held out); out {out}")
    store = DT.FeatureStore.build(target, items, head.target_layers, args.features or out / "features")
    opts = DT.BlockOptions(args.block, args.gamma if args.gamma is not None else DT.default_gamma(args.block))
    heldout = DT.heldout_batches(store, list(range(cut)), args.batch, args.seq_len, args.anchors, args.block,
                                 n=min(4, max(1, cut // args.batch)))
    head, meta = DT.fit_head(target, store, train_records, out, head=head, steps=args.steps, minutes=args.minutes,
                             lr=args.lr, warmup=args.warmup, seed=args.seed, resume=args.resume,
                             batch_size=args.batch, seq_len=args.seq_len, anchors=args.anchors, opts=opts,
                             heldout=heldout, log_every=args.log_every, ckpt_minutes=args.ckpt_minutes, name=name,
                             max_steps=args.max_steps, argv=sys.argv[1:] if argv is None else argv)
    jt.plot_log(out / "log.jsonl", out / "loss.png", name, ylabel="block cross-entropy (nats / token)")
    DT.plot_acceptance(out / "log.jsonl", out / "acceptance.png", f"{name}: held-out greedy acceptance")
    evals = [r for r in jt.read_log(out / "log.jsonl") if "heldout_loss" in r]
    last = {k: round(v, 4) for k, v in evals[-1].items() if k.startswith("heldout")} if evals else {}
    done = jt.finished(meta)
    command = "jspec train dflash " + " ".join(sys.argv[1:] if argv is None else argv)
    extra = {"steps": meta["step"], "total_steps": meta["total_steps"], "finished": done,
             "train_minutes": round(meta["elapsed_s"] / 60, 1), "lr": args.lr, "anchors": args.anchors,
             "gamma": opts.gamma, "device": jax.devices()[0].device_kind, "heldout": last, "command": command,
             "train_records": len(train_records), "heldout_records": cut}
    IO.save_head(head, str(out), extra=extra)
    if args.ship:
        ship = Path(models.head_dir(args.target, "dflash"))
        IO.save_head(head, str(ship), dtype="bfloat16", extra={"model": args.target, **extra})
        print(f"shipped to {ship}")
    print(f"saved the head ({head.num_params / 1e6:.2f}M params, step {meta['step']} of {meta['total_steps']}) to "
          f"{out}: held-out tau {last.get('heldout_tau')}")
    if not done:
        print("the schedule is not finished: rerun the same command to continue")
    return {"head": head, "meta": meta, "heldout": last}


if __name__ == "__main__":
    main()
