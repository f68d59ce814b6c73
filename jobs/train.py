"""Ray job entry point for training: the same as `raydl train ARGS` on the cluster the job runs on.

    ray job submit --address http://HEAD:8265 --working-dir . -- python jobs/train.py --config jobs/configs/gpt-tiny.yaml
    raydl submit --address http://HEAD:8265 -- train --config jobs/configs/gpt-tiny.yaml     # the same, plus auth

Inside a job, `--address auto` is added so the run uses the job's cluster instead of starting a local Ray.

Paths: relative ones (run.runs_dir=runs, data.cache_dir=.raydl_data) resolve inside the job's unpacked
working dir on the head. That is fine on a single node. With workers on other nodes, every path the workers
read or write must be shared storage: checkpoint.storage_path (s3://, gs://, NFS), data.path (or
data.cache_dir for the built-in data, on NFS), and run.runs_dir for the metrics. Otherwise workers on other
nodes fail with "data.path ... does not exist" (seen with the local fake multi-node cluster, where each
node's runtime-env agent re-extracts the working dir and wipes what the driver wrote there).
"""

import sys

from _entry import main

if __name__ == "__main__":
    sys.exit(main("train", sys.argv[1:]))
