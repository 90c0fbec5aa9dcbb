"""The tiny (target, draft) pair the engine tests share: a 3-layer random LLaMA and its first layer as the draft
(later target layers damped, so the draft agrees with the target often but not always), and ragged prompts."""
import dataclasses

import numpy as np

import ports

CFG = ports.TextConfig(model_type="llama", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3,
                       num_heads=4, num_kv_heads=2, head_dim=16)
PROMPTS = [np.arange(5) % 97, (np.arange(14) * 7) % 97, (np.arange(9) * 3 + 1) % 97]


def tiny_pair():
    """(target, draft): the draft is the target's first layer with the same embeddings and head."""
    target = ports.random_model(CFG, key=0, std=0.3)
    for layer in target.params["layers"][1:]:
        layer["wo"] = layer["wo"] * 0.3
        layer["w_down"] = layer["w_down"] * 0.3
    p = dict(target.params)
    p["layers"] = p["layers"][:1]
    return target, ports.Model(dataclasses.replace(CFG, num_layers=1), p)
