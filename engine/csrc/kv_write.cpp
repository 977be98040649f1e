// The step's new K/V rows into their cache slots, in the cache's dtype: copied as they are, or
// quantized to int8 with a scale per token and head (kv_layout.h). V rows go in whole (for int8,
// interleaved with their pair's), K rows scattered into their block's key layout (transposed; for
// int8, in groups of 4 dimensions).
// Advanced indexing (index_put_) did the plain copy at ~10x the cost.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "checks.h"
#include "kv_layout.h"
#include "vec.h"

namespace {

constexpr int64_t kMaxHeadDim = 1024;

struct Slots {
  int64_t tokens, heads, D, bs, block, head;  // block, head: cache strides in elements
  const int64_t* slot;
};

// Decodes write a few rows: threads would cost more than the copies.
template <typename F>
void for_each_row(const Slots& s, F&& f) {
  at::parallel_for(0, s.tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < s.heads; ++h) f(t, h, s.slot[t] / s.bs * s.block + h * s.head, s.slot[t] % s.bs);
  });
}

template <typename T>
void write_plain(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v, const Slots& s) {
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  for_each_row(s, [&](int64_t t, int64_t h, int64_t base, int64_t offset) {
    const T* src = kp + t * k.stride(0) + h * k.stride(1);
    for (int64_t d = 0; d < s.D; ++d) kc[base + offset + d * s.bs] = src[d];
    std::memcpy(vc + base + offset * s.D, vp + t * v.stride(0) + h * v.stride(1), s.D * sizeof(T));
  });
}

// One row of D values to int8 (x ~= q[d] * scale); returns the scale (0 for a row of zeros).
template <typename T>
float quantize_row(const T* src, int64_t D, int8_t* q) {
  float x[kMaxHeadDim];
  for (int64_t d = 0; d < D; ++d) x[d] = static_cast<float>(src[d]);
  const float peak = slotserve::abs_max(x, D);
  slotserve::round_to_int8(x, D, peak > 0.f ? 127.f / peak : 0.f, q);
  return peak / 127.f;
}

template <typename T>
void write_int8(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
                const Slots& s) {
  int8_t* kc = k_cache.data_ptr<int8_t>();
  int8_t* vc = v_cache.data_ptr<int8_t>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  constexpr int64_t G = slotserve::kKeyGroup;
  for_each_row(s, [&](int64_t t, int64_t h, int64_t base, int64_t offset) {
    int8_t* kb = kc + base;
    int8_t* vb = vc + base;
    int8_t row[kMaxHeadDim];
    slotserve::token_scales(kb, s.D, s.bs)[offset] = quantize_row(kp + t * k.stride(0) + h * k.stride(1), s.D, row);
    auto* keys = reinterpret_cast<uint8_t*>(kb);  // [D / 4, block_size, 4] of int8 + 128 (kv_layout.h)
    for (int64_t d = 0; d < s.D; ++d)
      keys[(d / G) * s.bs * G + offset * G + d % G] = static_cast<uint8_t>(static_cast<int32_t>(row[d]) + 128);
    slotserve::token_scales(vb, s.D, s.bs)[offset] = quantize_row(vp + t * v.stride(0) + h * v.stride(1), s.D, row);
    int8_t* values = vb + (offset / 2) * s.D * 2 + offset % 2;  // [block_size / 2, D, 2] (kv_layout.h)
    for (int64_t d = 0; d < s.D; ++d) values[2 * d] = row[d];
  });
}

template <typename T>
void write_any(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v, const Slots& s) {
  if (k_cache.scalar_type() == at::kChar) {
    write_int8<T>(k_cache, v_cache, k, v, s);
  } else {
    TORCH_CHECK(k_cache.scalar_type() == k.scalar_type(),
                "write_kv: k, v and the caches must share one dtype (or the caches be int8)");
    write_plain<T>(k_cache, v_cache, k, v, s);
  }
}

void write_kv(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.device().is_cpu() && k_cache.device().is_cpu(), "write_kv: tensors must be on the CPU");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "write_kv: k and v must be [tokens, kv_heads, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type(),
              "write_kv: the caches must be contiguous, of one dtype");
  const int64_t D = k.size(2);
  int64_t bs;
  if (k_cache.scalar_type() == at::kChar) {
    TORCH_CHECK(k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes() && k_cache.size(1) == k.size(1) &&
                    k_cache.size(2) % (D + slotserve::kScaleBytes) == 0,
                "write_kv: int8 caches are [blocks, kv_heads, block_size * (head_dim + 4)], K and V alike");
    bs = k_cache.size(2) / (D + slotserve::kScaleBytes);
    TORCH_CHECK(bs % 16 == 0, "write_kv: an int8 cache's block_size must be a multiple of 16, got ", bs);
    TORCH_CHECK(D % slotserve::W == 0 && D <= kMaxHeadDim, "write_kv: an int8 cache's head_dim must be a multiple "
                "of ", slotserve::W, ", at most ", kMaxHeadDim, ", got ", D);
  } else {
    TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "write_kv: k_cache [blocks, kv_heads, head_dim, block_size] "
                "and v_cache [blocks, kv_heads, block_size, head_dim]");
    TORCH_CHECK(k_cache.size(1) == k.size(1) && k_cache.size(2) == D && v_cache.size(0) == k_cache.size(0) &&
                    v_cache.size(1) == k.size(1) && v_cache.size(2) == k_cache.size(3) && v_cache.size(3) == D,
                "write_kv: kv_heads, head_dim and block_size must match between k/v and the caches");
    bs = k_cache.size(3);
  }
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), "write_kv: k, v and the caches must share one dtype");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "write_kv: head_dim of k and v must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == k.size(0),
              "write_kv: slot_mapping must be contiguous int64, one slot per token");
  slotserve::check_slots(slot_mapping.data_ptr<int64_t>(), k.size(0), k_cache.size(0), bs);
  const Slots s{k.size(0), k.size(1), D, bs, k_cache.stride(0), k_cache.stride(1), slot_mapping.data_ptr<int64_t>()};
  switch (k.scalar_type()) {
    case at::kFloat: write_any<float>(k_cache, v_cache, k, v, s); break;
    case at::kBFloat16: write_any<c10::BFloat16>(k_cache, v_cache, k, v, s); break;
    case at::kHalf: write_any<c10::Half>(k_cache, v_cache, k, v, s); break;
    default: TORCH_CHECK(false, "write_kv: dtype must be float32, bfloat16 or float16, got ", k.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(slotserve_cpu, m) {
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(slotserve_cpu, CPU, m) {
  m.impl("write_kv", &write_kv);
}
