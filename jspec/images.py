"""`jspec.decode` applied to images: text-to-image generation with a Chameleon / Lumina-mGPT target (the image
grammar, CFG and PNG output), and captions of images by a model that reads them (`ModelCaptioner`, TABED's C view).

`generate_image` appends Lumina-mGPT's image prefix (image start, height and width size tokens) to each prompt,
decodes the grid under `ImageGrammar` with classifier-free guidance (the unconditional prompt is the prefix alone,
as Lumina-mGPT's CFG processor uses the tokens from the image start on), with any strategy of `jspec.decode`,
then maps the grid to VQ codes and, given the VQGAN decoder, to pixels.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from jspec import api
from jspec.core.guidance import CFG, ImageGrammar
from jspec.parts.drafters.views import reads_images
from jspec.strategies.standard import AR
from ports.core.prompts import normalize_prompt

LUMINA_GRID_PX = 32  # Lumina-mGPT's size tokens count 32-pixel grid units


@dataclasses.dataclass
class ImageOutput:
    codes: np.ndarray  # [B, rows, cols] VQ code indices
    tokens: np.ndarray  # [B, rows * (cols + 1) + 1] generated ids: rows with end-of-row tokens, then end-of-image
    images: np.ndarray | None  # [B, H, W, 3] uint8 when a decoder was given
    stats: dict

    def save_png(self, directory: str, prefix: str = "image") -> list[str]:
        """Write each image as `directory/prefix_<row>.png`; returns the paths."""
        from PIL import Image

        if self.images is None:
            raise ValueError("no pixels to save: pass decoder=(vq_config, vq_params) to generate_image")
        os.makedirs(directory, exist_ok=True)
        paths = []
        for b, img in enumerate(self.images):
            path = os.path.join(directory, f"{prefix}_{b}.png")
            Image.fromarray(img).save(path)
            paths.append(path)
        return paths


def image_prefix(cfg: "ports.families.chameleon.ChameleonConfig", rows: int, cols: int) -> list[int]:
    """Lumina-mGPT's tokens before a grid of rows x cols codes: image start, then the size tokens of the height and
    the width in 32-pixel units (`<reserved{8800 + n:05d}>`)."""
    missing = [n for n, v in (("image start '<racm3:break>'", cfg.image_start_token_id),
                              ("size base '<reserved08800>'", cfg.size_token_base)) if v is None]
    if missing:
        raise ValueError(f"the model's vocabulary_map lacks {', '.join(missing)}; pass image_prefix= explicitly")
    f = cfg.vq.downsample
    if (rows * f) % LUMINA_GRID_PX or (cols * f) % LUMINA_GRID_PX:
        raise ValueError(f"a {rows}x{cols} code grid is {rows * f}x{cols * f} px, not a multiple of Lumina-mGPT's "
                         f"{LUMINA_GRID_PX}-px size unit; pass image_prefix= explicitly")
    return [cfg.image_start_token_id, cfg.size_token_base + rows * f // LUMINA_GRID_PX,
            cfg.size_token_base + cols * f // LUMINA_GRID_PX]


def grammar(cfg: "ports.families.chameleon.ChameleonConfig", rows: int, cols: int) -> ImageGrammar:
    """The image grammar of a rows x cols grid for this model's vocabulary."""
    missing = [n for n, v in (("end-of-row '<reserved08799>'", cfg.image_newline_token_id),
                              ("end-of-image '<eoss>'", cfg.image_end_token_id)) if v is None]
    if missing or not cfg.image_token_ids:
        raise ValueError(f"the model's vocabulary_map lacks {', '.join(missing) or 'the image tokens (IMGIMG*)'}: "
                         "it cannot generate images")
    from ports.families import chameleon as CH

    return ImageGrammar(jnp.asarray(CH.image_logit_mask(cfg)), rows, cols, int(cfg.image_newline_token_id),
                        int(cfg.image_end_token_id))


def _generating(model):
    """The model with HF's image-logit suppression off (text mode suppresses exactly the tokens we must draw)."""
    if getattr(model.config, "model_type", None) != "chameleon":
        raise ValueError(f"generate_image needs a chameleon model, got model_type {model.config.model_type!r}")
    if not model.config.suppress_image_logits:
        return model
    return dataclasses.replace(model, config=dataclasses.replace(model.config, suppress_image_logits=False),
                               _hf_aux=None)


def generate_image(target, prompt, rows: int, cols: int, strategy=None, cfg_scale: float | None = 3.0,
                   temperature: float = 1.0, top_k: int | None = 2000, top_p: float | None = None, key=None,
                   decoder: tuple["ports.families.vqgan.VQConfig", Any] | None = None, image_prefix_ids=None, mesh=None,
                   rules=None) -> ImageOutput:
    """Generate one rows x cols image per prompt row (any prompt form `jspec.decode` takes, token ids of the
    caption prompt). Defaults follow LANTERN++'s Lumina-mGPT setting: CFG 3.0, temperature 1, top-k 2000
    (`cfg_scale=None` turns CFG off). The strategy's draft, if any, is guided and constrained like the target.
    `decoder=(vq_config, vq_params)` (e.g. from `ports.families.vqgan.load_vqgan_decoder`) also returns the pixels.
    `mesh`, `rules`: as `jspec.decode`'s (the target sharded over the mesh; every process of a multi-controller
    run gets every image)."""
    if rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be >= 1, got {rows}x{cols}")
    target = _generating(target)
    strategy = AR() if strategy is None else strategy
    parts = strategy.parts()
    if parts is not None:  # every model the drafter runs generates images too
        strategy = parts.replace(drafter=parts.drafter.map_models(_generating))
    cfg = target.config
    prefix = list(image_prefix(cfg, rows, cols) if image_prefix_ids is None else image_prefix_ids)
    tokens, lengths, extra = normalize_prompt(prompt, cfg.vocab_size)
    if extra:
        raise ValueError(f"generate_image takes token prompts only; got inputs {sorted(extra)}")
    full = [np.concatenate([tokens[b, :lengths[b]], prefix]) for b in range(len(lengths))]
    gram = grammar(cfg, rows, cols)
    guidance = None if cfg_scale is None else CFG(float(cfg_scale), prefix)
    out = api.decode(target, full, strategy, max_new_tokens=gram.length, temperature=temperature, top_k=top_k,
                     top_p=top_p, key=key, eos_token_id=(gram.eoi,), guidance=guidance, constraint=gram, mesh=mesh,
                     rules=rules)
    grid = out.tokens[:, :rows * (cols + 1)].reshape(-1, rows, cols + 1)[:, :, :cols]
    from ports.families import chameleon as CH
    from ports.families import vqgan as VQ

    codes = np.asarray(CH.bpe_to_codes(cfg, grid))
    images = None
    if decoder is not None:
        vq_cfg, vq_params = decoder
        images = VQ.to_uint8(VQ.decode_jit(vq_cfg, vq_params, codes))
    return ImageOutput(codes, out.tokens, images, out.stats)


@dataclasses.dataclass(frozen=True, eq=False)
class ModelCaptioner:
    """Captions images with a jspec model that reads them (greedy, batched), for the C view.

    The request for image i is `before` + the model's placeholder run for that image + `after`; each caption
    comes back as `prefix` + its ids up to EOS (excluded), at most `max_new_tokens`."""

    model: Any
    before: Sequence[int]
    after: Sequence[int]
    prefix: Sequence[int] = ()
    max_new_tokens: int = 48
    eos_token_id: Any = None
    batch: int = 16

    def _run_len(self, images: dict, i: int) -> int:
        cfg = self.model.config
        if "image_sizes" in images and hasattr(cfg, "num_image_tokens"):
            return int(cfg.num_image_tokens(tuple(int(x) for x in images["image_sizes"][i])))
        return int(cfg.tokens_per_image)

    def __call__(self, images: dict) -> list[list[int]]:
        if not reads_images(self.model):
            raise ValueError(f"the captioner's model {self.model.config.model_type!r} does not read images")
        eos = set(api.eos_ids(self.model, self.eos_token_id))
        pv = images["pixel_values"]
        if "image_sizes" in images and pv.ndim != 5:
            raise ValueError(f"the captioner slices pixel_values per image: an anyres model's must be (num_images, "
                             f"num_tiles, C, H, W) as its processor returns them, got shape {pv.shape}")
        n = pv.shape[0]
        out: list[list[int]] = []
        for s in range(0, n, self.batch):
            idx = range(s, min(n, s + self.batch))
            rows = [list(self.before) + [self.model.config.image_token_id] * self._run_len(images, i) +
                    list(self.after) for i in idx]
            prompt = {"input_ids": rows, **{k: v[s:s + len(idx)] for k, v in images.items()}}
            res = api.decode(self.model, prompt, max_new_tokens=self.max_new_tokens, eos_token_id=self.eos_token_id)
            for b in range(len(idx)):
                ids = [int(t) for t in res.tokens[b, :res.lengths[b]]]
                cut = next((j for j, t in enumerate(ids) if t in eos), len(ids))
                out.append(list(self.prefix) + ids[:cut])
        return out
