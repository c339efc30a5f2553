// Torch binding of the multi-tensor CUDA Adam: checks, the chunk table, one launch per group on the
// current stream. The kernel (gpu_adam.cu) knows nothing of torch.
#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "gpu_adam.h"

namespace ga = tiered::gpu_adam;

namespace {

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return ga::kF32;
    case at::kBFloat16: return ga::kBF16;
    case at::kHalf: return ga::kF16;
    default: TORCH_CHECK_VALUE(false, "tiered_ext.gpu_adam_step: unsupported dtype ", t.scalar_type());
  }
}

void check(const at::Tensor& t, const char* name, size_t i, const at::Device& dev, int64_t n) {
  TORCH_CHECK_VALUE(t.device() == dev, "tiered_ext.gpu_adam_step: ", name, "[", i, "] is on ", t.device(),
                    ", expected ", dev);
  TORCH_CHECK_VALUE(t.dim() == 1 && t.is_contiguous(), "tiered_ext.gpu_adam_step: ", name, "[", i,
                    "] must be 1-D and contiguous");
  TORCH_CHECK_VALUE(t.numel() == n, "tiered_ext.gpu_adam_step: ", name, "[", i, "] has ", t.numel(),
                    " elements, params[", i, "] has ", n);
}

void gpu_adam_step(std::vector<at::Tensor> params, std::vector<at::Tensor> grads, std::vector<at::Tensor> exp_avgs,
                   std::vector<at::Tensor> exp_avg_sqs, c10::optional<std::vector<at::Tensor>> out_lowp,
                   int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                   bool adamw_mode, double grad_scale) {
  const size_t n = params.size();
  TORCH_CHECK_VALUE(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                        (!out_lowp.has_value() || out_lowp->size() == n),
                    "tiered_ext.gpu_adam_step: tensor lists must have equal lengths");
  if (n == 0) return;
  TORCH_CHECK_VALUE(step >= 1, "tiered_ext.gpu_adam_step: step must be >= 1");
  TORCH_CHECK_VALUE(std::isfinite(lr) && lr >= 0.0, "tiered_ext.gpu_adam_step: lr must be >= 0");
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0 && beta2 >= 0.0 && beta2 < 1.0,
                    "tiered_ext.gpu_adam_step: betas must be in [0, 1)");
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps > 0.0, "tiered_ext.gpu_adam_step: eps must be > 0");
  const at::Device dev = params[0].device();
  TORCH_CHECK_VALUE(dev.is_cuda(), "tiered_ext.gpu_adam_step: params must be CUDA tensors");
  const int gt = dtype_code(grads[0]), st = dtype_code(exp_avgs[0]);
  const int ot = out_lowp.has_value() ? dtype_code((*out_lowp)[0]) : ga::kNone;
  TORCH_CHECK_VALUE(st != ga::kF16 && ot != ga::kF32, "tiered_ext.gpu_adam_step: unsupported dtype combination");

  std::vector<ga::TensorDesc> tensors(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = params[i].numel();
    check(params[i], "params", i, dev, numel);
    check(grads[i], "grads", i, dev, numel);
    check(exp_avgs[i], "exp_avgs", i, dev, numel);
    check(exp_avg_sqs[i], "exp_avg_sqs", i, dev, numel);
    TORCH_CHECK_VALUE(params[i].scalar_type() == at::kFloat, "params[", i, "] must be float32");
    TORCH_CHECK_VALUE(dtype_code(grads[i]) == gt, "grads[", i, "] dtype differs within the group");
    TORCH_CHECK_VALUE(dtype_code(exp_avgs[i]) == st && dtype_code(exp_avg_sqs[i]) == st, "exp_avgs[", i,
                      "] / exp_avg_sqs[", i, "] dtype differs within the group");
    void* out = nullptr;
    if (out_lowp.has_value()) {
      check((*out_lowp)[i], "out_lowp", i, dev, numel);
      TORCH_CHECK_VALUE(dtype_code((*out_lowp)[i]) == ot, "out_lowp[", i, "] dtype differs within the group");
      out = (*out_lowp)[i].data_ptr();
    }
    tensors[i] = {params[i].data_ptr<float>(), grads[i].data_ptr(), exp_avgs[i].data_ptr(),
                  exp_avg_sqs[i].data_ptr(), out, numel};
  }
  const std::vector<ga::ChunkDesc> chunks = ga::plan_chunks(tensors.data(), static_cast<int64_t>(n));
  if (chunks.empty()) return;

  const ga::Hyper h = tiered::make_adam_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, grad_scale);

  // Tensor and chunk tables travel in one small H2D copy, stream-ordered before the launch. The
  // pinned host block stays valid until the copy ran (torch's host allocator records an event on
  // non-blocking copies), and the device block was allocated on this stream, so both may be freed
  // on return.
  const size_t tbytes = tensors.size() * sizeof(ga::TensorDesc);
  const size_t cbytes = chunks.size() * sizeof(ga::ChunkDesc);
  auto host = at::empty({static_cast<int64_t>(tbytes + cbytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), tensors.data(), tbytes);
  std::memcpy(static_cast<char*>(host.data_ptr()) + tbytes, chunks.data(), cbytes);
  auto dev_meta = host.to(dev, /*non_blocking=*/true);
  auto* base = static_cast<char*>(dev_meta.data_ptr());
  auto stream = c10::cuda::getCurrentCUDAStream(dev.index());
  const int err = ga::launch(reinterpret_cast<const ga::TensorDesc*>(base),
                             reinterpret_cast<const ga::ChunkDesc*>(base + tbytes),
                             static_cast<int64_t>(chunks.size()), gt, st, ot, h, stream.stream());
  TORCH_CHECK(err == 0, "tiered_ext.gpu_adam_step: kernel launch failed: ", ga::error_string(err));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tiered multi-tensor CUDA Adam (see tiered_ext/__init__.py for the documented API)";
  m.def("gpu_adam_step", &gpu_adam_step, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("out_lowp"), py::arg("step"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw_mode"), py::arg("grad_scale"));
}
