"""`dapo-ray rehearse`: a cluster description and a config tried on this machine under Ray's own
autoscaler before anyone pays for GPUs.

The cluster's worker groups (KubeRay RayCluster or RayJob, Anyscale compute config) become node types of
Ray's autoscaler v2, laptop-sized (`groups.laptop`); a head node with no CPUs for work runs it; each node
it launches is a `ray start` process in a mount namespace of its own (`provider`). The config runs on it
with the tiny model, and a timeline shows per group the nodes up, idle and pending, what waits for a
node, Serve's replicas and the policy version (`timeline`). `--lose rollout@3` kills a rollout node once
version 3 is out, as a preempted pod, and the rehearsal ends with the run's books checked: every step,
no prompt lost or trained twice, every group sampled by a version its step allows."""

from __future__ import annotations

import argparse
import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

from dapo_ray.config import Config, ConfigError, load_config
from dapo_ray.rehearsal import groups

DEFAULT_CONFIG = "workflows/configs/tiny_cpu.yaml"
OBJECT_STORE_BYTES = 400_000_000  # per node: the tiny model's versions and a step's batches


def overlay(
    cfg: Config, small: groups.ClusterDescription, steps: int, out_dir: Path, losing_trainer: bool
) -> list[tuple[str, str]]:
    """The overrides that fit `cfg` to the laptop cluster, each with its reason. Custom resources the config
    sets are kept; where it sets none and a group is named after its own resource (`rollout`, `trainer`,
    as in cluster/), one unit of it is asked for, as cluster/README.md tells a config to."""
    from dapo_ray.placement import replica_demand

    out: list[tuple[str, str]] = []
    by_name = {g.name: g for g in small.groups}
    for key, current in (("rollout", cfg.rollout.resources), ("trainer", cfg.trainer.resources)):
        g = by_name.get(key)
        if not current and g is not None and key in g.custom:
            out.append((f"{key}.resources={{{key}: 1}}", f"the config names no group; the cluster's `{key}` "
                                                         f"group offers `{key}` (add it to the config)"))  # fmt: skip
    asked = {"rollout": 1.0} if any(o.startswith("rollout.resources") for o, _ in out) else {}
    demand = {**replica_demand(cfg.rollout), **asked}
    capacity = sum(g.max_nodes * _fits(demand, g.resources) for g in small.groups)
    if capacity >= 1:
        out += [("rollout.num_replicas=1", "one replica at start, so the autoscaler has one node to add first"),
                ("rollout.min_replicas=1", "Serve's floor"),
                (f"rollout.max_replicas={capacity}", "as many as the laptop cluster's nodes hold"),
                ("rollout.target_ongoing_requests=2", "a second replica once a round keeps more calls in flight"),
                ("rollout.upscale_delay_s=1", "Serve reacts in seconds here (30 s on a cluster)"),
                ("rollout.look_back_period_s=12", "longer than the 10 s at which replicas report their load"),
                ("rollout.downscale_delay_s=600", "the fleet shrinks when the run ends, not between rounds")]  # fmt: skip
    out += [(f"trainer.total_steps={steps}", "--steps"), ("eval.every=0", "no evaluations: the rehearsal is about placement"),
            (f"trainer.output_dir={out_dir / 'run'}", "the rehearsal's own directory")]  # fmt: skip
    if losing_trainer:
        out.append(("trainer.save_every=2", "a checkpoint to restart from when the trainer node is lost"))
    return out


def _fits(demand: dict[str, float], node: dict[str, float]) -> int:
    """How many of `demand` one node holds.

    >>> _fits({"CPU": 1, "rollout": 1}, {"CPU": 2, "rollout": 1}), _fits({"CPU": 1}, {"CPU": 0})
    (1, 0)
    """
    return min((math.floor(node.get(k, 0) / v) for k, v in demand.items() if v > 0), default=0)


def fit_problems(cfg: Config, small: groups.ClusterDescription) -> list[str]:
    """Why the config's replicas or workers would wait forever on this cluster (empty when they fit)."""
    from dapo_ray.placement import replica_demand, worker_resources

    problems = []
    offered = ", ".join(f"{g.name} {groups.resources_text(g.custom)}" for g in small.groups)
    for what, key, demand, count in (("a rollout replica", "rollout.resources", replica_demand(cfg.rollout), 1),
                                     ("the trainer workers", "trainer.resources", worker_resources(cfg.trainer),
                                      cfg.trainer.num_workers)):  # fmt: skip
        custom = {k: v for k, v in demand.items() if k not in ("CPU", "GPU")}
        room = max((g.max_nodes * _fits(demand, g.resources) for g in small.groups), default=0)
        if room < count:
            problems.append(f"{what} needs {groups.resources_text(demand)} x{count} ({key}={groups.resources_text(custom)}): no group holds "
                            f"{'it' if count == 1 else 'them'} (groups: {offered})")  # fmt: skip
    return problems


def add_parser(sub) -> None:
    p = sub.add_parser("rehearse", help="run a config on this machine under Ray's own autoscaler, with the node groups "
                                        "of a KubeRay or Anyscale cluster description, and print what scales when")  # fmt: skip
    p.add_argument(
        "--cluster",
        default="cluster/kuberay/raycluster.yaml",
        help="KubeRay RayCluster or RayJob manifest, or Anyscale compute config (default: %(default)s)",
    )
    p.add_argument("--config", default=DEFAULT_CONFIG, help="the run's config (default: %(default)s)")
    p.add_argument(
        "overrides", nargs="*", help="section.key=value overrides, applied after the rehearsal's own"
    )
    p.add_argument("--steps", type=int, default=6, help="DAPO steps to run (default: %(default)s)")
    p.add_argument(
        "--max-nodes",
        type=int,
        default=2,
        help="most nodes of an autoscaled group; a fixed-size group gets 1 (default: %(default)s)",
    )
    p.add_argument(
        "--cpus-per-node", type=int, default=2, help="CPU slots of every node (default: %(default)s)"
    )
    p.add_argument(
        "--idle-timeout-s",
        type=float,
        default=10.0,
        help="idle timeouts are cut to this (the manifests say minutes) (default: %(default)s)",
    )
    p.add_argument("--lose", action="append", default=[], metavar="GROUP@VERSION",
                   help="kill every process of one GROUP node once policy VERSION is published, as a preempted "
                        "pod (repeatable), e.g. rollout@2 trainer@4")  # fmt: skip
    p.add_argument(
        "--out-dir", default="runs/rehearsal", help="logs, timeline.json and the run (default: %(default)s)"
    )
    p.add_argument("--no-dashboard", dest="dashboard", action="store_false",
                   help="no Ray dashboard (by default it is served on a free loopback port, and Ray Train's "
                        "helpers read the state API through it)")  # fmt: skip
    p.add_argument(
        "--no-isolation",
        action="store_true",
        help="nodes share /tmp and /dev/shm (where mount namespaces need root and there is none)",  # checked: help text
    )
    p.set_defaults(func=main)


def _losses(specs: list[str]) -> list[tuple[str, int]]:
    out = []
    for spec in specs:
        group, _, version = spec.partition("@")
        if not group or not version.isdigit():
            raise ConfigError(f"--lose {spec!r}: expected GROUP@VERSION, e.g. rollout@2")
        out.append((group, int(version)))
    return out


def main(args: argparse.Namespace) -> int:
    import ray
    from ray._private import auto_init_hook

    from dapo_ray import storage
    from dapo_ray.driver import check_reward, run
    from dapo_ray.models import ensure_model
    from dapo_ray.placement import plan
    from dapo_ray.progress import log
    from dapo_ray.ray_cluster import init_ray
    from dapo_ray.rehearsal import head, provider, timeline

    # No Ray call in this process may start a local Ray of its own (Ray does so on the first call before
    # `ray.init`, and after `ray.shutdown` for the metrics thread of Serve's handle): it joins the rehearsal's.
    auto_init_hook.enable_auto_connect = False
    full = groups.read(args.cluster)
    small = groups.laptop(full, args.max_nodes, args.idle_timeout_s, args.cpus_per_node)
    losses = _losses(args.lose)
    unknown = sorted({g for g, _ in losses} - {g.name for g in small.groups})
    if unknown:
        raise ConfigError(
            f"--lose names no group of {args.cluster}: {unknown} (groups: {[g.name for g in small.groups]})"
        )
    out_dir = Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    base = load_config(args.config, args.overrides)
    changes = overlay(base, small, args.steps, out_dir, any(g == "trainer" for g, _ in losses))
    cfg = load_config(args.config, [o for o, _ in changes] + list(args.overrides))
    log(f"rehearsing {args.cluster} ({full.kind}) with {args.config}; groups, the cluster's -> this machine's "
        f"(no GPUs: rollout.device {cfg.rollout.device}, the trainer on CPU):")  # fmt: skip
    for line in groups.describe(full, small):
        log(f"  {line}")
    log("the config as rehearsed (then your overrides):")
    for o, why in changes:
        log(f"  {o:40s} {why}")
    for line in plan(cfg):
        log(f"  {line}")
    problems = fit_problems(cfg, small)
    if problems:
        raise ConfigError("the config does not fit the cluster:\n  " + "\n  ".join(problems))
    isolate = not args.no_isolation and provider.isolation_available()
    if isolate and any(out_dir.is_relative_to(m) for m in provider.PRIVATE_MOUNTS):
        raise ConfigError(f"--out-dir {out_dir} is under {provider.PRIVATE_MOUNTS}, which every node has a private "
                          "copy of: the run's checkpoints there would not reach the trainer nodes (choose a "
                          "directory elsewhere, as a cluster's shared storage)")  # fmt: skip
    log("nodes in mount namespaces of their own (private /tmp, /dev/shm)" if isolate else  # checked: log text
        "nodes share /tmp and /dev/shm (no mount namespaces here: run as root, or pass --no-isolation to say so)")  # checked: log text
    check_reward(cfg)
    ensure_model(cfg, only_if_missing=True)
    if (out_dir / "run").exists():  # a rehearsal starts from step 0, never resumes an earlier one
        log(f"removing the previous rehearsal's run in {out_dir / 'run'}")
        shutil.rmtree(out_dir / "run")
    lifetime_s = int(1800 + 300 * args.steps)  # `timeout` ends every node should this process die first
    store = f"weights-{storage.name(cfg.trainer.output_dir)}"
    summary = None
    with head.Head(small, out_dir, isolate, lifetime_s, OBJECT_STORE_BYTES, args.dashboard) as cluster:
        log(
            f"head node up at {cluster.address}"
            + (f", dashboard {cluster.dashboard_url}" if args.dashboard else "")
        )
        cfg = replace(cfg, cluster=replace(cfg.cluster, address=cluster.address))
        init_ray(cfg)  # joined before anything here calls Ray
        watcher = timeline.Watcher(cluster, [g.name for g in small.groups], store, losses)
        watcher.start()
        try:
            summary = run(cfg, reward_checked=True)
            watcher.event(f"run finished: {summary['steps']} steps; Serve's rollout application deleted")
            _settle(watcher, small, args.idle_timeout_s + 60)
        finally:
            watcher.stop()
            if ray.is_initialized():
                ray.shutdown()
    return _report(watcher, small, summary, cfg, out_dir, losses)


def _settle(watcher, small: groups.ClusterDescription, timeout_s: float) -> None:
    """Watch on until every autoscaled group is back to its floor (its idle nodes removed)."""
    import time

    deadline = time.time() + timeout_s
    floors = {g.name: g.min_nodes for g in small.groups}
    while time.time() < deadline:
        s = watcher.latest()
        if s and all(s.nodes[g]["up"] + s.nodes[g]["pending"] <= floors[g] for g in floors):
            watcher.event(
                "every group back to its floor: " + ", ".join(f"{g} {s.nodes[g]['up']}" for g in floors)
            )
            return
        time.sleep(1)
    watcher.event(f"groups not back to their floor after {timeout_s:.0f} s")


def _report(watcher, small, summary, cfg, out_dir: Path, losses) -> int:
    from dapo_ray.progress import log
    from dapo_ray.rehearsal import timeline

    report = watcher.report()
    samples = watcher.samples
    peak = {g.name: max((s.nodes[g.name]["up"] for s in samples), default=0) for g in small.groups}
    path = [_changes([s.nodes[g.name]["up"] for s in samples]) for g in small.groups]
    log("rehearsal: nodes per group over the run: " + "; ".join(f"{g.name} {' -> '.join(map(str, p))}"
                                                                 for g, p in zip(small.groups, path, strict=True)))  # fmt: skip
    report["figures"] = {}
    for g in small.groups:
        res = next(iter(g.custom), g.name)
        lost_at = tuple(e["t"] for e in watcher.events if e["event"].startswith(f"lost a {g.name} node"))
        f = timeline.figures(samples, g.name, res, lost_at)
        report["figures"][g.name] = f
        if g.autoscaled:
            log(f"rehearsal: {g.name}: work waiting -> node up {_fmt(f['demand_to_node_s'])}; -> replica serving "
                f"{_fmt(f['demand_to_serving_s'])}; Serve's replicas gone -> node removed {_fmt(f['downscale_to_removal_s'])}")  # fmt: skip
    head_used = sorted({k for s in samples for k in s.head_used})
    checks = [
        (not head_used, "nothing placed on the head" + (f" (in use there: {head_used})" if head_used else ""))
    ]
    for g in (g for g in small.groups if not g.autoscaled):  # once at its size, a fixed group stays there
        ups = [s.nodes[g.name]["up"] for s in samples]
        after = ups[ups.index(g.max_nodes):] if g.max_nodes in ups else []
        lost = any(x == g.name for x, _ in losses)
        steady = bool(after) and (set(after) == {g.max_nodes} or (lost and after[-1] == g.max_nodes))
        checks.append((steady, f"{g.name} group: {g.max_nodes} node(s) from the start"
                               + (" (one lost on purpose, then replaced)" if lost else "")
                               + ("" if steady else f", but up over time: {_changes(ups)}")))  # fmt: skip
    if summary is not None:
        checks += timeline.verdict(summary, cfg.trainer.total_steps, cfg.algorithm.max_policy_lag)
    for ok, line in checks:
        log(f"rehearsal: {'ok  ' if ok else 'FAIL'} {line}")
    report.update(peak_nodes=peak, node_path=dict(zip([g.name for g in small.groups], path, strict=True)),
                  checks=[{"ok": ok, "check": line} for ok, line in checks],
                  restarts=summary["restarts"] if summary else None, steps=summary["steps"] if summary else 0)  # fmt: skip
    (out_dir / "timeline.json").write_text(json.dumps(report, indent=1))
    log(f"rehearsal: timeline and figures in {out_dir / 'timeline.json'}; node logs in {out_dir}")
    return 0 if all(ok for ok, _ in checks) else 1


def _changes(values: list[int]) -> list[int]:
    """The values with repeats collapsed: [0, 0, 1, 1, 2, 1] -> [0, 1, 2, 1].

    >>> _changes([0, 0, 1, 1, 2, 1])
    [0, 1, 2, 1]
    """
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.0f} s" for v in values) or "none seen"
