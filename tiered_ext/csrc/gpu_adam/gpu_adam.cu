// Multi-tensor fused Adam/AdamW kernel. The per-element arithmetic is the CPU kernel's
// ([Note: bitwise-identical paths] in ../cpu_adam/scalar_ops.h): explicit round-to-nearest intrinsics (__fmaf_rn where the CPU fuses, __fmul_rn/__fadd_rn elsewhere),
// IEEE sqrt and divide (__fsqrt_rn, __fdiv_rn), built with --fmad=false, so a GPU step gives
// the same bits as the CPU one.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "gpu_adam.h"

namespace tiered {
namespace gpu_adam {
namespace {

struct F32 {
  using T = float;
  __device__ static float load(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
  __device__ static void store(void* p, int64_t i, float x) { static_cast<float*>(p)[i] = x; }
};
struct BF16 {
  __device__ static float load(const void* p, int64_t i) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
  __device__ static void store(void* p, int64_t i, float x) {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
  }
};
struct F16 {
  __device__ static float load(const void* p, int64_t i) { return __half2float(static_cast<const __half*>(p)[i]); }
  __device__ static void store(void* p, int64_t i, float x) { static_cast<__half*>(p)[i] = __float2half_rn(x); }
};
struct NoOut {
  __device__ static void store(void*, int64_t, float) {}
};

template <class G, class S, class O, bool kAdamW>
__global__ void __launch_bounds__(kThreads)
adam_kernel(const TensorDesc* __restrict__ tensors, const ChunkDesc* __restrict__ chunks, Hyper h) {
  const ChunkDesc c = chunks[blockIdx.x];
  const TensorDesc t = tensors[c.tensor];
  const int64_t end = c.start + kChunk < t.n ? c.start + kChunk : t.n;
  for (int64_t i = c.start + threadIdx.x; i < end; i += kThreads) {
    float g = __fmul_rn(G::load(t.grad, i), h.grad_scale);
    float p = t.param[i];
    if (kAdamW) {
      p = __fmul_rn(p, h.decay);
    } else {
      g = __fmaf_rn(h.l2, p, g);
    }
    float m = S::load(t.exp_avg, i);
    float v = S::load(t.exp_avg_sq, i);
    m = __fmaf_rn(h.one_minus_beta1, __fsub_rn(g, m), m);
    v = __fmaf_rn(__fmul_rn(h.one_minus_beta2, g), g, __fmul_rn(h.beta2, v));
    const float d = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), h.bc2_sqrt), h.eps);
    p = __fadd_rn(p, __fdiv_rn(__fmul_rn(h.neg_step_size, m), d));
    t.param[i] = p;
    S::store(t.exp_avg, i, m);
    S::store(t.exp_avg_sq, i, v);
    O::store(t.out, i, p);
  }
}

template <class G, class S, class O>
int launch_mode(const TensorDesc* t, const ChunkDesc* c, int64_t n, const Hyper& h, cudaStream_t s) {
  if (h.adamw) adam_kernel<G, S, O, true><<<static_cast<unsigned>(n), kThreads, 0, s>>>(t, c, h);
  else adam_kernel<G, S, O, false><<<static_cast<unsigned>(n), kThreads, 0, s>>>(t, c, h);
  return static_cast<int>(cudaGetLastError());
}

template <class G, class S>
int launch_out(int out_t, const TensorDesc* t, const ChunkDesc* c, int64_t n, const Hyper& h, cudaStream_t s) {
  switch (out_t) {
    case kBF16: return launch_mode<G, S, BF16>(t, c, n, h, s);
    case kF16: return launch_mode<G, S, F16>(t, c, n, h, s);
    default: return launch_mode<G, S, NoOut>(t, c, n, h, s);
  }
}

template <class G>
int launch_state(int state_t, int out_t, const TensorDesc* t, const ChunkDesc* c, int64_t n, const Hyper& h,
                 cudaStream_t s) {
  if (state_t == kBF16) return launch_out<G, BF16>(out_t, t, c, n, h, s);
  return launch_out<G, F32>(out_t, t, c, n, h, s);
}

}  // namespace

int launch(const TensorDesc* tensors, const ChunkDesc* chunks, int64_t n_chunks, int grad_t, int state_t,
           int out_t, const Hyper& h, void* stream) {
  if (n_chunks <= 0) return 0;
  if (n_chunks > 0x7FFFFFFFll) return static_cast<int>(cudaErrorInvalidConfiguration);
  auto s = static_cast<cudaStream_t>(stream);
  switch (grad_t) {
    case kBF16: return launch_state<BF16>(state_t, out_t, tensors, chunks, n_chunks, h, s);
    case kF16: return launch_state<F16>(state_t, out_t, tensors, chunks, n_chunks, h, s);
    default: return launch_state<F32>(state_t, out_t, tensors, chunks, n_chunks, h, s);
  }
}

const char* error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // namespace gpu_adam
}  // namespace tiered
