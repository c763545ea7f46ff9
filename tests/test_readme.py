"""The README's Optax example runs as written and takes a real optimizer step."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

README = Path(__file__).resolve().parent.parent / "README.md"


def _optax_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    (snippet,) = [b for b in blocks if "satjax.objectives" in b]
    return snippet


def test_readme_optax_example_runs_and_updates_params():
    rng = np.random.default_rng(0)
    B, T, V, D = 8, 6, 11, 5
    feats = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, V, size=(B, T)))
    params = {"w": jnp.asarray(rng.normal(size=(D, V)) * 0.1, jnp.float32)}

    def logprob_fn(p):
        lp = jax.nn.log_softmax(feats @ p["w"], axis=-1)
        return jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0]

    behavior = logprob_fn(params) + jnp.asarray(rng.normal(size=(B, T)) * 1e-3, jnp.float32)
    batch = {
        "behavior_logprobs": behavior,
        "advantages": jnp.asarray(rng.normal(size=B), jnp.float32),
        "mask": jnp.ones((B, T), jnp.float32),
    }
    opt_state = optax.adam(1e-6).init(params)
    scope = {"logprob_fn": logprob_fn, "batch": batch, "params": params, "opt_state": opt_state}
    exec(_optax_snippet(), scope)  # noqa: S102 - the README's own code
    assert np.isfinite(float(scope["loss"]))
    assert {"clip_frac_low", "clip_frac_high", "sat_tail_frac", "kl_k3"} <= set(scope["aux"])
    new_params = optax.apply_updates(params, scope["updates"])
    assert float(jnp.abs(new_params["w"] - params["w"]).max()) > 0
