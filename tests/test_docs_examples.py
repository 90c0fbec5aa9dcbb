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
