"""The rollout deployment: vLLM replicas behind Ray Serve that follow the run's weight store.

Weights flow one way (see `dapo_ray.weights`): the trainer ranks publish each version to the store,
through the object store. Every replica
* loads the latest version in its constructor, so one the autoscaler adds serves the current policy
  before its first request;
* long-polls the store and loads each publish the moment it starts, then acknowledges it (a publish
  may also take it back to an older version: the trainer restarted from a checkpoint); a publish that
  later ones dropped before it was loaded is skipped for the latest. Idle, it loads each bucket as it
  arrives; busy, it pulls the buckets while decoding on and loads them at once (`dapo_ray.weights`);
* checks the store again before each generate call, so it never serves a stale policy once a newer one
  is published.
A load interrupts the responses in flight (`rollout.partial_rollout`, the default; `Engine.submit_load`):
they go on under the new weights, and the sync waits for the load itself, not for the calls in flight.
`wait_synced(version)` returns once every live replica has acknowledged `version`; the driver calls it
before the next rollout, so the whole fleet is on the new weights, not just one replica.

A replica whose engine died (its engine-core process killed, a GPU worker lost) fails Serve's health
check, and Serve replaces it; until then its calls fail with `EngineDead`, which the callers send again
as they do a call to a replica that died (`pipeline._call_replica`, `stream.Stream`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import uuid

import ray
from ray import serve

from dapo_ray.config import RolloutConfig
from dapo_ray.memory import peak_rss_gib
from dapo_ray.placement import replica_options
from dapo_ray.progress import QUIET_ENV, quiet_libraries
from dapo_ray.ray_metrics import ReplicaMetrics
from dapo_ray.rollout.engine import Completion, Engine, EngineDead, engine_env
from dapo_ray.weights import AHEAD, Superseded, get_store

APP_NAME = "dapo-rollout"


HEALTH_CHECK_PERIOD_S = 2.0
"""How often Serve asks a replica whether its engine lives (`RolloutServer.check_health`, an attribute
read): Serve replaces a replica after 3 failed checks in a row, so a dead engine's replica goes within
about 6 s, inside the callers' retries of its calls (Serve's default period is 10 s)."""


# Up to gen_batch_size calls in flight at once: the stream sends one call per group (`dapo_ray.stream`).
@serve.deployment(name="rollout", max_ongoing_requests=4096, health_check_period_s=HEALTH_CHECK_PERIOD_S,
                  logging_config={"log_level": "WARNING", "enable_access_log": False})  # fmt: skip
class RolloutServer:
    """One vLLM engine. Concurrent calls share its running batch (`Engine.submit`); a weight load
    interrupts them between two decoding steps (or, without partial rollout, waits for them)."""

    async def __init__(self, rollout: dict, max_model_len: int, store_name: str, seed: int, run: str,
                       export_metrics: bool) -> None:  # fmt: skip
        cfg = RolloutConfig(**rollout)
        quiet_libraries()
        self.engine = Engine(
            cfg.model_path,
            max_model_len=max_model_len,
            seed=seed,
            enforce_eager=cfg.enforce_eager,
            tensor_parallel_size=cfg.tensor_parallel_size,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            kv_cache_gib=cfg.cpu_kvcache_space_gib,
            dtype=cfg.dtype,
            device=cfg.device,
            gpu_fraction=cfg.gpu_fraction,
            core_process=True if cfg.engine_core_process else None,  # None: the device's default
            ready_timeout_s=cfg.engine_ready_timeout_s,
        )
        self.store_name = store_name
        self.partial_rollout = cfg.partial_rollout
        self.store = get_store(store_name)
        self.replica_id = f"replica-{uuid.uuid4().hex[:8]}"
        self.metrics = ReplicaMetrics(export_metrics, run, self.replica_id)
        self.load_lock = asyncio.Lock()  # one load at a time
        self.serial = 0  # the store's publish serial of the weights served (0: the model directory's)
        self.in_flight = 0  # generate calls received and not yet answered
        self._nudge: asyncio.Task | None = None  # a load a generate call started (held so it is not collected)
        self.load_s = 0.0  # how long the latest weight load took (queueing on the engine thread included)
        await self._load(await self.store.latest.remote())  # the current policy before the first request
        self.follower = asyncio.get_running_loop().create_task(self._follow())

    def check_health(self) -> None:
        """Serve's health check: fails once the engine is dead (`Engine.check_alive`), so Serve replaces
        this replica (without it Serve checks only that the actor answers, and a replica with a dead
        engine would stay, failing every call and acknowledging no load)."""
        self.engine.check_alive()

    async def _load(self, latest: tuple[int, list, int]) -> int:
        """Load `latest` = (version, [bucket count], serial) if published after ours and acknowledge; returns
        the version now served. Version 0 is the model directory's weights, which a replica that never
        loaded anything already serves. A publish dropped before its load gives way to the store's latest."""
        while True:
            try:
                return await self._load_once(*latest)
            except Superseded as e:
                print(f"[rollout {self.replica_id}] {e}", flush=True)
                latest = await self.store.latest.remote()

    async def _load_once(self, version: int, count_box: list, serial: int) -> int:
        if serial > self.serial and count_box[0] is not None:
            async with self.load_lock:
                if serial > self.serial:
                    if version != 0 or self.serial != 0:  # serial 0: never loaded anything
                        # Idle: load each bucket as it arrives. Busy: decode on while every bucket comes
                        # to this node, then load them in one job between two decoding steps.
                        stream = self.in_flight == 0 and not self.engine.broken
                        if not stream:
                            await self._prefetch(version, serial)
                        t0 = time.perf_counter()
                        await asyncio.wrap_future(self.engine.submit_load(self.store_name, version, serial,
                                                                          self.partial_rollout, stream))  # fmt: skip
                        self.load_s = time.perf_counter() - t0
                        self.metrics.loaded(version, self.load_s)
                    self.serial = serial
        await self.store.ack.remote(self.replica_id, self.engine.version, self.serial, self.load_s, peak_rss_gib(children=True))
        return self.engine.version

    async def _prefetch(self, version: int, serial: int) -> None:
        """Pull every bucket of publish `serial` to this node as soon as it is in (the trainer may still be
        gathering the next ones), AHEAD + 1 transfers in flight, while the engine goes on decoding; the load
        then reads them locally. A publish dropped meanwhile is left to the load, which says so."""
        count = await self.store.bucket_count.remote(version, serial)

        async def pull(k: int) -> bool:
            box = await self.store.bucket.remote(version, serial, k, 600.0)
            if box[0] is None:
                return False
            await box[0]  # into this node's object store (mapped, not copied, here; dropped at once)
            return True

        in_flight: list[asyncio.Task] = []
        try:
            for k in range(count or 0):
                in_flight.append(asyncio.ensure_future(pull(k)))
                if len(in_flight) > AHEAD and not await in_flight.pop(0):
                    return
            while in_flight:
                if not await in_flight.pop(0):
                    return
        finally:
            for task in in_flight:
                task.cancel()

    async def _follow(self) -> None:
        """Load each publish as soon as it happens; the 2 s timeout doubles as a liveness ack."""
        while True:
            try:
                await self._load(await self.store.wait_newer.remote(self.serial, 2.0))
            except Exception as e:  # noqa: BLE001 - keep following; generate() re-checks anyway
                print(f"[rollout {self.replica_id}] weight sync failed: {e!r}", flush=True)
                await asyncio.sleep(1.0)

    async def generate(
        self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float, max_tokens: int,
        seeds: list[int] | None = None,
    ) -> tuple[int, str, list[list[Completion]]]:  # fmt: skip
        """(policy version, this replica's id, n completions per prompt). A newer publish than the one
        served starts loading (unless a load runs already), but the call does not wait for it: the new
        version may still be streaming in from the trainer, and the load will interrupt this call (partial
        rollout) or wait for it. `seeds`: one per prompt (`Engine.submit`)."""
        self.engine.check_alive()
        self.in_flight += 1
        try:
            latest = await self.store.latest.remote()
            if latest[2] > self.serial and not self.load_lock.locked():
                self._nudge = asyncio.get_running_loop().create_task(self._load(latest))
            t0 = time.perf_counter()
            try:
                version, out = await asyncio.wrap_future(
                    self.engine.submit(prompt_ids, n=n, temperature=temperature, top_p=top_p,
                                       max_tokens=max_tokens, seeds=seeds)  # fmt: skip
                )
            except Exception as e:
                # vLLM's own EngineDeadError, or whatever a dying engine raised: the caller sends it again.
                dead = self.engine.why_dead()
                if dead is not None:
                    raise EngineDead(f"{dead} ({e!r})") from None  # the caller need not unpickle vLLM's error
                raise
            tokens = sum(len(c["response_ids"]) for completions in out for c in completions)
            self.metrics.generated(len(prompt_ids), tokens, time.perf_counter() - t0)
            return version, self.replica_id, out
        finally:
            self.in_flight -= 1

    async def stats(self) -> dict:
        """This replica's actor name, process id, policy version and generate calls in flight."""
        return {"actor": ray.get_runtime_context().get_actor_name(), "pid": os.getpid(),
                "version": self.engine.version, "in_flight": self.in_flight}  # fmt: skip

    async def trace(self, since: float = 0.0) -> list[tuple[float, int]]:
        """(wall time, sequences in the engine's running batch) of each decoding step after `since`."""
        return [(t, n) for t, n in list(self.engine.trace) if t > since]

    async def sequence_logprobs(self, token_ids: list[int]) -> tuple[int, list[float]]:
        """(policy version, log-probs of `token_ids`) on the newest publish: the driver's weight-sync probe.
        A dead engine raises `EngineDead`, as `generate` does, never vLLM's own error."""
        self.engine.check_alive()
        await self._load(await self.store.latest.remote())
        try:
            return await asyncio.wrap_future(self.engine.submit_logprobs(token_ids))
        except Exception as e:
            dead = self.engine.why_dead()
            if dead is not None:
                raise EngineDead(f"{dead} ({e!r})") from None
            raise


def deploy_rollout(cfg: RolloutConfig, max_model_len: int, store_name: str, seed: int, run: str = "",
                   export_metrics: bool = False) -> serve.handle.DeploymentHandle:  # fmt: skip
    """Start (or update) the Serve application; fixed size, or autoscaled when max_replicas > min_replicas.
    With `export_metrics`, each replica exports its Ray metrics (`dapo_ray.ray_metrics`) tagged `run`."""
    if cfg.max_replicas > cfg.min_replicas:
        scaling = {"autoscaling_config": {
            "min_replicas": cfg.min_replicas, "max_replicas": cfg.max_replicas, "initial_replicas": cfg.num_replicas,
            "target_ongoing_requests": cfg.target_ongoing_requests, "upscale_delay_s": cfg.upscale_delay_s,
            "downscale_delay_s": cfg.downscale_delay_s, "look_back_period_s": cfg.look_back_period_s,
        }}  # fmt: skip
    else:
        scaling = {"num_replicas": cfg.num_replicas}
    options = replica_options(cfg)
    env = engine_env(cfg.cpu_kvcache_space_gib, cfg.device, cfg.gpu_fraction, cfg.tensor_parallel_size,
                     True if cfg.engine_core_process else None, cfg.engine_ready_timeout_s)  # fmt: skip
    if os.environ.get(QUIET_ENV) == "1":  # a quiet console (`cluster.verbose` off): vLLM's warnings to the log
        env |= {QUIET_ENV: "1", "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
                "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning"}  # fmt: skip
    options["ray_actor_options"]["runtime_env"] = {"env_vars": env}
    # Requests come through deployment handles (Ray Data, the driver), so no HTTP proxy is needed.
    quiet_libraries()  # Serve sets its loggers' level on import
    serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
    app = RolloutServer.options(**options, **scaling).bind(
        dataclasses.asdict(cfg), max_model_len, store_name, seed, run, export_metrics
    )
    return serve.run(app, name=APP_NAME, route_prefix=None)


def wait_synced(store, version: int, timeout_s: float = 120.0) -> dict[str, int]:
    """Block until every live replica serves `version`; returns {replica: version}. The store answers
    the moment the last replica acknowledges (no polling interval); the replica count is re-read every
    second, since the autoscaler may change it meanwhile."""
    deadline = time.time() + timeout_s
    while True:
        expected = _live_replicas()
        versions = ray.get(store.wait_synced.remote(version, expected, 1.0))
        if versions is not None:
            return versions
        if time.time() > deadline:
            versions = ray.get(store.replica_versions.remote())
            behind = {r: v for r, v in versions.items() if v < version}
            raise TimeoutError(f"rollout replicas did not reach policy version {version} in {timeout_s:.0f}s: "
                               f"{behind or f'{len(versions)} of {expected} replica(s) heard from'}")  # fmt: skip


def _live_replicas() -> int:
    status = serve.status().applications.get(APP_NAME)
    if status is None:
        return 0
    dep = status.deployments["rollout"]
    return int(dep.replica_states.get("RUNNING", 0))
