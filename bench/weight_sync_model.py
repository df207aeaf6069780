"""The 32B weight-sync cost model of docs/RESULTS.md, stepped bucket by bucket: an estimate from measured and
assumed rates, not a measurement (nothing here touches Ray, a GPU or a network).

Qwen2.5-32B in bf16 at `weight_sync.bucket_mb` 256 is 67 buckets (each decoder layer, 0.98 GB, is larger
than a bucket): embedding, 64 layers, final norm, output layer. The trainer's ranks gather each bucket
together and its owner copies it to a pinned buffer inside the gather, then `ray.put`s it from a thread;
a replica pulls each bucket to its node and its 4 GPUs load their quarters. The pull of a bucket starts
once it is in the store and, with the pull ahead of the load, once the bucket `ahead + 1` before it is
loaded (`weights.AHEAD`); before that change it started only once the previous bucket was loaded.

`in step`: every replica pulls each bucket from its owner's node at the same time (an on-policy run's
replicas all wait for the same publish), so that node's NIC sends it R times; `spread`: a replica's own
ingress is the limit (the replicas out of step, later ones pulling from earlier ones' copies).

    python bench/weight_sync_model.py
"""

from __future__ import annotations

GB = 1e9
LAYER = 487_605_248 * 2 / GB  # one Qwen2.5-32B decoder layer in bf16
EMBED = 152_064 * 5_120 * 2 / GB  # the embedding, and the untied output layer
NORM = 5_120 * 2 / GB
SIZES = [EMBED] + [LAYER] * 64 + [NORM, EMBED]

GATHER = 40.0  # GB/s per rank, NCCL all-gather (assumed)
D2H = 55.3  # GB/s into a reused pinned buffer (measured, H200)
PUT = 6.3  # GB/s per process, ray.put (measured, CPU)
NIC = 50.0  # GB/s per node (assumed, 400 Gb/s)
H2D = 8.5  # GB/s per GPU from pageable memory (measured, H200)
TP = 4  # GPUs per replica


def in_store() -> list[float]:
    """When each bucket is in the weight store: gather and the owner's copy one after the other (the
    owner synchronizes before the next collective), then its put beside the next gathers."""
    t, out = 0.0, []
    for size in SIZES:
        t += size / GATHER + size / D2H
        out.append(t + size / PUT)
    return out


def last_loaded(replicas: int, in_step: bool, ahead: int | None) -> float:
    """When a replica has loaded the last bucket; `ahead` None: each pull waits for the previous load."""
    rate = NIC / replicas if in_step else NIC
    link_free, loaded = 0.0, []
    for k, (size, ready) in enumerate(zip(SIZES, in_store(), strict=True)):
        start = max(ready, link_free)
        if ahead is None and loaded:
            start = max(start, loaded[-1])
        elif ahead is not None and k > ahead:
            start = max(start, loaded[k - ahead - 1])  # a slot frees once that bucket is loaded
        link_free = start + size / rate
        loaded.append(max(link_free, loaded[-1] if loaded else 0.0) + size / TP / H2D)
    return loaded[-1]


def main() -> None:
    print(f"{len(SIZES)} buckets, {sum(SIZES):.1f} GB; last bucket in the store at {in_store()[-1]:.2f} s")
    print("replicas | before (pull after load): spread / in step | now (pull 2 ahead): spread / in step")
    for r in (2, 4, 8):
        before = [last_loaded(r, s, None) for s in (False, True)]
        now = [last_loaded(r, s, 2) for s in (False, True)]
        print(f"{r:8d} | {before[0]:5.2f} s / {before[1]:5.2f} s | {now[0]:5.2f} s / {now[1]:5.2f} s")


if __name__ == "__main__":
    main()
