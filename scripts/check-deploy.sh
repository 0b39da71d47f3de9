#!/usr/bin/env bash
# Validates the deployment files: the compose file with docker-compose's own parser, the Kubernetes
# manifests against the Kubernetes schemas (kubernetes-validate, strict), and that the seed ConfigMap
# matches config-seed/. With --write, regenerates deploy/k8s/config-seed.yaml instead of checking it.
set -euo pipefail
cd "$(dirname "$0")/.."

seed_configmap() {
  python3 - <<'PY'
import json, pathlib
files = sorted(pathlib.Path("config-seed").glob("*.json"))
out = ["# Generated from config-seed/ by scripts/check-deploy.sh --write; do not edit by hand.",
       "apiVersion: v1", "kind: ConfigMap", "metadata:", "  name: agent-config-seed",
       "  labels: { app.kubernetes.io/part-of: pulsar-agents }", "data:"]
for f in files:
    text = f.read_text()
    json.loads(text)
    out.append(f"  {f.name}: |")
    out.extend("    " + line if line else "" for line in text.rstrip("\n").split("\n"))
print("\n".join(out))
PY
}

if [ "${1:-}" = "--write" ]; then
  seed_configmap > deploy/k8s/config-seed.yaml
  exit 0
fi
if ! diff -q <(seed_configmap) deploy/k8s/config-seed.yaml >/dev/null; then
  echo "deploy/k8s/config-seed.yaml is out of date with config-seed/: run scripts/check-deploy.sh --write" >&2
  exit 1
fi
AGENT_ENV_FILE=.env.example docker-compose -f docker-compose.yml config -q
echo "docker-compose.yml: valid"
# No unauthenticated write path to the graph store: the aggregator owns it (a path) and every
# other service reaches it through the aggregator's token-checked endpoint; no SPARQL server image.
python3 - <<'PY'
import pathlib, sys, yaml
problems = []
docs = [("docker-compose.yml", d) for d in [yaml.safe_load(open("docker-compose.yml"))]]
docs += [(str(p), d) for p in sorted(pathlib.Path("deploy/k8s").glob("*.yaml"))
         for d in yaml.safe_load_all(open(p)) if d]
stores = ("oxigraph/oxigraph", "fuseki", "virtuoso", "graphdb", "blazegraph")
def walk(node, where, file):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "image" and isinstance(value, str) and any(s in value for s in stores):
                problems.append(f"{file}: {where}: a SPARQL server image ({value}) that takes writes without our token")
            if key == "GRAPH_STORE" and isinstance(value, str):
                check(value, where, file)
            if key == "name" and value == "GRAPH_STORE" and isinstance(node.get("value"), str):
                check(node["value"], where, file)
            walk(value, f"{where}/{key}", file)
    elif isinstance(node, list):
        for item in node:
            walk(item, where, file)
def check(value, where, file):
    if value.startswith("http") and "agent-aggregator" not in value:
        problems.append(f"{file}: {where}: GRAPH_STORE {value} is not the aggregator's authenticated endpoint")
for file, doc in docs:
    walk(doc, "", file)
# Published ports reach this machine's own clients only: the broker shipped in compose
# authenticates no one.
for name, service in (docs[0][1].get("services") or {}).items():
    for port in service.get("ports") or []:
        if not str(port).startswith("127.0.0.1:"):
            problems.append(f"docker-compose.yml: services/{name}: port {port} is published on every interface, not 127.0.0.1")
# Every pod talks to the broker, so every pod (the pulsar-init Job too) mounts its CA where
# PULSAR_TLS_CA_FILE points: a pod without it cannot reach a broker signed by a private CA.
for file, doc in docs[1:]:
    pod = ((doc.get("spec") or {}).get("template") or {}).get("spec")
    if not pod:
        continue
    volumes = {v.get("name"): v for v in pod.get("volumes") or []}
    ca = volumes.get("pulsar-ca", {}).get("secret", {})
    if ca.get("secretName") != "agent-pulsar-ca":
        problems.append(f"{file}: {doc['metadata']['name']}: no volume pulsar-ca of the Secret agent-pulsar-ca")
    for container in pod.get("containers") or []:
        mounts = {m.get("name"): m.get("mountPath") for m in container.get("volumeMounts") or []}
        if mounts.get("pulsar-ca") != "/etc/agent/pulsar-ca":
            problems.append(f"{file}: {container['name']}: the broker's CA is not mounted at /etc/agent/pulsar-ca")
if problems:
    print("\n".join(problems), file=sys.stderr)
    sys.exit(1)
print("graph store: only the aggregator's token-checked endpoint is shipped; every pod mounts the broker's CA")
PY
manifests=$(ls deploy/k8s/*.yaml | grep -v kustomization.yaml)
# shellcheck disable=SC2086
python3 -m kubernetes_validate --strict --quiet -k 1.31.0 $manifests
echo "deploy/k8s: $(echo "$manifests" | wc -l) files valid against the Kubernetes 1.31 schemas"
