"""The trainer loads model weights from safetensors only: a directory that holds a pickled checkpoint
(pytorch_model.bin, which unpickling could run code from) is refused, not loaded."""

import pytest
import torch
from transformers import Qwen2ForCausalLM

from dapo_ray.tiny_model import tiny_config
from dapo_ray.trainer.zero import load_causal_lm

DS_STAGE0 = {"zero_optimization": {"stage": 0}}


@pytest.mark.parametrize("safe", [True, False])
def test_only_safetensors_weights_are_loaded(tmp_path, safe):
    model = Qwen2ForCausalLM(tiny_config(vocab_size=97, hidden=32, layers=1))
    if safe:
        model.save_pretrained(tmp_path)
        assert isinstance(load_causal_lm(str(tmp_path), torch.float32, DS_STAGE0), Qwen2ForCausalLM)
    else:
        model.config.save_pretrained(tmp_path)
        torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
        with pytest.raises(OSError, match="safetensors"):
            load_causal_lm(str(tmp_path), torch.float32, DS_STAGE0)
