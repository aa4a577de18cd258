// Activation quantization for the quantized products (act_quant.h): per 32 columns, codes rounded to nearest
// even, as llama.cpp's Q8 activations.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "act_quant.h"

namespace qtiles {

namespace {

// Codes x * id rounded to nearest even (the default MXCSR mode; packs saturate at +-127): n floats (a
// multiple of 32) into xq; sum16 gets the sum of each 16 codes.
inline void round_codes(const float* x, int n, float id, int8_t* xq, int32_t* sum16) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  auto hsum = [](__m256i v) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    return _mm_cvtsi128_si32(t);
  };
  for (int b = 0; b < n; b += 32) {
    __m256i qi[4];
    for (int j = 0; j < 4; ++j) qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + b + 8 * j), _mm256_set1_ps(id)));
    // packs work per 128-bit lane; the permutation restores element order
    __m256i p = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b), p);
    sum16[b / 16] = hsum(_mm256_add_epi32(qi[0], qi[1]));
    sum16[b / 16 + 1] = hsum(_mm256_add_epi32(qi[2], qi[3]));
  }
}

// The largest |x| of n floats (a multiple of 8).
inline float abs_max(const float* x, int n) {
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int j = 0; j < n; j += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, _mm256_loadu_ps(x + j)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm_cvtss_f32(m4);
}

// Two int16 values as one int32 (low, high): a madd operand.
inline int32_t int16_pair(int32_t lo, int32_t hi) {
  return static_cast<int32_t>((static_cast<uint32_t>(hi) << 16) | (static_cast<uint32_t>(lo) & 0xFFFF));
}

}  // namespace

void ActRows::quantize(const float* x, int64_t M, int64_t K_, bool q8_0, bool q8_K, bool by_group) {
  K = K_;
  nb = K / 32;
  if (q8_0) {
    xq.resize(M * K);
    sx.resize(M * nb);
    xsum.resize(M * nb);
    isum.resize(M * nb);
  }
  if (q8_K) {  // K a multiple of 256
    kq.resize(M * K);
    ksx.resize(M * nb / 8);
    kf.resize(M * nb);
    kpair.resize(M * nb / 2);
    k16pair.resize(M * nb);
  }
  auto rows = [&](int64_t m0, int64_t m1) {
    int32_t s16[2];
    std::vector<int32_t> fsum(nb);  // f * sum(codes) per block
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = x + m * K;
      if (q8_0)
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t o = m * nb + b;
          const float d = abs_max(xr + 32 * b, 32) / 127.0f;
          round_codes(xr + 32 * b, 32, d != 0.0f ? 1.0f / d : 0.0f, xq.data() + m * K + 32 * b, s16);
          sx[o] = d;
          isum[o] = s16[0] + s16[1];
          xsum[o] = d * static_cast<float>(isum[o]);
        }
      if (q8_K) {
        for (int64_t g = 0; g < nb / 8; ++g) {
          const float amax = abs_max(xr + 256 * g, 256), D = amax / 127.0f;
          ksx[m * nb / 8 + g] = D * 0.125f;
          for (int64_t b = 8 * g; b < 8 * g + 8; ++b) {
            const float bmax = abs_max(xr + 32 * b, 32);
            const int f = amax != 0.0f ? std::min(8, std::max(1, static_cast<int>(std::ceil(8.0f * bmax / amax)))) : 8;
            const float s = D * (static_cast<float>(f) * 0.125f);
            round_codes(xr + 32 * b, 32, s != 0.0f ? 1.0f / s : 0.0f, kq.data() + m * K + 32 * b, s16);
            kf[m * nb + b] = static_cast<int16_t>(f);
            k16pair[m * nb + b] = int16_pair(f * s16[0], f * s16[1]);
            fsum[b] = f * (s16[0] + s16[1]);
          }
        }
        for (int64_t b = 0; b < nb; b += 2) kpair[m * nb / 2 + b / 2] = int16_pair(fsum[b], fsum[b + 1]);
      }
    }
  };
  if (M >= 16 && !at::in_parallel_region()) at::parallel_for(0, M, 8, rows);
  else rows(0, M);
  const int64_t groups = by_group ? M / 16 : 0;
  sx16.resize(q8_0 ? groups * nb * 16 : 0);
  xsum16.resize(sx16.size());
  kf16.resize(q8_K ? groups * nb * 16 : 0);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t o = (g * nb + b) * 16 + i, r = (16 * g + i) * nb + b;
        if (q8_0) sx16[o] = sx[r], xsum16[o] = xsum[r];
        if (q8_K) kf16[o] = kf[r];
      }
}

}  // namespace qtiles
