// The XLA FFI handler symbols this extension exports (registered from Python by jax_rope_cache._ffi).
#pragma once

#include "xla/ffi/api/ffi.h"

namespace jax_rope_cache {

// Platform "cpu": computes the op directly into the aliased caches.
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuRopeAndCache);

}  // namespace jax_rope_cache
