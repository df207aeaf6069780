"""DAPO steps with the rollout replicas on one node and the trainer workers on another, with no shared
/tmp or /dev/shm between them: the weights reach the replicas through Ray, or the run fails."""

import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def test_three_steps_with_rollout_and_trainers_on_separate_nodes(tiny_model_dir, multinode_cluster):
    # Checkpoints and the final model go to storage every node sees (here the repository's .cache, as an
    # NFS volume would be); the model directory is such a volume too. Nothing else is shared.
    out = ROOT / ".cache" / "multinode-runs" / uuid.uuid4().hex[:8]
    overrides = [
        f"rollout.model_path={tiny_model_dir}", f"trainer.output_dir={out}",
        "rollout.resources={rollout: 1}", "trainer.resources={trainer: 1}",
        "trainer.num_workers=2", "trainer.total_steps=3", "trainer.train_batch_size=4",
        "trainer.gen_batch_size=8", "trainer.mini_batch_size=16", "trainer.micro_batch_size=4",
        "trainer.save_every=0", "eval.every=0", "data.synthetic.num_eval=8", "eval.n=2",
    ]  # fmt: skip
    result = multinode_cluster.run_driver(
        f"""
        import ray
        from dapo_ray.config import load_config
        from dapo_ray.driver import run

        summary = run(load_config({str(ROOT / "workflows/configs/tiny_cpu.yaml")!r}, {overrides!r}))
        nodes = {{n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}}
        emit({{"steps": summary["steps"], "log": summary["steps_log"], "nodes": len(nodes)}})
        """,
        timeout_s=600,
    )
    assert result["steps"] == 3 and result["nodes"] == 3
    for entry in result["log"]:
        m = entry["metrics"]
        assert set(entry["replica_versions"].values()) == {entry["step"]}
        assert m["weight_sync/logprob_max_diff"] < 1e-4  # the replica serves exactly the trainer's weights
        assert m["weight_sync/bytes"] > 0
