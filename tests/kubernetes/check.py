#!/usr/bin/env python3
"""`make k8s-check`: the Kubernetes manifests in deploy/kubernetes/, offline (no cluster here).

- every manifest against the JSON schema of its kind (deploy/kubernetes/schemas/, extracted by
  extract.py there from the Kubernetes API and the CRDs; unknown keys are refused), with
  check-jsonschema from PyPI; a manifest with no schema fails the check;
- the PrometheusRule is what deploy/kubernetes/prometheusrule.py makes of
  alerts/vramguard.rules.yaml, byte for byte, and its groups equal the rule file's once parsed;
  promtool checks the rules taken back out of it;
- the pieces fit together: every selector selects the Deployment's pods, the pods carry the
  engine label the endpoint picker config names, ports and probes agree, the GPU comes only
  through the device plugin's resource, and the InferenceService names the runtime.

Run with check-jsonschema (and its ruamel.yaml) on PYTHONPATH: make installs them in
.deps/k8scheck.
"""

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from ruamel.yaml import YAML

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy/kubernetes"
SCHEMAS = DEPLOY / "schemas"

# Every Kubernetes object shipped, and the schema it must satisfy.
MANIFESTS = {
    "deployment.yaml": "deployment-apps-v1.json",
    "service.yaml": "service-v1.json",
    "inferencepool.yaml": "inferencepool-inference.networking.k8s.io-v1.json",
    "podmonitor.yaml": "podmonitor-monitoring.coreos.com-v1.json",
    "prometheusrule.yaml": "prometheusrule-monitoring.coreos.com-v1.json",
    "kserve/clusterservingruntime.yaml": "clusterservingruntime-serving.kserve.io-v1alpha1.json",
    "kserve/inferenceservice.yaml": "inferenceservice-serving.kserve.io-v1beta1.json",
}
# Files that are not Kubernetes objects, and what checks them instead.
NOT_OBJECTS = {
    # The endpoint picker's own config file (no CRD): its metric names are checked against a
    # live exposition by tests/it/picker.rs, its engine name here.
    "inference-gateway/endpoint-picker-config.yaml",
}
ENGINE_LABEL = "inference.networking.k8s.io/engine-type"
GPU = "nvidia.com/gpu"

failures = []


def fail(message):
    failures.append(message)
    print(f"error: {message}")


def load(rel):
    return YAML(typ="safe").load((DEPLOY / rel).read_text())


def check_schemas():
    shipped = {str(p.relative_to(DEPLOY)) for p in DEPLOY.rglob("*.yaml")}
    for rel in sorted(shipped - set(MANIFESTS) - NOT_OBJECTS):
        fail(f"deploy/kubernetes/{rel} has no schema: add it to MANIFESTS in {Path(__file__).name}")
    for rel, schema in MANIFESTS.items():
        run = subprocess.run(
            # The CRDs' patterns are Go regular expressions (`(?i)` flags and all), which Python's
            # dialect reads and the default (ECMAScript) one does not.
            [sys.executable, "-m", "check_jsonschema", "--no-cache", "--regex-variant", "python",
             "--schemafile", SCHEMAS / schema, DEPLOY / rel],
            capture_output=True,
            text=True,
        )
        if run.returncode != 0:
            fail(f"deploy/kubernetes/{rel} does not match {schema}:\n{run.stdout}{run.stderr}")
        else:
            print(f"deploy/kubernetes/{rel}: matches schemas/{schema}")


def check_prometheusrule():
    spec = importlib.util.spec_from_file_location("prometheusrule", DEPLOY / "prometheusrule.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    rules_text = generator.RULES.read_text()
    if generator.generate(rules_text) != generator.OUT.read_text():
        fail("deploy/kubernetes/prometheusrule.yaml differs from alerts/vramguard.rules.yaml: "
             "run `python3 deploy/kubernetes/prometheusrule.py`")
    groups = load("prometheusrule.yaml")["spec"]["groups"]
    if groups != YAML(typ="safe").load(rules_text)["groups"]:
        fail("the PrometheusRule's groups are not the rule file's groups")
    with tempfile.TemporaryDirectory() as tmp:
        extracted = Path(tmp) / "prometheusrule-groups.yaml"
        extracted.write_text(json.dumps({"groups": groups}))
        run = subprocess.run(["promtool", "check", "rules", extracted], capture_output=True, text=True)
        if run.returncode != 0:
            fail(f"promtool rejects the PrometheusRule's rules:\n{run.stdout}{run.stderr}")
        else:
            print("deploy/kubernetes/prometheusrule.yaml: the rule file's groups; promtool check rules: ok")


def selects(selector, labels, what):
    wanted = selector.get("matchLabels") or {}
    if not wanted or any(labels.get(k) != v for k, v in wanted.items()):
        fail(f"{what} selector {wanted} does not select the Deployment's pods ({labels})")


def check_fit():
    deployment = load("deployment.yaml")
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    selects(deployment["spec"]["selector"], labels, "deployment.yaml")
    selects({"matchLabels": load("service.yaml")["spec"]["selector"]}, labels, "service.yaml")
    pool = load("inferencepool.yaml")["spec"]
    selects(pool["selector"], labels, "inferencepool.yaml")
    podmonitor = load("podmonitor.yaml")["spec"]
    selects(podmonitor["selector"], labels, "podmonitor.yaml")
    # The alerts select job="vramguard": the PodMonitor takes the job from this pod label.
    if labels.get(podmonitor.get("jobLabel")) != "vramguard":
        fail("podmonitor.yaml: jobLabel must name a pod label whose value is `vramguard` (the alerts' job)")

    picker = load("inference-gateway/endpoint-picker-config.yaml")
    engines = [
        engine["name"]
        for plugin in picker["plugins"]
        if plugin["type"] == "core-metrics-extractor"
        for engine in plugin["parameters"]["engineConfigs"]
    ]
    if labels.get(ENGINE_LABEL) not in engines:
        fail(f"deployment.yaml: pods must carry {ENGINE_LABEL} with one of the picker's engines {engines}")

    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    listen = container["args"][container["args"].index("--listen") + 1]
    if int(listen.rsplit(":", 1)[1]) != ports.get("http"):
        fail(f"deployment.yaml: --listen {listen} is not the `http` port {ports.get('http')}")
    if [p["number"] for p in pool["targetPorts"]] != [ports.get("http")]:
        fail("inferencepool.yaml: targetPorts must be the Deployment's http port")
    for probe, path in (("livenessProbe", "/v2/health/live"), ("readinessProbe", "/v2/health/ready")):
        if container.get(probe, {}).get("httpGet", {}).get("path") != path:
            fail(f"deployment.yaml: {probe} must GET {path}")
    if str(container["resources"]["limits"].get(GPU)) != "1":
        fail(f"deployment.yaml: the GPU comes from the device plugin: limits.{GPU}: 1")
    if container.get("securityContext", {}).get("privileged") or any(
        "hostPath" in v for v in pod["spec"].get("volumes", [])
    ):
        fail("deployment.yaml: no privileged container and no hostPath: /dev/nvidia* come from the device plugin")

    runtime = load("kserve/clusterservingruntime.yaml")
    spec = runtime["spec"]
    if [c["name"] for c in spec["containers"]] != ["kserve-container"]:
        fail("kserve/clusterservingruntime.yaml: one container, named kserve-container")
    if spec["protocolVersions"] != ["v2"] or "onnx" not in [f["name"] for f in spec["supportedModelFormats"]]:
        fail("kserve/clusterservingruntime.yaml: protocolVersions [v2] and the onnx model format")
    model = load("kserve/inferenceservice.yaml")["spec"]["predictor"]["model"]
    if model.get("runtime") != runtime["metadata"]["name"] or model["modelFormat"]["name"] != "onnx":
        fail("kserve/inferenceservice.yaml: must use the vramguard runtime and the onnx format")
    if not failures:
        print("deploy/kubernetes: selectors, engine label, ports, probes and GPU access fit together")


def main():
    check_schemas()
    check_prometheusrule()
    check_fit()
    if failures:
        sys.exit(f"k8s-check: {len(failures)} problem(s)")
    print("k8s-check: ok")


if __name__ == "__main__":
    main()
