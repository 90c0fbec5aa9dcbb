"""Every registered strategy (tests/strategies.py) decodes on a (data=2, tensor=4) mesh of 8 forced CPU devices to
the tokens of one device. Run by tests/test_conformance.py in a subprocess: the default entries, or with `--slow`
the entries marked slow (and the two tests/sharded_checks.py covers by default); prints {"passed": [names]}."""
import json
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(__file__))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jspec  # noqa: E402
from strategies import REGISTRY, mesh_entries  # noqa: E402
from tiny_pairs import PROMPTS, tiny_pair  # noqa: E402
from tolerances import assert_clear_margins  # noqa: E402


def main():
    assert len(jax.devices()) == 8, jax.devices()
    target, draft = tiny_pair()
    prompts = PROMPTS + [PROMPTS[0][:3]]  # 4 rows: the data axis splits the batch
    mesh = jspec.make_mesh(data=2, tensor=4)
    ar = jspec.decode(target, prompts, max_new_tokens=12, eos_token_id=()).tokens
    assert_clear_margins(target, prompts, ar)  # the exact comparisons below are not decided by rounding
    passed = []
    slow = "--slow" in sys.argv
    for name in mesh_entries(slow):
        strat = REGISTRY[name].make(target, draft)
        out = jspec.decode(target, prompts, strategy=strat, max_new_tokens=12, eos_token_id=(), mesh=mesh)
        assert np.array_equal(out.tokens, ar), name
        passed.append(name)
        jax.clear_caches()
    print(json.dumps({"passed": passed}))


if __name__ == "__main__":
    main()
