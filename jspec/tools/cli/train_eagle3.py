"""Train an EAGLE-3 head on a frozen target with training-time test, and export it in vLLM's speculators format.

    jspec train eagle3 --target text-target --out build/eagle3/text-target --minutes 10
    jspec train eagle3 --target smollm2-135m-instruct \
        --data build/self-data/smollm2-135m-instruct.jsonl --out build/eagle3/smollm2-135m-instruct \
        --seq-len 512 --draft-vocab 8192 --minutes 50 --ship

The head (`jspec.parts.drafters.eagle3`): fc [3D -> D] over the target's residual streams at three layers (default
EAGLE-3's 2, L // 2, L - 3; --aux-layers), one decoder layer whose attention reads [embedding; fused state], its
own norm and an LM head over the --draft-vocab tokens the training answers use most (0: every token). The loss is
training-time test (`jspec.tools.train.eagle3`): --ttt-steps steps, the head's own states fed back, KL to the
target's next-token distribution over the draft vocabulary, step s weighted --decay**s. AdamW (0.9, 0.95) after a
per-value gradient clip of 0.5, warmup (3%) then decay.

Data and held-out batches are `jspec train eagle`'s: the zoo's text chats for a zoo target; for a registered
real model (`jspec.models`), the text it wrote itself (--data, `jspec.tools.self_data`), answers weighted, the first 5%
of the records held out; for an HF checkpoint directory, --texts.

Everything goes to --out: orbax checkpoints (ckpt/), the log (log.jsonl: loss, kl_s and top1_s per step s, per
--log-every window; held-out loss and top1_s at each checkpoint), a loss plot (loss.png) and the head
(`eagle3_io.save_head`: config.json + model.safetensors in the speculators format, which vLLM and SGLang load, and
eagle3_head.json). A rerun with the same --out continues from the checkpoint bit-identically (--no-resume starts
over). --ship also saves a registered model's head (bfloat16) where `jspec.models.head(name, "eagle3")` finds it.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jax  # noqa: E402

from jspec.tools.cli import train_eagle as TE  # noqa: E402  (the data and target helpers of the EAGLE-1 trainer)
from jspec.tools.train import trainer as jt  # noqa: E402
from jspec.parts.drafters import eagle3 as E3  # noqa: E402
from jspec.parts.drafters import eagle3_io as IO  # noqa: E402
from jspec.parts.drafters import eagle_io as EIO  # noqa: E402
from jspec.tools.train import eagle3 as E3T  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="jspec train eagle3", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    TE.add_source_arguments(ap, "eagle3")
    ap.add_argument("--aux-layers", type=int, nargs=3, default=None, help="the target layers fused (default EAGLE-3's)")
    ap.add_argument("--draft-vocab", type=int, default=0, help="draft vocabulary: the answers' most frequent tokens "
                                                               "(0: the target's whole vocabulary)")
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--decay", type=float, default=0.8, help="step s of training-time test weighs decay**s")
    TE.add_run_arguments(ap, lr=1e-3, seq_len=256)
    args = ap.parse_args(argv)
    if args.steps is None and args.minutes is None:
        args.minutes = 20.0
    if args.ttt_steps < 1:
        raise SystemExit("--ttt-steps must be >= 1")

    target, is_zoo = TE.load_target(args.target)
    cfg, _ = E3.text_parts(target)  # a clear error for targets an EAGLE-3 head cannot serve
    from jspec.tools import models

    registered = TE.check_sources(args, is_zoo)
    if is_zoo and args.draft_vocab:
        raise SystemExit("--draft-vocab needs token counts of the training answers: a zoo target drafts over its "
                         "whole (small) vocabulary")
    aux = tuple(args.aux_layers) if args.aux_layers else E3.default_aux_layers(cfg.num_layers)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    name = f"eagle3-{Path(args.target).name}"

    data, heldout, train_items, cut = TE.text_data(args, is_zoo, registered)
    vocab = None
    if args.draft_vocab:
        vocab = EIO.frequent_tokens(TE.answer_counts(train_items, cfg.vocab_size), args.draft_vocab)
    print(f"{name}: {cfg.model_type} target, hidden {cfg.hidden_size}, {cfg.num_layers} layers, fused layers "
          f"{list(aux)}, draft vocabulary {len(vocab) if vocab is not None else cfg.vocab_size}; out {out}")

    opts = E3T.TTTOptions(steps=args.ttt_steps, decay=args.decay)
    head, meta = E3T.fit_head(target, data, out, steps=args.steps, minutes=args.minutes, lr=args.lr,
                              warmup=args.warmup, seed=args.seed, resume=args.resume, opts=opts, heldout=heldout,
                              head=E3T.start_head(target, jax.random.key(args.seed), vocab, aux),
                              log_every=args.log_every, ckpt_minutes=args.ckpt_minutes, name=name,
                              max_steps=args.max_steps, argv=sys.argv[1:] if argv is None else argv)
    jt.plot_log(out / "log.jsonl", out / "loss.png", name, ylabel="loss (sum of decayed KL over TTT steps)")
    evals = [r for r in jt.read_log(out / "log.jsonl") if "heldout_loss" in r]
    last = {k: round(v, 4) for k, v in evals[-1].items() if k.startswith("heldout")} if evals else {}
    done = jt.finished(meta)
    command = "jspec train eagle3 " + " ".join(sys.argv[1:] if argv is None else argv)
    extra = {"steps": meta["step"], "total_steps": meta["total_steps"], "finished": done,
             "train_minutes": round(meta["elapsed_s"] / 60, 1), "lr": args.lr, "ttt_steps": args.ttt_steps,
             "decay": args.decay, "heldout": last, "command": command}
    IO.save_head(head, str(out), target=target, extra=extra)
    if args.ship:
        ship = Path(models.head_dir(args.target, "eagle3"))
        IO.save_head(head, str(ship), target=target, dtype="bfloat16", verifier=args.target, extra={
            "model": args.target, "train_records": len(train_items), "heldout_records": cut, **extra})
        print(f"shipped to {ship}")
    print(f"saved the head ({head.num_params / 1e6:.2f}M params, step {meta['step']} of {meta['total_steps']}) to "
          f"{out}: held-out {last}")
    if not done:
        print("the schedule is not finished: rerun the same command to continue")
    return {"head": head, "meta": meta, "heldout": last}


if __name__ == "__main__":
    main()
