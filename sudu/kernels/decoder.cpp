// A whole llama-family decode step's decoder stack in one call: for steps whose sequences all have a few
// new tokens (decodes, speculative verification), quantized fused projections and a float32 KV pool.
// It chains the very functions the Python layers call (qlinear, add_rms_norm, rotary_, the KV write,
// decode_attention, silu_mul), in the same order, so every row comes out bit for bit as through
// models/llama.py: what this saves is the ~100 Python-level module calls and dispatches per layer.
#include "kernels.h"

namespace {

constexpr size_t PER_LAYER = 18;  // the weights of one layer, in the order of llama_decode's comment

torch::Tensor linear(const torch::Tensor& x, const std::vector<torch::Tensor>& w, size_t at) {
  const torch::Tensor& bias = w[at + 3];
  return qlinear(x, w[at], w[at + 1], w[at + 2], 32, bias.defined() && bias.numel() ? c10::optional<torch::Tensor>(bias)
                                                                                      : c10::nullopt);
}

}  // namespace

// x: [T, hidden] embeddings of the step's tokens. weights: per layer, 18 tensors: the input norm's weight;
// qkv q, scales, mins, bias; o q, scales, mins, bias; the post-attention norm's weight; gate_up q, scales,
// mins, bias; down q, scales, mins, bias (absent mins and biases as empty tensors; models/llama.py).
// k_caches / v_caches: each layer's float32 pool; slot_mapping, rows, slots, mask: the step's
// AttentionView (decode batch). Returns the final norm of the residual stream [T, hidden].
torch::Tensor llama_decode(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> k_caches,
                           std::vector<torch::Tensor> v_caches, torch::Tensor slot_mapping, torch::Tensor rows,
                           torch::Tensor slots, torch::Tensor mask, torch::Tensor cos, torch::Tensor sin,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
                           torch::Tensor final_norm) {
  const size_t L = k_caches.size();
  TORCH_CHECK(weights.size() == L * PER_LAYER && v_caches.size() == L, "llama_decode: bad weight list");
  const int64_t T = x.size(0);
  const auto empty = torch::empty({0}, torch::dtype(torch::kHalf));
  torch::Tensor residual, h;
  for (size_t l = 0; l < L; ++l) {
    const size_t at = l * PER_LAYER;
    if (l == 0) {
      residual = x;
      h = rms_norm(x, weights[at], eps);
    } else {
      std::tie(residual, h) = add_rms_norm(residual, x, weights[at], eps);
    }
    auto qkv = linear(h, weights, at + 1).view({T, heads + 2 * kv_heads, head_dim});
    rotary_(qkv, cos, sin, heads + kv_heads);
    k_caches[l].index_copy_(0, slot_mapping, qkv.narrow(1, heads, kv_heads));
    v_caches[l].index_copy_(0, slot_mapping, qkv.narrow(1, heads + kv_heads, kv_heads));
    auto att = torch::empty({T, heads, head_dim}, x.options());
    decode_attention(qkv.narrow(1, 0, heads), k_caches[l], v_caches[l], empty, empty, rows, slots, mask, scale, att);
    auto o = linear(att.view({T, heads * head_dim}), weights, at + 5);
    std::tie(residual, h) = add_rms_norm(residual, o, weights[at + 9], eps);
    x = linear(silu_mul(linear(h, weights, at + 10)), weights, at + 14);
  }
  return std::get<1>(add_rms_norm(residual, x, final_norm, eps));
}
