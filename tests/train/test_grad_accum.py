"""satjax.train.grad_accum: the strided micro-batch split, and accumulated gradients equal
to the full batch's.

* :func:`value_and_grad` over A micro-batches against ``jax.value_and_grad`` of the same
  loss on the whole batch, for a loss that is a mean over rows and for one with a
  batch-level statistic (which summing per-micro-batch losses would get wrong);
* :func:`split_micro`'s micro-batch m holds exactly the rows whose statistic the SAT gate
  of ``objectives.make(..., microbatches=A)`` (the step's ``grad_accum``) takes together.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from satjax import objectives
from satjax.losses import SatKernelHParams, masked_quantile
from satjax.losses.sat import tail_kernel
from satjax.train.grad_accum import merge_micro, micro_map, split_micro, value_and_grad

B, D, A = 12, 5, 3
# float32 throughout; the accumulated gradient sums A vector-Jacobian products where the
# full batch's sums its rows in one reduction: equal up to float32 rounding in that order
RTOL, ATOL = 1e-5, 1e-6


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.normal(size=(D, D)), jnp.float32),
              "b": jnp.asarray(rng.normal(size=(D,)), jnp.float32)}
    batch = {"x": jnp.asarray(rng.normal(size=(B, D)), jnp.float32),
             "y": jnp.asarray(rng.normal(size=(B,)), jnp.float32)}
    return params, batch


def _forward(p, mb):
    """Per-row outputs (differentiated) and a per-row aux (carried)."""
    h = jnp.tanh(mb["x"] @ p["w"] + p["b"])
    return (h.sum(-1), h), {"row_norm": jnp.linalg.norm(mb["x"], axis=-1)}


def _row_mean_loss(out):
    s, h = out
    return jnp.mean((s - 1.0) ** 2) + 0.1 * jnp.mean(h ** 2), {"s_mean": jnp.mean(s)}


def _batch_statistic_loss(out):
    # centred on the whole batch's mean and scaled by its std: no row's term is its own
    s, _ = out
    z = (s - jnp.mean(s)) / (jnp.std(s) + 1.0)
    return jnp.mean(jnp.abs(z) ** 3), {}


def test_split_is_strided_and_merge_inverts_it():
    x = np.arange(B * 2).reshape(B, 2)
    micro = np.asarray(split_micro(jnp.asarray(x), A))
    assert micro.shape == (A, B // A, 2)
    for m in range(A):
        np.testing.assert_array_equal(micro[m], x[m::A])  # rows m, m + A, ...
    np.testing.assert_array_equal(merge_micro(jnp.asarray(micro)), x)


def test_micro_map_equals_the_function_on_the_whole_batch():
    params, batch = _problem()
    whole = _forward(params, batch)
    mapped = micro_map(lambda mb: _forward(params, mb), batch, A)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL),
                 mapped, whole)


@pytest.mark.parametrize("loss", [_row_mean_loss, _batch_statistic_loss],
                         ids=["mean_over_rows", "batch_statistic"])
@pytest.mark.parametrize("num", [1, 2, A, B])
def test_accumulated_gradient_equals_the_full_batch_gradient(loss, num):
    params, batch = _problem()
    (value, aux), (out, row_aux), grads = value_and_grad(_forward, loss, params, batch, num)

    def full(p):
        out, row_aux = _forward(p, batch)
        value, aux = loss(out)
        return value, (aux, out, row_aux)

    (ref_value, (ref_aux, ref_out, ref_row_aux)), ref_grads = jax.value_and_grad(
        full, has_aux=True)(params)
    np.testing.assert_allclose(value, ref_value, rtol=RTOL, atol=ATOL)
    for got, want in ((grads, ref_grads), (aux, ref_aux), (out, ref_out),
                      (row_aux, ref_row_aux)):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL),
                     got, want)


def test_a_batch_statistic_is_not_a_sum_of_micro_batch_losses():
    """What the two-pass accumulation is for: a loss with a batch-level statistic summed
    (or averaged) over micro-batches gives another gradient; the test above would catch an
    accumulation that did so."""
    params, batch = _problem()
    _, _, exact = value_and_grad(_forward, _batch_statistic_loss, params, batch, A)
    naive = jax.tree.map(lambda *g: sum(g) / A, *[
        jax.grad(lambda p, mb=mb: _batch_statistic_loss(_forward(p, mb)[0])[0])(params)
        for mb in (jax.tree.map(lambda x, m=m: x[m::A], batch) for m in range(A))])
    assert not np.allclose(exact["w"], naive["w"], rtol=1e-3)


def _staleness(seed=0):
    """[B, T] log-probs with a per-row staleness that differs between micro-batches."""
    rng = np.random.default_rng(seed)
    T = 4
    mu = rng.normal(size=(B, T)).astype(np.float32)
    # rows of micro-batch m (r % A == m) drift by about 10^m: each has its own gate
    drift = (10.0 ** (np.arange(B) % A))[:, None] * rng.uniform(0.01, 0.1, size=(B, T))
    return jnp.asarray(mu + drift, jnp.float32), jnp.asarray(mu), jnp.ones((B, T), bool)


def test_the_sat_gate_of_a_row_is_that_of_its_micro_batch():
    """``tail_kernel(..., microbatches=A)`` (what the objective the step builds with
    ``microbatches=grad_accum`` applies) gives each row the gate of ``split_micro``'s
    micro-batch that holds it."""
    lp, mu, valid = _staleness()
    hp = SatKernelHParams()
    d_seq = jnp.mean(lp - mu, axis=1)
    row_valid = jnp.ones((B,), bool)
    gate = np.asarray(tail_kernel(d_seq, row_valid, hp, microbatches=A).scale)
    rows = np.asarray(split_micro(jnp.arange(B), A))
    for m in range(A):
        q_m = masked_quantile(jnp.abs(split_micro(d_seq, A)[m]), hp.quantile,
                              split_micro(row_valid, A)[m], method="inverted_cdf")
        np.testing.assert_array_equal(gate[rows[m]], np.full(B // A, q_m))
    # the drift makes the split matter: contiguous blocks would mix the gates
    assert len(set(gate.tolist())) == A


def test_the_objectives_gate_is_the_mean_of_its_micro_batches_gates():
    """``sat_gspo`` with ``microbatches=A`` on the batch reports as ``sat_q`` the mean of
    the gates it reports on each of ``split_micro``'s micro-batches alone."""
    lp, mu, valid = _staleness(1)
    adv = jnp.asarray(np.random.default_rng(2).normal(size=(B,)), jnp.float32)
    batch = {"behavior_logprobs": mu, "advantages": adv, "mask": valid.astype(jnp.float32)}
    _, aux = objectives.make("sat_gspo", microbatches=A)(lp, batch)
    one = objectives.make("sat_gspo")
    per_micro = [float(one(split_micro(lp, A)[m],
                           jax.tree.map(lambda x, m=m: split_micro(x, A)[m], batch))[1]["sat_q"])
                 for m in range(A)]
    np.testing.assert_allclose(aux["sat_q"], np.mean(per_micro), rtol=1e-6)
