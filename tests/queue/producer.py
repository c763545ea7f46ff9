"""A producer process for the fault tests: ``python tests/queue/producer.py --address ...``.

Puts ``--count`` trajectories in batches and appends each acknowledged id to ``--log``, so
the test knows exactly what the server promised to keep.
"""

from __future__ import annotations

import argparse
import time

from queue_testlib import TOKEN, make_traj

from satjax.queue.client import QueueClient, RetryPolicy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--log", required=True)
    ap.add_argument("--version", type=int, default=0)
    a = ap.parse_args()
    client = QueueClient(a.address, token=TOKEN,
                         retry=RetryPolicy(retries=60, backoff_s=0.05, max_backoff_s=0.5))
    with open(a.log, "a") as log:
        for start in range(0, a.count, a.batch):
            trajs = [make_traj(f"{a.prefix}-{i}", f"{a.prefix}-g{i // a.group_size}",
                               version=a.version, group_size=a.group_size, seed=i)
                     for i in range(start, min(a.count, start + a.batch))]
            result = client.put(trajs, strict=True)
            log.write("".join(t + "\n" for t in result.accepted))
            log.flush()
            time.sleep(0.01)


if __name__ == "__main__":
    main()
