"""Multi-controller decoding: two processes of 4 CPU devices each (jax.distributed over localhost, gloo) decode
on a (data 2, tensor 4) mesh spanning both, every process passing the same prompts and getting the same tokens as
one process decoding alone, greedy and sampled; a target restored from a `jspec convert` checkpoint onto that mesh
(each process reading its shards) too; every process loading the whole model without shardings (`ports.load`,
`ports.load_hf`: onto a device of its own) decodes as one process alone; a mesh larger than the devices and hosts
passing different prompts are clear errors. AR and Chain by default; Tree, SAGE, EESD, DynamicTree, TABED and SpecVLM (image prompts) and
LANTERN++ through generate_image under -m slow, and SpecVLM on the zoo's video pair, TABED on its image pair and
LANTERN++ (its EAGLE head) on its text-to-image pair."""
import pytest

import ports
from multihost import launch
from multihost_cases import run
from tiny_pairs import tiny_pair

DEFAULT = ["ar", "chain"]
SLOW = ["tree", "sage", "eesd", "dynamic", "tabed", "specvlm", "lantern", "zoo_specvlm_video", "zoo_tabed_image", "zoo_lantern_t2i"]


def _single(names):
    return {f"{n}/{label}": run(n, label == "sampled") for n in names for label in ("greedy", "sampled")}


@pytest.mark.parametrize("names", [DEFAULT, pytest.param(SLOW, marks=pytest.mark.slow)],
                         ids=["default", "slow"])
def test_two_processes_decode_the_tokens_of_one(names, tmp_path):
    ckpt = hf = None
    if names == DEFAULT:
        ckpt, hf = str(tmp_path / "ckpt"), str(tmp_path / "hf")
        ports.save(tiny_pair()[0], ckpt)  # what `jspec convert` writes
        ports.save_hf(tiny_pair()[0], hf)
    results = launch(names + (["--ckpt", ckpt, "--hf", hf, "--bad"] if ckpt else []), timeout=900)
    bad = [r.pop("bad", None) for r in results]
    local = [r.pop("local", None) for r in results]
    if ckpt:  # each process loads the whole model without shardings, onto its own device, and decodes alone
        import jspec
        from multihost_cases import text_prompts

        alone = jspec.decode(tiny_pair()[0], text_prompts(), max_new_tokens=6, eos_token_id=()).tokens.tolist()
        assert local[0] == local[1] == {"load": alone, "load_hf": alone}
    assert results[0] == results[1]  # every process gets the whole output
    assert results[0] == _single(names)
    if ckpt:
        for i, b in enumerate(bad):
            assert b["mesh"] == "mesh data=4 x fsdp=1 x expert=1 x tensor=8 needs 32 devices; 8 available"
            assert b["prompts"].startswith(f"the processes passed different prompts (process {i} of 2)")
