// Weight-only quantized linear layers for CPUs with AVX2 + FMA + F16C.
//
// y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias), x and y float32.
// Formats (K a multiple of 32, group size G a multiple of 32 that divides K):
//   int8: q int8 [N, K];                 w = s[n, k / G] * q
//   int4: w = s * q + m per 32-block, q in [0, 15], stored in tiles of 16 rows (the int4 section below;
//         layers/linear.py pack_int4 builds them from the row layout).
// Scales and mins are float16 (half the bytes of float32, and F16C converts them for free).
//
// Why this kernel: decode is bound by reading weights. PyTorch's packed int8/int4 kernels read the
// weights once per activation row, so a batch of 8 costs 8x. Here each weight row is read from memory
// once per call and multiplied against every activation row while it sits in L1.
//
// Activations are rounded to int8 in blocks of 32 (a float scale per block, as llama.cpp's Q8 activations),
// and each (weight block, activation block) pair is an integer dot product (AVX2 maddubs + madd, or
// AVX-512 VNNI vpdpbusd where the CPU has it: the same integers) followed by float multiply-adds with
// the two blocks' scales (int4: 16 rows' blocks per vector operation, see dot_q4_tiles_vnni). That is far
// less arithmetic than dequantizing to float, so one-row decode is bound by memory rather than compute,
// and every row, at every row count and on either instruction set, goes through the same float
// operations in the same order: a row's result is bit for bit independent of the batch it shares the
// call with (what makes greedy speculative decoding identical to plain decoding on quantized weights,
// and batch-1 output identical to batched output).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"
#include <cstdint>
#include <type_traits>

namespace {


inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// Group index of column k (k rising from 0), advanced by one comparison per 32 columns: a 64-bit
// division there cost more than the rest of the dequantization.
struct GroupCursor {
  int64_t g, next, G;
  explicit GroupCursor(int64_t G_) : g(0), next(G_), G(G_) {}
  inline int64_t at(int64_t k) {
    if (k >= next) { ++g; next += G; }
    return g;
  }
};

// One int8 row of K columns into out.
inline void dequant_int8(const int8_t* q, const uint16_t* s, int64_t G, int64_t K, float* out) {
  GroupCursor cur(G);
  for (int64_t k = 0; k < K; k += 32) {
    const __m256 sv = _mm256_set1_ps(half_to_float(s[cur.at(k)]));
    for (int64_t j = 0; j < 32; j += 8) {
      __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k + j));
      __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
      _mm256_storeu_ps(out + k + j, _mm256_mul_ps(f, sv));
    }
  }
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
    __m256i p = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + 32 * b), p);
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    sx[b] = d;
    xsum[b] = d * static_cast<float>(_mm_cvtsi128_si32(t));
  }
}

// Weights stream from memory once per call; every kernel prefetches this far ahead of its loads (one
// prefetch per 64-byte line, measured best among 2-32 KiB: the hardware prefetcher alone leaves the
// kernel 20-40% short of the bandwidth). Prefetching past the end is harmless (no fault).
constexpr int64_t PREFETCH_BYTES = 4096;

// The first PREFETCH_BYTES of a call's weights, requested at once: the in-loop prefetch only reaches
// ahead of the loads, so without this each call (96 a step on the 0.5B, each thread a range of rows)
// would start with lines loaded on demand.
inline void prefetch_start(const uint8_t* q) {
  for (int64_t o = 0; o < PREFETCH_BYTES; o += 64) _mm_prefetch(reinterpret_cast<const char*>(q + o), _MM_HINT_T0);
}

// One call's quantized activations (from the first row a kernel call takes) for the int8 kernels.
struct Acts {
  const int8_t* xq;    // codes, row stride ldx (K)
  const float* xs;     // scales, one per block, row stride ldxs
  int64_t ldx, ldxs;
};
// `count` consecutive rounds of W int8 weight rows: row r has codes q + r * row_bytes and float16 block
// scales s16 + r * ld16, one per 32-block. Each kernel loops over the rows itself:
// per-row costs matter on short rows (the 0.5B's are 7 quads). Results: y[i * ldy + r] = dot + bias[r]
// for the kernel's R activation rows i.
struct WeightRows {
  const uint8_t* q;
  const uint16_t* s16;
  int64_t row_bytes, ld16, nb;
};

// ---- int8 weights: two 32-blocks per 512-bit step ----
// R activation rows against one int8 weight row at a time. Per block: sum(q * xq) in integers (maddubs +
// madd: 8 int32 lanes, each the sum of 4 adjacent products), converted to float and multiplied-added with
// the block factor sx * sf, even blocks into one accumulator and odd ones into another;
// y = hsum(acc0 + acc1) + bias. Each row's arithmetic is the same whatever R is, so a row's result does
// not depend on how many rows share the call (bit for bit).
template <int R>
inline void dot_q8_rows(const WeightRows& w, int64_t count, const Acts& a, const float* bias, float* y, int64_t ldy) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t r = 0; r < count; ++r) {
    const uint8_t* q = w.q + r * w.row_bytes;
    const uint16_t* s16 = w.s16 + r * w.ld16;
    __m256 acc[R][2];
    for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    auto block = [&](int64_t b, int parity) {
      if (parity == 0) _mm_prefetch(reinterpret_cast<const char*>(q + 32 * b + PREFETCH_BYTES), _MM_HINT_T0);
      const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32 * b));
      const __m256i qa = _mm256_sign_epi8(qv, qv);
      const __m256 sfv = _mm256_set1_ps(half_to_float(s16[b]));
      for (int i = 0; i < R; ++i) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq + i * a.ldx + 32 * b));
        // move q's sign onto x: |q|, |x| <= 127 cannot saturate int16
        const __m256i prod = _mm256_maddubs_epi16(qa, _mm256_sign_epi8(xv, qv));
        const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, ones));
        const __m256 d = _mm256_mul_ps(_mm256_broadcast_ss(a.xs + i * a.ldxs + b), sfv);
        acc[i][parity] = _mm256_fmadd_ps(f, d, acc[i][parity]);
      }
    };
    int64_t b = 0;
    for (; b + 2 <= w.nb; b += 2) {
      block(b, 0);
      block(b + 1, 1);
    }
    if (b < w.nb) block(b, 0);
    const float bn = bias ? bias[r] : 0.f;
    for (int i = 0; i < R; ++i) y[i * ldy + r] = hsum(_mm256_add_ps(acc[i][0], acc[i][1])) + bn;
  }
}

// The same dot products with AVX-512 VNNI, two blocks per 512-bit register: the low half holds the even
// block (acc0 above), the high half the odd one (acc1). vpdpbusd sums four adjacent u8 x s8 products into
// each int32 lane, exactly the integers maddubs + madd produce, and every float operation is the one of
// dot_q8_rows, so results are bit for bit the same on AVX2-only machines and VNNI ones. x + 128
// (x ^ 0x80) is the unsigned operand, and 128 * sum(q) is subtracted (x + 128 in [1, 255]: exact in
// int32). Compiled for VNNI by attribute only: the caller dispatches on the running CPU.
#define SUDU_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

// The 16 lanes' sum plus 8 more lanes, in the order hsum((low 8 + high 8) + extra), + bias (hsum itself
// is compiled for plain AVX2).
SUDU_VNNI inline float hsum16(__m512 acc, __m256 extra, float bias) {
  const __m256 v = _mm256_add_ps(_mm256_add_ps(_mm512_castps512_ps256(acc), _mm512_extractf32x8_ps(acc, 1)), extra);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s) + bias;
}

// W weight rows (1 or 2) at once: each activation block and its scale pair are loaded once for both;
// `count` such rounds (rows r * W .. r * W + W - 1).
template <int R, int W>
SUDU_VNNI void dot_q8_rows_vnni(const WeightRows& w, int64_t count, const Acts& a, const float* bias, float* y,
                                int64_t ldy) {
  if (count > 1) prefetch_start(w.q);  // (count 1: one round of a call with more activation rows than a chunk)
  const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  const int64_t nb = w.nb;
  // [v[0] x 8, v[1] x 8] from two adjacent floats, or from two adjacent float16 values
  auto pair_of = [&](const float* v) SUDU_VNNI {
    return _mm512_permutexvar_ps(pair, _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(v)))));
  };
  auto pair_of_halves = [&](const uint16_t* v) SUDU_VNNI {
    return _mm512_permutexvar_ps(pair, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(*reinterpret_cast<const int*>(v)))));
  };
  for (int64_t r = 0; r < count; ++r) {
    const uint8_t* q[W];
    const uint16_t* s16[W];
    for (int j = 0; j < W; ++j) {
      q[j] = w.q + (r * W + j) * w.row_bytes;
      s16[j] = w.s16 + (r * W + j) * w.ld16;
    }
    __m512 acc[W][R];
    for (int j = 0; j < W; ++j)
      for (int i = 0; i < R; ++i) acc[j][i] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
      __m512i qv[W], base[W];
      __m512 sfv[W];
      for (int j = 0; j < W; ++j) {
        _mm_prefetch(reinterpret_cast<const char*>(q[j] + 32 * b + PREFETCH_BYTES), _MM_HINT_T0);
        qv[j] = _mm512_loadu_si512(q[j] + 32 * b);
        base[j] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), flip, qv[j]));
        sfv[j] = pair_of_halves(s16[j] + b);
      }
      for (int i = 0; i < R; ++i) {
        const __m512i xu = _mm512_xor_si512(_mm512_loadu_si512(a.xq + i * a.ldx + 32 * b), flip);
        const __m512 sxv = pair_of(a.xs + i * a.ldxs + b);
        for (int j = 0; j < W; ++j) {
          const __m512i sum = _mm512_dpbusd_epi32(base[j], xu, qv[j]);
          acc[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(sxv, sfv[j]), acc[j][i]);
        }
      }
    }
    if (b < nb) {  // an odd last block: the low half only
      for (int j = 0; j < W; ++j) {
        const __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[j] + 32 * b));
        const __m256i base =
            _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8(char(0x80)), qv));
        const __m256 sfv = _mm256_set1_ps(half_to_float(s16[j][b]));
        for (int i = 0; i < R; ++i) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq + i * a.ldx + 32 * b));
          const __m256i sum = _mm256_dpbusd_epi32(base, _mm256_xor_si256(xv, _mm256_set1_epi8(char(0x80))), qv);
          const __m256 d = _mm256_mul_ps(_mm256_broadcast_ss(a.xs + i * a.ldxs + b), sfv);
          acc[j][i] = _mm512_mask3_fmadd_ps(_mm512_castps256_ps512(_mm256_cvtepi32_ps(sum)), _mm512_castps256_ps512(d),
                                            acc[j][i], 0x00FF);
        }
      }
    }
    for (int j = 0; j < W; ++j) {
      const float bn = bias ? bias[r * W + j] : 0.f;
      for (int i = 0; i < R; ++i) y[i * ldy + r * W + j] = hsum16(acc[j][i], _mm256_setzero_ps(), bn);
    }
  }
}

// ---- int4 weights: tiles of 16 rows, one row per 32-bit lane ----
// The kernel-side layout of int4 weights (layers/linear.py pack_int4 builds it from the row layout): rows
// in tiles of 16 (the last one zero-padded), and per tile and 32-block TILE_BLOCK_BYTES = 320 bytes:
//   4 chunks of 64 bytes, chunk c covering the block's columns 8c..8c+7: lane l (bytes 4l..4l+3) holds row
//   l's columns 8c..8c+3 in its low nibbles and 8c+4..8c+7 in its high ones; then the 16 rows' float16
//   scales (32 bytes) and float16 mins (32 bytes).
// So one integer dot product step (vpdpbusd: 4 u8 x s8 products summed per int32 lane) takes 4 columns of
// 16 rows against 4 activation codes broadcast to every lane, and after a block's 8 steps each lane holds
// its row's integer sum S over the block. The float work is then per 16 rows, not per row:
//   acc = fma(float(S), sx * s, acc);  acc = fma(m, xsum, acc)      (16 lanes = 16 rows)
// with sx the activation block's scale and xsum = sx * sum(codes) (the min term sum(m * x)), and
// y = acc + bias, written with no horizontal sum. The row layout needed that float work once per row
// and 4 blocks, with the activation codes reordered to meet the nibbles: 1.5-1.9x the time at 1-8 rows
// (benchmarks/linear_kernels.py). The AVX2 kernel computes each tile as two 8-lane halves: the same
// integers (maddubs + madd), the same float operations in the same order, bit for bit the same rows, and a
// row's result is independent of the other rows and tiles it shares a call with.
constexpr int64_t TILE_ROWS = 16, TILE_BLOCK_BYTES = 320;

// R activation rows against `count` rounds of W tiles (tiles r * W .. r * W + W - 1 from p); tile t's
// outputs go to y[i * ldy + 16 * t + l] (padding rows included: the caller's buffer has room).
template <int R, int W>
SUDU_VNNI void dot_q4_tiles_vnni(const uint8_t* p, int64_t count, int64_t nb, const int8_t* xq, const float* sx,
                                 const float* xsum, int64_t ldx, const float* bias, float* y, int64_t ldy) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  const int64_t tile_bytes = nb * TILE_BLOCK_BYTES;
  if (count > 1) prefetch_start(p);
  for (int64_t r = 0; r < count; ++r) {
    const uint8_t* tp[W];
    for (int j = 0; j < W; ++j) tp[j] = p + (r * W + j) * tile_bytes;
    __m512 acc[R][W];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < W; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      __m512i S[R][W];
      for (int i = 0; i < R; ++i)
        for (int j = 0; j < W; ++j) S[i][j] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        __m512i lo[W], hi[W];
        for (int j = 0; j < W; ++j) {
          const uint8_t* at = tp[j] + b * TILE_BLOCK_BYTES + 64 * c;
          _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH_BYTES), _MM_HINT_T0);
          const __m512i raw = _mm512_loadu_si512(at);
          lo[j] = _mm512_and_si512(raw, mask);
          hi[j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
        }
        for (int i = 0; i < R; ++i) {
          const int* xd = reinterpret_cast<const int*>(xq + i * ldx + 32 * b + 8 * c);
          const __m512i xl = _mm512_set1_epi32(xd[0]), xh = _mm512_set1_epi32(xd[1]);
          for (int j = 0; j < W; ++j) S[i][j] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(S[i][j], lo[j], xl), hi[j], xh);
        }
      }
      for (int j = 0; j < W; ++j) {
        const uint8_t* at = tp[j] + b * TILE_BLOCK_BYTES + 256;
        _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH_BYTES), _MM_HINT_T0);
        const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32)));
        for (int i = 0; i < R; ++i) {
          const __m512 d = _mm512_mul_ps(_mm512_set1_ps(sx[i * nb + b]), sv);
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[i][j]), d, acc[i][j]);
          acc[i][j] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[i * nb + b]), acc[i][j]);
        }
      }
    }
    for (int j = 0; j < W; ++j) {
      const int64_t t = r * W + j;
      const __m512 bv = bias ? _mm512_loadu_ps(bias + TILE_ROWS * t) : _mm512_setzero_ps();
      for (int i = 0; i < R; ++i) _mm512_storeu_ps(y + i * ldy + TILE_ROWS * t, _mm512_add_ps(acc[i][j], bv));
    }
  }
}

// The same on AVX2, one tile at a time, each tile as two 8-lane halves.
template <int R>
void dot_q4_tiles(const uint8_t* p, int64_t count, int64_t nb, const int8_t* xq, const float* sx, const float* xsum,
                  int64_t ldx, const float* bias, float* y, int64_t ldy) {
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int64_t tile_bytes = nb * TILE_BLOCK_BYTES;
  for (int64_t t = 0; t < count; ++t) {
    const uint8_t* tp = p + t * tile_bytes;
    for (int h = 0; h < 2; ++h) {  // rows 0-7, then 8-15
      __m256 acc[R];
      for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        __m256i S[R];
        for (int i = 0; i < R; ++i) S[i] = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
          const uint8_t* at = tp + b * TILE_BLOCK_BYTES + 64 * c + 32 * h;
          _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH_BYTES), _MM_HINT_T0);
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
          const __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
          for (int i = 0; i < R; ++i) {
            const int* xd = reinterpret_cast<const int*>(xq + i * ldx + 32 * b + 8 * c);
            // q in [0, 15] is maddubs' unsigned operand; 2 * 15 * 128 cannot saturate int16
            S[i] = _mm256_add_epi32(S[i], _mm256_add_epi32(
                _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(xd[0])), ones),
                _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_set1_epi32(xd[1])), ones)));
          }
        }
        const uint8_t* at = tp + b * TILE_BLOCK_BYTES + 256 + 16 * h;
        const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
        const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 32)));
        for (int i = 0; i < R; ++i) {
          const __m256 d = _mm256_mul_ps(_mm256_set1_ps(sx[i * nb + b]), sv);
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[i]), d, acc[i]);
          acc[i] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xsum[i * nb + b]), acc[i]);
        }
      }
      const int64_t o = TILE_ROWS * t + 8 * h;
      const __m256 bv = bias ? _mm256_loadu_ps(bias + o) : _mm256_setzero_ps();
      for (int i = 0; i < R; ++i) _mm256_storeu_ps(y + i * ldy + o, _mm256_add_ps(acc[i], bv));
    }
  }
}

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

// AVX2 kernels take MR rows per call: 4 rows x 2 accumulators + temporaries fit 16 ymm registers (VNNI:
// 8 rows x 2 weight rows = 16 accumulators of AVX-512's 32 registers).
constexpr int MR = 4, MR_VNNI = 8;

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
}
bool use_vnni = cpu_has_vnni();  // set_isa switches it, so the tests can compare the two paths

// Weight rows per round: VNNI with 3+ activation rows takes two, sharing the activation loads. With 1-2
// rows one is faster (measured: 20-45% on rows of 768+ bytes), though it computes more per weight; 2 rows
// on short rows (448-byte rows) still gain from sharing. A matrix far larger than the last-level cache (an
// output head: 233 MB on the 1.5B) streams faster one row at a time up to 4 rows (measured: 3 rows 7.7 ms
// against 11.3 ms).
inline int weight_rows_per_round(bool vnni, int64_t M, int64_t row_bytes, int64_t matrix_bytes) {
  if (!vnni || M == 1) return 1;
  if (M == 2) return row_bytes <= 512 ? 2 : 1;
  return M <= 4 && matrix_bytes > (64LL << 20) ? 1 : 2;
}

// int8 weights: activations quantized once per call, then the rows split over threads. Up to one kernel
// row chunk of activations (MR_VNNI rows, or MR on AVX2), a thread's whole range of weight rows goes through
// one kernel call; with more, each round of weight rows meets every row chunk while it sits in L1.
void qlinear_q8_impl(const float* x, int64_t M, int64_t K, const uint8_t* q, const uint16_t* s, int64_t N, int64_t G,
                     const float* bias, float* y) {
  const int64_t ngroups = K / G, nb = K / 32, nbp = (nb + 7) / 8 * 8;
  const int64_t row_bytes = K, ldx = K, ldxs = nbp;
  std::vector<int8_t> xq(M * ldx, 0);
  std::vector<float> sx(M * nbp, 0.f), xsum(M * nbp, 0.f);
  for (int64_t m = 0; m < M; ++m)
    quantize_row_q8(x + m * K, K, xq.data() + m * ldx, sx.data() + m * nbp, xsum.data() + m * nbp);
  const Acts acts{xq.data(), sx.data(), ldx, ldxs};
  const bool vnni = use_vnni;
  // count rounds of W weight rows from row n, against all M activation rows
  auto run = [&](const WeightRows& rows, int64_t count, int W, int64_t n) {
    auto chunk = [&](auto r, int64_t m) {
      constexpr int R = decltype(r)::value;
      const Acts at{acts.xq + m * ldx, acts.xs + m * ldxs, ldx, ldxs};
      const float* b = bias ? bias + n : nullptr;
      float* out = y + m * N + n;
      if (!vnni) dot_q8_rows<R>(rows, count, at, b, out, N);
      else if (W == 2) dot_q8_rows_vnni<R, 2>(rows, count, at, b, out, N);
      else dot_q8_rows_vnni<R, 1>(rows, count, at, b, out, N);
    };
    if (vnni)
      row_chunks<MR_VNNI>(M, chunk);
    else
      row_chunks<MR>(M, chunk);
  };
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    if (G != 32) {  // scales expanded to one per block, a row at a time
      std::vector<uint16_t> s16(nb);
      for (int64_t n = n0; n < n1; ++n) {
        for (int64_t b = 0; b < nb; ++b) s16[b] = s[n * ngroups + b * 32 / G];
        run(WeightRows{q + n * row_bytes, s16.data(), row_bytes, 0, nb}, 1, 1, n);
      }
      return;
    }
    auto rows_from = [&](int64_t n) { return WeightRows{q + n * row_bytes, s + n * ngroups, row_bytes, ngroups, nb}; };
    const int W = weight_rows_per_round(vnni, M, row_bytes, N * row_bytes);
    const int64_t rounds = (n1 - n0) / W;
    if (M <= (vnni ? MR_VNNI : MR)) {
      run(rows_from(n0), rounds, W, n0);
    } else {
      for (int64_t r = 0; r < rounds; ++r) run(rows_from(n0 + r * W), 1, W, n0 + r * W);
    }
    if (rounds * W < n1 - n0) run(rows_from(n0 + rounds * W), 1, 1, n0 + rounds * W);  // an odd last row
  });
}

// Tiles per round on VNNI by activation rows: with one row, 4 tiles give the 4 independent dot-product
// chains that keep vpdpbusd's pipeline full; from 5 rows the rows alone do, and a tile's accumulators
// (2 per row) would not fit the registers twice. (AVX2: one tile at a time.)
inline int tiles_per_round(int64_t R) { return R == 1 ? 4 : R <= 4 ? 2 : 1; }

// int4 weights in tiles (above): activations quantized once per call, tiles split over threads. Up to
// MR_VNNI (AVX2: MR) activation rows, a thread's tiles go through one kernel call per tile count; with
// more, each round of tiles meets every row chunk while it sits in L1/L2. y has ntiles * 16 columns.
void qlinear_q4_tiles_impl(const float* x, int64_t M, int64_t K, const uint8_t* p, int64_t ntiles, const float* bias,
                           float* y) {
  const int64_t nb = K / 32, tile_bytes = nb * TILE_BLOCK_BYTES, ldy = ntiles * TILE_ROWS;
  std::vector<int8_t> xq(M * K);
  std::vector<float> sx(M * nb), xsum(M * nb);
  for (int64_t m = 0; m < M; ++m) quantize_row_q8(x + m * K, K, xq.data() + m * K, sx.data() + m * nb, xsum.data() + m * nb);
  const bool vnni = use_vnni;
  // `count` rounds of W tiles from tile t against the activation rows of every chunk
  auto run = [&](int64_t t, int64_t count, int W) {
    auto chunk = [&](auto r, int64_t m) {
      constexpr int R = decltype(r)::value;
      const uint8_t* tp = p + t * tile_bytes;
      const int8_t* xa = xq.data() + m * K;
      const float *sa = sx.data() + m * nb, *ua = xsum.data() + m * nb;
      const float* b = bias ? bias + TILE_ROWS * t : nullptr;
      float* out = y + m * ldy + TILE_ROWS * t;
      if (!vnni) dot_q4_tiles<R>(tp, count, nb, xa, sa, ua, K, b, out, ldy);
      else if (W == 4) dot_q4_tiles_vnni<R, 4>(tp, count, nb, xa, sa, ua, K, b, out, ldy);
      else if (W == 2) dot_q4_tiles_vnni<R, 2>(tp, count, nb, xa, sa, ua, K, b, out, ldy);
      else dot_q4_tiles_vnni<R, 1>(tp, count, nb, xa, sa, ua, K, b, out, ldy);
    };
    if (vnni)
      row_chunks<MR_VNNI>(M, chunk);
    else
      row_chunks<MR>(M, chunk);
  };
  at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
    const int W = vnni ? tiles_per_round(std::min<int64_t>(M, MR_VNNI)) : 1;
    const bool one_chunk = M <= (vnni ? MR_VNNI : MR);
    int64_t t = t0;
    for (int w = W; w >= 1; w /= 2) {  // whole rounds of W tiles, then the rest in halves
      const int64_t rounds = (t1 - t) / w;
      if (one_chunk && rounds) {
        run(t, rounds, w);
      } else {
        for (int64_t r = 0; r < rounds; ++r) run(t + r * w, 1, w);
      }
      t += rounds * w;
    }
  });
}

// float32 -> bfloat16, round to nearest even (as PyTorch's .to(torch.bfloat16)); n a multiple of 8.
inline void to_bf16(const float* in, int64_t n, uint16_t* out) {
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF);
  for (int64_t i = 0; i < n; i += 16) {
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
}

// One tile's 16 rows (K = 32 * nb columns) as float32, w = s * q + m, into out (row stride ldo). Per chunk and
// 8 rows: the low and high nibbles of a lane, interleaved by dword (unpacklo / unpackhi), are that row's 8
// consecutive columns.
inline void dequant_int4_tile(const uint8_t* tp, int64_t nb, float* out, int64_t ldo) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  // the rows of the two unpacks' 64-bit elements: lo gives (0, 1 | 4, 5), hi (2, 3 | 6, 7)
  static const int rows_of[2][4] = {{0, 1, 4, 5}, {2, 3, 6, 7}};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = tp + b * TILE_BLOCK_BYTES;
    for (int h = 0; h < 2; ++h) {
      const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 256 + 16 * h)));
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 288 + 16 * h)));
      alignas(32) float s8[8], m8[8];
      _mm256_store_ps(s8, sv);
      _mm256_store_ps(m8, mv);
      for (int c = 0; c < 4; ++c) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * c + 32 * h));
        const __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        const __m256i u[2] = {_mm256_unpacklo_epi32(lo, hi), _mm256_unpackhi_epi32(lo, hi)};
        for (int k = 0; k < 2; ++k) {
          const __m128i halves[2] = {_mm256_castsi256_si128(u[k]), _mm256_extracti128_si256(u[k], 1)};
          for (int e = 0; e < 4; ++e) {
            const __m128i v = e % 2 ? _mm_srli_si128(halves[e / 2], 8) : halves[e / 2];
            const int row = rows_of[k][e];
            const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
            _mm256_storeu_ps(out + (8 * h + row) * ldo + 32 * b + 8 * c,
                             _mm256_fmadd_ps(f, _mm256_set1_ps(s8[row]), _mm256_set1_ps(m8[row])));
          }
        }
      }
    }
  }
}

// Dequantized rows as float32 (out32) or bfloat16 (out16, through a float buffer): int8 [N, K] a row at a
// time; int4 tiles a tile at a time (N = 16 * tiles rows, padding included).
template <bool INT4>
void dequant_impl(const uint8_t* q, const uint16_t* s, int64_t N, int64_t K, int64_t G, float* out32, uint16_t* out16) {
  const int64_t ngroups = K / G, nb = K / 32;
  const int64_t unit = INT4 ? TILE_ROWS : 1;  // rows per step
  at::parallel_for(0, N / unit, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> buf(out16 ? unit * K : 0);
    for (int64_t u = u0; u < u1; ++u) {
      float* dst = out16 ? buf.data() : out32 + u * unit * K;
      if (INT4)
        dequant_int4_tile(q + u * nb * TILE_BLOCK_BYTES, nb, dst, K);
      else
        dequant_int8(reinterpret_cast<const int8_t*>(q) + u * K, s + u * ngroups, G, K, dst);
      if (out16) to_bf16(dst, unit * K, out16 + u * unit * K);
    }
  });
}

// int4 tiles: uint8 [tiles, K / 32, TILE_BLOCK_BYTES]
void check_tiles(const torch::Tensor& q) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kByte && q.is_contiguous() && q.size(2) == TILE_BLOCK_BYTES,
              "int4 weights must be packed tiles uint8 [tiles, K / 32, 320]");
}

void check_args(const torch::Tensor& q, const torch::Tensor& s, int64_t K, int64_t G) {
  TORCH_CHECK(q.is_contiguous() && s.is_contiguous(), "weights must be contiguous");
  TORCH_CHECK(s.scalar_type() == torch::kHalf, "scales must be float16");
  TORCH_CHECK(K % 32 == 0 && G % 32 == 0 && K % G == 0, "K and the group size must be multiples of 32");
  TORCH_CHECK(s.size(0) == q.size(0) && s.size(1) == K / G, "scales must be [N, K / group_size]");
}

}  // namespace

// x: float32 [M, K]. int8: q int8 [N, K], s float16 [N, K / group_size] -> y [M, N]. int4: q the packed tiles
// uint8 [tiles, K / 32, 320] (s, mn and group_size unused: the tiles hold per-32 scales and mins) ->
// y [M, 16 * tiles], the padding rows' outputs included. bias: float32 [N] (or [<= 16 * tiles]) or empty.
torch::Tensor qlinear(torch::Tensor x, torch::Tensor q, torch::Tensor s, torch::Tensor mn, int64_t group_size,
                      c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be float32 [M, K]");
  x = x.contiguous();
  const bool int4 = q.scalar_type() == torch::kByte;
  const int64_t M = x.size(0), K = x.size(1);
  if (int4) {
    check_tiles(q);
    TORCH_CHECK(K % 32 == 0 && q.size(1) == K / 32, "weight shape does not match x");
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kChar, "int8 weights must be torch.int8");
    TORCH_CHECK(q.size(1) == K, "weight shape does not match x");
    check_args(q, s, K, group_size);
  }
  const int64_t N = int4 ? q.size(0) * TILE_ROWS : q.size(0);
  const float* b = nullptr;
  std::vector<float> padded;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() <= N &&
                (int4 ? bias->numel() > N - TILE_ROWS : bias->numel() == N), "bad bias");
    b = bias->data_ptr<float>();
    if (bias->numel() < N) {  // int4's padding rows
      padded.assign(N, 0.f);
      std::copy(b, b + bias->numel(), padded.begin());
      b = padded.data();
    }
  }
  auto y = torch::empty({M, N}, x.options());
  if (int4)
    qlinear_q4_tiles_impl(x.data_ptr<float>(), M, K, q.data_ptr<uint8_t>(), q.size(0), b, y.data_ptr<float>());
  else
    qlinear_q8_impl(x.data_ptr<float>(), M, K, reinterpret_cast<const uint8_t*>(q.data_ptr<int8_t>()),
                    reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>()), N, group_size, b, y.data_ptr<float>());
  return y;
}

// The weights as float32, or bfloat16 with bf16 = true (for prefill: dequantize, then one GEMM): int8 [N, K];
// int4 tiles [16 * tiles, K], padding rows included.
torch::Tensor dequantize(torch::Tensor q, torch::Tensor s, torch::Tensor mn, int64_t group_size, bool bf16) {
  const bool int4 = q.scalar_type() == torch::kByte;
  int64_t N, K;
  if (int4) {
    check_tiles(q);
    N = q.size(0) * TILE_ROWS, K = q.size(1) * 32;
  } else {
    N = q.size(0), K = q.size(1);
    check_args(q, s, K, group_size);
  }
  auto out = torch::empty({N, K}, torch::dtype(bf16 ? torch::kBFloat16 : torch::kFloat));
  float* out32 = bf16 ? nullptr : out.data_ptr<float>();
  uint16_t* out16 = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  if (int4)
    dequant_impl<true>(q.data_ptr<uint8_t>(), nullptr, N, K, 32, out32, out16);
  else
    dequant_impl<false>(reinterpret_cast<const uint8_t*>(q.data_ptr<int8_t>()),
                        reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>()), N, K, group_size, out32, out16);
  return out;
}

// "avx512vnni" or "avx2": the dot-product path qlinear takes. set_isa("avx2") forces the AVX2 path (the
// tests check both give identical results); set_isa("native") restores the CPU's best.
std::string isa() { return use_vnni ? "avx512vnni" : "avx2"; }
std::string set_isa(const std::string& name) {
  TORCH_CHECK(name == "avx2" || name == "native", "isa must be 'avx2' or 'native'");
  use_vnni = name == "native" && cpu_has_vnni();
  return isa();
}
