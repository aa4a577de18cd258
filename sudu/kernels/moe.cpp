// Routed experts for the native decode stack (decoder.cpp) and the router both it and layers/moe.py use.
//
// moe_route: each row's expert choice in plain loops (dot products against the router rows, softmax or
// sigmoid, top-k, renormalisation, scaling). layers/moe.py's Router calls it too wherever it applies, so
// the layers and the native stack choose the same experts with the same weights, bit for bit.
//
// sparse_moe: layers/moe.py SparseMoE.forward on a step's rows. A lone token (batch-1 decode) takes a
// fused path: the chosen experts' (and the shared expert's) gate/up products run in one parallel region,
// then their down products in one more, into scratch buffers; no ATen op per expert. The general path
// groups the rows by expert as run_experts does. Both sum a token's experts in ascending expert order,
// each output scaled by its weight and then added (no fused multiply-add), as index_add_ of a product.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "simd.h"

namespace {

// x . w over n floats, 8 lanes then their sum: a fixed order, whatever the batch.
float dot(const float* x, const float* w, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + j), _mm256_loadu_ps(w + j), acc);
  float s = hsum(acc);
  for (; j < n; ++j) s += x[j] * w[j];
  return s;
}

// One row's choice: ids ascending, weights[j] for ids[j].
void route_row(const float* x, const float* w, int64_t E, int64_t H, const MoeParams& p, std::vector<float>& scores,
               float* weights, int64_t* ids) {
  for (int64_t e = 0; e < E; ++e) scores[e] = dot(x, w + e * H, H);
  if (p.sigmoid) {
    for (int64_t e = 0; e < E; ++e) scores[e] = 1.0f / (1.0f + std::exp(-scores[e]));
  } else {
    float m = scores[0], sum = 0.0f;
    for (int64_t e = 1; e < E; ++e) m = std::max(m, scores[e]);
    for (int64_t e = 0; e < E; ++e) sum += (scores[e] = std::exp(scores[e] - m));
    for (int64_t e = 0; e < E; ++e) scores[e] = scores[e] / sum;
  }
  const int64_t k = p.top_k;
  // the k best (ties and NaNs: the lower index), then in ascending expert order
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      if (std::find(ids, ids + j, e) != ids + j) continue;
      if (best < 0 || scores[e] > scores[best]) best = e;
    }
    ids[j] = best;
  }
  std::sort(ids, ids + k);
  float total = 0.0f;
  for (int64_t j = 0; j < k; ++j) total += (weights[j] = scores[ids[j]]);
  const float scaling = static_cast<float>(p.scaling);
  for (int64_t j = 0; j < k; ++j) {
    if (p.norm_topk) weights[j] = weights[j] / (total + 1e-20f);
    if (p.scaling != 1.0) weights[j] = weights[j] * scaling;
  }
}

// out[i] = out[i] + y[i] * s, the product rounded before the add (as `out.index_add_(rows, y * s)`): the
// empty asm keeps the compiler from contracting the two into a multiply-add.
void add_scaled(float* out, const float* y, float s, int64_t n) {
  const __m256 sv = _mm256_set1_ps(s);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 prod = _mm256_mul_ps(_mm256_loadu_ps(y + i), sv);
    asm("" : "+x"(prod));
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(out + i), prod));
  }
  for (; i < n; ++i) {
    float prod = y[i] * s;
    asm("" : "+x"(prod));
    out[i] = out[i] + prod;
  }
}

// x @ w^T row by row (one batched vector-matrix product per row), as layers/moe.py rowwise_linear.
torch::Tensor rowwise_linear(const torch::Tensor& x, const torch::Tensor& w) {
  auto wt = w.t();
  return torch::bmm(x.unsqueeze(1), wt.expand({x.size(0), wt.size(0), wt.size(1)})).select(1, 0);
}

// Where the shared expert's tensors start in w (its gate weight first when p.shared == 1): after the
// router and the E experts' 4 tensors each.
size_t shared_at(size_t at, int64_t E) { return at + 1 + 4 * static_cast<size_t>(E); }

// out plus the shared expert's output: p.shared == 1 its gate weight [1, hidden] and 4 tensors, 2: 4 tensors.
torch::Tensor shared_part(const torch::Tensor& x, const std::vector<torch::Tensor>& w, size_t shared,
                          const MoeParams& p, torch::Tensor out) {
  if (p.shared == 1) out = out + torch::sigmoid(rowwise_linear(x, w[shared])) * gated_mlp(x, w, shared + 1);
  if (p.shared == 2) out = out + gated_mlp(x, w, shared);
  return out;
}

// One token's experts (ids ascending, their weights) and shared expert, fused as the file comment says.
torch::Tensor one_token_moe(const torch::Tensor& x, const std::vector<torch::Tensor>& w, size_t at, int64_t E,
                            const MoeParams& p, const int64_t* ids, const float* weights) {
  const int64_t H = x.size(1), k = p.top_k;
  std::vector<size_t> first;  // each product's gate_up tiles: the chosen experts', then the shared expert's
  for (int64_t j = 0; j < k; ++j) first.push_back(at + 1 + 4 * static_cast<size_t>(ids[j]));
  const size_t shared = shared_at(at, E);
  if (p.shared) first.push_back(p.shared == 1 ? shared + 1 : shared);
  const size_t n = first.size();
  std::vector<int64_t> width(n), offset(n + 1, 0);  // gate_up width (16 * tiles); buffer offsets
  for (size_t i = 0; i < n; ++i) {
    width[i] = w[first[i]].size(0) * 16;
    TORCH_CHECK(w[first[i] + 2].size(0) * 16 == H, "sparse_moe: an expert's down projection does not return hidden");
    offset[i + 1] = offset[i] + width[i] + width[i] / 2 + H;  // gate_up, activation, output
  }
  thread_local std::vector<float> scratch;
  scratch.resize(offset[n]);
  std::vector<QProduct> products(n);
  for (size_t i = 0; i < n; ++i)
    products[i] = {x.data_ptr<float>(), H, &w[first[i]], &w[first[i] + 1], scratch.data() + offset[i]};
  qlinear_products(products);
  for (size_t i = 0; i < n; ++i) {
    float* gu = scratch.data() + offset[i];
    silu_mul_row(gu, width[i] / 2, gu + width[i]);
    products[i] = {gu + width[i], width[i] / 2, &w[first[i] + 2], &w[first[i] + 3], gu + width[i] + width[i] / 2};
  }
  qlinear_products(products);
  auto out = torch::zeros_like(x);
  float* op = out.data_ptr<float>();
  auto output = [&](size_t i) { return scratch.data() + offset[i] + width[i] + width[i] / 2; };
  for (int64_t j = 0; j < k; ++j) add_scaled(op, output(j), weights[j], H);
  if (p.shared == 1) {
    const float s = torch::sigmoid(rowwise_linear(x, w[shared])).item<float>();
    add_scaled(op, output(k), s, H);
  } else if (p.shared == 2) {
    add_scaled(op, output(k), 1.0f, H);  // y * 1 is y: out + y
  }
  return out;
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> moe_route(torch::Tensor x, torch::Tensor w, MoeParams p) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous float32 [T, hidden]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat && w.is_contiguous() && w.size(1) == x.size(1),
              "router weight must be contiguous float32 [experts, hidden]");
  const int64_t T = x.size(0), H = x.size(1), E = w.size(0), k = p.top_k;
  TORCH_CHECK(k >= 1 && k <= E, "top_k must be in [1, experts]");
  auto weights = torch::empty({T, k}, x.options());
  auto ids = torch::empty({T, k}, x.options().dtype(torch::kLong));
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* wt = weights.data_ptr<float>();
  int64_t* id = ids.data_ptr<int64_t>();
  // rows per task: about 64K multiply-adds, so a decode step's rows stay on the calling thread
  at::parallel_for(0, T, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, E * H)), [&](int64_t t0, int64_t t1) {
    std::vector<float> scores(E);
    for (int64_t t = t0; t < t1; ++t) route_row(xp + t * H, wp, E, H, p, scores, wt + t * k, id + t * k);
  });
  return {weights, ids};
}

torch::Tensor sparse_moe(const torch::Tensor& x, const std::vector<torch::Tensor>& w, size_t at, int64_t E,
                         const MoeParams& p) {
  auto [weights, ids] = moe_route(x.contiguous(), w[at].contiguous(), p);
  if (x.size(0) == 1) return one_token_moe(x, w, at, E, p, ids.data_ptr<int64_t>(), weights.data_ptr<float>());
  auto flat = ids.reshape({-1});
  auto order = std::get<1>(flat.sort(true, 0, false));  // stable: tokens in order within an expert
  auto counts = torch::bincount(flat, {}, E);
  auto tokens = order.div(p.top_k, "floor");
  auto pair_weights = weights.reshape({-1}).index_select(0, order).unsqueeze(1);
  auto out = torch::zeros_like(x);
  const int64_t* c = counts.data_ptr<int64_t>();
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (c[e] == 0) continue;
    auto rows = tokens.narrow(0, start, c[e]);
    out.index_add_(0, rows, gated_mlp(x.index_select(0, rows), w, at + 1 + 4 * e) * pair_weights.narrow(0, start, c[e]));
    start += c[e];
  }
  return shared_part(x, w, shared_at(at, E), p, out);
}
