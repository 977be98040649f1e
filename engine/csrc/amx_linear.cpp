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
// contiguous run per block that the prefetcher streams. Threads take groups of column blocks as
// they finish the last; each thread loads its tile configuration and releases it when done, so
// oneDNN's own AMX kernels on the same threads configure theirs afresh.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

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
    // Column groups are handed out one at a time. With a static split, a decode step's profile had the
    // main thread in this loop ~40 % longer than the other (which waited): whichever core is busier
    // with other work sets the pace. A group (64 columns, one contiguous run of weights) is long
    // enough to stream.
    const int64_t groups = (blocks + kGroup - 1) / kGroup;
#pragma omp parallel num_threads(std::min<int64_t>(at::get_num_threads(), groups))
    {
      int tile_rows = 0;
#pragma omp for schedule(dynamic, 1)
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t nb = g * kGroup, group = std::min<int64_t>(kGroup, blocks - nb);
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
      if (tile_rows) _tile_release();
    }
  }
#endif
}

// The compiled decoder's linear layers (engine/model/compiled.py). The graph names each layer by
// its index; the running step binds the index -> weights table once, on its own thread, so one
// layer call is a single dispatch to C++ rather than a Python function (~7 us more a call, ~120 calls
// a decode step). It runs what engine/model/layers.py:linear runs eagerly: AMX tiles up to
// amx_max_rows rows where a layer has an AMX copy, oneDNN's prepacked GEMM otherwise.
struct PackedLayer {
  std::optional<at::Tensor> amx;
  at::Tensor packed;
  std::optional<at::Tensor> bias;
};

struct StepLayers {
  std::vector<PackedLayer> layers;
  int64_t amx_max_rows = 0;
};

thread_local StepLayers step_layers;

void bind_packed_layers(const std::vector<std::optional<at::Tensor>>& amx, const std::vector<at::Tensor>& packed,
                        const std::vector<std::optional<at::Tensor>>& bias, int64_t amx_max_rows) {
  TORCH_CHECK(amx.size() == packed.size() && bias.size() == packed.size(),
              "bind_packed_layers: amx, packed and bias need one entry per layer, got ", amx.size(), ", ",
              packed.size(), " and ", bias.size());
  step_layers.layers.clear();
  for (size_t i = 0; i < packed.size(); ++i) step_layers.layers.push_back({amx[i], packed[i], bias[i]});
  step_layers.amx_max_rows = amx_max_rows;
}

at::Tensor onednn_linear(const at::Tensor& x, const PackedLayer& layer, bool with_bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x, layer.packed, with_bias ? c10::IValue(layer.bias) : c10::IValue(),
                                 std::string("none"), c10::List<std::optional<at::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor packed_linear(const at::Tensor& x, int64_t index, int64_t out_features, bool with_bias) {
  const auto& table = step_layers.layers;
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(table.size()), "packed_linear: layer ", index,
              " is not bound on this thread (", table.size(), " layers bound); the compiled decoder binds them "
              "for each step");
  const PackedLayer& layer = table[index];
  if (!layer.amx || x.size(0) > step_layers.amx_max_rows) return onednn_linear(x, layer, with_bias);
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  amx_linear(out, x.stride(1) == 1 ? x : x.contiguous(), *layer.amx);
  if (with_bias && layer.bias) out.add_(*layer.bias);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(slotserve_cpu, m) {
  m.def("amx_ready() -> bool");
  m.def("amx_linear(Tensor(a!) out, Tensor x, Tensor weight) -> ()");
  m.def("bind_packed_layers(Tensor?[] amx, Tensor[] packed, Tensor?[] bias, int amx_max_rows) -> ()");
  m.def("packed_linear(Tensor x, int index, int out_features, bool with_bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(slotserve_cpu, CPU, m) {
  m.impl("amx_linear", &amx_linear);
  m.impl("packed_linear", &packed_linear);
}

TORCH_LIBRARY_IMPL(slotserve_cpu, CompositeExplicitAutograd, m) {
  m.impl("amx_ready", &amx_ready);
  m.impl("bind_packed_layers", &bind_packed_layers);
}
