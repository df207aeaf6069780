"""The Ray cluster a command runs on: the one named by `cluster.address` or RAY_ADDRESS (`ray job
submit`, KubeRay, Anyscale), else one of this machine alone that `dapo-ray` starts for itself and that
listens on loopback only. Every command (`train`, `demo`, `eval`, `prepare`) starts here."""

from __future__ import annotations

import os
from pathlib import Path

from dapo_ray import storage
from dapo_ray.config import Config
from dapo_ray.progress import log


def init_ray(cfg: Config) -> None:
    """Join the configured cluster or start a local one (nothing when this process already has one), with
    the environment every worker needs; prints where the dashboard is."""
    import logging

    import ray
    from ray.data import DataContext

    data_ctx = DataContext.get_current()
    data_ctx.enable_progress_bars = False
    data_ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    if ray.is_initialized():
        return
    env = {"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu" if not cfg.trainer.use_gpu else "cuda"),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    if "TORCH_EXTENSIONS_DIR" in os.environ:
        env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS") or None
    if address:
        # Under `ray job submit` the job's runtime_env already reaches every worker, and Ray refuses a
        # driver runtime_env that repeats one of its variables: add only what is not set here yet.
        env = {k: v for k, v in env.items() if k not in os.environ}
        ctx = ray.init(address=address, runtime_env={"env_vars": env} if env else None)
    else:
        ctx = start_local_ray(num_cpus=cfg.cluster.num_cpus, runtime_env={"env_vars": env})  # always our own
    log(dashboard_line(ctx.dashboard_url))


def start_local_ray(**kwargs):
    """Start a Ray cluster of this machine alone that listens on loopback only: GCS, dashboard, metrics.
    Returns `ray.init`'s context.

    Ray binds them to the node's IP, so on every interface of a laptop or a shared host, and `ray.init`
    replaces a loopback node IP by the machine's address unless Ray's multi-node switch is off (its
    default on macOS and Windows): it is turned off for this call."""
    import ray
    from ray._private import ray_constants

    multi_node = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        return ray.init(address="local", _node_ip_address="127.0.0.1", dashboard_host="127.0.0.1", **kwargs)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = multi_node


def dashboard_line(dashboard_url: str | None) -> str:
    """Where the Ray dashboard is, and how to sign in to it. Ray turns token authentication on for a
    cluster that `ray.init` starts (and for `ray start` where ~/.ray/auth_token exists), unless
    RAY_AUTH_MODE says otherwise; `ray.init` then sets RAY_AUTH_MODE=token in this process."""
    if not dashboard_url:
        return "Ray dashboard: not running (include_dashboard is off)"
    url = dashboard_url if "://" in dashboard_url else f"http://{dashboard_url}"
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        return (f"Ray dashboard: {url} (token authentication is on: paste the token that `ray get-auth-token` "
                f"prints when the page asks; `ray job submit` and other CLI calls need RAY_AUTH_MODE=token)")  # fmt: skip
    return f"Ray dashboard: {url}"


def absolute_paths(cfg: Config) -> Config:
    """The config with its local paths made absolute: Ray workers and replicas do not share the driver's
    working directory. Raises when rollout.model_path is not a local HF model directory."""
    from dataclasses import replace

    model = Path(cfg.rollout.model_path)
    if not (model / "config.json").exists():
        raise FileNotFoundError(f"rollout.model_path={cfg.rollout.model_path!r} is not a local HF model directory "
                                "(no config.json); models are loaded from paths, never downloaded")  # fmt: skip
    return replace(
        cfg,
        rollout=replace(cfg.rollout, model_path=str(model.resolve())),
        trainer=replace(cfg.trainer, output_dir=storage.resolve(cfg.trainer.output_dir)),
        data=replace(cfg.data, train_files=tuple(str(Path(f).resolve()) for f in cfg.data.train_files)),
        eval=replace(cfg.eval, files=tuple(str(Path(f).resolve()) for f in cfg.eval.files)),
    )
