// The module's Python surface: one binding per kernel, each defined in its own source.
#include <torch/extension.h>

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& lens, double scale);
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& slots, int64_t start, double scale);
bool has_bf16_micro_kernel();
at::Tensor decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const at::Tensor& slots, const at::Tensor& lens, double scale);
at::Tensor small_linear_bf16(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);
bool has_bf16_small_linear();
int64_t small_linear_rows(int64_t K);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (CPU)");
  m.def("prefill_attention", &prefill_attention, "paged causal prefill attention over a cached context (CPU)");
  m.def("small_linear_bf16", &small_linear_bf16, "few-row bf16 linear: x W^T + b (CPU, AVX512-BF16)");
  m.def("has_bf16_small_linear", &has_bf16_small_linear, "whether small_linear_bf16 was compiled");
  m.def("small_linear_rows", &small_linear_rows, "the most rows worth sending to small_linear_bf16 for width K");
  m.def("decode_attention_bf16", &decode_attention_bf16, "paged decode attention in bf16 via the prefill micro kernel (CPU)");
  m.def("has_bf16_micro_kernel", &has_bf16_micro_kernel, "whether bf16 prefill uses the AVX512-BF16 kernel");
}
