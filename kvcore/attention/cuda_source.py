"""CUDA text of the decode kernel and its split merge (for `mx.fast.cuda_kernel`).

Compile-time constants come from `cuda_launch.Plan.template`; runtime inputs are the per-row token
bounds `rows` (B, 3) = (lo0, hi0, count), `dims` = (chunk, nsplit, value head offset, block table
width), the softmax scale and, for paged rows, the block table `ptab`, so the kernel compiles once
per plan and never as the context grows. The device functions it inlines are in `cuda_helpers.py`
(`HEADER`), with how a token row's elements are read.
"""

import os

from .cuda_helpers import HEADER  # noqa: F401 - the kernel's header, beside its body

INPUTS = ["q", "kw", "ks", "kb", "vw", "vs", "vb", "kcb", "vcb", "rows", "dims", "fscale", "ctr", "slot", "sinks",
          "ptab"]
OUTPUTS = ["m_out", "l_out", "acc_out", "out"]

# grid (nsplit * NQC * THREADS, Hkv, B); block (THREADS): one (split, query chunk, KV head, row).
# dims = (chunk, nsplit, value head offset, table width); slot = the counters' base. With FUSED, the block
# that finishes a (row, KV head, query chunk) last merges its splits into `out` (flash decoding in one launch):
# every block counts itself in ctr[slot + (b * Hkv + h) * NQC + qc] after its partials are written
# and fenced; the one that sees nsplit - 1 merges and sets the counter back to 0 for the next launch.
PROLOGUE = r"""
  constexpr int QVT = REP * NQ;
  constexpr int NWARP = THREADS / 32;
  constexpr float NEG = -1e30f;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int qc = blockIdx.x % NQC, split = blockIdx.x / NQC, h = blockIdx.y, b = blockIdx.z;
  const int CHUNK = dims[0], NSPLIT = dims[1], VH = dims[2], PTW = dims[3];
  const int lo0 = rows[3 * b], hi0 = rows[3 * b + 1], cnt = rows[3 * b + 2];
  // paged: tiles start on tile boundaries, so none straddles a page (PAGE is a multiple of TT); the mask drops the rest
  const int t_begin = PAGED ? max(split * CHUNK, max(lo0, 0)) / TT * TT : max(split * CHUNK, max(lo0, 0));
  const int t_end = min(split * CHUNK + CHUNK, min(hi0 + NQ - 1, cnt));
  const float scale = fscale[0];
"""

SCALAR_BODY = r"""
  float* qs = reinterpret_cast<float*>(smem + OFF_Q);        // [D][QVP] scaled queries
  float* qsum = reinterpret_cast<float*>(smem + OFF_QSUM);   // [KNG][QVP] per-group sums (affine keys)
  float* kcbs = reinterpret_cast<float*>(smem + OFF_KCB);    // codebooks (turbo)
  float* vcbs = reinterpret_cast<float*>(smem + OFF_VCB);
  float* red = reinterpret_cast<float*>(smem + OFF_RED);     // [NWARP][QVP]
  float* ps = reinterpret_cast<float*>(smem + OFF_P);        // [TT][QVP] probabilities of the tile
  uint32_t* kt = reinterpret_cast<uint32_t*>(smem + OFF_KT); // [TT][KRW + 1]
  float* km = reinterpret_cast<float*>(smem + OFF_KM);       // scales [TT][KMS], then biases
  uint32_t* vt = reinterpret_cast<uint32_t*>(smem + OFF_VT);
  float* vm = reinterpret_cast<float*>(smem + OFF_VM);
  float* scratch = reinterpret_cast<float*>(smem + OFF_KT);  // after the last tile: [TS][QVB][DV]

  for (int i = tid; i < D * QVP; i += THREADS) {
    const int d = i / QVP, vl = i % QVP, v = qc * QVB + vl;
    float x = 0.f;
    if (vl < QVB) {
      const int r = v / NQ, n = v % NQ;
      x = static_cast<float>(q[b * q_strides[0] + (h * REP + r) * q_strides[1] + n * q_strides[2] +
                               d * q_strides[3]]) * scale;
    }
    qs[i] = x;
  }
  if constexpr (KK == 2) { for (int i = tid; i < (1 << KB); i += THREADS) kcbs[i] = kcb[i]; }
  if constexpr (VK == 2) { for (int i = tid; i < (1 << VB); i += THREADS) vcbs[i] = vcb[i]; }
  __syncthreads();
  if constexpr (KK == 1) {
    for (int i = tid; i < KNG * QVP; i += THREADS) {
      const int g = i / QVP, vl = i % QVP;
      float a = 0.f;
      for (int e = 0; e < KG; e++) a += qs[(g * KG + e) * QVP + vl];
      qsum[i] = a;
    }
  }

  float m_run[QVB], l_part[QVB], acc[QVB][VE];
#pragma unroll
  for (int v = 0; v < QVB; v++) {
    m_run[v] = NEG;
    l_part[v] = 0.f;
#pragma unroll
    for (int e = 0; e < VE; e++) acc[v][e] = 0.f;
  }
  const int vc = tid % TPR, vts = tid / TPR;
  const unsigned char* kbase = row_base(kw, sizeof(*kw), kw_strides.data(), b, h);
  const unsigned char* vbase = row_base(vw, sizeof(*vw), vw_strides.data(), b, h + VH);
  const long long ktb = kw_strides[2] * (long long)sizeof(*kw), vtb = vw_strides[2] * (long long)sizeof(*vw);

  for (int t0 = t_begin; t0 < t_end; t0 += TT) {
    const int nt = min(TT, t_end - t0);
    int pb = b, pt0 = t0;  // paged: the tile's page (the block table) and its first token in it
    if constexpr (PAGED) { pb = ptab[b * PTW + t0 / PAGE]; pt0 = t0 % PAGE; }
    const unsigned char* kpage = PAGED ? row_base(kw, sizeof(*kw), kw_strides.data(), pb, h) : kbase;
    const unsigned char* vpage = PAGED ? row_base(vw, sizeof(*vw), vw_strides.data(), pb, h + VH) : vbase;
    load_rows<KRW, TT, THREADS>(kt, kpage, ktb, pt0, nt, tid);
    load_rows<VRW, TT, THREADS>(vt, vpage, vtb, pt0, nt, tid);
    load_meta<KK, KNG, KMS, TT, THREADS>(km, ks, kb, ks_strides.data(), kb_strides.data(), pb, h, pt0, nt, tid);
    load_meta<VK, VNG, VMS, TT, THREADS>(vm, vs, vb, vs_strides.data(), vb_strides.data(), pb, h + VH, pt0, nt, tid);
    __syncthreads();

    // scores: one token per thread, every query vector of the block
    float s[QVB];
    if (tid < TT) {
      score_row<KK, KB, KDT, D, KG, KNG, QVB, QVP, TT, KMS>(s, kt + tid * (KRW + 1), km + tid * KMS, qs, qsum, kcbs);
    }
    const int j = t0 + tid;
#pragma unroll
    for (int v = 0; v < QVB; v++) {
      const int n = (qc * QVB + v) % NQ;
      const bool ok = tid < nt && j >= lo0 + n && j < min(hi0 + n, cnt);
      s[v] = ok ? s[v] : NEG;
      const float wm = warp_max(s[v]);
      if (lane == 0) red[warp * QVP + v] = wm;
    }
    __syncthreads();

    // online softmax over tiles: new running max, rescale, probabilities of this tile
    float corr[QVB];
#pragma unroll
    for (int v = 0; v < QVB; v++) {
      float tm = red[v];
#pragma unroll
      for (int w = 1; w < NWARP; w++) tm = fmaxf(tm, red[w * QVP + v]);
      const float mn = fmaxf(m_run[v], tm);
      corr[v] = __expf(m_run[v] - mn);
      m_run[v] = mn;
      const float p = s[v] > 0.5f * NEG ? __expf(s[v] - mn) : 0.f;
      if (tid < TT) ps[tid * QVP + v] = p;
      l_part[v] = l_part[v] * corr[v] + p;
    }
    __syncthreads();

    // weighted values: VE channels per thread, tokens vts, vts + TS, ...
#pragma unroll
    for (int v = 0; v < QVB; v++) {
#pragma unroll
      for (int e = 0; e < VE; e++) acc[v][e] *= corr[v];
    }
    for (int t = vts; t < nt; t += TS) {
      float x[VE];
      value_chunk<VK, VB, VDT, VG, VE, TT, VMS>(x, vt + t * (VRW + 1), vm + t * VMS, vc, vcbs);
      const float4* p4 = reinterpret_cast<const float4*>(ps + t * QVP);
      float p[QVP];
#pragma unroll
      for (int c = 0; c < QVP / 4; c++) {
        const float4 pp = p4[c];
        p[4 * c] = pp.x; p[4 * c + 1] = pp.y; p[4 * c + 2] = pp.z; p[4 * c + 3] = pp.w;
      }
#pragma unroll
      for (int v = 0; v < QVB; v++) {
#pragma unroll
        for (int e = 0; e < VE; e++) acc[v][e] = fmaf(p[v], x[e], acc[v][e]);
      }
    }
    __syncthreads();
  }

  // partials of this split: m, l (sum over threads), acc (sum over token subsets)
#pragma unroll
  for (int v = 0; v < QVB; v++) {
    const float ws = warp_sum(l_part[v]);
    if (lane == 0) red[warp * QVP + v] = ws;
  }
#pragma unroll
  for (int v = 0; v < QVB; v++) {
#pragma unroll
    for (int e = 0; e < VE; e++) scratch[(vts * QVB + v) * DV + vc * VE + e] = acc[v][e];
  }
  __syncthreads();
  const long long ob = ((long long)(b * gridDim.y + h) * NSPLIT + split) * QVT + qc * QVB;
  if (tid < QVB) {
    float lt = 0.f, mv = NEG;
    for (int w = 0; w < NWARP; w++) lt += red[w * QVP + tid];
#pragma unroll
    for (int v = 0; v < QVB; v++) mv = (v == tid) ? m_run[v] : mv;
    m_out[ob + tid] = mv;
    l_out[ob + tid] = lt;
  }
  for (int i = tid; i < QVB * DV; i += THREADS) {
    const int v = i / DV, d = i % DV;
    float a = 0.f;
#pragma unroll
    for (int u = 0; u < TS; u++) a += scratch[(u * QVB + v) * DV + d];
    acc_out[(ob + v) * DV + d] = a;
  }
"""

# how a split's block counts itself, and the last one learns it is last (then it merges): every warp fences
FENCE_ARRIVAL = r"""
    __shared__ int last;
    __threadfence();
    __syncthreads();
    int* counter = const_cast<int*>(ctr) + slot[0] + (b * gridDim.y + h) * NQC + qc;
    if (tid == 0) last = atomicAdd(counter, 1) == NSPLIT - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
"""
# the split's partials are written (m_out, l_out, acc_out at `ob`); `scratch` is free shared memory
TAIL = r"""
  if constexpr (FUSED) {""" + FENCE_ARRIVAL + r"""    // the merge, all threads: a warp per query vector for the splits' weights and the denominator,
    // then four output channels per thread (float4 reads of the partial outputs across splits)
    const long long base = (long long)(b * gridDim.y + h) * NSPLIT * QVT;
    const int HQ = gridDim.y * REP;
    float* ws = scratch;                   // [QVB][NSPLIT] weights e^(m_s - M)
    float* dens = scratch + QVB * NSPLIT;  // [QVB]
    for (int vl = warp; vl < QVB; vl += NWARP) {
      const int v = qc * QVB + vl;
      float M = NEG;
      for (int s = lane; s < NSPLIT; s += 32) M = fmaxf(M, __ldcg(m_out + base + (long long)s * QVT + v));
      M = warp_max(M);
      float sk = 0.f;
      if constexpr (HAS_SINK) { sk = sinks[h * REP + v / NQ]; M = fmaxf(M, sk); }
      float den = 0.f;
      for (int s = lane; s < NSPLIT; s += 32) {
        const long long o = base + (long long)s * QVT + v;
        const float w = __expf(__ldcg(m_out + o) - M);
        ws[vl * NSPLIT + s] = w;
        den = fmaf(w, __ldcg(l_out + o), den);
      }
      den = warp_sum(den);
      if (lane == 0) dens[vl] = HAS_SINK ? den + __expf(sk - M) : den;
    }
    __syncthreads();
    constexpr int D4 = DV / 4;
    for (int i = tid; i < QVB * D4; i += THREADS) {
      const int vl = i / D4, d4 = i % D4, v = qc * QVB + vl, hq = h * REP + v / NQ, n = v % NQ;
      const float* wv = ws + vl * NSPLIT;
      float4 num = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll MERGE_UNROLL
      for (int s = 0; s < NSPLIT; s++) {
        const float w = wv[s];
        const float4 a = __ldcg(reinterpret_cast<const float4*>(acc_out + (base + (long long)s * QVT + v) * DV) + d4);
        num.x = fmaf(w, a.x, num.x); num.y = fmaf(w, a.y, num.y);
        num.z = fmaf(w, a.z, num.z); num.w = fmaf(w, a.w, num.w);
      }
      const float den = dens[vl];
      OT* o = out + (((long long)b * HQ + hq) * NQ + n) * DV + d4 * 4;
      o[0] = static_cast<OT>(den > 0.f ? num.x / den : 0.f);
      o[1] = static_cast<OT>(den > 0.f ? num.y / den : 0.f);
      o[2] = static_cast<OT>(den > 0.f ? num.z / den : 0.f);
      o[3] = static_cast<OT>(den > 0.f ? num.w / den : 0.f);
    }
    if (tid == 0) *counter = 0;
  }
"""

MERGE_UNROLL = int(os.environ.get("MLXKV_CUDA_MERGE_UNROLL", "8"))  # partial outputs in flight per merge thread (A/B knob)


ARRIVE = os.environ.get("MLXKV_CUDA_ARRIVE", "release")  # how a split's block counts itself (A/B knob, below)

# The default since run 11 (MLXKV_CUDA_ARRIVE=fence: the former one, FENCE_ARRIVAL): ncu's source counters put 31% of
# form 1's stall samples at 32k on the fenced arrival (`__threadfence` is MEMBAR.SC.GPU + an L1 invalidate in
# all 4 warps, then every warp waits on a load of slot[0] issued after it). This one is CUTLASS's split-K
# semaphore: the block's barrier, then thread 0 alone releases (fence.acq_rel.gpu, a relaxed atomic add), the
# last block's thread 0 acquires (fence.acq_rel.gpu) before the barrier that lets its threads read the
# partials (through L2, __ldcg); slot[0] is read at the kernel's start (`slot0`, in PROLOGUE_SLOT).
RELEASE_ARRIVAL = r"""
    __shared__ int last;
    int* counter = const_cast<int*>(ctr) + slot0 + (b * gridDim.y + h) * NQC + qc;
    __syncthreads();
    if (tid == 0) {  // one split: the block's own partials, ordered by the barrier (no counter, no fence)
      int prev = 0;
      if (NSPLIT > 1) {
        asm volatile("fence.acq_rel.gpu;\n\tatom.relaxed.gpu.global.add.s32 %0, [%1], 1;" : "=r"(prev) : "l"(counter) : "memory");
        if (prev == NSPLIT - 1) asm volatile("fence.acq_rel.gpu;" ::: "memory");
      }
      last = prev == NSPLIT - 1;
    }
    __syncthreads();
    if (!last) return;
"""
PROLOGUE_SLOT = "  const int slot0 = slot[0];  // the split counters' base, read before the partials are written\n"


def tail(arrive: str = ARRIVE) -> str:
    """The in-launch merge with its arrival (`arrive`: ARRIVE's values) and unroll factor written in (NVRTC's
    `#pragma unroll` takes a literal)."""
    text = TAIL.replace("MERGE_UNROLL", str(MERGE_UNROLL))
    return text if arrive != "release" else text.replace(FENCE_ARRIVAL, RELEASE_ARRIVAL)


def prologue(arrive: str = ARRIVE) -> str:
    return PROLOGUE + PROLOGUE_SLOT if arrive == "release" else PROLOGUE


SOURCE = prologue() + SCALAR_BODY + tail()  # the kernel of plans read with CUDA cores (`cuda_mma` has the other body)

MERGE_INPUTS = ["m", "l", "acc", "sinks", "dims"]
MERGE_OUTPUTS = ["out"]

# grid (DV, Hq * NQ, B); block (DV): one (row, query head, query), a thread per output channel
#   out = sum_s e^(m_s - M) acc_s / (sum_s e^(m_s - M) l_s + e^(sink - M))
MERGE_SOURCE = r"""
  constexpr int QVT = REP * NQ;
  const int d = threadIdx.x, hq = blockIdx.y / NQ, n = blockIdx.y % NQ, b = blockIdx.z;
  const int HQ = gridDim.y / NQ, HKV = HQ / REP;
  const int h = hq / REP, r = hq % REP, v = r * NQ + n;
  const int S = dims[1];
  const long long base = (long long)(b * HKV + h) * S * QVT + v;
  float M = -1e30f;
  for (int s = 0; s < S; s++) M = fmaxf(M, m[base + (long long)s * QVT]);
  float sink = 0.f;
  if constexpr (HAS_SINK) { sink = sinks[hq]; M = fmaxf(M, sink); }
  float den = HAS_SINK ? __expf(sink - M) : 0.f, num = 0.f;
  for (int s = 0; s < S; s++) {
    const long long o = base + (long long)s * QVT;
    const float w = __expf(m[o] - M);
    den = fmaf(w, l[o], den);
    num = fmaf(w, acc[o * DV + d], num);
  }
  out[(((long long)b * HQ + hq) * NQ + n) * DV + d] = static_cast<OT>(den > 0.f ? num / den : 0.f);
"""


def kernel_name(prefix: str, *texts: str) -> str:
    """`prefix` and a hash of the kernel's text: MLX names a kernel's compiled module after the name alone, in
    memory and in its on-disk PTX cache (/tmp/mlx/<version>/ptx, shared by every process), and before
    ml-explore/mlx#4273 a second source under a used name ran the first one's code. A name per text never meets
    another text's module, in this process or a later one."""
    import hashlib

    digest = hashlib.sha1("\0".join(texts).encode()).hexdigest()[:16]
    return f"{prefix}_{digest}"


def rewrite(text: str, pairs, owner: str) -> str:
    """`text` with each (old, new) of `pairs` replaced, in order; every old piece must be in it exactly once, so a
    changed piece fails here (AssertionError naming `owner`) rather than build another kernel under a variant's name."""
    for old, new in pairs:
        if text.count(old) != 1:
            raise AssertionError(f"{owner}: {old[:60]!r} is not once in the text it rewrites")
        text = text.replace(old, new)
    return text


def compact(text: str) -> str:
    """The text without comments, indentation or blank lines: MLX rebuilds and hashes the kernel
    source on every call, so a shorter one costs less host time per launch."""
    lines = []
    for line in text.splitlines():
        code = line.split("//", 1)[0].strip()
        if code:
            lines.append(code)
    return "\n".join(lines) + "\n"
