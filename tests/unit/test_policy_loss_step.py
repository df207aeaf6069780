"""The trainer's step with each policy loss, Dr. GRPO's aggregation and the rollout correction, on the real
DeepSpeed engine (one CPU rank, gloo): the switches reach the loss, the update is finite, and the
correction's statistics are logged; tokens an older version sampled get weight exactly 1."""

import random

import pytest
import torch

from dapo_ray.config import load_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import Qwen2ForCausalLM

    from dapo_ray.tiny_model import tiny_config

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("policy-loss-tiny")
    Qwen2ForCausalLM(tiny_config(vocab_size=97, hidden=32, layers=2)).save_pretrained(out)
    return out


def _setup(model_dir, overrides: list[str], token_version: int | list[int], mini: int = 8):
    """A config, a DeepSpeed engine and this rank's shard of 16 random responses (2 mini-batches of 2
    micro-batches); `token_version` gives every response's tokens one version, or each its own."""
    from dapo_ray.trainer.batch import build_shards
    from dapo_ray.trainer.loop import build_engines

    cfg = load_config(overrides=["data.source=synthetic", f"rollout.model_path={model_dir}", "trainer.num_workers=1",
                                 "trainer.train_batch_size=2", "rollout.n=8", "trainer.mini_batch_size=8",
                                 "trainer.micro_batch_size=4", "trainer.zero_stage=0", "trainer.warmup_steps=0",
                                 "data.max_prompt_length=16", "rollout.max_response_length=24",
                                 "algorithm.overlong_cache_length=8", *overrides])  # fmt: skip
    rng = random.Random(0)
    batch = []
    for _ in range(16):
        n = rng.randrange(2, 15)
        batch.append({"input_ids": [rng.randrange(1, 97) for _ in range(3 + n)], "n_prompt": 3, "weight": 1.0,
                      "advantage": rng.uniform(-1, 1), "rollout_logprobs": [-4.57 + rng.uniform(-0.7, 0.7) for _ in range(n)],
                      "token_versions": [token_version if isinstance(token_version, int) else token_version[len(batch)]] * n})  # fmt: skip
    torch.manual_seed(0)
    engine, ref = build_engines(cfg, world=1)
    return cfg, engine, ref, build_shards(batch, 1, mini, 4, seed=0)[0]


def _step(model_dir, overrides: list[str], token_version: int) -> dict:
    from dapo_ray.trainer.loop import train_step

    cfg, engine, ref, shard = _setup(model_dir, overrides, token_version)
    return train_step(engine, ref, shard, 3, cfg, world=1)


@pytest.mark.parametrize("overrides", [
    ["algorithm.policy_loss=gspo", "algorithm.eps_low=0.0003", "algorithm.eps_high=0.0004",
     "algorithm.loss_agg_mode=seq-mean-token-mean", "algorithm.rollout_is=sequence"],
    ["algorithm.policy_loss=cispo", "algorithm.eps_low=1.0", "algorithm.loss_agg_mode=seq-mean-token-sum-norm",
     "algorithm.adv_std_norm=false", "algorithm.rollout_is=token", "algorithm.rollout_is_mode=mask",
     "algorithm.rollout_is_threshold=1.2"],
], ids=["gspo-sequence-tis", "cispo-drgrpo-token-mis"])  # fmt: skip
def test_each_switch_trains(gloo_group, model_dir, overrides):
    m = _step(model_dir, overrides, token_version=3)  # every token of the current version: corrected
    assert m["actor/updates"] == 2 and m["actor/skipped_updates"] == 0
    assert 0.0 < m["actor/grad_norm"] < float("inf")
    assert m["rollout_corr/rollout_is_max"] > 1.2 and 0.0 < m["rollout_corr/rollout_is_ratio_fraction_high"] < 1.0
    assert 0.3 < m["rollout_corr/rollout_is_mean"] < 3.0
    if "algorithm.rollout_is_mode=mask" in overrides:
        assert m["rollout_corr/rollout_is_masked_fraction"] == m["rollout_corr/rollout_is_ratio_fraction_high"]
    else:
        assert m["rollout_corr/rollout_is_masked_fraction"] == 0.0


def test_tokens_of_older_versions_are_not_corrected(gloo_group, model_dir):
    m = _step(model_dir, ["algorithm.rollout_is=token", "algorithm.rollout_is_mode=mask"], token_version=2)
    assert m["actor/off_policy_token_frac"] == 1.0
    assert m["rollout_corr/rollout_is_mean"] == 1.0 and m["rollout_corr/rollout_is_max"] == 1.0
    assert m["rollout_corr/rollout_is_masked_fraction"] == 0.0


def test_no_correction_logs_nothing_of_it(gloo_group, model_dir):
    m = _step(model_dir, [], token_version=3)
    assert not [k for k in m if k.startswith("rollout_corr/")]


def test_old_logprobs_are_recomputed_only_for_micro_batches_holding_current_tokens(gloo_group, model_dir):
    """Only the micro-batches that hold a response of the current version (3) run the forward pass; they get
    the same behaviour log-probs as when every micro-batch runs it, the others the engine's. (Two epochs: the
    first mini-batch is prepared too, as it is updated twice.)"""
    from dapo_ray.trainer.loop import _CorrectionTotals, _prepare, _Totals

    versions = [2] * 16
    versions[5] = 3  # one fresh response
    cfg, engine, ref, shard = _setup(model_dir, ["trainer.ppo_epochs=2"], versions)
    counting, calls = _counting(engine)
    prepared = _prepare(counting, ref, shard, 3, cfg, _Totals(), _CorrectionTotals())
    micros = [p for _, ps in prepared for p in ps]
    fresh = [bool(((p.m.version_BT >= 3) & (p.m.mask_BT > 0)).any()) for p in micros]
    assert len(micros) == 4 and sum(fresh) == 1 and len(calls) == 1
    every = _prepare(counting, ref, shard, 2, cfg, _Totals(), _CorrectionTotals())  # all tokens current
    assert len(calls) == 1 + 4
    for p, q, f in zip(micros, [p for _, ps in every for p in ps], fresh, strict=True):
        older_BT = p.m.version_BT < 3
        assert torch.equal(p.old_BT[older_BT], p.m.rollout_BT[older_BT])
        if f:
            assert torch.equal(p.old_BT[~older_BT], q.old_BT[~older_BT])
        else:
            assert torch.equal(p.old_BT, p.m.rollout_BT)


def _counting(engine):
    """`engine`, counting its forward passes (the shapes they ran on, in a list)."""
    calls = []

    class Counting:
        def __getattr__(self, name):
            return getattr(engine, name)

        def __call__(self, ids_BL, *args, **kwargs):
            calls.append(ids_BL.shape)
            return engine(ids_BL, *args, **kwargs)

    return Counting(), calls


@pytest.mark.parametrize("rollout_is", ["none", "token"])
@pytest.mark.parametrize(("mini", "passes_before"), [(16, 0), (8, 2)], ids=["one-update", "two-updates"])
def test_the_first_update_takes_old_logprobs_from_its_own_forward(gloo_group, model_dir, monkeypatch, rollout_is,
                                                                  mini, passes_before):  # fmt: skip
    """One epoch: no pass before the update for the first mini-batch (with one mini-batch, none at all), and
    the same step (statistics, gradient, weights after) as with that pass."""
    from dapo_ray.trainer import loop

    versions = [3, 2] * 8  # half of the responses of the current version
    overrides = [f"trainer.mini_batch_size={mini}", f"algorithm.rollout_is={rollout_is}"]

    def step(shortcut: bool):
        monkeypatch.setattr(loop, "first_from_update", lambda *_: shortcut)
        cfg, engine, ref, shard = _setup(model_dir, overrides, versions, mini=mini)
        counting, calls = _counting(engine)
        m = loop.train_step(counting, ref, shard, 3, cfg, world=1)
        return m, len(calls), [p.detach().clone() for p in engine.module.parameters()]

    fast, n_fast, after_fast = step(True)
    full, n_full, after_full = step(False)
    assert (n_fast, n_full) == (4 + passes_before, 8)  # 4 micro-batches: the updates' passes, and passes before
    assert fast["actor/updates"] == 16 // mini and 0.0 < fast["actor/rollout_logprob_diff"]
    for key in full:
        if not key.startswith("timing/"):
            assert fast[key] == pytest.approx(full[key], rel=1e-5, abs=1e-7), key
    for a, b in zip(after_fast, after_full, strict=True):
        torch.testing.assert_close(a, b)


def test_a_step_with_shared_prompts_is_the_step_without(gloo_group, model_dir):
    """trainer.share_prompts changes how the passes run, not the step: the same clip statistics, entropy
    and gradient norm (two updates, the second off-policy). Gradient checkpointing turns it off (it drops
    the KV cache the shared passes need)."""
    on = _step(model_dir, ["trainer.share_prompts=true"], token_version=3)
    off = _step(model_dir, ["trainer.share_prompts=false"], token_version=3)
    assert on.keys() == off.keys()
    for key in ("actor/entropy", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl", "actor/ratio_mean"):
        assert on[key] == pytest.approx(off[key], rel=1e-4, abs=1e-6), key
    _, engine, _, _ = _setup(model_dir, ["trainer.gradient_checkpointing=true"], 3)
    assert engine.module.share_prompts is False
    _, engine, _, _ = _setup(model_dir, [], 3)
    assert engine.module.share_prompts is True
