// The scalars of one Adam/AdamW step, shared by the CPU kernel (csrc/cpu_adam) and the CUDA kernel
// (csrc/gpu_adam). Torch-free, so nvcc alone compiles the .cu that includes it.
#pragma once

#include <cmath>
#include <cstdint>

namespace tiered {

// Precomputed once per call, in double as torch.optim.AdamW computes them from Python floats,
// then rounded to float once, so the inner loops are only multiplies, adds, one sqrt and the
// divides torch does.
struct AdamHyper {
  float grad_scale;       // gradient multiplier (unscale x clip coefficient)
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float eps;
  float neg_step_size;    // -lr / (1 - beta1^step)
  float bc2_sqrt;         // sqrt(1 - beta2^step)
  float decay;            // 1 - lr * weight_decay (AdamW); unused in L2 mode
  float l2;               // weight_decay (Adam, L2 mode); unused in AdamW mode
  bool adamw;
};

inline AdamHyper make_adam_hyper(int64_t step, double lr, double beta1, double beta2, double eps,
                                 double weight_decay, bool adamw_mode, double grad_scale) {
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  AdamHyper h{};
  h.grad_scale = static_cast<float>(grad_scale);
  h.beta1 = static_cast<float>(beta1);
  h.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.eps = static_cast<float>(eps);
  h.neg_step_size = static_cast<float>(-(lr / bc1));
  h.bc2_sqrt = static_cast<float>(std::pow(bc2, 0.5));
  h.decay = static_cast<float>(1.0 - lr * weight_decay);
  h.l2 = static_cast<float>(weight_decay);
  h.adamw = adamw_mode;
  return h;
}

}  // namespace tiered
