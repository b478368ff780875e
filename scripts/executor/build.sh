#!/usr/bin/env bash
# Builds trajectory-executor, the tool executor, static against musl (release; cached) and
# prints its path. This is the executor of the pods (scripts/images/build.sh puts it in the
# worker image) and of scripts/quickstart.sh's local runs:
# - it runs in the sandbox container or a task's own image, whatever libc that has (glibc,
#   musl, none): a static musl binary needs none;
# - every conversation's shell pays its start, and musl's start does no work of glibc's: no
#   dynamic loading and relocation, no CPU-feature and cache probing (`cpuid`, which traps to the
#   hypervisor in a VM). Measured here: 0.15 ms of CPU to start and exit against 0.8 for the
#   dynamic glibc build and 0.5 for the static glibc one (docs/benchmarks.md, issue 22).
# The musl target comes from rustup (`rustup target add`, once); Rust ships musl's C library
# for it, so nothing else is installed. Its own target directory: the target differs from the
# workspace's, and it is a few crates, so always optimised.
#
# Usage: scripts/executor/build.sh
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
cd "${REPO_ROOT}"

triple="$(uname -m)-unknown-linux-musl"
target_dir="${TRAJ_EXECUTOR_CARGO_TARGET_DIR:-${TRAJ_CACHE_DIR}/cargo-target-executor}/${RUSTC_ID}"

if ! rustup target list --installed | grep -qx "${triple}"; then
  echo "==> rustup target add ${triple} (once)" >&2
  rustup target add "${triple}" >&2
fi
# SOURCE_DATE_EPOCH unset: build scripts that track it would rebuild for every commit.
env -u SOURCE_DATE_EPOCH CARGO_TARGET_DIR="${target_dir}" \
  cargo build --release --locked --quiet -p trajectory-sandbox --bin trajectory-executor \
  --target "${triple}" >&2
binary="${target_dir}/${triple}/release/trajectory-executor"
if readelf -l "${binary}" | grep -q 'program interpreter'; then
  echo "${binary} is not statically linked" >&2
  exit 1
fi
echo "${binary}"
