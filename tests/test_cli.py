"""The `jspec` command line: demo, convert (orbax), decode from HF and converted dirs."""
import json

import numpy as np

import jspec
from jspec import cli


def test_demo_runs(capsys):
    assert cli.main(["demo", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "loaded back through load_hf" in out and "tokens/s" in out


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
