// The quantized products on AMX's int8 tiles (amx_tiles.cpp): 16 activation rows at a time against one weight
// tile, every format of quant_tiles.h, with the same integers and the same float steps in the same order as
// the AVX-512 VNNI kernels, so a row's result is bit for bit what those kernels give.
#pragma once
#include <cstdint>

#include "act_quant.h"
#include "quant_tiles.h"

namespace qtiles {

// Rows the AMX kernel takes per pass (an A tile's rows).
constexpr int64_t AMX_ROWS = 16;

// Whether the CPU has AMX's int8 tiles (with AVX-512 VNNI for the float steps and the leftover rows) and the
// OS grants this process their state: asked once, the first time (Linux arch_prctl ARCH_REQ_XCOMP_PERM);
// without the grant the first tile instruction would trap.
bool amx_granted();
// The tile registers' shapes as amx_dot_tile uses them for format fmt, loaded on the calling thread (other
// code on the thread, oneDNN's GEMMs, may have loaded its own), and released after (so the OS need not save
// them).
void amx_configure(int64_t fmt);
void amx_release();
// Bytes of the B operands amx_operands assembles for one tile of K columns in format fmt.
int64_t amx_operand_bytes(int64_t fmt, int64_t K);
// One tile tp's codes as AMX B operands into buf, per 32-block 8 rows of 64 bytes (row k, lane l: weight row
// l's columns 4k..4k+3): the K-quants' exactly gguf_unpack_tile's layout, which the VNNI kernels read too
// (`unpacked`); int8's and Q5_0's with their offsets taken out (signed codes), int4's as nibbles.
void amx_operands(int64_t fmt, const uint8_t* tp, int64_t K, uint8_t* buf);
// Rows [0, rows) of x (rows a multiple of AMX_ROWS) against one tile tp of format fmt (codes: its
// amx_operands): outputs plus bias (16 values, or null) into y[m * ldy + lane], past the caches where
// bypass. Needs amx_configure on this thread.
void amx_dot_tile(int64_t fmt, const uint8_t* tp, const uint8_t* codes, int64_t rows, const ActRows& x,
                  const float* bias, float* y, int64_t ldy, bool bypass);

}  // namespace qtiles
