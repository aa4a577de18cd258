// Attention of a prompt chunk: many new tokens of one sequence over its keys, in float32. This is what
// layers/attention.py otherwise hands to SDPA's flash kernel (one call per prompt chunk), with the two
// things that kernel does not do on a CPU:
//   - grouped heads without copies: the G query heads that share a kv head are one block of query rows
//     against that head's keys, which are read once per block instead of expanded G times;
//   - the causal (and sliding-window) span per query: a block of keys outside every row's span is never
//     computed, a block on the diagonal is masked per row.
//
// Inputs: q [T, H, D], k and v [L, Hkv, D] (float32, any row and head strides, unit stride within a head; k
// and v are the sequence's keys in position order, the new tokens' among them), out [T, H, D] (the same).
// Query i sits `first + i` keys after the first key and sees key j where j <= first + i and, with a window,
// first + i - j < window (layers/attention.py build_view: the same mask it would pass to SDPA).
//
// Work: (kv head, block of BQ query positions) items, the most expensive (latest positions) first, taken
// from a shared counter so that the causal triangle's uneven items even out over the threads. Per item,
// flash-style: keys in blocks of KB, the block's K transposed into an L1 buffer; scores RS rows x 16 keys
// per register block; a running max and sum per row (online softmax, exp by simd.h exp8); the values
// added RS rows x 16 columns per register block. The query is scaled before the products.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

constexpr int64_t BQ = 16;  // query positions per work item (each with the G query heads of its kv head)
constexpr int64_t KB = 64;  // keys per block
constexpr int RS = 6;       // query rows per register block (12 accumulators, 2 loads, 1 broadcast)
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

struct Geometry {
  const float *q, *k, *v;
  float* out;
  int64_t q_row, q_head, k_row, k_head, v_row, v_head, o_row, o_head;
  int64_t T, L, H, Hkv, G, D, first, window;
  float scale;
  int64_t lo(int64_t i) const { return window > 0 ? std::max<int64_t>(0, first + i - window + 1) : 0; }
  int64_t hi(int64_t i) const { return std::min(L, first + i + 1); }
};

// s[r][c0 .. c0 + 16) = qs[r] . key c0 + j, for RB query rows (qs rows of D floats), the keys' block
// transposed in kt [D][KB].
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

// o[r][c0 .. c0 + 8 NC) += sum over keys j < n of p[r][j] * v_j[c0 ..], in key order, for RB rows (o rows of D
// floats, p rows of KB); v_j = vb + j * v_row.
template <int RB, int NC>
inline void values(const float* p, int64_t n, const float* vb, int64_t v_row, float* o, int64_t D, int64_t c0) {
  __m256 a[RB][NC];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) a[r][c] = _mm256_loadu_ps(o + r * D + c0 + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    __m256 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = _mm256_loadu_ps(vb + j * v_row + c0 + 8 * c);
    for (int r = 0; r < RB; ++r) {
      const __m256 pv = _mm256_set1_ps(p[r * KB + j]);
      for (int c = 0; c < NC; ++c) a[r][c] = _mm256_fmadd_ps(pv, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(o + r * D + c0 + 8 * c, a[r][c]);
}

struct Scratch {
  std::vector<float> qs, o, s, kt, m, l;
  Scratch(int64_t R, int64_t D) : qs(R * D), o(R * D), s(R * KB), kt(D * KB), m(R), l(R) {}
};

// Query positions [i0, i1) of kv head g: rows r = (i - i0) * G + h', head g * G + h'.
void attend_item(const Geometry& x, int64_t g, int64_t i0, int64_t i1, Scratch& w) {
  const int64_t G = x.G, D = x.D, R = (i1 - i0) * G;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = i0 + r / G, h = g * G + r % G;
    const float* src = x.q + i * x.q_row + h * x.q_head;
    for (int64_t d = 0; d < D; ++d) w.qs[r * D + d] = src[d] * x.scale;
  }
  std::fill_n(w.o.begin(), R * D, 0.f);
  std::fill_n(w.m.begin(), R, NEG_INF);
  std::fill_n(w.l.begin(), R, 0.f);
  const int64_t jlo = x.lo(i0), jhi = x.hi(i1 - 1);
  for (int64_t j0 = jlo - jlo % 16; j0 < jhi; j0 += KB) {
    const int64_t n = std::min(KB, jhi - j0), nn = (n + 15) / 16 * 16;
    // the block's keys, transposed (zero past n)
    for (int64_t j = 0; j < nn; ++j) {
      if (j < n) {
        const float* kj = x.k + (j0 + j) * x.k_row + g * x.k_head;
        for (int64_t d = 0; d < D; ++d) w.kt[d * KB + j] = kj[d];
      } else {
        for (int64_t d = 0; d < D; ++d) w.kt[d * KB + j] = 0.f;
      }
    }
    row_chunks<RS>(R, [&](auto rb, int64_t r0) {
      constexpr int RB = decltype(rb)::value;
      for (int64_t c0 = 0; c0 < nn; c0 += 16) scores<RB>(w.qs.data() + r0 * D, D, w.kt.data(), c0, w.s.data() + r0 * KB);
    });
    // per row: its span within the block, the running max and sum, the block's weights in place of its scores
    for (int64_t r = 0; r < R; ++r) {
      const int64_t i = i0 + r / G;
      const int64_t jb = std::max(x.lo(i), j0) - j0, je = std::min(x.hi(i), j0 + n) - j0;
      float* s = w.s.data() + r * KB;
      if (jb >= je) {  // no key of this block is visible to the row
        std::fill_n(s, nn, 0.f);
        continue;
      }
      for (int64_t j = 0; j < jb; ++j) s[j] = NEG_INF;
      for (int64_t j = je; j < nn; ++j) s[j] = NEG_INF;
      const float mx = max_of(s + jb, je - jb);
      const float m_new = std::max(w.m[r], mx);
      const float corr = std::exp(w.m[r] - m_new);  // 0 on the row's first block (m = -inf)
      const __m256 mv = _mm256_set1_ps(m_new);
      __m256 sum = _mm256_setzero_ps();
      for (int64_t j = 0; j < nn; j += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, p);
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
    const float* vb = x.v + j0 * x.v_row + g * x.v_head;
    row_chunks<RS>(R, [&](auto rb, int64_t r0) {
      constexpr int RB = decltype(rb)::value;
      const float* p = w.s.data() + r0 * KB;
      float* o = w.o.data() + r0 * D;
      int64_t c0 = 0;
      for (; c0 + 16 <= D; c0 += 16) values<RB, 2>(p, n, vb, x.v_row, o, D, c0);
      if (c0 < D) values<RB, 1>(p, n, vb, x.v_row, o, D, c0);
    });
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = i0 + r / G, h = g * G + r % G;
    const float inv = w.l[r] > 0.f ? 1.f / w.l[r] : 0.f;
    const __m256 iv = _mm256_set1_ps(inv);
    float* dst = x.out + i * x.o_row + h * x.o_head;
    const float* o = w.o.data() + r * D;
    for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), iv));
  }
}

}  // namespace

void prompt_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor out, int64_t first,
                      int64_t window, double scale) {
  auto check3 = [](const torch::Tensor& t, const char* name) {
    TORCH_CHECK(t.dim() == 3 && t.scalar_type() == torch::kFloat && t.stride(2) == 1 && t.device().is_cpu(),
                name, " must be float32 [rows, heads, D] on the CPU with unit stride within a head");
  };
  check3(q, "q");
  check3(k, "k");
  check3(v, "v");
  check3(out, "out");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), L = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(out.sizes() == q.sizes(), "out must have q's shape");
  TORCH_CHECK(v.sizes() == k.sizes() && k.size(2) == D && D % 8 == 0 && Hkv > 0 && H % Hkv == 0,
              "k and v must be [L, Hkv, D] with Hkv dividing q's heads and D a multiple of 8");
  TORCH_CHECK(first >= 0 && first + T <= L && window >= 0, "the queries must be the last of the keys' positions");
  if (T == 0) return;
  const Geometry x{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(),
                   q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                   out.stride(0), out.stride(1), T, L, H, Hkv, H / Hkv, D, first, window, float(scale)};
  const int64_t blocks = (T + BQ - 1) / BQ, items = blocks * Hkv;
  const int64_t threads = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), items);
  std::atomic<int64_t> next{0};
  auto work = [&](int64_t, int64_t) {
    Scratch w(BQ * x.G, D);
    for (int64_t it; (it = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      const int64_t b = blocks - 1 - it / Hkv, g = it % Hkv;  // latest positions (most keys) first
      attend_item(x, g, b * BQ, std::min(T, (b + 1) * BQ), w);
    }
  };
  if (threads <= 1)
    work(0, 1);
  else
    at::parallel_for(0, threads, 1, work);
}
