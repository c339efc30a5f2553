// The codec kernels for the default target (the baseline x86-64 vector width): the path every CPU
// runs and the one the others are checked against (state_codecs_kernel.h holds the code).
#include "state_codecs_kernel.h"

namespace tiered {
namespace state_codecs {

Kernels kernels_scalar() { return {&bf16_encode_impl, &log_encode_impl, &log_decode_impl}; }

}  // namespace state_codecs
}  // namespace tiered
