"""Strategies over a Muse Glimmer target, with the Qwen3 targets' machinery (tests/qwen3_pairs.py,
tests/qwen3_sharded_checks.py): a tiny random MuseGlimmerForConditionalGeneration built by transformers and read by
`ports.load_hf` (3 layers: 0 and 1 slide over 5 tokens with rotary positions, 2 is global without; the attention
gate, the post-norms, the soft-cap and its multiplier as the config has them; tied embeddings; later layers
damped), whose greedy AR rows on a ragged batch of 3 are transformers' generate's for each prompt alone. Over it,
Chain and Tree with its one-layer draft (its own first layer), DFlash's chain and DDTree with a head in the
assistant's layout (written by transformers' MuseGlimmerAssistantModel) and a guarded chain give AR's tokens with
drafts accepted; the same on an 8-device mesh (a subprocess); Chain and DFlash on an image batch; and on a
tiny-vocabulary Muse Glimmer target a sampled chain and a sampled DFlash chain draw the target's exact
distribution. The default run decodes Tree, DDTree and the guarded chain here, Chain and DFlash's chain on the
mesh (against the unsharded AR tokens), Chain on images and both sampled strategies; the rest under -m slow."""
import json
import os
import subprocess
import sys
from typing import NamedTuple

import jax
import numpy as np
import pytest
import torch
import transformers

import jspec
import ports
from conftest import hf_greedy, perturb
from jspec.parts.drafters import dflash_io
from qwen3_pairs import MUSE_NAMES, PROMPTS, mesh_names, model_and_block, muse_glimmer_draft
from sampling_check import chi2_pvalue, empirical, exact_joint, noisy_copy, total_variation
from strategies import dflash_head
from test_muse_glimmer import IMAGES, TOP, VISION, left_padded, prompt, tiny_muse
from tolerances import assert_clear_margins

NEW = 16
WINDOW = 6  # the assistant's sliding_window: its block sees context within 6 positions


@pytest.fixture(autouse=True)
def _free_programs_per_test():
    yield
    jax.clear_caches()


def damped_muse(seed: int = 3, damp: float = 0.8):
    """`tiny_muse` with 3 layers and tied embeddings, the post-norm scales (1 + weight) of layers 1 and 2 times
    `damp`: a draft of the first layer agrees with the target often but not always, and the target writes the
    repeats a block drafter's `strategies.dflash_head` guesses, among other tokens."""
    hf = tiny_muse(seed, tie=True, num_hidden_layers=3)
    with torch.no_grad():
        for layer in hf.model.language_model.layers[1:]:
            for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
                norm.weight.copy_((1 + norm.weight) * damp - 1)
    return hf


def write_assistant(head, path: str, window: int = WINDOW) -> str:
    """`head` (a `DFlashHead`) saved by transformers' MuseGlimmerAssistantModel: the assistant's config (sliding
    layers of `window`, its block, mask token and target layer ids) and every tensor of its layout, loaded strictly
    from the head's values."""
    c = head.config
    cfg = transformers.MuseGlimmerAssistantConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps, block_size=head.block, mask_token_id=head.mask_token,
        target_layer_ids=[i - 1 for i in head.target_layers], sliding_window=window,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope.theta})
    model = transformers.MuseGlimmerAssistantModel(cfg).eval()
    names = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
    model.load_state_dict({names.get(k, k): torch.tensor(v) for k, v in dflash_io.state_dict(head).items()},
                          strict=True)
    model.save_pretrained(path)
    return path


class Case(NamedTuple):
    target: object
    draft: object  # the target's first layer (`qwen3_pairs.muse_glimmer_draft`)
    head: object  # a DFlashHead read from the assistant's layout
    ar: np.ndarray  # AR's greedy tokens on PROMPTS
    target_dir: str
    head_dir: str


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The damped target through its checkpoint, its draft, `strategies.dflash_head`'s values in the assistant's
    layout, and AR's tokens on PROMPTS: transformers' generate's for each prompt alone, with clear margins."""
    tmp = tmp_path_factory.mktemp("muse_strategies")
    hf = damped_muse()
    hf.save_pretrained(str(tmp / "target"))
    target = ports.load_hf(str(tmp / "target"))
    cfg = target.config.text
    assert (cfg.full_attention_layers, cfg.nope_layers, cfg.sliding_window, cfg.tie_word_embeddings) == (
        (2,), (2,), 5, True)
    head_dir = write_assistant(dflash_head(target, block=4), str(tmp / "assistant"))
    head = dflash_io.load_head(head_dir, target)
    assert (head.target_layers, head.block, head.config.sliding_window) == ((3,), 4, WINDOW + 1)
    ar = jspec.decode(target, PROMPTS, max_new_tokens=NEW, eos_token_id=()).tokens
    assert_clear_margins(target, PROMPTS, ar)
    for b, p in enumerate(PROMPTS):
        np.testing.assert_array_equal(ar[b], hf_greedy(hf, np.asarray(p), NEW), err_msg=f"row {b}")
    return Case(target, muse_glimmer_draft(target), head, ar, str(tmp / "target"), head_dir)


MESH_COVERED = ("chain", "dflash_chain")  # decoded against AR on the mesh by default (test below)


@pytest.mark.parametrize("name", [n if n not in MESH_COVERED else pytest.param(n, marks=pytest.mark.slow)
                                  for n in MUSE_NAMES])
def test_every_strategy_equals_ar_on_a_ragged_batch(case, name):
    """`qwen3_pairs.model_and_block`'s strategies over the Muse Glimmer target (the Qwen3 targets' settings): Chain
    and Tree with its first layer as the draft, DFlash's chain and DDTree with the assistant-layout head and the
    guarded chain give AR's tokens on the ragged batch, with drafts accepted (Chain and DFlash's chain: by default
    on the mesh below, here under -m slow)."""
    strat = model_and_block(case.draft, case.head)[name]
    out = jspec.decode(case.target, PROMPTS, strategy=strat, max_new_tokens=NEW, eos_token_id=())
    np.testing.assert_array_equal(out.tokens, case.ar)
    assert out.stats["mean_accepted"].max() > 1.0, out.stats["mean_accepted"]


@pytest.mark.parametrize("name", ["chain", pytest.param("dflash_chain", marks=pytest.mark.slow)])
def test_greedy_sd_on_an_image_batch_equals_ar(case, name):
    """A left-padded batch of an image prompt and one with two images (other shapes than the position table): a
    Chain whose draft reads the images through its own tower (the target's), and DFlash's chain over the
    target's states, give AR's tokens with drafts accepted."""
    batch = left_padded([prompt(IMAGES[:1]), prompt(IMAGES, text=(3,))])
    ar = jspec.decode(case.target, batch, max_new_tokens=12, eos_token_id=())
    strat = model_and_block(case.draft, case.head)[name]
    out = jspec.decode(case.target, batch, strategy=strat, max_new_tokens=12, eos_token_id=())
    np.testing.assert_array_equal(out.tokens, ar.tokens)
    assert out.stats["accepted_drafts"].sum() > 0


@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["default", "slow"])
def test_strategies_on_an_8_device_mesh(case, slow):
    """tests/qwen3_sharded_checks.py --muse-glimmer on 8 forced CPU devices: the target's attention gate split by
    query heads over `tensor`, rows over `data`; Chain and DFlash's chain (and under -m slow Tree, DDTree and the
    guarded chain) give the unsharded AR tokens on 4 ragged rows."""
    here = os.path.dirname(__file__)
    script = os.path.join(here, "qwen3_sharded_checks.py")
    proc = subprocess.run([sys.executable, script, "--muse-glimmer", case.target_dir, case.head_dir]
                          + (["--slow"] if slow else []), env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=1200, cwd=os.path.dirname(here))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"placement": 1,
                                                                 "passed": mesh_names(slow, "muse_glimmer")}


# ------------------------------------------------------------------------------------------ exact sampling


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    """(target, draft, the exact joint of 4 tokens after sampling_check.PROMPT) over 6 tokens: a random
    MuseGlimmerForConditionalGeneration with a sliding layer (window 2, rotary positions) and a global one without,
    soft-capped at 3, read through its checkpoint; the draft is the first layer of a noisy copy of it (close
    enough that whole paths are accepted, far enough that every depth rejects)."""
    text = dict(vocab_size=6, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, sliding_window=2, final_logit_softcapping=3.0,
                output_multiplier=0.7, qk_scale_factor=2.5, post_norm_eps=1e-6, bos_token_id=None,
                eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    hf = transformers.MuseGlimmerForConditionalGeneration(
        transformers.MuseGlimmerConfig(text_config=text, vision_config=VISION, **TOP)).eval()
    directory = str(tmp_path_factory.mktemp("muse_v6"))
    perturb(hf, 1, scale=0.4).save_pretrained(directory)
    target = ports.load_hf(directory)
    assert (target.config.text.nope_layers, target.config.text.full_attention_layers) == ((1,), (1,))
    return target, muse_glimmer_draft(noisy_copy(target)), exact_joint(target, 4)


SAMPLED = {"chain": lambda t, d: jspec.Chain(d, gamma=3), "dflash_chain": lambda t, d: jspec.DFlash(dflash_head(t))}


@pytest.mark.parametrize("name", sorted(SAMPLED))
def test_sampling_on_a_muse_glimmer_target_is_exact(tiny_vocab, name):
    """12000 rows sampled at temperature 1, by a chain with the draft and by DFlash's chain (a block of 5 from
    `strategies.dflash_head`, whose logits are the bare LM head while the target's are soft-capped): the first 4
    tokens' joint (3 decided by verification) is the target's, by enumeration over the 6-token vocabulary; both
    rejections at the root and accepted depth-2 paths occur."""
    target, draft, p = tiny_vocab
    counts, out = empirical(target, SAMPLED[name](target, draft), jax.random.key(0), n=4)
    pval, tv = chi2_pvalue(counts, p), total_variation(counts, p)
    first = out.stats["accepted"][:, 0]
    assert (first == 1).mean() > 0.05 and (first >= 3).mean() > 0.01, np.bincount(first)
    assert pval > 1e-3, (pval, tv)
