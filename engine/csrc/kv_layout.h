// The KV cache layouts, shared by the writer (kv_write.cpp) and the attention kernel.
//
// Unquantized caches: K [num_blocks, kv_heads, head_dim, block_size] (keys transposed, so one vector
// holds a dimension of W consecutive keys), V [num_blocks, kv_heads, block_size, head_dim].
//
// A quantized layer cache is [num_blocks, kv_heads, block_size * (head_dim + 4)] int8, K and V alike.
// One head's block holds its block_size * head_dim values, then block_size float32 scales, one per
// token: x ~= int8 * scale, with scale = max |x| over the token's head_dim values / 127.
// - V values: [block_size / 2, head_dim, 2] int8: the two tokens of a pair side by side in each
//   dimension, a 32-bit lane of two int16 once widened, what vpdpwssd multiplies by their two weights.
// - K values: [head_dim / 4, block_size, 4], stored as uint8 = int8 + 128: four consecutive
//   dimensions of a key are one 32-bit lane, what AVX-512 VNNI's vpdpbusd multiplies (unsigned by
//   signed bytes) against four dimensions of a query; the +128 comes back out as 128 * sum(query),
//   once per score.
// A scale per token and head costs 4 bytes in 68 at head_dim 64 and keeps an outlier token from
// flattening its neighbours; the kernel applies it once per score and once per probability, never
// per element.
#pragma once

#include <cstdint>

namespace slotserve {

struct Shapes {
  int64_t heads, kv_heads, group, head_dim, block_size, table_width;
  int64_t q_row, block, head;  // strides, in elements (the same for K and V)
};

constexpr int64_t kKeyGroup = 4;  // dimensions of an int8 key in one 32-bit lane

constexpr int64_t kScaleBytes = sizeof(float);

// The block_size scales of one head's block (`head_block` points at its first value).
inline const float* token_scales(const int8_t* head_block, int64_t head_dim, int64_t block_size) {
  return reinterpret_cast<const float*>(head_block + head_dim * block_size);
}

inline float* token_scales(int8_t* head_block, int64_t head_dim, int64_t block_size) {
  return reinterpret_cast<float*>(head_block + head_dim * block_size);
}

// The next block lives anywhere in the pool: the hardware prefetcher cannot guess the jump.
template <typename T>
inline void prefetch_block(const T* first, const Shapes& s) {
  const char* p = reinterpret_cast<const char*>(first);
  const int64_t bytes = s.head * static_cast<int64_t>(sizeof(T));
  for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(p + byte, 0, 1);
}

}  // namespace slotserve
