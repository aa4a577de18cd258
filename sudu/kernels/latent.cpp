// Latent attention's per-head float products (layers/mla.py): the queries mapped into latent space,
// W_UK^T q_nope, and each head's latent output mapped back, W_UV o. kv_b_proj stays in float32, and
// torch.bmm's blocking over the rows (and its one-row GEMV) changes the order of each output's sums with the
// number of rows in the call. Here every output is one fused multiply-add chain over k = 0..K-1 from zero,
// so a row's result depends only on that row: the same in a decode step, a verification run or a prompt
// chunk of any length (docs/exactness.md).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels.h"

namespace {

constexpr int64_t RB = 4;  // rows per register block

// RR rows (RR <= RB) of x, each with row stride xs, times w [K, N] (row stride N) into o (row stride os):
// NV vectors of 8 columns from column n.
template <int RR, int NV>
inline void row_block(const float* x, int64_t xs, const float* w, int64_t K, int64_t N, int64_t n, float* o,
                      int64_t os) {
  __m256 acc[RR][NV];
  for (int r = 0; r < RR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = _mm256_loadu_ps(w + k * N + n + 8 * v);
    for (int r = 0; r < RR; ++r) {
      const __m256 xv = _mm256_set1_ps(x[r * xs + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm256_fmadd_ps(xv, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(o + r * os + n + 8 * v, acc[r][v]);
}

template <int RR>
void rows_times(const float* x, int64_t xs, const float* w, int64_t K, int64_t N, float* o, int64_t os) {
  int64_t n = 0;
  for (; n + 16 <= N; n += 16) row_block<RR, 2>(x, xs, w, K, N, n, o, os);
  if (n < N) row_block<RR, 1>(x, xs, w, K, N, n, o, os);
}

}  // namespace

// x [T, H, K] float32 (unit stride within a head), w [H, K, N] float32 contiguous, N a multiple of 8:
// out [T, H, N] with out[t, h] = x[t, h] @ w[h].
torch::Tensor head_matmul(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat && x.stride(2) == 1 && x.device().is_cpu(),
              "x must be float32 [T, H, K] on the CPU with unit stride within a head");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kFloat && w.is_contiguous() && w.size(0) == x.size(1) &&
              w.size(1) == x.size(2) && w.size(2) % 8 == 0,
              "w must be contiguous float32 [H, K, N], N a multiple of 8");
  const int64_t T = x.size(0), H = x.size(1), K = x.size(2), N = w.size(2);
  auto out = torch::empty({T, H, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), xh = x.stride(1), blocks = (T + RB - 1) / RB;
  // items: (head, block of RB rows); a decode step's few rows stay on the calling thread
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, RB * K * N / 8));
  at::parallel_for(0, H * blocks, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / blocks, t0 = i % blocks * RB, rows = std::min(RB, T - t0);
      const float* xr = xp + t0 * xs + h * xh;
      const float* wh = wp + h * K * N;
      float* orow = op + (t0 * H + h) * N;
      switch (rows) {
        case 4: rows_times<4>(xr, xs, wh, K, N, orow, H * N); break;
        case 3: rows_times<3>(xr, xs, wh, K, N, orow, H * N); break;
        case 2: rows_times<2>(xr, xs, wh, K, N, orow, H * N); break;
        default: rows_times<1>(xr, xs, wh, K, N, orow, H * N); break;
      }
    }
  });
  return out;
}
