"""Every preset users name, each a composition of the engine's parts (`jspec.engine.strategy.Speculative`):
`standard` (AR, Chain, Tree, DynamicTree), `prompt_lookup`, `guarded`, and one module per paper method (with what
only it needs: SpecVLM's `pruning`)."""


def preset(table: dict, name, method: str, instead: str) -> dict:
    """The entry of a method's preset `table` for a shipped config name or path (its basename, without .json);
    ValueError naming the presets and what to pass `instead` otherwise."""
    import os

    key = os.path.basename(str(name).rstrip("/")).removesuffix(".json").lower()
    if key not in table:
        raise ValueError(f"no {method} preset for {name!r} (presets: {', '.join(table)}); {instead}")
    return table[key]
