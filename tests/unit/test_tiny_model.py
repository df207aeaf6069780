import json

from transformers import AutoTokenizer

from dapo_ray.tiny_model import EOS, build_tiny_model, build_tokenizer, tiny_config


def test_tokenizer_survives_save_and_auto_load(tmp_path):
    """AutoTokenizer maps a qwen2 model to Qwen2Tokenizer (so does vLLM); ours must load unchanged."""
    tok = build_tokenizer()
    tok.save_pretrained(tmp_path)
    tiny_config(len(tok)).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Start with 12, add 7. What is the result?\nAnswer: 19"
    ids = loaded.encode(text)
    assert ids == tok.encode(text) and len(ids) == len(text)  # one token per character
    assert loaded.decode(ids) == text
    assert loaded.eos_token == EOS and loaded.eos_token_id == 0
    prompt = loaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "hi\n"


def test_config_is_untied_and_sized_to_the_tokenizer():
    tok = build_tokenizer()
    cfg = tiny_config(len(tok))
    assert cfg.tie_word_embeddings is False and cfg.vocab_size == len(tok)


def test_a_label_smoothed_warm_up_records_its_spec_and_both_accuracies(tmp_path):
    """A short real warm-up: the smoothing is part of the cache key, and the stamp says how far the model got
    with samples and with greedy answers (the gap is what RL sharpens)."""
    synthetic = dict(num_train=64, num_eval=8, flavour="reasoning", num_terms=3, max_operand=9, style="symbols")
    lines = []
    build_tiny_model(tmp_path, synthetic=synthetic, target_acc=1.0, max_steps=2, label_smoothing=0.1,
                     eval_every=2, log=lines.append)  # fmt: skip
    stamp = json.loads((tmp_path / "dapo_ray_tiny.json").read_text())
    assert stamp["spec"]["label_smoothing"] == 0.1 and stamp["warmup_steps"] == 2
    assert 0.0 <= stamp["sampled_accuracy"] <= 1.0 and 0.0 <= stamp["greedy_accuracy"] <= 1.0
    assert stamp["spec"]["measure"] == {"samples": 8, "temperature": 1.0, "top_p": 1.0}  # avg@8, as the run's
    assert "held-out avg@8" in lines[0] and "at most 2 steps" in lines[0]
    assert "label smoothing 0.1" in lines[0] and "greedy" in lines[-1]
    build_tiny_model(tmp_path, synthetic=synthetic, target_acc=1.0, max_steps=2, label_smoothing=0.1,
                     eval_every=2, log=lines.append)  # fmt: skip
    assert lines[-1].startswith("[tiny-model] reusing")
    lines.clear()  # without smoothing: another model, built again
    build_tiny_model(tmp_path, synthetic=synthetic, target_acc=1.0, max_steps=2, eval_every=2, log=lines.append)
    assert lines[0].startswith("[tiny-model] Qwen2") and "label smoothing" not in lines[0]
    assert json.loads((tmp_path / "dapo_ray_tiny.json").read_text())["spec"]["label_smoothing"] == 0.0
