#!/bin/sh
# Prepare a Debian host for the eBPF source: bcc, bpftool, kernel headers.
# Idempotent: installs only what is missing and links headers only when the
# running kernel has none (Debian's generic headers do: the programs read kernel
# structs only at offsets taken from the running kernel's BTF).
set -eu

if [ "$(id -u)" != 0 ]; then
    echo "prepare-bpf-host: run as root (it installs packages and links /lib/modules)" >&2
    exit 1
fi

release=$(uname -r)
arch=$(dpkg --print-architecture)
modules=/lib/modules/$release

missing=""
[ -f /usr/lib/python3/dist-packages/bcc/__init__.py ] || missing="$missing python3-bpfcc"
command -v bpftool >/dev/null 2>&1 || missing="$missing bpftool"
if [ ! -f "$modules/build/include/generated/autoconf.h" ] && ! ls -d /usr/src/linux-headers-*-"$arch" >/dev/null 2>&1; then
    missing="$missing linux-headers-$arch"
fi
if [ -n "$missing" ]; then
    echo "prepare-bpf-host: installing$missing"
    # shellcheck disable=SC2086 # one word per package
    bash "$(dirname "$0")/apt-install.sh" $missing
fi

# Debian splits headers into an arch dir (generated config) and a -common dir
# (the tree); bcc reads them as $modules/build and $modules/source.
newest() { ls -d "$@" 2>/dev/null | sort -V | tail -n 1; }
if [ ! -f "$modules/build/include/generated/autoconf.h" ]; then
    build=$(newest /usr/src/linux-headers-*-"$arch")
    common=$(newest /usr/src/linux-headers-*-common)
    if [ -z "$build" ] || [ -z "$common" ]; then
        echo "prepare-bpf-host: no /usr/src/linux-headers-*-$arch and -common after installing linux-headers-$arch" >&2
        exit 1
    fi
    mkdir -p "$modules"
    ln -sfn "$build" "$modules/build"
    ln -sfn "$common" "$modules/source"
    echo "prepare-bpf-host: linked $modules/build -> $build, $modules/source -> $common"
fi
