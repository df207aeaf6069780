"""Peak memory of per-token log-probs: full-vocabulary logits vs `chunked_token_logprobs`.

Baseline: today's path in the trainer, `head(hidden)` -> [1, T, V] logits, then `loss.token_logprobs`
and `loss.entropy_from_logits` on them (the old-log-prob pass, no grad), and a forward + backward of
`token_logprobs` (the update pass). Against it, `algo.logprob.chunked_token_logprobs` with the same head
and hidden states. Qwen2.5-shaped output layer (V = 152064, H = 896 as in Qwen2.5-0.5B), float32, CPU.

Each (variant, pass) runs in its own subprocess, so its peak RSS (`ru_maxrss`) is its own; the figure
reported is that peak minus the RSS once the inputs (hidden states, head, and a small warm-up of the
same ops for the allocator and thread pools) are in place. The head's weight gradient ([V, H] float32,
545 MB at H = 896) is part of both update passes.

    python bench/logprob_memory.py [--seq-len 2048] [--hidden 896] [--chunk-size 1024] [--variants chunked]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from dapo_ray.algo.logprob import chunked_token_logprobs
from dapo_ray.algo.loss import entropy_from_logits, token_logprobs

VARIANTS = ("full", "chunked")
PASSES = ("old", "update")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def inputs(
    args: argparse.Namespace, grad: bool
) -> tuple[torch.Tensor, nn.Linear, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(args.hidden, args.vocab, bias=False)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.02, generator=g)  # in place: no full-size temporary before the baseline
    # Scaled so logits have a std of ~3, as a trained model's do.
    hidden_BTH = torch.randn(1, args.seq_len, args.hidden, generator=g) * (3.0 / (0.02 * args.hidden**0.5))
    tokens_BT = torch.randint(0, args.vocab, (1, args.seq_len), generator=g)
    w_BT = torch.randn(1, args.seq_len, generator=g)  # per-token loss weights (advantage x mask)
    head.requires_grad_(grad)
    hidden_BTH.requires_grad_(grad)
    return hidden_BTH, head, tokens_BT, w_BT


def run_one(args: argparse.Namespace) -> None:
    """Child process: one (variant, pass); prints a JSON line and saves its outputs for comparison."""
    update = args.pass_ == "update"
    hidden_BTH, head, tokens_BT, w_BT = inputs(args, grad=update)
    small = nn.Linear(args.hidden, 64, bias=False)  # warm-up: thread pools, allocator, kernels
    h = torch.randn(1, 8, args.hidden, requires_grad=True)
    token_logprobs(small(h), tokens_BT[:, :8] % 64).sum().backward()
    chunked_token_logprobs(h, small, tokens_BT[:, :8] % 64, chunk_size=4)[0].sum().backward()
    entropy_from_logits(small(h).detach())
    base = rss_mib()

    t0 = time.perf_counter()
    out: dict[str, torch.Tensor] = {}
    if not update:
        with torch.no_grad():
            if args.variant == "full":
                logits_BTV = head(hidden_BTH)
                out["logp"] = token_logprobs(logits_BTV, tokens_BT, args.temperature)
                out["entropy"] = entropy_from_logits(logits_BTV, args.temperature)
                del logits_BTV
            else:
                out["logp"], out["entropy"] = chunked_token_logprobs(
                    hidden_BTH, head, tokens_BT, temperature=args.temperature,
                    chunk_size=args.chunk_size, with_entropy=True,
                )  # fmt: skip
    else:
        if args.variant == "full":
            logp_BT = token_logprobs(head(hidden_BTH), tokens_BT, args.temperature)
        else:
            logp_BT, _ = chunked_token_logprobs(
                hidden_BTH, head, tokens_BT, temperature=args.temperature, chunk_size=args.chunk_size
            )
        (logp_BT * w_BT).sum().backward()
        out = {"logp": logp_BT.detach(), "grad_hidden": hidden_BTH.grad, "grad_head": head.weight.grad}
    seconds = time.perf_counter() - t0
    peak = peak_rss_mib()

    torch.save(out, Path(args.out) / f"{args.variant}-{args.pass_}.pt")
    print(json.dumps({"base_mib": base, "peak_mib": peak, "extra_mib": peak - base, "seconds": seconds}))


def spawn(args: argparse.Namespace, variant: str, pass_: str, out: str) -> dict:
    cmd = [
        sys.executable, __file__, "--variant", variant, "--pass", pass_, "--out", out,
        "--seq-len", str(args.seq_len), "--hidden", str(args.hidden), "--vocab", str(args.vocab),
        "--chunk-size", str(args.chunk_size), "--temperature", str(args.temperature),
    ]  # fmt: skip
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def max_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    d = float((a.double() - b.double()).abs().max())
    return f"{d:.2e} (max |value| {float(b.abs().max()):.3g})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=2048, help="T (positions with a log-prob)")
    p.add_argument("--hidden", type=int, default=896, help="H (Qwen2.5-0.5B: 896, 1.5B: 1536)")
    p.add_argument("--vocab", type=int, default=152064, help="V (Qwen2.5: 152064)")
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
        help="e.g. `--variants chunked` alone, for a T whose full logits would not fit",
    )  # fmt: skip
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--pass", dest="pass_", choices=PASSES, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        run_one(args)
        return

    logits_mib = args.seq_len * args.vocab * 4 / 2**20
    print(
        f"B=1 T={args.seq_len} H={args.hidden} V={args.vocab} chunk={args.chunk_size} float32, "
        f"{torch.get_num_threads()} threads; one [1, T, V] logits tensor = {logits_mib:,.0f} MiB"
    )
    with tempfile.TemporaryDirectory() as out:
        res = {(v, ps): spawn(args, v, ps, out) for ps in PASSES for v in args.variants}
        saved = {k: torch.load(Path(out) / f"{k[0]}-{k[1]}.pt") for k in res}

    print(f"{'variant':8s} {'pass':7s} {'peak extra MiB':>15s} {'x logits':>9s} {'seconds':>8s}")
    for (v, ps), r in res.items():
        print(
            f"{v:8s} {ps:7s} {r['extra_mib']:15,.0f} {r['extra_mib'] / logits_mib:9.2f} {r['seconds']:8.1f}"
        )
    if len(args.variants) < len(VARIANTS):
        return
    for ps in PASSES:
        full, chunked = res["full", ps], res["chunked", ps]
        print(
            f"{ps} pass: full / chunked peak extra = {full['extra_mib'] / chunked['extra_mib']:.2f}x, "
            f"time chunked / full = {chunked['seconds'] / full['seconds']:.2f}x"
        )
    print("max |full - chunked|:")
    for key, name in (
        (("old", "logp"), "logp (old pass)"),
        (("old", "entropy"), "entropy (old pass)"),
        (("update", "logp"), "logp (update pass)"),
        (("update", "grad_hidden"), "d/d hidden"),
        (("update", "grad_head"), "d/d head.weight"),
    ):
        ps, field = key
        print(f"  {name:20s} {max_diff(saved['chunked', ps][field], saved['full', ps][field])}")


if __name__ == "__main__":
    main()
