"""Training data a chat model writes itself, for the drafter heads trained on it (EESD, EAGLE): prompts it was
asked to write, then its answers to them, drawn as EESD draws self-distillation data.

1. Prompts: for each seed (a topic of `TOPICS` and a kind of request of `KINDS`, none taken from Spec-Bench), the
   model is asked through its chat template to write one user message of that kind about that topic, sampled at
   `prompt_temperature`; the cleaned text is the prompt (`clean`: one that comes out too short is dropped).
2. Answers: each prompt through the chat template, the first `greedy_first` tokens greedy and the rest sampled at
   T = 1 (`jspec.tools.train.eesd.self_distillation_texts`, the LLM-QAT hybrid), up to `max_new` tokens or EOS.

`make` works in chunks of `chunk` seeds and appends each finished chunk to a JSON-lines file, one record per seed:
{"id", "topic", "kind", "prompt" (None when dropped), "ids" (chat prompt + answer token ids), "start" (where the
answer begins)}. A stopped run resumes at its first unfinished chunk, and a chunk's draws depend only on the seed
and the chunk's index, so a resumed file equals an uninterrupted one.
"""
from __future__ import annotations

import json
import os
from typing import Callable

import numpy as np

TOPICS = (
    "volcanoes", "baking bread", "the water cycle", "chess openings", "saving money", "learning a new language",
    "honeybees", "electric cars", "the Roman Empire", "photosynthesis", "marathon training", "houseplants",
    "black holes", "coffee brewing", "public libraries", "recycling plastic", "the human heart", "jazz music",
    "job interviews", "rainforests", "cloud computing", "ancient Egypt", "sleep", "bicycles", "the moon",
    "vaccines", "composting", "the stock market", "earthquakes", "dinosaurs", "video games", "time management",
    "the printing press", "solar panels", "octopuses", "writing a resume", "glaciers", "the Olympic games",
    "friendship", "spreadsheets", "mushrooms", "renting an apartment", "the Internet", "bridges", "vitamins",
    "camping", "the French Revolution", "wind turbines", "penguins", "budget travel", "painting with watercolors",
    "climate change", "password security", "the Silk Road", "gardening in small spaces", "sharks", "meditation",
    "traffic lights", "chocolate", "the periodic table", "raising a puppy", "deserts", "smartphones",
    "the immune system", "origami", "public speaking", "trains", "coral reefs", "first aid", "the Renaissance",
    "tea", "robots", "hiking safety", "the solar system", "making pasta", "online shopping", "whales",
    "the history of money", "yoga", "3D printing", "rivers", "board games", "the brain", "fireworks",
    "starting a small business", "maps", "the Great Wall of China", "batteries", "birdwatching", "recipes for soup",
    "email etiquette", "magnets", "the ocean tides", "museums", "running a meeting", "spiders", "cheese making",
    "the Moon landing", "weather forecasts", "kindness", "sorting algorithms", "airplanes", "pottery",
)
KINDS = {
    "question": "Write one question that a curious person might ask about {topic}. Reply with the question only.",
    "howto": "Write one request for step-by-step instructions about {topic}. Reply with the request only.",
    "explain": "Write one request asking for a simple explanation of something about {topic}. Reply with the "
               "request only.",
    "writing": "Write one request for a short piece of writing (a letter, a story or a poem) about {topic}. Reply "
               "with the request only.",
    "math": "Write one short math word problem about {topic}. Reply with the problem only.",
    "compare": "Write one question asking to compare two things related to {topic}. Reply with the question only.",
    "advice": "Write one request for practical advice about {topic}. Reply with the request only.",
    "summary": "Write a paragraph of four sentences about {topic}. Then, on a new line, ask for a one-sentence "
               "summary of that paragraph.",
}
MIN_PROMPT_CHARS = 12


def seeds(n: int, seed: int = 0) -> list[dict]:
    """The first n (topic, kind) seeds in a fixed shuffled order (each pair once before any repeats)."""
    pairs = [(t, k) for t in TOPICS for k in KINDS]
    order = np.random.default_rng(seed).permutation(len(pairs))
    return [{"id": i, "topic": pairs[order[i % len(pairs)]][0], "kind": pairs[order[i % len(pairs)]][1]}
            for i in range(n)]


def clean(text: str) -> str | None:
    """A written prompt as the user message: whitespace and wrapping quotes stripped, a leading "Question:" or
    "Request:" label dropped; None when fewer than MIN_PROMPT_CHARS characters remain."""
    t = text.strip()
    for label in ("Question:", "Request:", "Problem:", "Prompt:"):
        if t.lower().startswith(label.lower()):
            t = t[len(label):].strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "\"'":
        t = t[1:-1].strip()
    return t if len(t) >= MIN_PROMPT_CHARS else None


def chat_ids(tokenizer, messages: list[dict]) -> np.ndarray:
    """The chat template's token ids for `messages`, ready for the assistant's answer."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return np.asarray(ids, np.int32).reshape(-1)


def write_prompts(model, tokenizer, batch: list[dict], key, max_new: int = 96, temperature: float = 0.7,
                  pad_prompt_to: int = 16) -> list[str | None]:
    """The model's written prompt for each seed of `batch` (`clean`ed; None when dropped)."""
    import jspec
    from jspec.api import eos_ids

    asks = [chat_ids(tokenizer, [{"role": "user", "content": KINDS[s["kind"]].format(topic=s["topic"])}])
            for s in batch]
    out = jspec.decode(model, asks, max_new_tokens=max_new, temperature=temperature, key=key,
                       eos_token_id=eos_ids(model, tokenizer.eos_token_id), pad_prompt_to=pad_prompt_to)
    return [clean(tokenizer.decode(out.tokens[b, :out.lengths[b]], skip_special_tokens=True))
            for b in range(len(batch))]


def read(path: str) -> list[dict]:
    """The records of a data file (a torn last line, from a stopped write, is ignored)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return out


def make(model, tokenizer, path: str, n: int, max_new: int = 256, greedy_first: int = 4, chunk: int = 16,
         seed: int = 0, prompt_temperature: float = 0.7, progress: Callable[[int, int], None] | None = None,
         pad_prompt_to: int = 16) -> list[dict]:
    """Writes (or completes) the n-seed data file at `path` (module docstring) and returns its records. Every
    chunk decodes as a batch of `chunk` rows (a dropped prompt's row is filled with another row's and discarded)
    and pads prompts to a multiple of `pad_prompt_to`, so that chunks share compiled programs; a row's tokens do
    not depend on the rows beside it."""
    import jax

    from jspec.api import eos_ids
    from jspec.tools.train.eesd import self_distillation_texts

    have = read(path)
    present = {r["id"] for r in have}
    todo = seeds(n, seed)
    chunks = [todo[i:i + chunk] for i in range(0, n, chunk)]
    done = {s["id"] for c in chunks if all(s["id"] in present for s in c) for s in c}
    records = [r for r in have if r["id"] in done]
    if len(records) != len(have):  # a torn chunk, or a file of another n or chunk size: keep whole chunks only
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    key = jax.random.key(seed)
    for ci, c in enumerate(chunks):
        if c[0]["id"] in done:
            continue
        ck = jax.random.fold_in(key, ci)
        prompts = write_prompts(model, tokenizer, c, jax.random.fold_in(ck, 0), temperature=prompt_temperature,
                                pad_prompt_to=pad_prompt_to)
        live = [i for i, p in enumerate(prompts) if p is not None]
        asks = [chat_ids(tokenizer, [{"role": "user", "content": prompts[i]}]) for i in live]
        fill = asks + asks[-1:] * (len(c) - len(asks)) if asks else []
        seqs = self_distillation_texts(model, fill, max_new, greedy_first, key=jax.random.fold_in(ck, 1),
                                       eos_token_id=eos_ids(model, tokenizer.eos_token_id), batch_size=len(fill) or 1,
                                       progress=False, pad_prompt_to=pad_prompt_to)[:len(asks)] if asks else []
        got = dict(zip(live, zip(asks, seqs)))
        new = []
        for i, s in enumerate(c):
            rec = {**s, "prompt": prompts[i], "ids": None, "start": None}
            if i in got:
                ask, seq = got[i]
                rec.update(ids=[int(x) for x in seq], start=len(ask))
            new.append(rec)
        with open(path, "a") as f:  # one write per chunk
            f.write("".join(json.dumps(r) + "\n" for r in new))
            f.flush()
            os.fsync(f.fileno())
        records += new
        if progress is not None:
            progress(sum(len(x) for x in chunks[:ci + 1]), n)
    return sorted(records, key=lambda r: r["id"])


def sequences(records: list[dict]) -> tuple[list[np.ndarray], np.ndarray]:
    """(token sequences, where each answer starts) of the records that have an answer, for `eesd_train.pack`."""
    kept = [r for r in records if r.get("ids")]
    return [np.asarray(r["ids"], np.int32) for r in kept], np.asarray([r["start"] for r in kept], np.int64)


__all__ = ["KINDS", "TOPICS", "chat_ids", "clean", "make", "read", "seeds", "sequences", "write_prompts"]
