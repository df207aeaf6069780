"""bf16 training sums its micro-batch gradients in fp32: the DeepSpeed config the trainer builds is accepted
under ZeRO 1, 2 and 3, and a gradient too small to register beside a bf16 running sum still counts. On the
real DeepSpeed engine (one CPU rank, gloo), driven as train_step drives it: the accumulation boundary set
on the last micro-batch, no division by DeepSpeed's accumulation count."""

import pytest
import torch

from dapo_ray.config import ConfigError, load_config
from dapo_ray.trainer.loop import ds_config, make_optimizer

# 1 + SMALL is 1 in bf16 (8 significant bits), so a bf16 running sum never grows; in fp32 the sum of 1 and
# 256 SMALLs is 1.5, which bf16 holds exactly: ZeRO 1's BF16_Optimizer all-reduces the fp32 sum in bf16
# (DeepSpeed's communication_data_type) at the boundary, one rounding of the total.
SMALL = 2.0**-9
MICRO = 257


class Coefficient(torch.nn.Module):
    """w * c, whose sum (the loss, taken outside the engine as train_step takes it from the log-probs) has
    the gradient c in every element of w."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return self.w * c


def _cfg(stage: int, dtype: str = "bfloat16"):
    return load_config(overrides=["data.source=synthetic", f"trainer.zero_stage={stage}", f"trainer.dtype={dtype}",
                                  "trainer.num_workers=1", "trainer.train_batch_size=4", "rollout.n=4",
                                  "trainer.mini_batch_size=4", "trainer.micro_batch_size=1"])  # fmt: skip


def _accumulated_norm(config: dict, cfg) -> tuple[float, str]:
    """One update from MICRO micro-batches, gradients 1 then SMALL each: (gradient norm, optimizer class)."""
    import deepspeed

    model = Coefficient()
    engine, *_ = deepspeed.initialize(model=model, optimizer=make_optimizer(model.parameters(), cfg), config=config)
    for i in range(MICRO):
        engine.set_gradient_accumulation_boundary(i == MICRO - 1)
        c = torch.tensor(1.0 if i == 0 else SMALL, dtype=torch.bfloat16)
        engine.backward(engine(c).sum(), scale_wrt_gas=False)
    engine.step()
    return float(engine.get_global_grad_norm()), type(engine.optimizer).__name__


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_gradients_accumulate_in_fp32(gloo_group, stage):
    cfg = _cfg(stage)
    config = ds_config(cfg, world=1)
    assert config["data_types"] == {"grad_accum_dtype": "fp32"} and config["bf16"]["enabled"]
    norm, optimizer = _accumulated_norm(config, cfg)
    assert norm == 2.0 * 1.5  # |(g, g, g, g)| = 2 g
    # Under ZeRO 1 DeepSpeed honours fp32 accumulation with its BF16_Optimizer (engine.py,
    # _do_optimizer_sanity_check), under 2 and 3 inside the ZeRO optimizer.
    assert optimizer == {1: "BF16_Optimizer", 2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}[stage]

    # Without the setting DeepSpeed sums in bf16 and the small gradients vanish.
    bf16_sum = {k: v for k, v in config.items() if k != "data_types"}
    assert _accumulated_norm(bf16_sum, cfg)[0] == 2.0


def test_no_fp32_accumulation_without_zero(gloo_group):
    """DeepSpeed refuses bf16 weights with fp32 accumulation without ZeRO, so the config refuses bf16 there."""
    import deepspeed

    with pytest.raises(ConfigError, match="zero_stage >= 1"):
        _cfg(0)
    config = ds_config(_cfg(1), world=1) | {"zero_optimization": {"stage": 0}}
    model = Coefficient()
    with pytest.raises(NotImplementedError, match="unsupported mix"):
        deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    assert "data_types" not in ds_config(_cfg(0, "float32"), world=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2ForCausalLM

    from dapo_ray.tiny_model import tiny_config

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("bf16-tiny")
    Qwen2ForCausalLM(tiny_config(vocab_size=97, hidden=32, layers=2)).save_pretrained(out)
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("budget", [0, 30])
def test_train_step_in_bf16(gloo_group, model_dir, stage, budget):
    """The trainer's own engines and step in bf16 (ZeRO-3: the model built partitioned under the same
    config), with and without a token budget: two updates, a finite gradient. Under ZeRO-3 every pass runs
    the modules in the same order whatever the micro-batch's shape (the head in a fixed number of chunks),
    so DeepSpeed's prefetch trace is dropped once only: the first trace, recorded in a no-grad pass, lacks
    the backward of the first update; the one recorded then holds for every pass after."""
    import random

    from dapo_ray.trainer.batch import build_shards
    from dapo_ray.trainer.loop import build_engines, train_step

    cfg = load_config(overrides=["data.source=synthetic", f"rollout.model_path={model_dir}", "trainer.num_workers=1",
                                 "trainer.train_batch_size=2", "rollout.n=16", "trainer.mini_batch_size=16",
                                 "trainer.micro_batch_size=4", f"trainer.zero_stage={stage}", "trainer.dtype=bfloat16",
                                 f"trainer.micro_batch_tokens={budget}", "trainer.warmup_steps=0",
                                 "trainer.logprob_chunk_size=40", "data.max_prompt_length=96",
                                 "rollout.max_response_length=24", "algorithm.overlong_cache_length=8"])  # fmt: skip
    rng = random.Random(0)
    batch = [{"input_ids": [rng.randrange(1, 97) for _ in range(rng.randrange(5, 20))], "n_prompt": 3, "weight": 1.0,
              "advantage": rng.uniform(-1, 1), "rollout_logprobs": [-4.0] * 20, "token_versions": [0] * 20}
             for _ in range(32)]  # fmt: skip
    torch.manual_seed(0)
    engine, ref = build_engines(cfg, world=1)
    assert ref is None and next(engine.module.parameters()).dtype == torch.bfloat16
    assert engine.module.n_chunks == (3 if budget else 12)  # 120 tokens, or 4 x 120, in chunks of 40
    shard = build_shards(batch, 1, 16, 4, seed=0, micro_batch_tokens=budget)[0]
    dropped = []
    if stage == 3:  # a spy: counts the trace being dropped, and drops it as before
        coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
        drop = coordinator._invalidate_trace
        coordinator._invalidate_trace = lambda: (dropped.append(1), drop())[1]
    for version in (0, 1):
        metrics = train_step(engine, ref, shard, version, cfg, world=1)
        assert metrics["actor/updates"] == 2 and metrics["actor/skipped_updates"] == 0
        assert 0.0 < metrics["actor/grad_norm"] < float("inf") and metrics["actor/entropy"] > 0.0
    if stage == 3:
        assert dropped == [1] and coordinator.is_complete_trace()
        engine.module.n_chunks += 1  # one more head call than the trace holds: the spy sees it dropped
        with torch.no_grad():
            engine(torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long))
        assert dropped == [1, 1]
