#!/usr/bin/env bash
# One command for a person: a local Kubernetes cluster with a real node, the operator installed by
# the Helm chart and running in its own image, and the quickstart run in real pods, to Succeeded.
#   1. builds the test images (scripts/images/build.sh --test: the debug binaries on the cached
#      Debian root filesystem) and helm (scripts/helm/build.sh), both cached;
#   2. starts the control plane with the real node (scripts/cluster/up.sh --real-node), importing
#      the images into the node's containerd; the API server listens on the bridge address 10.88.0.1;
#   3. helm-installs charts/trajectory-operator into trajectory-system: the test images, the real
#      node's toleration and selector, KUBERNETES_SERVICE_HOST/PORT set to the API server's bridge
#      address (there is no kube-proxy behind the kubernetes Service);
#   4. makes a hostPath PersistentVolume + claim `trajectory-demo` in `default` over TRAJ_DEMO_STORAGE
#      and copies examples/quickstart/datasets/* into it;
#   5. starts the llama.cpp model server on 0.0.0.0 (pods reach it at 10.88.0.1);
#   6. applies examples/quickstart/run.yaml with the model at 10.88.0.1, the claim and the real
#      node's pod settings, waits for Succeeded and prints `kubectl get trun` and where the output is.
# The cluster and the model server keep running; stop them with `scripts/demo-cluster.sh --down`.
#
# Usage: scripts/demo-cluster.sh [--down]
# Environment:
#   TRAJ_CLUSTER_DIR        the cluster's state directory (default /tmp/trajectory-demo-cluster)
#   TRAJ_MODEL_SERVER_DIR   the model server's state directory (default /tmp/trajectory-demo-model-server)
#   TRAJ_DEMO_STORAGE       the shared volume's host directory (default /tmp/trajectory-demo-storage)
#   TRAJ_DEMO_TIMEOUT       seconds to wait for the run (default 900)
# Needs root (the real node: containerd, runc, a kubelet) and, the first time, apt and Go modules
# for the cluster's build (about 30 minutes cold; see scripts/cluster/README.md).
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "${REPO_ROOT}"

export TRAJ_CLUSTER_DIR="${TRAJ_CLUSTER_DIR:-/tmp/trajectory-demo-cluster}"
export TRAJ_MODEL_SERVER_DIR="${TRAJ_MODEL_SERVER_DIR:-/tmp/trajectory-demo-model-server}"
STORAGE="${TRAJ_DEMO_STORAGE:-/tmp/trajectory-demo-storage}"
TIMEOUT="${TRAJ_DEMO_TIMEOUT:-900}"
RELEASE=trajectory-operator
OPERATOR_NS=trajectory-system
RUN_NS=default
CLAIM=trajectory-demo
NONROOT=65532

step() { echo "==> $* ($(date +%H:%M:%S))" >&2; }
die() {
	echo "ERROR: $*" >&2
	exit 1
}

stop_commands="scripts/demo-cluster.sh --down
  # or: TRAJ_MODEL_SERVER_DIR=${TRAJ_MODEL_SERVER_DIR} scripts/model-server/stop.sh
  #     TRAJ_CLUSTER_DIR=${TRAJ_CLUSTER_DIR} scripts/cluster/down.sh"

case "${1:-}" in
"") ;;
--down)
	step "stopping the model server and the cluster"
	scripts/model-server/stop.sh
	scripts/cluster/down.sh
	echo "stopped; the volume's files stay in ${STORAGE} (rm -rf it to delete them)" >&2
	exit 0
	;;
-h | --help)
	sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
	exit 0
	;;
*) die "unknown argument: $1 (see --help)" ;;
esac

[[ "$(id -u)" == 0 ]] || die "the real node needs root (containerd, runc, a kubelet)"
START=${SECONDS}

step "test images (scripts/images/build.sh --test)"
scripts/images/build.sh --test
images_dir="${TRAJ_IMAGES_OUT:-${REPO_ROOT}/out/images}/test"
export TRAJ_NODE_IMAGES="${images_dir}/trajectory-worker-test.tar ${images_dir}/trajectory-operator-test.tar"
for archive in ${TRAJ_NODE_IMAGES}; do
	[[ -f "${archive}" ]] || die "scripts/images/build.sh --test did not write ${archive}"
done

step "helm (scripts/helm/build.sh, cached)"
HELM="$(scripts/helm/build.sh --print-path)"

step "cluster with the real node (scripts/cluster/up.sh --real-node, in ${TRAJ_CLUSTER_DIR})"
scripts/cluster/up.sh --real-node >/dev/null
# shellcheck source=/dev/null # written by up.sh
source "${TRAJ_CLUSTER_DIR}/env"
[[ -n "${TRAJ_CLUSTER_API_HOST:-}" && "${TRAJ_CLUSTER_API_HOST}" != 127.0.0.1 ]] ||
	die "the API server is not on the bridge address (${TRAJ_CLUSTER_DIR}/env: TRAJ_CLUSTER_API_HOST=${TRAJ_CLUSTER_API_HOST:-})"
: "${TRAJ_CLUSTER_API_PORT:?not in ${TRAJ_CLUSTER_DIR}/env}"
kubectl() { "${TRAJ_CLUSTER_KUBECTL}" "$@"; }
HOST_IP="${TRAJ_CLUSTER_NODE_HOST_IP}"

step "Helm chart: ${RELEASE} in ${OPERATOR_NS}, the operator in its own image on the real node"
values="${TRAJ_CLUSTER_DIR}/demo-values.yaml"
cat >"${values}" <<EOF
image:
  repository: trajectory.local/trajectory-operator
  tag: test
  pullPolicy: IfNotPresent
worker:
  image:
    repository: trajectory.local/trajectory-worker
    tag: test
logFormat: pretty
nodeSelector:
  type: real
tolerations:
  - {key: trajectory.dev/real-node, operator: Exists, effect: NoSchedule}
# No kube-proxy: the kubernetes Service's ClusterIP leads nowhere; the API server is on the bridge.
extraEnv:
  - {name: KUBERNETES_SERVICE_HOST, value: "${TRAJ_CLUSTER_API_HOST}"}
  - {name: KUBERNETES_SERVICE_PORT, value: "${TRAJ_CLUSTER_API_PORT}"}
EOF
"${HELM}" install "${RELEASE}" charts/trajectory-operator --namespace "${OPERATOR_NS}" --create-namespace \
	--values "${values}" >/dev/null
kubectl rollout status deployment "${RELEASE}" --namespace "${OPERATOR_NS}" --timeout=180s || {
	kubectl get pods --namespace "${OPERATOR_NS}" -o wide >&2 || true
	kubectl logs --namespace "${OPERATOR_NS}" "deployment/${RELEASE}" --tail=30 >&2 || true
	die "the operator's Deployment did not become available"
}
kubectl get pods --namespace "${OPERATOR_NS}" -o wide >&2

step "shared storage: ${STORAGE} as PersistentVolume ${CLAIM}, the quickstart dataset in it"
if [[ -d "${STORAGE}" ]]; then
	[[ -f "${STORAGE}/.trajectory-demo" ]] || die "${STORAGE} exists and was not made by this script"
	rm -rf "${STORAGE}/runs"
fi
mkdir -p "${STORAGE}/datasets"
touch "${STORAGE}/.trajectory-demo"
cp examples/quickstart/datasets/* "${STORAGE}/datasets/"
# A hostPath volume ignores fsGroup: the pods' user owns the directory.
chown -R "${NONROOT}:${NONROOT}" "${STORAGE}"
kubectl apply -f - >/dev/null <<EOF
apiVersion: v1
kind: PersistentVolume
metadata:
  name: ${CLAIM}
spec:
  capacity: {storage: 1Gi}
  accessModes: [ReadWriteMany]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: ""
  hostPath: {path: ${STORAGE}, type: Directory}
  claimRef: {namespace: ${RUN_NS}, name: ${CLAIM}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: ${CLAIM}
  namespace: ${RUN_NS}
spec:
  accessModes: [ReadWriteMany]
  storageClassName: ""
  volumeName: ${CLAIM}
  resources: {requests: {storage: 1Gi}}
EOF
kubectl wait --namespace "${RUN_NS}" --for=jsonpath='{.status.phase}'=Bound "pvc/${CLAIM}" --timeout=60s >/dev/null

step "model server on 0.0.0.0 (first run installs it: about 5 minutes)"
MODEL_SERVER_HOST=0.0.0.0 scripts/model-server/start.sh >/dev/null
# shellcheck source=/dev/null # written by start.sh
source "${TRAJ_MODEL_SERVER_DIR}/env"
model_port="${MODEL_BASE_URL##*:}"
model_port="${model_port%%/*}"
model_url="http://${HOST_IP}:${model_port}/v1"

step "the quickstart run (examples/quickstart/run.yaml, model ${model_url})"
run_file="${TRAJ_CLUSTER_DIR}/quickstart-run.yaml"
# run.yaml with the model the pods reach, then the cluster's keys (spec is its last mapping).
sed -e "s|^\(    baseUrl: \).*|\1${model_url}|" -e "s|^\(    name: \)smollm2-.*|\1${MODEL_NAME}|" \
	examples/quickstart/run.yaml >"${run_file}"
cat >>"${run_file}" <<EOF
  storage:
    volume:
      persistentVolumeClaim: {claimName: ${CLAIM}}
  podTemplate:
    imagePullPolicy: IfNotPresent
    nodeSelector: {type: real}
    tolerations:
      - {key: trajectory.dev/real-node, operator: Exists, effect: NoSchedule}
EOF
grep -q "baseUrl: ${model_url}$" "${run_file}" || die "could not set the model URL in ${run_file}"
kubectl apply --namespace "${RUN_NS}" -f "${run_file}" >/dev/null
run_start=${SECONDS}
phase=""
until [[ "${phase}" == Succeeded || "${phase}" == Failed ]]; do
	if ((SECONDS - run_start > TIMEOUT)); then
		kubectl get pods --namespace "${RUN_NS}" -o wide >&2 || true
		die "the run did not finish within ${TIMEOUT} s (phase '${phase}')"
	fi
	sleep 2
	phase="$(kubectl get trun quickstart --namespace "${RUN_NS}" -o jsonpath='{.status.phase}')"
done
if [[ "${phase}" != Succeeded ]]; then
	kubectl get trun quickstart --namespace "${RUN_NS}" -o jsonpath='{.status}' >&2
	echo >&2
	kubectl get pods --namespace "${RUN_NS}" -o wide >&2 || true
	die "the run ended ${phase}"
fi
output="${STORAGE}/runs/${RUN_NS}/quickstart/trajectories.jsonl"
[[ -s "${output}" ]] || die "the run Succeeded but ${output} is missing or empty"

echo
kubectl get trun --namespace "${RUN_NS}"
cat <<EOF

The quickstart run Succeeded in real pods in $((SECONDS - run_start)) s ($((SECONDS - START)) s in all).
  trajectories: ${output} ($(wc -l <"${output}") records)
  the run:      ${run_file}
  kubectl:      source ${TRAJ_CLUSTER_DIR}/env && "\${TRAJ_CLUSTER_KUBECTL}" get trun,jobs,pods -A
  the operator: "\${TRAJ_CLUSTER_KUBECTL}" logs -n ${OPERATOR_NS} deployment/${RELEASE}
Stop the cluster and the model server:
  ${stop_commands}
EOF
