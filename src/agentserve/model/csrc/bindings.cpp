// The module's Python surface: one binding per kernel, each defined in its own source.
#include <torch/extension.h>

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& lens, double scale);
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& slots, int64_t start, double scale);
bool has_bf16_micro_kernel();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (CPU)");
  m.def("prefill_attention", &prefill_attention, "paged causal prefill attention over a cached context (CPU)");
  m.def("has_bf16_micro_kernel", &has_bf16_micro_kernel, "whether bf16 prefill uses the AVX512-BF16 kernel");
}
