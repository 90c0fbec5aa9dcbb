"""What a multi-controller run decodes (tests/multihost_worker.py), and the single-process reference
(tests/test_multihost.py) alike: `run(name, sampled, mesh)` -> tokens. Text strategies over the tiny pair, TABED
and SpecVLM over a tiny LLaVA pair with images, LANTERN++ through `generate_image` over a tiny Chameleon pair."""
import functools

import jax
import numpy as np

import jspec
from strategies import SAGE_SMALL, eesd_head
from tiny_pairs import PROMPTS, tiny_pair

TEXT = {
    "ar": lambda t, d: None,
    "chain": lambda t, d: jspec.Chain(d, gamma=3),
    "tree": lambda t, d: jspec.Tree(d, tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
    "dynamic": lambda t, d: jspec.DynamicTree(d, depth=3, top_k=2, total=5),
    "sage": lambda t, d: jspec.SAGE(d, **SAGE_SMALL),
    "eesd": lambda t, d: jspec.EESD(eesd_head(t), k_max=4),
}
VLM = {
    "tabed": lambda d: jspec.TABED(d, views=("M", "T", "P"), weights=(0.2, 0.5, 0.3), newline_id=3, gamma=3),
    "specvlm": lambda d: jspec.SpecVLM(d, ratio=0.5, modality="image", tree=[[0], [1], [0, 0], [0, 0, 0]]),
}
NAMES = (*TEXT, *VLM, "lantern", "zoo_specvlm_video", "zoo_tabed_image", "zoo_lantern_t2i")
_target = {"text": None}


def key():
    return jax.random.key(7)


def text_prompts():
    return [np.asarray(p) for p in PROMPTS[:2]]


def use_checkpoint(ckpt: str, mesh) -> None:
    """The text cases' target from now on: restored from `ckpt` (a `jspec convert` output) onto `mesh`, each
    process reading only its shards."""
    import ports
    from jspec.core import sharding as SH

    _target["text"] = ports.load(ckpt, shardings=SH.param_shardings(tiny_pair()[0], mesh))


@functools.lru_cache(maxsize=None)
def vlm_pair():
    from sampling_check import IMAGE_PROMPT, PIXELS, tiny_llava

    pix = np.concatenate([PIXELS, np.random.default_rng(1).normal(size=PIXELS.shape).astype(np.float32)])
    return tiny_llava(10, 0.4), tiny_llava(11, 0.6), {"input_ids": np.tile(IMAGE_PROMPT, (2, 1)),
                                                      "pixel_values": pix}


@functools.lru_cache(maxsize=None)
def t2i_pair():
    from jspec.parts.neighbours import NeighbourTable
    from ports.families import vqgan as VQ
    from sampling_check import tiny_chameleon

    target = tiny_chameleon(0, 0.15)
    draft = tiny_chameleon(1, 0.3, hidden_size=16, num_hidden_layers=1)
    table = NeighbourTable.for_chameleon(target.config, VQ.codebook(target.params["vqmodel"]), 3)
    return target, draft, table


def zoo_case(name: str):
    """(target, prompt, strategy) of the zoo's video pair under SpecVLM or its image pair under TABED."""
    from jspec.tools import zoo
    from jspec.tools.zoo import evaluate as ZE

    if name == "zoo_specvlm_video":
        from jspec.tools.zoo import video as ZV

        target, draft = zoo.load("video-target"), zoo.load("video-draft")
        return target, ZV.VideoEncoder().prompts(ZV.eval_set(2, tasks=("video_describe",))), jspec.SpecVLM(
            draft, ratio=0.8, tree="chain5")
    pair = ZE.load_pair("image")
    exs = ZE.scenario_examples("image", 2)
    prompt = ZE.batch_prompt(pair.encoder, [exs["caption"][0], exs["vqa"][1]])
    return pair.target, prompt, jspec.TABED(pair.draft, newline_id=204, gamma=3)


def run(name: str, sampled: bool, mesh=None) -> list:
    """The tokens case `name` decodes (10 new tokens; an image of 2 x 2 codes), greedy or sampled (key 7)."""
    kw = dict(temperature=1.0, key=key()) if sampled else {}
    if name in TEXT:
        target, draft = tiny_pair()
        target = _target["text"] or target
        return jspec.decode(target, text_prompts(), TEXT[name](target, draft), max_new_tokens=10, eos_token_id=(),
                            mesh=mesh, **kw).tokens.tolist()
    if name == "zoo_lantern_t2i":  # the zoo's text-to-image pair: LANTERN++ with its EAGLE head
        from jspec.parts.drafters import eagle_io as IO
        from jspec.tools.zoo import t2i as T

        target = T.load_target()
        head, table = IO.load_drafter(str(T.weights_dir("t2i-eagle")), target)
        caps = [T.caption_ids(T.caption(T.scene("heldout", i))) for i in range(2)]
        out = jspec.generate_image(target, caps, T.GRID, T.GRID, strategy=jspec.LanternPP(head, table, k=10, lam=3.0),
                                   image_prefix_ids=T.image_prefix(), top_k=128, mesh=mesh,
                                   **(kw or dict(temperature=0.0)))
        return out.tokens.tolist()
    if name.startswith("zoo_"):
        target, prompt, strat = zoo_case(name)
        return jspec.decode(target, prompt, strat, max_new_tokens=10, eos_token_id=(), mesh=mesh,
                            **kw).tokens.tolist()
    if name in VLM:
        target, draft, prompt = vlm_pair()
        return jspec.decode(target, prompt, VLM[name](draft), max_new_tokens=10, eos_token_id=(), mesh=mesh,
                            **kw).tokens.tolist()
    target, draft, table = t2i_pair()
    strat = jspec.LanternPP(draft, table=table, k=3, lam=3.0, tree=[[0], [1], [0, 0]])
    out = jspec.generate_image(target, [[9, 12, 30], [11, 9, 12]], 2, 2, strategy=strat, top_k=20, mesh=mesh,
                               image_prefix_ids=[4, 8, 8], **(kw or dict(temperature=0.0)))
    return out.tokens.tolist()
