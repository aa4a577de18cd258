// Attention of a few new tokens per sequence over the paged KV pool (decodes, speculative verification,
// short chunks): what layers/attention.py's padded path computes with index_select + SDPA, without
// gathering K and V into padded copies first, and with each query row computed on its own.
//
// Inputs (float32 unless noted):
//   q      [T, H, D]  any row/head strides, unit stride within a head
//   kc, vc [S, Hkv, D]  the layer's pool: float32, or int8 with float32 per-channel scales ks, vs [Hkv, D]
//          (value = int8 * scale; layers/kv_cache.py)
//   rows   int64 [B, Q]  row of each sequence's i-th new token in q / out, -1 = padding
//   slots  int64 [B, L]  slots of the keys each sequence may see, in position order
//   mask   bool  [B, Q, L]  true = attend (causal, sliding window)
// out [T, H, D] (contiguous) gets softmax(q k^T * scale) v for every valid row.
//
// Work is split by (sequence, kv head): each key and value vector is read once for all the sequence's new
// tokens and the query heads that share it (GQA). An int8 pool's K scales are folded into the query
// (q . (k * s) = (q * s) . k), its V scales into the output. Per (query row, head): scores for the keys in its
// mask's span (masked ones inside it -inf), max, exp (vectorized, ~1 ulp), sum, then the weighted values
// in key order. A row's result depends only on
// its own query and keys, never on the other rows or sequences in the call: speculative verification of k
// tokens gives bit for bit what k plain decode steps give.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {


// 8 float32 or int8 values as floats
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <typename KV>
void decode_attention_impl(const float* q, int64_t q_row_stride, int64_t q_head_stride, const KV* kc, const KV* vc,
                           const float* ks, const float* vs, int64_t Hkv, int64_t D, const int64_t* rows,
                           int64_t B, int64_t Q, const int64_t* slots, int64_t L, const bool* mask, int64_t H,
                           float scale, float* out) {
  const int64_t G = H / Hkv;  // query heads per kv head
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> score(Q * G * L), acc(Q * G * D), inv_sum(Q * G), qs(Q * G * D);
    std::vector<int64_t> lo(Q), hi(Q);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / Hkv, g = t % Hkv;
      const int64_t* seq_slots = slots + b * L;
      // each row's span of visible keys; the union is read once for all rows
      int64_t jlo = L, jhi = 0;
      for (int64_t i = 0; i < Q; ++i) {
        lo[i] = hi[i] = 0;
        const int64_t row = rows[b * Q + i];
        if (row < 0) continue;
        const bool* m = mask + (b * Q + i) * L;
        int64_t l = 0, h = L;
        while (l < L && !m[l]) ++l;
        while (h > l && !m[h - 1]) --h;
        lo[i] = l;
        hi[i] = h;
        if (l == h) {  // sees no key (cannot happen for a real token): zeros, as a fully masked softmax
          for (int64_t hh = 0; hh < G; ++hh) std::fill_n(out + (row * H + g * G + hh) * D, D, 0.f);
          continue;
        }
        jlo = std::min(jlo, l);
        jhi = std::max(jhi, h);
        // the row's G query heads, times the K scales of an int8 pool
        for (int64_t hh = 0; hh < G; ++hh) {
          const float* qh = q + row * q_row_stride + (g * G + hh) * q_head_stride;
          float* dst = qs.data() + (i * G + hh) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = ks ? qh[d] * ks[g * D + d] : qh[d];
        }
      }
      // scores: each key vector once, against every row's G query heads
      for (int64_t j = jlo; j < jhi; ++j) {
        const int64_t off = seq_slots[j] * Hkv + g;
        const KV* k = kc + off * D;
        for (int64_t i = 0; i < Q; ++i) {
          if (j < lo[i] || j >= hi[i]) continue;
          const bool visible = mask[(b * Q + i) * L + j];
          for (int64_t h = 0; h < G; ++h) {
            float s = NEG_INF;
            if (visible) {
              const float* qh = qs.data() + (i * G + h) * D;
              __m256 a = _mm256_setzero_ps();
              for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + d), load8(k + d), a);
              s = hsum(a) * scale;
            }
            score[(i * G + h) * L + j] = s;
          }
        }
      }
      // softmax per (row, head) over its own span
      for (int64_t i = 0; i < Q; ++i) {
        if (lo[i] == hi[i]) continue;
        for (int64_t h = 0; h < G; ++h) {
          float* s = score.data() + (i * G + h) * L;
          float mx = NEG_INF;
          for (int64_t j = lo[i]; j < hi[i]; ++j) mx = std::max(mx, s[j]);
          const __m256 mxv = _mm256_set1_ps(mx);
          __m256 sum = _mm256_setzero_ps();
          int64_t j = lo[i];
          for (; j + 8 <= hi[i]; j += 8) {
            const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mxv));
            _mm256_storeu_ps(s + j, p);
            sum = _mm256_add_ps(sum, p);
          }
          float tail = 0.f;
          if (j < hi[i]) {  // the last < 8 keys through the same exp, on a padded copy
            alignas(32) float buf[8];
            for (int64_t u = 0; u < 8; ++u) buf[u] = j + u < hi[i] ? s[j + u] - mx : NEG_INF;
            _mm256_store_ps(buf, exp8(_mm256_load_ps(buf)));
            for (int64_t u = 0; j + u < hi[i]; ++u) {
              s[j + u] = buf[u];
              tail += buf[u];
            }
          }
          inv_sum[i * G + h] = 1.0f / (hsum(sum) + tail);
        }
      }
      // weighted values: each value vector once, into every (row, head) accumulator, in key order
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = jlo; j < jhi; ++j) {
        const int64_t off = seq_slots[j] * Hkv + g;
        const KV* v = vc + off * D;
        for (int64_t i = 0; i < Q; ++i) {
          if (j < lo[i] || j >= hi[i]) continue;
          for (int64_t h = 0; h < G; ++h) {
            const float p = score[(i * G + h) * L + j];
            if (p == 0.f) continue;
            const __m256 pv = _mm256_set1_ps(p);
            float* a = acc.data() + (i * G + h) * D;
            for (int64_t d = 0; d < D; d += 8)
              _mm256_storeu_ps(a + d, _mm256_fmadd_ps(pv, load8(v + d), _mm256_loadu_ps(a + d)));
          }
        }
      }
      for (int64_t i = 0; i < Q; ++i) {
        if (lo[i] == hi[i]) continue;
        const int64_t row = rows[b * Q + i];
        for (int64_t h = 0; h < G; ++h) {
          const __m256 inv = _mm256_set1_ps(inv_sum[i * G + h]);
          const float* a = acc.data() + (i * G + h) * D;
          float* o = out + (row * H + g * G + h) * D;
          for (int64_t d = 0; d < D; d += 8) {
            const __m256 r = _mm256_mul_ps(_mm256_loadu_ps(a + d), inv);
            _mm256_storeu_ps(o + d, vs ? _mm256_mul_ps(r, _mm256_loadu_ps(vs + g * D + d)) : r);
          }
        }
      }
    }
  });
}

}  // namespace

// Writes into out; see the header for the arguments. ks / vs: float32 [Hkv, D] scales for an int8 pool,
// empty tensors for a float32 one.
void decode_attention(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor ks, torch::Tensor vs,
                      torch::Tensor rows, torch::Tensor slots, torch::Tensor mask, double scale, torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.stride(2) == 1, "q must be float32 [T, H, D]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == torch::kFloat, "bad out");
  TORCH_CHECK(kc.dim() == 3 && kc.is_contiguous() && vc.is_contiguous() && kc.sizes() == vc.sizes(), "bad pool");
  TORCH_CHECK(rows.dim() == 2 && slots.dim() == 2 && mask.dim() == 3 && rows.is_contiguous() && slots.is_contiguous() &&
              mask.is_contiguous() && mask.scalar_type() == torch::kBool, "bad metadata");
  const int64_t H = q.size(1), D = q.size(2), Hkv = kc.size(1), B = rows.size(0), Q = rows.size(1), L = slots.size(1);
  TORCH_CHECK(kc.size(2) == D && D % 8 == 0 && H % Hkv == 0, "head sizes do not match");
  TORCH_CHECK(slots.size(0) == B && mask.size(0) == B && mask.size(1) == Q && mask.size(2) == L, "metadata shapes");
  const bool quantized = kc.scalar_type() == torch::kChar;
  if (quantized) {
    TORCH_CHECK(ks.scalar_type() == torch::kFloat && vs.scalar_type() == torch::kFloat && ks.is_contiguous() &&
                vs.is_contiguous() && ks.numel() == Hkv * D && vs.numel() == ks.numel(),
                "int8 pool needs float32 scales [Hkv, D]");
    decode_attention_impl<int8_t>(q.data_ptr<float>(), q.stride(0), q.stride(1), kc.data_ptr<int8_t>(),
                                  vc.data_ptr<int8_t>(), ks.data_ptr<float>(), vs.data_ptr<float>(), Hkv, D, rows.data_ptr<int64_t>(), B, Q,
                                  slots.data_ptr<int64_t>(), L, mask.data_ptr<bool>(), H, float(scale),
                                  out.data_ptr<float>());
  } else {
    TORCH_CHECK(kc.scalar_type() == torch::kFloat, "pool must be float32 or int8");
    decode_attention_impl<float>(q.data_ptr<float>(), q.stride(0), q.stride(1), kc.data_ptr<float>(),
                                 vc.data_ptr<float>(), nullptr, nullptr, Hkv, D, rows.data_ptr<int64_t>(), B, Q,
                                 slots.data_ptr<int64_t>(), L, mask.data_ptr<bool>(), H, float(scale),
                                 out.data_ptr<float>());
  }
}
