// One layer's attention as a single dispatch from the compiled graph: slotserve_cpu::attention.
//
// The compiled decoder calls it where it would call slotserve::attention (engine/model/compiled.py),
// with the same schema. For a decode-only step, which is most steps, the engine binds the step's
// index tensors once (bind_attention_step), and each layer's call writes its K/V and runs the paged
// kernel here, in C++. The Python op did the same through a Python function and two more dispatches,
// ~1 ms of a ~30 ms step at 30 layers. Any other step (prompt chunks beside decodes, chunks after a
// cached prefix) binds nothing, and the call goes on to slotserve::attention, which the Python backend
// serves (engine/attention/cpu.py).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

namespace {

struct StepAttention {
  std::vector<at::Tensor> index;  // slot_mapping, cu_seqlens_q, seqlens_k, block_table; empty: not bound
  double scale = 1.0;
};

// Per thread, as the bound packed layers are: engines may share a process.
thread_local StepAttention step;

void bind_attention_step(const std::vector<at::Tensor>& index, double scale) {
  TORCH_CHECK(index.empty() || index.size() == 4,
              "bind_attention_step: slot_mapping, cu_seqlens_q, seqlens_k and block_table, or nothing");
  step.index = index;
  step.scale = scale;
}

c10::OperatorHandle find(const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }

at::Tensor call(const c10::OperatorHandle& op, std::vector<c10::IValue> stack) {
  op.callBoxed(&stack);
  return stack.empty() ? at::Tensor() : stack[0].toTensor();
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                     at::Tensor& v_cache) {
  if (step.index.empty()) {
    static const auto python = find("slotserve::attention");
    return call(python, {q, k, v, k_cache, v_cache});
  }
  static const auto write_kv = find("slotserve_cpu::write_kv"), paged = find("slotserve_cpu::paged_attention");
  const auto& i = step.index;
  TORCH_CHECK(i[0].numel() == q.size(0), "attention: the bound step has ", i[0].numel(), " tokens, q has ",
              q.size(0), "; the compiled decoder binds each decode step");
  call(write_kv, {k_cache, v_cache, k, v, i[0]});
  at::Tensor out = at::empty_like(q);
  call(paged, {out, q, k_cache, v_cache, i[1], i[2], i[3], step.scale});
  return out.view({q.size(0), -1});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(slotserve_cpu, m) {
  m.def("bind_attention_step(Tensor[] index, float scale) -> ()");
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache) -> Tensor");
}

TORCH_LIBRARY_IMPL(slotserve_cpu, CPU, m) {
  m.impl("attention", &attention);
}

TORCH_LIBRARY_IMPL(slotserve_cpu, CompositeExplicitAutograd, m) {
  m.impl("bind_attention_step", &bind_attention_step);
}
