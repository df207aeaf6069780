"""DAPO steps with the rollout replicas on one node and the trainer workers on another, with no shared
/tmp or /dev/shm between them: the weights reach the replicas through Ray, or the run fails. Checkpoints
and the final model go to object storage (a local S3 server), and a second driver resumes from there."""

import time
from pathlib import Path

import pytest

from dapo_ray import storage

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def test_steps_across_nodes_checkpoint_to_object_storage_and_resume(tiny_model_dir, multinode_cluster, s3_prefix,
                                                                    scrape, tmp_path):  # fmt: skip
    overrides = [
        f"rollout.model_path={tiny_model_dir}", f"trainer.output_dir={s3_prefix}",
        f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "rollout.resources={rollout: 1}", "trainer.resources={trainer: 1}",
        "trainer.num_workers=2", "trainer.train_batch_size=4",
        "trainer.gen_batch_size=8", "trainer.mini_batch_size=16", "trainer.micro_batch_size=4",
        "trainer.save_every=2", "eval.every=0", "data.synthetic.num_eval=8", "eval.n=2",
    ]  # fmt: skip
    script = f"""
        import os

        import ray
        from dapo_ray.config import load_config
        from dapo_ray.driver import run

        # Credentials of the object storage (this driver's environment: s3_prefix sets them) reach every
        # worker through the job's environment.
        ray.init(runtime_env={{"env_vars": {{k: v for k, v in os.environ.items() if k.startswith("AWS_")}}}})
        summary = run(load_config({str(ROOT / "workflows/configs/tiny_cpu.yaml")!r}, {overrides!r} + ARGS))
        nodes = {{n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}}
        emit({{"start": summary["start_step"], "steps": summary["steps"], "log": summary["steps_log"],
              "final": summary["final_model"], "nodes": len(nodes)}})
        """
    first = multinode_cluster.run_driver(script.replace("ARGS", repr(["trainer.total_steps=2"])), timeout_s=600)
    assert first["start"] == 0 and first["steps"] == 2 and first["nodes"] == 3
    _check_each_node_exports_its_metrics(multinode_cluster, scrape, run=storage.name(s3_prefix), steps=2)
    # The same command with more steps: a new driver finds the step-2 checkpoint in object storage.
    second = multinode_cluster.run_driver(script.replace("ARGS", repr(["trainer.total_steps=3"])), timeout_s=600)
    assert second["start"] == 2 and second["steps"] == 3
    for entry in first["log"] + second["log"]:
        m = entry["metrics"]
        assert set(entry["replica_versions"].values()) == {entry["step"]}
        assert m["weight_sync/logprob_max_diff"] < 1e-4  # the replica serves exactly the trainer's weights
        assert m["weight_sync/bytes"] > 0
    # The final model is in object storage, a HF directory that transformers loads.
    assert second["final"] == storage.join(s3_prefix, "final_model")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = storage.download_dir(second["final"], tmp_path / "final_model")
    AutoModelForCausalLM.from_pretrained(local)
    assert AutoTokenizer.from_pretrained(local).encode("Answer: 7")


def _check_each_node_exports_its_metrics(cluster, scrape, run: str, steps: int) -> None:
    """Ray metrics come from the process that measured them, through its own node's endpoint: the
    driver's from the head, each replica's from the rollout node, each trainer worker's from the
    trainer node (Ray reports every 10 s by default, so the last step may take that long to arrive).
    The run is over and its processes gone, so their gauges have left the endpoints: counters stay."""
    expected = {
        "head": [("ray_dapo_steps_total", {}, steps)],
        "rollout": [("ray_dapo_rollout_weight_loads_total", {}, steps)],
        "trainer": [("ray_dapo_trainer_steps_total", {"rank": "0"}, steps),
                    ("ray_dapo_trainer_steps_total", {"rank": "1"}, steps)],
    }  # fmt: skip
    deadline = time.time() + 60
    while True:
        samples = {node: scrape(cluster.metrics_url(node)) for node in expected}
        found = {
            node: [v for name, labels, want in wanted for n, lab, v in samples[node]
                   if n == name and lab.get("run") == run and labels.items() <= lab.items()]
            for node, wanted in expected.items()
        }  # fmt: skip
        done = {node: found[node] == [want for *_, want in expected[node]] for node in expected}
        if all(done.values()) or time.time() > deadline:
            break
        time.sleep(2)
    assert all(done.values()), f"expected {expected}, found {found}"
    tokens = [v for n, lab, v in samples["rollout"] if n == "ray_dapo_rollout_generated_tokens_total" and lab.get("run") == run]
    assert len(tokens) == 1 and tokens[0] > 0, tokens  # the one replica, on the rollout node
    on_trainer_node = {n for n, *_ in samples["trainer"]}
    assert "ray_dapo_rollout_generated_tokens_total" not in on_trainer_node
