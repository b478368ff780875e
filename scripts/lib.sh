# Shared settings of the repository's scripts. Source it; it changes nothing but variables.
# Caches live outside the clone, keyed by what they depend on, so fresh clones build warm.
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export TRAJ_CACHE_DIR="${TRAJ_CACHE_DIR:-${HOME}/.cache/trajectory-operator}"
# One cargo target directory per toolchain: artefacts of another rustc are useless anyway.
RUSTC_ID="$(rustc --version | tr -c 'a-zA-Z0-9.\n' '-')"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-${TRAJ_CACHE_DIR}/cargo-target/${RUSTC_ID}}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
