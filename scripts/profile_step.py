"""Where one decode step's time goes, for one prompt of a zoo pair: the phases and the whole step timed inside one
compiled program (`jspec.engine.profiling`), the fused decode loop's time per step, and the composition control (a draft
phase and an unrelated target AR step, repeated apart and in one loop body).

    python scripts/profile_step.py                         # zoo text pair, Chain gamma=5, the longest chat answer
    python scripts/profile_step.py --gamma 7 --rounds 5 --scenario described_caption
    python scripts/profile_step.py --calls --scenario described_vqa   # per-call costs of AR and Chain instead
    python scripts/profile_step.py --ops                   # the loop's time by XLA operation, AR and Chain
    python scripts/profile_step.py --draft-size            # the composition control with drafts of other widths

Prints one line per round (medians inside each), so a noisy host shows as spread between rounds. `--calls` fits
whole calls' decode time as per call + per step x steps instead (`jspec.tools.call_costs`; 4 prompts, EOS off,
4-24 new tokens), with the zero-step launch of the compiled loop and the prefill, for AR and for Chain. `--ops`
traces one decode loop of each (`jspec.engine.profiling.op_costs`) and prints its time per step by XLA operation.
`--draft-size` runs the composition control with the zoo draft and with random drafts of its depth at its width and
at a quarter of it: the same operations and instruction count on fewer weight bytes, to tell what composing costs
by data (the target's pass evicting the draft's weights) from what it costs per instruction (random weights of the
zoo draft's shape are a control for the trained values).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

import jspec  # noqa: E402
from jspec import api  # noqa: E402
from jspec.tools.bench import zoo as BENCH  # noqa: E402
from jspec.engine import profiling as PF  # noqa: E402
from jspec.tools import call_costs as CC  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--scenario", default="text", help="a zoo text-pair evaluation scenario")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts to pick the longest answer from")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", action="store_true", help="per-call costs of whole calls instead of one step's phases")
    ap.add_argument("--ops", action="store_true", help="the decode loop's time per step by XLA operation instead")
    ap.add_argument("--top", type=int, default=15, help="--ops: operations to print per strategy")
    ap.add_argument("--draft-size", action="store_true",
                    help="the composition control with random drafts of the zoo draft's depth at 1 and 1/4 its width")
    args = ap.parse_args(argv)
    pairs = BENCH.zoo_pairs(args.prompts)
    if "zoo text" not in pairs:
        raise SystemExit("the zoo text pair is not shipped in this install")
    target, draft, scenarios, eos, _ = pairs["zoo text"]
    if args.scenario not in scenarios:
        raise SystemExit(f"unknown scenario {args.scenario!r}; the text pair has {sorted(scenarios)}")
    prompts = scenarios[args.scenario]
    if args.calls:
        print(f"zoo text pair, {args.scenario}, 4 prompts, EOS off, 4-24 new tokens, {args.rounds} rounds; ms")
        for name, strat in (("AR", None), (f"Chain g={args.gamma}", jspec.Chain(draft, gamma=args.gamma))):
            c = CC.call_costs(target, [[p] for p in prompts[:4]], strat, rounds=args.rounds)
            print(f"{name}: per step {c['per_step_s'] * 1e3:.2f}, per call {c['per_call_s'] * 1e3:.2f}, zero-step "
                  f"loop call {c['zero_step_s'] * 1e3:.2f}, prefill {c['prefill_s'] * 1e3:.2f}", flush=True)
        return
    lengths = [int(jspec.decode(target, [p], max_new_tokens=args.max_new, eos_token_id=eos).lengths[0])
               for p in prompts]
    prompt = prompts[int(np.argmax(lengths))]
    strategy = jspec.Chain(draft, gamma=args.gamma)
    if args.draft_size:
        _draft_size_control(target, draft, prompt, args)
        return
    print(f"zoo text pair, Chain gamma={args.gamma}, {args.scenario} prompt with a {max(lengths)}-token answer; ms")
    kw = dict(strategy=strategy, max_new_tokens=args.max_new, eos_token_id=eos)
    if args.ops:
        for name, strat in (("AR", None), (f"Chain g={args.gamma}", strategy)):
            jspec.decode(target, [prompt], **dict(kw, strategy=strat))  # compile
            c = PF.op_costs(api.start(target, [prompt], **dict(kw, strategy=strat)), top=args.top)
            print(f"{name}: {c['steps']} steps, instructions sum to {c['total_us_per_step'] / 1e3:.2f} ms per step")
            for r in c["ops"]:
                print(f"  {r['us_per_step']:8.1f} us  x{r['per_step']:5.1f}  {r['shape']:<24} {r['op']}")
        return
    jspec.decode(target, [prompt], **kw)  # compile the loop
    for r in range(args.rounds):
        o = jspec.decode(target, [prompt], **kw)
        loop_ms = o.stats["decode_s"] / int(o.stats["steps"][0]) * 1e3
        s = api.start(target, [prompt], **kw)
        cost = PF.in_program_costs(s)
        ctl = PF.composition_control(s)
        ms = {k: v * 1e3 for k, v in cost.items()}
        c = {k: v * 1e3 for k, v in ctl.items()}
        phases = ms["draft_s"] + ms["verify_s"] + ms["other_s"]
        print(f"round {r + 1}: loop step {loop_ms:.2f} | in-program step {ms['step_s']:.2f} = draft {ms['draft_s']:.2f}"
              f" + verify {ms['verify_s']:.2f} + rule/commit {ms['other_s']:.3f} + composition "
              f"{ms['step_s'] - phases:.2f} | control: draft {c['draft']:.2f}, AR step {c['step']:.2f}, both in one "
              f"body {c['draft+ar']:.2f}, two AR steps {c['ar+ar']:.2f}", flush=True)


def _draft_size_control(target, draft, prompt, args) -> None:
    """Composition excess (both in one body minus the two apart) per draft, `args.rounds` interleaved rounds."""
    import jax

    def megabytes(model) -> float:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params)) / 1e6

    c = draft.config
    drafts = {"zoo draft": draft}
    for width in (c.hidden_size, c.hidden_size // 4):
        heads = max(1, c.num_heads * width // c.hidden_size)
        d = BENCH.random_llama(c.num_layers, vocab=c.vocab_size, hidden=width,
                           mlp=c.intermediate_size * width // c.hidden_size, heads=heads)
        drafts[f"random {c.num_layers}x{width} ({megabytes(d):.1f} MB)"] = d
    print(f"composition control, Chain gamma={args.gamma}, zoo draft {megabytes(draft):.1f} MB; ms per repetition")
    for r in range(args.rounds):
        for name, d in drafts.items():
            s = api.start(target, [prompt], jspec.Chain(d, gamma=args.gamma), max_new_tokens=args.max_new,
                          eos_token_id=())
            m = {k: v * 1e3 for k, v in
                 PF.composition_control(s).items()}
            print(f"round {r + 1}, {name}: draft {m['draft']:.2f}, AR step {m['step']:.2f}, both in one body "
                  f"{m['draft+ar']:.2f}: composing costs {m['draft+ar'] - m['draft'] - m['step']:+.2f}", flush=True)
            jax.clear_caches()  # each draft compiles its own programs; keep the process under vm.max_map_count


if __name__ == "__main__":
    main()
