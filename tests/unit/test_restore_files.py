"""Which checkpoint files a trainer rank fetches on restore (`dapo_ray.trainer.restore`), and where it reads
them from: in place for a checkpoint on the local filesystem, a private download from object storage.
The engine here only records what `load_checkpoint` was given; tests/integration/test_checkpoint_restore.py
restores real DeepSpeed engines from real checkpoints."""

import json
from pathlib import Path

import pytest

from dapo_ray import storage
from dapo_ray.trainer.restore import files_for_rank, restore

# What `loop._report` leaves in a checkpoint of 2 ranks (DeepSpeed 0.19.8's names), per ZeRO stage.
COMMON = ["driver_state.json", "latest", "zero_to_fp32.py", "zero_to_torch.py"]
STAGE_0 = ["driver_state.json", "latest", "ckpt/mp_rank_00_model_states.pt"]
STAGE_1_BF16 = COMMON + ["ckpt/mp_rank_00_model_states.pt"]
STAGE_1_BF16 += [f"ckpt/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
STAGE_3 = COMMON + [
    f"ckpt/zero_pp_rank_{r}_mp_rank_00_{k}_states.pt" for r in (0, 1) for k in ("model", "optim")
]


def test_stage_0_every_rank_reads_the_one_model_states_file():
    for rank in (0, 1):
        assert files_for_rank(STAGE_0, "ckpt", rank) == [STAGE_0[2], "driver_state.json"]


def test_stages_1_and_2_the_shared_module_and_the_rank_own_optimizer_partition():
    assert files_for_rank(STAGE_1_BF16, "ckpt", 1) == [
        "ckpt/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "ckpt/mp_rank_00_model_states.pt", "driver_state.json",
    ]  # fmt: skip


def test_stage_3_only_the_rank_own_files():
    assert files_for_rank(STAGE_3, "ckpt", 0) == [
        "ckpt/zero_pp_rank_0_mp_rank_00_model_states.pt", "ckpt/zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "driver_state.json",
    ]  # fmt: skip


def test_rank_numbers_are_matched_whole_and_other_tags_are_left():
    names = [f"ckpt/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (1, 10, 11, 21)]
    names += ["older/zero_pp_rank_1_mp_rank_00_optim_states.pt", "ckpt/mp_rank_00_model_states.pt"]
    assert files_for_rank(names, "ckpt", 1) == ["ckpt/mp_rank_00_model_states.pt",
                                                "ckpt/zero_pp_rank_1_mp_rank_00_optim_states.pt"]  # fmt: skip
    assert files_for_rank(names, "ckpt", 10) == ["ckpt/mp_rank_00_model_states.pt",
                                                 "ckpt/zero_pp_rank_10_mp_rank_00_optim_states.pt"]  # fmt: skip


class RecordingEngine:
    """Stands in for the DeepSpeed engine: records the directory `load_checkpoint` got and the files in it
    at that moment. Its optimizer has no data-parallel group, as without ZeRO: files go by world rank."""

    optimizer = object()

    def load_checkpoint(self, load_dir: str, tag: str, load_module_strict: bool) -> None:
        root = Path(load_dir)
        present = sorted(str(f.relative_to(root)) for f in root.rglob("*") if f.is_file())
        self.loaded = (load_dir, tag, present)


def _write(directory: Path, names: list[str]) -> dict[str, int]:
    sizes = {}
    for i, name in enumerate(names):
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        data = (
            json.dumps({"step": 3}).encode() if name == "driver_state.json" else bytes([i]) * 1000 * (i + 1)
        )
        (directory / name).write_bytes(data)
        sizes[name] = len(data)
    return sizes


def test_a_local_checkpoint_is_read_in_place(gloo_group, tmp_path):
    from ray.train import Checkpoint

    sizes = _write(tmp_path / "checkpoint_1", STAGE_3)
    engine = RecordingEngine()
    done = restore(engine, Checkpoint.from_directory(str(tmp_path / "checkpoint_1")))
    assert engine.loaded == (str(tmp_path / "checkpoint_1"), "ckpt", sorted(STAGE_3))
    assert done.driver_state == {"step": 3} and done.fetched == {}
    assert (done.total_files, done.total_bytes) == (len(STAGE_3), sum(sizes.values()))


@pytest.mark.parametrize("names", [STAGE_3, STAGE_1_BF16], ids=["zero3", "zero1-bf16"])
def test_from_object_storage_only_the_rank_files_come_down_into_a_private_directory(gloo_group, s3_prefix,
                                                                                     tmp_path, names):  # fmt: skip
    from ray.train import Checkpoint

    sizes = _write(tmp_path / "checkpoint_1", names)
    storage.upload_dir(tmp_path / "checkpoint_1", storage.join(s3_prefix, "checkpoint_1"))
    fs, path = storage.filesystem(storage.join(s3_prefix, "checkpoint_1"))
    engine = RecordingEngine()
    done = restore(engine, Checkpoint(path, filesystem=fs))
    want = files_for_rank(names, "ckpt", 0)
    load_dir, tag, present = engine.loaded
    assert present == want and tag == "ckpt"
    assert done.fetched == {name: sizes[name] for name in want} and done.fetched_bytes < done.total_bytes
    assert (done.total_files, done.total_bytes) == (len(names), sum(sizes.values()))
    assert done.driver_state == {"step": 3}
    assert not Path(load_dir).exists()  # the download is removed after loading
