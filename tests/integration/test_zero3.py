"""ZeRO-3 loading and layer-by-layer gathering (dapo_ray.trainer.zero) on 2 CPU ranks of a real
Ray Train TorchTrainer. Each rank saves what it observed under tmp_path; the test compares it with the
checkpoint and with a plain (non-ZeRO) copy of the model in the test process."""

import math
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

WORLD = 2


def _ds_config(stage: int, persist_small: bool = False) -> dict:
    zero = {"stage": stage}
    if stage == 3 and not persist_small:
        # Parameters of at most this many elements stay gathered on every rank by design (default 1e5:
        # all of the tiny model's); 0 makes the tiny model partition like the big layers of a 32B one.
        zero["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "zero_optimization": zero, "bf16": {"enabled": False}, "steps_per_print": 10**9}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(small_random_model_dir) -> Path:
    return small_random_model_dir


@pytest.fixture(scope="module")
def plain_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


# ---- what the workers run -------------------------------------------------------------------------------


def _worker(cfg: dict) -> None:
    """One run for all parts (each TorchTrainer start costs tens of seconds here): a ZeRO-3 policy, a
    frozen ZeRO-3 reference model beside it, a ZeRO-3 policy with DeepSpeed's default persistence
    threshold (loop.py's config), then a stage-1 policy, all in the same process."""
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    obs = _zero3_policy(cfg["model_dir"], cfg["final_dir"], rank)
    obs["persistent"] = _zero3_persistent_params(cfg["model_dir"], rank)
    obs["stage1"] = _stage1_policy(cfg["model_dir"], rank)
    torch.save(obs, Path(cfg["out"]) / f"rank{rank}.pt")


def _full_gather(module) -> dict:
    """The one-shot gather that gathered_layers replaces: every parameter at once (a collective)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def _train_step(engine, rank: int) -> float:
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(rank))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def _zero3_policy(model_dir: str, final_dir: str, rank: int) -> dict:
    """Load under ZeRO-3, train one step, then gather layer by layer while recording what is gathered."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from dapo_ray.trainer.zero import full_state_dict_cpu, gathered_layers, load_causal_lm

    ds_config = _ds_config(3)
    model = load_causal_lm(model_dir, torch.float32, ds_config)
    obs = {"construction": {n: [hasattr(p, "ds_id"), p.data.numel(), p.ds_numel, p.ds_tensor.numel()]
                            for n, p in model.named_parameters()}}  # fmt: skip
    obs["loaded"] = _full_gather(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    obs["loss"] = _train_step(engine, rank)
    obs["trained"] = _full_gather(engine.module)

    named = list(engine.module.named_parameters())

    def available() -> list[str]:
        return sorted(n for n, p in named if p.ds_status == ZeroParamStatus.AVAILABLE)

    at_gather: list[list[str]] = []
    real = deepspeed.zero.GatheredParameters

    class Recording(real):
        def __enter__(self):
            super().__enter__()
            if self.enabled:
                at_gather.append(available())

    obs["available_before"] = available()
    deepspeed.zero.GatheredParameters = Recording
    try:
        obs["groups"], obs["in_loop"] = [], []
        for group in gathered_layers(engine.module, 3, rank):
            obs["in_loop"].append(available())
            obs["groups"].append(group)
    finally:
        deepspeed.zero.GatheredParameters = real
    obs["at_gather"] = at_gather
    obs["loss_after_gather"] = _train_step(engine, rank)  # the engine still trains
    sd = full_state_dict_cpu(engine.module, 3, rank)
    obs["full_is_none"] = sd is None
    if rank == 0:  # how the lead writes the final HF model under ZeRO-3
        engine.module.save_pretrained(final_dir, state_dict=sd)
        obs["trained_twice"] = sd

    # A frozen reference model beside the policy, as the trainer will hold one.
    obs["reference"] = _frozen_reference(model_dir, rank)
    policy = _full_gather(engine.module)  # a collective: every rank
    if rank == 0:
        obs["policy_after_reference"] = policy
    return obs


def _frozen_reference(model_dir: str, rank: int) -> dict:
    """The reference-model recipe of load_causal_lm's docstring: a ZeRO-3 engine without an optimizer."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from dapo_ray.trainer.zero import load_causal_lm

    ds_config = _ds_config(3)
    ref = load_causal_lm(model_dir, torch.float32, ds_config).requires_grad_(False)
    ref_engine, *_ = deepspeed.initialize(model=ref, config=ds_config)
    ref_engine.eval()
    obs = {"ids": [], "logits": []}
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own batches, as in data parallelism
    for length in (7, 13):
        ids = torch.randint(1, 97, (3, length), generator=gen)
        with torch.no_grad():
            obs["logits"].append(ref_engine(input_ids=ids).logits)
        obs["ids"].append(ids)
    params = list(ref_engine.module.parameters())
    obs["partitioned_after"] = all(
        p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p.data.numel() == 0 for p in params
    )
    obs["requires_grad"] = any(p.requires_grad for p in params)
    return obs


def _zero3_persistent_params(model_dir: str, rank: int) -> dict:
    """Default persistence threshold: every tiny parameter is "persistent", kept gathered between steps.
    gathered_layers re-partitions them; the engine must gather them again and keep training."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from dapo_ray.trainer.zero import gathered_layers, load_causal_lm

    ds_config = _ds_config(3, persist_small=True)
    model = load_causal_lm(model_dir, torch.float32, ds_config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    obs = {"losses": [_train_step(engine, rank)], "groups": [], "one_shot": []}
    obs["persist"] = all(p.ds_persist for p in engine.module.parameters())
    for _ in range(2):
        obs["one_shot"].append(_full_gather(engine.module))
        obs["groups"].append(list(gathered_layers(engine.module, 3, rank)))
        obs["losses"].append(_train_step(engine, rank))
    obs["available_after_step"] = all(
        p.ds_status == ZeroParamStatus.AVAILABLE for p in engine.module.parameters()
    )
    return obs


def _stage1_policy(model_dir: str, rank: int) -> dict:
    import deepspeed

    from dapo_ray.trainer.zero import full_state_dict_cpu, gathered_layers, load_causal_lm

    ds_config = _ds_config(1)
    model = load_causal_lm(model_dir, torch.float32, ds_config)
    obs = {"any_ds_id": any(hasattr(p, "ds_id") for p in model.parameters())}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    obs["loss"] = _train_step(engine, rank)
    obs["state_dict"] = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    obs["groups"] = list(gathered_layers(engine.module, 1, rank))
    sd = full_state_dict_cpu(engine.module, 1, rank)
    obs["full"] = {} if sd is None else sd
    obs["full_is_none"] = sd is None
    return obs


# ---- the tests ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(ray_cluster, model_dir, tmp_path_factory) -> tuple[list[dict], Path]:
    """Run `_worker` on 2 CPU ranks; what each rank observed, by rank, and the final HF directory that
    rank 0 wrote from the ZeRO-3 policy."""
    import ray.cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # The workers cannot import this test module by name: ship its functions by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    tmp = tmp_path_factory.mktemp("zero3-run")
    out, final = tmp / "observed", tmp / "final"
    out.mkdir()
    TorchTrainer(
        _worker, train_loop_config={"model_dir": str(model_dir), "final_dir": str(final), "out": str(out)},
        scaling_config=ScalingConfig(num_workers=WORLD, use_gpu=False),
        run_config=RunConfig(name="zero3", storage_path=str(tmp / "ray")),
    ).fit()  # fmt: skip
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)], final


def test_zero3_loads_partitioned_and_trains(run, model_dir):
    from safetensors.torch import load_file

    ranks, _ = run
    ckpt = load_file(str(model_dir / "model.safetensors"))
    for obs in ranks:
        # Partitioned at construction (before deepspeed.initialize): no rank holds a full tensor.
        assert set(obs["construction"]) == set(ckpt)
        for name, (has_ds_id, local_numel, ds_numel, part_numel) in obs["construction"].items():
            assert has_ds_id and local_numel == 0, name
            assert ds_numel == ckpt[name].numel(), name
            assert part_numel == math.ceil(ds_numel / WORLD), name
        # Gathered, the partitions are the checkpoint, exactly.
        for name, t in ckpt.items():
            assert torch.equal(obs["loaded"][name], t), name
        # One optimizer step trains: every tensor moved (AdamW's weight decay alone moves all of them).
        assert math.isfinite(obs["loss"])
        assert all(not torch.equal(obs["trained"][n], ckpt[n]) for n in ckpt)
    # The ranks agree on the trained weights.
    for name in ckpt:
        assert torch.equal(ranks[0]["trained"][name], ranks[1]["trained"][name]), name


def test_gathered_layers_zero3_one_layer_at_a_time(run, plain_model):
    from transformers import AutoModelForCausalLM

    ranks, final = run
    expected = list(plain_model.state_dict())

    def layer(i: int) -> list[str]:
        return [k for k in expected if k.startswith(f"model.layers.{i}.")]

    expected_groups = [
        ["model.embed_tokens.weight"],
        layer(0),
        layer(1),
        ["model.norm.weight"],
        ["lm_head.weight"],
    ]
    r0, r1 = ranks

    # Rank 0: the names of a non-ZeRO state_dict, in order, grouped by layer; the one-shot gather's values.
    assert [[n for n, _ in g] for g in r0["groups"]] == expected_groups
    assert [n for g in r0["groups"] for n, _ in g] == expected
    for name, t in (item for g in r0["groups"] for item in g):
        assert t.device.type == "cpu" and torch.equal(t, r0["trained"][name]), name
    # Other ranks: one empty list per group, so every rank iterates in step.
    assert r1["groups"] == [[] for _ in expected_groups]

    for obs in ranks:
        # Nothing gathered before; at each gather exactly that group's parameters; nothing while the
        # caller holds a group (the gathered memory is released before it is yielded).
        assert obs["available_before"] == []
        assert obs["at_gather"] == [sorted(g) for g in expected_groups]
        assert obs["in_loop"] == [[] for _ in expected_groups]
        assert math.isfinite(obs["loss_after_gather"])  # the engine still trains after gathering

    # full_state_dict_cpu: the dict on rank 0 only; save_pretrained with it writes a loadable HF model.
    assert not r0["full_is_none"] and r1["full_is_none"]
    reloaded = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).state_dict()
    assert list(reloaded) == expected
    for name, t in r0["trained_twice"].items():
        assert torch.equal(reloaded[name], t), name
    assert any(not torch.equal(r0["trained_twice"][n], r0["trained"][n]) for n in expected)


def test_gathered_layers_zero3_persistent_params(run):
    """loop.py's ZeRO-3 config keeps DeepSpeed's default persistence threshold: small parameters stay
    gathered between steps. gathered_layers still yields the one-shot gather's values, and the engine,
    which gathers them again, keeps training in step across ranks."""
    ranks, _ = run
    r0, r1 = (obs["persistent"] for obs in ranks)
    assert r0["persist"] and r0["available_after_step"]
    assert all(math.isfinite(x) for x in r0["losses"] + r1["losses"])
    for groups, one_shot in zip(r0["groups"], r0["one_shot"], strict=True):
        items = dict(item for g in groups for item in g)
        assert list(items) == list(one_shot)
        assert all(torch.equal(items[n], one_shot[n]) for n in one_shot)
    before, after = r0["one_shot"]
    assert all(not torch.equal(before[n], after[n]) for n in before)  # the step between them trained
    for n in after:
        assert torch.equal(after[n], r1["one_shot"][1][n]), n  # the ranks agree


def test_gathered_layers_stage1_is_the_state_dict(run):
    ranks, _ = run
    r0, r1 = (obs["stage1"] for obs in ranks)
    assert not r0["any_ds_id"] and not r1["any_ds_id"]  # stages 0-2: a plain from_pretrained
    assert math.isfinite(r0["loss"])
    sd = r0["state_dict"]
    items = [item for g in r0["groups"] for item in g]
    assert [n for n, _ in items] == list(sd)
    for name, t in items:
        assert torch.equal(t, sd[name]), name
    assert r1["groups"] == [[] for _ in r0["groups"]] and len(r0["groups"]) == 5
    assert list(r0["full"]) == list(sd) and all(torch.equal(r0["full"][k], sd[k]) for k in sd)
    assert not r0["full_is_none"] and r1["full_is_none"]


def test_frozen_reference_model_forward_zero3(run, plain_model):
    ranks, _ = run
    for obs in ranks:
        ref = obs["reference"]
        assert ref["partitioned_after"] and not ref["requires_grad"]
        for ids, logits in zip(ref["ids"], ref["logits"], strict=True):
            with torch.no_grad():
                want = plain_model(input_ids=ids).logits
            torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    # The policy beside it is untouched.
    r0 = ranks[0]
    assert all(torch.equal(r0["policy_after_reference"][n], t) for n, t in r0["trained_twice"].items())
    assert not torch.equal(ranks[0]["reference"]["ids"][0], ranks[1]["reference"]["ids"][0])


def test_zero3_dtype_must_match_the_partition_dtype(model_dir):
    """zero.Init casts parameters to the config's dtype (bf16 only when "bf16" is enabled): refuse a mismatch."""
    from dapo_ray.trainer.zero import load_causal_lm

    with pytest.raises(ValueError, match="bf16"):
        load_causal_lm(str(model_dir), torch.bfloat16, _ds_config(3))
