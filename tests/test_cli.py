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
