// Host emulation of the few CUDA features rope_cache.cu uses, so a C++ compiler can build the
// kernel for the CPU and tests can check its index math and arithmetic against the numpy reference
// without a GPU (tests/test_cuda_compile.py). Build with -DRC_EMULATE and RC_NT=1: one "thread" per
// block runs every unit itself, so __syncthreads has nothing to wait for. There is no
// __shfl_xor_sync: the norm's butterfly rebuilds the other lanes of a shuffle group from their own
// chunks (rope_cache.cu: norm_lanes), so it tests the lane -> chunk mapping and the tree order, not
// the shuffle's masks or convergence (the GPU tests do).
#pragma once
#include <cstring>

struct RcDim3 {
  unsigned x = 0, y = 0, z = 0;
};
static RcDim3 threadIdx, blockIdx;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
static inline void __syncthreads() {}

struct uint4 {
  unsigned int x, y, z, w;
};
struct uint2 {
  unsigned int x, y;
};

static inline float __uint_as_float(unsigned int u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  std::memcpy(&u, &f, 4);
  return u;
}
static inline float __frcp_rn(float x) { return 1.0f / x; }
// Byte i of the result is byte (s >> 4i) & 7 of the 8 bytes y:x (x = bytes 0..3), as CUDA documents it.
static inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
  const unsigned long long b = (unsigned long long)y << 32 | x;
  unsigned int r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned int)(b >> (8 * ((s >> (4 * i)) & 7)) & 0xffu) << (8 * i);
  return r;
}
