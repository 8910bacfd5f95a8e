#!/usr/bin/env bash
# Unpack a llama-cpp-python sdist and apply a patch to its vendored llama.cpp (the AMX fix of
# scripts/patches/llamacpp-amx-tiles.patch), for scripts/install_llamacpp.sh.
#
#   scripts/patch_llamacpp_sdist.sh SDIST.tar.gz DEST PATCH
#
# No fuzz: a pinned version whose vendored file changed must fail here, loudly, rather than build
# a patched library whose fix landed in the wrong place.
set -euo pipefail
if [[ $# -ne 3 ]]; then
    echo "usage: $0 SDIST.tar.gz DEST PATCH" >&2
    exit 2
fi
sdist=$1
dest=$2
patch_file=$3

mkdir -p "$dest"
tar -xzf "$sdist" -C "$dest" --strip-components=1
if command -v patch >/dev/null; then
    check=(patch --dry-run --batch --forward --fuzz=0 -p1 -d "$dest" -i "$(realpath "$patch_file")")
    apply=(patch --batch --forward --fuzz=0 --silent -p1 -d "$dest" -i "$(realpath "$patch_file")")
else
    check=(git -C "$dest" apply --check "$(realpath "$patch_file")")
    apply=(git -C "$dest" apply "$(realpath "$patch_file")")
fi
if ! out=$("${check[@]}" 2>&1); then
    {
        echo "ERROR: $patch_file no longer applies to $(basename "$sdist"):"
        echo "$out"
        echo "Refresh the patch for this llama-cpp-python version (or drop it where upstream has the fix)."
    } >&2
    exit 1
fi
"${apply[@]}"
echo "applied $(basename "$patch_file") to $(basename "$sdist")"
