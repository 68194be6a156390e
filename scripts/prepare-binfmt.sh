#!/usr/bin/env bash
# Lets this machine run aarch64 binaries for the arm64 image's tests: mounts binfmt_misc where it
# is not mounted and enables qemu-user-static's aarch64 entry (binfmt-support registers entries
# only when binfmt_misc is mounted as it installs). Root; idempotent; nothing to do on aarch64.
# Where it cannot, it says why and leaves the tests to fail with the same fix.
set -euo pipefail
[ "$(uname -m)" = aarch64 ] && exit 0
dir=/proc/sys/fs/binfmt_misc
entry="$dir/qemu-aarch64"
grep -qx enabled "$entry" 2>/dev/null && exit 0
if [ ! -e "$dir/register" ] && ! mount -t binfmt_misc binfmt_misc "$dir"; then
  echo "prepare-binfmt: cannot mount binfmt_misc at $dir (a container without it?):" \
    "aarch64 binaries will not run here" >&2
  exit 0
fi
[ -e "$entry" ] || update-binfmts --import qemu-aarch64
update-binfmts --enable qemu-aarch64
grep -qx enabled "$entry" || echo "prepare-binfmt: $entry is not enabled after update-binfmts" >&2
