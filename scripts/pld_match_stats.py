"""How often prompt lookup's copies are accepted, by the length of the suffix that found them: the numbers behind
`jspec.PromptLookup(depths=...)` (a weak one-token match drafts little, a three-token match a long copy).

    python scripts/pld_match_stats.py                        # SmolLM2, Spec-Bench summarization and RAG, 10 each
    python scripts/pld_match_stats.py --categories qa --questions 5

Each question is answered once by jspec AR (greedy, 256 new tokens); then, along the steps a gamma-4 prompt lookup
takes over that answer, the copy drafted at each step (`jspec.parts.drafters.ngram.reference_draft`: the longest suffix of
at most 3 tokens seen before, its most frequent continuation, copied from the latest source) is compared with the
answer's next tokens. Writes scripts/results/pld-match-<model>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--categories", nargs="+", default=["summarization", "rag"])
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=256)
    a = ap.parse_args(argv)

    import jax

    import jspec
    from jspec.engine import compilation
    from jspec.tools import models
    from jspec.tools.bench.spec_bench import load_questions
    from jspec.parts.drafters.ngram import reference_draft
    from jspec.tools.self_data import chat_ids

    compilation.enable_cache()
    model, tok = models.load(a.model)
    eos = tuple(np.atleast_1d(tok.eos_token_id).tolist())
    rows = []
    for q in load_questions(tuple(a.categories), a.questions):
        ids = chat_ids(tok, [{"role": "user", "content": q["turns"][0]}])
        out = jspec.decode(model, ids, jspec.AR(), max_new_tokens=a.max_new, key=jax.random.key(0), eos_token_id=eos,
                           pad_prompt_to=128)
        gen = np.asarray(out.tokens[0, :int(out.lengths[0])]).tolist()
        text, i = ids.tolist() + gen[:1], 1
        while i < len(gen):
            g, draft = reference_draft(text, 3, a.gamma)
            acc = 0
            while acc < len(draft) and i + acc < len(gen) and draft[acc] == gen[i + acc]:
                acc += 1
            rows.append((q["category"], g, acc))
            text += gen[i:i + acc + 1]
            i += acc + 1
        print(f"{q['question_id']} {q['category']}: {len(gen)} tokens", flush=True)
    table = []
    for cat in a.categories:
        for g in range(4):
            acc = np.asarray([r[2] for r in rows if r[0] == cat and r[1] == g])
            if len(acc) == 0:
                continue
            table.append({"category": cat, "match": g, "steps": int(len(acc)),
                          **{f"first_{k}_accepted": round(float(np.mean(acc >= k)), 3) for k in range(1, a.gamma + 1)}})
    res = {"model": a.model, "questions_per_category": a.questions, "gamma": a.gamma, "max_new": a.max_new,
           "rows": table}
    out_dir = ROOT / "scripts" / "results"
    (out_dir / f"pld-match-{a.model}.json").write_text(json.dumps(res, indent=1))
    keys = list(table[0])
    md = [f"# Prompt lookup's copies by match length, {a.model}", "",
          f"Spec-Bench, {a.questions} questions per category, jspec AR's greedy answers ({a.max_new} tokens at most), "
          f"the steps of a gamma-{a.gamma} prompt lookup over them; match 0: no suffix seen before (nothing drafted).",
          "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    md += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in table]
    (out_dir / f"pld-match-{a.model}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return res


if __name__ == "__main__":
    main()
