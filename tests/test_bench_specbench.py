"""`jspec bench spec-bench`'s pieces: the shipped question set, the summary's arithmetic, the answer files
Spec-Bench's own `evaluation/speed.py` reads, and batched rows on a tiny model (the run itself is a benchmark, not
a test)."""
import json
from types import SimpleNamespace

import numpy as np
import pytest

from jspec.tools.bench import spec_bench as SB


def test_the_shipped_question_set_is_spec_bench():
    qs = SB.load_questions()
    assert len(qs) == 480 and len({q["question_id"] for q in qs}) == 480
    counts = {c: sum(q["category"] == c for q in qs) for c in SB.CATEGORIES}
    assert all(counts[c] == 10 for c in SB.MT_BENCH) and all(counts[c] == 80 for c in SB.CATEGORIES[8:])
    assert all(len(q["turns"]) == (2 if q["category"] in SB.MT_BENCH else 1) for q in qs)
    two = SB.load_questions(("rag", "writing"), 2)
    assert [q["category"] for q in two] == ["writing", "writing", "rag", "rag"]  # file order, 2 of each
    with pytest.raises(ValueError, match="unknown Spec-Bench categories"):
        SB.load_questions(("poetry",))


def _results():
    """Two questions (one with a second turn), two runs, AR and one method with known times and tokens."""
    qs = [{"question_id": 1, "category": "writing", "turns": ["a", "b"]},
          {"question_id": 2, "category": "rag", "turns": ["c"]}]
    turns = [(0, 0, None), (1, 0, None), (0, 1, None)]
    toks = {(0, 0): np.arange(8), (1, 0): np.arange(6), (0, 1): np.arange(4)}
    # AR: one token per step (the prefill's first), 0.2 s of decode loop per step
    ar = {k: [(t, [1] * len(t), 2.0 * len(t) / 8, 0.2 * (len(t) - 1)) for _ in range(2)] for k, t in toks.items()}
    # the method: same tokens except the rag answer, half the wall time, 2 tokens per step at 1.5 AR steps' cost
    pld = {}
    for k, t in toks.items():
        out = t if k != (1, 0) else t[::-1]
        acc = [1] + [2] * ((len(t) - 1) // 2) + [1] * ((len(t) - 1) % 2)
        pld[k] = [(out, acc, ar[k][0][2] / 2, 0.3 * (len(acc) - 1), 3 * (len(acc) - 1)) for _ in range(2)]
    return qs, turns, {"ar": ar, "pld": pld}


def test_summary_speedups_step_costs_and_equality():
    qs, turns, res = _results()
    summary = SB.summarize(qs, turns, res, {"ar": None, "pld": None}, (), 0.0)
    rows = {(r["group"], r["method"]): r for r in summary["rows"]}
    assert {g for g, _ in rows} == {"writing", "rag", "mt_bench", "overall"}
    assert rows["overall", "pld"]["speedup_vs_ar"] == pytest.approx(2.0)
    assert rows["overall", "pld"]["step_cost_ar_steps"] == pytest.approx(1.5)
    assert rows["writing", "pld"]["equal_to_ar"] == "2/2" and rows["rag", "pld"]["equal_to_ar"] == "0/1"
    assert rows["overall", "ar"]["mean_accepted"] == 1.0
    assert rows["rag", "pld"]["mean_accepted"] == pytest.approx(np.mean([1, 2, 2, 1]))
    assert rows["overall", "pld"]["drafts_per_step"] == 3.0 and "drafts_per_step" not in rows["overall", "ar"]


def test_answer_files_are_what_spec_bench_reads(tmp_path):
    qs, _, res = _results()
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    path = SB._write_answers(str(tmp_path / "pld.jsonl"), "pld", qs, res["pld"], tok, "m")
    rows = [json.loads(line) for line in open(path)]
    assert [r["question_id"] for r in rows] == [1, 2]
    c = rows[0]["choices"][0]
    assert len(c["turns"]) == 2 and c["new_tokens"] == [8, 4] and len(c["wall_time"]) == 2
    # evaluation/speed.py: sum(new_tokens) / sum(wall_time) per answer, accept_lengths extended over answers
    assert sum(c["new_tokens"]) / sum(c["wall_time"]) == pytest.approx(12 / (1.0 + 0.5))
    assert c["accept_lengths"] == res["pld"][0, 0][0][1] + res["pld"][0, 1][0][1]


def test_a_controllers_plan_is_summarised_and_written_per_step(tmp_path):
    """SAGE-like plans: depth / width / nodes averaged over steps, alpha against the drafts accepted at the same
    step (r = 1 when acceptance rises with alpha, -1 when it falls), and the per-step plan written aligned with
    accept_lengths (None at each turn's prefill)."""
    qs, turns, res = _results()

    def with_plan(sign):
        out = {}
        for k, runs in res["pld"].items():
            acc = runs[0][1]
            al = [0.5 + sign * 0.1 * (a - 1.5) for a in acc[1:]]
            plan = {"depth": [4.0] * (len(acc) - 1), "nodes": [6.0] * (len(acc) - 1), "alpha": al}
            out[k] = [r + (plan,) for r in runs]
        return out
    for sign in (1, -1):
        res2 = {**res, "pld": with_plan(sign)}
        row = {(r["group"], r["method"]): r for r in SB.summarize(qs, turns, res2, {"ar": None, "pld": None}, (),
                                                                     0.0)["rows"]}[("overall", "pld")]
        assert row["planned_depth"] == 4.0 and row["tree_nodes"] == 6.0 and "tree_width" not in row
        assert row["alpha_accept_r"] == pytest.approx(sign)
    assert "planned_depth" not in {(r["group"], r["method"]): r for r in SB.summarize(
        qs, turns, res, {"ar": None, "pld": None}, (), 0.0)["rows"]}[("overall", "pld")]
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)))
    path = SB._write_answers(str(tmp_path / "s.jsonl"), "s", qs, res2["pld"], tok, "m")
    c = json.loads(open(path).readline())["choices"][0]
    assert len(c["plan"]["depth"]) == len(c["accept_lengths"])
    assert [i for i, v in enumerate(c["plan"]["depth"]) if v is None] == [0, len(res["pld"][0, 0][0][1])]


def test_bf16_methods_are_checked_against_bf16_ar_and_timed_against_f32_ar():
    qs, turns, res = _results()
    res = {**res, "ar-bf16": res["pld"], "pld-bf16": res["pld"]}  # bf16 AR's tokens are the bf16 methods' own
    methods = {m: None for m in ("ar", "pld", "ar-bf16", "pld-bf16")}
    rows = {(r["group"], r["method"]): r for r in SB.summarize(qs, turns, res, methods, (), 0.0)["rows"]}
    assert rows["rag", "pld"]["equal_to_ar"] == "0/1"  # f32 prompt lookup against f32 AR
    assert rows["rag", "pld-bf16"]["equal_to_ar"] == "1/1"  # bf16 prompt lookup against bf16 AR
    assert rows["overall", "pld-bf16"]["speedup_vs_ar"] == pytest.approx(2.0)  # timed against float32 AR
    assert SB.dtype_of("pld-4-bf16") == "bfloat16" and SB.dtype_of("pld-4") == "float32"
    assert set(SB.strategies()) >= {"ar-bf16", "pld-bf16", "pld-4-bf16", "pld-tree-bf16"}


def test_a_run_never_overwrites_an_earlier_one(tmp_path):
    first = SB.fresh_dir(str(tmp_path / "spec-bench-m-T0-2026-01-01"))
    (tmp_path / "spec-bench-m-T0-2026-01-01" / "summary.md").write_text("kept")
    assert SB.fresh_dir(first) == first + "-2" and SB.fresh_dir(first) == first + "-3"
    assert (tmp_path / "spec-bench-m-T0-2026-01-01" / "summary.md").read_text() == "kept"


def test_batched_rows_are_each_rows_own_decode_and_share_the_batch_time(llama_pair):
    """--batch: ragged rows decoded together give each row the tokens, accept lengths and plan of decoding it
    alone, and the rows' time shares add up to the batch's; the summary of a batched run is overall only."""
    import jspec

    _, model = llama_pair
    runner = SB.Runner(model, SimpleNamespace(eos_token_id=100), 12, 0.0, 16)
    rows = [np.arange(3, 3 + n, dtype=np.int32) % 90 + 5 for n in (5, 11, 8)]
    strategy = jspec.Chain(model, gamma=2)  # the model drafting for itself
    batched = runner.jspec_rows(strategy, rows, 0)
    for ids, got in zip(rows, batched):
        alone = runner.jspec(strategy, ids, 0)
        np.testing.assert_array_equal(got[0], alone[0])
        assert got[1] == alone[1] and got[4] == alone[4]
    assert len({b[2] for b in batched}) == 1 and len({b[3] for b in batched}) == 1
    qs, turns, res = _results()
    summary = SB.summarize(qs, turns, res, {"ar": None, "pld": None}, (), 0.0, overall_only=True)
    assert {r["group"] for r in summary["rows"]} == {"overall"}
    assert {(r["method"], r["speedup_vs_ar"]) for r in summary["rows"]} == {("ar", 1.0), ("pld", 2.0)}


def test_ignore_eos_decodes_exactly_max_new_tokens(llama_pair):
    """--ignore-eos (EESD's protocol): an answer runs to max_new_tokens through the EOS that would have ended it;
    the transformers baselines, which stop at EOS, are refused before anything loads."""
    import jspec

    _, model = llama_pair
    ids = np.arange(3, 10, dtype=np.int32)
    first = int(jspec.decode(model, ids, max_new_tokens=1).tokens[0, 0])
    tok = SimpleNamespace(eos_token_id=first)
    stops = SB.Runner(model, tok, 12, 0.0, 16).jspec(jspec.AR(), ids, 0)[0]
    runs = SB.Runner(model, tok, 12, 0.0, 16, ignore_eos=True).jspec(jspec.AR(), ids, 0)[0]
    assert len(stops) == 1 and len(runs) == 12 and runs[0] == first
    with pytest.raises(ValueError, match="stop at EOS"):
        SB.run(strategies_=("ar",), hf_methods=("hf",), ignore_eos=True, progress=False)


def test_a_method_over_a_head_in_a_directory(tmp_path):
    """NAME@DIR: the method NAME over the head of its kind that DIR holds (a training run's output), labelled by
    the directory's name; its dtype and AR reference follow NAME; a missing directory is refused before any work."""
    assert SB.head_label("eesd@build/runs/eesd-head-only/") == ("eesd@eesd-head-only", "build/runs/eesd-head-only/")
    assert SB.head_label("eesd") == ("eesd", None)
    assert SB.head_method("eesd-k2-bf16@x")[0] == "eesd" and SB.head_method("nope@x") is None
    assert SB.dtype_of("eesd-bf16@x") == "bfloat16" and SB.reference_of("eesd-bf16@x") == "ar-bf16"
    assert SB.dtype_of("eesd@x-bf16") == "float32"
    with pytest.raises(ValueError, match="no head directory"):
        SB.run(strategies_=("eesd@" + str(tmp_path / "absent"),), hf_methods=())
    for d in ("a/head", "b/head"):
        (tmp_path / d).mkdir(parents=True)
    with pytest.raises(ValueError, match="share a name"):
        SB.run(strategies_=tuple(f"eesd@{tmp_path / d}" for d in ("a/head", "b/head")), hf_methods=())


def test_guarded_method_names_carry_the_guard_and_its_rate():
    import jspec

    assert SB.guard_of("eagle3-c3+guard") == ("eagle3-c3", "guard", None)
    assert SB.guard_of("eagle3-c3+guard-r0.1") == ("eagle3-c3", "guard", None)
    assert SB.guard_of("pld-4+depth2") == ("pld-4", "depth", 2)
    assert SB.guard_of("pld-4+guard-rx") == ("pld-4+guard-rx", None, None)  # not a rate: an unknown method
    s = jspec.PromptLookup(max_ngram=2, gamma=3)
    assert SB.guarded("pld-3+guard-r0.15", s).rate == 0.15
    assert SB.guarded("pld-3+guard", s).rate == jspec.Guarded(s).rate
