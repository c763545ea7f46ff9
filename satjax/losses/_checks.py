"""Argument checks shared by every losses module.

Value checks run only on concrete inputs: under ``jax.jit``/``grad``/``vmap`` the values are
tracers and cannot be inspected, so only shapes (always static) are checked there.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(x: Any) -> bool:
    """True when ``x`` holds values we may inspect (not a tracer under jit/grad/vmap)."""
    return not isinstance(x, jax.core.Tracer)


def check_range(name: str, value: Any, *, low: float | None = None,
                high: float | None = None, low_open: bool = False) -> None:
    """Range-check a scalar when its value is concrete."""
    if not is_concrete(value):
        return
    v = float(np.asarray(value))
    if not np.isfinite(v):
        raise ValueError(f"{name}: must be finite, got {value!r}")
    if low is not None and (v < low or (low_open and v == low)):
        op = ">" if low_open else ">="
        raise ValueError(f"{name}: must be {op} {low}, got {value!r}")
    if high is not None and v > high:
        raise ValueError(f"{name}: must be <= {high}, got {value!r}")


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: must be one of {choices}, got {value!r}")


def check_finite_where_valid(name: str, x: Any, valid: Any) -> None:
    """Raise if a valid entry of ``x`` is nan/inf (skipped under tracing)."""
    if not (is_concrete(x) and is_concrete(valid)):
        return
    xv = np.asarray(x, dtype=np.float64)
    vv = np.asarray(valid, dtype=bool)
    if not np.all(np.isfinite(xv[np.broadcast_to(vv, xv.shape)])):
        raise ValueError(f"{name}: must be finite at valid (mask=1) entries, got nan/inf")


def check_shape(name: str, x: Any, shape: tuple[int, ...], what: str) -> None:
    if tuple(jnp.shape(x)) != tuple(shape):
        raise ValueError(f"{name}: must have shape {what}={tuple(shape)}, got {jnp.shape(x)}")


def compute_dtype(x: Any) -> jnp.dtype:
    """At least float32 (bf16/fp16 inputs are promoted), float64 stays float64."""
    return jnp.promote_types(jnp.result_type(x), jnp.float32)

