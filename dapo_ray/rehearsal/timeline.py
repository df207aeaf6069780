"""What the rehearsal watches while the run goes: per group the nodes up, idle and pending (Ray's
autoscaler v2 status), what waits for a node (its pending resource demands), Serve's rollout replicas
and the newest published policy version. A line is printed whenever any of it changes; every sample is
kept for the figures (seconds from a demand to a node, to a serving replica; from Serve's downscale to
the node's removal) and the verdict on the run's ledger."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field

from dapo_ray.progress import log

HEAD_TYPE = "ray.head.default"


@dataclass
class Sample:
    t: float  # seconds since the rehearsal's cluster started
    nodes: dict[str, dict[str, int]]  # group -> {"up": n, "idle": n, "pending": n}
    waiting: list[str]  # pending resource demands, e.g. "{CPU: 1, rollout: 1} x1"
    replicas: dict[str, int]  # Serve's rollout replicas by state (RUNNING, STARTING, ...)
    version: int  # newest policy version the trainer published (-1: none yet)
    head_used: dict[str, float] = field(default_factory=dict)  # resources in use on the head node

    def line(self) -> str:
        nodes = " | ".join(f"{g} {n['up']} up" + (f" ({n['idle']} idle)" if n["idle"] else "")
                           + (f" +{n['pending']} pending" if n["pending"] else "") for g, n in self.nodes.items())  # fmt: skip
        reps = ", ".join(f"{v} {k.lower()}" for k, v in sorted(self.replicas.items())) or "none"
        wait = f" | waiting for a node: {'; '.join(self.waiting)}" if self.waiting else ""
        ver = f" | policy v{self.version}" if self.version >= 0 else ""
        return f"[rehearsal +{self.t:.0f}s] {nodes} | replicas: {reps}{wait}{ver}"

    def key(self) -> tuple:
        return (
            json.dumps(self.nodes, sort_keys=True),
            tuple(self.waiting),
            json.dumps(self.replicas, sort_keys=True),
        )


def _bundle(b: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(b.items())) + "}"


def sample(gcs_address: str, group_names: list[str], store_name: str, t0: float) -> Sample:
    """One look at the autoscaler, Serve and the weight store."""
    import ray
    from ray import serve
    from ray.autoscaler.v2.sdk import get_cluster_status

    from dapo_ray.rollout.deployment import APP_NAME
    from dapo_ray.weights import NAMESPACE

    st = get_cluster_status(gcs_address)
    nodes = {g: {"up": 0, "idle": 0, "pending": 0} for g in group_names}
    head_used: dict[str, float] = {}
    for n in st.active_nodes + st.idle_nodes:
        if n.ray_node_type_name == HEAD_TYPE:
            usage = n.resource_usage.usage if n.resource_usage else []
            head_used = {u.resource_name: u.used for u in usage if u.used > 0 and not u.resource_name.startswith(("node:", "object_store"))}  # fmt: skip
        elif n.ray_node_type_name in nodes:
            nodes[n.ray_node_type_name]["up"] += 1
            nodes[n.ray_node_type_name]["idle"] += n in st.idle_nodes
    for n in st.pending_nodes:
        if n.ray_node_type_name in nodes:
            nodes[n.ray_node_type_name]["pending"] += 1
    for req in st.pending_launches:
        if req.ray_node_type_name in nodes:
            nodes[req.ray_node_type_name]["pending"] += req.count
    waiting = [f"{_bundle(b.bundle)} x{b.count}" for d in st.resource_demands.ray_task_actor_demand + st.resource_demands.placement_group_demand
               for b in d.bundles_by_count]  # fmt: skip
    replicas: dict[str, int] = {}
    try:
        app = serve.status().applications.get(APP_NAME)
        if app is not None and "rollout" in app.deployments:
            replicas = {str(k): int(v) for k, v in app.deployments["rollout"].replica_states.items() if v}
    except Exception:  # noqa: BLE001 - Serve not started yet, or shutting down: no replicas to show
        pass
    version = -1
    try:
        store = ray.get_actor(store_name, namespace=NAMESPACE)
        version = int(ray.get(store.latest.remote(), timeout=5)[0])
    except Exception:  # noqa: BLE001 - before the run created its store, or after it ended
        pass
    return Sample(round(time.time() - t0, 1), nodes, waiting, replicas, version, head_used)


class Watcher:
    """Samples every `every_s` in a thread; prints a line on each change; runs `losses` (group, version):
    kills one node of `group` once policy version `version` is published, i.e. in the next step's round."""

    def __init__(
        self,
        head,
        group_names: list[str],
        store_name: str,
        losses: list[tuple[str, int]],
        every_s: float = 1.0,
    ):
        self.head, self.group_names, self.store_name = head, group_names, store_name
        self.losses, self.every_s = list(losses), every_s
        self.samples: list[Sample] = []
        self.events: list[dict] = []  # {"t": s, "event": text}
        self.t0 = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rehearsal-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def event(self, text: str) -> None:
        self.events.append({"t": round(time.time() - self.t0, 1), "event": text})
        log(f"[rehearsal +{self.events[-1]['t']:.0f}s] {text}")

    def latest(self) -> Sample | None:
        return self.samples[-1] if self.samples else None

    def _run(self) -> None:
        last_key, last_print = None, 0.0
        while not self._stop.is_set():
            try:
                s = sample(self.head.address, self.group_names, self.store_name, self.t0)
            except Exception as e:  # noqa: BLE001 - the GCS busy for a moment: try again next tick
                s = None
                if time.time() - last_print > 30:
                    log(f"[rehearsal] status unavailable: {e}")
                    last_print = time.time()
            if s is not None:
                self.samples.append(s)
                if s.key() != last_key or time.time() - last_print > 60:
                    log(s.line())
                    last_key, last_print = s.key(), time.time()
                for group, version in self.losses[:]:
                    if s.version >= version and s.nodes.get(group, {}).get("up"):
                        self.losses.remove((group, version))
                        nid = self.head.lose(group)
                        self.event(f"lost a {group} node ({nid and nid[-5:]}): every process of it killed at once, "
                                   f"policy v{s.version} published, the next round under way")  # fmt: skip
            self._stop.wait(self.every_s)

    def report(self) -> dict:
        return {"samples": [asdict(s) for s in self.samples], "events": self.events}


def figures(samples: list[Sample], group: str, resource: str, lost_at: tuple[float, ...] = ()) -> dict[str, list[float]]:
    """From the samples: seconds from work waiting for a `group` node (a pending demand naming `resource`, or
    a launch) to the node up, and to one more Serve replica running; seconds from Serve's replicas falling
    to the node's removal (not counted when a node was killed on purpose in between, at a time in `lost_at`).

    >>> S = lambda t, up, pend, run, wait=(): Sample(t, {"rollout": {"up": up, "idle": 0, "pending": pend}}, list(wait), {"RUNNING": run}, 0)
    >>> figures([S(0, 0, 0, 0, ["{CPU: 1, rollout: 1} x1"]), S(1, 0, 1, 0), S(6, 1, 1, 0), S(8, 1, 0, 0),
    ...          S(30, 1, 0, 1), S(70, 1, 1, 1), S(75, 2, 0, 1), S(90, 2, 0, 2), S(100, 2, 0, 0), S(112, 0, 0, 0)],
    ...         "rollout", "rollout")
    {'demand_to_node_s': [6.0, 5.0], 'demand_to_serving_s': [30.0, 20.0], 'downscale_to_removal_s': [12.0]}
    """
    out: dict[str, list[float]] = {
        "demand_to_node_s": [],
        "demand_to_serving_s": [],
        "downscale_to_removal_s": [],
    }
    asking_since = None  # since when work has waited for a node of the group
    came_up: list[float] = []  # for each node up whose replica is not serving yet: when its wait began
    down_at = None  # when Serve's running replicas last fell, until a node goes
    prev = None
    for s in samples:
        n = s.nodes.get(group, {"up": 0, "pending": 0, "idle": 0})
        running = s.replicas.get("RUNNING", 0)
        if prev is not None:
            pn = prev.nodes.get(group, {"up": 0, "pending": 0, "idle": 0})
            p_running = prev.replicas.get("RUNNING", 0)
            if n["up"] > pn["up"]:
                start = asking_since if asking_since is not None else prev.t
                out["demand_to_node_s"].append(round(float(s.t - start), 1))
                came_up.append(start)
                asking_since = None
            if running > p_running and came_up:
                out["demand_to_serving_s"].append(round(float(s.t - came_up.pop(0)), 1))
            if running < p_running and down_at is None:
                down_at = s.t
            if n["up"] < pn["up"] and down_at is not None:
                if not any(down_at - 5 <= t <= s.t for t in lost_at):
                    out["downscale_to_removal_s"].append(round(float(s.t - down_at), 1))
                down_at = None
        # Work waits for a node while one is pending or a demand names the group's resource (the
        # autoscaler's count of pending nodes lags a sample behind a node coming up: a wait ends there).
        if n["pending"] > 0 or any(f"{resource}:" in w for w in s.waiting):
            asking_since = s.t if asking_since is None else asking_since
        else:
            asking_since = None
        prev = s
    return out


def verdict(summary: dict, total_steps: int, max_policy_lag: int) -> list[tuple[bool, str]]:
    """The run's books, as (ok, line): every step done, no prompt lost or trained twice among the steps that
    count (a step trained again after a trainer restart counts once, its last time), every group sampled by a
    version its step allows, every replica on the step's weights."""
    log_ = summary["steps_log"]
    counted = list({e["step"]: e for e in log_}.values())  # the last entry of each step
    again = sum(r["failed_at_step"] - 1 - r["resumed_step"] for r in summary["restarts"])
    trained = [d for e in counted for d in e["draws"]["trained"]]
    last = log_[-1]["metrics"] if log_ else {}
    parts = ("trained", "filtered", "stale_dropped", "surplus_dropped", "carried", "in_flight")
    taken = last.get("ledger/taken", 0)
    accounted = sum(last.get(f"ledger/{k}", 0) for k in parts)
    # Every group trained was sampled within the lag bound (the driver's own measure over the trained batch),
    # and nothing generated came from a version newer than the step's (an abandoned one, after a restart).
    lag_max = max((e["metrics"]["rollout/policy_version_lag_max"] for e in counted), default=0)
    newer = [(e["step"], v) for e in counted for _, v in e["sampled_by"] if v > e["step"] - 1]
    unsynced = [e["step"] for e in counted if set(e["replica_versions"].values()) != {e["step"]}]
    return [
        (summary["steps"] == total_steps, f"steps: {summary['steps']} of {total_steps}"),
        (taken == accounted, f"prompt ledger: {taken} taken = " + " + ".join(f"{last.get(f'ledger/{k}', 0)} {k}" for k in parts)
         + ("" if taken == accounted else f" ({taken - accounted} lost)")),
        (len(trained) == len(set(trained)), f"prompts trained twice: {len(trained) - len(set(trained))}"),
        (lag_max <= max_policy_lag and not newer,
         f"groups trained within the policy lag: largest lag {lag_max} (max_policy_lag {max_policy_lag}); sampled by "
         f"a version newer than their step's: {len(newer)}" + (f" {newer[:5]}" if newer else "")),
        (not unsynced, "replicas on the step's weights at every step" + (f" (not at {unsynced})" if unsynced else "")),
        (True, f"trainer restarts: {len(summary['restarts'])} ({again} step(s) trained again)"),
    ]  # fmt: skip
