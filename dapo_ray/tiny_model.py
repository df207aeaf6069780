"""A tiny Qwen2-architecture model for the CPU demo and tests, built locally (no hub).

`build_tiny_model(out_dir, ...)`:

1. a character-level tokenizer (printable ASCII + newline, `<|endoftext|>` as EOS and pad) and a chat
   template that is just the user text and a newline;
2. a randomly initialised Qwen2 (untied embeddings: the tied case is the real model's,
   `dapo_ray.smollm2`; `vocab_size == len(tokenizer)`, or vLLM samples ids that decode to nothing);
3. a brief supervised warm-up on the synthetic task's training split (`synthetic`: the keyword
   arguments of `tasks.sums.synthetic_prompts`, the same as the RL run's, so held-out problems stay unseen), stopped as soon as
   held-out avg@k reaches `target_acc` (RL needs groups with both successes and failures, so the model
   must start low but above zero), measured as the run's first evaluation measures it (`build_for`: the
   config's `eval.n` samples per held-out problem at its `eval.temperature` and `eval.top_p`), within a
   budget of steps (`max_steps`), so any machine, fast or busy, builds the same model. The first
   evaluation of a run is a fresh sample of the same measure: it lands near `target_acc`, a little below
   as often as not, since the warm-up stops at the first measurement that reaches it. With `label_smoothing` the model learns the
   procedure while keeping probability on other tokens: greedy answers mostly right, samples slipping
   somewhere in a long scratchpad (`data.warmup` of the reasoning config).

The directory is a normal HF model directory that vLLM and transformers load. It is cached: a second
call with the same arguments returns at once.
"""

from __future__ import annotations

import functools
import json
import random
import time
from pathlib import Path

import torch

from dapo_ray.algo.reward import Mode
from dapo_ray.tasks import task_for
from dapo_ray.tasks.sums import synthetic_prompts
from dapo_ray.types import PromptRow

EOS = "<|endoftext|>"
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character table, used by byte-level BPE tokenizers such as Qwen2's."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def build_tokenizer(vocab_size: int | None = None):
    """A byte-level BPE tokenizer with no merges: one token per character (newline + printable ASCII),
    and with `vocab_size` placeholder tokens `<|r123|>` up to that many entries (a real model's shape).

    Byte-level BPE is what Qwen2's own tokenizer is, so `AutoTokenizer` (which maps a qwen2 model to
    `Qwen2Tokenizer`, in transformers and inside vLLM) loads it unchanged; a custom pre-tokenizer would
    be silently replaced by Qwen2's on load.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = _bytes_to_unicode()
    chars = [ord("\n"), *range(32, 127)]
    vocab = {EOS: 0, **{table[b]: i + 1 for i, b in enumerate(chars)}}
    vocab |= {f"<|r{i}|>": i for i in range(len(vocab), vocab_size or 0)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(vocab_size: int, hidden: int = 128, layers: int = 3, max_len: int = 256):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        dtype="float32",
    )


def prompt_text(tokenizer, row: PromptRow) -> str:
    return tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)


def _sft_batch(tokenizer, rows: list[PromptRow]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (-100 on prompt and padding)."""
    seqs, labels = [], []
    for r in rows:
        p = tokenizer.encode(prompt_text(tokenizer, r))
        a = tokenizer.encode(r["solution"]) + [tokenizer.eos_token_id]
        seqs.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    lab = torch.full((len(seqs), width), -100)
    att = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, lb) in enumerate(zip(seqs, labels, strict=True)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(lb)] = torch.tensor(lb)
        att[i, : len(s)] = 1
    return ids, att, lab


@torch.no_grad()
def sampled_accuracy(
    model, tokenizer, rows: list[PromptRow], samples: int, max_new_tokens: int, seed: int = 0, greedy: bool = False,
    temperature: float = 1.0, top_p: float = 1.0, mode: Mode = "dapo",
) -> float:  # fmt: skip
    """Mean correctness (the row's task's scorer, `mode` where it takes one) of `samples` samples per problem (avg@samples) at
    `temperature` and `top_p`, HF generation, with no top-k cut (`top_k=0`: HF's default would cut to the 50
    likeliest tokens); with `greedy`, of the one greedy answer per problem."""
    torch.manual_seed(seed)
    tokenizer.padding_side = "left"
    correct = total = 0
    model.eval()
    for i in range(0, len(rows), 32):
        chunk = rows[i : i + 32]
        enc = tokenizer([prompt_text(tokenizer, r) for r in chunk], return_tensors="pt", padding=True)
        out = model.generate(
            **enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
            **({"do_sample": False} if greedy else {"do_sample": True, "temperature": temperature, "top_p": top_p,
                                                   "top_k": 0, "num_return_sequences": samples}),
        )  # fmt: skip
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        for j, text in enumerate(texts):
            row = chunk[j // (1 if greedy else samples)]
            correct += task_for(row.get("data_source") or "").score(text, row["ground_truth"], mode)["acc"]
            total += 1
    model.train()
    return correct / total


def build_tiny_model(
    out_dir: str | Path,
    *,
    synthetic: dict | None = None,
    target_acc: float = 0.10,
    max_steps: int = 2000,
    label_smoothing: float = 0.0,
    eval_every: int = 25,
    eval_samples: int = 8,
    eval_temperature: float = 1.0,
    eval_top_p: float = 1.0,
    seed: int = 0,
    log=None,
) -> Path:
    """Build (or reuse) the tiny model directory; see the module docstring."""
    from transformers import Qwen2ForCausalLM

    log = log or functools.partial(print, flush=True)
    out = Path(out_dir)
    synthetic = dict(synthetic or {})
    measure = dict(samples=eval_samples, temperature=eval_temperature, top_p=eval_top_p)
    spec = dict(synthetic=synthetic, target_acc=target_acc, seed=seed, version=2, max_steps=max_steps,
                label_smoothing=label_smoothing, eval_every=eval_every, measure=measure)  # fmt: skip
    stamp = out / "dapo_ray_tiny.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("spec") == spec:
        log(f"[tiny-model] reusing {out}")
        return out

    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    model = Qwen2ForCausalLM(tiny_config(len(tokenizer)))
    n_params = sum(p.numel() for p in model.parameters())
    # The same split as the training run, so the held-out problems stay unseen by warm-up too.
    train, held_out = synthetic_prompts(**synthetic)
    max_new = max(len(r["solution"]) for r in train) + 4
    smoothing = f", label smoothing {label_smoothing}" if label_smoothing else ""
    name = f"held-out avg@{eval_samples}"
    log(f"[tiny-model] Qwen2, {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}; supervised warm-up{smoothing} "
        f"until {name} (the run's own measure: {len(held_out)} problems, temperature {eval_temperature}, top-p "
        f"{eval_top_p}) >= {target_acc:.0%}, at most {max_steps} steps")  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    rng = random.Random(seed)
    t0, step, acc = time.time(), 0, 0.0
    while step < max_steps:
        for _ in range(min(eval_every, max_steps - step)):
            ids, att, lab = _sft_batch(tokenizer, rng.sample(train, 64))
            if label_smoothing:
                logits = model(input_ids=ids, attention_mask=att).logits[:, :-1]
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), lab[:, 1:].flatten(),
                                                         label_smoothing=label_smoothing)  # fmt: skip
            else:
                loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            step += 1
        acc = sampled_accuracy(model, tokenizer, held_out, samples=eval_samples, max_new_tokens=max_new, seed=step,
                               temperature=eval_temperature, top_p=eval_top_p)  # fmt: skip
        log(f"[tiny-model] step {step:4d}  loss {loss.item():.3f}  {name} {acc:.1%}  {time.time() - t0:.0f}s")
        if acc >= target_acc:
            break
    else:
        log(f"[tiny-model] {name} is {acc:.1%} after {max_steps} steps, below {target_acc:.0%}; keeping this model")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    greedy = sampled_accuracy(model, tokenizer, held_out, samples=1, max_new_tokens=max_new, greedy=True)
    stamp.write_text(json.dumps({"spec": spec, "warmup_steps": step, "sampled_accuracy": acc,
                                 "greedy_accuracy": greedy}, indent=1))  # fmt: skip
    log(f"[tiny-model] saved {out} after {step} warm-up steps ({time.time() - t0:.0f}s): {name} {acc:.1%}, "
        f"greedy {greedy:.1%}")  # fmt: skip
    return out


def build_for(cfg, log=None) -> Path:
    """`build_tiny_model` for a workflow config: its `rollout.model_path`, synthetic task (`data.synthetic`),
    warm-up (`data.warmup`), evaluation's sampling (`eval`: the warm-up's stop rule measures what the run's
    first evaluation measures) and seed (`trainer.seed`)."""
    import dataclasses

    w, e = cfg.data.warmup, cfg.eval
    return build_tiny_model(cfg.rollout.model_path, synthetic=dataclasses.asdict(cfg.data.synthetic),
                            target_acc=w.target_acc, max_steps=w.max_steps, label_smoothing=w.label_smoothing,
                            eval_every=w.eval_every, eval_samples=e.n, eval_temperature=e.temperature,
                            eval_top_p=e.top_p, seed=cfg.trainer.seed, log=log)  # fmt: skip
