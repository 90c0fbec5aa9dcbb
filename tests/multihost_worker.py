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
    hf_dir = rest[rest.index("--hf") + 1] if "--hf" in rest else None
    names = [a for a in rest if not a.startswith("--") and a not in (ckpt, hf_dir)]
    assert jax.process_count() == nproc and jax.device_count() == nproc * jax.local_device_count()
    mesh = jspec.make_mesh(data=2, tensor=jax.device_count() // 2)
    if ckpt is not None:
        use_checkpoint(ckpt, mesh)
    res = {}
    if ckpt is not None and hf_dir is not None:
        res["local"] = local_loads(ckpt, hf_dir)
    if "--bad" in rest:
        res["bad"] = bad_setups(tiny_pair()[0], text_prompts())
    for name in names:
        for sampled in (False, True):
            res[f"{name}/{'sampled' if sampled else 'greedy'}"] = run(name, sampled, mesh)
    print(json.dumps(res), flush=True)


def local_loads(ckpt: str, hf_dir: str) -> dict:
    """Each process loads the whole model onto one of its own devices, with no shardings given (`ports.load` of a
    `jspec convert` output, `ports.load_hf` of an HF directory), and decodes alone: {loader: tokens}."""
    import ports

    out = {}
    for name, model in (("load", ports.load(ckpt)), ("load_hf", ports.load_hf(hf_dir))):
        leaf = jax.tree.leaves(model.params)[0]
        assert leaf.is_fully_addressable and leaf.devices() <= set(jax.local_devices()), name
        out[name] = jspec.decode(model, text_prompts(), max_new_tokens=6, eos_token_id=()).tokens.tolist()
    return out


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
