"""Write the training data a registered chat model writes itself (`jspec.tools.self_data`): prompts it was asked to
write about seed topics, then its answers drawn as EESD draws them (the first tokens greedy, then T = 1).

    jspec train self-data                       # SmolLM2-135M-Instruct, 2048 seeds, 256-token answers
    jspec train self-data --n 4096              # more; a rerun continues the same file where it stopped

The file (JSON lines, one record per seed) grows a chunk at a time, so a stopped run loses at most one chunk;
rerunning the same command completes it. The drafter trainers read it (`jspec train eesd --data`).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="jspec train self-data", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a name of `jspec.models` (jspec fetch NAME)")
    ap.add_argument("--n", type=int, default=2048, help="seeds (one prompt and answer each)")
    ap.add_argument("--max-new", type=int, default=256, help="answer tokens at most (EOS ends one sooner)")
    ap.add_argument("--greedy-first", type=int, default=4, help="answer tokens drawn greedily before T = 1")
    ap.add_argument("--chunk", type=int, default=32, help="seeds decoded as one batch and written at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pad-prompt-to", type=int, default=16,
                    help="prompt widths padded to a multiple of this: fewer compiles (a GPU run passes e.g. 128)")
    ap.add_argument("--out", default=None, help="default: build/self-data/<model>.jsonl")
    args = ap.parse_args(argv)

    from tqdm import tqdm

    from jspec.tools import models
    from jspec.tools import self_data as SD

    out = Path(args.out or Path("build") / "self-data" / f"{args.model}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    model, tok = models.load(args.model)
    before = len(SD.read(str(out)))
    bar = tqdm(total=args.n, initial=min(before, args.n), desc=f"{args.model} writes its data", unit="seed")
    t0 = time.perf_counter()

    def progress(done: int, total: int) -> None:
        bar.update(done - bar.n)

    recs = SD.make(model, tok, str(out), args.n, args.max_new, args.greedy_first, args.chunk, args.seed,
                   progress=progress, pad_prompt_to=args.pad_prompt_to)
    bar.close()
    seqs, starts = SD.sequences(recs)
    answer_tokens = int(sum(len(s) - st for s, st in zip(seqs, starts)))
    print(f"{out}: {len(recs)} seeds, {len(seqs)} answered ({len(recs) - len(seqs)} prompts dropped as too short), "
          f"{answer_tokens} answer tokens ({answer_tokens / max(len(seqs), 1):.0f} per answer); "
          f"{time.perf_counter() - t0:.0f} s this run")
    for r in [r for r in recs if r["ids"]][:3]:
        print(f"- [{r['kind']} / {r['topic']}] {r['prompt'][:200]!r}\n  -> "
              f"{tok.decode(r['ids'][r['start']:], skip_special_tokens=True)[:300]!r}")


if __name__ == "__main__":
    main()
