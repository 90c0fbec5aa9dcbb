"""Train, export and measure the zoo's text-to-image pair (assets/zoo/jspec_zoo/t2i-vq, assets/zoo/jspec_zoo/t2i-target).

    python scripts/train_zoo_t2i.py vq --minutes 28                 # the VQ tokenizer (resumable: --resume)
    python scripts/train_zoo_t2i.py encode                          # cache the training set's codes (build/)
    python scripts/train_zoo_t2i.py target --minutes 40             # the Chameleon caption -> image target
    python scripts/train_zoo_t2i.py eval                            # caption consistency, zoo-FID (training.json)

Each training run checkpoints to build/zoo/t2i-*/ (orbax, exact resume with --resume; a schedule that did not
finish is resumed with the same --steps, or none), logs to log.jsonl, plots to bench_out/ and exports
(bf16 safetensors + config.json + training.json) when its schedule is done (or with --export-partial).
See jspec/tools/zoo/t2i.py for the data, the layout and the measurements.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ports  # noqa: E402
from jspec.tools.train import trainer as jt  # noqa: E402
from jspec.tools.zoo import t2i as T  # noqa: E402
from ports.families import vqgan as VQ  # noqa: E402

RESULTS_DIR = ROOT / "bench_out"
ZOO = ROOT / "assets" / "zoo" / "jspec_zoo"
BUILD = ROOT / "build" / "zoo"
HELDOUT_IMAGES = 256
TRAIN_SCENES = 16_000  # the target's training set: scenes 0..N-1 of the train split, encoded once
TARGET = dict(num_layers=4, hidden=256, heads=4, ffn=704)


# --------------------------------------------------------------------------------------------------- common


def info_common(meta: dict, workdir: Path, keys=("loss",)) -> dict:
    rows = jt.read_log(workdir / "log.jsonl")
    tr = [r for r in rows if "loss" in r]
    ev = [r for r in rows if any(k.startswith("heldout") for k in r)]
    return {"steps": meta["step"], "total_steps": meta["total_steps"], "train_minutes": round(meta["elapsed_s"] / 60, 1),
            "seed": meta["seed"], "final_train": {k: tr[-1][k] for k in tr[-1] if k not in ("step",)} if tr else None,
            "final_heldout": {k: v for k, v in ev[-1].items()} if ev else None,
            "schedule": meta["schedule"], "runs": meta["runs"],
            "commands": [" ".join(["python scripts/train_zoo_t2i.py", *r["argv"]]) for r in meta["runs"]],
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "jax": jax.__version__,
            "date": datetime.date.today().isoformat()}


def merge_training_json(out: Path, extra: dict) -> None:
    path = out / "training.json"
    info = json.loads(path.read_text()) if path.exists() else {}
    info.update(extra)
    path.write_text(json.dumps(info, indent=2) + "\n")


def dir_mb(d: Path) -> float:
    return sum(f.stat().st_size for f in d.iterdir()) / 1e6


# --------------------------------------------------------------------------------------------------- VQ


def vq_train(args) -> None:
    name, cfg = "t2i-vq", T.VQ_CONFIG
    workdir = Path(args.workdir or BUILD / name).resolve()
    if workdir.exists() and not args.resume:
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tx = jt.adamw(0.0, b2=0.99)
    params = VQ.init_params(cfg, jax.random.key(args.seed))
    state = T.vq_state(cfg, params, tx)
    n_params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))
    ckpts = jt.Checkpoints(workdir)
    meta = jt.new_meta(name, args.seed, args.steps, args.lr, 100, batch=args.batch, vq=dataclasses.asdict(cfg))
    if args.resume:
        state, meta, resumed = jt.resume(ckpts, state, meta, args.steps, args.lr * 0.5)
        if resumed:
            print(f"resumed {name} at step {meta['step']} from {workdir}")
    print(f"{name}: {n_params / 1e6:.2f}M params, {cfg}, batch {args.batch}, lr {args.lr}")
    step_fn = T.make_vq_step(cfg, tx)
    held = T.image_batch("heldout", 0, 64, args.seed)

    def step(state, batch, lr, i):
        return step_fn(state, jnp.asarray(batch["images"]), np.float32(lr), np.int32(i))

    def evaluate(state):
        m = T.vq_metrics(cfg, state["params"], held)
        return {"heldout_l1_255": m["l1_255"], "heldout_psnr": m["psnr"],
                "heldout_round_trip": m["round_trip_codes_kept"], "heldout_codes_used": m["codes_used"]}

    data = T.vq_stream(args.batch, args.seed, meta["next_index"])
    state, meta = jt.fit(step, state, data, meta, workdir, ckpts=ckpts, budget_s=60 * args.minutes,
                         ckpt_minutes=args.ckpt_minutes, log_every=args.log_every, evaluate=evaluate, desc=name,
                         argv=sys.argv[1:])
    done = jt.finished(meta)
    print(f"{name}: step {meta['step']}/{meta['total_steps']}, {meta['elapsed_s'] / 60:.1f} min"
          f"{'' if done else ' (not finished: rerun with --resume)'}")
    jt.plot_log(workdir / "log.jsonl", RESULTS_DIR / f"zoo-{name}-loss.png", name, ylabel="VQ loss", train_key="loss",
                heldout_key="heldout_l1_255")
    if done or args.export_partial:
        vq_export(cfg, state["params"], meta, workdir, Path(args.out or ZOO / name), n_params)


def vq_export(cfg: VQ.VQConfig, params: dict, meta: dict, workdir: Path, out: Path, n_params: int) -> None:
    from ports.core.safetensors_io import write_safetensors

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    sd = VQ.state_dict_from_params(cfg, params)
    bf = np.dtype(jnp.bfloat16)
    write_safetensors(str(out / "model.safetensors"), {k: (tuple(v.shape), bf) for k, v in sd.items()},
                      lambda k: np.asarray(sd[k], np.float32).astype(bf))
    taming = {"embed_dim": cfg.embed_dim, "n_embed": cfg.num_embeddings,
              "ddconfig": {"double_z": False, "z_channels": cfg.latent_channels, "resolution": cfg.resolution,
                           "in_channels": cfg.in_channels, "out_ch": cfg.out_channels, "ch": cfg.base_channels,
                           "ch_mult": list(cfg.channel_multiplier), "num_res_blocks": cfg.num_res_blocks,
                           "attn_resolutions": list(cfg.attn_resolutions), "attn_type": cfg.attn_type,
                           "dropout": 0.0}}
    conf = {**VQ.vq_config_to_hf(cfg), "taming": taming, "image_size": T.IMAGE_SIZE,
            "note": "taming VQGAN (Chameleon's architecture); weights in taming names (encoder.*, quantize.*, "
                    "decoder.*). Load with jspec.tools.zoo.t2i.load_vq()."}
    (out / "config.json").write_text(json.dumps(conf, indent=2) + "\n")
    # measured on held-out scenes with the exported (bf16) weights
    _, p16 = T.load_vq(out)
    held = T.image_batch("heldout", 0, HELDOUT_IMAGES, meta["seed"])
    m = T.vq_metrics(cfg, p16, held)
    info = {"name": "t2i-vq", "params": n_params, **info_common(meta, workdir), "heldout_reconstruction": m}
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"exported t2i-vq to {out} ({dir_mb(out):.1f} MB): {m}")


def vq_eval(args) -> None:
    """Image-target exact match on colour / shape / position questions: rendered originals (at the target's own
    size and resized from 64 px) vs VQ reconstructions."""
    out = Path(args.out or ZOO / "t2i-vq")
    cfg, params = T.load_vq(out)
    asker = T.Asker.load()
    scenes = [T.scene("heldout", i, args.seed, counts=(1, 2, 2, 3, 3, 4)) for i in range(args.n)]
    qs = T.questions(scenes, per_scene=3, seed=args.seed)
    imgs = np.stack([T.render(s) for s in scenes])
    _, rec = T.reconstruct(cfg, params, jnp.asarray(T.to_signed(imgs)))
    rec = VQ.to_uint8(rec)
    res = {"scenes": len(scenes), "questions": len(qs),
           "originals_native": asker.ask(None, qs), "originals_64_resized": asker.ask(imgs, qs),
           "reconstructions_64_resized": asker.ask(rec, qs)}
    for v in res.values():
        if isinstance(v, dict):
            v.pop("hits", None)
    print(json.dumps(res, indent=1))
    save_grid(np.concatenate([imgs[:8], rec[:8]]), RESULTS_DIR / "zoo-t2i-vq-reconstructions.png", cols=8)
    merge_training_json(out, {"image_target_qa": res})


def save_grid(images: np.ndarray, path: Path, cols: int = 8, scale: int = 2) -> None:
    from PIL import Image

    n, H, W, _ = images.shape
    rows = -(-n // cols)
    canvas = np.full((rows * (H + 2), cols * (W + 2), 3), 255, np.uint8)
    for k, im in enumerate(images):
        r, c = divmod(k, cols)
        canvas[r * (H + 2):r * (H + 2) + H, c * (W + 2):c * (W + 2) + W] = im
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(canvas).resize((canvas.shape[1] * scale, canvas.shape[0] * scale), Image.NEAREST).save(path)
    print(f"wrote {path}")


# --------------------------------------------------------------------------------------------------- codes


def codes_path(seed: int) -> Path:
    return BUILD / f"t2i-codes-seed{seed}.npz"


def encode_cmd(args) -> None:
    """Encode training scenes 0..N-1 (and HELDOUT_IMAGES held-out ones) with the exported VQ tokenizer; cache the
    code grids and captions under build/ (resumable: an existing cache is extended)."""
    cfg, params = T.load_vq(Path(args.vq or ZOO / "t2i-vq"))
    path = codes_path(args.seed)
    have = dict(np.load(path, allow_pickle=False)) if path.exists() else {}
    out = {}
    for split, n in (("heldout", HELDOUT_IMAGES), ("train", args.n)):
        codes = list(have.get(f"{split}_codes", np.zeros((0, T.GRID, T.GRID), np.int32)))
        t0 = time.perf_counter()
        for i in range(len(codes), n, args.batch):
            k = min(args.batch, n - i)
            imgs = np.stack([T.render(T.scene(split, j, args.seed)) for j in range(i, i + k)])
            codes += list(np.asarray(VQ.encode_jit(cfg, params, jnp.asarray(T.to_signed(imgs)))))
            if (i // args.batch) % 10 == 0:
                print(f"{split}: {i + k}/{n} encoded ({time.perf_counter() - t0:.0f} s)", flush=True)
        out[f"{split}_codes"] = np.asarray(codes[:n], np.int32)
        out[f"{split}_captions"] = np.asarray([T.caption(T.scene(split, j, args.seed)) for j in range(n)])
        np.savez(path, **{**have, **out})
    print(f"wrote {path}: " + ", ".join(f"{k} {v.shape}" for k, v in out.items()))


def load_codes(seed: int) -> dict:
    path = codes_path(seed)
    if not path.exists():
        raise SystemExit(f"{path} is missing: run `python scripts/train_zoo_t2i.py encode` first")
    return dict(np.load(path, allow_pickle=False))


# --------------------------------------------------------------------------------------------------- target


def new_target(seed: int, vq_params: dict | None = None) -> ports.Model:
    from ports.families import chameleon as CH
    from ports.core.fused import fuse_params

    hf = T.t2i_hf_config(**TARGET)
    cfg = CH.config_from_hf(hf)
    params = fuse_params(cfg, CH.init_params(cfg, jax.random.key(seed)))
    if vq_params is not None:
        params["vqmodel"] = {k: vq_params[k] for k in VQ.HF_PARTS}
    return ports.Model(cfg, params, hf)


def target_train(args) -> None:
    import functools

    import optax

    name = "t2i-target"
    workdir = Path(args.workdir or BUILD / name).resolve()
    if workdir.exists() and not args.resume:
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    data = load_codes(args.seed)
    codes, caps = data["train_codes"], [str(c) for c in data["train_captions"]]
    vq_cfg, vq_params = T.load_vq(Path(args.vq or ZOO / "t2i-vq"))
    model = new_target(args.seed, vq_params)
    cfg = model.config
    lm = {k: v for k, v in model.params.items() if k != "vqmodel"}
    tx = jt.adamw(0.05)
    state = {"params": lm, "opt_state": tx.init(lm)}
    ckpts = jt.Checkpoints(workdir)
    meta = jt.new_meta(name, args.seed, args.steps, args.lr, 100, batch=args.batch, target=TARGET,
                       train_scenes=len(codes), seq_len=T.SEQ_LEN)
    if args.resume:
        state, meta, resumed = jt.resume(ckpts, state, meta, args.steps, args.lr * 0.5)
        if resumed:
            print(f"resumed {name} at step {meta['step']} (row {meta['next_index']}) from {workdir}")
    n_params = model.config.num_params
    print(f"{name}: {n_params / 1e6:.2f}M params (VQ encoder included), {TARGET}, vocab {cfg.vocab_size}, "
          f"{len(codes)} training scenes, batch {args.batch}, lr {args.lr}")

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch, lr):
        (_, (loss, acc, _)), grads = jax.value_and_grad(functools.partial(T.t2i_loss, cfg), has_aux=True)(
            params, batch)
        updates, opt_state = tx.update(grads, jt.set_lr(opt_state, lr), params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, "acc": acc,
                                                                 "grad_norm": optax.global_norm(grads)}

    @jax.jit
    def eval_step(params, batch):
        _, (loss, acc, n) = T.t2i_loss(cfg, params, batch)
        return loss * n, acc * n, n

    hc, hcap = data["heldout_codes"], [str(c) for c in data["heldout_captions"]]
    held = [{k: jnp.asarray(v) for k, v in T.t2i_batch(hc, hcap, i, 64, args.seed + 1).items()}
            for i in range(0, min(len(hc), 128), 64)]

    def step(state, batch, lr, i):
        params, opt_state, m = train_step(state["params"], state["opt_state"],
                                          {k: jnp.asarray(v) for k, v in batch.items()}, np.float32(lr))
        return {"params": params, "opt_state": opt_state}, m

    def evaluate(state):
        loss, acc = jt.weighted_means(eval_step, state["params"], held)
        return {"heldout_loss": loss, "heldout_acc": acc}

    stream = T.t2i_stream(codes, caps, args.batch, args.seed, meta["next_index"])
    state, meta = jt.fit(step, state, stream, meta, workdir, ckpts=ckpts, budget_s=60 * args.minutes,
                         ckpt_minutes=args.ckpt_minutes, log_every=args.log_every, evaluate=evaluate, desc=name,
                         argv=sys.argv[1:])
    done = jt.finished(meta)
    print(f"{name}: step {meta['step']}/{meta['total_steps']}, {meta['tokens'] / 1e6:.2f}M image tokens, "
          f"{meta['elapsed_s'] / 60:.1f} min{'' if done else ' (not finished: rerun with --resume)'}")
    jt.plot_log(workdir / "log.jsonl", RESULTS_DIR / f"zoo-{name}-loss.png", name,
                ylabel="cross-entropy (nats / image token)")
    if done or args.export_partial:
        out = Path(args.out or ZOO / name)
        if out.exists():
            shutil.rmtree(out)
        full = ports.Model(cfg, {**state["params"], "vqmodel": model.params["vqmodel"]}, model.hf_config)
        ports.save_hf(full, str(out), dtype=jnp.bfloat16)
        from jspec.tools.zoo import tokenizer as TK

        for f in sorted(TK.ASSET_DIR.iterdir()):
            shutil.copy(f, out / f.name)
        (out / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": 1, "eos_token_id": T.IMAGE_END_ID, "pad_token_id": 0}, indent=2) + "\n")
        info = {"name": name, "params": n_params, "config": TARGET, "vocab_size": cfg.vocab_size,
                "train_scenes": len(codes), "batch": args.batch, "seq_len": T.SEQ_LEN, "p_uncond": T.P_UNCOND,
                "image_tokens_seen": meta["tokens"], **info_common(meta, workdir),
                "decoder": "assets/zoo/jspec_zoo/t2i-vq (jspec.tools.zoo.t2i.load_vq())"}
        (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
        print(f"exported {name} to {out} ({dir_mb(out):.1f} MB)")


# --------------------------------------------------------------------------------------------------- eval


def generate(model, scenes, decoder, key_seed: int, cfg_scale=3.0, temperature=1.0, top_k=100, batch=32):
    """Images (uint8 [N, 64, 64, 3]) and codes generated from the scenes' captions."""
    import jspec

    imgs, codes = [], []
    for i in range(0, len(scenes), batch):
        ids = [T.caption_ids(T.caption(s)) for s in scenes[i:i + batch]]
        out = jspec.generate_image(model, ids, T.GRID, T.GRID, cfg_scale=cfg_scale, temperature=temperature,
                                   top_k=top_k, key=jax.random.key(key_seed + i), decoder=decoder)
        imgs.append(out.images)
        codes.append(out.codes)
    return np.concatenate(imgs), np.concatenate(codes)


def eval_cmd(args) -> None:
    """Caption consistency (image-target QA on generated images, as the caption says) for CFG sampling and greedy,
    and the zoo-FID of generated vs rendered images; written to both models' training.json."""
    vq_dir, t_dir = Path(args.vq or ZOO / "t2i-vq"), Path(args.out or ZOO / "t2i-target")
    vq_cfg, vq_params = T.load_vq(vq_dir)
    model = T.load_target(t_dir)
    asker = T.Asker.load()
    scenes = [T.scene("heldout", i, args.seed) for i in range(args.n)]
    qs = T.questions(scenes, per_scene=3, seed=args.seed)
    renders = np.stack([T.render(s) for s in scenes])
    _, rec = T.reconstruct(vq_cfg, vq_params, jnp.asarray(T.to_signed(renders)))
    rec = VQ.to_uint8(rec)
    ref_scenes = [T.scene("heldout", 100_000 + i, args.seed) for i in range(args.n)]
    f_ref = asker.features(np.stack([T.render(s) for s in ref_scenes]))
    f_ren, f_rec = asker.features(renders), asker.features(rec)
    res = {"prompts": len(scenes), "questions": len(qs), "top_k": args.top_k, "cfg_scale": 3.0,
           "qa_renders_64_resized": asker.ask(renders, qs), "qa_vq_reconstructions": asker.ask(rec, qs),
           "fid_renders_vs_other_renders": T.frechet_distance(f_ren, f_ref),
           "fid_vq_reconstructions_vs_renders": T.frechet_distance(f_rec, f_ref)}
    modes = {"ar_cfg3_topk": dict(cfg_scale=3.0, temperature=1.0, top_k=args.top_k),
             "greedy_cfg3": dict(cfg_scale=3.0, temperature=0.0, top_k=None),
             "ar_nocfg_topk": dict(cfg_scale=None, temperature=1.0, top_k=args.top_k)}
    grids = [renders[:8]]
    for mode, kw in modes.items():
        t0 = time.perf_counter()
        imgs, _ = generate(model, scenes, (vq_cfg, vq_params), args.seed, **kw)
        res[f"qa_{mode}"] = asker.ask(imgs, qs)
        res[f"fid_{mode}_vs_renders"] = T.frechet_distance(asker.features(imgs), f_ref)
        res[f"seconds_{mode}"] = round(time.perf_counter() - t0, 1)
        grids.append(imgs[:8])
        print(mode, res[f"qa_{mode}"]["all"], res[f"fid_{mode}_vs_renders"], flush=True)
    for v in res.values():
        if isinstance(v, dict):
            v.pop("hits", None)
    print(json.dumps(res, indent=1))
    save_grid(np.concatenate(grids), RESULTS_DIR / "zoo-t2i-samples.png", cols=8)
    (ROOT / "build" / "zoo").mkdir(parents=True, exist_ok=True)
    (BUILD / "t2i-eval.json").write_text(json.dumps(res, indent=2) + "\n")
    merge_training_json(t_dir, {"caption_consistency": res})


# --------------------------------------------------------------------------------------------------- main


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("vq", help="train the VQ tokenizer, then export it")
    t = sub.add_parser("target", help="train the caption -> image Chameleon target, then export it")
    for p, lr, batch in ((v, 1e-3, 16), (t, 2e-3, 32)):
        p.add_argument("--minutes", type=float, default=25.0)
        p.add_argument("--steps", type=int, default=None, help="schedule length (default: fill --minutes)")
        p.add_argument("--resume", action="store_true")
        p.add_argument("--out", default=None, help="export directory (default assets/zoo/jspec_zoo/t2i-vq / t2i-target)")
        p.add_argument("--workdir", default=None)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--lr", type=float, default=lr)
        p.add_argument("--batch", type=int, default=batch)
        p.add_argument("--ckpt-minutes", type=float, default=3.0)
        p.add_argument("--log-every", type=int, default=10)
        p.add_argument("--export-partial", action="store_true")
    ve = sub.add_parser("vq-eval", help="image-target QA on originals vs VQ reconstructions")
    ve.add_argument("--n", type=int, default=200)
    ve.add_argument("--seed", type=int, default=0)
    ve.add_argument("--out", default=None)
    t.add_argument("--vq", default=None, help="the VQ tokenizer directory (default assets/zoo/jspec_zoo/t2i-vq)")
    en = sub.add_parser("encode", help="cache the code grids of the target's training scenes under build/")
    en.add_argument("--n", type=int, default=TRAIN_SCENES)
    en.add_argument("--batch", type=int, default=128)
    en.add_argument("--seed", type=int, default=0)
    en.add_argument("--vq", default=None)
    ev = sub.add_parser("eval", help="caption consistency and zoo-FID of the exported target")
    ev.add_argument("--n", type=int, default=96)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--top-k", type=int, default=100)
    ev.add_argument("--vq", default=None)
    ev.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.cmd == "encode":
        encode_cmd(args)
    elif args.cmd == "eval":
        eval_cmd(args)
    elif args.cmd == "vq":
        vq_train(args)
    elif args.cmd == "vq-eval":
        vq_eval(args)
    elif args.cmd == "target":
        target_train(args)


if __name__ == "__main__":
    main()
