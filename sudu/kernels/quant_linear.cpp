// Weight-only quantized linear layers for CPUs with AVX2 + FMA + F16C.
//
// y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias), x and y float32.
// Formats (K a multiple of 32, group size G a multiple of 32 that divides K):
//   int8: q int8 [N, K];                 w = s[n, k / G] * q
//   int4: q uint8 [N, K / 2], 32-element sub-blocks of 16 bytes, byte j holding element j in its low
//         nibble and element j + 16 in its high one (so one shift + mask yields two contiguous halves);
//                                         w = s[n, k / G] * q + m[n, k / G],  q in [0, 15]
// Scales and mins are float16 (half the bytes of float32, and F16C converts them for free).
//
// Why this kernel: decode is bound by reading weights. PyTorch's packed int8/int4 kernels read the
// weights once per activation row, so a batch of 8 costs 8x. Here each worker dequantizes a tile of
// NR weight rows x KC columns into an L1-resident float buffer once, then runs every activation row
// against it: weights cross the memory bus once per step whatever M is, and the multiply-adds are
// plain float32 FMAs on exactly the dequantized weights (same numbers as the float reference).
//
// Activations are rounded to int8 in blocks of 32 (a float scale per block, as llama.cpp's Q8 activations),
// at every row count, so a row's result does not depend on the batch beyond float rounding:
//   M == 1   integer dot products (maddubs) of weight and activation codes, one float FMA per block:
//            ~3x less arithmetic than dequantizing, so one-row decode is bound by memory, not compute.
//   M >= 2   the rounded activations back in float, against an L1 tile of dequantized weights shared by
//            every row (the integer trick saves nothing once the dequantization is amortized).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>

namespace {

constexpr int64_t NR = 4;    // weight rows per tile: x loads are shared by NR FMAs
constexpr int64_t KC = 512;  // columns per tile: NR * KC floats = 8 KiB stays in L1

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// Dequantize columns [k0, k0 + kc) of one int8 row into out.
// Group index of column k, advanced by one comparison per 32 columns: a 64-bit division there cost
// more than the rest of the dequantization.
struct GroupCursor {
  int64_t g, next, G;
  GroupCursor(int64_t k0, int64_t G_) : g(k0 / G_), next((k0 / G_ + 1) * G_), G(G_) {}
  inline int64_t at(int64_t k) {
    if (k >= next) { ++g; next += G; }
    return g;
  }
};

inline void dequant_int8(const int8_t* q, const uint16_t* s, int64_t G, int64_t k0, int64_t kc, float* out) {
  GroupCursor cur(k0, G);
  for (int64_t k = k0; k < k0 + kc; k += 32) {
    const __m256 sv = _mm256_set1_ps(half_to_float(s[cur.at(k)]));
    for (int64_t j = 0; j < 32; j += 8) {
      __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k + j));
      __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
      _mm256_storeu_ps(out + (k - k0) + j, _mm256_mul_ps(f, sv));
    }
  }
}

inline void dequant_int4(const uint8_t* q, const uint16_t* s, const uint16_t* mn, int64_t G, int64_t k0, int64_t kc,
                         float* out) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  GroupCursor cur(k0, G);
  for (int64_t k = k0; k < k0 + kc; k += 32) {
    const int64_t g = cur.at(k);
    const __m256 sv = _mm256_set1_ps(half_to_float(s[g]));
    const __m256 mv = _mm256_set1_ps(half_to_float(mn[g]));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k / 2));
    __m128i lo = _mm_and_si128(b, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    float* o = out + (k - k0);
    _mm256_storeu_ps(o + 0, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), sv, mv));
    _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), sv, mv));
    _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), sv, mv));
    _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), sv, mv));
  }
}

// acc[r] += dot(x[0:kc], w[r][0:kc]) for ROWS activation rows and NR weight rows.
template <int ROWS>
inline void tile_dot(const float* x, int64_t ldx, const float* w, int64_t kc, float* acc, int64_t ldacc) {
  __m256 a[ROWS][NR];
  for (int i = 0; i < ROWS; ++i)
    for (int r = 0; r < NR; ++r) a[i][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; k += 8) {
    __m256 xv[ROWS];
    for (int i = 0; i < ROWS; ++i) xv[i] = _mm256_loadu_ps(x + i * ldx + k);
    for (int r = 0; r < NR; ++r) {
      __m256 wv = _mm256_loadu_ps(w + r * KC + k);
      for (int i = 0; i < ROWS; ++i) a[i][r] = _mm256_fmadd_ps(xv[i], wv, a[i][r]);
    }
  }
  for (int i = 0; i < ROWS; ++i)
    for (int r = 0; r < NR; ++r) acc[i * ldacc + r] += hsum(a[i][r]);
}

// x[0:K] -> int8 codes xq and per-32 scales sx (x ~= sx * xq); xsum[b] = sx[b] * sum(xq in block b).
// Round to nearest even (the default MXCSR mode), x * (1 / d) as PyTorch would compute it in float32.
inline void quantize_row_q8(const float* x, int64_t K, int8_t* xq, float* sx, float* xsum) {
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / 32; ++b) {
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(x + 32 * b + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    __m256i qi[4];
    __m256i total = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(id)));
      total = _mm256_add_epi32(total, qi[j]);
    }
    // packs work per 128-bit lane; the permutation restores element order
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + 32 * b), _mm256_permutevar8x32_epi32(p, order));
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    sx[b] = d;
    xsum[b] = d * static_cast<float>(_mm_cvtsi128_si32(t));
  }
}

// Per-block factors of one row: d[b] = weight scale * activation scale, and (int4) the min term
// sum_b min_b * xsum_b. Hoisted out of the dot product because, done per block inside it, this scalar
// work (half -> float, multiply, broadcast) cost as much as the integer dot itself. Returns the min term.
template <bool INT4>
inline float block_factors(const uint16_t* s, const uint16_t* mn, int64_t G, int64_t nb, const float* sx,
                           const float* xsum, float* d) {
  float min_term = 0.0f;
  int64_t b = 0;
  if (G == 32) {  // one scale per block: convert 8 at a time (F16C)
    __m256 macc = _mm256_setzero_ps();
    for (; b + 8 <= nb; b += 8) {
      const __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + b)));
      _mm256_storeu_ps(d + b, _mm256_mul_ps(s8, _mm256_loadu_ps(sx + b)));
      if (INT4) {
        const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + b)));
        macc = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xsum + b), macc);
      }
    }
    min_term = hsum(macc);
  }
  GroupCursor cur(32 * b, G);
  for (; b < nb; ++b) {
    const int64_t g = cur.at(32 * b);
    d[b] = half_to_float(s[g]) * sx[b];
    if (INT4) min_term += half_to_float(mn[g]) * xsum[b];
  }
  return min_term;
}

// One quantized row against int8 activation codes: per block, sum(q * xq) in integers (maddubs + madd),
// then one FMA with the block's factor d[b].
template <bool INT4>
inline float dot_q8(const uint8_t* q, int64_t K, const int8_t* xq, const float* d) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b) {
    const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * b));
    __m256i prod;
    if (INT4) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * b));
      const __m256i qv = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
      prod = _mm256_maddubs_epi16(qv, xv);  // q in [0, 15]: unsigned operand as maddubs wants
    } else {
      const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * b));
      // maddubs multiplies unsigned by signed: move q's sign onto x. |q|, |x| <= 127 cannot saturate int16.
      prod = _mm256_maddubs_epi16(_mm256_sign_epi8(qv, qv), _mm256_sign_epi8(xv, qv));
    }
    const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
    const __m256 db = _mm256_broadcast_ss(d + b);
    if (b & 1) acc1 = _mm256_fmadd_ps(f, db, acc1); else acc0 = _mm256_fmadd_ps(f, db, acc0);
  }
  return hsum(_mm256_add_ps(acc0, acc1));
}

template <bool INT4>
void qgemv_q8_impl(const float* x, int64_t K, const uint8_t* q, const uint16_t* s, const uint16_t* mn, int64_t N,
                   int64_t G, const float* bias, float* y) {
  const int64_t ngroups = K / G;
  const int64_t row_bytes = INT4 ? K / 2 : K;
  std::vector<int8_t> xq(K);
  std::vector<float> sx(K / 32), xsum(K / 32);
  quantize_row_q8(x, K, xq.data(), sx.data(), xsum.data());
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> d(K / 32);
    // Rows are adjacent, so [n0, n1) is one stream; prefetching ahead keeps more DRAM reads in flight than
    // the hardware prefetcher does here. Prefetching past the end is harmless (no fault).
    constexpr int64_t PREFETCH_BYTES = 2048;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = q + n * row_bytes;
      for (int64_t off = 0; off < row_bytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(row + off + PREFETCH_BYTES), _MM_HINT_T0);
      const float min_term = block_factors<INT4>(s + n * ngroups, INT4 ? mn + n * ngroups : nullptr, G, K / 32,
                                                 sx.data(), xsum.data(), d.data());
      y[n] = dot_q8<INT4>(row, K, xq.data(), d.data()) + min_term + (bias ? bias[n] : 0.f);
    }
  });
}

template <bool INT4>
void qlinear_impl(const float* x, int64_t M, int64_t K, const uint8_t* q, const uint16_t* s, const uint16_t* mn,
                  int64_t N, int64_t G, const float* bias, float* y) {
  if (M == 1) return qgemv_q8_impl<INT4>(x, K, q, s, mn, N, G, bias, y);
  // The rows' int8-rounded values, back in float (see the header).
  std::vector<float> xr(M * K);
  {
    std::vector<int8_t> xq(K);
    std::vector<float> sx(K / 32), xsum(K / 32);
    for (int64_t m = 0; m < M; ++m) {
      quantize_row_q8(x + m * K, K, xq.data(), sx.data(), xsum.data());
      for (int64_t k = 0; k < K; ++k) xr[m * K + k] = sx[k / 32] * static_cast<float>(xq[k]);
    }
  }
  x = xr.data();
  const int64_t ngroups = K / G;
  const int64_t row_bytes = INT4 ? K / 2 : K;
  const int64_t ntiles = (N + NR - 1) / NR;
  at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
    alignas(32) float wbuf[NR * KC];
    std::vector<float> acc(M * NR);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * NR;
      const int64_t nr = std::min(NR, N - n0);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        for (int64_t r = 0; r < NR; ++r) {
          // A ragged last tile repeats its last row: harmless work, no branches in the inner loop.
          const int64_t n = n0 + std::min(r, nr - 1);
          if (INT4)
            dequant_int4(q + n * row_bytes, s + n * ngroups, mn + n * ngroups, G, k0, kc, wbuf + r * KC);
          else
            dequant_int8(reinterpret_cast<const int8_t*>(q) + n * row_bytes, s + n * ngroups, G, k0, kc,
                         wbuf + r * KC);
        }
        int64_t m = 0;
        // Two rows at most: 2 x NR accumulators + 2 x vectors + 1 weight fit AVX2's 16 ymm registers.
        for (; m + 2 <= M; m += 2) tile_dot<2>(x + m * K + k0, K, wbuf, kc, acc.data() + m * NR, NR);
        for (; m < M; ++m) tile_dot<1>(x + m * K + k0, K, wbuf, kc, acc.data() + m * NR, NR);
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t r = 0; r < nr; ++r) y[m * N + n0 + r] = acc[m * NR + r] + (bias ? bias[n0 + r] : 0.f);
    }
  });
}

template <bool INT4>
void dequant_impl(const uint8_t* q, const uint16_t* s, const uint16_t* mn, int64_t N, int64_t K, int64_t G, float* out) {
  const int64_t ngroups = K / G;
  const int64_t row_bytes = INT4 ? K / 2 : K;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      if (INT4)
        dequant_int4(q + n * row_bytes, s + n * ngroups, mn + n * ngroups, G, 0, K, out + n * K);
      else
        dequant_int8(reinterpret_cast<const int8_t*>(q) + n * row_bytes, s + n * ngroups, G, 0, K, out + n * K);
    }
  });
}

void check_args(const torch::Tensor& q, const torch::Tensor& s, int64_t K, int64_t G) {
  TORCH_CHECK(q.is_contiguous() && s.is_contiguous(), "weights must be contiguous");
  TORCH_CHECK(s.scalar_type() == torch::kHalf, "scales must be float16");
  TORCH_CHECK(K % 32 == 0 && G % 32 == 0 && K % G == 0, "K and the group size must be multiples of 32");
  TORCH_CHECK(s.size(0) == q.size(0) && s.size(1) == K / G, "scales must be [N, K / group_size]");
}

}  // namespace

// x: float32 [M, K]; q: int8 [N, K] or uint8 [N, K/2]; s, mn: float16 [N, K/G]; bias: float32 [N] or empty.
torch::Tensor qlinear(torch::Tensor x, torch::Tensor q, torch::Tensor s, torch::Tensor mn, int64_t group_size,
                      c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be float32 [M, K]");
  x = x.contiguous();
  const bool int4 = q.scalar_type() == torch::kByte;
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(q.size(1) == (int4 ? K / 2 : K), "weight shape does not match x");
  check_args(q, s, K, group_size);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == N && bias->is_contiguous(), "bad bias");
    b = bias->data_ptr<float>();
  }
  auto y = torch::empty({M, N}, x.options());
  const auto* s_ptr = reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>());
  if (int4) {
    TORCH_CHECK(mn.sizes() == s.sizes() && mn.scalar_type() == torch::kHalf && mn.is_contiguous(), "bad mins");
    qlinear_impl<true>(x.data_ptr<float>(), M, K, q.data_ptr<uint8_t>(), s_ptr,
                       reinterpret_cast<const uint16_t*>(mn.data_ptr<at::Half>()), N, group_size, b, y.data_ptr<float>());
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kChar, "int8 weights must be torch.int8");
    qlinear_impl<false>(x.data_ptr<float>(), M, K, reinterpret_cast<const uint8_t*>(q.data_ptr<int8_t>()), s_ptr,
                        nullptr, N, group_size, b, y.data_ptr<float>());
  }
  return y;
}

// The float32 weights [N, K] (for prefill: dequantize once, then one float32 GEMM).
torch::Tensor dequantize(torch::Tensor q, torch::Tensor s, torch::Tensor mn, int64_t group_size) {
  const bool int4 = q.scalar_type() == torch::kByte;
  const int64_t N = q.size(0), K = int4 ? q.size(1) * 2 : q.size(1);
  check_args(q, s, K, group_size);
  auto out = torch::empty({N, K}, torch::dtype(torch::kFloat));
  const auto* s_ptr = reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>());
  if (int4)
    dequant_impl<true>(q.data_ptr<uint8_t>(), s_ptr, reinterpret_cast<const uint16_t*>(mn.data_ptr<at::Half>()), N, K,
                       group_size, out.data_ptr<float>());
  else
    dequant_impl<false>(reinterpret_cast<const uint8_t*>(q.data_ptr<int8_t>()), s_ptr, nullptr, N, K, group_size,
                        out.data_ptr<float>());
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &qlinear, "y = x @ dequant(W)^T + bias");
  m.def("dequantize", &dequantize, "dequant(W) as float32 [N, K]");
}
