"""Runs inside each vLLM worker (named by `worker_extension_cls`): loads new weights in place.

The replica passes the object reference of a published version (see `dapo_ray.weights`), and each
worker reads the buffer from its node's object store: the worker is the replica process itself (the
in-process engine) or, with tensor parallelism, a Ray actor of vLLM's Ray executor. `model.load_weights`
fails on the CPU backend after start-up (weights are repacked for oneDNN); the worker's `reload_weights`
handles that and the GPU backend alike.
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
    def dapo_load_weights(self, ref_box: list) -> int:
        """Load every tensor of the published version `ref_box[0]`; returns how many were loaded."""
        from dapo_ray.weights import fetch

        quiet_rotary_reload_warning()
        tensors = fetch(ref_box)
        self.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
        return len(tensors)
