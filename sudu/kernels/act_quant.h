// One call's activation rows quantized once (ActRows), in the forms the quantized products read (Acts,
// quant_tiles.h): q8_0 for sudu's int8/int4 tiles and Q5_0, q8_K for the K-quants. Rows are quantized each
// on its own, so a row's codes never depend on the rows it shares a call with.
#pragma once
#include <cstdint>
#include <vector>

#include "quant_tiles.h"
#include "simd.h"

namespace qtiles {

// The activation rows of one call, quantized once (Acts): q8_0 and q8_K, each only when a range reads it.
struct ActRows {
  int64_t K = 0, nb = 0;
  Aligned<int8_t> xq, kq;  // on a cache line: the AMX tiles load 32-byte rows of them
  std::vector<float> sx, xsum, ksx;
  std::vector<int32_t> isum, kpair, k16pair;
  std::vector<int16_t> kf;
  // sx, xsum and kf again for each whole group of 16 rows, by block: [group][block][16 rows], where the call
  // takes the AMX tiles (quantize's by_group). The AMX kernel broadcasts a block's value for each of its 16
  // rows; from one base address per block it needs no register per row (with the row-major arrays the
  // compiler ran out of them and moved addresses through vectors).
  Aligned<float> sx16, xsum16;
  Aligned<int32_t> kf16;

  // Rows in parallel (a prompt chunk's hundreds of rows), each row's values independent of the others.
  //   q8_0: per 32 columns d = amax / 127, codes x * (1 / d).
  //   q8_K: per 256 columns D = amax / 127, and per 32-block a multiple f in 1..8 of D / 8 as the block's
  //   scale, the smallest that holds the block (f = ceil(8 * block amax / amax)): blocks well under the
  //   super-block's largest keep most of q8_0's resolution, and the kernels still sum the super-block in
  //   integers (f times the block's products). Codes x * (1 / (D * f / 8)).
  //   by_group: also sx16, xsum16 and kf16 (for the AMX kernel; left empty otherwise).
  void quantize(const float* x, int64_t M, int64_t K_, bool q8_0, bool q8_K, bool by_group);
  Acts at(int64_t m) const {
    auto row = [](const auto& v, int64_t off) { return v.empty() ? nullptr : v.data() + off; };
    Acts a{row(xq, m * K), row(sx, m * nb), row(xsum, m * nb), row(isum, m * nb),
           row(kq, m * K), row(ksx, m * nb / 8), row(kf, m * nb), row(kpair, m * nb / 2), row(k16pair, m * nb), K, nb};
    if (m % 16 == 0) {
      const int64_t off = m * nb;  // group m / 16's [nb][16]
      if (off < static_cast<int64_t>(sx16.size())) a.sx16 = sx16.data() + off, a.xsum16 = xsum16.data() + off;
      if (off < static_cast<int64_t>(kf16.size())) a.kf16 = kf16.data() + off;
    }
    return a;
  }
};

}  // namespace qtiles
