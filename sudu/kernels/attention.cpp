// Attention over the paged KV pool, in float32: decode_attention (few new tokens per sequence: decodes,
// speculative verification, short chunks, many sequences per call) and prompt_attention (one prompt chunk's
// many new tokens). Both compute every query row with one arithmetic, the row recipe below, so a row's
// result depends only on its own query and the keys it sees: not on the other rows, sequences or heads of
// the call, not on which of the two entry points takes it, not on how the prompt was chunked or which part
// of it came from a cache (docs/exactness.md).
//
// Pool (both): kc, vc [S, Hkv, D] (any slot and head strides, unit stride within a head: layers/kv_cache.py
// keeps each head's rows together) float32, float16, bfloat16, or int8 with float32 per-channel scales ks, vs
// [Hkv, D] (value = int8 * scale; layers/kv_cache.py). A sequence's keys are a list of slots in position
// order; key index j of the list sits at absolute position base + j with base a multiple of KB
// (layers/attention.py build_view pads a list whose first kept position is not), so the key blocks below
// start at the same absolute positions whatever the list.
//
// The row recipe, per (query row, head), over its span [lo, hi) of visible keys:
//   qs = q * scale (int8 pool: * ks, the K scales folded into the query);
//   key blocks of KB, at key indices that are multiples of KB, in increasing order, each block with a
//   visible key: a key's score is one fused multiply-add chain over d = 0..D-1 (qs[d] * k[d]); invisible
//   keys -inf; the block's max m_b; m' = max(m, m_b); corr = exp(m - m') (std::exp); the weights
//   p = exp8(score - m') by 8-lane groups at key offsets 0, 8, ... of the block, summed lane-wise in group
//   order then by hsum; l = l * corr + that sum; o = o * corr (where corr != 1); o += p_j * v_j in key order;
//   out = o * (1 / l) (int8 pool: * vs).
// A key that the row does not see has p = 0 exactly, and adding 0 (a sum) or 0 * v (an accumulator that is
// never -0) changes nothing, so computing several rows together over the union of their spans gives each
// row exactly its own recipe.
//
// The other arithmetic, the "bfloat16 tiles" (tiles = true: attention_tiles.cpp, where AMX's bfloat16 tiles
// are granted and D is a multiple of 32), has a row recipe of its own with the same structure (key blocks of
// KB at absolute positions, an online softmax per row) and takes the same rows from both entry points.
//
// Work: decode_attention splits by (sequence, kv head), prompt_attention by (kv head, block of BQ query
// positions; up to 8 BQ with the tiles), the latest positions first from a shared counter (the causal
// triangle's uneven items even out over the threads). Per item the G query heads of the kv head and its query
// positions are one block of rows: each key block is gathered from the pool once, K transposed into an L1
// buffer for register-blocked scores (RS rows x 16 keys; AVX-512: RS512 rows x 32 keys), V as rows for the
// weighted sums (RS rows x 16 columns; AVX-512: 64). The AVX-512 products compute the AVX2 ones' chains lane
// for lane: the same bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_tiles.h"
#include "kernels.h"
#include "simd.h"

namespace {

constexpr int64_t KB = 64;  // keys per block (layers/attention.py KEY_BLOCK)
constexpr int64_t BQ = 16;  // query positions per prompt work item
constexpr int RS = 6;       // query rows per register block (12 accumulators, 2 loads, 1 broadcast)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

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

// r[0..8) transposed in place (8 x 8 floats).
inline void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// One sequence's keys and values in the pool, for kv head g: a key's row at slot * ss + g * hs (the pool's
// strides: layers/kv_cache.py keeps each head's rows together on the CPU).
template <typename KV>
struct SeqKV {
  const KV *kc, *vc;
  const int64_t* slots;  // key index -> slot
  int64_t ss, hs, D, g;
  const KV* k(int64_t j) const { return kc + slots[j] * ss + g * hs; }
  const KV* v(int64_t j) const { return vc + slots[j] * ss + g * hs; }
};

template <typename KV>
constexpr atiles::Pool pool_of() {
  if constexpr (std::is_same_v<KV, float>) return atiles::Pool::F32;
  if constexpr (std::is_same_v<KV, at::Half>) return atiles::Pool::F16;
  if constexpr (std::is_same_v<KV, at::BFloat16>) return atiles::Pool::BF16;
  return atiles::Pool::I8;
}

// s[r][c0 .. c0 + 16) = qs[r] . key c0 + j, for RB query rows (qs rows of D floats), the keys' block
// transposed in kt [D][KB]: one fused multiply-add chain over d per score.
template <int RB>
inline void scores(const float* qs, int64_t D, const float* kt, int64_t c0, float* s) {
  __m256 a[RB][2];
  for (int r = 0; r < RB; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * KB + c0), k1 = _mm256_loadu_ps(kt + d * KB + c0 + 8);
    for (int r = 0; r < RB; ++r) {
      const __m256 qv = _mm256_set1_ps(qs[r * D + d]);
      a[r][0] = _mm256_fmadd_ps(qv, k0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(qv, k1, a[r][1]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    _mm256_storeu_ps(s + r * KB + c0, a[r][0]);
    _mm256_storeu_ps(s + r * KB + c0 + 8, a[r][1]);
  }
}

// o[r][c0 .. c0 + 8 NC) += sum over keys j in [j0, j1) of p[r][j] * v_j[c0 ..], in key order, for RB rows
// (o rows of D floats, p rows of KB, v rows of D).
template <int RB, int NC>
inline void values(const float* p, int64_t j0, int64_t j1, const float* vb, float* o, int64_t D, int64_t c0) {
  __m256 a[RB][NC];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) a[r][c] = _mm256_loadu_ps(o + r * D + c0 + 8 * c);
  for (int64_t j = j0; j < j1; ++j) {
    __m256 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = _mm256_loadu_ps(vb + j * D + c0 + 8 * c);
    for (int r = 0; r < RB; ++r) {
      const __m256 pv = _mm256_set1_ps(p[r * KB + j]);
      for (int c = 0; c < NC; ++c) a[r][c] = _mm256_fmadd_ps(pv, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(o + r * D + c0 + 8 * c, a[r][c]);
}

// The same two products with AVX-512 (where the CPU has it: KernelOptions::attention512), bit for bit: a
// score is still one fused multiply-add chain over d per key (a lane per key, 16 or 32 keys per call), and an
// output column still sums p_j * v_j in key order (a lane per column). Twice the lanes per instruction, and
// more rows per register block (32 registers).
#define SUDU_AVX512 __attribute__((target("avx2,fma,f16c,avx512f")))
constexpr int RS512 = 8;  // query rows per register block: 8 x 2 accumulators of 16 keys

// s[r][c0 .. c0 + 16 NK) as scores<RB> (NK = 1 or 2 vectors of 16 keys).
template <int RB, int NK>
SUDU_AVX512 inline void scores512(const float* qs, int64_t D, const float* kt, int64_t c0, float* s) {
  __m512 a[RB][NK];
  for (int r = 0; r < RB; ++r)
    for (int k = 0; k < NK; ++k) a[r][k] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 kv[NK];
    for (int k = 0; k < NK; ++k) kv[k] = _mm512_loadu_ps(kt + d * KB + c0 + 16 * k);
    for (int r = 0; r < RB; ++r) {
      const __m512 qv = _mm512_set1_ps(qs[r * D + d]);
      for (int k = 0; k < NK; ++k) a[r][k] = _mm512_fmadd_ps(qv, kv[k], a[r][k]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int k = 0; k < NK; ++k) _mm512_storeu_ps(s + r * KB + c0 + 16 * k, a[r][k]);
}

// o[r][c0 .. c0 + 16 NC) as values<RB, NC> (NC vectors of 16 columns).
template <int RB, int NC>
SUDU_AVX512 inline void values512(const float* p, int64_t j0, int64_t j1, const float* vb, float* o, int64_t D,
                                  int64_t c0) {
  __m512 a[RB][NC];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) a[r][c] = _mm512_loadu_ps(o + r * D + c0 + 16 * c);
  for (int64_t j = j0; j < j1; ++j) {
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_ps(vb + j * D + c0 + 16 * c);
    for (int r = 0; r < RB; ++r) {
      const __m512 pv = _mm512_set1_ps(p[r * KB + j]);
      for (int c = 0; c < NC; ++c) a[r][c] = _mm512_fmadd_ps(pv, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + r * D + c0 + 16 * c, a[r][c]);
}

// A block's scores for rows [0, R), columns [c0, c1) (multiples of 16), on AVX-512.
SUDU_AVX512 void block_scores512(int64_t R, const float* qs, int64_t D, const float* kt, int64_t c0, int64_t c1,
                                 float* s) {
  row_chunks<RS512>(R, [&](auto rb, int64_t r0) {
    constexpr int RB = decltype(rb)::value;
    int64_t c = c0;
    for (; c + 32 <= c1; c += 32) scores512<RB, 2>(qs + r0 * D, D, kt, c, s + r0 * KB);
    if (c < c1) scores512<RB, 1>(qs + r0 * D, D, kt, c, s + r0 * KB);
  });
}

// A block's weighted values for rows [0, R) over keys [a, b), on AVX-512 (D a multiple of 16).
SUDU_AVX512 void block_values512(int64_t R, const float* p, int64_t a, int64_t b, const float* vb, float* o,
                                 int64_t D) {
  row_chunks<RS>(R, [&](auto rb, int64_t r0) {
    constexpr int RB = decltype(rb)::value;
    const float* pr = p + r0 * KB;
    float* orow = o + r0 * D;
    int64_t c = 0;
    for (; c + 64 <= D; c += 64) values512<RB, 4>(pr, a, b, vb, orow, D, c);
    switch ((D - c) / 16) {
      case 3: values512<RB, 3>(pr, a, b, vb, orow, D, c); break;
      case 2: values512<RB, 2>(pr, a, b, vb, orow, D, c); break;
      case 1: values512<RB, 1>(pr, a, b, vb, orow, D, c); break;
      default: break;
    }
  });
}

struct Scratch {
  std::vector<float> qs, o, s, kt, vb, m, l;
  std::vector<int64_t> lo, hi;
  std::vector<const float*> q;
  std::vector<float*> out;
  void size(int64_t R, int64_t D) {
    if (static_cast<int64_t>(m.size()) >= R && static_cast<int64_t>(kt.size()) == D * KB) return;
    qs.resize(R * D);
    o.resize(R * D);
    s.resize(R * KB);
    kt.resize(D * KB);
    vb.resize(KB * D);
    m.resize(R);
    l.resize(R);
    lo.resize(R);
    hi.resize(R);
    q.resize(R);
    out.resize(R);
  }
  // the row lists alone: the bfloat16 tiles keep buffers of their own (attention_tiles.cpp)
  void size_rows(int64_t R) {
    if (static_cast<int64_t>(q.size()) >= R) return;
    lo.resize(R);
    hi.resize(R);
    q.resize(R);
    out.resize(R);
  }
  void size(int64_t R, int64_t D, bool tiles) { tiles ? size_rows(R) : size(R, D); }
};

// Rows w.q[r] (one query head each, D floats) over their spans [w.lo[r], w.hi[r]) of the sequence's keys, into
// w.out[r]: the row recipe of the header. ks / vs: an int8 pool's scales for this kv head, else null.
template <typename KV>
void attend_rows(const SeqKV<KV>& kv, int64_t R, float scale, const float* ks, const float* vs, Scratch& w,
                 bool tiles) {
  const int64_t D = kv.D;
  if (tiles) {
    const atiles::Keys keys{kv.kc, kv.vc, pool_of<KV>(), kv.slots, kv.ss, kv.hs, D, kv.g};
    atiles::attend_rows(keys, atiles::Rows{R, w.q.data(), w.out.data(), w.lo.data(), w.hi.data()}, scale, ks, vs);
    return;
  }
  const bool wide = kernel_options().attention512;
  const bool wide_values = wide && D % 16 == 0;
  int64_t jlo = std::numeric_limits<int64_t>::max(), jhi = 0;
  for (int64_t r = 0; r < R; ++r) {
    const float* src = w.q[r];
    for (int64_t d = 0; d < D; ++d) w.qs[r * D + d] = ks ? (src[d] * scale) * ks[d] : src[d] * scale;
    if (w.lo[r] < w.hi[r]) {
      jlo = std::min(jlo, w.lo[r]);
      jhi = std::max(jhi, w.hi[r]);
    }
  }
  std::fill_n(w.o.begin(), R * D, 0.f);
  std::fill_n(w.m.begin(), R, NEG_INF);
  std::fill_n(w.l.begin(), R, 0.f);
  for (int64_t j0 = jhi > 0 ? jlo - jlo % KB : 0; j0 < jhi; j0 += KB) {
    // the block's keys that some row sees, [a, b) as offsets in the block; scores for columns [c0, c1)
    const int64_t a = std::max(jlo, j0) - j0, b = std::min(jhi, j0 + KB) - j0;
    const int64_t c0 = a / 16 * 16, c1 = (b + 15) / 16 * 16;
    float* kt = w.kt.data();
    for (int64_t d = 0; d < D; ++d) {
      std::fill(kt + d * KB + c0, kt + d * KB + a, 0.f);
      std::fill(kt + d * KB + b, kt + d * KB + c1, 0.f);
    }
    int64_t j = a;
    for (; j + 8 <= b; j += 8) {  // 8 keys x 8 channels at a time, transposed in registers
      for (int64_t d = 0; d < D; d += 8) {
        __m256 t[8];
        for (int u = 0; u < 8; ++u) t[u] = load8(kv.k(j0 + j + u) + d);
        transpose8(t);
        for (int u = 0; u < 8; ++u) _mm256_storeu_ps(kt + (d + u) * KB + j, t[u]);
      }
    }
    for (; j < b; ++j) {
      alignas(32) float tmp[8];
      for (int64_t d = 0; d < D; d += 8) {
        _mm256_store_ps(tmp, load8(kv.k(j0 + j) + d));
        for (int u = 0; u < 8; ++u) kt[(d + u) * KB + j] = tmp[u];
      }
    }
    if (wide)
      block_scores512(R, w.qs.data(), D, kt, c0, c1, w.s.data());
    else
      row_chunks<RS>(R, [&](auto rb, int64_t r0) {
        constexpr int RB = decltype(rb)::value;
        for (int64_t c = c0; c < c1; c += 16) scores<RB>(w.qs.data() + r0 * D, D, kt, c, w.s.data() + r0 * KB);
      });
    // per row: its span within the block, the running max and sum, the block's weights in place of its scores
    for (int64_t r = 0; r < R; ++r) {
      const int64_t jb = std::max(w.lo[r], j0) - j0, je = std::min(w.hi[r], j0 + KB) - j0;
      float* s = w.s.data() + r * KB;
      if (jb >= je) {  // no key of this block is visible to the row
        std::fill(s + c0, s + c1, 0.f);
        continue;
      }
      std::fill(s + c0, s + jb, NEG_INF);
      std::fill(s + je, s + c1, NEG_INF);
      const float mx = max_of(s + jb, je - jb);
      const float m_new = std::max(w.m[r], mx);
      const float corr = std::exp(w.m[r] - m_new);  // 0 on the row's first block (m = -inf)
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t c = c0; c < c1; c += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + c), mv));
        _mm256_storeu_ps(s + c, p);
        sum = _mm256_add_ps(sum, p);
      }
      w.l[r] = w.l[r] * corr + hsum(sum);
      w.m[r] = m_new;
      if (corr != 1.f) {
        const __m256 cv = _mm256_set1_ps(corr);
        float* o = w.o.data() + r * D;
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), cv));
      }
    }
    float* vb = w.vb.data();
    for (int64_t jj = a; jj < b; ++jj) {
      const KV* src = kv.v(j0 + jj);
      for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(vb + jj * D + d, load8(src + d));
    }
    if (wide_values)
      block_values512(R, w.s.data(), a, b, vb, w.o.data(), D);
    else
      row_chunks<RS>(R, [&](auto rb, int64_t r0) {
        constexpr int RB = decltype(rb)::value;
        const float* p = w.s.data() + r0 * KB;
        float* o = w.o.data() + r0 * D;
        int64_t c = 0;
        for (; c + 16 <= D; c += 16) values<RB, 2>(p, a, b, vb, o, D, c);
        if (c < D) values<RB, 1>(p, a, b, vb, o, D, c);
      });
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = w.l[r] > 0.f ? 1.f / w.l[r] : 0.f;  // a row that sees no key: zeros
    const __m256 iv = _mm256_set1_ps(inv);
    const float* o = w.o.data() + r * D;
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(o + d), iv);
      _mm256_storeu_ps(w.out[r] + d, vs ? _mm256_mul_ps(x, _mm256_loadu_ps(vs + d)) : x);
    }
  }
}

template <typename KV>
void decode_impl(const float* q, int64_t q_row, int64_t q_head, const KV* kc, const KV* vc, const float* ks,
                 const float* vs, int64_t Hkv, int64_t ss, int64_t hs, int64_t D, const int64_t* rows, int64_t B,
                 int64_t Q, const int64_t* slots, int64_t L, const bool* mask, int64_t H, float scale, float* out,
                 bool tiles) {
  const int64_t G = H / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t t0, int64_t t1) {
    Scratch w;
    w.size(Q * G, D, tiles);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / Hkv, g = t % Hkv;
      int64_t R = 0;
      for (int64_t i = 0; i < Q; ++i) {
        const int64_t row = rows[b * Q + i];
        if (row < 0) continue;
        // the row's span: from its first visible key to its last (the masks layers/attention.py builds are
        // contiguous: causal, window, the sequence's own keys)
        const bool* m = mask + (b * Q + i) * L;
        int64_t l = 0, h = L;
        while (l < L && !m[l]) ++l;
        while (h > l && !m[h - 1]) --h;
        for (int64_t hh = 0; hh < G; ++hh, ++R) {
          w.lo[R] = l;
          w.hi[R] = h;
          w.q[R] = q + row * q_row + (g * G + hh) * q_head;
          w.out[R] = out + (row * H + g * G + hh) * D;
        }
      }
      const SeqKV<KV> kv{kc, vc, slots + b * L, ss, hs, D, g};
      attend_rows(kv, R, scale, ks ? ks + g * D : nullptr, vs ? vs + g * D : nullptr, w, tiles);
    }
  });
}

template <typename KV>
void prompt_impl(const float* q, int64_t q_row, int64_t q_head, float* out, int64_t o_row, int64_t o_head,
                 const KV* kc, const KV* vc, const float* ks, const float* vs, int64_t Hkv, int64_t ss,
                 int64_t hs, int64_t D, const int64_t* slots, int64_t T, int64_t L, int64_t H, int64_t first,
                 int64_t window, float scale, bool tiles) {
  // the tiles take more positions per item (each item converts its keys and values once for all its rows),
  // down to BQ while that leaves fewer than 4 items per thread. Only the speed depends on it: rows are
  // computed alike in any item
  const int64_t pool = at::in_parallel_region() ? 1 : at::get_num_threads();
  int64_t bq = tiles ? 8 * BQ : BQ;
  while (bq > BQ && (T + bq - 1) / bq * Hkv < 4 * pool) bq /= 2;
  const int64_t G = H / Hkv, blocks = (T + bq - 1) / bq, items = blocks * Hkv;
  const int64_t threads = std::min<int64_t>(pool, items);
  std::atomic<int64_t> next{0};
  auto work = [&](int64_t, int64_t) {
    Scratch w;
    w.size(bq * G, D, tiles);
    for (int64_t it; (it = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t blk = blocks - 1 - it / Hkv, g = it % Hkv;  // latest positions (most keys) first
      const int64_t i0 = blk * bq, i1 = std::min(T, i0 + bq);
      int64_t R = 0;
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t hh = 0; hh < G; ++hh, ++R) {
          w.lo[R] = window > 0 ? std::max<int64_t>(0, first + i - window + 1) : 0;
          w.hi[R] = std::min(L, first + i + 1);
          w.q[R] = q + i * q_row + (g * G + hh) * q_head;
          w.out[R] = out + i * o_row + (g * G + hh) * o_head;
        }
      const SeqKV<KV> kv{kc, vc, slots, ss, hs, D, g};
      attend_rows(kv, R, scale, ks ? ks + g * D : nullptr, vs ? vs + g * D : nullptr, w, tiles);
    }
  };
  if (threads <= 1)
    work(0, 1);
  else
    at::parallel_for(0, threads, 1, work);
}

// The pool's scales (int8) or nulls (float), checked.
std::pair<const float*, const float*> pool_scales(const torch::Tensor& kc, const torch::Tensor& ks,
                                                  const torch::Tensor& vs, int64_t Hkv, int64_t D) {
  if (kc.scalar_type() != torch::kChar) return {nullptr, nullptr};
  TORCH_CHECK(ks.scalar_type() == torch::kFloat && vs.scalar_type() == torch::kFloat && ks.is_contiguous() &&
              vs.is_contiguous() && ks.numel() == Hkv * D && vs.numel() == ks.numel(),
              "int8 pool needs float32 scales [Hkv, D]");
  return {ks.data_ptr<float>(), vs.data_ptr<float>()};
}

void check_tiles(bool tiles, int64_t D) {
  TORCH_CHECK(!tiles || (atiles::granted() && D % 32 == 0), "bfloat16 tiles need AMX's bfloat16 tiles (granted ",
              "to this process) and a head size that is a multiple of 32");
}

template <typename F>
void with_pool(const torch::Tensor& kc, const torch::Tensor& vc, F&& f) {
  TORCH_CHECK(kc.dim() == 3 && kc.stride(2) == 1 && kc.sizes() == vc.sizes() && kc.strides() == vc.strides(),
              "bad pool: K and V [S, Hkv, D] alike, unit stride within a head");
  TORCH_CHECK(vc.scalar_type() == kc.scalar_type(), "K and V pools differ in dtype");
  switch (kc.scalar_type()) {
    case torch::kFloat: f(kc.data_ptr<float>(), vc.data_ptr<float>()); break;
    case torch::kHalf: f(kc.data_ptr<at::Half>(), vc.data_ptr<at::Half>()); break;
    case torch::kBFloat16: f(kc.data_ptr<at::BFloat16>(), vc.data_ptr<at::BFloat16>()); break;
    case torch::kChar: f(kc.data_ptr<int8_t>(), vc.data_ptr<int8_t>()); break;
    default: TORCH_CHECK(false, "pool must be float32, float16, bfloat16 or int8");
  }
}

}  // namespace

// q [T, H, D] float32 (unit stride within a head); rows int64 [B, Q] (row of each sequence's i-th new token
// in q / out, -1 = padding); slots int64 [B, L] (each sequence's key slots in position order, block-aligned:
// see the header); mask bool [B, Q, L] (true = attend; contiguous per row); out [T, H, D] contiguous.
void decode_attention(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor ks, torch::Tensor vs,
                      torch::Tensor rows, torch::Tensor slots, torch::Tensor mask, double scale, torch::Tensor out,
                      bool tiles) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.stride(2) == 1, "q must be float32 [T, H, D]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == torch::kFloat, "bad out");
  TORCH_CHECK(rows.dim() == 2 && slots.dim() == 2 && mask.dim() == 3 && rows.is_contiguous() && slots.is_contiguous() &&
              mask.is_contiguous() && mask.scalar_type() == torch::kBool, "bad metadata");
  const int64_t H = q.size(1), D = q.size(2), Hkv = kc.size(1), B = rows.size(0), Q = rows.size(1), L = slots.size(1);
  TORCH_CHECK(kc.size(2) == D && D % 8 == 0 && H % Hkv == 0, "head sizes do not match");
  TORCH_CHECK(slots.size(0) == B && mask.size(0) == B && mask.size(1) == Q && mask.size(2) == L, "metadata shapes");
  check_tiles(tiles, D);
  const auto [ksp, vsp] = pool_scales(kc, ks, vs, Hkv, D);
  with_pool(kc, vc, [&](auto* k, auto* v) {
    decode_impl(q.data_ptr<float>(), q.stride(0), q.stride(1), k, v, ksp, vsp, Hkv, kc.stride(0), kc.stride(1), D,
                rows.data_ptr<int64_t>(), B, Q, slots.data_ptr<int64_t>(), L, mask.data_ptr<bool>(), H, float(scale),
                out.data_ptr<float>(), tiles);
  });
}

// q, out [T, H, D] float32 (any row and head strides, unit stride within a head): one sequence's new tokens,
// query i at key index first + i, seeing key j where j <= first + i and, with window > 0, first + i - j <
// window; slots int64 [L]: the sequence's key slots in position order, block-aligned (see the header).
void prompt_attention(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor ks, torch::Tensor vs,
                      torch::Tensor slots, torch::Tensor out, int64_t first, int64_t window, double scale, bool tiles) {
  auto check3 = [](const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.dim() == 3 && t.scalar_type() == torch::kFloat && t.stride(2) == 1 && t.device().is_cpu(),
                name, " must be float32 [rows, heads, D] on the CPU with unit stride within a head");
  };
  check3(q, "q");
  check3(out, "out");
  TORCH_CHECK(slots.dim() == 1 && slots.is_contiguous() && slots.scalar_type() == torch::kLong, "slots must be int64 [L]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), L = slots.size(0), Hkv = kc.size(1);
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  TORCH_CHECK(kc.dim() == 3 && kc.size(2) == D && D % 8 == 0 && Hkv > 0 && H % Hkv == 0,
              "the pool must be [S, Hkv, D] with Hkv dividing q's heads and D (q's) a multiple of 8");
  TORCH_CHECK(first >= 0 && first + T <= L && window >= 0, "the queries must be the last of the keys' positions");
  check_tiles(tiles, D);
  if (T == 0) return;
  const auto [ksp, vsp] = pool_scales(kc, ks, vs, Hkv, D);
  with_pool(kc, vc, [&](auto* k, auto* v) {
    prompt_impl(q.data_ptr<float>(), q.stride(0), q.stride(1), out.data_ptr<float>(), out.stride(0), out.stride(1), k,
                v, ksp, vsp, Hkv, kc.stride(0), kc.stride(1), D, slots.data_ptr<int64_t>(), T, L, H, first, window,
                float(scale), tiles);
  });
}

bool bf16_tiles_granted() { return atiles::granted(); }
