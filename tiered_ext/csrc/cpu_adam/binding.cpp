// Python binding of the fused CPU Adam: argument checks (again, after the Python layer's), the
// OpenMP split over blocks, and the GIL released for the whole call. The kernels themselves live in
// cpu_adam_{scalar,avx2,avx512}.cpp and know nothing of torch.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <vector>

#include "cpu_adam.h"

namespace ca = tiered::cpu_adam;

// state_codecs_binding.cpp: the native optimizer-state codecs, on the same ISA choice
void bind_state_codecs(pybind11::module_& m, const std::atomic<int>& isa);

namespace {

std::atomic<int> g_isa{static_cast<int>(ca::best_isa())};

// [Note: block split]
// Threads get contiguous runs of 64 Ki-element blocks (at::parallel_for: one static chunk per
// thread), so each thread streams its own region of all five buffers; work below one block runs
// on the calling thread (no fork/join cost for small tensors). A many-partition call numbers the
// blocks of all its partitions in a row, so it forks and joins once (measured on 2 threads, 32
// tensors of 1-4 Mi elements: one call per tensor lost ~20% to one join each).
constexpr int64_t kBlock = int64_t{1} << 16;

ca::DType dtype_of(const at::Tensor& t, const char* name, bool allow_f32, bool allow_lowp) {
  const auto st = t.scalar_type();
  if (allow_f32 && st == at::kFloat) return ca::DType::kF32;
  if (allow_lowp && st == at::kBFloat16) return ca::DType::kBF16;
  if (allow_lowp && st == at::kHalf) return ca::DType::kF16;
  TORCH_CHECK_VALUE(false, "tiered_ext.adam_step: ", name, " has unsupported dtype ", st);
}

void check_buffer(const at::Tensor& t, const char* name, int64_t n, bool flat) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "tiered_ext.adam_step: ", name, " must be a CPU tensor, got ",
                    t.device());
  TORCH_CHECK_VALUE((t.dim() == 1 || !flat) && t.is_contiguous(), "tiered_ext.adam_step: ", name,
                    flat ? " must be 1-D and contiguous" : " must be contiguous");
  TORCH_CHECK_VALUE(t.numel() == n, "tiered_ext.adam_step: ", name, " has ", t.numel(),
                    " elements, param has ", n);
}

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  const auto* a0 = static_cast<const char*>(a.data_ptr());
  const auto* b0 = static_cast<const char*>(b.data_ptr());
  const auto* a1 = a0 + a.numel() * a.element_size();
  const auto* b1 = b0 + b.numel() * b.element_size();
  return a.numel() > 0 && b.numel() > 0 && a0 < b1 && b0 < a1;
}

// Checks one partition's buffers (device, layout, size, dtype, overlap) and returns the kernel's view
// of them; raises ValueError before any memory is touched.
ca::Buffers checked_buffers(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                            const at::Tensor& exp_avg_sq, const c10::optional<at::Tensor>& out_lowp, bool flat) {
  // flat=false (tiered.optim.CPUAdam) accepts contiguous tensors of any shape with equal numel:
  // a step over a parameter's storage, saving four .view(-1) calls per parameter.
  const int64_t n = param.numel();
  check_buffer(param, "param", n, flat);
  check_buffer(grad, "grad", n, flat);
  check_buffer(exp_avg, "exp_avg", n, flat);
  check_buffer(exp_avg_sq, "exp_avg_sq", n, flat);
  dtype_of(param, "param", true, false);
  const ca::DType gt = dtype_of(grad, "grad", true, true);
  const ca::DType st = dtype_of(exp_avg, "exp_avg", true, true);
  TORCH_CHECK_VALUE(st != ca::DType::kF16, "tiered_ext.adam_step: exp_avg must be float32 or bfloat16");
  TORCH_CHECK_VALUE(exp_avg_sq.scalar_type() == exp_avg.scalar_type(),
                    "tiered_ext.adam_step: exp_avg_sq dtype must equal exp_avg dtype");
  ca::DType ot = ca::DType::kNone;
  void* out = nullptr;
  std::vector<std::pair<const at::Tensor*, const char*>> bufs = {
      {&param, "param"}, {&grad, "grad"}, {&exp_avg, "exp_avg"}, {&exp_avg_sq, "exp_avg_sq"}};
  if (out_lowp.has_value()) {
    check_buffer(*out_lowp, "out_lowp", n, flat);
    ot = dtype_of(*out_lowp, "out_lowp", false, true);
    out = out_lowp->data_ptr();
    bufs.emplace_back(&*out_lowp, "out_lowp");
  }
  for (size_t i = 0; i < bufs.size(); ++i)
    for (size_t j = i + 1; j < bufs.size(); ++j)
      TORCH_CHECK_VALUE(!overlaps(*bufs[i].first, *bufs[j].first), "tiered_ext.adam_step: ",
                        bufs[i].second, " and ", bufs[j].second, " share memory");
  return ca::Buffers{param.data_ptr<float>(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                     out, gt, st, ot};
}

void check_scalars(int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                   double grad_scale) {
  TORCH_CHECK_VALUE(step >= 1, "tiered_ext.adam_step: step must be >= 1 (1-based), got ", step);
  TORCH_CHECK_VALUE(std::isfinite(lr) && lr >= 0.0, "tiered_ext.adam_step: lr must be >= 0, got ", lr);
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, "tiered_ext.adam_step: beta1 must be in [0, 1)");
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, "tiered_ext.adam_step: beta2 must be in [0, 1)");
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps > 0.0, "tiered_ext.adam_step: eps must be > 0");
  TORCH_CHECK_VALUE(std::isfinite(weight_decay) && weight_decay >= 0.0,
                    "tiered_ext.adam_step: weight_decay must be >= 0");
  TORCH_CHECK_VALUE(std::isfinite(grad_scale), "tiered_ext.adam_step: grad_scale must be finite");
}

// One partition of a (possibly multi-partition) step, with its own scalars.
struct Part {
  ca::Buffers b;
  ca::Hyper h;
  int64_t n;
};

// The step over every part in one parallel region ([Note: block split]): the blocks of all parts are
// numbered in a row and each thread takes one contiguous run of them, so a group of many tensors pays
// one fork/join, not one per tensor, and the threads' shares stay equal however the sizes fall.
// Returns true (nothing modified) when check_finite finds an inf/NaN gradient in any part.
bool run_parts(const std::vector<Part>& parts, bool check_finite) {
  std::vector<int64_t> first_block(parts.size() + 1, 0);  // prefix sums of the parts' block counts
  for (size_t i = 0; i < parts.size(); ++i)
    first_block[i + 1] = first_block[i] + (parts[i].n + kBlock - 1) / kBlock;
  const int64_t nblocks = first_block.back();
  if (nblocks == 0) return false;
  const auto isa = static_cast<ca::Isa>(g_isa.load());
  // Calls fn(part, begin, end) for the element ranges that global blocks [b0, b1) cover.
  auto for_blocks = [&](int64_t b0, int64_t b1, auto&& fn) {
    size_t i = std::upper_bound(first_block.begin(), first_block.end(), b0) - first_block.begin() - 1;
    for (int64_t blk = b0; blk < b1 && i < parts.size(); ++i) {
      const int64_t last = std::min(b1, first_block[i + 1]);
      if (last <= blk) continue;
      const int64_t begin = (blk - first_block[i]) * kBlock;
      const int64_t end = std::min(parts[i].n, (last - first_block[i]) * kBlock);
      fn(parts[i], begin, end);
      blk = last;
    }
  };
  if (check_finite) {
    // A separate read-only pass: "nothing modified" on overflow needs the verdict before any write.
    const ca::FiniteFn finite_fn = ca::finite_fn(isa);
    std::atomic<bool> bad{false};
    at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
      for_blocks(b0, b1, [&](const Part& p, int64_t begin, int64_t end) {
        if (!finite_fn(p.b.grad, p.b.grad_t, p.h.grad_scale, begin, end)) bad.store(true);
      });
    });
    if (bad.load()) return true;
  }
  const ca::StepFn step_fn = ca::step_fn(isa);
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for_blocks(b0, b1, [&](const Part& p, int64_t begin, int64_t end) { step_fn(p.b, p.h, begin, end); });
  });
  return false;
}

bool adam_step(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq, int64_t step,
               double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw_mode,
               double grad_scale, c10::optional<at::Tensor> out_lowp, bool check_finite, bool flat) {
  const ca::Buffers b = checked_buffers(param, grad, exp_avg, exp_avg_sq, out_lowp, flat);
  check_scalars(step, lr, beta1, beta2, eps, weight_decay, grad_scale);
  const ca::Hyper h = tiered::make_adam_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, grad_scale);
  return run_parts({Part{b, h, param.numel()}}, check_finite);
}

// Many partitions, each with its own step count, in one parallel region (tiered.optim.CPUAdam's
// parameter groups, the "gpu" tier's groups on a CPU machine). Every tensor is checked before any
// is touched: a refusal leaves all of them as they were.
bool adam_step_many(std::vector<at::Tensor> params, std::vector<at::Tensor> grads, std::vector<at::Tensor> exp_avgs,
                    std::vector<at::Tensor> exp_avg_sqs, c10::optional<std::vector<at::Tensor>> out_lowp,
                    std::vector<int64_t> steps, double lr, double beta1, double beta2, double eps,
                    double weight_decay, bool adamw_mode, double grad_scale, bool check_finite, bool flat) {
  const size_t n = params.size();
  TORCH_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n &&
                        (!out_lowp.has_value() || out_lowp->size() == n),
                    "tiered_ext.adam_step_many: the lists must have equal lengths");
  std::vector<Part> parts;
  parts.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const c10::optional<at::Tensor> out = out_lowp.has_value() ? c10::optional<at::Tensor>((*out_lowp)[i])
                                                                 : c10::nullopt;
    try {
      parts.push_back(Part{checked_buffers(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], out, flat),
                           ca::Hyper{}, params[i].numel()});
      check_scalars(steps[i], lr, beta1, beta2, eps, weight_decay, grad_scale);
    } catch (const c10::ValueError& e) {
      TORCH_CHECK_VALUE(false, "[", i, "]: ", e.what_without_backtrace());
    }
    parts.back().h =
        tiered::make_adam_hyper(steps[i], lr, beta1, beta2, eps, weight_decay, adamw_mode, grad_scale);
  }
  // Nor may the buffers the kernel writes overlap across partitions (the same tensor twice would be
  // stepped twice); checked_buffers covered each partition's own buffers, gradients included.
  struct Span {
    const char* begin;
    const char* end;
    const char* name;
    size_t index;
  };
  std::vector<Span> spans;
  auto add = [&](const at::Tensor& t, const char* name, size_t i) {
    if (t.numel() == 0) return;
    const auto* b = static_cast<const char*>(t.data_ptr());
    spans.push_back({b, b + t.numel() * t.element_size(), name, i});
  };
  for (size_t i = 0; i < n; ++i) {
    add(params[i], "params", i);
    add(exp_avgs[i], "exp_avgs", i);
    add(exp_avg_sqs[i], "exp_avg_sqs", i);
    if (out_lowp.has_value()) add((*out_lowp)[i], "out_lowp", i);
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t k = 1; k < spans.size(); ++k)
    TORCH_CHECK_VALUE(spans[k].begin >= spans[k - 1].end, "tiered_ext.adam_step_many: ", spans[k - 1].name, "[",
                      spans[k - 1].index, "] and ", spans[k].name, "[", spans[k].index,
                      "] share memory (the same tensor passed twice?)");
  return run_parts(parts, check_finite);
}

ca::Isa isa_from_name(const std::string& name) {
  for (auto isa : {ca::Isa::kScalar, ca::Isa::kAvx2, ca::Isa::kAvx512})
    if (name == ca::isa_name(isa)) return isa;
  TORCH_CHECK_VALUE(false, "unknown ISA '", name, "': expected scalar, avx2 or avx512");
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> out;
  for (auto isa : {ca::Isa::kScalar, ca::Isa::kAvx2, ca::Isa::kAvx512})
    if (ca::cpu_supports(isa)) out.emplace_back(ca::isa_name(isa));
  return out;
}

void set_isa(const std::string& name) {
  const auto isa = isa_from_name(name);
  TORCH_CHECK_VALUE(ca::cpu_supports(isa), "this CPU cannot run the ", name, " path");
  g_isa.store(static_cast<int>(isa));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tiered fused CPU Adam (see tiered_ext/__init__.py for the documented API)";
  m.def("adam_step", &adam_step, py::call_guard<py::gil_scoped_release>(), py::arg("param"),
        py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("step"), py::arg("lr"),
        py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw_mode"),
        py::arg("grad_scale"), py::arg("out_lowp"), py::arg("check_finite"), py::arg("flat") = true);
  m.def("adam_step_many", &adam_step_many, py::call_guard<py::gil_scoped_release>(), py::arg("params"),
        py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("out_lowp"), py::arg("steps"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("adamw_mode"), py::arg("grad_scale"), py::arg("check_finite"), py::arg("flat") = true);
  bind_state_codecs(m, g_isa);
  m.def("supported_isas", &supported_isas);
  m.def("get_isa", [] { return std::string(ca::isa_name(static_cast<ca::Isa>(g_isa.load()))); });
  m.def("set_isa", &set_isa);
  m.def("self_test", [](const std::string& name) { return ca::self_test(isa_from_name(name)); },
        py::call_guard<py::gil_scoped_release>());
  m.def("num_threads", [] { return at::get_num_threads(); });
  // True only in the test-only build whose AVX-512 path is emulated (tiered_ext/_avx512_emulated.py).
  m.def("emulated", [] {
#ifdef TIERED_SIMD_EMULATION
    return true;
#else
    return false;
#endif
  });
}
