// Small AVX2 helpers shared by the kernels.
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

// A std::allocator whose blocks start on a cache line: a tile row that straddles two lines makes every tile
// load and store several times slower.
template <typename T>
struct LineAligned {
  using value_type = T;
  LineAligned() = default;
  template <typename U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAligned<U>&) const { return true; }
};
template <typename T>
using Aligned = std::vector<T, LineAligned<T>>;

// A prefetch of p's line into every cache level (prefetcht0). An asm statement, because GCC 12 emitted no
// instruction for _mm_prefetch / __builtin_prefetch in the attention kernels' templates (their objects had none).
inline void prefetch_line(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }

// f(std::integral_constant<int, R>, m) over all M rows in chunks of at most MAXR (R a compile-time row count).
template <int MAXR, class F>
inline void row_chunks(int64_t M, F&& f) {
  int64_t m = 0;
  for (; m + MAXR <= M; m += MAXR) f(std::integral_constant<int, MAXR>{}, m);
  switch (M - m) {
#define SUDU_ROWS(R) \
  case R:            \
    if constexpr (R < MAXR) f(std::integral_constant<int, R>{}, m); \
    break;
    SUDU_ROWS(7) SUDU_ROWS(6) SUDU_ROWS(5) SUDU_ROWS(4) SUDU_ROWS(3) SUDU_ROWS(2) SUDU_ROWS(1)
#undef SUDU_ROWS
    default: break;
  }
}

// One float32 -> bfloat16, round to nearest even (as PyTorch's .to(torch.bfloat16) for finite values).
inline uint16_t to_bf16_1(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// float32 -> bfloat16, n values, rounded as to_bf16_1.
inline void to_bf16(const float* in, int64_t n, uint16_t* out) {
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i h[2];
    for (int j = 0; j < 2; ++j) {
      const __m256i bits = _mm256_castps_si256(_mm256_loadu_ps(in + i + 8 * j));
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
      h[j] = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(bias, odd)), 16);
    }
    // packus works per 128-bit lane; the permutation restores element order
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h[0], h[1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), packed);
  }
  for (; i < n; ++i) out[i] = to_bf16_1(in[i]);
}

// bfloat16 -> float32 (exact), n values.
inline void from_bf16(const uint16_t* in, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i)));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
  }
  for (; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(in[i]) << 16;
    std::memcpy(out + i, &bits, 4);
  }
}

// The sum of a vector's 8 floats.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The largest of s[0..n) (-inf for n = 0), 8 lanes at a time: a max is exact, so any order gives the same
// value. A NaN is skipped, as std::max(running, NaN) skips it.
inline float max_of(const float* s, int64_t n) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(_mm256_loadu_ps(s + j), m);  // m where the load is NaN
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  float mx = _mm_cvtss_f32(h);
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  return mx;
}

// exp(x) for 8 floats: exp(x) = 2^n * exp(r), n = round(x / ln 2), |r| <= ln 2 / 2, exp(r) by a degree-6
// polynomial (Cephes' coefficients); relative error ~1e-7. x below -87.3 (including -inf) gives 0.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  const __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(zero_mask, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// silu(g) * u for 8 floats, silu(g) = g / (1 + exp(-g)): the one expression every silu * up path uses, so
// they give the same values.
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 e = exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}
