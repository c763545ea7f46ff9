"""Client of the trajectory queue (producers: ``put``/``should_pause``; trainer: the rest).

Every call has a deadline (:class:`RetryPolicy`: ``deadline_s`` a try, beyond the wait a
GetBatch asks for), so a server that takes the connection and never answers fails the
call instead of hanging it. Calls that fail with UNAVAILABLE, past their deadline, with a
full disk on the server, or because the server has all the calls it takes at once, are
retried with bounded exponential backoff, one log line a retry: ``put`` is safe to
retry because the server de-duplicates on ``trajectory_id``, ``ack`` acknowledges up to a
cursor. A GetBatch past its deadline is not retried: its batch may have been delivered
with a reply that was lost, and the next batch's ack would cover it untrained. Other
failures raise a :class:`QueueError` subclass naming what went wrong. Each client is one consumer
(``consumer_id``, a fresh id unless given): the server serves one consumer at a time (see
``get_batch``'s ``take_over``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from satjax.queue._proto import SERVICE, pb2, pb2_grpc
from satjax.queue.codec import (
    MAX_MESSAGE_MB,
    PUT_BATCH_TRAJECTORIES,
    Buffer,
    decode_batch_reply,
    encode_parts,
    join_messages,
)
from satjax.queue.protocol import (
    ERROR_KIND_KEY,
    SERVER_BUSY_DETAILS,
    STORAGE_ERROR,
    PauseDecision,
    PutResult,
    Rejection,
    check_wait,
)
from satjax.trajectory import Trajectory

__all__ = ["PauseDecision", "PutResult", "QueueAuthError", "QueueClient", "QueueError",
           "QueueLeaseError", "QueueStorageError", "QueueTimeoutError", "QueueTooLargeError",
           "QueueUnavailableError", "QueueValidationError", "NO_RETRY", "Rejection", "RetryPolicy",
           "TrajectoryBatch"]

log = logging.getLogger(__name__)

T = TypeVar("T")
# Items at least this large (on average) are streamed, one message each, as they are: a
# PutBatch copies them into one message on the client and slices and copies them out again
# on the server. Measured with 489 KiB items, the stream was as fast or faster; below a few
# hundred KiB the stream's per-message overhead dominates instead.
STREAM_ITEM_BYTES = 256 << 10


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How a :class:`QueueClient` call waits and retries: the one default of every caller
    (:data:`NO_RETRY` for one that retries itself).

    Each try has ``deadline_s`` (a GetBatch: the wait it asks for, plus ``deadline_s``);
    a try that fails with a retryable error is repeated ``retries`` times at most, after
    ``backoff_s`` doubling to at most ``max_backoff_s``. With the defaults a server that
    never answers fails a call after 7 tries, 3.6 min; one that is down, after 5.1 s of
    backoff."""

    retries: int = 6
    backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    # a try's deadline: a 64 MiB PutBatch over a slow link, with room to spare
    deadline_s: float = 30.0

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries: must be >= 0, got {self.retries!r}")
        if not self.deadline_s > 0:
            raise ValueError(f"deadline_s: must be > 0, got {self.deadline_s!r}")


# for a caller that retries itself (a rollout worker: rollout.queue_retry_s), a try at a time
NO_RETRY = RetryPolicy(retries=0)


class QueueError(RuntimeError):
    """A queue call failed; ``code`` is the gRPC status code when there is one."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


class QueueAuthError(QueueError):
    """The server refused the bearer token (missing or wrong)."""


class QueueValidationError(QueueError):
    """Invalid request, or (strict put) rejected trajectories; see ``rejections``."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None,
                 rejections: Sequence[Rejection] = ()):
        super().__init__(message, code)
        self.rejections = list(rejections)


class QueueUnavailableError(QueueError):
    """The server could not be reached within the retry budget."""


class QueueTimeoutError(QueueError):
    """The call's deadline passed."""


class QueueTooLargeError(QueueError):
    """A message or batch is over the size limit (RESOURCE_EXHAUSTED)."""


class QueueStorageError(QueueError):
    """The server could not store the call's data (disk full, I/O error); nothing was kept,
    and the same call succeeds once the server's disk has room again."""


class QueueLeaseError(QueueError):
    """Another consumer holds the queue (FAILED_PRECONDITION); see ``take_over``."""


@dataclasses.dataclass(frozen=True)
class TrajectoryBatch:
    """A GetBatch answer: whole groups of decoded trajectories, oldest first."""

    trajectories: list[Trajectory]
    cursor: int              # pass to QueueClient.ack once trained on
    dropped_stale: int


_ERRORS: dict[grpc.StatusCode, type[QueueError]] = {
    grpc.StatusCode.UNAUTHENTICATED: QueueAuthError,
    grpc.StatusCode.PERMISSION_DENIED: QueueAuthError,
    grpc.StatusCode.INVALID_ARGUMENT: QueueValidationError,
    grpc.StatusCode.UNAVAILABLE: QueueUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: QueueTimeoutError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: QueueTooLargeError,
    grpc.StatusCode.FAILED_PRECONDITION: QueueLeaseError,
}


def _is_storage_error(e: grpc.RpcError) -> bool:
    trailing = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
    return (ERROR_KIND_KEY, STORAGE_ERROR) in tuple(trailing or ())


def _is_server_busy(e: grpc.RpcError) -> bool:
    return (e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and e.details() == SERVER_BUSY_DETAILS)


class QueueClient:
    """``QueueClient("127.0.0.1:50051", token=...)``; ``tls_ca`` (PEM path) enables TLS."""

    def __init__(self, address: str, *, token: str, tls_ca: str | Path | None = None,
                 tls_server_name: str | None = None, max_message_mb: float = MAX_MESSAGE_MB,
                 retry: RetryPolicy = RetryPolicy(), num_experts: int | None = None,
                 compact_routes: bool = False, consumer_id: str | None = None):
        if not token:
            raise ValueError(f"token: must be a non-empty bearer token, got {token!r}")
        size = int(max_message_mb * (1 << 20))
        options: list[tuple[str, int | str]] = [("grpc.max_receive_message_length", size),
                                                 ("grpc.max_send_message_length", size)]
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        if tls_ca is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca).read_bytes())
            self._channel = grpc.secure_channel(address, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(address, options=options)
        self._stub = pb2_grpc.TrajectoryQueueStub(self._channel)
        # Hot paths move raw bytes: the codec encodes/decodes with fewer copies than protobuf.
        self._put_raw = self._channel.stream_unary(
            f"/{SERVICE}/Put", response_deserializer=pb2.PutReply.FromString)
        self._put_batch_raw = self._channel.unary_unary(
            f"/{SERVICE}/PutBatch", response_deserializer=pb2.PutReply.FromString)
        self._get_raw = self._channel.unary_unary(
            f"/{SERVICE}/GetBatch", request_serializer=pb2.GetBatchRequest.SerializeToString)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),)
        self.address, self.retry, self.max_message_bytes = address, retry, size
        self.num_experts, self.compact_routes = num_experts, compact_routes
        self.consumer_id = consumer_id or uuid.uuid4().hex

    # -- plumbing -------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[float], T], wait_s: float = 0.0,
              idempotent: bool = True) -> T:
        """``fn(deadline)`` (seconds: ``wait_s`` plus the policy's ``deadline_s``), retried
        as :class:`RetryPolicy` says; past its deadline only when ``idempotent``."""
        policy = self.retry
        delay = policy.backoff_s
        for attempt in range(policy.retries + 1):
            try:
                return fn(wait_s + policy.deadline_s)
            except grpc.RpcError as e:
                code = e.code()
                storage = _is_storage_error(e)
                retry = (code == grpc.StatusCode.UNAVAILABLE or storage or _is_server_busy(e)
                         or (idempotent and code == grpc.StatusCode.DEADLINE_EXCEEDED))
                if retry and attempt < policy.retries:
                    log.warning("queue at %s: %s failed (%s: %s); retry %d of %d in %.2gs",
                                self.address, what, code.name, e.details(), attempt + 1,
                                policy.retries, delay)
                    time.sleep(delay)
                    delay = min(delay * 2, policy.max_backoff_s)
                    continue
                cls = QueueStorageError if storage else _ERRORS.get(code, QueueError)
                tries = f" (after {attempt + 1} tries)" if attempt else ""
                raise cls(f"{what} on {self.address}: {code.name}: {e.details()}{tries}",
                          code) from e
        raise AssertionError("unreachable")

    # -- producer API ---------------------------------------------------------------------
    def put(self, trajectories: Iterable[Trajectory | Any], *, strict: bool = False
            ) -> PutResult:
        """Sends ``trajectories`` (dataclasses, ``pb2.Trajectory`` or wire bytes) to the queue.

        Large items (at least ``STREAM_ITEM_BYTES`` on average) go as a client-streaming Put,
        each as its own message, sent as it is; small ones as one PutBatch message when they
        fit in one, else as a stream too.

        Returns accepted ids and per-item rejections; ``strict=True`` raises
        :class:`QueueValidationError` instead when any item is rejected.
        """
        # each item as parts (arrays as views): joining them is then the one copy
        parts: list[list[Buffer]] = [
            [t] if isinstance(t, bytes) else [t.SerializeToString()]
            if isinstance(t, pb2.Trajectory) else encode_parts(t, num_experts=self.num_experts)
            for t in trajectories]
        total = sum(len(p) for item in parts for p in item)
        reply = None
        if (1 < len(parts) and total < STREAM_ITEM_BYTES * len(parts)
                and total + 10 * len(parts) + 1024 <= self.max_message_bytes):
            request = join_messages(PUT_BATCH_TRAJECTORIES, parts)
            try:
                reply = self._call("put", lambda deadline: self._put_batch_raw(
                    request, timeout=deadline, metadata=self._metadata))
            except QueueTooLargeError:
                pass  # over the server's limit (refused whole, nothing stored): stream
        if reply is None:
            raws = [item[0] if len(item) == 1 else b"".join(item) for item in parts]
            reply = self._call("put", lambda deadline: self._put_raw(
                iter(raws), timeout=deadline, metadata=self._metadata))
        rejected = [Rejection(r.index, r.trajectory_id, r.field, r.message)
                    for r in reply.rejections]
        result = PutResult(list(reply.accepted_ids), list(reply.duplicate_ids), rejected)
        if strict and rejected:
            raise QueueValidationError(
                "put: rejected " + "; ".join(f"#{r.index} {r.trajectory_id!r}: {r.message}"
                                             for r in rejected),
                grpc.StatusCode.INVALID_ARGUMENT, rejected)
        return result

    def should_pause(self, worker_version: int) -> PauseDecision:
        """Whether a worker at ``worker_version`` should stop generating (would be wasted)."""
        r = self._call("should_pause", lambda deadline: self._stub.ShouldPause(
            pb2.ShouldPauseRequest(worker_version=worker_version), timeout=deadline,
            metadata=self._metadata))
        return PauseDecision(**{f.name: getattr(r, f.name)
                                for f in dataclasses.fields(PauseDecision)})

    # -- trainer API ----------------------------------------------------------------------
    def get_batch(self, n: int, trainer_version: int, max_lag: int | None = None,
                  timeout: float = 0.0, *, allow_partial: bool = False,
                  redeliver_unacked: bool = False, take_over: bool = False,
                  batch_rows: int | None = None) -> TrajectoryBatch:
        """Waits up to ``timeout`` s for ``n`` fresh trajectories in whole groups.

        An empty batch (cursor 0) comes back when fewer than ``n`` are ready in time, unless
        ``allow_partial``. Set ``redeliver_unacked`` on the first call after a trainer restart.
        While another consumer holds the queue this raises :class:`QueueLeaseError`, unless
        ``take_over`` (a trainer resuming after a crash): the other's unacknowledged batches
        are then delivered again and its later calls are refused.
        ``batch_rows``: the whole batch when it is fetched in several calls of ``n`` (the
        queue's ShouldPause predicts lags in batches of it).
        Routes are int32 unless the client was made with ``compact_routes=True`` (then
        read-only uint8/uint16 views, no copy). ``timeout`` must be in ``[0, MAX_WAIT_S]``
        (:mod:`satjax.queue.protocol`; ValueError otherwise): wait longer by calling again.
        """
        timeout = check_wait("timeout", timeout)
        request = pb2.GetBatchRequest(n=n, trainer_version=trainer_version, timeout_s=timeout,
                                      allow_partial=allow_partial,
                                      redeliver_unacked=redeliver_unacked,
                                      consumer_id=self.consumer_id, take_over=take_over)
        if max_lag is not None:
            request.max_lag = max_lag
        if batch_rows is not None:
            request.batch_rows = batch_rows
        raw = self._call("get_batch", lambda deadline: self._get_raw(
            request, timeout=deadline, metadata=self._metadata), wait_s=timeout,
            idempotent=False)
        trajs, cursor, dropped = decode_batch_reply(raw, compact_routes=self.compact_routes)
        return TrajectoryBatch(trajs, cursor, dropped)

    def ack(self, cursor: int) -> int:
        """Consumes every batch delivered to this client up to and including the one with
        ``cursor`` (cursors grow with each delivery); returns how many trajectories."""
        return self._call("ack", lambda deadline: self._stub.Ack(
            pb2.AckRequest(cursor=cursor, consumer_id=self.consumer_id), timeout=deadline,
            metadata=self._metadata)).acked

    def stats(self) -> dict[str, int]:
        reply = self._call("stats", lambda deadline: self._stub.Stats(
            pb2.StatsRequest(), timeout=deadline, metadata=self._metadata))
        return {f.name: getattr(reply, f.name) for f in reply.DESCRIPTOR.fields}

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Blocks until the health check reports SERVING; QueueUnavailableError after timeout."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise QueueUnavailableError(f"queue at {self.address} not ready after "
                                            f"{timeout}s: {last}", grpc.StatusCode.UNAVAILABLE)
            try:
                r = self._health.Check(health_pb2.HealthCheckRequest(service=SERVICE),
                                       timeout=min(left, 2.0), wait_for_ready=True)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = f"status {r.status}"
            except grpc.RpcError as e:
                last = f"{e.code().name}: {e.details()}"
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> QueueClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
