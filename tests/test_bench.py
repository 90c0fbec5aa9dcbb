"""The benchmark harness in --quick mode: every suite writes JSON + markdown (+ PNG with matplotlib) whose schema
holds and whose speed ratios are finite and positive. Speeds themselves are never asserted. Also: the transformers
baselines on the zoo image pair give jspec's tokens."""
import json
import math

import numpy as np
import pytest

from jspec.tools.bench import zoo as bench
from jspec.tools import cli
from provenance_check import assert_provenance


def finite_positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow  # a benchmark run
def test_quick_sd_suite_schema_and_ratios(tmp_path, capsys):
    assert cli.main(["bench", "sd", "--quick", "--runs", "1", "--out", str(tmp_path)]) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    stem = [f for f in files if f.endswith(".json")][0][:-5]
    assert stem.startswith("sd-quick-") and f"{stem}.md" in files
    res = json.loads((tmp_path / f"{stem}.json").read_text())
    assert res["meta"]["suite"] == "sd" and res["meta"]["quick"] is True and res["meta"]["runs"] == 1
    names = [r["strategy"] for r in res["rows"]]
    assert names[0] == "AR" and any(n.startswith("Chain") for n in names) and any(n.startswith("Tree") for n in names)
    assert any(n.startswith("DynamicTree") for n in names)
    ar_agreed = res["rows"][0]["tokens_before_divergence"]
    for r in res["rows"]:
        assert r["same_tokens_as_ar"] is True and r["tokens_before_divergence"] == ar_agreed > 0
        for k in ("mean_accepted", "block_efficiency", "tok_s", "wall_speedup", "decode_speedup"):
            assert finite_positive(r[k]), (r["strategy"], k, r[k])
        keys = ("step_ms", "loop_step_ms") if r["strategy"] == "AR" else (
            "predicted_speedup", "measured_over_predicted", "step_ms", "loop_step_ms", "predicted_from_phases",
            "step_over_phases")
        for k in keys:
            assert finite_positive(r[k]), (r["strategy"], k, r[k])
        if r["strategy"] != "AR":                   # one phase's slope may clamp to 0 on a tiny model, never both
            assert all(math.isfinite(r[k]) and r[k] >= 0 for k in ("draft_ms", "verify_ms"))
            assert r["draft_ms"] + r["verify_ms"] > 0
    assert res["rows"][0]["wall_speedup"] == 1.0
    chains = [r for r in res["transformers"] if "assisted" in r["strategy"]]
    assert chains and all(finite_positive(r["jspec_over_transformers"]) and r["same_tokens_as_jspec"]
                          for r in res["transformers"])
    md = (tmp_path / f"{stem}.md").read_text()
    assert "| strategy |" in md and "Chain g=3" in md and "Chain g=3" in capsys.readouterr().out


def test_quick_ar_suite_schema_and_ratios(tmp_path):
    res = bench.run("ar", runs=1, quick=True, out_dir=str(tmp_path), progress=False)
    assert {r["batch"] for r in res["rows"]} == {1, 2}
    written = json.loads(open(res["files"][0]).read())  # the result file records where and how it ran
    assert_provenance(written["meta"]["provenance"])
    assert written["meta"]["device"] == written["meta"]["provenance"]["device_model"]
    for r in res["rows"]:
        assert r["same_tokens"] is True
        assert finite_positive(r["jspec_over_transformers"]) and finite_positive(r["jspec_tok_s"])


@pytest.mark.slow  # a benchmark run
def test_gpu_suite_refuses_cpu_then_dry_runs_and_bad_input(tmp_path):
    with pytest.raises(RuntimeError, match="GPU"):
        bench.run("gpu", runs=1, quick=True, out_dir=str(tmp_path))
    # each part once (a full dry run is their union): the AR part alone, then the SD part alone
    res = bench.run("gpu", runs=1, quick=True, out_dir=str(tmp_path), progress=False, allow_cpu=True, pairs=("ar",))
    assert finite_positive(res["bandwidth_gbs"]) and res["meta"]["suite"] == "gpu"
    assert res["rows"] and not res["sd"] and not res["transformers"]  # no bf16 transformers baseline on a CPU
    for r in res["rows"]:
        assert finite_positive(r["x_floor"]) and finite_positive(r["floor_ms_per_token"])
    part = bench.run("gpu", runs=1, quick=True, out_dir=str(tmp_path), progress=False, allow_cpu=True,
                     pairs=("random damped 7B",))
    assert not part["rows"] and part["sd"] and not part["transformers"]
    sd = {r["strategy"]: r for r in part["sd"]}
    assert set(sd) >= {"AR", "Chain g=3"} and all(r["pair"] == "random damped 7B" for r in part["sd"])
    assert all(r["same_tokens_as_ar"] and finite_positive(r["wall_speedup"]) for r in part["sd"])
    assert any(f.endswith("-sd.png") for f in part["files"])
    with pytest.raises(ValueError, match="unknown part"):
        bench.run("gpu", runs=1, quick=True, out_dir=str(tmp_path), allow_cpu=True, pairs=("nope",))
    with pytest.raises(ValueError, match="ar, sd, gpu"):
        bench.run("nope", out_dir=str(tmp_path))
    with pytest.raises(ValueError, match="pairs of the sd suite"):
        bench.run("ar", out_dir=str(tmp_path), pairs=("zoo text",))
    with pytest.raises(ValueError, match="unknown pair"):
        bench.run("sd", runs=1, quick=True, out_dir=str(tmp_path), pairs=("nope",))


def test_transformers_baselines_read_image_prompts(tmp_path):
    """The sd suite's transformers rows on the zoo image pair: the LLaVA checkpoints load as transformers' image
    class, the prompt's pixel_values (two images) reach `generate`, and plain and assisted generation both give
    jspec's greedy tokens. (Assisted generation is lossless, so equal tokens do not show that the assistant read the
    images; transformers copies every model kwarg, pixel_values included, to the assistant.)"""
    import jspec
    from jspec.tools.zoo import evaluate as ZE

    pair = ZE.load_pair("image")
    prompt = pair.encoder.prompt(ZE.scenario_examples("image", 1)["two_image"][0])
    assert prompt["pixel_values"].shape[0] == 2
    want = jspec.decode(pair.target, prompt, max_new_tokens=24)
    want = want.tokens[0, :want.lengths[0]]
    bench._WORKDIR.append(str(tmp_path))
    try:
        hf_t, hf_d = bench._hf_from(pair.target, "t"), bench._hf_from(pair.draft, "d")
    finally:
        bench._WORKDIR.pop()
    assert type(hf_t).__name__ == "LlavaForConditionalGeneration"
    eos = tuple(pair.target.config.eos_token_ids)
    [plain] = bench._hf_generate(hf_t, [prompt], 24, eos=eos)
    [assisted] = bench._hf_generate(hf_t, [prompt], 24, hf_d, 3, eos)
    np.testing.assert_array_equal(plain, want)
    np.testing.assert_array_equal(assisted, want)


@pytest.mark.slow  # four fresh processes, each building a 110M model
def test_long_prompt_bench_writes_its_table(tmp_path, capsys):
    """`jspec bench long`: jspec and transformers at two lengths in fresh processes, medians of the runs, the
    ratio column, the JSON's device and model; with --compile-cache, jspec again from a warm persistent compilation
    cache, with --warm both libraries' second calls; bad options exit with a message; a video prompt on a tiny
    Qwen2.5-VL (16 frames of 4 x 8 patches: 4 tokens per two frames)."""
    out = tmp_path / "long"
    assert cli.main(["bench", "long", "--lengths", "16", "1100", "--runs", "1", "--compile-cache", "--warm",
                     "--out", str(out)]) == 0
    res = json.loads(out.with_suffix(".json").read_text())
    assert [r["tokens"] for r in res["rows"]] == [16, 1100]
    assert res["meta"]["model"] == "110m" and res["meta"]["dtype"] == "f32" and res["meta"]["device"]
    for row in res["rows"]:
        for case in ("jspec", "jspec_cached", "jspec_warm", "transformers", "transformers_warm"):
            assert finite_positive(row[case]["s"]) and finite_positive(row[case]["rss_gb"]), row
    md = out.with_suffix(".md").read_text()
    assert "| 1,100 |" in md and "jspec / transformers time" in md and out.with_suffix(".png").exists()
    assert "jspec_cached / transformers time" in md and "jspec_warm / transformers_warm time" in md
    with pytest.raises(SystemExit, match="--runs must be >= 1"):
        cli.main(["bench", "long", "--runs", "0", "--out", str(out)])
    video = tmp_path / "video"
    assert cli.main(["bench", "long", "--video", "qwen2.5-vl-tiny", "--lengths", "64", "--out", str(video)]) == 0
    row = json.loads(video.with_suffix(".json").read_text())["rows"][0]
    assert (row["video_tokens"], row["frames"], row["prompt_tokens"]) == (64, 16, 82)
    assert finite_positive(row["jspec"]["s"]) and "| 64 | 16 | 82 |" in video.with_suffix(".md").read_text()


def test_quick_moe_bench_schema_and_provenance(tmp_path, capsys):
    """`jspec bench moe --quick --runs 1`: the JSON holds both models' AR-step and 8-token-verify times (finite,
    not negative: on tiny models one timing's slope may clamp to 0 on a busy machine), their MoE / dense ratios, the token-expert pairs of the verify and the distinct experts the router
    woke for them (between top_k and the pairs), and the provenance; the markdown carries the table."""
    assert cli.main(["bench", "moe", "--quick", "--runs", "1", "--out", str(tmp_path)]) == 0
    [js] = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
    assert js.name.startswith("moe-quick-") and js.with_suffix(".md").exists()
    res = json.loads(js.read_text())
    assert res["meta"]["suite"] == "moe" and res["meta"]["quick"] is True and res["meta"]["runs"] == 1
    assert_provenance(res["meta"]["provenance"])
    assert [r["model"] for r in res["rows"]] == ["MoE", "dense"]
    for r in res["rows"]:
        assert all(math.isfinite(r[k]) and r[k] >= 0 for k in ("ar_step_ms", "verify_8_ms")), r
        assert len(r["ar_runs_ms"]) == len(r["verify_runs_ms"]) == 1
    s = res["summary"]
    for k in ("ar_step_ratio", "verify_ratio"):  # None where a timing clamped to 0
        assert s[k] is None or finite_positive(s[k]), (k, s[k])
    assert s["verify_tokens"] == 8 and s["verify_pairs"] == 8 * s["top_k"]
    assert res["experts_woken"] and all(w["pairs"] == s["verify_pairs"] for w in res["experts_woken"])
    assert s["top_k"] <= s["distinct_experts_min"] <= s["distinct_experts_max"] <= min(s["experts"], s["verify_pairs"])
    assert 0 < s["dense_weights_mb"] < s["moe_weights_mb"]
    md = js.with_suffix(".md").read_text()
    assert "| model |" in md and "MoE / dense" in md and "MoE / dense" in capsys.readouterr().out
    from jspec.tools.bench import moe
    with pytest.raises(ValueError, match="in-cache"):
        moe.run(size="huge", out_dir=str(tmp_path))


def test_quick_guard_bench_schema_and_provenance(tmp_path, capsys):
    """`jspec bench guard --quick --runs 1`: an AR step and a round without drafts timed in one program, the two
    decodes, their ratios (None only where a slope clamped to 0), the forced guard's tokens equal AR's, the target's
    cache as long under the strategy as under AR while the drafter's holds the deferred feed, the provenance."""
    assert cli.main(["bench", "guard", "--quick", "--runs", "1", "--out", str(tmp_path)]) == 0
    [js] = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
    assert js.name.startswith("guard-quick-") and js.with_suffix(".md").exists()
    res = json.loads(js.read_text())
    assert res["meta"]["suite"] == "guard" and res["meta"]["runs"] == 1
    assert_provenance(res["meta"]["provenance"])
    assert [r["measured"] for r in res["rows"]] == ["AR step", "round without drafts", "AR decode",
                                                     "decode, rounds without drafts"]
    for r in res["rows"]:
        assert math.isfinite(r["ms"]) and r["ms"] >= 0 and len(r["timed_runs_ms"]) == 1, r
    s = res["summary"]
    assert finite_positive(s["decode_ratio"]) and (s["in_program_ratio"] is None or finite_positive(s["in_program_ratio"]))
    assert s["tokens_equal"] is True and s["defer"] == 24 and s["per_step"] >= s["scratch"] + s["defer"]
    assert s["target_cache"] == s["target_cache_ar"] <= s["draft_cache"]
    assert s["draft_cache"] >= s["prompt_len"] + s["per_step"]
    assert "round without drafts costs" in capsys.readouterr().out
    from jspec.tools.bench import guard
    with pytest.raises(ValueError, match="smollm2"):
        guard.run(pair="llama", out_dir=str(tmp_path))


@pytest.mark.slow
def test_quick_hybrid_bench_schema_and_provenance(tmp_path):
    """`jspec bench hybrid --quick --runs 1`: per case (AR step; verify and accept of chains of depth 1, 3, 7 and
    trees of 8, 16, 32 nodes) both targets' times (finite, not negative) and their ratio; the bytes kept per node
    for the commit below a state per node; the provenance."""
    assert cli.main(["bench", "hybrid", "--quick", "--runs", "1", "--out", str(tmp_path)]) == 0
    [js] = [p for p in tmp_path.iterdir() if p.suffix == ".json"]
    res = json.loads(js.read_text())
    assert res["meta"]["suite"] == "hybrid" and js.with_suffix(".md").exists()
    assert_provenance(res["meta"]["provenance"])
    cases = [r["case"] for r in res["rows"]]
    assert cases[0] == "AR step" and len(cases) == 1 + 2 * 6 and "tree 32 accept" in cases
    for r in res["rows"]:
        assert all(math.isfinite(r[k]) and r[k] >= 0 for k in ("hybrid_ms", "attention_ms")), r
    mem = res["memory"]
    assert 0 < mem["verify_bytes_per_node"] < mem["state_bytes_per_node"]
