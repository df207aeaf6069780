"""trainer.output_dir as a directory or as object storage: names, joins, and a directory's round trip
through a real S3 protocol server (moto's, in a process of its own: tests/conftest.py `s3_prefix`)."""

from dapo_ray import storage


def test_names_and_joins_keep_the_filesystem_options_at_the_end():
    uri = "s3://bucket/runs/demo?endpoint_override=http://127.0.0.1:9000&scheme=http"
    assert storage.is_uri(uri) and not storage.is_uri("runs/demo") and not storage.is_uri("file:///x")
    assert storage.name(uri) == "demo" and storage.name("runs/demo/") == "demo"
    assert storage.join(uri, "ray_train") == "s3://bucket/runs/demo/ray_train?endpoint_override=http://127.0.0.1:9000&scheme=http"
    assert storage.join("runs/demo", "final_model") == "runs/demo/final_model"
    assert storage.resolve(uri) == uri and storage.resolve("runs").startswith("/")


def test_a_directory_goes_to_object_storage_and_back(s3_prefix, tmp_path):
    src = tmp_path / "model"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"a": 1}')
    (src / "sub" / "weights.bin").write_bytes(bytes(range(256)) * 1000)
    target = storage.join(s3_prefix, "final_model")
    storage.upload_dir(src, target)
    back = storage.download_dir(target, tmp_path / "back")
    assert (back / "config.json").read_text() == '{"a": 1}'
    assert (back / "sub" / "weights.bin").read_bytes() == (src / "sub" / "weights.bin").read_bytes()
    fs, path = storage.filesystem(target)
    assert fs.get_file_info(f"{path}/config.json").size == 8
