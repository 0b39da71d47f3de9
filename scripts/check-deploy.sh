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
manifests=$(ls deploy/k8s/*.yaml | grep -v kustomization.yaml)
# shellcheck disable=SC2086
python3 -m kubernetes_validate --strict --quiet -k 1.31.0 $manifests
echo "deploy/k8s: $(echo "$manifests" | wc -l) files valid against the Kubernetes 1.31 schemas"
