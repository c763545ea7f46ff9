#!/bin/bash
# satjax on a TPU VM slice (e.g. v5p-32: 4 hosts): the trainer runs on every host of the
# slice (`--distributed`: JAX finds the coordinator and process ids from the TPU
# metadata); the queue and the rollout workers run on a separate CPU/GPU VM ($QUEUE_VM).
# Not run here (no TPU): checked with `bash -n` and for satjax commands and flags that
# exist (tests/app/test_remote_worker.py). Needs RUN on a file system both the slice and
# $QUEUE_VM mount (Filestore NFS, or a bucket through gcsfuse: see docs/parallel.md).
set -euo pipefail

TPU=${TPU:?name of the TPU VM}
ZONE=${ZONE:?zone of the TPU VM}
QUEUE_VM=${QUEUE_VM:?name of the VM for the queue and the workers}
RUN=${RUN:-/mnt/shared/runs/tiny}
QUEUE=${QUEUE:?internal address of QUEUE_VM, host:port, e.g. 10.128.0.5:50051}
TOKEN=${SATJAX_QUEUE_TOKEN:-$(openssl rand -hex 24)}

# The queue and two workers on QUEUE_VM (the workers wait for the trainer's run_config.yaml).
gcloud compute ssh "$QUEUE_VM" --zone "$ZONE" --command "
  export SATJAX_QUEUE_TOKEN=$TOKEN
  nohup satjax serve-queue --host 0.0.0.0 --port ${QUEUE##*:} --insecure --data-dir $RUN/queue --vocab-size 55 --num-experts 8 --moe-layers 4 --top-k 2 --max-seq-len 4096 --group-size 8 --max-version 2147483647 --require-record routed_experts --require-record routed_gates > queue.log 2>&1 &
  for i in 0 1; do
    nohup satjax rollout --queue $QUEUE --weights $RUN/weights --worker-id \$i > worker\$i.log 2>&1 &
  done"

# The trainer on every host of the slice.
gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" --worker=all --command "
  export SATJAX_QUEUE_TOKEN=$TOKEN
  satjax train --distributed --no-progress --set run_dir=$RUN --set queue.address=$QUEUE --set rollout.num_workers=0 --set train.mesh.fsdp=4 --set train.mesh.expert=4"
