"""Key-map transforms between a checkpoint's HF layout and the params' (axis permutations or custom
objects), and the one error that lists every tensor a load found missing, unexpected or mis-shaped."""
from __future__ import annotations

import numpy as np

# Key-map transforms, each an axis permutation taking the HF tensor to our param (None = as is):
# "T" a Linear weight [out, in] -> [in, out]; "conv" a Conv2d kernel [out, in, kh, kw] -> [in, kh, kw, out].
# A transform may also be an object with to_ours(arr), to_hf(arr), shape_to_ours(hf_shape) (the param shape it
# loads as), shape_to_hf(shape) (what save_hf writes) and describe(shape) (the accepted HF shapes, for errors), e.g.
# ports.families.chameleon.HeadRows (Lumina-mGPT's QK-norm rows).
TRANSFORMS: dict[str, tuple[int, ...]] = {"T": (1, 0), "conv": (1, 2, 3, 0)}


def _custom(transform) -> bool:
    return transform is not None and not isinstance(transform, str)


def hf_to_ours(arr, transform: str | None):
    """An HF tensor (numpy / jax array) in our layout."""
    if _custom(transform):
        return transform.to_ours(arr)
    return arr if transform is None else arr.transpose(TRANSFORMS[transform])


def ours_to_hf(arr, transform: str | None):
    """Inverse of `hf_to_ours`."""
    if _custom(transform):
        return transform.to_hf(arr)
    return arr if transform is None else arr.transpose(tuple(np.argsort(TRANSFORMS[transform])))


def hf_shape_to_ours(shape: tuple, transform: str | None) -> tuple:
    if _custom(transform):
        return tuple(transform.shape_to_ours(tuple(shape)))
    return tuple(shape) if transform is None else tuple(shape[i] for i in TRANSFORMS[transform])


def ours_shape_to_hf(shape: tuple, transform: str | None) -> tuple:
    if _custom(transform):
        return tuple(transform.shape_to_hf(tuple(shape)))
    return tuple(shape) if transform is None else tuple(shape[i] for i in np.argsort(TRANSFORMS[transform]))


def expected_hf_shape(shape: tuple, transform: str | None) -> str:
    """The HF shape(s) a param of `shape` loads from, in words (errors)."""
    return transform.describe(tuple(shape)) if _custom(transform) else str(ours_shape_to_hf(shape, transform))


def key_mismatch_error(header: str, missing: list, unexpected: list, bad_shape: list, bad_dtype: list = (),
                       duplicated: list = ()) -> ValueError:
    """One error listing every missing, unexpected, mis-shaped, mis-typed and duplicated tensor (the first 20 of
    each)."""
    lines = [header]
    for what, names in (("missing keys", missing), ("unexpected keys", unexpected), ("wrong shapes", bad_shape),
                        ("not floating point", bad_dtype), ("in more than one file", duplicated)):
        if names:
            lines.append(f"  {what} ({len(names)}): {names[:20]}{' ...' if len(names) > 20 else ''}")
    return ValueError("\n".join(lines))
