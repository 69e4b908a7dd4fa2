"""The staged form of the tensor-core body (`MLXKV_CUDA_MMA=2`): each warp keeps a ring of `stages`
16-token tiles of packed K/V and their scales in shared memory, filled with `cp.async` (no registers
held by loads in flight), so `stages - 1` tiles are on their way from DRAM while one is computed.
The register form (1) has a warp's K loads, then its V loads, as the only bytes in flight: at 32k
tokens it reads ~0.5 TB/s of the card's ~4.3.

Per warp and stage (32-bit words; `krs` / `vrs` row strides chosen so the fragment reads are free of
shared-memory bank conflicts, `bank_wavefronts` checks it on CPU):
```
K rows [16][krs] | V rows [16][vrs] | K scales [16][KNG] | K biases | V scales [16][VNG] | V biases
```
Pure Python (the layout) and the device functions that fill a stage (`HEADER`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

TOKENS = 16  # a warp's tile: one mma n-block pair of keys, one k-block of values
BANKS = 32
STAGE_SMEM = 48 * 1024  # bytes of rings per block: 4 blocks of 128 threads per SM stay resident
MAX_STAGES = 4
MAX_RING = 96 * 1024  # what MLXKV_CUDA_STAGES may ask for (the plan's shared memory stays under cuda_launch.MAX_SMEM)


def _align16(n: int) -> int:
    return -(-n // 16) * 16


def bank_wavefronts(lanes: list[list[int]], width: int) -> int:
    """Shared-memory wavefronts of one warp-wide read: `lanes[i]` the first 32-bit word lane i reads,
    `width` words each (1, 2 or 4: LDS.32 / .64 / .128 run 32, 16 or 8 lanes per phase); in each phase
    a bank serves one distinct word per wavefront."""
    per = BANKS // width
    total = 0
    for p in range(0, len(lanes), per):
        banks: dict[int, set[int]] = {}
        for first in lanes[p : p + per]:
            for w in range(first, first + width):
                banks.setdefault(w % BANKS, set()).add(w)
        total += max(len(s) for s in banks.values())
    return total


def key_reads(stride: int, words_per_lane: int) -> list[tuple[list[int], int]]:
    """The body's K fragment reads: lane (g, c) reads words [wtk c, wtk c + wtk) of row g (as 16-byte
    pieces where wtk allows)."""
    width = min(words_per_lane, 4)
    return [([(lane >> 2) * stride + words_per_lane * (lane & 3) + piece for lane in range(32)], width)
            for piece in range(0, words_per_lane, width)]


def value_reads(stride: int, words_per_lane: int) -> list[tuple[list[int], int]]:
    """The body's V reads: lane (g, c) reads words [wtv g, wtv g + wtv) of rows 2c, 2c + 1, 2c + 8, 2c + 9."""
    width = min(words_per_lane, 4)
    out = []
    for k in range(4):
        for piece in range(0, words_per_lane, width):
            rows = [2 * (lane & 3) + (k & 1) + 8 * (k >> 1) for lane in range(32)]
            out.append(([r * stride + words_per_lane * (lane >> 2) + piece for r, lane in zip(rows, range(32))], width))
    return out


def row_stride(words: int, reads) -> int:
    """The smallest row stride >= `words`, a multiple of 4 words (16-byte rows for cp.async), whose
    reads run one wavefront per phase."""
    for stride in range(words, words + 33, 4):
        if all(bank_wavefronts(lanes, w) == len(lanes) // (BANKS // w) for lanes, w in reads(stride)):
            return stride
    return words


@dataclass(frozen=True)
class Stages:
    krs: int  # K row stride (words)
    vrs: int
    stage: int  # bytes of one stage
    count: int  # stages per warp ring

    def offsets(self, kng: int, vng: int) -> dict[str, int]:
        k = TOKENS * self.krs * 4
        v = k + TOKENS * self.vrs * 4
        km, vm = _align16(TOKENS * kng * 2), _align16(TOKENS * vng * 2)
        return {"KS": v, "KZ": v + km, "VS": v + 2 * km, "VZ": v + 2 * km + vm, "V": k}


def stages(key_words: int, value_words: int, key_groups: int, value_groups: int, warps: int) -> Stages:
    """The ring of a plan: strides free of bank conflicts, as many stages (2..4) as fit STAGE_SMEM."""
    krs = row_stride(key_words, lambda s: key_reads(s, key_words // 4))
    vrs = row_stride(value_words, lambda s: value_reads(s, value_words // 8))
    size = TOKENS * (krs + vrs) * 4 + 2 * _align16(TOKENS * key_groups * 2) + 2 * _align16(TOKENS * value_groups * 2)
    count = max(2, min(MAX_STAGES, STAGE_SMEM // (warps * size)))
    ask = os.environ.get("MLXKV_CUDA_STAGES", "")  # a device A/B of the ring's depth (read when a plan is made)
    if ask.isdigit() and 2 <= int(ask) <= 8 and warps * size * int(ask) <= MAX_RING:
        count = int(ask)
    return Stages(krs, vrs, size, count)


HEADER = r"""
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(s), "l"(src));
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" :: "r"(s), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// 16 token rows of RW words from global (row tp0 + r, rows past `last` repeat row `last`) into rows of RS words
template <int RW, int RS>
__device__ __forceinline__ void stage_rows(unsigned char* dst, const unsigned char* src, long long tb, int tp0,
                                           int last, int lane, bool vec) {
  if (vec) {
    constexpr int CPR = RW / 4, N = 16 * CPR;
#pragma unroll
    for (int k = 0; k < (N + 31) / 32; k++) {
      const int i = lane + 32 * k;
      if (N % 32 == 0 || i < N) {
        const int r = i / CPR, col = i % CPR;
        cp_async16(dst + (r * RS + 4 * col) * 4, src + (tp0 + min(r, last)) * tb + 16 * col);
      }
    }
  } else {
    constexpr int N = 16 * RW;
#pragma unroll 4
    for (int i = lane; i < N; i += 32) {
      const int r = i / RW, col = i % RW;
      cp_async4(dst + (r * RS + col) * 4, src + (tp0 + min(r, last)) * tb + 4 * col);
    }
  }
}

// 16 tokens' NG halves (scales or biases) into [16][NG]: 16-byte copies where they lie that way in memory
template <int NG>
__device__ __forceinline__ void stage_meta(__half* dst, const __half* src, const int64_t* st, int pb, int h,
                                           int tp0, int last, int lane) {
  const __half* base = src + pb * st[0] + h * st[1];
  const __half* first = base + (long long)tp0 * st[2];
  if (last >= 15 && st[3] == 1 && st[2] == NG && (reinterpret_cast<unsigned long long>(first) % 16) == 0) {
    constexpr int N = 16 * NG * 2 / 16;
    if (lane < N) cp_async16(reinterpret_cast<unsigned char*>(dst) + 16 * lane,
                             reinterpret_cast<const unsigned char*>(first) + 16 * lane);
  } else {
    for (int i = lane; i < 16 * NG; i += 32) {
      const int r = i / NG, gi = i % NG;
      dst[i] = base[(long long)(tp0 + min(r, last)) * st[2] + gi * st[3]];
    }
  }
}
"""
