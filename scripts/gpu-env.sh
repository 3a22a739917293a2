# gpu-env.sh — sourced by the scripts run on the GPU machine: unpacks the
# carried Debian libraries (.deps/debs, see scripts/gpu-check.sh) into
# .deps/prefix, points pkg-config / CMake / the loader at them, finds NCCL
# (the machine's toolkit has none; PyTorch's nvidia-nccl wheel does) and
# configures build-gpu/ with CUDA and NCCL. Keeps NCCL_NVLS_ENABLE=0.
# Sets: PREFIX, PKGCONF, NCCL_PY, FL_GPU_CMAKE_ARGS; defines gpu_configure.
PREFIX=$ROOT/.deps/prefix
if ls "$ROOT"/.deps/debs/*.deb >/dev/null 2>&1 && [ ! -d "$PREFIX/usr" ]; then
    mkdir -p "$PREFIX"
    for f in "$ROOT"/.deps/debs/*.deb; do dpkg -x "$f" "$PREFIX"; done
    find "$PREFIX" -name '*.pc' -exec sed -i "s|=/usr|=$PREFIX/usr|g" {} +
    # libmicrohttpd.pc names gnutls for static links only; the machine has
    # libgnutls.so.30 but no gnutls.pc
    find "$PREFIX" -name libmicrohttpd.pc -exec sed -i '/^Requires.private/d' {} +
fi
export PKG_CONFIG_PATH=$PREFIX/usr/lib/x86_64-linux-gnu/pkgconfig:$PREFIX/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
export CMAKE_PREFIX_PATH=$PREFIX/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
PKGCONF=$(command -v pkg-config || true)
[ -z "$PKGCONF" ] && [ -x "$PREFIX/usr/bin/pkgconf" ] && PKGCONF=$PREFIX/usr/bin/pkgconf
NCCL_PY=$(python3 -c "import nvidia.nccl as m; print(list(m.__path__)[0])" 2>/dev/null)
export LD_LIBRARY_PATH=${NCCL_PY:+$NCCL_PY/lib:}$PREFIX/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 NCCL_NVLS_ENABLE=0
FL_GPU_CMAKE_ARGS="-DCMAKE_BUILD_TYPE=RelWithDebInfo -DFL_CUDA=ON -DFL_WERROR=OFF -DCMAKE_CUDA_ARCHITECTURES=${FL_CUDA_ARCH:-90a}${PKGCONF:+ -DPKG_CONFIG_EXECUTABLE=$PKGCONF}"
if [ -n "$NCCL_PY" ] && [ -e "$NCCL_PY/lib/libnccl.so.2" ]; then
    mkdir -p /tmp/fl-nccl/lib && ln -sf "$NCCL_PY/lib/libnccl.so.2" /tmp/fl-nccl/lib/libnccl.so
    FL_GPU_CMAKE_ARGS="$FL_GPU_CMAKE_ARGS -DFL_NCCL_LIBRARY=/tmp/fl-nccl/lib/libnccl.so -DFL_NCCL_INCLUDE_DIR=$NCCL_PY/include"
fi
# gpu_configure LOG: configures build-gpu (idempotent).
gpu_configure() {
    # shellcheck disable=SC2086
    cmake -S "$ROOT" -B "$ROOT/build-gpu" $FL_GPU_CMAKE_ARGS >"$1" 2>&1 || { tail -20 "$1"; return 1; }
}
