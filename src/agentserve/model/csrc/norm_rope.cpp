// The small element-wise steps between a layer's matmuls, fused, in bf16: the residual add with
// the RMSNorm after it, RoPE on q and k with the KV-cache write, and the MLP's SiLU(gate) * up.
//
// Why: in torch ops these are ~30 calls per layer (an RMSNorm alone is eight: to-float, pow,
// mean, add, rsqrt, mul, to-bf16, mul), each a dispatch, an allocation and a release and
// re-take of the GIL. A decode step's rows are few, so the calls cost far more than their
// arithmetic: ~10 ms of a ~40 ms SmolLM2 step at 4 rows. Here each is one call per layer.
//
// Arithmetic: the same roundings as the torch composition they replace (HF's reference
// formulas), so results match it bit for bit but for the order of the fp32 sum of squares:
//   add:      h = bf16(h + d)
//   RMSNorm:  out = bf16(w * bf16(x * 1/sqrt(sum(x^2) / n + eps)))   (x, sums in fp32)
//   RoPE:     out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))  (cos, sin already bf16)
//   SiLU-mul: out = bf16(bf16(g / (1 + exp(-g))) * u)
// A product of two bf16 values is exact in fp32, so only the bf16 roundings matter (and exp's
// last fp32 bit, which the vector library computes its own way). The inverse
// square root is taken in double: under -ffast-math GCC computes a float 1/sqrtf with an
// approximation, which is not what torch's rsqrt returns.
//
// Rows are independent: split over threads only when there are enough of them to pay for
// waking the pool (a decode step's few rows run on the calling thread).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
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

inline void norm_row(const uint16_t* x, const uint16_t* w, uint16_t* out, int64_t n, float eps) {
  float squares = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_f32(x[i]);
    squares += v * v;
  }
  const float var = squares / float(n);
  const float inv = float(1.0 / std::sqrt(double(var + eps)));
  for (int64_t i = 0; i < n; ++i) out[i] = to_bf16(to_f32(w[i]) * to_f32(to_bf16(to_f32(x[i]) * inv)));
}

inline uint16_t rope(uint16_t x, float rotated, uint16_t c, uint16_t s) {
  return to_bf16(to_f32(to_bf16(to_f32(x) * to_f32(c))) + to_f32(to_bf16(rotated * to_f32(s))));
}

int64_t grain(int64_t values_per_row) { return std::max<int64_t>(1, kValuesPerTask / std::max<int64_t>(1, values_per_row)); }

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, what, " must be bf16 on CPU");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, " must be [rows, width] with contiguous rows");
}

}  // namespace norm_rope

// RMSNorm of each row of x: [rows, n] -> a new [rows, n].
at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& w, double eps) {
  using namespace norm_rope;
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(w.is_contiguous() && w.numel() == n && w.scalar_type() == at::kBFloat16, "weight must be bf16 [n]");
  auto out = at::empty({rows, n}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t xs = x.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * xs, wp, op + r * n, n, float(eps));
  });
  return out;
}

// h += d (rounded to bf16, in place), then the RMSNorm of the new h: [rows, n] -> a new [rows, n].
at::Tensor add_rms_norm_bf16(at::Tensor& h, const at::Tensor& d, const at::Tensor& w, double eps) {
  using namespace norm_rope;
  check_rows(h, "h");
  check_rows(d, "d");
  const int64_t rows = h.size(0), n = h.size(1);
  TORCH_CHECK(d.size(0) == rows && d.size(1) == n, "h and d must have the same shape");
  TORCH_CHECK(w.is_contiguous() && w.numel() == n && w.scalar_type() == at::kBFloat16, "weight must be bf16 [n]");
  auto out = at::empty({rows, n}, h.options());
  auto* hp = reinterpret_cast<uint16_t*>(h.data_ptr<at::BFloat16>());
  const auto* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t hs = h.stride(0), ds = d.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      uint16_t* hr = hp + r * hs;
      const uint16_t* dr = dp + r * ds;
      for (int64_t i = 0; i < n; ++i) hr[i] = to_bf16(to_f32(hr[i]) + to_f32(dr[i]));
      norm_row(hr, wp, op + r * n, n, float(eps));
    }
  });
  return out;
}

// qkv: [rows, (q_heads + 2 kv_heads) * dim] as the fused projection returns it. Rotates the q and
// k heads in place (rotate-half RoPE with cos, sin: [rows, dim] bf16) and writes each row's k and
// v heads to k_cache[slots[r]] and v_cache[slots[r]] ([num_slots, kv_heads, dim]).
void rope_store_bf16(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t q_heads,
                     int64_t kv_heads, const at::Tensor& slots, at::Tensor& k_cache, at::Tensor& v_cache) {
  using namespace norm_rope;
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t rows = qkv.size(0), dim = cos.size(1), half = dim / 2;
  TORCH_CHECK(dim % 2 == 0 && qkv.size(1) == (q_heads + 2 * kv_heads) * dim, "qkv's width must be (q_heads + 2 kv_heads) * dim");
  TORCH_CHECK(cos.size(0) == rows && sin.size(0) == rows && sin.size(1) == dim, "cos and sin must be [rows, dim]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == rows, "slots must be int64 [rows]");
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    TORCH_CHECK(c->is_contiguous() && c->scalar_type() == at::kBFloat16 && c->dim() == 3 && c->size(1) == kv_heads &&
                    c->size(2) == dim, "caches must be contiguous bf16 [num_slots, kv_heads, dim]");
  }
  const int64_t num_slots = k_cache.size(0), kv_width = kv_heads * dim;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(sp[r] >= 0 && sp[r] < num_slots, "slot out of range");
  auto* qp = reinterpret_cast<uint16_t*>(qkv.data_ptr<at::BFloat16>());
  const auto* cp = reinterpret_cast<const uint16_t*>(cos.data_ptr<at::BFloat16>());
  const auto* snp = reinterpret_cast<const uint16_t*>(sin.data_ptr<at::BFloat16>());
  auto* kc = reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  auto* vc = reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  const int64_t qs = qkv.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  at::parallel_for(0, rows, grain(qkv.size(1)), [&](int64_t r0, int64_t r1) {
    std::vector<uint16_t> head(dim);
    for (int64_t r = r0; r < r1; ++r) {
      uint16_t* row = qp + r * qs;
      const uint16_t* c = cp + r * cs;
      const uint16_t* s = snp + r * ss;
      for (int64_t h = 0; h < q_heads + kv_heads; ++h) {
        uint16_t* x = row + h * dim;
        for (int64_t i = 0; i < half; ++i) head[i] = rope(x[i], -to_f32(x[i + half]), c[i], s[i]);
        for (int64_t i = half; i < dim; ++i) head[i] = rope(x[i], to_f32(x[i - half]), c[i], s[i]);
        std::memcpy(x, head.data(), dim * sizeof(uint16_t));
      }
      std::memcpy(kc + sp[r] * kv_width, row + q_heads * dim, kv_width * sizeof(uint16_t));
      std::memcpy(vc + sp[r] * kv_width, row + (q_heads + kv_heads) * dim, kv_width * sizeof(uint16_t));
    }
  });
}

// gate_up: [rows, 2 * n] (the fused gate and up projections) -> SiLU(gate) * up: a new [rows, n].
at::Tensor silu_mul_bf16(const at::Tensor& gate_up) {
  using namespace norm_rope;
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * n, "gate_up's width must be even");
  auto out = at::empty({rows, n}, gate_up.options());
  const auto* gp = reinterpret_cast<const uint16_t*>(gate_up.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t gs = gate_up.stride(0);
  at::parallel_for(0, rows, grain(n), [&](int64_t r0, int64_t r1) {
    std::vector<float> act(n);
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* g = gp + r * gs;
      const uint16_t* u = g + n;
      for (int64_t i = 0; i < n; ++i) act[i] = std::exp(-to_f32(g[i]));  // vectorized by the compiler
      for (int64_t i = 0; i < n; ++i) {
        const float x = to_f32(g[i]);
        op[r * n + i] = to_bf16(to_f32(to_bf16(x / (1.f + act[i]))) * to_f32(u[i]));
      }
    }
  });
  return out;
}
