"""Build hook: compiles satjax/queue/trajectory.proto during build_py.

Metadata lives in pyproject.toml; this file only adds the protoc step so that the
generated trajectory_pb2*.py modules (never committed) ship in wheels and exist in
editable installs. grpcio-tools is a build-system requirement; after editing the .proto,
run `pip install -e .` again to regenerate them.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PROTO = "satjax/queue/trajectory.proto"


class BuildPyWithProto(build_py):
    """build_py that first runs grpc_tools.protoc on the queue's .proto."""

    def run(self):
        from grpc_tools import protoc

        root = os.path.dirname(os.path.abspath(__file__))
        include = os.path.join(os.path.dirname(protoc.__file__), "_proto")
        rc = protoc.main(["grpc_tools.protoc", f"-I{root}", f"-I{include}",
                          f"--python_out={root}", f"--grpc_python_out={root}",
                          os.path.join(root, PROTO)])
        if rc != 0:
            raise RuntimeError(f"grpc_tools.protoc failed on {PROTO} (exit {rc})")
        super().run()


setup(cmdclass={"build_py": BuildPyWithProto})
