"""Float32 comparisons that hold on any CPU, not only the one a test was written on.

Another instruction set (AVX-512, AVX2, SSE4.2, NEON) or another device layout (a mesh, a tile size) rounds and
orders the same float32 sums differently. The bounds here follow float32's resolution at the values compared:
- `assert_f32_close`: a number computed two ways through one network differs by a few hundred units in the last
  place of its magnitude (a log-probability of -58 resolves to 7.6e-6, so a fixed `atol=2e-4` is ~30 ulps there);
- `assert_layout_close`: two evaluations whose reductions run in another order differ by at most about
  `reduction * eps` of the magnitudes summed, per layer (recursive summation's worst case grows linearly with the
  reduction length);
- `assert_clear_margins`: exact token equality across layouts holds only where the greedy choice is not a
  near-tie; a test that asserts it checks that its inputs have clear margins first.
"""
from __future__ import annotations

import numpy as np

EPS = float(np.finfo(np.float32).eps)  # 1.19e-7


def assert_f32_close(actual, desired, *, ulps: float = 256, atol: float = 0.0, err_msg: str = "") -> None:
    """|actual - desired| <= atol + ulps * eps * |desired| elementwise: relative where magnitudes are large, `atol`
    near zero. 256 ulps (3e-5 relative) is what a few dozen float32 operations in another order can reach."""
    actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    np.testing.assert_allclose(actual, desired, rtol=ulps * EPS, atol=atol, err_msg=err_msg)


def layout_tolerance(desired, reduction: int, depth: int = 1, ulps: float = 4) -> float:
    """The bound `assert_layout_close` uses: ulps * eps * reduction * depth * max |desired|."""
    return float(ulps * EPS * reduction * depth * np.max(np.abs(np.asarray(desired))))


def assert_layout_close(actual, desired, *, reduction: int, depth: int = 1, ulps: float = 4,
                        err_msg: str = "") -> None:
    """Two evaluations of one function whose reductions run in another order (another mesh, tile, instruction
    set): every element within `layout_tolerance` of `desired`. `reduction` is the longest sum in a layer
    (e.g. the MLP's intermediate size), `depth` the number of layers the difference passes through."""
    actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    tol = layout_tolerance(desired, reduction, depth, ulps)
    np.testing.assert_allclose(actual, desired, rtol=0, atol=tol, err_msg=err_msg or f"layout tolerance {tol:.3g}")


def greedy_margins(logits) -> np.ndarray:
    """The gap between the largest and second largest logit at every position of [..., V] logits."""
    top2 = np.sort(np.asarray(logits, np.float64), axis=-1)[..., -2:]
    return top2[..., 1] - top2[..., 0]


def assert_clear_margins(model, prompts, tokens, lengths=None, *, rel: float = 1e-4) -> float:
    """Every greedy choice of `tokens` (rows decoded from `prompts` by `model`) wins by more than `rel` of the
    row's logit scale, far above what float32 reordering moves (~1e-6 of it), so exact token equality across
    layouts and CPUs is decided by the code under test, not by rounding. Returns the smallest relative margin;
    raises naming the row and step where the inputs are too close to a tie to assert exact equality."""
    import ports

    worst = np.inf
    for b, prompt in enumerate(prompts):
        n = tokens.shape[1] if lengths is None else int(lengths[b])
        if n == 0:
            continue
        seq = np.concatenate([np.asarray(prompt), np.asarray(tokens[b, :n])]).astype(np.int32)
        logits = ports.logits(model, seq[None])[0, len(prompt) - 1:len(seq) - 1]  # the n greedy choices
        margin = greedy_margins(logits) / np.max(np.abs(logits))
        t = int(np.argmin(margin))
        assert margin[t] > rel, (f"row {b} step {t}: the greedy choice wins by {margin[t]:.2e} of the logit scale, "
                                 f"a near-tie that float32 rounding may flip; choose other inputs")
        worst = min(worst, float(margin[t]))
    return worst
