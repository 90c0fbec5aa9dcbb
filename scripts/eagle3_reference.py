"""EAGLE-3 reference outputs from vLLM's `speculators` package, for jspec's parity tests (`tests/test_eagle3.py`).

Runs in an environment with `speculators` (its pins conflict with jspec's transformers; `scripts/speculators_env.sh`
makes one). Two commands, each writing only under OUT:

    python scripts/eagle3_reference.py make OUT [--seed S]
        a tiny random LLaMA verifier (OUT/verifier, HF safetensors) and a random EAGLE-3 head for it built and
        saved by `speculators` (OUT/head: its config.json and model.safetensors, a reduced draft vocabulary with
        d2t / t2d), then `logits` below on OUT/head
    python scripts/eagle3_reference.py logits HEAD VERIFIER OUT [--steps 3]
        loads HEAD with `speculators` (a head jspec saved, or one it made) and writes OUT/reference.npz: random
        fused target states `hidden` [1, T, 3D] and `tokens` [1, T + 1], and per training-time-test step s the
        draft logits `logits_s` [1, T, Vd] that its `Eagle3DraftModel.forward` computes (read from its LM head)
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

T = 12  # positions of the reference sequence


def make(out: str, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from speculators.models.eagle3 import Eagle3DraftModel

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2)
    verifier = LlamaForCausalLM(cfg).eval()
    vdir = os.path.join(out, "verifier")
    verifier.save_pretrained(vdir, safe_serialization=True)
    draft_ids = torch.sort(torch.randperm(cfg.vocab_size)[:64]).values  # the draft vocabulary, target ids
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    d2t = draft_ids - torch.arange(draft_ids.numel())
    head_cfg = LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": 1})
    model = Eagle3DraftModel.from_training_args(
        head_cfg, t2d=t2d, d2t=d2t, draft_vocab_size=draft_ids.numel(), norm_before_residual=False, ttt_steps=3,
        verifier_name_or_path=vdir, target_layer_ids=[1, 3, 5], draft_attn_impl="eager")
    with torch.no_grad():  # random trainable weights; norms away from 1 so that a missed norm shows
        for name, p in model.named_parameters():
            if name.startswith(("embed_tokens", "verifier_")):
                continue
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    hdir = os.path.join(out, "head")
    model.save_pretrained(hdir)
    logits(hdir, vdir, out, 3, seed)


def logits(head: str, verifier: str, out: str, steps: int, seed: int = 0) -> None:
    import torch

    from speculators.models.eagle3 import Eagle3DraftModel

    torch.manual_seed(seed + 1)
    with open(os.path.join(head, "config.json")) as f:
        conf = json.load(f)
    conf["transformer_layer_config"]["_attn_implementation"] = "eager"
    model = Eagle3DraftModel.from_pretrained(head, verifier=verifier, attn_implementation="eager").eval()
    model.config.transformer_layer_config._attn_implementation = "eager"
    for layer in model.layers:
        layer.self_attn.config._attn_implementation = "eager"
    model._attn_impl = "eager"
    from speculators.models.attention import create_float_mask
    model._create_mask_fn = create_float_mask
    from safetensors import safe_open

    with safe_open(os.path.join(head, "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    if "embed_tokens.weight" not in stored:  # a head saved without its embedding reads the verifier's, as vLLM
        model._load_verifier_weights(overwrite_embed_tokens=True)  # does (from_pretrained may init it at random)
    D = model.hidden_size
    n = len(model.config.eagle_aux_hidden_state_layer_ids)
    V = model.embed_tokens.weight.shape[0]
    hidden = torch.randn(1, T, n * D)
    tokens = torch.randint(0, V, (1, T + 1))
    caught = []
    hook = model.lm_head.register_forward_hook(lambda mod, inp, o: caught.append(o.detach().float().numpy()))
    with torch.no_grad():
        model(hidden_states=hidden, input_ids=tokens[:, 1:], document_ids=torch.zeros(1, T, dtype=torch.long),
              position_ids=torch.arange(1, T + 1)[None], ttt_steps=steps)
    hook.remove()
    arrays = {"hidden": hidden.numpy(), "tokens": tokens.numpy().astype(np.int32),
              "aux_layers": np.asarray(model.config.eagle_aux_hidden_state_layer_ids, np.int32)}
    if model.d2t is not None:
        arrays["draft_ids"] = (torch.arange(model.d2t.numel()) + model.d2t).numpy().astype(np.int32)
    arrays.update({f"logits_{s}": x for s, x in enumerate(caught)})
    os.makedirs(out, exist_ok=True)
    np.savez(os.path.join(out, "reference.npz"), **arrays)
    print(f"wrote {os.path.join(out, 'reference.npz')}: {len(caught)} steps of logits {caught[0].shape}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("out")
    m.add_argument("--seed", type=int, default=0)
    lg = sub.add_parser("logits")
    lg.add_argument("head")
    lg.add_argument("verifier")
    lg.add_argument("out")
    lg.add_argument("--steps", type=int, default=3)
    lg.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.cmd == "make":
        make(a.out, a.seed)
    else:
        logits(a.head, a.verifier, a.out, a.steps, a.seed)


if __name__ == "__main__":
    main()
