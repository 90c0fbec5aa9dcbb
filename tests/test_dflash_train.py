"""Training block drafters (jspec.tools.train.dflash): the training forward is the decode's forward, the feature
store holds the target's states, a head trained on a tiny target's own text accepts more of that text than a random
one, held-out batches are not training records, an interrupted run resumes bit-identically, and the script
trains, resumes, exports and ships."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.parts.drafters import dflash as DF
from jspec.parts.drafters import dflash_io as IO
from jspec.tools.train import dflash as DT
from jspec.tools.train import eagle as EGT
from jspec.tools.train import trainer as jt
from ports.core import cache as kvc
from tiny_pairs import PROMPTS, tiny_pair
from train_checks import assert_resumes_bit_identical, tiny_checkpoint_with_texts

BLOCK = 5
VOCAB = np.arange(97)[np.arange(97) % 5 > 0]  # a reduced draft vocabulary: 78 of 97 tokens


@pytest.fixture(scope="module")
def target():
    return tiny_pair()[0]


@pytest.fixture(scope="module")
def own_text(target):
    """The target's greedy continuations of PROMPTS (records 0 .. 2) and of 21 random prompts, masked to the
    continuation."""
    rng = np.random.default_rng(0)
    prompts = list(PROMPTS) + [rng.integers(0, 97, rng.integers(4, 12)) for _ in range(21)]
    out = jspec.decode(target, prompts, max_new_tokens=40, eos_token_id=())
    seqs = [np.concatenate([p, out.tokens[i]]) for i, p in enumerate(prompts)]
    return [(s.astype(np.int32), EGT.generated_mask(len(s), len(p))) for s, p in zip(seqs, prompts)]


@pytest.fixture(scope="module")
def store(target, own_text, tmp_path_factory):
    return DT.FeatureStore.build(target, own_text, (1, 3), tmp_path_factory.mktemp("features"), batch=5,
                                 progress=False)


def _head(target, key=0):
    return DF.init_head(target, jax.random.key(key), num_layers=1, block=BLOCK, target_layers=(1, 3),
                        draft_vocab=VOCAB, dtype=jnp.float32, scale=0.3)


def test_the_store_holds_the_target_states(target, own_text, store, tmp_path):
    """Each record's rows are the target's streams after layers 1 and 3 over that sequence alone (float16 when
    they fit), and building again for the same text reads the store back instead of running the target."""
    assert len(store) == len(own_text) and store.meta["dtype"] == "float16"
    cfg, lm = DF.text_parts(target)
    for r in (0, 7):
        ids, m = own_text[r]
        f, t, mm = store.record(r)
        want = np.asarray(DT._features(cfg, (1, 3), lm, jnp.asarray(ids[None])))[0]
        np.testing.assert_allclose(f, want, rtol=2e-3, atol=2e-3)
        np.testing.assert_array_equal(t, ids)
        np.testing.assert_array_equal(mm, m)
    again = DT.FeatureStore.build(target, own_text, (1, 3), store.dir, progress=False)
    assert again.meta["key"] == store.meta["key"]
    other = DT.FeatureStore.build(target, own_text[:3], (1, 3), tmp_path, progress=False)
    assert len(other) == 3 and other.meta["key"] != store.meta["key"]


def test_the_training_forward_is_the_decode_forward(target, store):
    """A block the loss scores (anchor a, the context before it, the block attending to itself) gives the states
    the drafter computes when decoding from a committed length of a: one forward over a cache of the context."""
    head = _head(target, key=4)
    batch = next(DT.batches(store, [3, 9], 2, 64, 3, BLOCK, seed=0))[0]
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    f, tgt = jax.jit(lambda h, b: DT.block_outputs(h, jnp.asarray(DF.text_parts(target)[1]["embed"]), b, BLOCK))(
        head, batch)
    _, lm = DF.text_parts(target)
    for b in range(2):
        for j in range(3):
            a = int(batch["anchors"][b, j])
            assert a >= 0
            cache = kvc.init_cache(1, 1, target.config.num_kv_heads, 80, target.config.head_dim, jnp.float32)
            cache = DF.write_context(head, cache, batch["h"][b:b + 1, :a])
            cache = cache.replace(length=jnp.asarray([a], jnp.int32))
            want = DF.block_forward(head, lm, batch["ids"][b:b + 1, a], cache, BLOCK)
            np.testing.assert_allclose(np.asarray(f[b, j]), np.asarray(want[0]), rtol=1e-4, atol=1e-5)
            np.testing.assert_array_equal(np.asarray(tgt[b, j]), np.asarray(batch["ids"][b, a:a + BLOCK]))


def _decode(target, head, tree="chain"):
    kw = dict(tree="ddtree", top_k=3, total=8) if tree == "ddtree" else {}
    return jspec.decode(target, PROMPTS, jspec.DFlash(head, **kw), max_new_tokens=24, eos_token_id=())


TRAIN, HELD = [0, 1, 2], [3, 4, 5, 6, 7, 8]  # the text trained on (PROMPTS' continuations) and records it never sees


def test_heldout_batches_are_not_training_records(store, own_text):
    """The held-out batches' rows are the held-out records' tokens, and none is a training record's."""
    trained = {tuple(own_text[r][0][:64]) for r in TRAIN}
    held = {tuple(own_text[r][0][:64]) for r in HELD}
    for b in DT.heldout_batches(store, HELD, 3, 64, 8, BLOCK, n=2):
        for row, n in zip(b["ids"], b["lengths"]):
            seq = tuple(int(t) for t in row[:n])
            assert seq in held and seq not in trained


def test_a_trained_head_accepts_more_than_a_random_one(target, store, tmp_path):
    """80 steps on the target's own continuations of PROMPTS: on that text the training loss falls, the greedy
    chain's block acceptance rises, and decoding PROMPTS (chain and DDTree) commits more tokens per step with the
    trained head than with the random head it started from, both keeping AR's output. Held-out batches (records
    never trained on) are evaluated at each checkpoint. The export loads back to the same decode."""
    head0 = DF.init_head(target, jax.random.key(0), num_layers=1, block=BLOCK, target_layers=(1, 3),
                         draft_vocab=VOCAB, dtype=jnp.float32)
    held = DT.heldout_batches(store, HELD, 3, 64, 8, BLOCK, n=1)
    head, meta = DT.fit_head(target, store, TRAIN, tmp_path, head=head0, steps=80, lr=1e-2, batch_size=3,
                             seq_len=64, anchors=8, heldout=held, progress=False, argv=[], log_every=10)
    assert jt.finished(meta) and meta["step"] == 80
    log = jt.read_log(tmp_path / "log.jsonl")
    losses = [r["loss"] for r in log if "loss" in r]
    assert {"loss", "top1_1", "top1_2", "grad_norm", "lr"} <= set([r for r in log if "loss" in r][0])
    assert losses[-1] < losses[0]
    assert [r for r in log if "heldout_tau" in r]
    _, rows, index_of = DT.vocab_tables(target, head0)
    embed = jnp.asarray(DF.text_parts(target)[1]["embed"])
    eval_step = DT.make_steps(head0, jt.adamw(0.0), DT.BlockOptions(BLOCK, DT.default_gamma(BLOCK))).eval
    on_text = DT.heldout_batches(store, TRAIN, 3, 64, 8, BLOCK, n=1)
    before, after = (jt.evaluate(eval_step, h.params, on_text, head0.vocab, embed, rows, index_of, prefix="")
                     for h in (head0, head))
    assert after["tau"] > before["tau"]
    ar = jspec.decode(target, PROMPTS, max_new_tokens=24, eos_token_id=())
    acc = {}
    for tree in ("chain", "ddtree"):
        out0, out1 = _decode(target, head0, tree), _decode(target, head, tree)
        for o in (out0, out1):
            np.testing.assert_array_equal(o.tokens, ar.tokens)
        acc[tree] = (float(np.mean(out0.stats["mean_accepted"])), float(np.mean(out1.stats["mean_accepted"])))
    print(f"on the training text {before} -> {after}; mean accepted (random, trained) {acc}")
    for tree, (a0, a1) in acc.items():
        assert a1 > a0, tree
    IO.save_head(head, str(tmp_path / "export"))
    again = _decode(target, IO.load_head(str(tmp_path / "export"), target))
    np.testing.assert_array_equal(again.stats["accepted"], _decode(target, head).stats["accepted"])
    assert DT.plot_acceptance(tmp_path / "log.jsonl", tmp_path / "acc.png", "t").exists()


def test_interrupted_run_resumes_bit_identical(target, store, tmp_path):
    """Two short runs (interrupted at step 7, then resumed) end where one run of 12 steps does: the same
    parameters and the same logged losses."""
    head = _head(target, key=5)

    def fit(t, items, workdir, **kw):
        return DT.fit_head(t, store, list(range(4, len(store))), workdir, head=head, **kw)

    assert_resumes_bit_identical(fit, target, None, tmp_path, steps=12, lr=3e-3, batch_size=3, seq_len=48,
                                 anchors=3, progress=False, argv=[], log_every=2, seed=3)


def test_the_script_trains_resumes_and_exports(tmp_path):
    """`jspec train dflash` on an HF checkpoint directory with --texts: a run, then the same command resuming the
    finished run (through the `jspec` entry point) and training nothing more; the exported head loads and
    decodes AR's tokens; the plots are written; a single record is refused (it cannot be both held out and
    trained on)."""
    from jspec.tools import cli
    from jspec.tools.cli import train_dflash as TS

    target, _ = tiny_pair()
    d, texts = tiny_checkpoint_with_texts(tmp_path, target)
    args = ["--target", str(d), "--texts", str(texts), "--out", str(tmp_path / "run"), "--steps", "6", "--batch",
            "4", "--seq-len", "32", "--draft-vocab", "40", "--layers", "1", "--block", "4", "--target-layers", "1",
            "3", "--anchors", "3", "--log-every", "2"]
    first = TS.main(args)
    assert first["meta"]["step"] == 6 and jt.finished(first["meta"])
    assert cli.main(["train", "dflash", *args]) == 0
    again = TS.main(args)
    assert again["meta"]["step"] == 6 and len(again["meta"]["runs"]) == 2  # a run that trains no step saves none
    for a, b in zip(jax.tree.leaves(first["head"].params), jax.tree.leaves(again["head"].params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    head = IO.load_head(str(tmp_path / "run"), target)
    assert head.draft_vocab_size == 40 and head.target_layers == (1, 3) and head.block == 4
    conf = json.load(open(tmp_path / "run" / IO.CONFIG_NAME))
    assert conf["dflash_config"]["target_layer_ids"] == [0, 2] and conf["jspec"]["finished"]
    assert "heldout_tau" in conf["jspec"]["heldout"]
    out = jspec.decode(target, PROMPTS, jspec.DFlash(head, tree="ddtree", top_k=3, total=8), max_new_tokens=8,
                       eos_token_id=())
    np.testing.assert_array_equal(out.tokens, jspec.decode(target, PROMPTS, max_new_tokens=8, eos_token_id=()).tokens)
    assert (tmp_path / "run" / "loss.png").exists() and (tmp_path / "run" / "acceptance.png").exists()
    one = tmp_path / "one.jsonl"
    one.write_text(texts.read_text().splitlines()[0] + "\n")
    with pytest.raises(SystemExit, match="at least 2"):  # a lone record would be both held out and trained on
        TS.main(args[:3] + [str(one), "--out", str(tmp_path / "one")] + args[6:])
