"""One process of a multi-process Trainer run (started by test_multiprocess.py).

    python multiprocess_child.py PROCESS_ID NUM_PROCESSES PORT OUT MESH MODE

MODE=publish: publishes the initial weights (version 0); process 0 copies the version to
OUT/v0-<NUM_PROCESSES>-<MESH>, every process lists the files it wrote in
OUT/files-<NUM_PROCESSES>-<MESH>-<PROCESS_ID>.json. MODE=train: that, then 3 deterministic
batches on the global mesh MESH (``d,f,e,t``), publishing each version, then a checkpoint;
process 0 writes the gathered parameters before and after to
OUT/params-{init,train}-<NUM_PROCESSES>.npz. MODE=restore: OUT's checkpoint restored
onto MESH, written to OUT/params-restore-<NUM_PROCESSES>.npz. MODE=wait: polls like a
primary waiting for rollouts, forever (until a peer dies).
"""

from __future__ import annotations

import json
import shutil
import sys
import time

import numpy as np


def trajectories(step: int, vocab: int, n: int = 8, group: int = 4):
    from satjax.trajectory import Trajectory

    rng = np.random.default_rng(step)
    out = []
    for i in range(n):
        p, r = int(rng.integers(3, 6)), int(rng.integers(3, 8))
        out.append(Trajectory(
            trajectory_id=f"s{step}t{i}", group_id=f"s{step}g{i // group}",
            prompt_id=f"s{step}p{i // group}",
            prompt_tokens=rng.integers(3, vocab, p).astype(np.int32),
            response_tokens=rng.integers(3, vocab, r).astype(np.int32),
            behavior_logprobs=(-rng.random(r) * 3).astype(np.float32),
            policy_version=0, reward=float(rng.random()), group_size=group))
    return out


def main() -> None:
    pid, nproc, port, out, mesh, mode = sys.argv[1:7]
    from satjax import parallel

    parallel.init_distributed(f"127.0.0.1:{port}", int(nproc), int(pid))
    import jax
    from flax import nnx
    from jax.experimental import multihost_utils

    from satjax.app.factory import build_model, build_tokenizer
    from satjax.app.multihost import Peers, Poll
    from satjax.config import load_config
    from satjax.train.trainer import Trainer

    d, f, e, t = (int(x) for x in mesh.split(","))
    cfg = load_config(None, [f"run_dir={out}/run", "train.buckets=[16]",
                             f"train.mesh={{data: {d}, fsdp: {f}, expert: {e}, tensor: {t}}}",
                             "checkpoint.every=3", "train.max_lag=100"])
    tok = build_tokenizer(cfg)
    trainer = Trainer(cfg, build_model(cfg, tok), tok, resume=mode == "restore")
    peers = Peers()

    def dump(tag: str) -> None:  # every process takes part in the gather
        params = nnx.state(trainer.train_state().model, nnx.Param)
        flat = multihost_utils.process_allgather(params, tiled=True) \
            if jax.process_count() > 1 else jax.device_get(params)
        if peers.primary:
            leaves = jax.tree_util.tree_flatten_with_path(flat)[0]
            np.savez(f"{out}/params-{tag}-{nproc}.npz",
                     **{jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves})

    if mode == "wait":
        print(f"process {pid}: waiting", flush=True)
        while True:
            peers.agree(Poll.EMPTY, None, stop=False)
            time.sleep(0.1)
    if mode in ("train", "publish"):
        trainer.publish()
        trainer.wait_published()
        tag = f"{nproc}-{mesh.replace(',', '')}"
        with open(f"{out}/files-{tag}-{pid}.json", "w") as fh:
            json.dump(trainer.publisher.last_files, fh)
        if peers.primary:
            shutil.copytree(trainer.dirs.version(0), f"{out}/v0-{tag}")
    if mode == "publish":
        peers.barrier("published")
        print(f"process {pid}: published", flush=True)
        return
    if mode == "train":
        dump("init")
        for step in range(3):
            # only the primary "reads the queue"; the others get its batch
            mine = trajectories(step, trainer.model_config.vocab_size) if peers.primary else None
            _, got, _ = peers.agree(Poll.BATCH if peers.primary else Poll.EMPTY, mine,
                                    stop=False)
            assert [t.trajectory_id for t in got] == [f"s{step}t{i}" for i in range(8)]
            trainer.train_on(got)
            trainer.publish()
        assert trainer.save()
        trainer.ckpt.wait()
    dump(mode)
    trainer.close()
    peers.barrier("done")
    print(f"process {pid}: {mode} done at step {trainer.step}", flush=True)


if __name__ == "__main__":
    main()
