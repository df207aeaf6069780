"""Every metric dapo-ray logs, with its one definition. Names follow verl where one exists.

The driver logs these to MLflow (and prints a progress line); `METRICS` is the single registry, and a
test checks that every logged key is in it.
"""

from __future__ import annotations

METRICS: dict[str, str] = {
    # rollout and reward
    "critic/score/mean": "mean shaped reward (correctness +1/-1 plus soft overlong penalty) of the batch's responses",
    "critic/acc/mean": "share of the batch's responses judged correct",
    "rollout/acc_all_generated": "share of correct responses among every generated response of the step",
    "rollout/solve_all_ratio": "share of generated prompts whose responses were all correct (paper Fig. 3b)",
    "rollout/solve_none_ratio": "share of generated prompts whose responses were all wrong",
    "response_length/mean": "mean response length in tokens, batch responses",
    "response_length/clip_ratio": "share of batch responses truncated at max_response_length",
    "rollout/policy_version_lag": "mean (current version - version that generated the response), batch responses",
    # dynamic sampling
    "dynamic_sampling/rounds": "generation rounds this step",
    "dynamic_sampling/generated_groups": "prompts (groups) generated this step",
    "dynamic_sampling/kept_groups": "generated groups that passed the filter this step",
    "dynamic_sampling/batch_groups": "groups trained on this step",
    "dynamic_sampling/carried_in": "kept groups carried over from the previous step",
    "dynamic_sampling/carried_out": "kept groups carried into the next step",
    "dynamic_sampling/partial": "1 if the cap was hit and the step trained on a partial batch",
    # actor
    "actor/entropy": "mean entropy of the policy over response tokens, before the update",
    "actor/rollout_logprob_diff": "mean |trainer log-prob - engine log-prob| of the sampled tokens",
    "actor/pg_clipfrac_upper": "share of tokens clipped by 1 + eps_high (A > 0)",
    "actor/pg_clipfrac_lower": "share of tokens clipped by 1 - eps_low (A < 0)",
    "actor/pg_clipfrac_dual": "share of tokens bounded by the dual clip",
    "actor/ppo_kl": "mean old_logp - logp over updates (k1 estimate)",
    "actor/ratio_mean": "mean importance ratio pi / pi_old",
    "actor/grad_norm": "mean gradient norm over the step's updates",
    "actor/lr": "learning rate of the step",
    "actor/updates": "optimizer steps this RL step",
    "actor/mean_token_prob": "mean probability of the sampled tokens under the rollout policy",
    # weight sync
    "weight_sync/bytes": "bytes of the published weights",
    "weight_sync/publish_s": "seconds to write and publish the weights",
    "weight_sync/wait_s": "seconds until every replica served the new version",
    "weight_sync/logprob_max_diff": "max |engine - trainer| log-prob of a fixed probe sequence after sync",
    "weight_sync/replicas": "replicas serving the new version",
    # timing
    "timing/generate_s": "seconds of generation and scoring this step",
    "timing/old_logprob_s": "seconds recomputing old log-probs",
    "timing/update_s": "seconds of gradient updates",
    "timing/weight_sync_s": "seconds of the trainer's weight publish",
    "timing/step_s": "wall seconds of the whole step",
    # evaluation
    "eval/avg_at_k": "mean accuracy over k samples per held-out problem",
    "eval/pass_at_k": "share of held-out problems with at least one correct sample",
}


def check_known(keys) -> list[str]:
    """Keys that are not in the registry (a test keeps this empty)."""
    return [k for k in keys if k not in METRICS]


class Tracker:
    """MLflow logging of params and registered metrics; a no-op when disabled."""

    def __init__(self, enabled: bool, tracking_uri: str, experiment: str, run_name: str, params: dict):
        self.enabled = enabled
        if not enabled:
            return
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri(tracking_uri)
        mlflow.set_experiment(experiment)
        self.run = mlflow.start_run(run_name=run_name)
        mlflow.log_params({k: str(v)[:250] for k, v in params.items()})

    def log(self, metrics: dict, step: int) -> None:
        if self.enabled:
            self.mlflow.log_metrics({k: float(v) for k, v in metrics.items() if k in METRICS}, step=step)

    def close(self) -> None:
        if self.enabled:
            self.mlflow.end_run()
