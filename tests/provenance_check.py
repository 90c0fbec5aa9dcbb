"""What every result file must say about where it ran (jspec.core.provenance)."""
import re

KEYS = ("date", "commit", "python", "versions", "backend", "device_model", "device_count", "cpu", "cores",
        "load_avg", "env")


def assert_provenance(p: dict) -> None:
    """`p` names the machine (the CPU's model and vector extensions), the versions, the switches and the code."""
    missing = [k for k in KEYS if k not in p]
    assert not missing, f"provenance lacks {missing}: {p}"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", p["date"]), p["date"]
    assert re.fullmatch(r"[0-9a-f]{40}", p["commit"]) and isinstance(p["dirty"], bool)
    assert p["versions"]["jax"] and p["versions"]["jaxlib"]
    assert p["device_model"].startswith(p["backend"]) and p["cpu"]["name"] in p["device_model"]
    assert p["cores"] >= 1 and p["device_count"] >= 1 and isinstance(p["env"], dict)
