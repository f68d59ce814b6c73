"""Offline checks of cluster/: Ray's own code reads every config the way `ray up`, the autoscaler and
KubeRay's autoscaler sidecar do. Pure file checks: no Ray cluster, no cloud or Kubernetes calls.

    python -m pytest -q tests/unit/test_cluster_configs.py

- Launcher YAMLs (cluster/*.yaml): `prepare_config` (merge with the provider's defaults.yaml, as `ray up`
  does) + `validate_config` (ray-schema.json and the min/max cross-checks), then Ray's v2
  `AutoscalingConfig` reads the node types. fake_multinode gets `validate_config` only: its defaults file
  (fake_multi_node/example.yaml) is not in the wheel, so `prepare_config` raises FileNotFoundError and
  the autoscaler reads that file as-is; we check it spells out every field instead.
- KubeRay manifests (cluster/kuberay/*.yaml): Ray's converter `_derive_autoscaling_config_from_ray_cr`
  (what the sidecar runs on the live RayCluster object) must yield the groups, replicas and GPUs.
- Negative tests: the same validators and our own checks reject deliberately broken configs.
"""

import copy
import re
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_TYPE
from ray.autoscaler._private.kuberay.autoscaling_config import (
    _derive_autoscaling_config_from_ray_cr,
)
from ray.autoscaler._private.providers import _get_default_config
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.autoscaler.v2.instance_manager.config import AutoscalingConfig

CLUSTER_DIR = Path(__file__).resolve().parents[2] / "cluster"
# Not recursive: kuberay/ is separate. prices.yaml is raydl's price table, not a cluster.
LAUNCHER_FILES = sorted(p for p in CLUSTER_DIR.glob("*.yaml") if p.name != "prices.yaml")
CLOUD_FILES = [p for p in LAUNCHER_FILES if p.name != "local-fake.yaml"]
KUBERAY_FILES = sorted((CLUSTER_DIR / "kuberay").glob("*.yaml"))
MARKET_LABEL = "ray.io/market-type"  # the key Ray itself uses (ray._raylet.RAY_NODE_MARKET_TYPE_KEY)

# Published hardware of the machine types used. Resources are declared explicitly in the YAMLs (AWS
# auto-detection needs credentials; GCP has none), so they are checked against this table.
AWS_INSTANCES = {
    "m5.2xlarge": {"CPU": 8, "GPU": 0},
    "g5.2xlarge": {"CPU": 8, "GPU": 1},  # 1x A10G
    "g5.12xlarge": {"CPU": 48, "GPU": 4},  # 4x A10G
}
GCP_MACHINE_CPUS = {"n1-standard-8": 8, "g2-standard-8": 8}
GCP_BUILT_IN_GPUS = {"g2-standard-8": ("nvidia-l4", 1)}  # G2 attaches its L4 with the machine type


def _load(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def _ids(paths):
    return [p.name for p in paths]


def ray_checked(cfg: dict) -> dict:
    """The config as the autoscaler will see it, after Ray's own defaults and validation."""
    cfg = copy.deepcopy(cfg)
    if cfg["provider"]["type"].startswith("fake_multinode"):
        validate_config(cfg)
        return cfg
    prepared = prepare_config(cfg)
    validate_config(prepared)
    return prepared


def worker_types(cfg: dict) -> dict:
    return {k: v for k, v in cfg["available_node_types"].items() if k != cfg["head_node_type"]}


def hardware(provider: str, node_config: dict) -> dict:
    """CPU/GPU count of the machine a node_config launches."""
    if provider == "aws":
        return AWS_INSTANCES[node_config["InstanceType"]]
    machine = node_config["machineType"]
    gpus = sum(a["acceleratorCount"] for a in node_config.get("guestAccelerators", []))
    return {"CPU": GCP_MACHINE_CPUS[machine], "GPU": gpus}


def is_spot(provider: str, node_config: dict) -> bool:
    if provider == "aws":
        return node_config.get("InstanceMarketOptions", {}).get("MarketType") == "spot"
    scheduling = node_config.get("scheduling", {})
    assert isinstance(scheduling, dict), "GCE scheduling is a mapping, not a list (ray#46248)"
    return scheduling.get("provisioningModel") == "SPOT" or scheduling.get("preemptible") is True


def check_gpu_declarations(cfg: dict) -> None:
    """Each node type advertises exactly the CPUs/GPUs of its machine; GPU types have >= 1 GPU."""
    provider = cfg["provider"]["type"]
    gpu_types = 0
    for name, node_type in cfg["available_node_types"].items():
        declared = node_type["resources"]
        if provider in ("aws", "gcp"):
            hw = hardware(provider, node_type["node_config"])
            assert declared.get("GPU", 0) == hw["GPU"], f"{name}: GPU {declared} vs machine {hw}"
            assert declared.get("CPU") == hw["CPU"], f"{name}: CPU {declared} vs machine {hw}"
        if "gpu" in name or name.startswith("ray_worker_"):
            assert declared.get("GPU", 0) >= 1, f"{name} is a GPU type but declares {declared}"
            gpu_types += 1
    assert gpu_types >= 1, "no GPU worker type"


def check_spot_marking(cfg: dict) -> None:
    """Spot types (name ends in 'spot') are spot in the cloud request and labelled so for Ray."""
    provider = cfg["provider"]["type"]
    for name, node_type in worker_types(cfg).items():
        spot = name.endswith("spot")
        assert is_spot(provider, node_type["node_config"]) == spot, f"{name}: market mismatch"
        expected = "spot" if spot else "on-demand"
        assert node_type.get("labels", {}).get(MARKET_LABEL) == expected, f"{name}: label"


def check_caps(cfg: dict) -> None:
    """Scale-to-zero GPU types, per-type caps within the global cap, idle timeout set."""
    head = cfg["available_node_types"][cfg["head_node_type"]]
    assert head["max_workers"] == 0
    workers = worker_types(cfg)
    assert workers
    for name, node_type in workers.items():
        assert node_type["min_workers"] == 0, f"{name}: min_workers must be 0 (scale to zero)"
        assert 1 <= node_type["max_workers"] <= cfg["max_workers"], name
    assert sum(t["min_workers"] for t in workers.values()) <= cfg["max_workers"]
    assert cfg["idle_timeout_minutes"] > 0
    assert cfg["upscaling_speed"] > 0


# ---------------------------------------------------------------- launcher configs (cluster/*.yaml)


def test_expected_files_exist():
    names = {p.name for p in LAUNCHER_FILES} | {f"kuberay/{p.name}" for p in KUBERAY_FILES}
    expected = {
        "aws-gpu.yaml",
        "gcp-gpu.yaml",
        "local-fake.yaml",
        "kuberay/raycluster-gpu.yaml",
        "kuberay/rayjob-train.yaml",
    }
    assert expected <= names
    readme = (CLUSTER_DIR / "README.md").read_text()
    for name in names:
        assert name.split("/")[-1] in readme, f"cluster/README.md does not mention {name}"


@pytest.mark.parametrize("path", LAUNCHER_FILES, ids=_ids(LAUNCHER_FILES))
def test_launcher_config_passes_ray_validation(path):
    cfg = ray_checked(_load(path))
    check_gpu_declarations(cfg)
    check_caps(cfg)


@pytest.mark.parametrize("path", CLOUD_FILES, ids=_ids(CLOUD_FILES))
def test_autoscaler_v2_reads_node_types(path):
    raw = _load(path)
    node_types = AutoscalingConfig(copy.deepcopy(raw), skip_content_hash=True).get_node_type_configs()
    assert set(node_types) == set(raw["available_node_types"])
    for name, node_type in worker_types(raw).items():
        assert node_types[name].min_worker_nodes == node_type["min_workers"]
        assert node_types[name].max_worker_nodes == node_type["max_workers"]
        assert node_types[name].resources == node_type["resources"]


@pytest.mark.parametrize("path", CLOUD_FILES, ids=_ids(CLOUD_FILES))
def test_cloud_config_policy(path):
    cfg = ray_checked(_load(path))
    check_spot_marking(cfg)
    assert any(n.endswith("spot") for n in worker_types(cfg)), "no spot GPU type"
    assert cfg["idle_timeout_minutes"] == 5
    head_cmds = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_cmds  # loopback; `ray dashboard` tunnels to it
    assert "0.0.0.0" not in head_cmds
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head_cmds
    image = cfg["docker"]["image"]
    assert image.startswith(f"rayproject/ray:{ray.__version__}-"), image  # not ray-ml; same Ray
    assert image.endswith("-gpu")
    assert any("pip install" in c and "raydl" in c for c in cfg["setup_commands"])


def test_gcp_node_types():
    cfg = ray_checked(_load(CLUSTER_DIR / "gcp-gpu.yaml"))
    for name, node_type in cfg["available_node_types"].items():
        # Ray puts the type name in a GCE label value: [a-z0-9_-] only (no dots).
        assert re.fullmatch(r"[a-z0-9_-]{1,63}", name), name
        node_config = node_type["node_config"]
        machine = node_config["machineType"]
        accelerators = node_config.get("guestAccelerators", [])
        if machine in GCP_BUILT_IN_GPUS:
            assert [(a["acceleratorType"], a["acceleratorCount"]) for a in accelerators] == [
                GCP_BUILT_IN_GPUS[machine]
            ]
        if not accelerators:
            continue
        scheduling = node_config["scheduling"]
        assert isinstance(scheduling, dict)  # GCE API object; a list is wrong (ray#46248)
        assert scheduling["onHostMaintenance"] == "TERMINATE"  # required with GPUs
        assert {"key": "install-nvidia-driver", "value": "True"} in node_config["metadata"]["items"]
        if is_spot("gcp", node_config):
            assert scheduling["automaticRestart"] is False
            assert scheduling["instanceTerminationAction"] == "DELETE"  # STOP would leak VMs


def test_aws_spot_uses_the_same_machine():
    cfg = ray_checked(_load(CLUSTER_DIR / "aws-gpu.yaml"))
    types = cfg["available_node_types"]
    on_demand, spot = types["ray.worker.gpu"], types["ray.worker.gpu_spot"]
    assert spot["node_config"]["InstanceType"] == on_demand["node_config"]["InstanceType"]
    assert types["ray.worker.gpu_4x"]["resources"]["GPU"] == 4


def test_fake_multinode_config():
    raw = _load(CLUSTER_DIR / "local-fake.yaml")
    cfg = ray_checked(raw)
    # Everything prepare_config would fill in for a real provider is spelled out.
    missing = set(_get_default_config({"type": "aws"})) - set(raw)
    assert not missing, f"local-fake.yaml lacks {missing}"
    assert cfg["head_node_type"] == FAKE_HEAD_NODE_TYPE  # hard-coded by the fake provider
    types = cfg["available_node_types"]
    assert types[FAKE_HEAD_NODE_TYPE]["resources"]["CPU"] == 1
    assert types["ray.worker.cpu"]["resources"]["CPU"] == 2
    assert types["ray.worker.cpu"]["max_workers"] == 3
    assert cfg["idle_timeout_minutes"] == 0.25
    host, port = cfg["provider"]["gcs_address"].rsplit(":", 1)  # placeholder the harness overwrites
    assert host and int(port) > 0


# ---------------------------------------------------------------- KubeRay manifests


def ray_cluster_spec(manifest: dict) -> dict:
    return manifest["spec"]["rayClusterSpec"] if manifest["kind"] == "RayJob" else manifest["spec"]


def derive(spec: dict) -> dict:
    """What the KubeRay autoscaler sidecar computes from the live RayCluster object."""
    # A RayCluster read back from the API server always has a namespace; the manifests leave it to -n.
    cr = {"metadata": {"name": "raydl-test", "namespace": "default"}, "spec": copy.deepcopy(spec)}
    return _derive_autoscaling_config_from_ray_cr(cr)  # runs validate_config itself


def check_kuberay_groups(spec: dict, derived: dict) -> None:
    node_types = derived["available_node_types"]
    assert set(node_types) == {"headgroup"} | {g["groupName"] for g in spec["workerGroupSpecs"]}
    assert node_types["headgroup"]["resources"]["CPU"] == 0  # num-cpus 0: no work on the head
    for group in spec["workerGroupSpecs"]:
        node_type = node_types[group["groupName"]]
        hosts = group.get("numOfHosts", 1)
        assert node_type["min_workers"] == group["minReplicas"] * hosts == 0
        assert node_type["max_workers"] == group["maxReplicas"] * hosts >= 1
        if "gpu" in group["groupName"]:
            assert node_type["resources"].get("GPU") == 1, node_type["resources"]


@pytest.mark.parametrize("path", KUBERAY_FILES, ids=_ids(KUBERAY_FILES))
def test_kuberay_autoscaler_reads_manifest(path):
    manifest = _load(path)
    assert manifest["apiVersion"] == "ray.io/v1"
    spec = ray_cluster_spec(manifest)
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["rayVersion"] == ray.__version__
    derived = derive(spec)
    check_kuberay_groups(spec, derived)
    assert derived["idle_timeout_minutes"] == spec["autoscalerOptions"]["idleTimeoutSeconds"] / 60 == 5
    assert derived["upscaling_speed"] == 1000  # upscalingMode Default: no rate limit
    # The v2 autoscaler (KubeRayConfigReader) wraps the same dict.
    node_types = AutoscalingConfig(derived, skip_content_hash=True).get_node_type_configs()
    assert node_types["gpu"].resources["GPU"] == 1


@pytest.mark.parametrize("path", KUBERAY_FILES, ids=_ids(KUBERAY_FILES))
def test_kuberay_pod_settings(path):
    spec = ray_cluster_spec(_load(path))
    head = spec["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"  # dashboard only via kubectl port-forward
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"  # the Service must reach the pod
    images = [c["image"] for c in head["template"]["spec"]["containers"]]
    for group in spec["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        images += [c["image"] for c in pod["containers"]]
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        assert pod["nodeSelector"]
        if group["groupName"].endswith("spot"):
            assert any("spot" in key for key in pod["nodeSelector"])
            env = {e["name"]: e["value"] for e in pod["containers"][0].get("env", [])}
            assert env.get("RAY_NODE_MARKET_TYPE") == "spot"
    assert all(i.startswith(f"rayproject/ray:{ray.__version__}-") for i in images), images


def _documents(path: Path) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def _containers(spec: dict) -> list[dict]:
    groups = [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def check_security(manifest: dict) -> None:
    """Token auth on and the autoscaler pinned to v2 for every RayCluster (also inside a RayJob)."""
    if manifest["kind"] not in ("RayCluster", "RayJob"):
        return
    spec = ray_cluster_spec(manifest)
    assert spec.get("authOptions", {}).get("mode") == "token", "token authentication is off"
    assert spec["autoscalerOptions"].get("version") == "v2", "autoscaler version not pinned to v2"
    env = {e["name"]: e.get("value") for c in _containers(spec) for e in c.get("env", [])}
    assert env.get("RAY_AUTH_MODE", "token") == "token", "a container turns token auth off"
    assert env.get("RAY_enable_autoscaler_v2", "1") == "1", "a container turns autoscaler v2 off"


def check_not_exposed(manifest: dict) -> None:
    """Nothing publishes the dashboard / Jobs API (8265) beyond the Kubernetes cluster."""
    kind = manifest["kind"]
    assert kind not in ("Ingress", "Route", "Gateway", "HTTPRoute"), f"a {kind} exposes the cluster"
    if kind == "Service":
        assert manifest["spec"].get("type", "ClusterIP") == "ClusterIP", f"Service type {manifest['spec']['type']}"
    if kind in ("RayCluster", "RayJob"):
        head = ray_cluster_spec(manifest)["headGroupSpec"]
        assert head["serviceType"] == "ClusterIP", f"head serviceType {head['serviceType']}"
        assert not head.get("enableIngress"), "head enableIngress"
        head_service = head.get("headService", {}).get("spec", {})
        assert head_service.get("type", "ClusterIP") == "ClusterIP", f"headService type {head_service['type']}"


@pytest.mark.parametrize("path", KUBERAY_FILES, ids=_ids(KUBERAY_FILES))
def test_kuberay_token_auth_on_autoscaler_v2_dashboard_inside(path):
    documents = _documents(path)
    assert any(d["kind"] in ("RayCluster", "RayJob") for d in documents)
    for manifest in documents:
        check_security(manifest)
        check_not_exposed(manifest)


def test_rayjob_fields():
    job = _load(CLUSTER_DIR / "kuberay" / "rayjob-train.yaml")
    spec = job["spec"]
    assert spec["entrypoint"] == "python jobs/train.py --config jobs/configs/gpt-small.yaml"
    assert spec["shutdownAfterJobFinishes"] is True
    assert isinstance(spec["ttlSecondsAfterFinished"], int) and spec["ttlSecondsAfterFinished"] > 0
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    # The submitter pod has no local checkout: working_dir must be a remote URI.
    assert re.match(r"(https|s3|gs)://", runtime_env["working_dir"]), runtime_env["working_dir"]


def test_rayjob_and_raycluster_scale_the_same():
    cluster = derive(ray_cluster_spec(_load(CLUSTER_DIR / "kuberay" / "raycluster-gpu.yaml")))
    job = derive(ray_cluster_spec(_load(CLUSTER_DIR / "kuberay" / "rayjob-train.yaml")))
    assert cluster["available_node_types"] == job["available_node_types"]


# ---------------------------------------------------------------- negative: the checks can fail


@pytest.fixture
def aws_cfg():
    return _load(CLUSTER_DIR / "aws-gpu.yaml")


def test_rejects_non_integer_max_workers(aws_cfg):
    aws_cfg["available_node_types"]["ray.worker.gpu"]["max_workers"] = "four"
    with pytest.raises(jsonschema.ValidationError, match="'four' is not of type 'integer'"):
        ray_checked(aws_cfg)


def test_rejects_misspelled_key(aws_cfg):
    node_type = aws_cfg["available_node_types"]["ray.worker.gpu"]
    node_type["max_worker"] = node_type.pop("max_workers")
    with pytest.raises(jsonschema.ValidationError, match="max_worker"):
        ray_checked(aws_cfg)


def test_rejects_node_type_without_resources(aws_cfg):
    del aws_cfg["available_node_types"]["ray.worker.gpu_spot"]["resources"]
    with pytest.raises(jsonschema.ValidationError, match="'resources' is a required property"):
        ray_checked(aws_cfg)


def test_rejects_min_workers_above_global_cap(aws_cfg):
    aws_cfg["available_node_types"]["ray.worker.gpu"]["min_workers"] = aws_cfg["max_workers"] + 1
    with pytest.raises(ValueError, match="smaller than the sum of `min_workers`"):
        ray_checked(aws_cfg)


def test_fake_config_with_wrong_type_is_rejected():
    cfg = _load(CLUSTER_DIR / "local-fake.yaml")
    cfg["available_node_types"]["ray.worker.cpu"]["resources"]["CPU"] = 1.5  # integers only
    with pytest.raises(jsonschema.ValidationError):
        ray_checked(cfg)


def test_own_checks_catch_gpu_spot_and_cap_mistakes(aws_cfg):
    no_gpu = copy.deepcopy(aws_cfg)
    no_gpu["available_node_types"]["ray.worker.gpu"]["resources"] = {"CPU": 8}
    with pytest.raises(AssertionError, match="GPU"):
        check_gpu_declarations(ray_checked(no_gpu))
    unmarked = copy.deepcopy(aws_cfg)
    del unmarked["available_node_types"]["ray.worker.gpu_spot"]["node_config"]["InstanceMarketOptions"]
    with pytest.raises(AssertionError, match="market mismatch"):
        check_spot_marking(ray_checked(unmarked))
    warm = copy.deepcopy(aws_cfg)
    warm["available_node_types"]["ray.worker.gpu"]["min_workers"] = 1
    with pytest.raises(AssertionError, match="scale to zero"):
        check_caps(ray_checked(warm))


def test_kuberay_converter_rejects_broken_groups():
    spec = ray_cluster_spec(_load(CLUSTER_DIR / "kuberay" / "raycluster-gpu.yaml"))
    no_cpu = copy.deepcopy(spec)
    del no_cpu["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
    with pytest.raises(ValueError, match="failed to detect `CPU`"):
        derive(no_cpu)
    no_min = copy.deepcopy(spec)
    del no_min["workerGroupSpecs"][0]["minReplicas"]
    with pytest.raises(KeyError, match="minReplicas"):
        derive(no_min)
    no_gpu = copy.deepcopy(spec)
    for key in ("limits", "requests"):
        del no_gpu["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"][key][
            "nvidia.com/gpu"
        ]
    with pytest.raises(AssertionError):
        check_kuberay_groups(no_gpu, derive(no_gpu))


@pytest.mark.parametrize("break_it, words", [
    (lambda m: m["spec"].pop("authOptions"), "token authentication is off"),
    (lambda m: m["spec"].update(authOptions={"mode": "disabled"}), "token authentication is off"),
    (lambda m: _containers(m["spec"])[0].setdefault("env", []).append({"name": "RAY_AUTH_MODE", "value": "disabled"}),
     "turns token auth off"),
    (lambda m: m["spec"]["autoscalerOptions"].pop("version"), "not pinned to v2"),
    (lambda m: m["spec"]["autoscalerOptions"].update(version="v1"), "not pinned to v2"),
])
def test_security_check_catches_auth_and_autoscaler_mistakes(break_it, words):
    manifest = _load(CLUSTER_DIR / "kuberay" / "raycluster-gpu.yaml")
    break_it(manifest)
    with pytest.raises(AssertionError, match=words):
        check_security(manifest)


@pytest.mark.parametrize("break_it, words", [
    (lambda m: m["spec"]["headGroupSpec"].update(serviceType="LoadBalancer"), "serviceType LoadBalancer"),
    (lambda m: m["spec"]["headGroupSpec"].update(serviceType="NodePort"), "serviceType NodePort"),
    (lambda m: m["spec"]["headGroupSpec"].update(enableIngress=True), "enableIngress"),
    (lambda m: m["spec"]["headGroupSpec"].update(headService={"spec": {"type": "LoadBalancer"}}),
     "headService type LoadBalancer"),
])
def test_exposure_check_catches_a_public_dashboard(break_it, words):
    manifest = _load(CLUSTER_DIR / "kuberay" / "raycluster-gpu.yaml")
    break_it(manifest)
    with pytest.raises(AssertionError, match=words):
        check_not_exposed(manifest)


def test_exposure_check_catches_an_extra_ingress_or_public_service():
    with pytest.raises(AssertionError, match="Ingress exposes"):
        check_not_exposed({"kind": "Ingress", "spec": {"rules": [{"http": {"paths": [{"backend": {"service": {
            "name": "raydl-gpu-head-svc", "port": {"number": 8265}}}}]}}]}})
    with pytest.raises(AssertionError, match="Service type NodePort"):
        check_not_exposed({"kind": "Service", "spec": {"type": "NodePort", "ports": [{"port": 8265}]}})
