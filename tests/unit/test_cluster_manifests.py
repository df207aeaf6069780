"""The cluster/ manifests, checked offline in seconds: no Kubernetes, no Anyscale account, no GPU.

* Every `ray.io/v1` document is validated against KubeRay 1.7's CRD schema (../shared/kuberay/; those
  tests skip without it) after the defaulting the API server does first, and walked for keys the schema
  has no place for: the API server silently drops a misspelt `entrypiont`.
* The operator's own rules, which the schema lacks (KubeRay 1.7, controllers/ray/utils/validation.go),
  and this recipe's: one pinned Ray everywhere, a head with no CPUs for tasks, /dev/shm in memory,
  credentials from secrets.
* The runtime environments are parsed by Ray's own `RuntimeEnv`.
* Feasibility: the node types Ray's KubeRay autoscaler derives from each cluster spec must host one
  rollout replica and one trainer worker of the config the entrypoint runs, and scale to its sizes.
* Disk: every disk volume sized, a pod's within the disk cluster/README.md lists, requested (ephemeral-storage,
  as the scheduler adds it up) for at least their sum and as much as the README lists, and TMPDIR on one with
  room for what the trainer ranks write there (a checkpoint's shards, the final model).
* The entrypoint names a config that loads and passes `dapo-ray check`.
* Anyscale: the anyscale SDK's models when installed, else its keys and ranges by hand; the same custom
  resources and the same entrypoint as the RayJob.
`test_broken_manifests_are_caught` breaks the RayJob one way at a time and expects each to be reported.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from dapo_ray import placement
from dapo_ray.cli import build_parser, main
from dapo_ray.config import Config, load_config

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster"
RAYCLUSTER = CLUSTER / "kuberay" / "raycluster.yaml"
RAYJOB = CLUSTER / "kuberay" / "rayjob.yaml"
RUNTIME_ENV = CLUSTER / "runtime_env.yaml"
ANYSCALE_JOB = CLUSTER / "anyscale" / "job.yaml"
ANYSCALE_COMPUTE = CLUSTER / "anyscale" / "compute_config.yaml"
SCHEMAS = REPO.parent / "shared" / "kuberay"

# Overrides that say where a platform keeps the model, the data and the runs: they may differ between
# platforms; every other override is the recipe and must not.
STORAGE_KEYS = ("rollout.model_path", "data.train_files", "eval.files", "trainer.output_dir")
# What `ray job submit --working-dir .` may upload (Ray's GCS package limit).
UPLOAD_LIMIT = 512 * 2**20


def _load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _ray_pin() -> str:
    """The Ray version pinned in pyproject.toml (`ray[...]==X.Y.Z`)."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(m.group(1) for d in deps if (m := re.fullmatch(r"ray\[[^]]*\]==(\S+)", d)))


def _ray_docs() -> list[dict]:
    return [d for p in (RAYCLUSTER, RAYJOB) for d in _load(p) if d.get("apiVersion") == "ray.io/v1"]


def _rayjob() -> dict:
    return next(d for d in _load(RAYJOB) if d["kind"] == "RayJob")


def _cluster_specs() -> dict[str, dict]:
    """The two cluster specs: the long-lived RayCluster's and the one the RayJob creates."""
    raycluster = next(d for d in _load(RAYCLUSTER) if d["kind"] == "RayCluster")
    return {"raycluster": raycluster["spec"], "rayjob": _rayjob()["spec"]["rayClusterSpec"]}


def _groups(spec: dict) -> list[tuple[str, dict]]:
    return [("head", spec["headGroupSpec"]), *((g["groupName"], g) for g in spec.get("workerGroupSpecs", []))]


def _parse_entrypoint(command: str) -> tuple[str, list[str]]:
    """(config path, overrides) of `python workflows/train.py --config PATH key=value ...`, read by the
    CLI's own parser, as workflows/train.py reads it."""
    argv = shlex.split(command)
    assert argv[:2] == ["python", "workflows/train.py"], (
        f"entrypoint must run workflows/train.py: {command!r}"
    )
    args = build_parser().parse_args(["train", *argv[2:]])
    return args.config, args.overrides


def _entrypoint_config(command: str) -> Config:
    config, overrides = _parse_entrypoint(command)
    return load_config(REPO / config, overrides)


# --- the API server: defaults, schema, unknown keys ---------------------------------------------------


@pytest.fixture(scope="module")
def crd_schemas() -> dict[str, dict]:
    if not SCHEMAS.is_dir():
        pytest.skip(f"KubeRay CRD schemas not found at {SCHEMAS}: the schema checks need them")
    return {kind: json.loads((SCHEMAS / f"{kind.lower()}.v1.schema.json").read_text())
            for kind in ("RayCluster", "RayJob")}  # fmt: skip


def _as_stored(node, schema: dict):
    """The object the API server validates: nulls dropped, absent fields that have a `default` filled in
    (`minReplicas`/`maxReplicas` are required but defaulted, so a validator without this pass rejects
    valid manifests)."""
    if isinstance(node, list):
        return [_as_stored(v, schema.get("items", {})) for v in node if v is not None]
    if not isinstance(node, dict):
        return node
    props, extra = schema.get("properties", {}), schema.get("additionalProperties")
    out = {k: _as_stored(v, props.get(k) or (extra if isinstance(extra, dict) else {}))
           for k, v in node.items() if v is not None}  # fmt: skip
    for k, sub in props.items():
        if k not in out and "default" in sub:
            out[k] = _as_stored(copy.deepcopy(sub["default"]), sub)
    return out


def _schema_errors(doc: dict, schema: dict) -> list[str]:
    import jsonschema

    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(_as_stored(doc, schema))]  # fmt: skip


def _unknown_keys(node, schema: dict, path: str = "") -> list[str]:
    """Keys absent from the schema's `properties` where neither `additionalProperties` nor
    `x-kubernetes-preserve-unknown-fields` lets them in: the API server would prune them."""
    if isinstance(node, list):
        return [
            k for i, v in enumerate(node) for k in _unknown_keys(v, schema.get("items", {}), f"{path}[{i}]")
        ]
    if not isinstance(node, dict) or "properties" not in schema:
        return []
    props, extra = schema["properties"], schema.get("additionalProperties")
    found = []
    for k, v in node.items():
        if k in props:
            found += _unknown_keys(v, props[k], f"{path}.{k}")
        elif isinstance(extra, dict):
            found += _unknown_keys(v, extra, f"{path}.{k}")
        elif not (extra or schema.get("x-kubernetes-preserve-unknown-fields")):
            found.append(f"{path}.{k}")
    return found


# --- the operator's rules -----------------------------------------------------------------------------

DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MAX_NAME = {"RayCluster": 53, "RayJob": 47}  # KubeRay 1.7 utils/constant.go: room for generated suffixes
SUBMISSION_MODES = ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")
RAY_START_RESOURCES = ("num-cpus", "num-gpus", "memory", "resources")


def _operator_errors(doc: dict) -> list[str]:
    kind, name, spec = doc["kind"], doc["metadata"].get("name", ""), doc.get("spec", {})
    errors = []
    if not DNS_1035.fullmatch(name) or len(name) > MAX_NAME[kind]:
        errors.append(f"{kind} name {name!r} must be a DNS-1035 label of at most {MAX_NAME[kind]} characters")
    cluster = spec
    if kind == "RayJob":
        cluster = spec.get("rayClusterSpec")
        mode = spec.get("submissionMode", "K8sJobMode")
        if mode not in SUBMISSION_MODES:
            errors.append(f"submissionMode {mode!r} is not one of {SUBMISSION_MODES}")
        if bool(cluster) == bool(spec.get("clusterSelector")):
            errors.append("a RayJob sets exactly one of rayClusterSpec and clusterSelector")
        ttl, shutdown = spec.get("ttlSecondsAfterFinished", 0), spec.get("shutdownAfterJobFinishes", False)
        if ttl < 0 or (ttl > 0 and not shutdown):
            errors.append(
                "ttlSecondsAfterFinished must be >= 0, and > 0 only with shutdownAfterJobFinishes: true"
            )
        if spec.get("suspend") and not shutdown:
            errors.append("suspend needs shutdownAfterJobFinishes: true")
        if mode == "InteractiveMode" and spec.get("backoffLimit", 0) > 0:
            errors.append("InteractiveMode does not allow backoffLimit > 0")
        if spec.get("backoffLimit", 0) < 0:
            errors.append("backoffLimit must be >= 0")
        errors += [f"{k} must be > 0" for k in ("activeDeadlineSeconds", "preRunningDeadlineSeconds")
                   if k in spec and spec[k] <= 0]  # fmt: skip
        if not isinstance(yaml.safe_load(spec.get("runtimeEnvYAML") or "{}"), dict):
            errors.append("runtimeEnvYAML must be a YAML mapping")
    return errors + (_cluster_spec_errors(cluster) if cluster else [])


def _cluster_spec_errors(spec: dict) -> list[str]:
    errors = []
    v2 = (spec.get("autoscalerOptions") or {}).get("version") == "v2"
    for name, g in _groups(spec):
        params = g.get("rayStartParams", {})
        if not g["template"]["spec"].get("containers"):
            errors.append(f"{name}: the pod template has no container")
        errors += [f"{name}: rayStartParams.{k} must be a string, got {v!r}" for k, v in params.items()
                   if not isinstance(v, str)]  # fmt: skip
        if g.get("resources") and any(params.get(k) for k in RAY_START_RESOURCES):
            errors.append(
                f"{name}: set resources either in the group's `resources` or in rayStartParams, not both"
            )
        if "labels" in params:
            errors.append(f"{name}: rayStartParams.labels is not supported; use the group's `labels`")
        if "resources" in params:
            errors += [f"{name}: {e}" for e in _ray_start_resources_errors(params["resources"])]
        if name != "head":
            lo, hi = g.get("minReplicas", 0), g.get("maxReplicas", 2**31 - 1)
            if not 0 <= lo <= hi:
                errors.append(f"{name}: needs 0 <= minReplicas ({lo}) <= maxReplicas ({hi})")
            if "idleTimeoutSeconds" in g and not v2:
                errors.append(f"{name}: a group's idleTimeoutSeconds needs autoscalerOptions.version: v2")
    return errors


def _ray_start_resources_errors(value) -> list[str]:
    """`rayStartParams.resources` is a JSON object inside an extra pair of double quotes, with integer
    amounts: `'"{\\"rollout\\": 1}"'` (Ray's autoscaler strips the quotes and backslashes to read it)."""
    if not (isinstance(value, str) and len(value) > 2 and value[0] == value[-1] == '"'):
        return [
            f"rayStartParams.resources must be a JSON object in an extra pair of double quotes, got {value!r}"
        ]
    try:
        parsed = json.loads(value[1:-1].replace("\\", ""))
    except json.JSONDecodeError as e:
        return [f"rayStartParams.resources {value!r} is not JSON: {e}"]
    if not (isinstance(parsed, dict) and all(type(v) is int for v in parsed.values())):
        return [f"rayStartParams.resources must map names to integers, got {parsed!r}"]
    return []


# --- this recipe's rules ------------------------------------------------------------------------------

SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|ACCESS_KEY|CREDENTIAL", re.I)


def _image_ray_version(image: str) -> str | None:
    """The Ray in an image tag: `rayproject/ray:2.60.0-py311-gpu`, or `...:ray2.60.0-...` for an image
    built from it."""
    repo, _, tag = image.rpartition(":")
    if repo.startswith("rayproject/"):
        return tag.split("-")[0]
    m = re.search(r"ray(\d+\.\d+\.\d+)", tag)
    return m.group(1) if m else None


def _quantity(q) -> float:
    from ray.autoscaler._private.kuberay.utils import parse_quantity

    return float(parse_quantity(str(q)))


def _recipe_errors(spec: dict) -> list[str]:
    pin = _ray_pin()
    errors = []
    if spec.get("rayVersion") != pin:
        errors.append(f"rayVersion {spec.get('rayVersion')!r} != the ray pinned in pyproject.toml ({pin})")
    if not (spec.get("enableInTreeAutoscaling") and spec.get("autoscalerOptions")):
        errors.append("needs enableInTreeAutoscaling: true and autoscalerOptions")
    if spec["headGroupSpec"].get("rayStartParams", {}).get("num-cpus") != "0":
        errors.append(
            'head: rayStartParams.num-cpus must be "0": no task or actor may compete with the driver'
        )
    for name, g in _groups(spec):
        pod = g["template"]["spec"]
        for c in pod.get("initContainers", []) + pod["containers"]:
            if _image_ray_version(c["image"]) != pin:
                errors.append(f"{name}/{c['name']}: image {c['image']} does not carry Ray {pin}")
        errors += _credential_errors(name, pod) + _shm_errors(name, g)
        if name != "head" and not g.get("minReplicas", 0) <= g.get("replicas", 0) <= g.get("maxReplicas", 0):
            errors.append(f"{name}: replicas must lie between minReplicas and maxReplicas")
    return errors


def _credential_errors(name: str, pod: dict) -> list[str]:
    """Credentials only from secrets: S3's for every Ray container (checkpoints, the code archive), the
    Hugging Face token for every container that downloads from the Hub."""
    errors = []
    for c in pod.get("initContainers", []) + pod["containers"]:
        errors += [f"{name}/{c['name']}: {e['name']} is written inline; read it from a secret"
                   for e in c.get("env", []) if SECRET_NAME.search(e["name"]) and "value" in e]  # fmt: skip
    if not any("secretRef" in s for s in pod["containers"][0].get("envFrom", [])):
        errors.append(f"{name}: the Ray container reads no storage credentials (envFrom secretRef)")
    for c in pod.get("initContainers", []):
        downloads = "hf download" in " ".join(c.get("command", []) + c.get("args", []))
        token = any(
            e["name"] == "HF_TOKEN" and "secretKeyRef" in e.get("valueFrom", {}) for e in c.get("env", [])
        )
        if downloads and not token:
            errors.append(f"{name}/{c['name']}: downloads from the Hub without HF_TOKEN from a secret")
    return errors


def _shm_errors(name: str, group: dict) -> list[str]:
    """/dev/shm in memory (vLLM's tensor-parallel workers, NCCL and Ray's object store use it; the container
    default is 64 MiB), at least as large as the object store, or Ray falls back to disk."""
    pod = group["template"]["spec"]
    mounts = {m["name"] for m in pod["containers"][0].get("volumeMounts", []) if m["mountPath"] == "/dev/shm"}
    shm = [v["emptyDir"] for v in pod.get("volumes", [])
           if v["name"] in mounts and v.get("emptyDir", {}).get("medium") == "Memory"]  # fmt: skip
    if not shm:
        return [f"{name}: needs an emptyDir with medium: Memory mounted at /dev/shm"]
    store = group.get("rayStartParams", {}).get("object-store-memory")
    if store and "sizeLimit" in shm[0] and _quantity(shm[0]["sizeLimit"]) < _quantity(store):
        return [f"{name}: /dev/shm ({shm[0]['sizeLimit']}) is smaller than object-store-memory ({store})"]
    return []


# --- feasibility --------------------------------------------------------------------------------------


def _demands(cfg: Config) -> tuple[dict[str, float], dict[str, float]]:
    """What one rollout replica and one trainer worker ask Ray for, as the code asks it
    (dapo_ray/placement.py): a replica's placement group on one node, a trainer worker's resources."""
    return placement.replica_demand(cfg.rollout), placement.worker_resources(cfg.trainer)


def _kuberay_node_types(spec: dict) -> dict[str, dict]:
    """Worker node types as Ray's KubeRay autoscaler reads them from the cluster spec (a private API of
    Ray; it needs the namespace the API server would fill in)."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr

    cr = {"metadata": {"name": "dapo", "namespace": "default"}, "spec": copy.deepcopy(spec)}
    types = _derive_autoscaling_config_from_ray_cr(cr)["available_node_types"]
    return {name: t for name, t in types.items() if name != "headgroup"}


def _hosts(node_types: dict[str, dict], demand: dict[str, float]) -> dict[str, int]:
    """{group: how many of `demand` one of its nodes holds at once}, for the groups that hold one."""
    held = {n: min(int(nt["resources"].get(k, 0) // v) for k, v in demand.items() if v > 0)
            for n, nt in node_types.items()}  # fmt: skip
    return {n: k for n, k in held.items() if k > 0}


def _feasibility_errors(node_types: dict[str, dict], cfg: Config, *, from_zero: bool) -> list[str]:
    """Can the groups host the config's rollout replicas and trainer workers, at the sizes it asks for?
    `node_types`: {group: {"resources", "min_workers", "max_workers"}}, per node, as Ray's autoscaler has
    them."""
    if not (cfg.rollout.resources and cfg.trainer.resources):
        return ["the config sets no rollout.resources / trainer.resources: set e.g. rollout.resources={rollout: 1} "
                "and trainer.resources={trainer: 1}, the custom resources the rollout and trainer groups declare; "
                "without them replicas and trainer workers land on any node with free GPUs, trainer nodes "
                "included"]  # fmt: skip
    replica, worker = _demands(cfg)
    rollout, trainer = _hosts(node_types, replica), _hosts(node_types, worker)
    offered = {n: nt["resources"] for n, nt in node_types.items()}
    missing = [f"no worker group holds one {what} {demand}; the groups offer {offered}"
               for what, demand, hosts in (("rollout replica", replica, rollout), ("trainer worker", worker, trainer))
               if not hosts]  # fmt: skip
    if missing:
        return missing
    errors = []
    if rollout.keys() & trainer.keys():
        errors.append(
            f"groups {sorted(rollout.keys() & trainer.keys())} hold both replicas and trainer workers"
        )
    for groups, demand, what in ((rollout, replica, "replica"), (trainer, worker, "trainer worker")):
        for n, k in groups.items():
            if (gpus := offered[n].get("GPU", 0)) != k * demand["GPU"]:
                errors.append(f"{n}: {gpus:g} GPUs for {k} {what}(s) of {demand['GPU']:g} GPUs; the custom resource "
                              "and the GPUs must come in the same proportion, or GPUs sit idle or a "
                              f"{what} waits for GPUs that are taken")  # fmt: skip
    return (
        errors
        + _rollout_scaling_errors(node_types, rollout, cfg, from_zero)
        + _trainer_size_errors(node_types, trainer, cfg)
    )


def _rollout_scaling_errors(
    node_types: dict, rollout: dict[str, int], cfg: Config, from_zero: bool
) -> list[str]:
    """Ray Serve moves between rollout.min_replicas and max_replicas; the rollout groups must follow it
    (from zero on a long-lived cluster) and hold no more than its floor."""
    r, errors = cfg.rollout, []
    most = sum(node_types[n]["max_workers"] * k for n, k in rollout.items())
    least = sum(node_types[n]["min_workers"] * k for n, k in rollout.items())
    gpus = sum(node_types[n]["max_workers"] * node_types[n]["resources"]["GPU"] for n in rollout)
    if most < r.max_replicas or gpus < r.max_replicas * r.tensor_parallel_size:
        errors.append(f"the rollout groups reach {most} replicas and {gpus:g} GPUs; rollout.max_replicas "
                      f"({r.max_replicas}) x tensor_parallel_size ({r.tensor_parallel_size}) need more")  # fmt: skip
    if least > r.min_replicas:
        errors.append(f"the rollout groups never shrink below {least} replicas, more than "
                      f"rollout.min_replicas ({r.min_replicas}): those GPUs idle while the trainers work")  # fmt: skip
    if all(node_types[n]["min_workers"] == node_types[n]["max_workers"] for n in rollout):
        errors.append("the rollout groups cannot grow or shrink (minReplicas == maxReplicas)")
    if from_zero and least:
        errors.append("a long-lived cluster's rollout groups should scale from zero (minReplicas: 0)")
    return errors


def _trainer_size_errors(node_types: dict, trainer: dict[str, int], cfg: Config) -> list[str]:
    """Ray Train starts every worker at once, so the trainer groups have a fixed size that holds them all."""
    n_workers, errors = cfg.trainer.num_workers, []
    errors += [f"{n}: a trainer group must have a fixed size (minReplicas == maxReplicas)" for n in trainer
               if node_types[n]["min_workers"] != node_types[n]["max_workers"]]  # fmt: skip
    held = sum(node_types[n]["min_workers"] * k for n, k in trainer.items())
    gpus = sum(node_types[n]["min_workers"] * node_types[n]["resources"]["GPU"] for n in trainer)
    if held < n_workers or gpus < n_workers:
        errors.append(
            f"the trainer groups hold {held} workers on {gpus:g} GPUs < trainer.num_workers ({n_workers})"
        )
    return errors


# --- disk: the volumes of each pod, and room for what the trainer ranks write under TMPDIR -------------

# Qwen2.5-32B's parameters. A ZeRO-3 checkpoint holds fp32 master weights and two Adam moments, 12 bytes a
# parameter, split over the trainer ranks; the final model is bf16, 2 bytes a parameter (61 GiB).
PARAMS = 32.5e9
README_DISK = re.compile(r"^\| (\w+) \|.*?(\d+) GiB disk", re.M)


def _readme_disk() -> dict[str, int]:
    """{group: bytes of disk per pod}, as cluster/README.md's sizing table lists them."""
    return {g: int(n) * 2**30 for g, n in README_DISK.findall((CLUSTER / "README.md").read_text())}


def _tmp_need(cfg: Config, ranks_per_pod: int) -> float:
    """The most a trainer pod writes under TMPDIR at once: its ranks' shards of a checkpoint before the upload
    (`_report` in dapo_ray/trainer/loop.py; restore.py fetches as much back), and the final model if rank 0
    is among them (`_save_final`; any pod may hold rank 0)."""
    return ranks_per_pod * 12 * PARAMS / cfg.trainer.num_workers + 2 * PARAMS


def _container_disk(c: dict, kind: str) -> float | None:
    """A container's ephemeral-storage `kind` ("requests" or "limits"); a request left out is its limit, as the
    API server fills it in."""
    res = c.get("resources") or {}
    q = (res.get(kind) or {}).get("ephemeral-storage")
    if q is None and kind == "requests":
        q = (res.get("limits") or {}).get("ephemeral-storage")
    return None if q is None else _quantity(q)


def _pod_disk(pod: dict, kind: str = "requests") -> float:
    """A pod's ephemeral-storage `kind` as Kubernetes adds it up (k8s.io/component-helpers resource.PodRequests,
    PodLimits): the larger of its containers' sum, sidecars (init containers with restartPolicy: Always)
    included, and any other init container's own with the sidecars started before it. The scheduler places a
    pod by its requests; an emptyDir's sizeLimit only says when the kubelet evicts it."""
    total = sum(_container_disk(c, kind) or 0.0 for c in pod["containers"])
    sidecars = init = 0.0
    for c in pod.get("initContainers", []):
        amount = _container_disk(c, kind) or 0.0
        if c.get("restartPolicy") == "Always":
            total, sidecars = total + amount, sidecars + amount
            init = max(init, sidecars)
        else:
            init = max(init, amount + sidecars)
    return max(total, init)


def _disk_request_errors(name: str, pod: dict, volumes: float, listed: float | None) -> list[str]:
    """The pod requests at least its disk volumes (emptyDirs on disk; /dev/shm counts as memory) and just the
    disk cluster/README.md lists for its group; its limit, if it has one, lets the volumes fill."""
    errors, gib = [], 2**30
    containers = pod.get("initContainers", []) + pod["containers"]
    for c in containers:
        limit = _container_disk(c, "limits")
        if limit is not None and (_container_disk(c, "requests") or 0.0) > limit:
            errors.append(f"{name}/{c['name']}: requests more ephemeral-storage than its limit; the API server "
                          "rejects it")  # fmt: skip
    request, limited = _pod_disk(pod), any(_container_disk(c, "limits") is not None for c in containers)
    if request < volumes:
        errors.append(f"{name}: the pod requests {request / gib:g} GiB of ephemeral-storage, less than its disk "
                      f"volumes' {volumes / gib:g} GiB: the scheduler places it on nodes without the room, and "
                      "the kubelet evicts it once they fill")  # fmt: skip
    if limited and _pod_disk(pod, "limits") < volumes:
        errors.append(f"{name}: the pod's ephemeral-storage limit ({_pod_disk(pod, 'limits') / gib:g} GiB) is "
                      f"below its disk volumes' {volumes / gib:g} GiB: the kubelet evicts it before they fill")  # fmt: skip
    if listed is not None and request != listed:
        errors.append(f"{name}: the pod requests {request / gib:g} GiB of ephemeral-storage; cluster/README.md "
                      f"lists {listed / gib:g} GiB disk")  # fmt: skip
    return errors


def _disk_errors(spec: dict, cfg: Config) -> list[str]:
    """Every disk volume is sized and a pod's add up within the disk the README lists for its group, which the
    pod requests (`_disk_request_errors`); every pod that runs trainer ranks sets TMPDIR on one of them, with
    room for `_tmp_need`."""
    trainer = _hosts(_kuberay_node_types(spec), placement.worker_resources(cfg.trainer))
    listed, errors = _readme_disk(), []
    for name, g in _groups(spec):
        pod = g["template"]["spec"]
        disks = {v["name"]: v["emptyDir"].get("sizeLimit") for v in pod.get("volumes", [])
                 if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"}  # fmt: skip
        errors += [f"{name}: emptyDir {v} has no sizeLimit" for v, size in disks.items() if size is None]
        total = sum(_quantity(size) for size in disks.values() if size is not None)
        if name not in listed:
            errors.append(f"{name}: cluster/README.md's sizing table lists no disk for this group")
        elif total > listed[name]:
            errors.append(f"{name}: the pod's disk volumes take {total / 2**30:g} GiB, more than the "
                          f"{listed[name] / 2**30:g} GiB cluster/README.md lists")  # fmt: skip
        errors += _disk_request_errors(name, pod, total, listed.get(name))
        if name not in trainer:
            continue
        container = pod["containers"][0]
        tmpdir = next((e.get("value") for e in container.get("env", []) if e["name"] == "TMPDIR"), None)
        on = [m["name"] for m in container.get("volumeMounts", [])
              if tmpdir and f"{tmpdir}/".startswith(m["mountPath"].rstrip("/") + "/")]  # fmt: skip
        need = _tmp_need(cfg, trainer[name])
        if tmpdir is None:
            errors.append(f"{name}: trainer ranks write checkpoints and the final model under TMPDIR; set it on "
                          "a sized volume, or they fill the container's own filesystem")  # fmt: skip
        elif not (on and disks.get(on[-1])):
            errors.append(f"{name}: TMPDIR {tmpdir} is on no sized disk volume")
        elif _quantity(disks[on[-1]]) < need:
            errors.append(f"{name}: TMPDIR's volume {on[-1]} ({disks[on[-1]]}) is smaller than the "
                          f"{need / 2**30:.0f} GiB a checkpoint's shards and the final model take")  # fmt: skip
    return errors


# --- the Anyscale files, by hand ----------------------------------------------------------------------

# Fields of the anyscale SDK's models (anyscale.job.models.JobConfig with WorkloadConfig's fields;
# anyscale.compute_config.models.ComputeConfig, HeadNodeConfig, WorkerNodeGroupConfig).
ANYSCALE_JOB_KEYS = {"name", "image_uri", "containerfile", "compute_config", "working_dir", "excludes",
                     "requirements", "env_vars", "py_modules", "py_executable", "cloud", "project",
                     "registry_login_secret", "ray_version", "entrypoint", "max_retries", "job_queue_config",
                     "timeout_s", "tags"}  # fmt: skip
ANYSCALE_COMPUTE_KEYS = {"cloud", "cloud_resource", "head_node", "worker_nodes", "min_resources", "max_resources",
                         "zones", "enable_cross_zone_scaling", "advanced_instance_config", "flags",
                         "auto_select_worker_config"}  # fmt: skip
ANYSCALE_NODE_KEYS = {"instance_type", "resources", "required_resources", "labels", "required_labels",
                      "advanced_instance_config", "flags", "cloud_deployment"}  # fmt: skip
ANYSCALE_WORKER_KEYS = ANYSCALE_NODE_KEYS | {"name", "min_nodes", "max_nodes", "market_type"}


def _anyscale_errors(job: dict, compute: dict) -> list[str]:
    errors = [f"job: unknown key {k!r}" for k in job.keys() - ANYSCALE_JOB_KEYS]
    errors += [f"compute config: unknown key {k!r}" for k in compute.keys() - ANYSCALE_COMPUTE_KEYS]
    if not (isinstance(job.get("entrypoint"), str) and job["entrypoint"].strip()):
        errors.append("job: entrypoint must be a non-empty string")
    if ("image_uri" in job) == ("containerfile" in job):
        errors.append("job: set exactly one of image_uri and containerfile")
    if not (type(job.get("max_retries", 1)) is int and job.get("max_retries", 1) >= 0):
        errors.append("job: max_retries must be an int >= 0")
    env = job.get("env_vars", {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        errors.append("job: env_vars must map strings to strings")
    if not isinstance(job.get("compute_config"), str | dict):
        errors.append("job: compute_config must be a registered name or an inline compute config")
    nodes = [("head_node", compute.get("head_node") or {}, ANYSCALE_NODE_KEYS)]
    nodes += [(w.get("name", f"worker_nodes[{i}]"), w, ANYSCALE_WORKER_KEYS)
              for i, w in enumerate(compute.get("worker_nodes") or [])]  # fmt: skip
    for name, node, keys in nodes:
        errors += [f"{name}: unknown key {k!r}" for k in node.keys() - keys]
        if not isinstance(node.get("instance_type"), str) and "required_resources" not in node:
            errors.append(f"{name}: needs instance_type (or required_resources)")
        if not all(isinstance(v, int | float) and v >= 0 for v in (node.get("resources") or {}).values()):
            errors.append(f"{name}: resources must be numbers >= 0")
    for name, w, _ in nodes[1:]:
        lo, hi = w.get("min_nodes", 0), w.get("max_nodes", 10)
        if not (type(lo) is int and type(hi) is int and 0 <= lo <= hi and hi >= 1):
            errors.append(f"{name}: needs integers 0 <= min_nodes ({lo}) <= max_nodes ({hi}), max_nodes >= 1")
        if w.get("market_type", "ON_DEMAND") not in ("ON_DEMAND", "SPOT", "PREFER_SPOT"):
            errors.append(f"{name}: market_type must be ON_DEMAND, SPOT or PREFER_SPOT")
    names = [n for n, _, _ in nodes[1:]]
    if len(set(names)) != len(names):
        errors.append(f"worker_nodes names must be unique: {names}")
    return errors


def _anyscale_node_types(compute: dict) -> dict[str, dict]:
    return {w["name"]: {"resources": w.get("resources", {}), "min_workers": w.get("min_nodes", 0),
                        "max_workers": w.get("max_nodes", 10)} for w in compute.get("worker_nodes", [])}  # fmt: skip


def _recipe_of(command: str) -> tuple[str, dict[str, str]]:
    """(config, overrides but storage locations) of an entrypoint: what must be equal across platforms."""
    config, overrides = _parse_entrypoint(command)
    pairs = dict(o.split("=", 1) for o in overrides)
    return config, {k: v for k, v in pairs.items() if k not in STORAGE_KEYS}


# --- tests --------------------------------------------------------------------------------------------


def test_one_pinned_ray_everywhere():
    pin = _ray_pin()
    for name, spec in _cluster_specs().items():
        assert spec["rayVersion"] == pin, name
    job = _load(ANYSCALE_JOB)[0]
    assert job["ray_version"] == pin and _image_ray_version(job["image_uri"]) == pin
    readme = (CLUSTER / "README.md").read_text()
    assert f"FROM rayproject/ray:{pin}-py311-gpu" in readme, "the image recipe must build on the pinned Ray"


@pytest.mark.parametrize("doc", _ray_docs(), ids=lambda d: d["kind"])
def test_manifests_fit_kuberays_crd_schema(doc, crd_schemas):
    schema = crd_schemas[doc["kind"]]
    assert _schema_errors(doc, schema) == []
    assert _unknown_keys(doc, schema) == [], "fields the API server would silently drop"


def test_a_misspelt_field_is_caught(crd_schemas):
    doc = _rayjob()
    doc["spec"]["entrypiont"] = doc["spec"].pop("entrypoint")
    rollout = doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    rollout["maxReplica"] = rollout.pop("maxReplicas")
    schema = crd_schemas["RayJob"]
    assert _schema_errors(doc, schema) == []  # the schema alone lets both through (maxReplicas is defaulted)
    assert sorted(_unknown_keys(doc, schema)) == [
        ".spec.entrypiont",
        ".spec.rayClusterSpec.workerGroupSpecs[0].maxReplica",
    ]


@pytest.mark.parametrize("doc", _ray_docs(), ids=lambda d: d["kind"])
def test_manifests_follow_the_operators_rules(doc):
    assert _operator_errors(doc) == []


@pytest.mark.parametrize("name", list(_cluster_specs()))
def test_cluster_specs_follow_the_recipes_rules(name):
    assert _recipe_errors(_cluster_specs()[name]) == []


def test_runtime_envs_are_valid_for_ray():
    from ray.runtime_env import RuntimeEnv

    by_hand = yaml.safe_load(RUNTIME_ENV.read_text())
    in_job = yaml.safe_load(_rayjob()["spec"]["runtimeEnvYAML"])
    anyscale = _load(ANYSCALE_JOB)[0]
    for env in (by_hand, in_job):
        assert env.keys() <= RuntimeEnv.known_fields, (
            f"unknown runtime_env fields {env.keys() - RuntimeEnv.known_fields}"
        )
        RuntimeEnv(**env)  # Ray's own checks of every field
    assert {".venv", "runs", ".git", ".cache"} <= set(by_hand["excludes"])
    assert anyscale["excludes"] == by_hand["excludes"]
    # One environment however a run is submitted; DS_ACCELERATOR stays the driver's choice (cuda on GPU).
    # (Anyscale also points TMPDIR at its nodes' NVMe; the KubeRay trainer pods set it themselves.)
    on_anyscale = {k: v for k, v in anyscale["env_vars"].items() if k != "TMPDIR"}
    assert in_job["env_vars"] == by_hand["env_vars"] == on_anyscale
    assert "DS_ACCELERATOR" not in by_hand["env_vars"]
    assert re.fullmatch(r"s3://.+\.zip", in_job["working_dir"]), (
        "the RayJob's code comes from a remote archive"
    )


def test_the_working_dir_upload_stays_small():
    """What `ray job submit --working-dir .` uploads with these excludes, walked the way Ray packs it: under
    the 1 MiB cluster/README.md promises (Ray's own limit is 512 MiB)."""
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

    sizes = {}
    excludes = yaml.safe_load(RUNTIME_ENV.read_text())["excludes"]
    _dir_travel(REPO, [_get_excludes(REPO, excludes)],
                lambda p: p.is_file() and sizes.setdefault(p.relative_to(REPO).as_posix(), p.stat().st_size), include_gitignore=True)  # fmt: skip
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert 0 < sum(sizes.values()) < 2**20 < UPLOAD_LIMIT, (
        f"{sum(sizes.values()) / 2**20:.2f} MiB, largest {largest}"
    )


def test_the_excludes_hold_for_any_kind_of_checkout(tmp_path):
    """A checkout's .git may be a file (a git worktree) and .venv or .cache symlinks: each stays behind."""
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

    (tmp_path / "dapo_ray").mkdir()
    (tmp_path / "dapo_ray" / "runs.py").write_text("# source, uploaded\n")
    (tmp_path / ".git").write_text("gitdir: /elsewhere/.git/worktrees/main\n")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "python").write_text("")
    (tmp_path / ".venv").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "big").write_text("x")
    seen = []
    excludes = yaml.safe_load(RUNTIME_ENV.read_text())["excludes"] + ["elsewhere"]
    _dir_travel(tmp_path, [_get_excludes(tmp_path, excludes)],
                lambda p: seen.append(p.relative_to(tmp_path).as_posix()), include_gitignore=False)  # fmt: skip
    assert sorted(seen) == [".", "dapo_ray", "dapo_ray/runs.py"]


@pytest.mark.parametrize("name", list(_cluster_specs()))
def test_the_groups_fit_the_config(name):
    cfg = _entrypoint_config(_rayjob()["spec"]["entrypoint"])
    node_types = _kuberay_node_types(_cluster_specs()[name])
    assert _feasibility_errors(node_types, cfg, from_zero=name == "raycluster") == []


def test_the_entrypoint_names_a_config_that_passes_check(real_data, capsys):
    """`dapo-ray check` needs no model, only the training data; offline it reads the config's own file
    (the same data set the head's init container downloads) instead of the cluster's path."""
    config, overrides = _parse_entrypoint(_rayjob()["spec"]["entrypoint"])
    assert (REPO / config).is_file(), f"the entrypoint's config {config} is not in the repository"
    cfg = load_config(REPO / config, overrides)
    assert cfg.trainer.output_dir.startswith("s3://"), (
        "trainer.output_dir must be shared storage on a cluster"
    )
    local = [o for o in overrides if o.split("=", 1)[0] not in STORAGE_KEYS]
    train = [str(real_data / Path(f).name) for f in load_config(REPO / config).data.train_files]
    assert [Path(f).name for f in train] == [Path(f).name for f in cfg.data.train_files]
    assert main(["check", "--config", str(REPO / config), *local, f"data.train_files={train}"]) == 0
    assert "[check] OK" in capsys.readouterr().out


def test_the_entrypoint_reads_what_the_pods_hold():
    cfg = _entrypoint_config(_rayjob()["spec"]["entrypoint"])
    for name, g in _groups(_cluster_specs()["rayjob"]):
        pod = g["template"]["spec"]
        mounts = [m["mountPath"] for m in pod["containers"][0].get("volumeMounts", [])]
        assert any(cfg.rollout.model_path.startswith(m + "/") for m in mounts), (
            f"{name}: no {cfg.rollout.model_path}"
        )
        if name == "head":  # the driver reads the data
            fetched = " ".join(" ".join(c["command"]) for c in pod.get("initContainers", []))
            for f in (*cfg.data.train_files, *cfg.eval.files):
                assert any(f.startswith(m + "/") for m in mounts) and Path(f).name in fetched, f


@pytest.mark.parametrize("name", list(_cluster_specs()))
def test_the_pods_disks_fit_the_readme_and_the_trainer_ranks_temporary_files(name):
    cfg = _entrypoint_config(_rayjob()["spec"]["entrypoint"])
    assert _disk_errors(_cluster_specs()[name], cfg) == []
    # A pod's 8 ranks: 45 GiB of checkpoint shards, and the final model's 61 GiB.
    assert 100 * 2**30 < _tmp_need(cfg, 8) < 110 * 2**30


@pytest.mark.parametrize("name", list(_cluster_specs()))
def test_the_pods_request_their_disk(name):
    """The scheduler places pods by requests: each pod asks for its disk volumes and a margin for logs and
    container layers, or it lands on a node with a small root disk and is evicted mid-run."""
    for group, g in _groups(_cluster_specs()[name]):
        pod = g["template"]["spec"]
        volumes = sum(_quantity(v["emptyDir"]["sizeLimit"]) for v in pod["volumes"]
                      if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory")  # fmt: skip
        assert volumes > 0, group
        assert _disk_request_errors(group, pod, volumes, None) == []
        assert _pod_disk(pod) == _pod_disk(pod, "limits") >= volumes + 8 * 2**30, group


def test_a_pods_disk_request_adds_up_as_kubernetes_adds_it():
    def c(name, request=None, limit=None, **extra):
        res = {k: {"ephemeral-storage": v} for k, v in (("requests", request), ("limits", limit)) if v}
        return {"name": name, "resources": res, **extra}

    pod = {"containers": [c("ray", "10Gi"), c("autoscaler")], "initContainers": [c("fetch", "50Gi")]}
    assert _pod_disk(pod) == 50 * 2**30  # the larger of the init container's and the containers' sum
    pod["containers"].append(c("log-shipper", limit="45Gi"))  # a request defaults to the limit
    assert _pod_disk(pod) == 55 * 2**30 and _pod_disk(pod, "limits") == 45 * 2**30
    pod["initContainers"].insert(0, c("proxy", "2Gi", restartPolicy="Always"))  # a sidecar runs throughout
    assert _pod_disk(pod) == 57 * 2**30
    assert _disk_request_errors("x", pod, 60 * 2**30, None) == [
        "x: the pod requests 57 GiB of ephemeral-storage, less than its disk volumes' 60 GiB: the scheduler "
        "places it on nodes without the room, and the kubelet evicts it once they fill",
        "x: the pod's ephemeral-storage limit (45 GiB) is below its disk volumes' 60 GiB: the kubelet evicts "
        "it before they fill",
    ]


def test_anyscale_nodes_write_temporary_files_to_their_nvme():
    """Anyscale mounts a node's NVMe at /mnt/local_storage (the root disk where there is none)."""
    assert _load(ANYSCALE_JOB)[0]["env_vars"]["TMPDIR"].startswith("/mnt/local_storage")


def test_anyscale_files_are_valid():
    job, compute = _load(ANYSCALE_JOB)[0], _load(ANYSCALE_COMPUTE)[0]
    try:
        from anyscale.compute_config.models import ComputeConfig
        from anyscale.job.models import JobConfig
    except ImportError:  # not a dependency of the project: check the same fields by hand
        pass
    else:
        JobConfig.from_dict(job)
        ComputeConfig.from_dict(compute)
    assert _anyscale_errors(job, compute) == []


def test_anyscale_runs_the_rayjobs_recipe_on_the_same_resources():
    job, compute = _load(ANYSCALE_JOB)[0], _load(ANYSCALE_COMPUTE)[0]
    rayjob = _rayjob()["spec"]["entrypoint"]
    assert _recipe_of(job["entrypoint"]) == _recipe_of(rayjob)
    custom = {k for nt in _kuberay_node_types(_cluster_specs()["rayjob"]).values() for k in nt["resources"]
              if k not in ("CPU", "GPU", "memory")}  # fmt: skip
    assert {k for w in compute["worker_nodes"] for k in w["resources"] if k not in ("CPU", "GPU")} == custom
    assert compute["head_node"]["resources"]["CPU"] == 0
    cfg = _entrypoint_config(job["entrypoint"])
    assert _feasibility_errors(_anyscale_node_types(compute), cfg, from_zero=False) == []
    register = (
        f"anyscale compute-config create -n {job['compute_config']} -f cluster/anyscale/compute_config.yaml"
    )
    assert register in (CLUSTER / "README.md").read_text(), (
        "job.yaml names a compute config the README registers"
    )


def _set(*changes: tuple[tuple, object]):
    """A way to break the RayJob: set each (path of keys, value)."""

    def mutate(doc: dict) -> None:
        for (*parents, last), value in changes:
            node = doc
            for k in parents:
                node = node[k]
            node[last] = value

    return mutate


def _drop(*paths: tuple):
    """A way to break the RayJob: remove each path of keys."""

    def mutate(doc: dict) -> None:
        for *parents, last in paths:
            node = doc
            for k in parents:
                node = node[k]
            del node[last]

    return mutate


SPEC = ("spec", "rayClusterSpec")
HEAD = (*SPEC, "headGroupSpec")
ROLLOUT = (*SPEC, "workerGroupSpecs", 0)
TRAINER = (*SPEC, "workerGroupSpecs", 1)
ROLLOUT_LIMITS = (*ROLLOUT, "template", "spec", "containers", 0, "resources", "limits")
ROLLOUT_REQUESTS = (*ROLLOUT, "template", "spec", "containers", 0, "resources", "requests")
TRAINER_POD = (*TRAINER, "template", "spec")
TRAINER_RESOURCES = (*TRAINER_POD, "containers", 0, "resources")
BROKEN = {
    # the operator's rules
    "unknown submission mode": _set((("spec", "submissionMode"), "K8sMode")),
    "minReplicas above maxReplicas": _set(((*ROLLOUT, "minReplicas"), 9)),
    "resources without the extra quotes": _set(((*ROLLOUT, "rayStartParams", "resources"), '{"rollout": 1}')),
    "a fractional custom resource": _set(((*ROLLOUT, "rayStartParams", "resources"), '"{\\"rollout\\": 0.5}"')),
    "a rayStartParams number": _set(((*HEAD, "rayStartParams", "num-cpus"), 0)),
    "resources set twice": _set(((*ROLLOUT, "resources"), {"rollout": "1"})),
    "a ttl without shutdown": _set((("spec", "shutdownAfterJobFinishes"), False)),
    "a cluster selector too": _set((("spec", "clusterSelector"), {"ray.io/cluster": "other"})),
    "a name with capitals": _set((("metadata", "name"), "DAPO-32b")),
    "a name too long": _set((("metadata", "name"), "dapo-" + "x" * 43)),
    # this recipe's rules
    "another Ray in an image": _set(((*TRAINER, "template", "spec", "containers", 0, "image"),
                                     "rayproject/ray:2.59.0-py311-gpu")),
    "no /dev/shm": _set(((*ROLLOUT, "template", "spec", "containers", 0, "volumeMounts"), [])),
    "an inline token": _set(((*HEAD, "template", "spec", "initContainers", 0, "env"),
                             [{"name": "HF_TOKEN", "value": "hf_x"}])),
    "/dev/shm smaller than the object store": _set(
        ((*ROLLOUT, "template", "spec", "volumes", 0, "emptyDir", "sizeLimit"), "64Gi")
    ),
    "CPUs for tasks on the head": _set(((*HEAD, "rayStartParams", "num-cpus"), "16")),
    # disk
    "no TMPDIR on the trainer pods": _set(((*TRAINER_POD, "containers", 0, "env"), [])),
    "TMPDIR on no volume": _set(((*TRAINER_POD, "containers", 0, "env"), [{"name": "TMPDIR", "value": "/tmp"}])),
    "too little room under TMPDIR": _set(((*TRAINER_POD, "volumes", 2, "emptyDir", "sizeLimit"), "64Gi")),
    "more disk than the README lists": _set(((*ROLLOUT, "template", "spec", "volumes", 1, "emptyDir", "sizeLimit"), "512Gi")),
    "an unbounded disk volume": _set(((*TRAINER_POD, "volumes", 1, "emptyDir"), {})),
    "no disk request on the trainer pods": _drop((*TRAINER_RESOURCES, "requests", "ephemeral-storage"),
                                                 (*TRAINER_RESOURCES, "limits", "ephemeral-storage")),
    "a trainer disk request below its volumes": _set(((*TRAINER_RESOURCES, "requests", "ephemeral-storage"), "128Gi")),
    "a rollout disk limit below its volumes": _set(((*ROLLOUT_LIMITS, "ephemeral-storage"), "100Gi"),
                                                   ((*ROLLOUT_REQUESTS, "ephemeral-storage"), "100Gi")),
    # feasibility
    "2-GPU rollout pods": _set(((*ROLLOUT_LIMITS, "nvidia.com/gpu"), "2"), ((*ROLLOUT_REQUESTS, "nvidia.com/gpu"), "2")),
    "8 GPUs for one replica": _set(((*ROLLOUT_LIMITS, "nvidia.com/gpu"), "8"), ((*ROLLOUT_REQUESTS, "nvidia.com/gpu"), "8")),
    "too few rollout pods": _set(((*ROLLOUT, "maxReplicas"), 4)),
    "a fixed rollout group": _set(((*ROLLOUT, "minReplicas"), 8), ((*ROLLOUT, "replicas"), 8)),
    "too few trainer pods": _set(((*TRAINER, "replicas"), 7), ((*TRAINER, "minReplicas"), 7), ((*TRAINER, "maxReplicas"), 7)),
    "no placement resources": _set((("spec", "entrypoint"),
                                    _rayjob()["spec"]["entrypoint"] + " rollout.resources={} trainer.resources={}")),
}  # fmt: skip


def _rayjob_errors(doc: dict) -> list[str]:
    """Everything but the schema (see test_a_misspelt_field_is_caught for that); feasibility only once the
    rest holds, as the autoscaler only ever sees a manifest the operator accepted."""
    spec = doc["spec"]["rayClusterSpec"]
    errors = _operator_errors(doc) + _recipe_errors(spec)
    if errors:
        return errors
    cfg = _entrypoint_config(doc["spec"]["entrypoint"])
    return _feasibility_errors(_kuberay_node_types(spec), cfg, from_zero=False) + _disk_errors(spec, cfg)


def test_the_rayjob_passes_every_check_it_is_broken_against():
    assert _rayjob_errors(_rayjob()) == []


@pytest.mark.parametrize("how", list(BROKEN))
def test_broken_manifests_are_caught(how):
    doc = _rayjob()
    BROKEN[how](doc)
    assert _rayjob_errors(doc), f"a RayJob with {how} passed every check"


def test_a_broken_anyscale_config_is_caught():
    job, compute = _load(ANYSCALE_JOB)[0], _load(ANYSCALE_COMPUTE)[0]
    compute["worker_nodes"][0]["min_node"] = compute["worker_nodes"][0].pop("min_nodes")
    compute["worker_nodes"][1]["max_nodes"] = 0
    job["image_uri_"] = job.pop("image_uri")
    errors = "\n".join(_anyscale_errors(job, compute))
    for expected in (
        "'min_node'",
        "max_nodes (0)",
        "'image_uri_'",
        "exactly one of image_uri and containerfile",
    ):
        assert expected in errors
