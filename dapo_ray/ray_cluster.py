"""The Ray cluster a command runs on: the one named by `cluster.address` or RAY_ADDRESS (`ray job
submit`, KubeRay, Anyscale), else one of this machine alone that `dapo-ray` starts for itself and that
listens on loopback only. Every command (`train`, `demo`, `eval`, `prepare`) starts here."""

from __future__ import annotations

import os
from pathlib import Path

from dapo_ray import storage
from dapo_ray.config import Config
from dapo_ray.progress import QUIET_ENV, log, quiet_libraries, shown_at_a_quiet_console


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
    outer = set(os.environ)  # what this process was given (under `ray job submit`: the job's runtime_env too)
    env = {"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu" if not cfg.trainer.use_gpu else "cuda"),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    quiet = {}
    if not cfg.cluster.verbose:
        quiet_console()
        env |= {QUIET_ENV: "1", "TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        quiet = {"logging_level": logging.WARNING}  # Ray's own INFO lines ("Started a local Ray instance")
    if "TORCH_EXTENSIONS_DIR" in os.environ:
        env["TORCH_EXTENSIONS_DIR"] = os.environ["TORCH_EXTENSIONS_DIR"]
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS") or None
    if address:
        # Under `ray job submit` the job's runtime_env already reaches every worker, and Ray refuses a
        # driver runtime_env that repeats one of its variables: add only what is not set here yet.
        env = {k: v for k, v in env.items() if k not in outer}
        ctx = ray.init(address=address, runtime_env={"env_vars": env} if env else None, **quiet)
    else:
        ctx = start_local_ray(num_cpus=cfg.cluster.num_cpus, runtime_env={"env_vars": env}, **quiet)  # always our own
    if not cfg.cluster.verbose:
        filter_worker_output()
    log(dashboard_line(ctx.dashboard_url))
    if not cfg.cluster.verbose:
        log(f"quiet console: the libraries' own lines go to the logs of each process, under "
            f"{_logs_dir()} on each node (--verbose, or cluster.verbose=true, shows them here)")  # fmt: skip


def quiet_console() -> None:
    """This driver's part of a quiet console: the libraries' loggers (`progress.quiet_libraries`) and the
    raylet's warning events ("N PYTHON worker processes have been started ..."), which Ray prints at the
    driver at RAY_LOG_TO_DRIVER_EVENT_LEVEL (read at call time): errors only, unless the user set it."""
    from ray._private import ray_constants

    os.environ[QUIET_ENV] = "1"  # this process's own, and what deploy_rollout hands the replicas
    quiet_libraries()
    if "RAY_LOG_TO_DRIVER_EVENT_LEVEL" not in os.environ:
        ray_constants.RAY_LOG_TO_DRIVER_EVENT_LEVEL = "ERROR"


def filter_worker_output() -> None:
    """Print what the run's processes write at this console through `progress.shown_at_a_quiet_console`:
    dapo-ray's own lines and anything that says something went wrong. The rest (vLLM's and DeepSpeed's
    start-up lines, Ray Train's and the raylet's notices, progress bars) stays in each process's log."""
    from ray._private import worker as ray_worker
    from ray._private.ray_logging import global_worker_stdstream_dispatcher

    original = getattr(ray_worker.print_to_stdstream, "unfiltered", ray_worker.print_to_stdstream)

    def print_shown(data: dict, ignore_prefix: bool = False) -> None:
        lines = shown_at_a_quiet_console(data.get("lines") or [])
        if lines:
            original({**data, "lines": lines}, ignore_prefix=ignore_prefix)

    print_shown.unfiltered = original
    global_worker_stdstream_dispatcher.remove_handler("ray_print_logs")  # the processes' output
    global_worker_stdstream_dispatcher.add_handler("ray_print_logs", print_shown)
    # The raylet's messages to the driver ("N PYTHON worker processes have been started", a task killed for
    # memory) go through this function at call time (`listen_error_messages`)
    ray_worker.print_to_stdstream = print_shown


def _logs_dir() -> str:
    import ray

    try:
        return f"{ray._private.worker._global_node.get_session_dir_path()}/logs"
    except AttributeError:  # not this process's node (a client connection)
        return "Ray's session directory (/tmp/ray/session_latest/logs)"


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
