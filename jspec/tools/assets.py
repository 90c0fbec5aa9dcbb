"""Where the weights that ship beside the code live: the zoo's models (distribution `jspec-zoo`, package
`jspec_zoo`) and the trained drafters of real models (`jspec-heads`, `jspec_heads`). They are separate
distributions so that the `jspec` wheel stays small; a checkout installs them with
`pip install -e assets/zoo -e assets/heads`."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ZOO = ("jspec_zoo", "jspec-zoo", "assets/zoo")
HEADS = ("jspec_heads", "jspec-heads", "assets/heads")


def directory(which: tuple[str, str, str]) -> Path | None:
    """The installed weights package's folder, or None when that distribution is not installed."""
    spec = importlib.util.find_spec(which[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]).resolve()


def install_hint(which: tuple[str, str, str]) -> str:
    """One sentence saying how to get the weights of `which`."""
    return (f"its weights ship in the {which[1]} distribution: `pip install {which[1]}` "
            f"(from a checkout of jspec: `pip install -e {which[2]}`)")
