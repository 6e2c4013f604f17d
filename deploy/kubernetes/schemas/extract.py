#!/usr/bin/env python3
"""Extract the JSON schemas `make k8s-check` validates deploy/kubernetes/ against.

Run by a maintainer when a pinned version below changes, never by `make test` (which must work
without GitHub); its output is committed beside it. It needs:
  - bare clones (or any git directories) of the three repositories whose CRDs are used, given as
    --repo OWNER/NAME=GITDIR; the files are read at the pinned tag with `git show`, so the
    working tree, if any, does not matter;
  - PyPI, for the `kubernetes-validate` wheel, whose strict JSON schemas of the Kubernetes API
    (generated from the Kubernetes OpenAPI spec) give Deployment and Service;
  - a YAML parser: PyYAML or ruamel.yaml (`make k8s-check` installs ruamel.yaml in .deps/k8scheck).

    PYTHONPATH=.deps/k8scheck python3 deploy/kubernetes/schemas/extract.py \\
        --repo kubernetes-sigs/gateway-api-inference-extension=/path/to/gaie.git \\
        --repo kserve/kserve=/path/to/kserve.git \\
        --repo prometheus-operator/prometheus-operator=/path/to/prometheus-operator.git

How a CRD's openAPIV3Schema becomes a JSON schema (draft 2020-12):
  - Kubernetes prunes fields a structural schema does not name, silently: a misspelt key in a
    manifest would be dropped by the API server, not refused. So every object schema that lists
    `properties` (and neither `additionalProperties` nor x-kubernetes-preserve-unknown-fields)
    gets `additionalProperties: false`, and a misspelt key fails here instead.
  - `nullable` becomes a "null" type, x-kubernetes-int-or-string an integer-or-string, and an
    x-kubernetes-embedded-resource object also allows apiVersion, kind and metadata.
  - The top-level `metadata` (just `type: object` in a CRD) is Kubernetes' strict ObjectMeta,
    and apiVersion and kind must be the resource's own.
  - Patterns are Go regular expressions; the one Go-only form in these CRDs, inline flags after
    the anchor (`^(?i)...`), becomes `(?i)^...`, which the validator's Python dialect reads (the
    check runs with --regex-variant python).
  - Descriptions and the other x-kubernetes-* keys (CEL rules, list types) are dropped: JSON
    schema validators ignore them, and they make up most of the bytes.
"""

import argparse
import io
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (output file, repository, tag, CRD file, version served)
CRDS = [
    (
        "inferencepool-inference.networking.k8s.io-v1.json",
        "kubernetes-sigs/gateway-api-inference-extension",
        "v1.5.0",
        "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml",
        "v1",
    ),
    (
        "clusterservingruntime-serving.kserve.io-v1alpha1.json",
        "kserve/kserve",
        "v0.20.0",
        "config/crd/full/serving.kserve.io_clusterservingruntimes.yaml",
        "v1alpha1",
    ),
    (
        "inferenceservice-serving.kserve.io-v1beta1.json",
        "kserve/kserve",
        "v0.20.0",
        "config/crd/full/serving.kserve.io_inferenceservices.yaml",
        "v1beta1",
    ),
    (
        "podmonitor-monitoring.coreos.com-v1.json",
        "prometheus-operator/prometheus-operator",
        "v0.93.0",
        "example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml",
        "v1",
    ),
    (
        "prometheusrule-monitoring.coreos.com-v1.json",
        "prometheus-operator/prometheus-operator",
        "v0.93.0",
        "example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml",
        "v1",
    ),
]

# The Kubernetes API: the strict schemas of one release, from the kubernetes-validate wheel.
KUBERNETES_VALIDATE = "1.37.0"
KUBERNETES = "v1.33.0"
CORE = [
    ("deployment-apps-v1.json", "io.k8s.api.apps.v1.Deployment", "apps/v1", "Deployment"),
    ("service-v1.json", "io.k8s.api.core.v1.Service", "v1", "Service"),
]
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
# How the kinds' own files refer to the definitions, and how the definitions refer to each other.
DEFS_REFS = ("/api/_definitions.json#/$defs/", "#/$defs/")
DRAFT = "https://json-schema.org/draft/2020-12/schema"


def load_yaml(text):
    try:
        import yaml

        return yaml.safe_load(text)
    except ImportError:
        from ruamel.yaml import YAML

        return YAML(typ="safe").load(text)


def kubernetes_definitions():
    """Kubernetes' own definitions ($defs by name), from the pinned kubernetes-validate wheel."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--disable-pip-version-check",
             "-d", tmp, f"kubernetes-validate=={KUBERNETES_VALIDATE}"],
            check=True,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            name = f"kubernetes_validate/kubernetes-json-schema/{KUBERNETES}-local-strict/_definitions.json"
            return json.load(io.BytesIO(z.read(name)))["$defs"]


def strip(node):
    """Drop descriptions everywhere, rewrite refs to this file's $defs."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "description" and isinstance(value, str):
                continue
            if key == "$ref" and isinstance(value, str) and value.startswith(DEFS_REFS):
                out[key] = "#/$defs/" + value.rsplit("/", 1)[1]
                continue
            out[key] = strip(value)
        return out
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def closure(defs, roots):
    """The definitions `roots` refer to, transitively."""
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)

        def refs(node):
            if isinstance(node, dict):
                for key, value in node.items():
                    if key == "$ref" and isinstance(value, str) and value.startswith(DEFS_REFS):
                        yield value.rsplit("/", 1)[1]
                    else:
                        yield from refs(value)
            elif isinstance(node, list):
                for v in node:
                    yield from refs(v)

        todo.extend(refs(defs[name]))
    return {name: strip(defs[name]) for name in sorted(seen)}


def pin_type(schema, api_version, kind):
    props = schema.setdefault("properties", {})
    props["apiVersion"] = {"const": api_version}
    props["kind"] = {"const": kind}
    required = schema.setdefault("required", [])
    for key in ("apiVersion", "kind", "metadata"):
        if key not in required:
            required.append(key)


def crd_node(node):
    """One openAPIV3Schema node as JSON schema (see the module's doc)."""
    if isinstance(node, list):
        return [crd_node(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("description", "nullable") or key.startswith("x-kubernetes-"):
            continue
        if key == "properties":
            out[key] = {name: crd_node(v) for name, v in value.items()}
        elif key in ("items", "additionalProperties", "not"):
            out[key] = crd_node(value)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = crd_node(value)
        elif key == "pattern":
            out[key] = re.sub(r"^\^(\(\?[a-z]+\))", r"\1^", value)
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("x-kubernetes-embedded-resource"):
        props = out.setdefault("properties", {})
        for key, kind in (("apiVersion", "string"), ("kind", "string"), ("metadata", "object")):
            props.setdefault(key, {"type": kind})
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    preserve = node.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False
    return out


def crd_schema(crd, version, meta_defs):
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = crd_node(served["schema"]["openAPIV3Schema"])
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    schema["properties"]["metadata"] = {"$ref": f"#/$defs/{OBJECT_META}"}
    pin_type(schema, f"{group}/{version}", kind)
    return {"$schema": DRAFT, **schema, "$defs": meta_defs}


def write(name, schema):
    # Compact: the InferenceService schema repeats a whole PodSpec per component (600 KB as it is).
    (HERE / name).write_text(json.dumps(schema, separators=(",", ":"), sort_keys=True) + "\n")
    print(f"wrote {name}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", action="append", default=[], metavar="OWNER/NAME=GITDIR")
    args = parser.parse_args()
    repos = dict(r.split("=", 1) for r in args.repo)
    missing = sorted({repo for _, repo, *_ in CRDS} - set(repos))
    if missing:
        parser.error("give --repo for " + ", ".join(missing))

    defs = kubernetes_definitions()
    meta_defs = closure(defs, [OBJECT_META])
    for name, root, api_version, kind in CORE:
        schema = strip(defs[root])
        pin_type(schema, api_version, kind)
        write(name, {"$schema": DRAFT, **schema, "$defs": closure(defs, [root])})
    for name, repo, tag, path, version in CRDS:
        text = subprocess.run(
            ["git", "--git-dir", repos[repo], "show", f"{tag}:{path}"],
            check=True, capture_output=True, text=True,
        ).stdout
        write(name, crd_schema(load_yaml(text), version, meta_defs))
    sources = {
        "kubernetes": f"kubernetes-validate=={KUBERNETES_VALIDATE} (PyPI), {KUBERNETES}-local-strict",
        "crds": [f"{repo}@{tag}:{path} ({version})" for _, repo, tag, path, version in CRDS],
    }
    (HERE / "SOURCES.json").write_text(json.dumps(sources, indent=1) + "\n")


if __name__ == "__main__":
    main()
