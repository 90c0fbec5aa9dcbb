"""The conformance suite: every strategy in tests/strategies.py's registry, proven against the invariants with no
strategy-specific test code (greedy == AR on a ragged batch, each row as if alone; the same on an 8-device mesh;
exact sampling where claimed; no recompilation after warm-up; a clear error for a draft of another vocabulary)."""
import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import jspec
import ports
from jspec import api
from sampling_check import close_pair, exactness, tiny_vocab_pair
from strategies import REGISTRY, mesh_entries
from tiny_pairs import CFG, PROMPTS, tiny_pair
from tolerances import assert_clear_margins

NAMES = sorted(REGISTRY)


def params(names):
    """The names as parameters, variants marked slow (`Entry.slow`)."""
    return [pytest.param(n, marks=pytest.mark.slow) if REGISTRY[n].slow else n for n in names]


@pytest.fixture(scope="module")
def pair():
    return tiny_pair()


@pytest.fixture(autouse=True)
def _free_programs_per_test():
    """Every registered strategy compiles its own programs; kept for the whole module they mapped past the
    kernel's vm.max_map_count (each XLA:CPU executable maps ~1000 regions) and XLA crashed compiling."""
    yield
    jax.clear_caches()


def _eos(target) -> int:
    """Row 0's sixth greedy token: an EOS id that stops row 0 early and no other row."""
    return int(jspec.decode(target, PROMPTS, max_new_tokens=17, eos_token_id=()).tokens[0, 5])


def test_the_shared_inputs_have_clear_greedy_margins(pair):
    """Every greedy choice the registry's exact-equality tests compare (here and on the mesh) wins by a clear
    margin, so that greedy SD == AR is decided by the engine on any CPU, not by float32 rounding of a near-tie."""
    target, _ = pair
    ar = jspec.decode(target, PROMPTS, max_new_tokens=17, eos_token_id=())
    assert assert_clear_margins(target, PROMPTS, ar.tokens) > 1e-4


@pytest.mark.parametrize("name", params(NAMES))
def test_greedy_equals_ar_and_rows_are_independent(pair, name):
    target, draft = pair
    strat = REGISTRY[name].make(target, draft)
    eos = _eos(target)
    ar = jspec.decode(target, PROMPTS, max_new_tokens=17, eos_token_id=(eos,))
    assert ar.lengths[0] == 6 and (ar.lengths[1:] == 17).all()  # finished rows decode beside running ones
    sd = jspec.decode(target, PROMPTS, strategy=strat, max_new_tokens=17, eos_token_id=(eos,))
    np.testing.assert_array_equal(sd.tokens, ar.tokens)
    np.testing.assert_array_equal(sd.lengths, ar.lengths)
    st = sd.stats
    assert np.all(st["mean_accepted"] >= 1.0) and st["mean_accepted"].max() > 1.0
    # per-position acceptance: position d counts the rounds whose accepted path reached draft d, over the rounds
    per, rate = st["accepted_per_position"], st["acceptance_per_position"]
    assert per.shape == rate.shape == (len(PROMPTS), strat.parts().plan.max_depth) and per[:, 0].sum() > 0
    assert (np.diff(per, axis=1) <= 0).all()  # a path that reaches position d reached d - 1
    np.testing.assert_array_equal(per.sum(1), st["accepted_drafts"])
    np.testing.assert_allclose(1.0 + rate.sum(1), st["mean_accepted"], rtol=1e-12)
    for b in (1, 2):
        alone = jspec.decode(target, PROMPTS[b], strategy=strat, max_new_tokens=17, eos_token_id=(eos,))
        np.testing.assert_array_equal(alone.tokens[0], sd.tokens[b])


@pytest.mark.parametrize("name", params(NAMES))
def test_no_recompilation_after_warmup(pair, name):
    target, draft = pair
    eos = (_eos(target),)  # the greedy test's programs: warm-up reads them from the run's compile cache
    jspec.decode(target, PROMPTS, strategy=REGISTRY[name].make(target, draft), max_new_tokens=17, eos_token_id=eos)
    n = api._decode_sd._cache_size(), api._prefill_sd._cache_size()
    rng = np.random.default_rng(0)
    for i in range(2):  # other prompts of the same padded width, another key, the strategy built anew
        jspec.decode(target, [rng.integers(0, 97, len(p)) for p in PROMPTS],
                     strategy=REGISTRY[name].make(target, draft), max_new_tokens=17, eos_token_id=eos,
                     key=jax.random.key(i))
    assert (api._decode_sd._cache_size(), api._prefill_sd._cache_size()) == n


@pytest.mark.parametrize("name", params(n for n in NAMES if REGISTRY[n].separate_draft))
def test_draft_of_another_vocabulary_is_refused(pair, name):
    target, _ = pair
    other = ports.random_model(dataclasses.replace(CFG, vocab_size=50, num_layers=1), key=3)
    with pytest.raises(ValueError, match="vocabularies differ"):
        jspec.decode(target, PROMPTS, strategy=REGISTRY[name].make(target, other), max_new_tokens=4)


DEEPER = {"chain", "tree", "dynamic"}  # tests/test_distributions.py proves these deeper in the default suite


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if REGISTRY[n].slow or n in DEEPER else n
                                  for n in NAMES if REGISTRY[n].exact])
def test_sampling_is_exact(name):
    entry = REGISTRY[name]
    target, draft = close_pair() if entry.target_layers == 1 else tiny_vocab_pair(entry.target_layers)
    kw = {} if entry.sampling_prompt is None else {"prompt": np.asarray(entry.sampling_prompt)}
    pval, tv, out = exactness(target, entry.make(target, draft), n=4, **kw)  # 3 tokens decided by verification
    first = out.stats["accepted"][:, 0]  # tokens the first step committed: 1 a rejection at the root, 3 a depth-2 path
    assert (first == 1).mean() > 0.05 and (first >= 3).mean() > 0.01, np.bincount(first)
    assert pval > 1e-3, (pval, tv)


@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["default", "slow"])
def test_every_strategy_on_an_8_device_mesh(slow):
    """tests/conformance_mesh.py in a subprocess (the device count is fixed when jax is imported): the default
    entries here, the slow ones under -m slow."""
    here = os.path.dirname(__file__)
    proc = subprocess.run([sys.executable, os.path.join(here, "conformance_mesh.py")] + (["--slow"] if slow else []),
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=1200,
                          cwd=os.path.dirname(here))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    want = mesh_entries(slow)
    assert len(want) >= 5
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"passed": want}
