"""The policy as the trainer sees it: a HF causal LM whose forward returns per-token log-probs (and
entropy) of the input's own next tokens, never the full [B, T, V] logits.

DeepSpeed wraps this module, so its forward runs inside the engine (ZeRO-3 gathers each submodule's
parameters as it runs) and `engine(ids, att, temperature)` is the whole log-prob computation. The
vocabulary projection runs chunk by chunk along the sequence (`algo.logprob`): at 22.5k tokens and a
152k vocabulary one float32 logits tensor would be 13.7 GB.
"""

from __future__ import annotations

import math

import torch

from dapo_ray.algo.logprob import chunked_token_logprobs


def head_chunks(largest_micro_tokens: int, chunk_tokens: int) -> int:
    """How many chunks every forward splits the output head into, so that the largest micro-batch's
    chunk holds about `chunk_tokens` tokens (responses x positions) of logits.
    Example: 24576 tokens a micro-batch at most, 1024 a chunk -> 24 chunks."""
    return max(1, math.ceil(largest_micro_tokens / chunk_tokens))


class PolicyLM(torch.nn.Module):
    def __init__(self, lm: torch.nn.Module, n_chunks: int = 1) -> None:
        super().__init__()
        self.lm = lm
        self.n_chunks = n_chunks

    def forward(
        self, ids_BL: torch.Tensor, att_BL: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False,
        first_target: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logp_BT, entropy_BT or None) with T = L - 1: position t scores token t + 1 under the
        temperature-scaled distribution (the one the engine sampled from).

        `first_target`: the head runs only from this position on (the micro-batch's first response
        token, `Micro.first_target`); earlier positions, prompt only, get 0. The loss never reads them,
        and the head (vocabulary projection, log-softmax, entropy, and their backward) is about a fifth
        of a short-response step: SmolLM2's 46-token chat prompt and 20-token replies, 16 of them on one
        thread, take 6.1 s forward and backward instead of 7.7.

        The head runs in exactly `n_chunks` calls whatever the shape: ceil((T - first_target) / n_chunks)
        positions each, the hidden states padded with zeros to n_chunks of them (fewer than n_chunks
        positions of padding, on which only the head runs, dropped after). Under ZeRO-3 each call gathers the head's weight, a
        collective; DeepSpeed records the order in which modules run in one pass (its prefetch trace),
        checks that it is the same on every rank, and drops the trace (back to fetching on demand) when a
        later pass departs from it. A fixed count makes every forward, and its backward recompute, alike
        on every rank and for every micro-batch, whatever its rows and length.

        No KV cache: `use_cache` defaults to the model config's (true for Qwen2) and transformers turns it
        off only for gradient checkpointing in training; a no-grad pass would build one (~6 GB at 32B and
        22.5k tokens) for nothing."""
        out = self.lm.get_decoder()(input_ids=ids_BL, attention_mask=att_BL, use_cache=False)
        T = ids_BL.shape[1] - 1
        if not 0 <= first_target < max(T, 1):
            raise ValueError(f"first_target {first_target} must lie in [0, {T})")
        hidden_BTH = out.last_hidden_state[:, first_target:-1]
        tokens_BT = ids_BL[:, first_target + 1 :]
        n = T - first_target
        chunk = max(1, math.ceil(n / self.n_chunks))
        pad = chunk * self.n_chunks - n
        if pad:
            hidden_BTH = torch.nn.functional.pad(hidden_BTH, (0, 0, 0, pad))
            tokens_BT = torch.nn.functional.pad(tokens_BT, (0, pad))
        logp_BT, ent_BT = chunked_token_logprobs(
            hidden_BTH, self.lm.get_output_embeddings(), tokens_BT,
            temperature=temperature, chunk_size=chunk, with_entropy=with_entropy,
        )  # fmt: skip
        # Back to [B, T]: zeros before first_target (a pad, so the gradient flows through unchanged).
        widen = (first_target, 0)
        logp_BT = torch.nn.functional.pad(logp_BT[:, :n], widen)
        return logp_BT, None if ent_BT is None else torch.nn.functional.pad(ent_BT[:, :n], widen)
