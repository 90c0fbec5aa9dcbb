"""Checks every head trainer shares (tests/test_eagle_train.py, tests/test_eagle3_train.py)."""
import jax
import numpy as np

from jspec.tools.train import trainer as jt


def assert_resumes_bit_identical(fit_head, target, items, tmp_path, **kw):
    """`fit_head(target, items, workdir, **kw)` for kw["steps"] steps, interrupted at step 7 and resumed, ends with the
    parameters and training log of an uninterrupted run (timings aside); returns the run dir kw resumed in."""
    whole, _ = fit_head(target, items, tmp_path / "a", **kw)
    _, meta = fit_head(target, items, tmp_path / "b", interrupt_at=7, **kw)
    assert meta["step"] == 7 and not jt.finished(meta)
    resumed, meta = fit_head(target, items, tmp_path / "b", **kw)
    assert meta["step"] == kw["steps"] and [r["from_step"] for r in meta["runs"]] == [0, 7]
    for a, b in zip(jax.tree.leaves(whole.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def strip(rows):
        return [{k: v for k, v in r.items() if k not in ("tok_s", "elapsed_s")} for r in rows if "loss" in r]

    assert strip(jt.read_log(tmp_path / "a" / "log.jsonl")) == strip(jt.read_log(tmp_path / "b" / "log.jsonl"))
    return tmp_path / "b"


def tiny_checkpoint_with_texts(tmp_path, target):
    """(an HF checkpoint directory of `target` with a 90-word word-level tokenizer, a JSON-lines file of 40
    prompt / answer pairs in those words): what the training scripts' --target and --texts take."""
    import json

    import ports
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    d = tmp_path / "target"
    ports.save_hf(target, str(d))
    words = [f"w{i}" for i in range(90)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0").save_pretrained(str(d))
    rng = np.random.default_rng(0)
    texts = tmp_path / "texts.jsonl"
    with open(texts, "w") as f:
        for _ in range(40):
            f.write(json.dumps({"prompt": " ".join(rng.choice(words, 6)), "answer": " ".join(rng.choice(words, 12))})
                    + "\n")
    return d, texts
