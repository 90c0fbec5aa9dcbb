"""The synthetic world (jspec.tools.zoo.world), its tokenizer and the data pipeline: determinism, answers re-derived from
the scenes by an independent solver, renders checked pixel by pixel, split disjointness, tokenizer / processor
compatibility with transformers, loss masks and packed batches."""
from __future__ import annotations

import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np
import pytest

from jspec.tools.zoo import data as ZD
from jspec.tools.zoo import tokenizer as TK
from jspec.tools.zoo import world as ZW


@pytest.fixture(scope="module")
def tok():
    return TK.load_tokenizer()


# The world's own tasks: the text pair's `described_*` tasks join the registry once jspec.tools.zoo.data registers them
# (train_zoo and the evaluation do), so the streams below name their tasks and stay the same in any test order.
WORLD_TASKS = tuple(n for n in ZW.TASKS if n not in ZD.DESCRIBED)
TRAIN_TASKS = tuple(n for n in WORLD_TASKS if not ZW.TASKS[n].ood)


@pytest.fixture(scope="module")
def train_exs():
    return list(ZW.examples("train", 3000, seed=0, tasks=TRAIN_TASKS))


@pytest.fixture(scope="module")
def heldout_exs():
    return list(ZW.examples("heldout", 1500, seed=0, tasks=WORLD_TASKS))


# ------------------------------------------------------------------------------------------ an independent solver

POS = {v: k for k, v in ZW.POSITIONS.items()}


def _words(q: str, vocab) -> list[str]:
    return [w for w in vocab if re.search(rf"\b{w}\b", q)]


def _pos_in(q: str) -> list[str]:
    return [p for p in ZW.POSITIONS.values() if re.search(rf"\bthe {p}\b", q)]


def _obj(s: ZW.Scene, colour=None, shape=None, pos=None) -> ZW.Obj:
    hits = [o for o in s.objects if (colour is None or o.colour == colour) and (shape is None or o.shape == shape)
            and (pos is None or o.position == pos)]
    assert len(hits) == 1, (colour, shape, pos, s)
    return hits[0]


def solve_image_question(s: ZW.Scene, q: str, a: str) -> str | None:
    """The answer to a single-image question, derived from the scene and the question words alone; None for
    captions (checked separately)."""
    cols, shapes, plural, pos = _words(q, ZW.COLOURS), _words(q, ZW.SHAPES), _words(q, ZW.PLURAL.values()), _pos_in(q)
    if re.search(r"Describe|caption|description", q) or "What is in this image" in q:
        return None
    if s.kind == "text":
        return s.text_colour if "colo" in q else s.text
    if s.kind == "chart":
        if re.search(r"tallest|highest", q):
            return max(s.bars, key=lambda b: b.value).colour
        if re.search(r"shortest|lowest", q):
            return min(s.bars, key=lambda b: b.value).colour
        if re.search(r"How many bars|Count the bars", q):
            return str(len(s.bars))
        (c,) = cols
        return str(next(b.value for b in s.bars if b.colour == c))
    if re.search(r"How many|Count", q):
        if cols:
            return str(sum(o.colour == cols[0] for o in s.objects))
        if plural:
            sh = next(k for k, v in ZW.PLURAL.items() if v == plural[0])
            return str(sum(o.shape == sh for o in s.objects))
        return str(len(s.objects))
    if re.search(r"Is there|Do you see|contain", q):
        return "yes" if any(o.colour == cols[0] and o.shape == shapes[0] for o in s.objects) else "no"
    if re.search(r"big or small|small or big|How big|What size", q):
        return _obj(s, cols[0], shapes[0]).size
    if re.search(r"Where|position|which part", q):
        return _obj(s, cols[0], shapes[0]).position
    if "colo" in q:
        return _obj(s, shape=shapes[0] if shapes and not pos else None, pos=pos[0] if pos else None).colour
    if "shape" in q:
        return _obj(s, colour=cols[0] if cols and not pos else None, pos=pos[0] if pos else None).shape
    raise AssertionError(f"unrecognised question {q!r}")


def check_caption(s: ZW.Scene, a: str) -> None:
    if s.kind == "shapes":
        mentioned = re.findall(r"\b(big|small) (\w+) (\w+)", a)
        assert sorted(mentioned) == sorted((o.size, o.colour, o.shape) for o in s.objects), (a, s)
        for m in re.finditer(r"(big|small) (\w+) (\w+) is in the ([a-z ]+)\.", a):
            assert _obj(s, m.group(2), m.group(3)).position == m.group(4)
    elif s.kind == "text":
        assert s.text in a and s.text_colour in a
    else:
        assert f"with {ZW.NUMBER_WORDS[len(s.bars)]} bars" in a
        for c, v in re.findall(r"the (\w+) bar is (\d)", a):
            assert next(b.value for b in s.bars if b.colour == c) == int(v)


def solve_text_question(q: str, prev: str | None) -> str:
    """Text-only questions: arithmetic, knowledge base, word games, follow-ups on the previous answer."""
    m = re.search(r"(\d+) (plus|minus|times) (\d+)", q)
    if m:
        x, y = int(m.group(1)), int(m.group(3))
        return str({"plus": x + y, "minus": x - y, "times": x * y}[m.group(2)])
    for country, capital in ZW.KB_COUNTRIES.items():
        if country in q:
            return capital
    for name, (colour, legs, food) in ZW.KB_CREATURES.items():
        if re.search(rf"\b{name}s?\b", q):
            return str(legs) if "legs" in q else colour if "colo" in q else food
    m = re.search(r"(?:word|spell|of|Write) ([a-z]+)\b", q)
    if m and m.group(1) in set(ZW.COLOURS) | set(ZW.SHAPES):
        w = m.group(1)
        return "-".join(w) if re.search(r"[Ss]pell", q) else str(len(w)) if "letters" in q and "capital" not in q \
            else w.upper()
    assert prev is not None, q
    if re.search(r"plus|Add|add", q):
        return str(int(prev) + int(re.search(r"\d+", q).group()))
    if re.search(r"minus|Subtract|take away", q):
        return str(int(prev) - int(re.search(r"\d+", q).group()))
    if re.search(r"double|twice|by two", q):
        return str(2 * int(prev))
    if re.search(r"even|odd", q):
        return "even" if int(prev) % 2 == 0 else "odd"
    if "creature" in q:
        return ZW.CREATURE_OF_COLOUR[prev]
    if re.search(r"[Ss]pell", q):
        return "-".join(prev)
    if re.search(r"capital|uppercase", q):
        return prev.upper()
    if re.search(r"backwards|reversed|right to left", q):
        return prev[::-1]
    if re.search(r"letters|characters", q):
        return str(len(prev))
    m = re.search(r"(left side|right side|top row|bottom row)", q)
    if m:
        r, c = POS[prev]
        return "yes" if {"left side": c == 0, "right side": c == 2, "top row": r == 0,
                         "bottom row": r == 2}[m.group(1)] else "no"
    raise AssertionError(f"unrecognised text question {q!r}")


def _objset(s: ZW.Scene):
    return {(o.shape, o.colour, o.size, o.row, o.col) for o in s.objects}


def check_difference(a: ZW.Scene, b: ZW.Scene, change: str) -> None:
    """Apply the described change to scene a and compare with scene b."""
    objs = _objset(a)
    if m := re.fullmatch(r"A (big|small) (\w+) (\w+) was added in the ([a-z ]+)\.", change):
        objs.add((m.group(3), m.group(2), m.group(1), *POS[m.group(4)]))
    elif m := re.fullmatch(r"The (\w+) (\w+) was removed\.", change):
        objs = {o for o in objs if (o[1], o[0]) != (m.group(1), m.group(2))}
    elif m := re.fullmatch(r"The (\w+) (\w+) moved from the ([a-z ]+) to the ([a-z ]+)\.", change):
        (o,) = [o for o in objs if (o[1], o[0]) == (m.group(1), m.group(2))]
        assert o[3:] == POS[m.group(3)]
        objs = (objs - {o}) | {o[:3] + POS[m.group(4)]}
    elif m := re.fullmatch(r"The (\w+) (\w+) (?:shrank|grew) from (big|small) to (big|small)\.", change):
        (o,) = [o for o in objs if (o[1], o[0]) == (m.group(1), m.group(2))]
        assert o[2] == m.group(3)
        objs = (objs - {o}) | {(o[0], o[1], m.group(4), o[3], o[4])}
    elif m := re.fullmatch(r"The (\w+) (\w+) turned (\w+)\.", change):
        (o,) = [o for o in objs if (o[1], o[0]) == (m.group(1), m.group(2))]
        objs = (objs - {o}) | {(o[0], m.group(3), *o[2:])}
    elif m := re.fullmatch(r"The (\w+) (\w+) became a (\w+)\.", change):
        (o,) = [o for o in objs if (o[1], o[0]) == (m.group(1), m.group(2))]
        objs = (objs - {o}) | {(m.group(3), *o[1:])}
    else:
        raise AssertionError(f"unrecognised change {change!r}")
    assert objs == _objset(b), (change, a, b)


def check_answer(q: str, a: str, short: str) -> None:
    """A prompt that asks for a sentence gets a sentence stating the short answer; any other gets the short answer."""
    if "sentence" in q:
        assert a.endswith(".") and a != short, (q, a, short)
        assert re.search(rf"(?i)(^|[\s,]){re.escape(short)}([\s,.]|$)", a), (q, a, short)
    else:
        assert a == short, (q, a, short)


def check_example(ex: ZW.Example) -> None:
    """Every assistant answer of the example is what the scenes and the questions determine."""
    user = [t for t in ex.turns if t.role == "user"]
    answers = [t.text for t in ex.turns if t.role == "assistant"]
    assert [t.role for t in ex.turns] == ["user", "assistant"] * len(user)
    assert sum(t.n_images for t in user) == len(ex.images)
    if ex.scenario == "two_image":
        a, b = ex.images
        if ex.task == "two_image_diff":
            check_difference(a, b, answers[0])
        else:
            na, nb = len(a.objects), len(b.objects)
            check_answer(user[0].text, answers[0],
                         "the first image" if na > nb else "the second image" if nb > na else "neither")
        return
    if ex.task == "ood_count":
        check_answer(user[0].text, answers[0], str(sum(len(s.objects) for s in ex.images)))
        return
    if ex.task == "ood_story":
        told = re.findall(r"a (big|small) (\w+) (\w+) appears in the ([a-z ]+)\.", answers[0])
        assert told == [(o.size, o.colour, o.shape, o.position) for s in ex.images for o in s.objects]
        return
    if ex.task == "text_story":
        listed = re.findall(r"a (big|small) (\w+) (\w+)", user[0].text)
        assert re.findall(r"a (big|small) (\w+) (\w+) appears", answers[0]) == listed and len(listed) >= 2
        return
    if ex.task == "prior_story":
        told = re.findall(r"a (big|small) (\w+) (\w+) appears in the ([a-z ]+)\.", answers[0])
        n = ZW.NUMBER_WORDS.index(re.search(r"\b(\w+) shapes\b", user[0].text).group(1))
        assert n == len(told) and len({t[3] for t in told}) == len(told) and set(t[3] for t in told) <= set(POS)
        return
    if ex.task == "prior_total":
        counts = [int(c) for c in re.findall(r"\b(\d+)\b", user[0].text)]
        assert re.search(rf"(?i)\b{ZW.NUMBER_WORDS[len(counts)]}\b", user[0].text) and len(counts) >= 2
        check_answer(user[0].text, answers[0], str(sum(counts)))
        return
    prev = None
    for i, (u, a) in enumerate(zip(user, answers)):
        if u.n_images:
            (s,) = ex.images
            want = solve_image_question(s, u.text, a)
            if want is None:
                check_caption(s, a)
            else:
                check_answer(u.text, a, want)
        else:
            want = solve_text_question(u.text, prev)
            check_answer(u.text, a, want)
        prev = want


def test_answers_follow_from_scenes(train_exs, heldout_exs):
    seen = set()
    for ex in train_exs[:2000] + heldout_exs:
        check_example(ex)
        seen.add(ex.task)
    assert seen == set(WORLD_TASKS), set(WORLD_TASKS) - seen
    # VQA answers are short (1-3 words) unless the prompt asks for a sentence; both kinds are common
    vqa = [ex for ex in train_exs if ex.scenario == "vqa"]
    short = [ex.answer for ex in vqa if "sentence" not in ex.turns[0].text]
    assert max(len(a.split()) for a in short) <= 3 and all(a == a.strip() for a in short)
    assert 0.3 < 1 - len(short) / len(vqa) < 0.6


def test_described_tasks_state_the_scene_and_keep_its_answers():
    """A described_* example is its inner task with each image replaced by a detailed caption of that very scene:
    replaying the generator's random stream recovers the scenes, and the independent solver checks both the
    descriptions and the answers against them."""
    import random
    ZD.register_described_tasks()
    ZD.register_described_tasks()                      # idempotent
    for name, (inner, _) in ZD.DESCRIBED.items():
        assert ZW.TASKS[name].scenario == "text" and ZW.TASKS[name].max_images == 0
        for i in range(40):
            rng, replay = random.Random(1000 * i + 7), random.Random(1000 * i + 7)
            turns, images = ZW.TASKS[name].make(rng, "train")
            assert images == []
            inner_name = replay.choices(inner, weights=[ZW.TASKS[n].weight for n in inner])[0] \
                if len(inner) > 1 else inner[0]
            inner_turns, scenes = ZW.TASKS[inner_name].make(replay, "train")
            assert len(turns) == len(inner_turns) and scenes
            k = 0
            for t, t0 in zip(turns, inner_turns):
                assert t.n_images == 0 and t.role == t0.role
                if not t0.n_images:
                    assert t.text == t0.text
                    continue
                pics = t.text[: len(t.text) - len(t0.text)].split("\n")[:-1]
                assert t.text.endswith(t0.text) and len(pics) == t0.n_images
                for pic, s in zip(pics, scenes[k:k + t0.n_images]):
                    assert pic.startswith("Picture: ")
                    check_caption(s, pic[len("Picture: "):])
                k += t0.n_images
            check_example(ZW.Example(inner_name, ZW.TASKS[inner_name].scenario, "train", i, tuple(inner_turns),
                                    tuple(scenes)))


def test_solver_rejects_wrong_answers(train_exs):
    """The checks above have teeth: corrupting an answer or a scene makes them fail."""
    failures = 0
    tried = 0
    for ex in train_exs[:400]:
        if ex.scenario not in ("vqa", "second_turn", "two_image"):
            continue
        tried += 1
        last = ex.turns[-1]
        wrong = "9" if last.text != "9" else "8"
        bad = ZW.Example(ex.task, ex.scenario, ex.split, ex.index, ex.turns[:-1] + (ZW.Turn("assistant", wrong),),
                        ex.images)
        try:
            check_example(bad)
        except (AssertionError, ValueError, KeyError, StopIteration):
            failures += 1
    assert tried > 100 and failures == tried


# ------------------------------------------------------------------------------------------------ rendering


@pytest.mark.parametrize("size", [32, 64])
def test_renders_show_the_scene(train_exs, size):
    scenes = [s for ex in train_exs[:600] for s in ex.images]
    kinds = {s.kind for s in scenes}
    assert kinds == {"shapes", "text", "chart"}
    area = {(sh, sz): [] for sh in ZW.SHAPES for sz in ZW.SIZES}
    for s in scenes:
        a = np.asarray(ZW.render(s, size))
        assert a.shape == (size, size, 3) and a.dtype == np.uint8
        if s.kind == "shapes":
            cell = size / ZW.GRID
            occupied = set()
            for o in s.objects:
                x, y = ZW.object_centre(o, size)
                assert tuple(a[int(y), int(x)]) == ZW.COLOURS[o.colour], (o, size)
                occupied.add((o.row, o.col))
                r0, c0 = int(o.row * cell), int(o.col * cell)
                block = a[r0:int((o.row + 1) * cell), c0:int((o.col + 1) * cell)]
                n = int(np.all(block == ZW.COLOURS[o.colour], axis=-1).sum())
                area[(o.shape, o.size)].append(n)
            for (r, c) in set(ZW.POSITIONS) - occupied:
                assert tuple(a[int((r + .5) * cell), int((c + .5) * cell)]) == ZW.BACKGROUND
        elif s.kind == "text":
            x0, y0, k = ZW.text_layout(s.text, size)
            ink = np.all(a == ZW.COLOURS[s.text_colour], axis=-1)
            read = ""
            for i in range(len(s.text)):
                gx = x0 + (ZW.GLYPH_W + 1) * k * i
                glyph = tuple("".join("#" if ink[y0 + r * k + k // 2, gx + c * k + k // 2] else "."
                                      for c in range(ZW.GLYPH_W)) for r in range(ZW.GLYPH_H))
                read += next(ch for ch, g in ZW.FONT.items() if g == glyph)
            assert read == s.text
            assert ink.sum() == sum(g.count("#") for ch in s.text for g in ZW.FONT[ch]) * k * k
        else:
            xs, base, unit = ZW.chart_layout(len(s.bars), size)
            for (x_a, x_b), bar in zip(xs, s.bars):
                col = np.all(a[:, (x_a + x_b) // 2] == ZW.COLOURS[bar.colour], axis=-1)
                assert round(col.sum() / unit) == bar.value and col[base - 1] and not col[base]
    for sh in ZW.SHAPES:     # big shapes cover ~2.7x the area of small ones (fewer whole pixels at 32 px)
        assert min(area[(sh, "big")]) > 1.6 * max(area[(sh, "small")]), sh


def test_font_glyphs_distinct_and_well_formed():
    glyphs = list(ZW.FONT.values())
    assert len(set(glyphs)) == len(glyphs) == len(ZW.TEXT_CHARS)
    assert all(len(g) == ZW.GLYPH_H and all(len(r) == ZW.GLYPH_W and set(r) <= {"#", "."} for r in g) for g in glyphs)
    assert all(set(w) <= set(ZW.TEXT_CHARS) for w in ZW.SIGN_WORDS)


def test_velocity_moves_objects():
    o = ZW.Obj("square", "blue", "big", 0, 0, velocity=(1.0, 2.0))
    s = ZW.Scene("shapes", objects=(o,))
    a0, a1 = np.asarray(ZW.render(s, 48)), np.asarray(ZW.render(s, 48, t=1.0))
    assert tuple(a0[8, 8]) == ZW.COLOURS["blue"] and tuple(a0[24, 40]) == ZW.BACKGROUND
    assert tuple(a1[24, 40]) == ZW.COLOURS["blue"] and tuple(a1[8, 8]) == ZW.BACKGROUND


# ---------------------------------------------------------------------------------------- determinism, splits


def test_deterministic_from_seed(train_exs):
    again = list(ZW.examples("train", 300, seed=0, tasks=TRAIN_TASKS))
    assert again == train_exs[:300]
    other = list(ZW.examples("train", 300, seed=1, tasks=TRAIN_TASKS))
    assert sum(a != b for a, b in zip(other, again)) > 250
    s = next(sc for ex in train_exs for sc in ex.images)
    assert ZW.render(s, 64).tobytes() == ZW.render(s, 64).tobytes()
    assert ZW.example("train", 1234, seed=5) == ZW.example("train", 1234, seed=5)   # random access, no state


def test_splits_disjoint_and_ood_held_out(train_exs, heldout_exs):
    train_keys = {s.key() for ex in train_exs for s in ex.images}
    held_keys = {s.key() for ex in heldout_exs for s in ex.images}
    assert train_keys and held_keys and not (train_keys & held_keys)
    assert all(s.split() == "train" for ex in train_exs for s in ex.images)
    assert all(s.split() == "heldout" for ex in heldout_exs for s in ex.images)
    # a free draw would collide: single-object scenes are few, so disjointness is the hash partition's doing
    assert any(len(s.objects) == 1 for ex in heldout_exs for s in ex.images)
    assert {ex.scenario for ex in train_exs} == set(ZW.SCENARIOS) - {"ood"}
    assert {ex.scenario for ex in heldout_exs} == set(ZW.SCENARIOS)
    assert not any(ZW.TASKS[ex.task].ood for ex in train_exs)
    with pytest.raises(ValueError, match="held out"):
        ZW.example("train", 0, tasks=["ood_story"])
    with pytest.raises(ValueError, match="held out"):
        next(ZD.batches("train", 2, 64, tasks=["ood_count"], view="T"))
    # a target may train on them (train-split scenes): only on request
    ex = ZW.example("train", 0, tasks=["ood_story"], allow_ood=True)
    assert ex.scenario == "ood" and len(ex.images) == 5 and all(s.split() == "train" for s in ex.images)
    with pytest.raises(ValueError, match="unknown task"):
        ZW.example("train", 0, tasks=["no_such_task"])
    ood = [ex for ex in heldout_exs if ex.scenario == "ood"]
    assert ood and all(len(ex.images) >= 3 for ex in ood)
    prior = set(ZW.tasks_of("prior"))
    assert prior and set(ZD.DRAFT_TASKS) <= set(ZD.TARGET_TASKS) | prior and prior <= set(ZD.DRAFT_TASKS)
    assert all(ZW.TASKS[t].max_images <= 1 for t in ZD.DRAFT_TASKS)
    # the draft's language prior is its own: no target's data (image target, text pair) lists those tasks
    assert not prior & (set(ZD.TARGET_TASKS) | set(ZD.TEXT_TASKS) | set(ZD.TEXT_PAIR_TASKS))
    assert all(ZW.TASKS[t].max_images == 0 for t in prior)
    assert set(ZW.tasks_of("ood")) <= set(ZD.TARGET_TASKS) and not set(ZD.DRAFT_TASKS) & set(ZW.tasks_of("ood"))


def test_eval_sets_cover_every_scenario():
    sets = ZD.eval_sets(n=24)
    assert set(sets) == set(ZW.SCENARIOS)
    for sc, exs in sets.items():
        assert len(exs) == 24 and {e.scenario for e in exs} == {sc} and {e.split for e in exs} == {"heldout"}
        assert {e.task for e in exs} == set(ZW.tasks_of(sc))           # balanced over the scenario's tasks
    assert ZD.eval_set("vqa", 24) == sets["vqa"]
    second = sets["second_turn"]
    assert all(len(e.images) == 1 and e.turns[0].n_images == 1 and e.turns[2].n_images == 0 for e in second)


# --------------------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_specials(tok, heldout_exs):
    assert len(tok) == TK.VOCAB_SIZE
    assert [tok.convert_tokens_to_ids(s) for s in TK.SPECIAL_TOKENS] == list(range(6))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (TK.BOS_ID, TK.EOS_ID, TK.PAD_ID)
    for s in TK.SPECIAL_TOKENS:
        assert tok.encode(s, add_special_tokens=False) == [TK.SPECIAL_TOKENS.index(s)]
    texts = [TK.chat_text(ex) for ex in heldout_exs[:400]] + ["Flintholm QZ9 7UP  two\n\nspaces", "é ✓ ünïcode"]
    for t in texts:
        ids = tok.encode(t, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == t
    # the chat text holds exactly one id per special token occurrence, and BPE compresses the world's text
    ex = heldout_exs[0]
    ids = tok.encode(TK.chat_text(ex), add_special_tokens=False)
    assert ids.count(TK.IMAGE_ID) == len(ex.images) and ids[0] == TK.BOS_ID and ids[-1] == TK.EOS_ID
    n_chars = sum(len(t) for t in texts[:400])
    n_ids = sum(len(tok.encode(t, add_special_tokens=False)) for t in texts[:400])
    assert n_chars / n_ids > 3.0


def test_tokenizer_training_is_deterministic(tmp_path):
    a = TK.train_tokenizer(vocab_size=400, n_examples=1500)
    b = TK.train_tokenizer(vocab_size=400, n_examples=1500)
    assert a.to_str() == b.to_str() and a.get_vocab_size() == 400
    TK.save_tokenizer(a, tmp_path)
    loaded = TK.load_tokenizer(tmp_path)
    assert loaded.convert_tokens_to_ids("<|assistant|>") == TK.ASSISTANT_ID and len(loaded) == 400
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        TK.load_tokenizer(tmp_path / "missing")


def test_chat_template_renders_our_format(tok, heldout_exs):
    for ex in [e for e in heldout_exs if e.scenario in ("second_turn", "two_image", "text")][:30]:
        assert tok.apply_chat_template(ex.messages(), tokenize=False) == TK.chat_text(ex)
        prompt = tok.apply_chat_template(ex.messages(upto_last_answer=True), tokenize=False,
                                         add_generation_prompt=True)
        assert prompt == TK.chat_text(ex, upto_last_answer=True) and prompt.endswith("<|assistant|>")


@pytest.mark.parametrize("patch,strategy,expect", [(16, "default", 16), (8, "default", 64), (16, "full", 17)])
def test_llava_processor_expands_images(tok, heldout_exs, tmp_path, patch, strategy, expect):
    import transformers

    assert TK.image_tokens(64, patch, strategy) == expect
    proc = TK.make_processor(tok, image_size=64, patch_size=patch, vision_feature_select_strategy=strategy)
    enc = ZD.Encoder(tok, image_tokens=expect, image_size=64)
    ex = next(e for e in heldout_exs if e.scenario == "two_image")
    prompt = proc.apply_chat_template(ex.messages(upto_last_answer=True), add_generation_prompt=True)
    out = proc(text=[prompt], images=[ZW.render(s, 64) for s in ex.images], return_tensors="np")
    mine = enc.prompt(ex)
    assert (out["input_ids"] == TK.IMAGE_ID).sum() == 2 * expect
    np.testing.assert_array_equal(out["input_ids"], mine["input_ids"])
    np.testing.assert_allclose(out["pixel_values"], mine["pixel_values"], atol=1e-5)
    if patch == 16 and strategy == "default":
        proc.save_pretrained(tmp_path)
        again = transformers.AutoProcessor.from_pretrained(tmp_path)
        out2 = again(text=[prompt], images=[ZW.render(s, 64) for s in ex.images], return_tensors="np")
        np.testing.assert_array_equal(out2["input_ids"], mine["input_ids"])
    with pytest.raises(ValueError, match="multiple of patch_size"):
        TK.image_tokens(64, 12)


# ------------------------------------------------------------------------------------------------ data pipeline


@pytest.mark.parametrize("view", ["M", "T"])
def test_loss_mask_covers_exactly_the_answers(tok, heldout_exs, view):
    enc = ZD.Encoder(tok, image_tokens=16, view=view)
    for ex in heldout_exs[:300]:
        e = enc.encode(ex)
        answers = [t.text for t in ex.turns if t.role == "assistant"]
        assert tok.decode(e.ids[e.loss_mask == 1], skip_special_tokens=False) == "".join(a + "</s>" for a in answers)
        # every masked run starts right after <|assistant|> and ends with </s>; nothing else is masked
        starts = np.flatnonzero(np.diff(np.r_[0, e.loss_mask]) == 1)
        ends = np.flatnonzero(np.diff(np.r_[e.loss_mask, 0]) == -1)
        assert len(starts) == len(answers) and all(e.ids[s - 1] == TK.ASSISTANT_ID for s in starts)
        assert all(e.ids[x] == TK.EOS_ID for x in ends)
        # the ids are the tokenizer's own encoding of the chat text (image placeholders expanded in the M view)
        text = TK.chat_text(ex)
        if view == "M":
            text = text.replace("<image>", "<image>" * 16)
            assert (e.ids == TK.IMAGE_ID).sum() == 16 * len(ex.images) and len(e.images) == len(ex.images)
        else:
            text = text.replace("<image>", "\n")
            assert TK.IMAGE_ID not in e.ids and e.images == ()
        assert e.ids.tolist() == tok.encode(text, add_special_tokens=False)
        p = enc.encode(ex, upto_last_answer=True)
        assert p.ids[-1] == TK.ASSISTANT_ID and e.ids[:len(p.ids)].tolist() == p.ids.tolist()


def test_pixels_match_clip_normalisation():
    import random

    s = ZW.random_shapes(random.Random(0), 3)
    x = ZD.pixels(s, 32)
    raw = np.asarray(ZW.render(s, 32)).astype(np.float64).transpose(2, 0, 1) / 255.0
    want = (raw - ZD.CLIP_MEAN[:, None, None]) / ZD.CLIP_STD[:, None, None]
    assert x.shape == (3, 32, 32) and x.dtype == np.float32
    np.testing.assert_allclose(x, want, atol=1e-6)


@pytest.mark.parametrize("pack", [True, False])
def test_batches_pack_the_example_stream(tok, pack):
    enc = ZD.Encoder(tok, image_tokens=16, image_size=32)
    B, T = 4, 96
    it = ZD.batches("train", B, T, seed=3, tasks=ZD.DRAFT_TASKS, pack=pack, encoder=enc, images_per_row=3)
    b1, b2 = next(it), next(it)
    shapes = {"input_ids": (B, T), "targets": (B, T), "target_mask": (B, T), "loss_mask": (B, T),
              "segment_ids": (B, T), "positions": (B, T), "attention_mask": (B, T),
              "pixel_values": (B, 3, 3, 32, 32), "image_mask": (B, 3)}
    assert {k: b1[k].shape for k in shapes} == shapes
    assert b1["input_ids"].dtype == np.int32 and b1["target_mask"].dtype == np.float32
    # rows hold the stream's examples in order, each as one segment; long ones are skipped
    i = 0
    for b in (b1, b2):
        for r in range(B):
            segs = [s for s in np.unique(b["segment_ids"][r]) if s > 0]
            assert pack or len(segs) == 1
            k_img = 0
            for sg in segs:
                while True:
                    e = enc.encode(ZW.example("train", i, 3, ZD.DRAFT_TASKS))
                    i += 1
                    if len(e.ids) <= T and len(e.images) <= 3:
                        break
                sel = b["segment_ids"][r] == sg
                np.testing.assert_array_equal(b["input_ids"][r][sel], e.ids)
                np.testing.assert_array_equal(b["loss_mask"][r][sel], e.loss_mask)
                np.testing.assert_array_equal(b["positions"][r][sel], np.arange(len(e.ids)))
                for s in e.images:
                    np.testing.assert_allclose(b["pixel_values"][r, k_img], ZD.pixels(s, 32))
                    k_img += 1
            assert b["image_mask"][r].sum() == k_img and not b["pixel_values"][r, k_img:].any()
            assert (b["input_ids"][r] == TK.IMAGE_ID).sum() == 16 * k_img
    assert int(b2["next_index"]) == i
    # targets: next token of the same segment; target_mask is loss_mask shifted within segments
    for b in (b1, b2):
        m = b["target_mask"] > 0
        assert m.sum() == b["loss_mask"].sum()         # every answer token is predicted from inside its segment
        rr, tt = np.nonzero(m)
        np.testing.assert_array_equal(b["targets"][rr, tt], b["input_ids"][rr, tt + 1])
        assert (b["segment_ids"][rr, tt] == b["segment_ids"][rr, tt + 1]).all()
        np.testing.assert_array_equal(b["attention_mask"], (b["segment_ids"] > 0).astype(np.int32))
    # resume from next_index reproduces the stream
    resumed = next(ZD.batches("train", B, T, seed=3, tasks=ZD.DRAFT_TASKS, pack=pack, encoder=enc, images_per_row=3,
                             start=int(b1["next_index"])))
    for k in shapes:
        np.testing.assert_array_equal(resumed[k], b2[k])


def test_t_view_batches_and_view_mixing(tok):
    st = ZD.Stats()
    b = next(ZD.batches("train", 4, 128, tasks=ZD.DRAFT_TASKS, view="T", tokenizer=tok, stats=st))
    assert b["pixel_values"].shape[1] == 0 and TK.IMAGE_ID not in b["input_ids"]
    assert st.examples > 4 and 0 < st.fill <= 1
    enc = ZD.Encoder(tok, image_tokens=8, image_size=32)
    mixed = next(ZD.batches("train", 8, 128, seed=1, tasks=ZD.DRAFT_TASKS, t_view_prob=0.5, encoder=enc, pack=False))
    views = [ZD._view_of(1, "train", i, 0.5, "M") for i in range(8)]
    assert set(views) == {"M", "T"}
    for row, v, i in zip(mixed["input_ids"], views, range(8)):     # pack=False: row i is example i
        ex = ZW.example("train", i, 1, ZD.DRAFT_TASKS)
        assert (row == TK.IMAGE_ID).sum() == (8 * len(ex.images) if v == "M" else 0)
        assert row.tolist()[:int((row > 0).sum())] == enc.encode(ex, view=v).ids.tolist()
    again = next(ZD.batches("train", 8, 128, seed=1, tasks=ZD.DRAFT_TASKS, t_view_prob=0.5, encoder=enc, pack=False))
    np.testing.assert_array_equal(mixed["input_ids"], again["input_ids"])
    with pytest.raises(ValueError, match="unknown view"):
        next(ZD.batches("train", 2, 64, view="X"))


def test_focus_names_the_object_an_answer_reads(tok, train_exs):
    """`Turn.focus` is set exactly on answers read off one object (colour/shape/position/size, and 'yes' to
    exists), names a cell holding that object, and the encoder points those answer tokens at that cell's image token
    (9 tokens per image: one per grid cell, row-major)."""
    enc = ZD.Encoder(tok, image_tokens=ZW.GRID ** 2)
    seen = 0
    for ex in train_exs[:1500]:
        e = enc.encode(ex)
        runs = np.flatnonzero(np.diff(np.r_[0, (e.ids == TK.IMAGE_ID).astype(int)]) == 1)
        answer_starts = np.flatnonzero(np.diff(np.r_[0, e.loss_mask]) == 1)
        answers = [t for t in ex.turns if t.role == "assistant"]
        for turn, start in zip(answers, answer_starts):
            end = start + int(np.argmax(e.loss_mask[start:] == 0)) if (e.loss_mask[start:] == 0).any() else len(e.ids)
            if turn.focus is None:
                assert (e.focus[start:end] == -1).all()
                continue
            seen += 1
            image, row, col = turn.focus
            (obj,) = [o for o in ex.images[image].objects if (o.row, o.col) == (row, col)]
            words = turn.text.lower().rstrip(".").replace(",", "").split()
            assert {obj.colour, obj.shape, obj.size} & set(words) or obj.position in turn.text or words[0] == "yes"
            assert (e.focus[start:end] == runs[image] + row * ZW.GRID + col).all()
            assert e.ids[e.focus[start]] == TK.IMAGE_ID
        assert (e.focus[e.loss_mask == 0] == -1).all()
    assert seen > 100
    tasks_with_focus = {ex.task for ex in train_exs[:1500] if ex.turns[-1].focus is not None}
    assert {"vqa_colour", "vqa_shape", "vqa_position", "vqa_size", "vqa_exists"} <= tasks_with_focus
    assert not tasks_with_focus & {"vqa_count", "vqa_text", "vqa_chart", "caption", "text_chat"}
    # 'no' answers to exists questions read no single object
    assert all(ex.turns[-1].focus is None for ex in train_exs if ex.task == "vqa_exists" and
               ex.turns[-1].text.lower().startswith("no"))
    # described scenes have no image to look at, and the M-view encoder takes them as they are
    ZD.register_described_tasks()
    described = ZD.eval_set("text", 24, tasks=list(ZD.DESCRIBED))
    assert all(t.focus is None for ex in described for t in ex.turns)
    assert all((enc.encode(ex).focus == -1).all() for ex in described)
    # with 16 tokens per image a token is no grid cell: no focus
    assert all((ZD.Encoder(tok, image_tokens=16).encode(ex).focus == -1).all() for ex in train_exs[:200])
