"""Bad input across the public API: every case raises a ValueError that names the problem, before anything is
traced or compiled (docs/inputs.md lists the cases and their messages)."""
import numpy as np
import pytest

import jax
import jspec
import ports

V = 101


@pytest.fixture(scope="module")
def model():
    cfg = ports.TextConfig(model_type="llama", vocab_size=V, hidden_size=32, intermediate_size=48, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=256)
    return ports.random_model(cfg, key=1)


@pytest.fixture
def no_compiles():
    """The XLA traces and compiles that happen while the test runs (a listener on JAX's compile events)."""
    seen = []

    def listen(event, duration, **kw):
        if event.startswith("/jax/core/compile/"):
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listen)


ids = np.ones((1, 3), np.int32)
PROMPTS = [  # (what, prompt, message)
    ("no rows", [], "prompt row 0 is empty|prompt is empty"),
    ("an empty row", [[1, 2, 3], []], "prompt row 1 is empty"),
    ("an id past the vocabulary", [[1, 2, V]], r"outside the model vocabulary \[0, 101\)"),
    ("a negative id", [[1, -2, 3]], "outside the model vocabulary"),
    ("float ids", np.array([[1.0, 2.0]]), "integer token ids, got dtype float64"),
    ("NaN ids", np.array([[1, np.nan]]), "integer token ids"),
    ("boolean ids", np.array([[True, False]]), "integer token ids, got dtype bool"),
    ("a 3-D array", np.zeros((1, 2, 3), np.int32), r"\[T\] or \[B, T\] token ids, got shape \(1, 2, 3\)"),
    ("text", "hello", "must be token ids.*tokenize the text first"),
    ("None", None, "must be token ids"),
    ("a prompt past the model's positions", np.ones((1, 300), np.int32), "max_position_embeddings=256"),
    ("a mapping without input_ids", {"attention_mask": np.ones((1, 3))}, "no 'input_ids'"),
    ("a mask of another shape", {"input_ids": ids, "attention_mask": np.ones((1, 4))},
     r"attention_mask has shape \(1, 4\), input_ids \(1, 3\)"),
    ("a mask that is not 0 / 1", {"input_ids": ids, "attention_mask": np.array([[1, 2, 1]])}, "0 / 1"),
    ("a mask with holes", {"input_ids": ids, "attention_mask": np.array([[1, 0, 1]])}, "has holes"),
    ("a row masked out", {"input_ids": np.ones((2, 3), np.int32), "attention_mask": np.array([[1, 1, 1], [0, 0, 0]])},
     "prompt row 1 is empty"),
    ("an unknown modality key", {"input_ids": ids, "pixel_valuez": np.zeros((1, 3, 4, 4))}, "unsupported keys"),
    ("NaN pixels", {"input_ids": ids, "pixel_values": np.full((1, 3, 4, 4), np.nan, np.float32)},
     "pixel_values has 48 NaN or infinite values"),
]
ARGS = [  # (what, decode keyword arguments, message)
    ("max_new_tokens = 0", dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    ("a negative temperature", dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    ("a NaN temperature", dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    ("a temperature that is text", dict(temperature="hot"), "temperature must be a number"),
    ("top_k = 0", dict(temperature=1.0, top_k=0), "top_k must be a positive integer"),
    ("a fractional top_k", dict(temperature=1.0, top_k=2.5), "top_k must be a positive integer"),
    ("top_p > 1", dict(temperature=1.0, top_p=1.5), r"top_p must be in \(0, 1\]"),
    ("an EOS id past the vocabulary", dict(eos_token_id=500), r"eos_token_id \[500\] outside"),
    ("an int as the key", dict(temperature=1.0, key=3), "key must be a JAX PRNG key"),
    ("keys for another batch size", dict(temperature=1.0, key=np.zeros((3, 2), np.uint32)),
     r"key must be one PRNG key or one per row \(1 rows\), got keys of shape \(3,\)"),
    ("a cache too short", dict(max_cache_len=4), "needs a cache of 7, longer than max_cache_len=4"),
    ("new tokens past the model's positions", dict(max_new_tokens=254), "max_position_embeddings=256"),
    ("a prefill chunk of 0", dict(prefill_chunk=0), "prefill_chunk must be"),
    ("a strategy that is not one", dict(strategy="chain"), "strategy must be a jspec strategy"),
]


@pytest.mark.parametrize("what, prompt, message", PROMPTS, ids=[c[0] for c in PROMPTS])
def test_bad_prompt(model, no_compiles, what, prompt, message):
    with pytest.raises(ValueError, match=message):
        jspec.decode(model, prompt, max_new_tokens=3)
    assert not no_compiles, no_compiles


@pytest.mark.parametrize("what, kwargs, message", ARGS, ids=[c[0] for c in ARGS])
def test_bad_arguments(model, no_compiles, what, kwargs, message):
    with pytest.raises(ValueError, match=message):
        jspec.decode(model, [[1, 2, 3]], **{"max_new_tokens": 3, **kwargs})
    assert not no_compiles, no_compiles


@pytest.fixture(scope="module")
def other():
    """A model of another vocabulary."""
    return ports.random_model(ports.TextConfig(model_type="llama", vocab_size=50, hidden_size=16,
                                               intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                                               head_dim=8))


def test_bad_strategies(model, other, no_compiles):
    """Strategy arguments: named when the strategy is built or, at the latest, when decode starts."""

    def decode(strategy):
        return jspec.decode(model, [[1, 2]], strategy=strategy, max_new_tokens=3)

    cases = [(lambda: jspec.Chain(model, gamma=0), r"gamma must be an integer in \[1, 64\]"),
             (lambda: jspec.Chain(model, gamma="5"), "gamma must be an integer"),
             (lambda: decode(jspec.Tree(model, tree=((1,),))), "rank 1 without rank 0"),
             (lambda: decode(jspec.Tree(model, tree="nope")), "unknown tree 'nope'"),
             (lambda: decode(jspec.DynamicTree(model, total=0)), "total must be a positive integer"),
             (lambda: jspec.SAGE(model, d_min=9, d_max=3), "d_min <= d_max"),
             (lambda: jspec.SpecVLM(model, ratio=1.5), r"ratio must be in \[0, 1\)"),
             (lambda: jspec.TABED(model, views=("Z",)), "views must be distinct entries"),
             (lambda: decode(jspec.Chain(other, gamma=3)),
              "vocabularies differ: target vocab_size=101, draft vocab_size=50"),
             (lambda: decode(jspec.Chain("draft", gamma=3)), "the draft must be a model")]
    for make, message in cases:
        with pytest.raises(ValueError, match=message):
            make()
    assert not no_compiles, no_compiles


# ------------------------------------------------------------------------- Qwen2.5-VL processor mappings

VS, VE, IMG, VID = 93, 94, 95, 96


@pytest.fixture(scope="module")
def qwen():
    """A tiny random Qwen2.5-VL: patch 7, merge 2, so a (1, 4, 4) image grid is 16 patch rows and 4 tokens."""
    import transformers
    from ports.families import qwen2_vl as QW

    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=100, max_position_embeddings=512, eos_token_id=None,
                bos_token_id=None, pad_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    vision = dict(depth=1, hidden_size=16, out_hidden_size=32, intermediate_size=24, num_heads=2, patch_size=7,
                  window_size=28, fullatt_block_indexes=[0])
    hf = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMG,
                                       video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
    return ports.random_model(QW.config_from_hf(hf.to_dict()), key=2)


PATCH_DIM = 3 * 2 * 7 * 7  # channels x temporal patch x patch^2
GRID = np.array([[1, 4, 4]])
IMAGE_IDS = np.array([[1, VS, IMG, IMG, IMG, IMG, VE, 2]])
ROWS = np.ones((16, PATCH_DIM), np.float32)


def image_inputs(ids=IMAGE_IDS, **over):
    d = {"input_ids": ids, "pixel_values": ROWS, "image_grid_thw": GRID}
    d.update(over)
    return {k: v for k, v in d.items() if v is not None}


QWEN = [  # (what, prompt, message)
    ("a grid that is not [N, 3]", image_inputs(image_grid_thw=np.array([1, 4, 4])),
     r"image_grid_thw must be an integer array \[num, 3\]"),
    ("a float grid", image_inputs(image_grid_thw=GRID.astype(np.float32)), "must be an integer array"),
    ("a zero in the grid", image_inputs(image_grid_thw=np.array([[0, 4, 4]])), "must be positive"),
    ("a height not a multiple of the merge", image_inputs(image_grid_thw=np.array([[1, 3, 4]])),
     "multiples of spatial_merge_size=2"),
    ("fewer pixel rows than the grid", image_inputs(pixel_values=ROWS[:15]),
     r"pixel_values holds 15 patches but image_grid_thw \[\[1, 4, 4\]\] describes 16"),
    ("pixel rows of another patch size", image_inputs(pixel_values=np.ones((16, 147), np.float32)),
     r"expects \(num_patches, 294\) rows"),
    ("pixels without a grid", image_inputs(image_grid_thw=None), "pixel_values given without image_grid_thw"),
    ("a grid without pixels", image_inputs(pixel_values=None), "image_grid_thw given without pixel_values"),
    ("a grid of another image size", image_inputs(image_grid_thw=np.array([[1, 4, 8]]),
                                                   pixel_values=np.ones((32, PATCH_DIM), np.float32)),
     r"prompt has 4 image tokens \(id 95\) but image_grid_thw \[\[1, 4, 8\]\] take 8"),
    ("two grids for one image run", image_inputs(image_grid_thw=np.array([[1, 4, 4], [1, 4, 4]]),
                                                  pixel_values=np.ones((32, PATCH_DIM), np.float32)),
     r"prompt has 4 image tokens \(id 95\) but image_grid_thw \[\[1, 4, 4\], \[1, 4, 4\]\] take 8"),
    ("grids in another order than the runs",
     image_inputs(np.array([[1, VS] + [IMG] * 4 + [VE, VS] + [IMG] * 8 + [VE]]),
                  image_grid_thw=np.array([[1, 4, 8], [1, 4, 4]]), pixel_values=np.ones((48, PATCH_DIM), np.float32)),
     r"prompt row 0: a run of 4 image tokens \(id 95\) where image \[1, 4, 8\] of image_grid_thw takes 8"),
    ("image tokens without pixels", {"input_ids": IMAGE_IDS},
     r"prompt has 4 image tokens \(id 95\) but no image_grid_thw"),
    ("NaN pixels", image_inputs(pixel_values=np.full((16, PATCH_DIM), np.nan, np.float32)), "NaN or infinite"),
    ("a video grid that does not match its run",
     {"input_ids": np.array([[1, VS] + [VID] * 4 + [VE]]), "pixel_values_videos": np.ones((32, PATCH_DIM)),
      "video_grid_thw": np.array([[2, 4, 4]])},
     r"prompt has 4 video tokens \(id 96\) but video_grid_thw \[\[2, 4, 4\]\] take 8"),
    ("seconds per grid for another video count",
     {"input_ids": np.array([[1, VS] + [VID] * 8 + [VE]]), "pixel_values_videos": np.ones((32, PATCH_DIM)),
      "video_grid_thw": np.array([[2, 4, 4]]), "second_per_grid_ts": [1.0, 1.0]},
     "second_per_grid_ts has 2 entries for 1 video"),
    ("prepared inputs passed as raw", image_inputs(mrope_positions=np.zeros((3, 1, 8))),
     r"unsupported keys \['mrope_positions'\]"),
]


@pytest.mark.parametrize("what, prompt, message", QWEN, ids=[c[0] for c in QWEN])
def test_bad_qwen_inputs(qwen, no_compiles, what, prompt, message):
    with pytest.raises(ValueError, match=message):
        jspec.decode(qwen, prompt, max_new_tokens=3)
    assert not no_compiles, no_compiles


def test_a_good_qwen_prompt_passes_the_same_checks(qwen):
    """The control: the mapping every case above damages decodes."""
    out = jspec.decode(qwen, image_inputs(), max_new_tokens=2)
    assert out.tokens.shape == (1, 2)
