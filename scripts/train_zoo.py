"""Train the zoo's model pairs on the synthetic world, export them in HF layout, and measure them.

Models (presets in `PRESETS`; our ports are the models; the text pair is trained from scratch):
    text-base     LLaMA, hidden 256, 6 layers, 4 heads, tied embeddings (5.1M params); a stage, not shipped
                  (exported into build/stages/text-base): the image target's LM and the text target start from it
    text-target   LLaMA, hidden 256, 12 layers (9.9M params), grown from text-base (`grow_params`: each layer
                  twice, the twin's output projections zero, so it starts as text-base's function) and trained
                  on examples text-base never read (`data_start`)
    text-draft-base  LLaMA, hidden 128, 3 layers, 2 heads, tied embeddings (0.73M params); a stage (build/stages):
                  the image draft's LM and the text draft start from it
    text-draft    LLaMA, hidden 128, 6 layers (1.33M params), grown from text-draft-base as text-target is from
                  text-base
    image-target-base  LLaVA-1.5: CLIP-style tower (60 px, patch 20 -> 9 tokens, one per grid cell; hidden 128,
                  4 layers) + GELU projector + text-base's LLaMA; every image-world task (data.TARGET_TASKS), the
                  multi-image OOD ones included (`allow_ood`: OOD means out of the draft's distribution, as in
                  TABED), in rows of 160 tokens (a five-image story takes ~130); a stage (build/stages), shipped as
                  image-target until 2026-11-24
    image-target-focus  a stage: image-target-base continued on VQA-dense data (each VQA task listed 5x, ~78% of
                  examples) with `focus_loss`: head 0 of layer 2 is taught, on each answer read off one object
                  (`Turn.focus`), to attend to that object's image token
    image-target  image-target-focus continued on the same data with `focus_readout` too: that head's write
                  alone, through the LM head, must name the attribute (the lookup circuit the answer loss alone
                  did not form; README, "Zoo models")
    image-draft   LLaVA-1.5: tower hidden 64, 2 layers + text-draft-base's LLaMA; single-image and text tasks
                  only (data.DRAFT_TASKS: multi-image prompts stay out of its distribution, and the "prior" tasks,
                  text-only positioned stories and totals, stand in for a real draft LM's text pretraining), 20%
                  of examples in TABED's text-only view (t_view_prob=0.2)
    image-target-vqa  a stage: image-target-base continued on the VQA-dense data with the answer loss alone
                  (stopped at step 2030 of 4000: superseded by the focus losses)
    video-target  Qwen2.5-VL: a Qwen2.5-VL vision tower (48 px frames, patch 8, temporal patch 2, 2x2 merger: 9
                  tokens per two frames, 288 per 64-frame clip; hidden 128, 4 blocks, window attention inside each
                  grid cell except blocks 1 and 3) + a Qwen2 LM started from image-target's LLaMA (hidden 256, 6
                  layers; q/k/v biases start at zero; M-RoPE sections (8, 12, 12)); the video tasks of
                  `jspec.tools.zoo.video` (moves, appearances, counts over time, detailed descriptions), with the focus
                  losses of image-target from the start and `time_loss` (each video token's stream must name its
                  temporal group)
    video-draft   the same family and recipe: tower hidden 64, 2 blocks + image-draft's LLaMA (hidden 128, 3 layers)
The video models train on rows of one clip and several QA segments about it (`jspec.tools.zoo.video.batches`: each
segment sees the clip and itself only, at the positions greedy decoding gives it alone: the question at its prompt's
M-RoPE ids, the answer where generation feeds it (`video.segment_positions`), so a row is several single-question
prompts and their answers that read the clip once); the clips are rendered in `--workers` processes. Their recipe is the image pair's:
tower pretraining on per-token attributes (each merged token's cell: colour, shape, size, row, column and motion
direction, per temporal group), alignment (LM and tower frozen, the merger learns), then everything. For them
`--minutes` bounds the whole command (tower pretraining and compiles included), so a run in a fixed-length job
stops in time with a checkpoint; `--schedule-minutes` sizes the learning-rate schedule for several such runs.
The image models follow LLaVA's recipe in three stages, all in one `train` run: (1) the tower is pretrained alone
(`tower_steps`, supervised on each scene's attributes: kind, the sign's characters, per bar colour/value from all
tokens, and each grid cell's colour/shape/size/row/column from that cell's own token; our stand-in for a pretrained
CLIP); (2) alignment: the LM starts from a trained text model (`init_lm`) and stays frozen, with the pretrained
tower, while the projector learns to feed it (`align_steps`); (3) everything trains, the LM at `lm_lr_scale` and the
tower at `tower_lr_scale` of the learning rate. Both image models train on batches of 16 rows: in 8-minute trials of
the image target (100 alignment steps, then the LM), batch 16 reached a held-out VQA exact match of 0.44, batch 32
0.33 and batch 8 0.41; more, smaller steps win at this budget. Trained from scratch end to end instead (the first
attempt), the LM learned the answers' text and ignored the image: its logits moved by <= 0.0015 when the pixels
were zeroed.
The text pair reads the world's text chats (data.TEXT_TASKS) plus `described_*` tasks registered here: the
single-image tasks (VQA, captions, image-grounded second turns) with each image replaced by its detailed
description ("Picture: There are two shapes. A big red circle is in the top left. ..."), so VQA-style questions
about scenes exist in text form and every training answer follows from the prompt.

Training: AdamW (optax, inject_hyperparams: the learning rate, linear warmup then cosine decay to 10%, is set each
step), global-norm clipping 1.0, weight decay on matrices; packed sequences (`jspec.tools.zoo.data.batches`, pack=True)
under a segment mask (a token attends causally within its own example only) through `ports.families.llama.forward`; the
loss is the mean cross-entropy over answer tokens (`target_mask`: the tokens of assistant answers and their EOS),
plus, with `prompt_loss`, that weight times the mean over the prompt's text tokens (`prompt_mask`).
Fixed seeds (init and data from --seed). Orbax checkpoints every --ckpt-minutes (and on Ctrl-C / SIGTERM) in
--workdir; `--resume` continues from the latest one with the same data stream and learning-rate schedule, so an
interrupted run ends where an uninterrupted one would. The schedule length is --steps, or, without it, estimated
after the first steps to fill --minutes; --minutes also stops the run (checkpointed; resume it later). At the end:
a loss-curve PNG (bench_out/zoo-<name>-loss.png), and the model exported with `ports.save_hf` (bf16
storage) into assets/zoo/jspec_zoo/<name>/ with the tokenizer files (image models: also the LlavaProcessor files) and
training.json, so `transformers.AutoModelForCausalLM` / `AutoTokenizer` (image models:
`LlavaForConditionalGeneration` / `AutoProcessor`) and `jspec.tools.zoo.load(name)` read the directory.

Reproduce the shipped models (commands also in assets/zoo/jspec_zoo/<name>/training.json; a 2-core CPU took ~95 minutes):
    python scripts/train_zoo.py train text-base --steps 1291              # first cosine cycle (sized by --minutes 38)
    python scripts/train_zoo.py train text-base --resume --steps 2600     # warm restart at lr 1e-3, second cycle
    python scripts/train_zoo.py train text-target --steps 1113            # grown from text-base (sized by --minutes 36)
    python scripts/train_zoo.py train text-draft-base --steps 1371        # (sized by --minutes 17)
    python scripts/train_zoo.py train text-draft --steps 1259             # grown from text-draft-base (--minutes 16)
(text-base and text-draft-base are the models shipped as text-target and text-draft until 2026-11-23. A model that
starts from another one, by `grow_from`, `init_from` or `init_lm`, lists that one's commands under "starts_from" in its
training.json.)
A run stopped by --minutes (or Ctrl-C / SIGTERM) continues with the same command plus --resume; an interrupted and
resumed run exports bit-identical weights.
Image pair (needs text-base and text-draft-base, whose LMs it starts from; ~66 minutes here, tower pretraining
included):
    python scripts/train_zoo.py train image-target-base --steps 2400      # 43 min (rows of 160 tokens)
    python scripts/train_zoo.py train image-draft --steps 4911            # (sized by --minutes 18, then --resume)
    python scripts/train_zoo.py train image-target-focus --steps 2000     # 37 min
    python scripts/train_zoo.py train image-target --steps 1600           # 31 min
    python scripts/train_zoo.py train image-target --resume --steps 3200 --restart-lr 1   # second cycle
Video pair (GPU; needs assets/zoo/jspec_zoo/image-target and image-draft, whose LMs it starts from); both at once on one GPU,
each sized to and stopped at 8.5 minutes:
    XLA_PYTHON_CLIENT_PREALLOCATE=false python scripts/train_zoo.py train video-draft --minutes 8.5 --workers 5 \
        --export-partial &
    XLA_PYTHON_CLIENT_PREALLOCATE=false python scripts/train_zoo.py train video-target --minutes 8.5 --workers 9 \
        --export-partial
    python scripts/train_zoo.py eval-video video-target --draft video-draft --n 96
(a longer run over several jobs: --schedule-minutes T --minutes M, then the same with --resume until it finishes)
Those GPU runs trained answers at positions that continued the question; generation feeds them after the clip's
temporal ids (`video.segment_positions`), so both were then fine-tuned from their exports on the fixed rows (CPU,
2 cores; `--init-from DIR` skips the LM init, tower pretraining and alignment; commands in their training.json):
    python scripts/train_zoo.py train video-target --init-from assets/zoo/jspec_zoo/video-target --batch 8 --lr 3e-4 \
        --warmup 20 --minutes 20 --workdir build/zoo/video-target-ft --export-partial
    python scripts/train_zoo.py train video-draft --init-from assets/zoo/jspec_zoo/video-draft --batch 8 --lr 6e-4 \
        --warmup 20 --minutes 8 --workdir build/zoo/video-draft-ft --export-partial
Measure the shipped pairs (exact match per task, acceptance per scenario and view): scripts/eval_zoo.py.
Other commands: `export NAME` (re-export from the latest checkpoint), `plot NAME`.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import ports  # noqa: E402
from ports.core import cache as kvc  # noqa: E402
from jspec.tools.train import trainer as jt  # noqa: E402
from jspec.tools.zoo import data as ZD  # noqa: E402
from jspec.tools.zoo import tokenizer as TK  # noqa: E402
from jspec.tools.zoo import video as VID  # noqa: E402
from jspec.tools.zoo import world as ZW  # noqa: E402
from ports.core import layers as LY  # noqa: E402
from ports.core.fused import fuse_params  # noqa: E402
from ports.families import llama, llava  # noqa: E402
from ports.families import qwen2_vl as QW  # noqa: E402
from ports.families import qwen2_vl_vision as QV  # noqa: E402
from ports.core import vision as VIS  # noqa: E402

ZOO_DIR = ROOT / "assets" / "zoo" / "jspec_zoo"
RESULTS_DIR = ROOT / "bench_out"

ZD.register_described_tasks()
TEXT_PAIR_TASKS = ZD.TEXT_PAIR_TASKS

# --------------------------------------------------------------------------------------------------- presets


@dataclasses.dataclass(frozen=True)
class Preset:
    kind: str                    # "text" (llama) | "image" (llava) | "video" (qwen2_5_vl)
    lm: dict                     # LLaMA shape: hidden, layers, heads, ffn
    vision: dict | None = None   # CLIP tower shape: hidden, layers, heads, ffn (Qwen2.5-VL's: + fullatt, the blocks
                                 # with full attention over a frame; the others attend within a grid cell)
    tasks: tuple = TEXT_PAIR_TASKS
    view: str = "T"
    t_view_prob: float = 0.0
    batch: int = 32
    seq_len: int = 128
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1
    minutes: float = 40.0
    init_lm: str | None = None   # zoo text model whose weights start the LLaVA LM (same shape, same tokenizer)
    align_steps: int = 0         # LLaVA's alignment stage: the LM is frozen for the first steps (tower+projector)
    lm_lr_scale: float = 1.0     # the LM's updates are scaled by this after the alignment stage
    tower_lr_scale: float = 1.0  # the tower's updates are scaled by this after the alignment stage (0 while aligning
                                 # when the tower was pretrained: LLaVA keeps its CLIP tower frozen)
    tower_steps: int = 0         # supervised pretraining of the tower on scene attributes first (our CLIP stand-in)
    allow_ood: bool = False      # may train on the world's OOD (multi-image) tasks: targets only, never a draft
    loss_per_example: bool = False  # weigh packed examples equally (else answer tokens equally); measured worse at
                                    # step 478 of the image target (VQA 0.37 vs 0.48), so off in the presets
    prompt_loss: float = 0.0      # weight of the prompt's text tokens (questions, captions asked for, ...) beside the
                                  # answers' (1.0): predicting "Where is the red ..." -> "circle" needs the same
                                  # lookup in the image that answering needs, so every question trains it;
                                  # measured no better on VQA (README), so 0 in the presets
    focus_loss: float = 0.0       # weight of `focus_nll`: one attention head (focus_head = (layer, head)) is taught
                                  # to look, from each answer token read off one object, at that object's image
                                  # token: a direct signal for the lookup the answer loss alone did not teach
    focus_head: tuple = (2, 0)
    focus_readout: float = 0.0    # weight of `focus_nll`'s readout term: that head's write alone must name the object's
                                  # attribute (with the focus loss alone, the head found the object but its output
                                  # did not carry the shape: a linear probe read it at 0.59)
    time_loss: float = 0.0        # video: weight of `time_nll`: the LM's stream at every video token, entering layer
    time_layer: int = 2           # `time_layer`, must name its temporal group (through a fixed random readout), so
                                  # answers can find "the end" by content; M-RoPE alone leaves that to the query's
                                  # own absolute position, which the LM does not know
    init_from: str | None = None  # an exported model of the same preset shape whose weights start this one
    grow_from: str | None = None  # a trained LLaMA of the same width and half the layers that starts this one
                                  # (`grow_params`: depth growth, the source's function at step 0)
    data_start: int = 0           # index of the first training example (a grown model reads examples its source
                                  # never saw)
    ship: bool = True             # exported into assets/zoo/jspec_zoo/NAME; else a training stage, exported into build/stages


PRESETS = {
    "text-base": Preset("text", dict(hidden=256, layers=6, heads=4, ffn=704), batch=16, lr=2e-3, minutes=38.0,
                        ship=False),
    "text-target": Preset("text", dict(hidden=256, layers=12, heads=4, ffn=704), batch=16, lr=1e-3, warmup=50,
                          minutes=40.0, grow_from="text-base", data_start=1_000_000),
    "text-draft-base": Preset("text", dict(hidden=128, layers=3, heads=2, ffn=352), lr=3e-3, minutes=18.0,
                              ship=False),
    "text-draft": Preset("text", dict(hidden=128, layers=6, heads=2, ffn=352), lr=1.5e-3, warmup=50, minutes=16.0,
                         grow_from="text-draft-base", data_start=1_000_000),
    # the image target shipped until 2026-11-24 (VQA exact match 0.625), now the first stage of the shipped one
    "image-target-base": Preset("image", dict(hidden=256, layers=6, heads=4, ffn=704),
                                dict(hidden=128, layers=4, heads=4, ffn=512), tasks=tuple(ZD.TARGET_TASKS), view="M",
                                allow_ood=True, seq_len=160, batch=16, lr=2e-3, init_lm="text-base", align_steps=200,
                                lm_lr_scale=1.0, tower_steps=3000, tower_lr_scale=0.1, ship=False),
    "image-draft": Preset("image", dict(hidden=128, layers=3, heads=2, ffn=352),
                          dict(hidden=64, layers=2, heads=2, ffn=256), tasks=tuple(ZD.DRAFT_TASKS), view="M",
                          t_view_prob=0.2, batch=16, lr=2e-3, minutes=20.0, init_lm="text-draft-base", align_steps=200,
                          lm_lr_scale=1.0, tower_steps=3000, tower_lr_scale=0.1),
    # image-target-base continued on VQA-dense data (each VQA task listed 5x: ~78% of examples; the other tasks keep
    # ~22% so they are not forgotten), answer loss only: stopped at step 2030 of 4000, superseded by the two below
    "image-target-vqa": Preset("image", dict(hidden=256, layers=6, heads=4, ffn=704),
                               dict(hidden=128, layers=4, heads=4, ffn=512),
                               tasks=tuple(ZD.TARGET_TASKS) + 4 * tuple(ZW.tasks_of("vqa")), view="M", allow_ood=True,
                               seq_len=160, batch=16, lr=1e-3, warmup=50, init_from="image-target-base",
                               tower_lr_scale=0.1, minutes=80.0, ship=False),
    # the same continuation with `focus_loss`: head 0 of layer 2 is taught where the asked-about object is
    "image-target-focus": Preset("image", dict(hidden=256, layers=6, heads=4, ffn=704),
                                 dict(hidden=128, layers=4, heads=4, ffn=512),
                                 tasks=tuple(ZD.TARGET_TASKS) + 4 * tuple(ZW.tasks_of("vqa")), view="M",
                                 allow_ood=True, seq_len=160, batch=16, lr=1e-3, warmup=50,
                                 init_from="image-target-base", tower_lr_scale=0.1, focus_loss=0.1, focus_head=(2, 0),
                                 minutes=60.0, ship=False),
    # the shipped image target: image-target-focus continued with that head's write taught to carry the attribute
    # (`focus_readout`); two cosine cycles (README)
    "image-target": Preset("image", dict(hidden=256, layers=6, heads=4, ffn=704),
                           dict(hidden=128, layers=4, heads=4, ffn=512),
                           tasks=tuple(ZD.TARGET_TASKS) + 4 * tuple(ZW.tasks_of("vqa")), view="M", allow_ood=True,
                           seq_len=160, batch=16, lr=1e-3, warmup=50, init_from="image-target-focus",
                           tower_lr_scale=0.1, focus_loss=0.1, focus_head=(2, 0), focus_readout=0.1, minutes=60.0),
    # the video pair (Qwen2.5-VL; trained on a GPU): every video task, the LMs of the image pair, 512-token rows of
    # one clip and ~7 QA segments
    "video-target": Preset("video", dict(hidden=256, layers=6, heads=4, ffn=704),
                           dict(hidden=128, layers=4, heads=4, ffn=384, fullatt=(1, 3)), tasks=VID.ALL_TASKS,
                           view="M", seq_len=512, batch=32, lr=1e-3, warmup=100, init_lm="image-target",
                           tower_steps=1500, align_steps=200, tower_lr_scale=0.3, focus_loss=0.1,
                           focus_head=(2, 0), focus_readout=0.1, time_loss=0.1, time_layer=2, minutes=8.0),
    "video-draft": Preset("video", dict(hidden=128, layers=3, heads=2, ffn=352),
                          dict(hidden=64, layers=2, heads=2, ffn=256, fullatt=(1,)), tasks=VID.ALL_TASKS, view="M",
                          seq_len=512, batch=32, lr=2e-3, warmup=100, init_lm="image-draft", tower_steps=1000,
                          align_steps=200, tower_lr_scale=0.3, focus_loss=0.1, focus_head=(1, 0), focus_readout=0.1,
                          time_loss=0.1, time_layer=1, minutes=8.0),
    # SpecVLM's control: the video draft's recipe stopped early on a CPU (batch 8, a 25-minute budget: the tower's
    # 300 steps, then 1,656 steps in 19.8 minutes, 2.8% of video-draft's tokens), so that its drafts sit below the
    # ceiling of what the answers allow
    "video-draft-weak": Preset("video", dict(hidden=128, layers=3, heads=2, ffn=352),
                               dict(hidden=64, layers=2, heads=2, ffn=256, fullatt=(1,)), tasks=VID.ALL_TASKS,
                               view="M", seq_len=512, batch=8, lr=1e-3, warmup=50, init_lm="image-draft",
                               tower_steps=300, align_steps=100, tower_lr_scale=0.3, focus_loss=0.1,
                               focus_head=(1, 0), focus_readout=0.1, time_loss=0.1, time_layer=1, minutes=25.0),
}
# One patch per grid cell: image token (r, c) sees exactly cell (r, c), so the tower can give each token the
# attributes of its own cell's object (bound together), which the LM then finds by content.
IMAGE_SIZE, PATCH_SIZE = 20 * ZW.GRID, 20
IMAGE_TOKENS = TK.image_tokens(IMAGE_SIZE, PATCH_SIZE)      # 9 per image ("default" strategy drops CLS)


def text_hf_config(lm: dict) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": TK.VOCAB_SIZE,
            "hidden_size": lm["hidden"], "intermediate_size": lm["ffn"], "num_hidden_layers": lm["layers"],
            "num_attention_heads": lm["heads"], "num_key_value_heads": lm["heads"],
            "head_dim": lm["hidden"] // lm["heads"], "rms_norm_eps": 1e-5, "max_position_embeddings": 512,
            "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu",
            "bos_token_id": TK.BOS_ID, "eos_token_id": TK.EOS_ID, "pad_token_id": TK.PAD_ID}


def mrope_section(head_dim: int) -> tuple[int, int, int]:
    """Qwen2.5-VL's M-RoPE split (16, 24, 24) of head_dim 128, scaled to head_dim: (8, 12, 12) for 64."""
    half = head_dim // 2
    t = half // 4
    return t, (half - t) // 2, half - t - (half - t) // 2


def video_hf_config(p: Preset) -> dict:
    """Qwen2.5-VL config of a video preset: the LM is Qwen2 (q/k/v biases) of the LLaMA shape `p.lm` under M-RoPE;
    the tower reads `jspec.tools.zoo.video`'s clips (window = one grid cell, 16 px); token ids: `video.special_ids()`."""
    v = p.vision
    text = {**text_hf_config(p.lm), "model_type": "qwen2", "max_position_embeddings": 1024,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": list(mrope_section(p.lm["hidden"] // p.lm["heads"]))}}
    text.pop("rope_theta")
    d = {"model_type": "qwen2_5_vl", "text_config": text,
         "vision_config": {"depth": v["layers"], "hidden_size": v["hidden"], "intermediate_size": v["ffn"],
                           "num_heads": v["heads"], "out_hidden_size": p.lm["hidden"], "hidden_act": "silu",
                           "in_channels": 3, "patch_size": VID.PATCH, "temporal_patch_size": VID.TEMPORAL_PATCH,
                           "spatial_merge_size": VID.MERGE, "window_size": VID.PATCH * VID.MERGE,
                           "fullatt_block_indexes": list(v["fullatt"]), "tokens_per_second": VID.TOKENS_PER_SECOND},
         **VID.special_ids(), "tie_word_embeddings": True,
         "bos_token_id": TK.BOS_ID, "eos_token_id": TK.EOS_ID, "pad_token_id": TK.PAD_ID}
    fam = ports.model.family("qwen2_5_vl")
    return fam.config_to_hf(fam.config_from_hf(d))


def hf_config(p: Preset) -> dict:
    """The model's HF config.json dict (parsed by the port's family, so the round trip is the port's own)."""
    text = text_hf_config(p.lm)
    if p.kind == "text":
        return ports.model.family("llama").config_to_hf(ports.model.family("llama").config_from_hf(text))
    if p.kind == "video":
        return video_hf_config(p)
    v = p.vision
    d = {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "text_config": text,
         "vision_config": {"model_type": "clip_vision_model", "hidden_size": v["hidden"],
                           "intermediate_size": v["ffn"], "num_hidden_layers": v["layers"],
                           "num_attention_heads": v["heads"], "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE,
                           "num_channels": 3, "layer_norm_eps": 1e-5, "hidden_act": "quick_gelu"},
         "image_token_index": TK.IMAGE_ID, "vision_feature_layer": -1, "vision_feature_select_strategy": "default",
         "projector_hidden_act": "gelu", "multimodal_projector_bias": True, "tie_word_embeddings": True,
         "bos_token_id": TK.BOS_ID, "eos_token_id": TK.EOS_ID, "pad_token_id": TK.PAD_ID}
    fam = ports.model.family("llava")
    return fam.config_to_hf(fam.config_from_hf(d))


def new_model(p: Preset, seed: int) -> ports.Model:
    hf = hf_config(p)
    fam = ports.model.family(hf["model_type"])
    cfg = fam.config_from_hf(hf)
    return ports.Model(cfg, fuse_params(cfg, fam.init_params(cfg, jax.random.key(seed))), hf)


# ------------------------------------------------------------------------------------------------ the model


def export_dir(name: str) -> Path:
    """Where `train NAME` exports by default: assets/zoo/jspec_zoo/NAME for a shipped model, build/stages/NAME for a stage."""
    return (ZOO_DIR if PRESETS[name].ship else ROOT / "build" / "stages") / name


def source_dir(name: str) -> Path:
    """An exported model: a preset's export directory, or a directory path (relative to the repository root)."""
    if name in PRESETS:
        return export_dir(name)
    d = Path(name)
    return d if d.is_absolute() else ROOT / d


def load_source(name: str, why: str) -> dict:
    """The float32 params of the exported model `name` (a preset or a directory), or SystemExit saying how to
    make it."""
    src = source_dir(name)
    if not (src / "config.json").exists():
        raise SystemExit(f"{src} is missing: train and export {name} first ({why})")
    return ports.load_hf(str(src), jnp.float32).params


def check_fits(params: dict, like: dict, what: str) -> dict:
    """`params`, or SystemExit "`what`: got vs want" when its tree of shapes and dtypes differs from `like`'s."""
    want = jax.tree.map(lambda x: (x.shape, x.dtype), like)
    got = jax.tree.map(lambda x: (x.shape, x.dtype), params)
    if want != got:
        raise SystemExit(f"{what}: {got} vs {want}")
    return params


def qwen2_from_llama(lm: dict, like: dict) -> dict:
    """LLaMA LM params (a text model's, or a LLaVA's "lm") as a Qwen2 LM's: the same weights and zero q/k/v biases
    (`like`: the Qwen2 params, for the bias shapes), so it computes the LLaMA's function (under M-RoPE, on text
    positions, which is RoPE)."""
    layers = [{**lp, "bqkv": jnp.zeros_like(ref["bqkv"])} if "bqkv" in ref and "bqkv" not in lp else dict(lp)
              for lp, ref in zip(lm["layers"], like["layers"])]
    return {**lm, "layers": layers}


def init_lm(p: Preset, model: ports.Model) -> dict:
    """The LM params of `p.init_lm` (an exported zoo text model, or the LM of an exported image model), checked
    against this model's LM shapes (a Qwen2 LM takes a LLaMA's weights with zero q/k/v biases)."""
    src = load_source(p.init_lm, "the multimodal model's LM starts there")
    if p.kind == "video":
        src = qwen2_from_llama(src.get("lm", src), model.params["lm"])
    lm = check_fits(src, model.params["lm"], f"{p.init_lm}'s weights do not fit the LM of this preset")
    src = export_dir(p.init_lm)
    print(f"LM initialised from {src} ({sum(x.size for x in jax.tree.leaves(lm)) / 1e6:.2f}M params)")
    return lm


def start_from(p: Preset, model: ports.Model) -> dict:
    """The params of `p.init_from` (an exported model), checked against `model`'s shapes."""
    params = check_fits(load_source(p.init_from, "this model continues its training"), model.params,
                        f"{p.init_from}'s weights do not fit this preset")
    print(f"starting from {source_dir(p.init_from)}")
    return params


def grow_params(src: dict, layers: int) -> dict:
    """Depth growth of LLaMA params: source layer i starts layers 2i and 2i+1; the second copy's output projections
    (`wo`, `w_down`) are zero, so it adds nothing to the residual stream and the grown model computes exactly the
    source's function at step 0. Its other weights are live copies, so its gradients are not zero."""
    if 2 * len(src["layers"]) != layers:
        raise SystemExit(f"depth growth doubles the layers: the source has {len(src['layers'])}, this preset {layers}")
    grown = []
    for lp in src["layers"]:
        twin = {k: jnp.zeros_like(v) if k in ("wo", "w_down") else jnp.copy(v) for k, v in lp.items()}
        grown += [dict(lp), twin]        # own buffers: the train step donates its params
    return {**src, "layers": grown}


def grown_init(p: Preset, model: ports.Model) -> dict:
    """`model`'s params grown from `p.grow_from`, checked against its shapes."""
    params = check_fits(grow_params(load_source(p.grow_from, "this model grows from it"), len(model.params["layers"])),
                        model.params, f"{p.grow_from}'s weights do not grow into this preset")
    print(f"grown from {export_dir(p.grow_from)}: {len(params['layers']) // 2} -> {len(params['layers'])} layers")
    return params


# ------------------------------------------------------------------------------------- tower pretraining
# LLaVA starts from a pretrained CLIP tower; ours is pretrained here, supervised, to predict what each single-image
# scene holds: its kind; per grid cell the colour, shape and size of the object there, and the cell's row and column;
# the sign's characters and colour; per bar slot the bar's colour and value. Class 0 of every attribute slot is "none /
# not this kind of scene". Two linear heads read the tower's patch features (the ones the projector reads): the cell
# slots from the cell's own token (one head shared by all tokens, so each token states its own object and where it
# is: the LM can copy both from the one token a question's words match), the other slots from all tokens
# concatenated. The heads are dropped afterwards.

TEXT_SLOTS = max(4, max(len(w) for w in ZW.SIGN_WORDS))
BAR_SLOTS = 4
COLOUR_IDS = {c: i + 1 for i, c in enumerate(ZW.COLOURS)}
SHAPE_IDS = {c: i + 1 for i, c in enumerate(ZW.SHAPES)}
SIZE_IDS = {c: i + 1 for i, c in enumerate(ZW.SIZES)}
CHAR_IDS = {c: i + 1 for i, c in enumerate(ZW.TEXT_CHARS)}
KIND_IDS = {"shapes": 0, "text": 1, "chart": 2}
CELL_CLASSES = [len(COLOUR_IDS) + 1, len(SHAPE_IDS) + 1, len(SIZE_IDS) + 1, ZW.GRID, ZW.GRID]  # + the cell's row, col
LABEL_CLASSES = ([3] + CELL_CLASSES * ZW.GRID ** 2
                 + [len(CHAR_IDS) + 1] * TEXT_SLOTS + [len(COLOUR_IDS) + 1]
                 + [len(COLOUR_IDS) + 1, 10] * BAR_SLOTS)


def scene_labels(s: ZW.Scene) -> np.ndarray:
    """int32 [len(LABEL_CLASSES)]: the scene's attributes, slot by slot (0 where a slot does not apply)."""
    y = np.zeros(len(LABEL_CLASSES), np.int32)
    y[0] = KIND_IDS[s.kind]
    A = len(CELL_CLASSES)
    for j in range(ZW.GRID ** 2):              # every token also states where its cell is (row, column)
        y[1 + A * j + 3:1 + A * j + 5] = divmod(j, ZW.GRID)
    if s.kind == "shapes":
        for o in s.objects:
            i = 1 + A * (o.row * ZW.GRID + o.col)
            y[i:i + 3] = COLOUR_IDS[o.colour], SHAPE_IDS[o.shape], SIZE_IDS[o.size]
    base = 1 + A * ZW.GRID ** 2
    if s.kind == "text":
        y[base:base + len(s.text)] = [CHAR_IDS[c] for c in s.text]
        y[base + TEXT_SLOTS] = COLOUR_IDS[s.text_colour]
    base += TEXT_SLOTS + 1
    if s.kind == "chart":
        for j, b in enumerate(s.bars):
            y[base + 2 * j:base + 2 * j + 2] = COLOUR_IDS[b.colour], b.value
    return y


def scene_batch(split: str, n: int, seed: int, start: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixels [n, 3, S, S] and labels [n, slots] of scenes start .. start + n - 1 of a split (deterministic)."""
    import random

    px, ys = [], []
    for i in range(start, start + n):
        rng = random.Random(f"tower/{seed}/{split}/{i}")
        kind = rng.choice(("shapes", "shapes", "shapes", "text", "chart"))
        sc = ZW.scene_in(rng, split, ZW.SCENE_MAKERS[kind])
        px.append(ZD.pixels(sc, IMAGE_SIZE))
        ys.append(scene_labels(sc))
    return np.stack(px), np.stack(ys)


CELL_SLOTS = np.arange(1, 1 + len(CELL_CLASSES) * ZW.GRID ** 2).reshape(ZW.GRID ** 2, -1)  # slots of grid cell j: row j
REST_SLOTS = np.setdiff1d(np.arange(len(LABEL_CLASSES)), CELL_SLOTS.ravel())  # kind (slot 0), sign, bars


def _slot_table(slots: np.ndarray) -> tuple[int, jax.Array, jax.Array]:
    """(total classes, valid [slots, max classes], column of each (slot, class) in a head's output)."""
    nc = np.array(LABEL_CLASSES)[slots]
    offsets = np.concatenate([[0], np.cumsum(nc)[:-1]])
    valid = np.arange(max(LABEL_CLASSES))[None, :] < nc[:, None]
    return int(nc.sum()), jnp.asarray(valid), jnp.asarray(np.where(valid, offsets[:, None] + np.arange(valid.shape[1]),
                                                                   0))


def init_tower_head(dv: int, key: jax.Array) -> dict:
    """The pretraining heads over [N, cells, dv] tower features: `cell_*` (shared by all tokens) reads a cell's
    colour/shape/size from that cell's token; `w`/`b` read the other slots from all tokens concatenated."""
    n_cell, n_rest = _slot_table(CELL_SLOTS[0])[0], _slot_table(REST_SLOTS)[0]
    k1, k2 = jax.random.split(key)
    return {"cell_w": jax.random.normal(k1, (dv, n_cell)) * 0.02, "cell_b": jnp.zeros((n_cell,)),
            "w": jax.random.normal(k2, (ZW.GRID ** 2 * dv, n_rest)) * 0.02, "b": jnp.zeros((n_rest,))}


def tower_head_logits(head: dict, feats: jax.Array) -> jax.Array:
    """[N, len(LABEL_CLASSES), max classes] logits in `scene_labels` slot order (-1e9 past a slot's classes); the
    slots of cell j depend on token j's features only."""
    _, cell_valid, cell_gather = _slot_table(CELL_SLOTS[0])
    _, rest_valid, rest_gather = _slot_table(REST_SLOTS)
    n = feats.shape[0]
    per_cell = (feats @ head["cell_w"] + head["cell_b"])[:, :, cell_gather]        # [N, cells, 3, classes]
    per_cell = jnp.where(cell_valid, per_cell, -1e9).reshape(n, CELL_SLOTS.size, -1)
    flat = (feats.reshape(n, -1) @ head["w"] + head["b"])[:, rest_gather]           # [N, rest slots, classes]
    flat = jnp.where(rest_valid, flat, -1e9)
    return jnp.concatenate([flat[:, :1], per_cell, flat[:, 1:]], axis=1)


def run_tower_pretraining(loss, tp, data, steps: int, warmup: int):
    """`steps` AdamW steps (peak 2e-3 after `warmup`, cosine to 2e-4, global-norm clipping 1.0, weight decay 0.05) on
    `loss(tp, x, y)` over the prefetched batches `data` (closed at the end), with a progress bar; returns tp."""
    from tqdm import tqdm

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 2e-3, warmup, steps, 2e-4), weight_decay=0.05))
    opt = tx.init(tp)

    @jax.jit
    def step(tp, opt, x, y):
        lo, g = jax.value_and_grad(loss)(tp, x, y)
        up, opt = tx.update(g, opt, tp)
        return optax.apply_updates(tp, up), opt, lo

    bar = tqdm(range(steps), desc="tower pretraining", unit="step", mininterval=2.0, dynamic_ncols=True)
    try:
        for _ in bar:
            x, y = next(data)
            tp, opt, lo = step(tp, opt, x, y)
            bar.set_postfix(loss=f"{float(lo):.3f}", refresh=False)
    finally:
        data.close()
        bar.close()
    return tp


def pretrain_tower(p: Preset, model: ports.Model, seed: int, batch: int = 64) -> dict:
    """The tower's params after `p.tower_steps` AdamW steps on scene attributes (progress bar; held-out accuracy per
    attribute group printed at the end)."""
    from tqdm import tqdm

    cfg = model.config
    P, Dv = cfg.tokens_per_image, cfg.vision.hidden_size
    if P != ZW.GRID ** 2:
        raise SystemExit(f"tower pretraining needs one image token per grid cell ({ZW.GRID ** 2}), got {P}")
    head = init_tower_head(Dv, jax.random.key(seed + 1))

    def logits(tp, x):
        feats = VIS.image_features(cfg.vision, tp["vision"], x, cfg.feature_layer, cfg.feature_strategy)
        return tower_head_logits(tp["head"], feats)

    def loss(tp, x, y):
        lg = logits(tp, x)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(lg, -1), y[..., None], -1)[..., 0]
        return nll.sum(-1).mean()

    tp = {"vision": model.params["vision"], "head": head}
    data = jt.Prefetch((scene_batch("train", batch, seed, i * batch) for i in range(p.tower_steps)), size=4)
    tp = run_tower_pretraining(loss, tp, data, p.tower_steps, warmup=50)
    x, y = scene_batch("heldout", 256, seed, 0)
    pred = np.asarray(jnp.argmax(logits(tp, x), -1))
    ok = pred == y
    end = 1 + len(CELL_CLASSES) * ZW.GRID ** 2
    groups = {"kind": (None, [0]), "shapes": (0, list(range(1, end))),
              "text": (1, list(range(end, end + TEXT_SLOTS + 1))), "chart": (2, list(range(end + TEXT_SLOTS + 1,
                                                                                          len(LABEL_CLASSES))))}
    print("tower pretraining, held-out scenes with every attribute right: " + ", ".join(
        f"{g} {ok[(y[:, 0] == k) if k is not None else slice(None)][:, idx].all(1).mean():.2f}"
        for g, (k, idx) in groups.items()))
    return tp["vision"]


# ---------------------------------------------------------------------------------------------- the video pair
# Qwen2.5-VL on `jspec.tools.zoo.video`'s rows: the clip's frames arrive as uint8 and become the processor's patches on
# the device (the same lookup table and layout as `video.video_pixels`); the tower runs on every temporal group of
# every row at once ([B * 32 frames, 36 patches]) and its merged tokens replace the video placeholders, which sit
# at the same positions in every row (`video.PREFIX_VIDEO_START`).


def video_patches(frames: jax.Array) -> jax.Array:
    """uint8 frames [B, F, S, S, 3] -> normalised patches [B * F / 2, (S / p)^2, PATCH_DIM] in the processor's
    layout (`video.video_pixels`, per temporal group)."""
    B = frames.shape[0]
    lut = jnp.asarray(VID._LUT)
    x = jnp.stack([lut[c][frames[..., c]] for c in range(3)], axis=2)        # [B, F, 3, S, S]
    gt, gh, p_, m = VID.GROUPS, VID.GRID_PATCHES, VID.PATCH, VID.MERGE
    x = x.reshape(B * gt, VID.TEMPORAL_PATCH, 3, gh // m, m, p_, gh // m, m, p_).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(B * gt, gh * gh, VID.PATCH_DIM)


def video_tokens(vcfg: QV.QwenVisionConfig, vparams: dict, frames: jax.Array) -> jax.Array:
    """The merged tokens [B, VIDEO_TOKENS, out_dim] of each row's clip (what the port splices over the video
    placeholders), from uint8 frames [B, F, S, S, 3]."""
    B = frames.shape[0]
    patches = video_patches(frames)
    n, Lp = patches.shape[:2]
    rot = QV.frame_rot(vcfg, VID.GRID_PATCHES, VID.GRID_PATCHES)
    window = QV.frame_windows(vcfg, rot, VID.GRID_PATCHES) if vcfg.windowed else np.zeros(Lp, np.int32)
    index, slot = QV.window_gather(vcfg, window[None])
    vo = QV.forward(vcfg, vparams, patches, jnp.broadcast_to(jnp.asarray(rot, jnp.int32), (n, Lp, 2)),
                    jnp.ones((n, Lp), bool), jnp.broadcast_to(jnp.asarray(index), (n,) + index.shape[1:]),
                    jnp.broadcast_to(jnp.asarray(slot), (n, Lp)))
    return vo.merged.reshape(B, VID.VIDEO_TOKENS, -1)


def prefix_mask(qa_segment: jax.Array) -> jax.Array:
    """[B, T, T] bool for video rows: query q sees key s <= q when s is in the clip's prefix (segment 0) or in q's
    own QA segment; padding (-1) sees and is seen by nothing."""
    T = qa_segment.shape[1]
    q, k = qa_segment[:, :, None], qa_segment[:, None, :]
    return (q >= 0) & (k >= 0) & ((k == 0) | (k == q)) & jnp.tril(jnp.ones((T, T), bool))[None]


def video_forward(cfg: QW.QwenVLConfig, params: dict, batch: dict, hidden_layers: tuple = ()) -> llama.ForwardOut:
    """Training forward of a Qwen2.5-VL on `video.batches` rows (the port's forward under M-RoPE and
    `prefix_mask`)."""
    tokens = batch["input_ids"]
    B, T = tokens.shape
    x = llama.embed(params["lm"], tokens)
    feats = video_tokens(cfg.vision, params["vision"], batch["frames"]).astype(x.dtype)
    x = jax.lax.dynamic_update_slice(x, feats, (0, VID.PREFIX_VIDEO_START, 0))
    text = cfg.text
    cache = kvc.init_cache(text.num_layers, B, text.num_kv_heads, T, text.head_dim, x.dtype)
    return QW.forward(cfg, params, tokens, batch["positions"], cache, prefix_mask(batch["qa_segment"]), embeds=x,
                      hidden_layers=hidden_layers)


def pretrain_video_tower(p: Preset, model: ports.Model, seed: int, clips: int = 8, workers: int = 0) -> dict:
    """The Qwen2.5-VL tower's params (merger included) after `p.tower_steps` AdamW steps on per-token attributes:
    one linear head per attribute reads each merged token (a grid cell in a temporal group) and names the colour,
    shape and size of the object there, the cell's row and column, and the object's motion direction (heads
    dropped afterwards; held-out accuracy per attribute printed)."""
    from tqdm import tqdm

    cfg = model.config
    nc = np.array(VID.LABEL_CLASSES)
    offs = np.concatenate([[0], np.cumsum(nc)])
    k1, _ = jax.random.split(jax.random.key(seed + 1))
    head = {"w": jax.random.normal(k1, (cfg.vision.out_dim, int(nc.sum()))) * 0.02, "b": jnp.zeros(int(nc.sum()))}

    def logits(tp, frames):
        return video_tokens(cfg.vision, tp["vision"], frames) @ tp["head"]["w"] + tp["head"]["b"]   # [B, N, sum]

    def loss(tp, frames, y):
        lg = logits(tp, frames)
        y = y.reshape(y.shape[0], VID.VIDEO_TOKENS, -1)
        tot = 0.0
        for i in range(len(nc)):
            lp = jax.nn.log_softmax(lg[..., offs[i]:offs[i + 1]], -1)
            tot = tot - jnp.take_along_axis(lp, y[..., i:i + 1], -1).mean()
        return tot

    tp = {"vision": model.params["vision"], "head": head}
    data = jt.Prefetch(VID.pooled(functools.partial(VID.tower_batch, "train", n=clips, seed=seed),
                                  (i * clips for i in range(p.tower_steps)), workers), size=4)
    tp = run_tower_pretraining(loss, tp, data, p.tower_steps, warmup=min(50, p.tower_steps // 2))
    x, y = VID.tower_batch("heldout", 0, 16, seed)
    lg = np.asarray(jax.jit(logits)(tp, x))
    y = y.reshape(y.shape[0], VID.VIDEO_TOKENS, -1)
    on = y[..., 0] > 0
    accs = [float((lg[..., offs[i]:offs[i + 1]].argmax(-1) == y[..., i])[on].mean()) for i in range(len(nc))]
    print("tower pretraining, held-out accuracy on the tokens of objects: "
          + ", ".join(f"{n} {a:.3f}" for n, a in zip(VID.LABELS, accs)))
    return tp["vision"]


segment_mask = jt.segment_mask


def image_embeds(cfg: llava.LlavaConfig, params: dict, tokens: jax.Array, pixel_values: jax.Array) -> jax.Array:
    """Token embeddings [B, T, D] with the image features spliced over the image-token runs: run j of row b gets
    image slot j of that row (pixel_values [B, K, C, S, S]; slots past the row's images are never read)."""
    B, K = pixel_values.shape[:2]
    x = llama.embed(params["lm"], tokens)
    _, proj = llava.image_features(cfg, params, pixel_values.reshape((B * K,) + pixel_values.shape[2:]))
    feats = proj.reshape(B, K * proj.shape[1], proj.shape[2]).astype(x.dtype)  # row b: its K images' tokens
    is_img = tokens == cfg.image_token_id
    idx = jnp.clip(jnp.cumsum(is_img, axis=1) - 1, 0, feats.shape[1] - 1)
    spliced = jnp.take_along_axis(feats, idx[..., None], axis=1)
    return jnp.where(is_img[..., None], spliced, x)


def logits_fn(model_cfg, params: dict, batch: dict) -> jax.Array:
    """Training forward: logits [B, T, V] of packed rows through the port's forward (an empty cache of T slots,
    the segment mask as the new tokens' visibility)."""
    return forward_fn(model_cfg, params, batch).logits


def forward_fn(model_cfg, params: dict, batch: dict, hidden_layers: tuple = ()) -> llama.ForwardOut:
    """`logits_fn`'s forward, with the residual streams of `hidden_layers` (`llama.forward`'s)."""
    if isinstance(model_cfg, QW.QwenVLConfig):
        return video_forward(model_cfg, params, batch, hidden_layers)
    tokens = batch["input_ids"]
    B, T = tokens.shape
    if isinstance(model_cfg, llava.LlavaConfig):
        text_cfg, lm = model_cfg.text, params["lm"]
        embeds = image_embeds(model_cfg, params, tokens, batch["pixel_values"]) if "pixel_values" in batch else None
    else:
        text_cfg, lm, embeds = model_cfg, params, None
    cache = kvc.init_cache(text_cfg.num_layers, B, text_cfg.num_kv_heads, T, text_cfg.head_dim,
                           jax.tree.leaves(lm)[0].dtype)
    return llama.forward(text_cfg, lm, tokens, batch["positions"], cache, segment_mask(batch["segment_ids"]),
                         embeds=embeds, hidden_layers=hidden_layers)


def text_parts(model_cfg, params: dict) -> tuple:
    """(the language model's config, its params) of a text, LLaVA or Qwen2.5-VL model."""
    if isinstance(model_cfg, (llava.LlavaConfig, QW.QwenVLConfig)):
        return model_cfg.text, params["lm"]
    return model_cfg, params


def video_attention(cfg: QW.QwenVLConfig, batch: dict) -> tuple:
    """((cos, sin), visibility [B, T, T]) of video rows as `video_forward` uses them: M-RoPE of the (t, h, w)
    positions and `prefix_mask`."""
    return LY.mrope_tables(cfg.text, batch["positions"], cfg.mrope_section), prefix_mask(batch["qa_segment"])


def focus_logprobs(text_cfg, layer_params: dict, x: jax.Array, batch: dict, head: int, rope=None,
                   visible=None) -> jax.Array:
    """[B, T, T] log attention probabilities of one head of one layer over the keys, from that layer's input
    residual stream x [B, T, D]: the same queries, keys, RoPE and segment mask as its forward (a recomputation of
    one head, so the port's forward stays as it is); `rope` / `visible` (video rows: `video_attention`) replace
    the batch's RoPE tables and segment mask."""
    B, T, _ = x.shape
    h = LY.rms_norm(x, layer_params["attn_norm"], text_cfg.rms_norm_eps)
    q, k, _ = LY.project_qkv(text_cfg, layer_params, h)
    cos, sin = LY.rope_tables(text_cfg, batch["positions"]) if rope is None else rope
    q, k = LY.apply_rope(q, cos, sin), LY.apply_rope(k, cos, sin)
    kv = head // (text_cfg.num_heads // text_cfg.num_kv_heads)
    scores = jnp.einsum("btd,bsd->bts", q[:, :, head], k[:, :, kv]).astype(jnp.float32) * q.shape[-1] ** -0.5
    visible = segment_mask(batch["segment_ids"]) if visible is None else visible
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    return jax.nn.log_softmax(scores, axis=-1)


def head_write(text_cfg, layer_params: dict, x: jax.Array, logp: jax.Array, head: int) -> jax.Array:
    """[B, T, D]: what head `head` adds to the residual stream (its values under attention exp(logp), through its
    rows of the output projection), from the layer's input stream x."""
    B, T, _ = x.shape
    h = LY.rms_norm(x, layer_params["attn_norm"], text_cfg.rms_norm_eps)
    _, _, v = LY.project_qkv(text_cfg, layer_params, h)
    kv = head // (text_cfg.num_heads // text_cfg.num_kv_heads)
    o = jnp.einsum("bts,bsd->btd", jnp.exp(logp), v[:, :, kv])
    Dh = o.shape[-1]
    return o @ layer_params["wo"][head * Dh:(head + 1) * Dh]


def attribute_ids() -> np.ndarray:
    """Token ids of the words an answer reads off one object (colours, shapes, sizes, positions, yes), with and
    without a leading space, where the word is one token."""
    words = list(ZW.COLOURS) + list(ZW.SHAPES) + ["big", "small", "top", "middle", "bottom", "left", "right", "center",
                                                "yes", "Yes"]
    tok = TK.load_tokenizer().backend_tokenizer
    ids = [tok.encode(pre + w, add_special_tokens=False).ids for w in words for pre in ("", " ")]
    return np.unique([i[0] for i in ids if len(i) == 1])


def focus_nll(text_cfg, lm: dict, x: jax.Array, batch: dict, layer: int, head: int,
              readout_ids: jax.Array | None = None, rope=None, visible=None) -> tuple[jax.Array, jax.Array]:
    """(mean -log attention of head `head` of layer `layer` on the focus cell's image token, over the positions
    whose target is read off one object (`target_focus` >= 0); and, with `readout_ids`, the mean
    cross-entropy of the target where it is one of those ids, under the logits of the head's write alone (final
    norm + LM head: the head's direct path to the answer), else 0). x: that layer's input stream; rope, visible:
    see `focus_logprobs`."""
    f = batch["target_focus"]
    on = (f >= 0).astype(jnp.float32)
    logp = focus_logprobs(text_cfg, lm["layers"][layer], x, batch, head, rope, visible)
    at = jnp.take_along_axis(logp, jnp.maximum(f, 0)[..., None], axis=-1)[..., 0]
    readout = jnp.zeros((), jnp.float32)
    if readout_ids is not None:
        words = on * jnp.isin(batch["targets"], readout_ids).astype(jnp.float32)
        lg = llama.unembed(text_cfg, lm, head_write(text_cfg, lm["layers"][layer], x, logp, head))
        nll = -jnp.take_along_axis(jax.nn.log_softmax(lg, -1), batch["targets"][..., None], -1)[..., 0]
        readout = (nll * words).sum() / jnp.maximum(words.sum(), 1.0)
    return -(at * on).sum() / jnp.maximum(on.sum(), 1.0), readout


def prompt_mask(batch: dict) -> jax.Array:
    """[B, T] 1 where the target is a prompt text token of the same example: not an answer token, not an image
    token, not padding or a special token (ids below 6: pad, BOS, EOS, image, the chat roles)."""
    t = batch["targets"]
    return ((batch["segment_ids"] > 0) & (t >= 6) & (batch["target_mask"] == 0)).astype(jnp.float32)


def time_nll(x: jax.Array) -> jax.Array:
    """Mean cross-entropy of each video token's temporal group under a fixed random linear readout of the
    (normalised) stream x [B, T, D] at the video placeholders of `video.batches` rows (the readout is a constant:
    the model learns to write the group where the readout looks)."""
    v = jax.lax.dynamic_slice_in_dim(x, VID.PREFIX_VIDEO_START, VID.VIDEO_TOKENS, axis=1).astype(jnp.float32)
    v = v * jax.lax.rsqrt(jnp.mean(v * v, axis=-1, keepdims=True) + 1e-6)
    proj = jax.random.normal(jax.random.key(20261125), (x.shape[-1], VID.GROUPS)) * x.shape[-1] ** -0.5
    logp = jax.nn.log_softmax(2.0 * v @ proj, axis=-1)
    group = np.repeat(np.arange(VID.GROUPS), VID.TOKENS_PER_GROUP)
    return -jnp.mean(logp[:, np.arange(VID.VIDEO_TOKENS), group])


def loss_fn(model_cfg, params, batch, per_example: bool = False, prompt_loss: float = 0.0,
            focus_loss: float = 0.0, focus_head: tuple[int, int] = (2, 0), focus_readout: float = 0.0,
            time_loss: float = 0.0, time_layer: int = 2):
    """The objective (cross-entropy over answer tokens under `answer_weights`, plus `prompt_loss` x the mean over
    prompt text tokens, plus `focus_loss` x `focus_nll` of head focus_head = (layer, head), plus `focus_readout` x
    its readout term over `attribute_ids`, plus `time_loss` x `time_nll` of the stream entering `time_layer` (video
    rows)); aux: (mean cross-entropy per answer token, answer-token accuracy, number of answer tokens): the answers
    alone, whatever the objective; then `focus_nll`'s attention and readout terms (0 without `focus_loss`), and
    `time_nll` (0 without `time_loss`)."""
    layer, head = focus_head
    wanted = ((layer,) if focus_loss else ()) + ((time_layer,) if time_loss and time_layer != layer else ())
    out = forward_fn(model_cfg, params, batch, wanted)
    hidden = dict(zip(wanted, out.hidden))
    logits = out.logits
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    m = batch["target_mask"]
    n = jnp.maximum(m.sum(), 1.0)
    acc = ((jnp.argmax(logits, -1) == batch["targets"]) * m).sum() / n
    segments = batch["segment_ids"] if "segment_ids" in batch else jnp.maximum(batch["qa_segment"], 0)
    objective = (nll * jt.answer_weights(segments, m, per_example)).sum()
    if prompt_loss:
        pm = prompt_mask(batch)
        objective = objective + prompt_loss * (nll * pm).sum() / jnp.maximum(pm.sum(), 1.0)
    focus = readout = jnp.zeros((), jnp.float32)
    if focus_loss:
        text_cfg, lm = text_parts(model_cfg, params)
        ids = jnp.asarray(attribute_ids()) if focus_readout else None
        rope, visible = video_attention(model_cfg, batch) if isinstance(model_cfg, QW.QwenVLConfig) else (None, None)
        focus, readout = focus_nll(text_cfg, lm, hidden[layer], batch, layer, head, ids, rope, visible)
        objective = objective + focus_loss * focus + focus_readout * readout
    timing = jnp.zeros((), jnp.float32)
    if time_loss:
        timing = time_nll(hidden[time_layer])
        objective = objective + time_loss * timing
    return objective, ((nll * m).sum() / n, acc, m.sum(), focus, readout, timing)


def make_optimizer(p: Preset) -> optax.GradientTransformation:
    return jt.adamw(p.weight_decay)


def stage_scales(p: Preset, step: int) -> tuple[float, float]:
    """(LM, tower) update scales at `step`: while aligning the LM is frozen, and so is a pretrained tower (LLaVA's
    frozen CLIP; a tower trained from scratch learns from the start); afterwards `lm_lr_scale`, `tower_lr_scale`."""
    aligning = step < p.align_steps
    return (0.0 if aligning else p.lm_lr_scale), (0.0 if aligning and p.tower_steps else p.tower_lr_scale)


def make_steps(model_cfg, tx, per_example: bool = False, prompt_loss: float = 0.0, focus_loss: float = 0.0,
               focus_head: tuple[int, int] = (2, 0), focus_readout: float = 0.0, time_loss: float = 0.0,
               time_layer: int = 2):
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch, lr, lm_scale, tower_scale=1.0):
        (_, (loss, acc, n, focus, readout, timing)), grads = jax.value_and_grad(
            functools.partial(loss_fn, model_cfg, per_example=per_example, prompt_loss=prompt_loss,
                              focus_loss=focus_loss, focus_head=focus_head, focus_readout=focus_readout,
                              time_loss=time_loss, time_layer=time_layer),
            has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, jt.set_lr(opt_state, lr), params)
        if "lm" in updates:   # LLaVA / Qwen2.5-VL: the LM's and tower's steps (weight decay included) are scaled
            vision = updates["vision"]
            if "merger" in vision:     # Qwen2.5-VL's merger is its projector: it learns at the full rate
                vision = {k: v if k == "merger" else jax.tree.map(lambda u: u * tower_scale, v)
                          for k, v in vision.items()}
            else:
                vision = jax.tree.map(lambda u: u * tower_scale, vision)
            updates = {**updates, "lm": jax.tree.map(lambda u: u * lm_scale, updates["lm"]), "vision": vision}
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, "acc": acc, "focus": focus,
                                                                 "readout": readout, "time": timing,
                                                                 "grad_norm": optax.global_norm(grads)}

    @jax.jit
    def eval_step(params, batch):
        _, (loss, acc, n, _, _, _) = loss_fn(model_cfg, params, batch)
        return loss * n, acc * n, n

    return train_step, eval_step


# ------------------------------------------------------------------------------------------------------ data


DEVICE_KEYS = ("input_ids", "targets", "target_mask", "segment_ids", "positions")
VIDEO_KEYS = ("frames", "input_ids", "targets", "target_mask", "qa_segment", "positions")


def stream(p: Preset, split: str, seed: int, start: int, workers: int = 0):
    """(batch of device arrays, next data index, tokens) per step from example `start` on; video presets' rows
    are made in `workers` processes."""
    if p.kind == "video":
        for b in VID.batches(split, p.batch, p.seq_len, seed, tasks=p.tasks, start=start, workers=workers):
            keep = {k: b[k] for k in VIDEO_KEYS + (("target_focus",) if p.focus_loss else ())}
            yield keep, int(b["next_index"]), int((b["qa_segment"] >= 0).sum())
        return
    kw = dict(tasks=p.tasks, view=p.view, t_view_prob=p.t_view_prob, image_tokens=IMAGE_TOKENS,
              image_size=IMAGE_SIZE, pack=True, start=start, allow_ood=p.allow_ood)
    for b in ZD.batches(split, p.batch, p.seq_len, seed, **kw):
        keep = {k: b[k] for k in DEVICE_KEYS + (("target_focus",) if p.focus_loss else ())}
        if p.kind == "image" and b["pixel_values"].shape[1]:
            keep["pixel_values"] = b["pixel_values"]
        yield keep, int(b["next_index"]), int(b["attention_mask"].sum())


# ------------------------------------------------------------------------------------------------- training


def heldout_batches(p: Preset, seed: int, n: int = 4) -> list[dict]:
    it = stream(p, "heldout", seed, 0)
    return [next(it)[0] for _ in range(n)]


FINAL_MARGIN_S = 30.0     # video presets: time kept after the loop for the final checkpoint, plot and export
FINE_TUNE_DATA_START = 1_000_000   # --init-from: the first training row (past the rows the source was trained on)


def train(args) -> None:
    started = time.perf_counter()
    name, p = args.name, PRESETS[args.name]
    if args.batch:
        p = dataclasses.replace(p, batch=args.batch)
    if args.lr:
        p = dataclasses.replace(p, lr=args.lr)
    if args.tower_steps is not None:
        p = dataclasses.replace(p, tower_steps=args.tower_steps)
    if args.init_from:        # continue an exported model: no LM init, tower pretraining or alignment; fresh rows
        p = dataclasses.replace(p, init_from=args.init_from, init_lm=None, grow_from=None, tower_steps=0,
                                align_steps=0, data_start=FINE_TUNE_DATA_START)
    if args.warmup is not None:
        p = dataclasses.replace(p, warmup=args.warmup)
    workdir = Path(args.workdir or ROOT / "build" / "zoo" / name).resolve()
    if workdir.exists() and not args.resume:
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model = new_model(p, args.seed)
    if p.init_lm and not args.resume:
        model = dataclasses.replace(model, params={**model.params, "lm": init_lm(p, model)})
    if p.init_from and not args.resume:
        model = dataclasses.replace(model, params=start_from(p, model))
    if p.grow_from and not args.resume:
        model = dataclasses.replace(model, params=grown_init(p, model))
    if p.tower_steps and not args.resume:
        tower = (pretrain_video_tower(p, model, args.seed, workers=args.workers) if p.kind == "video" else
                 pretrain_tower(p, model, args.seed))
        model = dataclasses.replace(model, params={**model.params, "vision": tower})
    tx = make_optimizer(p)
    state = {"params": model.params, "opt_state": tx.init(model.params)}
    train_step, eval_step = make_steps(model.config, tx, p.loss_per_example, p.prompt_loss, p.focus_loss,
                                       tuple(p.focus_head), p.focus_readout, p.time_loss, p.time_layer)
    ckpts = jt.Checkpoints(workdir)
    meta = jt.new_meta(name, args.seed, args.steps, p.lr, p.warmup, next_index=p.data_start,
                      preset=dataclasses.asdict(p))
    if args.init_from and not args.resume:    # the continued model's own record, for the export's history
        info = source_dir(args.init_from) / "training.json"
        meta["source_info"] = json.loads(info.read_text()) if info.exists() else None
    if args.resume:
        try:
            state, meta, resumed = jt.resume(ckpts, state, meta, args.steps, p.lr * args.restart_lr)
        except ValueError as e:
            raise SystemExit(f"{e} (--steps, --seed and the model name must match the checkpoint's)") from None
        if resumed:
            print(f"resumed {name} at step {meta['step']} (example {meta['next_index']}) from {workdir}; "
                  f"schedule {meta['schedule']}")
    print(f"{name}: {model.num_params / 1e6:.2f}M params, batch {p.batch} x {p.seq_len}, tasks {list(p.tasks)}, "
          f"view {p.view} (T with p={p.t_view_prob}), lr {p.lr}, workdir {workdir}")
    held = heldout_batches(p, args.seed)

    def step(state, batch, lr, i):
        params, opt_state, m = train_step(state["params"], state["opt_state"], batch, np.float32(lr),
                                          *map(np.float32, stage_scales(p, i)))
        logged = {"loss": m["loss"], "acc": m["acc"], "grad_norm": m["grad_norm"]}
        if p.focus_loss:
            logged["focus_nll"] = m["focus"]
        if p.focus_readout:
            logged["readout_nll"] = m["readout"]
        if p.time_loss:
            logged["time_nll"] = m["time"]
        return {"params": params, "opt_state": opt_state}, logged

    def evaluate(state):
        loss, acc = jt.weighted_means(eval_step, state["params"], held)
        return {"heldout_loss": loss, "heldout_acc": acc}

    budget = 60.0 * (args.minutes if args.minutes is not None else p.minutes)
    if p.kind == "video":     # --minutes bounds the whole command (a job of fixed length): what is left for the loop
        budget -= time.perf_counter() - started + FINAL_MARGIN_S
        if budget <= 0:
            raise SystemExit(f"--minutes {args.minutes or p.minutes} leaves no time for training after the setup")
    schedule = None if args.schedule_minutes is None else 60.0 * args.schedule_minutes
    data = stream(p, "train", args.seed, meta["next_index"], workers=args.workers if p.kind == "video" else 0)
    state, meta = jt.fit(step, state, data, meta, workdir, ckpts=ckpts, budget_s=budget,
                        ckpt_minutes=args.ckpt_minutes, log_every=args.log_every, evaluate=evaluate, desc=name,
                        schedule_s=schedule, argv=getattr(args, "argv", None))
    done = jt.finished(meta)
    print(f"{name}: step {meta['step']}/{meta['total_steps']}, {meta['tokens'] / 1e6:.2f}M tokens, "
          f"{meta['elapsed_s'] / 60:.1f} min{'' if done else ' (not finished: rerun with --resume)'}")
    plot(name, workdir)
    if done or args.export_partial:
        export(name, ports.Model(model.config, state["params"], model.hf_config), meta, workdir, args.out)


# --------------------------------------------------------------------------------------------------- export


def plot(name: str, workdir: Path | None = None) -> Path | None:
    """Loss curve (training loss per logged window, smoothed, and held-out loss at checkpoints) as a PNG."""
    workdir = Path(workdir or ROOT / "build" / "zoo" / name)
    return jt.plot_log(workdir / "log.jsonl", RESULTS_DIR / f"zoo-{name}-loss.png", name,
                      ylabel="cross-entropy (nats / answer token)")


def reproduce_commands(name: str, meta: dict) -> list[str]:
    """The train commands that rebuild this checkpoint: the first schedule, then one --resume per restart."""
    segs = meta["schedule"]
    seed = f" --seed {meta['seed']}" if meta["seed"] else ""
    out = [f"python scripts/train_zoo.py train {name} --steps {segs[0]['total']}{seed}"]
    for g in segs[1:]:
        scale = g["peak"] / meta["preset"]["lr"]
        out.append(f"python scripts/train_zoo.py train {name} --resume --steps {g['total']}{seed}"
                   + (f" --restart-lr {scale:g}" if abs(scale - 0.5) > 1e-9 else ""))
    return out


def export(name: str, model: ports.Model, meta: dict, workdir: Path, out: Path | None = None) -> Path:
    """assets/zoo/jspec_zoo/<name>/ (or `out`): model.safetensors (bf16) + config.json + generation_config.json + tokenizer files
    (+ processor files for image models) + training.json."""
    out = Path(out or export_dir(name))
    if out.exists():
        shutil.rmtree(out)
    ports.save_hf(model, str(out), dtype=jnp.bfloat16)
    gen = {"bos_token_id": TK.BOS_ID, "eos_token_id": TK.EOS_ID, "pad_token_id": TK.PAD_ID}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tok = TK.load_tokenizer()
    if model.config.model_type == "llava":
        TK.make_processor(tok, IMAGE_SIZE, PATCH_SIZE).save_pretrained(str(out))
    else:
        for f in sorted(TK.ASSET_DIR.iterdir()):
            shutil.copy(f, out / f.name)
    rows = jt.read_log(workdir / "log.jsonl")
    tr = [r for r in rows if "loss" in r]
    ev = [r for r in rows if "heldout_loss" in r]
    info = {"name": name, "params": model.num_params, "steps": meta["step"], "total_steps": meta["total_steps"],
            "tokens": meta["tokens"], "train_minutes": round(meta["elapsed_s"] / 60, 1), "seed": meta["seed"],
            "final_train_loss": tr[-1]["loss"] if tr else None,
            "final_heldout_loss": ev[-1]["heldout_loss"] if ev else None,
            "final_heldout_answer_token_acc": ev[-1]["heldout_acc"] if ev else None,
            "preset": meta["preset"], "commands": reproduce_commands(name, meta),
            "schedule": meta["schedule"],
            "runs": meta["runs"], "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "jax": jax.__version__, "date": datetime.date.today().isoformat()}
    prev = meta.get("source_info")
    if prev:     # --init-from an exported model: its whole record first (runs, commands, trained_on), then this run
        info = continued_info(prev, info, meta)
    else:
        source = (meta["preset"].get("grow_from") or meta["preset"].get("init_from")
                  or meta["preset"].get("init_lm"))
        if source and (source_dir(source) / "training.json").exists():   # the stage this one starts from
            src = json.loads((source_dir(source) / "training.json").read_text())
            info["starts_from"] = {k: src[k] for k in ("name", "params", "steps", "tokens", "train_minutes",
                                                       "final_heldout_loss", "commands", "date") if k in src}
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir()) / 1e6
    print(f"exported {name} to {out} ({size:.1f} MB)")
    return out


def continued_info(prev: dict, info: dict, meta: dict) -> dict:
    """training.json of a model fine-tuned from an exported one (`--init-from`): the source's record (its runs,
    commands, trained_on, starts_from) with this fine-tune appended: its runs and their commands, and the
    fine-tune's own numbers under "fine_tune"; steps, tokens and minutes add up over both."""
    ft = {k: info[k] for k in ("steps", "total_steps", "tokens", "train_minutes", "final_train_loss",
                               "final_heldout_loss", "final_heldout_answer_token_acc", "preset", "schedule",
                               "machine", "jax", "date")}
    ft["commands"] = [" ".join(["python scripts/train_zoo.py", *r["argv"]]) for r in meta["runs"]]
    ft["trained_on"] = (f"{platform.machine()} CPU ({os.cpu_count()} cores), jax {jax.__version__}, "
                        f"{info['date']}; started from the exported weights of {prev.get('name')}")
    out = dict(prev)
    out.update(steps=prev.get("steps", 0) + info["steps"], tokens=prev.get("tokens", 0) + info["tokens"],
               total_steps=(prev.get("total_steps") or prev.get("steps", 0)) + (info["total_steps"] or 0),
               train_minutes=round(prev.get("train_minutes", 0) + info["train_minutes"], 1),
               final_train_loss=info["final_train_loss"], final_heldout_loss=info["final_heldout_loss"],
               final_heldout_answer_token_acc=info["final_heldout_answer_token_acc"],
               commands=list(prev.get("commands", [])) + ft["commands"],
               runs=list(prev.get("runs", [])) + meta["runs"], date=info["date"],
               fine_tunes=list(prev.get("fine_tunes", [])) + [ft])
    return out


def eval_video(args) -> None:
    """Held-out video QA exact match per task of an exported video model, on its own clips, shuffled frames and
    blank frames; with --draft, greedy Chain SD acceptance on QA prompts and on detailed descriptions."""
    import jspec  # noqa: F401  (jspec.decode, through video.answers)

    def load(name):
        d = Path(args.dir) / name if args.dir else export_dir(name)
        return ports.load_hf(str(d), jnp.float32)

    target = load(args.name)
    enc = VID.VideoEncoder()
    exs = VID.eval_set(args.n, args.seed)
    out = {}
    for variant in VID.VARIANTS:
        hits = VID.exact_match(target, exs, variant, encoder=enc, batch=args.batch)
        per = {t: float(np.mean([h for h, e in zip(hits, exs) if e.task == t])) for t in VID.QA_TASKS}
        out[variant] = {"exact_match": float(np.mean(hits)), **per}
        print(f"{args.name} {variant:>8}: exact match {np.mean(hits):.3f} ("
              + ", ".join(f"{t} {v:.2f}" for t, v in per.items()) + f"; {len(exs)} held-out prompts)")
    if args.draft:
        draft = load(args.draft)
        desc = VID.eval_set(max(8, args.n // 6), args.seed, tasks=["video_describe"])
        hits = VID.exact_match(target, desc, encoder=enc, batch=args.batch, max_new=160)
        print(f"{args.name} descriptions: exact match {np.mean(hits):.3f} ({len(desc)} prompts)")
        for what, ex in (("qa", exs[:max(8, args.n // 3)]), ("describe", desc)):
            r = VID.sd_acceptance(target, draft, ex, encoder=enc)
            out[f"sd_{what}"] = r
            print(f"Chain SD (gamma 5) with {args.draft}, {what}: mean accepted {r['mean_accepted']:.2f} per target "
                  f"step, same tokens as AR: {r['same_tokens']} ({r['prompts']} prompts)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


def export_cmd(args) -> None:
    p = PRESETS[args.name]
    workdir = Path(args.workdir or ROOT / "build" / "zoo" / args.name).resolve()
    model = new_model(p, 0)
    tx = make_optimizer(p)
    restored = jt.Checkpoints(workdir).restore({"params": model.params, "opt_state": tx.init(model.params)})
    if restored is None:
        raise SystemExit(f"no checkpoint in {workdir}")
    params, meta = restored[0]["params"], restored[1]
    meta.setdefault("schedule", [{"start": 0, "total": meta["total_steps"], "peak": p.lr, "warmup": p.warmup}])
    export(args.name, ports.Model(model.config, params, model.hf_config), meta, workdir, args.out)


# ------------------------------------------------------------------------------------------------------ CLI


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train one zoo model (then plot and export it)")
    t.add_argument("name", choices=sorted(PRESETS))
    t.add_argument("--steps", type=int, default=None, help="schedule length (default: fill --minutes)")
    t.add_argument("--minutes", type=float, default=None,
                   help="wall-clock budget of this run (default: the preset's); without --steps the schedule is "
                        "sized to fill it")
    t.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --workdir")
    t.add_argument("--workdir", default=None, help="checkpoints and logs (default build/zoo/NAME)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--batch", type=int, default=None)
    t.add_argument("--lr", type=float, default=None)
    t.add_argument("--tower-steps", type=int, default=None, help="tower pretraining steps (default: the preset's)")
    t.add_argument("--init-from", default=None,
                   help="continue an exported model of this preset's shape (a directory, e.g. assets/zoo/jspec_zoo/video-target, "
                        "or a preset name): no LM init, tower pretraining or alignment, straight to the full model; "
                        "its training.json's history is kept in the export")
    t.add_argument("--warmup", type=int, default=None, help="learning-rate warmup steps (default: the preset's)")
    t.add_argument("--restart-lr", type=float, default=0.5,
                   help="peak lr of a continuation (--resume --steps N past a finished schedule), x the preset's")
    t.add_argument("--schedule-minutes", type=float, default=None,
                   help="without --steps: size the schedule to fill this many minutes of training (across several "
                        "--resume runs of --minutes each) instead of --minutes")
    t.add_argument("--workers", type=int, default=max(0, min(12, (os.cpu_count() or 1) - 2)),
                   help="video presets: processes that render the clips (0: in the training process)")
    t.add_argument("--ckpt-minutes", type=float, default=3.0)
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--export-partial", action="store_true", help="export even if the schedule did not finish")
    t.add_argument("--out", default=None, help="export directory (default assets/zoo/jspec_zoo/NAME; a stage: build/stages/NAME)")
    e = sub.add_parser("export", help="export NAME from its latest checkpoint")
    e.add_argument("name", choices=sorted(PRESETS))
    e.add_argument("--workdir", default=None)
    e.add_argument("--out", default=None, help="export directory (default assets/zoo/jspec_zoo/NAME; a stage: build/stages/NAME)")
    ev = sub.add_parser("eval-video", help="held-out video QA exact match (clips, shuffled, blank) and SD acceptance")
    ev.add_argument("name", choices=sorted(n for n, q in PRESETS.items() if q.kind == "video"))
    ev.add_argument("--draft", default=None, help="a video draft to measure Chain SD acceptance with")
    ev.add_argument("--dir", default=None, help="directory holding the exported models (default: their export dirs)")
    ev.add_argument("--n", type=int, default=96, help="held-out QA prompts (balanced over the video QA tasks)")
    ev.add_argument("--batch", type=int, default=16)
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--json", default=None, help="also write the numbers to this file")
    pl = sub.add_parser("plot", help="loss curve PNG of NAME's log")
    pl.add_argument("name", choices=sorted(PRESETS))
    pl.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)     # the command each run records
    if args.cmd == "train":
        train(args)
    elif args.cmd == "export":
        export_cmd(args)
    elif args.cmd == "eval-video":
        eval_video(args)
    else:
        plot(args.name, args.workdir)


if __name__ == "__main__":
    main()
