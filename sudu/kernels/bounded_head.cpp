// The tiles of an 8-bit output head that can hold a greedy row's argmax, found from the products of a 4-bit
// shadow of the head and a bound on how far each shadow logit is from the head's own (layers/bounded_head.py
// derives the bound and builds U, C and the per-row constants).
//
// Per row of x: xh = x as the kernels quantize it (q8_0_values), z = U^T xh, p = |xh - U z|,
// n = |xh| (in double). Vocabulary row j's own logit lies within b_j of a_j:
//   stage 1 (every j):           a_j = approx_j,            b_j = cn_j |z| + rr_j p + sl_j n
//   stage 2 (stage 1's rows):    a_j = approx_j + C_j . z,  b_j = rr_j p + sl_j n
// Any row's lower end a_j - b_j is a lower bound of the largest logit, so a row whose upper end a_j + b_j
// is below the largest lower end cannot be the argmax (nor tie with it). Stage 1 needs only three floats per
// row; stage 2 reads C's k floats for the few rows stage 1 keeps. Both run in float: their rounding, a few
// units of the sums they form, is far inside the spare factor of the bound's rounding term.
#include "kernels.h"
#include "simd.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t TILE = 16;
constexpr int64_t CHUNKS = 32;  // stage 1's pieces of the vocabulary, shared among the threads

struct RowTerms {
  std::vector<double> z;
  double zn = 0, p = 0, n = 0;
};

// z, |z|, p and |xh| of one row xh [K] against U [K, k].
RowTerms row_terms(const float* xh, const float* U, int64_t K, int64_t k) {
  RowTerms t;
  t.z.assign(k, 0.0);
  double nn = 0;
  for (int64_t i = 0; i < K; ++i) {
    nn += double(xh[i]) * xh[i];
    for (int64_t c = 0; c < k; ++c) t.z[c] += double(U[i * k + c]) * xh[i];
  }
  double pp = 0, zz = 0;
  for (int64_t c = 0; c < k; ++c) zz += t.z[c] * t.z[c];
  for (int64_t i = 0; i < K; ++i) {
    double r = xh[i];
    for (int64_t c = 0; c < k; ++c) r -= double(U[i * k + c]) * t.z[c];
    pp += r * r;
  }
  t.zn = std::sqrt(zz);
  t.p = std::sqrt(pp);
  t.n = std::sqrt(nn);
  return t;
}

}  // namespace

// x [M, K]: the head's input rows; approx [M, >= vocab]: the shadow's logits of x; U [K, k]; C [vocab, k];
// consts [3, vocab]: cn, rr, sl (float32, every one contiguous). Returns the ascending int64 tiles (16 vocab
// rows each) holding any row's stage-2 candidates, or an empty tensor: a row's values are not finite, or more
// than max_tiles tiles (the caller runs the whole head instead).
torch::Tensor head_candidates(torch::Tensor x, torch::Tensor approx, torch::Tensor U, torch::Tensor C,
                              torch::Tensor consts, int64_t vocab, int64_t max_tiles) {
  auto f32 = [](const torch::Tensor& t) { return t.scalar_type() == torch::kFloat && t.is_contiguous() && t.dim() == 2; };
  TORCH_CHECK(f32(x) && f32(approx) && f32(U) && f32(C) && f32(consts), "head_candidates: float32 contiguous 2-D inputs");
  const int64_t M = x.size(0), K = x.size(1), k = U.size(1), V = vocab, ld = approx.size(1);
  TORCH_CHECK(U.size(0) == K && C.size(0) == V && C.size(1) == k && consts.size(0) == 3 && consts.size(1) == V &&
                  approx.size(0) == M && ld >= V && V > 0,
              "head_candidates: shapes do not match");
  auto none = torch::empty({0}, torch::dtype(torch::kLong));
  const torch::Tensor xh = q8_0_values(x);
  std::vector<RowTerms> terms;
  for (int64_t m = 0; m < M; ++m) {
    terms.push_back(row_terms(xh.data_ptr<float>() + m * K, U.data_ptr<float>(), K, k));
    if (!std::isfinite(terms.back().n)) return none;
  }
  const float* A = approx.data_ptr<float>();
  const float *cn = consts.data_ptr<float>(), *rr = cn + V, *sl = rr + V;
  const int64_t V8 = V / 8 * 8, step = std::max<int64_t>(8, (V / CHUNKS + 7) / 8 * 8);
  const int64_t chunks = (V + step - 1) / step;

  // stage 1: each chunk's largest lower end per row (NaN where a value is not finite), then the rows reaching
  // the largest of them
  std::vector<float> lows(chunks * M, -std::numeric_limits<float>::infinity());
  std::vector<std::vector<std::pair<int32_t, float>>> kept(chunks * M);  // stage 2's rows: (j, upper end)
  // row m's stage-1 bounds over chunk c: on8(j, b) for each whole 8 rows from j, on1(j, b) for the rest
  auto each_bound = [&](int64_t c, int64_t m, auto&& on8, auto&& on1) {
    const int64_t j0 = c * step, j1 = std::min(V, j0 + step);
    const RowTerms& t = terms[m];
    const __m256 zn = _mm256_set1_ps(float(t.zn)), p = _mm256_set1_ps(float(t.p)), n = _mm256_set1_ps(float(t.n));
    int64_t j = j0;
    for (; j + 8 <= std::min(j1, V8); j += 8)
      on8(j, _mm256_fmadd_ps(_mm256_loadu_ps(cn + j), zn,
                             _mm256_fmadd_ps(_mm256_loadu_ps(rr + j), p, _mm256_mul_ps(_mm256_loadu_ps(sl + j), n))));
    for (; j < j1; ++j) on1(j, cn[j] * float(t.zn) + rr[j] * float(t.p) + sl[j] * float(t.n));
  };
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t m = 0; m < M; ++m) {
        const float* a = A + m * ld;
        __m256 lo = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), poison = _mm256_setzero_ps();
        float best = -std::numeric_limits<float>::infinity(), bad = 0;
        each_bound(c, m,
                   [&](int64_t j, __m256 b) {
                     const __m256 av = _mm256_loadu_ps(a + j);
                     lo = _mm256_max_ps(lo, _mm256_sub_ps(av, b));
                     poison = _mm256_add_ps(poison, _mm256_mul_ps(av, _mm256_setzero_ps()));  // NaN once a value is inf or NaN
                   },
                   [&](int64_t j, float b) {
                     best = std::max(best, a[j] - b);
                     bad += a[j] * 0.f;
                   });
        alignas(32) float l8[8], p8[8];
        _mm256_store_ps(l8, lo);
        _mm256_store_ps(p8, poison);
        best = std::max(best, *std::max_element(l8, l8 + 8));
        for (float v : p8) bad += v;
        lows[c * M + m] = std::isnan(bad) ? std::numeric_limits<float>::quiet_NaN() : best;
      }
  });
  std::vector<float> thr(M, -std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < chunks; ++c)
    for (int64_t m = 0; m < M; ++m) {
      if (std::isnan(lows[c * M + m])) return none;
      thr[m] = std::max(thr[m], lows[c * M + m]);
    }
  // stage 2, on the rows reaching that: the shadow's logit corrected by C_j . z, and the tighter bound; each
  // chunk's largest lower end per row, and its rows' upper ends
  const float* Cp = C.data_ptr<float>();
  std::vector<float> zf(M * k);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < k; ++i) zf[m * k + i] = float(terms[m].z[i]);
  std::vector<float> lows2(chunks * M, -std::numeric_limits<float>::infinity());
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t m = 0; m < M; ++m) {
        const RowTerms& t = terms[m];
        const float* a = A + m * ld;
        const float* z = zf.data() + m * k;
        std::vector<std::pair<int32_t, float>>& out = kept[c * M + m];
        float& best = lows2[c * M + m];
        auto stage2 = [&](int64_t j) {
          const float* cj = Cp + j * k;
          __m256 d = _mm256_setzero_ps();
          int64_t i = 0;
          for (; i + 8 <= k; i += 8) d = _mm256_fmadd_ps(_mm256_loadu_ps(cj + i), _mm256_loadu_ps(z + i), d);
          float centre = a[j] + hsum(d);
          for (; i < k; ++i) centre += cj[i] * z[i];
          const float b = rr[j] * float(t.p) + sl[j] * float(t.n);
          best = std::max(best, centre - b);
          out.emplace_back(int32_t(j), centre + b);
        };
        const __m256 th = _mm256_set1_ps(thr[m]);
        each_bound(c, m,
                   [&](int64_t j, __m256 b) {
                     int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_add_ps(_mm256_loadu_ps(a + j), b), th, _CMP_GE_OQ));
                     for (; bits; bits &= bits - 1) stage2(j + __builtin_ctz(bits));
                   },
                   [&](int64_t j, float b) {
                     if (a[j] + b >= thr[m]) stage2(j);
                   });
      }
  });
  std::vector<char> hit((V + TILE - 1) / TILE, 0);
  int64_t hits = 0;
  for (int64_t m = 0; m < M; ++m) {
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < chunks; ++c) best = std::max(best, lows2[c * M + m]);
    for (int64_t c = 0; c < chunks; ++c)
      for (const auto& [j, up] : kept[c * M + m])
        if (up >= best && !hit[j / TILE]) {
          hit[j / TILE] = 1;
          if (++hits > max_tiles) return none;
        }
  }
  std::vector<int64_t> tiles;
  for (int64_t i = 0; i < int64_t(hit.size()); ++i)
    if (hit[i]) tiles.push_back(i);
  if (tiles.empty()) return none;
  auto out = torch::empty({int64_t(tiles.size())}, torch::dtype(torch::kLong));
  std::copy(tiles.begin(), tiles.end(), out.data_ptr<int64_t>());
  return out;
}
