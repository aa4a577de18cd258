// What quant_linear.cpp (the int8/int4 tiles, the calls) and gguf_tiles.cpp (GGUF's own block formats in
// tiles) share: the tile geometry, one call's quantized activations, the prefetch distance, and the GGUF
// formats' entry points.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace qtiles {

// Weight rows per tile: one row per 32-bit lane of a 512-bit vector.
constexpr int64_t TILE_ROWS = 16;

// Weights stream from memory once per call; every kernel prefetches this far ahead of its loads (one
// prefetch per 64-byte line; the hardware prefetcher alone leaves the kernel short of the bandwidth).
// Prefetching past the end is harmless (no fault). Distances compared: docs/cpu_speed.md, "Prefetching".
constexpr int64_t PREFETCH_BYTES = 4096;
// Those prefetches fill L2, not L1: a core has few L1 misses in flight and its arithmetic keeps them busy,
// while prefetches into L2 queue there and keep the stream going as the core computes (T1 against T0:
// docs/cpu_speed.md).
constexpr auto PREFETCH_HINT = _MM_HINT_T1;
// The GGUF formats' kernels (gguf_tiles.cpp) prefetch further ahead, which pays with the weights in huge
// pages where the int8 kernel's does not (docs/cpu_speed.md, "GGUF prefetch at 6 KiB").
constexpr int64_t GGUF_PREFETCH_BYTES = 6144;

// The first n bytes of a call's weights (the kernel's prefetch distance), requested at once: the in-loop
// prefetch only reaches ahead of the loads, so without this each call (96 a step on the 0.5B, each thread
// a range of rows) would start with lines loaded on demand.
inline void prefetch_start(const uint8_t* q, int64_t n = PREFETCH_BYTES) {
  for (int64_t o = 0; o < n; o += 64) _mm_prefetch(reinterpret_cast<const char*>(q + o), _MM_HINT_T0);
}

// Compiled for VNNI by attribute only: the caller dispatches on the running CPU.
#define SUDU_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

// The low and high nibbles of every byte of raw, each as a byte: the 4-bit codes of sudu's int4 tiles and of
// GGUF's formats, one lane's low columns in lo and its high ones in hi.
SUDU_VNNI inline void nibbles(__m512i raw, __m512i& lo, __m512i& hi) {
  const __m512i mask = _mm512_set1_epi8(0x0F);
  lo = _mm512_and_si512(raw, mask);
  hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
}
inline void nibbles(__m256i raw, __m256i& lo, __m256i& hi) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(raw, mask);
  hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
}

// One call's quantized activations, from the first row a kernel call takes (row stride K codes, nb blocks
// of 32 columns), in two forms, each made only when a range of the call reads it:
//   q8_0 (sudu's int8/int4 tiles, Q5_0): x ~= sx * xq with one scale per 32 columns;
//   q8_K (the K-quants): x ~= ksx * kf * kq, ksx per 256 columns and a small integer kf (1..8) per 32, so a
//   super-block's 8 blocks sum in integers before one float multiply-add. The codes' sums, times kf, come
//   packed as int16 pairs for madd: kpair per two 32-blocks (the K-quants' min term), k16pair per 32-block's
//   two halves (Q6_K's offset).
struct Acts {
  const int8_t* xq;
  const float* sx;      // per block
  const float* xsum;    // per block: sx * sum(codes)
  const int32_t* isum;  // per block: sum(codes)
  const int8_t* kq;
  const float* ksx;         // per 256 columns (row stride nb / 8)
  const int16_t* kf;        // per 32 columns (row stride nb)
  const int32_t* kpair;     // per 64 columns: int16 sums of kq's two 32-blocks (row stride nb / 2)
  const int32_t* k16pair;   // per 32 columns: int16 sums of kq's two 16-column halves (row stride nb)
  int64_t K, nb;
  // Whether the kernel prefetches the weights ahead of its loads. A prompt's row chunks run one tile each
  // (quant_linear.cpp run_tiles): only the first chunk's call streams it, the others find it in cache.
  bool stream = true;
  // Whether the outputs go past the caches (non-temporal stores: kernels.h KernelOptions::bypass_min_rows).
  bool bypass = false;
  // From a row that starts a whole group of 16 (act_quant.h ActRows::sx16): the group's sx, xsum and kf by
  // block, [block][16 rows], else null.
  const float* sx16 = nullptr;
  const float* xsum16 = nullptr;
  const int32_t* kf16 = nullptr;
  inline int x4(int i, int64_t col) const { return *reinterpret_cast<const int*>(xq + i * K + col); }
  inline int k4(int i, int64_t col) const { return *reinterpret_cast<const int*>(kq + i * K + col); }
};

// A VNNI kernel's 16 outputs of one row (a whole 64-byte line): non-temporal where the call bypasses the
// caches and the address allows it (rows are whole tiles apart, so in practice every one is aligned).
// The AVX2 kernels write each line in two halves far apart in time, which a non-temporal store would
// send to memory as two partial writes, so they always store through the caches.
SUDU_VNNI inline void store_out(float* dst, __m512 v, bool bypass) {
  if (bypass && (reinterpret_cast<uintptr_t>(dst) & 63) == 0) _mm512_stream_ps(dst, v);
  else _mm512_storeu_ps(dst, v);
}

// Weight formats of a tile range. INT8 and INT4 are sudu's own tiles (quant_linear.cpp); the others hold a
// GGUF file's blocks, the same codes and scales in the same bits, rearranged into tiles (gguf_tiles.cpp).
enum Format : int64_t { INT8 = 0, INT4 = 1, Q5_0 = 2, Q4_K = 3, Q5_K = 4, Q6_K = 5 };

inline bool is_gguf_format(int64_t f) { return f >= Q5_0 && f <= Q6_K; }

// The layout of sudu's int8 and int4 tiles (quant_linear.cpp, where it is described): per 32-block, an int4
// tile has 320 bytes (4 chunks of nibbles, then float16 scales and mins); an int8 tile has, per pair of
// blocks, 1088 bytes (each block's 512 code bytes, then the two blocks' float16 scales).
constexpr int64_t Q4_BLOCK_BYTES = 320, Q8_CODE_BYTES = 512, Q8_PAIR_BYTES = 1088;
// A tile's bytes; where an int8 tile's block b has its codes and its 16 scales.
inline int64_t tile_bytes_of(bool int4, int64_t nb) { return int4 ? nb * Q4_BLOCK_BYTES : (nb + 1) / 2 * Q8_PAIR_BYTES; }
inline const uint8_t* q8_codes(const uint8_t* tp, int64_t b) { return tp + b / 2 * Q8_PAIR_BYTES + b % 2 * Q8_CODE_BYTES; }
inline const uint8_t* q8_scales(const uint8_t* tp, int64_t b) {
  return tp + b / 2 * Q8_PAIR_BYTES + 2 * Q8_CODE_BYTES + b % 2 * 32;
}

// The layout of the GGUF formats' tiles (gguf_tiles.cpp, where it is described): 32-blocks of low nibbles and
// high bits in groups (1 block for Q5_0, a 256-column super-block of 8 for the K-quants), each group's tail
// of scales after its blocks.
constexpr int blocks_per_group(int64_t f) { return f == Q5_0 ? 1 : 8; }
constexpr int high_bits(int64_t f) { return f == Q6_K ? 2 : f == Q4_K ? 0 : 1; }
constexpr int64_t block_bytes(int64_t f) { return 256 + 64 * high_bits(f); }
constexpr int64_t tail_bytes(int64_t f) { return f == Q5_0 ? 32 : f == Q6_K ? 288 : 320; }
constexpr int64_t group_bytes(int64_t f) { return blocks_per_group(f) * block_bytes(f) + tail_bytes(f); }
// gguf_unpack_tile's output: per block UNPACKED_BLOCK bytes (per chunk c of 8 columns, the 16 rows' codes of
// columns 8c..8c+3, then of 8c+4..8c+7, 64 bytes each), then, for the K-quants, per super-block
// UNPACKED_GROUP bytes of its scales' madd operands.
constexpr int64_t UNPACKED_BLOCK = 512, UNPACKED_GROUP = 512;
// The formats of 256-column super-blocks, which read the q8_K activations.
inline bool is_k_quant(int64_t f) { return f >= Q4_K && f <= Q6_K; }
// Bytes of one tile (16 rows) of K columns in a GGUF format; K a multiple of its group (32 or 256).
int64_t gguf_tile_bytes(int64_t fmt, int64_t K);
// R (1..8) activation rows against `count` consecutive tiles from p, as quant_linear.cpp's dot_tiles:
// tile t's outputs (plus bias) go to y[i * ldy + 16 * t + lane]. vnni: the AVX-512 VNNI path, else AVX2;
// both compute the same integers and the same float operations in the same order. unpacked (VNNI, count
// 1): the tile's codes and scale operands from gguf_unpack_tile, read from there instead of assembled
// again for every R rows of a prompt; the same results.
void gguf_dot_tiles(int64_t fmt, bool vnni, int R, const uint8_t* p, int64_t count, const Acts& a, const float* bias,
                    float* y, int64_t ldy, const uint8_t* unpacked = nullptr);
// AVX-512 VNNI only: one tile's codes and scale operands assembled once (gguf_unpacked_bytes(K) bytes into out).
int64_t gguf_unpacked_bytes(int64_t K);
void gguf_unpack_tile(int64_t fmt, const uint8_t* tp, int64_t K, uint8_t* out);
// Tiles [t0, t1) of a GGUF tensor in format fmt, from the file's blocks (rows x row_bytes, K columns per row),
// into out (whole tiles of gguf_tile_bytes each; rows past the last are zero).
void gguf_repack(int64_t fmt, const uint8_t* blocks, int64_t rows, int64_t row_bytes, int64_t K, uint8_t* out,
                 int64_t t0, int64_t t1);
// One tile's 16 rows of K columns as float32 into out (row stride ldo), the values GGUF's reference
// dequantization defines.
void gguf_dequant_tile(int64_t fmt, const uint8_t* tp, int64_t K, float* out, int64_t ldo);

}  // namespace qtiles
