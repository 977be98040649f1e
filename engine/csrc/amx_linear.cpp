// bfloat16 linear layers on AMX tiles for steps of up to a few hundred rows (decode steps, and
// decodes with a short prompt chunk).
//
// A decode step reads every weight once and does ~16 multiply-adds per weight: it is bound by
// memory bandwidth, and oneDNN's GEMM (through torch) reaches ~15-20 GB/s on it here, plus ~20 us
// of fixed cost a call. One AMX tile multiply covers 16 rows, 16 output columns and 32 of K, so
// this loop does little but stream the weights (measured 28-45 GB/s). Larger inputs take the rows
// 16 at a time in panels that stay in L2 while each group of columns passes over them; past
// ~1,000 rows oneDNN's blocking for caches is faster (engine/model/layers.py, AMX_MAX_ROWS).
//
// Weights are packed once (engine/model/layers.py, pack_amx) as [N/16, K/32, 16, 16, 2]: for each
// 16-column block, K/32 tiles of 16 rows of K-pairs x 16 columns, the layout TDPBF16PS reads, one
// contiguous run per block that the prefetcher streams. Threads split the column blocks; each
// thread loads its tile configuration and releases it when done, so oneDNN's own AMX kernels on
// the same threads configure theirs afresh.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define SLOTSERVE_AMX 1
#endif

namespace {

#ifdef SLOTSERVE_AMX

constexpr int kTileK = 32;   // bf16 values of K in one tile row (64 bytes)
constexpr int kBlockN = 16;  // output columns of one C tile
constexpr int kGroup = 4;    // column blocks sharing each A tile load (C tiles 0-3)
constexpr int64_t kPanelRows = 512;  // rows of x that stay in L2 while every column group passes over them
constexpr int64_t kBlockTile = kTileK * kBlockN;  // bf16 values in one B tile

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool request_tile_state() {
  constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Tiles 0-3: C, m x 16 fp32; 4: A, m rows x 32 bf16; 5 and 6: B, 16 K-pairs x 16 columns.
void configure(int m) {
  TileConfig c;
  for (int t = 0; t < kGroup; ++t) {
    c.rows[t] = m;
    c.colsb[t] = kBlockN * 4;
  }
  c.rows[4] = m;
  c.colsb[4] = kTileK * 2;
  for (int t = 5; t < 7; ++t) {
    c.rows[t] = kTileK / 2;
    c.colsb[t] = kBlockN * 4;
  }
  _tile_loadconfig(&c);
}

// out[:, 16*nb0 : 16*(nb0+NB)] = x @ W^T for NB consecutive column blocks.
template <int NB>
void column_group(const at::BFloat16* x, int64_t ldx, const at::BFloat16* w, int64_t k_tiles, int64_t nb0, int m,
                  at::BFloat16* out, int64_t ldo) {
  const int64_t block = k_tiles * kBlockTile;
  const at::BFloat16* wb = w + nb0 * block;
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    const at::BFloat16* wk = wb + kt * kBlockTile;
    _tile_loadd(4, x + kt * kTileK, ldx * 2);
    _tile_loadd(5, wk, 64);
    if constexpr (NB > 1) _tile_loadd(6, wk + block, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NB > 1) _tile_dpbf16ps(1, 4, 6);
    if constexpr (NB > 2) {
      _tile_loadd(5, wk + 2 * block, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (NB > 3) {
      _tile_loadd(6, wk + 3 * block, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  alignas(64) float c[kGroup][16][kBlockN];
  _tile_stored(0, c[0], 64);
  if constexpr (NB > 1) _tile_stored(1, c[1], 64);
  if constexpr (NB > 2) _tile_stored(2, c[2], 64);
  if constexpr (NB > 3) _tile_stored(3, c[3], 64);
  for (int b = 0; b < NB; ++b) {
    for (int r = 0; r < m; ++r) {
      const __m256bh row = _mm512_cvtneps_pbh(_mm512_load_ps(c[b][r]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + (nb0 + b) * kBlockN), (__m256i)row);
    }
  }
}

#endif  // SLOTSERVE_AMX

bool amx_ready() {
#ifdef SLOTSERVE_AMX
  static const bool granted = request_tile_state();
  return granted;
#else
  return false;
#endif
}

void amx_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(amx_ready(), "amx_linear: this build or process has no AMX tiles");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && weight.dim() == 5, "amx_linear: x and out are 2-D, the packed "
              "weight [N/16, K/32, 16, 16, 2]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                  weight.scalar_type() == at::kBFloat16, "amx_linear: tensors must be bfloat16");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  TORCH_CHECK(out.size(0) == m, "amx_linear: out must have as many rows as x, got ", out.size(0), " and ", m);
  TORCH_CHECK(weight.is_contiguous() && weight.size(0) * 16 == n && weight.size(1) * 32 == k &&
                  weight.size(2) == 16 && weight.size(3) == 16 && weight.size(4) == 2,
              "amx_linear: packed weight of shape ", weight.sizes(), " does not match x ", x.sizes(), " and out ",
              out.sizes());
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "amx_linear: rows of x and out must be contiguous");
  if (m == 0) return;
#ifdef SLOTSERVE_AMX
  const auto* xp = x.const_data_ptr<at::BFloat16>();
  const auto* wp = weight.const_data_ptr<at::BFloat16>();
  auto* op = out.mutable_data_ptr<at::BFloat16>();
  const int64_t blocks = n / kBlockN, k_tiles = k / kTileK, ldx = x.stride(0), ldo = out.stride(0);
  for (int64_t p0 = 0; p0 < m; p0 += kPanelRows) {
    const int64_t p1 = std::min(m, p0 + kPanelRows);
    at::parallel_for(0, blocks, kGroup, [&](int64_t begin, int64_t end) {
      int tile_rows = 0;
      for (int64_t nb = begin; nb < end; nb += kGroup) {
        const int64_t group = std::min<int64_t>(kGroup, end - nb);
        for (int64_t r0 = p0; r0 < p1; r0 += 16) {
          const int rows = static_cast<int>(std::min<int64_t>(16, p1 - r0));
          if (rows != tile_rows) {
            configure(rows);
            tile_rows = rows;
          }
          const at::BFloat16* xr = xp + r0 * ldx;
          at::BFloat16* orow = op + r0 * ldo;
          switch (group) {
            case 4: column_group<4>(xr, ldx, wp, k_tiles, nb, rows, orow, ldo); break;
            case 3: column_group<3>(xr, ldx, wp, k_tiles, nb, rows, orow, ldo); break;
            case 2: column_group<2>(xr, ldx, wp, k_tiles, nb, rows, orow, ldo); break;
            default: column_group<1>(xr, ldx, wp, k_tiles, nb, rows, orow, ldo);
          }
        }
      }
      _tile_release();
    });
  }
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(slotserve_cpu, m) {
  m.def("amx_ready() -> bool");
  m.def("amx_linear(Tensor(a!) out, Tensor x, Tensor weight) -> ()");
}

TORCH_LIBRARY_IMPL(slotserve_cpu, CPU, m) {
  m.impl("amx_linear", &amx_linear);
}

TORCH_LIBRARY_IMPL(slotserve_cpu, CompositeExplicitAutograd, m) {
  m.impl("amx_ready", &amx_ready);
}
