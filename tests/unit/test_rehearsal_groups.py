"""`dapo-ray rehearse`'s reading of the cluster descriptions, offline: the worker groups of the KubeRay
RayCluster and RayJob and of the Anyscale compute config, their laptop-sized node types (which Ray's own
cluster-config schema accepts), and the check that a config's replicas and workers fit the groups, on the
real cluster and on the laptop one."""

from pathlib import Path

import pytest

from dapo_ray.config import ConfigError, load_config
from dapo_ray.rehearsal import _losses, fit_problems, groups, overlay

REPO = Path(__file__).resolve().parents[2]
RAYCLUSTER = REPO / "cluster" / "kuberay" / "raycluster.yaml"
RAYJOB = REPO / "cluster" / "kuberay" / "rayjob.yaml"
ANYSCALE = REPO / "cluster" / "anyscale" / "compute_config.yaml"
REFERENCE = REPO / "workflows" / "configs" / "dapo_qwen2.5_32b.yaml"
TINY = REPO / "workflows" / "configs" / "tiny_cpu.yaml"


def _by_name(desc: groups.ClusterDescription) -> dict[str, groups.Group]:
    return {g.name: g for g in desc.groups}


def test_the_kuberay_groups_are_read_as_the_operator_sees_them():
    g = _by_name(groups.read(RAYCLUSTER))
    assert g["rollout"] == groups.Group("rollout", {"CPU": 80.0, "GPU": 4.0, "rollout": 1.0}, 0, 8, 180.0)
    # no idleTimeoutSeconds of its own: autoscalerOptions' 300 s
    assert g["trainer"] == groups.Group("trainer", {"CPU": 160.0, "GPU": 8.0, "trainer": 8.0}, 8, 8, 300.0)
    job = groups.read(RAYJOB)
    assert job.kind == "RayJob" and _by_name(job)["rollout"].min_nodes == 2
    assert job.head_resources == {"CPU": 0.0}


def test_the_anyscale_groups_are_read_from_the_compute_config():
    desc = groups.read(ANYSCALE)
    g = _by_name(desc)
    assert desc.kind == "Anyscale compute config" and desc.head_resources == {"CPU": 0.0}
    assert (g["rollout"].custom, g["rollout"].min_nodes, g["rollout"].max_nodes) == ({"rollout": 2.0}, 1, 4)
    assert (g["trainer"].custom, g["trainer"].min_nodes, g["trainer"].max_nodes) == ({"trainer": 8.0}, 8, 8)


@pytest.mark.parametrize("path", [RAYCLUSTER, RAYJOB, ANYSCALE], ids=lambda p: p.name)
def test_the_reference_config_fits_each_cluster_and_the_tiny_one_its_laptop_version(path, tmp_path):
    full = groups.read(path)
    assert fit_problems(load_config(REFERENCE), full) == []
    small = groups.laptop(full, max_nodes=2, idle_timeout_s=10, cpus_per_node=2)
    for g in small.groups:  # GPUs gone, custom resources kept, an autoscaled group 2 nodes at most
        assert "GPU" not in g.resources and g.custom == _by_name(full)[g.name].custom
        assert g.max_nodes == (2 if _by_name(full)[g.name].autoscaled else 1) and g.idle_timeout_s == 10
    changes = [o for o, _ in overlay(load_config(TINY), small, 6, tmp_path, losing_trainer=False)]
    assert "rollout.resources={rollout: 1}" in changes and "trainer.resources={trainer: 1}" in changes
    cfg = load_config(TINY, changes)
    assert fit_problems(cfg, small) == []
    assert cfg.rollout.max_replicas == sum(
        g.max_nodes * int(g.custom.get("rollout", 0)) for g in small.groups
    )


def test_a_config_that_fits_no_group_is_told_why():
    small = groups.laptop(groups.read(RAYCLUSTER), 2, 10, 2)
    (problem,) = fit_problems(
        load_config(TINY, ["rollout.resources={rolout: 1}", "trainer.resources={trainer: 1}"]), small
    )
    assert "rollout.resources={rolout: 1}" in problem and "rollout {rollout: 1}" in problem, problem
    (problem,) = fit_problems(load_config(TINY, ["trainer.num_workers=4", "rollout.resources={rollout: 1}",
                                                 "trainer.resources={trainer: 1}"]), small)  # fmt: skip
    assert "the trainer workers" in problem and "x4" in problem, problem  # 4 workers, 2 CPU slots


def test_the_autoscaler_config_passes_rays_own_schema(tmp_path):
    from ray.autoscaler._private.util import validate_config

    small = groups.laptop(groups.read(RAYCLUSTER), 2, 10, 2)
    config = groups.autoscaler_config(
        small, {"type": "external", "module": "dapo_ray.rehearsal.provider.LocalNodeProvider"}
    )
    validate_config(config)
    assert config["available_node_types"]["rollout"] | {} == {
        "resources": {"CPU": 2.0, "rollout": 1.0}, "node_config": {}, "min_workers": 0, "max_workers": 2,
        "idle_timeout_s": 10}  # fmt: skip
    assert config["available_node_types"]["ray.head.default"]["resources"] == {"CPU": 0.0}


def test_bad_input_is_named(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("kind: Deployment\n")
    with pytest.raises(ValueError, match="x.yaml: neither a KubeRay"):
        groups.read(bad)
    with pytest.raises(ConfigError, match="GROUP@VERSION"):
        _losses(["rollout"])
    assert _losses(["rollout@2", "trainer@4"]) == [("rollout", 2), ("trainer", 4)]
