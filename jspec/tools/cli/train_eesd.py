"""Train an EESD early-exit head by self-distillation on top of a target's frozen first N layers.

    jspec train eesd --target text-target --exit-layer 1 --steps 600          # a zoo target
    jspec train eesd --target text-target --exit-layer 1 --steps 600 --resume # continue a stopped run
    jspec train eesd --target DIR --texts open.jsonl --exit-layer 3 ...       # an HF checkpoint
    jspec train eesd --target smollm2-135m-instruct --data build/self-data/smollm2-135m-instruct.jsonl \
        --exit-layer 3 --seq-len 512 --minutes 60 --resume                               # a registered model

The head: `--layers` decoder layers initialised from the target's last ones (0: the head-only ablation), the final
norm and an untied LM head initialised from the target's (`--share-lm-head`: none; the target's, frozen). Data: open text (a zoo target: the answers of the zoo's
own text tasks, the text a zoo model is trained to write; otherwise --texts, a JSON-lines file of {"text": ...})
mixed with the target's own generations for prompts of the
same data (`--gen-share` of each batch's rows, the continuations weighted; the first --greedy-first tokens greedy, the rest sampled: the
LLM-QAT hybrid EESD uses; 0 trains on open text alone, the paper's "w/o SD" ablation). The generations are made
once and kept in the work directory. Loss: next-token cross-entropy; AdamW, warmup + cosine (`jspec.tools.train.trainer`).
Orbax checkpoints every --ckpt-minutes and on Ctrl-C / SIGTERM; `--resume` continues bit-identically. At the end
the head is saved (`jspec.parts.drafters.early_exit.save_head`: model.safetensors in the PyTorch layout + eesd_head.json)
to --out (default: jspec/tools/zoo/<target>-eesd-n<N> for a zoo target), with a loss plot beside the run's log.
`--data` (a file of `jspec train self-data`: prompts the target wrote and its answers, drawn greedy-first then
T = 1) is already the target's own text: it replaces both sources, the answers weighted, its last 5% held out.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jspec.tools.train import trainer as jt  # noqa: E402
from jspec.parts.drafters import early_exit as EE  # noqa: E402
from jspec.tools.train import eesd as EST  # noqa: E402


def load_target(spec: str):
    from jspec.tools import models
    from jspec.tools import zoo

    if spec in zoo.MODEL_NAMES:
        return zoo.load(spec), True
    if spec in models.REGISTRY:
        return models.load(spec)[0], False
    import ports

    return ports.load_hf(spec), False


def data_streams(path: str, batch: int, seq_len: int, start: int):
    """(train stream, held-out batches) of a self-written data file (`jspec.tools.self_data`), answers weighted."""
    from jspec.tools import self_data as SD

    seqs, starts = SD.sequences(SD.read(path))
    try:
        stream, held = EST.answer_streams(seqs, starts, batch, seq_len, start)
    except ValueError as e:
        raise SystemExit(f"{path}: {e} (write the data with `jspec train self-data`; --seq-len sets seq_len)")
    cut = max(1, len(seqs) // 20)
    print(f"{path}: {len(seqs)} answered prompts ({len(seqs) - cut} train, {cut} held out), "
          f"{int(sum(len(q) - st for q, st in zip(seqs, starts)))} answer tokens")
    return stream, held


def zoo_open_stream(batch: int, seq_len: int, seed: int, start: int, split: str = "train"):
    from jspec.tools.zoo import data as ZD

    ZD.register_described_tasks()
    for b in ZD.batches(split, batch, seq_len, seed, tasks=ZD.TEXT_PAIR_TASKS, view="T", pack=True, start=start):
        yield ({"input_ids": b["input_ids"], "targets": b["targets"], "segment_ids": b["segment_ids"],
                "positions": b["positions"], "weights": b["target_mask"].astype(np.float32)},
               int(b["next_index"]))


def zoo_prompts(n: int, seed: int) -> list[np.ndarray]:
    """Prompts (up to the last answer) of the zoo's text training examples, from the end of the stream the open
    text reads first (so the generations answer other questions than the open batches of the first steps)."""
    from jspec.tools.zoo import data as ZD
    from jspec.tools.zoo import world as ZW

    ZD.register_described_tasks()
    enc = ZD.Encoder(None, view="T")
    names = ZW.allowed_tasks("train", ZD.TEXT_PAIR_TASKS, False)
    return [enc.encode(ZW.example("train", 5_000_000 + i, seed, names), upto_last_answer=True, view="T").ids
            for i in range(n)]


def file_texts(path: str, target_dir: str) -> list[np.ndarray]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    with open(path) as f:
        return [np.asarray(tok(json.loads(line)["text"])["input_ids"], np.int32) for line in f if line.strip()]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="jspec train eesd", description=__doc__.split("\n")[0])
    ap.add_argument("--target", required=True, help="a zoo model name or an HF checkpoint directory")
    ap.add_argument("--exit-layer", type=int, required=True, help="N: the head reads the target after N layers")
    ap.add_argument("--layers", type=int, default=1, help="early-exit decoder layers (0: head only)")
    ap.add_argument("--share-lm-head", action="store_true", help="no LM head of the head's own: draft and train "
                                                                 "through the target's, frozen")
    ap.add_argument("--texts", default=None, help="open text, JSON lines of {'text': ...} (non-zoo targets)")
    ap.add_argument("--data", default=None, help="the target's self-written data (`jspec train self-data`), "
                                                  "instead of --texts and the generations")
    ap.add_argument("--gen-share", type=float, default=0.5, help="share of each batch's rows from the target's "
                    "own generations (0: open text only)")
    ap.add_argument("--gen-prompts", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=96)
    ap.add_argument("--greedy-first", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--max-steps", type=int, default=None, help="without --steps: the schedule sized to fill "
                                                                  "--minutes holds at most this many steps")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--ship", action="store_true", help="a registered model's head: save it (bfloat16) where the "
                                                        "package ships it, `jspec.models.head(target, 'eesd')`")
    ap.add_argument("--ckpt-minutes", type=float, default=3.0)
    ap.add_argument("--log-every", type=int, default=10)
    args = ap.parse_args(argv)

    target, is_zoo = load_target(args.target)
    if not is_zoo and not (args.texts or args.data):
        raise SystemExit("a target outside the zoo needs --texts (open text to train on) or --data (its own text)")
    if args.data and args.texts:
        raise SystemExit("--data is the target's own text: give it or --texts, not both")
    own = 1.0 if args.data else args.gen_share  # the share of the target's own text in each batch
    tag = f"{Path(args.target).name}-eesd-n{args.exit_layer}" + (f"-k{args.layers}" if args.layers != 1 else "") + (
        "-open" if own == 0 else "") + ("-shared" if args.share_lm_head else "")
    workdir = Path(args.workdir or Path("build") / "eesd" / tag).resolve()
    if workdir.exists() and not args.resume:
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    head = EE.init_head(target, args.exit_layer, args.layers, share_lm_head=args.share_lm_head)
    cfg, lm = EST.head_target_lm(target, head)
    tx = jt.adamw(weight_decay=0.0)
    state = {"params": head.params, "opt_state": tx.init(head.params)}
    meta = jt.new_meta(tag, args.seed, args.steps, args.lr, args.warmup, next_index=[0, 0],
                       exit_layer=args.exit_layer, layers=args.layers, gen_share=own,
                       shares_lm_head=args.share_lm_head)
    if args.resume:
        state, meta, resumed = jt.resume(jt.Checkpoints(workdir), state, meta, args.steps, args.lr * 0.5)
        if resumed:
            print(f"resumed {tag} at step {meta['step']} from {workdir}")
    print(f"{tag}: head {head.num_params / 1e6:.2f}M params ({args.layers} layer(s) + norm"
          f"{' (the target' + chr(39) + 's LM head, shared)' if args.share_lm_head else ' + LM head'}) on "
          f"{cfg.num_layers}-layer {args.target} exiting after layer {args.exit_layer}; workdir {workdir}")

    gen = gen_starts = None
    if args.gen_share > 0 and not args.data:
        cache = workdir / "generations.npz"
        if cache.exists():
            z = np.load(cache)
            gen, gen_starts = np.split(z["tokens"], z["ends"][:-1]), z["starts"]
        else:
            prompts = zoo_prompts(args.gen_prompts, args.seed) if is_zoo else file_texts(args.texts, args.target)[
                :args.gen_prompts]
            gen = EST.self_distillation_texts(target, prompts, args.gen_tokens, args.greedy_first,
                                             key=jax.random.key(args.seed))
            gen_starts = np.asarray([len(p) for p in prompts])
            np.savez(cache, tokens=np.concatenate(gen), ends=np.cumsum([len(g) for g in gen]), starts=gen_starts)
        print(f"{len(gen)} target generations, {sum(map(len, gen))} tokens")

    if args.data:
        open_stream, held = data_streams(args.data, args.batch, args.seq_len, meta["next_index"][0])
    elif is_zoo:
        open_stream = zoo_open_stream(args.batch, args.seq_len, args.seed, meta["next_index"][0])
        held = [b for b, _ in (next(it) for it in [zoo_open_stream(args.batch, args.seq_len, args.seed, 0,
                                                                   "heldout")] * 4)]
    else:
        texts = file_texts(args.texts, args.target)
        cut = max(1, len(texts) // 20)
        open_stream = EST.pack(texts[cut:], args.batch, args.seq_len, meta["next_index"][0])
        held = [b for b, _ in (next(it) for it in [EST.pack(texts[:cut], args.batch, args.seq_len)] * 4)]
    gen_stream = EST.pack(gen, args.batch, args.seq_len, meta["next_index"][1], gen_starts) if gen else None
    train_step, eval_step = EST.make_steps(cfg, args.exit_layer, tx)

    def step(state, batch, lr, i):
        params, opt, m = train_step(state["params"], state["opt_state"], np.float32(lr), lm, batch)
        return {"params": params, "opt_state": opt}, m

    batches = EST.mix(open_stream, gen_stream, 0.0 if args.data else args.gen_share)
    state, meta = jt.fit(step, state, batches, meta, workdir,
                         budget_s=60 * args.minutes, ckpt_minutes=args.ckpt_minutes, log_every=args.log_every,
                         evaluate=lambda s: EST.evaluate(eval_step, s["params"], lm, held), desc=tag,
                         max_steps=args.max_steps)
    jt.plot_log(workdir / "log.jsonl", workdir / "loss.png", tag)
    if not jt.finished(meta):
        print(f"{tag}: stopped at step {meta['step']} of {meta['total_steps']}: rerun with --resume")
        return
    if args.ship:
        from jspec.tools import models

        out = Path(models.head_dir(args.target, "eesd"))
    else:
        from jspec.tools import zoo

        out = Path(args.out or (zoo.ZOO_DIR / tag if is_zoo else workdir / "head"))
    last = [r for r in jt.read_log(workdir / "log.jsonl") if "heldout_loss" in r][-1]
    head = head.replace(params=state["params"])
    import jax.numpy as jnp

    EE.save_head(head, target, str(out), dtype=jnp.bfloat16 if is_zoo or args.ship else None, extra={
        "steps": meta["step"], "train_minutes": round(meta["elapsed_s"] / 60, 1), "gen_share": own,
        "heldout": {k: round(v, 4) for k, v in last.items() if k.startswith("heldout")},
        "command": "jspec train eesd " + " ".join(sys.argv[1:] if argv is None else argv)})
    print(f"saved the head to {out}: held-out {last}")


if __name__ == "__main__":
    main()
