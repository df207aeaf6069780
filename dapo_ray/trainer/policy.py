"""The policy as the trainer sees it: a HF causal LM whose forward returns per-token log-probs (and
entropy) of the input's own next tokens, never the full [B, T, V] logits.

DeepSpeed wraps this module, so its forward runs inside the engine (ZeRO-3 gathers each submodule's
parameters as it runs) and `engine(ids, att, temperature)` is the whole log-prob computation. The
vocabulary projection runs chunk by chunk along the sequence (`algo.logprob`): at 22.5k tokens and a
152k vocabulary one float32 logits tensor would be 13.7 GB.
"""

from __future__ import annotations

import torch

from dapo_ray.algo.logprob import chunked_token_logprobs


class PolicyLM(torch.nn.Module):
    def __init__(self, lm: torch.nn.Module, chunk_size: int = 1024) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_size = chunk_size

    def forward(
        self,
        ids_BL: torch.Tensor,
        att_BL: torch.Tensor,
        temperature: float = 1.0,
        with_entropy: bool = False,
        positions: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logp_BT, entropy_BT or None) with T = L - 1: position t scores token t + 1 under the
        temperature-scaled distribution (the one the engine sampled from).

        `positions` (>= T) pads the hidden states with zeros to that many positions before the chunked
        head, and drops the padding after. Under ZeRO-3 every call of the head gathers its weight, a
        collective, so every rank must make the same number of calls: ranks pass the same `positions`
        (the longest of their micro-batches, see `batch.build_shards`). Only the head runs on the padding."""
        hidden_BTH = self.lm.get_decoder()(input_ids=ids_BL, attention_mask=att_BL).last_hidden_state[:, :-1]
        tokens_BT = ids_BL[:, 1:]
        T = tokens_BT.shape[1]
        if positions is not None and positions > T:
            hidden_BTH = torch.nn.functional.pad(hidden_BTH, (0, 0, 0, positions - T))
            tokens_BT = torch.nn.functional.pad(tokens_BT, (0, positions - T))
        logp_BT, ent_BT = chunked_token_logprobs(
            hidden_BTH, self.lm.get_output_embeddings(), tokens_BT,
            temperature=temperature, chunk_size=self.chunk_size, with_entropy=with_entropy,
        )  # fmt: skip
        return logp_BT[:, :T], None if ent_BT is None else ent_BT[:, :T]
