"""Runs inside each vLLM worker (named by `worker_extension_cls`): loads new weights in place.

vLLM passes `collective_rpc` arguments by value and tensors do not survive it, so the trainer writes a
safetensors file (on /dev/shm where there is one) and sends its path. `model.load_weights` fails on the
CPU backend after start-up (weights are repacked for oneDNN); the worker's `reload_weights` handles
that and the GPU backend alike.
"""

from __future__ import annotations


class WeightLoader:
    def dapo_load_weights(self, path: str) -> int:
        """Load every tensor of the safetensors file at `path`; returns how many were loaded."""
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
            tensors = [(name, f.get_tensor(name)) for name in names]
        self.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
        return len(tensors)
