"""The deployment files, checked as far as can be done offline: the manifests parse, the server
command in the RayCluster is one our CLI accepts and agrees with the worker pods it runs on,
and the image builds its Python environment from Makefile targets and variables that exist."""

import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from tutorserve.cli import build_parser
from tutorserve.cluster.scaling import Scale, scale_from_args

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"


def _docs(name):
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d is not None]


@pytest.fixture(scope="module")
def cluster():
    [rc] = [d for d in _docs("raycluster.yaml") if d["kind"] == "RayCluster"]
    return rc


def _head(cluster):
    [container] = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    return container


def _serve_args(cluster):
    """The `tutorserve serve` options in the head's shell command."""
    script = " ".join(_head(cluster)["args"])
    words = shlex.split(script[script.index("tutorserve serve") :])
    return words[2:]


def test_every_manifest_parses_as_kubernetes_objects():
    names = sorted(p.name for p in DEPLOY.glob("*.yaml"))
    assert names == ["postgres.yaml", "raycluster.yaml"]
    for name in names:
        for doc in _docs(name):
            assert {"apiVersion", "kind", "metadata", "spec"} <= set(doc), (name, doc)


def test_the_head_runs_a_serve_command_our_cli_accepts(cluster):
    args = _serve_args(cluster)
    parsed = build_parser().parse_args(["serve", *args])  # an unknown option exits
    flags = {w.split("=")[0] for w in args if w.startswith("--")}
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    assert flags <= set(serve._option_string_actions)
    assert parsed.ray_address == "auto" and parsed.host == "0.0.0.0"
    assert parsed.tutor_db == "$TUTOR_DB_URL"  # the shell's, from the env below
    env = {e["name"]: e for e in _head(cluster)["env"]}
    assert env["TUTOR_DB_URL"]["value"].startswith("postgresql+psycopg://")
    assert env["PGPASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "tutorserve-postgres"
    # KubeRay's own `ray start` runs first, without its --block.
    assert "${KUBERAY_GEN_RAY_START_CMD/--block/}" in _head(cluster)["args"][0]
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"


def _cpus(container):
    return float(container["resources"]["limits"]["cpu"])


def test_replica_bounds_and_sizes_match_the_worker_pods(cluster):
    a = build_parser().parse_args(["serve", *_serve_args(cluster)])
    scale = scale_from_args(a, batch=a.max_num_seqs)
    [workers] = cluster["spec"]["workerGroupSpecs"]
    [worker] = workers["template"]["spec"]["containers"]
    assert isinstance(scale, Scale) and scale.elastic
    # One replica per worker pod, so the pod bounds are the replica bounds.
    assert a.cpus_per_replica == _cpus(worker) and a.num_threads <= _cpus(worker)
    assert (workers["minReplicas"], workers["maxReplicas"]) == (
        scale.min_replicas,
        scale.max_replicas,
    )
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert cluster["spec"]["enableInTreeAutoscaling"] is True


def test_the_ray_version_is_one_our_cluster_extra_allows(cluster):
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["cluster"]
    [spec] = extra
    low, high = re.search(r">=([\d.]+),<([\d.]+)", spec).groups()
    version = tuple(int(x) for x in cluster["spec"]["rayVersion"].split("."))
    assert tuple(int(x) for x in low.split(".")) <= version < tuple(map(int, high.split(".")))


def test_the_store_service_is_the_one_the_server_names(cluster):
    objects = {(d["kind"], d["metadata"]["name"]): d for d in _docs("postgres.yaml")}
    url = {e["name"]: e for e in _head(cluster)["env"]}["TUTOR_DB_URL"]["value"]
    host, port, db = re.search(r"@([\w-]+):(\d+)/(\w+)$", url).groups()
    service = objects[("Service", host)]
    assert service["spec"]["ports"][0]["port"] == int(port)
    [pg] = objects[("StatefulSet", host)]["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e.get("value") for e in pg["env"]}["POSTGRES_DB"] == db


def _make_calls():
    """Each `make` in the Dockerfile's RUN steps: (targets, VAR=value assignments)."""
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    calls = []
    for line in text.splitlines():
        if not line.startswith("RUN"):
            continue
        for command in re.split(r"&&|;", line.removeprefix("RUN")):
            words = shlex.split(command)
            while words and words[0].startswith("--"):  # RUN's own options
                words.pop(0)
            if words[:1] == ["make"]:
                rest = words[1:]
                calls.append(([w for w in rest if "=" not in w], [w for w in rest if "=" in w]))
    return calls


def test_the_image_builds_its_environment_from_makefile_targets():
    calls = _make_calls()
    assert calls and any(".venv/.installed-stamp" in targets for targets, _ in calls)
    makefile = (ROOT / "Makefile").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for targets, assignments in calls:
        for name, value in (a.split("=", 1) for a in assignments):
            # A variable the Makefile does not read would be ignored without a word.
            assert re.search(rf"^{name} [?:]?=", makefile, re.M), name
            if name == "EXTRAS":
                assert set(value.split(",")) <= set(extras), value
        # -B: print every command, as a fresh image would run them.
        dry = subprocess.run(["make", "-n", "-B", *targets, *assignments], cwd=ROOT,
                             capture_output=True, text=True)  # fmt: skip
        assert dry.returncode == 0, dry.stderr


def test_the_image_copies_files_that_exist():
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY"):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source
