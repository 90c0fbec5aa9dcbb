"""The `jspec` command line: demo, convert (orbax), decode from HF and converted dirs."""
import json
import os

import numpy as np
import pytest

import jspec
from jspec.tools import cli
from provenance_check import assert_provenance


@pytest.mark.slow  # (each section's strategies are proven greedy == AR and exact elsewhere in the default run)
def test_demo_runs(tmp_path, capsys):
    """`jspec demo`'s quick path: long answers on the text pair with AR, Chain and the tree, greedy and sampled; the
    table has its columns and a row per (strategy, mode), every greedy row gives AR's tokens, the drafts are
    accepted, and the figure and the table are written."""
    from jspec.tools import demo

    lines = []
    res = demo.run(seed=3, out_dir=str(tmp_path), max_new_tokens=24, rounds=1, cache="off", print_fn=lines.append,
                   real=None)
    out = "\n".join(lines)
    assert out.count("Q: ") == 4 and "reference: " in out
    head = "| " + " | ".join(demo.COLUMNS) + " |"
    assert head == "| strategy | mode | tokens/s | tokens/step | speedup | same as AR | compile s |" and head in out
    (sec,) = res["sections"]
    r = sec["results"]
    assert {(n, m) for n in r for m in r[n]} == {("AR", "greedy"), ("AR", "sampled"), ("Chain gamma=5", "greedy"),
                                                  ("Chain gamma=5", "sampled"), ("Tree (9 drafts)", "greedy"),
                                                  ("Tree (9 drafts), guarded", "greedy")}
    assert r["Tree (9 drafts), guarded"]["greedy"]["same_as_ar"]
    for name in ("Chain gamma=5", "Tree (9 drafts)"):
        g = r[name]["greedy"]
        assert g["same_as_ar"] and g["tau"] > 2.0, (name, g["tau"])
        assert f"| {name} | greedy |" in out and out.count(f"| {name} |") == len(r[name])
    assert r["Chain gamma=5"]["sampled"]["same_as_ar"] is None and r["Chain gamma=5"]["sampled"]["tau"] > 2.0
    assert r["AR"]["greedy"]["lengths"].min() >= 20  # long answers: every row runs to the 24-token cap or near it
    assert {p.name for p in tmp_path.iterdir()} == {"demo-3.png", "demo-3.md", "demo-3.json"}
    assert head in (tmp_path / "demo-3.md").read_text()
    written = json.loads((tmp_path / "demo-3.json").read_text())  # the numbers, where they ran, how often
    assert_provenance(written["meta"]["provenance"])
    assert written["meta"]["rounds"] == 1
    chain = written["sections"][0]["rows"]["Chain gamma=5"]["greedy"]
    assert chain["tau"] == r["Chain gamma=5"]["greedy"]["tau"]
    assert len(chain["wall_runs_s"]) == 1 and chain["wall_s"] == chain["wall_runs_s"][0]
    with pytest.raises(SystemExit) as e:  # the command is wired
        cli.main(["demo", "--help"])
    assert e.value.code == 0 and "--seed" in capsys.readouterr().out


@pytest.mark.slow  # about 80 s: four SmolLM2 programs compiled (the demo itself is measured by `jspec demo`)
def test_demo_puts_the_real_model_first(tmp_path):
    """With the real model fetched, `jspec demo` runs it first (AR, prompt lookup, the EAGLE-3 head's chain,
    greedy), then the zoo's text pair; the headline names the real model's best greedy strategy, whose rows equal
    AR's, and its speedup as measured in that run."""
    from jspec.tools import demo, models

    if not models.available(demo.REAL_MODEL):
        pytest.skip(f"{demo.REAL_MODEL} is not fetched (`jspec fetch {demo.REAL_MODEL}`)")
    lines = []
    res = demo.run(seed=1, out_dir=str(tmp_path), max_new_tokens=16, rounds=1, cache="off", print_fn=lines.append)
    real, zoo = res["sections"]
    assert real["title"].startswith(demo.REAL_MODEL) and zoo["title"].startswith("text pair")
    r = real["results"]
    assert {(n, m) for n in r for m in r[n]} >= {("AR", "greedy"), ("PromptLookup gamma=4", "greedy"),
                                                  ("EAGLE-3 head, chain of 2", "greedy")}
    assert all(m == "greedy" for n in r for m in r[n])
    assert r["AR"]["greedy"]["lengths"].max() > 16  # the real section writes its own, longer answers
    name, best = demo.best_greedy(r)
    assert best["same_as_ar"] and res["headline"] == demo.headline(demo.Section(real["title"], *[None] * 5), r)
    assert f"{name} at {best['speedup']:.2f}x" in res["headline"] and res["headline"] in lines
    assert (tmp_path / "demo-1.png").exists()


def test_drafted_mask():
    """The figure's strip: the prefill's token and each step's last token are the target's, the rest drafts."""
    from jspec.tools.demo import drafted_mask

    assert drafted_mask([3, 1, 2], 7).tolist() == [False, True, True, False, False, True, False]
    assert drafted_mask([3, 1, 2], 4).tolist() == [False, True, True, False]
    with pytest.raises(ValueError, match="account for 7 tokens"):
        drafted_mask([3, 1, 2], 8)


def test_convert_then_decode(llama_pair, tmp_path, capsys):
    hf, model = llama_pair
    hf.save_pretrained(str(tmp_path / "hf"))
    assert cli.main(["convert", str(tmp_path / "hf"), str(tmp_path / "orbax")]) == 0
    capsys.readouterr()
    ref = jspec.decode(model, np.array([3, 1, 4, 1, 5]), max_new_tokens=6).tokens[0].tolist()
    for src in ("hf", "orbax"):
        assert cli.main(["decode", "--model", str(tmp_path / src), "--prompt-ids", "3,1,4,1,5",
                         "--max-new-tokens", "6"]) == 0
        line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("{")][-1]
        assert json.loads(line)["tokens"] == ref


def test_decode_text_prompt_with_tokenizer(llama_pair, tmp_path, capsys):
    """`--prompt` text goes through the checkpoint dir's tokenizer, and the output is decoded back to text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    hf, model = llama_pair
    vocab = {f"w{i}": i for i in range(101)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(str(tmp_path))
    hf.save_pretrained(str(tmp_path))
    assert cli.main(["decode", "--model", str(tmp_path), "--prompt", "w3 w1 w4", "--max-new-tokens", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    toks = json.loads(lines[-1])["tokens"]
    assert toks == jspec.decode(model, np.array([3, 1, 4]), max_new_tokens=5).tokens[0].tolist()
    assert lines[0].split() == [f"w{t}" for t in toks if t != 0]  # the streamed text, then the closing line and the JSON
    assert lines[1].startswith("[jspec] 5 tokens in ") and "tokens per target step" in lines[1]


def _word_tokenizer(path, template=None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(101)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(str(path))


def test_decode_speculates_streams_and_reports_acceptance(llama_pair, tmp_path, capsys):
    """`jspec decode --draft D --strategy chain|tree|pld` gives AR's tokens, streams the text piece by piece and
    closes with the throughput, tokens per step and acceptance; a strategy without the draft it needs is refused."""
    hf, model = llama_pair
    _word_tokenizer(tmp_path)
    hf.save_pretrained(str(tmp_path))
    ref = jspec.decode(model, np.array([3, 1, 4, 1, 5]), max_new_tokens=12).tokens[0].tolist()
    for extra in (["--draft", str(tmp_path)], ["--draft", str(tmp_path), "--strategy", "tree", "--tree",
                                                "[[0], [1], [0, 0]]"], ["--strategy", "pld", "--gamma", "3"]):
        assert cli.main(["decode", "--model", str(tmp_path), "--prompt", "w3 w1 w4 w1 w5", "--max-new-tokens", "12",
                         "--every", "1", *extra]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert json.loads(lines[-1])["tokens"] == ref, extra
        assert lines[0].split() == [f"w{t}" for t in ref if t != 0]  # w0: the unknown token, a special one
        assert "acceptance" in lines[1]
        if "--strategy" not in extra:  # a chain of the model drafting for itself: every draft is accepted (the last
            # round's are cut at max_new_tokens, and count as rejected)
            assert float(lines[1].rsplit("acceptance ", 1)[1]) > 0.8 and json.loads(lines[-1])["tokens_per_step"] > 2
    with pytest.raises(SystemExit, match="needs --draft"):
        cli.main(["decode", "--model", str(tmp_path), "--prompt-ids", "3,1", "--strategy", "sage"])
    with pytest.raises(SystemExit, match="takes no --draft"):
        cli.main(["decode", "--model", str(tmp_path), "--prompt-ids", "3,1", "--draft", str(tmp_path),
                  "--strategy", "pld"])


def test_decode_guarded_and_costs(llama_pair, tmp_path, capsys, monkeypatch):
    """`jspec costs` prints a strategy's round costs per depth and writes the plot; `jspec decode --guard` measures
    them on first use, gives AR's tokens and says how often it speculated; AR cannot be guarded."""
    monkeypatch.setenv("JSPEC_COSTS_DIR", str(tmp_path / "costs"))
    hf, model = llama_pair
    hf.save_pretrained(str(tmp_path))
    ref = jspec.decode(model, np.array([3, 1, 4, 1, 5]), max_new_tokens=10).tokens[0].tolist()
    png = tmp_path / "c.png"
    assert cli.main(["costs", "--model", str(tmp_path), "--draft", str(tmp_path), "--gamma", "2", "--batch", "1",
                     "--prompt-len", "8", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "AR step" in out and out.count(" | ") >= 3 * 3 and png.exists()  # depths 0, 1, 2
    assert cli.main(["decode", "--model", str(tmp_path), "--draft", str(tmp_path), "--gamma", "2", "--guard",
                     "--prompt-ids", "3,1,4,1,5", "--max-new-tokens", "10"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert json.loads(lines[-1])["tokens"] == ref and "speculated in" in lines[-2]
    with pytest.raises(SystemExit, match="--guard needs a speculative"):
        cli.main(["decode", "--model", str(tmp_path), "--guard", "--prompt-ids", "3,1"])


def test_chat_holds_two_turns(llama_pair, tmp_path, capsys):
    """`jspec chat`: each line is a user turn wrapped in the chat template with the conversation so far; replies
    stream; an empty line ends the session."""
    import io

    from jspec.tools.cli import generate as CG

    hf, model = llama_pair
    _word_tokenizer(tmp_path, "{% for m in messages %}{{ m['content'] }} {% endfor %}")
    hf.save_pretrained(str(tmp_path))
    p = cli.argparse.ArgumentParser()
    CG.add_args(p, chat=True)
    args = p.parse_args(["--model", str(tmp_path), "--draft", str(tmp_path), "--max-new-tokens", "4"])
    assert CG.cmd_chat(args, io.StringIO("w3 w1\nw4\n\n")) == 0
    out = capsys.readouterr().out
    first = jspec.decode(model, np.array([3, 1]), max_new_tokens=4).tokens[0].tolist()
    reply1 = " ".join(f"w{t}" for t in first if t != 0)
    second = jspec.decode(model, np.array([3, 1] + first + [4]), max_new_tokens=4).tokens[0].tolist()
    assert out.count("[jspec] 4 tokens") == 2
    assert reply1 in out and " ".join(f"w{t}" for t in second if t != 0) in out


@pytest.mark.slow
def test_demo_video_runs(tmp_path):
    """`jspec demo video`: the video pair with AR, the unpruned tree, SpecVLM and Self-SD at 90% pruning; every
    strategy gives AR's tokens greedy, and the frame strips and the figure are written."""
    from jspec.tools import demo

    lines = []
    res = demo.run_video(seed=5, out_dir=str(tmp_path), max_new_tokens=24, rounds=1, cache="off",
                         print_fn=lines.append)
    assert "\n".join(lines).count("Q: ") == 2
    assert {p.name for p in tmp_path.iterdir()} == {"clips-5.png", "video-5.png"}
    for name, by_mode in res["results"].items():
        g = by_mode["greedy"]
        assert g["same_as_ar"], name
        assert name == "AR" or g["tau"] > 1.5, (name, g["tau"])


def test_no_pytorch_advisory_without_pytorch():
    """Without PyTorch, transformers announces "PyTorch was not found" on import; jspec does not need it for the
    tokenizers and processors it reads, and silences it (the control run, without jspec, shows the notice)."""
    import subprocess
    import sys

    def stderr(first: str) -> str:
        code = f"import sys; sys.modules['torch'] = None\n{first}\nimport transformers\n"
        quiet = ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "TRANSFORMERS_VERBOSITY")  # conftest sets the latter
        env = {k: v for k, v in os.environ.items() if k not in quiet}
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stderr

    assert "PyTorch was not found" in stderr("pass")
    assert "PyTorch was not found" not in stderr("import jspec")


def test_decode_an_image_prompt_through_the_models_processor(tmp_path, capsys):
    """`--image` goes through the processor saved beside a LLaVA-1.5 checkpoint; with a VLM draft the tokens are
    those of jspec.decode on what the processor returns."""
    import transformers
    from PIL import Image
    from tokenizers import Tokenizer, models, pre_tokenizers

    import ports
    from test_llava import IMG, PATCHES, V, tiny_llava

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(IMG)} | {"<image>": IMG}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    fast.add_special_tokens({"additional_special_tokens": ["<image>"]})
    ip = transformers.CLIPImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    proc = transformers.LlavaProcessor(image_processor=ip, tokenizer=fast, patch_size=7, image_token="<image>",
                                       vision_feature_select_strategy="default", num_additional_image_tokens=1)
    tiny_llava(0).save_pretrained(str(tmp_path))
    proc.save_pretrained(str(tmp_path))
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    batch = proc(text=["w1 w7 <image> w2 w3"], images=[Image.open(tmp_path / "a.png").convert("RGB")],
                 return_tensors="np")
    assert int((batch["input_ids"] == IMG).sum()) == PATCHES and V == IMG + 1
    model = ports.load_hf(str(tmp_path))
    ref = jspec.decode(model, {"input_ids": batch["input_ids"], "pixel_values": batch["pixel_values"]},
                       max_new_tokens=6).tokens[0].tolist()
    assert cli.main(["decode", "--model", str(tmp_path), "--draft", str(tmp_path), "--image", str(tmp_path / "a.png"),
                     "--prompt", "w1 w7 <image> w2 w3", "--max-new-tokens", "6", "--gamma", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert json.loads(lines[-1])["tokens"] == ref
    tiny_llava(0).save_pretrained(str(tmp_path / "bare"))  # no processor beside it
    with pytest.raises(SystemExit, match="needs a processor .* in .*bare"):
        cli.main(["decode", "--model", str(tmp_path / "bare"), "--image", str(tmp_path / "a.png"), "--prompt", "w1"])
