"""Checks what a schema cannot about the deployment files, and fails
loudly: run by tests/tests/deploy.rs after the Kubernetes schemas passed.

- every berth container has liveness and readiness probes on /healthz and
  /readyz (HTTP, or `berth health [--ready]` for a unix socket);
- terminationGracePeriodSeconds exceeds the config's drain_timeout, and
  the config's memory_budget stays below the container's memory limit;
- no token is written in a manifest: BERTH_TOKEN comes from a Secret;
- each manifest has a Service;
- the Containerfile has a build stage and a runtime stage, runs as a
  non-root user, stops with SIGTERM and starts `berth serve`.

    python3 deploy/check.py deploy
"""

import re
import sys
import tomllib
from pathlib import Path

import yaml
from dockerfile_parse import DockerfileParser

UNITS = {"s": 1, "m": 60, "h": 3600}
SIZES = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
problems = []


def problem(where, what):
    problems.append("{}: {}".format(where, what))


def seconds(text):
    m = re.fullmatch(r"(\d+)(s|m|h)", text)
    return int(m.group(1)) * UNITS[m.group(2)]


def size(text):
    m = re.fullmatch(r"(\d+)\s*(KiB|MiB|GiB|Ki|Mi|Gi)", str(text))
    return int(m.group(1)) * SIZES[m.group(2)]


def probes(where, container):
    for kind, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        probe = container.get(kind)
        if probe is None:
            problem(where, "no {}".format(kind))
            continue
        if "httpGet" in probe:
            if probe["httpGet"].get("path") != path:
                problem(where, "{} does not ask {}".format(kind, path))
        elif "exec" in probe:
            command = probe["exec"]["command"]
            ready = "--ready" in command
            if command[:2] != ["berth", "health"] or ready != (path == "/readyz"):
                problem(where, "{} is not `berth health{}`".format(kind, " --ready" if ready else ""))
        else:
            problem(where, "{} is neither an HTTP nor a `berth health` probe".format(kind))


def manifests(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    configs = {d["metadata"]["name"]: tomllib.loads(d["data"]["berth.toml"])
               for d in docs if d["kind"] == "ConfigMap" and "berth.toml" in d.get("data", {})}
    if not any(d["kind"] == "Service" for d in docs):
        problem(path.name, "no Service")
    for d in docs:
        if d["kind"] not in ("Deployment", "DaemonSet"):
            continue
        spec = d["spec"]["template"]["spec"]
        grace = spec.get("terminationGracePeriodSeconds", 30)
        config_volumes = {v["name"]: v["configMap"]["name"] for v in spec.get("volumes", []) if "configMap" in v}
        berths = [c for c in spec.get("initContainers", []) + spec["containers"] if c.get("args", [None])[0] == "serve"]
        if not berths:
            problem(path.name, "{} runs no `berth serve`".format(d["metadata"]["name"]))
        for c in berths:
            where = "{}/{}".format(path.name, c["name"])
            probes(where, c)
            mounted = [config_volumes[m["name"]] for m in c.get("volumeMounts", []) if m["name"] in config_volumes]
            if len(mounted) != 1:
                problem(where, "mounts no berth.toml ConfigMap")
                continue
            config = configs[mounted[0]]
            drain = seconds(config.get("drain_timeout", "30s"))
            if grace <= drain:
                problem(where, "terminationGracePeriodSeconds {} is not above drain_timeout {}s".format(grace, drain))
            limit = c.get("resources", {}).get("limits", {}).get("memory")
            if limit is None:
                problem(where, "no memory limit")
            elif "memory_budget" in config and size(config["memory_budget"]) >= size(limit):
                problem(where, "memory_budget {} is not below the memory limit {}".format(config["memory_budget"], limit))
            listen = config.get("listen", "")
            for env in c.get("env", []):
                if "TOKEN" in env["name"] and "secretKeyRef" not in env.get("valueFrom", {}):
                    problem(where, "{} is not taken from a Secret".format(env["name"]))
            if not listen.startswith("unix:") and not any(e["name"] == "BERTH_TOKEN" for e in c.get("env", [])):
                problem(where, "listens on {} without BERTH_TOKEN".format(listen))
    text = path.read_text()
    for word in ("token =", "token:", "Bearer "):
        if word in text:
            problem(path.name, "`{}` written in the manifest".format(word))


def containerfile(path):
    parser = DockerfileParser(fileobj=open(path, "rb"))
    stages = [i for i in parser.structure if i["instruction"] == "FROM"]
    if len(stages) < 2 or " AS build" not in stages[0]["value"] or " AS runtime" not in stages[-1]["value"]:
        problem(path.name, "not a build stage then a runtime stage")
    runtime = parser.structure[parser.structure.index(stages[-1]):]
    users = [i["value"] for i in runtime if i["instruction"] == "USER"]
    if not users or users[-1].split(":")[0] in ("0", "root"):
        problem(path.name, "the runtime stage does not run as a non-root user")
    if not any(i["instruction"] == "STOPSIGNAL" and i["value"] == "SIGTERM" for i in runtime):
        problem(path.name, "no STOPSIGNAL SIGTERM")
    entry = [i["value"] for i in runtime if i["instruction"] == "ENTRYPOINT"]
    cmd = [i["value"] for i in runtime if i["instruction"] == "CMD"]
    if entry != ['["berth"]'] or not cmd or not cmd[-1].startswith('["serve"'):
        problem(path.name, "does not start `berth serve`")
    if not any(i["instruction"] == "HEALTHCHECK" for i in runtime):
        problem(path.name, "no HEALTHCHECK")
    # podman builds OCI images by default, which have no HEALTHCHECK: it
    # would be dropped without a word.
    build = (path.parent / "build.sh").read_text()
    if "--format docker" not in build:
        problem("build.sh", "podman must build in Docker's format (--format docker)")


def main():
    root = Path(sys.argv[1])
    for path in sorted((root / "k8s").glob("*.yaml")):
        manifests(path)
    containerfile(root / "container" / "Containerfile")
    for p in problems:
        print("deploy check: " + p)
    if problems:
        sys.exit(1)
    print("deploy check: ok")


if __name__ == "__main__":
    main()
