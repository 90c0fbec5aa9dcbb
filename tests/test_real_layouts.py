"""The loaders against real checkpoint layouts: for every folder of ../shared/real_layouts (configs and tensor-name
indexes of public checkpoints, read in place, never copied), the config parses with the ports; the index's tensor
names are exactly the loader's (nothing missing, nothing unexpected beyond the family's ignored keys); at full
size, every tensor shape the ports expect is the shape transformers' own model has (built on the meta device);
and a shrunk copy (the same config with small dimensions, random weights written under the real checkpoint's
names) loads and gives transformers' logits. The folders of `next/` whose family is ported (`PORTED_NEXT`) are
checked the same way. Skipped, saying so, where the folder is absent."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import numpy as np
import pytest

import ports
from ports.io.hf_checkpoint import SourceTensor, read_hf_config, stream_checkpoint
from ports.core.hf_layout import ours_shape_to_hf
from ports.model import family
from ports.core.param_paths import get_path
from ports.core.safetensors_io import write_safetensors

LAYOUTS = Path(__file__).resolve().parent.parent.parent / "shared" / "real_layouts"
# layouts under next/ (families ported after the others) whose family jspec loads now
PORTED_NEXT = ("next/Qwen__Qwen3-4B-finetune", "next/nvidia__Cosmos-Reason2-8B",
               "next/bryce-hoehn__Qwen3.5-18B-REAP-A3B-Coding", "next/masidyai__qwen3.5-9b-masidy")
FOLDERS = sorted(p.name for p in LAYOUTS.iterdir() if (p / "config.json").exists()) if LAYOUTS.is_dir() else []
FOLDERS += [f for f in PORTED_NEXT if (LAYOUTS / f / "config.json").exists()]
INDEXED = [f for f in FOLDERS if (LAYOUTS / f / "model.safetensors.index.json").exists()]
if not FOLDERS:
    pytest.skip(f"no real layouts at {LAYOUTS} (the shared folder of real checkpoint configs)",
                allow_module_level=True)

CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
           "llava": "LlavaForConditionalGeneration", "llava_next": "LlavaNextForConditionalGeneration",
           "llava_next_video": "LlavaNextVideoForConditionalGeneration",
           "qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
           "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           "qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
           "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
           "qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
LAYER = re.compile(r"\.(layers|blocks)\.(\d+)\.")


def hf_config(folder: str) -> dict:
    """config.json (+ generation config ids) without a quantization section (a bnb-4bit fine-tune's config is
    otherwise the architecture's)."""
    hf = read_hf_config(str(LAYOUTS / folder))
    hf.pop("quantization_config", None)
    return hf


def expected(hf: dict) -> tuple:
    """(family, {loader name: HF-layout shape}, ignored regexes) of a config."""
    fam = family(hf.get("model_type"))
    cfg = fam.config_from_hf(hf)
    shapes = fam.param_shapes(cfg)
    want = {name: ours_shape_to_hf(tuple(get_path(shapes, path)), tr) for name, path, tr in fam.hf_key_map(cfg)}
    ignored = [re.compile(p) for p in fam.ignored_keys]
    return fam, cfg, want, ignored


def index_names(folder: str) -> list[str]:
    return list(json.loads((LAYOUTS / folder / "model.safetensors.index.json").read_text())["weight_map"])


def check_names(folder: str, names: list[str]) -> None:
    """The loader's own pre-read check (`stream_checkpoint`) over `names`, each given the shape the loader
    expects: raises listing what is missing or unexpected."""
    hf = hf_config(folder)
    fam, _, want, _ = expected(hf)

    def entry(n):
        canon = fam.rename_hf_key(n)
        return SourceTensor(canon, n, want.get(canon, (1,)), lambda: (_ for _ in ()).throw(AssertionError(n)))

    stream_checkpoint(folder, hf, [entry(n) for n in names], None, False)


@pytest.mark.parametrize("folder", FOLDERS)
def test_config_parses_as_transformers_reads_it(folder):
    import transformers

    hf = hf_config(folder)
    _, cfg, want, _ = expected(hf)
    text = getattr(cfg, "text", cfg)
    ref = transformers.AutoConfig.for_model(**copy.deepcopy(hf)).get_text_config()
    kv = getattr(ref, "num_key_value_heads", None) or ref.num_attention_heads
    assert (text.num_layers, text.hidden_size, text.num_heads, text.num_kv_heads, text.vocab_size) == (
        ref.num_hidden_layers, ref.hidden_size, ref.num_attention_heads, kv, ref.vocab_size) and want


@pytest.mark.parametrize("folder", INDEXED)
def test_index_names_are_the_loaders(folder):
    names = index_names(folder)
    check_names(folder, names)  # nothing missing, nothing unexpected
    with pytest.raises(ValueError, match=r"missing keys \(1\)"):
        check_names(folder, [n for n in names if not n.endswith("layers.0.post_attention_layernorm.weight")])
    with pytest.raises(ValueError, match=r"unexpected keys \(1\)"):
        check_names(folder, names + ["model.layers.0.mlp.extra_proj.weight"])


def transformers_model(hf: dict, meta: bool):
    """transformers' model of an HF config dict (random weights; on the meta device: shapes only)."""
    import torch
    import transformers

    conf = transformers.AutoConfig.for_model(**copy.deepcopy(hf))
    cls = getattr(transformers, CLASSES[hf["model_type"]])
    if meta:
        with torch.device("meta"):
            return cls(conf)
    torch.manual_seed(0)
    return cls(conf).to(torch.float32).eval()


def state_pieces(fam, state: dict):
    """(loader name, its name in transformers' layout, shape, value) of each tensor of a transformers state dict;
    a fused one (transformers' in-memory experts) as the pieces the family's `split_hf_tensor` reads from it."""
    for n, t in state.items():
        c = fam.rename_hf_key(n)
        pieces = fam.split_hf_tensor(c, tuple(t.shape)) if fam.split_hf_tensor is not None else None
        if pieces is None:
            yield c, n, tuple(t.shape), (lambda t=t: t)
        else:
            yield from ((pc, pc, shape, (lambda t=t, take=take: take(t))) for pc, shape, take in pieces)


@pytest.mark.parametrize("folder", FOLDERS)
def test_full_size_shapes_are_transformers(folder):
    hf = hf_config(folder)
    fam, cfg, want, ignored = expected(hf)
    model = transformers_model(hf, meta=True)
    got = {c: shape for c, _, shape, _ in state_pieces(fam, model.state_dict())}
    tied = getattr(getattr(cfg, "text", cfg), "tie_word_embeddings", False)
    extra = [n for n in got if n not in want and not any(p.search(n) for p in ignored)
             and not (tied and n.endswith("lm_head.weight"))]
    assert extra == [] and sorted(set(want) - set(got)) == []
    assert {n: s for n, s in want.items() if got[n] != s} == {}


# ------------------------------------------------------------------------------------------ shrunk copies


def shrink_text(t: dict) -> dict:
    heads = 4
    kv = heads if t.get("num_key_value_heads", t.get("num_attention_heads")) == t.get("num_attention_heads") else 2
    t.update(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
             num_key_value_heads=kv, max_window_layers=2)
    if "head_dim" in t:
        t["head_dim"] = 16
    if isinstance(t.get("layer_types"), list):  # one entry per layer (Qwen3's)
        t["layer_types"] = t["layer_types"][:2]
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(t.get(key), dict) and "mrope_section" in t[key]:
            t[key] = {**t[key], "mrope_section": [2, 3, 3]}  # sums to head_dim / 2 = 8
    if "linear_num_key_heads" in t:  # Qwen3.5's hybrid: one linear-attention layer, then a full-attention one
        t.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                 layer_types=["linear_attention", "full_attention"])
        if "num_experts" in t:
            t.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=40)
    if t.get("model_type") == "mistral":
        t["sliding_window"] = 6  # shorter than the test prompt (11 tokens): the window is exercised
    return t


def shrink(hf: dict) -> dict:
    hf = copy.deepcopy(hf)
    text = hf.get("text_config")
    shrink_text(text if text is not None else hf)
    vis = hf.get("vision_config")
    if vis is not None:
        if hf["model_type"] in ("qwen2_vl", "qwen2_5_vl"):
            # Qwen2-VL's tower: embed_dim wide, hidden_size = the text's; Qwen2.5-VL's: hidden_size wide, out_hidden_size
            vis.update(depth=2, embed_dim=32, hidden_size=64 if hf["model_type"] == "qwen2_vl" else 32,
                       num_heads=2, intermediate_size=48, out_hidden_size=64, fullatt_block_indexes=[1])
        elif hf["model_type"] in ("qwen3_vl", "qwen3_vl_moe"):
            vis.update(depth=3, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                       num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
        elif hf["model_type"] in ("qwen3_5", "qwen3_5_moe"):  # Qwen3-VL's tower without DeepStack
            vis.update(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                       num_position_embeddings=16)
        else:
            vis.update(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                       image_size=56, projection_dim=32)
    if hf["model_type"] in ("llava", "llava_next", "llava_next_video"):
        hf["vision_feature_layer"] = -1
    return hf


def template(name: str) -> str:
    """`name` with its layer index as a `{}` placeholder."""
    return LAYER.sub(lambda g: f".{g.group(1)}.{{}}.", name)


def real_name(templates: dict, canon: str) -> str | None:
    """The real checkpoint's name of loader name `canon`: its layer index put into the matching template."""
    m = LAYER.search(canon)
    t = templates.get(template(canon))
    return None if t is None else (t.format(m.group(2)) if m else t)


def write_shrunk(folder: str, out: Path) -> tuple:
    """(transformers model, loader family) of the shrunk config, its weights written into `out` under the real
    checkpoint's names (transformers' own names where the folder has no index)."""
    import torch

    hf = shrink(hf_config(folder))
    model = transformers_model(hf, meta=False)
    fam, cfg, want, ignored = expected(hf)
    templates = None
    if (LAYOUTS / folder / "model.safetensors.index.json").exists():
        templates = {template(fam.rename_hf_key(n)): template(n) for n in index_names(folder)}
    tensors = {}
    state = {n: t.detach().to(torch.float32).numpy() for n, t in model.state_dict().items()}
    for c, n, _, take in state_pieces(fam, state):
        if c not in want:
            continue
        name = n if templates is None else real_name(templates, c)
        assert name is not None, f"{n} ({c}) has no name in the real index"
        tensors[name] = np.ascontiguousarray(take())
    if templates is not None:  # the real index's ignored tensors too (e.g. LLaMA-1's rotary inv_freq), in their layers
        for key, tmpl in templates.items():
            if any(p.search(key.replace("{}", "0")) for p in ignored) and "inv_freq" in key:
                for i in range(2):
                    tensors[tmpl.format(i)] = np.zeros(8, np.float32)
    out.mkdir(parents=True)
    write_safetensors(str(out / "model.safetensors"), {n: (a.shape, a.dtype) for n, a in tensors.items()},
                      tensors.__getitem__)
    (out / "config.json").write_text(json.dumps(hf))
    return model, fam


@pytest.mark.parametrize("folder", FOLDERS)
def test_a_shrunk_copy_under_the_real_names_matches_transformers(folder, tmp_path):
    import torch

    model, _ = write_shrunk(folder, tmp_path / "ckpt")
    ours = ports.load_hf(str(tmp_path / "ckpt"))
    vocab = ours.vocab_size
    ids = np.random.default_rng(0).integers(3, min(vocab, 30000), (2, 11)).astype(np.int64)
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(ids)).logits.float().numpy()
    got = ports.logits(ours, ids.astype(np.int32))
    scale = float(np.max(np.abs(ref)))
    assert float(np.max(np.abs(got - ref))) <= 1e-4 * scale


QWEN3_VL = [f for f in FOLDERS if hf_config(f).get("model_type") in ("qwen3_vl", "qwen3_vl_moe", "qwen3_5",
                                                                      "qwen3_5_moe")]


@pytest.mark.parametrize("folder", QWEN3_VL)
def test_a_shrunk_qwen3_vl_copy_reads_an_image_as_transformers(folder, tmp_path):
    """The shrunk Qwen3-VL (or Qwen3.5) copy on an image prompt (tower, DeepStack where the family has it,
    interleaved M-RoPE at the real config's patch size and token ids) gives transformers' logits."""
    import torch

    model, _ = write_shrunk(folder, tmp_path / "ckpt")
    ours = ports.load_hf(str(tmp_path / "ckpt"))
    cfg = ours.config
    v = cfg.vision
    grid = np.array([[1, 4, 6]])
    rng = np.random.default_rng(1)
    pixels = rng.normal(size=(24, v.patch_dim)).astype(np.float32)
    n = 24 // v.merge_unit
    ids = np.array([[5, 7, cfg.vision_start_token_id] + [cfg.image_token_id] * n + [cfg.vision_end_token_id, 9, 11]])
    batch = {"input_ids": ids, "attention_mask": np.ones_like(ids), "pixel_values": pixels, "image_grid_thw": grid,
             "mm_token_type_ids": (ids == cfg.image_token_id).astype(np.int64)}
    with torch.no_grad():
        ref = model(**{k: torch.tensor(x) for k, x in batch.items()}).logits.float().numpy()
    got = ports.logits(ours, batch)
    assert float(np.max(np.abs(got - ref))) <= 1e-4 * float(np.max(np.abs(ref)))
