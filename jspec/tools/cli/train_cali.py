"""Train Cali-TS's acceptance predictor for a trained early-exit head, and save it beside the head.

    jspec train cali --target text-target --head assets/zoo/jspec_zoo/text-target-eesd-n1 --steps 300
    jspec train cali --target text-target --head assets/zoo/jspec_zoo/text-target-eesd-n1 --steps 300 --resume
    jspec train cali --target DIR --head HEAD_DIR --texts prompts.jsonl ...     # an HF checkpoint
    jspec train cali --target smollm2-135m-instruct --head assets/heads/jspec_heads/smollm2-135m-instruct/eesd \
        --data build/self-data/smollm2-135m-instruct.jsonl --gen-tokens 256 --seq-len 400 --pad-prompt-to 144

Data: the target's greedy continuations (--gen-tokens) of prompts (a zoo target: the zoo's text tasks, other
examples than the head was trained on; a registered model: the last prompts of its self-written data, --data;
otherwise --texts), made once and kept in the work directory; labels by
teacher forcing (`jspec.tools.train.cali`). The last --heldout generations are held out: their cross-entropy,
accuracy and calibration are logged. AdamW, warmup + cosine (`jspec.tools.train.trainer`); orbax checkpoints every --ckpt-minutes
and on Ctrl-C; `--resume` continues. At the end the predictor is saved into the head's directory
(`calibration.safetensors` + `calibration.json`), where `load_head` finds it for `jspec.EESD(head, controller="cali")`.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jspec.tools.cli import train_eesd as TE  # noqa: E402
from jspec.tools.train import trainer as jt  # noqa: E402
from jspec.parts.controllers import calibration as CAL  # noqa: E402
from jspec.parts.drafters import early_exit as EE  # noqa: E402
from jspec.tools.train import cali as CT  # noqa: E402
from jspec.tools.train import eesd as EST  # noqa: E402


def data_prompts(path: str, n: int) -> list[np.ndarray]:
    """The prompts of the last `n` answered records of a self-written data file (`jspec.tools.self_data`): the EESD
    trainer holds out the last 5% of its records, so these are mostly prompts the head never saw."""
    from jspec.tools import self_data as SD

    seqs, starts = SD.sequences(SD.read(path))
    if len(seqs) < n:
        raise SystemExit(f"{path} holds {len(seqs)} answered prompts; --gen-prompts + --heldout asks for {n}")
    return [np.asarray(q[:int(st)], np.int32) for q, st in zip(seqs[-n:], starts[-n:])]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="jspec train cali", description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="a zoo model name or an HF checkpoint directory")
    ap.add_argument("--head", required=True, help="the early-exit head's directory (save_head)")
    ap.add_argument("--texts", default=None, help="prompts, JSON lines of {'text': ...} (non-zoo targets)")
    ap.add_argument("--data", default=None, help="a registered model's self-written data (`jspec train self-data`): "
                                                  "its last prompts, instead of --texts")
    ap.add_argument("--positions", type=int, default=10, help="P: W^1..W^P (draft offsets past P share W^P)")
    ap.add_argument("--gen-prompts", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=96)
    ap.add_argument("--gen-batch", type=int, default=32, help="prompts decoded together")
    ap.add_argument("--pad-prompt-to", type=int, default=16, help="prompts padded to a multiple of this (one "
                                                                   "compiled program for prompts up to it)")
    ap.add_argument("--heldout", type=int, default=32)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--ckpt-minutes", type=float, default=3.0)
    ap.add_argument("--log-every", type=int, default=10)
    args = ap.parse_args(argv)

    target, is_zoo = TE.load_target(args.target)
    if not is_zoo and not (args.texts or args.data):
        raise SystemExit("a target outside the zoo needs --texts or --data (prompts to continue)")
    if args.texts and args.data:
        raise SystemExit("give --texts or --data, not both")
    head = EE.load_head(args.head, target)
    cfg, lm = EST.head_target_lm(target, head)
    hd = Path(args.head).resolve()
    tag = f"{hd.parent.name}-{hd.name}-cali" if hd.name == "eesd" else f"{hd.name}-cali"  # a shipped head: <model>/eesd
    workdir = Path(args.workdir or Path("build") / "eesd" / tag).resolve()
    if workdir.exists() and not args.resume:  # a fresh run keeps the generations it would make again
        for p in workdir.iterdir():
            if p.name != "greedy.npz":
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    workdir.mkdir(parents=True, exist_ok=True)
    pred = CAL.init_predictor(jax.random.key(args.seed), cfg.hidden_size, positions=args.positions)
    tx = jt.adamw(weight_decay=args.weight_decay)
    state = {"pred": pred, "opt_state": tx.init(pred)}
    meta = jt.new_meta(tag, args.seed, args.steps, args.lr, args.warmup, next_index=0, positions=args.positions)
    if args.resume:
        state, meta, resumed = jt.resume(jt.Checkpoints(workdir), state, meta, args.steps, args.lr * 0.5)
        if resumed:
            print(f"resumed {tag} at step {meta['step']} from {workdir}")

    cache = workdir / "greedy.npz"
    if cache.exists():
        z = np.load(cache)
        texts, starts = np.split(z["tokens"], z["ends"][:-1]), z["starts"]
    else:
        n = args.gen_prompts + args.heldout
        if args.data:
            prompts = data_prompts(args.data, n)
        elif is_zoo:
            prompts = TE.zoo_prompts(n, args.seed + 100)
        else:
            prompts = TE.file_texts(args.texts, args.target)[:n]
        texts = EST.self_distillation_texts(target, prompts, args.gen_tokens, greedy_first=args.gen_tokens,
                                            batch_size=args.gen_batch, pad_prompt_to=args.pad_prompt_to)
        starts = np.asarray([len(p) for p in prompts])
        np.savez(cache, tokens=np.concatenate(texts), ends=np.cumsum([len(t) for t in texts]), starts=starts)
    k = min(args.heldout, len(texts) // 5)
    train, held = (texts[:-k], starts[:-k]), (texts[-k:], starts[-k:])
    print(f"{tag}: predictor {sum(a.size for a in jax.tree.leaves(pred)) / 1e6:.2f}M params (P={args.positions}); "
          f"{len(train[0])} greedy texts to train on, {k} held out; workdir {workdir}")
    held_batches = [b for b, _ in (next(it) for it in [EST.pack(*held[:1], args.batch, args.seq_len,
                                                                starts=held[1])] * 2)]
    stream = ((b, i, int((b["segment_ids"] > 0).sum()))
              for b, i in EST.pack(train[0], args.batch, args.seq_len, meta["next_index"], train[1]))
    train_step, eval_step = CT.make_steps(cfg, head.exit_layer, tx)

    def step(state, batch, lr, i):
        pred, opt, m = train_step(state["pred"], state["opt_state"], np.float32(lr), head.params, lm, batch)
        return {"pred": pred, "opt_state": opt}, m

    state, meta = jt.fit(step, state, stream, meta, workdir, budget_s=60 * args.minutes,
                         ckpt_minutes=args.ckpt_minutes, log_every=args.log_every,
                         evaluate=lambda s: CT.evaluate(eval_step, s["pred"], head.params, lm, held_batches), desc=tag)
    jt.plot_log(workdir / "log.jsonl", workdir / "loss.png", tag)
    if not jt.finished(meta):
        print(f"{tag}: stopped at step {meta['step']} of {meta['total_steps']}: rerun with --resume")
        return
    last = [r for r in jt.read_log(workdir / "log.jsonl") if "heldout_loss" in r][-1]
    import jax.numpy as jnp

    CAL.save_calibration(state["pred"], args.head, dtype=jnp.bfloat16 if is_zoo else None, extra={
        "steps": meta["step"], "train_minutes": round(meta["elapsed_s"] / 60, 1),
        "heldout": {k: round(v, 4) for k, v in last.items() if k.startswith("heldout")},
        "command": "jspec train cali " + " ".join(sys.argv[1:] if argv is None else argv)})
    print(f"saved the calibration predictor to {args.head}: held-out {last}")


if __name__ == "__main__":
    main()
