// The op's dtype codes (kernels/common/rope_cache_math.h, RC_*) of XLA FFI buffer types, shared by
// the CPU handlers.
#pragma once

#include "kernels/common/rope_cache_math.h"
#include "xla/ffi/api/ffi.h"

namespace jax_rope_cache {

// -1 for a type no operand of the ops may have.
inline int DtypeCode(xla::ffi::DataType t) {
  switch (t) {
    case xla::ffi::DataType::F32: return RC_F32;
    case xla::ffi::DataType::BF16: return RC_BF16;
    case xla::ffi::DataType::F16: return RC_F16;
    case xla::ffi::DataType::F8E4M3FN: return RC_FP8_E4M3FN;
    case xla::ffi::DataType::F8E4M3FNUZ: return RC_FP8_E4M3FNUZ;
    case xla::ffi::DataType::F8E5M2: return RC_FP8_E5M2;
    default: return -1;
  }
}

}  // namespace jax_rope_cache
