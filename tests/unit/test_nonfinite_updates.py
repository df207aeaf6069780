"""An update whose gradients hold a NaN or an inf is skipped and counted, and the weights stay as they
were; the next finite update applies. On the real DeepSpeed engine the trainer builds (one CPU rank,
gloo), with ZeRO stage 0 (our GuardedAdamW) and stage 1 (DeepSpeed's own check, fp32 and bf16)."""

import pytest
import torch

from dapo_ray.config import load_config
from dapo_ray.trainer.loop import ds_config, make_optimizer


@pytest.mark.parametrize("stage, dtype", [(0, "float32"), (1, "float32"), (1, "bfloat16")])
def test_a_nonfinite_gradient_skips_the_update(gloo_group, stage, dtype):
    import deepspeed

    cfg = load_config(overrides=["data.source=synthetic", f"trainer.zero_stage={stage}", "trainer.mini_batch_size=4",
                                 "trainer.micro_batch_size=4", "trainer.num_workers=1", "trainer.train_batch_size=4",
                                 "rollout.n=4", "trainer.lr=1e-2", f"trainer.dtype={dtype}"])  # fmt: skip
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(getattr(torch, dtype))
    optimizer = make_optimizer(model.parameters(), cfg)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(cfg, world=1))
    x = torch.randn(4, 4, dtype=getattr(torch, dtype))

    def update(poison: float) -> list[torch.Tensor]:
        before = [p.detach().clone() for p in engine.module.parameters()]
        engine.backward(engine(x).pow(2).mean() * poison)
        engine.step()
        return [not torch.equal(b, p.detach()) for b, p in zip(before, engine.module.parameters(), strict=True)]

    assert not any(update(float("nan")))
    assert not any(update(float("nan")))
    assert not any(update(float("inf")))
    assert engine.skipped_steps == 3 and engine.global_steps == 3
    assert all(update(1.0))  # the gradients of the skipped updates are gone: a finite one applies
    assert engine.skipped_steps == 3 and engine.global_steps == 4
    assert all(torch.isfinite(p).all() for p in engine.module.parameters())
