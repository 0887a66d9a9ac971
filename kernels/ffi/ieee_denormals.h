// ScopedIeeeDenormals: IEEE subnormals for the scope of one thread's work, shared by the CPU
// handlers (cpu_handler.cc, mla_cpu_handler.cc). XLA's CPU threads compute with flush-to-zero and
// denormals-are-zero; the reference keeps subnormals.
#pragma once

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace jax_rope_cache {

// IEEE subnormals for the scope of one thread's work: saves the floating-point control register,
// clears flush-to-zero and denormals-are-zero (x86 MXCSR FTZ/DAZ; aarch64 FPCR FZ/FZ16), and
// restores the saved value on exit. Rounding mode and exception masks are left as they are.
class ScopedIeeeDenormals {
 public:
  ScopedIeeeDenormals() {
#if defined(__x86_64__) || defined(__i386__)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ & ~(kFtz | kDaz));
#elif defined(__aarch64__)
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    saved_ = fpcr;
    fpcr &= ~(kFz | kFz16);
    __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr) : "memory");
#endif
  }
  ~ScopedIeeeDenormals() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(static_cast<unsigned>(saved_));
#elif defined(__aarch64__)
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_) : "memory");
#endif
  }
  ScopedIeeeDenormals(const ScopedIeeeDenormals&) = delete;
  ScopedIeeeDenormals& operator=(const ScopedIeeeDenormals&) = delete;

 private:
  static constexpr unsigned kFtz = 1u << 15, kDaz = 1u << 6;         // MXCSR
  static constexpr uint64_t kFz = uint64_t{1} << 24, kFz16 = uint64_t{1} << 19;  // FPCR
  uint64_t saved_ = 0;
};

}  // namespace jax_rope_cache
