// The few-row linear layers of decode: y[M, N] = x[M, K] W[N, K]^T (+ b[N]) in bf16, for M up
// to kMaxRows rows (one per sequence being decoded).
//
// Why: with M this small every weight is read once per step and used M times, so the step is
// bound by memory bandwidth, not arithmetic. Two cores here stream ~38 GB/s from DRAM; oneDNN's
// few-row matmul reached 16-27 GB/s, and linear layers were ~80% of a decode step.
//
// How: W is read in its own row-major layout, as one sequential stream per thread (each thread
// takes a contiguous range of weight rows), with software prefetch ahead of the loads (the
// hardware prefetcher alone left it at ~20 GB/s). Each weight row is dotted with every input
// row: per 32 values one load of W and one VDPBF16PS per input row, fp32 accumulators in
// registers, input rows taken 4 at a time with 2 accumulators each (fewer rows, more each).
// The input rows are re-read from L1 for every weight row, so the kernel is worth it only while
// they fit there beside the stream: small_linear_rows(K) says how many rows that is.
//
// The weight stays row-major in memory next to oneDNN's packed copy (used for more rows, where
// it reuses W better): one more copy of the weights, the price of ~1.3x faster decode steps.
//
// Arithmetic: bf16 pairs multiplied and accumulated in fp32, the bias added in fp32, one
// rounding to bf16 (nearest even) at the end. The order of the fp32 sums differs from oneDNN's,
// so results may differ from F.linear in the last bf16 bit (tested against an fp64 reference,
// with an error no larger than F.linear's own).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define AGENTSERVE_BF16_GEMV 1
#endif

namespace small_linear {

constexpr int64_t kMaxRows = 8;  // past this oneDNN's packed matmul reuses W better (its own layout)
constexpr int64_t kL1Values = 8192;  // bf16 values of input rows worth keeping in L1 (16 KiB)

#ifdef AGENTSERVE_BF16_GEMV
constexpr int64_t kPrefetchValues = 1024;  // 2 KiB ahead in the weight stream

inline __m512bh load32(const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline __m512bh load_tail(const at::BFloat16* p, int64_t left) {  // left < 32 values, rest zero
  return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ULL << left) - 1), p);
}

// out[j] = dot(w[0 .. K), x[j * K + 0 .. K)) for j < MM; pf is prefetched alongside
// w. U accumulators per input row hide VDPBF16PS's latency when MM is small.
template <int MM, int U>
inline void row_dot(const at::BFloat16* w, const at::BFloat16* pf, const at::BFloat16* x, int64_t K,
                    float* out) {
  __m512 acc[U][MM];
  for (int u = 0; u < U; ++u)
    for (int j = 0; j < MM; ++j) acc[u][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 * U <= K; k += 32 * U) {
    for (int u = 0; u < U; ++u)  // one 64-byte line per 32 values
      _mm_prefetch(reinterpret_cast<const char*>(pf + k + 32 * u), _MM_HINT_T0);
    for (int u = 0; u < U; ++u) {
      const __m512bh wv = load32(w + k + 32 * u);
      for (int j = 0; j < MM; ++j) acc[u][j] = _mm512_dpbf16_ps(acc[u][j], wv, load32(x + j * K + k + 32 * u));
    }
  }
  for (; k < K; k += 32) {
    const int64_t left = K - k;
    const __m512bh wv = left >= 32 ? load32(w + k) : load_tail(w + k, left);
    for (int j = 0; j < MM; ++j) {
      const __m512bh xv = left >= 32 ? load32(x + j * K + k) : load_tail(x + j * K + k, left);
      acc[0][j] = _mm512_dpbf16_ps(acc[0][j], wv, xv);
    }
  }
  for (int j = 0; j < MM; ++j) {
    __m512 s = acc[0][j];
    for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[u][j]);
    out[j] = _mm512_reduce_add_ps(s);
  }
}

// one weight row against all M input rows
inline void row_all(const at::BFloat16* w, const at::BFloat16* x, int64_t M, int64_t K, float* out) {
  const at::BFloat16* pf = w + kPrefetchValues;
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) row_dot<4, 2>(w, pf, x + m * K, K, out + m);
  const at::BFloat16* xm = x + m * K;
  switch (M - m) {
    case 3: row_dot<3, 1>(w, pf, xm, K, out + m); break;
    case 2: row_dot<2, 2>(w, pf, xm, K, out + m); break;
    case 1: row_dot<1, 4>(w, pf, xm, K, out + m); break;
    default: break;
  }
}

// weight rows [n0, n1) against every input row
inline void rows(const at::BFloat16* x, const at::BFloat16* w, const float* bias, at::BFloat16* y,
                 int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  float out[kMaxRows];
  for (int64_t n = n0; n < n1; ++n) {
    row_all(w + n * K, x, M, K, out);
    const float b = bias != nullptr ? bias[n] : 0.0f;
    for (int64_t j = 0; j < M; ++j) y[j * N + n] = at::BFloat16(out[j] + b);  // nearest even
  }
}
#endif

}  // namespace small_linear

bool has_bf16_small_linear() {
#ifdef AGENTSERVE_BF16_GEMV
  return true;
#else
  return false;
#endif
}

// The most rows worth sending here for inputs of width K: while M input rows of K values fit
// in L1 (16 KiB), and 2 always. Measured against oneDNN's packed matmul on Qwen2.5-0.5B's shapes
// here: 1.1-2.2x at 1-2 rows, 0.9-2x at 4-8 rows for K = 896; for K = 4,864 1.2x at 1-2 rows and
// 0.6-0.8x at 4 or more (the input rows no longer fit in L1).
int64_t small_linear_rows(int64_t K) {
  using namespace small_linear;
  return std::min<int64_t>(kMaxRows, std::max<int64_t>(2, kL1Values / std::max<int64_t>(K, 1)));
}

at::Tensor small_linear_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  using namespace small_linear;
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.size(0) <= kMaxRows, "at most ", kMaxRows, " rows");
#ifndef AGENTSERVE_BF16_GEMV
  TORCH_CHECK(false, "compiled without AVX512-BF16");
  return x;
#else
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  at::Tensor b32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bias [N] expected");
    b32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, N}, xc.options());
  if (M == 0) return y;  // a step whose rows all belong to unfinished prefill chunks
  const auto* xp = xc.data_ptr<at::BFloat16>();
  const auto* wp = wc.data_ptr<at::BFloat16>();
  const float* bp = bias.has_value() ? b32.data_ptr<float>() : nullptr;
  auto* yp = y.data_ptr<at::BFloat16>();
  // one contiguous range of weight rows per thread: one sequential stream through W each
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, N, (N + threads - 1) / threads, [&](int64_t n0, int64_t n1) {
    rows(xp, wp, bp, yp, M, K, N, n0, n1);
  });
  return y;
#endif
}
