// The sampler's random draws on CPU: the same splitmix64 hash of (seed, position, token id) as
// engine/sampler.py's hashed_uniform, bit for bit, in one pass of scalar 64-bit integer
// arithmetic. Torch's int64 tensor ops take ~10 ms for a 16 x 49k step here (AVX2 has no
// 64-bit vector multiply, and every op allocates a batch-sized temporary).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr uint64_t GOLDEN = 0x9E3779B97F4A7C15ull, MUL1 = 0xBF58476D1CE4E5B9ull, MUL2 = 0x94D049BB133111EBull;
constexpr uint64_t POS_MUL = 0xD1B54A32D192ED03ull;

at::Tensor hashed_uniform(const at::Tensor& seeds, const at::Tensor& positions, int64_t vocab) {
  TORCH_CHECK(seeds.device().is_cpu() && positions.device().is_cpu(), "hashed_uniform: tensors must be on the CPU");
  TORCH_CHECK(seeds.scalar_type() == at::kLong && positions.scalar_type() == at::kLong && seeds.dim() == 1 &&
                  positions.sizes() == seeds.sizes() && seeds.is_contiguous() && positions.is_contiguous(),
              "hashed_uniform: seeds and positions must be contiguous int64 vectors of one length");
  TORCH_CHECK(vocab > 0, "hashed_uniform: vocab must be positive, got ", vocab);
  const int64_t rows = seeds.size(0);
  at::Tensor out = at::empty({rows, vocab}, seeds.options().dtype(at::kDouble));
  const int64_t* seed = seeds.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  double* u = out.data_ptr<double>();
  at::parallel_for(0, rows * vocab, 16384, [&](int64_t begin, int64_t end) {
    int64_t row = begin / vocab, token = begin % vocab;
    uint64_t base = static_cast<uint64_t>(seed[row]) * GOLDEN + static_cast<uint64_t>(pos[row]) * POS_MUL;
    for (int64_t i = begin; i < end; ++i) {
      uint64_t x = base + static_cast<uint64_t>(token) * GOLDEN;
      x = (x ^ (x >> 30)) * MUL1;
      x = (x ^ (x >> 27)) * MUL2;
      x ^= x >> 31;
      // (k + 0.5) / 2^53 as torch computes it: (2k + 1) rounds to double as k + 0.5 does, and the
      // power-of-two scale is exact, so no compiler flag can change a bit.
      u[i] = static_cast<double>(((x >> 11) << 1) | 1) * 0x1p-54;
      if (++token == vocab && i + 1 < end) {
        token = 0, ++row;
        base = static_cast<uint64_t>(seed[row]) * GOLDEN + static_cast<uint64_t>(pos[row]) * POS_MUL;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(slotserve_cpu, m) {
  m.def("hashed_uniform(Tensor seeds, Tensor positions, int vocab) -> Tensor");
}

TORCH_LIBRARY_IMPL(slotserve_cpu, CPU, m) { m.impl("hashed_uniform", &hashed_uniform); }
