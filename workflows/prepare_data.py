"""Entry point for `ray job submit`: prompt files -> one de-duplicated, templated parquet and its report.

    ray job submit --working-dir . -- python workflows/prepare_data.py \
        --input /data/dapo-math-17k.parquet --output /data/dapo-17k-prepared.parquet

Against a running cluster it joins it (RAY_ADDRESS is set by the job); run directly, it starts a local one.
Give absolute paths (or s3://...): the job runs in its own working directory, on any node.
"""

import sys

from dapo_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["prepare", *sys.argv[1:]]))
