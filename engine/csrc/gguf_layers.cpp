// A compiled decoder's GGUF layers, named by index (engine.model.compiled). Passed as tensors, a layer's
// blocks would be three of the graph's inputs, ~360 for a 30-layer model, each fetched from its module,
// checked for size and stride, and handed through dynamo and inductor's wrappers on every step. Bound
// here once a step instead, a layer call reads its blocks from this thread's table: the graph keeps the
// index: a decode step at 1 running, default model, 2-core AVX-512 host, 0.3-0.9 ms shorter (issue 47).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <vector>

namespace slotserve::gguf {
at::Tensor mm_packed(const at::Tensor& x, const at::Tensor& quants, const at::Tensor& scales, const at::Tensor& mins,
                     int64_t qtype, int64_t max_rows);  // gguf_linear_int8.cpp
at::Tensor mm(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t max_rows,
              bool exact);  // gguf_linear.cpp
}  // namespace slotserve::gguf

namespace {

struct QuantLayer {
  at::Tensor quants;                    // the file's blocks, or quants packed for the int8 kernel
  std::optional<at::Tensor> scales;     // packed layers only
  std::optional<at::Tensor> mins;
  int64_t qtype;
  bool exact;
};

struct StepQuantLayers {
  std::vector<QuantLayer> layers;
  int64_t packed_max_rows = 0, max_rows = 0;
};

thread_local StepQuantLayers step_quant;

void bind_gguf_layers(const std::vector<at::Tensor>& quants, const std::vector<std::optional<at::Tensor>>& scales,
                      const std::vector<std::optional<at::Tensor>>& mins, const std::vector<int64_t>& qtypes,
                      const c10::List<bool>& exact, int64_t packed_max_rows, int64_t max_rows) {
  const size_t n = quants.size();
  TORCH_CHECK(scales.size() == n && mins.size() == n && qtypes.size() == n && exact.size() == n,
              "bind_gguf_layers: quants, scales, mins, qtypes and exact need one entry per layer, got ", n, ", ",
              scales.size(), ", ", mins.size(), ", ", qtypes.size(), " and ", exact.size());
  step_quant.layers.clear();
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(scales[i].has_value() == mins[i].has_value(), "bind_gguf_layers: layer ", i,
                " has scales without minimums or the reverse");
    step_quant.layers.push_back({quants[i], scales[i], mins[i], qtypes[i], exact.get(i)});
  }
  step_quant.packed_max_rows = packed_max_rows;
  step_quant.max_rows = max_rows;
}

// x [M, K] @ W^T of bound layer ``index``, in x's dtype: gguf_mm_packed or gguf_mm as the eager layer calls it.
at::Tensor gguf_layer(const at::Tensor& x, int64_t index, int64_t out_features) {
  const auto& table = step_quant.layers;
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(table.size()), "gguf_layer: layer ", index,
              " is not bound on this thread (", table.size(), " layers bound); the compiled decoder binds them "
              "for each step");
  const QuantLayer& layer = table[index];
  at::Tensor out = layer.scales ? slotserve::gguf::mm_packed(x, layer.quants, *layer.scales, *layer.mins, layer.qtype,
                                                             step_quant.packed_max_rows)
                                : slotserve::gguf::mm(x, layer.quants, layer.qtype, step_quant.max_rows, layer.exact);
  TORCH_CHECK(out.size(1) == out_features, "gguf_layer: layer ", index, " has ", out.size(1),
              " outputs, the graph was traced with ", out_features);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(slotserve_cpu, m) {
  m.def("bind_gguf_layers(Tensor[] quants, Tensor?[] scales, Tensor?[] mins, int[] qtypes, bool[] exact, "
        "int packed_max_rows, int max_rows) -> ()");
  m.def("gguf_layer(Tensor x, int index, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(slotserve_cpu, CPU, m) { m.impl("gguf_layer", &gguf_layer); }

TORCH_LIBRARY_IMPL(slotserve_cpu, CompositeExplicitAutograd, m) { m.impl("bind_gguf_layers", &bind_gguf_layers); }
