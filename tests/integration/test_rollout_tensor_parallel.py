"""A rollout replica with tensor_parallel_size 2 on the CPU engine follows the weight store: the trainer
publishes new weights, the replica's two vLLM workers (processes the replica spawned, in its placement
group of two one-CPU bundles) fetch them from the store, and the replica's log-probs are then the
trainer's."""

import time

import pytest
import ray
from ray import serve
from test_engine_weight_load import Trainer, gap, perturbed, trainer_logprobs

from dapo_ray.config import RolloutConfig
from dapo_ray.rollout.deployment import APP_NAME, deploy_rollout, wait_synced
from dapo_ray.weights import create_store

pytestmark = pytest.mark.integration

STORE = "weights-rollout-tp2"


def test_a_tensor_parallel_replica_serves_the_published_weights(ray_cluster, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = ["What is 12+30? Answer: 42", "7*6=42\nAnswer: 42", "hello world"]
    probe_ids = [tok.encode(t) for t in texts]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype="float32")
    base = {k: v.clone() for k, v in model.state_dict().items()}

    store = create_store(STORE)
    cfg = RolloutConfig(model_path=str(tiny_model_dir), n=2, max_response_length=16, num_replicas=1,
                        tensor_parallel_size=2, enforce_eager=True, dtype="float32")  # fmt: skip
    try:
        t0 = time.perf_counter()
        handle = deploy_rollout(cfg, max_model_len=128, store_name=STORE, seed=1)
        started = time.perf_counter() - t0

        def served() -> list[float]:
            out = []
            for ids in probe_ids:
                out += handle.sequence_logprobs.remote(ids).result()[1]
            return out

        assert gap(served(), trainer_logprobs(tiny_model_dir, base, probe_ids)) < 1e-4
        new = perturbed(base, seed=7)
        trainer = Trainer.remote()  # owns the published object: kept alive while the replica fetches it
        ray.get(trainer.publish.remote(store, 1, new))
        t1 = time.perf_counter()
        assert list(wait_synced(store, 1, timeout_s=120).values()) == [1]
        synced = time.perf_counter() - t1
        got = served()
        print(f"TP-2 replica: started in {started:.1f}s, synced in {synced:.2f}s, "
              f"|replica - trainer| {gap(got, trainer_logprobs(tiny_model_dir, new, probe_ids)):.2e}")
        assert gap(got, trainer_logprobs(tiny_model_dir, new, probe_ids)) < 1e-4
    finally:
        serve.delete(APP_NAME)
        ray.kill(store)
