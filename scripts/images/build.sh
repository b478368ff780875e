#!/usr/bin/env bash
# Builds the container images of the operator and the worker without a Docker daemon and without
# pulling a base image: our own release binaries, a Debian root filesystem made by mmdebstrap from
# Debian's packages (the worker's userland, and the few shared libraries the operator links), and
# umoci to assemble OCI image layouts. Both images run as uid/gid 65532.
#
# Usage: scripts/images/build.sh [operator] [worker] [--refresh-rootfs] [--no-verify] [--debug|--test]
#        scripts/images/build.sh --rootfs-only [--refresh-rootfs]
#   (no image named: both)
#   --refresh-rootfs  rebuild the cached Debian root filesystem (e.g. for security updates)
#   --no-verify       skip scripts/images/verify.sh at the end
#   --rootfs-only     make (or find) the cached Debian root filesystem only, and print its path on
#                     stdout; no cargo build, no image (scripts/harbor/with-docker.sh imports it)
#   --debug           use debug binaries from the workspace's usual target directory (a quick check
#                     of the image pipeline, as in scripts/test.sh; not for publishing)
#   --test            the test variant the real-pod tests import into the local cluster's node:
#                     the debug binaries the test build (`cargo test --workspace --all-features`)
#                     compiles, tagged trajectory.local/IMAGE:test, in out/images/test/; no verify
#
# Output in out/images/ (gitignored), for IMAGE in trajectory-operator, trajectory-worker:
#   IMAGE/              OCI image layout, tag VERSION (push: skopeo copy oci:out/images/IMAGE:VERSION docker://...)
#   IMAGE-VERSION.tar   docker-archive tagged REGISTRY/IMAGE:VERSION (docker/podman load, ctr import, kind load)
# VERSION is the workspace version in Cargo.toml; REGISTRY is ghcr.io/trajectory-operator unless
# TRAJ_IMAGE_REGISTRY says otherwise: the Helm chart's default image references.
#
# Caches (outside the clone): release builds in ~/.cache/trajectory-operator/cargo-target-images,
# the static (musl) trajectory-executor in .../cargo-target-executor (scripts/executor/build.sh),
# the Debian root filesystem keyed by images/worker/* and the .deb files in .../images/.
# Runs as root (mmdebstrap's root mode; verify.sh runs the images with runc); mmdebstrap can
# also work unprivileged in its unshare mode. Installs umoci, skopeo, mmdebstrap and binutils with
# apt-get when missing.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
# shellcheck source=scripts/images/common.sh
source "${REPO_ROOT}/scripts/images/common.sh"
cd "${REPO_ROOT}"
umask 022

select_images "$0" "$@"
refresh_rootfs=false
verify=true
rootfs_only=false
profile=release
for option in "${options[@]}"; do
  case "${option}" in
    --refresh-rootfs) refresh_rootfs=true ;;
    --no-verify) verify=false ;;
    --rootfs-only) rootfs_only=true ;;
    --debug) profile=debug ;;
    --test)
      profile="test"
      verify=false
      ;;
    *) die "unknown argument ${option} (see --help)" ;;
  esac
done

IMAGES_CACHE="${TRAJ_CACHE_DIR}/images"
if [[ ${profile} == release ]]; then
  BUILD_TARGET_DIR="${TRAJ_IMAGES_CARGO_TARGET_DIR:-${TRAJ_CACHE_DIR}/cargo-target-images}"
  cargo_profile=(--release)
else
  BUILD_TARGET_DIR="${CARGO_TARGET_DIR}"
  cargo_profile=()
fi
if [[ ${profile} == test ]]; then
  # Never a release's name: a registry nothing resolves, and the tag `test`.
  REGISTRY=trajectory.local
  TAG="test"
  OUT="${OUT}/test"
fi
# Reproducible timestamps: the commit's time, for the layers and for mmdebstrap. Not exported:
# cc-based build scripts (aws-lc-sys) track SOURCE_DATE_EPOCH, so cargo would rebuild them, and
# everything above them, for every commit.
if [[ -z ${SOURCE_DATE_EPOCH:-} ]]; then
  SOURCE_DATE_EPOCH="$(git log -1 --format=%ct 2>/dev/null || date +%s)"
fi
CREATED="$(date -u -d "@${SOURCE_DATE_EPOCH}" +%Y-%m-%dT%H:%M:%SZ)"
REVISION="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
case "$(uname -m)" in
  x86_64) ARCH=amd64 ;;
  aarch64) ARCH=arm64 ;;
  *) die "unsupported machine $(uname -m)" ;;
esac
TRIPLET="$(uname -m)-linux-gnu"

step "tools: umoci, skopeo, mmdebstrap, readelf"
need_commands umoci:umoci skopeo:skopeo mmdebstrap:mmdebstrap readelf:binutils

work="$(mktemp -d "${TMPDIR:-/tmp}/trajectory-images.XXXXXX")"
trap 'rm -rf "${work}"' EXIT

step "${profile} binaries (${BUILD_TARGET_DIR})"
if [[ ${rootfs_only} == true ]]; then
  echo "skipped (--rootfs-only)" >&2
elif [[ ${profile} == test ]]; then
  # The feature set and profile of the test build, so its compiled crates are reused: after
  # `cargo test --workspace --all-features --no-run` only the binaries are linked (the worker's
  # engine is in the operator binary then, which a test image does not mind).
  env -u SOURCE_DATE_EPOCH cargo build --workspace --all-features --bins --tests --locked --quiet
else
  # One cargo call per binary: built together, cargo would unify the worker crate's features and
  # link the worker's engine into the operator.
  for image in "${images[@]}"; do
    env -u SOURCE_DATE_EPOCH CARGO_TARGET_DIR="${BUILD_TARGET_DIR}" \
      cargo build "${cargo_profile[@]}" --locked --quiet \
      -p "trajectory-${image}" --bin "trajectory-${image}"
  done
fi
binary_path() { echo "${BUILD_TARGET_DIR}/${profile/test/debug}/trajectory-$1"; }

if [[ ${rootfs_only} != true && " ${images[*]} " == *" worker "* ]]; then
  step "static trajectory-executor (musl; scripts/executor/build.sh)"
  # The tool executor runs inside the run's task image, whatever libc that has.
  executor_binary="$(scripts/executor/build.sh)"
fi

step "Debian root filesystem (mmdebstrap, cached)"
# shellcheck source=images/worker/debian.env
source images/worker/debian.env
packages="$(sed 's/#.*//' images/worker/packages.txt | xargs | tr ' ' ',')"
mmdebstrap_args=(
  --variant=essential
  --include="${packages}"
  --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
  --skip=output/dev
  --dpkgopt='path-exclude=/usr/share/man/*'
  --dpkgopt='path-exclude=/usr/share/info/*'
  --dpkgopt='path-exclude=/usr/share/locale/*'
  --dpkgopt='path-include=/usr/share/locale/locale.alias'
  --dpkgopt='path-exclude=/usr/share/doc/*'
  --dpkgopt='path-include=/usr/share/doc/*/copyright'
)
rootfs_key="$(
  {
    printf '%s\n' "${DEBIAN_SUITE}" "${mmdebstrap_args[@]}" "$(mmdebstrap --version)"
    cat images/worker/customize.sh
  } | sha256sum | cut -c1-16
)"
rootfs="${IMAGES_CACHE}/rootfs-${DEBIAN_SUITE}-${ARCH}-${rootfs_key}.tar"
if [[ ${refresh_rootfs} == true ]]; then
  rm -f "${rootfs}"
fi
if [[ ! -f ${rootfs} ]]; then
  debs="${IMAGES_CACHE}/debs-${DEBIAN_SUITE}-${ARCH}"
  mkdir -p "${debs}"
  # The .deb files are kept between builds (apt fetches only newer versions); a mirror can be
  # given in TRAJ_DEBIAN_MIRROR (default: Debian's, with its updates and security suites).
  # shellcheck disable=SC2016  # "$1" is for mmdebstrap's hook shell: the chroot directory
  SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH}" mmdebstrap "${mmdebstrap_args[@]}" \
    --skip=essential/unlink \
    --setup-hook='mkdir -p "$1"/var/cache/apt/archives/' \
    --setup-hook="sync-in ${debs} /var/cache/apt/archives/" \
    --customize-hook="sync-out /var/cache/apt/archives ${debs}" \
    --customize-hook="${REPO_ROOT}/images/worker/customize.sh" \
    --format=tar "${DEBIAN_SUITE}" "${rootfs}.partial" ${TRAJ_DEBIAN_MIRROR:+"${TRAJ_DEBIAN_MIRROR}"} \
    >"${work}/mmdebstrap.log" 2>&1 || {
    tail -n 40 "${work}/mmdebstrap.log" >&2
    die "mmdebstrap failed (log above)"
  }
  mv "${rootfs}.partial" "${rootfs}"
fi
echo "${rootfs} ($(du -h "${rootfs}" | cut -f1))" >&2
if [[ ${rootfs_only} == true ]]; then
  echo "${rootfs}"
  exit 0
fi
mkdir -p "${work}/rootfs"
tar -xf "${rootfs}" -C "${work}/rootfs" --no-same-owner

# Installs binary $1 as $2 without its debug info (the release profile keeps line tables, which
# make the operator five times larger); symbols stay, so backtraces still name functions.
install_binary() {
  install -D -m 0755 "$1" "$2"
  strip --strip-debug "$2"
}

# Packs directory $1 as an uncompressed layer tarball $2, owned by root, with fixed timestamps.
pack_layer() {
  tar --create --file "$2" --directory "$1" --sort=name --numeric-owner --owner=0 --group=0 \
    --mtime="@${SOURCE_DATE_EPOCH}" --format=posix \
    --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime .
}

# Copies the file at absolute path $3 of root filesystem $1 into directory $2 under the same
# name, with every symlink met on the way (the dynamic loader is /lib64/ld-linux-x86-64.so.2,
# which on a merged-/usr system is two symlinks away from the file).
copy_from_root() {
  local root="$1" stage="$2" rest="${3#/}" resolved="" component target hops=0
  while [[ -n ${rest} ]]; do
    component="${rest%%/*}"
    if [[ ${rest} == */* ]]; then rest="${rest#*/}"; else rest=""; fi
    case "${component}" in
      "" | .) continue ;;
      ..)
        if [[ ${resolved} == */* ]]; then resolved="${resolved%/*}"; else resolved=""; fi
        continue
        ;;
    esac
    local candidate="${resolved:+${resolved}/}${component}"
    if [[ -L ${root}/${candidate} ]]; then
      hops=$((hops + 1))
      [[ ${hops} -lt 40 ]] || die "too many symlinks resolving $3 in ${root}"
      mkdir -p "${stage}/$(dirname "${candidate}")"
      [[ -L ${stage}/${candidate} ]] || cp -P "${root}/${candidate}" "${stage}/${candidate}"
      target="$(readlink "${root}/${candidate}")"
      if [[ ${target} == /* ]]; then
        resolved=""
        rest="${target#/}${rest:+/${rest}}"
      else
        rest="${target}${rest:+/${rest}}"
      fi
    else
      resolved="${candidate}"
    fi
  done
  [[ -f ${root}/${resolved} ]] || die "$3 is not a file in the Debian root filesystem"
  mkdir -p "${stage}/$(dirname "${resolved}")"
  cp "${root}/${resolved}" "${stage}/${resolved}"
}

# The Debian package that installed file NAME (a basename) in the root filesystem.
owning_package() {
  local list
  list="$(grep -l -E "/$1\$" "${work}/rootfs"/var/lib/dpkg/info/*.list | head -n 1)"
  [[ -n ${list} ]] || die "no Debian package in the root filesystem ships $1"
  basename "${list}" .list | cut -d: -f1
}

# Assembles the OCI layout of image $1 from layers given as TARBALL=WHAT_MADE_IT.
assemble() {
  local name="$1"
  shift
  # shellcheck source=images/operator/config.env
  source "images/${name#trajectory-}/config.env"
  local layout="${OUT}/${name}" ref="${REGISTRY}/${name}:${TAG}" layer
  rm -rf "${layout}" "${OUT}/${name}-${TAG}.tar"
  mkdir -p "${OUT}"
  umoci init --layout "${layout}"
  umoci new --image "${layout}:${TAG}"
  for layer in "$@"; do
    umoci raw add-layer --image "${layout}:${TAG}" --history.created "${CREATED}" \
      --history.created_by "${layer#*=}" "${layer%%=*}"
  done
  local config=(
    --created "${CREATED}" --author "trajectory-operator" --architecture "${ARCH}" --os linux
    --config.user "${NONROOT_UID}:${NONROOT_UID}" --config.workingdir "${WORKDIR}"
    --config.label "org.opencontainers.image.title=${name}"
    --config.label "org.opencontainers.image.description=${DESCRIPTION}"
    --config.label "org.opencontainers.image.version=${VERSION}"
    --config.label "org.opencontainers.image.revision=${REVISION}"
    --config.label "org.opencontainers.image.source=https://github.com/trajectory-operator/trajectory-operator"
    --config.label "org.opencontainers.image.licenses=Apache-2.0"
    --config.label "org.opencontainers.image.created=${CREATED}"
    --manifest.annotation "org.opencontainers.image.ref.name=${TAG}"
    --history.created "${CREATED}" --history.created_by "scripts/images/build.sh: image config"
  )
  local value
  for value in "${ENTRYPOINT[@]}"; do config+=(--config.entrypoint "${value}"); done
  for value in "${CMD[@]}"; do config+=(--config.cmd "${value}"); done
  for value in "${ENV[@]}"; do config+=(--config.env "${value}"); done
  for value in "${EXPOSED_PORTS[@]}"; do config+=(--config.exposedports "${value}"); done
  umoci config --image "${layout}:${TAG}" "${config[@]}"
  umoci gc --layout "${layout}"
  skopeo --insecure-policy copy --quiet "oci:${layout}:${TAG}" \
    "docker-archive:${OUT}/${name}-${TAG}.tar:${ref}"
  echo "${ref}  $(skopeo inspect --format '{{.Digest}}' "oci:${layout}:${TAG}")" >&2
}

for image in "${images[@]}"; do
  case "${image}" in
    operator)
      step "image trajectory-operator"
      stage="${work}/operator"
      bin="$(binary_path operator)"
      install_binary "${bin}" "${stage}/usr/local/bin/trajectory-operator"
      install -D -m 0644 images/operator/rootfs/etc/passwd "${stage}/etc/passwd"
      install -D -m 0644 images/operator/rootfs/etc/group "${stage}/etc/group"
      install -D -m 0644 "${work}/rootfs/etc/ssl/certs/ca-certificates.crt" \
        "${stage}/etc/ssl/certs/ca-certificates.crt"
      install -d -m 1777 "${stage}/tmp"
      # The dynamic loader and every library the binary links, from the Debian packages, with
      # their copyright files.
      interpreter="$(readelf -l "${bin}" | sed -n 's/.*Requesting program interpreter: \(.*\)]/\1/p')"
      copy_from_root "${work}/rootfs" "${stage}" "${interpreter}"
      doc_packages=(ca-certificates "$(owning_package "$(basename "${interpreter}")")")
      for library in $(readelf -d "${bin}" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
        copy_from_root "${work}/rootfs" "${stage}" "/usr/lib/${TRIPLET}/${library}"
        doc_packages+=("$(owning_package "${library}")")
      done
      for package in $(printf '%s\n' "${doc_packages[@]}" | sort -u); do
        install -D -m 0644 "${work}/rootfs/usr/share/doc/${package}/copyright" \
          "${stage}/usr/share/doc/${package}/copyright"
      done
      pack_layer "${stage}" "${work}/operator.tar"
      assemble trajectory-operator \
        "${work}/operator.tar=scripts/images/build.sh: trajectory-operator, its shared libraries, CA bundle, passwd"
      ;;
    worker)
      step "image trajectory-worker"
      stage="${work}/worker"
      install_binary "$(binary_path worker)" "${stage}/usr/local/bin/trajectory-worker"
      # Beside the worker (which finds it there for a pod without a sandbox container), and the
      # file the generation pods' init container copies into the sandbox container.
      install_binary "${executor_binary}" "${stage}/usr/local/bin/trajectory-executor"
      pack_layer "${stage}" "${work}/worker.tar"
      assemble trajectory-worker \
        "${rootfs}=mmdebstrap --variant=essential ${DEBIAN_SUITE} (+ ${packages}), images/worker/customize.sh" \
        "${work}/worker.tar=scripts/images/build.sh: trajectory-worker, trajectory-executor (static)"
      ;;
  esac
done

step "built"
for image in "${images[@]}"; do
  name="trajectory-${image}"
  echo "${OUT}/${name}  (OCI layout, $(du -sh "${OUT}/${name}" | cut -f1))" >&2
  echo "${OUT}/${name}-${TAG}.tar  (docker-archive, $(du -h "${OUT}/${name}-${TAG}.tar" | cut -f1))" >&2
done

if [[ ${verify} == true ]]; then
  "${REPO_ROOT}/scripts/images/verify.sh" "${images[@]}"
fi
