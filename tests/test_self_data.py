"""Self-written training data: seeds, cleaning, the EESD draw of the answers (greedy head, sampled rest), and a
stopped run that resumes into the same file an uninterrupted run writes."""
import json

import jax
import numpy as np
import pytest

import jspec
import ports
from jspec.tools import self_data as SD

EOS, USER, ASSISTANT = 256, 257, 258
CFG = ports.TextConfig(model_type="llama", vocab_size=260, hidden_size=32, intermediate_size=64, num_layers=2,
                       num_heads=2, num_kv_heads=1, head_dim=16)


class CharChat:
    """A byte-level tokenizer with a two-token chat template (the interface `self_data` uses)."""

    eos_token_id = EOS

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        ids = []
        for m in messages:
            ids += [USER if m["role"] == "user" else ASSISTANT] + list(m["content"].encode())
        return ids + [ASSISTANT]

    def decode(self, ids, skip_special_tokens=True):
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def model():
    return ports.random_model(CFG, key=3, std=0.3)


def test_seeds_cover_every_pair_before_repeating_and_clean_drops_labels_and_short_text():
    s = SD.seeds(len(SD.TOPICS) * len(SD.KINDS) + 3)
    pairs = [(x["topic"], x["kind"]) for x in s]
    assert len(set(pairs[:-3])) == len(pairs) - 3 and pairs[-3:] == pairs[:3]
    assert [x["id"] for x in s] == list(range(len(s)))
    assert SD.clean('  Question: "How do volcanoes form?" ') == "How do volcanoes form?"
    assert SD.clean("Why?") is None and SD.clean("   ") is None


def test_answers_are_greedy_first_then_sampled_and_resume_writes_the_same_file(model, tmp_path):
    tok = CharChat()
    whole = tmp_path / "whole.jsonl"
    recs = SD.make(model, tok, str(whole), n=6, max_new=12, greedy_first=3, chunk=4, seed=1)
    assert [r["id"] for r in recs] == list(range(6)) and len(whole.read_text().splitlines()) == 6
    kept = [r for r in recs if r["ids"]]
    assert kept, [r["prompt"] for r in recs]
    for r in recs:
        assert (r["prompt"] is None) == (r["ids"] is None)
    for r in kept:
        ask = SD.chat_ids(tok, [{"role": "user", "content": r["prompt"]}])
        ids = np.asarray(r["ids"])
        assert r["start"] == len(ask) and np.array_equal(ids[:len(ask)], ask)
        assert len(ask) < len(ids) <= len(ask) + 12
        # the first 3 answer tokens are the target's greedy ones
        greedy = jspec.decode(model, [ask], max_new_tokens=3, eos_token_id=(EOS,))
        n = int(greedy.lengths[0])
        assert np.array_equal(ids[len(ask):len(ask) + n], greedy.tokens[0, :n])
    # the sampled rest is not the greedy continuation everywhere
    greedy_all = [jspec.decode(model, [np.asarray(r["ids"][:r["start"]])], max_new_tokens=12,
                               eos_token_id=(EOS,)) for r in kept]
    assert any(not np.array_equal(np.asarray(r["ids"][r["start"]:]), g.tokens[0, :g.lengths[0]])
               for r, g in zip(kept, greedy_all))

    part = tmp_path / "part.jsonl"
    SD.make(model, tok, str(part), n=4, max_new=12, greedy_first=3, chunk=4, seed=1)  # stopped after one chunk
    with open(part, "a") as f:
        f.write(json.dumps({**recs[4], "ids": recs[4]["ids"]}) + "\n" + '{"id": 5, "top')  # a torn second chunk
    again = SD.make(model, tok, str(part), n=6, max_new=12, greedy_first=3, chunk=4, seed=1)
    assert again == recs and part.read_text() == whole.read_text()
    seqs, starts = SD.sequences(again)
    assert len(seqs) == len(kept) and list(starts) == [r["start"] for r in kept]
