"""deploy/k8s: the kustomization rendered here (its resources, labels and images applied) and
every document validated offline against Kubernetes' own schemas (kubernetes-validate,
strict), then the deployment's invariants: the NATS cluster, the URLs, the credentials, the
trainer's node ranks and the run's configuration."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]

from jetrl.deploy.config import load_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30.0"
WORKLOADS = {"Deployment", "StatefulSet", "Job"}

Doc = dict[str, Any]


def render() -> list[Doc]:
    """What `kustomize build deploy/k8s` gives for this kustomization: its resources in order,
    its labels on every resource's metadata (not selectors), its image rewrites."""
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    allowed = {"apiVersion", "kind", "resources", "labels", "images"}
    assert set(kust) <= allowed, f"kustomization fields this test does not render: {set(kust) - allowed}"
    docs: list[Doc] = []
    for res in kust["resources"]:
        docs.extend(d for d in yaml.safe_load_all((K8S / res).read_text()) if d is not None)
    for entry in kust.get("labels", []):
        assert not entry.get("includeSelectors") and not entry.get("includeTemplates")
        for d in docs:
            d["metadata"].setdefault("labels", {}).update(entry["pairs"])
    images = {i["name"]: i for i in kust.get("images", [])}
    for c in all_containers(docs):
        name, _, tag = c["image"].partition(":")
        if name in images:
            img = images[name]
            c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag)}"
    return docs


def pod_spec(doc: Doc) -> Doc:
    spec: Doc = doc["spec"]["template"]["spec"]
    return spec


def all_containers(docs: list[Doc]) -> Iterator[Doc]:
    for d in docs:
        if d["kind"] in WORKLOADS:
            spec = pod_spec(d)
            yield from spec.get("initContainers", [])
            yield from spec["containers"]


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return render()


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def config_map(docs: list[Doc], name: str) -> dict[str, str]:
    data: dict[str, str] = find(docs, "ConfigMap", name)["data"]
    return data


def resolved_args(docs: list[Doc], container: Doc) -> list[str]:
    """The container's argv as the kubelet expands it: $(VAR) from its ConfigMap envFrom and
    literal env values; a variable from a Secret or the downward API is left as written."""
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        env.update(config_map(docs, src["configMapRef"]["name"]))
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]

    def sub(arg: str) -> str:
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg)

    return [sub(a) for a in [*container.get("command", []), *container.get("args", [])]]


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} given {argv.count(name)} times in {argv}"
    return argv[argv.index(name) + 1]


def jetrl_containers(docs: list[Doc]) -> list[tuple[Doc, Doc]]:
    return [
        (d, c)
        for d in docs
        if d["kind"] in WORKLOADS
        for c in pod_spec(d)["containers"]
        if c.get("command") == ["jetrl"]
    ]


def test_kustomization_lists_every_manifest() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == on_disk


def test_every_document_validates_against_the_kubernetes_schemas(docs: list[Doc]) -> None:
    assert len(docs) >= 15
    for d in docs:
        try:
            kubernetes_validate.validate(copy.deepcopy(d), KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{d['kind']}/{d['metadata']['name']}: {exc.message} at {list(exc.caught.absolute_path)}"
            )


def test_the_validator_rejects_a_broken_manifest(docs: list[Doc]) -> None:
    # Strict: an unknown field and a wrongly typed one are both errors (the check can fail).
    bad = copy.deepcopy(find(docs, "StatefulSet", "jetrl-nats"))
    bad["spec"]["replica"] = 3
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)
    bad = copy.deepcopy(find(docs, "StatefulSet", "jetrl-nats"))
    bad["spec"]["replicas"] = "three"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def test_names_are_unique_and_the_image_is_jetrl(docs: list[Doc]) -> None:
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys))
    images = {c["image"] for c in all_containers(docs)}
    assert images == {"jetrl:0.1.0", "postgres:16"}
    assert all(d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "jetrl" for d in docs)


def test_nats_is_a_three_server_jetstream_cluster_on_volumes(docs: list[Doc]) -> None:
    sts = find(docs, "StatefulSet", "jetrl-nats")
    assert sts["spec"]["replicas"] == 3
    svc = find(docs, "Service", sts["spec"]["serviceName"])
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert {p["port"] for p in svc["spec"]["ports"]} == {4222, 6222, 8222}
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    (nats,) = pod_spec(sts)["containers"]
    mounts = {m["mountPath"]: m["name"] for m in nats["volumeMounts"]}
    assert mounts["/data"] == claim["metadata"]["name"]
    conf = config_map(docs, "jetrl-nats-config")["nats.conf"]
    assert nats["command"] == ["nats-server", "-c", "/etc/nats/nats.conf"]
    assert re.search(r"^server_name: \$POD_NAME$", conf, re.M)
    assert any(
        e["name"] == "POD_NAME" and e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        for e in nats["env"]
    )
    assert re.search(r"store_dir: /data/jetstream", conf)
    routes = re.findall(r"nats://(\S+):6222", conf)
    assert routes == [f"jetrl-nats-{i}.jetrl-nats" for i in range(3)]
    # The authorization from `jetrl tenants`, beside the config in the same projected volume.
    assert 'include "auth/nats-auth.conf"' in conf
    (vol,) = [v for v in pod_spec(sts)["volumes"] if v["name"] == mounts["/etc/nats"]]
    sources = vol["projected"]["sources"]
    assert {"configMap": {"name": "jetrl-nats-config"}} in sources
    (secret,) = [s["secret"] for s in sources if "secret" in s]
    assert secret["name"] == "jetrl-creds"
    assert secret["items"] == [{"key": "nats-auth.conf", "path": "auth/nats-auth.conf"}]


def test_every_jetrl_container_is_given_the_three_nats_pods(docs: list[Doc]) -> None:
    expected = [f"nats://jetrl-nats-{i}.jetrl-nats:4222" for i in range(3)]
    found = jetrl_containers(docs)
    assert {d["metadata"]["name"] for d, _ in found} == {
        "jetrl-coordinator",
        "jetrl-trainer",
        "jetrl-inference",
        "jetrl-producer",
        "jetrl-recorder",
        "jetrl-monitor",
    }
    for d, c in found:
        argv = resolved_args(docs, c)
        assert flag(argv, "--nats-url").split(",") == expected, d["metadata"]["name"]
        run = flag(argv, "--run-id") if argv[1] == "run" else flag(argv, "--run")
        assert run == config_map(docs, "jetrl-run")["JETRL_RUN_ID"]
        # And each pod waits for those servers before it starts.
        (init,) = pod_spec(d)["initContainers"]
        assert init["command"] == ["python", "/etc/jetrl/scripts/wait_nats.py"]
        assert config_map(docs, "jetrl-run")["JETRL_NATS_URL"] == ",".join(expected)


def secret_files(docs: list[Doc], d: Doc, container: Doc) -> dict[str, tuple[str, str]]:
    """Mounted file path -> (Secret name, key), for the container's Secret volumes."""
    vols = {v["name"]: v for v in pod_spec(d)["volumes"]}
    out = {}
    for m in container.get("volumeMounts", []):
        vol = vols[m["name"]]
        if "secret" in vol:
            for item in vol["secret"]["items"]:
                out[f"{m['mountPath']}/{item['path']}"] = (vol["secret"]["secretName"], item["key"])
    return out


def test_each_part_connects_with_its_own_mounted_creds(docs: list[Doc]) -> None:
    creds = find(docs, "Secret", "jetrl-creds")["stringData"]
    for d, c in jetrl_containers(docs):
        argv = resolved_args(docs, c)
        files = secret_files(docs, d, c)
        if argv[1] == "part":
            kind = argv[2]
            path = flag(argv, "--creds")
            assert files[path] == ("jetrl-creds", f"{kind}.creds"), d["metadata"]["name"]
            assert set(files) == {path}, "a part mounts only its own identity's credentials"
        else:  # the coordinator: the tenants' registry, as the admin identity
            assert argv[1:3] == ["run", "/etc/jetrl/config/run.toml"]
            tdir = flag(argv, "--tenants-dir")
            assert files == {
                f"{tdir}/tenants.json": ("jetrl-creds", "tenants.json"),
                f"{tdir}/nats-auth.conf": ("jetrl-creds", "nats-auth.conf"),
                f"{tdir}/creds/admin.creds": ("jetrl-creds", "admin.creds"),
            }
            assert flag(argv, "--parts") == "none"
        for _, key in files.values():
            assert key in creds
        assert all(m.get("readOnly") for m in c["volumeMounts"] if m["name"] in {"creds", "tenants"})


def test_the_store_url_comes_from_a_secret(docs: list[Doc]) -> None:
    db = find(docs, "Secret", "jetrl-db")["stringData"]
    assert db["url"].startswith("postgresql+psycopg://") and "@jetrl-postgres:5432/" in db["url"]
    find(docs, "Service", "jetrl-postgres")
    users = 0
    for _, c in jetrl_containers(docs):
        argv = resolved_args(docs, c)
        if "--db" in argv:
            users += 1
            assert flag(argv, "--db") == "$(JETRL_DB_URL)"
            (e,) = [e for e in c["env"] if e["name"] == "JETRL_DB_URL"]
            assert e["valueFrom"]["secretKeyRef"] == {"name": "jetrl-db", "key": "url"}
    assert users == 2  # the coordinator and the recorder


def test_trainer_is_an_indexed_job_whose_pods_are_torchrun_node_ranks(docs: list[Doc]) -> None:
    job = find(docs, "Job", "jetrl-trainer")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    nodes = spec["completions"]
    assert nodes >= 2 and spec["parallelism"] == nodes
    pod = pod_spec(job)
    assert pod["restartPolicy"] == "OnFailure"
    (c,) = pod["containers"]
    argv = resolved_args(docs, c)
    assert argv[1:3] == ["part", "trainer"]
    assert flag(argv, "--nnodes") == str(nodes)
    # The node rank is the pod's completion index (0..completions-1), through the downward API.
    assert flag(argv, "--node-rank") == "$(NODE_RANK)"
    (rank,) = [e for e in c["env"] if e["name"] == "NODE_RANK"]
    assert (
        rank["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    # One rendezvous endpoint: index 0's stable name under the headless Service.
    host, _, port = flag(argv, "--rdzv-endpoint").rpartition(":")
    svc = find(docs, "Service", pod["subdomain"])
    assert host == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert int(port) in {p["port"] for p in svc["spec"]["ports"]}


def test_every_part_writes_under_one_shared_run_directory(docs: list[Doc]) -> None:
    # Every trainer node writes its shards of a checkpoint into one run directory, and file
    # payloads are read from it: a ReadWriteMany volume, at the same path in every pod.
    seen = set()
    for d, c in jetrl_containers(docs):
        argv = resolved_args(docs, c)
        run_dir = flag(argv, "--run-dir") if argv[1] == "part" else f"{flag(argv, '--runs-dir')}/demo-k8s"
        seen.add(run_dir)
        (mount,) = [m for m in c["volumeMounts"] if run_dir.startswith(m["mountPath"] + "/")]
        (vol,) = [v for v in pod_spec(d)["volumes"] if v["name"] == mount["name"]]
        claim = find(docs, "PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"])
        assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert seen == {"/runs/demo-k8s"}


def test_the_run_config_loads_and_splits_over_the_trainer_nodes(docs: list[Doc], tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(config_map(docs, "jetrl-run-config")["run.toml"])
    cfg = load_config(str(path), [])
    nodes = find(docs, "Job", "jetrl-trainer")["spec"]["completions"]
    assert cfg.trainer.parallelism.world_size % nodes == 0
    monitor = find(docs, "Service", "jetrl-monitor")
    assert [p["port"] for p in monitor["spec"]["ports"]] == [cfg.monitor.prometheus_port]
    assert cfg.bus.replicas == 3


def test_workloads_that_scale_and_those_that_are_single(docs: list[Doc]) -> None:
    inference = find(docs, "Deployment", "jetrl-inference")
    assert inference["spec"]["replicas"] >= 1
    argv = resolved_args(docs, pod_spec(inference)["containers"][0])
    assert flag(argv, "--worker-id") == "$(POD_NAME)"  # each replica is its own worker
    for name in ("jetrl-producer", "jetrl-recorder", "jetrl-monitor"):
        dep = find(docs, "Deployment", name)
        assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    coord = find(docs, "Job", "jetrl-coordinator")
    assert pod_spec(coord)["restartPolicy"] == "Never"
    for d in docs:  # every selector selects its own pods
        if d["kind"] in {"Deployment", "StatefulSet"}:
            assert (
                d["spec"]["selector"]["matchLabels"].items()
                <= d["spec"]["template"]["metadata"]["labels"].items()
            )
