// The small element-wise steps between a layer's matmuls, fused: the residual add with the
// RMSNorm after it, RoPE on q and k with the KV-cache write, and the MLP's SiLU(gate) * up. For
// bf16 activations, and for fp32 ones over a bf16 or fp32 cache (a bf16 model computed in fp32 on
// a CPU without a bf16 dot product: model/precision.py).
//
// Why: in torch ops these are ~30 calls per layer (an RMSNorm alone is eight: to-float, pow,
// mean, add, rsqrt, mul, to-bf16, mul), each a dispatch, an allocation and a release and
// re-take of the GIL. A decode step's rows are few, so the calls cost far more than their
// arithmetic: ~10 ms of a ~40 ms SmolLM2 step at 4 rows. Here each is one call per layer.
//
// Arithmetic: the same roundings as the torch composition they replace (HF's reference
// formulas), so in bf16 results match it bit for bit but for the order of the fp32 sum of squares:
//   add:      h = bf16(h + d)
//   RMSNorm:  out = bf16(w * bf16(x * 1/sqrt(sum(x^2) / n + eps)))   (x, sums in fp32)
//   RoPE:     out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))  (cos, sin already bf16)
//   SiLU-mul: out = bf16(bf16(g / (1 + exp(-g))) * u)
// A product of two bf16 values is exact in fp32, so only the bf16 roundings matter (and exp's
// last fp32 bit, which the vector library computes its own way). In fp32 every bf16(.) above is
// the identity, and the results differ from torch's by the fp32 sums' order and by the FMAs
// that -ffast-math contracts (a few fp32 steps). The inverse square root is taken in double:
// under -ffast-math GCC computes a float 1/sqrtf with an approximation, which is not what torch's
// rsqrt returns.
//
// K and V go to the cache in its dtype. When that is narrower than the activations (fp32 over a
// bf16 cache), the k and v heads in qkv are rounded in place as well, so that this chunk's own
// attention sees them as every later chunk will read them back.
//
// Rows are independent: split over threads only when there are enough of them to pay for
// waking the pool (a decode step's few rows run on the calling thread).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace norm_rope {

constexpr int64_t kValuesPerTask = 64 * 1024;  // below this a call stays on the calling thread

inline float to_f32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, as c10::BFloat16 does; NaN stays a (quiet) NaN.
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return nan ? uint16_t(0x7fc0) : uint16_t(rounded);
}

// How a dtype's values are read into fp32, written back, and rounded in between.
struct Bf16 {
  using T = uint16_t;
  static constexpr at::ScalarType kType = at::kBFloat16;
  static float load(T v) { return to_f32(v); }
  static T store(float f) { return to_bf16(f); }
  static float round(float f) { return to_f32(to_bf16(f)); }
};

struct F32 {
  using T = float;
  static constexpr at::ScalarType kType = at::kFloat;
  static float load(T v) { return v; }
  static T store(float f) { return f; }
  static float round(float f) { return f; }
};

template <typename A>
typename A::T* values(const at::Tensor& t) { return static_cast<typename A::T*>(t.data_ptr()); }

template <typename A>
inline void norm_row(const typename A::T* x, const typename A::T* w, typename A::T* out, int64_t n, float eps) {
  float squares = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = A::load(x[i]);
    squares += v * v;
  }
  const float var = squares / float(n);
  const float inv = float(1.0 / std::sqrt(double(var + eps)));
  for (int64_t i = 0; i < n; ++i) out[i] = A::store(A::load(w[i]) * A::round(A::load(x[i]) * inv));
}

template <typename A>
inline typename A::T rope(typename A::T x, float rotated, typename A::T c, typename A::T s) {
  return A::store(A::round(A::load(x) * A::load(c)) + A::round(rotated * A::load(s)));
}

int64_t grain(int64_t values_per_row) { return std::max<int64_t>(1, kValuesPerTask / std::max<int64_t>(1, values_per_row)); }

void check_rows(const at::Tensor& t, const char* what, at::ScalarType type) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type, what, " must be ", type, " on CPU");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, " must be [rows, width] with contiguous rows");
}

void check_weight(const at::Tensor& w, int64_t n, at::ScalarType type) {
  TORCH_CHECK(w.is_contiguous() && w.numel() == n && w.scalar_type() == type, "weight must be [n] in the activations' dtype");
}

// The activations' dtype: bf16 or fp32.
at::ScalarType activations(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat, "bf16 or fp32 activations expected");
  return t.scalar_type();
}

template <typename A>
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x", A::kType);
  const int64_t rows = x.size(0), n = x.size(1);
  check_weight(w, n, A::kType);
  auto out = at::empty({rows, n}, x.options());
  const auto* xp = values<A>(x);
  const auto* wp = values<A>(w);
  auto* op = values<A>(out);
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row<A>(xp + r * xs, wp, op + r * n, n, float(eps));
  });
  return out;
}

template <typename A>
at::Tensor add_rms_norm(at::Tensor& h, const at::Tensor& d, const at::Tensor& w, double eps) {
  check_rows(h, "h", A::kType);
  check_rows(d, "d", A::kType);
  const int64_t rows = h.size(0), n = h.size(1);
  TORCH_CHECK(d.size(0) == rows && d.size(1) == n, "h and d must have the same shape");
  check_weight(w, n, A::kType);
  auto out = at::empty({rows, n}, h.options());
  auto* hp = values<A>(h);
  const auto* dp = values<A>(d);
  const auto* wp = values<A>(w);
  auto* op = values<A>(out);
  const int64_t hs = h.stride(0), ds = d.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      auto* hr = hp + r * hs;
      const auto* dr = dp + r * ds;
      for (int64_t i = 0; i < n; ++i) hr[i] = A::store(A::load(hr[i]) + A::load(dr[i]));
      norm_row<A>(hr, wp, op + r * n, n, float(eps));
    }
  });
  return out;
}

// A: the activations (qkv, cos, sin); C: the caches.
template <typename A, typename C>
void rope_store(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t q_heads, int64_t kv_heads,
                const at::Tensor& slots, at::Tensor& k_cache, at::Tensor& v_cache) {
  check_rows(qkv, "qkv", A::kType);
  check_rows(cos, "cos", A::kType);
  check_rows(sin, "sin", A::kType);
  const int64_t rows = qkv.size(0), dim = cos.size(1), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0 && qkv.size(1) == (q_heads + 2 * kv_heads) * dim, "qkv's width must be (q_heads + 2 kv_heads) * dim");
  TORCH_CHECK(cos.size(0) == rows && sin.size(0) == rows && sin.size(1) == dim, "cos and sin must be [rows, dim]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == rows, "slots must be int64 [rows]");
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    TORCH_CHECK(c->is_contiguous() && c->scalar_type() == C::kType && c->dim() == 3 && c->size(1) == kv_heads &&
                    c->size(2) == dim, "caches must be contiguous [num_slots, kv_heads, dim], both of one dtype");
  }
  const int64_t num_slots = k_cache.size(0), kv_width = kv_heads * dim;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(sp[r] >= 0 && sp[r] < num_slots, "slot out of range");
  auto* qp = values<A>(qkv);
  const auto* cp = values<A>(cos);
  const auto* snp = values<A>(sin);
  auto* kc = values<C>(k_cache);
  auto* vc = values<C>(v_cache);
  const int64_t qs = qkv.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, rows, grain(qkv.size(1)), [&](int64_t r0, int64_t r1) {
    std::vector<typename A::T> head(dim);
    for (int64_t r = r0; r < r1; ++r) {
      auto* row = qp + r * qs;
      const auto* c = cp + r * cs;
      const auto* s = snp + r * ss;
      for (int64_t h = 0; h < q_heads + kv_heads; ++h) {
        auto* x = row + h * dim;
        for (int64_t i = 0; i < half; ++i) head[i] = rope<A>(x[i], -A::load(x[i + half]), c[i], s[i]);
        for (int64_t i = half; i < dim; ++i) head[i] = rope<A>(x[i], A::load(x[i - half]), c[i], s[i]);
        std::memcpy(x, head.data(), dim * sizeof(typename A::T));
      }
      auto* k = row + q_heads * dim;  // k then v: 2 * kv_width values
      if constexpr (std::is_same_v<A, C>) {
        std::memcpy(kc + sp[r] * kv_width, k, kv_width * sizeof(typename A::T));
        std::memcpy(vc + sp[r] * kv_width, k + kv_width, kv_width * sizeof(typename A::T));
      } else {
        for (int64_t i = 0; i < 2 * kv_width; ++i) {  // one rounding: stored, and read back into qkv
          const typename C::T stored = C::store(A::load(k[i]));
          (i < kv_width ? kc[sp[r] * kv_width + i] : vc[sp[r] * kv_width + i - kv_width]) = stored;
          k[i] = A::store(C::load(stored));
        }
      }
    }
  });
}

template <typename A>
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up", A::kType);
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * n, "gate_up's width must be even");
  auto out = at::empty({rows, n}, gate_up.options());
  const auto* gp = values<A>(gate_up);
  auto* op = values<A>(out);
  const int64_t gs = gate_up.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
    std::vector<float> act(n);
    for (int64_t r = r0; r < r1; ++r) {
      const auto* g = gp + r * gs;
      const auto* u = g + n;
      for (int64_t i = 0; i < n; ++i) act[i] = std::exp(-A::load(g[i]));  // vectorized by the compiler
      for (int64_t i = 0; i < n; ++i) {
        const float x = A::load(g[i]);
        op[r * n + i] = A::store(A::round(x / (1.f + act[i])) * A::load(u[i]));
      }
    }
  });
  return out;
}

}  // namespace norm_rope

// RMSNorm of each row of x: [rows, n] (bf16 or fp32, the weight the same) -> a new [rows, n].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return norm_rope::activations(x) == at::kFloat ? norm_rope::rms_norm<norm_rope::F32>(x, w, eps) : norm_rope::rms_norm<norm_rope::Bf16>(x, w, eps);
}

// h += d (rounded to h's dtype, in place), then the RMSNorm of the new h: [rows, n] -> a new [rows, n].
at::Tensor add_rms_norm(at::Tensor& h, const at::Tensor& d, const at::Tensor& w, double eps) {
  return norm_rope::activations(h) == at::kFloat ? norm_rope::add_rms_norm<norm_rope::F32>(h, d, w, eps) : norm_rope::add_rms_norm<norm_rope::Bf16>(h, d, w, eps);
}

// qkv: [rows, (q_heads + 2 kv_heads) * dim] as the fused projection returns it. Rotates the q and
// k heads in place (rotate-half RoPE with cos, sin: [rows, dim] in qkv's dtype) and writes each
// row's k and v heads to k_cache[slots[r]] and v_cache[slots[r]] ([num_slots, kv_heads, dim]; bf16,
// or fp32 under fp32 activations).
void rope_store(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t q_heads,
                int64_t kv_heads, const at::Tensor& slots, at::Tensor& k_cache, at::Tensor& v_cache) {
  if (norm_rope::activations(qkv) == at::kBFloat16) return norm_rope::rope_store<norm_rope::Bf16, norm_rope::Bf16>(qkv, cos, sin, q_heads, kv_heads, slots, k_cache, v_cache);
  if (k_cache.scalar_type() == at::kFloat) return norm_rope::rope_store<norm_rope::F32, norm_rope::F32>(qkv, cos, sin, q_heads, kv_heads, slots, k_cache, v_cache);
  norm_rope::rope_store<norm_rope::F32, norm_rope::Bf16>(qkv, cos, sin, q_heads, kv_heads, slots, k_cache, v_cache);
}

// gate_up: [rows, 2 * n] (the fused gate and up projections) -> SiLU(gate) * up: a new [rows, n].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  return norm_rope::activations(gate_up) == at::kFloat ? norm_rope::silu_mul<norm_rope::F32>(gate_up) : norm_rope::silu_mul<norm_rope::Bf16>(gate_up);
}
