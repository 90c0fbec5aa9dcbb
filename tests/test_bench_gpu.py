"""`jspec bench gpu`: the dry run of every step (the plan's budgets, the results file rewritten after each step, the
summary's arithmetic against the parts it records), the runner keeping what a failing or hanging step measured and
going on, and the pure helpers (interpolation, prediction, near-tie verdicts, the papers' shapes)."""
import json
import os
import time

import jax
import pytest

from jspec.tools.bench import gpu as BG
from jspec.tools import cli

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------------------------------------ the plan


def test_the_plan_fits_one_device_command():
    assert sum(s.budget_s for s in BG.STEPS) <= BG.BUDGET_TOTAL_S == 540
    assert [s.name for s in BG.STEPS] == ["attention", "ar-7b", "methods", "paper", "long", "train"]
    assert [s.name for s in BG.select("paper,1")] == ["attention", "paper"]  # the plan's order, numbers or names
    for bad in ("7", "nope"):
        with pytest.raises(ValueError, match="unknown step"):
            BG.select(bad)
    with pytest.raises(SystemExit, match="unknown step"):
        cli.main(["bench", "gpu", "--steps", "0"])
    with pytest.raises(SystemExit, match="unknown pair"):
        cli.main(["bench", "gpu", "--pair", "zoo nope"])
    if jax.default_backend() == "cpu":  # without --dry-run the steps refuse a CPU
        with pytest.raises(SystemExit, match="need a GPU"):
            cli.main(["bench", "gpu", "--steps", "2"])


# ------------------------------------------------------------------------------------------------ the runner

# steps for the runner test: the step process imports them from this module (PYTHONPATH=tests)


def fake_ok(rec):
    rec.add("rows", {"x": 1})
    rec.put(headline="one row")


def fake_raises(rec):
    rec.add("rows", {"x": 2})
    raise RuntimeError("boom")


def fake_hangs(rec):
    rec.add("rows", {"x": 3})
    time.sleep(120)


def fake_after(rec):
    rec.put(headline="ran after the hang")


@pytest.mark.slow
def test_a_failing_or_hanging_step_loses_only_itself(tmp_path):
    steps = [BG.Step(n, budget, f"test_bench_gpu:fake_{n}", n) for n, budget in  # the hang first: nothing carried
             (("hangs", 8), ("ok", 60), ("raises", 60), ("after", 60))]
    snaps = []
    t0 = time.time()
    res = BG.run(steps, str(tmp_path), env={"PYTHONPATH": HERE},
                 after_step=lambda name, files: snaps.append((name, json.load(open(files[0])))))
    st = res["steps"]
    assert {n: s["status"] for n, s in st.items()} == {"hangs": "timed out", "ok": "ok", "raises": "failed",
                                                      "after": "ok"}
    assert "RuntimeError: boom" in st["raises"]["error"]
    assert st["raises"]["tables"]["rows"] == [{"x": 2}] and st["hangs"]["tables"]["rows"] == [{"x": 3}]
    assert st["hangs"]["seconds"] < 8 + 2 and time.time() - t0 < 60  # killed at its budget
    assert st["after"]["headline"] == "ran after the hang"
    # the file is rewritten after each step, holding every step so far
    assert [n for n, _ in snaps] == ["hangs", "ok", "raises", "after"]
    for i, (_, snap) in enumerate(snaps):
        assert list(snap["steps"]) == ["hangs", "ok", "raises", "after"][:i + 1]
    md = open(res["files"][1]).read()
    assert "timed out" in md and "boom" in md and "ran after the hang" in md
    # a second call the same day adds to the first: its steps rerun, the others kept as they were
    again = BG.run([steps[1]], str(tmp_path), isolate=False)
    assert {n: (s["status"], s.get("earlier", False)) for n, s in again["steps"].items()} == {
        "hangs": ("timed out", True), "ok": ("ok", False), "raises": ("failed", True), "after": ("ok", True)}
    assert sorted(p["name"] for p in again["plan"]) == ["after", "hangs", "ok", "raises"]
    assert "timed out (earlier call)" in open(again["files"][1]).read()
    assert [c["steps"] for c in again["meta"]["calls"]] == [["hangs", "ok", "raises", "after"], ["ok"]]


def fake_left(rec):
    rec.put(left=rec.left())


def test_unspent_budget_passes_to_the_next_steps(tmp_path):
    """A step that ends early hands its time on: the next step's deadline is the plan's cumulative one, so the
    whole run stays within the budgets' sum."""
    steps = [BG.Step("quick", 20, "test_bench_gpu:fake_after", "quick"),
             BG.Step("left", 2, "test_bench_gpu:fake_left", "left")]
    res = BG.run(steps, str(tmp_path), isolate=False)
    st = res["steps"]
    assert st["quick"]["budget_s"] == 20 and 18 < st["left"]["budget_s"] <= 22
    assert 15 < st["left"]["left"] <= 22 - BG.MARGIN_S  # the step saw the carried time as its own


def test_a_later_call_keeps_the_earlier_pairs_and_predicts_again():
    """Step 3 rerun for some pairs keeps the earlier call's rows of the others (marked), their notes and skips, and
    an earlier paper step's predictions are made again from its recorded costs with the merged taus."""
    earlier = {"plan": [{"step": 3, "name": "methods"}, {"step": 4, "name": "paper"}], "steps": {
        "methods": {"status": "partial", "tables": {"rows": [
            {"pair": "zoo text", "strategy": "AR", "tau": 1.0, "wall_speedup": 1.0},
            {"pair": "zoo text", "strategy": "Chain g=5", "tau": 4.75, "wall_speedup": 0.77}]},
            "notes": ["SmolLM2-135M-Instruct: not run (ImportError: x)"],
            "skipped": ["zoo text: DynamicTree 6x10/60", "pair zoo image"]},
        "paper": {"status": "partial", "tables": {"costs": [
            {"shape": "llama-2-7b", "k": 1, "ms": 4.0}, {"shape": "llama-2-7b", "k": 6, "ms": 4.4},
            {"shape": "llama-68m x2", "k": 1, "ms": 0.1}, {"shape": "llama-68m", "k": 1, "ms": 0.15}]}}}}
    result = {"meta": {"dry_run": True}, "plan": [{"step": 3, "name": "methods"}], "steps": {
        "methods": {"status": "ok", "tables": {"rows": [
            {"pair": "zoo image", "strategy": "AR", "tau": 1.0, "wall_speedup": 1.0},
            {"pair": "zoo image", "strategy": "TABED MT*", "tau": 2.25, "wall_speedup": 0.5}]},
            "notes": [], "skipped": []}}}
    BG.merge_earlier(result, earlier)
    m, p = result["steps"]["methods"], result["steps"]["paper"]
    assert [(r["pair"], r["strategy"], r.get("call")) for r in m["tables"]["rows"]] == [
        ("zoo text", "AR", "earlier"), ("zoo text", "Chain g=5", "earlier"), ("zoo image", "AR", None),
        ("zoo image", "TABED MT*", None)]
    assert m["notes"] == ["SmolLM2-135M-Instruct: not run (ImportError: x)"]
    assert m["skipped"] == ["zoo text: DynamicTree 6x10/60"]  # zoo image was measured now
    assert "4 rows" in m["headline"] and "zoo text Chain g=5 0.77x" in m["headline"]
    assert p["earlier"] and p["repredicted"]
    tabed = next(r for r in p["tables"]["methods"] if r["method"] == "TABED MT*")
    assert tabed["tau"] == 2.25 and tabed["predicted"] == pytest.approx(2.25 * 4.0 / (4.4 + 5 * 0.1), rel=1e-2)
    BG.merge_earlier(result, earlier)  # idempotent
    assert len(m["tables"]["rows"]) == 4


# ------------------------------------------------------------------------------------------------ the dry run


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-dry")
    snaps = []
    res = BG.run(None, str(out), dry_run=True, isolate=False,
                 after_step=lambda name, files: snaps.append((name, json.load(open(files[0])))))
    return res, snaps


def test_dry_run_runs_every_step_and_writes_as_it_goes(dry, capsys):
    res, snaps = dry
    names = [s.name for s in BG.STEPS]
    assert {n: s["status"] for n, s in res["steps"].items()} == dict.fromkeys(names, "ok")
    assert [n for n, _ in snaps] == names
    for i, (_, snap) in enumerate(snaps):
        assert list(snap["steps"]) == names[:i + 1]
    assert [p["budget_s"] for p in res["plan"]] == [s.budget_s for s in BG.STEPS]
    assert all(os.path.basename(f).startswith("gpu-dry-") for f in res["files"])
    assert [os.path.splitext(f)[1] for f in res["files"]] == [".json", ".md", ".png"]
    md = open(res["files"][1]).read()
    for p in res["plan"]:
        assert f"## {p['step']}. {p['name']}" in md
    # every step measured something
    for n in names:
        assert res["steps"][n].get("tables") and res["steps"][n].get("headline"), n


def test_dry_run_numbers_agree_with_their_parts(dry):
    steps = dry[0]["steps"]
    close = lambda a, b, rel=2e-2: a == pytest.approx(b, rel=rel, abs=2e-3)  # noqa: E731 (parts are rounded)
    # step 2: time per token against the HBM floor
    for r in steps["ar-7b"]["tables"]["rows"]:  # both ms are rounded to 3 decimals: the tiny floor's by up to 3%
        ms, floor = r["ms_per_token"], r["floor_ms_per_token"]
        assert close(r["x_floor"], ms / floor, rel=2e-2 + 5e-4 / floor + 5e-4 / ms)
    # step 3: AR is the baseline of its pair; tau, speedups present; greedy rows equal AR's
    rows = steps["methods"]["tables"]["rows"]
    assert {r["pair"].split(" (")[0] for r in rows} == {"SmolLM2-135M-Instruct", "random damped 7B"}
    for r in rows:
        assert r["tau"] >= 1.0 and r["equal_to_ar"] == "1/1" and r["verdict"] == "equal"
        if r["strategy"] == "AR":
            assert r["tau"] == 1.0 and r["wall_speedup"] == 1.0
    # step 4: each verify / draft cost in AR steps of its shape; predictions from the recorded parts
    costs = steps["paper"]["tables"]["costs"]
    ar = {r["shape"]: r["ms"] for r in costs if r["k"] == 1}
    for r in costs:
        assert close(r["over_ar"], r["ms"] / ar[r["shape"]])
    by = {(r["pair"].split(" (")[0], r["strategy"]): r for r in rows}
    methods = steps["paper"]["tables"]["methods"]
    assert {m[0] for m in BG.METHODS} == {r["method"] for r in methods}
    measured = [r for r in methods if r["tau"] is not None]
    assert {r["method"] for r in measured} == {"PromptLookup g=10", "Chain g=5, damped pair"}
    assert {r["tau_source"] for r in measured} == {"this run"}
    for r in methods:
        parts = r["ar_ms"] / (r["verify_ms"] + r["draft_ms"])
        if r["tau"] is not None:
            pair, strategy = r["tau_from"].split(": ")
            assert r["tau"] == by[(pair, strategy)]["tau"]
            assert close(r["predicted"], r["tau"] * parts)
        if r["paper_tau"] is not None:
            assert close(r["predicted_paper_tau"], r["paper_tau"] * parts)
            assert close(r["paper_over_predicted"], r["paper_speedup"] / r["predicted_paper_tau"])
    damped = next(r for r in methods if r["method"] == "Chain g=5, damped pair")
    assert close(damped["measured_over_predicted"], damped["measured_decode_speedup"] / damped["predicted"])
    assert damped["measured_decode_speedup"] == by[("random damped 7B", "Chain g=5")]["decode_speedup"]
    # step 1: the fused path (XLA's, standing in for cuDNN's) agrees with the blockwise pass
    att = steps["attention"]["tables"]["attention"]
    assert att and all(a["agree"] and a["implementation"] == "xla" for a in att)
    assert {r["compile_ahead"] for r in steps["attention"]["tables"]["first_decode"]} == {True, False}
    # steps 5 and 6: every point finished
    assert all(r.get("seconds") and "error" not in r for r in steps["long"]["tables"]["rows"])
    assert all(r["step_s"] > 0 for r in steps["train"]["tables"]["rows"])


# ------------------------------------------------------------------------------------------------ helpers


def test_interpolate_and_predict():
    pts = {1: 1.0, 8: 2.0, 64: 6.0}
    assert BG.interpolate(pts, 8) == 2.0
    assert BG.interpolate(pts, 4) == pytest.approx(1.0 + 3 / 7)
    assert BG.interpolate(pts, 36) == pytest.approx(4.0)
    assert BG.interpolate(pts, 72) == pytest.approx(6.0 + 8 * 4 / 56)  # the last segment's slope
    assert BG.interpolate({1: 1.0}, 6) is None and BG.interpolate({1: 1.0}, 1) == 1.0
    assert BG.predict(3.0, 10.0, 12.0, 3.0) == pytest.approx(2.0)
    assert BG.predict(None, 10.0, 12.0, 3.0) is None


def test_near_tie_verdicts():
    tie = {"ref_gap_bf16_ulps": 0.8, "margin_bf16_ulps": 0.8}
    assert BG.tie_verdict([tie, dict(tie, ref_gap_bf16_ulps=3.5)]).startswith("near-tie (2 rows")
    assert BG.tie_verdict([tie, dict(tie, ref_gap_bf16_ulps=40.0)]).startswith("DIFFERS (1 of 2")
    assert BG.tie_verdict([{"position": 3, "note": "margin not measured"}]).startswith("DIFFERS")


def test_a_diverging_row_is_measured_at_its_first_divergence():
    """The reference forward of a tiny model: where a row leaves AR's, the gap between the two tokens' logits (a
    token far from the top is no near-tie; the runner-up is, when its logit is within a few ulps)."""
    import jax.numpy as jnp
    import numpy as np

    from jspec.tools.bench import zoo as BENCH
    import ports

    target, _ = BENCH.damped_pair(layers=2, vocab=64, hidden=32, mlp=64, heads=4, dtype=jnp.float32)
    prompt = np.arange(3, 11, dtype=np.int32)
    ar = np.asarray([5, 9, 2, 7])
    logits = np.asarray(ports.logits(target, np.concatenate([prompt, ar[:2]])[None]))[0, -1]
    order = np.argsort(-logits)
    far = ar.copy()
    far[2] = order[-1]  # the least likely token
    rec = BG.near_tie(target, prompt, ar, far)
    assert rec["position"] == 2 and rec["ar_token"] == 2 and rec["sd_token"] == int(order[-1])
    gap = abs(logits[2] - logits[order[-1]]) / float(BG._numerics().bf16_resolution(logits[order[0]]))
    assert rec["ref_gap_bf16_ulps"] == pytest.approx(gap, rel=1e-3)
    assert BG.tie_verdict([rec]).startswith("DIFFERS")
    assert BG.near_tie(target, prompt, ar, ar[:3])["note"] == "one row is a prefix of the other"


def test_the_papers_shapes():
    params = {name: BG.text_config(sp["config"], **sp.get("over", {})).num_params / 1e9
              for name, sp in BG.SHAPES.items()}
    assert params["llama-2-7b"] == pytest.approx(6.74, abs=0.01)
    assert params["llama-2-13b"] == pytest.approx(13.02, abs=0.01)
    assert params["llama-68m"] == pytest.approx(0.068, abs=0.001)
    assert params["qwen2.5-vl-7b"] == pytest.approx(7.6, abs=0.1)  # its language model
    assert params["qwen2.5-vl-3b"] == pytest.approx(3.1, abs=0.1)
    assert params["lumina-mgpt-7b"] == pytest.approx(7.0, abs=0.05)
    assert BG.text_config("llama-2-13b", num_hidden_layers=4).num_layers == 4
    # a static tree's draft forwards: the root, then every level but the last; a chain's: gamma of 1 token
    levels = BG.tree_levels("mc_sim_7b_63")
    assert levels[0] == 1 and len(levels) >= 3 and sum(levels) < 63
    assert BG.drafting([("llama-68m", 1)] * 5, None) == [("llama-68m", 1, 1.0)] * 5
    assert BG.drafting("eesd draft", 3.5) == [("eesd draft", 1, 3.5)]
    probes = BG.probes()
    assert probes[0] == ("llama-2-7b", 1) and len(probes) == len(set(probes))
    assert {("qwen2.5-vl-7b", 65), ("lumina-mgpt-7b", 58), ("llama-2-13b", 11)} <= set(probes)
