"""Ray job entry point for sweeps: the same as `raydl sweep ARGS` on the cluster the job runs on.

    ray job submit --address http://HEAD:8265 --working-dir . -- python jobs/sweep.py --config my-sweep.yaml
    raydl submit --address http://HEAD:8265 -- sweep --config my-sweep.yaml
"""

import sys

from _entry import main

if __name__ == "__main__":
    sys.exit(main("sweep", sys.argv[1:]))
