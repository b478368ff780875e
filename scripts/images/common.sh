# shellcheck shell=bash disable=SC2034  # the variables are for the scripts that source this file
# Shared settings of scripts/images/*.sh. Source it after scripts/lib.sh; it changes nothing but
# variables and functions.

step() { printf '\n==> %s (%(%H:%M:%S)T)\n' "$1" -1 >&2; }
die() {
  echo "error: $*" >&2
  exit 1
}

# Image identity: the Helm chart's defaults are REGISTRY/trajectory-{operator,worker}:VERSION.
VERSION="$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' "${REPO_ROOT}/Cargo.toml")"
[[ -n ${VERSION} ]] || die "no version in [workspace.package] of Cargo.toml"
REGISTRY="${TRAJ_IMAGE_REGISTRY:-ghcr.io/trajectory-operator}"
# The tag of the images (build.sh --test: `test`).
TAG="${VERSION}"
OUT="${TRAJ_IMAGES_OUT:-${REPO_ROOT}/out/images}"
# The user both images run as (distroless' "nonroot"): numeric, so the kubelet can check
# runAsNonRoot.
NONROOT_UID=65532

# Installs the Debian packages $@ when one of the commands they provide is missing; the caller
# names command:package pairs.
need_commands() {
  local missing=() pair
  for pair in "$@"; do
    command -v "${pair%%:*}" >/dev/null || missing+=("${pair#*:}")
  done
  [[ ${#missing[@]} -eq 0 ]] && return
  [[ $(id -u) -eq 0 ]] || die "missing Debian packages: ${missing[*]}; install them: sudo apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# Sorts the arguments $2... of script $1 into `images` (operator, worker; none named: both) and
# `options` (the rest); prints the script's header comment for --help.
select_images() {
  local script="$1" arg
  shift
  images=()
  options=()
  for arg in "$@"; do
    case "${arg}" in
      operator | worker) images+=("${arg}") ;;
      -h | --help)
        sed -n '2,/^set -euo/p' "${script}" | sed '$d; s/^# \{0,1\}//'
        exit 0
        ;;
      *) options+=("${arg}") ;;
    esac
  done
  [[ ${#images[@]} -gt 0 ]] || images=(operator worker)
}
