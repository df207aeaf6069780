"""Where a rollout replica runs: the actor and, with tensor parallelism, its placement group."""

import pytest

from dapo_ray.config import RolloutConfig
from dapo_ray.rollout.deployment import replica_options


def _fits(demand: dict, bundle: dict) -> bool:
    return all(bundle.get(k, 0.0) >= v for k, v in demand.items() if v)


@pytest.mark.parametrize("cuda", [True, False])
def test_tensor_parallel_replicas_reserve_their_devices_on_one_rollout_node(cuda):
    cfg = RolloutConfig(model_path="m", tensor_parallel_size=4, resources={"rollout": 1})
    opts = replica_options(cfg, cuda=cuda)
    device = "GPU" if cuda else "CPU"
    bundles = opts["placement_group_bundles"]
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    # One device per bundle (vLLM's rule), one bundle per tensor-parallel rank.
    assert [b[device] for b in bundles] == [1.0] * 4
    # The replica actor fits the first bundle, which carries the rollout group's resource.
    actor = opts["ray_actor_options"]
    demand = {"CPU": actor["num_cpus"], "GPU": actor["num_gpus"], **actor["resources"]}
    assert bundles[0]["rollout"] == 1 and _fits(demand, bundles[0])
    # ... and leaves the first bundle's device to vLLM's first worker.
    assert bundles[0][device] - demand.get(device, 0) >= 1


def test_a_single_device_replica_holds_its_device_and_resources_itself():
    cfg = RolloutConfig(model_path="m", resources={"rollout": 1}, cpus_per_replica=2)
    assert replica_options(cfg, cuda=True) == {"ray_actor_options": {"num_cpus": 2, "num_gpus": 1, "resources": {"rollout": 1.0}}}
    assert replica_options(RolloutConfig(model_path="m"), cuda=False) == {"ray_actor_options": {"num_cpus": 1}}
