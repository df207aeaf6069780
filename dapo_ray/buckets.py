"""A weight publish's buckets, apart from how they travel (`dapo_ray.weights`): which layers go together
(`bucket_plan`), tensors copied into a bucket's host buffer at aligned offsets (`copy_into`), and read
back as views of it (`unpack_bucket`). Nothing here needs Ray.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int = 0  # byte offset in its bucket's buffer (`copy_into`)


def bucket_plan(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive groups (layers; `sizes` in bytes) in buckets of at most `bucket_bytes`, a larger group
    alone in its own; returns each bucket's group indices.

    >>> bucket_plan([4, 4, 4, 10, 1, 1], 8)
    [[0, 1], [2], [3], [4, 5]]
    """
    plan: list[list[int]] = []
    filled = bucket_bytes  # so the first group opens a bucket
    for i, size in enumerate(sizes):
        if filled + size > bucket_bytes:
            plan.append([])
            filled = 0
        plan[-1].append(i)
        filled += size
    return plan


ALIGN = 64
"""Byte alignment of each tensor in a bucket's buffer."""


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to ALIGN: the room a tensor of that size takes in a bucket."""
    return -(-nbytes // ALIGN) * ALIGN


def spec_nbytes(spec: TensorSpec) -> int:
    """Bytes of the tensor a spec describes."""
    n = 1
    for d in spec.shape:
        n *= d
    return n * torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()


def copy_into(buf: torch.Tensor, offset: int, name: str, tensor: torch.Tensor) -> tuple[TensorSpec, int]:
    """Copy `tensor` (any device) into the host buffer at `offset` (asynchronously from a GPU into pinned
    memory: synchronize before the buffer is read); returns its spec and the next offset, aligned to 64."""
    t = tensor.detach()
    n = t.numel() * t.element_size()
    if n:
        buf[offset : offset + n].view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
    spec = TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset)
    return spec, offset + aligned(n)


def unpack_bucket(payload: tuple[list[TensorSpec], np.ndarray | list[np.ndarray]]) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views of a bucket (no copy; read-only when it came from `ray.get`): one uint8 buffer
    holding every tensor at its spec's offset (`copy_into`), or one uint8 array per tensor."""
    specs, data = payload
    with warnings.catch_warnings():  # the object store's buffers are read-only; the loader only reads
        warnings.simplefilter("ignore", UserWarning)
        if isinstance(data, list):
            parts = [torch.from_numpy(a) for a in data]
        else:
            whole = torch.from_numpy(data)
            parts = [whole[sp.offset : sp.offset + spec_nbytes(sp)] for sp in specs]
        return [(sp.name, part.view(getattr(torch, sp.dtype)).view(sp.shape)) for sp, part in zip(specs, parts, strict=True)]
