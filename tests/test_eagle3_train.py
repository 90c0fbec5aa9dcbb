"""EAGLE-3 training-time-test training (jspec.tools.train.eagle3): the loss against a direct computation from
the unrolled head, a few dozen steps on a tiny target's own greedy text raising every step's agreement and the
decode's acceptance, an interrupted run resuming bit-identically, and the training script end to end."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jspec
from jspec.tools.train import trainer as jt
from jspec.parts.drafters import eagle as EG
from jspec.parts.drafters import eagle3 as E3
from jspec.parts.drafters import eagle3_io as IO
from jspec.tools.train import eagle3 as E3T
from jspec.tools.train import eagle as EGT
from ports.core import cache as kvc
from train_checks import assert_resumes_bit_identical, tiny_checkpoint_with_texts
from tiny_pairs import PROMPTS, tiny_pair

NEW = 12
OPTS = E3T.TTTOptions(steps=3, decay=0.8)
VOCAB = np.arange(97)[np.arange(97) % 5 > 0]  # a reduced draft vocabulary: 78 of 97 tokens


@pytest.fixture(scope="module")
def target():
    return tiny_pair()[0]


def _aux(target):
    return (0, 1, target.config.num_layers)


def _decode(target, head):
    return jspec.decode(target, PROMPTS, jspec.Eagle3(head, tree="chain", depth=3), max_new_tokens=NEW,
                        eos_token_id=())


@pytest.fixture(scope="module")
def own_text(target):
    """The target's greedy continuations of PROMPTS, masked to the continuation."""
    out = jspec.decode(target, PROMPTS, max_new_tokens=NEW, eos_token_id=())
    seqs = [np.concatenate([p, out.tokens[i]]) for i, p in enumerate(PROMPTS)]
    return [(s, EGT.generated_mask(len(s), len(p))) for s, p in zip(seqs, PROMPTS)]


_ttt3 = jax.jit(lambda head, embed, h, toks: E3.ttt_logits(head, embed, h, toks, 3))


def test_the_loss_is_training_time_test(target, own_text):
    """Each step's KL and top-1, computed here from the head unrolled from scratch (`eagle3.ttt_logits`, the
    computation `speculators` checks) and the target's own logits, one row at a time."""
    head = E3.init_head(target, jax.random.key(2), _aux(target), VOCAB, scale=0.3)
    batch, _, _ = next(EGT.batches(own_text, 3, 32))
    cfg, lm = EG.text_parts(target)
    _, aux = jax.jit(lambda h, b: E3T.loss_terms(cfg, lm, h, b, OPTS))(head, {k: jnp.asarray(v) for k, v in
                                                                             batch.items()})
    kls, top1s = [[] for _ in range(3)], [[] for _ in range(3)]
    @jax.jit
    def forward(seq):
        n = seq.shape[0]
        cache = kvc.init_cache(cfg.num_layers, 1, cfg.num_kv_heads, n, cfg.head_dim, jnp.float32)
        fo = target.forward(seq[None], jnp.arange(n)[None], cache, fresh=True, hidden_layers=head.aux_layers)
        return jnp.concatenate(fo.hidden, axis=-1), fo.logits[0]

    for b, (seq, mask) in enumerate(own_text):
        n = len(seq)
        h, logits = forward(jnp.asarray(seq))
        p = np.asarray(jax.nn.log_softmax(logits[:, VOCAB], axis=-1))  # the target over the draft vocabulary
        toks = np.pad(seq, (0, 3))[None]
        for s, x in enumerate(_ttt3(head, lm["embed"], h, jnp.asarray(toks))):
            q = np.asarray(jax.nn.log_softmax(np.asarray(x[0])[:, VOCAB], axis=-1))
            for t in range(n - 2 - s):  # entry t of step s predicts token t + 2 + s, drawn from p[t + 1 + s]
                if mask[t + 1 + s]:
                    pt = p[t + 1 + s]
                    kls[s].append(float(np.sum(np.exp(pt) * (pt - q[t]))))
                    top1s[s].append(float(np.argmax(q[t]) == np.argmax(pt)))
    for s in range(3):
        assert len(kls[s]) == int(aux[f"weight{s}"]) > 5
        np.testing.assert_allclose(float(aux[f"kl{s}"]), np.mean(kls[s]), rtol=2e-4)
        np.testing.assert_allclose(float(aux[f"top1_{s}"]), np.mean(top1s[s]), rtol=1e-6)
    want = sum(0.8 ** s * np.mean(kls[s]) for s in range(3))
    np.testing.assert_allclose(float(aux["loss"]), want, rtol=2e-4)


def test_training_raises_every_step_s_agreement_and_acceptance(target, own_text, tmp_path):
    """Self-distillation with training-time test on the prompts' own greedy continuations: after 60 steps every
    step's held-out top-1 rises (step 2 drafts from the head's own states twice) and the decode of the same
    prompts accepts more drafts per step. The trained head's export loads back to the same decode."""
    head0 = E3T.start_head(target, jax.random.key(0), VOCAB, _aux(target))
    held = [next(EGT.batches(own_text, 3, 32))[0]]
    _, lm = EG.text_parts(target)
    eval_step = E3T.make_steps(target, head0, EGT.optimizer(), OPTS).eval
    before = E3T.evaluate(eval_step, head0.params, head0.vocab, lm, held)
    acc0 = float(np.mean(_decode(target, head0).stats["mean_accepted"]))
    head, meta = E3T.fit_head(target, own_text, tmp_path, steps=60, lr=1e-2, batch_size=3, seq_len=32, opts=OPTS,
                              head=head0, heldout=held, progress=False, argv=[])
    assert jt.finished(meta) and meta["step"] == 60
    log = jt.read_log(tmp_path / "log.jsonl")
    rows = [r for r in log if "loss" in r]
    assert {"kl0", "kl2", "top1_0", "top1_2", "grad_norm", "lr"} <= set(rows[0])
    after = [r for r in log if "heldout_loss" in r][-1]
    out = _decode(target, head)
    acc1 = float(np.mean(out.stats["mean_accepted"]))
    print(f"held-out {before} -> {after}; mean accepted {acc0:.3f} -> {acc1:.3f}")
    assert after["heldout_loss"] < 0.5 * before["heldout_loss"]
    for s in range(3):
        assert after[f"heldout_top1_{s}"] > before[f"heldout_top1_{s}"] + 0.3, s
    assert acc1 > acc0 + 0.5
    IO.save_head(head, str(tmp_path / "export"), target=target)
    again = _decode(target, IO.load_head(str(tmp_path / "export"), target))
    np.testing.assert_array_equal(again.stats["accepted"], out.stats["accepted"])


def test_interrupted_run_resumes_bit_identical(target, own_text, tmp_path):
    kw = dict(steps=12, lr=1e-2, batch_size=3, seq_len=32, progress=False, argv=[], log_every=2, seed=3, opts=OPTS,
              draft_vocab=VOCAB, aux_layers=_aux(target))
    assert_resumes_bit_identical(E3T.fit_head, target, own_text, tmp_path, **kw)


def test_the_script_trains_resumes_and_exports(tmp_path):
    """`jspec train eagle3` on an HF checkpoint directory with --texts: a short run, then the same command
    continuing it (twice, once through the `jspec` entry point), then the exported speculators-format head loading
    and drafting."""
    from jspec.tools import cli
    from jspec.tools.cli import train_eagle3 as TS

    target, _ = tiny_pair()
    d, texts = tiny_checkpoint_with_texts(tmp_path, target)
    args = ["--target", str(d), "--texts", str(texts), "--out", str(tmp_path / "run"), "--steps", "6", "--batch",
            "4", "--seq-len", "32", "--draft-vocab", "40", "--aux-layers", "0", "1", "3", "--log-every", "2"]
    first = TS.main(args)
    assert first["meta"]["step"] == 6 and jt.finished(first["meta"])
    assert cli.main(["train", "eagle3", *args]) == 0  # the `jspec` entry point: resumes, nothing left to train
    again = TS.main(args)  # the same command: resumes the finished run from its checkpoint, trains nothing more
    assert again["meta"]["step"] == 6 and len(again["meta"]["runs"]) == 2  # a run that trains no step saves none
    for a, b in zip(jax.tree.leaves(first["head"].params), jax.tree.leaves(again["head"].params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    head = IO.load_head(str(tmp_path / "run"), target)
    assert head.draft_vocab_size == 40 and head.aux_layers == (0, 1, 3)
    meta = json.load(open(tmp_path / "run" / IO.META_NAME))
    assert meta["finished"] and meta["ttt_steps"] == 3 and "heldout_top1_2" in meta["heldout"]
    out = jspec.decode(target, PROMPTS, jspec.Eagle3(head, depth=3, top_k=3, total=8), max_new_tokens=8,
                       eos_token_id=())
    np.testing.assert_array_equal(out.tokens, jspec.decode(target, PROMPTS, max_new_tokens=8, eos_token_id=()).tokens)
    assert (tmp_path / "run" / "loss.png").exists()
