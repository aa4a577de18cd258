// Weight-only quantized linear layers for CPUs with AVX2 + FMA + F16C.
//
// y[M, N] = x[M, K] @ dequant(W)[N, K]^T (+ bias), x and y float32.
// Formats (K a multiple of 32), per 32-block of a row:
//   int8: w = s * q, q in [-127, 127]
//   int4: w = s * q + m, q in [0, 15]
// both stored in tiles of 16 rows (the tiles section below; layers/linear.py pack builds them from the
// row layout).
// Scales and mins are float16 (half the bytes of float32, and F16C converts them for free).
//
// Why this kernel: decode is bound by reading weights. PyTorch's packed int8/int4 kernels read the
// weights once per activation row, so a batch of 8 costs 8x. Here each weight row is read from memory
// once per call and multiplied against every activation row while it sits in L1.
//
// Activations are rounded to int8 in blocks of 32 (a float scale per block, as llama.cpp's Q8 activations),
// and each (weight block, activation block) pair is an integer dot product (AVX2 maddubs + madd, or
// AVX-512 VNNI vpdpbusd where the CPU has it: the same integers) followed by float multiply-adds with
// the two blocks' scales (16 rows' blocks per vector operation, see dot_tiles_vnni). That is far
// less arithmetic than dequantizing to float, so one-row decode is bound by memory rather than compute,
// and every row, at every row count and on either instruction set, goes through the same float
// operations in the same order: a row's result is bit for bit independent of the batch it shares the
// call with (what makes greedy speculative decoding identical to plain decoding on quantized weights,
// and batch-1 output identical to batched output).
//
// This file holds the products (the tile kernels, the weights' layouts, the calls); the activation rows'
// quantization is act_quant.cpp's, the split of a call's tiles over the threads work_shares.h's, and the
// switches that compare routes (KernelOptions) are declared in kernels.h.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "act_quant.h"
#include "amx_tiles.h"
#include "kernels.h"
#include "quant_tiles.h"
#include "simd.h"
#include "work_shares.h"

namespace {

using namespace qtiles;

// ---- Tiles of 16 weight rows, one row per 32-bit lane ----
// Both formats are stored as the kernels read them (layers/linear.py pack builds the tiles from the row
// layout): rows in tiles of 16, the last one zero-padded. An integer dot-product step
// (vpdpbusd: 4 u8 x s8 products summed per int32 lane) takes 4 columns of 16 rows against 4 activation
// codes broadcast to every lane, so after a block's 8 steps each lane holds its row's integer sum S over
// the block, and the float work is per 16 rows, not per row:
//   acc = fma(float(S), sx * s, acc)   (int4 then: acc = fma(m, xsum, acc))   (16 lanes = 16 rows)
// with sx the activation block's scale and xsum = sx * sum(codes) (the min term sum(m * x)), and
// y = acc + bias, written with no horizontal sum. Rows laid out one after another needed that float work
// once per row and block (int4: per 4 blocks, with the activation codes reordered to meet the nibbles), and
// were slower at 1-8 rows (benchmarks/linear_kernels.py; figures in docs/cpu_speed.md). The AVX2 kernels compute each tile as two
// 8-lane halves: the same integers (maddubs + madd), the same float operations in the same order, bit for
// bit the same rows; and a row's result is independent of the other rows and tiles it shares a call with.
//
// int4, per tile and 32-block, 320 bytes: 4 chunks of 64 bytes, chunk c covering the block's columns
//   8c..8c+7: lane l (bytes 4l..4l+3) holds row l's columns 8c..8c+3 in its low nibbles and 8c+4..8c+7 in
//   its high ones; then the 16 rows' float16 scales (32 bytes) and float16 mins (32 bytes).
// int8, per tile and pair of 32-blocks, 1088 bytes (17 lines): each block's 512 code bytes (8 chunks of 64:
//   chunk c, lane l = row l's columns 4c..4c+3, stored as q + 128 in [1, 255]: vpdpbusd's unsigned
//   operand), then the two blocks' 16 float16 scales (32 bytes each); an odd last block is paired with a
//   zero one. So the codes stay 64-byte aligned and the tile is one stream (scales kept after all of a
//   tile's codes streamed well below int4 tiles: docs/cpu_speed.md). vpdpbusd then sums
//   (q + 128) * x; starting the sum at -128 * sum(x) leaves exactly sum(q * x), the integer the AVX2
//   kernel computes.
// (Q4_BLOCK_BYTES, Q8_PAIR_BYTES, q8_codes and q8_scales: quant_tiles.h)

// R activation rows against `count` consecutive tiles from p; tile t's outputs go to y[i * ldy + 16 * t + l]
// (padding rows included: the caller's buffer has room). One tile at a time keeps each thread reading one
// stream of weights: measured fastest where the weights come from memory, against 2 and 4 tiles per round
// (docs/cpu_speed.md, the tile kernels).
// CH (int8): dependency chains per block (below); 4 for 1-2 rows, 2 from 3 (registers)
template <bool INT4, int R, int CH>
SUDU_VNNI void dot_tiles_vnni(const uint8_t* p, int64_t count, const Acts& a, const float* bias, float* y,
                              int64_t ldy) {
  const int64_t nb = a.nb, tile_bytes = tile_bytes_of(INT4, nb);
  if (count > 1) prefetch_start(p);
  for (int64_t t = 0; t < count; ++t) {
    const uint8_t* tp = p + t * tile_bytes;
    __m512 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      if constexpr (INT4) {
        __m512i S[R];
        for (int i = 0; i < R; ++i) S[i] = _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
          const uint8_t* at = tp + b * Q4_BLOCK_BYTES + 64 * c;
          _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH_BYTES), PREFETCH_HINT);
          const __m512i raw = _mm512_loadu_si512(at);
          __m512i lo, hi;
          nibbles(raw, lo, hi);
          for (int i = 0; i < R; ++i) {
            const __m512i xl = _mm512_set1_epi32(a.x4(i, 32 * b + 8 * c)), xh = _mm512_set1_epi32(a.x4(i, 32 * b + 8 * c + 4));
            S[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(S[i], lo, xl), hi, xh);
          }
        }
        const uint8_t* at = tp + b * Q4_BLOCK_BYTES + 256;
        _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH_BYTES), PREFETCH_HINT);
        const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
        const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32)));
        for (int i = 0; i < R; ++i) {
          const __m512 d = _mm512_mul_ps(_mm512_set1_ps(a.sx[i * nb + b]), sv);
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[i]), d, acc[i]);
          acc[i] = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.xsum[i * nb + b]), acc[i]);
        }
      } else {
        // the 8 chunks in CH independent dependency chains, added in integers at the end (more chains
        // streamed faster, four fastest at one row: docs/cpu_speed.md)
        __m512i S[CH][R];
        for (int i = 0; i < R; ++i) {
          S[0][i] = _mm512_set1_epi32(-128 * a.isum[i * nb + b]);
          for (int h = 1; h < CH; ++h) S[h][i] = _mm512_setzero_si512();
        }
        const uint8_t* codes = q8_codes(tp, b);
        for (int c = 0; c < 8; c += CH) {
          for (int h = 0; h < CH; ++h) {
            _mm_prefetch(reinterpret_cast<const char*>(codes + 64 * (c + h) + PREFETCH_BYTES), PREFETCH_HINT);
            const __m512i qv = _mm512_loadu_si512(codes + 64 * (c + h));
            for (int i = 0; i < R; ++i) S[h][i] = _mm512_dpbusd_epi32(S[h][i], qv, _mm512_set1_epi32(a.x4(i, 32 * b + 4 * (c + h))));
          }
        }
        for (int h = 1; h < CH; ++h)
          for (int i = 0; i < R; ++i) S[0][i] = _mm512_add_epi32(S[0][i], S[h][i]);
        const uint8_t* at = q8_scales(tp, b);
        if (b % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH_BYTES), PREFETCH_HINT);
        const __m512 sv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
        for (int i = 0; i < R; ++i) {
          const __m512 d = _mm512_mul_ps(_mm512_set1_ps(a.sx[i * nb + b]), sv);
          acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S[0][i]), d, acc[i]);
        }
      }
    }
    const __m512 bv = bias ? _mm512_loadu_ps(bias + TILE_ROWS * t) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i) store_out(y + i * ldy + TILE_ROWS * t, _mm512_add_ps(acc[i], bv), a.bypass);
  }
}

// The same on AVX2, one tile at a time, each tile as two 8-lane halves.
template <bool INT4, int R>
void dot_tiles(const uint8_t* p, int64_t count, const Acts& a, const float* bias, float* y, int64_t ldy) {
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(char(0x80));
  const int64_t nb = a.nb, tile_bytes = tile_bytes_of(INT4, nb);
  // sum over 4 columns of q * x per lane: q unsigned (int4, [0, 15]) or signed with its sign moved onto x
  // (int8, |q|, |x| <= 127); neither saturates maddubs' int16 pairs
  auto dot4 = [&](__m256i q, int x4) {
    const __m256i xv = _mm256_set1_epi32(x4);
    if (INT4) return _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), ones);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(xv, q)), ones);
  };
  for (int64_t t = 0; t < count; ++t) {
    const uint8_t* tp = p + t * tile_bytes;
    for (int h = 0; h < 2; ++h) {  // rows 0-7, then 8-15
      __m256 acc[R];
      for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        __m256i S[R];
        for (int i = 0; i < R; ++i) S[i] = _mm256_setzero_si256();
        for (int c = 0; c < (INT4 ? 4 : 8); ++c) {
          const uint8_t* at = (INT4 ? tp + b * Q4_BLOCK_BYTES : q8_codes(tp, b)) + 64 * c + 32 * h;
          _mm_prefetch(reinterpret_cast<const char*>(at + PREFETCH_BYTES), PREFETCH_HINT);
          const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
          if (INT4) {
            // int16 sums over the whole block, widened once below: 8 pairs of at most 2 * 15 * 127 per lane
            __m256i lo, hi;
            nibbles(raw, lo, hi);
            for (int i = 0; i < R; ++i) {
              const __m256i m = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(a.x4(i, 32 * b + 8 * c))),
                                                 _mm256_maddubs_epi16(hi, _mm256_set1_epi32(a.x4(i, 32 * b + 8 * c + 4))));
              S[i] = c == 0 ? m : _mm256_add_epi16(S[i], m);
            }
          } else {
            const __m256i q = _mm256_xor_si256(raw, flip);
            for (int i = 0; i < R; ++i) S[i] = _mm256_add_epi32(S[i], dot4(q, a.x4(i, 32 * b + 4 * c)));
          }
        }
        if (INT4)
          for (int i = 0; i < R; ++i) S[i] = _mm256_madd_epi16(S[i], ones);
        const uint8_t* sat = (INT4 ? tp + b * Q4_BLOCK_BYTES + 256 : q8_scales(tp, b)) + 16 * h;
        const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sat)));
        const __m256 mv = INT4 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sat + 32))) : sv;
        for (int i = 0; i < R; ++i) {
          const __m256 d = _mm256_mul_ps(_mm256_set1_ps(a.sx[i * nb + b]), sv);
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[i]), d, acc[i]);
          if (INT4) acc[i] = _mm256_fmadd_ps(mv, _mm256_set1_ps(a.xsum[i * nb + b]), acc[i]);
        }
      }
      const int64_t o = TILE_ROWS * t + 8 * h;
      const __m256 bv = bias ? _mm256_loadu_ps(bias + o) : _mm256_setzero_ps();
      for (int i = 0; i < R; ++i) _mm256_storeu_ps(y + i * ldy + o, _mm256_add_ps(acc[i], bv));
    }
  }
}

// AVX2 kernels take MR activation rows per call, VNNI ones MR_VNNI (each row's accumulators, a float one
// and 1-4 integer ones, stay in registers).
constexpr int MR = 4, MR_VNNI = 8;

// The options the calls read (kernels.h KernelOptions): the defaults, the CPU's best path.
KernelOptions default_options() {
  KernelOptions o;
  o.vnni = cpu_has_vnni();
  o.attention512 = cpu_has_avx512();
  o.amx = cpu_has_amx();
  return o;
}
KernelOptions options = default_options();

// A weight tensor as the kernels take it: either packed tiles of one format (uint8 [tiles, K / 32, 320] int4,
// [tiles, ceil(K / 64), 1088] int8), or a segmented tensor (uint8 [bytes], layers/gguf_native.py): a header of
// SEGMENT_HEADER int64 (magic, K, number of segments, then per segment its format, tiles and byte offset)
// followed by the segments' tiles, each of its own format (a fused q/k/v whose parts the file stores in
// different formats). Segments follow each other in output rows, each a whole number of tiles.
constexpr int64_t SEGMENTED_MAGIC = 0x3130515544555353LL, SEGMENT_HEADER = 16, MAX_SEGMENTS = 4;

struct Range {
  int64_t fmt, ntiles, tile_bytes;
  const uint8_t* p;
};
struct Weights {
  int64_t K = 0, ntiles = 0;
  int n = 0;
  Range r[MAX_SEGMENTS];
};

inline int64_t tile_bytes_for(int64_t fmt, int64_t K) {
  if (fmt == INT4 || fmt == INT8) return tile_bytes_of(fmt == INT4, K / 32);
  return gguf_tile_bytes(fmt, K);
}

// q's ranges, checked against K (K < 0: K as q defines it).
Weights weights_of(const torch::Tensor& q, int64_t K) {
  TORCH_CHECK(q.scalar_type() == torch::kByte && q.is_contiguous(), "weights must be contiguous uint8 tiles");
  Weights w;
  const uint8_t* base = q.data_ptr<uint8_t>();
  if (q.dim() == 3) {
    TORCH_CHECK(q.size(2) == Q4_BLOCK_BYTES || q.size(2) == Q8_PAIR_BYTES,
                "weights must be packed tiles uint8 [tiles, K / 32, 320] (int4) or [tiles, ceil(K / 64), 1088] (int8)");
    const bool int4 = q.size(2) == Q4_BLOCK_BYTES;
    TORCH_CHECK(K < 0 || (K % 32 == 0 && q.size(1) == (int4 ? K / 32 : (K / 32 + 1) / 2)), "weight shape does not match x");
    w.K = K >= 0 ? K : q.size(1) * (int4 ? 32 : 64);
    w.n = 1;
    w.r[0] = Range{int4 ? INT4 : INT8, q.size(0), q.size(1) * q.size(2), base};
    w.ntiles = q.size(0);
    return w;
  }
  TORCH_CHECK(q.dim() == 1 && q.numel() >= 8 * SEGMENT_HEADER, "weights must be packed tiles or a segmented tensor");
  int64_t h[SEGMENT_HEADER];
  std::memcpy(h, base, sizeof(h));
  TORCH_CHECK(h[0] == SEGMENTED_MAGIC && h[2] >= 1 && h[2] <= MAX_SEGMENTS && h[1] > 0 && h[1] % 32 == 0,
              "not a segmented weight tensor");
  TORCH_CHECK(K < 0 || K == h[1], "weight shape does not match x");
  w.K = h[1];
  w.n = static_cast<int>(h[2]);
  for (int i = 0; i < w.n; ++i) {
    const int64_t fmt = h[3 + 3 * i], nt = h[4 + 3 * i], off = h[5 + 3 * i];
    TORCH_CHECK(fmt >= INT8 && fmt <= Q6_K && nt > 0, "segmented weights: bad segment");
    const int64_t tb = tile_bytes_for(fmt, w.K);
    TORCH_CHECK(tb > 0 && (is_gguf_format(fmt) ? w.K % (fmt == Q5_0 ? 32 : 256) == 0 : true) && off >= 8 * SEGMENT_HEADER &&
                off + nt * tb <= q.numel(), "segmented weights: a segment does not fit its tensor");
    w.r[i] = Range{fmt, nt, tb, base + off};
    w.ntiles += nt;
  }
  return w;
}

// One tile range of a call: its activation rows (quantized once per call: the first range's buffers, which
// the other ranges of a segmented tensor share), its tiles, bias (padded to whole tiles) and outputs.
struct Tiles {
  int64_t fmt, K, nb, ntiles, tile_bytes, ldy, first;  // first: its tiles' offset in the call's tile range
  const uint8_t* p;
  const float* bias;
  float* y;  // [M, ldy], this range's first column
  const ActRows* x;  // the first job's rows
  // outputs into a thread's scratch rows that it reads right after (qlinear_silu): ordinary stores, never
  // past the caches
  bool scratch = false;
};
struct Job : Tiles {
  ActRows rows;
  std::vector<float> padded;
};

// Whether a call of M rows takes AMX's int8 tiles (for its first M / 16 * 16 rows).
bool uses_amx(int64_t M) { return options.vnni && options.amx && M >= options.amx_min_rows; }

// Tiles [t0, t1) of one job against its M activation rows. Up to MR_VNNI (AVX2: MR) rows, the tiles go
// through one kernel call; with more, each tile meets every row chunk while it sits in L1/L2 (a GGUF tile on
// the VNNI path, from unpack_min_rows rows: its codes assembled once, into a per-thread buffer).
void run_tiles(const Tiles& j, int64_t M, int64_t t0, int64_t t1) {
  const int64_t ldy = j.ldy;
  const bool vnni = options.vnni;
  const bool bypass = vnni && M >= options.bypass_min_rows && !j.scratch;  // whole 64-byte lines per store
  const bool once = vnni && is_gguf_format(j.fmt) && M >= options.unpack_min_rows;
  // AMX tiles take the first M16 rows, the VNNI kernels the rest
  const bool amx = uses_amx(M);
  const int64_t M16 = amx ? M / AMX_ROWS * AMX_ROWS : 0;
  // tiles [t, t + count) against rows [m0, M); unpacked: tile t's codes from gguf_unpack_tile (count 1)
  auto run = [&](int64_t t, int64_t count, const uint8_t* unpacked, int64_t m0) {
    auto chunk = [&](auto r, int64_t mr) {
      constexpr int R = decltype(r)::value;
      const int64_t m = m0 + mr;
      const uint8_t* tp = j.p + t * j.tile_bytes;
      Acts a = j.x->at(m);
      a.stream = m == 0 && !unpacked;  // unpacking read the tile already
      a.bypass = bypass;
      const float* b = j.bias ? j.bias + TILE_ROWS * t : nullptr;
      float* out = j.y + m * ldy + TILE_ROWS * t;
      if (j.fmt == INT4) {
        if (!vnni) dot_tiles<true, R>(tp, count, a, b, out, ldy);
        else dot_tiles_vnni<true, R, R <= 2 ? 4 : 2>(tp, count, a, b, out, ldy);
      } else if (j.fmt == INT8) {
        if (!vnni) dot_tiles<false, R>(tp, count, a, b, out, ldy);
        else dot_tiles_vnni<false, R, R <= 2 ? 4 : 2>(tp, count, a, b, out, ldy);
      } else {
        gguf_dot_tiles(j.fmt, vnni, R, tp, count, a, b, out, ldy, unpacked);
      }
    };
    if (vnni)
      row_chunks<MR_VNNI>(M - m0, chunk);
    else
      row_chunks<MR>(M - m0, chunk);
  };
  if (M <= (vnni ? MR_VNNI : MR)) {
    run(t0, t1 - t0, nullptr, 0);
    return;
  }
  thread_local Aligned<uint8_t> unpacked;  // tile loads of rows that straddle cache lines run several times slower
  if (amx) {
    // each tile's codes as AMX operands once (GGUF: the layout the VNNI kernels read too), then its rows
    amx_configure(j.fmt);
    unpacked.resize(amx_operand_bytes(j.fmt, j.K));
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* tp = j.p + t * j.tile_bytes;
      amx_operands(j.fmt, tp, j.K, unpacked.data());
      amx_dot_tile(j.fmt, tp, unpacked.data(), M16, *j.x, j.bias ? j.bias + TILE_ROWS * t : nullptr,
                   j.y + TILE_ROWS * t, ldy, bypass);
      if (M16 < M) run(t, 1, is_k_quant(j.fmt) ? unpacked.data() : nullptr, M16);
    }
    amx_release();
    if (bypass) _mm_sfence();
    return;
  }
  if (once) unpacked.resize(gguf_unpacked_bytes(j.K));
  for (int64_t t = t0; t < t1; ++t) {
    // the tile's codes assembled once for all the row chunks (the same sums and float steps)
    if (once) gguf_unpack_tile(j.fmt, j.p + t * j.tile_bytes, j.K, unpacked.data());
    run(t, 1, once ? unpacked.data() : nullptr, 0);
  }
  if (bypass) _mm_sfence();  // the non-temporal stores visible before the join
}

int64_t number_jobs(std::vector<Job>& jobs, size_t n) {
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    jobs[i].first = total;
    total += jobs[i].ntiles;
  }
  return total;
}

// f(job, a, b) for each job's part [a, b) (its own tile indices) of the call's tiles [t0, t1).
template <typename F>
void each_range(const std::vector<Job>& jobs, size_t n, int64_t t0, int64_t t1, F&& f) {
  for (size_t i = 0; i < n; ++i) {
    const Job& j = jobs[i];
    const int64_t a = std::max(t0, j.first), b = std::min(t1, j.first + j.ntiles);
    if (a < b) f(j, a - j.first, b - j.first);
  }
}

void run_jobs(std::vector<Job>& jobs, size_t n, int64_t M) {
  const int64_t total = number_jobs(jobs, n);
  run_shares(total, options.contiguous_shares, [&](int64_t t0, int64_t t1) {
    each_range(jobs, n, t0, t1, [&](const Job& j, int64_t a, int64_t b) { run_tiles(j, M, a, b); });
  });
}

// qlinear_silu's work: jobs over a fused gate | up weight of 2P tiles (gate's rows, then up's). Pair p is
// gate tile p and up tile P + p; a thread's chunk of pairs [a, b) computes gate's tiles and up's for all M
// rows into its scratch rows, then silu(gate) * up into out's columns 16a..16b (row stride 16P). With a few
// rows (decode), each stream's tiles of the chunk go through the kernels in one call, as qlinear's would;
// with more, a pair at a time, so the scratch rows stay in cache.
void run_pairs(std::vector<Job>& jobs, size_t n, int64_t M, int64_t P, float* out) {
  number_jobs(jobs, n);
  // tiles [t, t + count) into y (row stride ldy), over the job ranges they span
  auto run_span = [&](int64_t t, int64_t count, float* y, int64_t ldy) {
    each_range(jobs, n, t, t + count, [&](const Job& j, int64_t a, int64_t b) {
      Tiles v = j;  // from its tile a on, the outputs from column 16 (first + a - t)
      v.p += a * j.tile_bytes;
      if (v.bias) v.bias += TILE_ROWS * a;
      v.y = y + TILE_ROWS * (j.first + a - t);
      v.ldy = ldy;
      v.scratch = true;
      run_tiles(v, M, 0, b - a);
    });
  };
  run_shares(P, options.contiguous_shares, [&](int64_t p0, int64_t p1) {
    thread_local std::vector<float> scratch;
    const int64_t step = M <= MR_VNNI ? p1 - p0 : 1;
    for (int64_t a = p0; a < p1; a += step) {
      const int64_t count = std::min(p1, a + step) - a, w = TILE_ROWS * count;
      scratch.resize(2 * M * w);
      float *g = scratch.data(), *u = g + M * w;
      run_span(a, count, g, w);
      run_span(P + a, count, u, w);
      for (int64_t m = 0; m < M; ++m) {
        float* o = out + m * P * TILE_ROWS + TILE_ROWS * a;
        for (int64_t c = 0; c < w; c += 8)
          _mm256_storeu_ps(o + c, silu_mul8(_mm256_loadu_ps(g + m * w + c), _mm256_loadu_ps(u + m * w + c)));
      }
    }
  });
}


// One tile's 16 rows (K = 32 * nb columns) as float32, w = s * q + m, into out (row stride ldo). Per chunk and
// 8 rows: the low and high nibbles of a lane, interleaved by dword (unpacklo / unpackhi), are that row's 8
// consecutive columns.
inline void dequant_int4_tile(const uint8_t* tp, int64_t nb, float* out, int64_t ldo) {
  // the rows of the two unpacks' 64-bit elements: lo gives (0, 1 | 4, 5), hi (2, 3 | 6, 7)
  static const int rows_of[2][4] = {{0, 1, 4, 5}, {2, 3, 6, 7}};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = tp + b * Q4_BLOCK_BYTES;
    for (int h = 0; h < 2; ++h) {
      const __m256 sv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 256 + 16 * h)));
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 288 + 16 * h)));
      alignas(32) float s8[8], m8[8];
      _mm256_store_ps(s8, sv);
      _mm256_store_ps(m8, mv);
      for (int c = 0; c < 4; ++c) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * c + 32 * h));
        __m256i lo, hi;
            nibbles(raw, lo, hi);
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

// One int8 tile's 16 rows as float32, w = s * q, into out (row stride ldo): per block and 8 rows, the 8
// chunks' dwords (chunk c, lane l: row l's columns 4c..4c+3) transposed 8 x 8, so that each vector holds
// one row's 32 codes in column order.
inline void dequant_int8_tile(const uint8_t* tp, int64_t nb, float* out, int64_t ldo) {
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    for (int h = 0; h < 2; ++h) {
      __m256i r[8], t[8], u[8];
      for (int c = 0; c < 8; ++c)
        r[c] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8_codes(tp, b) + 64 * c + 32 * h)), flip);
      for (int k = 0; k < 4; ++k) {
        t[2 * k] = _mm256_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
        t[2 * k + 1] = _mm256_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
      }
      for (int k = 0; k < 2; ++k) {
        u[4 * k + 0] = _mm256_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 1] = _mm256_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
        u[4 * k + 2] = _mm256_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
        u[4 * k + 3] = _mm256_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
      }
      alignas(32) float s8[8];
      _mm256_store_ps(s8, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q8_scales(tp, b) + 16 * h))));
      for (int l = 0; l < 8; ++l) {  // row l: u[l % 4] (rows 0-3) or its high lane with u[4 + l % 4] (rows 4-7)
        const __m256i row = l < 4 ? _mm256_permute2x128_si256(u[l % 4], u[4 + l % 4], 0x20)
                                  : _mm256_permute2x128_si256(u[l % 4], u[4 + l % 4], 0x31);
        const __m128i halves[2] = {_mm256_castsi256_si128(row), _mm256_extracti128_si256(row, 1)};
        const __m256 sv = _mm256_set1_ps(s8[l]);
        float* o = out + (8 * h + l) * ldo + 32 * b;
        for (int j = 0; j < 4; ++j) {
          const __m128i v = j % 2 ? _mm_srli_si128(halves[j / 2], 8) : halves[j / 2];
          _mm256_storeu_ps(o + 8 * j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), sv));
        }
      }
    }
  }
}

// One tile of any format as float32 into out (row stride ldo).
inline void dequant_tile(const Range& r, const uint8_t* tp, int64_t K, float* out, int64_t ldo) {
  if (r.fmt == INT4) dequant_int4_tile(tp, K / 32, out, ldo);
  else if (r.fmt == INT8) dequant_int8_tile(tp, K / 32, out, ldo);
  else gguf_dequant_tile(r.fmt, tp, K, out, ldo);
}

// Tiles [t0, t1) of w (over its ranges) dequantized as float32 (out32) or bfloat16 (out16, through a float
// buffer): [16 * (t1 - t0), K].
void dequant_impl(const Weights& w, int64_t t0, int64_t t1, float* out32, uint16_t* out16) {
  const int64_t K = w.K;
  at::parallel_for(t0, t1, 1, [&](int64_t a, int64_t b) {
    std::vector<float> buf(out16 ? TILE_ROWS * K : 0);
    int64_t first = 0;
    for (int i = 0; i < w.n; ++i) {
      const Range& r = w.r[i];
      for (int64_t t = std::max(a, first); t < std::min(b, first + r.ntiles); ++t) {
        const int64_t o = (t - t0) * TILE_ROWS * K;
        float* dst = out16 ? buf.data() : out32 + o;
        dequant_tile(r, r.p + (t - first) * r.tile_bytes, K, dst, K);
        if (out16) to_bf16(dst, TILE_ROWS * K, out16 + o);
      }
      first += r.ntiles;
    }
  });
}

// Sets jobs[0..w.n) up for a product of x's M rows with w: the first job quantizes the rows (into its
// reused buffers: a decode step makes a few hundred such products), the others share them; the bias is
// padded to whole tiles.
void set_jobs(Job* jobs, const Weights& w, const float* x, int64_t M, const torch::Tensor* bias, float* y) {
  const int64_t K = w.K, nb = K / 32, N = w.ntiles * TILE_ROWS;
  Job& j0 = jobs[0];
  const float* bp = nullptr;
  if (bias && bias->defined() && bias->numel()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->is_contiguous() && bias->numel() <= N &&
                bias->numel() > N - TILE_ROWS, "bad bias");
    bp = bias->data_ptr<float>();
    if (bias->numel() < N) {  // the padding rows'
      j0.padded.assign(N, 0.f);
      std::copy(bp, bp + bias->numel(), j0.padded.begin());
      bp = j0.padded.data();
    }
  }
  bool q8_0 = false, q8_K = false;
  for (int i = 0; i < w.n; ++i) (is_k_quant(w.r[i].fmt) ? q8_K : q8_0) = true;
  j0.rows.quantize(x, M, K, q8_0, q8_K, uses_amx(M));
  int64_t row = 0;
  for (int i = 0; i < w.n; ++i) {
    Job& j = jobs[i];
    const Range& r = w.r[i];
    j.fmt = r.fmt;
    j.K = K;
    j.nb = nb;
    j.ntiles = r.ntiles;
    j.tile_bytes = r.tile_bytes;
    j.ldy = N;
    j.p = r.p;
    j.bias = bp ? bp + row : nullptr;
    j.y = y ? y + row : nullptr;
    j.x = &j0.rows;
    row += r.ntiles * TILE_ROWS;
  }
}

// A calling thread's reusable jobs for products of a few rows (larger ones allocate their own, so a
// prompt's buffers are not held).
constexpr int64_t REUSED_ELEMENTS = 1 << 16;
thread_local std::vector<Job> reused_jobs;

// The jobs of a call of x's rows (contiguous) with w, set up by set_jobs (outputs into y, or none): the
// calling thread's reused jobs for a few rows, else `own`.
std::vector<Job>& call_jobs(const torch::Tensor& x, const Weights& w, const c10::optional<torch::Tensor>& bias,
                            std::vector<Job>& own, float* y) {
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<Job>& jobs = M * K <= REUSED_ELEMENTS ? reused_jobs : own;
  if (jobs.size() < static_cast<size_t>(w.n)) jobs.resize(w.n);
  set_jobs(jobs.data(), w, x.data_ptr<float>(), M, bias.has_value() ? &*bias : nullptr, y);
  return jobs;
}

// x as the calls take it: float32 [M, K], contiguous.
torch::Tensor call_input(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x must be float32 [M, K]");
  return x.contiguous();
}

}  // namespace

// x: float32 [M, K]; q: packed tiles or a segmented tensor (weights_of) -> y [M, 16 * tiles], the padding
// rows' outputs included. bias: float32 [<= 16 * tiles, > 16 * (tiles - 1)] or empty.
torch::Tensor qlinear(torch::Tensor x, torch::Tensor q, c10::optional<torch::Tensor> bias) {
  x = call_input(x);
  const Weights w = weights_of(q, x.size(1));
  auto y = torch::empty({x.size(0), w.ntiles * TILE_ROWS}, x.options());
  std::vector<Job> own;
  run_jobs(call_jobs(x, w, bias, own, y.data_ptr<float>()), w.n, x.size(0));
  return y;
}

// x: float32 [M, K]; q: a fused gate | up weight (layers/mlp.py), I rows each, I a multiple of 16, so 2I / 16
// tiles, gate's first -> silu(x gate^T + b) * (x up^T + b) [M, I]: every value exactly what
// silu_mul(qlinear(x, q, bias)) gives, without the [M, 2I] intermediate or the pass over it.
torch::Tensor qlinear_silu(torch::Tensor x, torch::Tensor q, c10::optional<torch::Tensor> bias) {
  if (!options.fused_silu) return silu_mul(qlinear(x, q, bias));
  x = call_input(x);
  const Weights w = weights_of(q, x.size(1));
  TORCH_CHECK(w.ntiles % 2 == 0, "qlinear_silu: gate | up must be an even number of tiles (I a multiple of 16)");
  const int64_t P = w.ntiles / 2;
  auto out = torch::empty({x.size(0), P * TILE_ROWS}, x.options());
  std::vector<Job> own;
  run_pairs(call_jobs(x, w, bias, own, nullptr), w.n, x.size(0), P, out.data_ptr<float>());
  return out;
}

// x: float32 [M, K]; q: weights of one format (packed tiles or a one-segment tensor); tiles: ascending int64
// tile indices -> y [M, 16 * tiles]: tile tiles[i]'s outputs in columns 16i..16i+15, each exactly what qlinear
// gives for that tile (a tile's outputs do not depend on the call). Runs of consecutive tiles are one job each.
torch::Tensor qlinear_tiles(torch::Tensor x, torch::Tensor q, torch::Tensor tiles) {
  x = call_input(x);
  const Weights w = weights_of(q, x.size(1));
  TORCH_CHECK(w.n == 1, "qlinear_tiles: weights of one format");
  TORCH_CHECK(tiles.scalar_type() == torch::kLong && tiles.dim() == 1 && tiles.is_contiguous(),
              "qlinear_tiles: tiles must be int64 [n]");
  const int64_t n = tiles.numel(), M = x.size(0);
  const int64_t* t = tiles.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(t[i] >= 0 && t[i] < w.ntiles && (i == 0 || t[i] > t[i - 1]), "qlinear_tiles: tiles must ascend within the weights");
  auto y = torch::empty({M, n * TILE_ROWS}, x.options());
  std::vector<Job> own;
  const Job& whole = call_jobs(x, w, c10::nullopt, own, nullptr)[0];  // its activation rows serve every run
  std::vector<Job> runs;
  for (int64_t i = 0, e; i < n; i = e) {
    for (e = i + 1; e < n && t[e] == t[e - 1] + 1;) ++e;
    Job run;
    static_cast<Tiles&>(run) = whole;
    run.p = whole.p + t[i] * whole.tile_bytes;
    run.ntiles = e - i;
    run.ldy = n * TILE_ROWS;
    run.y = y.data_ptr<float>() + i * TILE_ROWS;
    runs.push_back(std::move(run));
  }
  if (n) run_jobs(runs, runs.size(), M);
  return y;
}

// x [M, K] (K a multiple of 32) as the calls of the 8-bit, 4-bit and Q5_0 tiles quantize it: per 32 columns,
// code * d (q8_0: ActRows.quantize), float32 [M, K]. layers/bounded_head.py bounds its products with it.
torch::Tensor q8_0_values(torch::Tensor x) {
  x = call_input(x);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "q8_0_values: K must be a multiple of 32");
  ActRows a;
  a.quantize(x.data_ptr<float>(), M, K, true, false, false);
  auto out = torch::empty_like(x);
  float* o = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < K; ++i) o[m * K + i] = static_cast<float>(a.xq[m * K + i]) * a.sx[m * (K / 32) + i / 32];
  return out;
}

// Tiles of packed weights q (16 rows each, the last one's padding included).
int64_t weight_tiles(torch::Tensor q) { return weights_of(q, -1).ntiles; }

// Several one-row products in one parallel region (kernels.h QProduct): what qlinear computes for each.
void qlinear_products(std::vector<QProduct>& products) {
  std::vector<Job>& jobs = reused_jobs;
  std::vector<Weights> ws;
  ws.reserve(products.size());
  size_t n = 0;
  for (const QProduct& p : products) {
    TORCH_CHECK(p.K <= REUSED_ELEMENTS, "qlinear_products: rows longer than its buffers");
    ws.push_back(weights_of(*p.q, p.K));
    n += ws.back().n;
  }
  if (jobs.size() < n) jobs.resize(n);
  size_t at = 0;
  for (size_t i = 0; i < products.size(); ++i) {
    set_jobs(jobs.data() + at, ws[i], products[i].x, 1, products[i].bias, products[i].y);
    at += ws[i].n;
  }
  run_jobs(jobs, n, 1);
}

// The weights' tiles [t0, t1) (t1 < 0: to the end) as float32, or bfloat16 with bf16 = true (for prefill:
// dequantize, then one GEMM): [16 * (t1 - t0), K], padding rows included (3-D int8 tiles with an odd
// number of blocks: K + 32, a zero block last).
torch::Tensor dequantize(torch::Tensor q, bool bf16, int64_t t0, int64_t t1) {
  const Weights w = weights_of(q, -1);
  if (t1 < 0) t1 = w.ntiles;
  TORCH_CHECK(0 <= t0 && t0 <= t1 && t1 <= w.ntiles, "dequantize: bad tile range");
  const int64_t N = (t1 - t0) * TILE_ROWS, K = w.K;
  auto out = torch::empty({N, K}, torch::dtype(bf16 ? torch::kBFloat16 : torch::kFloat));
  float* out32 = bf16 ? nullptr : out.data_ptr<float>();
  uint16_t* out16 = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  dequant_impl(w, t0, t1, out32, out16);
  return out;
}

// Rows `ids` of the weights (K columns) as float32 [n, K]: an embedding lookup from a quantized table, with
// dequantize's values bit for bit. Each row's tile is dequantized into a buffer and its lane copied out
// (16 rows' work for one: a step looks up a few rows, a prompt chunk a few hundred).
torch::Tensor embedding_rows(torch::Tensor q, torch::Tensor ids, int64_t K) {
  const Weights w = weights_of(q, K);
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.dim() == 1, "ids must be int64 [n]");
  ids = ids.contiguous();
  const int64_t n = ids.numel(), N = w.ntiles * TILE_ROWS;
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < N, "embedding_rows: id out of range");
  auto out = torch::empty({n, K}, torch::kFloat);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n, 32, [&](int64_t a, int64_t b) {
    std::vector<float> buf(TILE_ROWS * K);
    for (int64_t i = a; i < b; ++i) {
      int64_t t = id[i] / TILE_ROWS;
      for (int r = 0; r < w.n; t -= w.r[r].ntiles, ++r) {
        if (t < w.r[r].ntiles) {
          dequant_tile(w.r[r], w.r[r].p + t * w.r[r].tile_bytes, K, buf.data(), K);
          break;
        }
      }
      std::memcpy(o + i * K, buf.data() + (id[i] % TILE_ROWS) * K, sizeof(float) * K);
    }
  });
  return out;
}

// Bytes of one tile (16 rows) of K columns in format fmt (a segmented tensor's segments: layers/gguf_native.py).
int64_t tile_bytes(int64_t fmt, int64_t K) { return tile_bytes_for(fmt, K); }

// A GGUF tensor's blocks (uint8 [rows, bytes per row], K columns) -> its tiles uint8 [tiles, bytes per tile] in
// format fmt (Q5_0, Q4_K, Q5_K, Q6_K: gguf_tiles.cpp), the file's codes and scales moved, not changed.
torch::Tensor repack_gguf(torch::Tensor blocks, int64_t fmt, int64_t K) {
  TORCH_CHECK(is_gguf_format(fmt), "repack_gguf: not a GGUF tile format");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kByte && blocks.is_contiguous(),
              "blocks must be contiguous uint8 [rows, bytes per row]");
  const int64_t per = fmt == Q5_0 ? 32 : 256, size = fmt == Q5_0 ? 22 : fmt == Q4_K ? 144 : fmt == Q5_K ? 176 : 210;
  TORCH_CHECK(K % per == 0 && blocks.size(1) == K / per * size, "repack_gguf: blocks do not match K and the format");
  const int64_t rows = blocks.size(0), ntiles = (rows + TILE_ROWS - 1) / TILE_ROWS, tb = gguf_tile_bytes(fmt, K);
  auto out = torch::empty({ntiles, tb}, torch::kByte);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, ntiles, 16, [&](int64_t t0, int64_t t1) { gguf_repack(fmt, src, rows, blocks.size(1), K, dst, t0, t1); });
  return out;
}

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
}

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

KernelOptions kernel_options() { return options; }

KernelOptions set_kernel_options(const KernelOptions& o) {
  TORCH_CHECK(!o.vnni || cpu_has_vnni(), "this CPU has no AVX-512 VNNI");
  TORCH_CHECK(!o.attention512 || cpu_has_avx512(), "this CPU has no AVX-512");
  TORCH_CHECK(!o.amx || cpu_has_amx(), "this CPU has no AMX int8 tiles, or the OS does not grant them");
  TORCH_CHECK(o.unpack_min_rows > 0 && o.bypass_min_rows > 0 && o.amx_min_rows >= AMX_ROWS,
              "row thresholds must be positive (amx_min_rows at least 16)");
  return std::exchange(options, o);
}

bool cpu_has_amx() { return amx_granted(); }

std::string isa() { return options.vnni ? (options.amx ? "amx" : "avx512vnni") : "avx2"; }
