"""dapo_ray.algo must stay pure: importing it loads no framework (Ray, vLLM, DeepSpeed, MLflow)."""

import subprocess
import sys


def test_algo_imports_no_framework():
    code = (
        "import sys, dapo_ray.algo, dapo_ray.algo.logprob, dapo_ray.config, dapo_ray.data\n"
        "bad = [m for m in ('ray', 'vllm', 'deepspeed', 'mlflow', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
