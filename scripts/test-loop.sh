#!/usr/bin/env bash
# Runs one package's tests N times in a row, as `cargo test` runs them by default (its own
# parallelism), with the model server up and the tool backends installed as scripts/test.sh has
# them: the check that a test suite is reliable on this machine, not only green once. Stops at the
# first red run. Each run's output goes to OUT_DIR/run-<i>.log; OUT_DIR/summary gets one line a run
# (its number, the commit, the exit code, the seconds, the test result lines' sums).
#
# Usage: scripts/test-loop.sh [-n RUNS] [-p PACKAGE] [-o OUT_DIR] [-- extra cargo test args]
#   defaults: 10 runs, trajectory-worker, ${TMPDIR:-/tmp}/trajectory-test-loop
#   e.g. scripts/test-loop.sh -n 10 -p trajectory-worker
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "${REPO_ROOT}"

runs=10
package=trajectory-worker
out_dir="${TMPDIR:-/tmp}/trajectory-test-loop"
while (($# > 0)); do
	case "$1" in
	-n) runs="$2" && shift 2 ;;
	-p) package="$2" && shift 2 ;;
	-o) out_dir="$2" && shift 2 ;;
	--) shift && break ;;
	-h | --help)
		awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
		exit 0
		;;
	*)
		echo "test-loop.sh: unknown argument '$1' (see --help)" >&2
		exit 2
		;;
	esac
done

scripts/model-server/install.sh
scripts/browser/install.sh
scripts/web/install.sh
TRAJ_MCP_DIR="$(scripts/mcp/install.sh --print-dir)"
export TRAJ_MCP_DIR
# Built before the first run, so that every run times the tests alone.
cargo test -p "${package}" --all-features --no-run --quiet

mkdir -p "${out_dir}"
# A fresh record each time: "in a row" counts this invocation's runs only.
: >"${out_dir}/summary"
commit="$(git rev-parse --short HEAD)"
for ((i = 1; i <= runs; i++)); do
	log="${out_dir}/run-${i}.log"
	start=${SECONDS}
	status=0
	scripts/model-server/with-model-server.sh \
		cargo test -p "${package}" --all-features -- "$@" >"${log}" 2>&1 || status=$?
	# Sums of cargo's "test result: ok. N passed; M failed; ..." lines over the package's binaries.
	totals="$(awk '/^test result:/ { p += $4; f += $6 } END { printf "%d passed, %d failed", p, f }' "${log}")"
	line="run ${i} commit ${commit} exit ${status} $((SECONDS - start)) s ${totals}"
	echo "${line}" | tee -a "${out_dir}/summary"
	if ((status != 0)); then
		echo "test-loop.sh: run ${i} of ${runs} failed; its output: ${log}" >&2
		exit "${status}"
	fi
done
echo "test-loop.sh: ${runs} runs of ${package}'s tests green in a row (${out_dir}/summary)"
