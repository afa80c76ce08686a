// The module's Python surface: one binding per kernel, each defined in its own source.
#include <torch/extension.h>

#include <vector>

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& lens, double scale);
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& slots, int64_t start, double scale);
bool has_bf16_micro_kernel();
bool has_avx2_attention();
at::Tensor decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& slots, const at::Tensor& lens, double scale);
at::Tensor small_linear_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
bool has_bf16_small_linear();
int64_t small_linear_rows(int64_t K);
at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& w, int64_t n, const c10::optional<at::Tensor>& bias);
bool has_avx2_widened_linear();
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor add_rms_norm(at::Tensor& h, const at::Tensor& d, const at::Tensor& w, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
std::vector<int64_t> bind_intraop_threads(const std::vector<int64_t>& cpus);
void rope_store(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t q_heads,
                int64_t kv_heads, const at::Tensor& slots, at::Tensor& k_cache, at::Tensor& v_cache);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (CPU)");
  m.def("prefill_attention", &prefill_attention, "paged causal prefill attention over a cached context (CPU)");
  m.def("small_linear_bf16", &small_linear_bf16, "few-row bf16 linear: x W^T + b (CPU, AVX512-BF16)");
  m.def("has_bf16_small_linear", &has_bf16_small_linear, "whether small_linear_bf16 was compiled");
  m.def("small_linear_rows", &small_linear_rows, "the most rows worth sending to small_linear_bf16 for width K");
  m.def("widened_linear", &widened_linear, "few-row linear, fp32 x and bf16 W (rows in interleaved pairs) widened in registers: x W^T + b (CPU)");
  m.def("has_avx2_widened_linear", &has_avx2_widened_linear, "whether widened_linear has its AVX2/FMA body");
  m.def("decode_attention_bf16", &decode_attention_bf16, "paged decode attention in bf16 via the prefill micro kernel (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, bf16 or fp32 (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "h += d in place, then RMSNorm of h, bf16 or fp32 (CPU)");
  m.def("rope_store", &rope_store, "RoPE on q and k in a fused qkv row, in place, and the K/V cache write, bf16 or fp32 (CPU)");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up over the fused gate and up projections, bf16 or fp32 (CPU)");
  m.def("has_avx2_attention", &has_avx2_attention, "whether fp32 prefill attention has its AVX2/FMA kernel");
  m.def("bind_intraop_threads", &bind_intraop_threads, "pin intra-op (OpenMP) team member t to cpus[t]; their thread ids");
  m.def("has_bf16_micro_kernel", &has_bf16_micro_kernel, "whether bf16 prefill uses the AVX512-BF16 kernel");
}
