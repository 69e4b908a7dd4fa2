#!/usr/bin/env bash
# Run 16's second call (about 7 minutes), right after scripts/gpu_session.sh on the warm machine: where the decode
# kernels lose bandwidth once the fixed cost is gone (run 15: form 1 at 128k 105 us for 151 MB, 1.44 TB/s of the
# H200's ~3.4; turbo decodes at 0.70x of mlx-lm against affine:4's 0.94x, its tensor-core body not yet profiled).
#   source /var/tmp/mlxw/gpu-env.sh && OUT=/some/folder bash scripts/gpu_session_kernel.sh
# 1. form 1's 128k launch: ncu sections with warm caches (what its warps wait on per instruction), and the A/B
#    of more splits (MLXKV_CUDA_TARGET_BLOCKS=1056: two blocks' worth of rows in flight per SM slot) and the
#    staged body (MLXKV_CUDA_MMA=2: a ring of cp.async tiles per warp) against the default;
# 2. turbo's body: its device time at 32k and 128k and its sections at 32k.
# 0. first, form 1 at 4k: the launch constants are now 4 KiB pages (backend.PAGE_BYTES), run 15 measured
#    64 KiB ones (16.8 us); a return towards run 13's 35 us means the page is shared and faults again.
set -uo pipefail
cd "$(dirname "$0")/.."
TAIL_LINES=12 source scripts/gpu_steps.sh
step page-4k 40 env OUT="$RES" CONTEXTS="4096" VARIANTS="MLXKV_CUDA_MMA=1" bash scripts/gpu_kernel_ab.sh
step sections-128k 60 env OUT="$RES" CONTEXTS="131072" CACHE=none bash scripts/gpu_kernel_sections.sh
step ab-128k 130 env OUT="$RES" CONTEXTS="131072" \
  VARIANTS="MLXKV_CUDA_MMA=1 MLXKV_CUDA_TARGET_BLOCKS=1056 MLXKV_CUDA_MMA=2" bash scripts/gpu_kernel_ab.sh
step turbo-time 90 env OUT="$RES" KIND=turbo-kernel CONTEXTS="32768 131072" VARIANTS="MLXKV_CUDA_MMA=1" \
  bash scripts/gpu_kernel_ab.sh
step turbo-sections 60 env OUT="$RES/turbo" KIND=turbo-kernel CONTEXTS="32768" CACHE=none bash scripts/gpu_kernel_sections.sh
exit 0
