"""GPU <-> host copy rates, the per-GB cost of the weight publish's host copy (trainer, device to host) and
of a replica's load (host to device): pageable memory (what `tensor.cpu()` gives) beside pinned memory,
one bucket at a time as a bucketed publish would copy them.

    python bench/host_copy.py [--gb 1.0] [--bucket-mb 256] [--repeats 5]

Prints the median GB/s of each direction and kind of host memory, and the ratio pinned / pageable.
Needs a CUDA GPU."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _rate(copy, nbytes: int, repeats: int) -> float:
    """Median GB/s of `copy()` over `repeats` runs after one warm-up."""
    copy()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return nbytes / 1e9 / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_copy.py needs a CUDA GPU")
    numel = args.bucket_mb * 2**20 // 2  # bf16
    buckets = [
        torch.randn(numel, device="cuda").to(torch.bfloat16)
        for _ in range(max(1, int(args.gb * 1e9) // (numel * 2)))
    ]
    nbytes = len(buckets) * numel * 2
    pageable = [torch.empty(numel, dtype=torch.bfloat16) for _ in buckets]
    pinned = [torch.empty(numel, dtype=torch.bfloat16, pin_memory=True) for _ in buckets]

    def d2h(hosts, non_blocking):
        return lambda: [h.copy_(b, non_blocking=non_blocking) for h, b in zip(hosts, buckets, strict=True)]

    def h2d(hosts, non_blocking):
        return lambda: [b.copy_(h, non_blocking=non_blocking) for h, b in zip(hosts, buckets, strict=True)]

    out = {"device": torch.cuda.get_device_name(), "GB": round(nbytes / 1e9, 3), "bucket_MB": args.bucket_mb,
           "d2h_tensor_cpu": _rate(lambda: [b.cpu() for b in buckets], nbytes, args.repeats),
           "d2h_pageable": _rate(d2h(pageable, False), nbytes, args.repeats),
           "d2h_pinned": _rate(d2h(pinned, True), nbytes, args.repeats),
           "h2d_pageable": _rate(h2d(pageable, False), nbytes, args.repeats),
           "h2d_pinned": _rate(h2d(pinned, True), nbytes, args.repeats)}  # fmt: skip
    out = {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}
    out["d2h_pinned_over_pageable"] = round(out["d2h_pinned"] / out["d2h_pageable"], 2)
    out["h2d_pinned_over_pageable"] = round(out["h2d_pinned"] / out["h2d_pageable"], 2)
    print("[host-copy] " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
