"""The generated protobuf/gRPC modules of ``trajectory.proto``: ``pb2`` and ``pb2_grpc``.

They are build artefacts, never committed: ``setup.py``'s build_py runs ``grpc_tools.protoc``
(a wheel ships them; an editable install writes them next to the ``.proto``).
"""

from __future__ import annotations

try:
    import satjax.queue.trajectory_pb2 as pb2
    import satjax.queue.trajectory_pb2_grpc as pb2_grpc
except ImportError as e:  # pragma: no cover - depends on how the package was installed
    raise ImportError(
        "satjax.queue: the generated modules trajectory_pb2 / trajectory_pb2_grpc are "
        "missing; run `pip install -e .` to generate them from trajectory.proto") from e

SERVICE = pb2.DESCRIPTOR.services_by_name["TrajectoryQueue"].full_name

__all__ = ["SERVICE", "pb2", "pb2_grpc"]
