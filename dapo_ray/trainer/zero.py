"""DeepSpeed ZeRO-3 at both ends of the trainer's life: load a model without any rank holding all of it,
and hand its full weights out one layer at a time.

`load_causal_lm` builds the model under `deepspeed.zero.Init` when the DeepSpeed config asks for stage 3,
so every parameter is partitioned as soon as its module is constructed, and transformers then copies the
checkpoint into the partitions module by module. `gathered_layers` walks the model in `state_dict()`
order and gathers one decoder layer (or one top-level tensor) at a time, so publishing weights or writing
the final HF model costs one layer of extra accelerator memory instead of the whole model on every rank.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterator

import torch

# "model.layers.17.mlp.up_proj.weight" -> group "model.layers.17"; anything else is its own group.
_LAYER_PREFIX = re.compile(r"^(.*?\blayers\.\d+)\.")


def _stage(ds_config: dict) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))


def load_causal_lm(model_path: str, dtype: torch.dtype, ds_config: dict, attn_implementation: str = "sdpa"
                   ) -> torch.nn.Module:  # fmt: skip
    """An HF causal LM from a local directory, partitioned at construction under ZeRO-3.

    `ds_config` is the complete DeepSpeed config that will go to `deepspeed.initialize` (batch sizes,
    "zero_optimization", "bf16"; as trainer/loop.py builds it). Stages 0-2 partition no parameters: a
    plain `from_pretrained`. Stage 3: `from_pretrained` runs with transformers' DeepSpeed integration
    switched on (see `_hf_zero3`), which constructs the model inside `deepspeed.zero.Init(ds_config)`
    (every parameter is split across the ranks as its module's `__init__` returns; weight init is
    skipped), then, for each module in turn, gathers that module's own parameters, lets rank 0 copy the
    checkpoint tensors into them and broadcasts and re-partitions them. Every rank memory-maps all
    checkpoint shards but only rank 0 reads their bytes (page cache, shared between the ranks of a node);
    no rank allocates more than one module's full parameters on top of its partition.

    The result goes to `deepspeed.initialize(model=..., optimizer=torch.optim.AdamW(...), config=ds_config)`.

    A frozen reference model (no optimizer) under ZeRO-3 is loaded the same way and wrapped in an engine
    without an optimizer, which keeps only ZeRO-3's parameter partitioning (each forward gathers the
    layers it runs, so every rank must call it the same number of times):

        ref = load_causal_lm(path, dtype, ds_config).requires_grad_(False)
        ref_engine, *_ = deepspeed.initialize(model=ref, config=ds_config)
        ref_engine.eval()
        with torch.no_grad():
            logits = ref_engine(input_ids=ids, attention_mask=att).logits

    Under stages 0-2 the reference model is a plain replica (`.to(device).eval()`, no engine).
    `deepspeed.init_inference` is not a substitute: it does not partition parameters the ZeRO-3 way.

    Raises ValueError when `dtype` differs from the one `zero.Init` would cast the parameters to
    (bf16 when "bf16" is enabled, fp16 when "fp16" is, float32 otherwise), and when the checkpoint
    lacks any of the model's weights (under ZeRO-3 transformers would leave them random silently).
    """
    from transformers import AutoModelForCausalLM

    if _stage(ds_config) != 3:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, use_safetensors=True,
                                                    attn_implementation=attn_implementation)  # fmt: skip
    partition_dtype = _zero_init_dtype(ds_config)
    if dtype != partition_dtype:
        raise ValueError(f"dtype {dtype} but deepspeed.zero.Init would cast parameters to {partition_dtype}: "
                         'set "bf16" (or "fp16") "enabled" in the DeepSpeed config to match')  # fmt: skip
    with _hf_zero3(ds_config):
        model, info = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, output_loading_info=True,
                                                           use_safetensors=True,
                                                           attn_implementation=attn_implementation)  # fmt: skip
    if info["missing_keys"]:
        raise ValueError(f"{model_path} lacks weights for {sorted(info['missing_keys'])}")
    return model


def _zero_init_dtype(ds_config: dict) -> torch.dtype:
    """The dtype `deepspeed.zero.Init(config_dict_or_path=ds_config)` gives parameters (its `_set_dtype`)."""
    if ds_config.get("bf16", ds_config.get("bfloat16", {})).get("enabled"):
        return torch.bfloat16
    if ds_config.get("fp16", {}).get("enabled"):
        return torch.float16
    return torch.float32


class _Zero3Config:
    """What transformers reads from its registered DeepSpeed config: `is_zero3()` and `config`."""

    def __init__(self, ds_config: dict):
        self.config = copy.deepcopy(ds_config)

    def is_zero3(self) -> bool:
        return True


@contextlib.contextmanager
def _hf_zero3(ds_config: dict):
    """Switch transformers' DeepSpeed ZeRO-3 integration on for the duration of the block.

    `transformers.integrations.HfDeepSpeedConfig(ds_config)` does this by registering itself (a weak
    reference) where `from_pretrained` looks, but its constructor requires `accelerate`, which nothing
    else here needs; we register a minimal stand-in through the same hook. It is removed on exit, so a
    later `from_pretrained` in the process (a non-ZeRO model, say) is not built partitioned by surprise;
    the HF features that consult it after loading (`generate(synced_gpus=...)`, resizing embeddings)
    are not used on trainer models.
    """
    from transformers.integrations import deepspeed as hf_deepspeed

    registered = _Zero3Config(ds_config)  # held here: transformers keeps only a weak reference
    hf_deepspeed.set_hf_deepspeed_config(registered)
    try:
        yield
    finally:
        hf_deepspeed.unset_hf_deepspeed_config()


def _group_of(name: str) -> str:
    m = _LAYER_PREFIX.match(name)
    return m.group(1) if m else name


def gathered_layers(
    module: torch.nn.Module, zero_stage: int, rank: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The module's full weights as CPU tensors, one group at a time, under `module.state_dict()` names
    (those HF `save_pretrained` and vLLM `load_weights` expect; pass `engine.module`, not the engine).

    A group is everything under one `...layers.<i>.` prefix, or one other state-dict entry (embed_tokens,
    the final norm, lm_head, ...), in `state_dict()` order; persistent buffers are included, as in
    `state_dict()`. Tied weights appear under each of their names, as in `state_dict()`.

    Under ZeRO-3 each group's parameters are gathered with `GatheredParameters(modifier_rank=None)`,
    copied to CPU on rank 0 and released again *before* the group is yielded, so at most one group is
    ever gathered, and nothing is held gathered while the caller works on a group. The gather is a
    collective: every rank must run this generator to the end, in step. Rank 0 gets
    `[(name, tensor), ...]` per group (tensors are fresh CPU copies, in the parameters' dtype); every
    other rank gets an empty list for each group, so all ranks iterate the same number of times and a
    caller may run per-group collectives of its own in the loop body. For `zero_stage` < 3 the module
    already holds full parameters: no gather, same output.

    Small "persistent" parameters (ZeRO-3 keeps those of at most `stage3_param_persistence_threshold`
    elements, default 1e5, gathered between steps) come out partitioned like the rest; the engine
    gathers them again at its next forward.
    """
    for members in layer_groups(module):
        with gathered(members, zero_stage) as whole:
            out = [(name, t.to("cpu", copy=True)) for name, t in whole] if rank == 0 else []
        yield out


def layer_groups(module: torch.nn.Module) -> list[list[tuple[str, torch.Tensor]]]:
    """`module.state_dict()` entries grouped as `gathered_layers` gathers them (one decoder layer, or one
    other entry), in order; parameters stay partitioned (see `full_nbytes`)."""
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        groups.setdefault(_group_of(name), []).append((name, tensor))
    return list(groups.values())


def tie_groups(groups: list[list[tuple[str, torch.Tensor]]]) -> list[list[tuple[str, torch.Tensor]]]:
    """`layer_groups` with each tied weight (an entry whose tensor is an earlier entry's: `lm_head.weight`
    of a model with tied embeddings) moved into the group of the entry it shares, so that a publish
    gathers and carries it once, as a second name for the same bytes (`weights.send_buckets`). The
    engine still receives both names: on the CPU engine a head that gets no weight of its own keeps the
    packed copy of the old embedding it multiplies with (vLLM 0.32 `vocab_parallel_embedding.py`
    `process_weights_after_loading` -> `dispatch_cpu_unquantized_gemm`), a stale head."""
    home: dict[int, list[tuple[str, torch.Tensor]]] = {}
    out = []
    for group in groups:
        kept: list[tuple[str, torch.Tensor]] = []
        for name, t in group:
            if id(t) in home:
                home[id(t)].append((name, t))
            else:
                home[id(t)] = kept
                kept.append((name, t))
        if kept:
            out.append(kept)
    return out


def group_nbytes(group: list[tuple[str, torch.Tensor]]) -> int:
    """Room a group takes in a bucket: each distinct tensor once, at `buckets.aligned` size."""
    from dapo_ray.buckets import aligned

    distinct = {id(t): t for _, t in group}
    return sum(aligned(full_nbytes(t)) for t in distinct.values())


def full_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the whole tensor, also when ZeRO-3 holds only a partition of it."""
    return int(getattr(tensor, "ds_numel", tensor.numel())) * tensor.element_size()


@contextlib.contextmanager
def gathered(members: list[tuple[str, torch.Tensor]], zero_stage: int):
    """Inside the block, the group's parameters are whole on every rank (ZeRO-3: a collective, which every
    rank must enter in step); yields (name, tensor) on the accelerator, to be copied before the block ends."""
    import deepspeed

    params = [t for _, t in members if isinstance(t, torch.nn.Parameter)]
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=zero_stage == 3 and bool(params)):
        yield [(name, t.detach()) for name, t in members]


def full_state_dict_cpu(
    module: torch.nn.Module, zero_stage: int, rank: int
) -> dict[str, torch.Tensor] | None:
    """The whole `module.state_dict()` as CPU tensors on rank 0 (None elsewhere), gathered layer by layer
    (see `gathered_layers`; every rank must call it). Rank 0 then holds the full model in CPU memory:
    fine for writing the final model (`module.save_pretrained(out, state_dict=sd)`), whereas a publisher
    that can write group by group should iterate `gathered_layers` itself."""
    sd: dict[str, torch.Tensor] = {}
    for group in gathered_layers(module, zero_stage, rank):
        sd.update(group)
    return sd if rank == 0 else None
