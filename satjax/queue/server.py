"""gRPC server of the trajectory queue: ``satjax serve-queue`` or :class:`QueueServer`.

Every call except the standard health check must carry ``authorization: Bearer <token>``
(checked in constant time, from the metadata, before the request body is parsed); the
health service is left open so that orchestrators can probe liveness without the secret,
and it reveals nothing but SERVING/NOT_SERVING. Binds 127.0.0.1 unless told otherwise; TLS
when given a certificate and key; another address in plaintext only with ``insecure``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hmac
import ipaddress
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any, NamedTuple

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from satjax.queue._proto import SERVICE, pb2
from satjax.queue.codec import (
    MAX_MESSAGE_MB,
    PUT_BATCH_TRAJECTORIES,
    WireError,
    encode_batch_reply,
    split_messages,
)
from satjax.queue.core import (
    BatchResult,
    ConsumerLeaseError,
    Parsed,
    QueueClosedError,
    QueueRequestError,
    QueueSettings,
    StagedPut,
    TrajectoryQueue,
    undecodable,
)
from satjax.queue.protocol import ERROR_KIND_KEY, MIN_TOKEN_CHARS, STORAGE_ERROR, TOKEN_ENV
from satjax.queue.store import FSYNC_POLICIES, DataDirError, StorageError
from satjax.queue.validation import ROUTER_FIELDS, Limits

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
# A put is written in chunks of this many items or bytes, each as soon as it has arrived.
# Not smaller: on the development VM an fsync has a large fixed cost (records of 489 KiB
# fsynced one by one: 0.15-0.4 GB/s; 16 per fsync: ~1 GB/s), so writing each item of a
# stream as it arrived, for the group commit to overlap the transfer, measured slower.
PUT_CHUNK_ITEMS = 64
PUT_CHUNK_BYTES = 32 << 20
# grpc's synchronous server gives every call a thread from its start to its reply, also
# while the client sends nothing, so a handful of silent or slow clients used to hold all
# 16 and stall every worker. Threads are made as calls need them (a waiting one costs
# memory, not CPU), so there are many; the server takes no more calls than it has threads
# (maximum_concurrent_rpcs): one beyond is refused at once, and the client retries it,
# instead of waiting unseen behind held threads.
MAX_WORKERS = 256
# Calls one connection may have open at once (HTTP/2 streams): no one client holds more
# threads than this; its further calls wait on its own side.
MAX_STREAMS_PER_CONNECTION = 32
# A Put stream that sends no message for this long is cancelled: a producer streams
# records it already holds, so silence that long is a stuck or hostile client.
STREAM_IDLE_S = 30.0


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call without the right bearer token, health excepted."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(given, self._expected):
                    return handler
                break

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        # No deserializer: the body is refused as raw bytes, never parsed (a large
        # unauthenticated message costs its transfer, not our CPU). A stream is not read.
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


class _Stream:
    """A client stream being read: its call and when its last message came."""

    __slots__ = ("context", "last")

    def __init__(self, context) -> None:
        self.context, self.last = context, time.monotonic()


class IdleStreams:
    """Cancels client streams that send nothing for ``idle_s`` (their thread is freed:
    the handler's read raises), checking a few times per ``idle_s`` in one thread."""

    def __init__(self, idle_s: float):
        self.idle_s = idle_s
        self._streams: set[_Stream] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="idle-streams")
        self._thread.start()

    def read(self, items: Iterable[Parsed], context) -> Iterator[Parsed]:
        """``items`` as they come, the stream watched while it is read."""
        stream = _Stream(context)
        with self._lock:
            self._streams.add(stream)
        try:
            for item in items:
                stream.last = time.monotonic()
                yield item
        finally:
            with self._lock:
                self._streams.discard(stream)

    def _run(self) -> None:
        while not self._stop.wait(min(self.idle_s / 4, 1.0)):
            now = time.monotonic()
            with self._lock:
                idle = [s for s in self._streams if now - s.last > self.idle_s]
                self._streams.difference_update(idle)  # cancelled once, logged once
            for s in idle:
                log.warning("cancelling a Put stream from %s: no message for %.0f s",
                            s.context.peer(), now - s.last)
                s.context.cancel()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _serialize_batch(result: BatchResult) -> bytes:
    """GetBatchReply wire bytes, splicing stored Trajectory bytes without re-parsing them."""
    return encode_batch_reply(result.payloads, result.cursor, result.dropped_stale)


class Malformed(NamedTuple):
    """A unary request body that did not parse (see :func:`_lenient`)."""

    message: str


def _lenient(request_cls) -> Callable[[bytes], Any]:
    """A request deserializer that returns :class:`Malformed` instead of raising: gRPC
    answers a raising deserializer with INTERNAL and logs a traceback, but a body that is
    not a ``request_cls`` is the caller's mistake (INVALID_ARGUMENT, see :func:`_guard`)."""
    name = request_cls.DESCRIPTOR.name

    def parse(raw: bytes):
        try:
            return request_cls.FromString(raw)
        except DecodeError as e:
            return Malformed(f"request: must be a valid {name} message, got {len(raw)} bytes "
                             f"that are not ({e})")

    return parse


def _guard(fn: Callable) -> Callable:
    """Maps queue errors to status codes: a malformed request body to INVALID_ARGUMENT, a
    closing queue to UNAVAILABLE (clients retry, e.g. against a restart), a failed write
    to RESOURCE_EXHAUSTED naming the data dir, a lease conflict to FAILED_PRECONDITION."""

    @functools.wraps(fn)
    def wrapper(request, context):
        if isinstance(request, Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            return fn(request, context)
        except QueueClosedError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except StorageError as e:
            context.set_trailing_metadata(((ERROR_KIND_KEY, STORAGE_ERROR),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e.strerror))
        except ConsumerLeaseError as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))

    return wrapper


class QueueService:
    """The RPC handlers over one :class:`TrajectoryQueue`."""

    def __init__(self, queue: TrajectoryQueue, streams: IdleStreams):
        self.queue, self.streams = queue, streams

    def _parse_put_batch(self, raw: bytes) -> list[Parsed]:
        """PutBatchRequest's trajectories, sliced out without re-encoding, each parsed."""
        try:
            views = split_messages(raw, PUT_BATCH_TRAJECTORIES)
        except WireError as e:
            return [Parsed(raw, None, undecodable(e))]
        # copies: a cached payload must not keep the whole request alive
        return [self.queue.parse(bytes(v)) for v in views]

    def _put_items(self, items: Iterable[Parsed]) -> pb2.PutReply:
        """Writes ``items`` in chunks as they come, then replies once all of them are
        durable (the queue's ``stage`` / ``commit``): under fsync="always" the disk
        flushes a chunk while the next is received, and puts of other producers share
        the fsync."""
        staged: list[tuple[int, StagedPut]] = []  # (index of the chunk's first item, stage)
        chunk: list[Parsed] = []
        chunk_start, chunk_bytes = 0, 0
        try:
            for item in items:  # a stream's items are parsed as they arrive (deserializer)
                chunk.append(item)
                chunk_bytes += len(item.raw)
                if len(chunk) >= PUT_CHUNK_ITEMS or chunk_bytes >= PUT_CHUNK_BYTES:
                    staged.append((chunk_start, self.queue.stage(chunk)))
                    chunk_start += len(chunk)
                    chunk, chunk_bytes = [], 0
            if chunk:
                staged.append((chunk_start, self.queue.stage(chunk)))
        finally:
            # every written chunk is committed, also when the stream broke off: its items
            # become deliverable (or are taken back) instead of staying half-stored
            results, failure = [], None
            for start, stage in staged:
                try:
                    results.append((start, self.queue.commit(stage)))
                except StorageError as e:
                    failure = failure or e
            if failure is not None:
                raise failure
        reply = pb2.PutReply()
        for start, result in results:
            reply.accepted_ids.extend(result.accepted)
            reply.duplicate_ids.extend(result.duplicates)
            for r in result.rejected:
                reply.rejections.add(index=start + r.index, trajectory_id=r.trajectory_id,
                                     field=r.field, message=r.message)
        return reply

    def put(self, request_iterator: Iterable[Parsed], context) -> pb2.PutReply:
        return self._put_items(self.streams.read(request_iterator, context))

    def put_batch(self, items: list[Parsed], context) -> pb2.PutReply:
        return self._put_items(items)

    # context.abort raises; grpc (untyped) cannot tell mypy that it never returns
    def get_batch(self, request: pb2.GetBatchRequest, context) -> BatchResult:  # type: ignore[return]
        try:
            result = self.queue.get_batch(
                request.n, request.trainer_version,
                request.max_lag if request.HasField("max_lag") else None,
                request.timeout_s, allow_partial=request.allow_partial,
                redeliver_unacked=request.redeliver_unacked, consumer_id=request.consumer_id,
                take_over=request.take_over,
                batch_rows=request.batch_rows if request.HasField("batch_rows") else None,
                alive=context.is_active)
        except QueueRequestError as e:
            code = (grpc.StatusCode.RESOURCE_EXHAUSTED if e.too_large
                    else grpc.StatusCode.INVALID_ARGUMENT)
            context.abort(code, str(e))
        if result.cursor and not context.is_active():
            # the caller left while the batch was read: nobody will train on or ack it
            self.queue.undeliver(result.cursor)
        return result

    def ack(self, request: pb2.AckRequest, context) -> pb2.AckReply:
        acked, watermark = self.queue.ack(request.cursor, request.consumer_id)
        return pb2.AckReply(acked=acked, watermark=watermark)

    def stats(self, request: pb2.StatsRequest, context) -> pb2.StatsReply:
        return pb2.StatsReply(**self.queue.stats())

    def should_pause(self, request: pb2.ShouldPauseRequest, context) -> pb2.ShouldPauseReply:
        decision = self.queue.should_pause(request.worker_version)
        return pb2.ShouldPauseReply(**dataclasses.asdict(decision))

    def handler(self) -> grpc.GenericRpcHandler:
        def unary(fn: Callable, request_cls, serializer=None):
            return grpc.unary_unary_rpc_method_handler(
                _guard(fn), request_deserializer=_lenient(request_cls),
                response_serializer=serializer or (lambda m: m.SerializeToString()))

        return grpc.method_handlers_generic_handler(SERVICE, {
            "Put": grpc.stream_unary_rpc_method_handler(
                _guard(self.put), request_deserializer=self.queue.parse,
                response_serializer=pb2.PutReply.SerializeToString),
            "PutBatch": grpc.unary_unary_rpc_method_handler(
                _guard(self.put_batch), request_deserializer=self._parse_put_batch,
                response_serializer=pb2.PutReply.SerializeToString),
            "GetBatch": unary(self.get_batch, pb2.GetBatchRequest, _serialize_batch),
            "Ack": unary(self.ack, pb2.AckRequest),
            "Stats": unary(self.stats, pb2.StatsRequest),
            "ShouldPause": unary(self.should_pause, pb2.ShouldPauseRequest),
        })


class QueueServer:
    """In-process server: ``QueueServer(data_dir, token).start(port)`` ... ``.stop(grace)``."""

    def __init__(self, data_dir: str | Path, token: str, *,
                 settings: QueueSettings | None = None, tls_cert: str | Path | None = None,
                 tls_key: str | Path | None = None, max_message_mb: float = MAX_MESSAGE_MB,
                 max_workers: int = MAX_WORKERS, insecure: bool = False,
                 reset_consumer_state: bool = False, stream_idle_s: float = STREAM_IDLE_S):
        if len(token.strip()) < MIN_TOKEN_CHARS:
            raise ValueError(f"token: must be at least {MIN_TOKEN_CHARS} characters (e.g. "
                             f"python -c 'import secrets; print(secrets.token_urlsafe(24))'), "
                             f"got {len(token.strip())!r}")
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert/tls_key: must give both or neither, got only "
                             + ("tls_cert" if tls_cert is not None else "tls_key"))
        if not stream_idle_s > 0:
            raise ValueError(f"stream_idle_s: must be positive, got {stream_idle_s!r}")
        if max_workers < 1:
            raise ValueError(f"max_workers: must be >= 1, got {max_workers!r}")
        if max_message_mb <= 0:
            raise ValueError(f"max_message_mb: must be positive, got {max_message_mb!r}")
        self.max_message_bytes = int(max_message_mb * (1 << 20))
        # 1 KiB of the message is left for the reply's non-trajectory fields
        settings = dataclasses.replace(settings or QueueSettings(),
                                       max_reply_bytes=self.max_message_bytes - 1024)
        self.data_dir, self.token, self.settings = Path(data_dir), token, settings
        self.tls = None
        if tls_cert is not None and tls_key is not None:
            self.tls = (_read_pem("tls_cert", tls_cert, b"CERTIFICATE"),
                        _read_pem("tls_key", tls_key, b"PRIVATE KEY"))
        self.max_workers, self.insecure = max_workers, insecure
        self.stream_idle_s = stream_idle_s
        self._streams: IdleStreams | None = None
        self.reset_consumer_state = reset_consumer_state
        self.queue: TrajectoryQueue | None = None
        self._server: grpc.Server | None = None
        self.port: int | None = None

    def start(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Opens the queue and serves; returns the bound port (``port=0``: any free one)."""
        if not self.tls and not _is_loopback(host):
            if not self.insecure:
                raise ValueError(f"host: a non-loopback address needs TLS (--tls-cert, "
                                 f"--tls-key) or --insecure, got {host!r}")
            log.warning("SERVING PLAINTEXT ON %s: the bearer token and every trajectory "
                        "cross the network unencrypted (--insecure)", host)
        self.queue = TrajectoryQueue(self.data_dir, self.settings,
                                     reset_consumer_state=self.reset_consumer_state)
        options = [("grpc.max_receive_message_length", self.max_message_bytes),
                   ("grpc.max_send_message_length", self.max_message_bytes),
                   ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
                   ("grpc.so_reuseport", 0)]
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.max_workers),
                             interceptors=[BearerTokenInterceptor(self.token)], options=options,
                             maximum_concurrent_rpcs=self.max_workers)
        self._streams = IdleStreams(self.stream_idle_s)
        server.add_generic_rpc_handlers((QueueService(self.queue, self._streams).handler(),))
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        address = f"{host}:{port}"
        try:
            if self.tls:
                key_cert = ((self.tls[1], self.tls[0]),)
                self.port = server.add_secure_port(address,
                                                   grpc.ssl_server_credentials(key_cert))
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError:  # what grpcio raises now where it used to return 0
            self.port = 0
        if not self.port:
            self._streams.close()
            self.queue.close()
            raise OSError(f"could not bind {address}: the port is in use (another server?) "
                          "or the host is not an address of this machine; --port 0 picks "
                          "a free port")
        server.start()
        for name in ("", SERVICE):
            health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._health, self._server = health_servicer, server
        return self.port

    def stop(self, grace: float | None = None) -> None:
        """Stops serving (in-flight calls get ``grace`` seconds), then closes the log."""
        if self._server is not None:
            self._health.enter_graceful_shutdown()
            done = self._server.stop(grace)  # no new calls; in-flight ones get ``grace``
            if self.queue is not None:
                self.queue.shutdown()  # a GetBatch waiting for data returns UNAVAILABLE now
            done.wait()
            self._server = None
        if self._streams is not None:
            self._streams.close()
            self._streams = None
        if self.queue is not None:
            self.queue.close()
            self.queue = None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _read_pem(name: str, path: str | Path, marker: bytes) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{name}: must be a readable PEM file, got {str(path)!r} "
                         f"({e.strerror})") from None
    if marker not in data:
        raise ValueError(f"{name}: must be a PEM file holding a {marker.decode()}, "
                         f"got {str(path)!r}")
    return data


def build_parser() -> argparse.ArgumentParser:
    # defaults: the run config's for fsync / max lag (via QueueSettings), the library's else
    d, limits = QueueSettings(), Limits()
    p = argparse.ArgumentParser(prog="satjax serve-queue", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--data-dir", required=True, help="directory of the durable segment log")
    p.add_argument("--token", help=f"bearer token (else --token-file or ${TOKEN_ENV})")
    p.add_argument("--token-file", help="file holding the bearer token")
    p.add_argument("--tls-cert", help="PEM certificate (with --tls-key: serve TLS)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--fsync", choices=FSYNC_POLICIES, default=d.fsync,
                   help="when appends reach the disk (default: %(default)s)")
    p.add_argument("--max-message-mb", type=float, default=MAX_MESSAGE_MB,
                   help="largest gRPC message (default: %(default)s)")
    p.add_argument("--max-lag-default", type=int, default=d.max_lag_default,
                   help="max_lag of a GetBatch that does not set one")
    p.add_argument("--future-slack", type=int, default=d.future_slack,
                   help="versions beyond trainer+1 a put may claim (default: %(default)s)")
    p.add_argument("--max-pending", type=int, default=d.max_pending,
                   help="pending trajectories before puts are refused (back-pressure)")
    p.add_argument("--insecure", action="store_true",
                   help="allow a plaintext bind on a non-loopback address")
    p.add_argument("--reset-consumer-state", action="store_true",
                   help="forget a missing or damaged state.json: every record still in the "
                        "log is delivered again")
    p.add_argument("--consumer-lease-s", type=float, default=d.consumer_lease_s,
                   help="idle time after which another consumer may take over")
    # the model's bounds (satjax train passes them); unset: not checked
    p.add_argument("--vocab-size", type=int, help="reject tokens outside the vocabulary")
    p.add_argument("--num-experts", type=int, help="reject routes naming other experts")
    p.add_argument("--moe-layers", type=int, help="reject routes with another layer count")
    p.add_argument("--top-k", type=int, help="reject routes with another experts-per-token")
    p.add_argument("--group-size", type=int, help="reject groups of another size")
    p.add_argument("--max-version", type=int, default=limits.max_version,
                   help="reject a newer policy_version (default: the int64 range)")
    p.add_argument("--require-record", action="append", default=[], choices=ROUTER_FIELDS,
                   help="reject trajectories without this router field (repeatable)")
    p.add_argument("--refuse-record", action="append", default=[], choices=ROUTER_FIELDS,
                   help="reject trajectories with this router field (repeatable)")
    p.add_argument("--max-seq-len", "--max-tokens", dest="max_seq_len", type=int,
                   default=limits.max_seq_len,
                   help="longest trajectory, prompt + response (default: %(default)s)")
    p.add_argument("--segment-mb", type=float, default=d.segment_bytes / (1 << 20),
                   help="size at which the log starts a new segment file")
    p.add_argument("--cache-mb", type=float, default=d.cache_bytes / (1 << 20),
                   help="recent trajectories kept in memory for GetBatch")
    p.add_argument("--workers", type=int, default=MAX_WORKERS,
                   help="gRPC server threads, and calls served at once (default: %(default)s)")
    p.add_argument("--stream-idle-s", type=float, default=STREAM_IDLE_S,
                   help="cancel a Put stream that sends nothing for this long "
                        "(default: %(default)s)")
    p.add_argument("--log-level", default="INFO",
                   choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), type=str.upper,
                   help="log level (default: %(default)s)")
    return p


def _token(args: argparse.Namespace) -> str:
    if args.token:
        return args.token
    if args.token_file:
        try:
            return Path(args.token_file).read_text().strip()
        except OSError as e:
            raise ValueError(f"token_file: must be a readable file, got "
                             f"{args.token_file!r} ({e.strerror})") from None
    return os.environ.get(TOKEN_ENV, "")


def main(argv: list[str] | None = None) -> int:
    """``satjax serve-queue``: serves until SIGTERM/SIGINT, then shuts down gracefully."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        token = _token(args)
    except ValueError as e:
        print(f"serve-queue: {e}", file=sys.stderr)
        return 2
    if not token:
        print(f"serve-queue: no token: give --token, --token-file or ${TOKEN_ENV}",
              file=sys.stderr)
        return 2
    try:
        limits = Limits(max_seq_len=args.max_seq_len, vocab_size=args.vocab_size,
                        num_experts=args.num_experts, moe_layers=args.moe_layers,
                        top_k=args.top_k, group_size=args.group_size,
                        max_version=args.max_version, required=tuple(args.require_record),
                        refused=tuple(args.refuse_record))
        settings = QueueSettings(
            fsync=args.fsync, segment_bytes=int(args.segment_mb * (1 << 20)),
            max_lag_default=args.max_lag_default, future_slack=args.future_slack,
            max_pending=args.max_pending, limits=limits,
            cache_bytes=int(args.cache_mb * (1 << 20)), consumer_lease_s=args.consumer_lease_s)
        server = QueueServer(args.data_dir, token, settings=settings, tls_cert=args.tls_cert,
                             tls_key=args.tls_key, max_message_mb=args.max_message_mb,
                             max_workers=args.workers, insecure=args.insecure,
                             reset_consumer_state=args.reset_consumer_state,
                             stream_idle_s=args.stream_idle_s)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        port = server.start(args.port, args.host)
    except ValueError as e:  # a bad flag value
        print(f"serve-queue: {e}", file=sys.stderr)
        return 2
    except (DataDirError, OSError) as e:  # the data dir or the port cannot be used as is
        print(f"serve-queue: {e.strerror if isinstance(e, StorageError) else e}",
              file=sys.stderr)
        return 1
    print(f"satjax-queue listening on {args.host}:{port}", flush=True)
    while not stop.wait(0.5):
        pass
    log.info("shutting down")
    server.stop(grace=5.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
