// Multi-tensor fused Adam/AdamW kernel. The per-element arithmetic is the CPU kernel's
// ([Note: bitwise-identical paths] in ../cpu_adam/scalar_ops.h): explicit round-to-nearest intrinsics (__fmaf_rn where the CPU fuses, __fmul_rn/__fadd_rn elsewhere),
// IEEE sqrt and divide (__fsqrt_rn, __fdiv_rn), built with --fmad=false, so a GPU step gives
// the same bits as the CPU one.
//
// [Note: the kernel body on the host]
// The body (adam_chunk_thread) is __host__ __device__: on the device each op is the intrinsic
// above, on the host the same IEEE round-to-nearest float op. Built with
// -DTIERED_GPU_ADAM_HOST_EMULATION this file also exports tiered_gpu_adam_emulate(), which runs
// every (block, thread) of a launch in a host loop over the same chunk table the binding builds.
// Tests use it to check the kernel's indexing, dtype dispatch and arithmetic on machines without a
// GPU (tests/test_gpu_adam.py); the launch itself still needs a GPU to be checked.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <vector>

#include "gpu_adam.h"

namespace tiered {
namespace gpu_adam {
namespace {

// Round-to-nearest float ops: the intrinsics on the device, plain IEEE ops on the host (the host
// pass is built with -ffp-contract=off, so a*b+c stays two roundings there too).
struct Rn {
  __host__ __device__ static float mul(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
  }
  __host__ __device__ static float add(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
  }
  __host__ __device__ static float sub(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
  }
  __host__ __device__ static float div(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fdiv_rn(a, b);
#else
    return a / b;
#endif
  }
  __host__ __device__ static float sqrt(float a) {
#ifdef __CUDA_ARCH__
    return __fsqrt_rn(a);
#else
    return std::sqrt(a);
#endif
  }
  __host__ __device__ static float fma(float a, float b, float c) {
#ifdef __CUDA_ARCH__
    return __fmaf_rn(a, b, c);
#else
    return std::fma(a, b, c);
#endif
  }
};

struct F32 {
  __host__ __device__ static float load(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
  __host__ __device__ static void store(void* p, int64_t i, float x) { static_cast<float*>(p)[i] = x; }
};
struct BF16 {
  __host__ __device__ static float load(const void* p, int64_t i) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
  __host__ __device__ static void store(void* p, int64_t i, float x) {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
  }
};
struct F16 {
  __host__ __device__ static float load(const void* p, int64_t i) {
    return __half2float(static_cast<const __half*>(p)[i]);
  }
  __host__ __device__ static void store(void* p, int64_t i, float x) {
    static_cast<__half*>(p)[i] = __float2half_rn(x);
  }
};
struct NoOut {
  __host__ __device__ static void store(void*, int64_t, float) {}
};

// What thread `thread` of block `block` does: a strided walk over its block's chunk.
template <class G, class S, class O, bool kAdamW>
__host__ __device__ inline void adam_chunk_thread(const TensorDesc* __restrict__ tensors,
                                                  const ChunkDesc* __restrict__ chunks, const Hyper& h,
                                                  int64_t block, int thread) {
  const ChunkDesc c = chunks[block];
  const TensorDesc t = tensors[c.tensor];
  const int64_t end = c.start + kChunk < t.n ? c.start + kChunk : t.n;
  for (int64_t i = c.start + thread; i < end; i += kThreads) {
    float g = Rn::mul(G::load(t.grad, i), h.grad_scale);
    float p = t.param[i];
    if (kAdamW) {
      p = Rn::mul(p, h.decay);
    } else {
      g = Rn::fma(h.l2, p, g);
    }
    float m = S::load(t.exp_avg, i);
    float v = S::load(t.exp_avg_sq, i);
    m = Rn::fma(h.one_minus_beta1, Rn::sub(g, m), m);
    v = Rn::fma(Rn::mul(h.one_minus_beta2, g), g, Rn::mul(h.beta2, v));
    const float d = Rn::add(Rn::div(Rn::sqrt(v), h.bc2_sqrt), h.eps);
    p = Rn::add(p, Rn::div(Rn::mul(h.neg_step_size, m), d));
    t.param[i] = p;
    S::store(t.exp_avg, i, m);
    S::store(t.exp_avg_sq, i, v);
    O::store(t.out, i, p);
  }
}

template <class G, class S, class O, bool kAdamW>
__global__ void __launch_bounds__(kThreads)
adam_kernel(const TensorDesc* __restrict__ tensors, const ChunkDesc* __restrict__ chunks, Hyper h) {
  adam_chunk_thread<G, S, O, kAdamW>(tensors, chunks, h, blockIdx.x, static_cast<int>(threadIdx.x));
}

// One block per chunk, kThreads threads per block, on `stream`.
struct DeviceLaunch {
  cudaStream_t stream;
  template <class G, class S, class O, bool kAdamW>
  int run(const TensorDesc* t, const ChunkDesc* c, int64_t n, const Hyper& h) const {
    adam_kernel<G, S, O, kAdamW><<<static_cast<unsigned>(n), kThreads, 0, stream>>>(t, c, h);
    return static_cast<int>(cudaGetLastError());
  }
};

// The dtype and mode dispatch, shared by the device launch and the host emulation.
template <class G, class S, class O, class L>
int run_mode(const L& l, const TensorDesc* t, const ChunkDesc* c, int64_t n, const Hyper& h) {
  if (h.adamw) return l.template run<G, S, O, true>(t, c, n, h);
  return l.template run<G, S, O, false>(t, c, n, h);
}

template <class G, class S, class L>
int run_out(const L& l, int out_t, const TensorDesc* t, const ChunkDesc* c, int64_t n, const Hyper& h) {
  switch (out_t) {
    case kBF16: return run_mode<G, S, BF16>(l, t, c, n, h);
    case kF16: return run_mode<G, S, F16>(l, t, c, n, h);
    default: return run_mode<G, S, NoOut>(l, t, c, n, h);
  }
}

template <class G, class L>
int run_state(const L& l, int state_t, int out_t, const TensorDesc* t, const ChunkDesc* c, int64_t n,
              const Hyper& h) {
  if (state_t == kBF16) return run_out<G, BF16>(l, out_t, t, c, n, h);
  return run_out<G, F32>(l, out_t, t, c, n, h);
}

template <class L>
int dispatch(const L& l, const TensorDesc* t, const ChunkDesc* c, int64_t n, int grad_t, int state_t, int out_t,
             const Hyper& h) {
  switch (grad_t) {
    case kBF16: return run_state<BF16>(l, state_t, out_t, t, c, n, h);
    case kF16: return run_state<F16>(l, state_t, out_t, t, c, n, h);
    default: return run_state<F32>(l, state_t, out_t, t, c, n, h);
  }
}

}  // namespace

int launch(const TensorDesc* tensors, const ChunkDesc* chunks, int64_t n_chunks, int grad_t, int state_t,
           int out_t, const Hyper& h, void* stream) {
  if (n_chunks <= 0) return 0;
  if (n_chunks > 0x7FFFFFFFll) return static_cast<int>(cudaErrorInvalidConfiguration);
  return dispatch(DeviceLaunch{static_cast<cudaStream_t>(stream)}, tensors, chunks, n_chunks, grad_t, state_t,
                  out_t, h);
}

const char* error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // namespace gpu_adam
}  // namespace tiered

#ifdef TIERED_GPU_ADAM_HOST_EMULATION
namespace tiered {
namespace gpu_adam {
namespace {

// Every block, and every thread of it, in turn on the host (see [Note: the kernel body on the host]).
struct HostLaunch {
  template <class G, class S, class O, bool kAdamW>
  int run(const TensorDesc* t, const ChunkDesc* c, int64_t n, const Hyper& h) const {
    for (int64_t block = 0; block < n; ++block)
      for (int thread = 0; thread < kThreads; ++thread) adam_chunk_thread<G, S, O, kAdamW>(t, c, h, block, thread);
    return 0;
  }
};

}  // namespace
}  // namespace gpu_adam
}  // namespace tiered

// Host tensors in, the same chunk table and scalars as the binding's launch. Returns the number of
// chunks run.
extern "C" int64_t tiered_gpu_adam_emulate(const tiered::gpu_adam::TensorDesc* tensors, int64_t n_tensors,
                                           int grad_t, int state_t, int out_t, int64_t step, double lr,
                                           double beta1, double beta2, double eps, double weight_decay,
                                           int adamw_mode, double grad_scale) {
  namespace ga = tiered::gpu_adam;
  const std::vector<ga::ChunkDesc> chunks = ga::plan_chunks(tensors, n_tensors);
  const ga::Hyper h = tiered::make_adam_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw_mode != 0,
                                              grad_scale);
  ga::dispatch(ga::HostLaunch{}, tensors, chunks.data(), static_cast<int64_t>(chunks.size()), grad_t, state_t,
               out_t, h);
  return static_cast<int64_t>(chunks.size());
}
#endif
