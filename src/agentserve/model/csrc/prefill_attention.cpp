// Prefill attention over the paged KV pool, read in place: a chunk of `rows` query tokens at
// positions start .. start + rows - 1 attends causally to its context, slots[0 .. start + rows).
//
// q: [rows, H, D]; k_cache, v_cache: [slots, KVH, D]; slots: [start + rows] int64 -> out:
// [rows, H, D], same dtype as q (q of the caches' dtype, or fp32 over bf16 caches). No gathered copy of the context and no dense mask: each task
// packs one tile of keys at a time from the pool and masks only the tiles the diagonal crosses.
//
// Work split: a task is (KV head, block of kRows rows). Its kRows * G query vectors (G query
// heads share a KV head) are laid out row-major, row r head g at r * G + g, and swept against
// each tile of kKeys keys with an online softmax, so a tile is packed once per task and reused by
// every query vector of the block. Tasks run longest first (later rows see more keys) on an
// OpenMP dynamic schedule, because the causal mask makes their costs unequal.
//
// Three implementations of the same task:
// - bf16 with AVX512-BF16 (`micro`): QK^T and PV with VDPBF16PS (bf16 pairs, fp32 accumulate).
//   K is packed pair-major ([D/2][kKeys] words of two bf16) so a broadcast query pair meets 16
//   keys per instruction; V is packed key-pair-major ([kKeys/2][D] words) so a broadcast pair of
//   probabilities meets 16 output dimensions. Probabilities are rounded to bf16 for PV, as
//   torch's flash kernel does for bf16; scores, max, sums and the output stay fp32.
// - fp32 queries with AVX2 and FMA (`avx2`), over fp32 or bf16 caches: fp32 models, and bf16
//   models computed in fp32 on CPUs without a bf16 dot product (model/precision.py). K is
//   widened and packed transposed ([D][kKeys2] floats) so a broadcast query value meets 8 keys
//   per FMA; V row-major ([kKeys2][D] floats) so a broadcast probability meets 8 dimensions.
//   All arithmetic fp32; the softmax's exp2 is a polynomial (relative error ~2e-7).
// - everything else (`generic`): fp32 arithmetic, plain loops the compiler vectorizes, for CPUs
//   without AVX2; bf16 queries there stay on torch's SDPA (see has_bf16_micro_kernel).
// Scores are kept in the log2 domain (scaled by scale * log2(e)) so the softmax uses exp2. The
// running max starts at a large negative finite value: -ffast-math assumes no infinities.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define AGENTSERVE_BF16_MICRO 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define AGENTSERVE_AVX2_MICRO 1
#endif

namespace prefill {

constexpr int kKeys = 128;  // keys per tile
constexpr int kRows = 64;  // chunk rows per task
constexpr float kMinusLarge = -1e30f;
constexpr float kLog2e = 1.4426950408889634f;

struct Task {
  int64_t head;    // KV head
  int64_t row0;    // first chunk row of the block
  int64_t nrows;   // rows in the block (<= kRows)
};

// Tasks, most keys first. Every row r of the chunk sees start + r + 1 keys.
std::vector<Task> tasks_longest_first(int64_t rows, int64_t kvh) {
  std::vector<Task> tasks;
  for (int64_t r0 = ((rows - 1) / kRows) * kRows; r0 >= 0; r0 -= kRows)
    for (int64_t h = 0; h < kvh; ++h) tasks.push_back({h, r0, std::min<int64_t>(kRows, rows - r0)});
  return tasks;
}

struct Shape {
  int64_t rows, H, KVH, G, start;
  const int64_t* slots;
  float scale_log2;  // scale * log2(e)
};

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

// ── generic: fp32 arithmetic over any element type ─────────────────────────────────────────
// q_t: the queries' and the output's type; kv_t: the cache's.
template <typename q_t, typename kv_t, int D>
void generic_task(const Shape& s, const Task& t, const q_t* qp, const kv_t* kp, const kv_t* vp, q_t* op) {
  const int64_t M = t.nrows * s.G, row = s.KVH * D, kend = s.start + t.row0 + t.nrows;
  std::vector<float> q(M * D), o(M * D, 0.f), m(M, kMinusLarge), l(M, 0.f), kf(kKeys * D), vf(kKeys * D), sc(kKeys);
  for (int64_t i = 0; i < M; ++i) {
    const q_t* src = qp + ((t.row0 + i / s.G) * s.H + t.head * s.G + i % s.G) * D;
    for (int d = 0; d < D; ++d) q[i * D + d] = to_float(src[d]) * s.scale_log2;
  }
  for (int64_t t0 = 0; t0 < kend; t0 += kKeys) {
    const int64_t nk = std::min<int64_t>(kKeys, kend - t0);
    for (int64_t j = 0; j < nk; ++j) {
      const kv_t* kr = kp + s.slots[t0 + j] * row + t.head * D;
      const kv_t* vr = vp + s.slots[t0 + j] * row + t.head * D;
      for (int d = 0; d < D; ++d) kf[j * D + d] = to_float(kr[d]), vf[j * D + d] = to_float(vr[d]);
    }
    for (int64_t i = 0; i < M; ++i) {
      const int64_t visible = std::min<int64_t>(nk, s.start + t.row0 + i / s.G + 1 - t0);
      if (visible <= 0) continue;
      const float* qi = q.data() + i * D;
      float mx = m[i];
      for (int64_t j = 0; j < visible; ++j) {
        float dot = 0.f;
        for (int d = 0; d < D; ++d) dot += qi[d] * kf[j * D + d];
        sc[j] = dot;
        mx = std::max(mx, dot);
      }
      const float corr = std::exp2(m[i] - mx);
      float* oi = o.data() + i * D;
      for (int d = 0; d < D; ++d) oi[d] *= corr;
      float sum = 0.f;
      for (int64_t j = 0; j < visible; ++j) {
        const float p = std::exp2(sc[j] - mx);
        sum += p;
        for (int d = 0; d < D; ++d) oi[d] += p * vf[j * D + d];
      }
      l[i] = l[i] * corr + sum;
      m[i] = mx;
    }
  }
  for (int64_t i = 0; i < M; ++i) {
    q_t* dst = op + ((t.row0 + i / s.G) * s.H + t.head * s.G + i % s.G) * D;
    const float inv = 1.f / l[i];
    for (int d = 0; d < D; ++d) dst[d] = static_cast<q_t>(o[i * D + d] * inv);
  }
}

#ifdef AGENTSERVE_BF16_MICRO
constexpr int kQ = 4;        // query vectors per micro tile
constexpr int kVecs = kKeys / 16;  // zmm of scores per query vector and tile
constexpr int kBlock = 4;  // zmm of scores per query vector in one register block (kQ * kBlock accumulators)

// 2^x for x <= 0 (x >= -127 after the clamp): 2^round(x) * p(f), |f| <= 0.5, p of degree 6
// (Taylor of e^(f ln 2); relative error ~2e-7, below bf16's and near fp32's rounding).
inline __m512 exp2_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-127.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// r[i] word j becomes r[j] word i (a 16 x 16 transpose of 32-bit words, in registers)
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

template <int D>
void micro_task(const Shape& s, const Task& t, const uint16_t* qp, const uint16_t* kp, const uint16_t* vp,
                uint16_t* op) {
  static_assert(D % 16 == 0, "D is a multiple of 16");
  constexpr int kPairs = D / 2, kDV = D / 16;
  const int64_t M = t.nrows * s.G, M4 = (M + kQ - 1) / kQ * kQ, row = s.KVH * D;
  const int64_t kend = s.start + t.row0 + t.nrows;
  // q: [M4][D] bf16 (padding rows zero); o: [M4][D] fp32; pos: the position of each vector
  // (padding: -1, sees nothing). kpack: [kPairs][kKeys] words; vpack: [kKeys / 2][D] words.
  std::vector<uint16_t> q(M4 * D, 0);
  std::vector<float> o(M4 * D, 0.f), m(M4, kMinusLarge), l(M4, 0.f);
  std::vector<int64_t> pos(M4, -1), group_last(M4 / kQ, -1);  // the latest position in each group
  alignas(64) uint32_t kpack[kPairs * kKeys];
  alignas(64) uint32_t vpack[(kKeys / 2) * D];
  alignas(64) uint16_t pbuf[kQ * kKeys];
  alignas(64) float sbuf[kQ * kKeys];
  for (int64_t i = 0; i < M; ++i) {
    std::memcpy(q.data() + i * D, qp + ((t.row0 + i / s.G) * s.H + t.head * s.G + i % s.G) * D, D * 2);
    pos[i] = s.start + t.row0 + i / s.G;
    group_last[i / kQ] = pos[i];  // positions rise with i
  }
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // interleave two rows of 32 bf16: out[2d] = a[d], out[2d + 1] = b[d]
  const __m512i lo_idx = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                           0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002a000a, 0x002b000b,
                                           0x002c000c, 0x002d000d, 0x002e000e, 0x002f000f);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  alignas(64) const uint16_t zero_row[D] = {};
  for (int64_t t0 = 0; t0 < kend; t0 += kKeys) {
    const int64_t nk = std::min<int64_t>(kKeys, kend - t0);
    // ask for the next tile's K and V rows now: their slots are scattered over the pool, so
    // without this a decode task (few query vectors, little arithmetic per tile) waited on
    // one cache miss after another (~3x slower with the pool cold, as it is in a real step)
    for (int64_t j = t0 + kKeys; j < std::min<int64_t>(kend, t0 + 2 * kKeys); ++j) {
      const char* kr = reinterpret_cast<const char*>(kp + s.slots[j] * row + t.head * D);
      const char* vr = reinterpret_cast<const char*>(vp + s.slots[j] * row + t.head * D);
      for (int b = 0; b < D * 2; b += 64) {
        _mm_prefetch(kr + b, _MM_HINT_T1);
        _mm_prefetch(vr + b, _MM_HINT_T1);
      }
    }
    // pack K: word (p, j) = K[j][2p .. 2p + 1]; keys past nk are zero (and masked below).
    // 16 keys at a time through 16 x 16 word transposes: with a decode step's few query
    // vectors, word-by-word packing cost more than the arithmetic it fed
    for (int64_t j0 = 0; j0 < kKeys; j0 += 16) {
      const uint32_t* kr[16];
      for (int j = 0; j < 16; ++j)
        kr[j] = reinterpret_cast<const uint32_t*>(j0 + j < nk ? kp + s.slots[t0 + j0 + j] * row + t.head * D : zero_row);
      if constexpr (kPairs % 16 == 0) {
        for (int c = 0; c < kPairs; c += 16) {
          __m512i r[16];
          for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(kr[j] + c);
          transpose16x16(r);
          for (int w = 0; w < 16; ++w) _mm512_store_si512(kpack + (c + w) * kKeys + j0, r[w]);
        }
      } else {
        for (int j = 0; j < 16; ++j)
          for (int p = 0; p < kPairs; ++p) kpack[p * kKeys + j0 + j] = kr[j][p];
      }
    }
    // pack V: word (jp, d) = (V[2jp][d], V[2jp + 1][d])
    for (int64_t jp = 0; jp < kKeys / 2; ++jp) {
      const int64_t j = 2 * jp;
      const uint16_t* a = j < nk ? vp + s.slots[t0 + j] * row + t.head * D : zero_row;
      const uint16_t* b = j + 1 < nk ? vp + s.slots[t0 + j + 1] * row + t.head * D : zero_row;
      if constexpr (D % 32 == 0) {
        for (int d0 = 0; d0 < D; d0 += 32) {
          const __m512i va = _mm512_loadu_si512(a + d0), vb = _mm512_loadu_si512(b + d0);
          _mm512_store_si512(vpack + jp * D + d0, _mm512_permutex2var_epi16(va, lo_idx, vb));
          _mm512_store_si512(vpack + jp * D + d0 + 16, _mm512_permutex2var_epi16(va, hi_idx, vb));
        }
      } else {  // D == 16: one half-width row each
        const __m512i va = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
        const __m512i vb = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
        _mm512_store_si512(vpack + jp * D, _mm512_permutex2var_epi16(va, lo_idx, vb));
      }
    }
    for (int64_t i0 = 0; i0 < M4; i0 += kQ) {
      if (group_last[i0 / kQ] < t0) continue;  // every vector's keys end before the tile
      // scores: sbuf[a][16c + lane] = q[i0 + a] . K[t0 + 16c + lane], accumulated in registers
      // (an accumulator array the softmax below also indexed was kept in memory by the compiler)
      const uint32_t* qw = reinterpret_cast<const uint32_t*>(q.data() + i0 * D);
      for (int c0 = 0; c0 < kVecs; c0 += kBlock) {
        __m512 acc[kQ][kBlock];
#pragma GCC unroll 16
        for (int a = 0; a < kQ; ++a)
#pragma GCC unroll 16
          for (int c = 0; c < kBlock; ++c) acc[a][c] = _mm512_setzero_ps();
        for (int p = 0; p < kPairs; ++p) {
          __m512i kv[kBlock];
#pragma GCC unroll 16
          for (int c = 0; c < kBlock; ++c) kv[c] = _mm512_load_si512(kpack + p * kKeys + 16 * (c0 + c));
#pragma GCC unroll 16
          for (int a = 0; a < kQ; ++a) {
            const __m512i qb = _mm512_set1_epi32(static_cast<int>(qw[a * kPairs + p]));
#pragma GCC unroll 16
            for (int c = 0; c < kBlock; ++c) acc[a][c] = dp(acc[a][c], qb, kv[c]);
          }
        }
#pragma GCC unroll 16
        for (int a = 0; a < kQ; ++a)
#pragma GCC unroll 16
          for (int c = 0; c < kBlock; ++c) _mm512_store_ps(sbuf + a * kKeys + 16 * (c0 + c), acc[a][c]);
      }
      float corr[kQ];
      for (int a = 0; a < kQ; ++a) {
        const int64_t visible = std::min<int64_t>(nk, pos[i0 + a] + 1 - t0);  // may be <= 0
        __m512 mx = _mm512_set1_ps(m[i0 + a]);
        __mmask16 keep[kVecs];
        __m512 sc[kVecs];
        const __m512 scale = _mm512_set1_ps(s.scale_log2);
        for (int c = 0; c < kVecs; ++c) {
          keep[c] = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16 * c)),
                                            _mm512_set1_epi32(static_cast<int>(std::max<int64_t>(visible, 0))));
          sc[c] = _mm512_maskz_mul_ps(keep[c], _mm512_load_ps(sbuf + a * kKeys + 16 * c), scale);
          mx = _mm512_mask_max_ps(mx, keep[c], mx, sc[c]);
        }
        const float m_new = _mm512_reduce_max_ps(mx);
        const __m512 mv = _mm512_set1_ps(m_new);
        __m512 sum = _mm512_setzero_ps();
        for (int c = 0; c < kVecs; ++c) sc[c] = _mm512_maskz_mov_ps(keep[c], exp2_neg(_mm512_sub_ps(sc[c], mv)));
        // the denominator sums the rounded probabilities PV uses, so the weights sum to one
        for (int c = 0; c < kVecs; c += 2) {
          const __m512i packed = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(sc[c + 1], sc[c]));
          _mm512_store_si512(pbuf + a * kKeys + 16 * c, packed);
          const __m512i lo = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(packed)), 16);
          const __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(packed, 1)), 16);
          sum = _mm512_add_ps(sum, _mm512_add_ps(_mm512_castsi512_ps(lo), _mm512_castsi512_ps(hi)));
        }
        corr[a] = std::exp2(m[i0 + a] - m_new);
        l[i0 + a] = l[i0 + a] * corr[a] + _mm512_reduce_add_ps(sum);
        m[i0 + a] = m_new;
      }
      // o[i0 + a] = o * corr + P V, four output vectors of 16 dims at a time
      const uint32_t* pw = reinterpret_cast<const uint32_t*>(pbuf);
      for (int v0 = 0; v0 < kDV; v0 += 4) {
        constexpr int kChunk = kDV < 4 ? kDV : 4;
        __m512 acc[kQ][kChunk];
        for (int a = 0; a < kQ; ++a)
          for (int c = 0; c < kChunk; ++c)
            acc[a][c] = _mm512_mul_ps(_mm512_loadu_ps(o.data() + (i0 + a) * D + 16 * (v0 + c)), _mm512_set1_ps(corr[a]));
        for (int jp = 0; jp < kKeys / 2; ++jp) {
          __m512i vv[kChunk];
          for (int c = 0; c < kChunk; ++c) vv[c] = _mm512_load_si512(vpack + jp * D + 16 * (v0 + c));
          for (int a = 0; a < kQ; ++a) {
            const __m512i pb = _mm512_set1_epi32(static_cast<int>(pw[a * (kKeys / 2) + jp]));
            for (int c = 0; c < kChunk; ++c) acc[a][c] = dp(acc[a][c], pb, vv[c]);
          }
        }
        for (int a = 0; a < kQ; ++a)
          for (int c = 0; c < kChunk; ++c) _mm512_storeu_ps(o.data() + (i0 + a) * D + 16 * (v0 + c), acc[a][c]);
      }
    }
  }
  for (int64_t i = 0; i < M; ++i) {
    uint16_t* dst = op + ((t.row0 + i / s.G) * s.H + t.head * s.G + i % s.G) * D;
    const __m512 inv = _mm512_set1_ps(1.f / l[i]);
    for (int d0 = 0; d0 < D; d0 += 16) {  // round to nearest even, as static_cast<BFloat16> does
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o.data() + i * D + d0), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d0), reinterpret_cast<const __m256i&>(h));
    }
  }
}
#endif

#ifdef AGENTSERVE_AVX2_MICRO
constexpr int kKeys2 = 64;  // keys per tile: K^T and V in fp32, 2 x 16 KiB at D = 64 (L1)
constexpr int kQ2 = 4;      // query vectors per micro tile

// 2^x for x <= 0 (x >= -127 after the clamp): 2^round(x) * p(f), |f| <= 0.5, p of degree 6, as
// exp2_neg above; the power of two is put together in the exponent bits (no scalef in AVX2).
inline __m256 exp2_neg8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-127.f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(1.5403530393381606e-4f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
  // n in [-127, 0]: 2^n as a float is (n + 127) << 23; n = -127 gives 0, below any real weight
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

template <int D>
inline void widen_row(const float* src, float* dst) { std::memcpy(dst, src, D * sizeof(float)); }
template <int D>
inline void widen_row(const at::BFloat16* src, float* dst) {
  const auto* b = reinterpret_cast<const uint16_t*>(src);
  for (int d = 0; d < D; d += 8) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + d));
    _mm256_storeu_ps(dst + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16)));
  }
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline float hsum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps(m, m, 1)));
}

// Scores of kQ2 query vectors (q, rows of D) against keys [j0, j0 + 16) of the packed K^T tile:
// s[a * kKeys2 + j0 + 0 .. 16). Eight named accumulators (GCC spilled an array of them).
template <int D>
inline void scores4x16(const float* q, const float* kt, int j0, float* s) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, e0 = a0, e1 = a0;
  for (int d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_load_ps(kt + d * kKeys2 + j0), k1 = _mm256_load_ps(kt + d * kKeys2 + j0 + 8);
    __m256 qb = _mm256_broadcast_ss(q + d);
    a0 = _mm256_fmadd_ps(qb, k0, a0), a1 = _mm256_fmadd_ps(qb, k1, a1);
    qb = _mm256_broadcast_ss(q + D + d);
    b0 = _mm256_fmadd_ps(qb, k0, b0), b1 = _mm256_fmadd_ps(qb, k1, b1);
    qb = _mm256_broadcast_ss(q + 2 * D + d);
    c0 = _mm256_fmadd_ps(qb, k0, c0), c1 = _mm256_fmadd_ps(qb, k1, c1);
    qb = _mm256_broadcast_ss(q + 3 * D + d);
    e0 = _mm256_fmadd_ps(qb, k0, e0), e1 = _mm256_fmadd_ps(qb, k1, e1);
  }
  _mm256_store_ps(s + j0, a0), _mm256_store_ps(s + j0 + 8, a1);
  _mm256_store_ps(s + kKeys2 + j0, b0), _mm256_store_ps(s + kKeys2 + j0 + 8, b1);
  _mm256_store_ps(s + 2 * kKeys2 + j0, c0), _mm256_store_ps(s + 2 * kKeys2 + j0 + 8, c1);
  _mm256_store_ps(s + 3 * kKeys2 + j0, e0), _mm256_store_ps(s + 3 * kKeys2 + j0 + 8, e1);
}

// o[a][d0 .. d0 + 16) = o * corr[a] + sum over j < nk of p[a][j] V[j][d0 .. d0 + 16), a < kQ2.
template <int D>
inline void pv4x16(const float* p, const float* vt, int64_t nk, int d0, const float* corr, float* o) {
  __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(o + d0), _mm256_set1_ps(corr[0]));
  __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(o + d0 + 8), _mm256_set1_ps(corr[0]));
  __m256 b0 = _mm256_mul_ps(_mm256_loadu_ps(o + D + d0), _mm256_set1_ps(corr[1]));
  __m256 b1 = _mm256_mul_ps(_mm256_loadu_ps(o + D + d0 + 8), _mm256_set1_ps(corr[1]));
  __m256 c0 = _mm256_mul_ps(_mm256_loadu_ps(o + 2 * D + d0), _mm256_set1_ps(corr[2]));
  __m256 c1 = _mm256_mul_ps(_mm256_loadu_ps(o + 2 * D + d0 + 8), _mm256_set1_ps(corr[2]));
  __m256 e0 = _mm256_mul_ps(_mm256_loadu_ps(o + 3 * D + d0), _mm256_set1_ps(corr[3]));
  __m256 e1 = _mm256_mul_ps(_mm256_loadu_ps(o + 3 * D + d0 + 8), _mm256_set1_ps(corr[3]));
  for (int64_t j = 0; j < nk; ++j) {
    const __m256 v0 = _mm256_load_ps(vt + j * D + d0), v1 = _mm256_load_ps(vt + j * D + d0 + 8);
    __m256 pb = _mm256_broadcast_ss(p + j);
    a0 = _mm256_fmadd_ps(pb, v0, a0), a1 = _mm256_fmadd_ps(pb, v1, a1);
    pb = _mm256_broadcast_ss(p + kKeys2 + j);
    b0 = _mm256_fmadd_ps(pb, v0, b0), b1 = _mm256_fmadd_ps(pb, v1, b1);
    pb = _mm256_broadcast_ss(p + 2 * kKeys2 + j);
    c0 = _mm256_fmadd_ps(pb, v0, c0), c1 = _mm256_fmadd_ps(pb, v1, c1);
    pb = _mm256_broadcast_ss(p + 3 * kKeys2 + j);
    e0 = _mm256_fmadd_ps(pb, v0, e0), e1 = _mm256_fmadd_ps(pb, v1, e1);
  }
  _mm256_storeu_ps(o + d0, a0), _mm256_storeu_ps(o + d0 + 8, a1);
  _mm256_storeu_ps(o + D + d0, b0), _mm256_storeu_ps(o + D + d0 + 8, b1);
  _mm256_storeu_ps(o + 2 * D + d0, c0), _mm256_storeu_ps(o + 2 * D + d0 + 8, c1);
  _mm256_storeu_ps(o + 3 * D + d0, e0), _mm256_storeu_ps(o + 3 * D + d0 + 8, e1);
}

template <typename kv_t, int D>
void avx2_task(const Shape& s, const Task& t, const float* qp, const kv_t* kp, const kv_t* vp, float* op) {
  static_assert(D % 16 == 0, "D is a multiple of 16");
  const int64_t M = t.nrows * s.G, M4 = (M + kQ2 - 1) / kQ2 * kQ2, row = s.KVH * D;
  const int64_t kend = s.start + t.row0 + t.nrows;
  // q: [M4][D] scaled by scale * log2(e) (padding vectors zero); o: [M4][D]; pos: each vector's
  // position (padding: -1, sees nothing); group_last: the latest position in each micro tile
  std::vector<float> q(M4 * D, 0.f), o(M4 * D, 0.f), m(M4, kMinusLarge), l(M4, 0.f);
  std::vector<int64_t> pos(M4, -1), group_last(M4 / kQ2, -1);
  alignas(32) float kt[D * kKeys2];
  alignas(32) float vt[kKeys2 * D];
  alignas(32) float sbuf[kQ2 * kKeys2];
  alignas(32) float wide[D];
  for (int64_t i = 0; i < M; ++i) {
    const float* src = qp + ((t.row0 + i / s.G) * s.H + t.head * s.G + i % s.G) * D;
    for (int d = 0; d < D; ++d) q[i * D + d] = src[d] * s.scale_log2;
    pos[i] = s.start + t.row0 + i / s.G;
    group_last[i / kQ2] = pos[i];  // positions rise with i
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t t0 = 0; t0 < kend; t0 += kKeys2) {
    const int64_t nk = std::min<int64_t>(kKeys2, kend - t0);
    // the next tile's rows are scattered over the pool: ask for them now (see micro_task)
    for (int64_t j = t0 + kKeys2; j < std::min<int64_t>(kend, t0 + 2 * kKeys2); ++j) {
      const char* kr = reinterpret_cast<const char*>(kp + s.slots[j] * row + t.head * D);
      const char* vr = reinterpret_cast<const char*>(vp + s.slots[j] * row + t.head * D);
      for (size_t b = 0; b < D * sizeof(kv_t); b += 64) {
        _mm_prefetch(kr + b, _MM_HINT_T1);
        _mm_prefetch(vr + b, _MM_HINT_T1);
      }
    }
    // pack: kt[d][j] = K[t0 + j][d], vt[j][d] = V[t0 + j][d]; keys past nk are zero
    for (int64_t j = 0; j < kKeys2; ++j) {
      if (j < nk) {
        widen_row<D>(kp + s.slots[t0 + j] * row + t.head * D, wide);
        for (int d = 0; d < D; ++d) kt[d * kKeys2 + j] = wide[d];
        widen_row<D>(vp + s.slots[t0 + j] * row + t.head * D, vt + j * D);
      } else {
        for (int d = 0; d < D; ++d) kt[d * kKeys2 + j] = 0.f;
        std::memset(vt + j * D, 0, D * sizeof(float));
      }
    }
    for (int64_t i0 = 0; i0 < M4; i0 += kQ2) {
      if (group_last[i0 / kQ2] < t0) continue;  // every vector's keys end before the tile
      for (int j0 = 0; j0 < kKeys2; j0 += 16) scores4x16<D>(q.data() + i0 * D, kt, j0, sbuf);
      float corr[kQ2];
      for (int a = 0; a < kQ2; ++a) {
        const int64_t visible = std::max<int64_t>(0, std::min<int64_t>(nk, pos[i0 + a] + 1 - t0));
        const __m256i vis = _mm256_set1_epi32(static_cast<int>(visible));
        float* sa = sbuf + a * kKeys2;
        __m256 mx = _mm256_set1_ps(m[i0 + a]);
        for (int c = 0; c < kKeys2; c += 8) {
          const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(vis, _mm256_add_epi32(lane, _mm256_set1_epi32(c))));
          mx = _mm256_max_ps(mx, _mm256_blendv_ps(mx, _mm256_load_ps(sa + c), keep));
        }
        const float m_new = hmax8(mx);
        const __m256 mv = _mm256_set1_ps(m_new);
        __m256 sum = _mm256_setzero_ps();
        for (int c = 0; c < kKeys2; c += 8) {
          const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(vis, _mm256_add_epi32(lane, _mm256_set1_epi32(c))));
          const __m256 p = _mm256_and_ps(exp2_neg8(_mm256_sub_ps(_mm256_load_ps(sa + c), mv)), keep);
          _mm256_store_ps(sa + c, p);
          sum = _mm256_add_ps(sum, p);
        }
        corr[a] = std::exp2(m[i0 + a] - m_new);
        l[i0 + a] = l[i0 + a] * corr[a] + hsum8(sum);
        m[i0 + a] = m_new;
      }
      for (int d0 = 0; d0 < D; d0 += 16) pv4x16<D>(sbuf, vt, nk, d0, corr, o.data() + i0 * D);
    }
  }
  for (int64_t i = 0; i < M; ++i) {
    float* dst = op + ((t.row0 + i / s.G) * s.H + t.head * s.G + i % s.G) * D;
    const float inv = 1.f / l[i];
    for (int d = 0; d < D; ++d) dst[d] = o[i * D + d] * inv;
  }
}
#endif

template <typename F>
void run_tasks(const std::vector<Task>& tasks, F&& body) {
  const int64_t n = static_cast<int64_t>(tasks.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::max<int64_t>(1, std::min<int64_t>(n, at::get_num_threads())))
  for (int64_t k = 0; k < n; ++k) body(tasks[k]);
}

template <typename q_t, typename kv_t, int D>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
         int64_t start, float scale, at::Tensor& out) {
  const int64_t rows = q.size(0), H = q.size(1), KVH = k_cache.size(1);
  const Shape s{rows, H, KVH, H / KVH, start, slots.data_ptr<int64_t>(), scale * kLog2e};
  const auto tasks = tasks_longest_first(rows, KVH);
  const q_t* qp = q.data_ptr<q_t>();
  const kv_t* kp = k_cache.data_ptr<kv_t>();
  const kv_t* vp = v_cache.data_ptr<kv_t>();
  q_t* op = out.data_ptr<q_t>();
#ifdef AGENTSERVE_BF16_MICRO
  if constexpr (std::is_same_v<q_t, at::BFloat16> && std::is_same_v<kv_t, at::BFloat16> && D % 16 == 0) {
    const auto* q16 = reinterpret_cast<const uint16_t*>(qp);
    const auto* k16 = reinterpret_cast<const uint16_t*>(kp);
    const auto* v16 = reinterpret_cast<const uint16_t*>(vp);
    auto* o16 = reinterpret_cast<uint16_t*>(op);
    run_tasks(tasks, [&](const Task& t) { micro_task<D>(s, t, q16, k16, v16, o16); });
    return;
  }
#endif
#ifdef AGENTSERVE_AVX2_MICRO
  if constexpr (std::is_same_v<q_t, float> && D % 16 == 0) {
    run_tasks(tasks, [&](const Task& t) { avx2_task<kv_t, D>(s, t, qp, kp, vp, op); });
    return;
  }
#endif
  run_tasks(tasks, [&](const Task& t) { generic_task<q_t, kv_t, D>(s, t, qp, kp, vp, op); });
}

#ifdef AGENTSERVE_BF16_MICRO
// Decode: one query row per sequence, each a one-row chunk at position lens[b] - 1 over its own
// slots row. A task is (sequence, KV head): the G query heads sharing the KV head are the
// micro kernel's query vectors, so each packed tile of keys serves G of them.
template <int D>
void decode_run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
                const at::Tensor& lens, float scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), KVH = k_cache.size(1), L = slots.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  std::vector<int64_t> order(B);
  for (int64_t b = 0; b < B; ++b) order[b] = b;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return lp[a] > lp[b]; });  // longest first
  std::vector<Task> tasks;  // Task.row0 carries the sequence here (each sequence is a one-row chunk)
  for (const int64_t b : order)
    for (int64_t h = 0; h < KVH; ++h) tasks.push_back({h, b, 1});
  const auto* q16 = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* k16 = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* v16 = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  auto* o16 = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  run_tasks(tasks, [&](const Task& t) {
    const int64_t b = t.row0;
    const Shape s{1, H, KVH, H / KVH, lp[b] - 1, sp + b * L, scale * kLog2e};
    micro_task<D>(s, Task{t.head, 0, 1}, q16 + b * H * D, k16, v16, o16 + b * H * D);
  });
}
#endif

template <typename q_t, typename kv_t>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                  int64_t start, float scale, at::Tensor& out) {
  switch (q.size(2)) {  // keep in step with HEAD_DIMS in cpu_kernels.py
    case 16: return run<q_t, kv_t, 16>(q, k, v, slots, start, scale, out);
    case 32: return run<q_t, kv_t, 32>(q, k, v, slots, start, scale, out);
    case 64: return run<q_t, kv_t, 64>(q, k, v, slots, start, scale, out);
    case 128: return run<q_t, kv_t, 128>(q, k, v, slots, start, scale, out);
    default: TORCH_CHECK(false, "prefill_attention: head_dim ", q.size(2), " not compiled (16, 32, 64, 128)");
  }
}

}  // namespace prefill

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& slots, int64_t start, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(slots.is_contiguous() && slots.scalar_type() == at::kLong && slots.dim() == 1, "int64 slots [context]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches of one dtype");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() ||
              (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16),
              "q of the caches' dtype, or fp32 over bf16 caches");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && q.size(2) == k_cache.size(2), "q [rows, H, D], cache [S, KVH, D]");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(start >= 0 && slots.size(0) == start + q.size(0), "slots: the context, start + rows of them");
  auto out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  if (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16) {
    prefill::dispatch_dim<float, at::BFloat16>(q, k_cache, v_cache, slots, start, static_cast<float>(scale), out);
  } else if (q.scalar_type() == at::kFloat) {
    prefill::dispatch_dim<float, float>(q, k_cache, v_cache, slots, start, static_cast<float>(scale), out);
  } else if (q.scalar_type() == at::kBFloat16) {
    prefill::dispatch_dim<at::BFloat16, at::BFloat16>(q, k_cache, v_cache, slots, start, static_cast<float>(scale), out);
  } else {
    TORCH_CHECK(false, "prefill_attention: dtype ", q.scalar_type(), " not supported (float32, bfloat16)");
  }
  return out;
}

bool has_avx2_attention() {
#ifdef AGENTSERVE_AVX2_MICRO
  return true;
#else
  return false;
#endif
}

bool has_bf16_micro_kernel() {
#ifdef AGENTSERVE_BF16_MICRO
  return true;
#else
  return false;
#endif
}

// Decode attention in bf16 through the prefill micro kernel (one-row chunks): q [B, H, D],
// caches [slots, KVH, D], slots [B, L] (row b's first lens[b] are its context), lens [B].
at::Tensor decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& slots, const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(slots.is_contiguous() && lens.is_contiguous(), "contiguous slots and lens");
  TORCH_CHECK(slots.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "int64 slots and lens");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
              v_cache.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && q.size(2) == k_cache.size(2), "q [B, H, D], cache [S, KVH, D]");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == q.size(0) && lens.size(0) == q.size(0), "one slots row and length per query");
  auto out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  const int64_t* lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) TORCH_CHECK(lp[b] >= 1 && lp[b] <= slots.size(1), "lengths in [1, L]");
#ifdef AGENTSERVE_BF16_MICRO
  switch (q.size(2)) {  // keep in step with HEAD_DIMS in cpu_kernels.py
    case 16: prefill::decode_run<16>(q, k_cache, v_cache, slots, lens, static_cast<float>(scale), out); break;
    case 32: prefill::decode_run<32>(q, k_cache, v_cache, slots, lens, static_cast<float>(scale), out); break;
    case 64: prefill::decode_run<64>(q, k_cache, v_cache, slots, lens, static_cast<float>(scale), out); break;
    case 128: prefill::decode_run<128>(q, k_cache, v_cache, slots, lens, static_cast<float>(scale), out); break;
    default: TORCH_CHECK(false, "decode_attention_bf16: head_dim ", q.size(2), " not compiled (16, 32, 64, 128)");
  }
#else
  TORCH_CHECK(false, "compiled without AVX512-BF16");
#endif
  return out;
}
