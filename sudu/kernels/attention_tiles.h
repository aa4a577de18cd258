// Attention's products on AMX's bfloat16 tiles (attention_tiles.cpp): the "bfloat16 tiles" arithmetic of
// attention.cpp, one recipe for every query row whatever the call (decode, verification, prompt chunk).
#pragma once
#include <cstdint>

namespace atiles {

// Keys per block: the recipe's blocks start at absolute key positions that are multiples of KB (attention.cpp).
constexpr int64_t KB = 64;

enum class Pool { F32, F16, BF16, I8 };

// Whether this CPU has AMX's bfloat16 tiles with AVX-512 BF16, and the OS grants this process the tile state
// (asked once, as for the int8 tiles).
bool granted();

// One sequence's keys and values in the pool [S, Hkv, D] (strides ss, hs, 1), for kv head g: key index j's
// row at slots[j] * ss + g * hs.
struct Keys {
  const void *kc, *vc;
  Pool type;
  const int64_t* slots;
  int64_t ss, hs, D, g;
};

// R query rows (one query head each, D floats), row r over the keys [lo[r], hi[r]) of the list, into out[r].
struct Rows {
  int64_t R;
  const float* const* q;
  float* const* out;
  const int64_t* lo;
  const int64_t* hi;
};

// The bfloat16-tile row recipe (attention_tiles.cpp) for every row; ks / vs: an int8 pool's scales for this kv
// head, else null. D must be a multiple of 32. Needs granted().
void attend_rows(const Keys& kv, const Rows& rows, float scale, const float* ks, const float* vs);

}  // namespace atiles
