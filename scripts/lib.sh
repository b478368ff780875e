# Shared settings of the repository's scripts. Source it; it changes nothing but variables.
# Caches live outside the clone, keyed by what they depend on, so fresh clones build warm.
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export TRAJ_CACHE_DIR="${TRAJ_CACHE_DIR:-${HOME}/.cache/trajectory-operator}"
# One cargo target directory per toolchain: artefacts of another rustc are useless anyway.
RUSTC_ID="$(rustc --version | tr -c 'a-zA-Z0-9.\n' '-')"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-${TRAJ_CACHE_DIR}/cargo-target/${RUSTC_ID}}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

# prune_old_test_binaries DIR: in a cargo deps directory, removes every executable named
# <target>-<hash> (no extension: test and bench binaries) but the newest of each target.
prune_old_test_binaries() {
	local dir="$1"
	[[ -d "${dir}" ]] || return 0
	find "${dir}" -maxdepth 1 -type f -executable ! -name '*.*' -printf '%T@ %f\n' |
		sort -rn |
		awk '{ name = $2; sub(/-[0-9a-f]+$/, "", name); if (seen[name]++) print $2 }' |
		while IFS= read -r old; do
			rm -f "${dir}/${old}" "${dir}/${old}.d"
		done
}

# prune_incremental DIR LIMIT_GB: removes cargo's incremental caches under DIR/incremental when they
# hold more than LIMIT_GB. They grow with every build of every test target and are never collected:
# on one machine over many sessions they reached 21 GB and filled the disk mid-build. Without them
# the next build recompiles the workspace's own crates once (the dependencies stay built).
prune_incremental() {
	local dir="$1/incremental" limit_gb="$2" used_kb
	[[ -d "${dir}" ]] || return 0
	used_kb="$(du -sk "${dir}" | cut -f1)"
	if ((used_kb > limit_gb * 1024 * 1024)); then
		echo "removing ${dir}: $((used_kb / 1024 / 1024)) GB, over ${limit_gb} GB" >&2
		rm -rf "${dir}"
	fi
}


# make_room_for_test_build TARGET_DIR MIN_FREE_GB: when the disk under TARGET_DIR has less than
# MIN_FREE_GB free, removes every test and bench executable in its debug/deps and the incremental
# caches before a build. A checkout at another path builds all its test binaries anew (the crate
# hashes include the path), so the previous checkout's are dead weight: two checkouts' worth
# (~25 GB each at full debug info) filled a 92 GB disk mid-link once ("Bus error" in ld, then
# "No space left on device"). The next build relinks what it needs; dependencies stay built.
make_room_for_test_build() {
	local dir="$1" min_gb="$2" free_kb
	mkdir -p "${dir}"
	free_kb="$(df -Pk "${dir}" | awk 'NR == 2 { print $4 }')"
	if ((free_kb < min_gb * 1024 * 1024)); then
		echo "only $((free_kb / 1024 / 1024)) GB free under ${dir} (want ${min_gb}):" \
			"removing the test binaries and incremental caches of earlier builds" >&2
		[[ ! -d "${dir}/debug/deps" ]] ||
			find "${dir}/debug/deps" -maxdepth 1 -type f -executable ! -name '*.*' -delete
		rm -rf "${dir}/debug/incremental"
	fi
}

# python_312_or_later [CANDIDATE]: prints the first Python 3.12 or later among CANDIDATE (a
# variable's override), python3.12, python3.13 on PATH and pyenv's versions; fails when none is
# found. Harbor needs 3.12 (scripts/formats, scripts/harbor).
python_312_or_later() {
	local candidate pyenv_root
	pyenv_root="$(pyenv root 2>/dev/null || printf '%s' "${HOME}/.pyenv")"
	for candidate in ${1:-} python3.12 python3.13 \
		"${pyenv_root}"/versions/3.12*/bin/python3 "${pyenv_root}"/versions/3.13*/bin/python3; do
		if "${candidate}" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
			printf '%s\n' "${candidate}"
			return 0
		fi
	done
	return 1
}

# stop_pids SIGNAL_WAIT_S PID...: SIGTERM, wait up to SIGNAL_WAIT_S for exit, then SIGKILL.
stop_pids() {
	local wait_s="$1" pid
	shift
	[[ $# -gt 0 ]] || return 0
	kill -TERM "$@" 2>/dev/null || true
	local deadline=$((SECONDS + wait_s)) left
	while :; do
		left=()
		for pid in "$@"; do
			! kill -0 "${pid}" 2>/dev/null || left+=("${pid}")
		done
		[[ ${#left[@]} -gt 0 ]] || return 0
		((SECONDS < deadline)) || break
		sleep 0.2
	done
	kill -KILL "${left[@]}" 2>/dev/null || true
	sleep 0.2
}
