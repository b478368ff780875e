#!/bin/sh
# mmdebstrap customize hook of the worker image's Debian root filesystem; $1 is that filesystem.
# Adds the unprivileged user the image runs as and drops what only the build left behind.
set -eu
root="$1"

# uid/gid 65532 ("nonroot", as in distroless images): the pods run with runAsNonRoot, which the
# kubelet can only verify for a numeric user that is not 0.
echo 'nonroot:x:65532:65532:nonroot:/nonexistent:/usr/sbin/nologin' >>"$root/etc/passwd"
echo 'nonroot:x:65532:' >>"$root/etc/group"
echo 'nonroot:!*:19000::::::' >>"$root/etc/shadow"

# Logs and backup files of the installation: not part of the userland, and they change with
# every build.
rm -rf "$root"/var/log/apt "$root"/var/log/*.log "$root"/var/cache/debconf/*-old \
  "$root"/var/lib/dpkg/*-old "$root"/var/cache/ldconfig/aux-cache
