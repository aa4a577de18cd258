// Attention of a few new tokens per sequence over the paged KV pool (decodes, speculative verification,
// short chunks): what layers/attention.py's padded path computes with index_select + SDPA, without
// gathering K and V into padded copies first, and with each query row computed on its own.
//
// Inputs (float32 unless noted):
//   q      [T, H, D]  any row/head strides, unit stride within a head
//   kc, vc [S, Hkv, D]  the layer's pool: float32, float16, bfloat16, or int8 with float32 per-channel
//          scales ks, vs [Hkv, D] (value = int8 * scale; layers/kv_cache.py)
//   rows   int64 [B, Q]  row of each sequence's i-th new token in q / out, -1 = padding
//   slots  int64 [B, L]  slots of the keys each sequence may see, in position order
//   mask   bool  [B, Q, L]  true = attend (causal, sliding window)
// out [T, H, D] (contiguous) gets softmax(q k^T * scale) v for every valid row.
//
// Work is split by (sequence, kv head). Keys and values are gathered from the paged pool 64 at a time into a
// float32 block that stays in L1 while every new token of the sequence and every query head sharing the kv
// head (GQA) uses it. Scores go 8 keys per step: 8 dot products side by side, reduced together, rather than
// one horizontal sum per key (which made decode at long contexts slow). An
// int8 pool's K scales are folded into the query (q . (k * s) = (q * s) . k), its V scales into the output.
// Per (query row, head): scores for the keys in its mask's span (masked ones inside it -inf), max, exp
// (vectorized, ~1 ulp), sum, then the weighted values in key order, the accumulator in registers. A row's
// result depends only on its own query and keys, never on the other rows or sequences in the call:
// speculative verification of k tokens gives bit for bit what k plain decode steps give.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"
#include <cmath>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {


// 8 pool values (float32, float16, bfloat16 or int8) as float32: exact conversions
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const at::BFloat16* p) {  // a bfloat16 is the top half of its float32
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

constexpr int64_t KB = 64;  // keys per block: a block's K or V, as float32 [KB, D], stays in L1 for all query heads

// Keys j0..j0+n-1 of a sequence (kv head g) from the pool into buf [KB, D] as float32, zero past n. The
// next block's rows (keys j0 + KB .. j1 - 1) are requested meanwhile, so they arrive while this block is
// computed on: without it the gathers wait on memory one block at a time (docs/cpu_speed.md).
template <typename KV>
inline void gather_block(const KV* pool, const int64_t* seq_slots, int64_t j0, int64_t n, int64_t j1, int64_t Hkv,
                         int64_t g, int64_t D, float* buf) {
  const int64_t row_bytes = D * sizeof(KV);
  for (int64_t t = 0; t < n; ++t) {
    if (j0 + KB + t < j1) {
      const char* next = reinterpret_cast<const char*>(pool + (seq_slots[j0 + KB + t] * Hkv + g) * D);
      for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch(next + o, _MM_HINT_T1);
    }
    const KV* src = pool + (seq_slots[j0 + t] * Hkv + g) * D;
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(buf + t * D + d, load8(src + d));
  }
  if (n < KB) std::fill(buf + n * D, buf + KB * D, 0.f);
}

// Lane t = the sum of a[t]'s 8 lanes, by the same tree for every t.
inline __m256 hsum8x8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// acc[0 : 8 NC] += sum over keys j in [jb, je) of p[j] * v[j - j0] (v rows of D floats from column dc), in
// key order, the accumulator in registers.
template <int NC>
inline void accumulate_values(float* acc, const float* p, const float* v, int64_t j0, int64_t jb, int64_t je,
                              int64_t D) {
  __m256 r[NC];
  for (int c = 0; c < NC; ++c) r[c] = _mm256_loadu_ps(acc + 8 * c);
  for (int64_t j = jb; j < je; ++j) {
    if (p[j] == 0.f) continue;
    const __m256 pv = _mm256_set1_ps(p[j]);
    const float* vj = v + (j - j0) * D;
    for (int c = 0; c < NC; ++c) r[c] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vj + 8 * c), r[c]);
  }
  for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc + 8 * c, r[c]);
}

template <typename KV>
void decode_attention_impl(const float* q, int64_t q_row_stride, int64_t q_head_stride, const KV* kc, const KV* vc,
                           const float* ks, const float* vs, int64_t Hkv, int64_t D, const int64_t* rows,
                           int64_t B, int64_t Q, const int64_t* slots, int64_t L, const bool* mask, int64_t H,
                           float scale, float* out) {
  const int64_t G = H / Hkv;  // query heads per kv head
  constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * Hkv, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> score(Q * G * L), acc(Q * G * D), inv_sum(Q * G), qs(Q * G * D), buf(KB * D);
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
      // scores, a block of keys at a time (as float32 in L1), 8 keys per step: 8 dot products side by side,
      // reduced together (hsum8x8). A key's score depends only on its own vector and the query.
      for (int64_t j0 = jlo; j0 < jhi; j0 += KB) {
        const int64_t n = std::min(KB, jhi - j0);
        gather_block(kc, seq_slots, j0, n, jhi, Hkv, g, D, buf.data());
        for (int64_t i = 0; i < Q; ++i) {
          const int64_t jb = std::max(lo[i], j0), je = std::min(hi[i], j0 + n);
          if (jb >= je) continue;
          const bool* m = mask + (b * Q + i) * L;
          for (int64_t h = 0; h < G; ++h) {
            const float* qh = qs.data() + (i * G + h) * D;
            float* srow = score.data() + (i * G + h) * L;
            for (int64_t k0 = (jb - j0) / 8 * 8; j0 + k0 < je; k0 += 8) {
              __m256 a[8];
              for (int u = 0; u < 8; ++u) a[u] = _mm256_setzero_ps();
              const float* kb = buf.data() + k0 * D;
              for (int64_t d = 0; d < D; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qh + d);
                for (int u = 0; u < 8; ++u) a[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kb + u * D + d), a[u]);
              }
              const __m256 sv = _mm256_mul_ps(hsum8x8(a), _mm256_set1_ps(scale));
              const int64_t jj = j0 + k0;
              uint64_t m8;
              // 8 keys inside the row's span and all visible (a decode's usual case): one store
              if (jj >= jb && jj + 8 <= je && (std::memcpy(&m8, m + jj, 8), m8 == 0x0101010101010101ull)) {
                _mm256_storeu_ps(srow + jj, sv);
                continue;
              }
              alignas(32) float s8[8];
              _mm256_store_ps(s8, sv);
              for (int u = 0; u < 8; ++u) {
                const int64_t j = j0 + k0 + u;
                if (j >= jb && j < je) srow[j] = m[j] ? s8[u] : NEG_INF;
              }
            }
          }
        }
      }
      // softmax per (row, head) over its own span
      for (int64_t i = 0; i < Q; ++i) {
        if (lo[i] == hi[i]) continue;
        for (int64_t h = 0; h < G; ++h) {
          float* s = score.data() + (i * G + h) * L;
          const float mx = max_of(s + lo[i], hi[i] - lo[i]);
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
            alignas(32) float pad[8];
            for (int64_t u = 0; u < 8; ++u) pad[u] = j + u < hi[i] ? s[j + u] - mx : NEG_INF;
            _mm256_store_ps(pad, exp8(_mm256_load_ps(pad)));
            for (int64_t u = 0; j + u < hi[i]; ++u) {
              s[j + u] = pad[u];
              tail += pad[u];
            }
          }
          inv_sum[i * G + h] = 1.0f / (hsum(sum) + tail);
        }
      }
      // weighted values, a block at a time: each (row, head) accumulator takes its keys in key order
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j0 = jlo; j0 < jhi; j0 += KB) {
        const int64_t n = std::min(KB, jhi - j0);
        gather_block(vc, seq_slots, j0, n, jhi, Hkv, g, D, buf.data());
        for (int64_t i = 0; i < Q; ++i) {
          const int64_t jb = std::max(lo[i], j0), je = std::min(hi[i], j0 + n);
          if (jb >= je) continue;
          for (int64_t h = 0; h < G; ++h) {
            const float* p = score.data() + (i * G + h) * L;
            float* a = acc.data() + (i * G + h) * D;
            for (int64_t dc = 0; dc < D; dc += 64) {
              switch (std::min<int64_t>(8, (D - dc) / 8)) {
#define SUDU_NC(NC) \
  case NC:          \
    accumulate_values<NC>(a + dc, p, buf.data() + dc, j0, jb, je, D); \
    break;
                SUDU_NC(1) SUDU_NC(2) SUDU_NC(3) SUDU_NC(4) SUDU_NC(5) SUDU_NC(6) SUDU_NC(7) SUDU_NC(8)
#undef SUDU_NC
                default: break;
              }
            }
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
// empty tensors for a float one.
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
  TORCH_CHECK(vc.scalar_type() == kc.scalar_type(), "K and V pools differ in dtype");
  const float* ksp = nullptr;
  const float* vsp = nullptr;
  if (kc.scalar_type() == torch::kChar) {
    TORCH_CHECK(ks.scalar_type() == torch::kFloat && vs.scalar_type() == torch::kFloat && ks.is_contiguous() &&
                vs.is_contiguous() && ks.numel() == Hkv * D && vs.numel() == ks.numel(),
                "int8 pool needs float32 scales [Hkv, D]");
    ksp = ks.data_ptr<float>();
    vsp = vs.data_ptr<float>();
  }
  auto run = [&](auto* k, auto* v) {
    decode_attention_impl(q.data_ptr<float>(), q.stride(0), q.stride(1), k, v, ksp, vsp, Hkv, D,
                          rows.data_ptr<int64_t>(), B, Q, slots.data_ptr<int64_t>(), L, mask.data_ptr<bool>(), H,
                          float(scale), out.data_ptr<float>());
  };
  switch (kc.scalar_type()) {
    case torch::kFloat: run(kc.data_ptr<float>(), vc.data_ptr<float>()); break;
    case torch::kHalf: run(kc.data_ptr<at::Half>(), vc.data_ptr<at::Half>()); break;
    case torch::kBFloat16: run(kc.data_ptr<at::BFloat16>(), vc.data_ptr<at::BFloat16>()); break;
    case torch::kChar: run(kc.data_ptr<int8_t>(), vc.data_ptr<int8_t>()); break;
    default: TORCH_CHECK(false, "pool must be float32, float16, bfloat16 or int8");
  }
}
