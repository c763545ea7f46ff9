"""Ctrl-C during ``satjax train``'s start-up, many times: how often it ends as promised.

Each try starts a tiny ``satjax train`` in a fresh run directory, sends SIGINT (what a
terminal's Ctrl-C sends to the foreground process) after a delay, and records the exit
code. The delays step through start-up: imports, the warm-up compile and steps, the queue
server's start, the first publish, the workers' start. Promised: exit code 130 every
time (docs/reliability.md), never 139 (a segfault) or a traceback.

    PYTHONPATH=$PWD python scripts/interrupt_startup.py --tries 10
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_try(run_dir: Path, delay: float, timeout: float) -> tuple[int, bool]:
    """(exit code, whether stderr held a traceback) of one start interrupted after
    ``delay`` seconds."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "satjax", "train", "--no-progress", "--set", f"run_dir={run_dir}",
         "--set", "sft.steps=20", "--set", "train.steps=3", "--set", "rollout.group_size=4",
         "--set", "rollout.prompts_per_step=2"],
        env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        # a shell's background job ignores SIGINT and its children inherit that; a terminal's
        # foreground command does not
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        return -9, "Traceback" in err
    return proc.returncode, "Traceback" in err


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tries", type=int, default=10)
    p.add_argument("--first", type=float, default=1.0, help="delay of the first try (s)")
    p.add_argument("--last", type=float, default=25.0, help="delay of the last try (s)")
    p.add_argument("--timeout", type=float, default=90.0, help="per try, after the SIGINT")
    args = p.parse_args()
    from satjax.utils import versions_line

    print(versions_line(("satjax", "jax", "jaxlib", "grpcio", "orbax-checkpoint")), flush=True)
    codes: collections.Counter[str] = collections.Counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.tries):
            delay = args.first + (args.last - args.first) * i / max(1, args.tries - 1)
            rc, tb = one_try(Path(tmp) / f"run{i}", delay, args.timeout)
            print(f"try {i + 1}: SIGINT after {delay:.1f}s -> exit {rc}"
                  f"{' (traceback)' if tb else ''}", flush=True)
            codes[f"{rc}{' traceback' if tb else ''}"] += 1
    print("exit codes: " + ", ".join(f"{k}: {v}" for k, v in sorted(codes.items())))
    return 0 if set(codes) == {"130"} else 1


if __name__ == "__main__":
    sys.exit(main())
