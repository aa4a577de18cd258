// The C++ entry points of sudu's native kernels, shared by bindings.cpp (the Python module) and by kernels
// that call each other (decoder.cpp).
#pragma once
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

torch::Tensor qlinear(torch::Tensor x, torch::Tensor q, c10::optional<torch::Tensor> bias);
// silu(gate) * up from a fused gate | up weight q (2I / 16 tiles): silu_mul(qlinear(x, q, bias)) in one call.
torch::Tensor qlinear_silu(torch::Tensor x, torch::Tensor q, c10::optional<torch::Tensor> bias);
int64_t weight_tiles(torch::Tensor q);
// x's rows as the 8-bit, 4-bit and Q5_0 tiles' calls quantize them (q8_0), as float32 values.
torch::Tensor q8_0_values(torch::Tensor x);
// qlinear's outputs of the given tiles only (ascending int64 indices): y [M, 16 * tiles].
torch::Tensor qlinear_tiles(torch::Tensor x, torch::Tensor q, torch::Tensor tiles);
// Greedy rows' candidate tiles of an output head, from its 4-bit shadow's products and their error bounds
// (bounded_head.cpp; layers/bounded_head.py).
torch::Tensor head_candidates(torch::Tensor x, torch::Tensor approx, torch::Tensor U, torch::Tensor C,
                              torch::Tensor consts, int64_t vocab, int64_t max_tiles);
// One row's product with packed tiles q: y [16 * tiles] = qlinear(x [1, K], q, bias), written in place.
struct QProduct {
  const float* x;
  int64_t K;
  const torch::Tensor* q;
  const torch::Tensor* bias;  // null or empty: none
  float* y;
};
// Several such products in one parallel region (the experts a token chose), each exactly as qlinear.
void qlinear_products(std::vector<QProduct>& products);
torch::Tensor dequantize(torch::Tensor q, bool bf16, int64_t t0, int64_t t1);
torch::Tensor embedding_rows(torch::Tensor q, torch::Tensor ids, int64_t K);
int64_t tile_bytes(int64_t fmt, int64_t K);
torch::Tensor repack_gguf(torch::Tensor blocks, int64_t fmt, int64_t K);
// The kernels' switches in one place. The defaults are what sudu runs; tests and benchmarks set others to
// compare routes that compute the same values (every option leaves every output unchanged).
struct KernelOptions {
  bool vnni = false;               // AVX-512 VNNI dot products (only where the CPU has them), else AVX2
  int64_t unpack_min_rows = 64;    // VNNI: from this many rows a GGUF tile's codes are assembled once per call
  // VNNI: from this many rows a call's outputs are written past the caches (non-temporal stores): a prompt
  // chunk's outputs (tens of MB) would otherwise be read from memory line by line before each write and
  // push the activations, tiles and codes the call reuses out of L2 and L3
  int64_t bypass_min_rows = 64;
  bool contiguous_shares = true;   // each thread streams a contiguous share of the tiles (else a shared counter)
  bool fused_silu = true;          // qlinear_silu applies silu * up inside the call (else qlinear, then silu_mul)
  bool attention512 = false;       // attention's products on AVX-512 (only where the CPU has it), else AVX2
  // AMX int8 tiles for calls of amx_min_rows+ rows, 16 rows at a time (amx_tiles.cpp; only where the CPU has
  // them and the OS grants them, and with vnni, whose kernels take each call's leftover rows)
  bool amx = false;
  int64_t amx_min_rows = 32;
};
bool cpu_has_vnni();
// Whether this CPU has AMX's int8 tiles and the OS grants them to this process (asked once).
bool cpu_has_amx();
bool cpu_has_avx512();
KernelOptions kernel_options();
// Checked (no VNNI where the CPU lacks it); returns the previous options.
KernelOptions set_kernel_options(const KernelOptions& o);
// "amx" (AMX tiles from amx_min_rows rows, AVX-512 VNNI below), "avx512vnni" or "avx2": the dot-product
// path the calls take now.
std::string isa();
// softmax(q k^T * scale) v over the paged KV pool, every row by one arithmetic (attention.cpp): few new tokens
// of many sequences (decode_attention), a prompt chunk's new tokens causal from `first` and within `window`
// keys when > 0 (prompt_attention); into out.
// tiles: the "bfloat16 tiles" arithmetic (attention_tiles.cpp; needs bf16_tiles_granted() and D a multiple of
// 32), else float32 (attention.cpp); each is one recipe for every row.
void decode_attention(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor ks, torch::Tensor vs,
                      torch::Tensor rows, torch::Tensor slots, torch::Tensor mask, double scale, torch::Tensor out,
                      bool tiles);
void prompt_attention(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, torch::Tensor ks, torch::Tensor vs,
                      torch::Tensor slots, torch::Tensor out, int64_t first, int64_t window, double scale, bool tiles);
// out[t, h] = x[t, h] @ w[h] for x [T, H, K], w [H, K, N] float32: each output one fused multiply-add chain
// over k, whatever T (latent.cpp; layers/mla.py's per-head products).
torch::Tensor head_matmul(torch::Tensor x, torch::Tensor w);
// Whether this CPU has AMX's bfloat16 tiles (with AVX-512 BF16) and the OS grants them to this process.
bool bf16_tiles_granted();
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gu);
// One row of silu_mul: gu [2I] -> out [I].
void silu_mul_row(const float* gu, int64_t I, float* out);
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads);
torch::Tensor argmax_rows(torch::Tensor x);
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask);
// The routing of a model's expert layers for llama_decode (decoder.cpp; layers/moe.py Router without groups).
struct MoeParams {
  int64_t top_k = 0;
  bool norm_topk = false;
  double scaling = 1.0;
  bool sigmoid = false;  // scores: sigmoid (else softmax)
  int64_t shared = 0;    // 0 none, 1 a shared expert scaled by sigmoid(x . gate), 2 shared experts unscaled
};
// Expert choice per row of x [T, hidden] against the router weight w [E, hidden] (both float32), under p's
// top_k, scoring, renormalisation and scaling: (weights float32 [T, k], expert ids int64 [T, k], ascending).
std::tuple<torch::Tensor, torch::Tensor> moe_route(torch::Tensor x, torch::Tensor w, MoeParams p);
// One gated MLP (gate_up tiles, bias, down tiles, bias at w[at..at+3]) on rows x (decoder.cpp).
torch::Tensor gated_mlp(const torch::Tensor& x, const std::vector<torch::Tensor>& w, size_t at);
// layers/moe.py SparseMoE.forward on rows x: w[at] the router weight, then E experts (4 tensors each), then
// the shared expert's (moe.cpp).
torch::Tensor sparse_moe(const torch::Tensor& x, const std::vector<torch::Tensor>& w, size_t at, int64_t E,
                         const MoeParams& p);
torch::Tensor llama_decode(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> k_caches,
                           std::vector<torch::Tensor> v_caches, std::vector<torch::Tensor> k_scales,
                           std::vector<torch::Tensor> v_scales, std::vector<torch::Tensor> k_centres, bool tiles,
                           torch::Tensor slot_mapping, torch::Tensor rows,
                           torch::Tensor slots, torch::Tensor mask, torch::Tensor cos, torch::Tensor sin,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
                           torch::Tensor final_norm, std::vector<int64_t> experts, MoeParams moe);
torch::Tensor gemma_decode(torch::Tensor x, std::vector<torch::Tensor> weights, std::vector<torch::Tensor> k_caches,
                           std::vector<torch::Tensor> v_caches, std::vector<torch::Tensor> k_scales,
                           std::vector<torch::Tensor> v_scales, std::vector<torch::Tensor> k_centres, bool tiles,
                           std::vector<int64_t> sliding,
                           std::vector<torch::Tensor> full_view, std::vector<torch::Tensor> sliding_view,
                           torch::Tensor cos_global, torch::Tensor sin_global, torch::Tensor cos_local,
                           torch::Tensor sin_local, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps,
                           double scale, torch::Tensor final_norm);
