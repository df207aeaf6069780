"""The transport of a weight version between two Ray nodes: `dapo_ray.weights` (uint8 numpy views) vs `ray.put` of the state dict.

Two Ray nodes on this machine (`ray.cluster_utils.Cluster`: two raylets, two object stores), so the bytes
really move from one node's store to the other's. A publisher actor on node A holds the full state dict
(as trainer rank 0 does after gathering it: every entry its own CPU tensor, the tied `lm_head` included
under its own name); a reader actor on node B stands in for a rollout replica. Per weight version:

* `plain` (baseline): publisher `ray.put(state_dict)` (torch tensors, pickled by Ray's default
  serializer, i.e. torch's own `__reduce__`: the bytes go in band); the reader `ray.get`s it.
* `ray_zero_copy`: the same put with what Ray's opt-in `RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1` registers
  (each tensor becomes an out-of-band uint8 numpy buffer, bf16 included), registered around that put.
* `object_store` (ours, the real path): publisher `weights.publish` to a real `WeightStore` (buckets of
  `weight_sync.bucket_mb`: each copied into a host buffer and `ray.put` out of band, from a thread, and
  announced to the store); the reader asks the store for the latest version (untimed, as a replica's long
  poll returns it) and `weights.fetch`es it.
* `object_store + load`: the same fetch, then every tensor copied by name into a same-shaped, resident
  module on node B (`param.copy_`, tied weights once): the in-place load vLLM does, without vLLM.

Every fetch then reads one byte of every 4 KiB page of every tensor, so zero-copy views are really
mapped. put s = the publisher's call (serialize + copy into node A's store [+ the store call]); get s = the reader's call (pull into node B's store +
deserialize + touch [+ load]); GB/s = state bytes / (put + get). The actors ask for no CPU, so Ray runs
torch in them on one thread (OMP_NUM_THREADS=1).

One publisher, one reader and one store (keeping 1 version) per model; the methods take turns within
each version, the order rotating, so load from other work on the machine hits them alike (after its
turn, `object_store` publishes an empty version, so its weights do not sit in memory through the
others' turns). `--warmup` untimed versions, then `--repeats` timed ones, each new version's predecessor
dropped; figures are medians. put/get MiB: the most private (anonymous) memory the publisher / reader
process gained during the call (largest over the versions), polled every few ms from the driver; the
object stores' shared memory is not in it. `plain` needs about 3x the state dict in the publisher
(torch pickles every storage to bytes, and the stream holds them all again): float32 Qwen2.5-0.5B
(2.5 GB) did not fit next to both stores on a 24 GB machine; `--methods ray_zero_copy,object_store`
runs without it.

    python bench/weight_transport.py [--models tiny,qwen0.5b] [--dtypes bfloat16,float32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import ray  # noqa: E402
import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from dapo_ray import weights  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from procmem import PeakAnon  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Built by the test suite (tests/conftest.py); a random tiny model when absent.
TINY_DIR = ROOT / ".cache" / "test-tiny-model"
METHODS = ("plain", "ray_zero_copy", "object_store")
BASELINE = "plain"


def model_config(name: str):
    """(config, safetensors file to take the values from or None)."""
    from transformers import Qwen2Config

    if name == "tiny":
        if (TINY_DIR / "model.safetensors").exists():
            return Qwen2Config.from_pretrained(TINY_DIR), TINY_DIR / "model.safetensors"
        from dapo_ray.tiny_model import build_tokenizer, tiny_config

        return tiny_config(len(build_tokenizer())), None  # random init: the values do not matter here
    if name == "qwen0.5b":
        return Qwen2Config(
            hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
            tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
        ), None  # fmt: skip
    raise ValueError(f"unknown model {name!r} (tiny, qwen0.5b)")


def build_model(name: str, dtype: str, fill: bool) -> torch.nn.Module:
    """The model on CPU in `dtype`, built on the meta device (no init); `fill`: random or saved values,
    else uninitialised memory."""
    from transformers import Qwen2ForCausalLM

    config, saved = model_config(name)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model = model.to(getattr(torch, dtype)).to_empty(device="cpu")
    model.tie_weights()
    if fill:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02, generator=g)
            if saved is not None:
                from safetensors.torch import load_file

                model.load_state_dict(load_file(saved), strict=False)  # cast to `dtype` by copy_
    return model


def trainer_state(name: str, dtype: str) -> dict[str, torch.Tensor]:
    """`state_dict()` with every entry its own tensor, as `trainer.zero.full_state_dict_cpu` returns it."""
    seen, state = set(), {}
    for k, v in build_model(name, dtype, fill=True).state_dict().items():
        state[k] = v.detach().clone() if v.data_ptr() in seen else v.detach()
        seen.add(v.data_ptr())
    return state


def state_nbytes(name: str, dtype: str) -> int:
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(model_config(name)[0]).to(getattr(torch, dtype))
    return sum(v.numel() * v.element_size() for v in model.state_dict().values())


def touch(tensors) -> int:
    """Read one byte of every 4 KiB page of every tensor (maps lazily mapped views for real)."""
    return sum(int(t.reshape(-1).view(torch.uint8)[::4096].sum()) for t in tensors)


@ray.remote(num_cpus=0)
class Publisher:
    """Trainer rank 0 after gathering: holds the full state dict on node A."""

    def __init__(self, name: str, dtype: str) -> None:
        self.state = trainer_state(name, dtype)

    def info(self) -> tuple[int, str, int]:
        nbytes = sum(t.numel() * t.element_size() for t in self.state.values())
        return os.getpid(), ray.get_runtime_context().get_node_id(), nbytes

    def put_plain(self, zero_copy: bool) -> tuple[float, list]:
        """`ray.put(state_dict)`; the reference goes back in a list, so the object lives until the caller
        drops it. `zero_copy`: the reducer `RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1` makes Ray register at
        worker start-up (`SerializationContext.__init__`), registered around this one put instead."""
        from ray._private.tensor_serialization_utils import zero_copy_tensors_reducer

        ctx = ray._private.worker.global_worker.get_serialization_context()
        before = ray.cloudpickle.CloudPickler.dispatch.get(torch.Tensor)  # None: torch's own reducer
        if zero_copy:
            ctx._register_cloudpickle_reducer(torch.Tensor, zero_copy_tensors_reducer)
        try:
            t0 = time.perf_counter()
            box = [ray.put(self.state)]
            return time.perf_counter() - t0, box
        finally:
            if zero_copy and before is None:
                ctx._unregister_cloudpickle_reducer(torch.Tensor)
            elif zero_copy:
                ctx._register_cloudpickle_reducer(torch.Tensor, before)

    def publish(self, store, version: int) -> tuple[float, float]:
        """(`weights.publish` seconds, 0: the copy into its buckets is not timed apart)."""
        t0 = time.perf_counter()
        weights.publish(store, version, self.state)
        return time.perf_counter() - t0, 0.0


@ray.remote(num_cpus=0)
class Reader:
    """A rollout replica on node B, with a same-shaped module to load the weights into."""

    def __init__(self, name: str, dtype: str, load: bool) -> None:
        self.module = build_model(name, dtype, fill=False) if load else None
        with torch.no_grad():
            for p in self.module.parameters() if load else ():
                p.zero_()  # resident, as a serving model's weights are

    def info(self) -> tuple[int, str]:
        return os.getpid(), ray.get_runtime_context().get_node_id()

    def get_plain(self, box: list) -> float:
        t0 = time.perf_counter()
        state = ray.get(box[0])
        touch(state.values())
        return time.perf_counter() - t0

    def get_weights(self, store, version: int) -> tuple[float, float]:
        """(fetch seconds, load seconds or 0)."""
        latest, _, serial = ray.get(store.latest.remote())
        assert latest == version, (latest, version)
        t0 = time.perf_counter()
        tensors = weights.fetch(store, version, serial)
        touch(t for _, t in tensors)
        t1 = time.perf_counter()
        if self.module is None:
            return t1 - t0, 0.0
        params, done = self.module.state_dict(), set()
        with torch.no_grad():
            for name, t in tensors:
                p = params[name]
                if p.data_ptr() not in done:  # tied lm_head: loaded once, as vLLM does
                    p.copy_(t)
                    done.add(p.data_ptr())
        return t1 - t0, time.perf_counter() - t1


def run_model(name: str, dtype: str, methods: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """{method: median put/get/load/pack seconds, state bytes, peak extra MiB}."""
    pub = Publisher.options(resources={"a": 1}).remote(name, dtype)
    reader = Reader.options(resources={"b": 1}).remote(name, dtype, args.load)
    store = weights.create_store(f"bench-{name}-{dtype}", keep=1)
    (pub_pid, pub_node, nbytes), (read_pid, read_node) = ray.get([pub.info.remote(), reader.info.remote()])
    assert pub_node != read_node, "publisher and reader must be on different nodes"
    rows: dict[str, list[tuple[float, ...]]] = {m: [] for m in methods}
    try:
        for version in range(1, args.warmup + args.repeats + 1):
            k = version % len(methods)
            for method in methods[k:] + methods[:k]:
                pack_s = load_s = 0.0
                with PeakAnon(pub_pid) as pp:
                    if method == "object_store":
                        put_s, pack_s = ray.get(pub.publish.remote(store, 2 * version))
                    else:
                        put_s, box = ray.get(pub.put_plain.remote(method == "ray_zero_copy"))
                with PeakAnon(read_pid) as rp:
                    if method == "object_store":
                        get_s, load_s = ray.get(reader.get_weights.remote(store, 2 * version))
                    else:
                        get_s = ray.get(reader.get_plain.remote(box))
                        del box  # the last reference: the object is freed
                if method == "object_store":  # an empty version, so the store lets go of the weights
                    weights.publish(store, 2 * version + 1, {})
                if version > args.warmup:
                    rows[method].append((put_s, get_s, load_s, pack_s, pp.extra, rp.extra))
    finally:
        for actor in (pub, reader, store):
            ray.kill(actor)
        time.sleep(1.0)  # let the processes exit and their objects be freed before the next model
    out = {}
    for method, rs in rows.items():
        put, get, load, pack, put_mib, get_mib = zip(*rs, strict=True)
        out[method] = {
            "bytes": nbytes, "put": statistics.median(put), "get": statistics.median(get),
            "load": statistics.median(load), "pack": statistics.median(pack),
            "put_mib": max(put_mib), "get_mib": max(get_mib),
        }  # fmt: skip
    return out


def print_table(results: dict, models: list[str], dtypes: list[str], methods: list[str], load: bool) -> None:
    print(
        f"{'model':9s} {'dtype':9s} {'size GB':>8s} {'method':20s} "
        f"{'put s':>7s} {'get s':>7s} {'total s':>8s} "
        f"{'GB/s':>6s} {'(pack s)':>8s} {'put MiB':>8s} {'get MiB':>8s}"
    )
    for m in models:
        for d in dtypes:
            rows = [(meth, results[m, d, meth], False) for meth in methods]
            if "object_store" in methods and load:
                rows.append(("object_store + load", results[m, d, "object_store"], True))
            for meth, r, with_load in rows:
                get = r["get"] + (r["load"] if with_load else 0.0)
                total = r["put"] + get
                pack = f"{r['pack']:8.3f}" if meth.startswith("object_store") else f"{'-':>8s}"
                print(
                    f"{m:9s} {d:9s} {r['bytes'] / 1e9:8.3g} {meth:20s} "
                    f"{r['put']:7.3f} {get:7.3f} {total:8.3f} "
                    f"{r['bytes'] / 1e9 / total:6.2f} {pack} {r['put_mib']:8.0f} {r['get_mib']:8.0f}"
                )
            pairs = [(meth, BASELINE) for meth in methods if meth != BASELINE] + [
                ("object_store", "ray_zero_copy")
            ]
            for meth, ref in pairs:
                if meth in methods and ref in methods:
                    r, b = results[m, d, meth], results[m, d, ref]
                    print(
                        f"  {m} {d}: {meth} vs {ref}: "
                        f"{(b['put'] + b['get']) / (r['put'] + r['get']):.2f} times faster "
                        f"(put {b['put'] / r['put']:.2f}x, get {b['get'] / r['get']:.2f}x)"
                    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,qwen0.5b", help="comma-separated: tiny, qwen0.5b")
    p.add_argument("--dtypes", default="bfloat16", help="comma-separated, e.g. bfloat16,float32")
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated subset of {METHODS}; without {BASELINE!r}, no ratios",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed versions per method (medians reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed versions first (fresh pages, imports)")
    p.add_argument("--no-load", dest="load", action="store_false", help="skip the `object_store + load` row")
    p.add_argument("--object-store-gb", type=float, help="per node; default 2.6x the largest state dict")
    args = p.parse_args()
    models, dtypes = args.models.split(","), args.dtypes.split(",")
    methods = [m for m in METHODS if m in args.methods.split(",")]

    t_start = time.perf_counter()
    largest = max(state_nbytes(m, d) for m in models for d in dtypes)
    # Two versions may be alive at once on node A (objects are freed asynchronously; the store drops the
    # old version only once the new one is put), and Ray spills to disk above 80%: 2 / 0.8 = 2.5x.
    store_bytes = int(args.object_store_gb * 1e9) if args.object_store_gb else int(max(2.6 * largest, 5e8))
    tmp = tempfile.mkdtemp(prefix="wsync-", dir="/tmp")
    os.environ["RAY_TMPDIR"] = tmp  # this cluster's sessions and address file stay out of /tmp/ray
    node = dict(num_cpus=2, object_store_memory=store_bytes)
    cluster = Cluster(
        initialize_head=True, head_node_args=dict(**node, resources={"a": 1}, include_dashboard=False)
    )
    results: dict[tuple[str, str, str], dict] = {}
    try:
        cluster.add_node(**node, resources={"b": 1})
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        cluster.wait_for_nodes()
        print(
            f"2 Ray nodes on one machine ({os.cpu_count()} cores), object store {store_bytes / 1e9:.1f} GB "
            f"each; {args.warmup} warm-up + {args.repeats} timed versions per method, medians",
            flush=True,
        )
        for m in models:
            for d in dtypes:
                for method, r in run_model(m, d, methods, args).items():
                    results[m, d, method] = r
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(results, models, dtypes, methods, args.load)
    print(f"took {time.perf_counter() - t_start:.0f}s")


if __name__ == "__main__":
    main()
