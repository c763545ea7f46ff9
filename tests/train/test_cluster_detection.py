"""``satjax train --distributed`` under SLURM: JAX's own cluster detection, run for real.

Two processes get the environment ``srun --ntasks=2`` gives its tasks on one node named
localhost; ``parallel.init_distributed(auto=True)`` (what ``--distributed`` calls) must
find the coordinator, the count and each id from it and form one 8-device job.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from satjax.utils import free_port

REPO = Path(__file__).resolve().parents[2]
CHILD = """
import sys
import jax, numpy as np
from jax.experimental import multihost_utils
from satjax import parallel
assert parallel.init_distributed(auto=True)
total = multihost_utils.process_allgather(np.array([jax.process_index() + 1]))
with open(sys.argv[1], "w") as f:
    print(jax.process_index(), jax.process_count(), jax.device_count(), int(np.sum(total)),
          end="", file=f)
"""


@pytest.mark.slow
def test_slurm_environment_is_detected(tmp_path):
    # JAX derives the port from the job id unless JAX_COORDINATOR_PORT says (a free one)
    port = free_port()
    procs = []
    for i in range(2):
        env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
               "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost",
               "SLURM_NTASKS": "2", "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i),
               "SLURM_STEP_NUM_NODES": "1", "JAX_COORDINATOR_PORT": str(port)}
        for name in ("SATJAX_COORDINATOR", "SATJAX_NUM_PROCESSES", "SATJAX_PROCESS_ID"):
            env.pop(name, None)
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / f"result{i}")],
                                      env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    try:
        outs = [p.communicate(timeout=120) for p in procs]  # (stdout, stderr: gloo's logs)
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    # each child writes its result to a file: gloo's C++ logs share (and can split) stdout lines
    results = [(tmp_path / f"result{i}").read_text() for i in range(2)]
    assert results == ["0 2 8 3", "1 2 8 3"], outs
