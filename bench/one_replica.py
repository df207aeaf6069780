"""The set-up the rollout benchmarks share: the config's tiny model, a local Ray cluster, the prompts and
one Serve rollout app with its weight store (`python bench/rollout_round.py`, `python bench/occupancy.py`)."""

from __future__ import annotations


def start(config: str, store_name: str):
    """(config with absolute paths, tokenized train prompts, the deployment's handle, the weight store: keep
    it referenced while the replica reads it)."""
    from ray import serve
    from transformers import AutoTokenizer

    from dapo_ray.config import load_config
    from dapo_ray.driver import prepare_prompts
    from dapo_ray.ray_cluster import absolute_paths, init_ray
    from dapo_ray.rollout.deployment import APP_NAME, deploy_rollout
    from dapo_ray.tiny_model import build_for
    from dapo_ray.weights import create_store

    cfg = load_config(config)
    build_for(cfg)
    cfg = absolute_paths(cfg)
    init_ray(cfg)
    rows, _ = prepare_prompts(cfg, AutoTokenizer.from_pretrained(cfg.rollout.model_path))
    store = create_store(store_name)
    deploy_rollout(cfg.rollout, cfg.max_model_len, store_name, seed=1)
    return cfg, rows, serve.get_deployment_handle("rollout", app_name=APP_NAME), store
