"""The objective registry (each loss registers where it is defined), the typed prepared
batch and the SAT kernel's one hyperparameter object."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from satjax import losses, objectives
from satjax.losses import hparams as H
from satjax.losses import policy_gradient, registry, sat


def test_every_objective_is_its_loss_with_its_dataclass():
    assert objectives.NAMES == tuple(losses.OBJECTIVES)
    for name, spec in losses.OBJECTIVES.items():
        assert spec.loss is getattr(losses, f"{name}_loss")
        assert spec.loss.__module__ == policy_gradient.__name__  # registered where defined
        assert type(objectives.hparams(name)) is spec.hparams


def test_a_second_registration_of_a_name_is_refused(monkeypatch):
    monkeypatch.setattr(registry, "OBJECTIVES", dict(registry.OBJECTIVES))
    with pytest.raises(ValueError, match="'gspo': must be registered once"):
        registry.register("gspo", H.GspoHParams)(losses.gspo_loss)


def test_the_prepared_batch_is_a_typed_pytree():
    lp = jnp.array([[-1.0, jnp.nan], [-0.5, -2.0]])
    mu = jnp.array([[-1.5, 0.0], [-0.5, -1.0]])
    p = policy_gradient._prepare(lp, mu, jnp.array([1.0, -1.0]),
                                 jnp.array([[1, 0], [1, 1]]), None, None)
    assert isinstance(p, policy_gradient.Prepared)
    assert len(jax.tree.leaves(p)) == len(policy_gradient.Prepared._fields)
    np.testing.assert_array_equal(p.lp, [[-1.0, 0.0], [-0.5, -2.0]])  # nan padding zeroed
    np.testing.assert_array_equal(p.lengths, [1.0, 2.0])
    np.testing.assert_array_equal(p.d_tok, [[0.5, 0.0], [0.0, -1.0]])
    assert p.ref is p.mu  # no old_logprobs: the ratio is taken against behaviour


@pytest.mark.parametrize("kernel", H.KERNELS)
def test_the_sat_kernel_reads_one_hyperparameter_object(kernel):
    d = jnp.array([0.0, 0.01, -0.02, 0.03, 0.01, 0.0, -0.01, 0.02, 0.01, 0.01, 5.0])
    valid = jnp.ones(d.shape, bool)
    hp = H.SatKernelHParams(kernel=kernel)
    f = sat.tail_kernel(d, valid, hp).phi(jnp.abs(d))
    assert float(f[-1]) < 1.0 and float(f[0]) == 1.0  # the stale entry is contracted
    if kernel != "paper":  # lam 0: no contraction at all (the paper's kernel has no lam)
        off = sat.tail_kernel(d, valid, dataclasses.replace(hp, lam=0.0)).phi(jnp.abs(d))
        np.testing.assert_array_equal(off, np.ones(d.shape))
    lo, hi = losses.sat_interval(d, eps_low=0.2, eps_high=0.2, kernel=kernel)
    np.testing.assert_allclose(hi, 1.0 + 0.2 * np.where(np.asarray(d) > 0, f, 1.0),
                               rtol=1e-6)
