#!/usr/bin/env bash
# The whole test suite, on a fresh machine or a warm one: formatting and lints, then every test
# of the workspace with the real components they need running — a llama.cpp model server
# (scripts/model-server, listening on 0.0.0.0 so that pods reach it at the bridge address) and a
# Kubernetes control plane built from source with a real node (kubelet, Debian's containerd and
# runc; scripts/cluster, --real-node) that imports the test images (scripts/images/build.sh --test:
# the test build's binaries on the cached Debian root filesystem), for tests/tests/real_pods.rs.
# Both are installed or built into caches outside the repository on first use, started here,
# and stopped at the end whatever happens.
#
# Usage: scripts/test.sh [extra cargo test args]
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "${REPO_ROOT}"

step() { printf '\n==> %s (%(%H:%M:%S)T)\n' "$1" -1 >&2; }

step "Go tools: build in the background (cached)"
# The tools built from Go modules (Kueue, Karpenter, gitops-health, gubernator, versitygw, helm,
# crane) are mostly module downloads on a new machine: building them side by side with the cargo
# builds and the model server below overlaps those waits. Each is waited for before its first use.
mkdir -p "${TRAJ_CACHE_DIR}/logs"
go_tools_log="${TRAJ_CACHE_DIR}/logs/go-tools-$(date +%Y%m%d-%H%M%S).log"
(
  set -e
  for tool in kueue karpenter gitops-health gubernator versitygw helm registry; do
    printf '== %s (%(%H:%M:%S)T)\n' "${tool}" -1
    nice -n 10 "scripts/${tool}/build.sh"
  done
  printf '== built (%(%H:%M:%S)T)\n' -1
) >"${go_tools_log}" 2>&1 &
go_tools=$!
# A suite that stops early stops the chain after the tool being built (each lands whole or not).
trap '[[ -z "${go_tools}" ]] || kill "${go_tools}" 2>/dev/null || true' EXIT
wait_for_go_tools() {
  [[ -n "${go_tools}" ]] || return 0
  if ! wait "${go_tools}"; then
    cat "${go_tools_log}" >&2
    echo "the Go tools' build failed (log above: ${go_tools_log})" >&2
    exit 1
  fi
  go_tools=""
  grep '^== ' "${go_tools_log}" >&2
}

step "llama.cpp: build in the background (cached)"
# llama.cpp's libraries, which the model server loads, and its own server (worker/tests/token_ids.rs
# records its token ids), in one C++ build of ~10 min on a new machine beside the cargo builds; the
# model server's install below waits for it.
llama_server_log="${TRAJ_CACHE_DIR}/logs/llama-server-$(date +%Y%m%d-%H%M%S).log"
nice -n 10 scripts/llama-server/install.sh >"${llama_server_log}" 2>&1 &
llama_server=$!
trap '[[ -z "${go_tools}" ]] || kill "${go_tools}" 2>/dev/null || true
  [[ -z "${llama_server}" ]] || kill "${llama_server}" 2>/dev/null || true' EXIT

step "prune cargo's incremental caches past ${TRAJ_INCREMENTAL_LIMIT_GB:-8} GB"
prune_incremental "${CARGO_TARGET_DIR}/debug" "${TRAJ_INCREMENTAL_LIMIT_GB:-8}"

step "make room for the test build: ${TRAJ_MIN_FREE_GB:-30} GB free"
make_room_for_test_build "${CARGO_TARGET_DIR}" "${TRAJ_MIN_FREE_GB:-30}"

step "cargo fmt --check"
cargo fmt --all -- --check

step "cargo clippy"
cargo clippy --workspace --all-targets --all-features --quiet -- -D warnings

step "build the tests"
cargo test --workspace --all-features --no-run --quiet

step "prune test binaries of earlier builds from the cargo cache"
# Every build of a test target leaves a new ~300 MB executable in deps/ beside the old ones; over
# many commits they filled the disk until the real node's kubelet reported disk pressure and
# stopped starting pods. Only the newest of each target is the one cargo runs.
prune_old_test_binaries "${CARGO_TARGET_DIR}/debug/deps"

step "model server: install (cached)"
scripts/model-server/install.sh

step "browser: Debian's chromium (apt-get, once)"
scripts/browser/install.sh

step "real node: Debian packages (apt-get, once)"
scripts/cluster/install-node.sh

step "test images: the test build's binaries (scripts/images/build.sh --test)"
scripts/images/build.sh --test
images_dir="${TRAJ_IMAGES_OUT:-${REPO_ROOT}/out/images}/test"
# up.sh --real-node imports them into containerd's k8s.io namespace; the pods use them with
# imagePullPolicy IfNotPresent.
export TRAJ_NODE_IMAGES="${images_dir}/trajectory-worker-test.tar ${images_dir}/trajectory-operator-test.tar"

step "control plane and kubelet: build (cached)"
scripts/cluster/build.sh --real-node

step "Go tools: wait for the background build"
wait_for_go_tools

step "image registry: crane (cached)"
scripts/registry/build.sh

step "helm: build (cached)"
TRAJ_HELM="$(scripts/helm/build.sh --print-path)"
# tests/tests/chart.rs renders the chart with it.
export TRAJ_HELM

step "helm lint"
"${TRAJ_HELM}" lint --strict charts/trajectory-operator

step "helm template (default, and namespaced with two replicas)"
"${TRAJ_HELM}" template trajectory-operator charts/trajectory-operator \
  --namespace trajectory-system --include-crds >/dev/null
"${TRAJ_HELM}" template trajectory-operator charts/trajectory-operator \
  --namespace trajectory-system --set scope=Namespace,replicaCount=2 >/dev/null

step "MCP servers: install (cached)"
# worker/tests/mcp_tools.rs talks to them (npm's server-everything, PyPI's time and fetch servers).
TRAJ_MCP_DIR="$(scripts/mcp/install.sh --print-dir)"
export TRAJ_MCP_DIR
step "export formats' validators: install (cached)"
# worker/tests/token_ids.rs checks the ATIF, ADP, ShareGPT and OpenAI exports with Harbor's
# validator, ADP's models and Hugging Face datasets (scripts/formats/validate.py).
TRAJ_FORMATS_PYTHON="$(scripts/formats/install.sh --print-path)"
export TRAJ_FORMATS_PYTHON
step "gubernator: build (cached)"
# worker/tests/shared_limits.rs keeps two runs' rate limit in it.
TRAJ_GUBERNATOR="$(scripts/gubernator/build.sh --print-path)"
export TRAJ_GUBERNATOR
step "versitygw: build (cached)"
# worker/tests/object_storage.rs runs the worker on its buckets (a real S3 server).
TRAJ_VERSITYGW="$(scripts/versitygw/build.sh --print-path)"
export TRAJ_VERSITYGW
step "gitops health: build (cached)"
# tests/tests/gitops.rs judges runs with Flux's kstatus and Argo CD's health code (one Go program).
TRAJ_GITOPS_HEALTH="$(scripts/gitops-health/build.sh --print-path)"
export TRAJ_GITOPS_HEALTH

step "kueue: build (cached)"
# tests/tests/kueue.rs runs queued runs through it, beside the control plane.
TRAJ_KUEUE="$(scripts/kueue/build.sh --print-path)"
TRAJ_KUEUE_SRC="$(scripts/kueue/build.sh --print-src)"
export TRAJ_KUEUE TRAJ_KUEUE_SRC
step "karpenter: build (cached)"
# tests/tests/autoscaling.rs scales kwok nodes for runs with it (its kwok provider).
TRAJ_KARPENTER="$(scripts/karpenter/build.sh --print-path)"
TRAJ_KARPENTER_SRC="$(scripts/karpenter/build.sh --print-src)"
export TRAJ_KARPENTER TRAJ_KARPENTER_SRC

step "envoy: install (cached)"
# worker/tests/real_model_admission.rs sheds load with it in front of a real model server.
TRAJ_ENVOY="$(scripts/envoy/install.sh --print-path)"
export TRAJ_ENVOY
step "web tools: searx and python3-doc (apt-get, once)"
scripts/web/install.sh

step "llama.cpp: wait for the background build"
if ! wait "${llama_server}"; then
  cat "${llama_server_log}" >&2
  echo "the llama-server build failed (log above: ${llama_server_log})" >&2
  exit 1
fi
llama_server=""
cat "${llama_server_log}" >&2
TRAJ_LLAMA_SERVER="$(scripts/llama-server/install.sh --print-path)"
export TRAJ_LLAMA_SERVER

step "run the tests with a model server and a control plane with a real node"
MODEL_SERVER_HOST=0.0.0.0 scripts/model-server/with-model-server.sh \
  scripts/cluster/with-cluster.sh --real-node \
  cargo test --workspace --all-features -- "$@"
