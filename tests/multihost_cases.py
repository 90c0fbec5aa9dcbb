"""The strategies a multi-controller run decodes (tests/multihost_worker.py) and the single-process reference
(tests/test_multihost.py) builds alike: name -> make(target, draft)."""
import jax
import numpy as np

import jspec
from strategies import SAGE_SMALL, eesd_head
from tiny_pairs import PROMPTS, tiny_pair

CASES = {
    "ar": lambda t, d: None,
    "chain": lambda t, d: jspec.Chain(d, gamma=3),
    "tree": lambda t, d: jspec.Tree(d, tree=[[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
    "dynamic": lambda t, d: jspec.DynamicTree(d, depth=3, top_k=2, total=5),
    "sage": lambda t, d: jspec.SAGE(d, **SAGE_SMALL),
    "eesd": lambda t, d: jspec.EESD(eesd_head(t), k_max=4),
}
SAMPLED = dict(temperature=1.0, key=jax.random.key(7))


def pair(ckpt=None, mesh=None):
    """(target, draft, prompts): the tiny pair; with `ckpt` the target restored from that `jspec convert` output
    onto `mesh`, each process reading only its shards."""
    target, draft = tiny_pair()
    if ckpt is not None:
        import ports
        from jspec import sharding as SH

        target = ports.load(ckpt, shardings=SH.param_shardings(target, mesh))
    return target, draft, [np.asarray(p) for p in PROMPTS[:2]]
