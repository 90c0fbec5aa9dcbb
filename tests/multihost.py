"""Multi-controller runs on one machine: N processes of D forced CPU devices each, joined by
`jax.distributed.initialize` over localhost with gloo collectives, each running tests/multihost_worker.py (the same
program on every process, as on the hosts of a TPU slice or a GPU cluster). `launch` returns each process's
result (the JSON of its last stdout line); a failure shows every process's output."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(args: list[str], processes: int = 2, devices: int = 4, timeout: float = 600) -> list[dict]:
    """Run the worker with `args` in `processes` processes of `devices` CPU devices each; [result per process]."""
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                                                      f" --xla_force_host_platform_device_count={devices}").strip())
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_worker.py"), str(i), str(processes),
                               str(port), *args], env=env, cwd=os.path.dirname(HERE), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(processes)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate() for p in procs]
        raise AssertionError("multi-process run timed out\n" + _report(procs, outs))
    if any(p.returncode for p in procs):
        raise AssertionError("a process failed\n" + _report(procs, outs))
    return [json.loads(o[0].strip().splitlines()[-1]) for o in outs]


def _report(procs, outs) -> str:
    return "\n".join(f"--- process {i} (exit {p.returncode})\n{o[0][-3000:]}\n{o[1][-6000:]}"
                     for i, (p, o) in enumerate(zip(procs, outs)))
