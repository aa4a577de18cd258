// The elementwise steps of a decoder layer, one pass each over float32 rows: RMSNorm (alone, or fused
// with the residual add before it), the SiLU-gated product of the MLP, and the rotary embedding in place.
// On the few rows of a decode step PyTorch spends more time dispatching these than computing them
// (F.rms_norm alone runs five kernels on CPU). Each row's result depends on that row only, whatever the
// batch; large inputs (prefill) are split by rows over threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"
#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

// rows per task: about 16K floats, so decode rows stay on the calling thread
int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width)); }

// out = x * rsqrt(mean(x^2) + eps) * w, as F.rms_norm computes it in float32
void rms_row(const float* x, const float* w, float eps, int64_t n, float* out) {
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum(acc);
  for (; j < n; ++j) ss += x[j] * x[j];
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  const __m256 iv = _mm256_set1_ps(inv);
  for (j = 0; j + 8 <= n; j += 8)
    _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), iv), _mm256_loadu_ps(w + j)));
  for (; j < n; ++j) out[j] = x[j] * inv * w[j];
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x must be contiguous float32 [T, n]");
  TORCH_CHECK(w.scalar_type() == torch::kFloat && w.is_contiguous() && w.numel() == x.size(1), "w must be float32 [n]");
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, w);
  auto out = torch::empty_like(x);
  const int64_t n = x.size(1);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), grain(n), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) rms_row(xp + t * n, wp, static_cast<float>(eps), n, op + t * n);
  });
  return out;
}

// (x + delta, rms_norm(x + delta)): the residual add and the next norm in one pass.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps) {
  check_rows(x, w);
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == torch::kFloat && delta.is_contiguous(), "bad delta");
  auto sum = torch::empty_like(x), out = torch::empty_like(x);
  const int64_t n = x.size(1);
  const float *xp = x.data_ptr<float>(), *dp = delta.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *sp = sum.data_ptr<float>(), *op = out.data_ptr<float>();
  at::parallel_for(0, x.size(0), grain(n), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t j = 0; j < n; ++j) sp[t * n + j] = xp[t * n + j] + dp[t * n + j];
      rms_row(sp + t * n, wp, static_cast<float>(eps), n, op + t * n);
    }
  });
  return {sum, out};
}

// gu [2I] (gate | up) -> silu(gate) * up [I], silu(g) = g / (1 + exp(-g))
void silu_mul_row(const float* g, int64_t I, float* o) {
  const float* u = g + I;
  int64_t j = 0;
  for (; j + 8 <= I; j += 8) _mm256_storeu_ps(o + j, silu_mul8(_mm256_loadu_ps(g + j), _mm256_loadu_ps(u + j)));
  for (; j < I; ++j) o[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
}

// gu [T, 2I] (gate | up) -> silu(gate) * up [T, I], float32, or bfloat16 in and out (a prompt chunk's
// bfloat16 GEMM output, layers/mlp.py: the values silu_mul_row gives on the float32 copy, rounded to
// nearest even as .to(torch.bfloat16) rounds them)
torch::Tensor silu_mul(torch::Tensor gu) {
  const bool bf16 = gu.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(gu.dim() == 2 && (bf16 || gu.scalar_type() == torch::kFloat) && gu.is_contiguous() && gu.size(1) % 2 == 0,
              "gate_up must be contiguous float32 or bfloat16 [T, 2I]");
  const int64_t I = gu.size(1) / 2;
  auto out = torch::empty({gu.size(0), I}, gu.options());
  if (!bf16) {
    const float* gp = gu.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, gu.size(0), grain(I), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) silu_mul_row(gp + t * 2 * I, I, op + t * I);
    });
    return out;
  }
  const auto* gp = reinterpret_cast<const uint16_t*>(gu.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, gu.size(0), grain(I), [&](int64_t t0, int64_t t1) {
    std::vector<float> row(3 * I);
    for (int64_t t = t0; t < t1; ++t) {
      from_bf16(gp + t * 2 * I, 2 * I, row.data());
      silu_mul_row(row.data(), I, row.data() + 2 * I);
      to_bf16(row.data() + 2 * I, I, op + t * I);
    }
  });
  return out;
}

// x [T, heads_total, D] (any row stride, heads contiguous): the first `heads` heads of each row rotated in
// place by the rotate-half convention, out = x * cos + rotate_half(x) * sin with cos, sin [T, D].
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "x must be float32 [T, heads, D] with contiguous heads");
  const int64_t T = x.size(0), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && heads <= x.size(1), "bad head count or size");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat &&
              sin.scalar_type() == torch::kFloat && cos.size(0) == T && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "cos, sin must be float32 [T, D]");
  float* xp = x.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t rs = x.stride(0);
  at::parallel_for(0, T, grain(heads * D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *c = cp + t * D, *s = sp + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = xp + t * rs + h * D;
        int64_t j = 0;
        for (; j + 8 <= half; j += 8) {
          const __m256 a = _mm256_loadu_ps(v + j), b = _mm256_loadu_ps(v + half + j);
          const __m256 ra = _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + j)), _mm256_mul_ps(b, _mm256_loadu_ps(s + j)));
          const __m256 rb = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + j)),
                                          _mm256_mul_ps(a, _mm256_loadu_ps(s + half + j)));
          _mm256_storeu_ps(v + j, ra);
          _mm256_storeu_ps(v + half + j, rb);
        }
        for (; j < half; ++j) {
          const float a = v[j], b = v[half + j];
          v[j] = a * c[j] - b * s[j];
          v[half + j] = b * c[half + j] + a * s[half + j];
        }
      }
    }
  });
}

namespace {

// Index of the largest of x[0:n] as torch.argmax picks it: the first among equals, and a NaN counts as
// largest (the first NaN wins).
int64_t argmax_row(const float* x, int64_t n) {
  __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    best = _mm256_max_ps(best, v);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  float m = -INFINITY;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best);
  for (float v : lanes) m = std::max(m, v);
  bool has_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t k = j; k < n; ++k) {
    has_nan |= std::isnan(x[k]);
    m = std::max(m, x[k]);
  }
  if (has_nan) {
    for (int64_t k = 0; k < n; ++k)
      if (std::isnan(x[k])) return k;
  }
  const __m256 mv = _mm256_set1_ps(m);
  for (j = 0; j + 8 <= n; j += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), mv, _CMP_EQ_OQ));
    if (hits) return j + __builtin_ctz(hits);
  }
  for (; j < n; ++j)
    if (x[j] == m) return j;
  return 0;  // unreachable for n > 0
}

}  // namespace

// Each row's argmax of float32 logits [R, V], as torch.argmax(dim=-1) (which runs a scalar loop on CPU,
// an order of magnitude slower over a 152K vocabulary).
torch::Tensor argmax_rows(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous() && x.size(1) > 0,
              "x must be contiguous float32 [R, V], V > 0");
  const int64_t R = x.size(0), V = x.size(1);
  auto out = torch::empty({R}, torch::dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = argmax_row(xp + r * V, V);
  });
  return out;
}

// Structured output: the logits of tokens a grammar disallows to -inf, in place. bitmask [R, W] int32, bit b of
// word w = token 32 * w + b allowed (llguidance's layout); logits [R, V] float32 with unit stride along V. A
// whole word at a time: all-ones words (most of a permissive mask) are skipped, all-zeros words (most of a
// strict one) are filled without testing bits.
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.stride(1) == 1,
              "logits must be float32 [R, V] with unit stride along V");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt && bitmask.is_contiguous() &&
                  bitmask.size(0) == logits.size(0),
              "bitmask must be contiguous int32 [R, W] with R = logits' rows");
  const int64_t R = logits.size(0), V = logits.size(1), W = bitmask.size(1), ls = logits.stride(0);
  const int64_t words = std::min(W, (V + 31) / 32);
  float* lp = logits.data_ptr<float>();
  const uint32_t* mp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < R; ++r) {
    float* row = lp + r * ls;
    const uint32_t* m = mp + r * W;
    for (int64_t w = 0; w < words; ++w) {
      const uint32_t bits = m[w];
      if (bits == 0xFFFFFFFFu) continue;
      const int64_t base = w * 32, n = std::min<int64_t>(32, V - base);
      if (bits == 0) {
        std::fill(row + base, row + base + n, ninf);
        continue;
      }
      for (int64_t b = 0; b < n; ++b)
        if (!((bits >> b) & 1u)) row[base + b] = ninf;
    }
  }
}
