#!/usr/bin/env bash
# Prints the path of a root-filesystem tarball that stands in for docker.io/library/debian:bookworm-slim,
# for `podman import` where no container registry is reachable (tests/test_image.py).
# Built with debootstrap (minbase) from this machine's Debian mirror and slimmed the way the official
# image is (debuerreotype's slimify lists); it also carries this machine's apt Acquire:: settings and
# trusted CAs, so apt and pip inside a build work behind the same (TLS-inspecting) proxy.
# Cached in CACHE_DIR: rebuilt once per ISO week, or when the mirror or this script changes.
# ARCH is a Debian architecture (default: this machine's). A foreign one (arm64 on amd64) runs its
# second stage under qemu-user-static, through the kernel's binfmt_misc entry for that CPU.
# Usage: scripts/debian-base-image.sh CACHE_DIR [ARCH]
#   (root; bash scripts/apt-install.sh debootstrap, and qemu-user-static binfmt-support for a foreign ARCH)
set -euo pipefail

cache=${1:?usage: debian-base-image.sh CACHE_DIR [ARCH]}
arch=${2:-$(dpkg --print-architecture)}
suite=bookworm
if [ "$(id -u)" -ne 0 ]; then
  echo "debian-base-image: run as root (debootstrap needs it)" >&2
  exit 1
fi
if ! command -v debootstrap >/dev/null; then
  echo "debian-base-image: no debootstrap: bash scripts/apt-install.sh debootstrap" >&2
  exit 1
fi

# The mirror apt uses here: the first URIs: of debian.sources, else the first deb line of sources.list.
mirror=${DEBIAN_MIRROR:-}
if [ -z "$mirror" ] && [ -f /etc/apt/sources.list.d/debian.sources ]; then
  mirror=$(awk '$1 == "URIs:" { print $2; exit }' /etc/apt/sources.list.d/debian.sources)
fi
if [ -z "$mirror" ] && [ -f /etc/apt/sources.list ]; then
  mirror=$(awk '$1 == "deb" { print ($2 ~ /^\[/ ? $3 : $2); exit }' /etc/apt/sources.list)
fi
[ -n "$mirror" ] || { echo "debian-base-image: no Debian mirror in /etc/apt; set DEBIAN_MIRROR=URL" >&2; exit 1; }

key=$( { echo "$mirror"; cat "$0"; } | sha256sum | cut -c1-12)
tarball="$cache/debian-$suite-slim-$arch-$(date +%G-W%V)-$key.tar"
if [ -s "$tarball" ]; then
  echo "$tarball"
  exit 0
fi

if [ "$arch" != "$(dpkg --print-architecture)" ]; then
  # The kernel's name for the CPU, as qemu-user-static names its binfmt_misc entries.
  case $arch in
    arm64) cpu=aarch64 ;; armhf | armel) cpu=arm ;; amd64) cpu=x86_64 ;; i386) cpu=i386 ;;
    ppc64el) cpu=ppc64le ;; *) cpu=$arch ;;
  esac
  if ! grep -qx enabled "/proc/sys/fs/binfmt_misc/qemu-$cpu" 2>/dev/null; then
    echo "debian-base-image: $arch binaries cannot run here (no enabled /proc/sys/fs/binfmt_misc/qemu-$cpu):" \
      "bash scripts/apt-install.sh qemu-user-static binfmt-support, then update-binfmts --enable qemu-$cpu" \
      "(mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc first where it is not mounted)" >&2
    exit 1
  fi
fi

mkdir -p "$cache"
work=$(mktemp -d "$cache/rootfs.XXXXXX")
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"
if ! debootstrap --variant=minbase --arch="$arch" "$suite" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1; then
  tail -n 20 "$work/debootstrap.log" >&2
  echo "debian-base-image: debootstrap $suite ($arch) from $mirror failed (log above); DEBIAN_MIRROR=URL picks another" >&2
  exit 1
fi

# Slim like the official image: dpkg leaves out documentation and translations from now on, and they go now.
cat >"$rootfs/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/man/*
EOF
# and configure dpkg and apt for image builds as the official image does (debuerreotype's minimizing config):
# no services started, no sync per package, no apt caches or translations left in a layer.
printf '#!/bin/sh\nexit 101\n' >"$rootfs/usr/sbin/policy-rc.d"
chmod 0755 "$rootfs/usr/sbin/policy-rc.d"
echo force-unsafe-io >"$rootfs/etc/dpkg/dpkg.cfg.d/docker-apt-speedup"
clean='"rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true";'
cat >"$rootfs/etc/apt/apt.conf.d/docker-clean" <<EOF
DPkg::Post-Invoke { $clean };
APT::Update::Post-Invoke { $clean };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
echo 'Apt::AutoRemove::SuggestsImportant "false";' >"$rootfs/etc/apt/apt.conf.d/docker-autoremove-suggests"
echo 'Acquire::GzipIndexes "true";' >"$rootfs/etc/apt/apt.conf.d/docker-gzip-indexes"
echo 'Acquire::Languages "none";' >"$rootfs/etc/apt/apt.conf.d/docker-no-languages"
find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} +
rm -rf "$rootfs"/usr/share/{groff,info,linda,man}/* "$rootfs"/usr/share/lintian/overrides/*

# apt: this machine's sources (security and updates too) and Acquire:: settings (proxies, mirror quirks).
if [ -f /etc/apt/sources.list.d/debian.sources ]; then
  cp /etc/apt/sources.list.d/debian.sources "$rootfs/etc/apt/sources.list.d/"
  rm -f "$rootfs/etc/apt/sources.list"
fi
for conf in /etc/apt/apt.conf.d/*; do
  if grep -q '^[[:space:]]*Acquire' "$conf"; then cp "$conf" "$rootfs/etc/apt/apt.conf.d/"; fi
done
# Trust: the machine's extra CAs and its CA bundle (which holds them); pip reads the bundle through /etc/pip.conf.
mkdir -p "$rootfs/usr/local/share/ca-certificates" "$rootfs/etc/ssl/certs"
cp -r /usr/local/share/ca-certificates/. "$rootfs/usr/local/share/ca-certificates/"
cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$rootfs/etc/pip.conf"
# Like the official image: no package lists or downloaded packages.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb

rm -f "$cache"/debian-"$suite"-slim-"$arch"-*.tar
tar --numeric-owner -C "$rootfs" -cf "$tarball.$$.tmp" .
mv "$tarball.$$.tmp" "$tarball"
echo "$tarball"
