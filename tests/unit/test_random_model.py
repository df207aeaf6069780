"""Randomly initialised models of real shapes (dapo_ray/random_model.py), for GPU smoke runs."""

import torch

from dapo_ray.random_model import build_random_model, random_config
from dapo_ray.tiny_model import build_tokenizer


def test_the_qwen2_5_0_5b_shape_has_its_published_parameter_count():
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(random_config("qwen2.5-0.5b"))
    n = sum(p.numel() for p in model.parameters())
    untied_head = 151936 * 896
    assert n - untied_head == 494_032_768  # Qwen2.5-0.5B's parameters, embeddings tied


def test_a_built_model_loads_and_every_id_decodes(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    small = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=300)  # fmt: skip
    out = build_random_model(tmp_path / "m", "qwen2.5-0.5b", dtype="float32", **small)
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == model.config.vocab_size == 300
    assert tok.decode(tok.encode("12+7=")) == "12+7="
    assert tok.decode([299]) == "<|r299|>"
    assert build_random_model(tmp_path / "m", "qwen2.5-0.5b", dtype="float32", **small) == out  # reused


def test_the_tokenizer_pads_to_the_vocabulary():
    assert len(build_tokenizer(1000)) == 1000
    assert build_tokenizer().get_vocab() == {k: v for k, v in build_tokenizer(1000).get_vocab().items() if v < len(build_tokenizer())}
