"""The trainer's passes with and without `trainer.share_prompts`, on SmolLM2-135M-Instruct.

A micro-batch as the demo trains it: `--groups` groups of `--n` responses (16 rows), each group one prompt
of `--prompt-len` tokens (46: the demo's chat-templated "What is 7 + 15? Reply with the number only.")
and responses of `--resp-min`..`--resp-max` tokens. Baseline: every row runs its whole sequence
(share_prompts false). Against it: each prompt once, each row's rest attending to its prompt's keys and
values. Both through `PolicyLM` with the demo's eager attention, float32, on one thread (a trainer worker
gets one): the update pass (forward with entropy, backward) and the no-grad old-log-prob pass. Settings
alternate; medians of `--repeats` after one warm-up.

    python bench/share_prompts.py [--groups 2] [--n 8] [--prompt-len 46] [--resp-min 6] [--resp-max 32]
    python bench/share_prompts.py --prompt-len 200   # few-shot prompts, as the Mathematics config's
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dapo_ray.smollm2 import build_smollm2
from dapo_ray.trainer.batch import pad_micro
from dapo_ray.trainer.policy import PolicyLM
from dapo_ray.trainer.zero import load_causal_lm


def micro_batch(groups: int, n: int, prompt_len: int, resp_min: int, resp_max: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(groups):
        prompt = torch.randint(1, vocab, (prompt_len,), generator=g).tolist()
        for _ in range(n):
            r = int(torch.randint(resp_min, resp_max + 1, (1,), generator=g))
            samples.append({"input_ids": prompt + torch.randint(1, vocab, (r,), generator=g).tolist(),
                            "n_prompt": prompt_len, "weight": 1.0, "advantage": 1.0,
                            "rollout_logprobs": [-1.0] * r, "token_versions": [0] * r})  # fmt: skip
    return pad_micro(samples, 0)


def time_passes(policy: PolicyLM, m) -> tuple[float, float]:
    """(update pass s, old-log-prob pass s) of one micro-batch."""
    policy.train()
    t0 = time.perf_counter()
    logp, _ = policy(m.ids_BL, m.att_BL, 1.0, with_entropy=True, first_target=m.first_target, prefix_B=m.prefix_B)
    (logp * m.mask_BT).sum().backward()
    t1 = time.perf_counter()
    policy.zero_grad(set_to_none=True)
    policy.eval()
    with torch.no_grad():
        t2 = time.perf_counter()
        policy(m.ids_BL, m.att_BL, 1.0, first_target=m.first_target, prefix_B=m.prefix_B)
        t3 = time.perf_counter()
    return t1 - t0, t3 - t2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=".cache/smollm2-135m-instruct", help="SmolLM2's HF directory (built if absent)")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=46)
    ap.add_argument("--resp-min", type=int, default=6)
    ap.add_argument("--resp-max", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build_smollm2(args.model)  # written from its wheel the first time, reused after
    lm = load_causal_lm(str(model), torch.float32, {"zero_optimization": {"stage": 1}}, "eager")
    m = micro_batch(args.groups, args.n, args.prompt_len, args.resp_min, args.resp_max, lm.config.vocab_size)
    rows, width = m.ids_BL.shape
    print(f"micro-batch: {rows} rows of {args.groups} prompt(s) x {args.n}, prompt {args.prompt_len} tokens, "
          f"padded width {width}, {int(m.att_BL.sum())} real tokens; float32, 1 thread", flush=True)  # fmt: skip
    settings = {"whole rows (baseline)": PolicyLM(lm, 1, share_prompts=False), "share_prompts": PolicyLM(lm, 1, True)}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in settings}
    for i in range(args.repeats + 1):
        for name, policy in settings.items():
            t = time_passes(policy, m)
            if i:  # the first round warms up
                times[name].append(t)
    base = [statistics.median(t[k] for t in times["whole rows (baseline)"]) for k in (0, 1)]
    print(f"{'setting':<24}{'update pass s':>15}{'ratio':>8}{'old-logprob s':>15}{'ratio':>8}")
    for name in settings:
        med = [statistics.median(t[k] for t in times[name]) for k in (0, 1)]
        print(f"{name:<24}{med[0]:>15.2f}{base[0] / med[0]:>7.2f}x{med[1]:>15.2f}{base[1] / med[1]:>7.2f}x")


if __name__ == "__main__":
    main()
