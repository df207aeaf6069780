"""A resume from object storage (the local S3 server): each of 2 trainer workers fetches only the files its
rank reads, and gets back exactly the training state that was saved.

Two runs of a real Ray Train TorchTrainer (2 CPU workers, DeepSpeed engines as `loop.build_engines` makes
them) with the same RunConfig: the first trains a step, saves a checkpoint through `loop._report` (the
trainer's own save path, to S3) and trains one more step; the second finds that checkpoint, restores it
with `restore.restore` (what `loop.train_loop` calls) and trains the same second step. Each rank writes
what it observed under tmp_path; the test compares it with the objects on the S3 server."""

import os
import sys
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import pytest
import torch
from test_end_to_end import TINY_CFG

pytestmark = pytest.mark.integration

WORLD = 2
MODEL_STATES = "ckpt/mp_rank_00_model_states.pt"  # stages 0-2: rank 0 writes it, every rank loads it
# One layout of each family, which between them name every file a restore reads: ZeRO-3 (per-rank module
# files, stage3.py) in bf16 (the `bf16_` optimizer files) and ZeRO-2 (the shared module file,
# stage_1_and_2.py, which ZeRO-1 shares) in fp32. ZeRO-3 fp32 and ZeRO-1 bf16 pass too (add them here);
# each layout costs two Ray Train runs, about two minutes on 2 cores.
LAYOUTS = {(3, "bfloat16"), (2, "float32")}


@pytest.fixture(scope="module")
def model_dir(small_random_model_dir) -> Path:
    return small_random_model_dir


# ---- what the workers run -------------------------------------------------------------------------------


def _worker(c: dict) -> None:
    import ray.train

    from dapo_ray.trainer import loop
    from dapo_ray.trainer.restore import restore
    from dapo_ray.trainer.zero import full_state_dict_cpu

    cfg = c["cfg"]
    rank = ray.train.get_context().get_world_rank()
    torch.manual_seed(cfg.trainer.seed)
    engine, _ = loop.build_engines(cfg, WORLD)

    def params() -> dict | None:
        return full_state_dict_cpu(engine.module.lm, cfg.trainer.zero_stage, rank)

    ckpt = ray.train.get_checkpoint()
    if ckpt is None:  # the first run: step, checkpoint, step
        _step(engine, rank, batch=0)
        loop._report(engine, {"step": 1}, {"cursor": 7}, 1, rank)
        obs = {"saved": params(), "saved_steps": engine.global_steps}
        obs["next_loss"] = _step(engine, rank, batch=1)
        obs["next"] = params()
        phase = "first"
    else:  # the resumed run: restore, the same second step
        done = restore(engine, ckpt)
        obs = {"restored": params(), "restored_steps": engine.global_steps, "driver_state": done.driver_state,
               "fetched": done.fetched, "total_files": done.total_files, "total_bytes": done.total_bytes,
               "optimizer": type(engine.optimizer).__name__}  # fmt: skip
        obs["next_loss"] = _step(engine, rank, batch=1)
        obs["next"] = params()
        phase = "resumed"
    torch.save(obs, Path(c["out"]) / f"{phase}-rank{rank}.pt")


def _step(engine, rank: int, batch: int) -> float:
    """One optimizer step (one micro-batch: gradient_accumulation_steps is 1) on a batch fixed by
    (batch, rank)."""
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(100 * batch + rank))
    engine.train()
    logp, _ = engine(ids.to(engine.device), torch.ones_like(ids).to(engine.device), 1.0)
    loss = -logp.float().mean()
    engine.backward(loss)
    engine.step()
    return loss.item()


# ---- the test -------------------------------------------------------------------------------------------


def _s3(prefix: str):
    """(filesystem, path) of `prefix` with the server's credentials inside the filesystem object, so
    that Ray Train's controller and workers (which do not share this test's environment, where `s3_prefix`
    put them) reach it."""
    import pyarrow.fs

    u = urlsplit(prefix)
    opts = dict(parse_qsl(u.query))
    fs = pyarrow.fs.S3FileSystem(
        access_key=os.environ["AWS_ACCESS_KEY_ID"], secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        endpoint_override=opts["endpoint_override"], scheme=opts["scheme"], region=opts["region"],
        allow_bucket_creation=True,
    )  # fmt: skip
    return fs, f"{u.netloc}{u.path}"


def _fit(cfg, fs, path: str, out: Path) -> None:
    import ray.cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this module
    TorchTrainer(
        _worker, train_loop_config={"cfg": cfg, "out": str(out)},
        scaling_config=ScalingConfig(num_workers=WORLD, use_gpu=False),
        run_config=RunConfig(name="restore", storage_path=path, storage_filesystem=fs),
    ).fit()  # fmt: skip


@pytest.mark.parametrize("stage,dtype", sorted(LAYOUTS))
def test_each_worker_fetches_only_its_rank_files_and_resumes_exactly(stage, dtype, model_dir, ray_cluster,
                                                                     s3_prefix, tmp_path):  # fmt: skip
    import pyarrow.fs

    from dapo_ray.config import load_config

    cfg = load_config(TINY_CFG, [
        f"rollout.model_path={model_dir}", f"trainer.zero_stage={stage}", f"trainer.dtype={dtype}",
        f"trainer.num_workers={WORLD}", "trainer.mini_batch_size=4", "trainer.micro_batch_size=2",
        "trainer.lr=1e-2", "algorithm.kl_coef=0",
    ])  # fmt: skip
    fs, path = _s3(s3_prefix)
    _fit(cfg, fs, path, tmp_path)
    _fit(cfg, fs, path, tmp_path)
    first = [torch.load(tmp_path / f"first-rank{r}.pt", weights_only=False) for r in range(WORLD)]
    resumed = [torch.load(tmp_path / f"resumed-rank{r}.pt", weights_only=False) for r in range(WORLD)]

    # The checkpoint as the S3 server holds it.
    (ckpt_dir,) = [i.path for i in fs.get_file_info(pyarrow.fs.FileSelector(f"{path}/restore"))
                   if i.type == pyarrow.fs.FileType.Directory and i.base_name.startswith("checkpoint_")]  # fmt: skip
    listed = fs.get_file_info(pyarrow.fs.FileSelector(ckpt_dir, recursive=True))
    on_s3 = {i.path[len(ckpt_dir) + 1 :]: i.size for i in listed if i.type == pyarrow.fs.FileType.File}
    bf16 = "bf16_" if dtype == "bfloat16" else ""
    for rank, obs in enumerate(resumed):
        optim = f"ckpt/{bf16}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        model = f"ckpt/zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3 else MODEL_STATES
        own = {"driver_state.json", model, optim}
        assert own <= set(on_s3) and len(on_s3) > len(own)
        # Exactly this rank's files came down, byte for byte as stored; the other rank's shards did not.
        assert obs["fetched"] == {name: on_s3[name] for name in own}, (rank, sorted(obs["fetched"]))
        assert (obs["total_files"], obs["total_bytes"]) == (len(on_s3), sum(on_s3.values()))
        fetched, total = sum(obs["fetched"].values()), sum(on_s3.values())
        print(f"ZeRO-{stage} {dtype} ({obs['optimizer']}) rank {rank}: fetched {fetched:,} of {total:,} bytes "
              f"({len(obs['fetched'])} of {len(on_s3)} files)")  # fmt: skip
        assert fetched < total
        assert obs["driver_state"] == {"cursor": 7, "step": 1}
        assert obs["restored_steps"] == first[rank]["saved_steps"] == 1

    # The restored weights are the saved ones, and the next step (which also uses Adam's moments and the
    # step count restored from the optimizer partitions) gives exactly what the uninterrupted run got.
    saved, restored = first[0]["saved"], resumed[0]["restored"]
    assert list(restored) == list(saved)
    for name, t in saved.items():
        assert restored[name].dtype == t.dtype and torch.equal(restored[name], t), name
    for rank in range(WORLD):
        assert resumed[rank]["next_loss"] == first[rank]["next_loss"]
    for name, t in first[0]["next"].items():
        assert torch.equal(resumed[0]["next"][name], t), name
    assert any(not torch.equal(first[0]["next"][n], saved[n]) for n in saved)  # the second step trained
