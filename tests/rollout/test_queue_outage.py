"""A worker whose queue goes away keeps the group it holds and waits for it (backoff,
one log line per try, bounded by ``queue_retry_s``); a restarted queue gets the group
exactly once. The engine is a stand-in (a unit-test fake): what is tested is the loop."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from satjax.data.pipeline import prompt_dataset
from satjax.data.tasks import ArithmeticTask
from satjax.model.tokenizer import CharTokenizer
from satjax.queue.client import NO_RETRY, QueueClient, QueueUnavailableError
from satjax.queue.protocol import TOKEN_ENV, PauseDecision, PutResult
from satjax.rollout.engine import Completion, SamplingParams
from satjax.rollout.worker import QueueRejectedError, RolloutWorker, WorkerConfig
from satjax.weight_sync import WeightPublisher, WeightSubscriber

REPO = Path(__file__).resolve().parents[2]
TOKEN = "outage-test-token-0123"


class FakeEngine:
    """Answers every prompt with "7" then EOS; ``on_generate`` runs before it answers."""

    name, canary_atol = "fake", 0.0

    def __init__(self, tok, on_generate=lambda: None):
        self.tok, self.on_generate, self.version = tok, on_generate, None

    def load(self, checkpoint_dir, version):
        self.version = version

    def apply_deltas(self, delta_dirs, version):
        self.version = version

    def canary_logprobs(self, tokens):
        return [0.0] * (len(tokens) - 1)

    def generate(self, prompts, sampling, seed, sync=None):
        self.on_generate()
        response = np.asarray([*self.tok.encode("7"), self.tok.eos_id], np.int32)
        return [Completion(np.asarray(p, np.int32), response, np.full(len(response), -0.5,
                                                                      np.float32),
                           np.zeros((len(p) + len(response) - 1, 1, 1), np.int32), "stop")
                for p in prompts]


def _weights(tmp_path) -> WeightSubscriber:
    def write(d):
        (d / "model.bin").write_bytes(b"w")

    WeightPublisher(tmp_path / "weights").publish(0, write)
    return WeightSubscriber(tmp_path / "weights")


def _cfg(**kw) -> WorkerConfig:
    tok = CharTokenizer()
    return WorkerConfig(group_size=2, prompts_per_step=1, worker_id="o", record_routes=False,
                        sampling=SamplingParams(max_new_tokens=4,
                                                stop_token_ids=(tok.eos_id,)), **kw)


def _serve(data_dir: Path, port: int) -> tuple[subprocess.Popen, int]:
    """``satjax serve-queue`` on ``port`` (0: any), once it listens; and its port."""
    env = {**os.environ, TOKEN_ENV: TOKEN, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "satjax", "serve-queue", "--port", str(port), "--data-dir",
         str(data_dir), "--log-level", "WARNING"], env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError(f"server did not start: {line!r}, rc={proc.wait()}")
    return proc, int(line.rsplit(":", 1)[1])


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


def test_a_restarted_queue_gets_the_held_group_exactly_once(tmp_path, caplog):
    tok = CharTokenizer()
    task = ArithmeticTask()
    server, port = _serve(tmp_path / "queue", 0)
    restarted: list[subprocess.Popen] = []
    timer = threading.Timer(1.0, lambda: restarted.append(_serve(tmp_path / "queue", port)[0]))

    def outage():  # the queue stops while the group is sampled, and comes back later
        if server.poll() is None:
            _stop(server)
            timer.start()

    address = f"127.0.0.1:{port}"
    try:
        # retries=0: every failed call is the worker's to retry (and to log)
        with QueueClient(address, token=TOKEN, retry=NO_RETRY) as client, \
                QueueClient(address, token=TOKEN) as trainer:
            worker = RolloutWorker(FakeEngine(tok, outage), task, tok, client,
                                   _weights(tmp_path), iter(prompt_dataset(task, seed=0)),
                                   _cfg(queue_retry_s=120.0))
            with caplog.at_level(logging.INFO, logger="satjax.rollout.worker"):
                assert worker.run(max_batches=1, install_signal_handlers=False) == 2
            retries = [r.getMessage() for r in caplog.records
                       if "unreachable, retrying in" in r.getMessage()]
            puts = [r.getMessage() for r in caplog.records if " put group " in r.getMessage()]
            assert len(puts) == 1, puts
            group = puts[0].split(" put group ")[1].split(":")[0]
            assert retries and all(f"queue at {address}" in m and f"(group {group} kept)" in m
                                   for m in retries), retries
            # the backoff doubles (0.5 s, 1 s, ...): a restart of ~1-3 s takes a few tries
            waits = [float(m.split("retrying in ")[1].split(" s")[0]) for m in retries]
            assert waits == [min(0.5 * 2 ** i, 10.0) for i in range(len(waits))]
            got = trainer.get_batch(2, trainer_version=0, max_lag=0, timeout=10)
            assert sorted(t.trajectory_id for t in got.trajectories) == [f"{group}-0",
                                                                         f"{group}-1"]
            # a put repeated after one the server stored (its answer lost) is a no-op
            again = trainer.put(got.trajectories)
            assert sorted(again.duplicates) == [f"{group}-0", f"{group}-1"]
            stats = trainer.stats()
            assert stats["accepted_total"] == 2 and stats["duplicates_total"] == 2
    finally:
        timer.cancel()
        if timer.is_alive():
            timer.join()
        for proc in (server, *restarted):
            if proc.poll() is None:
                _stop(proc)


class _DownClient:
    """A queue that never answers, as QueueClient reports it."""

    address = "10.0.0.9:50051"

    def __init__(self):
        self.calls = 0

    def should_pause(self, version):
        return PauseDecision(False, "", 0, 0, 0, 0)

    def put(self, group):
        self.calls += 1
        raise QueueUnavailableError(f"put on {self.address}: UNAVAILABLE: connection refused")


def _down_worker(tmp_path, client, **kw) -> RolloutWorker:
    tok = CharTokenizer()
    task = ArithmeticTask()
    return RolloutWorker(FakeEngine(tok), task, tok, client, _weights(tmp_path),
                         iter(prompt_dataset(task, seed=0)), _cfg(**kw))


def test_an_unreachable_queue_is_retried_for_queue_retry_s_then_one_line(tmp_path, caplog):
    client = _DownClient()
    worker = _down_worker(tmp_path, client, queue_retry_s=1.6)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="satjax.rollout.worker"), \
            pytest.raises(QueueUnavailableError) as e:
        worker.run(max_batches=1, install_signal_handlers=False)
    took = time.monotonic() - t0
    # waits 0.5 s, 1.0 s, then what is left of the bound (0.1 s; less on a loaded machine):
    # tries at 0, 0.5, 1.5 and 1.6 s, then the error
    waits = [float(r.getMessage().split("retrying in ")[1].split(" s")[0])
             for r in caplog.records]
    assert waits[:2] == [0.5, 1.0] and len(waits) in (2, 3) and client.calls == len(waits) + 1
    assert all(w <= 0.1 for w in waits[2:]) and 1.6 <= took < 6.0  # loaded machines: slack
    message = str(e.value)
    assert "\n" not in message and message.startswith(
        "queue at 10.0.0.9:50051 unreachable for 1.6 s (rollout.queue_retry_s), giving up")
    assert worker.produced == 0


def test_sigterm_during_the_backoff_stops_the_worker_at_once(tmp_path):
    client = _DownClient()
    worker = _down_worker(tmp_path, client, queue_retry_s=300.0)
    stopped = []
    put = client.put

    def put_then_stop(group):
        if client.calls == 1:  # the second try fails next, then a 1 s wait: stop inside it
            def stop():
                stopped.append(time.monotonic())
                worker.stop_event.set()  # what the SIGTERM handler does
            threading.Timer(0.2, stop).start()
        return put(group)

    client.put = put_then_stop
    assert worker.run(max_batches=1, install_signal_handlers=False) == 0
    # the 1 s wait after the second try ended with the stop, not after it
    assert client.calls == 2 and time.monotonic() - stopped[0] < 0.5


def test_a_refused_group_stops_the_worker_without_retrying(tmp_path):
    from satjax.queue.protocol import Rejection

    class Refusing(_DownClient):
        def put(self, group):
            self.calls += 1
            return PutResult([], [], [Rejection(i, t.trajectory_id, "response_tokens",
                                                "too long") for i, t in enumerate(group)])

    client = Refusing()
    with pytest.raises(QueueRejectedError, match="refused 2 of the 2 .*too long"):
        _down_worker(tmp_path, client, queue_retry_s=300.0).run(
            max_batches=1, install_signal_handlers=False)
    assert client.calls == 1
