"""Stop ids: EOS ids plus the chat template's end-of-turn token, on local tokenizers (no vLLM, no hub)."""

import pytest
from transformers import AutoTokenizer

from dapo_ray.rollout.stop_tokens import end_of_turn_token_id, stop_token_ids
from dapo_ray.tiny_model import build_tokenizer, tiny_config

# Qwen2.5's template without its tool-calling branches: the default system turn, then
# <|im_start|>{role}\n{content}<|im_end|>\n per message, then the generation prompt.
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwen25_like_tokenizer():
    """The tiny byte-level BPE with Qwen2.5's special tokens and template; EOS stays <|endoftext|>."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = QWEN25_TEMPLATE
    return tok


def test_qwen25_template_adds_im_end_to_eos():
    tok = qwen25_like_tokenizer()
    eos, im_end = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    assert tok.eos_token == "<|endoftext|>" and eos != im_end
    turn = [{"role": "user", "content": "1+2="}]
    prompt = tok.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n")
    assert end_of_turn_token_id(tok) == im_end
    assert stop_token_ids(tok, None) == [eos, im_end]


def test_qwen25_like_tokenizer_survives_save_and_auto_load(tmp_path):
    """vLLM loads the tokenizer with AutoTokenizer (Qwen2Tokenizer for a qwen2 model): same answer."""
    tok = qwen25_like_tokenizer()
    tok.save_pretrained(tmp_path)
    tiny_config(len(tok)).save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(loaded, None) == stop_token_ids(tok, None) == [0, im_end]


def test_tiny_model_template_adds_nothing():
    """Its turns end with "\\n", an ordinary token: only EOS stops."""
    tok = build_tokenizer()
    assert end_of_turn_token_id(tok) is None
    assert stop_token_ids(tok, None) == [tok.eos_token_id] == [0]


@pytest.mark.parametrize(
    ("generation_eos", "expected"), [(0, [0]), (5, [0, 5]), ([5, 0, 7], [0, 5, 7]), ([], [0])]
)
def test_generation_config_eos_int_or_list(generation_eos, expected):
    assert stop_token_ids(build_tokenizer(), generation_eos) == expected


def test_generation_config_eos_with_template_token():
    tok = qwen25_like_tokenizer()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    # Qwen2.5-Instruct's generation_config.json lists both: no repeats in the union.
    assert stop_token_ids(tok, [im_end, 0]) == [0, im_end]


def test_no_template_or_a_template_that_refuses_assistant_turns():
    tok = build_tokenizer()
    tok.chat_template = None
    assert stop_token_ids(tok, None) == [0]
    tok.chat_template = "{% if messages[-1]['role'] == 'assistant' %}{{ raise_exception('no') }}{% endif %}"
    assert stop_token_ids(tok, None) == [0]


def test_whitespace_before_the_end_of_turn_token_is_skipped():
    """Llama-2 style "{{content}} </s>": the token after the space is the (special) EOS."""
    tok = build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<eot>"]})
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} <eot>{% endfor %}"
    assert stop_token_ids(tok, None) == [0, tok.convert_tokens_to_ids("<eot>")]
