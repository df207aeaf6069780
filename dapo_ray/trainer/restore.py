"""Restore a trainer worker from a Ray Train checkpoint, fetching only the files its rank reads.

A checkpoint is the union of what every rank wrote in `loop._report` (Ray Train copies each worker's
directory into the same checkpoint directory). With DeepSpeed 0.19.8 and 2 ranks:

    driver_state.json                          rank 0's: the driver's state; every rank reads the step
    latest, zero_to_fp32.py, zero_to_torch.py  rank 0's (DeepSpeed): not read when the tag is given
    ckpt/mp_rank_00_model_states.pt            stages 0-2, rank 0's: the module (stage 0: and the
                                               optimizer); every rank loads it
    ckpt/zero_pp_rank_{r}_mp_rank_00_model_states.pt     stage 3, rank r's: its partition's metadata
    ckpt/[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt  stages 1-3, rank r's optimizer partition

`engine.load_checkpoint(dir, tag=...)` builds every name it opens under `dir/tag/`, and of the
rank-numbered files opens only those of its own data-parallel rank (it names the other ranks' optimizer
files but opens them only with `elastic_checkpoint`, which this trainer does not set). So a rank needs
`driver_state.json` and the files under `tag/` that are not another rank's: under ZeRO-3 about 1/world
of the checkpoint, where `Checkpoint.to_directory` would download all of it on every worker.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

DRIVER_STATE = "driver_state.json"
# DeepSpeed's rank-numbered files: "[bf16_]zero_pp_rank_{dp_rank}_mp_rank_{mp:02d}_{model,optim}_states.pt".
_SHARD_RANK = re.compile(r"(?:^|_)zero_pp_rank_(\d+)_")


@dataclass(frozen=True)
class Restored:
    """What a restore found and did on one rank."""

    driver_state: dict
    fetched: dict[str, int]  # file (relative to the checkpoint) -> bytes downloaded; {} when read in place
    total_files: int  # the whole checkpoint, every rank's files
    total_bytes: int

    @property
    def fetched_bytes(self) -> int:
        return sum(self.fetched.values())


def files_for_rank(names: Iterable[str], tag: str, rank: int) -> list[str]:
    """The files (paths relative to the checkpoint) that data-parallel rank `rank` reads to restore `tag`.

    >>> files_for_rank(["driver_state.json", "latest", "ckpt/mp_rank_00_model_states.pt",
    ...                 "ckpt/zero_pp_rank_0_mp_rank_00_optim_states.pt",
    ...                 "ckpt/zero_pp_rank_1_mp_rank_00_optim_states.pt"], "ckpt", 1)
    ['ckpt/mp_rank_00_model_states.pt', 'ckpt/zero_pp_rank_1_mp_rank_00_optim_states.pt', 'driver_state.json']
    """
    keep = []
    for name in names:
        if name == DRIVER_STATE:
            keep.append(name)
        elif name.startswith(f"{tag}/"):
            shard = _SHARD_RANK.search(name.rsplit("/", 1)[-1])
            if shard is None or int(shard.group(1)) == rank:
                keep.append(name)
    return sorted(keep)


def restore(engine, checkpoint, tag: str = "ckpt") -> Restored:
    """Load `checkpoint` (a `ray.train.Checkpoint` written by `loop._report`) into the DeepSpeed `engine`;
    returns the driver state saved with it and what was fetched. A checkpoint on the local filesystem (one
    machine, or a mount every node sees) is read in place, as `Checkpoint.as_directory` does; one in object
    storage is downloaded file by file into a directory of this worker's own, and removed after loading."""
    import pyarrow.fs
    import torch.distributed as dist

    fs, root = checkpoint.filesystem, checkpoint.path.rstrip("/")
    sizes = {info.path[len(root) + 1 :]: info.size
             for info in fs.get_file_info(pyarrow.fs.FileSelector(root, recursive=True))
             if info.type == pyarrow.fs.FileType.File}  # fmt: skip
    if isinstance(fs, pyarrow.fs.LocalFileSystem):
        state = _load(engine, Path(root), tag)
        done = Restored(state, {}, len(sizes), sum(sizes.values()))
        print(f"[trainer {dist.get_rank()}] restored step {state['step']} in place from {root} "
              f"({done.total_files} files, {done.total_bytes:,} bytes)", flush=True)  # fmt: skip
        return done
    local = Path(tempfile.mkdtemp(prefix="dapo-restore-"))  # checked: this worker's own download of its shards from storage, read back by the same worker
    try:
        fetched = {}
        for name in files_for_rank(sizes, tag, _shard_rank(engine)):
            (local / name).parent.mkdir(parents=True, exist_ok=True)
            pyarrow.fs.copy_files(f"{root}/{name}", str(local / name), source_filesystem=fs,
                                  destination_filesystem=pyarrow.fs.LocalFileSystem())  # fmt: skip
            fetched[name] = (local / name).stat().st_size
        state = _load(engine, local, tag)
    finally:
        shutil.rmtree(local, ignore_errors=True)
    done = Restored(state, fetched, len(sizes), sum(sizes.values()))
    print(f"[trainer {dist.get_rank()}] restored step {state['step']} from {root}: fetched "
          f"{done.fetched_bytes:,} of {done.total_bytes:,} bytes ({len(fetched)} of {done.total_files} files)",
          flush=True)  # fmt: skip
    return done


def _shard_rank(engine) -> int:
    """The rank DeepSpeed numbers this worker's files with: its rank in the optimizer's data-parallel group
    (the world rank without ZeRO, whose optimizer has no such group, and where no file is numbered)."""
    import torch.distributed as dist

    return dist.get_rank(group=getattr(engine.optimizer, "dp_process_group", None))


def _load(engine, directory: Path, tag: str) -> dict:
    engine.load_checkpoint(str(directory), tag=tag, load_module_strict=True)
    return json.loads((directory / DRIVER_STATE).read_text())
