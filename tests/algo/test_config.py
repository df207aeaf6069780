import dataclasses
from pathlib import Path

import pytest

from dapo_ray.config import Config, ConfigError, check_model_fits, load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "workflows" / "configs").glob("*.yaml"))


def test_there_are_configs():
    assert {p.name for p in CONFIGS} >= {"dapo_qwen2.5_32b.yaml", "tiny_cpu.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_in_the_repo_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)


def test_paper_config_has_the_paper_hyperparameters():
    cfg = load_config(ROOT / "workflows/configs/dapo_qwen2.5_32b.yaml")
    a, t, r, e = cfg.algorithm, cfg.trainer, cfg.rollout, cfg.eval
    assert (a.eps_low, a.eps_high, a.kl_coef) == (0.2, 0.28, 0.0)
    assert (t.train_batch_size, r.n, t.mini_batch_size) == (512, 16, 512)
    assert cfg.updates_per_step == 16
    assert (t.lr, t.warmup_steps) == (1e-6, 20)
    assert (r.max_response_length, a.overlong_cache_length) == (20480, 4096)
    assert a.dynamic_sampling and a.soft_overlong and a.overlong_filter and a.loss_agg_mode == "token-mean"
    assert (e.n, e.temperature, e.top_p) == (32, 1.0, 0.7)
    assert (r.temperature, r.top_p) == (1.0, 1.0)


def test_overrides_are_typed():
    cfg = load_config(ROOT / "workflows/configs/tiny_cpu.yaml", ["algorithm.eps_high=0.2", "trainer.lr=1e-5",
                      "algorithm.dynamic_sampling=false", "algorithm.clip_ratio_c=null", "eval.files=[a.parquet]"])  # fmt: skip
    assert cfg.algorithm.eps_high == 0.2 and cfg.trainer.lr == 1e-5
    assert cfg.algorithm.dynamic_sampling is False and cfg.algorithm.clip_ratio_c is None
    assert cfg.eval.files == ("a.parquet",)


def test_config_is_frozen():
    cfg = load_config(overrides=["data.source=synthetic"])
    with pytest.raises(AttributeError):
        cfg.trainer.lr = 1.0  # type: ignore[misc]


def test_typo_names_the_key_and_suggests():
    with pytest.raises(ConfigError, match=r"algorithm\.eps_hgih.*did you mean 'algorithm\.eps_high'"):
        load_config(overrides=["data.source=synthetic", "algorithm.eps_hgih=0.3"])
    with pytest.raises(ConfigError, match="unknown config key 'algo'"):
        load_config(overrides=["data.source=synthetic", "algo.eps_high=0.3"])


def test_bad_choice_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"algorithm\.loss_agg_mode.*token-mean.*seq-mean-token-mean"):
        load_config(overrides=["data.source=synthetic", "algorithm.loss_agg_mode=token_mean"])
    with pytest.raises(ConfigError, match=r"reward\.mode.*math_verify"):
        load_config(overrides=["data.source=synthetic", "reward.mode=sympy"])
    for key, value, choices in [("policy_loss", "gpso", r"'dapo', 'gspo', 'cispo'"),
                                ("rollout_is", "tokens", r"'none', 'token', 'sequence'"),
                                ("rollout_is_mode", "clip", r"'truncate', 'mask'"),
                                ("loss_agg_mode", "seq-mean-token-norm", "seq-mean-token-sum-norm")]:  # fmt: skip
        with pytest.raises(ConfigError, match=rf"'algorithm\.{key}' = '{value}' is not one of .*{choices}"):
            load_config(overrides=["data.source=synthetic", f"algorithm.{key}={value}"])
    with pytest.raises(ConfigError, match=r"did you mean 'algorithm\.rollout_is_threshold'"):
        load_config(overrides=["data.source=synthetic", "algorithm.rollout_is_treshold=2"])


def test_the_configs_choices_are_the_algorithms():
    """Each Literal of the algorithm section lists exactly what `dapo_ray.algo` implements."""
    import typing

    from dapo_ray import algo
    from dapo_ray.config import AlgorithmConfig

    hints = typing.get_type_hints(AlgorithmConfig)
    assert typing.get_args(hints["policy_loss"]) == tuple(algo.POLICY_LOSSES)
    assert typing.get_args(hints["loss_agg_mode"]) == algo.LOSS_AGG_MODES
    assert typing.get_args(hints["rollout_is"]) == algo.ROLLOUT_IS_LEVELS
    assert typing.get_args(hints["rollout_is_mode"]) == algo.ROLLOUT_IS_MODES
    assert typing.get_args(hints["kl_estimator"]) == algo.KL_ESTIMATORS


def test_the_new_switches_default_to_dapo_and_are_checked():
    a = load_config(ROOT / "workflows/configs/dapo_qwen2.5_32b.yaml").algorithm
    assert (a.policy_loss, a.adv_std_norm, a.rollout_is, a.rollout_is_threshold, a.rollout_is_mode) == (
        "dapo", True, "none", 2.0, "truncate")  # fmt: skip
    base = ["data.source=synthetic"]
    # CISPO clips a weight: eps_low >= 1 means no lower bound (its paper); a ratio clip needs eps_low < 1.
    assert load_config(overrides=[*base, "algorithm.policy_loss=cispo", "algorithm.eps_low=10"]).algorithm.eps_low == 10
    with pytest.raises(ConfigError, match=r"algorithm\.eps_low must be in \[0, 1\) with policy_loss gspo"):
        load_config(overrides=[*base, "algorithm.policy_loss=gspo", "algorithm.eps_low=1.0"])
    with pytest.raises(ConfigError, match="algorithm.rollout_is_threshold must be >= 1"):
        load_config(overrides=[*base, "algorithm.rollout_is=token", "algorithm.rollout_is_threshold=0.5"])


def test_bad_types_and_cross_field_checks():
    with pytest.raises(ConfigError, match="trainer.lr.*float"):
        load_config(overrides=["data.source=synthetic", "trainer.lr=fast"])
    with pytest.raises(ConfigError, match="true or false"):
        load_config(overrides=["data.source=synthetic", "algorithm.soft_overlong=1"])
    with pytest.raises(ConfigError, match="mini_batch_size"):
        load_config(overrides=["data.source=synthetic", "trainer.mini_batch_size=500"])
    with pytest.raises(ConfigError, match="rollout.n"):
        load_config(overrides=["data.source=synthetic", "rollout.n=1"])
    with pytest.raises(ConfigError, match="train_files"):
        load_config()
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(overrides=["trainer.lr"])
    with pytest.raises(ConfigError, match=r"carry_over needs algorithm\.max_policy_lag >= 2"):
        load_config(overrides=["data.source=synthetic", "algorithm.carry_over=true", "algorithm.max_policy_lag=1"])
    load_config(overrides=["data.source=synthetic", "algorithm.carry_over=true", "algorithm.max_policy_lag=2"])
    with pytest.raises(ConfigError, match=r"data\.warmup\.label_smoothing must be in \[0, 1\), got 1.0"):
        load_config(overrides=["data.source=synthetic", "data.warmup.label_smoothing=1.0"])
    with pytest.raises(ConfigError, match=r"data\.warmup\.target_acc must be in \(0, 1\]"):
        load_config(overrides=["data.source=synthetic", "data.warmup.target_acc=0"])


def test_a_gpu_fraction_below_one_is_refused_where_ray_could_pack_two_ranks_of_one_group_on_a_gpu():
    smoke = ROOT / "workflows" / "configs" / "gpu_smoke.yaml"
    cfg = load_config(smoke)  # half a GPU each for one replica's single rank and one trainer worker
    assert cfg.rollout.gpu_fraction == cfg.trainer.gpu_fraction == 0.5
    with pytest.raises(ConfigError, match=r"rollout\.gpu_fraction \(0\.5\) below 1 needs "
                                          r"rollout\.tensor_parallel_size 1, got 2"):  # fmt: skip
        load_config(smoke, ["rollout.tensor_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"trainer\.gpu_fraction \(0\.5\) below 1 needs trainer\.num_workers 1, "
                                          r"got 2"):  # fmt: skip
        load_config(smoke, ["trainer.num_workers=2"])
    whole = ["rollout.gpu_fraction=1.0", "trainer.gpu_fraction=1.0"]
    load_config(smoke, [*whole, "rollout.tensor_parallel_size=2", "trainer.num_workers=2"])
    # Where no GPU is reserved the fraction means nothing and is not checked.
    load_config(overrides=["data.source=synthetic", "rollout.gpu_fraction=0.5", "rollout.tensor_parallel_size=2",
                           "trainer.gpu_fraction=0.5", "trainer.num_workers=2"])  # fmt: skip


def test_an_autoscaling_window_shorter_than_serves_reports_is_refused(monkeypatch):
    """Serve's replicas and handles report calls in flight every 10 s: a shorter look-back window sees
    gaps, and the fleet flaps (replicas stopped while they start)."""
    autoscaled = ["data.source=synthetic", "rollout.max_replicas=2"]
    with pytest.raises(ConfigError, match=r"rollout.look_back_period_s \(2.0\) must exceed the 10 s"):
        load_config(overrides=autoscaled + ["rollout.look_back_period_s=2"])
    load_config(overrides=["data.source=synthetic", "rollout.look_back_period_s=2"])  # fixed size: unused
    monkeypatch.setenv("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
    monkeypatch.setenv("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "1")
    load_config(overrides=autoscaled + ["rollout.look_back_period_s=2"])


def test_ablation_ladder_rungs_load():
    """Every rung of paper Table 1 is a set of overrides (the README lists them)."""
    from dapo_ray.ablation import LADDER

    base = ROOT / "workflows/configs/dapo_qwen2.5_32b.yaml"
    names = [name for name, _ in LADDER]
    assert names[0] == "naive-grpo" and names[-1] == "dapo"
    cfgs = [load_config(base, overrides) for _, overrides in LADDER]
    naive, dapo = cfgs[0].algorithm, cfgs[-1].algorithm
    assert not naive.overlong_filter and not naive.soft_overlong and not naive.dynamic_sampling
    assert naive.eps_high == naive.eps_low and naive.loss_agg_mode == "seq-mean-token-mean"
    # The paper's GRPO and DAPO have no dual clip (verl's): off on every rung, the only difference
    # between the top rung and the shipped config.
    assert all(c.algorithm.clip_ratio_c is None for c in cfgs)
    assert dapo == dataclasses.replace(load_config(base).algorithm, clip_ratio_c=None)
    # Each rung switches on exactly one technique.
    for lower, upper in zip(cfgs, cfgs[1:], strict=False):
        a, b = dataclasses.asdict(lower.algorithm), dataclasses.asdict(upper.algorithm)
        assert len([k for k in a if a[k] != b[k]]) == 1


def test_variants_beside_the_ladder_change_only_their_methods_switches():
    from dapo_ray.ablation import LADDER, VARIANTS, overrides_for

    base = ROOT / "workflows/configs/tiny_cpu_reasoning.yaml"
    dapo = dataclasses.asdict(load_config(base, LADDER[-1][1]).algorithm)
    changed = {
        "dapo+gspo": {"policy_loss": "gspo", "eps_low": 3e-4, "eps_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"},
        "dapo+cispo": {"policy_loss": "cispo", "eps_low": 1.0},
        "dapo+drgrpo": {"loss_agg_mode": "seq-mean-token-sum-norm", "adv_std_norm": False},
        "dapo+tis": {"rollout_is": "token"},
    }  # fmt: skip
    assert [name for name, _ in VARIANTS] == list(changed)
    for name, _ in VARIANTS:
        a = dataclasses.asdict(load_config(base, overrides_for(name)).algorithm)
        assert {k: v for k, v in a.items() if v != dapo[k]} == changed[name], name
    assert not {name for name, _ in VARIANTS} & {name for name, _ in LADDER}
    with pytest.raises(ValueError, match="dapo\\+gspo"):
        overrides_for("gspo")


def test_a_sequence_longer_than_the_models_context_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "max_position_embeddings": 64}')
    fits = ["data.source=synthetic", f"rollout.model_path={tmp_path}", "data.max_prompt_length=40",
            "rollout.max_response_length=24", "algorithm.overlong_cache_length=8"]  # fmt: skip
    check_model_fits(load_config(overrides=fits))
    with pytest.raises(ConfigError, match=r"data.max_prompt_length \(40\).*= 65 tokens exceeds .*max_position_embeddings 64"):
        check_model_fits(load_config(overrides=[*fits, "rollout.max_response_length=25"]))
    with pytest.raises(ConfigError, match="eval.max_response_length 30"):
        check_model_fits(load_config(overrides=[*fits, "eval.max_response_length=30"]))
    # A model directory that is not on this machine (a cluster path) is left to the cluster.
    check_model_fits(load_config(overrides=[*fits, "rollout.model_path=/models/elsewhere", "rollout.max_response_length=999",
                                            "algorithm.overlong_cache_length=100"]))  # fmt: skip



def test_fastest_dtype_is_bf16_only_where_the_hardware_computes_in_it(monkeypatch, tmp_path):
    from dapo_ray import config

    assert config.fastest_dtype("gpu", "flags : avx2") == "bfloat16"
    assert config.fastest_dtype("cpu", "processor : 0\nflags\t\t: fpu avx2 amx_bf16 amx_tile\n") == "bfloat16"
    assert config.fastest_dtype("cpu", "flags : fpu avx2 avx512f avx512_vnni") == "float32"
    cpuinfo = tmp_path / "cpuinfo"
    monkeypatch.setattr(config, "CPUINFO", str(cpuinfo))
    for flags, dtype in (("avx2 avx512_bf16", "bfloat16"), ("avx2 avx512f", "float32")):
        cpuinfo.write_text(f"processor : 0\nflags : {flags}\n")
        cfg = load_config(ROOT / "workflows" / "configs" / "smollm2_cpu.yaml")
        assert (cfg.rollout.dtype, cfg.trainer.dtype) == (dtype, dtype)
        pinned = load_config(ROOT / "workflows" / "configs" / "smollm2_cpu.yaml", ["rollout.dtype=float32"])
        assert (pinned.rollout.dtype, pinned.trainer.dtype) == ("float32", dtype)
    cpuinfo.unlink()  # no /proc/cpuinfo (not Linux): float32
    assert load_config(ROOT / "workflows" / "configs" / "smollm2_cpu.yaml").trainer.dtype == "float32"


def test_an_override_yaml_cannot_read_is_taken_as_written_and_a_misread_one_says_to_quote_it():
    assert load_config(ROOT / "workflows" / "configs" / "smollm2_cpu.yaml", ["data.synthetic.operators=*"]).data.synthetic.operators == "*"
    with pytest.raises(ConfigError, match="quote it"):
        load_config(ROOT / "workflows" / "configs" / "smollm2_cpu.yaml", ["data.synthetic.operators=-"])
    quoted = load_config(ROOT / "workflows" / "configs" / "smollm2_cpu.yaml", ["data.synthetic.operators='-'"])
    assert quoted.data.synthetic.operators == "-"


def test_the_engines_start_up_time_is_a_checked_key():
    """`rollout.engine_ready_timeout_s` keeps vLLM's 600 s unless set; the 32B recipe waits longer."""
    assert load_config(overrides=["data.source=synthetic"]).rollout.engine_ready_timeout_s == 600
    assert load_config(ROOT / "workflows/configs/dapo_qwen2.5_32b.yaml").rollout.engine_ready_timeout_s > 600
    with pytest.raises(ConfigError, match="did you mean 'rollout.engine_ready_timeout_s'"):
        load_config(overrides=["data.source=synthetic", "rollout.engine_ready_timout_s=900"])
    with pytest.raises(ConfigError, match=r"rollout\.engine_ready_timeout_s must be >= 1, got 0"):
        load_config(overrides=["data.source=synthetic", "rollout.engine_ready_timeout_s=0"])


@pytest.mark.parametrize("name", ["smollm2_cpu.yaml", "mathematics_cpu.yaml"])
def test_the_real_model_configs_update_more_than_once_a_step_so_clip_higher_can_bind(name):
    """With one update a step the ratio is exactly 1 on it and Clip-Higher is a switch that does nothing."""
    cfg = load_config(ROOT / "workflows" / "configs" / name)
    assert cfg.trainer.train_batch_size * cfg.rollout.n // cfg.trainer.mini_batch_size >= 2
    assert cfg.algorithm.eps_high > cfg.algorithm.eps_low
