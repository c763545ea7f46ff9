"""Shared fixtures of the rollout tests."""

import pytest

from satjax.queue.client import QueueClient
from satjax.queue.server import QueueServer

TOKEN = "rollout-test-token"


@pytest.fixture()
def queue(tmp_path):
    """A client of a real queue server on a loopback port, with its own data directory."""
    server = QueueServer(tmp_path / "queue", TOKEN)
    port = server.start(0)
    client = QueueClient(f"127.0.0.1:{port}", token=TOKEN)
    client.wait_ready(timeout=30)
    yield client
    client.close()
    server.stop(1.0)
