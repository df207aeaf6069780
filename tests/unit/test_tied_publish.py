"""A tied head is published once: grouped with the embedding it shares (`trainer.zero.tie_groups`) and
carried as a second name for the same bytes (`weights.send_buckets`), so the engine still loads both names."""

import torch

from dapo_ray.buckets import aligned
from dapo_ray.trainer.zero import group_nbytes, layer_groups, tie_groups


class Tied(torch.nn.Module):
    """The layout of a causal LM with tied embeddings: embedding first, head last, sharing one Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(2)])
        self.lm_head = torch.nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.embed.weight


def test_a_tied_head_joins_its_embeddings_group_and_counts_once():
    model = Tied()
    groups = layer_groups(model)
    assert [n for n, _ in groups[-1]] == ["lm_head.weight"]  # as state_dict() lists it: its own group
    tied = tie_groups(groups)
    assert [[n for n, _ in g] for g in tied] == [
        ["embed.weight", "lm_head.weight"],
        ["layers.0.weight", "layers.0.bias"],
        ["layers.1.weight", "layers.1.bias"],
    ]
    assert group_nbytes(tied[0]) == aligned(10 * 4 * 4)
    untied = torch.nn.Linear(4, 4)  # nothing shared: unchanged
    assert [[n for n, _ in g] for g in tie_groups(layer_groups(untied))] == [["weight"], ["bias"]]
