# Source me: `. scripts/blas-env.sh`
# Makes MLX's Linux CPU matmuls use the system OpenBLAS instead of the reference BLAS
# bundled in the mlx[cpu] wheel (install: apt-get install libopenblas0-pthread libgfortran5).
# No-op when OpenBLAS is not installed. Also sets OPENBLAS_CORETYPE when OpenBLAS does
# not recognise the CPU and would fall back to its slow SSE3 "Prescott" kernels.
_mlxkv_arch="$(uname -m)"
_mlxkv_blas=""
for _mlxkv_c in "/usr/lib/${_mlxkv_arch}-linux-gnu/openblas-pthread/libblas.so.3" \
                "/usr/lib/${_mlxkv_arch}-linux-gnu/openblas-openmp/libblas.so.3"; do
    if [ -e "$_mlxkv_c" ]; then _mlxkv_blas="$_mlxkv_c"; break; fi
done
if [ -n "$_mlxkv_blas" ]; then
    case ":${LD_PRELOAD:-}:" in
        *":${_mlxkv_blas}:"*) ;;
        *) export LD_PRELOAD="${_mlxkv_blas}${LD_PRELOAD:+:$LD_PRELOAD}" ;;
    esac
    if [ -z "${OPENBLAS_CORETYPE:-}" ] && [ -r /proc/cpuinfo ] &&
        OPENBLAS_VERBOSE=2 LD_PRELOAD="$_mlxkv_blas" /bin/true 2>&1 | grep -q "Core: Prescott"; then
        _mlxkv_flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
        case "$_mlxkv_flags" in
            *" avx512bw "*) export OPENBLAS_CORETYPE=SkylakeX ;;
            *" avx2 "*) export OPENBLAS_CORETYPE=Haswell ;;
        esac
    fi
fi
unset _mlxkv_arch _mlxkv_blas _mlxkv_c _mlxkv_flags
