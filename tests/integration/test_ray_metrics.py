"""The run's Ray metrics reach Prometheus: a short run on the real stack, then the cluster's metrics
endpoint is scraped, and every metric that a panel of dashboards/dapo_run.json queries must be exported
with data for that run, from the driver, each rollout replica and each trainer worker. Where a
`prometheus` binary is installed, a real Prometheus scrapes the endpoint and every panel's query must
return data."""

import json
import os
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from dapo_ray.config import load_config
from dapo_ray.driver import run
from dapo_ray.metrics import METRICS
from dapo_ray.ray_metrics import prometheus_name

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "dapo_run.json"
RUN = "metrics-run"
STEPS = 3
# Logged only with a KL term, only in a step where some token was up-clipped, and only with the rollout
# correction on (algorithm.rollout_is).
OPTIONAL = {"actor/kl_loss", "actor/up_clipped_prob"} | {k for k in METRICS if k.startswith("rollout_corr/")}

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, ray_cluster, scrape, tmp_path_factory):
    """A 3-step run with 2 replicas and 2 trainer workers. Returns every series the metrics endpoint
    served while it ran (a gauge's latest value; gauges leave the endpoint soon after their process ends,
    counters stay) and, where a `prometheus` binary is installed, the query API of a Prometheus that
    scraped the run from its start, with the run's time window."""
    tmp = tmp_path_factory.mktemp("metrics")
    prometheus = _Prometheus(ray_cluster.metrics_url, tmp) if shutil.which("prometheus") else None
    seen: dict[tuple, tuple] = {}
    done = threading.Event()

    def poll() -> None:
        while not done.wait(0.5):
            for name, labels, value in scrape(ray_cluster.metrics_url):
                seen[(name, tuple(sorted(labels.items())))] = (name, labels, value)

    out = tmp / RUN
    # Two replicas under autoscaling (so Serve exports its autoscaling metrics), with a downscale delay
    # longer than the test, so that both stay however slowly the machine runs it. A clip range of 1%
    # makes sure some tokens are clipped at the upper bound, or actor/up_clipped_prob has no value.
    overrides = [
        f"rollout.model_path={tiny_model_dir}", f"trainer.output_dir={out}", "rollout.num_replicas=2", "rollout.downscale_delay_s=600",
        "rollout.max_replicas=2", "trainer.num_workers=2", f"trainer.total_steps={STEPS}",
        "trainer.train_batch_size=4", "trainer.gen_batch_size=8", "trainer.mini_batch_size=16",
        "trainer.micro_batch_size=4", "eval.every=0", "data.synthetic.num_eval=8", "eval.n=2",
        "algorithm.eps_low=0.01", "algorithm.eps_high=0.01",
    ]  # fmt: skip
    poller = threading.Thread(target=poll, daemon=True)
    t0 = time.time()
    poller.start()
    try:
        run(load_config(ROOT / "workflows" / "configs" / "tiny_cpu.yaml", overrides))
        # Processes report every second (the fixture's system config); the trainers' counters are the
        # latest to arrive.
        deadline = time.time() + 120

        def trainer_steps() -> dict[str, float]:
            return _by([x for x in seen.values() if x[1].get("run") == RUN], "ray_dapo_trainer_steps_total", "rank")

        while trainer_steps() != {"0": STEPS, "1": STEPS}:
            assert time.time() < deadline, (f"the trainers' final step counts did not reach {ray_cluster.metrics_url} "
                                            f"in 120 s: {trainer_steps()}")  # fmt: skip
            time.sleep(1)
        time.sleep(3)
        done.set()
        poller.join()
        yield SimpleNamespace(samples=list(seen.values()), prometheus=prometheus, window=(t0, time.time()))
    finally:
        done.set()
        if prometheus:
            prometheus.stop()


def test_driver_replicas_and_trainers_export_their_metrics(finished_run):
    ours = [s for s in finished_run.samples if s[1].get("run") == RUN]
    names = {name for name, _, _ in ours}
    # The driver: every registry key as a gauge, but for those this run need not log.
    missing = [k for k in METRICS if f"ray_{prometheus_name(k)}" not in names]
    assert set(missing) <= OPTIONAL, f"registry keys not exported: {missing}"
    assert _value(ours, "ray_dapo_step") == STEPS
    assert _value(ours, "ray_dapo_steps_total") == STEPS
    kept = _value(ours, "ray_dapo_kept_groups_total")
    generated = _value(ours, "ray_dapo_generated_groups_total")
    assert 0 < kept <= generated
    # Each rollout replica, by its own tag: both generated, and both loaded every version.
    tokens = _by(ours, "ray_dapo_rollout_generated_tokens_total", "replica")
    assert len(tokens) == 2 and all(v > 0 for v in tokens.values()), tokens
    assert set(_by(ours, "ray_dapo_rollout_weight_loads_total", "replica").values()) == {STEPS}
    assert set(_by(ours, "ray_dapo_rollout_policy_version", "replica").values()) <= set(range(STEPS + 1))
    # Each trainer worker, by rank.
    assert _by(ours, "ray_dapo_trainer_steps_total", "rank") == {"0": STEPS, "1": STEPS}
    assert all(v > 0 for v in _by(ours, "ray_dapo_trainer_tokens_total", "rank").values())


def test_every_panel_of_the_dashboard_has_data(finished_run):
    exported = {name for name, labels, _ in finished_run.samples if labels.get("run", RUN) == RUN}
    histograms = {n.removesuffix("_bucket") for n in exported if n.endswith("_bucket")}
    for title, expr in panel_queries():
        for name in re.findall(r"\b(ray_[a-zA-Z0-9_:]+)", expr):
            assert name in exported or name in histograms, f"panel {title!r} queries {name}, which has no data"


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary (Debian package "
                    "'prometheus'): the panels' queries are not evaluated, only their metric names checked")  # fmt: skip
def test_every_panel_query_returns_data_in_prometheus(finished_run):
    """Each query over the run's time window, as Grafana asks for a panel's range."""
    prom = finished_run.prometheus
    start, end = finished_run.window
    queries = [(t, e.replace("$run", RUN).replace("$__rate_interval", "10s")) for t, e in panel_queries()]
    empty = [(t, e) for t, e in queries if not prom.query_range(e, start, end)]
    assert not empty, (f"targets (a scrape's last error): {prom.targets()}\n"
                       f"panels whose query returned no data: {empty}\n{prom.log()[-3000:]}")


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], target["expr"]) for p in dashboard["panels"] for target in p.get("targets", [])]


def _value(samples, name: str, **labels) -> float | None:
    values = [v for n, lab, v in samples if n == name and labels.items() <= lab.items()]
    return values[0] if len(values) == 1 else None


def _by(samples, name: str, key: str) -> dict[str, float]:
    return {lab[key]: v for n, lab, v in samples if n == name}


class _Prometheus:
    """A Prometheus server scraping one endpoint every 3 s, for the length of the module."""

    def __init__(self, target_url: str, tmp: Path):
        self.dir = tmp
        port = _free_port()
        (tmp / "prometheus.yml").write_text(
            # A scrape times out after its interval at most: 1 s was too short for a busy 2-core machine.
            "global: {scrape_interval: 3s, scrape_timeout: 3s, evaluation_interval: 3s}\n"
            f"scrape_configs: [{{job_name: ray, static_configs: [{{targets: ['{urllib.parse.urlsplit(target_url).netloc}']}}]}}]\n"
        )  # fmt: skip
        self.log_file = (tmp / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=self.log_file, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.api = f"http://127.0.0.1:{port}/api/v1"
        deadline = time.time() + 60
        while not self._get("/status/buildinfo"):
            assert self.proc.poll() is None and time.time() < deadline, f"prometheus did not start\n{self.log()}"
            time.sleep(0.5)

    def _get(self, path: str, **params) -> dict | None:
        try:
            with urllib.request.urlopen(f"{self.api}{path}?{urllib.parse.urlencode(params)}", timeout=10) as r:
                return json.loads(r.read())["data"]
        except OSError:
            return None

    def query_range(self, expr: str, start: float, end: float) -> list:
        data = self._get("/query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step="1s")
        return data["result"] if data else []

    def targets(self) -> list[dict]:
        """Each scrape target's health, last error and last scrape's duration."""
        data = self._get("/targets") or {}
        keys = ("scrapeUrl", "health", "lastError", "lastScrapeDuration")
        return [{k: t.get(k) for k in keys} for t in data.get("activeTargets", [])]

    def log(self) -> str:
        return (self.dir / "prometheus.log").read_text()

    def stop(self) -> None:
        os.killpg(self.proc.pid, 15)
        self.proc.wait(timeout=30)
        self.log_file.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
