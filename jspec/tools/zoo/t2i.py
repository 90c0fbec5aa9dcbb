"""The zoo's text-to-image pair (LANTERN++'s testbed): data, losses and measurements.

Two models, trained by scripts/train_zoo_t2i.py on the world's shape scenes and shipped under jspec/tools/zoo/:

    t2i-vq      a tiny VQGAN image tokenizer of Chameleon's architecture (`ports.families.vqgan`): 64 px images -> an
                8 x 8 grid of codes (downsample 8), 512 unit-norm codes of dimension 8. `load_vq()` gives
                (VQConfig, params).
    t2i-target  a Chameleon decoder (`ports.families.chameleon`) that writes an image after a caption, in Lumina-mGPT's
                layout: caption ids, then <racm3:break> <reserved08802> <reserved08802> (64 px = 2 units of 32 px),
                then 8 rows of 8 code tokens each closed by <reserved08799>, then <eoss>. Its checkpoint holds the
                VQ encoder too (model.vqmodel.*), as Chameleon's do; the decoder comes from t2i-vq.

Vocabulary of the target (`VOCAB`): ids 0..1023 are the zoo tokenizer's text tokens (jspec.tools.zoo.tokenizer), then
the image grammar tokens, then one token `IMGIMG<digits as A..J>Z` per VQ code from `IMAGE_TOKEN_BASE` on.

Captions (`caption`): the objects in reading order, e.g. "a big red circle in the top left and a small blue square
in the bottom right" (`caption_ids` adds <s>). The unconditional prompt of classifier-free guidance is the image
prefix alone (`jspec.core.guidance.CFG` as `jspec.generate_image` builds it); training drops the caption of
`P_UNCOND` of the rows so the model knows that stream.

Measurements: `ask` puts colour / shape / position questions about any images (originals, VQ reconstructions,
generated images) to the zoo's image target (a LLaVA reading 60 px images; ours are resized from 64 px) and
scores exact match as `jspec.tools.zoo.evaluate` does; `frechet_distance` of the image target's vision-tower features
(`vision_features`) is the zoo-FID of generated vs rendered images.
"""
from __future__ import annotations

import dataclasses
import functools
import random
from pathlib import Path
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ports.families import vqgan as VQ
from jspec.tools.zoo import tokenizer as TK
from jspec.tools.zoo import world as ZW
from jspec.tools.zoo import weights_dir

IMAGE_SIZE = 64  # pixels of the images the pair reads and writes
GRID = 8  # code rows and columns (IMAGE_SIZE / downsample)
VQ_CONFIG = VQ.VQConfig(embed_dim=8, num_embeddings=512, latent_channels=64, resolution=IMAGE_SIZE,
                        base_channels=32, channel_multiplier=(1, 1, 2, 2), num_res_blocks=1, attn_resolutions=(),
                        attn_type="vanilla")

# ------------------------------------------------------------------------------------------------- vocabulary

TEXT_VOCAB = TK.VOCAB_SIZE  # 1024
IMAGE_START_ID = TEXT_VOCAB  # <racm3:break>
IMAGE_END_ID = TEXT_VOCAB + 1  # <eoss>
IMAGE_NEWLINE_ID = TEXT_VOCAB + 2  # <reserved08799>
SIZE_BASE_ID = TEXT_VOCAB + 3  # <reserved08800>; <reserved{8800 + n}> = SIZE_BASE_ID + n, n = 0..8
MAX_SIZE_UNITS = 8
IMAGE_TOKEN_BASE = TEXT_VOCAB + 16  # BPE id of VQ code 0
PLACEHOLDER_ID = TK.IMAGE_ID  # "<image>" (the zoo tokenizer's)


def vocab_size(num_codes: int = VQ_CONFIG.num_embeddings) -> int:
    return IMAGE_TOKEN_BASE + num_codes


def vocabulary_map(num_codes: int = VQ_CONFIG.num_embeddings, tokenizer=None) -> dict[str, int]:
    """The target's HF vocabulary_map: the zoo tokenizer's tokens, the image grammar tokens and the code tokens."""
    from ports.families import chameleon as CH

    tok = tokenizer if tokenizer is not None else TK.load_tokenizer()
    vm = {name: int(i) for name, i in tok.get_vocab().items() if int(i) < TEXT_VOCAB}
    vm.update({CH.IMAGE_START: IMAGE_START_ID, CH.IMAGE_END: IMAGE_END_ID, CH.IMAGE_NEWLINE: IMAGE_NEWLINE_ID})
    for n in range(MAX_SIZE_UNITS + 1):
        vm[f"<reserved{8800 + n:05d}>"] = SIZE_BASE_ID + n
    vm.update({CH.code_name(c): IMAGE_TOKEN_BASE + c for c in range(num_codes)})
    return vm


def image_prefix(rows: int = GRID, cols: int = GRID, downsample: int = VQ_CONFIG.downsample) -> list[int]:
    """Lumina-mGPT's image prefix: image start, then the height and width in 32-px units."""
    return [IMAGE_START_ID, SIZE_BASE_ID + rows * downsample // 32, SIZE_BASE_ID + cols * downsample // 32]


def image_token_rows(codes: np.ndarray) -> np.ndarray:
    """A code grid [rows, cols] -> its generated tokens: each row of code tokens then end-of-row, then
    end-of-image ([rows * (cols + 1) + 1], what `jspec.generate_image` returns as tokens)."""
    codes = np.asarray(codes)
    rows, cols = codes.shape
    grid = np.concatenate([codes + IMAGE_TOKEN_BASE, np.full((rows, 1), IMAGE_NEWLINE_ID)], axis=1)
    return np.concatenate([grid.reshape(-1), [IMAGE_END_ID]]).astype(np.int32)


def codes_from_tokens(tokens: np.ndarray, rows: int = GRID, cols: int = GRID) -> np.ndarray:
    """Inverse of `image_token_rows` (ValueError if the tokens break the grammar)."""
    t = np.asarray(tokens)
    if t.shape != (rows * (cols + 1) + 1,) or t[-1] != IMAGE_END_ID:
        raise ValueError("not an image token sequence of the grammar")
    g = t[:-1].reshape(rows, cols + 1)
    if (g[:, -1] != IMAGE_NEWLINE_ID).any() or (g[:, :-1] < IMAGE_TOKEN_BASE).any():
        raise ValueError("not an image token sequence of the grammar")
    return g[:, :-1] - IMAGE_TOKEN_BASE


# ------------------------------------------------------------------------------------------------- scenes

OBJECT_COUNTS = (1, 1, 2, 2, 2, 3)  # objects per training scene (captions stay short)


def scene(split: str, index: int, seed: int = 0, counts: Sequence[int] = OBJECT_COUNTS) -> ZW.Scene:
    """Shape scene `index` of a split (the world's held-out rule: 1 scene in 8 by content hash is "heldout")."""
    rng = random.Random(f"jspec.zoo.t2i/{seed}/{split}/{index}")
    return ZW.scene_in(rng, split, lambda r: ZW.random_shapes(r, r.choice(tuple(counts))))


def caption(s: ZW.Scene) -> str:
    """'a big red circle in the top left and a small blue square in the bottom right' (reading order)."""
    parts = [f"{o.phrase()} in the {o.position}" for o in s.by_position()]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


@functools.lru_cache(maxsize=1)
def _backend():
    return TK.load_tokenizer().backend_tokenizer


def caption_ids(text: str) -> list[int]:
    """<s> + the caption's zoo-tokenizer ids (the prompt `generate_image` is given)."""
    return [TK.BOS_ID] + _backend().encode(text, add_special_tokens=False).ids


def render(s: ZW.Scene, size: int = IMAGE_SIZE) -> np.ndarray:
    """uint8 [size, size, 3]."""
    return np.asarray(ZW.render(s, size))


def to_signed(images_u8: np.ndarray) -> np.ndarray:
    """uint8 [B, H, W, 3] -> float32 NCHW in [-1, 1] (the VQ tokenizer's input)."""
    return (np.asarray(images_u8, np.float32) / 127.5 - 1.0).transpose(0, 3, 1, 2)


def image_batch(split: str, start: int, n: int, seed: int = 0, counts: Sequence[int] = (1, 2, 2, 3, 3, 4),
                size: int = IMAGE_SIZE) -> np.ndarray:
    """Rendered scenes start..start+n-1 as float32 NCHW in [-1, 1] (VQ training: up to 4 objects)."""
    return to_signed(np.stack([render(scene(split, i, seed, counts), size) for i in range(start, start + n)]))


def vq_stream(batch: int, seed: int, start: int, size: int = IMAGE_SIZE) -> Iterator[tuple[dict, int, int]]:
    """`jspec.tools.train.trainer.fit` data: ({"images": [B, 3, S, S]}, next_index, pixels) from training scene `start` on."""
    i = start
    while True:
        yield {"images": image_batch("train", i, batch, seed, size=size)}, i + batch, batch * size * size
        i += batch


# ------------------------------------------------------------------------------------------------- VQ training


def unit(x: jax.Array) -> jax.Array:
    """Rows scaled to unit L2 norm (zero rows stay zero)."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-6)


def vq_forward(cfg: VQ.VQConfig, params: dict, images: jax.Array) -> dict:
    """Encode, quantise (straight-through) and decode: latents z [B, h, w, D], codes, zq, reconstruction NCHW.

    Latents and codes are compared on the unit sphere (a cosine lookup, as ViT-VQGAN's factorised codes). The
    training step keeps the codebook's rows at unit norm, so Chameleon's plain L2 lookup (`VQ.encode`) picks the
    same codes from the unnormalised latents, and the decoder reads the same vectors: a shipped tokenizer is an
    ordinary Chameleon VQGAN."""
    z = unit(VQ.encode_latents(cfg, params, images))
    cb = unit(VQ.codebook(params))
    codes = VQ.quantize(jax.lax.stop_gradient(cb), jax.lax.stop_gradient(z))
    zq = VQ.lookup(cb, codes)
    z_st = z + jax.lax.stop_gradient(zq - z)
    return {"z": z, "codes": codes, "zq": zq, "recon": VQ.decode_latents(cfg, params, z_st)}


BACKGROUND_SIGNED = np.asarray(ZW.BACKGROUND, np.float32) / 127.5 - 1.0


def foreground(images: jax.Array, tol: float = 0.08) -> jax.Array:
    """[B, 1, H, W] float mask of the pixels that differ from the world's background colour (NCHW, [-1, 1])."""
    bg = jnp.asarray(BACKGROUND_SIGNED)[None, :, None, None]
    return (jnp.max(jnp.abs(images - bg), axis=1, keepdims=True) > tol).astype(jnp.float32)


def _grads_xy(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return x[:, :, 1:, :] - x[:, :, :-1, :], x[:, :, :, 1:] - x[:, :, :, :-1]


def vq_loss(cfg: VQ.VQConfig, params: dict, images: jax.Array, beta: float = 0.25, edge: float = 0.5,
            fg_weight: float = 8.0):
    """Pixel-weighted L1 + L2 reconstruction + `edge` x L1 of the image gradients + codebook + beta x commitment
    losses. Object pixels weigh 1 + `fg_weight` against 1 for the background (weights normalised to mean 1): the
    shapes cover a small part of each image, and an unweighted loss learns the background first and the objects'
    colours last. Returns (loss, aux: recon_l1, recon_l2, codebook, commit, codes, z)."""
    out = vq_forward(cfg, params, images)
    rec, x = out["recon"].astype(jnp.float32), images.astype(jnp.float32)
    w = 1.0 + fg_weight * foreground(x)
    w = w / jnp.mean(w)
    l1 = jnp.mean(w * jnp.abs(rec - x))
    l2 = jnp.mean(w * (rec - x) ** 2)
    (ry, rx), (xy, xx) = _grads_xy(rec), _grads_xy(x)
    e = jnp.mean(jnp.abs(ry - xy)) + jnp.mean(jnp.abs(rx - xx))
    cb = jnp.mean((out["zq"] - jax.lax.stop_gradient(out["z"])) ** 2)
    commit = jnp.mean((jax.lax.stop_gradient(out["zq"]) - out["z"]) ** 2)
    loss = l1 + l2 + edge * e + cb + beta * commit
    return loss, {"l1": l1, "l2": l2, "edge": e, "codebook": cb, "commit": commit, "codes": out["codes"],
                  "z": out["z"]}


def vq_state(cfg: VQ.VQConfig, params: dict, tx) -> dict:
    """A VQ run's state: params, optimizer state, and the EMA of each code's use per batch (for dead-code reset)."""
    return {"params": params, "opt_state": tx.init(params), "usage": jnp.zeros((cfg.num_embeddings,), jnp.float32)}


def make_vq_step(cfg: VQ.VQConfig, tx, reset_every: int = 50, dead_below: float = 0.05, decay: float = 0.95,
                 beta: float = 0.25, edge: float = 0.5, fg_weight: float = 8.0):
    """A jitted `step(state, images, lr, step) -> (state, metrics)`. Every `reset_every` steps (step 0 included:
    the codebook then starts as a sample of encoder outputs) each code whose use EMA is under `dead_below` is
    replaced by a random latent of the batch. After every step the codebook's rows are put back on the unit
    sphere (see `vq_forward`)."""
    from jspec.tools.train import trainer as jt

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(state, images, lr, i):
        (loss, aux), grads = jax.value_and_grad(functools.partial(vq_loss, cfg, beta=beta, edge=edge,
                                                                  fg_weight=fg_weight),
                                                has_aux=True)(state["params"], images)
        updates, opt_state = tx.update(grads, jt.set_lr(state["opt_state"], lr), state["params"])
        params = optax_apply(state["params"], updates)
        K = cfg.num_embeddings
        counts = jnp.zeros((K,), jnp.float32).at[aux["codes"].reshape(-1)].add(1.0)
        usage = decay * state["usage"] + (1 - decay) * counts
        usage = jnp.where(i == 0, counts, usage)
        flat = jax.lax.stop_gradient(aux["z"]).reshape(-1, cfg.embed_dim)
        key = jax.random.fold_in(jax.random.key(1234), i)
        pick = jax.random.randint(key, (K,), 0, flat.shape[0])
        noise = 0.01 * jax.random.normal(jax.random.fold_in(key, 1), (K, cfg.embed_dim))
        dead = ((usage < dead_below) | (i == 0)) & (i % reset_every == 0)
        cb = VQ.codebook(params)
        new_cb = unit(jnp.where(dead[:, None], flat[pick] + noise, cb))
        params = {**params, "quantize": {"embedding": {"weight": new_cb.astype(cb.dtype)}}}
        usage = jnp.where(dead, 1.0, usage)
        p = counts / counts.sum()
        ppl = jnp.exp(-jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.maximum(p, 1e-12)), 0.0)))
        metrics = {"loss": loss, "l1": aux["l1"], "l2": aux["l2"], "edge": aux["edge"], "codebook": aux["codebook"],
                   "commit": aux["commit"], "perplexity": ppl, "used": jnp.sum(counts > 0).astype(jnp.float32),
                   "reset": jnp.sum(dead).astype(jnp.float32)}
        return {"params": params, "opt_state": opt_state, "usage": usage}, metrics

    return step


def optax_apply(params, updates):
    import optax

    return optax.apply_updates(params, updates)


@functools.partial(jax.jit, static_argnums=0)
def reconstruct(cfg: VQ.VQConfig, params: dict, images: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(codes [B, h, w], decoded images NCHW) of images NCHW in [-1, 1]."""
    codes = VQ.encode(cfg, params, images)
    return codes, VQ.decode(cfg, params, codes)


def vq_metrics(cfg: VQ.VQConfig, params: dict, images: np.ndarray, batch: int = 64) -> dict:
    """Held-out reconstruction numbers: L1 / MSE / PSNR (on [-1, 1] -> [0, 255] uint8), codes kept by a second
    round trip (encode(decode(codes)) == codes), codebook use."""
    codes, recs, again = [], [], []
    for i in range(0, len(images), batch):
        c, r = reconstruct(cfg, params, jnp.asarray(images[i:i + batch]))
        c2, _ = reconstruct(cfg, params, jnp.asarray(to_signed(VQ.to_uint8(r))))
        codes.append(np.asarray(c))
        recs.append(VQ.to_uint8(r))
        again.append(np.asarray(c2))
    codes, recs, again = np.concatenate(codes), np.concatenate(recs), np.concatenate(again)
    orig = VQ.to_uint8(images)
    diff = recs.astype(np.float32) - orig.astype(np.float32)
    mse = float(np.mean(diff ** 2))
    return {"l1_255": float(np.mean(np.abs(diff))), "mse_255": mse,
            "psnr": float(10 * np.log10(255.0 ** 2 / max(mse, 1e-9))),
            "round_trip_codes_kept": float(np.mean(codes == again)),
            "codes_used": int(len(np.unique(codes))), "codebook": cfg.num_embeddings}


# ------------------------------------------------------------------------------------------------- T2I data

P_UNCOND = 0.1  # share of training rows without a caption (the CFG unconditional stream)
SEQ_LEN = 112  # training row length: caption + prefix + 8 x 9 + 1 image tokens, padded


def t2i_row(caption_text: str | None, codes: np.ndarray, seq_len: int = SEQ_LEN) -> dict:
    """One training row: [<s> caption] + image prefix + image tokens, right-padded; the loss covers the tokens
    after the prefix (codes, end-of-row and end-of-image). caption_text None: the unconditional row (prefix +
    image only)."""
    rows, cols = np.asarray(codes).shape
    head = (caption_ids(caption_text) if caption_text is not None else []) + image_prefix(rows, cols)
    ids = np.asarray(head + list(image_token_rows(codes)), np.int32)
    if len(ids) > seq_len:
        raise ValueError(f"row of {len(ids)} tokens is longer than seq_len={seq_len}")
    tokens = np.zeros(seq_len, np.int32)
    tokens[:len(ids)] = ids
    targets = np.zeros(seq_len, np.int32)
    targets[:len(ids) - 1] = ids[1:]
    mask = np.zeros(seq_len, np.float32)
    mask[len(head) - 1:len(ids) - 1] = 1.0  # predicting every token after the prefix
    return {"input_ids": tokens, "targets": targets, "target_mask": mask}


def t2i_batch(codes_cache: np.ndarray, scenes_caps: Sequence[str], start: int, n: int, seed: int = 0,
              seq_len: int = SEQ_LEN) -> dict:
    """Rows start..start+n-1 of the training stream over a cached encoded set (codes_cache [N, h, w] and the
    captions of its scenes): row i uses item i mod N, unconditional with probability P_UNCOND."""
    N = len(codes_cache)
    rows = []
    for i in range(start, start + n):
        r = random.Random(f"jspec.zoo.t2i/rows/{seed}/{i}")
        j = i % N
        rows.append(t2i_row(None if r.random() < P_UNCOND else scenes_caps[j], codes_cache[j], seq_len))
    return {k: np.stack([row[k] for row in rows]) for k in rows[0]}


def t2i_stream(codes_cache: np.ndarray, caps: Sequence[str], batch: int, seed: int, start: int,
               seq_len: int = SEQ_LEN):
    i = start
    while True:
        b = t2i_batch(codes_cache, caps, i, batch, seed, seq_len)
        yield b, i + batch, int(b["target_mask"].sum())
        i += batch


def t2i_loss(cfg, params: dict, batch: dict):
    """Mean cross-entropy over the image tokens (and grammar tokens) of the batch; aux (loss, accuracy)."""
    from ports.core import cache as kvc
    from ports.families import chameleon as CH

    tokens = batch["input_ids"]
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
    cache = kvc.init_cache(cfg.num_layers, B, cfg.num_kv_heads, T, cfg.head_dim, params["embed"].dtype)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool))[None], (B, T, T))
    logits = CH.forward(cfg, params, tokens, positions, cache, mask).logits
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)[..., 0]
    m = batch["target_mask"]
    n = jnp.maximum(m.sum(), 1.0)
    loss = (nll * m).sum() / n
    acc = ((jnp.argmax(logits, -1) == batch["targets"]) * m).sum() / n
    return loss, (loss, acc, m.sum())


def t2i_config(num_layers: int = 6, hidden: int = 256, heads: int = 4, ffn: int = 704,
               vq_cfg: VQ.VQConfig = VQ_CONFIG) -> "ports.families.chameleon.ChameleonConfig":
    """The target's ChameleonConfig (through the HF dict, so the export parses back to it)."""
    from ports.families import chameleon as CH

    return CH.config_from_hf(t2i_hf_config(num_layers, hidden, heads, ffn, vq_cfg))


def t2i_hf_config(num_layers: int = 6, hidden: int = 256, heads: int = 4, ffn: int = 704,
                  vq_cfg: VQ.VQConfig = VQ_CONFIG) -> dict:
    return {"model_type": "chameleon", "architectures": ["ChameleonForConditionalGeneration"],
            "vocab_size": vocab_size(vq_cfg.num_embeddings), "hidden_size": hidden, "intermediate_size": ffn,
            "num_hidden_layers": num_layers, "num_attention_heads": heads, "num_key_value_heads": heads,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "swin_norm": False,
            "hidden_act": "silu", "bos_token_id": TK.BOS_ID, "eos_token_id": IMAGE_END_ID, "pad_token_id": TK.PAD_ID,
            "mask_image_logits": False, "image_token_id": PLACEHOLDER_ID,
            "vq_config": VQ.vq_config_to_hf(vq_cfg), "vocabulary_map": vocabulary_map(vq_cfg.num_embeddings)}


# ------------------------------------------------------------------------------------------------- loading


def load_vq(directory=None) -> tuple[VQ.VQConfig, dict]:
    """(VQConfig, params) of the shipped t2i-vq tokenizer (or a directory in its layout)."""
    import json

    d = Path(directory) if directory is not None else weights_dir("t2i-vq")
    cfg = VQ.vq_config_from_taming(json.loads((d / "config.json").read_text())["taming"])
    return VQ.load_vqgan(str(d / "model.safetensors"), cfg, dtype=jnp.float32)


def load_target(directory=None):
    """The shipped t2i-target as a `ports.Model` (float32)."""
    import ports

    d = directory if directory is not None else weights_dir("t2i-target")
    return ports.load_hf(str(d), dtype=jnp.float32)


# ------------------------------------------------------------------------------------------------- measuring

ASK_TASKS = ("vqa_colour", "vqa_shape", "vqa_position")


def clip_pixels(images_u8: np.ndarray, size: int) -> np.ndarray:
    """uint8 [B, H, W, 3] -> CLIP-normalised float32 [B, 3, size, size] (bilinear resize when H != size), as the
    image target's processor normalises its renders."""
    from PIL import Image

    from jspec.tools.zoo import data as ZD

    out = []
    for a in np.asarray(images_u8):
        if a.shape[0] != size:
            a = np.asarray(Image.fromarray(a).resize((size, size), Image.BILINEAR))
        out.append(np.stack([ZD._LUT[c][a[..., c]] for c in range(3)]))
    return np.stack(out).astype(np.float32)


def questions(scenes: Sequence[ZW.Scene], per_scene: int = 3, seed: int = 0,
              tasks: Sequence[str] = ASK_TASKS) -> list[tuple[int, ZW.Example]]:
    """(scene index, question example) pairs: `per_scene` questions per scene, the tasks in turn (the world's own
    question generators, their answer styles included)."""
    out = []
    for si, s in enumerate(scenes):
        for q in range(per_scene):
            task = tasks[(si + q) % len(tasks)]
            rng = random.Random(f"jspec.zoo.t2i/ask/{seed}/{si}/{q}")
            qa = ZW.SINGLE_IMAGE_QA[task][1](rng, s)
            turns = (ZW.Turn("user", qa.question, 1), ZW.answer_turn(qa))
            out.append((si, ZW.Example(task, "vqa", "heldout", si, turns, (s,))))
    return out


@dataclasses.dataclass
class Asker:
    """The zoo's image target as a judge of images."""
    model: object
    encoder: object
    tokenizer: object

    @classmethod
    def load(cls) -> "Asker":
        from jspec.tools import zoo
        from jspec.tools.zoo import data as ZD

        model = zoo.load("image-target")
        tok = zoo.load_tokenizer("image-target")
        enc = ZD.Encoder(tok, image_tokens=model.config.tokens_per_image,
                        image_size=model.config.vision.image_size, view="M")
        return cls(model, enc, tok)

    @property
    def image_size(self) -> int:
        return self.encoder.image_size

    def ask(self, images_u8: np.ndarray | None, qs: Sequence[tuple[int, ZW.Example]], batch: int = 32) -> dict:
        """Exact match of the image target's greedy answers to questions about images_u8[scene index] (None: the
        scenes rendered at the target's own size). Returns {"all": rate, task: rate, "hits": [bool]}."""
        import jspec
        from jspec.tools.zoo import data as ZD
        from jspec.tools.zoo import evaluate as ZE

        S = self.image_size
        hits = []
        for i in range(0, len(qs), batch):
            chunk = qs[i:i + batch]
            ps = [self.encoder.prompt(ex) for _, ex in chunk]
            if images_u8 is None:
                pv = np.concatenate([p["pixel_values"] for p in ps])
            else:
                pv = clip_pixels(np.stack([images_u8[si] for si, _ in chunk]), S)
            out = jspec.decode(self.model, {"input_ids": [p["input_ids"][0] for p in ps], "pixel_values": pv},
                               max_new_tokens=24)
            hits += [ZE.answer_text(self.tokenizer, out.tokens[b, :out.lengths[b]]) == ex.answer
                     for b, (_, ex) in enumerate(chunk)]
        res = {"all": float(np.mean(hits)), "n": len(hits)}
        for t in sorted({ex.task for _, ex in qs}):
            res[t] = float(np.mean([h for h, (_, ex) in zip(hits, qs) if ex.task == t]))
        res["hits"] = hits
        return res

    def features(self, images_u8: np.ndarray, batch: int = 64) -> np.ndarray:
        """Mean-pooled final vision-tower features [N, D] of uint8 images (resized to the target's size)."""
        return vision_features(self.model, clip_pixels(images_u8, self.image_size), batch)


def vision_features(model, pixel_values: np.ndarray, batch: int = 64) -> np.ndarray:
    """The LLaVA image target's vision-tower output (its selected features), mean over patches: [N, hidden]."""
    cfg = model.config
    out = []
    for i in range(0, len(pixel_values), batch):
        feats, _ = _features_jit(cfg, model.params, jnp.asarray(pixel_values[i:i + batch]))
        out.append(np.asarray(feats, np.float64))
    return np.concatenate(out)


@functools.partial(jax.jit, static_argnums=0)
def _features_jit(cfg, params, pv):
    from ports.families import llava

    vis, proj = llava.image_features(cfg, params, pv)
    return jnp.mean(vis.astype(jnp.float32), axis=1), proj


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Fréchet distance between Gaussians fitted to feature sets a [N, D] and b [M, D] (the FID formula)."""
    from scipy import linalg

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    mu1, mu2 = a.mean(0), b.mean(0)
    s1, s2 = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean, _ = linalg.sqrtm(s1 @ s2, disp=False)
    if not np.isfinite(covmean).all():
        eps = 1e-6 * np.eye(s1.shape[0])
        covmean = linalg.sqrtm((s1 + eps) @ (s2 + eps))
    covmean = np.real(covmean)
    return float(max(0.0, np.sum((mu1 - mu2) ** 2) + np.trace(s1) + np.trace(s2) - 2.0 * np.trace(covmean)))
