"""A cluster description's worker groups, read from the files a user deploys (KubeRay's RayCluster or
RayJob, Anyscale's compute config), and their laptop-sized version as node types of Ray's autoscaler.

What a group keeps in the rehearsal: its custom resources (`rollout`, `trainer`: what the config's
`rollout.resources` / `trainer.resources` ask for), its autoscaling range (capped so a laptop holds it)
and its idle timeout (scaled down). What it loses: GPUs (the rehearsal runs `rollout.device: cpu` and a
CPU trainer, so each node gets a few CPU slots instead) and memory sizes."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

KUBERAY_DEFAULT_IDLE_S = 60.0  # KubeRay's autoscalerOptions.idleTimeoutSeconds when unset
ANYSCALE_DEFAULT_IDLE_S = 300.0  # Anyscale removes idle workers after ~5 min unless configured


@dataclass(frozen=True)
class Group:
    """One worker group: every node of it alike."""

    name: str
    resources: dict[str, float]
    """Per node, as declared: CPU, GPU and custom resources."""
    min_nodes: int
    max_nodes: int
    idle_timeout_s: float

    @property
    def custom(self) -> dict[str, float]:
        """The custom resources only (what rollout.resources / trainer.resources match)."""
        return {
            k: v
            for k, v in self.resources.items()
            if k not in ("CPU", "GPU", "memory", "object_store_memory")
        }

    @property
    def autoscaled(self) -> bool:
        return self.min_nodes < self.max_nodes


@dataclass(frozen=True)
class ClusterDescription:
    kind: str  # "RayCluster", "RayJob" or "Anyscale compute config"
    head_resources: dict[str, float]
    groups: tuple[Group, ...]


def read(path: str | Path) -> ClusterDescription:
    """The worker groups of a KubeRay RayCluster or RayJob manifest, or of an Anyscale compute config."""
    doc = yaml.safe_load(Path(path).read_text())
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a cluster description (a YAML mapping)")
    if doc.get("kind") == "RayCluster":
        return _kuberay("RayCluster", doc.get("spec") or {}, path)
    if doc.get("kind") == "RayJob":
        return _kuberay("RayJob", (doc.get("spec") or {}).get("rayClusterSpec") or {}, path)
    if "worker_nodes" in doc or "head_node" in doc:
        return _anyscale(doc)
    raise ValueError(f"{path}: neither a KubeRay RayCluster/RayJob (kind: ...) nor an Anyscale compute config "
                     "(head_node, worker_nodes)")  # fmt: skip


def _kuberay(kind: str, spec: dict[str, Any], path: str | Path) -> ClusterDescription:
    default_idle = float(
        (spec.get("autoscalerOptions") or {}).get("idleTimeoutSeconds", KUBERAY_DEFAULT_IDLE_S)
    )
    head = _pod_resources(spec.get("headGroupSpec") or {})
    groups = []
    for g in spec.get("workerGroupSpecs") or []:
        lo = int(g.get("minReplicas", g.get("replicas", 0)))
        groups.append(Group(name=g["groupName"], resources=_pod_resources(g), min_nodes=lo,
                            max_nodes=int(g.get("maxReplicas", lo)),
                            idle_timeout_s=float(g.get("idleTimeoutSeconds", default_idle))))  # fmt: skip
    if not groups:
        raise ValueError(f"{path}: the {kind} has no workerGroupSpecs")
    return ClusterDescription(kind, head, tuple(groups))


def _pod_resources(group: dict[str, Any]) -> dict[str, float]:
    """A KubeRay group's logical Ray resources per pod: rayStartParams first (num-cpus, num-gpus,
    resources), else the container's limits, as the operator derives them."""
    params = group.get("rayStartParams") or {}
    containers = (((group.get("template") or {}).get("spec") or {}).get("containers")) or [{}]
    limits = (containers[0].get("resources") or {}).get("limits") or {}
    out: dict[str, float] = {}
    cpu = params.get("num-cpus", limits.get("cpu"))
    if cpu is not None:
        out["CPU"] = _quantity(cpu)
    gpu = params.get("num-gpus", limits.get("nvidia.com/gpu"))
    if gpu is not None:
        out["GPU"] = _quantity(gpu)
    custom = params.get("resources")
    if custom:
        # rayStartParams values are strings; `resources` is JSON, itself often quoted once more for the shell
        value = json.loads(custom) if isinstance(custom, str) else custom
        value = json.loads(value) if isinstance(value, str) else value
        out.update({k: float(v) for k, v in value.items()})
    return out


def _quantity(value: Any) -> float:
    """A Kubernetes CPU quantity ("16", "500m") or a number."""
    text = str(value).strip().strip('"')
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _anyscale(doc: dict[str, Any]) -> ClusterDescription:
    head = {k: float(v) for k, v in ((doc.get("head_node") or {}).get("resources") or {}).items()}
    idle_min = doc.get("idle_termination_minutes")
    idle_s = float(idle_min) * 60 if idle_min is not None else ANYSCALE_DEFAULT_IDLE_S
    groups = tuple(
        Group(name=w.get("name") or w["instance_type"], resources={k: float(v) for k, v in (w.get("resources") or {}).items()},
              min_nodes=int(w.get("min_nodes", 0)), max_nodes=int(w.get("max_nodes", w.get("min_nodes", 0))),
              idle_timeout_s=idle_s)
        for w in doc.get("worker_nodes") or [])  # fmt: skip
    if not groups:
        raise ValueError("the compute config has no worker_nodes")
    return ClusterDescription("Anyscale compute config", head, groups)


def laptop(
    desc: ClusterDescription, max_nodes: int, idle_timeout_s: float, cpus_per_node: int
) -> ClusterDescription:
    """The cluster a laptop holds: an autoscaled group keeps its minimum (capped) and at most `max_nodes`;
    a fixed-size group gets one node (its size does not move under the autoscaler, and one node shows
    its work placed); each node has `cpus_per_node` CPU slots and no GPU; idle timeouts are at most
    `idle_timeout_s`.

    >>> g = Group("rollout", {"CPU": 80.0, "GPU": 4.0, "rollout": 1.0}, 0, 8, 180.0)
    >>> laptop(ClusterDescription("RayCluster", {"CPU": 0.0}, (g,)), 2, 10, 2).groups[0]
    Group(name='rollout', resources={'CPU': 2.0, 'rollout': 1.0}, min_nodes=0, max_nodes=2, idle_timeout_s=10)
    """
    groups = []
    for g in desc.groups:
        hi = min(g.max_nodes, max_nodes) if g.autoscaled else min(g.max_nodes, 1)
        groups.append(replace(g, resources={"CPU": float(cpus_per_node), **g.custom}, min_nodes=min(g.min_nodes, hi),
                              max_nodes=hi, idle_timeout_s=min(g.idle_timeout_s, idle_timeout_s)))  # fmt: skip
    return replace(desc, head_resources={"CPU": 0.0}, groups=tuple(groups))


def describe(full: ClusterDescription, small: ClusterDescription) -> list[str]:
    """One line per group: the cluster's and the rehearsal's.

    >>> g = Group("trainer", {"CPU": 160.0, "GPU": 8.0, "trainer": 8.0}, 8, 8, 300.0)
    >>> print(describe(ClusterDescription("RayCluster", {}, (g,)), laptop(ClusterDescription("RayCluster", {}, (g,)), 2, 10, 2))[0])
    trainer: 8..8 nodes of {CPU: 160, GPU: 8, trainer: 8}, idle 300s -> 1..1 nodes of {CPU: 2, trainer: 8}, idle 10s
    """
    return [f"{g.name}: {g.min_nodes}..{g.max_nodes} nodes of {resources_text(g.resources)}, idle {g.idle_timeout_s:g}s -> "
            f"{s.min_nodes}..{s.max_nodes} nodes of {resources_text(s.resources)}, idle {s.idle_timeout_s:g}s"
            for g, s in zip(full.groups, small.groups, strict=True)]  # fmt: skip


def resources_text(resources: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in resources.items()) + "}"


def autoscaler_config(desc: ClusterDescription, provider: dict[str, Any]) -> dict[str, Any]:
    """Ray's cluster config (the `ray up` YAML schema) of the laptop cluster: one node type per group plus
    the head's, for the autoscaler that `ray start --head --autoscaling-config` runs."""
    types: dict[str, Any] = {
        "ray.head.default": {"resources": dict(desc.head_resources), "node_config": {}, "max_workers": 0},
    }
    for g in desc.groups:
        types[g.name] = {"resources": {k: v for k, v in g.resources.items()}, "node_config": {},
                         "min_workers": g.min_nodes, "max_workers": g.max_nodes, "idle_timeout_s": g.idle_timeout_s}  # fmt: skip
    return {
        "cluster_name": "dapo-ray-rehearsal",
        "max_workers": sum(g.max_nodes for g in desc.groups),
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": max(g.idle_timeout_s for g in desc.groups) / 60,
        "provider": provider,
        "available_node_types": types,
        "head_node_type": "ray.head.default",
        "auth": {},
        "docker": {},
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
        "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [],
    }  # fmt: skip
