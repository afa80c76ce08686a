// The few-row linear layers of decode on CPUs without a bf16 dot product (AVX2 and FMA, as on
// AMD Zen 2/3 and most client CPUs): y[M, N] = x[M, K] W[N, K]^T (+ b[N]) with x, b and y in
// fp32 and the weight W kept in bf16, widened to fp32 in registers as it is read.
//
// Why: on such a CPU oneDNN's bf16 matmul is emulated (~20 GFLOP/s here against ~160 for fp32),
// so bf16 weights are served by fp32 arithmetic. Decode steps read every weight once and use it
// M times: bound by memory bandwidth at a few rows, so the weight stays bf16 in memory (half the
// bytes of an fp32 copy) and is widened in registers, where a bf16 value is the high half of an
// fp32 one.
//
// Layout (pack_pairs in Python): weight rows in pairs, interleaved value by value, [N/2][K][2]
// (an odd N padded with a zero row). Read as 32-bit lanes, lane k of a pair holds row 2p's value
// k in its low half and row 2p+1's in its high half, so one 32-byte load gives 8 values of both
// rows: AND with 0xffff0000 widens the odd row, a 16-bit shift left the even one, and both line
// up with the same 8 values of an input row.
//
// How: each thread takes one contiguous range of pairs, one sequential stream with software
// prefetch ahead of it. A pair goes against input rows four at a time (8 accumulators: enough to
// cover FMA latency on two FMA ports; one input vector serves both rows). Fewer input rows unroll
// along K instead. More than four input rows re-read the pair from L1.
//
// Arithmetic: a bf16 times an fp32 value, rounded once in the FMA; fp32 sums in another order
// than a BLAS's; the bias added in fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define AGENTSERVE_WIDENED_AVX2 1
#endif

namespace widened {

constexpr int64_t kPrefetchLanes = 512;  // 2 KiB ahead in the pair stream

inline float widen1(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Both rows of a pair (lanes of 32 bits) against one input row, values [k0, K): the tails and
// the portable path.
inline void pair_tail(const uint32_t* p, const float* x, int64_t k0, int64_t K, float& even, float& odd) {
  for (int64_t k = k0; k < K; ++k) {
    even += widen1(uint16_t(p[k] & 0xffffu)) * x[k];
    odd += widen1(uint16_t(p[k] >> 16)) * x[k];
  }
}

#ifdef AGENTSERVE_WIDENED_AVX2
inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// out[2 * j] = dot(row 2p, x_j), out[2 * j + 1] = dot(row 2p + 1, x_j) for MM input rows
// (x + j * K). The main loop takes 32 values (two 64-byte lines of the pair, prefetched ahead) in
// four steps of 8 over U sets of accumulators; the rest of K8 = K rounded down to 8 goes 8 at a
// time, the last K - K8 values to the scalar tail. No branch in the main loop: with one there,
// GCC kept the accumulators on the stack across it.
template <int MM, int U>
inline void pair_tile(const uint32_t* p, const uint32_t* pf, const float* x, int64_t K, float* out) {
  static_assert(4 % U == 0, "the four steps of 32 values go round U accumulator sets");
  const __m256i high = _mm256_set1_epi32(int(0xffff0000u));
  __m256 ev[U][MM], od[U][MM];
  for (int u = 0; u < U; ++u)
    for (int j = 0; j < MM; ++j) ev[u][j] = od[u][j] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7), K32 = K & ~int64_t(31);
  int64_t k = 0;
  for (; k < K32; k += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(pf + k), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(pf + k + 16), _MM_HINT_T0);
    for (int step = 0; step < 4; ++step) {
      const int u = step % U;
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k + 8 * step));
      const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
      for (int j = 0; j < MM; ++j) {
        const __m256 xv = _mm256_loadu_ps(x + j * K + k + 8 * step);
        ev[u][j] = _mm256_fmadd_ps(we, xv, ev[u][j]);
        od[u][j] = _mm256_fmadd_ps(wo, xv, od[u][j]);
      }
    }
  }
  for (; k < K8; k += 8) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k));
    const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
    for (int j = 0; j < MM; ++j) {
      const __m256 xv = _mm256_loadu_ps(x + j * K + k);
      ev[0][j] = _mm256_fmadd_ps(we, xv, ev[0][j]);
      od[0][j] = _mm256_fmadd_ps(wo, xv, od[0][j]);
    }
  }
  for (int j = 0; j < MM; ++j) {
    __m256 e = ev[0][j], o = od[0][j];
    for (int u = 1; u < U; ++u) e = _mm256_add_ps(e, ev[u][j]), o = _mm256_add_ps(o, od[u][j]);
    float te = 0.f, to = 0.f;
    pair_tail(p, x + j * K, K8, K, te, to);
    out[2 * j] = hsum(e) + te;
    out[2 * j + 1] = hsum(o) + to;
  }
}

// pair_tile<4, 1> with its eight accumulators as named variables: as an array GCC 12 kept some on
// the stack and re-stored them every iteration (the kernel then ran at ~70 GFLOP/s of ~190).
inline void pair_tile4(const uint32_t* p, const uint32_t* pf, const float* x, int64_t K, float* out) {
  const __m256i high = _mm256_set1_epi32(int(0xffff0000u));
  __m256 e0 = _mm256_setzero_ps(), e1 = e0, e2 = e0, e3 = e0, o0 = e0, o1 = e0, o2 = e0, o3 = e0;
  const float *x0 = x, *x1 = x + K, *x2 = x + 2 * K, *x3 = x + 3 * K;
  const int64_t K8 = K & ~int64_t(7), K32 = K & ~int64_t(31);
  // a macro, not a lambda: a lambda taking the accumulators by reference put them in memory
#define WIDENED_STEP(at)                                                                     \
  do {                                                                                       \
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + (at)));     \
    const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));                       \
    const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(raw, high));                      \
    __m256 xv = _mm256_loadu_ps(x0 + (at));                                                  \
    e0 = _mm256_fmadd_ps(we, xv, e0), o0 = _mm256_fmadd_ps(wo, xv, o0);                      \
    xv = _mm256_loadu_ps(x1 + (at));                                                         \
    e1 = _mm256_fmadd_ps(we, xv, e1), o1 = _mm256_fmadd_ps(wo, xv, o1);                      \
    xv = _mm256_loadu_ps(x2 + (at));                                                         \
    e2 = _mm256_fmadd_ps(we, xv, e2), o2 = _mm256_fmadd_ps(wo, xv, o2);                      \
    xv = _mm256_loadu_ps(x3 + (at));                                                         \
    e3 = _mm256_fmadd_ps(we, xv, e3), o3 = _mm256_fmadd_ps(wo, xv, o3);                      \
  } while (0)
  int64_t k = 0;
  for (; k < K32; k += 32) {
    _mm_prefetch(reinterpret_cast<const char*>(pf + k), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(pf + k + 16), _MM_HINT_T0);
    WIDENED_STEP(k);
    WIDENED_STEP(k + 8);
    WIDENED_STEP(k + 16);
    WIDENED_STEP(k + 24);
  }
  for (; k < K8; k += 8) WIDENED_STEP(k);
#undef WIDENED_STEP
  const __m256 acc[8] = {e0, o0, e1, o1, e2, o2, e3, o3};
  for (int j = 0; j < 4; ++j) {
    float te = 0.f, to = 0.f;
    pair_tail(p, x + j * K, K8, K, te, to);
    out[2 * j] = hsum(acc[2 * j]) + te;
    out[2 * j + 1] = hsum(acc[2 * j + 1]) + to;
  }
}
#endif

// One pair against every input row: out[2 * j + r] for row 2p + r and input row j.
inline void pair_all(const uint32_t* p, const float* x, int64_t M, int64_t K, float* out) {
#ifdef AGENTSERVE_WIDENED_AVX2
  const uint32_t* pf = p + kPrefetchLanes;
  for (int64_t m = 0; m < M; m += 4) {
    const float* xm = x + m * K;
    float* om = out + 2 * m;
    switch (std::min<int64_t>(4, M - m)) {
      case 4: pair_tile4(p, pf, xm, K, om); break;
      case 3: pair_tile<3, 1>(p, pf, xm, K, om); break;
      case 2: pair_tile<2, 2>(p, pf, xm, K, om); break;
      default: pair_tile<1, 4>(p, pf, xm, K, om); break;
    }
    pf = p;  // the pair is in L1 after the first group: nothing further to fetch
  }
#else
  for (int64_t j = 0; j < M; ++j) {
    float e = 0.f, o = 0.f;
    pair_tail(p, x + j * K, 0, K, e, o);
    out[2 * j] = e, out[2 * j + 1] = o;
  }
#endif
}

}  // namespace widened

bool has_avx2_widened_linear() {
#ifdef AGENTSERVE_WIDENED_AVX2
  return true;
#else
  return false;
#endif
}

// x: [M, K] fp32; w: [ceil(N / 2), K, 2] bf16, the weight's rows in interleaved pairs; n: N;
// bias: [N] fp32 or none -> [M, N] fp32.
at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, const c10::optional<at::Tensor>& bias) {
  using namespace widened;
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3 && w.size(2) == 2 && x.size(1) == w.size(1),
              "x [M, K] and w [ceil(N / 2), K, 2] expected");
  TORCH_CHECK(n >= 0 && (n + 1) / 2 == w.size(0), "n must be the weight's row count: w holds ceil(n / 2) pairs");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kBFloat16, "x fp32 and w bf16 expected");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && w.is_contiguous(), "CPU tensors, w contiguous");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), pairs = w.size(0);
  at::Tensor bc;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat, "bias fp32 [N] expected");
    bc = bias->contiguous();
  }
  at::Tensor y = at::empty({M, n}, xc.options());
  if (M == 0 || n == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint32_t*>(w.data_ptr<at::BFloat16>());
  const float* bp = bias.has_value() ? bc.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // one contiguous range of pairs per thread: one sequential stream through W
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, pairs, (pairs + threads - 1) / threads, [&](int64_t p0, int64_t p1) {
    std::vector<float> part(2 * M);
    for (int64_t p = p0; p < p1; ++p) {
      pair_all(wp + p * K, xp, M, K, part.data());
      for (int r = 0; r < 2 && 2 * p + r < n; ++r) {
        const int64_t row = 2 * p + r;
        const float b = bp != nullptr ? bp[row] : 0.f;
        for (int64_t j = 0; j < M; ++j) yp[j * n + row] = part[2 * j + r] + b;
      }
    }
  });
  return y;
}
