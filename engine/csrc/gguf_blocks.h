// What both GGUF linear kernels (gguf_linear.cpp, gguf_linear_int8.cpp) know of the file's blocks:
// rows of 32-weight blocks, each a float16 scale, for Q4_1 a float16 minimum, then the quants.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace slotserve::gguf {

constexpr int64_t kBlock = 32;  // weights in one block, every type here

enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

template <int64_t QT>
constexpr int64_t kBytes = QT == kQ4_0 ? 18 : QT == kQ4_1 ? 20 : 34;

inline int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return kBytes<kQ4_0>;
    case kQ4_1: return kBytes<kQ4_1>;
    case kQ8_0: return kBytes<kQ8_0>;
    default: TORCH_CHECK(false, "GGUF quant type ", qtype, " has no kernel (Q4_0=2, Q4_1=3, Q8_0=8 do)");
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
  TORCH_CHECK(k % kBlock == 0, "GGUF weight: K=", k, " is not a multiple of the block size 32");
  TORCH_CHECK(blocks.size(1) == k / kBlock * block_bytes(qtype), "GGUF weight: rows of ", blocks.size(1),
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
