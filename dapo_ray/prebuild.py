"""Compile DeepSpeed's CPU ops once into TORCH_EXTENSIONS_DIR so later runs load them in seconds.

`shm_comm` is built on first use of DeepSpeed's CPU communication backend (~105 s on 2 cores).
We do not build `fused_adam`: the trainer passes a torch optimizer, which never needs it.
"""

import os
import time


def main() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if accel.device_name() != "cpu":
        print(f"[prebuild] accelerator is {accel.device_name()}; nothing to pre-build")
        return
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    t0 = time.time()
    ShareMemCommBuilder().load(verbose=False)
    print(f"[prebuild] shm_comm ready in {time.time() - t0:.1f}s ({os.environ.get('TORCH_EXTENSIONS_DIR')})")


if __name__ == "__main__":
    main()
