"""Rollout: the vLLM engine (`engine.py`), its Ray Serve deployment and weight store (`deployment.py`),
and the worker extension that loads new weights in place (`worker_ext.py`)."""
