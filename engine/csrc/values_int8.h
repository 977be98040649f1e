// The probability-weighted sum of an int8 cache's values (kv_layout.h) with AVX-512 VNNI.
//
// Each probability, times its value's scale, becomes an int16 weight relative to the row's largest
// (15 bits: a token loses its weight only below 1/65534 of the largest, where 8 bits would drop
// the many small weights of a long context). Values are stored two tokens to a 32-bit lane per
// dimension, so one vpdpwssd multiplies 16 dimensions of two tokens by their two weights and adds
// them in int32: a widening and G instructions for two tokens, where the float path spends two
// widenings, two conversions and 2 * G FMAs. The int32 sums go to float at the end of each block,
// before 256 token pairs (127 * 32767 * 2 each) could overflow them.

#pragma once

#include <algorithm>
#include <cstdint>

#include "kv_layout.h"
#include "vec.h"

#if defined(__AVX512VNNI__)

namespace slotserve {

constexpr int64_t kPairsPerFlush = 256;

// w[i] = round(x[i] * inv) as int16 (saturating), for n floats (a multiple of 16).
inline void round_to_int16(const float* x, int64_t n, float inv, int16_t* w) {
  const __m512 scale = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 16) {
    const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), scale));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + i), _mm512_cvtsepi32_epi16(r));
  }
}

// out[g * (D / 16) + c0 + c] += sum over the row's first `len` tokens of w[g][t] * value_t[(c0 + c) * 16 ..],
// in int32 units, for G query heads and C vectors of 16 dimensions. w holds G rows of int16 weights,
// ld apart, whose tokens 2p and 2p + 1 are one int32 (a weight past `len` is 0, so the odd slot after
// a row's last token adds nothing whatever it holds).
template <int G, int C>
void values_row_int8(const int16_t* w, const int8_t* v_cache, const int32_t* blocks, int64_t kv_head, int64_t len,
                     const Shapes& s, int64_t ld, int64_t c0, vfloat* out) {
  const int64_t D = s.head_dim, bs = s.block_size, nblocks = (len + bs - 1) / bs;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int8_t* block = v_cache + blocks[b] * s.block + kv_head * s.head;
    if (b + 1 < nblocks) prefetch_block(v_cache + blocks[b + 1] * s.block + kv_head * s.head, s);
    const int64_t pairs = (std::min(bs, len - b * bs) + 1) / 2;
    for (int64_t p0 = 0; p0 < pairs; p0 += kPairsPerFlush) {
      __m512i acc[G][C];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_si512();
      for (int64_t p = p0; p < std::min(pairs, p0 + kPairsPerFlush); ++p) {
        __m512i x[C];
        for (int c = 0; c < C; ++c)
          x[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
              block + p * D * 2 + (c0 + c) * 32)));
        for (int g = 0; g < G; ++g) {
          int32_t pair;
          std::memcpy(&pair, w + g * ld + b * bs + 2 * p, sizeof(pair));
          const __m512i wg = _mm512_set1_epi32(pair);
          for (int c = 0; c < C; ++c) acc[g][c] = _mm512_dpwssd_epi32(acc[g][c], x[c], wg);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c)
          out[g * (D / 16) + c0 + c] += reinterpret_cast<vfloat>(_mm512_cvtepi32_ps(acc[g][c]));
    }
  }
}

// values_row_int8 over the whole head dimension and all of a row's query heads (8 at a time), from
// zeroed outputs: out[g * (D / 16) + c], in units of the row's weight scale.
inline void values_row_int8_any(const int16_t* w, const int8_t* v_cache, const int32_t* blocks, int64_t kv_head,
                                int64_t len, const Shapes& s, int64_t ld, vfloat* out) {
  const int64_t chunks = s.head_dim / 16;
  std::fill(out, out + s.group * chunks, vfloat{});
  for (int64_t g0 = 0; g0 < s.group; g0 += 8) {
    with_group(std::min<int64_t>(s.group - g0, 8), [&](auto G) {
      constexpr int g = decltype(G)::value, C = g <= 4 ? 4 : 2;
      int64_t c0 = 0;
      for (; c0 + C <= chunks; c0 += C)
        values_row_int8<g, C>(w + g0 * ld, v_cache, blocks, kv_head, len, s, ld, c0, out + g0 * chunks);
      for (; c0 < chunks; ++c0)
        values_row_int8<g, 1>(w + g0 * ld, v_cache, blocks, kv_head, len, s, ld, c0, out + g0 * chunks);
    });
  }
}

}  // namespace slotserve

#endif
