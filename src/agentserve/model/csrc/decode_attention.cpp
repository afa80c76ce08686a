// Decode attention over the paged KV pool, read in place: one query token per sequence.
//
// q: [B, H, D]; k_cache, v_cache: [slots, KVH, D]; slots: [B, L] int64 (row b's first lens[b]
// entries are its context); lens: [B] int64 -> out: [B, H, D], same dtype as q.
// One task per (sequence, KV head), run by ATen's intra-op thread pool: the task's H / KVH
// query heads share every K and V row it loads. Online softmax over tiles of the context, all
// arithmetic in fp32 (bf16 rows are widened as they are read), so the numerics are those of
// torch's flash kernel without its gather and per-call overheads. Built with -ffast-math for
// vectorized exp: no infinities are used (the running max starts at a large negative finite
// value, and each row stops at its length instead of being masked).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kTile = 128;
constexpr float kMinusLarge = -1e30f;
// Keys ahead whose K row is asked for while this one is scored. Rows sit in 16-slot blocks
// scattered over the pool: the hardware prefetcher loses the stream at every block, and without
// this the loads of K and V rows took ~45% of a decode call (perf, 4 x 8k contexts).
constexpr int64_t kAhead = 16;
// A task's fixed cost (its queries, the output, the setup), in keys' worth, for the partition.
constexpr int64_t kTaskOverhead = 16;

template <typename kv_t, int D>
inline void prefetch_row(const kv_t* p) {
  const char* c = reinterpret_cast<const char*>(p);
  for (size_t b = 0; b < D * sizeof(kv_t); b += 64) __builtin_prefetch(c + b, 0, 3);
}

// Widen one row to fp32. bf16 is the high half of an fp32: a shift the compiler vectorizes.
template <int D>
inline void widen(const float* src, float* dst) {
  for (int d = 0; d < D; ++d) dst[d] = src[d];
}
template <int D>
inline void widen(const at::BFloat16* src, float* dst) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t wide[D];
  for (int d = 0; d < D; ++d) wide[d] = static_cast<uint32_t>(bits[d]) << 16;
  std::memcpy(dst, wide, sizeof(wide));
}

// q_t: the queries' and the output's type; kv_t: the cache's (fp32 queries over a bf16 cache on
// CPUs that compute bf16 models in fp32).
template <typename q_t, typename kv_t, int D>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
         const at::Tensor& slots, const at::Tensor& lens, float scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), KVH = k_cache.size(1), G = H / KVH, L = slots.size(1);
  const q_t* qp = q.data_ptr<q_t>();
  const kv_t* kp = k_cache.data_ptr<kv_t>();
  const kv_t* vp = v_cache.data_ptr<kv_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  q_t* op = out.data_ptr<q_t>();
  const int64_t row = KVH * D;  // elements between consecutive slots
  // Tasks go to threads in contiguous runs of about equal work (keys read), not of equal count:
  // a task's cost is its sequence's length, and a batch mixes long contexts with short ones (a
  // request joining long-running streams). By count, 4 sequences of 3k keys and a 5th of 60
  // split 8 / 7 tasks over 2 threads, 2.67 sequences' reads against 1.33, and the step waited
  // for the heavier thread. Each task goes to the run that holds its midpoint in the work's
  // prefix sum, so runs are contiguous and each is off the even share by at most half a task.
  const int64_t tasks = B * KVH;
  const int64_t runs = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  std::vector<int64_t> first(runs + 1, tasks);  // run r computes tasks [first[r], first[r + 1])
  {
    double total = 0;
    for (int64_t b = 0; b < B; ++b) total += static_cast<double>(KVH) * (lp[b] + kTaskOverhead);
    double before = 0;
    int64_t r = 0;
    first[0] = 0;
    for (int64_t task = 0; task < tasks; ++task) {
      const double cost = lp[task / KVH] + kTaskOverhead;
      const int64_t mine = std::min<int64_t>(runs - 1, static_cast<int64_t>((before + cost / 2) * runs / total));
      while (r < mine) first[++r] = task;
      before += cost;
    }
  }
  at::parallel_for(0, runs, 1, [&](int64_t run_begin, int64_t run_end) {
    std::vector<float> qf(G * D), acc(G * D), s(G * kTile), m(G), l(G);
    alignas(64) float kv[D];
    for (int64_t task = first[run_begin]; task < first[run_end]; ++task) {
      const int64_t b = task / KVH, h = task % KVH, n = lp[b];
      const int64_t* ctx = sp + b * L;
      for (int64_t g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(qp[(b * H + h * G + g) * D + d]) * scale;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), kMinusLarge);
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t t0 = 0; t0 < n; t0 += kTile) {
        const int64_t nt = std::min<int64_t>(kTile, n - t0);
        for (int64_t t = 0; t < nt; ++t) {  // scores of every query head against this key
          if (t + kAhead < n - t0) prefetch_row<kv_t, D>(kp + ctx[t0 + t + kAhead] * row + h * D);
          prefetch_row<kv_t, D>(vp + ctx[t0 + t] * row + h * D);  // read by the PV loop below
          widen<D>(kp + ctx[t0 + t] * row + h * D, kv);
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float dot = 0.f;
            for (int d = 0; d < D; ++d) dot += qg[d] * kv[d];
            s[g * kTile + t] = dot;
          }
        }
        for (int64_t g = 0; g < G; ++g) {  // online softmax: rescale what came before
          float* sg = s.data() + g * kTile;
          float mx = m[g];
          for (int64_t t = 0; t < nt; ++t) mx = std::max(mx, sg[t]);
          const float corr = std::exp(m[g] - mx);
          float sum = 0.f;
          for (int64_t t = 0; t < nt; ++t) {
            sg[t] = std::exp(sg[t] - mx);
            sum += sg[t];
          }
          l[g] = l[g] * corr + sum;
          m[g] = mx;
          float* ag = acc.data() + g * D;
          for (int d = 0; d < D; ++d) ag[d] *= corr;
        }
        for (int64_t t = 0; t < nt; ++t) {
          widen<D>(vp + ctx[t0 + t] * row + h * D, kv);
          for (int64_t g = 0; g < G; ++g) {
            const float p = s[g * kTile + t];
            float* ag = acc.data() + g * D;
            for (int d = 0; d < D; ++d) ag[d] += p * kv[d];
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / l[g];
        for (int d = 0; d < D; ++d) op[(b * H + h * G + g) * D + d] = static_cast<q_t>(acc[g * D + d] * inv);
      }
    }
  });
}

template <typename q_t, typename kv_t>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots,
                  const at::Tensor& lens, float scale, at::Tensor& out) {
  switch (q.size(2)) {  // keep in step with HEAD_DIMS in cpu_kernels.py
    case 16: return run<q_t, kv_t, 16>(q, k, v, slots, lens, scale, out);
    case 32: return run<q_t, kv_t, 32>(q, k, v, slots, lens, scale, out);
    case 64: return run<q_t, kv_t, 64>(q, k, v, slots, lens, scale, out);
    case 128: return run<q_t, kv_t, 128>(q, k, v, slots, lens, scale, out);
    default: TORCH_CHECK(false, "decode_attention: head_dim ", q.size(2), " not compiled (16, 32, 64, 128)");
  }
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(slots.is_contiguous() && lens.is_contiguous(), "contiguous slots and lens");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches of one dtype");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() ||
              (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16),
              "q of the caches' dtype, or fp32 over bf16 caches");
  TORCH_CHECK(slots.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "int64 slots and lens");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && q.size(2) == k_cache.size(2), "q [B, H, D], cache [S, KVH, D]");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(slots.size(0) == q.size(0) && lens.size(0) == q.size(0), "one slots row and length per query");
  auto out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16) {
    dispatch_dim<float, at::BFloat16>(q, k_cache, v_cache, slots, lens, static_cast<float>(scale), out);
  } else if (q.scalar_type() == at::kFloat) {
    dispatch_dim<float, float>(q, k_cache, v_cache, slots, lens, static_cast<float>(scale), out);
  } else if (q.scalar_type() == at::kBFloat16) {
    dispatch_dim<at::BFloat16, at::BFloat16>(q, k_cache, v_cache, slots, lens, static_cast<float>(scale), out);
  } else {
    TORCH_CHECK(false, "decode_attention: dtype ", q.scalar_type(), " not supported (float32, bfloat16)");
  }
  return out;
}
