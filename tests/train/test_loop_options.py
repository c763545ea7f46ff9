"""The step's loop options: several updates per rollout batch, reference KL, entropy bonus.

* ``updates_per_batch`` x ``mini_batches``: equal to a hand-written loop of single steps
  on the same mini-batches with the proximal log-probs and advantages of the whole batch;
* ``kl_coef`` / ``entropy_coef``: each term's logged value and the gradient of the sum
  against numpy / full-vocabulary references computed outside the step.

(With both options at their defaults the step is bit-identical to the one before them:
``scripts/step_identity.py`` compares two checkouts.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from satjax import losses, objectives
from satjax.model import token_logprobs
from satjax.model.logprobs import chunked_logprobs, chunked_logprobs_entropy
from satjax.train.grad_accum import split_micro
from satjax.train.step import StepOptions, batch_advantages, make_train_step

MESH = (1, 1, 1, 1)


def _lr(count):
    return 0.1 / (1.0 + count)


def _step(make_state, mesh_of, reference=None, **options):
    graphdef, state = nnx.split(make_state(0))
    return make_train_step(graphdef, state, mesh=mesh_of(MESH), reference=reference,
                           options=StepOptions(lr_schedule=_lr, objective="ppo_clip",
                                               replay=False, **options))


def _fresh(step, make_state):
    return step.place_state(nnx.split(make_state(0))[1])


@pytest.mark.slow
def test_updates_per_batch_equal_a_loop_of_single_steps(make_state, mesh_of, synthetic_batch,
                                                        host):
    batch = synthetic_batch(3, B=8, group_size=4)
    U, M = 2, 2
    multi = _step(make_state, mesh_of, updates_per_batch=U, mini_batches=M)
    state, m = multi(_fresh(multi, make_state), multi.place_batch(batch))
    state, m = host(state), host(m)

    # the hand-written loop: proximal log-probs of the initial policy, whole-batch
    # advantages, mini-batch j = rows j, j+M, ..., one single-update step each
    graphdef, params, rest = nnx.split(make_state(0).model, nnx.Param, ...)
    old, _ = token_logprobs(nnx.merge(graphdef, params, rest), batch.tokens,
                            batch.attention_mask)
    full = batch.replace(advantages=batch_advantages(batch), old_logprobs=old)
    single = _step(make_state, mesh_of)
    s = _fresh(single, make_state)
    loop = []
    for _ in range(U):
        for j in range(M):
            mini = jax.tree.map(lambda x, j=j: np.asarray(x)[j::M], full)
            s, mj = single(s, single.place_batch(mini))
            loop.append(host(mj))
    s = host(s)

    for a, b in zip(jax.tree.leaves(state["model"]), jax.tree.leaves(s["model"]), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(state["optimizer"]), jax.tree.leaves(s["optimizer"]),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(state["step"]) == U * M == int(s["step"])
    assert int(state["policy_version"]) == 1  # once per rollout batch (the loop: 4)
    for key in ("loss", "grad_norm", "ratio_mean", "kl_k3", "learning_rate"):
        np.testing.assert_allclose(m[key], np.mean([x[key] for x in loop]), rtol=1e-5,
                                   atol=1e-7, err_msg=key)
    for key in ("clip_frac_low", "clip_frac_high"):
        np.testing.assert_allclose(m[key], loop[-1][key], rtol=1e-6, err_msg=key)
    # the test can tell: later updates move away from the proximal policy and clip
    assert abs(loop[0]["ratio_max"] - 1.0) < 1e-5 and loop[-1]["ratio_max"] > 1.0 + 1e-3
    assert m["tokens"] == float(np.sum(batch.loss_mask))  # the whole rollout batch
    assert m["nonfinite_steps"] == 0.0


def _tis_reference(lp, batch, threshold):
    """numpy: the TIS weight mean min(exp(lp - mu), C) over the valid tokens."""
    valid = np.asarray(batch.loss_mask) > 0
    w = np.minimum(np.exp(np.asarray(lp, np.float64) - batch.behavior_logprobs), threshold)
    return float(w[valid].mean())


@pytest.mark.slow
def test_tis_takes_the_step_start_logprobs(make_state, mesh_of, synthetic_batch, host):
    """is_correction="tis" weights by min(pi_start / mu, C), pi_start the policy at the
    step's start: with one update, the detached current log-probs (the step passes them
    as old_logprobs; before, the objective refused the batch); with two updates, the
    proximal log-probs of the first, for both (not those of the moved policy)."""
    batch = synthetic_batch(5, B=8, group_size=4)
    hp = {"is_correction": "tis", "is_threshold": 1.2}
    model = make_state(0).model
    lp0, _ = token_logprobs(model, batch.tokens, batch.attention_mask)
    want = _tis_reference(lp0, batch, 1.2)

    one = _step(make_state, mesh_of, objective_hp=hp)
    _, m = one(_fresh(one, make_state), one.place_batch(batch))
    m = host(m)
    np.testing.assert_allclose(m["is_weight_mean"], want, rtol=1e-5)
    assert m["ratio_max"] == pytest.approx(1.0, abs=1e-6)  # pi / pi_start at the start
    obj_batch = {"behavior_logprobs": batch.behavior_logprobs,
                 "advantages": batch_advantages(batch), "mask": batch.loss_mask,
                 "old_logprobs": lp0}
    ref_loss, _ = objectives.make("ppo_clip", **hp)(lp0, obj_batch)
    np.testing.assert_allclose(m["loss"], float(ref_loss), rtol=1e-5, atol=1e-7)

    two = _step(make_state, mesh_of, objective_hp=hp, updates_per_batch=2)
    state, m2 = two(_fresh(two, make_state), two.place_batch(batch))
    state, m2 = host(state), host(m2)
    np.testing.assert_allclose(m2["is_weight_mean"], want, rtol=1e-5)  # both updates
    moved = nnx.merge(nnx.graphdef(model), jax.tree.map(jnp.asarray, state["model"]))
    lp_end, _ = token_logprobs(moved, batch.tokens, batch.attention_mask)
    assert abs(_tis_reference(lp_end, batch, 1.2) - want) > 1e-3  # the test can tell


def test_mini_batch_split_keeps_rows_strided():
    x = jnp.arange(8)
    np.testing.assert_array_equal(split_micro(x, 2), [[0, 2, 4, 6], [1, 3, 5, 7]])


def _np_kl(x, estimator):
    """numpy KL(pi || pi_ref) estimators at x = log pi_ref / pi (verl's low_var_kl: k3
    with x clamped to [-20, 20] and the estimate to [-10, 10])."""
    xc = np.clip(x, -20, 20)
    return {"k1": -x, "k2": 0.5 * x ** 2, "k3": np.exp(x) - 1 - x,
            "low_var_kl": np.clip(np.exp(xc) - xc - 1, -10, 10)}[estimator]


def _np_sequence_kl(lp, ref, valid, estimator):
    """numpy sequence-level KL: per row the estimator of the mean over its valid tokens of
    ref - lp; mean over the rows with a valid token."""
    rows = [r for r in range(lp.shape[0]) if valid[r].any()]
    return float(np.mean([_np_kl(np.mean((ref - lp)[r][valid[r]]), estimator) for r in rows]))


def _numpy_terms(model, batch, ref_model, estimator, level="token"):
    """numpy: per-token log-probs of policy and reference and the entropy, from the full
    [B, T, V] logits (the independent path the chunked head avoids)."""

    def logits(m):
        out = m.backbone(jnp.asarray(batch.tokens), attention_mask=jnp.asarray(
            batch.attention_mask))
        return np.asarray(out.hidden @ m.head_weight(), np.float64)[:, :-1]

    tok = np.asarray(batch.tokens)[:, 1:]
    valid = np.asarray(batch.loss_mask)[:, 1:] > 0

    def logp(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    lz, rz = logp(logits(model)), logp(logits(ref_model))
    lp = np.take_along_axis(lz, tok[..., None], -1)[..., 0]
    rl = np.take_along_axis(rz, tok[..., None], -1)[..., 0]
    ent = float((-(np.exp(lz) * lz).sum(-1))[valid].mean())
    if level == "sequence":
        return _np_sequence_kl(lp, rl, valid, estimator), ent
    return float(_np_kl(rl - lp, estimator)[valid].mean()), ent


@pytest.mark.parametrize("grad_accum", [1, 2])
@pytest.mark.slow
def test_reference_kl_and_entropy_terms(make_state, mesh_of, synthetic_batch, tiny_model,
                                        host, grad_accum):
    batch = synthetic_batch(4, B=8, group_size=4)
    ref_model = tiny_model(1)  # another policy, so the KL is not 0
    kl_coef, ent_coef = 0.5, 0.1
    step = _step(make_state, mesh_of, kl_coef=kl_coef, kl_estimator="k2",
                 entropy_coef=ent_coef, reference=nnx.state(ref_model, nnx.Param),
                 grad_accum=grad_accum)
    _, m = step(_fresh(step, make_state), step.place_batch(batch))
    m = host(m)
    model = make_state(0).model
    kl, ent = _numpy_terms(model, batch, ref_model, "k2")
    assert kl > 1e-3 and ent > 1.0  # the test can tell
    np.testing.assert_allclose(m["kl_ref"], kl, rtol=1e-4)
    np.testing.assert_allclose(m["entropy"], ent, rtol=1e-5)
    obj_batch = {"behavior_logprobs": batch.behavior_logprobs,
                 "advantages": batch_advantages(batch), "mask": batch.loss_mask}
    obj = objectives.make("ppo_clip")
    lp, _ = token_logprobs(model, batch.tokens, batch.attention_mask)
    np.testing.assert_allclose(m["policy_loss"], float(obj(lp, obj_batch)[0]), rtol=1e-5,
                               atol=1e-7)
    np.testing.assert_allclose(m["loss"], m["policy_loss"] + kl_coef * m["kl_ref"]
                               - ent_coef * m["entropy"], rtol=1e-6)

    # the gradient of the whole loss, through full-vocabulary logits outside the step
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ref_lp, _ = token_logprobs(ref_model, batch.tokens, batch.attention_mask)
    mask = jnp.asarray(batch.loss_mask)

    def total(p):
        mdl = nnx.merge(graphdef, p, rest)
        out = mdl.backbone(jnp.asarray(batch.tokens),
                           attention_mask=jnp.asarray(batch.attention_mask))
        z = jax.nn.log_softmax(out.hidden[:, :-1] @ mdl.head_weight(), axis=-1)
        lp = jnp.pad(jnp.take_along_axis(z, jnp.asarray(batch.tokens)[:, 1:, None],
                                         -1)[..., 0], ((0, 0), (1, 0)))
        h = jnp.pad(-jnp.sum(jnp.exp(z) * z, -1), ((0, 0), (1, 0)))
        kl = losses.masked_mean(losses.kl_penalty(lp, ref_lp, mask, "k2"), mask > 0)
        return (obj(lp, obj_batch)[0] + kl_coef * kl
                - ent_coef * losses.masked_mean(h, mask > 0))

    grads = jax.grad(total)(params)
    norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
    np.testing.assert_allclose(m["grad_norm"], norm, rtol=1e-4)


@pytest.mark.slow
def test_sequence_level_low_var_kl_in_the_step(make_state, mesh_of, synthetic_batch,
                                               tiny_model, host):
    """kl_level="sequence", kl_estimator="low_var_kl": the logged term and the loss's
    gradient against the numpy sequence KL of full-vocabulary log-probs."""
    batch = synthetic_batch(4, B=8, group_size=4)
    ref_model = tiny_model(1)
    kl_coef = 0.5
    step = _step(make_state, mesh_of, kl_coef=kl_coef, kl_estimator="low_var_kl",
                 kl_level="sequence", reference=nnx.state(ref_model, nnx.Param))
    _, m = step(_fresh(step, make_state), step.place_batch(batch))
    m = host(m)
    model = make_state(0).model
    kl_seq, _ = _numpy_terms(model, batch, ref_model, "low_var_kl", level="sequence")
    kl_tok, _ = _numpy_terms(model, batch, ref_model, "low_var_kl")
    assert kl_seq > 1e-4 and abs(kl_seq - kl_tok) > 1e-2  # the test can tell the levels
    np.testing.assert_allclose(m["kl_ref"], kl_seq, rtol=1e-4)
    np.testing.assert_allclose(m["loss"], m["policy_loss"] + kl_coef * m["kl_ref"], rtol=1e-6)

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ref_lp, _ = token_logprobs(ref_model, batch.tokens, batch.attention_mask)
    obj_batch = {"behavior_logprobs": batch.behavior_logprobs,
                 "advantages": batch_advantages(batch), "mask": batch.loss_mask}
    obj = objectives.make("ppo_clip")
    valid = jnp.asarray(batch.loss_mask) > 0
    n = jnp.maximum(jnp.sum(valid, -1), 1)
    rows = jnp.any(valid, -1)

    def total(p):
        lp, _ = token_logprobs(nnx.merge(graphdef, p, rest), batch.tokens,
                               batch.attention_mask)
        x = jnp.sum(jnp.where(valid, ref_lp - lp, 0.0), -1) / n  # written out, not the lib's
        k3 = jnp.clip(jnp.expm1(x) - x, -10.0, 10.0)
        return obj(lp, obj_batch)[0] + kl_coef * jnp.sum(jnp.where(rows, k3, 0.0)) / rows.sum()

    grads = jax.grad(total)(params)
    norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
    np.testing.assert_allclose(m["grad_norm"], norm, rtol=1e-4)


def test_low_var_kl_is_verls_clamped_k3():
    """Values and gradient against numpy, where the clamps bite (x = log pi_ref / pi of
    -25, -12, 3, 25, 100) and where they do not (k3 itself)."""
    x = np.array([[-25.0, -12.0, -1.0, 0.0, 0.5, 2.0, 3.0, 25.0, 100.0]])
    lp = np.full_like(x, -1.0)
    ref, mask = lp + x, np.ones_like(x)
    got = np.asarray(losses.kl_penalty(jnp.asarray(lp, jnp.float32), jnp.asarray(ref,
                                       jnp.float32), jnp.asarray(mask), "low_var_kl"))
    want = _np_kl(x, "low_var_kl")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[0, [0, 1, 6, 7, 8]], 10.0)  # clamped (k3 > 10)
    free = np.abs(want) < 10
    np.testing.assert_allclose(got[free], _np_kl(x, "k3")[free], rtol=1e-5, atol=1e-6)
    g = np.asarray(jax.grad(lambda a: jnp.sum(losses.kl_penalty(
        a, jnp.asarray(ref, jnp.float32), jnp.asarray(mask), "low_var_kl")))(
        jnp.asarray(lp, jnp.float32)))
    assert np.all(np.isfinite(g))  # exp(100) never reaches the gradient
    np.testing.assert_allclose(g, np.where(free, 1 - np.exp(np.minimum(x, 20)), 0.0),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("estimator", ["k1", "k3", "low_var_kl"])
def test_sequence_kl_matches_numpy(estimator):
    r = np.random.default_rng(2)
    lp = np.log(r.uniform(0.01, 1.0, (5, 6)))
    ref = lp + r.normal(0.0, 2.0, (5, 6))  # wide: some rows' low_var_kl clamps
    ref[0] = lp[0] + 4.0  # x_0 = 4: k3 = 50.6, low_var_kl 10
    mask = (r.random((5, 6)) < 0.6).astype(np.float32)
    mask[0, :2], mask[3] = 1.0, 0.0  # row 3 empty: not a row of the mean
    lp[mask == 0] = np.nan  # padding never reaches the estimate
    valid = mask > 0
    args = (jnp.asarray(lp, jnp.float32), jnp.asarray(ref, jnp.float32), jnp.asarray(mask))
    per_row = np.asarray(losses.sequence_kl_penalty(*args, estimator))
    x_seq = np.array([np.mean((ref - lp)[i][valid[i]]) if valid[i].any() else 0.0
                      for i in range(5)])
    want = np.where(valid.any(1), _np_kl(x_seq, estimator), 0.0)
    np.testing.assert_allclose(per_row, want, rtol=1e-5, atol=1e-6)
    if estimator == "low_var_kl":
        assert per_row[0] == 10.0
    got = float(losses.reference_kl(*args, estimator=estimator, level="sequence"))
    np.testing.assert_allclose(got, _np_sequence_kl(lp, ref, valid, estimator), rtol=1e-5)
    tok = float(losses.reference_kl(*args, estimator=estimator, level="token"))
    np.testing.assert_allclose(tok, _np_kl(ref - lp, estimator)[valid].mean(), rtol=1e-5)
    assert abs(got - tok) > 1e-3  # the levels differ on this batch
    # d/d lp_{i,t} = -k'(x_i) / (n_i R) for k3: k'(x) = exp(x) - 1
    if estimator == "k3":
        g = np.asarray(jax.grad(lambda a: losses.reference_kl(
            a, args[1], args[2], estimator="k3", level="sequence"))(
            jnp.asarray(np.where(valid, lp, 0.0), jnp.float32)))
        n, rows = valid.sum(1, keepdims=True), valid.any(1).sum()
        dwant = np.where(valid, -(np.exp(x_seq)[:, None] - 1) / np.maximum(n, 1) / rows, 0.0)
        np.testing.assert_allclose(g, dwant, rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="level"):
        losses.reference_kl(*args, estimator=estimator, level="row")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_matches_numpy(estimator):
    r = np.random.default_rng(0)
    lp = np.log(r.uniform(0.05, 1.0, (3, 5)))
    ref = np.log(r.uniform(0.05, 1.0, (3, 5)))
    mask = (r.random((3, 5)) < 0.7).astype(np.float32)
    lp[mask == 0] = np.nan  # padding never reaches the estimate
    x = ref - lp
    want = _np_kl(x, estimator)
    got = np.asarray(losses.kl_penalty(jnp.asarray(lp, jnp.float32),
                                       jnp.asarray(ref, jnp.float32),
                                       jnp.asarray(mask), estimator))
    np.testing.assert_allclose(got[mask > 0], want[mask > 0], rtol=1e-5, atol=1e-6)
    assert np.all(got[mask == 0] == 0.0)
    # d k / d lp: 1 (k1), -x (k2), 1 - exp(x) (k3); ref gets no gradient
    g = jax.grad(lambda a: jnp.sum(losses.kl_penalty(a, jnp.asarray(ref, jnp.float32),
                                                     jnp.asarray(mask), estimator)))(
        jnp.asarray(np.where(mask > 0, lp, 0.0), jnp.float32))
    dwant = {"k1": np.ones_like(x), "k2": -x, "k3": 1 - np.exp(x)}[estimator]
    np.testing.assert_allclose(np.asarray(g)[mask > 0], dwant[mask > 0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="estimator"):
        losses.kl_penalty(jnp.asarray(lp), jnp.asarray(ref), jnp.asarray(mask), "k4")


@pytest.mark.parametrize("chunk", [3, 64])  # scanned chunks, one block
@pytest.mark.slow
def test_chunked_entropy_matches_numpy(chunk):
    r = np.random.default_rng(1)
    B, T, D, V = 2, 7, 5, 11
    hidden = r.standard_normal((B, T, D)).astype(np.float32)
    head = r.standard_normal((D, V)).astype(np.float32)
    y = r.integers(0, V, (B, T))
    lp, ent = chunked_logprobs_entropy(jnp.asarray(hidden), jnp.asarray(head), jnp.asarray(y),
                                       temperature=0.7, chunk=chunk)
    z = (hidden.astype(np.float64) @ head) / 0.7
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    np.testing.assert_allclose(ent, -(np.exp(logp) * logp).sum(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lp, np.take_along_axis(logp, y[..., None], -1)[..., 0],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(lp, chunked_logprobs(jnp.asarray(hidden), jnp.asarray(head),
                                                       jnp.asarray(y), temperature=0.7,
                                                       chunk=chunk))

    def h_sum(h):
        return jnp.sum(chunked_logprobs_entropy(h, jnp.asarray(head), jnp.asarray(y),
                                                temperature=0.7, chunk=chunk)[1])

    def h_full(h):
        zz = jax.nn.log_softmax((h @ jnp.asarray(head)) / 0.7, axis=-1)
        return jnp.sum(-jnp.exp(zz) * zz)

    np.testing.assert_allclose(jax.grad(h_sum)(jnp.asarray(hidden)),
                               jax.grad(h_full)(jnp.asarray(hidden)), rtol=1e-4, atol=1e-5)


def test_kl_needs_a_reference(make_state, mesh_of):
    with pytest.raises(ValueError, match="reference"):
        _step(make_state, mesh_of, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_estimator"):
        _step(make_state, mesh_of, kl_estimator="k9")
    with pytest.raises(ValueError, match="kl_level"):
        _step(make_state, mesh_of, kl_level="row")
    with pytest.raises(ValueError, match="updates_per_batch"):
        _step(make_state, mesh_of, updates_per_batch=0)


def test_make_batch_min_rows_pads_with_masked_groups():
    from satjax.train.batch import make_batch
    from satjax.trajectory import Trajectory

    trajs = [Trajectory(trajectory_id=f"g-{i}", group_id="g", prompt_id="p",
                        prompt_tokens=np.array([1, 2], np.int32),
                        response_tokens=np.array([3], np.int32),
                        behavior_logprobs=np.array([-0.5], np.float32), policy_version=0,
                        reward=float(i), group_size=2) for i in range(2)]
    b = make_batch(trajs, buckets=(8,), min_rows=6)
    assert b.tokens.shape == (6, 8) and b.loss_mask[2:].sum() == 0
    assert list(b.group_ids) == [0, 0, 1, 1, 2, 2]


def test_config_choices_are_the_librarys():
    import typing

    from satjax.config import ObjectiveConfig, TrainConfig, load_config

    hints = typing.get_type_hints(ObjectiveConfig)
    assert typing.get_args(hints["kl_estimator"]) == losses.KL_ESTIMATORS
    assert typing.get_args(hints["kl_level"]) == losses.KL_LEVELS
    # the mismatch metrics are metrics the step logs for every objective
    metrics = set(losses.AUX_KEYS) | {"token_gate_frac", "token_extreme_frac"}
    assert set(typing.get_args(typing.get_type_hints(TrainConfig)["mismatch_metric"])) <= metrics
    for bad in ("train.mini_batches=0", "objective.kl_coef=-1", "train.mismatch_target=0",
                "train.max_fetches=0", "objective.kl_estimator=k4",
                "objective.kl_level=row"):
        with pytest.raises(ValueError, match=bad.split("=")[0]):
            load_config(None, [bad])
