// Python binding of the native optimizer-state codecs (tiered/optim/state_codecs.py calls them when
// this module is built, its pure-torch codecs otherwise): argument checks, the OpenMP split and the
// GIL released. The kernels (state_codecs_kernel.h) give every element the same bits on any thread
// count and split, since an element's noise is a function of its global index only.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>

#include "state_codecs.h"

namespace sc = tiered::state_codecs;

namespace {

constexpr int64_t kGrain = int64_t{1} << 16;  // elements per thread's work unit, as [Note: block split]

sc::Kernels kernels_for(int isa) {
  switch (static_cast<sc::Isa>(isa)) {
    case sc::Isa::kAvx512: return sc::kernels_avx512();
    case sc::Isa::kAvx2: return sc::kernels_avx2();
    default: return sc::kernels_scalar();
  }
}

void check_flat(const at::Tensor& t, const char* name, at::ScalarType st, int64_t n) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.dim() == 1 && t.is_contiguous() && t.scalar_type() == st,
                    "tiered_ext state codec: ", name, " must be a flat contiguous CPU ", st, " tensor, got ",
                    t.scalar_type(), " ", t.sizes());
  TORCH_CHECK_VALUE(n < 0 || t.numel() == n, "tiered_ext state codec: ", name, " has ", t.numel(),
                    " elements, expected ", n);
}

sc::LogCodec log_codec(const at::Tensor& grid, int64_t levels, int64_t steps, bool is_signed, bool sqrt_domain) {
  TORCH_CHECK_VALUE(levels >= 1 && levels <= 255 && steps >= 1, "tiered_ext state codec: bad levels/steps");
  check_flat(grid, "grid", at::kFloat, levels + 1);
  return sc::LogCodec{grid.data_ptr<float>(), static_cast<int>(levels), static_cast<int>(steps), is_signed,
                      sqrt_domain};
}

}  // namespace

void bind_state_codecs(pybind11::module_& m, const std::atomic<int>& isa) {
  namespace py = pybind11;
  m.def(
      "bf16_encode",
      [&isa](const at::Tensor& x, const at::Tensor& out, int64_t key, int64_t index0) {
        check_flat(x, "x", at::kFloat, -1);
        check_flat(out, "out", at::kShort, x.numel());
        const auto fn = kernels_for(isa.load()).bf16_encode;
        const float* xp = x.data_ptr<float>();
        auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<int16_t>());
        std::atomic<bool> odd{false};
        at::parallel_for(0, x.numel(), kGrain, [&](int64_t a, int64_t b) {
          if (fn(xp, op, a, b, static_cast<uint64_t>(key), index0)) odd.store(true);
        });
        return odd.load();
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("out"), py::arg("key"), py::arg("index0"));
  m.def(
      "log_encode",
      [&isa](const at::Tensor& x, const at::Tensor& scales, const at::Tensor& codes, const at::Tensor& grid,
             int64_t levels, int64_t steps, bool is_signed, bool sqrt_domain, int64_t key, int64_t index0) {
        const int64_t n = x.numel(), nb = (n + sc::kBlock - 1) / sc::kBlock;
        check_flat(x, "x", at::kFloat, -1);
        check_flat(scales, "scales", at::kFloat, nb);
        check_flat(codes, "codes", at::kByte, n);
        const sc::LogCodec cd = log_codec(grid, levels, steps, is_signed, sqrt_domain);
        const auto fn = kernels_for(isa.load()).log_encode;
        const float* xp = x.data_ptr<float>();
        float* sp = scales.data_ptr<float>();
        uint8_t* cp = codes.data_ptr<uint8_t>();
        at::parallel_for(0, nb, kGrain / sc::kBlock, [&](int64_t b0, int64_t b1) {
          fn(cd, xp, sp, cp, n, b0, b1, static_cast<uint64_t>(key), index0);
        });
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("scales"), py::arg("codes"), py::arg("grid"),
      py::arg("levels"), py::arg("steps"), py::arg("is_signed"), py::arg("sqrt_domain"), py::arg("key"),
      py::arg("index0"));
  m.def(
      "log_decode",
      [&isa](const at::Tensor& scales, const at::Tensor& codes, const at::Tensor& out, const at::Tensor& table,
             bool is_signed, bool sqrt_domain) {
        const int64_t n = out.numel(), nb = (n + sc::kBlock - 1) / sc::kBlock;
        check_flat(out, "out", at::kFloat, -1);
        check_flat(scales, "scales", at::kFloat, nb);
        check_flat(codes, "codes", at::kByte, n);
        check_flat(table, "table", at::kFloat, 256);
        const sc::LogCodec cd{nullptr, 255, 1, is_signed, sqrt_domain};
        const auto fn = kernels_for(isa.load()).log_decode;
        const float* tp = table.data_ptr<float>();
        const float* sp = scales.data_ptr<float>();
        const uint8_t* cp = codes.data_ptr<uint8_t>();
        float* op = out.data_ptr<float>();
        at::parallel_for(0, n, kGrain, [&](int64_t a, int64_t b) { fn(cd, tp, sp, cp, op, a, b); });
      },
      py::call_guard<py::gil_scoped_release>(), py::arg("scales"), py::arg("codes"), py::arg("out"), py::arg("table"),
      py::arg("is_signed"), py::arg("sqrt_domain"));
}
