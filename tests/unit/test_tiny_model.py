from transformers import AutoTokenizer

from dapo_ray.tiny_model import EOS, build_tokenizer, tiny_config


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
