"""The trainer's own collectives (sums and maxima of its statistics, a barrier), all on the engine's device.

Why: with `use_gpu` Ray Train creates the default process group with the `nccl` backend alone (ray 2.60
`train/torch/config.py`, `_TorchBackend.on_start`: GPUs per worker > 0 -> "nccl"), DeepSpeed reuses that
group, and torch binds a plain "nccl" backend to CUDA tensors only (torch 2.13
`distributed/distributed_c10d.py`, `Backend.backend_capability[NCCL] == ["cuda"]`): a collective on a CPU
tensor fails with "No backend type associated with device type cpu". On CPU workers (gloo) the device is
the CPU and nothing moves.

Every collective the trainer itself makes goes through here (a test scans `dapo_ray/trainer/` for others);
DeepSpeed's own collectives take its tensors, which live on the device already.
"""

from __future__ import annotations

from typing import Literal

import torch


def all_reduce(values: torch.Tensor, device: torch.device | str, op: Literal["sum", "max"] = "sum") -> torch.Tensor:  # fmt: skip
    """`values` reduced over all ranks (every rank must call it), computed on `device` (the engine's) and
    returned as a new CPU tensor of the same dtype and shape; `values` itself is left as it was.
    Example: rank 0 passes [1., 2.], rank 1 [3., 4.]; both get [4., 6.] (op "sum") or [3., 4.] ("max")."""
    import torch.distributed as dist

    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    on_device = values.to(device, copy=True)
    dist.all_reduce(on_device, op=reduce_op)
    return on_device.cpu()


def barrier(device: torch.device | str) -> None:
    """Wait until every rank gets here. A one-element all-reduce on `device` rather than `dist.barrier()`,
    which under NCCL has to guess each rank's GPU (torch warns when it does)."""
    all_reduce(torch.zeros(1), device)
