// The Python module of sudu's native kernels: quant_linear.cpp (weight-only quantized linear layers, with
// act_quant.cpp quantizing their activations, gguf_tiles.cpp for GGUF's own block formats and amx_tiles.cpp
// for AMX's int8 tiles),
// attention.cpp (attention over the paged KV pool: few new tokens of many sequences, or a prompt chunk, one
// arithmetic), ops.cpp (a decoder layer's elementwise steps), decoder.cpp (a whole decode step's decoder
// stack), moe.cpp (routed experts) and bounded_head.cpp (a greedy row's candidates in the output head).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qlinear", &qlinear, "y = x @ dequant(W)^T + bias, W as packed tiles",
        py::call_guard<py::gil_scoped_release>());
  m.def("qlinear_silu", &qlinear_silu, "silu(x @ gate^T + b) * (x @ up^T + b) from fused gate | up tiles",
        py::call_guard<py::gil_scoped_release>());
  m.def("weight_tiles", &weight_tiles, "tiles of 16 rows in packed weights");
  m.def("qlinear_tiles", &qlinear_tiles, "qlinear's outputs of the given (ascending) tiles only, [M, 16 * tiles]",
        py::call_guard<py::gil_scoped_release>());
  m.def("q8_0_values", &q8_0_values, "rows of x as the 8-bit, 4-bit and Q5_0 tiles' calls quantize them (q8_0), float32");
  m.def("head_candidates", &head_candidates,
        "the output head's tiles that can hold a greedy row's argmax, from a 4-bit shadow's logits (bounded_head.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize", &dequantize, "dequant(W) as float32 (or bfloat16) [16 * tiles, K], tiles [t0, t1)",
        py::call_guard<py::gil_scoped_release>(),
        py::arg("q"), py::arg("bf16") = false, py::arg("t0") = 0, py::arg("t1") = -1);
  m.def("embedding_rows", &embedding_rows, "rows ids of the weights (K columns) as float32 [n, K]");
  m.def("tile_bytes", &tile_bytes, "bytes of one tile (16 rows) of K columns in a weight format");
  m.def("repack_gguf", &repack_gguf, "a GGUF tensor's blocks [rows, bytes] -> its tiles in a GGUF tile format",
        py::call_guard<py::gil_scoped_release>());
  py::class_<KernelOptions>(m, "KernelOptions")
      .def(py::init<>())
      .def_readwrite("vnni", &KernelOptions::vnni)
      .def_readwrite("unpack_min_rows", &KernelOptions::unpack_min_rows)
      .def_readwrite("bypass_min_rows", &KernelOptions::bypass_min_rows)
      .def_readwrite("contiguous_shares", &KernelOptions::contiguous_shares)
      .def_readwrite("fused_silu", &KernelOptions::fused_silu)
      .def_readwrite("attention512", &KernelOptions::attention512)
      .def_readwrite("amx", &KernelOptions::amx)
      .def_readwrite("amx_min_rows", &KernelOptions::amx_min_rows);
  m.def("kernel_options", &kernel_options, "the quantized products' options now (a copy)");
  m.def("set_kernel_options", &set_kernel_options, "set the quantized products' options; returns the previous ones");
  m.def("cpu_has_vnni", &cpu_has_vnni, "whether this CPU has the AVX-512 VNNI path");
  m.def("cpu_has_avx512", &cpu_has_avx512, "whether this CPU has AVX-512F (attention's wide path)");
  m.def("cpu_has_amx", &cpu_has_amx, "whether this CPU has AMX int8 tiles and the OS grants them");
  m.def("bf16_tiles_granted", &bf16_tiles_granted,
        "whether this CPU has AMX bfloat16 tiles and the OS grants them (attention's bfloat16-tile arithmetic)");
  m.def("isa", &isa, "the dot-product instruction set the calls use now");
  m.def("decode_attention", &decode_attention, "attention of few new tokens over the paged KV pool, into out",
        py::call_guard<py::gil_scoped_release>());
  m.def("prompt_attention", &prompt_attention,
        "a prompt chunk's attention over its key slots in the pool (causal from `first`, optional window), into out",
        py::call_guard<py::gil_scoped_release>());
  m.def("head_matmul", &head_matmul, "out[t, h] = x[t, h] @ w[h], each output one FMA chain (latent.cpp)");
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows: x * rsqrt(mean(x^2) + eps) * w");
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, rms_norm(x + delta))");
  m.def("silu_mul", &silu_mul, "[T, 2I] gate | up -> silu(gate) * up");
  m.def("rotary_", &rotary_, "rotate the first `heads` heads of x [T, heads_total, D] in place (rotate-half)");
  m.def("argmax_rows", &argmax_rows, "each row's argmax of float32 [R, V], as torch.argmax(dim=-1)");
  m.def("apply_token_bitmask", &apply_token_bitmask, "logits of tokens a grammar's bitmask disallows to -inf, in place");
  py::class_<MoeParams>(m, "MoeParams")
      .def(py::init<>())
      .def_readwrite("top_k", &MoeParams::top_k)
      .def_readwrite("norm_topk", &MoeParams::norm_topk)
      .def_readwrite("scaling", &MoeParams::scaling)
      .def_readwrite("sigmoid", &MoeParams::sigmoid)
      .def_readwrite("shared", &MoeParams::shared);
  m.def("moe_route", &moe_route, "each row's experts (ascending) and weights under a router weight (moe.cpp)");
  m.def("llama_decode", &llama_decode, "a llama-family decode step's decoder stack in one call (decoder.cpp)",
        py::call_guard<py::gil_scoped_release>());
  m.def("gemma_decode", &gemma_decode, "a Gemma 3 decode step's decoder stack in one call (decoder.cpp)",
        py::call_guard<py::gil_scoped_release>());
}
