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

