"""Masked statistics over the valid entries of an array: mean and exact quantile."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from satjax.losses._checks import check_choice

Array = jax.Array

QUANTILE_METHODS = ("auto", "sort", "bisect")


def masked_mean(x: Array, valid: Array) -> Array:
    """Mean of ``x`` over the entries where ``valid`` is true; 0 when there are none.

    Args:
      x: float array of any shape.
      valid: bool array of ``x``'s shape.

    Returns:
      scalar of ``x``'s dtype: ``sum(x * valid) / max(sum(valid), 1)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from satjax.losses import masked_mean
      >>> float(masked_mean(jnp.array([1.0, 3.0, 100.0]), jnp.array([True, True, False])))
      2.0
    """
    v = valid.astype(x.dtype)
    return jnp.sum(x * v) / jnp.maximum(jnp.sum(v), 1.0)


def _order_key(x: Array) -> Array:
    """Integer key with the same order as the float ``x`` (an involution on the bits)."""
    itype = jnp.int64 if x.dtype == jnp.float64 else jnp.int32
    bits = jax.lax.bitcast_convert_type(x, itype)
    return jnp.where(bits < 0, bits ^ jnp.iinfo(itype).max, bits)


def _from_order_key(key: Array, dtype: jnp.dtype) -> Array:
    bits = jnp.where(key < 0, key ^ jnp.iinfo(key.dtype).max, key)
    return jax.lax.bitcast_convert_type(bits, dtype)


@jax.jit
def _kth_smallest(keys: Array, k: Array) -> Array:
    """Exact k-th smallest (0-based) of an integer key vector by bisection on the key space.

    One counting pass per key bit (32 for float32), no sort: O(n * bits) but far faster
    than XLA's CPU sort for hundreds of thousands of entries.
    """
    info = jnp.iinfo(keys.dtype)

    def body(_, carry):
        lo, hi = carry
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        enough = jnp.sum((keys <= mid).astype(jnp.int32)) >= k + 1
        return jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)

    lo, _ = jax.lax.fori_loop(0, info.bits, body,
                              (jnp.asarray(info.min, keys.dtype),
                               jnp.asarray(info.max, keys.dtype)))
    return lo


def masked_quantile(x: Array, q: float | Array, mask: Array | None = None, *,
                    method: str = "auto") -> Array:
    """Quantile of the valid entries of ``x`` with numpy's default linear interpolation.

    With ``v`` the sorted valid entries (``n`` of them) and ``pos = q (n - 1)``:
    ``v[floor(pos)] + (v[floor(pos) + 1] - v[floor(pos)]) * (pos - floor(pos))``, i.e.
    ``np.quantile(x[mask], q)``.

    Args:
      x: float array of any shape (flattened); valid entries must not be nan.
      q: quantile level in [0, 1].
      mask: 0/1 or bool array of ``x``'s shape; ``None`` means every entry is valid.
      method: "sort" (invalid entries pushed to +inf, the valid count indexes the sorted
        array), "bisect" (exact order statistics by bisection on the float bit pattern), or
        "auto": bisect on the CPU backend (measured 3x faster than XLA's CPU sort at 256
        entries, ~50x at 262k), sort on accelerators (fast device sorts; not measured
        here). All are exact.

    Returns:
      scalar of ``x``'s (float) dtype; 0 when there is no valid entry.

    Example:
      >>> import jax.numpy as jnp
      >>> from satjax.losses import masked_quantile
      >>> x = jnp.array([4.0, 1.0, 3.0, 2.0, 1e9])
      >>> float(masked_quantile(x, 0.5, x < 100))  # median of [1, 2, 3, 4]
      2.5
    """
    check_choice("method", method, QUANTILE_METHODS)
    flat = jnp.ravel(jnp.asarray(x))
    if not jnp.issubdtype(flat.dtype, jnp.floating):
        flat = flat.astype(jnp.float32)
    if flat.dtype not in (jnp.float32, jnp.float64):
        flat = flat.astype(jnp.float32)
    dt = flat.dtype
    valid = jnp.ones(flat.shape, bool) if mask is None else jnp.ravel(mask).astype(bool)
    n = jnp.sum(valid.astype(jnp.int32))
    last = jnp.maximum(n - 1, 0)
    pos = jnp.asarray(q, dt) * last.astype(dt)
    i0 = jnp.clip(jnp.floor(pos).astype(jnp.int32), 0, last)
    i1 = jnp.minimum(i0 + 1, last)
    frac = pos - i0.astype(dt)
    filled = jnp.where(valid, flat, jnp.asarray(jnp.inf, dt))
    if method == "auto":
        method = "bisect" if jax.default_backend() == "cpu" else "sort"
    if method == "sort":
        srt = jnp.sort(filled)
        v0, v1 = srt[i0], srt[i1]
    else:
        keys = _order_key(filled)
        k0 = _kth_smallest(keys, i0)
        # The next order statistic is k0 again if it repeats, else the smallest larger one.
        repeats = jnp.sum((keys <= k0).astype(jnp.int32)) >= i1 + 1
        nxt = jnp.min(jnp.where(keys > k0, keys, jnp.iinfo(keys.dtype).max))
        v0 = _from_order_key(k0, dt)
        v1 = _from_order_key(jnp.where(repeats, k0, nxt), dt)
    val = v0 + (v1 - v0) * frac
    return jnp.where(n > 0, val, jnp.zeros((), dt))
