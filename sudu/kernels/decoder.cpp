// A whole decode step's decoder stack in one call, for llama-family networks (llama_decode) and Gemma 3
// (gemma_decode): for steps whose sequences all have a few new tokens (decodes, speculative verification),
// quantized fused projections and any KV pool.
// It chains the very functions the Python layers call (qlinear, rms_norm, add_rms_norm, rotary_, the KV
// write, decode_attention, silu_mul or gelu), in the same order, so every row comes out bit for bit as
// through models/llama.py or models/gemma3.py: what this saves is the ~100 Python-level module calls and
// dispatches per layer.
// The KV pools are float32, float16, bfloat16, or int8 with per-channel scales (layers/kv_cache.py).
#include "kernels.h"

#include <algorithm>
#include <cmath>

namespace {

constexpr size_t PER_LAYER = 10;  // the weights of one layer, in the order of llama_decode's comment

// A layer's bias as the kernels take it: absent for an empty tensor.
c10::optional<torch::Tensor> bias_of(const torch::Tensor& bias) {
  return bias.defined() && bias.numel() ? c10::optional<torch::Tensor>(bias) : c10::nullopt;
}

torch::Tensor linear(const torch::Tensor& x, const std::vector<torch::Tensor>& w, size_t at) {
  return qlinear(x, w[at], bias_of(w[at + 1]));
}

// Copies x's rows (heads of D floats, strides xs, xh) into a float pool's slots (strides ss, hs): float32 as
// they are, float16 and bfloat16 rounded to nearest even, as Tensor.to() rounds.
template <typename T>
void write_rows(T* dst, const int64_t* slots, const float* src, int64_t rows, int64_t xs, int64_t xh, int64_t Hkv,
                int64_t D, int64_t ss, int64_t hs, int64_t num_slots) {
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv: slot out of range");
    for (int64_t h = 0; h < Hkv; ++h) {
      const float* s = src + t * xs + h * xh;
      T* d = dst + slots[t] * ss + h * hs;
      for (int64_t i = 0; i < D; ++i) d[i] = T(s[i]);
    }
  }
}

// The new tokens' K or V (x: [T, Hkv, D], unit stride within a head) into the pool's slots: into a float32,
// float16 or bfloat16 pool by write_rows; into an int8 one as round((x - centre) / scale) to nearest even,
// saturated at +-127, which is what Int8KVCache.quantize computes (centre: [Hkv, D], or empty for none).
void write_kv(torch::Tensor& pool, const torch::Tensor& slot_mapping, const torch::Tensor& x,
              const torch::Tensor& scale, const torch::Tensor& centre) {
  const int64_t T = x.size(0), Hkv = x.size(1), D = x.size(2);
  if (pool.scalar_type() != torch::kChar) {
    if (x.scalar_type() != torch::kFloat || x.stride(2) != 1 || pool.stride(2) != 1 || pool.size(1) != Hkv ||
        pool.size(2) != D) {
      pool.index_copy_(0, slot_mapping, x.to(pool.scalar_type()));
      return;
    }
    const float* src = x.data_ptr<float>();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    auto write = [&](auto* dst) {
      write_rows(dst, slots, src, T, x.stride(0), x.stride(1), Hkv, D, pool.stride(0), pool.stride(1), pool.size(0));
    };
    switch (pool.scalar_type()) {
      case torch::kFloat: write(pool.data_ptr<float>()); return;
      case torch::kHalf: write(pool.data_ptr<at::Half>()); return;
      case torch::kBFloat16: write(pool.data_ptr<at::BFloat16>()); return;
      default: pool.index_copy_(0, slot_mapping, x.to(pool.scalar_type())); return;
    }
  }
  TORCH_CHECK(x.stride(2) == 1 && scale.scalar_type() == torch::kFloat && scale.is_contiguous() &&
              scale.numel() == Hkv * D && pool.stride(2) == 1 && pool.size(1) == Hkv && pool.size(2) == D,
              "write_kv: bad int8 pool, scales or input");
  const bool centred = centre.numel() > 0;
  TORCH_CHECK(!centred || (centre.scalar_type() == torch::kFloat && centre.is_contiguous() &&
                            centre.numel() == Hkv * D),
              "write_kv: bad int8 centres");
  const float* xp = x.data_ptr<float>();
  const float* sp = scale.data_ptr<float>();
  const float* cp = centred ? centre.data_ptr<float>() : nullptr;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  int8_t* out = pool.data_ptr<int8_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < pool.size(0), "write_kv: slot out of range");
    for (int64_t h = 0; h < Hkv; ++h) {
      const float* src = xp + t * x.stride(0) + h * x.stride(1);
      int8_t* dst = out + slots[t] * pool.stride(0) + h * pool.stride(1);
      for (int64_t d = 0; d < D; ++d) {
        const float value = centred ? src[d] - cp[h * D + d] : src[d];
        dst[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(value / sp[h * D + d]))));
      }
    }
  }
}

// A layer's normed input, and the residual stream updated in place: the first layer's is its input x, a later
// layer's the stream plus the previous layer's output x (add_rms_norm).
torch::Tensor layer_input(size_t l, torch::Tensor& residual, const torch::Tensor& x, const torch::Tensor& w, double eps) {
  if (l == 0) {
    residual = x;
    return rms_norm(x, w, eps);
  }
  torch::Tensor h;
  std::tie(residual, h) = add_rms_norm(residual, x, w, eps);
  return h;
}

// The new tokens' K and V (k, v: [T, Hkv, D]) into layer pools kc / vc at slot_mapping (an int8 K pool's around
// kcentre: write_kv), then the queries q [T, H, D] attended over them (decode_attention): [T, H * D].
torch::Tensor cache_and_attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& kc,
                               torch::Tensor& vc, const torch::Tensor& ks, const torch::Tensor& vs,
                               const torch::Tensor& kcentre, const torch::Tensor& slot_mapping,
                               const torch::Tensor& rows, const torch::Tensor& slots,
                               const torch::Tensor& mask, double scale, bool tiles) {
  write_kv(kc, slot_mapping, k, ks, kcentre);
  write_kv(vc, slot_mapping, v, vs, torch::Tensor());
  auto att = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  decode_attention(q, kc, vc, ks, vs, rows, slots, mask, scale, att, tiles);
  return att.view({q.size(0), q.size(1) * q.size(2)});
}

}  // namespace

// One gated MLP (gate_up tiles, bias, down tiles, bias at w[at..at+3]) on rows x, as GatedMLP.forward:
// silu(gate) * up in the gate_up call itself where gate and up are whole tiles each (qlinear_silu).
torch::Tensor gated_mlp(const torch::Tensor& x, const std::vector<torch::Tensor>& w, size_t at) {
  if (weight_tiles(w[at]) % 2 == 0) return linear(qlinear_silu(x, w[at], bias_of(w[at + 1])), w, at + 2);
  return linear(silu_mul(linear(x, w, at)), w, at + 2);
}

// x: [T, hidden] embeddings of the step's tokens. weights: per layer, 10 tensors: the input norm's weight;
// qkv tiles, bias; o tiles, bias; the post-attention norm's weight; gate_up tiles, bias; down tiles, bias
// (absent biases as empty tensors; each layer's outputs whole tiles; models/llama.py).
// A layer with experts (experts[l] = E > 0) has, after its post-attention norm, a router and E experts
// instead of gate_up / down (moe.cpp sparse_moe: 1 + 4 E tensors, then the shared expert's 5 or 4).
// k_caches / v_caches: each layer's pool, float32, float16, bfloat16 or int8; k_scales / v_scales: an int8
// pool's float32 [Hkv, D] scales (empty tensors for float pools); k_centres: its K centres [Hkv, D] (empty
// for float pools); tiles: attention's bfloat16-tile arithmetic;
// slot_mapping, rows, slots, mask: the step's AttentionView (decode batch). Returns the final norm of the
// residual stream [T, hidden].
torch::Tensor llama_decode(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> k_caches,
                           std::vector<torch::Tensor> v_caches, std::vector<torch::Tensor> k_scales,
                           std::vector<torch::Tensor> v_scales, std::vector<torch::Tensor> k_centres, bool tiles,
                           torch::Tensor slot_mapping, torch::Tensor rows,
                           torch::Tensor slots, torch::Tensor mask, torch::Tensor cos, torch::Tensor sin,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
                           torch::Tensor final_norm, std::vector<int64_t> experts, MoeParams moe) {
  const size_t L = k_caches.size();
  TORCH_CHECK(experts.size() == L && v_caches.size() == L && k_scales.size() == L && v_scales.size() == L &&
                  k_centres.size() == L,
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
    h = layer_input(l, residual, x, weights[at], eps);
    auto qkv = linear(h, weights, at + 1).view({T, heads + 2 * kv_heads, head_dim});
    rotary_(qkv, cos, sin, heads + kv_heads);
    auto att = cache_and_attend(qkv.narrow(1, 0, heads), qkv.narrow(1, heads, kv_heads),
                                qkv.narrow(1, heads + kv_heads, kv_heads), k_caches[l], v_caches[l], k_scales[l],
                                v_scales[l], k_centres[l], slot_mapping, rows, slots, mask, scale, tiles);
    auto o = linear(att, weights, at + 3);
    std::tie(residual, h) = add_rms_norm(residual, o, weights[at + 5], eps);
    x = experts[l] ? sparse_moe(h, weights, at + 6, experts[l], moe) : gated_mlp(h, weights, at + 6);
    at += layer_len(l);
  }
  return std::get<1>(add_rms_norm(residual, x, final_norm, eps));
}

namespace {

constexpr size_t GEMMA_PER_LAYER = 14;  // the weights of one Gemma layer, in the order of gemma_decode's comment

// An attention view's tensors as gemma_decode takes them: slot_mapping, rows, slots, mask.
struct View {
  const torch::Tensor &slot_mapping, &rows, &slots, &mask;
};

View view_of(const std::vector<torch::Tensor>& v) {
  TORCH_CHECK(v.size() == 4, "gemma_decode: a view is slot_mapping, rows, slots, mask");
  return {v[0], v[1], v[2], v[3]};
}

}  // namespace

// models/gemma3.py's decoder stack. x: [T, hidden] scaled embeddings of the step's tokens. weights: per layer,
// 14 tensors: the input norm's weight; qkv tiles, bias; the q norm's and k norm's weights; o tiles, bias; the
// post-attention and pre-feed-forward norms' weights; gate_up tiles, bias; down tiles, bias; the
// post-feed-forward norm's weight (every norm weight as the kernel multiplies by: 1 + w). sliding[l]: layer l
// attends through sliding_view with the local RoPE table, else through full_view with the global one; a view
// is {slot_mapping, rows, slots, mask} of its AttentionView's decode batch. The MLP is
// down(gelu_tanh(gate) * up). Returns the final norm of the residual stream [T, hidden].
torch::Tensor gemma_decode(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> k_caches,
                           std::vector<torch::Tensor> v_caches, std::vector<torch::Tensor> k_scales,
                           std::vector<torch::Tensor> v_scales, std::vector<torch::Tensor> k_centres, bool tiles,
                           std::vector<int64_t> sliding,
                           std::vector<torch::Tensor> full_view, std::vector<torch::Tensor> sliding_view,
                           torch::Tensor cos_global, torch::Tensor sin_global, torch::Tensor cos_local,
                           torch::Tensor sin_local, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
                           double scale, torch::Tensor final_norm) {
  const size_t L = k_caches.size();
  TORCH_CHECK(v_caches.size() == L && k_scales.size() == L && v_scales.size() == L && k_centres.size() == L &&
                  sliding.size() == L &&
                  weights.size() == L * GEMMA_PER_LAYER,
              "gemma_decode: bad weight, pool or layer list");
  const View full = view_of(full_view), local = view_of(sliding_view);
  const int64_t T = x.size(0), H = heads, Hk = kv_heads, D = head_dim;
  torch::Tensor residual, h, delta = x;
  const auto& w = weights;
  for (size_t l = 0; l < L; ++l) {
    const size_t at = l * GEMMA_PER_LAYER;
    h = layer_input(l, residual, delta, w[at], eps);
    auto qkv = linear(h, w, at + 1).view({T, H + 2 * Hk, D});
    auto q = rms_norm(qkv.narrow(1, 0, H).reshape({T * H, D}).contiguous(), w[at + 3], eps).view({T, H, D});
    auto k = rms_norm(qkv.narrow(1, H, Hk).reshape({T * Hk, D}).contiguous(), w[at + 4], eps).view({T, Hk, D});
    auto qk = torch::cat({q, k}, 1);
    const View& v = sliding[l] ? local : full;
    rotary_(qk, sliding[l] ? cos_local : cos_global, sliding[l] ? sin_local : sin_global, H + Hk);
    auto att = cache_and_attend(qk.narrow(1, 0, H), qk.narrow(1, H, Hk), qkv.narrow(1, H + Hk, Hk), k_caches[l],
                                v_caches[l], k_scales[l], v_scales[l], k_centres[l], v.slot_mapping, v.rows,
                                v.slots, v.mask, scale, tiles);
    auto o = linear(att, w, at + 5);
    std::tie(residual, h) = add_rms_norm(residual, rms_norm(o, w[at + 7], eps), w[at + 8], eps);
    auto gate_up = linear(h, w, at + 9);
    const int64_t I = gate_up.size(1) / 2;
    auto act = torch::gelu(gate_up.narrow(1, 0, I), "tanh") * gate_up.narrow(1, I, I);
    delta = rms_norm(linear(act, w, at + 11), w[at + 13], eps);
  }
  return std::get<1>(add_rms_norm(residual, delta, final_norm, eps));
}
