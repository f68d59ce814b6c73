"""Ray job entry point for training: the same as `raydl train ARGS` on the cluster the job runs on.

    ray job submit --address http://HEAD:8265 --working-dir . -- python jobs/train.py --config jobs/configs/gpt-tiny.yaml
    raydl submit --address http://HEAD:8265 -- train --config jobs/configs/gpt-tiny.yaml     # the same, plus auth

Inside a job, `--address auto` is added so the run uses the job's cluster instead of starting a local Ray.
The run directory (run.runs_dir, default runs/) is relative to the job's unpacked working dir on the head:
on a real cluster set checkpoint.storage_path (and run.runs_dir) to shared storage (s3://, gs://, NFS).
"""

import sys

from _entry import main

if __name__ == "__main__":
    sys.exit(main("train", sys.argv[1:]))
