"""Checks what a schema cannot about the deployment files, and fails
loudly: run by tests/tests/deploy.rs after the Kubernetes schemas passed.

- every berth container has liveness and readiness probes on /healthz and
  /readyz (HTTP, or `berth health [--ready]` for a unix socket);
- terminationGracePeriodSeconds exceeds the config's drain_timeout, and
  the config's memory_budget stays below the container's memory limit;
- no token is written in a manifest: BERTH_TOKEN comes from a Secret;
- each manifest has a Service;
- each InferencePool selects the pods of a berth workload, targets its
  port, names the endpoint picker's Service and port in its own file; that
  picker's config reads berth's four gauges and scores by the warm model;
  and the berth configs it selects set public_metrics, since the picker
  scrapes /metrics without a token;
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
# berth's gauges in the places of the Model Server Protocol, as the
# endpoint picker's core-metrics-extractor names them.
GAUGES = {
    "queuedRequestsSpec": "berth_requests_waiting",
    "runningRequestsSpec": "berth_requests_running",
    "kvUsageSpec": "berth_budget_usage_ratio",
    "loraSpec": "berth_loaded_models_info",
}
# The keys the v1.5.0 picker's strict decoder takes in its config
# (apix/config/v1alpha1): any other stops it at start.
PICKER_KEYS = {"apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles",
               "saturationDetector", "dataLayer", "flowControl", "parser"}
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


def berth_configs(docs):
    return {d["metadata"]["name"]: tomllib.loads(d["data"]["berth.toml"])
            for d in docs if d["kind"] == "ConfigMap" and "berth.toml" in d.get("data", {})}


def containers(workload):
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def mounted_configmaps(workload, container):
    """Mount path -> ConfigMap name."""
    volumes = {v["name"]: v["configMap"]["name"]
               for v in workload["spec"]["template"]["spec"].get("volumes", []) if "configMap" in v}
    return {m["mountPath"].rstrip("/"): volumes[m["name"]]
            for m in container.get("volumeMounts", []) if m["name"] in volumes}


def is_berth_image(container):
    return container["image"].split("/")[-1].split(":")[0] == "berth"


def manifests(path, docs):
    configs = berth_configs(docs)
    if not any(d["kind"] == "Service" for d in docs):
        problem(path.name, "no Service")
    for d in docs:
        # Workloads of other images (the endpoint picker) are not berth's.
        if d["kind"] not in ("Deployment", "DaemonSet") or not any(map(is_berth_image, containers(d))):
            continue
        grace = d["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        berths = [c for c in containers(d) if c.get("args", [None])[0] == "serve"]
        if not berths:
            problem(path.name, "{} runs no `berth serve`".format(d["metadata"]["name"]))
        for c in berths:
            where = "{}/{}".format(path.name, c["name"])
            probes(where, c)
            mounted = list(mounted_configmaps(d, c).values())
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


def labels_match(selector, labels):
    return all(labels.get(k) == v for k, v in selector.items())


def pod_labels(workload):
    return workload["spec"]["template"]["metadata"].get("labels", {})


def find(docs, kind, name):
    return next((d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name), None)


def pools(files):
    """Each InferencePool against the berth pods it selects, in any file."""
    workloads = [(f, d) for f, docs in files.items() for d in docs
                 if d["kind"] in ("Deployment", "DaemonSet") and any(map(is_berth_image, containers(d)))]
    for name, docs in files.items():
        for pool in (d for d in docs if d["kind"] == "InferencePool"):
            where = "{}/{}".format(name, pool["metadata"]["name"])
            spec = pool["spec"]
            chosen = [(f, w) for f, w in workloads if labels_match(spec["selector"]["matchLabels"], pod_labels(w))]
            if not chosen:
                problem(where, "selects the pods of no berth Deployment or DaemonSet")
            targets = {p["number"] for p in spec["targetPorts"]}
            for f, w in chosen:
                configs = berth_configs(files[f])
                for c in (c for c in containers(w) if c.get("args", [None])[0] == "serve"):
                    listens = {p["containerPort"] for p in c.get("ports", [])}
                    what = "{}'s {} {}".format(f, w["kind"], w["metadata"]["name"])
                    if not targets & listens:
                        problem(where, "targets port {} but {} listens on {}".format(sorted(targets), what, sorted(listens)))
                    for m in mounted_configmaps(w, c).values():
                        if not configs.get(m, {}).get("public_metrics", False):
                            problem(where, "selects the pods of {}, whose {} lacks public_metrics = true: "
                                    "the picker scrapes /metrics without a token".format(what, m))
            picker(where, spec["endpointPickerRef"], docs)


def picker(where, ref, docs):
    """The pool's endpoint picker: a Service and port in the pool's file,
    the Deployment behind it, and the config file that Deployment reads."""
    service = find(docs, "Service", ref["name"])
    if ref.get("kind", "Service") != "Service" or service is None:
        problem(where, "its endpointPickerRef names no Service in the same file")
        return
    if ref["port"]["number"] not in [p["port"] for p in service["spec"]["ports"]]:
        problem(where, "Service {} has no port {}".format(ref["name"], ref["port"]["number"]))
    behind = [d for d in docs if d["kind"] == "Deployment" and labels_match(service["spec"]["selector"], pod_labels(d))]
    if len(behind) != 1:
        problem(where, "Service {} selects {} Deployments, not one picker".format(ref["name"], len(behind)))
        return
    for c in containers(behind[0]):
        args = c.get("args", [])
        if "--config-file" not in args:
            continue
        path = args[args.index("--config-file") + 1]
        folder, key = path.rsplit("/", 1)
        configmap = find(docs, "ConfigMap", mounted_configmaps(behind[0], c).get(folder))
        if configmap is None or key not in configmap.get("data", {}):
            problem(where, "the picker's --config-file {} is in no ConfigMap of this file".format(path))
            return
        picker_config("{} ({}/{})".format(where, configmap["metadata"]["name"], key),
                      yaml.safe_load(configmap["data"][key]))
        return
    problem(where, "the picker {} has no --config-file".format(behind[0]["metadata"]["name"]))


def picker_config(where, config):
    unknown = set(config) - PICKER_KEYS
    if unknown:
        problem(where, "keys the v1.5.0 picker refuses: {}".format(sorted(unknown)))
    plugins = {p.get("name", p["type"]): p["type"] for p in config.get("plugins", [])}
    extractors = [p.get("parameters", {}) for p in config.get("plugins", []) if p["type"] == "core-metrics-extractor"]
    if len(extractors) != 1:
        problem(where, "not one core-metrics-extractor but {}".format(len(extractors)))
    else:
        engine = extractors[0].get("defaultEngine", "vllm")
        entry = next((e for e in extractors[0].get("engineConfigs", []) if e["name"] == engine), None)
        if entry is None:
            problem(where, "the default engine `{}` has no engineConfigs entry: the picker reads "
                    "its built-in names, not berth's".format(engine))
        for field, gauge in GAUGES.items():
            if entry is not None and entry.get(field) != gauge:
                problem(where, "engine `{}`: {} is {!r}, not {}".format(engine, field, entry.get(field), gauge))
    profiles = config.get("schedulingProfiles", [])
    refs = [p["pluginRef"] for prof in profiles for p in prof["plugins"]]
    refs += [r["pluginRef"] for s in config.get("dataLayer", {}).get("sources", []) for r in [s] + s.get("extractors", [])]
    for ref in refs:
        if ref not in plugins:
            problem(where, "`{}` names no plugin".format(ref))
    if not profiles:
        problem(where, "no schedulingProfiles")
    for prof in profiles:
        if not any(plugins.get(p["pluginRef"]) == "lora-affinity-scorer" for p in prof["plugins"]):
            problem(where, "profile {} has no lora-affinity-scorer: requests would not go where their "
                    "model is warm".format(prof["name"]))


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
    files = {}
    for path in sorted((root / "k8s").glob("*.yaml")):
        files[path.name] = [d for d in yaml.safe_load_all(path.read_text()) if d]
        manifests(path, files[path.name])
    pools(files)
    containerfile(root / "container" / "Containerfile")
    for p in problems:
        print("deploy check: " + p)
    if problems:
        sys.exit(1)
    print("deploy check: ok")


if __name__ == "__main__":
    main()
