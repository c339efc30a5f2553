// Portable path: any CPU, and the reference the vector paths are self-tested against.
#include "scalar_ops.h"

namespace tiered {
namespace cpu_adam {
namespace {

template <class G, class S, class O, bool kAdamW>
struct ScalarStep {
  static void run(const Buffers& b, const Hyper& h, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) step_element<G, S, O, kAdamW>(b, h, i);
  }
};

}  // namespace

void step_scalar(const Buffers& b, const Hyper& h, int64_t begin, int64_t end) {
  dispatch_all<ScalarStep>(b, h, begin, end);
}

bool all_finite_scalar(const void* grad, DType t, float scale, int64_t begin, int64_t end) {
  return all_finite_scalar_impl(grad, t, scale, begin, end);
}

}  // namespace cpu_adam
}  // namespace tiered
