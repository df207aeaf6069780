"""The rollout deployment: vLLM replicas behind Ray Serve, and the versioned weight store they follow.

Weights flow one way: the trainer writes a safetensors file and `publish`es (version, path) to the
`WeightStore` actor. Every replica checks the store before each generate call and also polls it in the
background, loads anything newer in place, and acknowledges the version it serves. So:

* a replica never serves a stale policy once a newer version is published (it checks first);
* replicas started later by the autoscaler load the latest weights before their first request;
* `wait_synced(version)` returns once every live replica has acknowledged `version`, which the driver
  calls before the next rollout, so the whole fleet is on the new weights, not just the one that happened
  to receive a request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

import ray
from ray import serve

from dapo_ray.config import RolloutConfig
from dapo_ray.rollout.engine import Completion, Engine, engine_env

APP_NAME = "dapo-rollout"


@ray.remote(num_cpus=0)
class WeightStore:
    """The latest published weights (version, path) and the version each replica serves."""

    def __init__(self) -> None:
        self.version, self.path = 0, ""
        self.replicas: dict[str, tuple[int, float]] = {}  # replica -> (version, time of last ack)

    def publish(self, version: int, path: str) -> None:
        self.version, self.path = version, path

    def latest(self) -> tuple[int, str]:
        return self.version, self.path

    def ack(self, replica: str, version: int) -> None:
        self.replicas[replica] = (version, time.time())

    def replica_versions(self, max_age_s: float = 5.0) -> dict[str, int]:
        """Versions of the replicas heard from in the last `max_age_s` (each polls every 0.5 s), so a
        replica removed by the autoscaler drops out by itself."""
        now = time.time()
        return {r: v for r, (v, t) in self.replicas.items() if now - t <= max_age_s}


STORE_NAMESPACE = "dapo-ray"


def create_store(name: str) -> ray.actor.ActorHandle:
    """The run's weight store, owned by the driver (it goes away with the driver)."""
    return WeightStore.options(name=name, namespace=STORE_NAMESPACE, get_if_exists=True).remote()


@serve.deployment(name="rollout", max_ongoing_requests=8,
                  logging_config={"log_level": "WARNING", "enable_access_log": False})  # fmt: skip
class RolloutServer:
    """One vLLM engine; calls are serialised on a lock (vLLM batches the prompts of each call itself)."""

    def __init__(self, rollout: dict, max_model_len: int, store_name: str, seed: int) -> None:
        cfg = RolloutConfig(**rollout)
        self.engine = Engine(
            cfg.model_path,
            max_model_len=max_model_len,
            seed=seed,
            enforce_eager=cfg.enforce_eager,
            tensor_parallel_size=cfg.tensor_parallel_size,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            kv_cache_gib=cfg.cpu_kvcache_space_gib,
            dtype=cfg.dtype,
        )
        self.store = ray.get_actor(store_name, namespace=STORE_NAMESPACE)
        self.replica_id = f"replica-{uuid.uuid4().hex[:8]}"
        self.lock = asyncio.Lock()
        self.poller: asyncio.Task | None = None

    async def _sync(self) -> int:
        """Load the store's latest weights if newer than ours; returns the version now served."""
        version, path = await self.store.latest.remote()
        if version > self.engine.version:
            async with self.lock:
                if version > self.engine.version:
                    await asyncio.to_thread(self.engine.load_weights, path, version)
        await self.store.ack.remote(self.replica_id, self.engine.version)
        return self.engine.version

    async def _poll(self) -> None:
        while True:
            try:
                await self._sync()
            except Exception as e:  # noqa: BLE001 - keep polling; generate() re-checks anyway
                print(f"[rollout {self.replica_id}] weight sync failed: {e!r}")
            await asyncio.sleep(0.5)

    def _ensure_polling(self) -> None:
        if self.poller is None:
            self.poller = asyncio.get_running_loop().create_task(self._poll())

    async def generate(
        self, prompt_ids: list[list[int]], n: int, temperature: float, top_p: float, max_tokens: int
    ) -> tuple[int, list[list[Completion]]]:
        """(policy version, n completions per prompt); the version is checked against the store first."""
        self._ensure_polling()
        await self._sync()
        async with self.lock:
            version = self.engine.version
            out = await asyncio.to_thread(
                self.engine.generate, prompt_ids, n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens
            )
        return version, out

    async def sequence_logprobs(self, token_ids: list[int]) -> tuple[int, list[float]]:
        self._ensure_polling()
        await self._sync()
        async with self.lock:
            return self.engine.version, await asyncio.to_thread(self.engine.sequence_logprobs, token_ids)

    async def ping(self) -> str:
        """Starts the background poller and registers this replica with the store."""
        self._ensure_polling()
        await self._sync()
        return self.replica_id


def deploy_rollout(cfg: RolloutConfig, max_model_len: int, store_name: str, seed: int) -> serve.handle.DeploymentHandle:
    """Start (or update) the Serve application; fixed size, or autoscaled when max_replicas > min_replicas."""
    if cfg.max_replicas > cfg.min_replicas:
        scaling = {"autoscaling_config": {"min_replicas": cfg.min_replicas, "max_replicas": cfg.max_replicas,
                                          "initial_replicas": cfg.num_replicas, "target_ongoing_requests": 2}}  # fmt: skip
    else:
        scaling = {"num_replicas": cfg.num_replicas}
    actor_options: dict = {"num_cpus": cfg.cpus_per_replica}
    if cfg.tensor_parallel_size > 1:
        actor_options = {"num_cpus": 0, "num_gpus": 0}  # the engine places its own workers
    else:
        try:
            import torch

            if torch.cuda.is_available():
                actor_options["num_gpus"] = 1
        except ImportError:
            pass
    actor_options["runtime_env"] = {"env_vars": engine_env(cfg.cpu_kvcache_space_gib)}
    # Requests come through deployment handles (Ray Data, the driver), so no HTTP proxy is needed.
    serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
    app = RolloutServer.options(ray_actor_options=actor_options, **scaling).bind(
        dataclasses.asdict(cfg), max_model_len, store_name, seed
    )
    return serve.run(app, name=APP_NAME, route_prefix=None)


def wait_synced(store, handle, version: int, timeout_s: float = 120.0) -> dict[str, int]:
    """Block until every live replica serves `version`; returns {replica: version}."""
    deadline = time.time() + timeout_s
    expected = _live_replicas()
    while True:
        versions = ray.get(store.replica_versions.remote())
        behind = {r: v for r, v in versions.items() if v < version}
        if len(versions) >= expected and not behind:
            return versions
        if time.time() > deadline:
            raise TimeoutError(f"rollout replicas did not reach policy version {version} in {timeout_s:.0f}s: "
                               f"{behind or 'waiting for ' + str(expected - len(versions)) + ' replica(s)'}")  # fmt: skip
        if len(versions) < expected:
            handle.ping.remote()  # new replicas register (and start polling) on their first call
        time.sleep(0.2)


def _live_replicas() -> int:
    status = serve.status().applications.get(APP_NAME)
    if status is None:
        return 0
    dep = status.deployments["rollout"]
    return int(dep.replica_states.get("RUNNING", 0))
