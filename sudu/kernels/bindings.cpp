// The Python module of sudu's native kernels: quant_linear.cpp (weight-only quantized linear layers),
// attention.cpp (attention of few new tokens over the paged KV pool), ops.cpp (a decoder layer's
// elementwise steps) and decoder.cpp (a whole decode step's decoder stack).
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

torch::Tensor qlinear(torch::Tensor x, torch::Tensor q, torch::Tensor s, torch::Tensor mn, int64_t group_size,
                      c10::optional<torch::Tensor> bias);
torch::Tensor dequantize(torch::Tensor q, torch::Tensor s, torch::Tensor mn, int64_t group_size, bool bf16);
std::string isa();
std::string set_isa(const std::string& name);
void decode_attention(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor ks, torch::Tensor vs,
                      torch::Tensor rows, torch::Tensor slots, torch::Tensor mask, double scale, torch::Tensor out);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gu);
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads);
torch::Tensor llama_decode(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> k_caches,
                           std::vector<torch::Tensor> v_caches, torch::Tensor slot_mapping, torch::Tensor rows,
                           torch::Tensor slots, torch::Tensor mask, torch::Tensor cos, torch::Tensor sin,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
                           torch::Tensor final_norm);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &qlinear, "y = x @ dequant(W)^T + bias");
  m.def("dequantize", &dequantize, "dequant(W) as float32 (or bfloat16) [N, K]", py::arg("q"), py::arg("s"),
        py::arg("mn"), py::arg("group_size"), py::arg("bf16") = false);
  m.def("isa", &isa, "the dot-product instruction set qlinear uses");
  m.def("set_isa", &set_isa, "force 'avx2' or restore 'native'");
  m.def("decode_attention", &decode_attention, "attention of few new tokens over the paged KV pool, into out");
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows: x * rsqrt(mean(x^2) + eps) * w");
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, rms_norm(x + delta))");
  m.def("silu_mul", &silu_mul, "[T, 2I] gate | up -> silu(gate) * up");
  m.def("rotary_", &rotary_, "rotate the first `heads` heads of x [T, heads_total, D] in place (rotate-half)");
  m.def("llama_decode", &llama_decode, "a llama-family decode step's decoder stack in one call (decoder.cpp)");
}
