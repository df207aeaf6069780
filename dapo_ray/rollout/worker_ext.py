"""Runs inside each vLLM worker (named by `worker_extension_cls`): loads new weights in place.

The replica passes the object reference of a published version (see `dapo_ray.weights`), and each
worker reads the buffer from its node's object store: the worker is the replica process itself (the
in-process engine) or, with tensor parallelism, a Ray actor of vLLM's Ray executor. `model.load_weights`
fails on the CPU backend after start-up (weights are repacked for oneDNN); the worker's `reload_weights`
handles that and the GPU backend alike.
"""

from __future__ import annotations


class WeightLoader:
    def dapo_load_weights(self, ref_box: list) -> int:
        """Load every tensor of the published version `ref_box[0]`; returns how many were loaded."""
        from dapo_ray.weights import fetch

        tensors = fetch(ref_box)
        self.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
        return len(tensors)
