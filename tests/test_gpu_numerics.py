"""jspec.tools.bench.numerics (`python -m jspec.tools.bench.numerics`): the bf16-resolution and first-divergence helpers on known numbers, the divergence
record on constructed logits, and a CPU --quick run (one SD strategy) with an injected divergence, whose position,
tokens and margins must come out where the injection put them."""
import json

import ml_dtypes
import numpy as np
import pytest

from jspec.tools.bench import numerics as G


def test_bf16_resolution_known_numbers():
    xs = [1.0, 1.99, 2.0, -3.0, 10.0, 0.3, 1024.0, 17.2]
    want = [2.0 ** -7, 2.0 ** -7, 2.0 ** -6, 2.0 ** -6, 2.0 ** -4, 2.0 ** -9, 2.0 ** 3, 2.0 ** -3]
    np.testing.assert_array_equal(G.bf16_resolution(xs), want)
    assert G.bf16_resolution(0.0) == 2.0 ** -133 and G.bf16_resolution(1e-39) == 2.0 ** -133
    # against ml_dtypes: the next bf16 number after v (away from 0) is v + resolution
    rng = np.random.default_rng(0)
    v = (rng.standard_normal(200) * 10.0 ** rng.integers(-4, 5, 200)).astype(ml_dtypes.bfloat16)
    away = np.where(v > 0, np.inf, -np.inf).astype(ml_dtypes.bfloat16)
    step = np.abs(np.nextafter(v, away).astype(np.float64) - v.astype(np.float64))
    np.testing.assert_array_equal(G.bf16_resolution(v.astype(np.float32)), step)


def test_first_divergence():
    assert G.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert G.first_divergence(np.array([1, 2, 3, 4]), np.array([1, 2, 9, 4])) == 2
    assert G.first_divergence([5, 2], [1, 2]) == 0
    assert G.first_divergence([1, 2, 3], [1, 2]) == 2          # a strict prefix: at the shorter length
    assert G.first_divergence([1, 7, 3], [1, 2]) == 1
    assert G.first_divergence([], []) is None


def test_divergence_record_and_margins():
    V = 16
    ref = np.full(V, -1.0, np.float32)
    ref[7], ref[2], ref[3] = 5.0, 4.99, 4.0            # AR's token 7 wins by 0.01 over SD's token 2
    bf = ref.copy()
    bf[2] = 5.015625                                     # the bf16 forward flips it (one bf16 ulp at 5 is 2^-5)
    rec = G.divergence_record(ref, bf, ar_tok=7, sd_tok=2, baseline_ulps=[0.1, 0.5, 1.0, 10.0])
    assert rec["ref_top1"] == 7 and rec["ref_top2"] == 2 and rec["ar_sd_are_ref_top2"]
    assert rec["bf16_resolution"] == 2.0 ** -5
    assert rec["ref_margin"] == pytest.approx(0.01, abs=1e-6)
    assert rec["margin_bf16_ulps"] == pytest.approx(0.01 / 2.0 ** -5, rel=1e-4)
    assert rec["ref_gap_ar_minus_sd"] == pytest.approx(0.01, abs=1e-6)
    assert rec["ref_picks"] == "AR" and rec["bf16_picks"] == "SD"
    assert rec["bf16_gap_ar_minus_sd"] == pytest.approx(-0.015625)
    assert rec["gap_perturbation"] == pytest.approx(0.025625, abs=1e-6)
    assert rec["margin_percentile"] == 25.0                 # 0.32 ulps: only 0.1 of the baseline is <= it
    i1, i2, v1, m = G.margins(np.stack([ref, bf]))
    np.testing.assert_array_equal(i1, [7, 2])
    np.testing.assert_array_equal(i2, [2, 7])
    np.testing.assert_allclose(m, [0.01, 0.015625], rtol=1e-4)
    assert G.pick(ref, 1, 2) == "other"


def test_parse_args_pairs_and_errors():
    a = G.parse_args(["--pairs", "random,text", "--strategies", "Chain g=3"])
    assert a.pairs == ("random damped 7B", "zoo text") and a.strategies == ("AR", "Chain g=3")
    assert G.parse_args([]).pairs == G.DEFAULT_PAIRS and G.parse_args(["--quick"]).pairs == ("random damped 7B",)
    with pytest.raises(SystemExit):
        G.parse_args(["--pairs", "nope"])
    with pytest.raises(SystemExit):
        G.parse_args(["--variants", "fp8"])


def _inject(monkeypatch, variant="f32", strategy="Chain g=3", row=0, pos=5):
    """Make one SD row differ from AR at `pos` (token + 1) in `variant`: the analysis must find it there."""
    real = G.decode_variant

    def fake(pair, target, draft, v, names, quick, log):
        out = real(pair, target, draft, v, names, quick, log)
        if v == variant:
            t = out[strategy]["tokens"]
            t[row] = t[row].copy()
            t[row][pos] = (t[row][pos] + 1) % target.config.vocab_size
        return out

    monkeypatch.setattr(G, "decode_variant", fake)


def test_quick_run_finds_an_injected_divergence(tmp_path, monkeypatch, capsys):
    _inject(monkeypatch)
    # one variant and one SD strategy keep it near 15 s on a 2-core CPU (compiles: AR, Chain, two full forwards);
    # the whole --quick run is the slow test below
    res = G.main(["--quick", "--variants", "f32", "--strategies", "Chain g=3", "--prompts", "2", "--new-tokens", "12",
                  "--out", str(tmp_path)])
    stem = tmp_path / f"gpu-numerics-quick-{res['meta']['date']}"
    assert {str(stem) + e for e in (".json", ".md")} <= set(res["files"])
    data = json.loads((tmp_path / f"{stem.name}.json").read_text())
    m = data["meta"]
    assert m["quick"] and m["jax"] and m["device_kind"] and m["variants"] == ["f32"] and m["date"]
    rows = {(r["variant"], r["strategy"]): r for r in data["rows"]}
    assert set(rows) == {("f32", "Chain g=3")} and rows["f32", "Chain g=3"]["rows"] == 2
    # the injected row, and only it (on a CPU the tiny pair's SD gives AR's tokens in f32)
    r = rows["f32", "Chain g=3"]
    assert r["rows_differ"] == 1 and r["first_divergences"] == [5] and not r["same_tokens_as_ar"]
    (d,) = data["divergences"]
    assert (d["variant"], d["strategy"], d["row"], d["position"]) == ("f32", "Chain g=3", 0, 5)
    assert d["sd_token"] == (d["ar_token"] + 1) % 512
    # the reference forward at that position predicts AR's token: the logits are taken at the right position
    assert d["ref_picks"] == "AR" and d["ref_top1"] == d["ar_token"] and d["bf16_picks"] in ("AR", "SD", "other")
    assert d["ref_margin"] > 0
    assert d["margin_bf16_ulps"] == pytest.approx(d["ref_margin"] / d["bf16_resolution"], rel=1e-4)
    assert d["bf16_resolution"] == G.bf16_resolution(d["ref_top_logit"])
    assert 0 <= d["margin_percentile"] <= 100
    for b in data["baselines"]:
        assert b["positions"] == 2 * 12
        assert b["ref_argmax_is_ar"] >= 0.95 and b["bf16_argmax_is_ar"] >= 0.95   # teacher forcing lines up
        assert b["perturbation_p99"] >= b["perturbation_median"] >= 0
    md = (tmp_path / f"{stem.name}.md").read_text()
    assert "## Verdicts" in md and "| Chain g=3 |" in md
    assert "random damped 7B, f32: not every strategy gives AR's tokens (1 of 2 strategy-rows differ)" in md
    assert "## First divergences" in capsys.readouterr().out


@pytest.mark.slow  # the whole --quick run (every quick strategy, both variants): ~40 s on a 2-core CPU
def test_quick_run_all_strategies(tmp_path):
    res = G.main(["--quick", "--out", str(tmp_path)])
    assert res["meta"]["variants"] == ["bf16", "f32"]
    names = {(r["variant"], r["strategy"]) for r in res["rows"]}
    quick = ("Chain g=3", "Tree [[0],[1],[0,0]]", "DynamicTree 3x3/6")
    assert names == {(v, s) for v in ("bf16", "f32") for s in quick}
    # on a CPU f32 is true f32: SD gives AR's tokens
    assert all(r["same_tokens_as_ar"] for r in res["rows"] if r["variant"] == "f32")
    for r in res["rows"]:
        assert r["rows_differ"] == len(r["first_divergences"]) == sum(
            (d["variant"], d["strategy"]) == (r["variant"], r["strategy"]) for d in res["divergences"])
    for b in res["baselines"]:
        assert b["positions"] == 3 * 16 and b["bf16_argmax_is_ar"] >= 0.9 and b["ref_argmax_is_ar"] >= 0.9
    assert (res["ar"][1]["variant"], res["ar"][1]["rows"]) == ("f32", 3)
    assert 0 <= res["ar"][1]["rows_equal_bf16_ar"] <= 3
