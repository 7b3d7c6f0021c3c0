"""Validates the custom resources in deploy/k8s/*.yaml, which
kubernetes-validate has no schema for, against the CRDs vendored in
deploy/k8s/crds/, and fails loudly, one line per problem:

- a document of an API group Kubernetes 1.34 does not serve needs a
  vendored CRD of its group, kind and version;
- it is checked against that version's openAPIV3Schema as the API server
  and kubectl's strict field validation would: defaults filled in, unknown
  fields refused, `nullable` honoured, metadata.name a DNS subdomain;
- then the CRD's CEL rules (x-kubernetes-validations), by the Python
  equivalents in RULES, keyed by the rule's text: a rule the CRD has and
  RULES lacks is a problem, so an updated CRD cannot skip one silently;
- each vendored file's git blob SHA-1 is one that crds/README.md pins;
- broken copies of each resource (BREAKAGES) must all be refused: the
  proof that this check can fail.

    python3 deploy/crd_check.py deploy
"""

import copy
import hashlib
import re
import sys
from pathlib import Path

import jsonschema
import yaml

# The API groups of Kubernetes 1.34's own schemas, which kubernetes-validate
# checks; any other group is a custom resource's.
BUILTIN = {
    "", "admission.k8s.io", "admissionregistration.k8s.io", "apiextensions.k8s.io",
    "apiregistration.k8s.io", "apps", "authentication.k8s.io", "authorization.k8s.io",
    "autoscaling", "batch", "certificates.k8s.io", "coordination.k8s.io", "discovery.k8s.io",
    "events.k8s.io", "extensions", "flowcontrol.apiserver.k8s.io", "imagepolicy.k8s.io",
    "internal.apiserver.k8s.io", "networking.k8s.io", "node.k8s.io", "policy",
    "rbac.authorization.k8s.io", "resource.k8s.io", "scheduling.k8s.io", "storage.k8s.io",
    "storagemigration.k8s.io",
}

# The CEL rules of the vendored CRDs in Python, each true where the rule
# holds for `self` (after defaults, as the API server evaluates them).
RULES = {
    # InferencePool v1 spec.endpointPickerRef; kind defaults to Service.
    "self.kind != 'Service' || has(self.port)":
        lambda ref: ref["kind"] != "Service" or "port" in ref,
    # InferencePool v1 spec.targetPorts: no number twice.
    "self.all(p1, self.exists_one(p2, p1.number==p2.number))":
        lambda ports: all(sum(p2["number"] == p1["number"] for p2 in ports) == 1 for p1 in ports),
}

# Broken copies each resource must be refused in: name, how to break it.
BREAKAGES = {
    "InferencePool": [
        ("without targetPorts", lambda o: o["spec"].pop("targetPorts")),
        ("with a port number twice", lambda o: o["spec"]["targetPorts"].append(dict(o["spec"]["targetPorts"][0]))),
        ("with a Service picker and no port", lambda o: o["spec"]["endpointPickerRef"].pop("port")),
        ("with an unknown field under spec", lambda o: o["spec"].update(replicas=2)),
    ],
}

DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def blob_sha1(data):
    """What `git hash-object` prints for a file holding `data`."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def strict(schema):
    """An OpenAPI v3 structural schema as JSON Schema: jsonschema ignores the
    x-kubernetes-* keys, so what they mean is spelled out here."""
    s = dict(schema)
    if s.get("nullable") and "type" in s:
        s["type"] = [s["type"], "null"]
    if s.get("x-kubernetes-int-or-string"):
        s["type"] = ["integer", "string"]
    if "properties" in s:
        s["properties"] = {k: strict(v) for k, v in s["properties"].items()}
        # The API server prunes unknown fields; kubectl's strict field
        # validation refuses them instead.
        if "additionalProperties" not in s and not s.get("x-kubernetes-preserve-unknown-fields"):
            s["additionalProperties"] = False
    if isinstance(s.get("additionalProperties"), dict):
        s["additionalProperties"] = strict(s["additionalProperties"])
    if "items" in s:
        s["items"] = strict(s["items"])
    return s


def child(schema, key):
    if key in schema.get("properties", {}):
        return schema["properties"][key]
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, dict) else {}


def defaulted(schema, obj):
    """`obj` with the schema's defaults filled in, as the API server does."""
    if isinstance(obj, dict):
        out = {k: defaulted(child(schema, k), v) for k, v in obj.items()}
        for k, sub in schema.get("properties", {}).items():
            if k not in out and "default" in sub:
                out[k] = defaulted(sub, copy.deepcopy(sub["default"]))
        return out
    if isinstance(obj, list):
        return [defaulted(schema.get("items", {}), v) for v in obj]
    return obj


def cel(schema, obj, path, errors):
    """Evaluates the rules on `obj` and below, appending each broken one."""
    for v in schema.get("x-kubernetes-validations", []):
        if v["rule"] in RULES and not RULES[v["rule"]](obj):
            errors.append("{}: {}".format(path or "(root)", v.get("message", v["rule"])))
    if isinstance(obj, dict):
        for k, value in obj.items():
            cel(child(schema, k), value, path + "." + k if path else k, errors)
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            cel(schema.get("items", {}), value, "{}.{}".format(path, i), errors)


def rules(schema):
    """Every CEL rule text anywhere in a schema."""
    if isinstance(schema, dict):
        for v in schema.get("x-kubernetes-validations", []):
            yield v["rule"]
        for value in schema.values():
            yield from rules(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from rules(value)


def refusals(schema, obj):
    """Why the API server would refuse `obj` (empty: it would take it)."""
    obj = defaulted(schema, obj)
    errors = ["{}: {}".format(".".join(map(str, e.absolute_path)) or "(root)", e.message)
              for e in jsonschema.Draft4Validator(strict(schema)).iter_errors(obj)]
    name = obj.get("metadata", {}).get("name", "")
    if len(name) > 253 or not DNS_SUBDOMAIN.fullmatch(name):
        errors.append("metadata.name: {!r} is not a DNS subdomain".format(name))
    if not errors:  # the rules assume the schema's shape
        cel(schema, obj, "", errors)
    return errors


def main():
    root = Path(sys.argv[1]) / "k8s"
    problems, done = [], []
    pinned = set(re.findall(r"^- blob: ([0-9a-f]{40})$", (root / "crds" / "README.md").read_text(), re.M))
    crds = {}
    for path in sorted((root / "crds").glob("*.yaml")):
        data = path.read_bytes()
        if blob_sha1(data) not in pinned:
            problems.append("crds/{}: git blob {} is not pinned by a `- blob:` line of crds/README.md"
                            .format(path.name, blob_sha1(data)))
        crd = yaml.safe_load(data)
        for version in crd["spec"]["versions"]:
            unknown = set(rules(version["schema"])) - set(RULES)
            for rule in sorted(unknown):
                problems.append("crds/{}: the CRD has a CEL rule this check does not evaluate: {}"
                                .format(path.name, rule))
            if version["served"]:
                key = (crd["spec"]["group"], crd["spec"]["names"]["kind"], version["name"])
                crds[key] = (path.name, version["schema"]["openAPIV3Schema"])
    for path in sorted(root.glob("*.yaml")):
        for doc in (d for d in yaml.safe_load_all(path.read_text()) if d):
            group, _, version = doc["apiVersion"].rpartition("/")
            if group in BUILTIN:
                continue
            what = "{}/{} in {}".format(doc["kind"], doc["metadata"]["name"], path.name)
            if (group, doc["kind"], version) not in crds:
                problems.append("{}: no CRD in crds/ serves {} {}".format(what, doc["apiVersion"], doc["kind"]))
                continue
            crd_file, schema = crds[(group, doc["kind"], version)]
            problems += ["{}: {}".format(what, e) for e in refusals(schema, doc)]
            if doc["kind"] not in BREAKAGES:
                problems.append("{}: no broken copies in BREAKAGES to prove the check refuses them".format(what))
            for name, breakage in BREAKAGES.get(doc["kind"], []):
                broken = copy.deepcopy(doc)
                breakage(broken)
                if not refusals(schema, broken):
                    problems.append("{}: a copy {} passed: the check is not checking".format(what, name))
            done.append("{} against {} (and refused {} broken copies)".format(
                what, crd_file, len(BREAKAGES.get(doc["kind"], []))))
    for p in problems:
        print("crd check: " + p)
    if problems:
        sys.exit(1)
    print("crd check: ok, validated " + "; ".join(done) if done else "crd check: ok, no custom resources")


if __name__ == "__main__":
    main()
