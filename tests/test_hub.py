"""Checkpoints by Hub id: "org/name" loads from a cache laid out as the Hugging Face Hub's with networking off (a
pinned revision too), converts the same way, and a repo that is not there is a clear error."""
import os
import shutil

import numpy as np
import pytest

import ports
from conftest import tiny_hf

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root, repo: str, src_dir: str, commit: str = COMMIT, ref: str = "main") -> str:
    """A Hugging Face Hub cache at `root` holding `src_dir`'s files as snapshot `commit` of `repo`, `ref` -> commit
    (the layout huggingface_hub reads: models--org--name/{refs/REF, snapshots/COMMIT/...})."""
    base = os.path.join(root, "models--" + repo.replace("/", "--"))
    os.makedirs(os.path.join(base, "refs"), exist_ok=True)
    with open(os.path.join(base, "refs", ref), "w") as f:
        f.write(commit)
    shutil.copytree(src_dir, os.path.join(base, "snapshots", commit))
    return root


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("src"))
    hf = tiny_hf("llama", seed=3)
    hf.save_pretrained(src)
    cache = hub_cache(str(tmp_path_factory.mktemp("hub")), "tiny-org/tiny-llama", src)
    return src, cache


def test_a_repo_id_loads_from_the_hub_cache_offline(cached, monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    src, cache = cached
    want = ports.load_hf(src)
    got = ports.load_hf("tiny-org/tiny-llama", cache_dir=cache)
    ids = np.array([[1, 5, 9, 2]])
    np.testing.assert_array_equal(ports.logits(got, ids), ports.logits(want, ids))
    pinned = ports.load_hf("tiny-org/tiny-llama", revision=COMMIT, cache_dir=cache)
    np.testing.assert_array_equal(ports.logits(pinned, ids), ports.logits(want, ids))
    ports.convert_hf("tiny-org/tiny-llama", str(tmp_path / "conv"), cache_dir=cache)
    np.testing.assert_array_equal(ports.logits(ports.load(str(tmp_path / "conv")), ids), ports.logits(want, ids))
    assert ports.io.hub.resolve(src) == src  # a local directory passes through


def test_missing_repos_and_revisions_are_clear_errors(cached, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    _, cache = cached
    with pytest.raises(ValueError, match="no checkpoint 'tiny-org/absent'.*not in the Hugging Face cache.*offline|"
                                         "no checkpoint 'tiny-org/absent'.*networking is off"):
        ports.load_hf("tiny-org/absent", cache_dir=cache)
    with pytest.raises(ValueError, match="at revision 'v9'"):
        ports.load_hf("tiny-org/tiny-llama", revision="v9", cache_dir=cache)
    with pytest.raises(ValueError, match="applies to a Hub repo id"):
        ports.load_hf(cached[0], revision="main")
    assert not ports.io.hub.is_repo_id("model.gguf") and ports.io.hub.is_repo_id("org/name")
