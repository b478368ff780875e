#!/usr/bin/env bash
# Installs (once; warm it checks and returns in about a second) what running Harbor (the agent-evaluation
# harness, `harbor` on PyPI) with its local `docker` environment needs on this Debian 12 machine, for the
# benchmark that runs Harbor beside this project on the same tasks (scripts/harbor/with-docker.sh starts
# the daemon; docs/research/harbor-anchor.md in the shared docs measured it):
#   - Debian's docker.io (dockerd 20.10, its CLI, tini as docker-init) with apt-get (root only). No
#     systemd here: with-docker.sh starts dockerd by hand and stops it again.
#   - the Docker Compose v2 CLI plugin, DOCKER_COMPOSE_VERSION below, built from source through the Go
#     module proxy by scripts/go-tool.sh (Debian 12 has no Compose v2; its docker-compose 1.29 lacks the
#     `up --wait`, `cp` and `--project-directory` Harbor calls `docker compose` with):
#       ${TRAJ_CACHE_DIR}/docker-compose/v<version>/bin/cmd
#     made visible to `docker` as a CLI plugin through a Docker config directory of our own, so that
#     ~/.docker is left alone (every Docker CLI looks in $DOCKER_CONFIG/cli-plugins):
#       ${TRAJ_CACHE_DIR}/harbor/docker-config/cli-plugins/docker-compose -> that binary
#     Commands that call `docker compose` need DOCKER_CONFIG set to it (with-docker.sh exports it).
#   - Harbor with its whole dependency closure, hash-pinned in requirements.txt (scripts/harbor/lock.sh
#     regenerates it), in a venv of its own made by scripts/pip-tool.sh:
#       ${TRAJ_CACHE_DIR}/harbor/<key>/venv/   (<key>: the requirements file and Python's version)
#     Harbor needs Python 3.12 or later: the first of python3.12, python3.13 on PATH or in pyenv's
#     versions is used (HARBOR_PYTHON names another; the lock has wheels for 3.12 and 3.13 only).
# Then it checks that `docker compose version` answers with the plugin under every `docker` CLI on PATH
# (Debian's 20.10 in /usr/bin, and any other, e.g. a static docker 28 in /usr/local/bin, that shadows it).
#
# Usage: scripts/harbor/install.sh [--print-path | --print-docker-config]
#   --print-path           print the venv's `harbor` executable on stdout
#   --print-docker-config  print the DOCKER_CONFIG directory holding the compose plugin on stdout
# Environment: TRAJ_CACHE_DIR (default ~/.cache/trajectory-operator), HARBOR_PYTHON.
# Logs: apt-get's in ${TRAJ_CACHE_DIR}/build-logs/, the compose build's there when it fails, pip's in
# the venv's directory (install.log).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

DOCKER_COMPOSE_VERSION=2.29.7
DOCKER_COMPOSE_PACKAGE=github.com/docker/compose/v2/cmd

print=""
for arg in "$@"; do
	case "${arg}" in
	--print-path | --print-docker-config) print="${arg}" ;;
	-h | --help)
		sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
		exit 0
		;;
	*)
		echo "install.sh: unknown argument '${arg}' (see --help)" >&2
		exit 2
		;;
	esac
done

log() { printf '[harbor %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}
# shellcheck source=scripts/apt.sh
source "${HERE}/../apt.sh"

export TRAJ_CACHE_DIR="${TRAJ_CACHE_DIR:-${HOME}/.cache/trajectory-operator}"
DOCKER_CONFIG_DIR="${TRAJ_CACHE_DIR}/harbor/docker-config"
# Harbor posts PostHog events at the end of each CLI command unless this is set (pip-tool.sh runs
# `harbor --version` to check the install).
export HARBOR_TELEMETRY=0

# --- Debian's Docker -----------------------------------------------------------------------------------
mapfile -t missing < <(apt_missing docker.io)
if ((${#missing[@]})); then
	apt_install harbor-docker docker.io
	# Without systemd the package's init script may have started a daemon: with-docker.sh starts its own.
	if pid="$(pgrep -x dockerd)"; then
		log "dockerd ${pid} was started by the package's init script: stopping it"
		/etc/init.d/docker stop >/dev/null 2>&1 || kill ${pid} 2>/dev/null || true
	fi
fi
for tool in dockerd docker-init runc containerd; do
	command -v "${tool}" >/dev/null || die "${tool} is missing after installing docker.io"
done
[[ -x /usr/bin/docker ]] || die "/usr/bin/docker (Debian's docker CLI) is missing"

# --- Compose v2, as a CLI plugin in our own Docker config directory ------------------------------------
compose="$("${HERE}/../go-tool.sh" --print-path docker-compose "${DOCKER_COMPOSE_VERSION}" \
	"${DOCKER_COMPOSE_PACKAGE}" "-X github.com/docker/compose/v2/internal.Version=v${DOCKER_COMPOSE_VERSION}")"
mkdir -p "${DOCKER_CONFIG_DIR}/cli-plugins"
if [[ "$(readlink "${DOCKER_CONFIG_DIR}/cli-plugins/docker-compose" 2>/dev/null)" != "${compose}" ]]; then
	ln -sfn "${compose}" "${DOCKER_CONFIG_DIR}/cli-plugins/docker-compose"
fi
# Every docker CLI on PATH (the first is the one Harbor runs), and Debian's in any case.
mapfile -t clis < <({
	type -ap docker
	echo /usr/bin/docker
} | awk '!seen[$0]++')
for cli in "${clis[@]}"; do
	out="$(DOCKER_CONFIG="${DOCKER_CONFIG_DIR}" "${cli}" compose version 2>&1)" ||
		die "'${cli} compose version' failed with DOCKER_CONFIG=${DOCKER_CONFIG_DIR}: ${out}"
	[[ "${out}" == *"v${DOCKER_COMPOSE_VERSION}"* ]] ||
		die "'${cli} compose version' says '${out}', not v${DOCKER_COMPOSE_VERSION}"
done

# --- Harbor --------------------------------------------------------------------------------------------
# shellcheck source=scripts/lib.sh
source "${HERE}/../lib.sh"
python="$(python_312_or_later "${HARBOR_PYTHON:-}")" || python=""
[[ -n "${python}" ]] || die "no Python 3.12 or later found (Harbor needs it): install one, or name it in HARBOR_PYTHON"
# --no-deps: the file pins the whole closure, and pip's hash-checking mode refuses a dependency asked for
# with extras (litellm's httpx[http2]) even when it is pinned.
harbor="$(PIP_TOOL_PYTHON="${python}" PIP_TOOL_NO_DEPS=1 "${HERE}/../pip-tool.sh" harbor "${HERE}/requirements.txt" \
	venv/bin/harbor --print-path)"

case "${print}" in
--print-path) printf '%s\n' "${harbor}" ;;
--print-docker-config) printf '%s\n' "${DOCKER_CONFIG_DIR}" ;;
esac
