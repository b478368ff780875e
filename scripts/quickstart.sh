#!/usr/bin/env bash
# The main job on its built-in default: builds the worker, starts a real local model server
# (llama.cpp serving SmolLM2-135M, installed into a cached virtualenv on first use), runs
# examples/quickstart/run.yaml with `trajectory-worker local`, and prints where the
# trajectories are. Run it again after an interruption: it resumes where it stopped.
#
# Usage: scripts/quickstart.sh [RUN_FILE]
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "${REPO_ROOT}"

run_file="${1:-examples/quickstart/run.yaml}"
echo "==> building trajectory-worker and its tool executor, trajectory-executor (release)" >&2
cargo build --release --quiet -p trajectory-worker
worker="${CARGO_TARGET_DIR}/release/trajectory-worker"
# The executor static against musl, as in the pods: each conversation's shell starts cheaper.
TRAJ_EXECUTOR="$(scripts/executor/build.sh)"
export TRAJ_EXECUTOR

echo "==> starting the local model server (first run installs it: about 5 minutes)" >&2
# shellcheck disable=SC2016 # expanded by the inner shell, after with-model-server.sh exported it
scripts/model-server/with-model-server.sh bash -c '
  exec "$0" local "$1" --base-url "${MODEL_BASE_URL}"
' "${worker}" "${run_file}"
