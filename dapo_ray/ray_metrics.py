"""The run's metrics as Ray metrics (`ray.util.metrics`): they reach each node's Prometheus export
(`ray start --metrics-export-port`) and the Ray dashboard's Metrics view. Ray prefixes every name with
`ray_` on export, so `dapo_critic_score_mean` is scraped as `ray_dapo_critic_score_mean`.

Each figure is exported by the process that knows it, on whatever node that process runs:

* the driver: every key of the registry (`dapo_ray.metrics.METRICS`) as a gauge, set each step, plus
  run totals as counters;
* each rollout replica (tag `replica`): generate calls, generated tokens (their rate is the rollout's
  tokens/s), seconds per call, the policy version it serves, and its weight loads;
* each trainer worker (tag `rank`): its trained tokens, old-log-prob and update seconds per step.

Every metric carries the tag `run` (the run's name), so the dashboards of `dashboards/` can show one run
among several.

Ray's metrics agent drops a gauge that has not been set for two report intervals (20 s by default), which
would blank a panel between the minutes-long steps of a large run; so each process re-sets its gauges'
latest values in the background while the object that set them lives. Counters and histograms are
cumulative and stay. A finished run's gauges therefore fade once its processes (or its driver's metrics
object) are gone, and its counters remain.
"""

from __future__ import annotations

import re
import threading
import time
import weakref

from dapo_ray import storage
from dapo_ray.metrics import METRICS

# Counters of the driver: the run's totals, from each step's metrics.
DRIVER_COUNTERS = {
    "dapo_steps": ("RL steps trained", None),
    "dapo_generated_groups": ("prompts (groups) generated", "dynamic_sampling/generated_groups"),
    "dapo_kept_groups": ("generated groups that passed the dynamic-sampling filter", "dynamic_sampling/kept_groups"),
    "dapo_gen_rounds": ("generation rounds", "dynamic_sampling/rounds"),
    "dapo_stale_dropped_groups": ("groups dropped as older than max_policy_lag", "dynamic_sampling/stale_dropped"),
}  # fmt: skip


def prometheus_name(key: str) -> str:
    """The Ray metric name of a registry key (before Ray's `ray_` prefix).

    >>> prometheus_name("critic/score/mean"), prometheus_name("eval/avg_at_k")
    ('dapo_critic_score_mean', 'dapo_eval_avg_at_k')
    """
    return "dapo_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def run_name(cfg) -> str:
    """The run's name, as MLflow and the `run` tag know it: tracking.run_name, else output_dir's name."""
    return cfg.tracking.run_name or storage.name(cfg.trainer.output_dir)


class _Metrics:
    """Ray metrics sharing fixed tags, created on first use; a no-op when disabled."""

    def __init__(self, enabled: bool, tags: dict[str, str]):
        self.enabled = enabled
        self.tags = tags
        self.metrics: dict[str, object] = {}
        self.gauge_values: dict[str, float] = {}  # re-set by _keep_alive
        self.last_update = 0.0  # time.monotonic() of the latest set or inc

    def _get(self, kind: str, name: str, description: str, **kwargs):
        if name not in self.metrics:
            from ray.util import metrics

            cls = {"gauge": metrics.Gauge, "counter": metrics.Counter, "histogram": metrics.Histogram}[kind]
            self.metrics[name] = cls(name, description, tag_keys=tuple(self.tags), **kwargs)
            self.metrics[name].set_default_tags(self.tags)
        return self.metrics[name]

    def set(self, name: str, value: float, description: str) -> None:
        if self.enabled:
            self._get("gauge", name, description).set(float(value))
            self.gauge_values[name] = float(value)
            self.last_update = time.monotonic()
            _keep_alive(self)

    def refresh(self) -> None:
        """Set every gauge again to its latest value."""
        for name, value in list(self.gauge_values.items()):
            self.metrics[name].set(value)

    def inc(self, name: str, value: float, description: str) -> None:
        if self.enabled and value > 0:
            self._get("counter", name, description).inc(float(value))
            self.last_update = time.monotonic()

    def observe(self, name: str, value: float, description: str, boundaries: list[float]) -> None:
        if self.enabled:
            self._get("histogram", name, description, boundaries=boundaries).observe(float(value))
            self.last_update = time.monotonic()

    def wait_exported(self) -> None:
        """Return once Ray has exported this process's latest values: Ray sends them to the node's
        metrics agent every report interval, so a process that exits sooner after its last update loses
        it (a short run's trainer worker would never show up at all). Two intervals and 2 s: on a loaded
        machine one interval and 1 s lost the last steps' counts (the exporting thread ran late)."""
        if self.enabled and self.last_update:
            time.sleep(max(0.0, self.last_update + 2 * _report_interval_s() + 2.0 - time.monotonic()))


def _report_interval_s() -> float:
    import ray

    return max(ray._config.metrics_report_interval_ms(), 1000) / 1000


_alive: weakref.WeakSet[_Metrics] = weakref.WeakSet()
_alive_lock = threading.Lock()
_refresher: list[threading.Thread] = []


def _keep_alive(m: _Metrics) -> None:
    """Have this process's refresh thread (started on first use) re-set `m`'s gauges while `m` lives,
    twice per report interval of Ray's metrics."""
    with _alive_lock:
        if not _refresher:
            every_s = _report_interval_s() / 2
            _refresher.append(threading.Thread(target=_refresh_forever, args=(every_s,), name="dapo-metrics", daemon=True))
            _refresher[0].start()
        _alive.add(m)


def _refresh_forever(every_s: float) -> None:
    while True:
        time.sleep(every_s)
        with _alive_lock:
            alive = list(_alive)
        for m in alive:
            m.refresh()


class DriverMetrics(_Metrics):
    """The step's registry metrics as gauges and the run's totals as counters."""

    def __init__(self, enabled: bool, run: str):
        super().__init__(enabled, {"run": run})

    def record(self, metrics: dict[str, float], step: int) -> None:
        """One step's (or one evaluation's) metrics."""
        self.set("dapo_step", step, "the latest RL step")
        for key, value in metrics.items():
            if key in METRICS:
                self.set(prometheus_name(key), value, METRICS[key])
        if "timing/step_s" not in metrics:  # an evaluation, not a step
            return
        for name, (description, key) in DRIVER_COUNTERS.items():
            self.inc(name, 1 if key is None else metrics.get(key, 0), description)
        self.observe("dapo_step_seconds", metrics["timing/step_s"], "wall seconds per RL step",
                     boundaries=[0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600])  # fmt: skip


class ReplicaMetrics(_Metrics):
    """One rollout replica's work and the policy version it serves."""

    def __init__(self, enabled: bool, run: str, replica: str):
        super().__init__(enabled, {"run": run, "replica": replica})

    def generated(self, prompts: int, tokens: int, seconds: float) -> None:
        self.inc("dapo_rollout_requests", 1, "generate calls answered")
        self.inc("dapo_rollout_prompts", prompts, "prompts generated for")
        self.inc("dapo_rollout_generated_tokens", tokens, "response tokens generated")
        self.observe("dapo_rollout_generate_seconds", seconds, "seconds per generate call (vLLM, all n samples)",
                     boundaries=[0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120])  # fmt: skip

    def loaded(self, version: int, seconds: float) -> None:
        self.set("dapo_rollout_policy_version", version, "policy version this replica serves")
        self.set("dapo_rollout_weight_load_seconds", seconds, "seconds the latest weight load took")
        self.inc("dapo_rollout_weight_loads", 1, "policy versions loaded")


class TrainerMetrics(_Metrics):
    """One trainer worker's share of each step."""

    def __init__(self, enabled: bool, run: str, rank: int):
        super().__init__(enabled, {"run": run, "rank": str(rank)})

    def trained(self, step: int, tokens: float, old_logprob_s: float, update_s: float) -> None:
        self.set("dapo_trainer_step", step, "the latest RL step this worker trained")
        self.inc("dapo_trainer_steps", 1, "RL steps this worker trained")
        self.inc("dapo_trainer_tokens", tokens, "response tokens trained on (each PPO epoch counts)")
        self.set("dapo_trainer_old_logprob_seconds", old_logprob_s, "seconds recomputing old log-probs, latest step")
        self.set("dapo_trainer_update_seconds", update_s, "seconds of gradient updates, latest step")
        self.set("dapo_trainer_tokens_per_second", tokens / max(old_logprob_s + update_s, 1e-9),
                 "response tokens trained per second of this worker's compute, latest step")  # fmt: skip
