// What both GGUF linear kernels (gguf_linear.cpp, gguf_linear_int8.cpp) know of the file's blocks.
// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: rows of 32-weight blocks, each a float16 scale, for Q4_1 and Q5_1 a
// float16 minimum, for Q5 32 bits of fifth bits, then the quants. Q4_K, Q6_K (llama.cpp's "k-quants"): rows of 256-weight super-blocks holding eight
// 32-weight sub-blocks with 6- or 8-bit scales of their own; the kernels go through them 32 at a time.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace slotserve::gguf {

constexpr int64_t kBlock = 32;  // weights the kernels widen at once: a block, or a k-quant's sub-block

enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };

template <int64_t QT>
constexpr bool kSuper = QT == kQ4_K || QT == kQ6_K;

// Weights and bytes of one block as the file stores it.
template <int64_t QT>
constexpr int64_t kWeights = kSuper<QT> ? 256 : kBlock;
template <int64_t QT>
constexpr int64_t kBytes = QT == kQ4_0   ? 18
                           : QT == kQ4_1 ? 20
                           : QT == kQ5_0 ? 22
                           : QT == kQ5_1 ? 24
                           : QT == kQ8_0 ? 34
                           : QT == kQ4_K ? 144
                                         : 210;

inline void check_type(int64_t qtype) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ5_0 || qtype == kQ5_1 || qtype == kQ8_0 ||
                  qtype == kQ4_K || qtype == kQ6_K,
              "GGUF quant type ", qtype, " has no kernel (Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q4_K=12, Q6_K=14 do)");
}

inline int64_t block_weights(int64_t qtype) {
  check_type(qtype);
  return qtype == kQ4_K || qtype == kQ6_K ? 256 : kBlock;
}

inline int64_t block_bytes(int64_t qtype) {
  check_type(qtype);
  switch (qtype) {
    case kQ4_0: return kBytes<kQ4_0>;
    case kQ4_1: return kBytes<kQ4_1>;
    case kQ5_0: return kBytes<kQ5_0>;
    case kQ5_1: return kBytes<kQ5_1>;
    case kQ8_0: return kBytes<kQ8_0>;
    case kQ4_K: return kBytes<kQ4_K>;
    default: return kBytes<kQ6_K>;
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

inline void check_weight(const at::Tensor& blocks, int64_t qtype, int64_t k) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "GGUF weight blocks must be a contiguous uint8 [N, bytes] tensor");
  const int64_t per_block = block_weights(qtype);
  TORCH_CHECK(k % per_block == 0, "GGUF weight: K=", k, " is not a multiple of the block size ", per_block);
  TORCH_CHECK(blocks.size(1) == k / per_block * block_bytes(qtype), "GGUF weight: rows of ", blocks.size(1),
              " bytes do not hold K=", k, " weights of type ", qtype);
}

// out [M, N] float32 = x [M, K] float32 @ W^T over the file's blocks, widened to float32 in registers
// (gguf_linear.cpp).
void linear_f32(at::Tensor& out, const at::Tensor& x, const at::Tensor& blocks, int64_t qtype);

// The same over weights packed at load (engine/model/quant.py, pack_int8) with activations quantized
// per block to int8 for VNNI dot products, where int8_ready() (gguf_linear_int8.cpp).
void linear_int8(at::Tensor& out, const at::Tensor& x, const at::Tensor& quants, const at::Tensor& scales,
                 const at::Tensor& mins, int64_t qtype);
at::Tensor dequantize_packed(const at::Tensor& quants, const at::Tensor& scales, const at::Tensor& mins,
                             int64_t qtype, int64_t k);
bool int8_ready();

}  // namespace slotserve::gguf
