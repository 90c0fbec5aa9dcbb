"""GGUF (llama.cpp) checkpoints through `ports`: tiny random LLaMAs, Qwen2s, Qwen3s and Qwen3-MoEs written as GGUF
files the way llama.cpp's converter writes them (its metadata keys, tensor names and Q/K row order, each tensor type
we claim), read by `ports.load_gguf` and compared with transformers on the same dequantized weights and with
transformers' own GGUF loader; bad files fail early with a message naming the problem."""
import functools
import json
import os

import gguf
import numpy as np
import pytest
import torch
import transformers
from conftest import hf_logits, perturb, tiny_hf

import jspec
import ports
from jspec.tools import cli
from ports.io import gguf as GF

T = gguf.GGMLQuantizationType
PROMPT = np.array([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]])
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # gguf.quants.quantize writes these
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")  # gguf cannot quantize to these: random blocks instead
NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp"}


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for Q/K, written from its description (not from our inverse): within
    each head it interleaves the two rotary halves, rows (0, d/2, 1, d/2 + 1, ...)."""
    d = w.shape[0] // n_heads
    pairs = np.stack([np.arange(d // 2), np.arange(d // 2) + d // 2], axis=1).reshape(-1)
    return w[np.concatenate([h * d + pairs for h in range(n_heads)])]


def encode(w: np.ndarray, qtype: str, rng) -> np.ndarray:
    """A 2-D HF-layout weight as the stored rows of `qtype` (float rows, or uint8 block rows)."""
    if qtype == "F32":
        return w.astype(np.float32)
    if qtype == "F16":
        return w.astype(np.float16)
    if qtype in K_TYPES:  # bytes < 0x20: every f16 scale in a block is small and finite
        block, size = gguf.GGML_QUANT_SIZES[T[qtype]]
        return rng.integers(0, 0x20, (w.shape[0], w.shape[1] // block * size), dtype=np.uint8)
    return gguf.quants.quantize(w.astype(np.float32), T[qtype])


def gguf_tensors(hf_model) -> list[tuple[str, np.ndarray]]:
    """(llama.cpp name, HF-layout array) of every tensor of an HF LlamaForCausalLM or Qwen2ForCausalLM (whose Q/K/V
    biases are "blk.N.attn_q.bias", ...), in llama.cpp's order; a Qwen3MoeForCausalLM's fused experts as
    llama.cpp's `Qwen2MoeModel` stacks them, ffn_down_exps [E, D, F], ffn_gate_exps and ffn_up_exps [E, F, D]."""
    sd = {k: v.detach().numpy() for k, v in hf_model.state_dict().items()}
    out = [("token_embd.weight", sd["model.embed_tokens.weight"])]
    for i in range(hf_model.config.num_hidden_layers):
        for h, g in NAMES.items():
            out += [(f"blk.{i}.{g}.{kind}", sd[f"model.layers.{i}.{h}.{kind}"]) for kind in ("weight", "bias")
                    if f"model.layers.{i}.{h}.{kind}" in sd]
        if f"model.layers.{i}.mlp.experts.down_proj" in sd:
            gate_up = sd[f"model.layers.{i}.mlp.experts.gate_up_proj"]
            F = gate_up.shape[1] // 2
            out += [(f"blk.{i}.ffn_down_exps.weight", sd[f"model.layers.{i}.mlp.experts.down_proj"]),
                    (f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :F]), (f"blk.{i}.ffn_up_exps.weight", gate_up[:, F:])]
    out.append(("output_norm.weight", sd["model.norm.weight"]))
    if not hf_model.config.tie_word_embeddings:
        out.append(("output.weight", sd["lm_head.weight"]))
    return out


def write_gguf(path, hf_model, qtype="F32", *, arch="llama", permute=None, drop=(), extra=(), tokenizer=None,
               seed=0) -> dict:
    """Write `hf_model` as llama.cpp would (metadata, names, Q/K row order; 2-D tensors in `qtype`, norms and
    biases F32); returns {HF name: the HF-layout weight the file holds, dequantized} (a reference model loads these).
    As convert_hf_to_gguf.py: `LlamaModel` adds rope.dimension_count and vocab_size to the common keys and permutes
    Q/K rows; `Qwen2Model` (arch "qwen2") adds neither (the vocabulary size is the tokenizer's) and does not
    permute; `Qwen3Model` (arch "qwen3", a `Qwen2Model`) adds the head size as key_length / value_length (the
    common keys' `head_dim`); `Qwen3MoeModel` (arch "qwen3moe", a `Qwen2MoeModel`) also the expert counts and
    width, and keeps the router F32. `drop` also drops metadata keys ("qwen3moe.expert_count")."""
    c, rng = hf_model.config, np.random.default_rng(seed)
    permute = arch == "llama" if permute is None else permute
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    if arch not in ("qwen2", "qwen3"):
        w.add_rope_dimension_count(c.head_dim)
        w.add_vocab_size(c.vocab_size)
    if arch in ("qwen3", "qwen3moe"):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if arch == "qwen3moe":
        for k, v in (("expert_count", c.num_experts), ("expert_used_count", c.num_experts_per_tok),
                     ("expert_feed_forward_length", c.moe_intermediate_size)):
            if f"qwen3moe.{k}" not in drop:
                getattr(w, f"add_{k}")(v)
    if tokenizer:
        tokenizer(w)
    held, heads = {}, {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}
    for name, arr in gguf_tensors(hf_model):
        if name in drop:
            continue
        rows = encode(arr, qtype, rng) if arr.ndim >= 2 and "ffn_gate_inp" not in name else arr.astype(np.float32)
        raw = None if rows.dtype != np.uint8 else T[qtype]
        key = GF.hf_name(name)
        value = gguf.quants.dequantize(rows, raw or (T.F16 if rows.dtype == np.float16 else T.F32))
        held[key] = np.concatenate([held[key], value], axis=1) if key in held else value  # gate, then up experts
        kind = name.split(".")[2] if name.startswith("blk.") else None
        if permute and kind in heads and name.endswith(".weight"):
            rows = llama_cpp_permute(rows, heads[kind])
        w.add_tensor(name, rows, raw_dtype=raw)
    for name, rows, raw in extra:
        w.add_tensor(name, rows, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def reference(hf_model, held: dict):
    """A copy of `hf_model` holding the weights `write_gguf` says the file holds."""
    ref = type(hf_model)(hf_model.config).eval()
    ref.load_state_dict({k: torch.tensor(np.asarray(v, np.float32)) for k, v in held.items()}, strict=False)
    if hf_model.config.tie_word_embeddings:
        ref.tie_weights()
    return ref


def assert_close(ours, ref, rel=1e-5):
    assert np.abs(ours - ref).max() <= rel * np.abs(ref).max(), np.abs(ours - ref).max()


@pytest.fixture(scope="module")
def tiny():
    """A tiny GQA LLaMA (4 heads, 2 KV heads) with untied head and every norm perturbed."""
    return perturb(tiny_hf("llama", seed=3), seed=4, scale=0.3)


@pytest.fixture(scope="module")
def tiny_k():
    """Rows of 256, the K-quants' block size; tied embeddings."""
    return perturb(tiny_hf("llama", seed=5, hidden_size=256, intermediate_size=256, tie_word_embeddings=True),
                   seed=6, scale=0.3)


@pytest.fixture(scope="module")
def f32_file(tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"
    write_gguf(path, tiny)
    return path


@pytest.mark.parametrize("qtype", ("F32", "F16", "BF16") + BLOCK_TYPES)
def test_quant_types_match_transformers(tiny, tmp_path, qtype):
    """Every float and block type: the logits of transformers on the weights the file holds (dequantized)."""
    held = write_gguf(tmp_path / "m.gguf", tiny, qtype)
    model = ports.load_gguf(str(tmp_path / "m.gguf"))
    assert model.config.num_kv_heads == 2 and not model.config.tie_word_embeddings
    assert_close(ports.logits(model, PROMPT), hf_logits(reference(tiny, held), PROMPT))


@pytest.mark.parametrize("qtype", K_TYPES)
def test_k_quants_match_transformers(tiny_k, tmp_path, qtype):
    """K-quant blocks (random bytes, small scales): the same, tied embeddings (no output.weight)."""
    held = write_gguf(tmp_path / "m.gguf", tiny_k, qtype)
    model = ports.load_gguf(str(tmp_path / "m.gguf"))
    assert model.config.tie_word_embeddings and "lm_head" not in model.params
    assert_close(ports.logits(model, PROMPT), hf_logits(reference(tiny_k, held), PROMPT))


def test_matches_transformers_gguf_loader(tiny, f32_file, tmp_path):
    """transformers' own GGUF loader (its config mapping and its Q/K inverse) on the same F32 and Q8_0 files."""
    write_gguf(tmp_path / "q8.gguf", tiny, "Q8_0")
    for path in (f32_file, tmp_path / "q8.gguf"):
        theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
        assert_close(ports.logits(ports.load_gguf(str(path)), PROMPT), hf_logits(theirs, PROMPT))
    assert_close(ports.logits(ports.load_gguf(str(f32_file)), PROMPT), hf_logits(tiny, PROMPT))


def test_rope_permutation_is_undone(tiny, f32_file, monkeypatch):
    """The Q/K rows go back to HF's order: the inverse of llama.cpp's permutation (for Q's 4 heads and K's 2), and
    skipping it changes the logits."""
    w = np.arange(32 * 3).reshape(32, 3)
    for heads in (4, 2, 1):
        np.testing.assert_array_equal(GF.unpermute_rope_rows(llama_cpp_permute(w, heads), heads), w)
    ref = hf_logits(tiny, PROMPT)
    monkeypatch.setattr(GF, "unpermute_rope_rows", lambda w, heads: w)
    skipped = ports.logits(ports.load_gguf(str(f32_file)), PROMPT)
    assert np.abs(skipped - ref).max() > 0.05 * np.abs(ref).max()


def test_config_and_save_hf_round_trip(tiny, f32_file, tmp_path):
    """The metadata becomes an HF LlamaConfig dict; `save_hf` of the loaded model is a checkpoint transformers
    loads with the same logits; `convert_gguf` writes a jspec checkpoint `ports.load` reads."""
    hf = ports.gguf_to_hf_config(str(f32_file))
    c = tiny.config
    assert hf["model_type"] == "llama" and hf["num_key_value_heads"] == 2 and hf["tie_word_embeddings"] is False
    assert (hf["hidden_size"], hf["intermediate_size"], hf["num_hidden_layers"], hf["vocab_size"], hf["head_dim"]) == \
        (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size, c.head_dim)
    assert hf["rope_theta"] == c.rope_parameters["rope_theta"] and hf["rms_norm_eps"] == pytest.approx(c.rms_norm_eps)
    model = ports.load_gguf(str(f32_file))
    ports.save_hf(model, str(tmp_path / "hf"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert_close(hf_logits(back, PROMPT), hf_logits(tiny, PROMPT))
    cfg, n = ports.convert_gguf(str(f32_file), str(tmp_path / "jspec"))
    assert n == model.num_params and cfg == model.config
    assert_close(ports.logits(ports.load(str(tmp_path / "jspec")), PROMPT), hf_logits(tiny, PROMPT))


def test_bad_files_fail_early(tiny, f32_file, tmp_path, monkeypatch):
    """Not GGUF, truncated (header or data), another architecture, an unsupported or unknown tensor type, and
    missing / unexpected / mis-shaped tensors: each a ValueError naming the problem, raised before anything is
    dequantized."""
    calls = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: calls.append(a) or real(*a))
    data = f32_file.read_bytes()

    def fails(name, content, match):
        p = tmp_path / name
        if content is not None:
            p.write_bytes(content)
        calls.clear()
        with pytest.raises(ValueError, match=match):
            ports.load_gguf(str(p))
        assert calls == [], name

    fails("text.gguf", b"this is not a gguf file at all", r"text\.gguf: not a GGUF file")
    fails("empty.gguf", b"", r"empty\.gguf: not a GGUF file")
    fails("cut-header.gguf", data[:200], r"cut-header\.gguf: not a GGUF file, or truncated")
    fails("cut-data.gguf", data[:len(data) - 1000], r"cut-data\.gguf: (truncated|not a GGUF file, or truncated)")
    write_gguf(tmp_path / "phi.gguf", tiny, arch="phi3")
    fails("phi.gguf", None,
          r"phi\.gguf: GGUF architecture 'phi3' is not supported; jspec reads llama, qwen2, qwen3, qwen3moe$")
    rows = np.random.default_rng(0).integers(0, 0x20, (4, 2 * 18), dtype=np.uint8)  # IQ4_NL blocks of 32
    write_gguf(tmp_path / "iq4.gguf", tiny, extra=[("blk.0.extra.weight", rows, T.IQ4_NL)])
    fails("iq4.gguf", None, r"unsupported ggml types \(1\).*blk\.0\.extra\.weight: IQ4_NL")
    name = b"blk.1.ffn_up.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8  # after the name: n_dims (u32), 2 dims (u64), then the type
    fails("unknown.gguf", data[:at] + (99).to_bytes(4, "little") + data[at + 4:],
          r"tensor blk\.1\.ffn_up\.weight: unknown ggml type id 99")
    write_gguf(tmp_path / "keys.gguf", tiny, drop=("blk.1.ffn_up.weight",),
               extra=[("blk.0.attn_q.bias", np.zeros(64, np.float32), None)])
    fails("keys.gguf", None, r"(?s)missing keys \(1\).*blk\.1\.ffn_up\.weight.*unexpected keys \(1\).*attn_q\.bias")
    write_gguf(tmp_path / "shape.gguf", tiny, drop=("output.weight",),
               extra=[("output.weight", np.zeros((7, 64), np.float32), None)])
    fails("shape.gguf", None, r"wrong shapes \(1\).*output\.weight: checkpoint \(7, 64\), expected \(101, 64\)")


def tiny_tokenizer(w, pre="default"):
    """A byte-level BPE vocabulary (GPT-2 style: 256 byte symbols, a few merges, two control tokens) and a chat
    template, as llama.cpp writes one (`pre`: its pre-tokenizer name, "qwen2" for Qwen2's)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r"]
    tokens = symbols + [m.replace(" ", "") for m in merges] + ["<|im_start|>", "<|im_end|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory):
    """A tiny model (vocabulary 264) in a GGUF that holds a tokenizer."""
    path = tmp_path_factory.mktemp("gguf-tok") / "tok.gguf"
    model = tiny_hf("llama", seed=7, vocab_size=264, eos_token_id=263, bos_token_id=262)
    write_gguf(path, model, tokenizer=tiny_tokenizer)
    return path, model


def test_tokenizer_matches_transformers(tok_file, f32_file):
    """`tokenizer_from_gguf` (no torch) encodes, decodes and applies the chat template as transformers'
    `AutoTokenizer.from_pretrained(dir, gguf_file=...)` does."""
    path, _ = tok_file
    ours = ports.tokenizer_from_gguf(str(path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in ("hello world", "hello, hello\nworld!", "<|im_start|>user\nhello<|im_end|>"):
        assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    chat = [{"role": "user", "content": "hello world"}]
    ids = ours.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    assert ids == theirs.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    assert ours.decode(ids).startswith("<|im_start|>user\nhello world<|im_end|>")
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")
    with pytest.raises(ValueError, match=r"tiny-f32\.gguf: holds no tokenizer"):
        ports.tokenizer_from_gguf(str(f32_file))


def test_tokenizer_keys_and_older_transformers(tok_file, monkeypatch):
    """The tokenizer key table is transformers' (where it has one); where a transformers version keeps the converter
    at `integrations.ggml` (5.17: the GPU machine's) the tokenizer is built from there, with the file's special
    tokens winning over the converter's extra kwargs; with neither, the error names the version."""
    import sys
    import transformers.integrations.ggml as ggml
    from transformers.integrations.gguf import gguf_tokenizer_mapping as new

    assert GF.TOKENIZER_KEYS == new.GGUF_TOKENIZER_MAPPING
    path, _ = tok_file
    text = "hello, hello\nworld!"
    expected = ports.tokenizer_from_gguf(str(path))(text)["input_ids"]
    real = new.convert_gguf_tokenizer
    seen = []

    def old_style(arch, vocab):  # as 5.17's converter: its kwargs repeat a special token, with another value
        seen.append(arch)
        backend, extra = real(arch, vocab)
        return backend, {**extra, "eos_token": "<unk>"}

    monkeypatch.setitem(sys.modules, "transformers.integrations.gguf.gguf_tokenizer_mapping", None)
    monkeypatch.setattr(ggml, "convert_gguf_tokenizer", old_style, raising=False)
    tok = ports.tokenizer_from_gguf(str(path))
    assert seen == ["llama"] and tok(text)["input_ids"] == expected and tok.eos_token == "<|im_end|>"
    monkeypatch.delattr(ggml, "convert_gguf_tokenizer")
    with pytest.raises(ImportError, match=r"transformers \S+ has no GGUF tokenizer converter"):
        ports.tokenizer_from_gguf(str(path))


def test_cli_convert_gguf_then_decode(tok_file, tmp_path, capsys):
    """`jspec convert model.gguf OUT` writes the checkpoint and the tokenizer: `jspec decode --model OUT --prompt`
    then gives the tokens jspec.decode gives on the GGUF model (the checkpoint's EOS is the file's)."""
    path, _ = tok_file
    assert cli.main(["convert", str(path), str(tmp_path / "out")]) == 0
    assert os.path.exists(tmp_path / "out" / "tokenizer.json")
    assert json.load(open(tmp_path / "out" / "config.json"))["eos_token_id"] == 263
    capsys.readouterr()
    model = ports.load_gguf(str(path))
    tok = ports.tokenizer_from_gguf(str(path))
    ref = jspec.decode(model, np.asarray(tok("hello world")["input_ids"]), max_new_tokens=5)
    for src in (tmp_path / "out", path):
        assert cli.main(["decode", "--model", str(src), "--prompt", "hello world", "--max-new-tokens", "5"]) == 0
        line = [l for l in capsys.readouterr().out.splitlines() if l.startswith("{")][-1]
        assert json.loads(line)["tokens"] == ref.tokens[0, :ref.lengths[0]].tolist()


def tiny_qwen2(tied: bool):
    """A tiny GQA Qwen2 (Q/K/V biases, every parameter perturbed), vocabulary 264 (`tiny_tokenizer`'s)."""
    return perturb(tiny_hf("qwen2", seed=8, vocab_size=264, tie_word_embeddings=tied), seed=9, scale=0.3)


@pytest.fixture(scope="module", params=[(False, "F32"), (True, "F32"), (True, "F16")],
                ids=["untied-F32", "tied-F32", "tied-F16"])
def qwen2_file(request, tmp_path_factory):
    """`tiny_qwen2` written as llama.cpp's `Qwen2Model` writes it: arch "qwen2", no vocab_size key (the tokenizer's
    264 tokens say it), Q/K rows unpermuted, output.weight only when the head is untied."""
    tied, qtype = request.param
    model = tiny_qwen2(tied)
    path = tmp_path_factory.mktemp("gguf-qwen2") / f"qwen2-{'tied' if tied else 'untied'}-{qtype}.gguf"
    held = write_gguf(path, model, qtype, arch="qwen2", tokenizer=functools.partial(tiny_tokenizer, pre="qwen2"))
    return path, model, held, qtype


def test_qwen2_matches_transformers(qwen2_file, tmp_path, monkeypatch):
    """A qwen2 GGUF loads as a `qwen2` model with its biases and its head tied or not, without any RoPE row
    permutation, and gives the logits of transformers' own GGUF loader, of the original model and of transformers on
    the weights the file holds; its config says Qwen2ForCausalLM and `save_hf` writes a checkpoint transformers
    loads as one; its tokenizer is transformers'."""
    path, tiny, held, qtype = qwen2_file
    tied = tiny.config.tie_word_embeddings
    hf = ports.gguf_to_hf_config(str(path))
    assert (hf["model_type"], hf["architectures"], hf["tie_word_embeddings"]) == ("qwen2", ["Qwen2ForCausalLM"], tied)
    assert (hf["vocab_size"], hf["num_key_value_heads"], hf["head_dim"]) == (264, 2, 16)
    calls = []
    monkeypatch.setattr(GF, "unpermute_rope_rows", lambda w, heads: calls.append(heads) or w)
    model = ports.load_gguf(str(path))
    assert calls == []
    c = model.config
    assert (c.model_type, c.qkv_bias, c.o_bias, c.tie_word_embeddings) == ("qwen2", True, False, tied)
    assert ("lm_head" in model.params) != tied
    ours = ports.logits(model, PROMPT)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    assert isinstance(theirs, transformers.Qwen2ForCausalLM) and theirs.config.tie_word_embeddings == tied
    assert_close(ours, hf_logits(theirs, PROMPT), 1e-3)
    assert_close(ours, hf_logits(tiny, PROMPT), 1e-3 if qtype == "F32" else 1e-2)  # F16 rounds the weights
    assert_close(ours, hf_logits(reference(tiny, held), PROMPT))
    ports.save_hf(model, str(tmp_path / "hf"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert isinstance(back, transformers.Qwen2ForCausalLM)
    assert_close(hf_logits(back, PROMPT), ours)
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert ports.tokenizer_from_gguf(str(path))("hello world")["input_ids"] == tok("hello world")["input_ids"]


def test_qwen2_bad_files_fail_early(tmp_path, monkeypatch):
    """A qwen2 file without a bias names it in llama.cpp's spelling, before anything is dequantized."""
    path = tmp_path / "nobias.gguf"
    write_gguf(path, tiny_qwen2(False), arch="qwen2", drop=("blk.1.attn_k.bias",), tokenizer=tiny_tokenizer)
    calls = []
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: calls.append(a))
    missing = r"(?s)nobias\.gguf does not match qwen2.*missing keys \(1\).*blk\.1\.attn_k\.bias"
    with pytest.raises(ValueError, match=missing):
        ports.load_gguf(str(path))
    assert calls == []


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def qwen3_file(request, tmp_path_factory):
    """A tiny Qwen3 (GQA, every parameter perturbed, head_dim 128: transformers' GGUF loader maps no head size for
    qwen3 and takes Qwen3Config's default 128) written as llama.cpp's `Qwen3Model` writes it: arch "qwen3", the
    Q/K norms as attn_q_norm / attn_k_norm, Q/K rows unpermuted, output.weight only when untied."""
    torch.manual_seed(10)
    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=128, vocab_size=264, initializer_range=0.25,
                                   tie_word_embeddings=request.param, bos_token_id=None, eos_token_id=None,
                                   pad_token_id=None)
    model = perturb(transformers.Qwen3ForCausalLM(cfg).eval(), seed=11, scale=0.3)
    path = tmp_path_factory.mktemp("gguf-qwen3") / f"qwen3-{request.param}.gguf"
    held = write_gguf(path, model, "Q8_0", arch="qwen3", tokenizer=functools.partial(tiny_tokenizer, pre="qwen2"))
    return path, model, held


def test_qwen3_matches_transformers(qwen3_file, tmp_path, monkeypatch):
    """A qwen3 GGUF (Q8_0 matrices) loads as a `qwen3` model with its Q/K norms and its head tied or not, without
    any RoPE row permutation, and gives the logits of transformers on the weights the file holds and of
    transformers' own GGUF loader; `save_hf` writes a checkpoint transformers loads as Qwen3ForCausalLM."""
    path, tiny, held = qwen3_file
    tied = tiny.config.tie_word_embeddings
    hf = ports.gguf_to_hf_config(str(path))
    assert (hf["model_type"], hf["architectures"], hf["tie_word_embeddings"]) == ("qwen3", ["Qwen3ForCausalLM"], tied)
    assert (hf["vocab_size"], hf["num_key_value_heads"], hf["head_dim"]) == (264, 2, 128)
    calls = []
    monkeypatch.setattr(GF, "unpermute_rope_rows", lambda w, heads: calls.append(heads) or w)
    model = ports.load_gguf(str(path))
    assert calls == [] and model.config.model_type == "qwen3" and ("lm_head" in model.params) != tied
    assert not np.allclose(np.asarray(model.params["layers"][0]["q_norm"]), 1.0)  # the file's norms, perturbed
    ours = ports.logits(model, PROMPT)
    assert_close(ours, hf_logits(reference(tiny, held), PROMPT))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    assert isinstance(theirs, transformers.Qwen3ForCausalLM)
    assert_close(ours, hf_logits(theirs, PROMPT), 1e-3)
    ports.save_hf(model, str(tmp_path / "hf"))
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert isinstance(back, transformers.Qwen3ForCausalLM)
    assert_close(hf_logits(back, PROMPT), ours)


def test_qwen3_without_its_norms_fails_early(tmp_path, monkeypatch):
    """A qwen3 file that lacks a Q norm names it in llama.cpp's spelling, before anything is dequantized."""
    torch.manual_seed(12)
    cfg = transformers.Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=24, vocab_size=264, bos_token_id=None,
                                   eos_token_id=None, pad_token_id=None)
    path = tmp_path / "nonorm.gguf"
    write_gguf(path, transformers.Qwen3ForCausalLM(cfg).eval(), arch="qwen3", drop=("blk.1.attn_q_norm.weight",),
               tokenizer=tiny_tokenizer)
    assert ports.gguf_to_hf_config(str(path))["head_dim"] == 24  # from key_length, not hidden / heads (16)
    calls = []
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: calls.append(a))
    missing = r"(?s)nonorm\.gguf does not match qwen3.*missing keys \(1\).*blk\.1\.attn_q_norm"
    with pytest.raises(ValueError, match=missing):
        ports.load_gguf(str(path))
    assert calls == []


def tiny_qwen3_moe(moe_intermediate_size: int = 32):
    """A tiny Qwen3-MoE (GQA, head_dim 32 != hidden / heads, 8 experts, top 2, norm_topk_prob as Qwen3-MoE sets
    it), every parameter perturbed."""
    torch.manual_seed(13)
    cfg = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=moe_intermediate_size,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, vocab_size=264,
                                      initializer_range=0.25, tie_word_embeddings=False, bos_token_id=None,
                                      eos_token_id=None, pad_token_id=None)
    return perturb(transformers.Qwen3MoeForCausalLM(cfg).eval(), seed=14, scale=0.3)


@pytest.mark.parametrize("qtype", ("F32", "Q8_0"))
def test_qwen3_moe_matches_transformers(tmp_path, monkeypatch, qtype):
    """A qwen3moe GGUF (stacked experts, F32 router) loads as a `qwen3_moe` model, each tensor dequantized once, and
    gives the logits of transformers on the weights the file holds; its config is one transformers builds the model
    from (norm_topk_prob true, every layer sparse, as transformers reads the file); `save_hf` writes a checkpoint
    transformers loads as Qwen3MoeForCausalLM."""
    tiny = tiny_qwen3_moe()
    path = tmp_path / "moe.gguf"
    held = write_gguf(path, tiny, qtype, arch="qwen3moe", tokenizer=functools.partial(tiny_tokenizer, pre="qwen2"))
    hf = ports.gguf_to_hf_config(str(path))
    assert (hf["model_type"], hf["architectures"]) == ("qwen3_moe", ["Qwen3MoeForCausalLM"])
    assert (hf["num_experts"], hf["num_experts_per_tok"], hf["moe_intermediate_size"], hf["head_dim"]) == (8, 2, 32, 32)
    assert (hf["norm_topk_prob"], hf["decoder_sparse_step"], hf["mlp_only_layers"]) == (True, 1, [])
    theirs = transformers.AutoConfig.for_model(**hf)
    assert isinstance(theirs, transformers.Qwen3MoeConfig) and theirs.num_experts == 8 and theirs.norm_topk_prob
    calls = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda data, kind: calls.append(data.shape) or real(data, kind))
    model = ports.load_gguf(str(path))
    assert len(calls) == len(gguf.GGUFReader(str(path)).tensors)
    c = model.config
    assert (c.model_type, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == ("qwen3_moe", 8, 2, 32)
    assert all(c.is_sparse(i) for i in range(c.num_layers)) and c.norm_topk_prob
    ours = ports.logits(model, PROMPT)
    assert_close(ours, hf_logits(reference(tiny, held), PROMPT))
    if qtype == "F32":
        assert_close(ours, hf_logits(tiny, PROMPT))
        ports.save_hf(model, str(tmp_path / "hf"))
        back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
        assert isinstance(back, transformers.Qwen3MoeForCausalLM)
        assert_close(hf_logits(back, PROMPT), ours)


def test_qwen3_moe_bad_files_fail_early(tmp_path, monkeypatch):
    """A qwen3moe file without an expert tensor, or without qwen3moe.expert_count, is refused by name before anything
    is dequantized."""
    tiny = tiny_qwen3_moe()
    cases = ((("blk.1.ffn_up_exps.weight",), r"(?s)does not match qwen3_moe.*missing keys \(1\): "
                                              r"\['blk\.1\.ffn_up_exps\.weight'\]$"),
             (("blk.0.ffn_down_exps.weight",), r"missing keys \(1\): \['blk\.0\.ffn_down_exps\.weight'\]$"),
             (("qwen3moe.expert_count",), r"moe2\.gguf: GGUF metadata has no qwen3moe\.expert_count$"))
    for i, (drop, _) in enumerate(cases):
        write_gguf(tmp_path / f"moe{i}.gguf", tiny, arch="qwen3moe", drop=drop, tokenizer=tiny_tokenizer)
    calls = []
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *a: calls.append(a))
    for i, (_, match) in enumerate(cases):
        with pytest.raises(ValueError, match=match):
            ports.load_gguf(str(tmp_path / f"moe{i}.gguf"))
    assert calls == []


def test_qwen3_moe_matches_transformers_gguf_loader(tmp_path):
    """transformers' own GGUF loader gives the same model: its config (it reads no expert width and takes
    Qwen3MoeConfig's 768, so the experts here are 768 wide) and its expert tensors."""
    tiny = tiny_qwen3_moe(moe_intermediate_size=768)
    path = tmp_path / "moe.gguf"
    write_gguf(path, tiny, arch="qwen3moe", tokenizer=functools.partial(tiny_tokenizer, pre="qwen2"))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    assert isinstance(theirs, transformers.Qwen3MoeForCausalLM)
    hf = ports.gguf_to_hf_config(str(path))
    for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
              "mlp_only_layers", "head_dim", "intermediate_size", "num_key_value_heads", "tie_word_embeddings"):
        assert hf[k] == getattr(theirs.config, k), k
    assert_close(ports.logits(ports.load_gguf(str(path)), PROMPT), hf_logits(theirs, PROMPT))
