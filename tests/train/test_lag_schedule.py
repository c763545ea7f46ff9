"""The served-version schedule: exact lag, broadcast interval (slime's async loop), free."""

import pytest

from satjax.config import TrainConfig
from satjax.train.lag_schedule import served_version


def slime_generation_versions(interval: int, steps: int) -> list[int]:
    """Replays slime's ``train_async.py`` loop (``--update-weights-interval``) and returns,
    per rollout id, the engine version its generation started with: weights are pushed
    before the loop; rollout r+1 is started before training on rollout r; after a step
    whose count is a multiple of the interval the rollout in flight is waited for, then
    the trainer's weights (version = steps trained) are pushed."""
    engine = trainer = 0
    generated_with: dict[int, int] = {}
    in_flight: int | None = 0
    generated_with[0] = engine  # generate.remote(start_rollout_id)
    current = None
    for rollout_id in range(steps):
        if in_flight is not None:
            current, in_flight = in_flight, None  # ray.get(rollout_data_next_future)
        if rollout_id + 1 < steps:
            in_flight = rollout_id + 1  # started early, with the weights the engines hold
            generated_with[in_flight] = engine
        assert current == rollout_id  # the step trains on its own rollout
        trainer += 1
        if (rollout_id + 1) % interval == 0:
            current, in_flight = in_flight, None  # the generation in flight finishes first
            engine = trainer  # update_weights()
    return [generated_with[r] for r in range(steps)]


@pytest.mark.parametrize("n", [1, 4, 8])
def test_broadcast_interval_serves_what_slimes_async_loop_generates_with(n):
    steps = 4 * n + 3
    t = TrainConfig(broadcast_every=n, max_lag=n)
    # trainer version k trains step k (one version per rollout batch)
    assert [served_version(k, t) for k in range(steps)] == slime_generation_versions(n, steps)
    lags = [k - served_version(k, t) for k in range(steps)]
    # the served lag: 0 at step 0, then cycling 1..n, from the first steps on (version 0
    # serves steps 1..n before n versions exist)
    assert lags == [0] + [(k - 1) % n + 1 for k in range(1, steps)]
    assert max(lags) == n and all(served_version(k, t) % n == 0 for k in range(steps))


def test_broadcast_interval_4_first_steps():
    t = TrainConfig(broadcast_every=4, max_lag=4)
    assert [served_version(k, t) for k in range(10)] == [0, 0, 0, 0, 0, 4, 4, 4, 4, 8]


def test_exact_lag_and_free_running():
    exact = TrainConfig(exact_lag=3, max_lag=3)
    assert [served_version(k, exact) for k in range(6)] == [0, 0, 0, 0, 1, 2]
    # interval 1 is exact lag 1 (slime's default interval in its async loop)
    one = TrainConfig(broadcast_every=1, max_lag=1)
    assert [served_version(k, one) for k in range(6)] == [
        served_version(k, TrainConfig(exact_lag=1, max_lag=1)) for k in range(6)]
    assert served_version(5, TrainConfig()) is None  # workers follow the newest version


def test_trainer_points_workers_at_the_broadcast_versions(tmp_path):
    """The real path: each publish sets the weight directory's TARGET, the version every
    RolloutWorker loads (``WeightSubscriber.wanted_version``), to the schedule's, and that
    version (with the target before it) is still published."""
    from satjax.app.factory import build_model, build_tokenizer
    from satjax.config import load_config
    from satjax.train.trainer import Trainer
    from satjax.weight_sync import WeightSubscriber, published_versions

    cfg = load_config(None, [f"run_dir={tmp_path}", "train.broadcast_every=4",
                             "train.max_lag=4", "train.keyframe_every=1",
                             "train.mesh={data: 1}"])
    tok = build_tokenizer(cfg)
    trainer = Trainer(cfg, build_model(cfg, tok), tok)
    sub = WeightSubscriber(trainer.dirs.weights)
    wanted = []
    try:
        for v in range(10):  # the versions train_on would make, without the steps
            trainer.state["policy_version"][...] = v
            trainer.publish()
            trainer.wait_published()
            wanted.append(sub.wanted_version())
            kept = published_versions(trainer.dirs.weights)
            assert {wanted[-1], wanted[max(0, v - 1)], v} <= set(kept), (v, kept)
    finally:
        trainer.close()
    assert wanted == [served_version(v, cfg.train) for v in range(10)]
    assert wanted == [0, 0, 0, 0, 0, 4, 4, 4, 4, 8]


def test_a_lowered_lag_limit_moves_the_broadcast_target_up(tmp_path):
    """``train.mismatch_target`` with a broadcast interval: while the controller admits a
    lag below the schedule's, the trainer points the workers at ``version - limit`` (the
    queue would drop the scheduled version's batches); back at ``max_lag``, the schedule."""
    from satjax.app.factory import build_model, build_tokenizer
    from satjax.config import load_config
    from satjax.train.trainer import Trainer
    from satjax.weight_sync import WeightSubscriber

    cfg = load_config(None, [f"run_dir={tmp_path}", "train.broadcast_every=4",
                             "train.max_lag=4", "train.keyframe_every=1",
                             "train.mismatch_target=0.001", "train.mesh={data: 1}"])
    tok = build_tokenizer(cfg)
    trainer = Trainer(cfg, build_model(cfg, tok), tok)
    sub = WeightSubscriber(trainer.dirs.weights)
    limits = [4, 4, 4, 1, 1, 1, 0, 4, 4, 4]  # the controller's decisions, set by hand
    wanted = []
    try:
        for v, limit in enumerate(limits):
            trainer.lag_controller.limit = limit
            trainer.state["policy_version"][...] = v
            trainer.publish()
            trainer.wait_published()
            wanted.append(sub.wanted_version())
    finally:
        trainer.close()
    # schedule 0 0 0 0 0 4 4 4 4 8; at v 3..5 the limit 1 moves it to v - 1, at v 6 to v
    assert wanted == [0, 0, 0, 2, 3, 4, 6, 4, 4, 8]
    assert wanted == [served_version(v, cfg.train, lim) for v, lim in enumerate(limits)]
