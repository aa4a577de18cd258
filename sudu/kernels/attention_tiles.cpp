// Attention on AMX's bfloat16 tiles: the "bfloat16 tiles" arithmetic of attention.cpp (attention_tiles.h).
//
// The row recipe, per (query row, head), over its span [lo, hi) of visible keys:
//   q' = bf16(q * scale) (int8 pool: bf16((q * scale) * ks), the K scales folded into the query);
//   key blocks of KB at key indices that are multiples of KB, in increasing order, each block with a visible
//   key: k' = bf16(k) (exact for bfloat16 and int8 pools); a key's score = TDPBF16PS's sum of q'[d] k'[d] over
//   d in 32-channel chunks, chunk after chunk into one float32 accumulator; invisible keys -inf;
//   the running max m: where a block has a score above m (on the row's first block, m = -inf), m' = the
//   block's max, l = l * exp(m - m') and o = o * exp(m - m') (std::exp), m = m'; otherwise m stays;
//   w = bf16(weights16(score, m)) (2^((score - m) log2 e) by a polynomial and vscalefps); l += w in 16 lanes,
//   the block's two 32-key halves in order, lane i taking keys 2i + 1 then 2i of a half (VDPBF16PS against
//   ones); o += TDPBF16PS's sums of w * bf16(v) over the block's keys, in 32-key halves; at the end
//   out = o * (1 / l's lanes summed by a fixed halving tree) (int8 pool: * vs).
//
// Why every row gets its own recipe whatever else the call computes: a tile product's output row depends only
// on its own A row (the row's query, or its weights) and on B (the block's keys or values, the same for every
// row), and the softmax steps are per row. A key block or 32-key half that a row does not see gives it p = 0:
// m, l and o stay as they were (a zero product adds zero), so the union of several rows' spans gives each row
// exactly its own blocks. The tiles flush denormal inputs and outputs to zero, as part of their arithmetic.
//
// Operands (all tiles 16 rows x 64 bytes): A = 16 query rows' 32 bf16 channels (rows of D in a buffer), or 16
// rows' weights of a 32-key half; B = a block's keys transposed into pairs of channels (row p: the 16 keys'
// channels 2p, 2p + 1), or its values in pairs of keys (row p: 16 channels of keys 2p, 2p + 1). Each block's
// keys and values are converted and laid out once per work item (a decode call's sequence and kv head, a prompt
// call's kv head and block of positions), for all its rows.
#include "attention_tiles.h"

#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <new>
#include <vector>

#include "amx_tiles.h"
#include "simd.h"

namespace atiles {
namespace {

#define SUDU_AMXBF16 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16")))

constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// tmm0..tmm3: C (16 x 16 float32); tmm4: A; tmm6, tmm7: B. Every tile 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
const TileConfig tile_config;

// 32 consecutive pool values from element i on, as 32 bfloat16 (round to nearest even; float16, bfloat16
// and int8 values are exact in float32 first).
template <Pool P>
SUDU_AMXBF16 inline __m512i bf16x32(const void* base, int64_t i) {
  if constexpr (P == Pool::BF16) {
    return _mm512_loadu_si512(static_cast<const uint16_t*>(base) + i);
  } else {
    __m512 lo, hi;
    if constexpr (P == Pool::F32) {
      const float* p = static_cast<const float*>(base) + i;
      lo = _mm512_loadu_ps(p);
      hi = _mm512_loadu_ps(p + 16);
    } else if constexpr (P == Pool::F16) {
      const uint16_t* p = static_cast<const uint16_t*>(base) + i;
      lo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      hi = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16)));
    } else {
      const int8_t* p = static_cast<const int8_t*>(base) + i;
      lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
    }
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  }
}

// The weights of 16 scores x given the row's running max m, visible lanes only (others exactly 0):
// 2^t with t = x * log2(e) - m * log2(e) (one fused multiply-add), t = n + f with n = round(t), 2^f by a degree-4
// polynomial (relative error ~4e-5, well inside the bfloat16 rounding that follows), times 2^n by vscalefps
// (which takes any n: far below the max the weight is 0).
SUDU_AMXBF16 inline __m512 weights16(__m512 x, __m512 m_log2e, __mmask16 visible) {
  const __m512 t = _mm512_fmsub_ps(x, _mm512_set1_ps(1.44269504088896341f), m_log2e);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.6181291e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(visible, p, n);
}

// The sum and the largest of 16 lanes, by a fixed halving tree (the sum's last three halvings: simd.h hsum).
SUDU_AMXBF16 inline float hsum16(__m512 v) {
  return hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}
SUDU_AMXBF16 inline float hmax16(__m512 v) {
  __m256 h = _mm256_max_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// r[0..16) transposed in place (16 x 16 dwords).
SUDU_AMXBF16 inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + m], lane L: channel 4L + m of rows i .. i + 3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int m = 0; m < 4; ++m) {
    t[m] = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x88);           // lanes 0, 2 of rows 0-3 and 4-7
    t[4 + m] = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xdd);       // lanes 1, 3
    t[8 + m] = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x88);  // rows 8-11 and 12-15
    t[12 + m] = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xdd);
  }
  for (int m = 0; m < 4; ++m) {
    r[m] = _mm512_shuffle_i32x4(t[m], t[8 + m], 0x88);        // channel m (lane 0)
    r[4 + m] = _mm512_shuffle_i32x4(t[4 + m], t[12 + m], 0x88);  // channel 4 + m (lane 1)
    r[8 + m] = _mm512_shuffle_i32x4(t[m], t[8 + m], 0xdd);       // channel 8 + m (lane 2)
    r[12 + m] = _mm512_shuffle_i32x4(t[4 + m], t[12 + m], 0xdd);  // channel 12 + m (lane 3)
  }
}

struct Buffers {
  Aligned<uint16_t> qa, p;  // [Rp, D] queries, [Rp, KB] weights (bfloat16)
  Aligned<float> s, o, m, l;  // [Rp, KB] scores, [Rp, D] accumulators, per-row max, [Rp, 16] sums
  Aligned<uint32_t> kb, vb;   // a block's keys [D / 32][KB / 16][16][16], values [KB / 32][D / 16][16][16]
  Aligned<uint16_t> ka;       // narrow calls: a block's keys as rows [KB][D] (bfloat16)
  Aligned<uint32_t> qb, st;   // narrow calls: the queries as B operands [D / 32][16][16], scores [KB][16]
  void size(int64_t Rp, int64_t D) {
    if (static_cast<int64_t>(qa.size()) < Rp * D || static_cast<int64_t>(kb.size()) != D * KB / 2) {
      qa.resize(std::max<int64_t>(qa.size(), Rp * D));
      o.resize(qa.size());
      kb.resize(D * KB / 2);
      vb.resize(D * KB / 2);
      ka.resize(D * KB);
      qb.resize(D * 8);
      st.resize(KB * 16);
    }
    if (static_cast<int64_t>(p.size()) < Rp * KB) {
      p.resize(Rp * KB);
      s.resize(Rp * KB);
      m.resize(Rp);
      l.resize(Rp * 16);
    }
  }
};
thread_local Buffers scratch;

// The pool offsets (in elements) of the rows of key indices j0 + [a, b), kv head kv.g, into off[a, b).
SUDU_AMXBF16 inline void row_offsets(const Keys& kv, int64_t j0, int64_t a, int64_t b, int64_t* off) {
  for (int64_t jj = a; jj < b; ++jj) off[jj] = kv.slots[j0 + jj] * kv.ss + kv.g * kv.hs;
}

// Channels [32 c, 32 c + 32) of block key jj's row in pool (kv.kc or kv.vc) as bfloat16 if jj is in [a, b),
// else zeros (off: row_offsets).
template <Pool P>
SUDU_AMXBF16 inline __m512i pool_row(const void* pool, const int64_t* off, int64_t a, int64_t b, int64_t jj,
                                     int64_t c) {
  return jj >= a && jj < b ? bf16x32<P>(pool, off[jj] + c * 32) : _mm512_setzero_si512();
}

// The block's keys [a, b) (off: row_offsets) as B operands, zeros for the other keys of their 16-key column
// tiles.
template <Pool P>
SUDU_AMXBF16 void gather_keys(const Keys& kv, const int64_t* off, int64_t a, int64_t b, uint32_t* kb) {
  for (int64_t ct = a / 16; ct * 16 < b; ++ct)
    for (int64_t c = 0; c < kv.D / 32; ++c) {
      __m512i r[16];
      for (int64_t n = 0; n < 16; ++n) r[n] = pool_row<P>(kv.kc, off, a, b, ct * 16 + n, c);
      transpose16(r);
      uint32_t* dst = kb + (c * (KB / 16) + ct) * 256;
      for (int n = 0; n < 16; ++n) _mm512_storeu_si512(dst + n * 16, r[n]);
    }
}

// The block's values [a, b) as B operands in pairs of keys, zeros for the other keys of their 32-key halves.
// Channels go to the tiles' columns in unpack order: of a 32-channel chunk c, tile 2c holds channels
// 8q + r and tile 2c + 1 channels 8q + 4 + r (q, r = 0..3) at column 4q + r; the accumulators keep that
// order and attend puts the channels back in place at the end (unpermute).
template <Pool P>
SUDU_AMXBF16 void gather_values(const Keys& kv, const int64_t* off, int64_t a, int64_t b, uint32_t* vb) {
  const int64_t D = kv.D, cts = D / 16;
  for (int64_t h = a / 32; h * 32 < b; ++h)
    for (int64_t pr = 0; pr < 16; ++pr) {
      const int64_t jj = h * 32 + 2 * pr;
      for (int64_t c = 0; c < D / 32; ++c) {
        const __m512i x0 = pool_row<P>(kv.vc, off, a, b, jj, c), x1 = pool_row<P>(kv.vc, off, a, b, jj + 1, c);
        uint32_t* dst = vb + (h * cts + 2 * c) * 256 + pr * 16;
        _mm512_storeu_si512(dst, _mm512_unpacklo_epi16(x0, x1));
        _mm512_storeu_si512(dst + 256, _mm512_unpackhi_epi16(x0, x1));
      }
    }
}

// 32 accumulators of one chunk in gather_values' column order (lo: tile 2c, hi: tile 2c + 1) back in channel
// order: channels [0, 16) into first, [16, 32) into second.
SUDU_AMXBF16 inline void unpermute(__m512 lo, __m512 hi, __m512& first, __m512& second) {
  alignas(64) static const int32_t i0[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
  alignas(64) static const int32_t i1[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
  first = _mm512_permutex2var_ps(lo, _mm512_load_si512(i0), hi);
  second = _mm512_permutex2var_ps(lo, _mm512_load_si512(i1), hi);
}

// Asks for the keys and values of a block's keys [a, b) (off: row_offsets) ahead of their use: a block's rows
// are scattered over the pool, so without it each block waits on memory key by key (two blocks ahead,
// prefetcht1, or the requests spread over the gathers measured no faster; docs/cpu_speed.md "Decode at depth
// on AMX").
template <Pool P>
SUDU_AMXBF16 inline void prefetch_keys(const Keys& kv, const int64_t* off, int64_t a, int64_t b) {
  constexpr int64_t bytes = P == Pool::F32 ? 4 : P == Pool::I8 ? 1 : 2;
  const int64_t row = kv.D * bytes;
  const char* kc = static_cast<const char*>(kv.kc);
  const char* vc = static_cast<const char*>(kv.vc);
  for (int64_t jj = a; jj < b; ++jj) {
    const int64_t at = off[jj] * bytes;
    for (int64_t c = 0; c < row; c += 64) {
      prefetch_line(kc + at + c);
      prefetch_line(vc + at + c);
    }
  }
}

// C tiles tmm0..tmm3, those in [lo, hi), += A . B_i: A (tmm4) loaded from a, its rows lda bytes apart; B_i the
// 16 x 64-byte operand at b + 256 i, in tmm6 / tmm7 by i's parity.
SUDU_AMXBF16 inline void tile_products(const void* a, int64_t lda, const uint32_t* b, int64_t lo, int64_t hi) {
  _tile_loadd(4, a, lda);
  if (lo <= 0 && 0 < hi) { _tile_loadd(6, b, 64); _tile_dpbf16ps(0, 4, 6); }
  if (lo <= 1 && 1 < hi) { _tile_loadd(7, b + 256, 64); _tile_dpbf16ps(1, 4, 7); }
  if (lo <= 2 && 2 < hi) { _tile_loadd(6, b + 512, 64); _tile_dpbf16ps(2, 4, 6); }
  if (lo <= 3 && 3 < hi) { _tile_loadd(7, b + 768, 64); _tile_dpbf16ps(3, 4, 7); }
}

// Scores of 16 query rows (qa, rows of D) for the block's 16-key column tiles [t0, t1) into s (rows of KB).
SUDU_AMXBF16 void score_tiles(const uint16_t* qa, int64_t D, const uint32_t* kb, int64_t t0, int64_t t1,
                              float* s) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < D / 32; ++c)  // chunk after chunk of 32 channels
    tile_products(qa + c * 32, D * 2, kb + c * (KB / 16) * 256, t0, t1);
  if (t0 <= 0 && 0 < t1) _tile_stored(0, s, KB * 4);
  if (t0 <= 1 && 1 < t1) _tile_stored(1, s + 16, KB * 4);
  if (t0 <= 2 && 2 < t1) _tile_stored(2, s + 32, KB * 4);
  if (t0 <= 3 && 3 < t1) _tile_stored(3, s + 48, KB * 4);
}

// Narrow calls (one tile of query rows: decodes, verifications) take the keys as the A operand instead, rows
// straight from the pool converted to bfloat16 with no transposition, and the queries as B: TDPBF16PS gives
// the same score bits with its operands swapped (each product is q'[d] k'[d] either way, summed in the same
// order; docs/cpu_speed.md "Decode at depth on AMX"), and the 16 x 16 score tiles are transposed back per
// block, where the wide path transposes each block's keys per 32 channels.

// The 16 query rows' bfloat16 channels (qa, rows of D) as B operands, per 32-channel chunk c: row p, lane n =
// query n's channels 32 c + 2p, 2p + 1 (a 16 x 16 dword transposition per chunk).
SUDU_AMXBF16 void query_operands(const uint16_t* qa, int64_t D, uint32_t* qb) {
  for (int64_t c = 0; c < D / 32; ++c) {
    __m512i r[16];
    for (int n = 0; n < 16; ++n) r[n] = _mm512_loadu_si512(qa + n * D + 32 * c);
    transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(qb + (c * 16 + p) * 16, r[p]);
  }
}

// The block's keys [a, b) (off: row_offsets) as bfloat16 rows of D into ka, zeros for the other keys of their
// 16-key tiles.
template <Pool P>
SUDU_AMXBF16 void key_rows(const Keys& kv, const int64_t* off, int64_t a, int64_t b, uint16_t* ka) {
  const int64_t D = kv.D;
  for (int64_t jj = a / 16 * 16; jj < (b + 15) / 16 * 16; ++jj)
    for (int64_t c = 0; c < D / 32; ++c)
      _mm512_storeu_si512(ka + jj * D + 32 * c, pool_row<P>(kv.kc, off, a, b, jj, c));
}

// Scores of the (at most 16) query rows for the block's 16-key tiles [t0, t1) into s (rows of KB): per key tile,
// C (keys x queries) = the chunks' products in channel order, stored, transposed, rows [0, R) kept.
SUDU_AMXBF16 void narrow_scores(const uint16_t* ka, const uint32_t* qb, int64_t D, int64_t t0, int64_t t1, int64_t R,
                                uint32_t* st, float* s) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t c = 0; c < D / 32; ++c) {
    _tile_loadd(6, qb + c * 256, 64);
    if (t0 <= 0 && 0 < t1) { _tile_loadd(4, ka + 32 * c, D * 2); _tile_dpbf16ps(0, 4, 6); }
    if (t0 <= 1 && 1 < t1) { _tile_loadd(5, ka + 16 * D + 32 * c, D * 2); _tile_dpbf16ps(1, 5, 6); }
    if (t0 <= 2 && 2 < t1) { _tile_loadd(4, ka + 32 * D + 32 * c, D * 2); _tile_dpbf16ps(2, 4, 6); }
    if (t0 <= 3 && 3 < t1) { _tile_loadd(5, ka + 48 * D + 32 * c, D * 2); _tile_dpbf16ps(3, 5, 6); }
  }
  if (t0 <= 0 && 0 < t1) _tile_stored(0, st, 64);
  if (t0 <= 1 && 1 < t1) _tile_stored(1, st + 256, 64);
  if (t0 <= 2 && 2 < t1) _tile_stored(2, st + 512, 64);
  if (t0 <= 3 && 3 < t1) _tile_stored(3, st + 768, 64);
  for (int64_t t = t0; t < t1; ++t) {
    __m512i r[16];
    for (int n = 0; n < 16; ++n) r[n] = _mm512_load_si512(st + t * 256 + n * 16);
    transpose16(r);
    for (int64_t q = 0; q < R; ++q) _mm512_storeu_si512(s + q * KB + t * 16, r[q]);
  }
}

// o (16 rows of D) += p (16 rows of KB weights) . values, over the 32-key halves [h0, h1), for the column
// tiles [c0, c0 + n), n <= 4.
SUDU_AMXBF16 void value_tiles(const uint16_t* p, const uint32_t* vb, int64_t h0, int64_t h1, int64_t cts,
                              int64_t c0, int64_t n, float* o, int64_t D) {
  float* oc = o + c0 * 16;
  _tile_loadd(0, oc, D * 4);
  if (n > 1) _tile_loadd(1, oc + 16, D * 4);
  if (n > 2) _tile_loadd(2, oc + 32, D * 4);
  if (n > 3) _tile_loadd(3, oc + 48, D * 4);
  for (int64_t h = h0; h < h1; ++h) tile_products(p + h * 32, KB * 2, vb + (h * cts + c0) * 256, 0, n);
  _tile_stored(0, oc, D * 4);
  if (n > 1) _tile_stored(1, oc + 16, D * 4);
  if (n > 2) _tile_stored(2, oc + 32, D * 4);
  if (n > 3) _tile_stored(3, oc + 48, D * 4);
}

// One row's softmax step over a block (the header's recipe): its scores sr (KB of them), of which the keys
// [jb, je) are visible; updates its running max m, lane sums l (16) and accumulators o (D), and writes its
// bfloat16 weights pr (KB, zeros where not visible).
SUDU_AMXBF16 inline void row_weights(const float* sr, int64_t jb, int64_t je, float& m, float* l, uint16_t* pr,
                                     float* o, int64_t D) {
  if (jb >= je) {  // no key of this block is visible to the row: weights 0, nothing else changes
    std::fill(pr, pr + KB, uint16_t(0));
    return;
  }
  const uint64_t vis = (je == 64 ? ~0ull : (1ull << je) - 1) & ~((1ull << jb) - 1);
  __m512 x[4];
  for (int v = 0; v < 4; ++v)
    x[v] = _mm512_mask_loadu_ps(_mm512_set1_ps(NEG_INF), static_cast<__mmask16>(vis >> (16 * v)), sr + 16 * v);
  const __m512 mx = _mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3]));
  // the max rises (always on the row's first block, m = -inf): rescale. Its largest weight is then exactly 1,
  // which bfloat16 holds exactly; a block whose scores stay below the max costs one compare here
  if (_mm512_cmp_ps_mask(mx, _mm512_set1_ps(m), _CMP_GT_OQ)) {
    const float m_new = hmax16(mx);
    const float corr = std::exp(m - m_new);
    const __m512 cv = _mm512_set1_ps(corr);
    _mm512_storeu_ps(l, _mm512_mul_ps(_mm512_loadu_ps(l), cv));
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), cv));
    m = m_new;
  }
  const __m512 mv = _mm512_set1_ps(m * 1.44269504088896341f);
  // the weights as the products take them, summed by VDPBF16PS against ones: per lane i of a 32-weight half,
  // l_i += w_{2i+1}, then l_i += w_{2i} (float32, rounded each time; denormals flushed, as the tiles do)
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);
  __m512 sum = _mm512_loadu_ps(l);
  for (int v = 0; v < 4; v += 2) {
    const __m512bh pb = _mm512_cvtne2ps_pbh(weights16(x[v + 1], mv, static_cast<__mmask16>(vis >> (16 * v + 16))),
                                            weights16(x[v], mv, static_cast<__mmask16>(vis >> (16 * v))));
    _mm512_storeu_si512(pr + 16 * v, (__m512i)pb);
    sum = _mm512_dpbf16_ps(sum, pb, ones);
  }
  _mm512_storeu_ps(l, sum);
}

template <Pool P>
SUDU_AMXBF16 void attend(const Keys& kv, const Rows& rw, float scale, const float* ks, const float* vs) {
  const int64_t D = kv.D, R = rw.R, Rp = (R + 15) / 16 * 16, cts = D / 16;
  Buffers& w = scratch;
  w.size(Rp, D);
  uint16_t* qa = w.qa.data();
  uint16_t* pw = w.p.data();
  float* o = w.o.data();
  int64_t jlo = std::numeric_limits<int64_t>::max(), jhi = 0;
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < R; ++r) {
    const float* src = rw.q[r];
    for (int64_t c = 0; c < D; c += 32) {
      __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(src + c), sv), x1 = _mm512_mul_ps(_mm512_loadu_ps(src + c + 16), sv);
      if (ks) {
        x0 = _mm512_mul_ps(x0, _mm512_loadu_ps(ks + c));
        x1 = _mm512_mul_ps(x1, _mm512_loadu_ps(ks + c + 16));
      }
      _mm512_storeu_si512(qa + r * D + c, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
    }
    if (rw.lo[r] < rw.hi[r]) {
      jlo = std::min(jlo, rw.lo[r]);
      jhi = std::max(jhi, rw.hi[r]);
    }
  }
  std::fill(qa + R * D, qa + Rp * D, uint16_t(0));
  std::fill(pw + R * KB, pw + Rp * KB, uint16_t(0));
  std::fill(o, o + Rp * D, 0.f);
  std::fill_n(w.m.begin(), R, NEG_INF);
  std::fill_n(w.l.begin(), R * 16, 0.f);
  const bool narrow = Rp == 16;
  if (narrow) query_operands(qa, D, w.qb.data());
  int64_t offsets[2][KB];  // the rows of this block's keys and of the next one's (row_offsets)
  const int64_t first = jhi > 0 ? jlo - jlo % KB : 0;
  if (first < jhi) row_offsets(kv, first, jlo - first, std::min(jhi, first + KB) - first, offsets[0]);
  _tile_loadconfig(&tile_config);
  for (int64_t j0 = first, k = 0; j0 < jhi; j0 += KB, ++k) {
    // the block's keys that some row sees, [a, b) as offsets in the block; the next block's from its start
    const int64_t a = std::max(jlo, j0) - j0, b = std::min(jhi, j0 + KB) - j0;
    const int64_t* off = offsets[k % 2];
    if (j0 + KB < jhi) {
      int64_t* next = offsets[(k + 1) % 2];
      const int64_t nb = std::min(jhi, j0 + 2 * KB) - (j0 + KB);
      row_offsets(kv, j0 + KB, 0, nb, next);
      prefetch_keys<P>(kv, next, 0, nb);
    }
    if (narrow) {
      key_rows<P>(kv, off, a, b, w.ka.data());
      narrow_scores(w.ka.data(), w.qb.data(), D, a / 16, (b + 15) / 16, R, w.st.data(), w.s.data());
    } else {
      gather_keys<P>(kv, off, a, b, w.kb.data());
    }
    gather_values<P>(kv, off, a, b, w.vb.data());
    for (int64_t r0 = 0; r0 < Rp; r0 += 16) {  // row tile by row tile: scores, softmax, values
      if (!narrow) score_tiles(qa + r0 * D, D, w.kb.data(), a / 16, (b + 15) / 16, w.s.data() + r0 * KB);
      for (int64_t r = r0; r < std::min(R, r0 + 16); ++r)
        row_weights(w.s.data() + r * KB, std::max(rw.lo[r], j0) - j0, std::min(rw.hi[r], j0 + KB) - j0,
                    w.m[r], w.l.data() + r * 16, pw + r * KB, o + r * D, D);
      for (int64_t c0 = 0; c0 < cts; c0 += 4)
        value_tiles(pw + r0 * KB, w.vb.data(), a / 32, (b + 31) / 32, cts, c0, std::min<int64_t>(4, cts - c0),
                    o + r0 * D, D);
    }
  }
  _tile_release();
  for (int64_t r = 0; r < R; ++r) {
    const float l = hsum16(_mm512_loadu_ps(w.l.data() + r * 16));
    const __m512 iv = _mm512_set1_ps(l > 0.f ? 1.f / l : 0.f);  // a row that sees no key: zeros
    const float* orow = o + r * D;
    for (int64_t d = 0; d < D; d += 32) {
      __m512 y[2];
      unpermute(_mm512_loadu_ps(orow + d), _mm512_loadu_ps(orow + d + 16), y[0], y[1]);
      for (int u = 0; u < 2; ++u) {
        const __m512 z = _mm512_mul_ps(y[u], iv);
        _mm512_storeu_ps(rw.out[r] + d + 16 * u, vs ? _mm512_mul_ps(z, _mm512_loadu_ps(vs + d + 16 * u)) : z);
      }
    }
  }
}

bool has_bf16_tiles() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 22))) return false;  // AMX-BF16
  if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) || !(eax & (1u << 5))) return false;  // AVX512_BF16
  return true;
}

}  // namespace

bool granted() {
  static const bool ok = has_bf16_tiles() && qtiles::amx_granted();
  return ok;
}

void attend_rows(const Keys& kv, const Rows& rows, float scale, const float* ks, const float* vs) {
  switch (kv.type) {
    case Pool::F32: attend<Pool::F32>(kv, rows, scale, ks, vs); break;
    case Pool::F16: attend<Pool::F16>(kv, rows, scale, ks, vs); break;
    case Pool::BF16: attend<Pool::BF16>(kv, rows, scale, ks, vs); break;
    case Pool::I8: attend<Pool::I8>(kv, rows, scale, ks, vs); break;
  }
}

}  // namespace atiles
