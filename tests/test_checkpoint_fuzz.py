"""Damaged checkpoints fail clearly, before any tensor is read, and `jspec convert` survives being killed.

Each fuzz case starts from a tiny LLaMA that transformers saved, damages it one way, and asserts the error names
the problem; `SafetensorsFile.get` is counted to prove no tensor was read first. An interrupted conversion never
loads as a model, and running it again resumes (its finished layers are not read again) or starts clean.
"""
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import ports
from conftest import tiny_hf, write_layered_checkpoint
from ports.io import checkpoint as CK
from ports.core.safetensors_io import SafetensorsFile, write_safetensors

WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny LLaMA saved by transformers (single file and 3+ shards), and its params as load_hf reads them."""
    root = tmp_path_factory.mktemp("fuzz")
    hf = tiny_hf("llama", seed=11, num_hidden_layers=3)
    hf.save_pretrained(str(root / "single"))
    hf.save_pretrained(str(root / "sharded"), max_shard_size="40KB")
    return root, ports.load_hf(str(root / "single"))


def _copy(saved, tmp_path, which="single"):
    import shutil

    root, _ = saved
    return shutil.copytree(root / which, tmp_path / which)


def _tensors(path):
    f = SafetensorsFile(str(path))
    return {k: f.get(k) for k in f.keys()}


def _write(path, tensors):
    write_safetensors(str(path), {k: (v.shape, v.dtype) for k, v in tensors.items()}, tensors.__getitem__)


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_header(path, edit):
    """Rewrite the safetensors header of `path` through `edit(header dict)`, keeping the data bytes."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = edit(json.loads(raw[8:8 + n]))
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(len(blob).to_bytes(8, "little") + blob + raw[8 + n:])


def _first_key(header):
    return next(k for k in header if k != "__metadata__")


def shuffled(d):  # tensors in reverse order in the file: not damage, it must load the same
    t = _tensors(d / WEIGHTS)
    _write(d / WEIGHTS, dict(reversed(list(t.items()))))


def missing(d):
    t = _tensors(d / WEIGHTS)
    del t["model.layers.2.mlp.down_proj.weight"]
    _write(d / WEIGHTS, t)


def extra(d):
    _write(d / WEIGHTS, {**_tensors(d / WEIGHTS), "model.layers.0.self_attn.rotary_emb.scale": np.ones(3, "f4")})


def wrong_shape(d):
    t = _tensors(d / WEIGHTS)
    t["model.layers.1.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"].T.copy()  # [96, 64] -> [64, 96]
    _write(d / WEIGHTS, t)


def wrong_type(d):
    t = _tensors(d / WEIGHTS)
    t["model.norm.weight"] = t["model.norm.weight"].astype(np.int32)
    _write(d / WEIGHTS, t)


def unsupported_dtype(d):
    def edit(h):
        h["model.norm.weight"]["dtype"] = "F8_E4M3"
        return h
    _edit_header(d / WEIGHTS, edit)


def offsets_disagree(d):
    def edit(h):
        h[_first_key(h)]["shape"][0] -= 1
        return h
    _edit_header(d / WEIGHTS, edit)


def malformed_entry(d):
    def edit(h):
        del h[_first_key(h)]["data_offsets"]
        return h
    _edit_header(d / WEIGHTS, edit)


def truncated(d):
    raw = (d / WEIGHTS).read_bytes()
    (d / WEIGHTS).write_bytes(raw[:len(raw) - 100])


def truncated_header(d):
    (d / WEIGHTS).write_bytes((d / WEIGHTS).read_bytes()[:200])


def empty_file(d):
    (d / WEIGHTS).write_bytes(b"")


def garbage_header(d):
    raw = (d / WEIGHTS).read_bytes()
    (d / WEIGHTS).write_bytes(raw[:8] + b"\xff" * 64 + raw[72:])


def config_hidden_size(d):
    _edit_config(d, hidden_size=128, head_dim=32)


def config_more_layers(d):
    _edit_config(d, num_hidden_layers=4)


def config_vocab(d):
    _edit_config(d, vocab_size=100)


def config_not_json(d):
    (d / "config.json").write_text("{'model_type': 'llama'")


def config_model_type(d):
    _edit_config(d, model_type="mamba")


def index_missing_shard(d):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    os.remove(d / shard)


def index_not_json(d):
    (d / "model.safetensors.index.json").write_text("weight_map:")


def duplicated_across_shards(d):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    a, b = _tensors(d / shards[0]), _tensors(d / shards[1])
    name = next(iter(a))
    _write(d / shards[1], {**b, name: a[name]})


# (damage, which checkpoint, error type, what the message must say)
CASES = {
    "missing tensor": (missing, "single", ValueError, r"missing keys \(1\).*layers\.2\.mlp\.down_proj"),
    "extra tensor": (extra, "single", ValueError, r"unexpected keys \(1\).*rotary_emb\.scale"),
    "wrong shape": (wrong_shape, "single", ValueError, r"wrong shapes \(1\).*layers\.1\.mlp\.up_proj"),
    "integer tensor": (wrong_type, "single", ValueError, r"not floating point \(1\).*model\.norm\.weight: I32"),
    "unsupported dtype": (unsupported_dtype, "single", ValueError, r"model\.norm\.weight.*unsupported dtype F8_E4M3"),
    "offsets disagree with shape": (offsets_disagree, "single", ValueError, r"data_offsets .* do not hold"),
    "malformed header entry": (malformed_entry, "single", ValueError, r"malformed header entry"),
    "truncated file": (truncated, "single", ValueError, r"truncated: the header describes \d+ bytes"),
    "truncated in header": (truncated_header, "single", ValueError, r"truncated inside its header"),
    "empty file": (empty_file, "single", ValueError, r"not a safetensors file"),
    "garbage header": (garbage_header, "single", ValueError, r"header is not valid JSON"),
    "config: other hidden size": (config_hidden_size, "single", ValueError, r"wrong shapes \(\d+\)"),
    "config: more layers": (config_more_layers, "single", ValueError, r"missing keys \(9\).*layers\.3\."),
    "config: other vocab": (config_vocab, "single", ValueError, r"wrong shapes \(2\).*embed_tokens"),
    "config: not JSON": (config_not_json, "single", ValueError, r"config\.json: not valid JSON"),
    "config: unknown model_type": (config_model_type, "single", ValueError, r"unknown architecture.*'mamba'"),
    "index names a missing shard": (index_missing_shard, "sharded", FileNotFoundError,
                                    r"index\.json names shard files that are missing"),
    "index not JSON": (index_not_json, "sharded", ValueError, r"not a safetensors index"),
    "tensor in two shards": (duplicated_across_shards, "sharded", ValueError, r"in more than one file \(1\)"),
}


@pytest.fixture
def count_reads(monkeypatch):
    reads = []
    real = SafetensorsFile.get
    monkeypatch.setattr(SafetensorsFile, "get", lambda self, key: reads.append(key) or real(self, key))
    return reads


def test_reordered_tensors_load_the_same(saved, tmp_path):
    d = _copy(saved, tmp_path)
    shuffled(d)
    for a, b in zip(jax.tree.leaves(ports.load_hf(str(d)).params), jax.tree.leaves(saved[1].params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("case", sorted(CASES))
def test_damaged_checkpoint_is_named_before_any_tensor_is_read(case, saved, tmp_path, count_reads):
    damage, which, error, message = CASES[case]
    d = _copy(saved, tmp_path, which)
    damage(d)
    count_reads.clear()  # the damage itself read the tensors it rewrote
    with pytest.raises(error, match=message):
        ports.load_hf(str(d))
    with pytest.raises(error, match=message):
        ports.convert_hf(str(d), str(tmp_path / "out"))
    assert count_reads == [], f"{len(count_reads)} tensors were read before the error"
    assert not (tmp_path / "out").exists()  # nothing written for a checkpoint that cannot convert


def _assert_same_params(a, b):
    assert jax.tree.structure(a.params) == jax.tree.structure(b.params)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_killed_convert_never_loads_and_running_it_again_resumes(tmp_path, count_reads):
    """`jspec convert` killed (SIGKILL) after a few of 24 layers: the directory refuses to load, naming the
    command that finishes it; that command resumes (the layers already written are not read again) and the result
    equals the checkpoint."""
    src, out = tmp_path / "hf", tmp_path / "out"
    write_layered_checkpoint(src, 24)
    proc = subprocess.Popen([sys.executable, "-m", "jspec.tools.cli", "convert", str(src), str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    deadline = time.time() + 300
    while not (out / "layers" / "00003").exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    written = sorted(int(n) for n in os.listdir(out / "layers") if n.isdigit())
    assert 3 <= len(written) < 24 and not (out / CK.COMPLETE).exists()
    with pytest.raises(FileNotFoundError, match=rf"unfinished conversion \({len(written)} layers written.*"
                                                 rf"jspec convert {src} {out}` again"):
        ports.load(str(out))

    per_layer = 9  # tensors of one LLaMA decoder layer
    cfg, n = ports.convert_hf(str(src), str(out))
    assert len(count_reads) == 24 * per_layer + 3 - len(written) * per_layer
    assert not any(name.startswith("model.layers.%d." % i) for name in count_reads for i in written)
    back, ref = ports.load(str(out)), ports.load_hf(str(src))
    _assert_same_params(back, ref)
    assert n == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(ref.params))
    assert json.loads((out / CK.COMPLETE).read_text())["num_layers"] == 24
    assert not (out / CK.CONVERTING).exists()


def _interrupt_after(monkeypatch, saves: int):
    """Make the `saves`-th orbax write raise, as a crash would stop it."""
    real, count = CK.orbax_save, []

    def save(path, tree):
        count.append(path)
        if len(count) == saves:
            raise KeyboardInterrupt("interrupted")
        real(path, tree)
    monkeypatch.setattr(CK, "orbax_save", save)


def test_an_other_conversion_into_an_unfinished_directory_starts_clean(saved, tmp_path, monkeypatch):
    """A different dtype (or source, or config) does not reuse another conversion's layers."""
    root, ref = saved
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        _interrupt_after(m, 3)
        with pytest.raises(KeyboardInterrupt):
            ports.convert_hf(str(root / "single"), str(out), dtype="bfloat16")
    assert sorted(os.listdir(out / "layers")) == ["00000", "00001"]
    with pytest.raises(FileNotFoundError, match="unfinished conversion"):
        ports.load(str(out))
    ports.convert_hf(str(root / "single"), str(out))  # f32 now: every layer is read and written again
    back = ports.load(str(out))
    assert back.dtype == np.float32
    _assert_same_params(back, ref)


def test_an_interrupted_save_never_loads(saved, tmp_path, monkeypatch):
    """`ports.save` over a complete checkpoint, interrupted before its last write: the directory no longer loads
    (neither the old model nor half of the new one); a finished save loads again."""
    _, model = saved
    out = tmp_path / "ckpt"
    ports.save(model, str(out))
    assert (out / CK.COMPLETE).exists()
    with monkeypatch.context() as m:
        _interrupt_after(m, 4)  # three layers, then the non-layer params
        with pytest.raises(KeyboardInterrupt):
            ports.save(model, str(out))
    with pytest.raises(FileNotFoundError, match="incomplete jspec checkpoint"):
        ports.load(str(out))
    ports.save(model, str(out))
    _assert_same_params(ports.load(str(out)), model)
