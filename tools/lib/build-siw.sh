#!/bin/bash
# build-siw.sh: build Soft-iWARP (siw.ko) for one of Debian's kernels, which do not ship it.
#
#   tools/lib/build-siw.sh KVER OUTDIR
#
# KVER is a Debian 12 kernel version (6.1.0-NN-amd64). The sources of drivers/infiniband/sw/siw
# come from Debian's linux-source-6.1 (only that folder is extracted from its tarball), the build
# uses that exact kernel's linux-headers-KVER; both are installed through install-deps.sh (as
# root; otherwise it names the command). Writes OUTDIR/siw.ko and OUTDIR/ready (what it was built
# from, with the patches of tools/lib/siw-patches applied: siw-patches.sh), replacing OUTDIR only
# when the build succeeded. Takes a few seconds, plus a minute to
# read the 140 MB source tarball.
#
# Exit status: 0 built; 77 when it cannot be done here (not root and packages missing, or a
# kernel series other than 6.1: Debian 13's 6.12 headers need gcc-14 and glibc 2.38); 1 when the
# build failed.
set -euo pipefail

say() { printf 'build-siw: %s\n' "$*" >&2; }
[ $# = 2 ] || { echo "usage: tools/lib/build-siw.sh KVER OUTDIR" >&2; exit 2; }
kver=$1 out=$2
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)

[[ $kver =~ ^([0-9]+\.[0-9]+)\. ]] || { say "not a kernel version: $kver"; exit 2; }
series=${BASH_REMATCH[1]}
if [ "$series" != 6.1 ]; then
  say "siw is built for Debian 12's 6.1 kernels only, not $kver (Debian 13's headers need gcc-14 and glibc 2.38)"
  exit 77
fi

headers=/usr/src/linux-headers-$kver
tarball=/usr/src/linux-source-$series.tar.xz
# make: the kernel's build; linux-headers-KVER brings linux-kbuild-6.1 and gcc-12.
if ! "$here/install-deps.sh" "linux-source-$series" "linux-headers-$kver" make patch; then
  say "cannot build siw.ko for $kver without those packages"
  exit 77
fi
if [ ! -f "$tarball" ] || [ ! -f "$headers/Makefile" ]; then say "missing $tarball or $headers"; exit 1; fi

src_version=$(dpkg-query -W -f='${Version}' "linux-source-$series")
hdr_version=$(dpkg-query -W -f='${Version}' "linux-headers-$kver")
if [ "$src_version" != "$hdr_version" ]; then
  # Within one stable series siw's sources rarely change, but say so: a failure may come from it.
  say "note: linux-source-$series is $src_version, the kernel $kver is $hdr_version"
fi

mkdir -p "$(dirname "$out")"
tmp=$(mktemp -d "$out.build.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
say "building siw.ko for $kver from linux-source-$series $src_version (once; cached in $out)"
mkdir "$tmp/src"
# The tarball holds the whole tree: extract only the driver (tar still reads all of it).
tar -xaf "$tarball" -C "$tmp/src" --strip-components=5 --wildcards \
  "linux-source-$series/drivers/infiniband/sw/siw/*"
[ -f "$tmp/src/Makefile" ] || { say "no drivers/infiniband/sw/siw in $tarball"; exit 1; }
# Fixes of siw's own bugs that the tests met (each patch says what and how it was seen).
shopt -s nullglob
for p in "$here"/siw-patches/*.patch; do
  # No fuzz: a changed siw_cm.c must not take a hunk at the wrong place.
  if ! patch -d "$tmp/src" -p1 --forward --fuzz=0 --silent <"$p"; then
    say "$(basename "$p") does not apply to linux-source-$series $src_version"
    exit 1
  fi
done
# The driver's own Makefile lists the objects (obj-$(CONFIG_RDMA_SIW) += siw.o, siw-y := ...).
if ! make -C "$headers" M="$tmp/src" CONFIG_RDMA_SIW=m -j "$(nproc)" modules >"$tmp/log" 2>&1; then
  sed 's/^/  make: /' "$tmp/log" >&2
  say "the build of siw.ko failed"
  exit 1
fi
vermagic=$(modinfo -F vermagic "$tmp/src/siw.ko")
if [[ $vermagic != "$kver "* ]]; then
  say "siw.ko has vermagic '$vermagic', not $kver"
  exit 1
fi
mkdir "$tmp/out"
# Debian strips its modules: without debug information siw.ko is 280 KB instead of 5 MB, which
# the guest's initramfs reads under emulation at every boot.
strip --strip-debug -o "$tmp/out/siw.ko" "$tmp/src/siw.ko"
cp "$tmp/log" "$tmp/out/build.log"
printf 'kver=%s\nsource=linux-source-%s %s\nheaders=linux-headers-%s %s\nvermagic=%s\npatches=%s\n' \
  "$kver" "$series" "$src_version" "$kver" "$hdr_version" "$vermagic" \
  "$("$here/siw-patches.sh")" >"$tmp/out/ready"
rm -rf "$out"
mv "$tmp/out" "$out"
