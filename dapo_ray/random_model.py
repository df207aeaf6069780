"""A randomly initialised model of a real model's shape, built locally, for GPU smoke runs and benchmarks
where no weights can be downloaded.

`build_random_model(out_dir, "qwen2.5-0.5b")` writes a HF model directory with Qwen2.5-0.5B's
architecture (layers, widths, heads, vocabulary, context) and random weights, and a tokenizer whose
vocabulary is exactly the model's: the demo's character tokens (so prompts of the synthetic task
tokenize as usual) and placeholder tokens `<|r123|>` up to the vocabulary size, so every id the engine
samples decodes to something. Its answers are noise: a smoke run checks that the machinery runs
(engine start-up, generation, NCCL, ZeRO, weight sync, checkpoints), not that accuracy moves.

One departure from the real shape: the embeddings are untied, so the head is a weight of its own in every
sync (and in the benchmarks' byte counts). Tied embeddings are the real model's case: SmolLM2-135M-Instruct
(`dapo_ray.smollm2`, `tests/integration/test_smollm2.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

# The published configs' shape fields (Qwen/Qwen2.5-*/config.json).
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768),
    "qwen2.5-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                        num_key_value_heads=8, vocab_size=152064, max_position_embeddings=32768),
}  # fmt: skip


def random_config(shape: str, **overrides):
    """The Qwen2 config of `shape` (a key of SHAPES), untied, with `overrides` (e.g. fewer layers)."""
    from transformers import Qwen2Config

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    return Qwen2Config(**SHAPES[shape] | overrides, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       use_sliding_window=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip


def build_random_model(out_dir: str | Path, shape: str, *, dtype: str = "bfloat16", seed: int = 0,
                       log=print, **overrides) -> Path:  # fmt: skip
    """Write (or reuse) a randomly initialised `shape` model with its tokenizer at `out_dir`."""
    import torch
    from transformers import Qwen2ForCausalLM

    from dapo_ray.tiny_model import build_tokenizer

    out = Path(out_dir)
    spec = {"shape": shape, "dtype": dtype, "seed": seed, "overrides": overrides}
    stamp = out / "dapo_ray_random.json"
    if stamp.exists() and json.loads(stamp.read_text()) == spec:
        log(f"[random-model] reusing {out}")
        return out
    config = random_config(shape, **overrides)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    n = sum(p.numel() for p in model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer(config.vocab_size).save_pretrained(out)
    stamp.write_text(json.dumps(spec))
    log(f"[random-model] {shape} shape, {n / 1e6:.0f}M parameters ({dtype}, untied embeddings), random weights: {out}")
    return out
