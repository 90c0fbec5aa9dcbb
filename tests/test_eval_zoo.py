"""scripts/eval_zoo.py's verdicts: TABED's premise and issue 8's bars read the right numbers."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ez():
    spec = importlib.util.spec_from_file_location("eval_zoo", ROOT / "scripts" / "eval_zoo.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["eval_zoo"] = mod
    spec.loader.exec_module(mod)
    return mod


def _res(vqa_em, tau_m, tau_t):
    em = {"vqa_colour": {"scenario": "vqa", "target": vqa_em[0], "draft": 0.1},
          "vqa_count": {"scenario": "vqa", "target": vqa_em[1], "draft": 0.1},
          "caption": {"scenario": "caption", "target": 0.0, "draft": 0.0}}       # not a VQA task: not averaged
    sd = {s: {"M": {"mean_accepted": tau_m[s]}, "T": {"mean_accepted": tau_t[s]}} for s in tau_m}
    return {"exact_match": em, "sd": sd}


def test_bars_and_premise(ez):
    tau_m = {"caption": 3.0, "vqa": 2.6, "second_turn": 3.0, "ood": 1.2}
    tau_t = {"caption": 2.0, "vqa": 2.0, "second_turn": 3.1, "ood": 2.0}
    r = _res((0.95, 0.87), tau_m, tau_t)
    b = ez.bars(r)
    assert b["target VQA exact match >= 0.90"] == {"value": pytest.approx(0.91), "met": True}
    assert b["VQA mean accepted (M view) >= 2.5"]["met"]
    assert all(ez.premise(r["sd"]).values())
    r = _res((0.95, 0.80), dict(tau_m, vqa=2.4), dict(tau_t, vqa=2.4, ood=1.1))
    b, p = ez.bars(r), ez.premise(r["sd"])
    assert not b["target VQA exact match >= 0.90"]["met"] and not b["VQA mean accepted (M view) >= 2.5"]["met"]
    assert not p["M > T on vqa"] and not p["T >= M on ood"] and p["M > T on caption"]


def test_binding_groups_by_objects_and_describes_the_same_scene():
    from jspec.tools.zoo import evaluate as ZE
    from jspec.tools.zoo import world as ZW

    exs = [ZW.example("heldout", i, 0, [t]) for t in ("vqa_colour", "vqa_text") for i in range(12)]
    counts = [len(e.images[0].objects) for e in exs[:12]]
    hits = [i % 3 == 0 for i in range(len(exs))]
    g = ZE.by_objects(exs, hits)
    assert sorted(g) == sorted(set(counts))                       # text scenes (vqa_text) are left out
    assert sum(r["n"] for r in g.values()) == 12
    for k, r in g.items():
        want = [h for h, c in zip(hits[:12], counts) if c == k]
        assert r["n"] == len(want) and r["exact_match"] == pytest.approx(sum(want) / len(want))
    d = ZE.described_example(exs[0])
    last = exs[0].turns[-1]
    assert not d.images and d.answer == exs[0].answer and (d.turns[-1].role, d.turns[-1].text) == (last.role, last.text)
    assert d.turns[-1].focus is None      # a described scene has no image cell to look at
    o = exs[0].images[0].objects[0]
    assert f"{o.size} {o.colour} {o.shape} is in the {o.position}" in d.turns[0].text
    assert d.turns[0].text.endswith(exs[0].turns[0].text)
