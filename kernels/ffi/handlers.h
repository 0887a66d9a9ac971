// The XLA FFI handler symbols this extension exports (registered from Python by jax_rope_cache._ffi).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_rope_cache {

// Platform "cpu": computes the op directly into the aliased caches.
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuRopeAndCache);
// The same with per-token fp8 scales: two more results, the scale caches (aliased to k_scale / v_scale).
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuRopeAndCacheTokenScales);
// Platform "cpu": mla_rope_and_cache (kernels/ffi/mla_cpu_handler.cc), into the aliased latent cache(s).
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuMlaRopeAndCache);

// Platforms "CUDA" and "ROCM": the generic code-object launcher (kernels/ffi/gpu_launcher.cc).
// Stages instantiate / initialize / execute; initialize and execute exist once per driver (*Cuda
// binds libcuda, *Hip binds libamdhip64: registered for "CUDA" and "ROCM" respectively); the
// execute stage comes command-buffer compatible (kGpuRopeCacheExecute*) or not (*NoGraph*).
XLA_FFI_DECLARE_HANDLER_SYMBOL(kGpuRopeCacheInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kGpuRopeCacheInitializeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kGpuRopeCacheInitializeHip);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kGpuRopeCacheExecuteCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kGpuRopeCacheExecuteNoGraphCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kGpuRopeCacheExecuteHip);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kGpuRopeCacheExecuteNoGraphHip);
// The initialize stage's buffer-signature check alone, as a plain handler any platform can run
// (tests drive it through jax.ffi.ffi_call on CPU, where the GPU stages cannot run).
XLA_FFI_DECLARE_HANDLER_SYMBOL(kGpuCheckBuffers);
// Kernels launched by the GPU launcher in this process (execute calls that launched; with XLA
// command buffers a replayed launch does not call the handler and is not counted).
uint64_t GpuLaunchCount();
// Modules the GPU launcher has loaded in this process (one per code object and device).
uint64_t GpuModuleCount();

}  // namespace jax_rope_cache
