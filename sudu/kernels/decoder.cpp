// A whole llama-family decode step's decoder stack in one call: for steps whose sequences all have a few
// new tokens (decodes, speculative verification), quantized fused projections and a float32 KV pool.
// It chains the very functions the Python layers call (qlinear, add_rms_norm, rotary_, the KV write,
// decode_attention, silu_mul), in the same order, so every row comes out bit for bit as through
// models/llama.py: what this saves is the ~100 Python-level module calls and dispatches per layer.
// The KV pools are float32, or int8 with per-channel scales (layers/kv_cache.py Int8KVCache).
#include "kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

constexpr size_t PER_LAYER = 10;  // the weights of one layer, in the order of llama_decode's comment

torch::Tensor linear(const torch::Tensor& x, const std::vector<torch::Tensor>& w, size_t at) {
  const torch::Tensor& bias = w[at + 1];
  return qlinear(x, w[at], bias.defined() && bias.numel() ? c10::optional<torch::Tensor>(bias) : c10::nullopt);
}

// The new tokens' K or V (x: [T, Hkv, D], unit stride within a head) into the pool's slots: copied into a
// float32 pool (row by row); into an int8 one as round(x / scale) to nearest even, saturated at +-127, which is what
// Int8KVCache.quantize computes.
void write_kv(torch::Tensor& pool, const torch::Tensor& slot_mapping, const torch::Tensor& x,
              const torch::Tensor& scale) {
  const int64_t T = x.size(0), Hkv = x.size(1), D = x.size(2);
  if (pool.scalar_type() != torch::kChar) {
    // a token's heads are one contiguous run in both (a slice of the fused qkv row; a pool slot): plain copies
    if (pool.scalar_type() != torch::kFloat || x.scalar_type() != torch::kFloat || x.stride(2) != 1 ||
        x.stride(1) != D || !pool.is_contiguous() || pool.size(1) != Hkv || pool.size(2) != D) {
      pool.index_copy_(0, slot_mapping, x);
      return;
    }
    const float* src = x.data_ptr<float>();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    float* dst = pool.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(slots[t] >= 0 && slots[t] < pool.size(0), "write_kv: slot out of range");
      std::memcpy(dst + slots[t] * Hkv * D, src + t * x.stride(0), sizeof(float) * Hkv * D);
    }
    return;
  }
  TORCH_CHECK(x.stride(2) == 1 && scale.scalar_type() == torch::kFloat && scale.is_contiguous() &&
              scale.numel() == Hkv * D && pool.is_contiguous() && pool.size(1) == Hkv && pool.size(2) == D,
              "write_kv: bad int8 pool, scales or input");
  const float* xp = x.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  int8_t* out = pool.data_ptr<int8_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < pool.size(0), "write_kv: slot out of range");
    for (int64_t h = 0; h < Hkv; ++h) {
      const float* src = xp + t * x.stride(0) + h * x.stride(1);
      int8_t* dst = out + (slots[t] * Hkv + h) * D;
      for (int64_t d = 0; d < D; ++d)
        dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(src[d] / sp[h * D + d]))));
    }
  }
}

// x @ w^T row by row (one batched vector-matrix product per row), as layers/moe.py rowwise_linear.
torch::Tensor rowwise_linear(const torch::Tensor& x, const torch::Tensor& w) {
  auto wt = w.t();
  return torch::bmm(x.unsqueeze(1), wt.expand({x.size(0), wt.size(0), wt.size(1)})).select(1, 0);
}

// One gated expert (gate_up tiles, bias, down tiles, bias at w[at..at+3]) on rows x, as GatedMLP.forward.
torch::Tensor expert(const torch::Tensor& x, const std::vector<torch::Tensor>& w, size_t at) {
  return linear(silu_mul(linear(x, w, at)), w, at + 2);
}

// out plus the shared expert's output: p.shared == 1 its gate weight [1, hidden] at w[shared] and 4 tensors,
// 2: 4 tensors (layers/moe.py SparseMoE.forward).
torch::Tensor shared_part(const torch::Tensor& x, const std::vector<torch::Tensor>& w, size_t shared, const MoeParams& p,
                          torch::Tensor out) {
  if (p.shared == 1) out = out + torch::sigmoid(rowwise_linear(x, w[shared])) * expert(x, w, shared + 1);
  if (p.shared == 2) out = out + expert(x, w, shared);
  return out;
}

// The experts of a single token: what the general path below computes for one row (index_add_ of each
// selected expert's weighted output into zeros, in ascending expert order) without its sort, bincount and
// gathers, which cost more than the experts' small matmuls at batch 1.
torch::Tensor one_token_moe(const torch::Tensor& x, const std::vector<torch::Tensor>& w, size_t at, int64_t E,
                            const MoeParams& p, const torch::Tensor& ids, const torch::Tensor& weights) {
  const int64_t k = ids.size(1);
  std::vector<std::pair<int64_t, int64_t>> chosen;  // (expert, slot)
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t j = 0; j < k; ++j) chosen.emplace_back(id[j], j);
  std::sort(chosen.begin(), chosen.end());
  auto wx = weights.to(x.scalar_type());
  auto out = torch::zeros_like(x);
  for (const auto& [e, j] : chosen) out.add_(expert(x, w, at + 1 + 4 * e) * wx.narrow(1, j, 1));
  return shared_part(x, w, at + 1 + 4 * E, p, out);
}

// layers/moe.py SparseMoE.forward for a router without groups or correction bias, op for op (so every row
// comes out as through the Python layers): w[at] the router weight [E, hidden], then E experts (4 tensors
// each), then the shared expert's tensors (shared_part).
torch::Tensor sparse_moe(const torch::Tensor& x, const std::vector<torch::Tensor>& w, size_t at, int64_t E,
                         const MoeParams& p) {
  auto logits = rowwise_linear(x.to(torch::kFloat), w[at].to(torch::kFloat));
  auto scores = p.sigmoid ? logits.sigmoid() : logits.softmax(-1);
  auto ids = std::get<1>(scores.topk(p.top_k, -1, true, false));
  auto weights = scores.gather(1, ids);
  if (p.norm_topk) weights = weights / (weights.sum(-1, true) + 1e-20);
  if (p.scaling != 1.0) weights = weights * p.scaling;
  if (x.size(0) == 1) return one_token_moe(x, w, at, E, p, ids, weights);
  auto flat = ids.reshape({-1});
  auto order = std::get<1>(flat.sort(true, 0, false));  // stable: tokens in order within an expert
  auto counts = torch::bincount(flat, {}, E);
  auto tokens = order.div(p.top_k, "floor");
  auto pair_weights = weights.reshape({-1}).index_select(0, order).to(x.scalar_type()).unsqueeze(1);
  auto out = torch::zeros_like(x);
  const int64_t* c = counts.data_ptr<int64_t>();
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (c[e] == 0) continue;
    auto rows = tokens.narrow(0, start, c[e]);
    out.index_add_(0, rows, expert(x.index_select(0, rows), w, at + 1 + 4 * e) * pair_weights.narrow(0, start, c[e]));
    start += c[e];
  }
  return shared_part(x, w, at + 1 + 4 * E, p, out);
}

}  // namespace

// x: [T, hidden] embeddings of the step's tokens. weights: per layer, 10 tensors: the input norm's weight;
// qkv tiles, bias; o tiles, bias; the post-attention norm's weight; gate_up tiles, bias; down tiles, bias
// (absent biases as empty tensors; each layer's outputs whole tiles; models/llama.py).
// A layer with experts (experts[l] = E > 0) has, after its post-attention norm, a router and E experts
// instead of gate_up / down (sparse_moe above: 1 + 4 E tensors, then the shared expert's 5 or 4).
// k_caches / v_caches: each layer's pool, float32 or int8; k_scales / v_scales: an int8 pool's float32 [Hkv, D]
// scales (empty tensors for float32 pools); slot_mapping, rows, slots, mask: the step's
// AttentionView (decode batch). Returns the final norm of the residual stream [T, hidden].
torch::Tensor llama_decode(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> k_caches,
                           std::vector<torch::Tensor> v_caches, std::vector<torch::Tensor> k_scales,
                           std::vector<torch::Tensor> v_scales, torch::Tensor slot_mapping, torch::Tensor rows,
                           torch::Tensor slots, torch::Tensor mask, torch::Tensor cos, torch::Tensor sin,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
                           torch::Tensor final_norm, std::vector<int64_t> experts, MoeParams moe) {
  const size_t L = k_caches.size();
  TORCH_CHECK(experts.size() == L && v_caches.size() == L && k_scales.size() == L && v_scales.size() == L,
              "llama_decode: bad expert or pool list");
  const size_t shared = moe.shared == 1 ? 5 : moe.shared == 2 ? 4 : 0;
  // tensors of layer l: norm, qkv, o, norm (6), then the dense MLP's 4 or the router, experts and shared expert
  auto layer_len = [&](size_t l) { return experts[l] ? 6 + 1 + 4 * experts[l] + shared : PER_LAYER; };
  size_t total = 0;
  for (size_t l = 0; l < L; ++l) total += layer_len(l);
  TORCH_CHECK(weights.size() == total, "llama_decode: bad weight list");
  const int64_t T = x.size(0);
  torch::Tensor residual, h;
  size_t at = 0;
  for (size_t l = 0; l < L; ++l) {
    if (l == 0) {
      residual = x;
      h = rms_norm(x, weights[at], eps);
    } else {
      std::tie(residual, h) = add_rms_norm(residual, x, weights[at], eps);
    }
    auto qkv = linear(h, weights, at + 1).view({T, heads + 2 * kv_heads, head_dim});
    rotary_(qkv, cos, sin, heads + kv_heads);
    write_kv(k_caches[l], slot_mapping, qkv.narrow(1, heads, kv_heads), k_scales[l]);
    write_kv(v_caches[l], slot_mapping, qkv.narrow(1, heads + kv_heads, kv_heads), v_scales[l]);
    auto att = torch::empty({T, heads, head_dim}, x.options());
    decode_attention(qkv.narrow(1, 0, heads), k_caches[l], v_caches[l], k_scales[l], v_scales[l], rows, slots, mask,
                     scale, att);
    auto o = linear(att.view({T, heads * head_dim}), weights, at + 3);
    std::tie(residual, h) = add_rms_norm(residual, o, weights[at + 5], eps);
    x = experts[l] ? sparse_moe(h, weights, at + 6, experts[l], moe) : expert(h, weights, at + 6);
    at += layer_len(l);
  }
  return std::get<1>(add_rms_norm(residual, x, final_norm, eps));
}
