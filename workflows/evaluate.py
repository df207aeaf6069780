"""Entry point for `ray job submit`: avg@k, best@k and maj@k of a model directory on a prompt set.

    ray job submit --working-dir . -- python workflows/evaluate.py --config workflows/configs/dapo_qwen2.5_32b.yaml \
        --model /models/ckpt --files /data/aime-2024.parquet --out /data/eval/ckpt-aime-2024.json

Against a running cluster it joins it (RAY_ADDRESS is set by the job); run directly, it starts a local one.
Give absolute paths: the job runs in its own working directory, and the report is written on the node
that runs the job's driver.
"""

import sys

from dapo_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", *sys.argv[1:]]))
