// The C++ entry points of sudu's native kernels, shared by bindings.cpp (the Python module) and by kernels
// that call each other (decoder.cpp).
#pragma once
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

torch::Tensor qlinear(torch::Tensor x, torch::Tensor q, c10::optional<torch::Tensor> bias);
torch::Tensor dequantize(torch::Tensor q, bool bf16);
std::string isa();
std::string set_isa(const std::string& name);
void decode_attention(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor ks, torch::Tensor vs,
                      torch::Tensor rows, torch::Tensor slots, torch::Tensor mask, double scale, torch::Tensor out);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gu);
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads);
torch::Tensor argmax_rows(torch::Tensor x);
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask);
// The routing of a model's expert layers for llama_decode (decoder.cpp; layers/moe.py Router without groups).
struct MoeParams {
  int64_t top_k = 0;
  bool norm_topk = false;
  double scaling = 1.0;
  bool sigmoid = false;  // scores: sigmoid (else softmax)
  int64_t shared = 0;    // 0 none, 1 a shared expert scaled by sigmoid(x . gate), 2 shared experts unscaled
};
torch::Tensor llama_decode(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> k_caches,
                           std::vector<torch::Tensor> v_caches, std::vector<torch::Tensor> k_scales,
                           std::vector<torch::Tensor> v_scales, torch::Tensor slot_mapping, torch::Tensor rows,
                           torch::Tensor slots, torch::Tensor mask, torch::Tensor cos, torch::Tensor sin,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
                           torch::Tensor final_norm, std::vector<int64_t> experts, MoeParams moe);
