"""Memory planning (`jspec.tools.memory`, `jspec memory`): exact per-device bytes against really allocated arrays on 8 forced
CPU devices (subprocess), every shipped config plans with public parameter counts, the 70B numbers, the fit
verdict, Qwen-VL towers counted like transformers builds them, and bad input."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jspec.tools import cli
from jspec.tools import memory as MEM

GB = 1e9

# Public parameter counts of the shipped checkpoints (their model cards / safetensors metadata), +-1.5%.
PUBLIC_PARAMS = {"llama-2-7b": 6.74e9, "llama-2-13b": 13.0e9, "llama-2-70b": 69.0e9, "llama-68m": 68e6,
                 "llava-1.5-7b": 7.06e9, "llava-next-video-7b": 7.07e9, "llava-onevision-qwen2-72b": 73.2e9, "llava-onevision-qwen2-7b": 8.03e9,
                 "qwen2.5-vl-72b": 73.4e9, "qwen2.5-vl-7b": 8.29e9, "lumina-mgpt-7b-768": 7.0e9,
                 "qwen3-8b": 8.19e9, "qwen3-30b-a3b": 30.5e9, "qwen3-235b-a22b": 235e9}


def test_plan_equals_allocated_bytes():
    """Per-device params / KV cache / draft params / draft cache of the plan == bytes really on device 0, for
    meshes (1,8), (2,4), fsdp 2 x tensor 4, (8,1), batches that do and do not divide `data`, a VLM target, a
    tensor-parallel draft (less per device than a replicated one)."""
    here = os.path.dirname(__file__)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(here, "memory_checks.py")], env=env, capture_output=True,
                          text=True, timeout=600, cwd=os.path.dirname(here))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results["cases"] == 15


def test_shipped_configs_are_listed():
    assert set(PUBLIC_PARAMS) <= set(MEM.available_configs())


@pytest.mark.parametrize("name", sorted(PUBLIC_PARAMS))
def test_every_shipped_config_plans(name):
    p = MEM.estimate(MEM.load_config(name), {"tensor": 8}, batch=2, max_len=1024, dtype="bf16")
    assert p["target"]["params"] == pytest.approx(PUBLIC_PARAMS[name], rel=0.015)
    c = p["components"]
    assert c["params"]["total"] == 2 * p["target"]["params"]  # bf16
    for comp in c.values():
        assert 0 < comp["per_device"] <= comp["total"]
    assert p["per_device"] == sum(v["per_device"] for v in c.values())
    assert c["activations"]["estimate"] is True
    json.dumps(p)  # serialisable as is


def test_moe_params_store_every_expert_split_over_the_expert_axis():
    """qwen3-30b-a3b (bf16): all 128 experts of its 48 layers counted; on expert=8 each device holds an eighth of
    them and everything else whole; expert=4 x tensor=2 holds 3/8 of the experts fewer per device than tensor=2
    alone (the experts split 8 ways, not 2)."""
    cfg = MEM.load_config("qwen3-30b-a3b")
    experts = 2 * 48 * 128 * 3 * 2048 * 768  # bytes: layers x experts x (gate, up, down) x hidden x moe width
    plan = {k: MEM.estimate(cfg, mesh, batch=1, max_len=1024)["components"]["params"]
            for k, mesh in (("one", {}), ("e8", {"expert": 8}), ("t2", {"tensor": 2}),
                            ("e4t2", {"expert": 4, "tensor": 2}))}
    assert plan["one"]["per_device"] == plan["one"]["total"] > experts
    assert plan["e8"]["per_device"] == plan["one"]["total"] - experts + experts // 8
    assert plan["t2"]["per_device"] - plan["e4t2"]["per_device"] == experts // 2 - experts // 8


def test_llama_2_70b_numbers():
    cfg = MEM.load_config("llama-2-70b")
    p = MEM.estimate(cfg, {"tensor": 8}, batch=1, max_len=4096, dtype="bf16")
    c = p["components"]
    assert 137 * GB < c["params"]["total"] < 139 * GB
    # vocab 32000, 64 heads, 8 kv heads and mlp 28672 all divide 8: only the norms (a few MB) stay replicated
    assert c["params"]["per_device"] == pytest.approx(c["params"]["total"] / 8, rel=1e-3)
    assert c["params"]["per_device"] > c["params"]["total"] / 8
    kv = 80 * 2 * 1 * 8 * 4096 * 128 * 2  # layers x (k, v) x batch x kv heads x slots x head_dim x bf16
    assert kv <= c["kv_cache"]["total"] < kv + 1024  # + the per-row length vectors
    assert kv // 8 <= c["kv_cache"]["per_device"] < kv // 8 + 1024
    # 16-way tensor: 8 kv heads cannot split 16 ways -> the cache and wk/wv are replicated (the engine's fallback)
    p16 = MEM.estimate(cfg, {"tensor": 16}, batch=1, max_len=4096)
    assert p16["components"]["kv_cache"]["per_device"] == p16["components"]["kv_cache"]["total"]
    wkv = 80 * 2 * 8192 * 1024 * 2
    assert p16["components"]["params"]["per_device"] == pytest.approx((c["params"]["total"] - wkv) / 16 + wkv,
                                                                          rel=1e-3)
    # fsdp x tensor splits everything 16 ways again, the cache only over tensor
    pf = MEM.estimate(cfg, {"fsdp": 2, "tensor": 8}, batch=1, max_len=4096)
    assert pf["components"]["params"]["per_device"] == pytest.approx(c["params"]["total"] / 16, rel=1e-3)
    assert pf["components"]["kv_cache"]["per_device"] == c["kv_cache"]["per_device"]
    assert pf["components"]["activations"]["detail"]["fsdp_gather"] > 0
    # batch over data: 8 rows on data=2 x tensor=4 -> 4 rows x 2 kv heads per device = the 1-row, 8-head bytes
    pd = MEM.estimate(cfg, {"data": 2, "tensor": 4}, batch=8, max_len=4096)
    assert kv <= pd["components"]["kv_cache"]["per_device"] < kv + 1024
    # activations: a 4096-token prefill attends blockwise, one 512 x 512 tile of f32 scores, softmax and bf16
    # probabilities per head, plus f32 outputs and log-sum-exp for every query
    act = c["activations"]
    assert act["phase"] == "prefill" and act["detail"]["heads_per_device"] == 8
    assert act["detail"]["prefill_attention_scores"] == 8 * (512 * 512 * (4 + 4 + 2) + 4096 * (128 + 1) * 4)
    assert p.fits("80GB")["fits"] and not p.fits("16GB")["fits"]


def test_draft_is_replicated_and_scales_with_batch():
    cfg, dcfg = MEM.load_config("llama-2-70b"), MEM.load_config("llama-2-7b")
    p1 = MEM.estimate(cfg, {"tensor": 8}, 1, 4096, draft_config=dcfg, prompt_len=512)
    p8 = MEM.estimate(cfg, {"tensor": 8}, 8, 4096, draft_config=dcfg, prompt_len=512)
    d = p1["components"]["draft_params"]
    assert d["per_device"] == d["total"] == pytest.approx(13.48 * GB, rel=0.01)
    dc1, dc8 = p1["components"]["draft_cache"], p8["components"]["draft_cache"]
    assert dc1["per_device"] == dc1["total"] and dc8["per_device"] == pytest.approx(8 * dc1["per_device"], rel=1e-6)
    assert p8["components"]["activations"]["detail"]["draft_prefill"] > 0
    # a longer prompt costs more activation memory
    long = MEM.estimate(cfg, {"tensor": 8}, 8, 4096, draft_config=dcfg)
    assert long["components"]["activations"]["per_device"] > p8["components"]["activations"]["per_device"]


def test_a_tensor_parallel_draft_saves_what_replication_costs(capsys):
    """The 70B plans' 7B draft: replicated it takes 13.5 GB on each of 8 devices; split by the target's rules an
    eighth of it (its 32 heads and MLP divide 8), and the note says how much that saves."""
    cfg, dcfg = MEM.load_config("llama-2-70b"), MEM.load_config("llama-2-7b")
    rep = MEM.estimate(cfg, {"tensor": 8}, 1, 4096, draft_config=dcfg, prompt_len=512)
    tp = MEM.estimate(cfg, {"tensor": 8}, 1, 4096, draft_config=dcfg, prompt_len=512, draft_tensor_parallel=True)
    r, t = rep["components"]["draft_params"], tp["components"]["draft_params"]
    assert t["total"] == r["total"] and not t["replicated"]
    assert t["per_device"] == pytest.approx(r["per_device"] / 8, rel=0.03)  # embeddings / norms: not all split
    assert tp["components"]["draft_cache"]["per_device"] == pytest.approx(
        rep["components"]["draft_cache"]["per_device"] / 8)
    assert any("tensor-parallel draft" in n and "GiB per device less" in n for n in tp["notes"])
    assert cli.main(["memory", "--config", "llama-2-70b", "--mesh", "tensor=8", "--max-len", "4096", "--draft",
                     "llama-2-7b", "--draft-tensor-parallel", "--json"]) in (0, 1)
    js = json.loads(capsys.readouterr().out)
    assert js["components"]["draft_params"]["per_device"] < 2.0 * GB


def test_fits_verdict_and_sizes():
    p = MEM.estimate(MEM.load_config("llama-2-7b"), {"tensor": 1}, 1, 2048)
    need = p["per_device"]
    assert p.fits(int(need / 0.9) + 10)["fits"]
    assert not p.fits(int(need / 0.9) - 10)["fits"]
    assert p.fits(need, headroom=0.0)["fits"] and not p.fits(need - 1, headroom=0.0)["fits"]
    assert MEM.parse_bytes("80GB") == 80 * 10 ** 9 and MEM.parse_bytes("16GiB") == 16 * 2 ** 30
    assert MEM.parse_bytes("1.5e3") == 1500 and MEM.parse_bytes(1234) == 1234
    with pytest.raises(ValueError, match="memory size"):
        MEM.parse_bytes("lots")


def test_vision_towers_counted():
    ov = MEM.estimate(MEM.load_config("llava-onevision-qwen2-72b"), {"tensor": 8}, 1, 4096)
    lm_only = MEM.estimate(dict(MEM.load_config("llava-onevision-qwen2-72b")["text_config"]), {"tensor": 8}, 1, 4096)
    extra = ov["components"]["params"]["per_device"] - lm_only["components"]["params"]["per_device"]
    # SigLIP so400m tower (~0.4B) + projector + newline, replicated on every device (bf16)
    assert 0.7 * GB < extra < 1.0 * GB
    act = ov["components"]["activations"]["detail"]
    assert "40 tile(s) of 729 tokens" in act["vision_what"] and act["vision"] > 0
    qvl = MEM.estimate(MEM.load_config("qwen2.5-vl-72b"), {"tensor": 8}, 1, 4096)
    lm_only = MEM.estimate(MEM._qwen_vl_text(MEM.load_config("qwen2.5-vl-72b")), {"tensor": 8}, 1, 4096)
    assert qvl["target"]["params"] - lm_only["target"]["params"] == pytest.approx(0.705e9, rel=0.01)
    assert qvl["components"]["activations"]["detail"]["vision"] > 0


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen2_vl"])
def test_qwen_vl_counts_match_transformers(kind):
    """The analytic Qwen-VL tower and the qwen2-family text model count exactly the parameters transformers
    builds (config saved by transformers 5: text fields under text_config)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    text = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2,  # head_dim 16: M-RoPE sections must sum to 8
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    if kind == "qwen2_5_vl":
        cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=dict(
            depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=64, fullatt_block_indexes=[1]))
        hf = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    else:
        cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=dict(
            depth=2, embed_dim=32, mlp_ratio=3, num_heads=4, hidden_size=64))
        hf = transformers.Qwen2VLForConditionalGeneration(cfg)
    p = MEM.estimate(cfg.to_dict(), {"tensor": 2}, 1, 64, dtype="float32")
    assert p["target"]["params"] == sum(x.numel() for x in hf.parameters())
    # the older layout (text fields at the top level) plans the same
    flat = {**cfg.to_dict(), **cfg.to_dict()["text_config"], "model_type": kind}
    flat.pop("text_config")
    assert MEM.estimate(flat, {"tensor": 2}, 1, 64, dtype="float32")["per_device"] == p["per_device"]


def test_chameleon_without_vocabulary_map():
    from ports.families import chameleon as CH

    d = MEM.load_config("lumina-mgpt-7b-768")
    assert "vocabulary_map" not in d
    with pytest.raises(ValueError, match="no vocabulary_map"):
        CH.config_from_hf(d)
    cfg = CH.config_from_hf(d, require_vocabulary=False)
    assert cfg.image_token_ids == () and not cfg.suppress_image_logits
    p = MEM.estimate(d, {"tensor": 8}, 1, 4096)
    assert any("vocabulary_map" in n for n in p["notes"])


def test_cli_table_json_and_exit_status(capsys):
    args = ["memory", "--config", "llama-2-70b", "--mesh", "tensor=8", "--batch", "1", "--max-len", "4096",
            "--dtype", "bf16", "--draft", "llama-68m"]
    assert cli.main(args + ["--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out
    assert "per device" in out and "draft params (replicated)" in out and "FITS" in out
    assert "137.95 GB" in out and "17.25 GB" in out
    assert cli.main(args + ["--device-memory", "16GB"]) == 3
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert cli.main(args + ["--json", "--device-memory", "80GB"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["fit"]["fits"] and js["mesh"] == {"data": 1, "fsdp": 1, "expert": 1, "tensor": 8}
    assert js["components"]["params"]["per_device"] < js["components"]["params"]["total"] / 7


def test_config_from_a_file_or_directory(tmp_path):
    cfg = MEM.load_config("llama-2-7b")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert MEM.load_config(str(tmp_path)) == cfg == MEM.load_config(str(tmp_path / "config.json"))


def test_unknown_config_lists_the_shipped_ones(capsys):
    with pytest.raises(ValueError, match=r"unknown config 'llama-3-405b'.*llama-2-70b.*qwen2.5-vl-72b"):
        MEM.load_config("llama-3-405b")
    with pytest.raises(SystemExit, match="shipped configs: .*lumina-mgpt-7b-768"):
        cli.main(["memory", "--config", "nope", "--max-len", "64"])


@pytest.mark.parametrize("mesh", ["tensor8", "tensor=x", "gpu=8", "tensor=0", "tensor=2,tensor=4", "", "tensor=2,",
                                  "data=2;tensor=4"])
def test_malformed_mesh(mesh):
    with pytest.raises(ValueError, match="malformed mesh"):
        MEM.parse_mesh(mesh)
    with pytest.raises(SystemExit, match="malformed mesh"):
        cli.main(["memory", "--config", "llama-68m", "--mesh", mesh, "--max-len", "64"])


def test_mesh_parsing():
    assert MEM.parse_mesh("tensor=8") == {"data": 1, "fsdp": 1, "expert": 1, "tensor": 8}
    assert MEM.parse_mesh("data=2, fsdp=2,tensor=4") == {"data": 2, "fsdp": 2, "expert": 1, "tensor": 4}


def test_other_bad_input():
    cfg = MEM.load_config("llama-68m")
    with pytest.raises(ValueError, match="unknown architecture: model_type 'mamba'"):
        MEM.estimate({**cfg, "model_type": "mamba"}, {"tensor": 1}, 1, 64)
    with pytest.raises(ValueError, match="prompt_len=100 must be in"):
        MEM.estimate(cfg, {"tensor": 1}, 1, 64, prompt_len=100)
    with pytest.raises(ValueError, match="unknown dtype"):
        MEM.estimate(cfg, {"tensor": 1}, 1, 64, dtype="int3")
    with pytest.raises(ValueError, match="batch must be >= 1"):
        MEM.estimate(cfg, {"tensor": 1}, 0, 64)
    with pytest.raises(ValueError, match="unknown mesh axes"):
        MEM.estimate(cfg, {"pipeline": 2}, 1, 64)


def tiny_target():
    """(HF config dict, random jspec model) of one tiny LLaMA: a drafter's planned count vs a real one's."""
    import ports

    tiny = {"model_type": "llama", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    return tiny, ports.random_model(ports.TextConfig(model_type="llama", vocab_size=97, hidden_size=64,
                                                     intermediate_size=96, num_layers=3, num_heads=4,
                                                     num_kv_heads=2, head_dim=16), key=0)


def test_eesd_drafter_sizes():
    """The early-exit head's count equals a real head's on a tiny target, and the paper's sizes on LLaMA-2 (EESD
    Table 1: 481M / 13B, 1.12B / 70B; Cali-TS's predictor 262M / 0.67B); the presets' N; bad N refused."""
    from jspec.parts.drafters import early_exit as EE

    tiny, target = tiny_target()
    for k in (0, 1, 2):
        p = MEM.estimate(tiny, {}, 1, 64, dtype="float32", eesd=(1, k, False))
        assert p["components"]["eesd_head"]["count"] == EE.init_head(target, 1, k).num_params
    for name, head, cali in (("llama-2-13b", 481e6, 262e6), ("llama-2-70b", 1.12e9, 0.67e9)):
        from jspec.strategies.eesd import preset_exit_layer

        p = MEM.estimate(MEM.load_config(name), {"tensor": 8}, 1, 2048, eesd=(preset_exit_layer(name), 1, True))
        c = p["components"]
        assert abs(c["eesd_head"]["count"] / head - 1) < 0.01 and abs(c["eesd_calibration"]["count"] / cali - 1) < 0.01
        assert c["eesd_head"]["per_device"] == c["eesd_head"]["total"]     # replicated
    assert preset_exit_layer("llama-2-13b") == 3 and preset_exit_layer("llama-2-70b") == 5
    with pytest.raises(ValueError, match="out of range"):
        MEM.estimate(tiny, {}, 1, 64, eesd=(3, 1, False))
    with pytest.raises(ValueError, match="no EESD preset"):
        preset_exit_layer("llama-2-7b")


@pytest.mark.parametrize("name", ["llava-onevision-qwen2-72b", "qwen2.5-vl-72b"])
def test_sage_presets_plan_the_72b_target_and_its_draft_on_8_gpus(name, capsys):
    """`jspec memory --sage`: the paper's 7B draft from the preset, 65 verified tokens, and the preset's command fits
    8 x 80 GB; a target without a preset asks for --draft."""
    from jspec.strategies.sage import PRESETS

    cmd = PRESETS[name]["memory"].split()[1:]
    assert cli.main(cmd + ["--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["tree_nodes"] == 65 and js["fit"]["fits"] and "draft_params" in js["components"]
    assert js["components"]["draft_params"]["total"] > 14e9  # the 7B draft in bf16
    assert any("SAGE: trees of <= 64 drafts" in n for n in js["notes"])
    with pytest.raises(SystemExit, match="no SAGE preset"):
        cli.main(["memory", "--config", "llama-2-7b", "--sage", "--max-len", "512"])


@pytest.mark.parametrize("name", ["llava-onevision-qwen2-72b", "qwen2.5-vl-32b"])
def test_specvlm_presets_plan_a_pruned_draft_cache(name, capsys):
    """`jspec memory --specvlm`: the preset's 7B draft, 26 verified tokens, a draft cache short by the pruned video
    tokens (and the draft's prefill sized on the pruned prompt); the preset's command fits 80 GB devices. Self-SD
    (`--draft self`) sizes a second, sharded target cache and no draft params; no preset and no clip size asks for
    --video-tokens."""
    from jspec.strategies.specvlm import PRESETS

    pre = PRESETS[name]
    cmd = pre["memory"].split()[1:]
    assert cli.main(cmd + ["--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["tree_nodes"] == 26 and js["fit"]["fits"]
    assert js["components"]["draft_params"]["total"] > 14e9
    max_len = js["max_len"]
    kept = int(pre["video_tokens"] * (1 - pre["ratio"]) + 1e-3)
    assert js["components"]["draft_cache"]["slots"] == max_len - pre["video_tokens"] + kept
    full = cli.main(cmd + ["--json", "--prune-ratio", "0"])
    js0 = json.loads(capsys.readouterr().out)
    assert full in (0, 3) and js0["components"]["draft_cache"]["total"] > 5 * js["components"]["draft_cache"]["total"]
    assert cli.main(cmd + ["--json", "--draft", "self"]) in (0, 3)
    js_self = json.loads(capsys.readouterr().out)
    assert "draft_params" not in js_self["components"]
    assert js_self["components"]["draft_cache"]["replicated"] is False
    with pytest.raises(SystemExit, match="--video-tokens"):
        cli.main(["memory", "--config", "llama-2-7b", "--specvlm", "--max-len", "512"])


def test_lantern_plans_an_eagle_head_and_cfg_streams(capsys):
    """`jspec memory --lantern`: the EAGLE head's count equals a real head's on a tiny target; CFG doubles the KV
    cache; Lumina-mGPT-7B-768 with LANTERN++'s preset (58 verified nodes, ~0.24B head) fits an 80 GB device."""
    import jax
    from jspec.parts.drafters import eagle as EG

    tiny, target = tiny_target()
    one = MEM.estimate(tiny, {}, 1, 64, dtype="float32", eagle=True)
    two = MEM.estimate(tiny, {}, 1, 64, dtype="float32", eagle=True, streams=2)
    assert one["components"]["eagle_head"]["count"] == EG.init_head(target, jax.random.key(0)).num_params
    assert two["components"]["kv_cache"]["total"] == 2 * one["components"]["kv_cache"]["total"]
    assert two["components"]["eagle_cache"]["total"] == 2 * one["components"]["eagle_cache"]["total"]
    assert cli.main(["memory", "--config", "lumina-mgpt-7b-768", "--max-len", "2500", "--lantern",
                     "--device-memory", "80GB", "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["tree_nodes"] == 58 and js["fit"]["fits"]
    assert abs(js["components"]["eagle_head"]["count"] / 0.236e9 - 1) < 0.01
    assert any("naive_extend_57" in n and "2 streams" in n for n in js["notes"])
    with pytest.raises(SystemExit, match="pick one"):
        cli.main(["memory", "--config", "lumina-mgpt-7b-768", "--max-len", "64", "--lantern", "--sage"])


def test_prefill_chunk_and_attention_path_set_the_prefill_activations(capsys):
    """A 32k prompt: one pass holds activations for all its tokens, chunks of 4,096 (the default) for a chunk's; the
    blockwise path holds no [T, S] scores (a direct-path chunk of 512 over the cache does); short prompts are not
    chunked; the CLI takes the chunk."""
    cfg = MEM.load_config("llama-2-7b")
    act = lambda **kw: MEM.estimate(cfg, {}, 1, 32768 + 64, prompt_len=32768, tree_nodes=1, **kw)[  # noqa: E731
        "components"]["activations"]["detail"]
    one, auto, small = act(prefill_chunk=None), act(), act(prefill_chunk=512)
    assert one["prefill_tokens_at_once"] == 32768 and one["prefill_blockwise"]
    assert auto["prefill_tokens_at_once"] == 4096 and auto["prefill_blockwise"]
    assert small["prefill_tokens_at_once"] == 512 and not small["prefill_blockwise"]
    assert auto["prefill_mlp"] * 8 == one["prefill_mlp"] and auto["prefill"] < one["prefill"] / 4
    assert small["prefill_attention_scores"] == 32 * 512 * (32768 + 64) * (4 + 4 + 2)  # [T, S] scores per layer
    assert auto["prefill_attention_scores"] < small["prefill_attention_scores"] / 30
    short = MEM.estimate(cfg, {}, 1, 2048, prompt_len=2000)["components"]["activations"]["detail"]
    assert short["prefill_tokens_at_once"] == 2000
    assert cli.main(["memory", "--config", "llama-2-7b", "--max-len", "32832", "--prompt-len", "32768", "--prefill-chunk",
                     "2048"]) == 0
    assert "in chunks of 2048, blockwise attention" in capsys.readouterr().out
    with pytest.raises(ValueError, match="prefill_chunk must be"):
        MEM.estimate(cfg, {}, 1, 2048, prefill_chunk=0)


@pytest.mark.parametrize("name, cls", [("qwen3.5-9b", "Qwen3_5ForCausalLM"),
                                       ("qwen3.5-35b-a3b", "Qwen3_5MoeForCausalLM")])
def test_qwen3_5_plans_count_as_transformers_with_the_state_and_an_mtp_head(name, cls):
    """The hybrid language models' params equal transformers' model built from the config (meta device); the cache
    holds the attention layers' K/V and the linear layers' state; the verify's per-node commit inputs are counted;
    `mtp=True` adds the head (its count equals a real head's on a tiny target) and refuses a target without one."""
    import copy

    import jax
    import torch
    import transformers

    import ports
    from jspec.parts.drafters import mtp as MT
    from ports.families import qwen3_5 as Q5

    cfg = MEM.load_config(name)
    conf = transformers.AutoConfig.for_model(**copy.deepcopy(cfg))
    with torch.device("meta"):
        ref = sum(p.numel() for p in getattr(transformers, cls)(conf).parameters())
    p = MEM.estimate(cfg, {"tensor": 2}, batch=2, max_len=1024, tree_nodes=16, mtp=True)
    assert p["target"]["params"] == ref
    text = Q5.config_from_hf(cfg)
    kv = 2 * 2 * 1024 * len(text.attention_layers) * text.num_kv_heads * text.head_dim * 2  # bf16, 2 rows
    state = 2 * len(text.linear_layers) * (3 * text.conv_channels * 2 + text.linear_value_heads * text.linear_key_dim
                                           * text.linear_value_dim * 4)
    c = p["components"]
    assert c["kv_cache"]["total"] == kv + state + 3 * 2 * 4  # (+ length, start, pos_offset: int32 per row)
    assert c["recurrent_verify"]["total"] == MEM.recurrent_verify_bytes(text, 2, 16, np.dtype("bfloat16"))
    assert c["mtp_head"]["per_device"] == c["mtp_head"]["total"]  # replicated
    tiny = {**cfg, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 40, "num_experts": 4, "num_hidden_layers": 4, "layer_types": None,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 97,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 12, "num_experts_per_tok": 2}
    target = ports.random_model(Q5.config_from_hf(tiny), key=0)
    count = MEM.estimate(tiny, {}, 1, 64, dtype="float32", mtp=True)["components"]["mtp_head"]["count"]
    assert count == MT.init_head(target, jax.random.key(0)).num_params
    with pytest.raises(ValueError, match="MTP head"):
        MEM.estimate(MEM.load_config("qwen3-8b"), {}, 1, 64, mtp=True)
