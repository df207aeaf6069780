"""Entry point for `ray job submit`:

    ray job submit --working-dir . -- python workflows/train.py --config workflows/configs/tiny_cpu.yaml k=v ...

Against a running cluster it joins it (RAY_ADDRESS is set by the job); run directly, it starts a local one.
"""

import sys

from dapo_ray.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
