"""Chameleon decoder port (Chameleon, Anole, Lumina-mGPT): config, params, forward, image-token vocabulary, HF map.

Chameleon is LLaMA with three changes, all matched to HF `ChameleonForConditionalGeneration` (transformers 5):
  * per-head QK LayerNorm: after the q/k projections and before RoPE, every head's [head_dim] vector is
    layer-normalised (no affine, eps 1e-5 fixed) and then scaled and shifted by that head's own weight and bias
    (q_norm / k_norm of shape [heads, head_dim] and [kv_heads, head_dim]);
  * `swin_norm`: the two RMSNorms move from the block inputs to the block outputs (x + norm(attn(x)),
    then x + norm(mlp(x))), as Chameleon-34B does;
  * images are VQ codes written as ordinary BPE tokens (`IMGIMG...Z` in `vocabulary_map`), so an image prompt is a
    token prompt: `image_tokens` encodes pixels with the VQGAN encoder (ports.families.vqgan) and maps codes to BPE ids,
    `merge_image_tokens` puts them where the processor wrote `<image>` placeholders.
HF sets the logits of every image token to float32 min (text-only generation); `suppress_image_logits` (HF's
behaviour, Lumina-mGPT's `mask_image_logits` key) switches that, and must be off to generate images.

What `ports.load_hf(dir)` loads: an HF-format directory whose config.json has model_type "chameleon", whatever its
config class (transformers' ChameleonConfig, Lumina-mGPT's ChameleonConfig / ChameleonXLLMXConfig: keys the model
does not use, such as `z_loss_weight`, `dropout`, `attention_dropout`, `initializer_range`, are ignored), with
safetensors holding transformers' names (model.*, lm_head.weight, model.vqmodel.* without the VQGAN decoder), where
each layer's `self_attn.q_norm` / `self_attn.k_norm` weight and bias is either
  * transformers' per-head layout, [heads, head_dim] / [kv_heads, head_dim], or
  * Lumina-mGPT's layout (its weight converter and `ChameleonXLLMXForConditionalGeneration`): [r, head_dim] rows,
    r = model_parallel_size ([1, head_dim] for 7B), row j serving heads j * n .. (j + 1) * n - 1 with n = heads / r
    (kv_heads / r for k_norm), as its ChameleonLayerNorm repeat-interleaves them. Any r dividing the heads loads
    so, whatever the config's class (expanded to [heads, head_dim] in memory); any other shape is refused, naming
    the tensor, its shape and the shapes expected.
`ports.save_hf` writes the layout the config names: [model_parallel_size, head_dim] rows when `architectures` is
ChameleonXLLMXForConditionalGeneration (`ChameleonConfig.qk_norm_rows`, read from model_parallel_size, default 1),
else per head. Rows are the first row of each group, written after checking that the group's rows are equal; if
they are not (per-head values, e.g. after training in jspec, or a per-head file relabelled as Lumina-mGPT's), it
writes [heads, head_dim], warns, and says so in config.json (`architectures` = ChameleonForConditionalGeneration,
transformers' layout). So a Lumina-mGPT checkpoint saves back to the same tensors (byte for byte when saved in its
own dtype) and the same config. A checkpoint in rows whose config names transformers' class (as a file written by
Lumina-mGPT's converter may) loads, but saves per head: nothing in its config says it was in rows.
The VQGAN decoder comes from the tokenizer checkpoint these projects ship (`vqgan.ckpt`), see
`ports.families.vqgan.load_vqgan_decoder`. To generate images, turn the suppression off:
`dataclasses.replace(model.config, suppress_image_logits=False)` (Lumina-mGPT's config may already say so).
Anole's original release uses Meta's consolidated format; it needs an HF-format conversion first.

Params: the LLaMA pytree of ports.families.llama (embed, layers[...], final_norm, lm_head) with per-layer q_norm, q_norm_b
[H, Dh] and k_norm, k_norm_b [KVH, Dh] added (whatever the checkpoint's row count), plus "vqmodel": the VQ encoder,
quantizer and post_quant_conv (ports.families.vqgan, HF_PARTS). The VQGAN decoder is not in HF checkpoints: see
`ports.families.vqgan.load_vqgan_decoder`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ports.core import cache as kvc
from ports.core import layers as LY
from ports.families import llama
from ports.families import vqgan as VQ
from ports.core.config import TextConfig, id_tuple, rope_from_hf
from ports.core.cache import ForwardOut
from ports.core.vision import layer_norm

QK_NORM_EPS = 1e-5  # HF ChameleonLayerNorm calls F.layer_norm with eps=1e-5 whatever the config says

# Names in Chameleon's vocabulary (vocabulary_map) of the tokens an image prompt / generation uses.
IMAGE_PLACEHOLDER = "<image>"  # what ChameleonProcessor repeats image_seq_length times
IMAGE_START = "<racm3:break>"  # begin of image (processor's image_start_token, Lumina-mGPT's image_start_token)
IMAGE_END = "<eoss>"  # end of image
IMAGE_NEWLINE = "<reserved08799>"  # Lumina-mGPT's end-of-row token
SIZE_TOKEN_BASE = "<reserved08800>"  # Lumina-mGPT: the size token for n grid units is <reserved{8800 + n:05d}>
IMAGE_NAME_PREFIX = "IMGIMG"
LUMINA_ARCHITECTURE = "ChameleonXLLMXForConditionalGeneration"  # Lumina-mGPT's model class: QK norms in mp rows
HF_ARCHITECTURE = "ChameleonForConditionalGeneration"


@dataclasses.dataclass(frozen=True)
class ChameleonConfig(TextConfig):
    """A Chameleon decoder: the TextConfig fields plus the Chameleon-specific ones (hashable)."""

    swin_norm: bool = False
    suppress_image_logits: bool = True  # HF: logits of image tokens = float32 min (turn off to generate images)
    image_token_ids: tuple[int, ...] = ()  # BPE id of VQ code i (HF vocabulary_mapping.img2bpe); () = unknown
    image_token_id: int | None = None  # the "<image>" placeholder
    image_start_token_id: int | None = None
    image_end_token_id: int | None = None
    image_newline_token_id: int | None = None
    size_token_base: int | None = None
    vq: VQ.VQConfig = VQ.VQConfig()
    # rows of the q_norm / k_norm tensors in the checkpoint `ports.save_hf` writes: 0 = one per head (transformers),
    # mp = Lumina-mGPT's [model_parallel_size, head_dim] (row r shared by consecutive heads). Params are [H, Dh]
    # either way; this only names the checkpoint layout.
    qk_norm_rows: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError(f"chameleon: hidden_size={self.hidden_size} must equal num_attention_heads="
                             f"{self.num_heads} x head_dim={self.head_dim}")
        if self.image_token_ids and len(self.image_token_ids) != self.vq.num_embeddings:
            raise ValueError(f"chameleon: {len(self.image_token_ids)} image tokens in the vocabulary but the VQ "
                             f"codebook has num_embeddings={self.vq.num_embeddings}")
        if self.qk_norm_rows < 0 or (self.qk_norm_rows and (self.num_heads % self.qk_norm_rows
                                                             or self.num_kv_heads % self.qk_norm_rows)):
            raise ValueError(f"chameleon: model_parallel_size={self.qk_norm_rows} (the rows of Lumina-mGPT's QK-norm "
                             f"tensors) must divide num_attention_heads={self.num_heads} and num_key_value_heads="
                             f"{self.num_kv_heads}")
        bad = [t for t in self.image_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"chameleon: image token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def save_hf_view(self, model):
        """What `ports.save_hf` writes for `model` (`checkpoint_view`: the QK-norm layout)."""
        return checkpoint_view(model)

    @property
    def num_params(self) -> int:
        return int(sum(np.prod(s) for s in jax.tree.leaves(param_shapes(self), is_leaf=lambda x: isinstance(x, tuple))))


# --------------------------------------------------------------------------------------------------- vocabulary


def code_name(code: int) -> str:
    """The vocabulary name of VQ code `code`: IMGIMG + its decimal digits written A..J + Z."""
    return IMAGE_NAME_PREFIX + "".join(chr(ord("A") + int(d)) for d in str(int(code))) + "Z"


def image_vocabulary(vocabulary_map: Mapping[str, int] | None, num_embeddings: int) -> tuple[int, ...]:
    """BPE ids of VQ codes 0..num_embeddings-1, read from the `IMGIMG...` names as HF's
    ChameleonImageVocabularyMapping does (letters A..J are digits 0..9, the last character is dropped).
    ValueError if the map is missing or does not name every code exactly once."""
    if not vocabulary_map:
        raise ValueError("chameleon config has no vocabulary_map: it is needed to map VQ image codes to BPE token ids "
                         "(the IMGIMG... entries); copy it from the checkpoint's config.json")
    digits = {chr(ord("A") + i): str(i) for i in range(10)}
    ids: dict[int, int] = {}
    for name, bpe in vocabulary_map.items():
        if not name.startswith(IMAGE_NAME_PREFIX):
            continue
        text = "".join(digits.get(c, c) for c in name[len(IMAGE_NAME_PREFIX):-1])
        try:
            code = int(text)
        except ValueError:
            raise ValueError(f"vocabulary_map entry {name!r} is not an image-code name "
                             "(IMGIMG<A..J digits>Z)") from None
        if code in ids:
            raise ValueError(f"vocabulary_map names VQ code {code} twice")
        ids[code] = int(bpe)
    if not ids:
        raise ValueError(f"vocabulary_map has no image tokens (names starting with {IMAGE_NAME_PREFIX!r})")
    missing = sorted(set(range(num_embeddings)) - set(ids))
    extra = sorted(set(ids) - set(range(num_embeddings)))
    if missing or extra:
        raise ValueError(f"vocabulary_map image tokens do not cover the codebook of {num_embeddings} codes: "
                         f"missing codes {missing[:10]}, codes out of range {extra[:10]}")
    return tuple(ids[c] for c in range(num_embeddings))


@functools.lru_cache(maxsize=16)
def _bpe_to_code_table(cfg: ChameleonConfig) -> np.ndarray:
    table = np.full((cfg.vocab_size,), -1, np.int32)
    table[np.asarray(cfg.image_token_ids, np.int64)] = np.arange(len(cfg.image_token_ids), dtype=np.int32)
    return table


def codes_to_bpe(cfg: ChameleonConfig, codes: jax.Array) -> jax.Array:
    """VQ codes (any shape) -> their BPE token ids (int32)."""
    return jnp.take(jnp.asarray(np.asarray(cfg.image_token_ids, np.int32)), jnp.asarray(codes).astype(jnp.int32))


def bpe_to_codes(cfg: ChameleonConfig, ids: jax.Array) -> jax.Array:
    """BPE token ids (any shape) -> VQ codes, -1 where the token is not an image token (int32)."""
    return jnp.take(jnp.asarray(_bpe_to_code_table(cfg)), jnp.asarray(ids).astype(jnp.int32))


def image_logit_mask(cfg: ChameleonConfig) -> np.ndarray:
    """bool [V]: the image-code tokens (what HF suppresses; begin/end-of-image tokens are not among them)."""
    return _bpe_to_code_table(cfg) >= 0


# --------------------------------------------------------------------------------------------------- config


def config_from_hf(d: Mapping[str, Any], require_vocabulary: bool = True) -> ChameleonConfig:
    """Parse an HF chameleon config.json dict (transformers 5 or older spellings; Lumina-mGPT's ChameleonXLLMXConfig
    too: its `mask_image_logits` sets `suppress_image_logits`, architectures ChameleonXLLMXForConditionalGeneration
    sets `qk_norm_rows` to its `model_parallel_size`; keys the model does not use are ignored).

    A config without `vocabulary_map` is refused (images need it) unless `require_vocabulary=False` (shapes only,
    e.g. memory planning): the image vocabulary is then empty and no token id is an image token."""
    if d.get("model_type") != "chameleon":
        raise ValueError(f"config_from_hf: model_type {d.get('model_type')!r} is not chameleon")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {d.get('hidden_act')!r} is not supported (Chameleon uses silu)")
    vq = VQ.vq_config_from_hf(d.get("vq_config"))
    vm = d.get("vocabulary_map")
    if not vm and not require_vocabulary:
        vm, image_ids = {}, ()
    else:
        image_ids = image_vocabulary(vm, vq.num_embeddings)
    heads = d.get("num_attention_heads", 32)
    hidden = d.get("hidden_size", 4096)
    bias = bool(d.get("attention_bias", False))
    lumina = LUMINA_ARCHITECTURE in (d.get("architectures") or ())
    return ChameleonConfig(
        model_type="chameleon",
        vocab_size=d.get("vocab_size", 65536),
        hidden_size=hidden,
        intermediate_size=d.get("intermediate_size", 11008),
        num_layers=d.get("num_hidden_layers", 32),
        num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=hidden // heads,  # HF Chameleon ignores any head_dim key
        rms_norm_eps=d.get("rms_norm_eps", 1e-5),
        rope=rope_from_hf(d),
        max_position_embeddings=d.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(d.get("mlp_bias", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=id_tuple(d.get("eos_token_id")),
        pad_token_id=d.get("pad_token_id"),
        swin_norm=bool(d.get("swin_norm", False)),
        suppress_image_logits=bool(d.get("mask_image_logits", True)),
        image_token_ids=image_ids,
        image_token_id=vm.get(IMAGE_PLACEHOLDER, d.get("image_token_id")),
        image_start_token_id=vm.get(IMAGE_START),
        image_end_token_id=vm.get(IMAGE_END),
        image_newline_token_id=vm.get(IMAGE_NEWLINE),
        size_token_base=vm.get(SIZE_TOKEN_BASE),
        vq=vq,
        qk_norm_rows=int(d.get("model_parallel_size") or 1) if lumina else 0,
    )


def vocabulary_map(cfg: ChameleonConfig) -> dict[str, int]:
    """The part of a vocabulary_map the model needs: image codes, the placeholder and the image grammar tokens."""
    vm = {code_name(c): int(t) for c, t in enumerate(cfg.image_token_ids)}
    for name, tid in ((IMAGE_PLACEHOLDER, cfg.image_token_id), (IMAGE_START, cfg.image_start_token_id),
                      (IMAGE_END, cfg.image_end_token_id), (IMAGE_NEWLINE, cfg.image_newline_token_id),
                      (SIZE_TOKEN_BASE, cfg.size_token_base)):
        if tid is not None:
            vm[name] = int(tid)
    return vm


def config_to_hf(cfg: ChameleonConfig) -> dict[str, Any]:
    """An HF config.json dict (transformers-5 spelling) that builds this model. Its vocabulary_map holds only the
    entries the model uses (see `vocabulary_map`); a loaded checkpoint keeps its full map in Model.hf_config."""
    from ports.core.config import text_config_to_hf

    out = text_config_to_hf(cfg)
    for k in ("head_dim", "attention_bias"):
        out.pop(k, None)
    out.update(model_type="chameleon", architectures=[LUMINA_ARCHITECTURE if cfg.qk_norm_rows else HF_ARCHITECTURE],
               attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias, swin_norm=cfg.swin_norm,
               model_parallel_size=cfg.qk_norm_rows or 1,
               vq_config=VQ.vq_config_to_hf(cfg.vq), vocabulary_map=vocabulary_map(cfg),
               image_token_id=cfg.image_token_id)
    if not cfg.suppress_image_logits:
        out["mask_image_logits"] = False
    return out


# --------------------------------------------------------------------------------------------------- params


def param_shapes(cfg: ChameleonConfig) -> dict:
    """Shapes of every parameter (the same structure `init_params` and the converters produce)."""
    shapes = llama.param_shapes(cfg)
    H, KVH, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    for layer in shapes["layers"]:
        layer.update(q_norm=(H, Dh), q_norm_b=(H, Dh), k_norm=(KVH, Dh), k_norm_b=(KVH, Dh))
    shapes["vqmodel"] = VQ.param_shapes(cfg.vq, VQ.HF_PARTS)
    return shapes


def init_params(cfg: ChameleonConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict:
    """Random params: normal(0, std) matrices and biases, unit norm scales (RMSNorm and QK-norm weights), and a
    random VQ encoder (ports.families.vqgan.init_params). One random draw, split on the host. With `cfg.qk_norm_rows` the
    QK-norm biases are equal within each group of heads sharing a row (a model Lumina-mGPT's layout holds)."""
    k_lm, k_vq = jax.random.split(key)
    shapes = param_shapes(cfg)
    del shapes["vqmodel"]
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    sizes = [int(np.prod(shape)) for _, shape in flat]
    noise = np.asarray(jax.random.normal(k_lm, (sum(sizes),), jnp.float32)) * std
    out, offset = [], 0
    for (path, shape), n in zip(flat, sizes):
        arr = np.ones(shape, np.float32) if jax.tree_util.keystr(path).endswith("norm']") else \
            noise[offset:offset + n].reshape(shape)
        offset += n
        out.append(jnp.asarray(arr, dtype))
    params = jax.tree.unflatten(treedef, out)
    if cfg.qk_norm_rows:  # Lumina-mGPT's layout: a group of heads shares one row (the QK-norm biases drawn per row)
        for layer in params["layers"]:
            for k, heads in (("q_norm_b", cfg.num_heads), ("k_norm_b", cfg.num_kv_heads)):
                n = heads // cfg.qk_norm_rows
                layer[k] = jnp.repeat(layer[k][::n], n, axis=0)
    params["vqmodel"] = VQ.init_params(cfg.vq, k_vq, VQ.HF_PARTS, dtype)
    return params


# --------------------------------------------------------------------------------------------------- forward


def embed(cfg: ChameleonConfig, params: dict, tokens: jax.Array) -> jax.Array:
    return llama.embed(params, tokens)


def unembed(cfg: ChameleonConfig, params: dict, h: jax.Array) -> jax.Array:
    """Final norm + LM head, float32 logits; image-code tokens set to float32 min if cfg.suppress_image_logits."""
    logits = llama.unembed(cfg, params, h)
    if cfg.suppress_image_logits:
        logits = jnp.where(jnp.asarray(image_logit_mask(cfg)), jnp.finfo(jnp.float32).min, logits)
    return logits


def attention_block(cfg: ChameleonConfig, p: dict, x: jax.Array, cos, sin, k_buf, v_buf, start, visible,
                    fresh: bool = False):
    """Project, per-head QK LayerNorm, rotate, write the new K/V at slots start[b].., attend
    (`layers.write_and_attend`). Returns (out, k, v)."""
    B, T, _ = x.shape
    q, k, v = LY.project_qkv(cfg, p, x)
    q = layer_norm(q, p["q_norm"], p["q_norm_b"], QK_NORM_EPS)
    k = layer_norm(k, p["k_norm"], p["k_norm_b"], QK_NORM_EPS)
    q, k = LY.apply_rope(q, cos, sin), LY.apply_rope(k, cos, sin)
    o, k_buf, v_buf = LY.write_and_attend(q, k, v, k_buf, v_buf, start, visible, fresh=fresh)
    return LY.linear(o.reshape(B, T, -1), p["wo"], p.get("bo")), k_buf, v_buf


def forward(cfg: ChameleonConfig, params: dict, tokens: jax.Array | None, positions: jax.Array, cache: kvc.KVCache,
            new_mask: jax.Array | None = None, *, embeds: jax.Array | None = None,
            hidden_layers: Sequence[int] = (), logits_at: jax.Array | None = None,
            compute_logits: bool = True, write_offset: int = 0, fresh: bool = False,
            rope: tuple | None = None) -> ForwardOut:
    """Run T new tokens per row against the cache: the contract of `ports.families.llama.forward` (cache slots, new_mask,
    hidden_layers, logits_at, write_offset, fresh, rope all mean the same)."""
    llama.check_fresh(fresh, write_offset)
    x = embed(cfg, params, tokens) if embeds is None else embeds
    B, T, _ = x.shape
    visible = LY.prefill_visibility(cache, T, new_mask, write_offset, fresh)
    start = cache.length + write_offset
    cos, sin = LY.rope_tables(cfg, positions, LY.whole_sequence_len(cfg, positions, fresh)) if rope is None else rope
    want = set(hidden_layers)
    hidden = {0: x} if 0 in want else {}
    ks, vs = [], []
    eps = cfg.rms_norm_eps
    for i, p in enumerate(params["layers"]):
        if cfg.swin_norm:
            a, kb, vb = attention_block(cfg, p, x, cos, sin, cache.k[i], cache.v[i], start, visible, fresh)
            x = x + LY.rms_norm(a, p["attn_norm"], eps)
            x = x + LY.rms_norm(LY.swiglu(x, p), p["mlp_norm"], eps)
        else:
            a, kb, vb = attention_block(cfg, p, LY.rms_norm(x, p["attn_norm"], eps), cos, sin, cache.k[i],
                                        cache.v[i], start, visible, fresh)
            x = x + a
            x = x + LY.swiglu(LY.rms_norm(x, p["mlp_norm"], eps), p)
        ks.append(kb)
        vs.append(vb)
        if i + 1 in want:
            hidden[i + 1] = x
    head = (lambda xs: unembed(cfg, params, xs)) if compute_logits else None
    return llama.finish_forward(x, ks, vs, cache, hidden, hidden_layers, logits_at, head)


def kv_layout(cfg: ChameleonConfig) -> tuple[int, int, int]:
    return cfg.num_layers, cfg.num_kv_heads, cfg.head_dim


# --------------------------------------------------------------------------------------------------- images


def image_tokens(cfg: ChameleonConfig, params: dict, pixel_values: jax.Array) -> jax.Array:
    """Images [N, C, H, W] (NCHW in [-1, 1], as ChameleonProcessor gives them) -> BPE ids [N, h * w], row-major
    (HF get_image_tokens)."""
    codes = VQ.encode(cfg.vq, params["vqmodel"], pixel_values)
    return codes_to_bpe(cfg, codes.reshape(codes.shape[0], -1))


def tokens_per_image(cfg: ChameleonConfig, height: int, width: int) -> int:
    h, w = cfg.vq.grid(height, width)
    return h * w


def merge_image_tokens(cfg: ChameleonConfig, tokens: jax.Array, image_bpe: jax.Array) -> jax.Array:
    """tokens [B, T] with the k-th `<image>` placeholder (row-major over the batch, as HF's masked_scatter) replaced
    by the k-th image token of image_bpe [N, P]. Counts are checked by `prepare_inputs`."""
    if cfg.image_token_id is None:
        raise ValueError("this chameleon config has no '<image>' placeholder id (vocabulary_map has no '<image>')")
    flat = image_bpe.reshape(-1).astype(jnp.int32)
    is_img = tokens == cfg.image_token_id
    idx = jnp.clip(jnp.cumsum(is_img.reshape(-1)) - 1, 0, flat.shape[0] - 1).reshape(tokens.shape)
    return jnp.where(is_img, jnp.take(flat, idx), tokens).astype(jnp.int32)


class PromptEmbeds(NamedTuple):
    embeds: jax.Array  # [B, T, D]: embeddings of the prompt with image tokens in place of the placeholders
    image_mask: jax.Array  # [B, T] bool: which prompt positions held placeholders
    tokens: jax.Array  # [B, T] int32: the prompt as token ids (placeholders replaced by image tokens)


def prepare_inputs(cfg: ChameleonConfig, tokens: np.ndarray, lengths: np.ndarray, inputs: Mapping[str, Any]) -> dict:
    """Host-side checks before any compute: only pixel_values, NCHW with a size the tokenizer divides, and
    exactly one `<image>` placeholder per image token. Returns the inputs for the device (unchanged)."""
    unknown = sorted(set(inputs) - {"pixel_values"})
    if unknown:
        raise ValueError(f"chameleon takes pixel_values only; got {unknown}")
    n_tok = 0
    if cfg.image_token_id is not None:
        n_tok = int(sum(np.sum(np.asarray(tokens)[b, :lengths[b]] == cfg.image_token_id)
                        for b in range(np.asarray(tokens).shape[0])))
    pv = inputs.get("pixel_values")
    if pv is None:
        if n_tok:
            raise ValueError(f"prompt has {n_tok} '<image>' placeholders (id {cfg.image_token_id}) but no pixel_values")
        return dict(inputs)
    h, w = VQ.check_images(cfg.vq, pv)
    want = pv.shape[0] * h * w
    if n_tok != want:
        raise ValueError(f"prompt has {n_tok} '<image>' placeholders (id {cfg.image_token_id}) but {pv.shape[0]} "
                         f"image(s) x {h * w} tokens = {want}; build the prompt with the model's processor")
    return dict(inputs)


def prompt_embeds(cfg: ChameleonConfig, params: dict, tokens: jax.Array,
                  inputs: Mapping[str, jax.Array]) -> PromptEmbeds:
    """Embeddings of prompts [B, T] whose `<image>` placeholders are replaced, in order, by the images' tokens."""
    pv = inputs.get("pixel_values")
    is_img = (tokens == cfg.image_token_id) if cfg.image_token_id is not None else jnp.zeros(tokens.shape, bool)
    if pv is not None:
        tokens = merge_image_tokens(cfg, tokens, image_tokens(cfg, params, pv))
    return PromptEmbeds(embed(cfg, params, tokens), is_img, tokens.astype(jnp.int32))


# --------------------------------------------------------------------------------------------------- HF key map


class HeadRows(NamedTuple):
    """The `hf_key_map` transform (ports.io.hf_checkpoint's protocol) of a QK-norm weight / bias, [heads, Dh] in our
    params: the checkpoint holds it as is, or as [r, Dh] with r dividing heads (Lumina-mGPT), row j serving heads
    j * heads / r .. (j + 1) * heads / r - 1 (its ChameleonLayerNorm's repeat_interleave). `rows` is what save_hf
    writes: 0 = [heads, Dh], else [rows, Dh], the first row of each group (the group's rows must be equal)."""

    heads: int
    rows: int = 0

    def shape_to_ours(self, shape: tuple) -> tuple:
        if len(shape) == 2 and 0 < shape[0] <= self.heads and self.heads % shape[0] == 0:
            return (self.heads, shape[1])
        return tuple(shape)  # not a loadable shape: the loader reports it against `describe`

    def shape_to_hf(self, shape: tuple) -> tuple:
        return (self.rows or shape[0],) + tuple(shape[1:])

    def describe(self, shape: tuple) -> str:
        return f"{tuple(shape)} or [r, {shape[1]}] with r dividing {self.heads} (Lumina-mGPT's model-parallel rows)"

    def to_ours(self, arr):
        return arr if arr.shape[0] == self.heads else np.repeat(arr, self.heads // arr.shape[0], axis=0)

    def to_hf(self, arr):
        if not self.rows or self.rows == self.heads:
            return arr
        if not self.collapses(arr):  # save_hf writes such a model per head instead (`checkpoint_view`)
            raise ValueError(f"QK-norm rows differ within a group of {self.heads // self.rows} heads: they cannot be "
                             f"written as {self.rows} rows")
        return np.ascontiguousarray(arr[::self.heads // self.rows])

    def collapses(self, arr) -> bool:
        """Whether `arr` [heads, Dh] is `rows` groups of equal rows (so `to_hf` writes it exactly)."""
        if not self.rows or self.rows == self.heads:
            return True
        groups = np.asarray(arr).reshape(self.rows, self.heads // self.rows, *arr.shape[1:])
        return bool((groups == groups[:, :1]).all())


def hf_key_map(cfg: ChameleonConfig):
    """(hf_name, param path, transform) rows of ChameleonForConditionalGeneration; transformers 5 writes the same
    names to disk as its state_dict (model.*, lm_head.weight, model.vqmodel.*), as older hub checkpoints do. The QK
    norms' transform is `HeadRows` (per-head or Lumina-mGPT's rows in, `cfg.qk_norm_rows` out)."""
    rows = llama.hf_key_map(cfg, "model.", "lm_head.weight")
    for i in range(cfg.num_layers):
        a = f"model.layers.{i}.self_attn."
        for n, heads in (("q_norm", cfg.num_heads), ("k_norm", cfg.num_kv_heads)):
            tr = HeadRows(heads, cfg.qk_norm_rows)
            rows += [(f"{a}{n}.weight", ("layers", i, n), tr), (f"{a}{n}.bias", ("layers", i, n + "_b"), tr)]
    rows += VQ.key_map(cfg.vq, "model.vqmodel.", VQ.HF_PARTS, ("vqmodel",))
    return rows


IGNORED_HF_KEYS = llama.IGNORED_HF_KEYS


def checkpoint_view(model):
    """The model `ports.save_hf` writes: `model` itself, unless its config names Lumina-mGPT's row layout
    (qk_norm_rows) and some QK-norm tensor is not groups of equal rows; then the same params, per-head layout
    (qk_norm_rows 0) and transformers' class in the HF config's `architectures`, with a warning."""
    cfg = model.config
    if not cfg.qk_norm_rows:
        return model
    bad = []
    for i, layer in enumerate(model.params["layers"]):
        for n, heads in (("q_norm", cfg.num_heads), ("k_norm", cfg.num_kv_heads)):
            for k in (n, n + "_b"):
                if not HeadRows(heads, cfg.qk_norm_rows).collapses(np.asarray(jax.device_get(layer[k]))):
                    bad.append(f"layers.{i}.{k}")
    if not bad:
        return model
    import warnings

    warnings.warn(f"chameleon save_hf: {len(bad)} QK-norm tensors ({bad[:4]}{' ...' if len(bad) > 4 else ''}) differ "
                  f"within a group of heads, so they cannot be written as model_parallel_size={cfg.qk_norm_rows} "
                  f"rows (Lumina-mGPT's layout): writing them per head, config architectures = [{HF_ARCHITECTURE!r}]",
                  stacklevel=4)
    hf = dict(model.hf_config)
    if hf:
        hf["architectures"] = [HF_ARCHITECTURE]
    return type(model)(dataclasses.replace(cfg, qk_norm_rows=0), model.params, hf)
