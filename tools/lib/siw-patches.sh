#!/bin/bash
# siw-patches.sh: prints one word naming the patches in tools/lib/siw-patches (a hash of their
# names and contents). build-siw.sh writes it in siw.ko's ready file; softroce-vm builds siw.ko
# again when it differs.
set -euo pipefail
CDPATH='' cd "$(dirname "${BASH_SOURCE[0]}")/siw-patches"
shopt -s nullglob
for p in *.patch; do
  printf '%s\n' "$p"
  cat "$p"
done | sha256sum | cut -c1-16
