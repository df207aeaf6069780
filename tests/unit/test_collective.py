"""The trainer's collectives run on the engine's device (dapo_ray/trainer/collective.py).

What these tests catch on CPU: a torch.distributed (or deepspeed.comm) collective called anywhere in
dapo_ray/trainer/ other than through `collective` (source scan; the rollout's own collectives run on
vLLM's gloo CPU group, where CPU tensors are right); the helper's arithmetic, dtype and CPU result on
a real gloo group; and torch's refusal of a CPU tensor by a backend bound to CUDA alone, which is what a
plain "nccl" group is. What they cannot catch: that the tensor reaches a CUDA device under NCCL (on CPU the
engine's device is the CPU), nor collectives made inside DeepSpeed (its own tensors, on its device).
"""

import ast
from pathlib import Path

import pytest
import torch

from dapo_ray.trainer import collective

TRAINER = Path(__file__).resolve().parents[2] / "dapo_ray" / "trainer"
HELPER = TRAINER / "collective.py"
COMM_MODULES = ("torch.distributed", "deepspeed.comm")
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "all_reduce_coalesced", "all_gather_coalesced",
}  # fmt: skip


def collective_calls(source: str) -> list[str]:
    """`line: dotted.name` of every call of a torch.distributed / deepspeed.comm collective in `source`,
    whatever the import spelling (`import torch.distributed as dist`, `torch.distributed.barrier()`,
    `from torch.distributed import all_reduce`, `from deepspeed import comm`)."""
    tree = ast.parse(source)
    alias: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    alias[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        parts, f = [], node.func
        while isinstance(f, ast.Attribute):
            parts.append(f.attr)
            f = f.value
        if not isinstance(f, ast.Name):
            continue
        dotted = ".".join([alias.get(f.id, f.id), *reversed(parts)])
        module, _, name = dotted.rpartition(".")
        if module in COMM_MODULES and name in COLLECTIVES:
            found.append(f"{node.lineno}: {dotted}")
    return found


def test_the_scan_finds_every_spelling():
    # Among them the two calls and the barrier the trainer made on CPU tensors before the helper existed.
    src = """
import torch
import torch.distributed as dist
from torch.distributed import all_reduce as ar
from torch import distributed
from deepspeed import comm

def f(t):
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    torch.distributed.barrier()
    ar(t)
    distributed.broadcast(t, 0)
    comm.all_gather_into_tensor(t, t)
    dist.get_rank(); dist.is_initialized(); t.all_reduce()
"""
    assert [c.split(": ")[1] for c in collective_calls(src)] == [
        "torch.distributed.all_reduce", "torch.distributed.barrier", "torch.distributed.all_reduce",
        "torch.distributed.broadcast", "deepspeed.comm.all_gather_into_tensor",
    ]  # fmt: skip


def test_no_collective_outside_the_helper():
    offenders = {
        str(p.relative_to(TRAINER.parent)): calls
        for p in sorted(TRAINER.rglob("*.py"))
        if p != HELPER and (calls := collective_calls(p.read_text()))
    }
    assert offenders == {}, "call torch.distributed through dapo_ray.trainer.collective (on the engine's device)"
    assert collective_calls(HELPER.read_text())  # the helper itself is what the scan would see


def test_all_reduce_on_a_real_group(gloo_group):
    values = torch.tensor([1.5, -2.0, 3.0], dtype=torch.float64)
    summed = collective.all_reduce(values, torch.device("cpu"))
    assert summed.device.type == "cpu" and summed.dtype == torch.float64
    assert torch.equal(summed, values)  # one rank: the sum is the values
    assert summed is not values and summed.data_ptr() != values.data_ptr()  # a new tensor; the input kept
    peak = collective.all_reduce(torch.tensor([0.0, 1.0]), "cpu", op="max")
    assert peak.tolist() == [0.0, 1.0]
    collective.barrier("cpu")


def test_a_backend_bound_to_cuda_alone_refuses_cpu_tensors(gloo_group):
    """torch binds a plain "nccl" backend to CUDA tensors only; a gloo backend bound to "cuda" alone is the
    same binding on a machine without NCCL, and a CPU tensor fails as it would under NCCL."""
    import torch.distributed as dist

    cuda_only = dist.new_group(backend="cuda:gloo")
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        dist.all_reduce(torch.ones(1), group=cuda_only)
    from torch.distributed.distributed_c10d import Backend

    assert Backend.backend_capability[Backend.NCCL] == ["cuda"]
