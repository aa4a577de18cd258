// The quantized products on AMX's int8 tiles (amx_tiles.h): a prompt chunk's rows 16 at a time against one
// weight tile, bit for bit what the AVX-512 VNNI kernels (quant_linear.cpp dot_tiles_vnni, gguf_tiles.cpp
// dot_vnni) compute for each row.
//
// Why it gives the same bits: the VNNI kernels compute, per row and 32-column block (Q6_K: per 16-column
// half), one exact int32 sum of code products for each of a tile's 16 weight rows, and then float steps per
// block or super-block in a fixed order. TDPBSSD / TDPBSUD compute exactly such sums (signed activation codes
// times signed or unsigned weight codes, summed in int32 without saturation) for 16 rows by 16 weight rows at
// once, so one tile product per block (K = 32 bytes: one block's columns, never two blocks summed together)
// gives the same integers. They are stored to a small buffer and read back a row at a time (16 weight rows
// in one 512-bit vector, the VNNI kernels' lane order), and every step after that is the VNNI kernels' own:
// the K-quants' scales and multiples applied in int32 over the super-block (exact, so in any grouping), then
// the same multiplies and fused multiply-adds in the same order, the bias added last.
//
// Operands: A is 16 activation rows' codes of one block (16 rows of 32 bytes, read in place from the call's
// quantized rows, row stride K); B is the block's weight codes in AMX's VNNI layout (8 rows of 64 bytes: row
// k, lane l = weight row l's columns 4k..4k+3), which is the order the tiles already keep their codes in
// (quant_linear.cpp, gguf_tiles.cpp). Each tile's codes are assembled once per call into a per-thread buffer
// (amx_operands), no copy of the weights is kept: the 4-bit and GGUF codes unpacked from their nibbles and
// high bits, and the offsets the VNNI kernels remove in int32 taken out of the codes instead (int8's +128,
// Q5_0's -16: the same integer sums).
//
// Per 16 rows and weight tile, the blocks go in batches (batch_of): a batch's tile products are issued before
// the float steps of the batch before it. (On the Xeon VMs measured, tile and vector work did not overlap:
// their cycles add; docs/cpu_speed.md "AMX int8 tiles".)
#include "amx_tiles.h"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>


namespace qtiles {
namespace {

#define SUDU_AMX \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,amx-tile,amx-int8")))

// Linux's request for a dynamically enabled xstate component (arch/x86/include/uapi/asm/prctl.h), and the
// component number of AMX's tile data.
constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;

// The tile registers' shapes (palette 1): rows and bytes per row of tmm0..tmm7.
//   tmm0..tmm3: C, 16 x 16 int32 (one unit's sums: a 32-block, or a Q6_K 16-column half)
//   tmm4, tmm6: A, 16 rows x 32 codes (one block of 16 activation rows; Q6_K: 16 x 16, a half)
//   tmm5, tmm7: B, 8 rows x 64 bytes (one block of 16 weight rows; Q6_K: 4 x 64, a half)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 32, 64, 32, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 8, 16, 8};
};
TileConfig config_for(int64_t fmt) {
  TileConfig c;
  if (fmt == Q6_K) {
    c.colsb[4] = c.colsb[6] = 16;
    c.rows[5] = c.rows[7] = 4;
  }
  return c;
}
const TileConfig tile_config = config_for(INT8), half_config = config_for(Q6_K);

// Blocks per batch of tile products: a K-quant super-block is one batch (its int32 sums stay in registers
// until its float steps; batches of 2 or 4 blocks were up to 20% slower), the other formats two blocks (their
// sums are read back sooner: gate_proj at 512 rows 1.13x faster than in batches of 8; docs/cpu_speed.md).
constexpr int64_t BATCH = 8;
template <int64_t F>
constexpr int64_t batch_of() { return F == Q4_K || F == Q5_K || F == Q6_K ? BATCH : 2; }
// A batch's sums, per block (Q6_K: per 16-column half) 16 rows x 16 int32 at C's row stride of 64 bytes.
constexpr int64_t SLOT = AMX_ROWS * 16;
using Sums = int32_t[2][2 * BATCH * SLOT];

SUDU_AMX inline __m512i sums_of(const int32_t* s, int i) { return _mm512_load_si512(s + 16 * i); }

// Units [u0, u1) of 16 rows (codes xq, row stride K) against a tile's B operands (codes): a unit is a 32-block
// (Q6_K: a 16-column half, W = 16 columns), at columns W u of the rows and 16 W u bytes into the operands;
// unit u's sums into out + SLOT * (u - u0). Four C tiles in turn, so that a tile's product need not wait
// for the store of the one before it; A and B in two pairs. int8 and Q5_0 multiply signed codes by signed
// codes, the others by unsigned codes.
template <int64_t F>
SUDU_AMX void products(const int8_t* xq, int64_t K, const uint8_t* codes, int64_t u0, int64_t u1, int32_t* out) {
  constexpr int64_t W = F == Q6_K ? 16 : 32;
#define SUDU_UNIT(c, ta, tb, u)                                  \
  _tile_zero(c);                                                 \
  _tile_loadd(ta, xq + W * (u), K);                              \
  _tile_loadd(tb, codes + 16 * W * (u), 64);                     \
  if constexpr (F == INT8 || F == Q5_0) _tile_dpbssd(c, ta, tb); \
  else _tile_dpbsud(c, ta, tb);                                  \
  _tile_stored(c, out + SLOT * ((u) - u0), 64);
  int64_t u = u0;
  for (; u + 4 <= u1; u += 4) {
    SUDU_UNIT(0, 4, 5, u)
    SUDU_UNIT(1, 6, 7, u + 1)
    SUDU_UNIT(2, 4, 5, u + 2)
    SUDU_UNIT(3, 6, 7, u + 3)
  }
  if (u < u1) { SUDU_UNIT(0, 4, 5, u) }
  if (u + 1 < u1) { SUDU_UNIT(1, 6, 7, u + 1) }
  if (u + 2 < u1) { SUDU_UNIT(2, 4, 5, u + 2) }
#undef SUDU_UNIT
}

// One 32-block's float steps for 16 rows (sb: the block's sums), dot_tiles_vnni's and dot_vnni<Q5_0>'s: int8
// and Q5_0 (their offsets already out of the codes, so the sums are the VNNI kernels' S), int4 (with its
// min term).
template <int64_t F>
SUDU_AMX inline void block_steps(const uint8_t* tp, int64_t b, const int32_t* sb, const Acts& a, __m512* acc) {
  if constexpr (F == Q5_0) {
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tp + b * group_bytes(Q5_0) + block_bytes(Q5_0))));
#pragma GCC unroll 16
    for (int i = 0; i < AMX_ROWS; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums_of(sb, i)), _mm512_mul_ps(dv, _mm512_set1_ps(a.sx16[16 * b + i])), acc[i]);
  } else {
    const uint8_t* at = F == INT4 ? tp + b * Q4_BLOCK_BYTES + 256 : q8_scales(tp, b);
    const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
    const __m512 mv = F == INT4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32))) : sv;
#pragma GCC unroll 16
    for (int i = 0; i < AMX_ROWS; ++i) {
      const __m512 d = _mm512_mul_ps(_mm512_set1_ps(a.sx16[16 * b + i]), sv);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums_of(sb, i)), d, acc[i]);
      if constexpr (F == INT4) acc[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.xsum16[16 * b + i]), acc[i]);
    }
  }
}

// A K-quant super-block g's steps for 16 rows (s: its 8 blocks' sums), dot_vnni's: the block sums' scales
// and multiples applied in int32 (sc * f as one factor: the same product modulo 2^32), then the offset or
// min term (the scale pairs from the unpacked tile, codes) and the float steps.
template <int64_t F>
SUDU_AMX inline void group_steps(const uint8_t* tp, const uint8_t* codes, int64_t g, const int32_t* s, const Acts& a,
                                 __m512* acc) {
  constexpr int G = blocks_per_group(F);
  const int64_t nb = a.nb;
  const uint8_t* tail = tp + g * group_bytes(F) + G * block_bytes(F);
  __m512i iS[AMX_ROWS];
#pragma GCC unroll 16
  for (int i = 0; i < AMX_ROWS; ++i) iS[i] = _mm512_setzero_si512();
  for (int j = 0; j < G; ++j) {
    const int64_t b = g * G + j;
    // madd of a 32-bit lane (scale, 0) with (f, 0): the exact scale * f
    if constexpr (F == Q6_K) {
      const __m512i sa = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tail + 32 * j)));
      const __m512i sb = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tail + 32 * j + 16)));
#pragma GCC unroll 16
      for (int i = 0; i < AMX_ROWS; ++i) {
        const __m512i f = _mm512_set1_epi32(a.kf16[16 * b + i]);
        iS[i] = _mm512_add_epi32(iS[i], _mm512_add_epi32(_mm512_mullo_epi32(sums_of(s + SLOT * 2 * j, i), _mm512_madd_epi16(sa, f)),
                                                         _mm512_mullo_epi32(sums_of(s + SLOT * (2 * j + 1), i), _mm512_madd_epi16(sb, f))));
      }
    } else {
      const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tail + 16 * j)));
#pragma GCC unroll 16
      for (int i = 0; i < AMX_ROWS; ++i)
        iS[i] = _mm512_add_epi32(iS[i], _mm512_mullo_epi32(sums_of(s + SLOT * j, i), _mm512_madd_epi16(sc, _mm512_set1_epi32(a.kf16[16 * b + i]))));
    }
  }
  const uint8_t* up = codes + nb * UNPACKED_BLOCK + g * UNPACKED_GROUP;
  const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail + 256)));
  if constexpr (F == Q6_K) {
#pragma GCC unroll 16
    for (int i = 0; i < AMX_ROWS; ++i) {
      __m512i off = _mm512_setzero_si512();
      for (int j = 0; j < G; ++j)
        off = _mm512_add_epi32(off, _mm512_madd_epi16(_mm512_loadu_si512(up + 64 * j), _mm512_set1_epi32(a.k16pair[i * nb + g * G + j])));
      const __m512 kd = _mm512_mul_ps(dv, _mm512_set1_ps(a.ksx[i * (nb / 8) + g]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(iS[i], _mm512_slli_epi32(off, 5))), kd, acc[i]);
    }
  } else {
    const __m512 dminv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tail + 288)));
#pragma GCC unroll 16
    for (int i = 0; i < AMX_ROWS; ++i) {
      __m512i mins = _mm512_setzero_si512();
      for (int j = 0; j < G; j += 2)
        mins = _mm512_add_epi32(mins, _mm512_madd_epi16(_mm512_loadu_si512(up + 64 * (j / 2)), _mm512_set1_epi32(a.kpair[i * (nb / 2) + (g * G + j) / 2])));
      const __m512 kx = _mm512_set1_ps(a.ksx[i * (nb / 8) + g]);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iS[i]), _mm512_mul_ps(dv, kx), acc[i]);
      acc[i] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), _mm512_mul_ps(dminv, kx), acc[i]);
    }
  }
}

// 16 rows against one tile: batch k + 1's tile products, then batch k's steps.
template <int64_t F>
SUDU_AMX void rows16(const uint8_t* tp, const uint8_t* codes, const Acts& a, const float* bias, float* y, int64_t ldy,
                     bool bypass, Sums& s) {
  constexpr bool KQ = F == Q4_K || F == Q5_K || F == Q6_K;
  constexpr int64_t NB = batch_of<F>();
  const int64_t nb = a.nb, K = a.K, batches = (nb + NB - 1) / NB;
  const int8_t* xq = KQ ? a.kq : a.xq;
  __m512 acc[AMX_ROWS];
#pragma GCC unroll 16
  for (int i = 0; i < AMX_ROWS; ++i) acc[i] = _mm512_setzero_ps();
  constexpr int64_t U = F == Q6_K ? 2 : 1;  // units per block
  products<F>(xq, K, codes, 0, U * std::min(NB, nb), s[0]);
  for (int64_t k = 0; k < batches; ++k) {
    const int64_t b0 = k * NB, n = std::min(NB, nb - b0);
    if (k + 1 < batches) products<F>(xq, K, codes, U * (b0 + NB), U * std::min(nb, b0 + 2 * NB), s[(k + 1) % 2]);
    const int32_t* sk = s[k % 2];
    if constexpr (KQ) {
      group_steps<F>(tp, codes, k, sk, a, acc);
    } else {
      for (int64_t j = 0; j < n; ++j) block_steps<F>(tp, b0 + j, sk + SLOT * j, a, acc);
    }
  }
  const __m512 bv = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int i = 0; i < AMX_ROWS; ++i) store_out(y + i * ldy, _mm512_add_ps(acc[i], bv), bypass);
}

// int8: the codes without their +128 (signed); int4: each block's 4 chunks of nibbles as lo, hi per chunk
// (gguf_unpack_tile's order, unsigned); Q5_0: gguf_unpack_tile's codes less 16 (signed).
SUDU_AMX void operands_of(int64_t fmt, const uint8_t* tp, int64_t nb, uint8_t* out) {
  if (fmt == INT8) {
    const __m512i flip = _mm512_set1_epi8(char(0x80));
    for (int64_t b = 0; b < nb; ++b)
      for (int c = 0; c < 8; ++c)
        _mm512_storeu_si512(out + b * UNPACKED_BLOCK + 64 * c, _mm512_xor_si512(_mm512_loadu_si512(q8_codes(tp, b) + 64 * c), flip));
  } else if (fmt == INT4) {
    for (int64_t b = 0; b < nb; ++b)
      for (int c = 0; c < 4; ++c) {
        __m512i lo, hi;
        nibbles(_mm512_loadu_si512(tp + b * Q4_BLOCK_BYTES + 64 * c), lo, hi);
        _mm512_storeu_si512(out + b * UNPACKED_BLOCK + 128 * c, lo);
        _mm512_storeu_si512(out + b * UNPACKED_BLOCK + 128 * c + 64, hi);
      }
  } else {
    gguf_unpack_tile(fmt, tp, 32 * nb, out);
    if (fmt == Q5_0) {
      const __m512i sixteen = _mm512_set1_epi8(16);
      for (int64_t o = 0; o < nb * UNPACKED_BLOCK; o += 64)
        _mm512_storeu_si512(out + o, _mm512_sub_epi8(_mm512_loadu_si512(out + o), sixteen));
    }
  }
}

SUDU_AMX void dot_tile(int64_t fmt, const uint8_t* tp, const uint8_t* codes, int64_t rows, const ActRows& x,
                       const float* bias, float* y, int64_t ldy, bool bypass) {
  thread_local Sums s alignas(64);
  for (int64_t m = 0; m < rows; m += AMX_ROWS) {
    const Acts a = x.at(m);
    float* ym = y + m * ldy;
    switch (fmt) {
      case INT8: rows16<INT8>(tp, codes, a, bias, ym, ldy, bypass, s); break;
      case INT4: rows16<INT4>(tp, codes, a, bias, ym, ldy, bypass, s); break;
      case Q5_0: rows16<Q5_0>(tp, codes, a, bias, ym, ldy, bypass, s); break;
      case Q4_K: rows16<Q4_K>(tp, codes, a, bias, ym, ldy, bypass, s); break;
      case Q5_K: rows16<Q5_K>(tp, codes, a, bias, ym, ldy, bypass, s); break;
      default: rows16<Q6_K>(tp, codes, a, bias, ym, ldy, bypass, s); break;
    }
  }
}

bool request_amx() {
  __builtin_cpu_init();
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool tile = edx & (1u << 24), int8 = edx & (1u << 25);
  const bool vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                    __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  if (!tile || !int8 || !vnni) return false;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

}  // namespace

bool amx_granted() {
  static const bool granted = request_amx();
  return granted;
}

SUDU_AMX void amx_configure(int64_t fmt) { _tile_loadconfig(fmt == Q6_K ? &half_config : &tile_config); }

SUDU_AMX void amx_release() { _tile_release(); }

int64_t amx_operand_bytes(int64_t fmt, int64_t K) {
  return is_gguf_format(fmt) ? gguf_unpacked_bytes(K) : K / 32 * UNPACKED_BLOCK;
}

void amx_operands(int64_t fmt, const uint8_t* tp, int64_t K, uint8_t* buf) { operands_of(fmt, tp, K / 32, buf); }

void amx_dot_tile(int64_t fmt, const uint8_t* tp, const uint8_t* codes, int64_t rows, const ActRows& x,
                  const float* bias, float* y, int64_t ldy, bool bypass) {
  dot_tile(fmt, tp, codes, rows, x, bias, y, ldy, bypass);
}

}  // namespace qtiles
