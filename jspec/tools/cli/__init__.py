"""The `jspec` command line: decode, chat, convert, fetch, demo, plan, bench, train."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


def cmd_convert(args) -> int:
    import ports

    t = time.perf_counter()
    if args.hf_dir.endswith(".gguf") and os.path.isfile(args.hf_dir):
        cfg, n = _convert_gguf(args.hf_dir, args.out_dir, args.dtype)
    else:
        cfg, n = ports.convert_hf(args.hf_dir, args.out_dir, dtype=args.dtype, progress=True)
    print(f"converted {args.hf_dir} -> {args.out_dir} ({cfg.model_type}, {n / 1e6:.1f}M params) "
          f"in {time.perf_counter() - t:.1f}s")
    return 0


def _convert_gguf(path: str, out_dir: str, dtype):
    """A GGUF file -> a jspec checkpoint plus the tokenizer files (when the file holds a tokenizer), so that
    `jspec decode --model OUT_DIR --prompt ...` works on it."""
    from ports.io import gguf as GF

    try:
        reader = GF.open_gguf(path)
        cfg, n = GF.convert_gguf(reader, out_dir, dtype=dtype, progress=True)
    except ValueError as e:
        raise SystemExit(f"jspec convert: {e}")
    if "tokenizer.ggml.tokens" in reader.fields:
        GF.tokenizer_from_gguf(reader).save_pretrained(out_dir)
    else:
        print(f"{path} holds no tokenizer: decode {out_dir} with --prompt-ids")
    return cfg, n


def cmd_fetch(args) -> int:
    from jspec.tools import models

    if args.list:
        for name, entry in models.REGISTRY.items():
            state = "fetched" if models.available(name, args.cache_dir) else "not fetched"
            print(f"{name}  [{state}]  {entry.license}  {entry.description}")
        return 0
    if args.name is None:
        raise SystemExit(f"jspec fetch: name a model ({', '.join(models.REGISTRY)}) or give --list")
    try:
        print(models.fetch(args.name, cache_dir=args.cache_dir))
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"jspec fetch: {e}")
    return 0


def cmd_demo(args) -> int:
    from jspec.tools import demo

    try:
        if args.what == "video":
            demo.run_video(seed=args.seed, out_dir=args.out, max_new_tokens=args.max_new_tokens or 96,
                           cache=args.cache)
        elif args.what == "image-gen":
            demo.run_image_gen(seed=args.seed, out_dir=args.out)
        elif args.what == "real":
            demo.run_real(seed=args.seed or 0, out_dir=args.out, max_new_tokens=args.max_new_tokens or 160,
                          cache=args.cache)
        else:
            demo.run(seed=args.seed, out_dir=args.out, max_new_tokens=args.max_new_tokens or 64,
                     methods="all" if args.what == "all" else "core", cache=args.cache,
                     real=None if args.no_real else demo.REAL_MODEL)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"jspec demo: {e}")
    return 0


def cmd_memory(args) -> int:
    from jspec.tools import memory as MEM

    try:
        mesh = MEM.parse_mesh(args.mesh)
        device = MEM.parse_bytes(args.device_memory) if args.device_memory else None
        target = MEM.load_config(args.config)
        draft_name, tree_nodes, sage_note = args.draft, args.tree_nodes, None
        draft_max_len, self_draft = None, draft_name == "self"
        if sum(map(bool, (args.sage, args.specvlm, args.lantern))) > 1:
            raise ValueError("--sage, --specvlm and --lantern size different verify widths: pick one")
        streams, eagle = 1, False
        if args.lantern:
            from jspec.strategies.lantern import lantern_budget

            tree_nodes, streams, sage_note = lantern_budget(args.config)
            eagle = draft_name is None
        if args.specvlm:
            from jspec.strategies.specvlm import specvlm_budget

            name, tree_nodes, draft_max_len, sage_note = specvlm_budget(args.config, args.max_len, args.video_tokens,
                                                                        args.prune_ratio)
            draft_name = draft_name or name
            self_draft = draft_name == "self"
        if args.sage:
            from jspec.strategies.sage import preset_draft, sage_budget

            draft_name = draft_name or preset_draft(args.config)
            tree_nodes, sage_note = sage_budget()
        draft = MEM.load_config(draft_name) if draft_name and not self_draft else None
        eesd = None
        if args.eesd is not None:
            from jspec.strategies.eesd import preset_exit_layer

            n = preset_exit_layer(args.config) if args.eesd == "preset" else int(args.eesd)
            eesd = (n, args.eesd_layers, args.cali)
        p = MEM.estimate(target, mesh, args.batch, args.max_len, dtype=args.dtype, draft_config=draft,
                    tree_nodes=tree_nodes, prompt_len=args.prompt_len, images=args.images, eesd=eesd,
                    draft_max_len=draft_max_len, self_draft=self_draft, streams=streams, eagle=eagle,
                    prefill_chunk=args.prefill_chunk if args.prefill_chunk != "none" else None,
                    draft_tensor_parallel=args.draft_tensor_parallel, mtp=args.mtp)
        if sage_note:
            p["notes"].append(sage_note)
    except ValueError as e:
        raise SystemExit(f"jspec memory: {e}")
    if args.json:
        out = dict(p)
        if device is not None:
            out["fit"] = p.fits(device, args.headroom)
        print(json.dumps(out, indent=2, default=str))
    else:
        print(MEM.format_estimate(p, device, args.headroom))
    return 0 if device is None or p.fits(device, args.headroom)["fits"] else 3


def cmd_bench(args) -> int:
    from jspec.tools.bench import zoo as bench

    try:
        result = bench.run(args.suite, runs=args.runs, quick=args.quick, out_dir=args.out,
                           with_transformers=not args.no_transformers, pairs=tuple(args.pair))
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"jspec bench: {e}")
    print(bench.markdown(result))
    print("wrote " + ", ".join(result["files"]))
    return 0


def bench_long(argv) -> int:
    """`jspec bench long ...`: the long-prompt benchmark (its own options: `jspec.tools.bench.long`)."""
    from jspec.tools.bench import long as BL

    ap = argparse.ArgumentParser(prog="jspec bench long", description=BL.__doc__.split("\n")[0])
    BL.add_arguments(ap)
    try:
        result = BL.run_bench(ap.parse_args(argv))
    except ValueError as e:
        raise SystemExit(f"jspec bench long: {e}")
    print("wrote " + ", ".join(result["files"]))
    return 0


def bench_spec(argv) -> int:
    """`jspec bench spec-bench ...`: Spec-Bench on a real model (its own options: `jspec.tools.bench.spec_bench`)."""
    from jspec.tools.bench import spec_bench as SB

    try:
        result = SB.main(argv)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"jspec bench spec-bench: {e}")
    print(result["markdown"])
    print("wrote " + ", ".join(result["files"]))
    return 0


SMALL_BENCHES = {"moe": "an MoE decode step's cost against a dense model as wide as its chosen experts",
                 "hybrid": "a verify's cost on a hybrid (linear-attention) target by depth and tree size, beside an "
                           "attention-only one",
                 "guard": "a round in which no row drafts (the guard's depth 0) against an AR step"}


def bench_small(suite: str, argv) -> int:
    """`jspec bench moe|hybrid|guard ...`: a small in-program benchmark (`jspec.tools.bench.moe` / `.hybrid` /
    `.guard`)."""
    import importlib

    mod = importlib.import_module(f"jspec.tools.bench.{suite}")
    ap = argparse.ArgumentParser(prog=f"jspec bench {suite}", description=mod.__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="interleaved timed runs (median), after a warm-up")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test; its numbers mean nothing)")
    ap.add_argument("--out", default="bench_out", help="output directory")
    choice = next(((name, getattr(mod, table)) for name, table in (("size", "SIZES"), ("pair", "PAIRS"))
                   if hasattr(mod, table)), None)
    if choice:
        ap.add_argument(f"--{choice[0]}", choices=list(choice[1]), default=next(iter(choice[1])),
                        help=f"the {choice[0]} measured (the module's docstring says what each is)")
    args = ap.parse_args(argv)
    try:
        result = mod.run(runs=args.runs, quick=args.quick, out_dir=args.out,
                         **({choice[0]: getattr(args, choice[0])} if choice else {}))
    except ValueError as e:
        raise SystemExit(f"jspec bench {suite}: {e}")
    print(mod.markdown(result))
    print("wrote " + ", ".join(result["files"]))
    return 0


def bench_gpu(argv) -> int:
    """`jspec bench gpu ...`: every GPU measurement in one command of budgeted steps (`jspec.tools.bench.gpu`)."""
    from jspec.tools.bench import gpu as BG

    try:
        result = BG.main(argv)
    except ValueError as e:
        raise SystemExit(f"jspec bench gpu: {e}")
    return 0 if all(s["status"] in ("ok", "partial") for s in result["steps"].values()) else 1


TRAINERS = {"eagle": "train_eagle", "eagle3": "train_eagle3", "dflash": "train_dflash", "eesd": "train_eesd",
            "cali": "train_cali",
            "self-data": "self_data"}  # `jspec train KIND ...` -> jspec.tools.cli.<module>.main


def train(argv) -> int:
    """`jspec train KIND ...`: train a drafter (or write the data it trains on), resumable from its checkpoints
    (each kind's own options: `jspec train KIND --help`)."""
    import importlib

    if not argv or argv[0] not in TRAINERS:
        kinds = ", ".join(TRAINERS)
        raise SystemExit(f"usage: jspec train {{{kinds}}} [options]; `jspec train KIND --help` for a kind's options"
                         + (f" (unknown kind {argv[0]!r})" if argv and not argv[0].startswith("-") else ""))
    module = importlib.import_module(f"jspec.tools.cli.{TRAINERS[argv[0]]}")
    module.main(argv[1:])
    return 0


def _configure_logging(argv: list[str]) -> list[str]:
    """`jspec -v ...` (INFO: compile, prefill and decode times) or `-vv` (DEBUG: each decode's static shape), or
    $JSPEC_LOG=INFO|DEBUG, sends the `jspec` logger to stderr; returns argv without the flag."""
    level = os.environ.get("JSPEC_LOG")
    if argv and argv[0] in ("-v", "-vv"):
        level, argv = ("INFO" if argv[0] == "-v" else "DEBUG"), argv[1:]
    if level:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        logger = logging.getLogger("jspec")
        logger.addHandler(handler)
        logger.setLevel(level.upper())
    return argv


def main(argv=None) -> int:
    argv = _configure_logging(sys.argv[1:] if argv is None else list(argv))
    from jspec.core import compilation

    if os.environ.get(compilation.CACHE_ENV):  # compiled programs persist there across runs
        compilation.enable_cache()
    if argv[:2] == ["bench", "long"]:
        return bench_long(argv[2:])
    if argv[:2] == ["bench", "spec-bench"]:
        return bench_spec(argv[2:])
    if argv[:2] == ["bench", "gpu"]:
        return bench_gpu(argv[2:])
    if argv[:1] == ["bench"] and argv[1:2] and argv[1] in SMALL_BENCHES:
        return bench_small(argv[1], argv[2:])
    if argv[:1] == ["train"]:
        return train(argv[1:])
    p = argparse.ArgumentParser(prog="jspec", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    from jspec.tools.cli import generate as CG

    d = sub.add_parser("decode", help="generate from a checkpoint (HF dir, Hub id, `jspec convert` output or .gguf "
                                      "file), speculatively with --draft / --strategy; text streams as it comes")
    CG.add_args(d)
    d.set_defaults(fn=CG.cmd_decode)
    ch = sub.add_parser("chat", help="a multi-turn chat in the terminal (the tokenizer's chat template), speculative "
                                     "with --draft / --strategy; an empty line ends it")
    CG.add_args(ch, chat=True)
    ch.set_defaults(fn=CG.cmd_chat)
    co = sub.add_parser("costs", help="what a round of a strategy costs on this device at each draft depth, in AR "
                                      "steps (the table jspec.Guarded decides from; cached): a table and its plot")
    CG.add_args(co, chat=True)
    co.add_argument("--batch", type=int, default=1)
    co.add_argument("--prompt-len", type=int, default=128)
    co.add_argument("--fresh", action="store_true", help="measure anew (the cached table is not read or written)")
    co.add_argument("--plot", default="jspec-costs.png", help="where the plot goes")
    co.set_defaults(fn=CG.cmd_costs)
    c = sub.add_parser("convert", help="HF checkpoint dir or GGUF file -> orbax checkpoint dir")
    c.add_argument("hf_dir", help="an HF checkpoint directory or Hub id (org/name), or a .gguf file (llama; its "
                                  "tokenizer is written beside the checkpoint)")
    c.add_argument("out_dir")
    c.add_argument("--dtype", default=None)
    c.set_defaults(fn=cmd_convert)
    fe = sub.add_parser("fetch", help="download a registered pretrained checkpoint (jspec.models) into the cache")
    fe.add_argument("name", nargs="?", help="a registered name (see --list)")
    fe.add_argument("--list", action="store_true", help="list the registry and what is fetched")
    fe.add_argument("--cache-dir", default=None, help="default $JSPEC_MODELS_DIR or ~/.cache/jspec/models")
    fe.set_defaults(fn=cmd_fetch)
    demo_help = ("a real model (SmolLM2-135M-Instruct, fetched on first use) and the zoo's pairs decode with AR and "
                 "speculative decoding, measured in the same run: tables, the headline and one figure")
    m = sub.add_parser("demo", help=demo_help, description=demo_help)
    m.add_argument("what", nargs="?", default="core", choices=("core", "all", "video", "image-gen", "real"),
                   help="core (default, a few minutes the first time): SmolLM2 with AR, prompt lookup and the "
                        "EAGLE-3 head, then AR, Chain and a tree on the zoo's text pair; all: adds DynamicTree, "
                        "SAGE, EESD, TABED on the image pair and SpecVLM on video clips; video: the video pair "
                        "alone; image-gen: the text-to-image pair, AR beside LANTERN++ and MC-SJD; real: SmolLM2 "
                        "with every drafter shipped for it")
    m.add_argument("--no-real", action="store_true", help="core / all: the zoo alone (no real model)")
    m.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (96 for video)")
    m.add_argument("--seed", type=int, default=None, help="example seed (default: a fresh one, printed)")
    m.add_argument("--out", default="jspec-demo", help="directory for the table, the figure and the images")
    m.add_argument("--cache", default=None, help="compile cache directory (default $JSPEC_COMPILE_CACHE or "
                                                  "~/.cache/jspec/xla; 'off' for none)")
    m.set_defaults(fn=cmd_demo)
    pl = sub.add_parser("memory", help="bytes per device of params, KV cache, draft and activations on a mesh "
                                     "(from shapes alone: no weights, no devices needed)")
    pl.add_argument("--config", required=True,
                    help="config.json, an HF checkpoint dir, or a shipped name (llama-2-70b, qwen2.5-vl-72b, ...)")
    pl.add_argument("--mesh", default="tensor=1", help="axis=size over data, fsdp, expert, tensor, e.g. tensor=8 "
                                                       "or data=2,tensor=4 or expert=4,tensor=2")
    pl.add_argument("--batch", type=int, default=1)
    pl.add_argument("--max-len", type=int, required=True, help="KV cache slots per row")
    pl.add_argument("--dtype", default="bf16", help="bf16, f16 or f32")
    pl.add_argument("--draft", help="draft config (same forms as --config); replicated on every device; 'self': "
                                    "the target drafts for itself (SpecVLM's Self-SD)")
    pl.add_argument("--draft-tensor-parallel", action="store_true", help="the draft split over the mesh by the "
                    "target's rules (`jspec.shard(draft, mesh)`), not replicated")
    pl.add_argument("--eesd", metavar="N", help="size an EESD early-exit drafter exiting after layer N ('preset': "
                                                "the paper's N for llama-2-13b / 70b)")
    pl.add_argument("--eesd-layers", type=int, default=1, help="the early-exit head's decoder layers")
    pl.add_argument("--cali", action="store_true", help="with Cali-TS's predictor (W^1..W^10, W_p)")
    pl.add_argument("--mtp", action="store_true", help="a Qwen3.5 target's own MTP head drafts (its mtp.* layers)")
    pl.add_argument("--tree-nodes", type=int, default=64, help="nodes verified per step (gamma + 1 for a chain)")
    pl.add_argument("--sage", action="store_true", help="SAGE's verify width (n_max + 1 = 65) and, for a target "
                                                        "with a SAGE preset, the paper's draft unless --draft")
    pl.add_argument("--specvlm", action="store_true", help="SpecVLM: the 25-node tree (26 verified), the draft's "
                                                           "cache less the pruned video tokens and, for a target "
                                                           "with a preset, the paper's draft unless --draft")
    pl.add_argument("--lantern", action="store_true", help="LANTERN++: an EAGLE-1 head (or --draft) verified on the "
                                                           "preset's tree (58 nodes for naive_extend_57) under CFG "
                                                           "(two streams per row)")
    pl.add_argument("--video-tokens", type=int, help="--specvlm: video tokens per prompt (default: the preset's clip)")
    pl.add_argument("--prune-ratio", type=float, help="--specvlm: share of video tokens the draft drops (default: "
                                                      "the preset's, else 0.9)")
    pl.add_argument("--prompt-len", type=int, help="prompt tokens prefilled (default: max-len, the worst case)")
    pl.add_argument("--prefill-chunk", default="auto", type=lambda v: v if v in ("auto", "none") else int(v),
                    help="tokens through a layer at once in the prefill, as decode(prefill_chunk=) (default auto: "
                         "4096; none: one pass)")
    pl.add_argument("--images", type=int, help="images in the prefill batch of a VLM (default: one per row)")
    pl.add_argument("--device-memory", help="memory of one device, e.g. 80GB, 16GiB: prints whether it fits "
                                            "(exit status 3 when it does not)")
    pl.add_argument("--headroom", type=float, default=0.10, help="fraction of device memory kept free")
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.set_defaults(fn=cmd_memory)
    sub.add_parser("train", help="train a drafter, resumable: eagle, eagle3, dflash, eesd, cali, or self-data (the text "
                                 "a registered model writes for its drafters); `jspec train KIND --help`")
    b = sub.add_parser("bench", help="benchmark suites (ar, sd; gpu: `jspec bench gpu --help`; long: `jspec bench "
                                     "long --help`; spec-bench: `jspec bench spec-bench --help`; moe, hybrid, guard: "
                                     "`jspec bench moe --help`): JSON, "
                                     "markdown table and PNG per run")
    b.add_argument("suite", help="ar | sd | gpu | long | spec-bench | moe | hybrid | guard")
    b.add_argument("--runs", type=int, default=3, help="timed runs per case (median), after a warm-up")
    b.add_argument("--quick", action="store_true", help="tiny sizes, finishes in well under 3 minutes")
    b.add_argument("--out", default="bench_out", help="output directory")
    b.add_argument("--no-transformers", action="store_true", help="skip the transformers baselines")
    b.add_argument("--pair", action="append", default=[], help="sd suite: run only this pair (repeatable), e.g. "
                                                               "'zoo text', 'zoo image', 'random damped'")
    b.set_defaults(fn=cmd_bench)
    args = p.parse_args(argv)
    return args.fn(args)
