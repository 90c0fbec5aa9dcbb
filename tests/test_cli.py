"""The `jspec` command line: demo, convert (orbax), decode from HF and converted dirs."""
import json
import os

import numpy as np
import pytest

import jspec
from jspec import cli


def test_demo_runs(tmp_path, capsys):
    """`jspec demo` answers with the shipped pair: every strategy gives AR's tokens, the drafts are accepted, and the
    image and the plot are written."""
    from jspec import demo

    lines = []
    res = demo.run(seed=3, out_dir=str(tmp_path), max_new_tokens=16, print_fn=lines.append)
    out = "\n".join(lines)
    assert out.count("Q: ") == 2 and "reference: " in out and "Chain gamma=5" in out and "Tree (9 drafts)" in out
    assert {p.name for p in tmp_path.iterdir()} == {"scenes-3.png", "accepted-3.png"}
    r = res["results"]
    for name in ("Chain gamma=5", "Tree (9 drafts)"):
        assert r[name]["same_as_ar"] and r[name]["mean_accepted"] > 1.5, (name, r[name])
    assert r["AR"]["answers"] == r["Chain gamma=5"]["answers"] and all(r["AR"]["answers"])
    with pytest.raises(SystemExit) as e:  # the command is wired
        cli.main(["demo", "--help"])
    assert e.value.code == 0 and "--seed" in capsys.readouterr().out


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
    toks = json.loads([l for l in lines if l.startswith("{")][-1])["tokens"]
    assert toks == jspec.decode(model, np.array([3, 1, 4]), max_new_tokens=5).tokens[0].tolist()
    assert lines[-1].split() == [f"w{t}" for t in toks]


@pytest.mark.slow
def test_demo_video_runs(tmp_path):
    """`jspec demo video`: the video pair with AR, the unpruned tree, SpecVLM and Self-SD at 90% pruning; every
    strategy gives AR's tokens, and the frame strips and the plot are written."""
    from jspec import demo

    lines = []
    res = demo.run_video(seed=5, out_dir=str(tmp_path), max_new_tokens=24, print_fn=lines.append)
    assert "\n".join(lines).count("Q: ") == 2
    assert {p.name for p in tmp_path.iterdir()} == {"clips-5.png", "video-accepted-5.png"}
    for name, r in res["results"].items():
        assert r["same_as_ar"], name
        assert name == "AR" or r["mean_accepted"] > 1.5, (name, r["mean_accepted"])


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
