"""Where a run's checkpoints and final model live: a local directory, a mount every node sees, or object
storage (`s3://`, `gs://`, anything `pyarrow.fs` understands).

On a cluster the trainer workers write checkpoints and the final model on their own nodes, and a
resumed run may start on other nodes: `trainer.output_dir` must be storage that all of them reach. A
local path works on one machine or on a shared mount; a URI goes through `pyarrow.fs` (Ray Train's own
storage layer), so no file path ever passes between nodes. Options of the filesystem ride in the URI's
query, as pyarrow reads them (`s3://bucket/runs/x?endpoint_override=http://minio:9000&scheme=http`);
credentials come from the environment (`AWS_ACCESS_KEY_ID`, ...), never from the config.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit, urlunsplit


def is_uri(location: str) -> bool:
    """`s3://...`, `gs://...` (object storage) rather than a local or mounted path."""
    return "://" in location and not location.startswith("file://")


def join(location: str, *parts: str) -> str:
    """`location`/parts, keeping a URI's query (the filesystem's options) at the end.

    >>> join("s3://b/runs/x?endpoint_override=http://h:9000", "final_model")
    's3://b/runs/x/final_model?endpoint_override=http://h:9000'
    >>> join("/data/runs/x", "ray_train")
    '/data/runs/x/ray_train'
    """
    if not is_uri(location):
        return str(Path(location, *parts))
    u = urlsplit(location)
    path = "/".join([u.path.rstrip("/"), *(p.strip("/") for p in parts)])
    return urlunsplit((u.scheme, u.netloc, path, u.query, u.fragment))


def name(location: str) -> str:
    """The run's name: the last part of its path.

    >>> name("s3://b/runs/demo?region=us-east-1"), name("runs/demo/")
    ('demo', 'demo')
    """
    path = urlsplit(location).path if is_uri(location) else location
    return Path(path.rstrip("/")).name


def resolve(location: str) -> str:
    """An absolute path for a local directory (Ray workers do not share the driver's working
    directory); a URI unchanged."""
    return location if is_uri(location) else str(Path(location).resolve())


def filesystem(location: str):
    """(pyarrow filesystem, path inside it) for `location`."""
    import pyarrow.fs

    return pyarrow.fs.FileSystem.from_uri(location if is_uri(location) else str(Path(location).resolve()))


def upload_dir(local: Path, location: str) -> None:
    """Copy the directory `local` to `location` (a URI); replaces what is there."""
    import pyarrow.fs

    fs, path = filesystem(location)
    fs.create_dir(path, recursive=True)
    pyarrow.fs.copy_files(str(local), path, source_filesystem=pyarrow.fs.LocalFileSystem(), destination_filesystem=fs)


def download_dir(location: str, local: Path) -> Path:
    """Copy the directory at `location` into `local`; returns `local`."""
    import pyarrow.fs

    fs, path = filesystem(location)
    local.mkdir(parents=True, exist_ok=True)
    pyarrow.fs.copy_files(path, str(local), source_filesystem=fs, destination_filesystem=pyarrow.fs.LocalFileSystem())
    return local
