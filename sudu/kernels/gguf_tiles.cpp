// GGUF's quantized block formats run as the file stores them (`--quantization native`): Q5_0, Q4_K, Q5_K and
// Q6_K. (Q8_0 is exactly sudu's int8 tile, Q4_0 and Q4_1 exactly its int4 tile: layers/gguf_native.py.)
//
// The codes and scales are the file's, bit for bit; only their order changes, into tiles of 16 rows as
// quant_linear.cpp's kernels read them, so one vector operation covers one block of 16 rows. That is
// what llama.cpp forks do with run-time repacking (ik_llama.cpp's -rtr): same bytes per weight as the file,
// laid out for the vector units.
//
// Per tile and 32-column block, every format starts with the 4 low bits of each code in int4's layout:
//   256 bytes, 4 chunks of 64: chunk c, lane l (bytes 4l..4l+3), byte k: row l's column 8c+k in the
//   low nibble, column 8c+4+k in the high one.
// then the codes' high bits, if any:
//   1 bit (Q5_0, Q5_K), 64 bytes: lane l's 32-bit word, byte k: bit c = column 8c+k's fifth bit, bit 4+c =
//     column 8c+4+k's. For chunk c, (word << (4 - c)) & 0x10 and (word >> c) & 0x10 put them at bit 4 of the
//     low and the high nibbles' bytes (no bit of a neighbouring byte lands there).
//   2 bits (Q6_K), 128 bytes: two such words per lane, for the low nibbles' columns then the high ones':
//     byte k, bits 2c, 2c+1 = column 8c+k's (or 8c+4+k's) bits 4 and 5, moved to bits 4-5 by a shift of
//     4 - 2c.
// and per group of blocks (1 block for Q5_0, a 256-column super-block of 8 for the K-quants) a tail:
//   Q5_0: the 16 rows' float16 d (32 bytes). w = d * (q - 16).
//   Q4_K / Q5_K: the 8 blocks' 6-bit scales and mins as bytes, [block][row] (128 + 128), then float16 d and
//     dmin (32 + 32). w = d * sc * q - dmin * m.
//   Q6_K: the 16 sub-blocks' (16 columns each) int8 scales [sub-block][row] (256), then float16 d (32).
//     w = d * sc * (q - 32).
// Q4_K and Q5_K keep their scales unpacked: 4 bytes per row and super-block more than the file's 12 packed
// bytes (148 against 144, 180 against 176); the others are exactly the file's bytes per weight.
//
// Dot products: the activations are int8, Q5_0's with one scale per 32 columns (q8_0), the K-quants' with one
// per 256 times a small integer per 32 (q8_K, quant_linear.cpp: finer than llama.cpp's q8_K, which has one
// per 256), so a super-block sums in integers before any float work. Each (block, activation block) pair is
// an integer dot product of the unsigned codes (vpdpbusd, or AVX2 maddubs + madd: the same integers). Q5_0:
// its offset removed in integers (q - 16: 16 * sum(x codes)), then one float multiply-add per block and 16
// rows with d * sx. K-quants: the sub-block scales and the activation block's multiple applied in integers
// (AVX2: as madd's multipliers) and summed over the super-block's 8 blocks; the offset (Q6_K: 32 * sc *
// sum(x codes) per 16 columns) or the min term (Q4_K/Q5_K: m * sum(x codes) per block) also in integers, by
// madd of the scales' int16 pairs with the activations' pair sums; then per super-block and 16 rows one
// float multiply-add with d * sx (and one with dmin * sx for the mins).
// As for int8/int4, a row's result is the same at any row count and on either instruction set.
#include "quant_tiles.h"

#include <cstring>
#include <type_traits>

namespace qtiles {
namespace {


template <int S>
SUDU_VNNI inline __m512i shift512(__m512i v) {
  if constexpr (S > 0) return _mm512_slli_epi32(v, S);
  else if constexpr (S < 0) return _mm512_srli_epi32(v, -S);
  else return v;
}
template <int S>
inline __m256i shift256(__m256i v) {
  if constexpr (S > 0) return _mm256_slli_epi32(v, S);
  else if constexpr (S < 0) return _mm256_srli_epi32(v, -S);
  else return v;
}

// The prefetches of one stretch of the weight stream [at, at + n), GGUF_PREFETCH_BYTES ahead.
inline void prefetch_ahead(const uint8_t* at, int64_t n) {
  for (int64_t o = 0; o < n; o += 64) _mm_prefetch(reinterpret_cast<const char*>(at + o + GGUF_PREFETCH_BYTES), PREFETCH_HINT);
}

// Four activation codes of row i from column col (q8_0 or q8_K: Acts).
inline int codes4(const int8_t* q, int64_t K, int i, int64_t col) { return *reinterpret_cast<const int*>(q + i * K + col); }

// Chunk c (columns 8c..8c+7) of block bp of a tile: its 16 rows' codes, each lane's low 4 columns in lo
// and high 4 in hi (low nibbles with their high bits W0, W1).
template <int64_t F, int c>
SUDU_VNNI inline void codes512(const uint8_t* bp, __m512i W0, __m512i W1, __m512i& lo, __m512i& hi) {
  nibbles(_mm512_loadu_si512(bp + 64 * c), lo, hi);
  if constexpr (high_bits(F) == 1) {
    const __m512i bit4 = _mm512_set1_epi8(0x10);
    lo = _mm512_or_si512(lo, _mm512_and_si512(shift512<4 - c>(W0), bit4));
    hi = _mm512_or_si512(hi, _mm512_and_si512(shift512<-c>(W0), bit4));
  } else if constexpr (high_bits(F) == 2) {
    const __m512i bits45 = _mm512_set1_epi8(0x30);
    lo = _mm512_or_si512(lo, _mm512_and_si512(shift512<4 - 2 * c>(W0), bits45));
    hi = _mm512_or_si512(hi, _mm512_and_si512(shift512<4 - 2 * c>(W1), bits45));
  }
}

// 16 rows' bytes u and v interleaved and widened to int16 pairs (u[r], v[r]) per 32-bit lane: a madd operand.
SUDU_VNNI inline __m512i pairs512(const uint8_t* u, const uint8_t* v, bool is_signed) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u)), b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
  const __m256i ab = _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b));
  return is_signed ? _mm512_cvtepi8_epi16(ab) : _mm512_cvtepu8_epi16(ab);
}
// A tile's codes as codes512 assembles them, block by block: per block and chunk, lo then hi (64 bytes
// each, UNPACKED_BLOCK bytes a block); then, for the K-quants, per super-block the madd operands of its
// scales that every row's offset or min term takes (pairs512: Q6_K's 8 sub-block scale pairs, Q4_K/Q5_K's
// 4 min pairs; UNPACKED_GROUP bytes a super-block). A prompt's row chunks read them from here (L1/L2, made
// once per tile and call) instead of assembling them again for every 8 rows.
template <int64_t F>
SUDU_VNNI inline __m512i scale_pairs(const uint8_t* tail, int j) {
  if constexpr (F == Q6_K) return pairs512(tail + 32 * j, tail + 32 * j + 16, true);
  else return pairs512(tail + 128 + 16 * j, tail + 144 + 16 * j, false);
}
// Pair operand j of a super-block's scales (scale_pairs): read from an unpacked tile (up: the super-block's
// entries there), else assembled from the tail.
template <int64_t F>
SUDU_VNNI inline __m512i group_pairs(const uint8_t* up, const uint8_t* tail, int j) {
  return up ? _mm512_loadu_si512(up + 64 * (F == Q6_K ? j : j / 2)) : scale_pairs<F>(tail, j);
}
template <int64_t F>
SUDU_VNNI void unpack_vnni(const uint8_t* tp, int64_t nb, uint8_t* out) {
  constexpr int G = blocks_per_group(F), HB = high_bits(F);
  constexpr int64_t BB = block_bytes(F), GB = group_bytes(F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* bp = tp + b / G * GB + b % G * BB;
    __m512i W0 = _mm512_setzero_si512(), W1 = _mm512_setzero_si512();
    if constexpr (HB >= 1) W0 = _mm512_loadu_si512(bp + 256);
    if constexpr (HB == 2) W1 = _mm512_loadu_si512(bp + 320);
    uint8_t* o = out + b * UNPACKED_BLOCK;
    __m512i lo, hi;
#define SUDU_UNPACK(C)                              \
    codes512<F, C>(bp, W0, W1, lo, hi);             \
    _mm512_storeu_si512(o + 128 * C, lo);           \
    _mm512_storeu_si512(o + 128 * C + 64, hi);
    SUDU_UNPACK(0) SUDU_UNPACK(1) SUDU_UNPACK(2) SUDU_UNPACK(3)
#undef SUDU_UNPACK
  }
  if constexpr (F != Q5_0)
    for (int64_t g = 0; g < nb / G; ++g) {
      const uint8_t* tail = tp + g * GB + G * BB;
      uint8_t* o = out + nb * UNPACKED_BLOCK + g * UNPACKED_GROUP;
      for (int j = 0; j < G; j += F == Q6_K ? 1 : 2) _mm512_storeu_si512(o + 64 * (F == Q6_K ? j : j / 2), scale_pairs<F>(tail, j));
    }
}

// Chunk c (columns 8c..8c+7) of block b of a tile: the codes (low nibbles and high bits) of its 16 rows
// against R activation rows (codes xq), into S (Q6_K: columns 16..31 into S2). With `unpacked` (the
// block's codes from unpack_vnni), the codes are read from there.
template <int64_t F, int R, int c>
SUDU_VNNI inline void vnni_chunk(const uint8_t* bp, const uint8_t* unpacked, __m512i W0, __m512i W1, const int8_t* xq,
                                 int64_t K, int64_t b, __m512i* S, __m512i* S2) {
  __m512i lo, hi;
  if (unpacked) {
    lo = _mm512_loadu_si512(unpacked + 128 * c);
    hi = _mm512_loadu_si512(unpacked + 128 * c + 64);
  } else {
    codes512<F, c>(bp, W0, W1, lo, hi);
  }
  __m512i* T = (F == Q6_K && c >= 2) ? S2 : S;
  for (int i = 0; i < R; ++i) {
    const __m512i xl = _mm512_set1_epi32(codes4(xq, K, i, 32 * b + 8 * c));
    const __m512i xh = _mm512_set1_epi32(codes4(xq, K, i, 32 * b + 8 * c + 4));
    T[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(T[i], lo, xl), hi, xh);
  }
}

// The same for the 8 rows of half h (AVX2).
inline __m256i pairs256(const uint8_t* u, const uint8_t* v, int h, bool is_signed) {
  const __m128i ab = _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(u + 8 * h)),
                                       _mm_loadl_epi64(reinterpret_cast<const __m128i*>(v + 8 * h)));
  return is_signed ? _mm256_cvtepi8_epi16(ab) : _mm256_cvtepu8_epi16(ab);
}

// unpacked: one tile's codes from unpack_vnni (count 1), or null.
template <int64_t F, int R>
SUDU_VNNI void dot_vnni(const uint8_t* p, int64_t count, const Acts& a, const float* bias, float* y, int64_t ldy,
                        const uint8_t* unpacked = nullptr) {
  constexpr int G = blocks_per_group(F), HB = high_bits(F);
  constexpr int64_t BB = block_bytes(F), GB = group_bytes(F);
  const int64_t nb = a.nb, ng = nb / G, K = a.K;
  const int8_t* xq = F == Q5_0 ? a.xq : a.kq;
  if (count > 1) prefetch_start(p, GGUF_PREFETCH_BYTES);
  for (int64_t t = 0; t < count; ++t) {
    const uint8_t* tp = p + t * ng * GB;
    __m512 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; ++g) {
      const uint8_t* gp = tp + g * GB;
      const uint8_t* tail = gp + G * BB;
      if (a.stream) prefetch_ahead(tail, tail_bytes(F));
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail + tail_bytes(F) - (F == Q4_K || F == Q5_K ? 64 : 32))));
      __m512i iS[R];
      for (int i = 0; i < R; ++i) iS[i] = _mm512_setzero_si512();
      for (int j = 0; j < G; ++j) {
        const int64_t b = g * G + j;
        const uint8_t* bp = gp + j * BB;
        if (a.stream) prefetch_ahead(bp, BB);
        // Q5_0's offset (q - 16: 16 * sum(x codes)) as the sums' starting value
        __m512i S[R], S2[R];
        for (int i = 0; i < R; ++i) {
          S[i] = F == Q5_0 ? _mm512_set1_epi32(-16 * a.isum[i * nb + b]) : _mm512_setzero_si512();
          S2[i] = _mm512_setzero_si512();
        }
        __m512i W0 = _mm512_setzero_si512(), W1 = _mm512_setzero_si512();
        const uint8_t* ub = unpacked ? unpacked + b * UNPACKED_BLOCK : nullptr;
        if (!ub) {
          if constexpr (HB >= 1) W0 = _mm512_loadu_si512(bp + 256);
          if constexpr (HB == 2) W1 = _mm512_loadu_si512(bp + 320);
        }
        vnni_chunk<F, R, 0>(bp, ub, W0, W1, xq, K, b, S, S2);
        vnni_chunk<F, R, 1>(bp, ub, W0, W1, xq, K, b, S, S2);
        vnni_chunk<F, R, 2>(bp, ub, W0, W1, xq, K, b, S, S2);
        vnni_chunk<F, R, 3>(bp, ub, W0, W1, xq, K, b, S, S2);
        if constexpr (F == Q5_0) {
          for (int i = 0; i < R; ++i)
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[i]), _mm512_mul_ps(dv, _mm512_set1_ps(a.sx[i * nb + b])), acc[i]);
        } else if constexpr (F == Q6_K) {
          const __m512i sa = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tail + 32 * j)));
          const __m512i sb = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tail + 32 * j + 16)));
          for (int i = 0; i < R; ++i) {
            const __m512i s = _mm512_add_epi32(_mm512_mullo_epi32(S[i], sa), _mm512_mullo_epi32(S2[i], sb));
            iS[i] = _mm512_add_epi32(iS[i], _mm512_mullo_epi32(s, _mm512_set1_epi32(a.kf[i * nb + b])));
          }
        } else {
          const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tail + 16 * j)));
          for (int i = 0; i < R; ++i)
            iS[i] = _mm512_add_epi32(iS[i], _mm512_mullo_epi32(_mm512_mullo_epi32(S[i], sc), _mm512_set1_epi32(a.kf[i * nb + b])));
        }
      }
      // the scales' madd operands: from the unpacked tile, else assembled here
      const uint8_t* up = unpacked ? unpacked + nb * UNPACKED_BLOCK + g * UNPACKED_GROUP : nullptr;
      if constexpr (F == Q6_K) {
        for (int i = 0; i < R; ++i) {
          __m512i off = _mm512_setzero_si512();
          for (int j = 0; j < G; ++j)
            off = _mm512_add_epi32(off, _mm512_madd_epi16(group_pairs<F>(up, tail, j), _mm512_set1_epi32(a.k16pair[i * nb + g * G + j])));
          const __m512 kd = _mm512_mul_ps(dv, _mm512_set1_ps(a.ksx[i * (nb / 8) + g]));
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(iS[i], _mm512_slli_epi32(off, 5))), kd, acc[i]);
        }
      } else if constexpr (F == Q4_K || F == Q5_K) {
        const __m512 dminv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail + 288)));
        for (int i = 0; i < R; ++i) {
          __m512i mins = _mm512_setzero_si512();
          for (int j = 0; j < G; j += 2)
            mins = _mm512_add_epi32(mins, _mm512_madd_epi16(group_pairs<F>(up, tail, j), _mm512_set1_epi32(a.kpair[i * (nb / 2) + (g * G + j) / 2])));
          const __m512 kx = _mm512_set1_ps(a.ksx[i * (nb / 8) + g]);
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iS[i]), _mm512_mul_ps(dv, kx), acc[i]);
          acc[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(dminv, kx), acc[i]);
        }
      }
    }
    const __m512 bv = bias ? _mm512_loadu_ps(bias + TILE_ROWS * t) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i) store_out(y + i * ldy + TILE_ROWS * t, _mm512_add_ps(acc[i], bv), a.bypass);
  }
}

// AVX2: chunk c (columns 8c..8c+7) of block bp's 8-row half h: each lane's codes for its low 4 columns (lo)
// and its high 4 (hi), low nibbles with their high bits (W0, W1: the half's high-bit words, high_words256).
template <int64_t F>
inline void high_words256(const uint8_t* bp, int h, __m256i& W0, __m256i& W1) {
  W0 = W1 = _mm256_setzero_si256();
  if constexpr (high_bits(F) >= 1) W0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 256 + 32 * h));
  if constexpr (high_bits(F) == 2) W1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 320 + 32 * h));
}
template <int64_t F, int c>
inline void codes256(const uint8_t* bp, int h, __m256i W0, __m256i W1, __m256i& lo, __m256i& hi) {
  nibbles(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bp + 64 * c + 32 * h)), lo, hi);
  if constexpr (high_bits(F) == 1) {
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    lo = _mm256_or_si256(lo, _mm256_and_si256(shift256<4 - c>(W0), bit4));
    hi = _mm256_or_si256(hi, _mm256_and_si256(shift256<-c>(W0), bit4));
  } else if constexpr (high_bits(F) == 2) {
    const __m256i bits45 = _mm256_set1_epi8(0x30);
    lo = _mm256_or_si256(lo, _mm256_and_si256(shift256<4 - 2 * c>(W0), bits45));
    hi = _mm256_or_si256(hi, _mm256_and_si256(shift256<4 - 2 * c>(W1), bits45));
  }
}

// v as an opaque register value: GCC reassociates integer adds, and left alone it computes a block's 32
// maddubs products first and sums them in a tree afterwards, spilling half of them to the stack (16 ymm
// registers). Marking each running sum keeps the adds in the written order.
inline void in_register(__m256i& v) { __asm__("" : "+x"(v)); }

// The same on AVX2: each tile as two 8-lane halves, the same integers and float operations per lane.
template <int64_t F, int R>
void dot_avx2(const uint8_t* p, int64_t count, const Acts& a, const float* bias, float* y, int64_t ldy) {
  constexpr int G = blocks_per_group(F);
  constexpr int64_t BB = block_bytes(F), GB = group_bytes(F);
  const int64_t nb = a.nb, ng = nb / G, K = a.K;
  const int8_t* xq = F == Q5_0 ? a.xq : a.kq;
  // maddubs' int16 pairs of codes times activations (|x| <= 127), summed in int16 over as many chunks as
  // cannot overflow (a chunk: 2 pairs per lane, at most 2 * 2 * 127 * max code), before one madd widens
  // them (K-quants: with the block's or 16-column sub-block's scale as the multiplier): 4-bit codes over a
  // whole block, 5-bit over 2 chunks, Q6_K's 6-bit over each chunk. Exact integers, the sums the VNNI
  // path computes in int32.
  constexpr int PAIRS16 = F == Q4_K ? 4 : F == Q6_K ? 1 : 2;
  static_assert(PAIRS16 * 4 * 127 * ((1 << (4 + high_bits(F))) - 1) <= 32767, "int16 sums overflow");
  auto dot2 = [&](__m256i q, int x4) { return _mm256_maddubs_epi16(q, _mm256_set1_epi32(x4)); };
  for (int64_t t = 0; t < count; ++t) {
    const uint8_t* tp = p + t * ng * GB;
    for (int h = 0; h < 2; ++h) {
      __m256 acc[R];
      for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t g = 0; g < ng; ++g) {
        const uint8_t* gp = tp + g * GB;
        const uint8_t* tail = gp + G * BB;
        if (a.stream) prefetch_ahead(tail, tail_bytes(F));
        const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
            tail + tail_bytes(F) - (F == Q4_K || F == Q5_K ? 64 : 32) + 16 * h)));
        __m256i iS[R];  // Q5_0: the block's sum; K-quants: the super-block's scaled sums
        for (int i = 0; i < R; ++i) iS[i] = _mm256_setzero_si256();
        for (int j = 0; j < G; ++j) {
          const int64_t b = g * G + j;
          const uint8_t* bp = gp + j * BB;
          if (a.stream) prefetch_ahead(bp, BB);
          __m256i W0, W1;
          high_words256<F>(bp, h, W0, W1);
          // madd's multipliers per chunk: ones (Q5_0), the block's scale (Q4_K, Q5_K) or the 16-column
          // sub-block's (Q6_K), as an int16 pair per lane
          __m256i m0, m1;
          if constexpr (F == Q5_0) {
            m0 = m1 = _mm256_set1_epi16(1);
          } else if constexpr (F == Q6_K) {
            m0 = pairs256(tail + 32 * j, tail + 32 * j, h, true);
            m1 = pairs256(tail + 32 * j + 16, tail + 32 * j + 16, h, true);
          } else {
            m0 = m1 = pairs256(tail + 16 * j, tail + 16 * j, h, false);
          }
          __m256i P[R], T[R];
          auto chunk = [&](auto cc) {
            constexpr int c = decltype(cc)::value;
            __m256i lo, hi;
            codes256<F, c>(bp, h, W0, W1, lo, hi);
            for (int i = 0; i < R; ++i) {
              const __m256i m = _mm256_add_epi16(dot2(lo, codes4(xq, K, i, 32 * b + 8 * c)), dot2(hi, codes4(xq, K, i, 32 * b + 8 * c + 4)));
              P[i] = c % PAIRS16 == 0 ? m : _mm256_add_epi16(P[i], m);
              in_register(P[i]);
            }
            if constexpr ((c + 1) % PAIRS16 == 0)
              for (int i = 0; i < R; ++i) {
                if constexpr (F == Q6_K) {  // the block's sum first, then times kf below
                  const __m256i v = _mm256_madd_epi16(P[i], c < 2 ? m0 : m1);
                  T[i] = c == 0 ? v : _mm256_add_epi32(T[i], v);
                } else {
                  __m256i mult = c < 2 ? m0 : m1;  // K-quants: times the activation block's multiple kf
                  if constexpr (F != Q5_0) mult = _mm256_mullo_epi16(mult, _mm256_set1_epi16(a.kf[i * nb + b]));
                  iS[i] = _mm256_add_epi32(iS[i], _mm256_madd_epi16(P[i], mult));
                }
              }
          };
          chunk(std::integral_constant<int, 0>{});
          chunk(std::integral_constant<int, 1>{});
          chunk(std::integral_constant<int, 2>{});
          chunk(std::integral_constant<int, 3>{});
          if constexpr (F == Q6_K)
            for (int i = 0; i < R; ++i)
              iS[i] = _mm256_add_epi32(iS[i], _mm256_mullo_epi32(T[i], _mm256_set1_epi32(a.kf[i * nb + b])));
          if constexpr (F == Q5_0) {
            for (int i = 0; i < R; ++i) {
              const __m256i s = _mm256_sub_epi32(iS[i], _mm256_set1_epi32(16 * a.isum[i * nb + b]));
              acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dv, _mm256_set1_ps(a.sx[i * nb + b])), acc[i]);
              iS[i] = _mm256_setzero_si256();
            }
          }
        }
        if constexpr (F == Q6_K) {
          for (int i = 0; i < R; ++i) {
            __m256i off = _mm256_setzero_si256();
            for (int j = 0; j < G; ++j)
              off = _mm256_add_epi32(off, _mm256_madd_epi16(pairs256(tail + 32 * j, tail + 32 * j + 16, h, true),
                                                            _mm256_set1_epi32(a.k16pair[i * nb + g * G + j])));
            const __m256 kd = _mm256_mul_ps(dv, _mm256_set1_ps(a.ksx[i * (nb / 8) + g]));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(iS[i], _mm256_slli_epi32(off, 5))), kd, acc[i]);
          }
        } else if constexpr (F == Q4_K || F == Q5_K) {
          const __m256 dminv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tail + 288 + 16 * h)));
          for (int i = 0; i < R; ++i) {
            __m256i mins = _mm256_setzero_si256();
            for (int j = 0; j < G; j += 2)
              mins = _mm256_add_epi32(mins, _mm256_madd_epi16(pairs256(tail + 128 + 16 * j, tail + 144 + 16 * j, h, false),
                                                              _mm256_set1_epi32(a.kpair[i * (nb / 2) + (g * G + j) / 2])));
            const __m256 kx = _mm256_set1_ps(a.ksx[i * (nb / 8) + g]);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(iS[i]), _mm256_mul_ps(dv, kx), acc[i]);
            acc[i] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dminv, kx), acc[i]);
          }
        }
      }
      const int64_t o = TILE_ROWS * t + 8 * h;
      const __m256 bv = bias ? _mm256_loadu_ps(bias + o) : _mm256_setzero_ps();
      for (int i = 0; i < R; ++i) _mm256_storeu_ps(y + i * ldy + o, _mm256_add_ps(acc[i], bv));
    }
  }
}

template <int64_t F>
void dot_rows(bool vnni, int R, const uint8_t* p, int64_t count, const Acts& a, const float* bias, float* y, int64_t ldy,
              const uint8_t* unpacked) {
  switch (R) {
#define SUDU_R(N) \
  case N: return vnni ? dot_vnni<F, N>(p, count, a, bias, y, ldy, unpacked) : dot_avx2<F, N>(p, count, a, bias, y, ldy);
    SUDU_R(1) SUDU_R(2) SUDU_R(3) SUDU_R(4) SUDU_R(5) SUDU_R(6) SUDU_R(7) SUDU_R(8)
#undef SUDU_R
    default: break;
  }
}

// One tile as float32: per block and 8-row half, each chunk's codes (low nibbles and high bits as the
// kernels assemble them) unpacked to 8 consecutive columns of 8 rows (as quant_linear.cpp's
// dequant_int4_tile), then w = (q - offset) * A - B with A and B per row and block (Q6_K: per 16 columns),
// in the order GGUF's reference computes them: Q5_0 (q - 16) * d, Q4_K/Q5_K (d * sc) * q - dmin * m, Q6_K
// (d * sc) * (q - 32).
template <int64_t F>
void dequant_tile(const uint8_t* tp, int64_t K, float* out, int64_t ldo) {
  constexpr int G = blocks_per_group(F);
  constexpr int64_t BB = block_bytes(F), GB = group_bytes(F);
  constexpr float OFF = F == Q5_0 ? 16.f : F == Q6_K ? 32.f : 0.f;
  const int64_t ng = K / 32 / G;
  static const int rows_of[2][4] = {{0, 1, 4, 5}, {2, 3, 6, 7}};
  for (int64_t g = 0; g < ng; ++g) {
    const uint8_t* gp = tp + g * GB;
    const uint8_t* tail = gp + G * BB;
    uint16_t dh[16], dminh[16];
    std::memcpy(dh, tail + tail_bytes(F) - (F == Q4_K || F == Q5_K ? 64 : 32), 32);
    if (F == Q4_K || F == Q5_K) std::memcpy(dminh, tail + 288, 32);
    for (int j = 0; j < G; ++j) {
      const int64_t b = g * G + j;
      const uint8_t* bp = gp + j * BB;
      for (int h = 0; h < 2; ++h) {
        float A[2][8], B[8];
        for (int r = 0; r < 8; ++r) {
          const int row = 8 * h + r;
          const float d = _cvtsh_ss(dh[row]);
          if (F == Q5_0) {
            A[0][r] = A[1][r] = d;
            B[r] = 0.f;
          } else if (F == Q6_K) {
            A[0][r] = d * static_cast<float>(static_cast<int8_t>(tail[32 * j + row]));
            A[1][r] = d * static_cast<float>(static_cast<int8_t>(tail[32 * j + 16 + row]));
            B[r] = 0.f;
          } else {
            A[0][r] = A[1][r] = d * static_cast<float>(tail[16 * j + row]);
            B[r] = _cvtsh_ss(dminh[row]) * static_cast<float>(tail[128 + 16 * j + row]);
          }
        }
        __m256i W0, W1;
        high_words256<F>(bp, h, W0, W1);
        auto chunk = [&](auto cc) {
          constexpr int c = decltype(cc)::value;
          __m256i lo, hi;
          codes256<F, c>(bp, h, W0, W1, lo, hi);
          const __m256i u[2] = {_mm256_unpacklo_epi32(lo, hi), _mm256_unpackhi_epi32(lo, hi)};
          for (int k = 0; k < 2; ++k) {
            const __m128i halves[2] = {_mm256_castsi256_si128(u[k]), _mm256_extracti128_si256(u[k], 1)};
            for (int e = 0; e < 4; ++e) {
              const __m128i v = e % 2 ? _mm_srli_si128(halves[e / 2], 8) : halves[e / 2];
              const int r = rows_of[k][e];
              __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
              if (OFF != 0.f) f = _mm256_sub_ps(f, _mm256_set1_ps(OFF));
              f = _mm256_mul_ps(f, _mm256_set1_ps(A[c / 2][r]));
              if (F == Q4_K || F == Q5_K) f = _mm256_sub_ps(f, _mm256_set1_ps(B[r]));
              _mm256_storeu_ps(out + (8 * h + r) * ldo + 32 * b + 8 * c, f);
            }
          }
        };
        chunk(std::integral_constant<int, 0>{});
        chunk(std::integral_constant<int, 1>{});
        chunk(std::integral_constant<int, 2>{});
        chunk(std::integral_constant<int, 3>{});
      }
    }
  }
}

// One row's 32-block b of a GGUF tensor (its blocks `row`, K columns): its unsigned codes and, per format, the
// scale fields the tile keeps (llama.cpp's block layouts).
struct BlockCodes {
  uint8_t q[32];
};

inline uint16_t u16_at(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Q4_K/Q5_K's 6-bit scale and min of sub-block j from the 12 packed bytes s (llama.cpp get_scale_min_k4).
inline void k_scale_min(const uint8_t* s, int j, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = s[j] & 63;
    *m = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

template <int64_t F>
void block_codes(const uint8_t* row, int64_t b, BlockCodes& out) {
  if constexpr (F == Q5_0) {
    const uint8_t* blk = row + 22 * b;
    uint32_t qh;
    std::memcpy(&qh, blk + 2, 4);
    for (int j = 0; j < 16; ++j) {
      out.q[j] = (blk[6 + j] & 0x0F) | (((qh >> j) & 1) << 4);
      out.q[j + 16] = (blk[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    }
  } else if constexpr (F == Q4_K || F == Q5_K) {
    const int64_t size = F == Q4_K ? 144 : 176;
    const uint8_t* sb = row + size * (b / 8);
    const int j = b % 8;
    const uint8_t* qs = sb + (F == Q4_K ? 16 : 48) + 32 * (j / 2);
    for (int l = 0; l < 32; ++l) {
      uint8_t q = j % 2 ? qs[l] >> 4 : qs[l] & 0x0F;
      if (F == Q5_K) q |= ((sb[16 + l] >> j) & 1) << 4;
      out.q[l] = q;
    }
  } else {
    const uint8_t* sb = row + 210 * (b / 8);
    for (int i = 0; i < 32; ++i) {
      const int e = 32 * (b % 8) + i, n = e / 128, g = (e % 128) / 32, l = e % 32;
      const uint8_t ql = sb[64 * n + l + 32 * (g & 1)];
      out.q[i] = (g < 2 ? ql & 0x0F : ql >> 4) | (((sb[128 + 32 * n + l] >> (2 * g)) & 3) << 4);
    }
  }
}

// Tiles [t0, t1) of a GGUF tensor (rows of the file's blocks, `row_bytes` each) in gguf_tiles' layout.
template <int64_t F>
void repack_tiles(const uint8_t* blocks, int64_t rows, int64_t row_bytes, int64_t K, uint8_t* out, int64_t t0,
                  int64_t t1) {
  constexpr int G = blocks_per_group(F), HB = high_bits(F);
  constexpr int64_t BB = block_bytes(F), GB = group_bytes(F);
  const int64_t nb = K / 32, ng = nb / G;
  for (int64_t t = t0; t < t1; ++t) {
    uint8_t* tp = out + t * ng * GB;
    std::memset(tp, 0, ng * GB);
    for (int l = 0; l < TILE_ROWS && TILE_ROWS * t + l < rows; ++l) {
      const uint8_t* row = blocks + (TILE_ROWS * t + l) * row_bytes;
      for (int64_t g = 0; g < ng; ++g) {
        uint8_t* gp = tp + g * GB;
        uint8_t* tail = gp + G * BB;
        for (int j = 0; j < G; ++j) {
          BlockCodes c;
          block_codes<F>(row, g * G + j, c);
          uint8_t* bp = gp + j * BB;
          for (int ch = 0; ch < 4; ++ch)
            for (int k = 0; k < 4; ++k) {
              const uint8_t lo = c.q[8 * ch + k], hi = c.q[8 * ch + 4 + k];
              bp[64 * ch + 4 * l + k] = (lo & 0x0F) | ((hi & 0x0F) << 4);
              if (HB == 1) bp[256 + 4 * l + k] |= (((lo >> 4) & 1) << ch) | (((hi >> 4) & 1) << (4 + ch));
              if (HB == 2) {
                bp[256 + 4 * l + k] |= ((lo >> 4) & 3) << (2 * ch);
                bp[320 + 4 * l + k] |= ((hi >> 4) & 3) << (2 * ch);
              }
            }
        }
        if constexpr (F == Q5_0) {
          std::memcpy(tail + 2 * l, row + 22 * g, 2);
        } else if constexpr (F == Q6_K) {
          const uint8_t* sb = row + 210 * g;
          for (int s = 0; s < 16; ++s) tail[16 * s + l] = sb[192 + s];
          std::memcpy(tail + 256 + 2 * l, sb + 208, 2);
        } else {
          const uint8_t* sb = row + (F == Q4_K ? 144 : 176) * g;
          for (int j = 0; j < 8; ++j) k_scale_min(sb + 4, j, tail + 16 * j + l, tail + 128 + 16 * j + l);
          std::memcpy(tail + 256 + 2 * l, sb, 2);
          std::memcpy(tail + 288 + 2 * l, sb + 2, 2);
        }
      }
    }
  }
}

// f(std::integral_constant<int64_t, F>) for GGUF format fmt (one of Q5_0, Q4_K, Q5_K, Q6_K).
template <class Fn>
auto with_format(int64_t fmt, Fn&& f) {
  switch (fmt) {
    case Q4_K: return f(std::integral_constant<int64_t, Q4_K>{});
    case Q5_K: return f(std::integral_constant<int64_t, Q5_K>{});
    case Q6_K: return f(std::integral_constant<int64_t, Q6_K>{});
    default: return f(std::integral_constant<int64_t, Q5_0>{});
  }
}

}  // namespace

void gguf_repack(int64_t fmt, const uint8_t* blocks, int64_t rows, int64_t row_bytes, int64_t K, uint8_t* out,
                 int64_t t0, int64_t t1) {
  if (!is_gguf_format(fmt)) return;
  with_format(fmt, [&](auto f) { repack_tiles<decltype(f)::value>(blocks, rows, row_bytes, K, out, t0, t1); });
}

int64_t gguf_tile_bytes(int64_t fmt, int64_t K) {
  if (!is_gguf_format(fmt)) return -1;
  return with_format(fmt, [&](auto f) { return K / (f == Q5_0 ? 32 : 256) * group_bytes(f); });
}

void gguf_dot_tiles(int64_t fmt, bool vnni, int R, const uint8_t* p, int64_t count, const Acts& a, const float* bias,
                    float* y, int64_t ldy, const uint8_t* unpacked) {
  if (!is_gguf_format(fmt)) return;
  with_format(fmt, [&](auto f) { dot_rows<decltype(f)::value>(vnni, R, p, count, a, bias, y, ldy, unpacked); });
}

int64_t gguf_unpacked_bytes(int64_t K) { return K / 32 * UNPACKED_BLOCK + K / 256 * UNPACKED_GROUP; }

void gguf_unpack_tile(int64_t fmt, const uint8_t* tp, int64_t K, uint8_t* out) {
  if (!is_gguf_format(fmt)) return;
  with_format(fmt, [&](auto f) { unpack_vnni<decltype(f)::value>(tp, K / 32, out); });
}

void gguf_dequant_tile(int64_t fmt, const uint8_t* tp, int64_t K, float* out, int64_t ldo) {
  if (!is_gguf_format(fmt)) return;
  with_format(fmt, [&](auto f) { dequant_tile<decltype(f)::value>(tp, K, out, ldo); });
}

}  // namespace qtiles
