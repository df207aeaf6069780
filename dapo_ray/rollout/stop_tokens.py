"""The token ids that end a response: the model's EOS ids and its chat template's end-of-turn token.

A chat-templated Qwen2.5 turn ends with `<|im_end|>`, but the base model's EOS is `<|endoftext|>`; a
policy that learned to close its turn must stop there, and that stop token belongs to |y| (it is the
action that ended the response, so the loss trains on it, as it does on EOS). The end-of-turn token is
read off the template itself rather than from a table of model names:

    render [user "x", assistant SENTINEL]        ->  "...<|im_start|>assistant\\nSENTINEL<|im_end|>\\n"
    text after SENTINEL, less leading whitespace ->  "<|im_end|>\\n"
    its first token                              ->  <|im_end|>, a special token: a stop id

The tiny model's template ("{{content}}\\n") leaves "\\n" after the content, which is no special token, so
nothing is added there.
"""

from __future__ import annotations

_SENTINEL = "<<dapo-ray assistant content>>"


def end_of_turn_token_id(tokenizer) -> int | None:
    """The special (or added) token the chat template writes right after an assistant message, if any."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    conversation = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses an assistant turn has no end-of-turn to read
        return None
    at = text.rfind(_SENTINEL)
    if at < 0:
        return None
    # Leading whitespace is skipped so a template such as "{{content}} </s>" still yields its special token.
    ids = tokenizer.encode(text[at + len(_SENTINEL) :].lstrip(), add_special_tokens=False)
    if not ids:
        return None
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    return ids[0] if ids[0] in special else None


def stop_token_ids(tokenizer, generation_config_eos: int | list[int] | None = None) -> list[int]:
    """The union, in this order and without repeats, of the tokenizer's EOS id, the generation config's
    `eos_token_id` (an int, a list, or None when the model directory has none) and the chat template's
    end-of-turn token (`end_of_turn_token_id`)."""
    if isinstance(generation_config_eos, int):
        generation_config_eos = [generation_config_eos]
    candidates = [tokenizer.eos_token_id, *(generation_config_eos or []), end_of_turn_token_id(tokenizer)]
    return list(dict.fromkeys(int(i) for i in candidates if i is not None))
