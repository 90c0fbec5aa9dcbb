"""The code a reader copies from the docs runs: `docs/architecture.md`'s drafter example decodes AR's tokens."""
import re
from pathlib import Path

import numpy as np

import jspec
from tiny_pairs import PROMPTS, tiny_pair

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _block(doc: str, heading: str) -> str:
    text = (DOCS / doc).read_text()
    section = text[text.index(heading):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_drafter_example_is_lossless_and_drafts():
    scope: dict = {}
    exec(compile(_block("architecture.md", "### Writing a drafter"), "architecture.md", "exec"), scope)
    target, _ = tiny_pair()
    ar = jspec.decode(target, PROMPTS, max_new_tokens=24, eos_token_id=())
    out = jspec.decode(target, PROMPTS, scope["echo"](target), max_new_tokens=24, eos_token_id=())
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    assert np.sum(out.stats["drafted"]) > 0  # the echo found earlier occurrences and proposed from them
    assert np.asarray(out.stats["accepted"]).max() >= 2  # and some of its drafts were the target's own tokens


def test_the_readme_token_drafter_is_five_lines_and_lossless():
    text = (DOCS.parent / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "TokenDrafter" in b)
    code = block[:block.index("out = jspec.decode")]
    assert len([line for line in code.splitlines() if line.strip() and not line.startswith("import")]) <= 5
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    target, _ = tiny_pair()
    ar = jspec.decode(target, PROMPTS, max_new_tokens=12, eos_token_id=())
    out = jspec.decode(target, PROMPTS, jspec.Chain(jspec.TokenDrafter(scope["last_k"]), gamma=4), max_new_tokens=12,
                       eos_token_id=())
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    assert np.sum(out.stats["drafted"]) > 0


def test_the_readme_feed_drafter_is_a_few_lines_and_lossless():
    """The README's draft model written on `FeedDrafter` (its cache and prefill, its forward; the feed, deferral and
    commit are the base's) decodes AR's greedy tokens, accepts drafts, and samples the tokens `ModelDrafter` samples
    with the same key; under a guard that leaves its feed unread it still decodes AR's tokens."""
    import jax

    from strategies import guarded

    text = (DOCS.parent / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "FeedDrafter" in b)
    code = block[:block.index("out = jspec.decode")]
    assert len([line for line in code.splitlines() if line.strip() and not line.startswith(("import", "from"))]) <= 8
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    target, draft = tiny_pair()
    small = scope["SmallDraft"](draft)
    ar = jspec.decode(target, PROMPTS, max_new_tokens=16, eos_token_id=())
    for strategy in (jspec.Chain(small, gamma=3), jspec.Tree(small, tree=[[0], [1], [0, 0]]),
                     guarded(jspec.Chain(small, gamma=3))):
        out = jspec.decode(target, PROMPTS, strategy, max_new_tokens=16, eos_token_id=())
        np.testing.assert_array_equal(out.tokens, ar.tokens)
        assert np.asarray(out.stats["accepted"]).max() >= 2
    kw = dict(max_new_tokens=16, eos_token_id=(), temperature=1.0, key=jax.random.key(3))
    mine = jspec.decode(target, PROMPTS, jspec.Chain(small, gamma=3), **kw)
    model = jspec.decode(target, PROMPTS, jspec.Chain(draft, gamma=3), **kw)
    np.testing.assert_array_equal(mine.tokens, model.tokens)
    np.testing.assert_array_equal(mine.stats["accepted"], model.stats["accepted"])
