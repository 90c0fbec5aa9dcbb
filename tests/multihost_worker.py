"""One process of a multi-controller run (tests/multihost.py launches it): `python multihost_worker.py PROCESS_ID
NUM_PROCESSES PORT CASE... [--ckpt DIR] [--bad]`. Joins the others, decodes every case on a (data 2, tensor 4) mesh
over all processes' devices, greedy and sampled, and prints {case: tokens} as JSON on its last line."""
import json
import os
import sys

pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rest = sys.argv[4:]

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=nproc, process_id=pid)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jspec  # noqa: E402
from multihost_cases import run, text_prompts, use_checkpoint  # noqa: E402
from tiny_pairs import tiny_pair  # noqa: E402


def main():
    ckpt = rest[rest.index("--ckpt") + 1] if "--ckpt" in rest else None
    names = [a for a in rest if not a.startswith("--") and a != ckpt]
    assert jax.process_count() == nproc and jax.device_count() == nproc * jax.local_device_count()
    mesh = jspec.make_mesh(data=2, tensor=jax.device_count() // 2)
    if ckpt is not None:
        use_checkpoint(ckpt, mesh)
    res = {}
    if "--bad" in rest:
        res["bad"] = bad_setups(tiny_pair()[0], text_prompts())
    for name in names:
        for sampled in (False, True):
            res[f"{name}/{'sampled' if sampled else 'greedy'}"] = run(name, sampled, mesh)
    print(json.dumps(res), flush=True)


def bad_setups(target, prompts) -> dict:
    errors = {}
    try:
        jspec.make_mesh(data=4, tensor=jax.device_count())
    except ValueError as e:
        errors["mesh"] = str(e)
    mine = [list(p) for p in prompts]
    mine[0] = mine[0] + [int(jax.process_index()) + 1]  # each host a different prompt
    try:
        jspec.decode(target, mine, max_new_tokens=4, mesh=jspec.make_mesh(data=2, tensor=jax.device_count() // 2))
    except ValueError as e:
        errors["prompts"] = str(e)
    return errors


if __name__ == "__main__":
    main()
