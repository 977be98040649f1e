// Index checks at the kernels' entry points: a bad slot, query offset, length or block id from the
// Python side becomes an exception that names it, not a read or write outside the cache or q.
// They run serially, before any parallel region: an exception thrown inside an OpenMP region (or
// at::parallel_for's) aborts the process. A step has a few hundred indices at most: the pass costs
// next to nothing beside the kernel.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace slotserve {

// write_kv: every slot is a token of the pool, block * block_size + offset. The engine has no
// padding slot (CUDA graphs pad with a real block), so there is no sentinel to let through.
inline void check_slots(const int64_t* slot, int64_t tokens, int64_t num_blocks, int64_t block_size) {
  const int64_t limit = num_blocks * block_size;
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < limit, "write_kv: slot_mapping[", t, "] = ", slot[t],
                " is outside the cache's ", limit, " slots (", num_blocks, " blocks of ", block_size, ")");
}

// paged_attention: request b owns query rows cu[b]..cu[b + 1]; the kernel maps every row to its request
// by these offsets, so they must tile q's rows exactly.
inline void check_query_offsets(const int32_t* cu, int64_t batch, int64_t rows) {
  TORCH_CHECK(cu[0] == 0, "paged_attention: cu_seqlens_q[0] = ", cu[0], " must be 0");
  for (int64_t b = 1; b <= batch; ++b)
    TORCH_CHECK(cu[b] >= cu[b - 1], "paged_attention: cu_seqlens_q[", b, "] = ", cu[b], " is below cu_seqlens_q[",
                b - 1, "] = ", cu[b - 1], "; the offsets must not decrease");
  TORCH_CHECK(cu[batch] == rows, "paged_attention: cu_seqlens_q[", batch, "] = ", cu[batch], " must equal q's ", rows,
              " rows");
}

// paged_attention: request b reads the first ceil(seqlens_k[b] / block_size) entries of its block
// table row; those must fit the row and name blocks of the pool. The entries after them are padding
// (0 from the engine, anything from a caller) and are not read, so not checked.
inline void check_block_reads(const int32_t* lens, const int32_t* table, int64_t batch, int64_t width,
                              int64_t block_size, int64_t num_blocks) {
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens[b], reads = (len + block_size - 1) / block_size;
    TORCH_CHECK(len >= 0 && reads <= width, "paged_attention: seqlens_k[", b, "] = ", len, " is outside [0, ",
                width * block_size, "]: the block table holds ", width, " blocks of ", block_size, " per request");
    const int32_t* row = table + b * width;
    for (int64_t i = 0; i < reads; ++i)
      TORCH_CHECK(row[i] >= 0 && row[i] < num_blocks, "paged_attention: block_table[", b, ", ", i, "] = ", row[i],
                  " is outside the cache's ", num_blocks, " blocks [0, ", num_blocks, ")");
  }
}

// paged_attention's index tensors (int32, contiguous, one row or entry per request: checked first)
// against q's rows and the pool's blocks.
inline void check_paged_indices(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& cu_seqlens_q,
                                const at::Tensor& seqlens_k, const at::Tensor& block_table, int64_t block_size) {
  const int64_t batch = seqlens_k.numel();
  const int32_t *cu = cu_seqlens_q.data_ptr<int32_t>(), *lens = seqlens_k.data_ptr<int32_t>();
  check_query_offsets(cu, batch, q.size(0));
  check_block_reads(lens, block_table.data_ptr<int32_t>(), batch, block_table.size(1),
                    block_size, k_cache.size(0));
  // A query row attends to its own key at least: fewer keys than rows would leave rows unwritten.
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(lens[b] >= cu[b + 1] - cu[b], "paged_attention: seqlens_k[", b, "] = ", lens[b], " is below request ",
                b, "'s ", cu[b + 1] - cu[b], " query rows");
}

}  // namespace slotserve
