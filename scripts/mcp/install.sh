#!/usr/bin/env bash
# Installs (or reuses) the real MCP servers the tests talk to, from their registries:
#   ${TRAJ_CACHE_DIR:-~/.cache/trajectory-operator}/mcp/<key>/
#     node/   npm's @modelcontextprotocol/server-everything (stdio and streamable HTTP)
#     venv/   PyPI's mcp-server-time and mcp-server-fetch
# <key> hashes the pinned versions below, node's and python's versions.
#
# Usage: install.sh [--print-dir] [--force]
#   --print-dir  print the install directory on stdout (also when it was already installed)
#   --force      reinstall even if a complete install exists
# Warm: prints nothing (except --print-dir's path) and takes well under a second.
# Environment: TRAJ_CACHE_DIR, MCP_PYTHON (default python3).
set -euo pipefail

EVERYTHING_VERSION="2026.8.31"
TIME_VERSION="2026.10.19"
FETCH_VERSION="2026.10.24"

print_dir=0
force=0
for arg in "$@"; do
	case "${arg}" in
	--print-dir) print_dir=1 ;;
	--force) force=1 ;;
	-h | --help)
		awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
		exit 0
		;;
	*)
		echo "install.sh: unknown argument '${arg}' (see --help)" >&2
		exit 2
		;;
	esac
done

log() { printf '[mcp] %s\n' "$*" >&2; }
die() {
	log "$*"
	exit 1
}

CACHE="${TRAJ_CACHE_DIR:-${HOME}/.cache/trajectory-operator}/mcp"
PYTHON="${MCP_PYTHON:-python3}"
command -v node >/dev/null 2>&1 || die "node is missing (Debian: apt-get install nodejs npm)"
command -v npm >/dev/null 2>&1 || die "npm is missing (Debian: apt-get install npm)"
command -v "${PYTHON}" >/dev/null 2>&1 || die "${PYTHON} is missing"
KEY="$(printf '%s\n' "${EVERYTHING_VERSION}" "${TIME_VERSION}" "${FETCH_VERSION}" \
	"$(node --version)" "$("${PYTHON}" --version 2>&1)" | sha256sum | cut -c1-16)"
DIR="${CACHE}/${KEY}"

done_() {
	if ((print_dir)); then printf '%s\n' "${DIR}"; fi
	exit 0
}

if ((!force)) && [[ -f "${DIR}/.complete" ]]; then done_; fi

mkdir -p "${CACHE}"
# One installer per key at a time; a second one waits, then finds the install complete.
exec 9>"${CACHE}/.${KEY}.lock"
flock 9
if ((!force)) && [[ -f "${DIR}/.complete" ]]; then done_; fi

rm -rf "${CACHE}/.${KEY}.building."*
TMP="$(mktemp -d "${CACHE}/.${KEY}.building.XXXXXX")"
trap 'rm -rf "${TMP}"' EXIT
LOG="${TMP}/install.log"

step() {
	local name="$1"
	shift
	log "install: ${name}"
	if ! "$@" >>"${LOG}" 2>&1 </dev/null; then
		log "install step '${name}' failed: $*"
		tail -n 40 "${LOG}" >&2
		exit 1
	fi
}

step "npm @modelcontextprotocol/server-everything@${EVERYTHING_VERSION}" \
	npm install --prefix "${TMP}/node" --no-audit --no-fund --omit=dev \
	"@modelcontextprotocol/server-everything@${EVERYTHING_VERSION}"
step "python venv" "${PYTHON}" -m venv "${TMP}/venv"
step "pip mcp-server-time==${TIME_VERSION} mcp-server-fetch==${FETCH_VERSION}" \
	"${TMP}/venv/bin/python" -m pip --disable-pip-version-check --no-input install \
	"mcp-server-time==${TIME_VERSION}" "mcp-server-fetch==${FETCH_VERSION}"

# Publish under the final name, then fix the paths the venv's scripts name, then check from there.
rm -rf "${DIR}"
mv "${TMP}" "${DIR}"
TMP="${DIR}.failed"
while IFS= read -r f; do
	sed -i "s|${CACHE}/\.${KEY}\.building\.[A-Za-z0-9]*|${DIR}|g" "${f}"
done < <(grep -rlI -- "${CACHE}/.${KEY}.building." "${DIR}/venv/bin" || true)
[[ -f "${DIR}/node/node_modules/@modelcontextprotocol/server-everything/dist/index.js" ]] ||
	{ rm -rf "${DIR}"; die "server-everything's dist/index.js is missing"; }
for module in mcp_server_time mcp_server_fetch; do
	"${DIR}/venv/bin/python" -c "import ${module}" >>"${DIR}/install.log" 2>&1 ||
		{ rm -rf "${DIR}"; die "python cannot import ${module} from ${DIR}/venv"; }
done
TMP=""
touch "${DIR}/.complete"
log "installed: ${DIR}"
done_
