#!/usr/bin/env bash
# Puts ONNX Runtime's C API headers in build/ort-include/, where `pip install` looks for them to compile
# kvexport's native ops (kvexport/native/qmatmul.c and attention.c; setup.py). The onnxruntime wheel ships no headers;
# this takes them from an npm package that carries ONNX Runtime's prebuilt releases with their headers (MIT), and
# keeps only the headers. Where npm or the package cannot be had it says so and exits 0: the install then leaves
# the library out and `cpu` engines run ONNX Runtime's own kernels. Run from anywhere:
#     bash kvexport/native/fetch_ort_headers.sh && pip install -e ".[test]"
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
dest=build/ort-include
pkg=com.github.asus4.onnxruntime@0.4.9   # ONNX Runtime C API version 29, which onnxruntime >= 1.29 serves
if [ -f "$dest/onnxruntime_c_api.h" ]; then
  echo "ONNX Runtime headers already in $dest"
  exit 0
fi
skip() { echo "kvexport: $1; the native ops will not be built (or set KVEXPORT_ORT_INCLUDE to a folder holding onnxruntime_c_api.h)" >&2; exit 0; }
command -v npm >/dev/null || skip "npm not found"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "$pkg" >/dev/null 2>&1) || skip "npm could not fetch $pkg"
inner='package/Plugins/iOS~/onnxruntime.xcframework/ios-arm64_x86_64-simulator/onnxruntime.framework/Headers'
tar xzf "$tmp"/*.tgz -C "$tmp" --wildcards "$inner/*.h" || skip "$pkg holds no headers where expected"
mkdir -p "$dest" && cp "$tmp/$inner/"*.h "$dest/" || skip "could not write $dest"
echo "ONNX Runtime C API headers ($pkg) in $dest"
