"""The rollout stream's abort through a real Serve replica (algorithm.stale_groups resample): aborted
groups never come back, their Serve calls are cancelled on the replica, and its engine drops their
requests from the batch at once while the other groups run on."""

import queue
import time

import pytest
from ray import serve

from dapo_ray.config import RolloutConfig
from dapo_ray.pipeline import SamplingSpec, ScoringSpec
from dapo_ray.random_model import build_random_model
from dapo_ray.rollout.deployment import APP_NAME, deploy_rollout
from dapo_ray.stream import Stream, wait_any
from dapo_ray.tasks import RewardSpec
from dapo_ray.weights import create_store

pytestmark = pytest.mark.integration

N, MAX_TOKENS = 4, 900


def test_aborted_groups_leave_the_replicas_batch_and_never_come_back(tmp_path, ray_cluster):
    import ray

    # Random weights over 4096 tokens: a response rarely samples the end token, so it runs to max_tokens.
    model = build_random_model(tmp_path / "random", "qwen2.5-0.5b", dtype="float32", hidden_size=64,
                               intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=1, vocab_size=4096, log=lambda _: None)  # fmt: skip
    store = create_store("weights-stream-abort")
    cfg = RolloutConfig(model_path=str(model), n=N, max_response_length=MAX_TOKENS, num_replicas=1, min_replicas=1,
                        max_replicas=1, enforce_eager=True, dtype="float32")  # fmt: skip
    stream = None
    try:
        handle = deploy_rollout(cfg, max_model_len=1024, store_name="weights-stream-abort", seed=1)
        stream = Stream(APP_NAME, SamplingSpec(N, 1.0, 1.0, MAX_TOKENS),
                        ScoringSpec(RewardSpec("dapo"), MAX_TOKENS, True, 8, 1.0, True, 1e-6, True))  # fmt: skip
        rows = [{"uid": str(i), "draw": f"0:{i}", "prompt_ids": [5 + i, 6, 7, 8], "ground_truth": "1"} for i in range(8)]
        t0 = time.time()
        stream.admit(rows)
        deadline = t0 + 60
        while max((n for _, n in handle.trace.remote(t0).result()), default=0) < 8 * N and time.time() < deadline:
            time.sleep(0.05)
        t_abort = time.time()
        aborted = stream.abort([r["draw"] for r in rows[2:]])
        assert [r["draw"] for r in aborted] == [f"0:{i}" for i in range(2, 8)] and set(stream.in_flight) == {"0:0", "0:1"}
        back = sorted(wait_any(stream, deadline_s=120)["draw"] for _ in range(2))
        t_end = time.time()
        assert back == ["0:0", "0:1"] and not stream.in_flight
        with pytest.raises(queue.Empty):  # nothing else comes back: the aborted groups are gone
            stream.next_group(timeout_s=2.0)
        trace = handle.trace.remote(t0).result()
        assert max(n for t, n in trace if t < t_abort) == 8 * N  # all eight groups ran together
        # Soon after the abort only the two remaining groups' sequences are left in the batch, for many
        # steps while they run on. Without the engine's abort the other 24 would run to max_tokens beside
        # them, and all 32 would end together.
        after = [(t, n) for t, n in trace if t_abort < t < t_end]
        dropped = next((i for i, (_, n) in enumerate(after) if n <= 2 * N), None)
        assert dropped is not None, f"the batch never fell to {2 * N} sequences: {after[-5:]}"
        assert after[dropped][0] - t_abort < 5.0
        assert all(n <= 2 * N for _, n in after[dropped:])
        assert sum(0 < n <= 2 * N for _, n in after) >= 10, after[-12:]
        assert handle.stats.remote().result()["in_flight"] == 0
    finally:
        if stream is not None:
            stream.close()
        serve.delete(APP_NAME)
        ray.kill(store)
