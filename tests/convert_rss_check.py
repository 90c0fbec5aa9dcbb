"""Run by tests/test_conversion.py in a fresh process: stream-convert an HF checkpoint and report peak RSS growth.

Prints one JSON line: the resident set size before `ports.convert_hf` and its peak during it (bytes), after a
warm-up save that loads orbax's machinery; the peak is reset first (Linux `clear_refs` 5) so that imports and the
warm-up do not mask the conversion."""
import json
import os
import sys
import tempfile

import numpy as np

import ports


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main(hf_dir: str, out_dir: str) -> None:
    with tempfile.TemporaryDirectory() as d:  # warm-up: orbax, tensorstore and their threads
        ports.io.checkpoint.orbax_save(os.path.join(d, "warm"), {"x": np.zeros((256, 256), np.float32)})
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current RSS
    base = status_kb("VmRSS")
    cfg, n = ports.convert_hf(hf_dir, out_dir)
    print(json.dumps({"baseline": base, "peak": status_kb("VmHWM"), "params": int(n)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
