// One generic GPU launcher for CUDA and HIP: XLA FFI handler that launches a precompiled kernel
// whose code object travels inside the executable as a bytes attribute. No vendor headers: the
// driver API is reached through dlopen, binding first with RTLD_NOLOAD to the copy the PJRT plugin
// already loaded. The driver is chosen by the platform the handler was registered for, never by
// what happens to be installed: the "CUDA" handlers (kGpuRopeCache*Cuda) bind libcuda, the "ROCM"
// handlers (kGpuRopeCache*Hip) the HIP runtime libamdhip64. First a copy already loaded into the
// process, whatever its soname (found with dl_iterate_phdr: the one jax's PJRT plugin uses, e.g. a
// libamdhip64.so.10 of a newer ROCm), then by name: libcuda.so.1 / libcuda.so, libamdhip64.so.7 /
// .so.6 / .so.
//
// HIP code objects: AMDHSA code-object v6 (what FlyDSL 0.5.0 emits) loads with the HIP runtime of
// ROCm >= 6.3 only; a load failure's error names the code object's version, the ROCm it needs and
// the runtime this process bound (version and path).
//
// Attributes (all read in every stage):
//   code       bytes  a code-object table (format below) holding one or more code objects
//   code_hash  int64  a hash of `code` computed by the caller (module cache key; never trusted
//                     for anything but lookups: a collision only matters with equal hashes from
//                     different tables, which the caller's 64-bit sha256 prefix makes negligible)
//   kernel     string the kernel's symbol name (extern "C")
//   grid_div   int64  grid.x = ceil(dim0(operand 0) / grid_div)
//   grid_y     int64  grid.y (1 .. 65535: the parts a block's work is split into); grid.z = 1
//   block      int64  threads per block (x)
//   smem       int64  dynamic shared memory bytes
//   signature  int64[] the dtype and dims of every buffer the kernel was compiled for:
//                     {n_args, n_rets, then per buffer (args, then rets): xla_type, rank, dims...}
//                     with xla_type the XLA element type number (ffi::DataType)
//   buffer_names string the buffers' names, comma-separated, in the same order (for messages)
//
// Code-object table (little-endian):
//   char magic[8] = "JRCCODE1"; uint32 count; uint32 reserved;
//   count entries of { uint32 kind; uint32 reserved; char arch[16] (NUL-padded);
//                      uint64 offset; uint64 size }   offsets from the start of the table
//   kind 1: CUDA cubin for arch "sm_XY"; kind 2: CUDA PTX (NUL-terminated) for "compute_XY";
//   kind 3: AMDGPU code object for "gfxNNN".
// CUDA picks the cubin whose arch equals the device's sm_XY, else the PTX entry with the highest
// compute_XY <= the device's (the driver JIT-compiles it). HIP picks the AMDGPU entry whose arch
// equals the device's gfx name (gcnArchName up to the first ':', read with
// hipGetDevicePropertiesR0600); only if the runtime does not report a gfx name does it try each
// AMDGPU entry until hipModuleLoadData accepts one. No fit: an error naming the device's arch and
// the table's.
//
// Kernel ABI: a parameter block of 8-byte words: void* of every operand buffer in order, then of
// every result buffer, then int64 dim0 of every operand (1 for rank-0 operands); at most
// kMaxBuffers buffers. CUDA: the kernel takes it as ONE struct parameter by value
// (kernelParams = {&block}). HIP: the block is passed as the raw kernarg buffer
// (HIP_LAUNCH_PARAM_BUFFER_POINTER), so a kernel may declare the words as one struct or as
// separate 8-byte arguments.
//
// Stages: instantiate parses and checks the table and the signature; initialize checks every
// buffer's dtype and dims against the signature (a direct ffi_call with other buffers gets an error
// naming the buffer, never a kernel reading past one) and (has the stream) loads the module
// for this device into a process-wide cache keyed by (code_hash, device ordinal) and resolves the
// function; execute looks the function up lock-free (atomic open-addressing table), packs the
// parameter struct on the stack and launches on XLA's stream. No allocation, no host sync, no lock
// on that path. kGpuRopeCacheExecute{Cuda,Hip} are registered command-buffer compatible (XLA may
// capture them into a CUDA/HIP graph and replay the launch without calling the handler: every
// index the kernel uses is read from device buffers); kGpuRopeCacheExecuteNoGraph{Cuda,Hip} are
// the same without that trait: what jax_rope_cache lowers to on ROCm unless
// JAX_ROPE_CACHE_COMMAND_BUFFERS=1, and on CUDA when it is 0 (backends/launcher.py).
#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include "kernels/ffi/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_rope_cache {
namespace {

// ---- the driver API, by hand ------------------------------------------------------------------
using Result = int;  // CUresult / hipError_t: 0 is success
using Handle = void*;

struct Driver {
  bool hip = false;
  void* lib = nullptr;
  std::string error;  // why no driver was found
  // CUDA
  Result (*cuInit)(unsigned) = nullptr;
  Result (*cuDeviceGet)(int*, int) = nullptr;
  Result (*cuDeviceGetAttribute)(int*, int, int) = nullptr;
  Result (*cuDevicePrimaryCtxRetain)(Handle*, int) = nullptr;
  Result (*cuCtxPushCurrent)(Handle) = nullptr;
  Result (*cuCtxPopCurrent)(Handle*) = nullptr;
  Result (*cuCtxGetCurrent)(Handle*) = nullptr;
  Result (*cuModuleLoadData)(Handle*, const void*) = nullptr;
  Result (*cuModuleGetFunction)(Handle*, Handle, const char*) = nullptr;
  Result (*cuLaunchKernel)(Handle, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, Handle,
                           void**, void**) = nullptr;
  Result (*cuGetErrorString)(Result, const char**) = nullptr;
  // HIP
  Result (*hipInit)(unsigned) = nullptr;
  Result (*hipGetDevice)(int*) = nullptr;
  Result (*hipSetDevice)(int) = nullptr;
  Result (*hipModuleLoadData)(Handle*, const void*) = nullptr;
  Result (*hipModuleGetFunction)(Handle*, Handle, const char*) = nullptr;
  Result (*hipModuleLaunchKernel)(Handle, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  Handle, void**, void**) = nullptr;
  const char* (*hipGetErrorString)(Result) = nullptr;
  Result (*hipGetDevicePropertiesR0600)(void*, int) = nullptr;  // optional (ROCm >= 6)
  Result (*hipRuntimeGetVersion)(int*) = nullptr;               // optional: for messages
  std::string path;  // the library bound (for messages)

  std::string ErrorString(Result r) const {
    const char* s = nullptr;
    if (hip) {
      if (hipGetErrorString) s = hipGetErrorString(r);
    } else if (cuGetErrorString) {
      cuGetErrorString(r, &s);
    }
    return std::string(s ? s : "unknown error") + " (" + std::to_string(r) + ")";
  }
};

template <typename F>
bool Sym(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  return *out != nullptr;
}

bool BindCuda(Driver& d, void* lib) {
  d.lib = lib;
  d.hip = false;
  return Sym(lib, "cuInit", &d.cuInit) && Sym(lib, "cuDeviceGet", &d.cuDeviceGet) &&
         Sym(lib, "cuDeviceGetAttribute", &d.cuDeviceGetAttribute) &&
         Sym(lib, "cuDevicePrimaryCtxRetain", &d.cuDevicePrimaryCtxRetain) &&
         Sym(lib, "cuCtxPushCurrent_v2", &d.cuCtxPushCurrent) && Sym(lib, "cuCtxPopCurrent_v2", &d.cuCtxPopCurrent) &&
         Sym(lib, "cuCtxGetCurrent", &d.cuCtxGetCurrent) && Sym(lib, "cuModuleLoadData", &d.cuModuleLoadData) &&
         Sym(lib, "cuModuleGetFunction", &d.cuModuleGetFunction) && Sym(lib, "cuLaunchKernel", &d.cuLaunchKernel) &&
         Sym(lib, "cuGetErrorString", &d.cuGetErrorString);
}

bool BindHip(Driver& d, void* lib) {
  d.lib = lib;
  d.hip = true;
  return Sym(lib, "hipInit", &d.hipInit) && Sym(lib, "hipGetDevice", &d.hipGetDevice) &&
         Sym(lib, "hipSetDevice", &d.hipSetDevice) && Sym(lib, "hipModuleLoadData", &d.hipModuleLoadData) &&
         Sym(lib, "hipModuleGetFunction", &d.hipModuleGetFunction) &&
         Sym(lib, "hipModuleLaunchKernel", &d.hipModuleLaunchKernel) &&
         Sym(lib, "hipGetErrorString", &d.hipGetErrorString) &&
         (Sym(lib, "hipGetDevicePropertiesR0600", &d.hipGetDevicePropertiesR0600), true) &&
         (Sym(lib, "hipRuntimeGetVersion", &d.hipRuntimeGetVersion), true);
}

// Paths of the loaded objects whose file name starts with `prefix` ("libamdhip64.so"), in load order.
struct LoadedScan {
  const char* prefix = nullptr;
  std::string paths[8];
  int n = 0;
};

int CollectLoaded(struct dl_phdr_info* info, size_t, void* data) {
  auto* scan = static_cast<LoadedScan*>(data);
  const char* path = info->dlpi_name;
  if (!path || !*path || scan->n == 8) return 0;
  const char* slash = std::strrchr(path, '/');
  const char* base = slash ? slash + 1 : path;
  if (std::strncmp(base, scan->prefix, std::strlen(scan->prefix)) == 0) scan->paths[scan->n++] = path;
  return 0;
}

// The vendor a handler was registered for ("CUDA" -> kCuda, "ROCM" -> kHip).
enum class Vendor { kCuda, kHip };

// The driver of `vendor`, bound once per process: first a copy already loaded (RTLD_NOLOAD, the
// one the PJRT plugin uses), else loaded by name.
const Driver* MakeDriver(Vendor vendor) {
  auto* d = new Driver();
  const bool hip = vendor == Vendor::kHip;
  static const char* cuda_names[] = {"libcuda.so.1", "libcuda.so", nullptr};
  static const char* hip_names[] = {"libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so", nullptr};
  const char* const* names = hip ? hip_names : cuda_names;
  std::string why;
  auto bind = [&](void* h) { return hip ? BindHip(*d, h) : BindCuda(*d, h); };
  auto init = [&](const std::string& path) {
    d->path = path;
    const Result r = hip ? d->hipInit(0) : d->cuInit(0);
    if (r != 0) d->error = std::string(hip ? "hipInit: " : "cuInit: ") + d->ErrorString(r);
    return d;
  };
  LoadedScan scan;
  scan.prefix = hip ? "libamdhip64.so" : "libcuda.so";
  dl_iterate_phdr(CollectLoaded, &scan);  // any soname already in the process, first
  for (int i = 0; i < scan.n; ++i) {
    void* h = dlopen(scan.paths[i].c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (h && bind(h)) return init(scan.paths[i]);
  }
  for (int pass = 0; pass < 2; ++pass) {  // pass 0: only libraries already loaded
    const int flags = RTLD_NOW | RTLD_LOCAL | (pass == 0 ? RTLD_NOLOAD : 0);
    for (int i = 0; names[i]; ++i) {
      void* h = dlopen(names[i], flags);
      if (!h) {
        if (pass == 1) {
          const char* e = dlerror();
          why += std::string(why.empty() ? "" : "; ") + (e ? e : names[i]);
        }
        continue;
      }
      if (bind(h)) return init(names[i]);
      why += std::string(why.empty() ? "" : "; ") + names[i] + " lacks a driver API symbol";
    }
  }
  d->lib = nullptr;
  d->hip = hip;
  d->error = std::string(hip ? "the HIP runtime (libamdhip64.so, loaded or .so.7 / .so.6) could not be loaded: "
                             : "the CUDA driver (libcuda.so.1) could not be loaded: ") + why;
  return d;
}

const Driver& GetDriver(Vendor vendor) {
  static const Driver* cuda = nullptr;
  static const Driver* hip = nullptr;
  static std::once_flag cuda_once, hip_once;
  if (vendor == Vendor::kHip) {
    std::call_once(hip_once, [] { hip = MakeDriver(Vendor::kHip); });
    return *hip;
  }
  std::call_once(cuda_once, [] { cuda = MakeDriver(Vendor::kCuda); });
  return *cuda;
}

// The gfx arch of HIP device `device` ("gfx942"), or "" when the runtime does not say. Read from
// hipDeviceProp_tR0600::gcnArchName ("gfx942:sramecc+:xnack-"), char[256] at byte offset 1160 of
// the 1472-byte struct (LP64; the same layout in the ROCm 6.0-6.4 and 7.x headers, which keep
// R0600 as the current ABI). The versioned symbol matters: the unversioned
// hipGetDeviceProperties export fills the older R0000 layout. The buffer is larger than the
// struct so a later, longer layout cannot overrun it, and anything but a NUL-terminated "gfx..."
// name at that offset is treated as unknown.
constexpr size_t kHipPropGcnArchNameOffset = 1160;
constexpr size_t kHipPropBufferBytes = 8192;

std::string HipDeviceArch(const Driver& d, int device) {
  if (!d.hipGetDevicePropertiesR0600) return "";
  alignas(16) unsigned char props[kHipPropBufferBytes];
  std::memset(props, 0, sizeof(props));
  if (d.hipGetDevicePropertiesR0600(props, device) != 0) return "";
  const char* name = reinterpret_cast<const char*>(props + kHipPropGcnArchNameOffset);
  const size_t n = strnlen(name, 256);
  if (n == 256 || n < 4 || std::strncmp(name, "gfx", 3) != 0) return "";
  std::string arch(name, n);
  return arch.substr(0, arch.find(':'));
}

// Why a HIP runtime may refuse an AMDGPU code object: its AMDHSA code-object version (ELF
// EI_OSABI 64, EI_ABIVERSION 2/3/4 = v4/v5/v6), the oldest ROCm that loads v6, and the runtime this
// process bound. "" when the image is not an AMDHSA code object.
std::string HipRuntimeText(const Driver& d) {
  int v = 0;
  std::string text = "this process's HIP runtime: ";
  if (d.hipRuntimeGetVersion && d.hipRuntimeGetVersion(&v) == 0 && v > 0)
    text += std::to_string(v / 10000000) + "." + std::to_string(v / 100000 % 100) + "." + std::to_string(v % 100000);
  else
    text += "version not reported";
  return text + " (" + d.path + ")";
}

std::string CodeObjectNeeds(const Driver& d, const void* image, uint64_t size) {
  const auto* p = static_cast<const unsigned char*>(image);
  if (size < 16 || std::memcmp(p, "\x7f" "ELF", 4) != 0 || p[7] != 64) return "";
  const int version = p[8] + 2;
  std::string text = "; the code object is AMDHSA code-object v" + std::to_string(version);
  if (version >= 6) text += ", which the HIP runtime of ROCm >= 6.3 loads (older ones refuse it)";
  return text + "; " + HipRuntimeText(d) + ". Supported: ROCm 7.x with jax's ROCm 7 plugin (see docs/rocm.md)";
}

// ---- the code-object table --------------------------------------------------------------------
constexpr char kMagic[8] = {'J', 'R', 'C', 'C', 'O', 'D', 'E', '1'};
enum Kind : uint32_t { kCubin = 1, kPtx = 2, kAmdgpu = 3 };

struct Entry {
  uint32_t kind;
  std::string arch;
  const void* data;
  uint64_t size;
};

template <typename T>
T ReadLE(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

constexpr int kMaxEntries = 16;

struct Table {
  int n = 0;
  Entry e[kMaxEntries];
};

ffi::Error ParseTable(std::string_view code, Table* t) {
  constexpr size_t kHeader = 16, kEntry = 40;
  if (code.size() < kHeader || std::memcmp(code.data(), kMagic, 8) != 0)
    return ffi::Error::InvalidArgument("gpu launcher: attribute 'code' is not a code-object table");
  const uint32_t count = ReadLE<uint32_t>(code.data() + 8);
  if (count < 1 || count > kMaxEntries || code.size() < kHeader + count * kEntry)
    return ffi::Error::InvalidArgument("gpu launcher: bad code-object table header");
  t->n = static_cast<int>(count);
  for (uint32_t i = 0; i < count; ++i) {
    const char* p = code.data() + kHeader + i * kEntry;
    Entry& e = t->e[i];
    e.kind = ReadLE<uint32_t>(p);
    e.arch.assign(p + 8, strnlen(p + 8, 16));
    const uint64_t off = ReadLE<uint64_t>(p + 24);
    e.size = ReadLE<uint64_t>(p + 32);
    if (off > code.size() || e.size > code.size() - off || e.size == 0)
      return ffi::Error::InvalidArgument("gpu launcher: code-object table entry out of range");
    if (e.kind == kPtx && code[off + e.size - 1] != '\0')
      return ffi::Error::InvalidArgument("gpu launcher: PTX entry is not NUL-terminated");
    e.data = code.data() + off;
  }
  return ffi::Error::Success();
}

std::string TableArchs(const Table& t) {
  std::string s;
  for (int i = 0; i < t.n; ++i) s += (i ? ", " : "") + t.e[i].arch;
  return s;
}

// ---- the buffer signature ----------------------------------------------------------------------
constexpr int kMaxSignatureBuffers = 32;
constexpr int64_t kMaxRank = 8;

struct Signature {
  int n_args = 0, n_rets = 0;
  int64_t type[kMaxSignatureBuffers];
  int64_t rank[kMaxSignatureBuffers];
  const int64_t* dims[kMaxSignatureBuffers];
  std::string_view name[kMaxSignatureBuffers];
};

ffi::Error ParseSignature(ffi::Span<const int64_t> sig, std::string_view names, Signature* s) {
  auto bad = [](const std::string& why) {
    return ffi::Error::InvalidArgument("gpu launcher: attribute 'signature' " + why);
  };
  if (sig.size() < 2) return bad("is shorter than its header {n_args, n_rets}");
  if (sig[0] < 1 || sig[1] < 0 || sig[0] + sig[1] > kMaxSignatureBuffers)
    return bad("declares " + std::to_string(sig[0]) + " operands and " + std::to_string(sig[1]) +
               " results (1..32 buffers in all)");
  s->n_args = static_cast<int>(sig[0]), s->n_rets = static_cast<int>(sig[1]);
  size_t at = 2;
  for (int i = 0; i < s->n_args + s->n_rets; ++i) {
    if (at + 2 > sig.size()) return bad("ends inside buffer " + std::to_string(i));
    s->type[i] = sig[at], s->rank[i] = sig[at + 1];
    if (s->rank[i] < 0 || s->rank[i] > kMaxRank || at + 2 + s->rank[i] > sig.size())
      return bad("has a bad rank for buffer " + std::to_string(i));
    s->dims[i] = sig.begin() + at + 2;
    for (int64_t j = 0; j < s->rank[i]; ++j)
      if (s->dims[i][j] < 0) return bad("has a negative dimension for buffer " + std::to_string(i));
    at += 2 + s->rank[i];
  }
  if (at != sig.size()) return bad("is longer than its buffers");
  for (int i = 0; i < s->n_args + s->n_rets; ++i) {
    const size_t comma = names.find(',');
    s->name[i] = names.substr(0, comma);
    if (s->name[i].empty())
      return ffi::Error::InvalidArgument("gpu launcher: attribute 'buffer_names' names fewer buffers than the signature");
    names = comma == std::string_view::npos ? std::string_view() : names.substr(comma + 1);
  }
  if (!names.empty())
    return ffi::Error::InvalidArgument("gpu launcher: attribute 'buffer_names' names more buffers than the signature");
  return ffi::Error::Success();
}

std::string DimsText(const int64_t* d, int64_t n) {
  std::string t = "[";
  for (int64_t i = 0; i < n; ++i) t += (i ? ", " : "") + std::to_string(d[i]);
  return t + "]";
}

ffi::Error CheckOneBuffer(const Signature& s, int i, const ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  const int64_t type = static_cast<int64_t>(b.element_type());
  bool same = type == s.type[i] && static_cast<int64_t>(d.size()) == s.rank[i];
  for (int64_t j = 0; same && j < s.rank[i]; ++j) same = d[j] == s.dims[i][j];
  if (same) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(
      "gpu launcher: " + std::string(s.name[i]) + ": expected element type " + std::to_string(s.type[i]) + " dims " +
      DimsText(s.dims[i], s.rank[i]) + " (what the kernel was compiled for), got element type " +
      std::to_string(type) + " dims " + DimsText(d.begin(), static_cast<int64_t>(d.size())));
}

// Every buffer XLA hands the call against the signature: count, element type, dims.
ffi::Error CheckBuffers(ffi::Span<const int64_t> sig, std::string_view names, ffi::RemainingArgs args,
                        ffi::RemainingRets rets) {
  Signature s;
  if (auto e = ParseSignature(sig, names, &s); e.failure()) return e;
  if (static_cast<int>(args.size()) != s.n_args || static_cast<int>(rets.size()) != s.n_rets)
    return ffi::Error::InvalidArgument("gpu launcher: expected " + std::to_string(s.n_args) + " operands and " +
                                       std::to_string(s.n_rets) + " results, got " + std::to_string(args.size()) +
                                       " and " + std::to_string(rets.size()));
  for (int i = 0; i < s.n_args; ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (!b.has_value())
      return ffi::Error::InvalidArgument("gpu launcher: " + std::string(s.name[i]) + ": not a buffer");
    if (auto e = CheckOneBuffer(s, i, *b); e.failure()) return e;
  }
  for (int i = 0; i < s.n_rets; ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (!b.has_value())
      return ffi::Error::InvalidArgument("gpu launcher: " + std::string(s.name[s.n_args + i]) + ": not a buffer");
    if (auto e = CheckOneBuffer(s, s.n_args + i, **b); e.failure()) return e;
  }
  return ffi::Error::Success();
}

// ---- the process-wide function cache ----------------------------------------------------------
// Open addressing, insert-only: written under a mutex (initialize), read lock-free (execute).
struct Slot {
  std::atomic<uint64_t> key{0};  // 0: empty; published last (release)
  Handle function = nullptr;
  Handle context = nullptr;  // CUDA: the primary context the module lives in
};
constexpr uint64_t kSlots = 4096;
Slot g_slots[kSlots];
std::mutex g_insert_mutex;
std::atomic<uint64_t> g_launches{0};
std::atomic<uint64_t> g_modules{0};  // modules loaded: one per (code object, device), ever

// Keyed by vendor too: a module loaded through one driver is no function of the other.
uint64_t CacheKey(int64_t code_hash, int device, Vendor vendor) {
  const uint64_t dev = static_cast<uint64_t>(device + 1) + (vendor == Vendor::kHip ? (1ull << 32) : 0);
  uint64_t k = static_cast<uint64_t>(code_hash) ^ (0x9e3779b97f4a7c15ull * dev);
  k ^= k >> 29;
  return k ? k : 1;
}

const Slot* Lookup(uint64_t key) {
  for (uint64_t i = 0; i < kSlots; ++i) {
    const Slot& s = g_slots[(key + i) & (kSlots - 1)];
    const uint64_t k = s.key.load(std::memory_order_acquire);
    if (k == key) return &s;
    if (k == 0) return nullptr;
  }
  return nullptr;
}

ffi::Error DriverError(const Driver& d, const char* what, Result r) {
  return ffi::Error::Internal(std::string("gpu launcher: ") + what + " failed: " + d.ErrorString(r));
}

// Loads the table's best code object for `device` and resolves `kernel`.
ffi::Error LoadFunction(const Driver& d, const Table& t, std::string_view kernel, int device, Handle* function,
                        Handle* context) {
  const std::string name(kernel);
  if (!d.hip) {
    int dev = 0, major = 0, minor = 0;
    if (Result r = d.cuDeviceGet(&dev, device); r) return DriverError(d, "cuDeviceGet", r);
    d.cuDeviceGetAttribute(&major, 75, dev);  // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    d.cuDeviceGetAttribute(&minor, 76, dev);  // ..._MINOR
    const int cc = major * 10 + minor;
    const std::string sm = "sm_" + std::to_string(cc);
    const Entry* pick = nullptr;
    int best_ptx = -1;
    for (int i = 0; i < t.n; ++i) {
      const Entry& e = t.e[i];
      if (e.kind == kCubin && e.arch == sm) {
        pick = &e;
        break;
      }
      if (e.kind == kPtx && e.arch.rfind("compute_", 0) == 0) {
        const int a = std::atoi(e.arch.c_str() + 8);
        if (a <= cc && a > best_ptx) best_ptx = a, pick = &e;
      }
    }
    if (!pick)
      return ffi::Error::InvalidArgument("gpu launcher: no code object for this GPU (" + sm +
                                         "); the executable holds: " + TableArchs(t) +
                                         ". Lower the computation on (or for) this GPU's architecture");
    Handle ctx = nullptr, popped = nullptr, module = nullptr;
    if (Result r = d.cuDevicePrimaryCtxRetain(&ctx, dev); r) return DriverError(d, "cuDevicePrimaryCtxRetain", r);
    if (Result r = d.cuCtxPushCurrent(ctx); r) return DriverError(d, "cuCtxPushCurrent", r);
    Result r = d.cuModuleLoadData(&module, pick->data);
    Result r2 = r ? 0 : d.cuModuleGetFunction(function, module, name.c_str());
    d.cuCtxPopCurrent(&popped);
    if (r) return DriverError(d, ("cuModuleLoadData (" + pick->arch + ")").c_str(), r);
    if (r2) return DriverError(d, ("cuModuleGetFunction(" + name + ")").c_str(), r2);
    *context = ctx;
    return ffi::Error::Success();
  }
  int prev = 0;
  d.hipGetDevice(&prev);
  if (Result r = d.hipSetDevice(device); r) return DriverError(d, "hipSetDevice", r);
  const std::string arch = HipDeviceArch(d, device);
  std::string tried;
  Result last = 0;
  bool any = false;
  const Entry* first_amdgpu = nullptr;
  for (int i = 0; i < t.n; ++i) {
    if (t.e[i].kind != kAmdgpu) continue;
    any = true;
    if (!first_amdgpu) first_amdgpu = &t.e[i];
    if (!arch.empty() && t.e[i].arch != arch) continue;  // a known arch loads only its own entry
    Handle module = nullptr;
    last = d.hipModuleLoadData(&module, t.e[i].data);
    if (last == 0) {
      last = d.hipModuleGetFunction(function, module, name.c_str());
      d.hipSetDevice(prev);
      if (last) return DriverError(d, ("hipModuleGetFunction(" + name + ")").c_str(), last);
      *context = nullptr;
      return ffi::Error::Success();
    }
    if (!arch.empty()) {
      d.hipSetDevice(prev);
      return ffi::Error::Internal("gpu launcher: hipModuleLoadData (" + arch + ") failed: " + d.ErrorString(last) +
                                  CodeObjectNeeds(d, t.e[i].data, t.e[i].size));
    }
    tried += (tried.empty() ? "" : ", ") + t.e[i].arch;
  }
  d.hipSetDevice(prev);
  if (!arch.empty() || !any)
    return ffi::Error::InvalidArgument("gpu launcher: no code object for this GPU (" +
                                       (arch.empty() ? std::string("HIP device ") + std::to_string(device) : arch) +
                                       "); the executable holds: " + TableArchs(t) +
                                       ". Lower the computation on (or for) this GPU's architecture");
  return ffi::Error::InvalidArgument("gpu launcher: no code object loads on HIP device " + std::to_string(device) +
                                     " (its arch is not reported; tried: " + tried +
                                     "; last error: " + d.ErrorString(last) + "); the executable holds: " +
                                     TableArchs(t) + CodeObjectNeeds(d, first_amdgpu->data, first_amdgpu->size));
}

ffi::Error EnsureLoaded(Vendor vendor, std::string_view code, int64_t code_hash, std::string_view kernel,
                        int device) {
  const Driver& d = GetDriver(vendor);
  if (!d.lib) return ffi::Error::Internal("gpu launcher: " + d.error);
  if (!d.error.empty()) return ffi::Error::Internal("gpu launcher: " + d.error);
  const uint64_t key = CacheKey(code_hash, device, vendor);
  if (Lookup(key)) return ffi::Error::Success();
  Table t;
  if (auto e = ParseTable(code, &t); e.failure()) return e;
  std::lock_guard<std::mutex> lock(g_insert_mutex);
  if (Lookup(key)) return ffi::Error::Success();
  Handle fn = nullptr, ctx = nullptr;
  if (auto e = LoadFunction(d, t, kernel, device, &fn, &ctx); e.failure()) return e;
  for (uint64_t i = 0; i < kSlots; ++i) {
    Slot& s = g_slots[(key + i) & (kSlots - 1)];
    if (s.key.load(std::memory_order_relaxed) == 0) {
      s.function = fn;
      s.context = ctx;
      s.key.store(key, std::memory_order_release);
      g_modules.fetch_add(1, std::memory_order_relaxed);
      return ffi::Error::Success();
    }
  }
  return ffi::Error::Internal("gpu launcher: module cache full (4096 kernels)");
}

// ---- stages ------------------------------------------------------------------------------------
ffi::Error Instantiate(std::string_view code, int64_t code_hash, std::string_view kernel, int64_t grid_div,
                       int64_t grid_y, int64_t block, int64_t smem, ffi::Span<const int64_t> signature,
                       std::string_view buffer_names) {
  (void)code_hash;
  Table t;
  if (auto e = ParseTable(code, &t); e.failure()) return e;
  Signature sig;
  if (auto e = ParseSignature(signature, buffer_names, &sig); e.failure()) return e;
  if (kernel.empty()) return ffi::Error::InvalidArgument("gpu launcher: empty kernel name");
  auto bad = [](const char* name, const char* want, int64_t got) {
    return ffi::Error::InvalidArgument(std::string("gpu launcher: bad launch attributes: '") + name + "' must be " +
                                       want + ", got " + std::to_string(got));
  };
  if (grid_div < 1) return bad("grid_div", ">= 1", grid_div);
  if (grid_y < 1 || grid_y > 65535) return bad("grid_y", "1..65535", grid_y);
  if (block < 1 || block > 1024) return bad("block", "1..1024", block);
  if (smem < 0) return bad("smem", ">= 0", smem);
  return ffi::Error::Success();
}

ffi::Error Initialize(Vendor vendor, int32_t device, ffi::RemainingArgs args, ffi::RemainingRets rets,
                      std::string_view code, int64_t code_hash, std::string_view kernel, int64_t grid_div,
                      int64_t grid_y, int64_t block, int64_t smem, ffi::Span<const int64_t> signature,
                      std::string_view buffer_names) {
  (void)grid_div, (void)grid_y, (void)block, (void)smem;
  if (auto e = CheckBuffers(signature, buffer_names, args, rets); e.failure()) return e;
  return EnsureLoaded(vendor, code, code_hash, kernel, device);
}

// A CPU-runnable stage with the initialize stage's buffer check alone (registered by the tests for
// platform "cpu", where the launcher's own stages cannot run): the same CheckBuffers on real FFI
// buffers, so a raw ffi_call exercises it under ASan without a GPU.
ffi::Error CheckBuffersOnly(ffi::RemainingArgs args, ffi::RemainingRets rets, ffi::Span<const int64_t> signature,
                            std::string_view buffer_names) {
  return CheckBuffers(signature, buffer_names, args, rets);
}

constexpr int kMaxBuffers = 32;

ffi::Error Execute(Vendor vendor, void* stream, int32_t device, ffi::RemainingArgs args, ffi::RemainingRets rets,
                   std::string_view code, int64_t code_hash, std::string_view kernel, int64_t grid_div,
                   int64_t grid_y, int64_t block, int64_t smem, ffi::Span<const int64_t> signature,
                   std::string_view buffer_names) {
  const Driver& d = GetDriver(vendor);
  const Slot* slot = Lookup(CacheKey(code_hash, device, vendor));
  if (XLA_FFI_PREDICT_FALSE(slot == nullptr)) {  // initialize did not run for this device
    if (auto e = CheckBuffers(signature, buffer_names, args, rets); e.failure()) return e;
    if (auto e = EnsureLoaded(vendor, code, code_hash, kernel, device); e.failure()) return e;
    slot = Lookup(CacheKey(code_hash, device, vendor));
    if (!slot) return ffi::Error::Internal("gpu launcher: module cache lookup failed");
  }
  const size_t na = args.size(), nr = rets.size();
  if (na + nr > kMaxBuffers || na < 1) return ffi::Error::InvalidArgument("gpu launcher: too many buffers");
  // The parameter struct: pointers of args, then rets, then dim0 of each arg.
  alignas(16) unsigned char params[kMaxBuffers * 8 + kMaxBuffers * 8];
  int64_t* words = reinterpret_cast<int64_t*>(params);
  size_t w = 0;
  int64_t dim0[kMaxBuffers];
  for (size_t i = 0; i < na; ++i) {
    auto b = args.get<ffi::AnyBuffer>(i);
    if (XLA_FFI_PREDICT_FALSE(!b.has_value())) return ffi::Error::InvalidArgument("gpu launcher: bad operand");
    void* p = b->untyped_data();
    std::memcpy(&words[w++], &p, sizeof(p));
    auto dims = b->dimensions();
    dim0[i] = dims.size() ? dims[0] : 1;
  }
  for (size_t i = 0; i < nr; ++i) {
    auto b = rets.get<ffi::AnyBuffer>(i);
    if (XLA_FFI_PREDICT_FALSE(!b.has_value())) return ffi::Error::InvalidArgument("gpu launcher: bad result");
    void* p = (*b)->untyped_data();
    std::memcpy(&words[w++], &p, sizeof(p));
  }
  for (size_t i = 0; i < na; ++i) words[w++] = dim0[i];
  const int64_t n = dim0[0];
  if (n <= 0) return ffi::Error::Success();
  const int64_t grid = (n + grid_div - 1) / grid_div;
  if (grid > 0x7fffffff) return ffi::Error::InvalidArgument("gpu launcher: grid too large");
  void* kparams[1] = {params};
  Result r;
  if (d.hip) {
    // HIP reads kernelParams[i] for EACH argument the code object declares (a kernel may declare the
    // block's 8-byte words as separate arguments), so hand the block over as the raw kernarg buffer.
    size_t kernarg_bytes = w * sizeof(int64_t);
    void* extra[] = {reinterpret_cast<void*>(0x01), params,          // HIP_LAUNCH_PARAM_BUFFER_POINTER
                     reinterpret_cast<void*>(0x02), &kernarg_bytes,  // HIP_LAUNCH_PARAM_BUFFER_SIZE
                     reinterpret_cast<void*>(0x03)};                 // HIP_LAUNCH_PARAM_END
    // The calling thread's current device must be the stream's (newer HIP runtimes refuse the launch
    // with hipErrorInvalidResourceHandle otherwise): switched to `device` for the launch when it is
    // another, and switched back. The common case costs one hipGetDevice (thread-local).
    int current = -1;
    const bool switched = d.hipGetDevice(&current) != 0 || current != device;
    if (switched) {
      if (Result rs = d.hipSetDevice(device); rs) return DriverError(d, "hipSetDevice (before the launch)", rs);
    }
    r = d.hipModuleLaunchKernel(slot->function, static_cast<unsigned>(grid), static_cast<unsigned>(grid_y), 1,
                                static_cast<unsigned>(block), 1, 1, static_cast<unsigned>(smem), stream, nullptr,
                                extra);
    if (switched && current >= 0) d.hipSetDevice(current);
    if (r) return DriverError(d, "hipModuleLaunchKernel", r);
  } else {
    Handle current = nullptr;
    d.cuCtxGetCurrent(&current);
    const bool push = current != slot->context;
    if (push) d.cuCtxPushCurrent(slot->context);
    r = d.cuLaunchKernel(slot->function, static_cast<unsigned>(grid), static_cast<unsigned>(grid_y), 1,
                         static_cast<unsigned>(block), 1, 1,
                         static_cast<unsigned>(smem), stream, kparams, nullptr);
    if (push) d.cuCtxPopCurrent(&current);
    if (r) return DriverError(d, "cuLaunchKernel", r);
  }
  g_launches.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

}  // namespace

uint64_t GpuLaunchCount() { return g_launches.load(std::memory_order_relaxed); }
uint64_t GpuModuleCount() { return g_modules.load(std::memory_order_relaxed); }

namespace {
// The launch attributes every stage binds, after the stage's own contexts and buffers.
template <typename Binding>
auto WithLaunchAttrs(Binding b) {
  return std::move(b)
      .template Attr<std::string_view>("code")
      .template Attr<int64_t>("code_hash")
      .template Attr<std::string_view>("kernel")
      .template Attr<int64_t>("grid_div")
      .template Attr<int64_t>("grid_y")
      .template Attr<int64_t>("block")
      .template Attr<int64_t>("smem")
      .template Attr<ffi::Span<const int64_t>>("signature")
      .template Attr<std::string_view>("buffer_names");
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGpuCheckBuffers, CheckBuffersOnly,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("signature")
                                  .Attr<std::string_view>("buffer_names"));

// The stages of one vendor: the registered platform fixes the driver.
template <Vendor V>
constexpr auto kInitializeOn = [](auto&&... a) { return Initialize(V, std::forward<decltype(a)>(a)...); };
template <Vendor V>
constexpr auto kExecuteOn = [](auto&&... a) { return Execute(V, std::forward<decltype(a)>(a)...); };

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGpuRopeCacheInstantiate, Instantiate, WithLaunchAttrs(ffi::Ffi::BindInstantiate()));

#define JRC_INITIALIZE_BINDING \
  WithLaunchAttrs(ffi::Ffi::BindInitialize().Ctx<ffi::DeviceOrdinal>().RemainingArgs().RemainingRets())
#define JRC_EXECUTE_BINDING                                                                              \
  WithLaunchAttrs(                                                                                      \
      ffi::Ffi::Bind().Ctx<ffi::PlatformStream<void*>>().Ctx<ffi::DeviceOrdinal>().RemainingArgs().RemainingRets())

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGpuRopeCacheInitializeCuda, kInitializeOn<Vendor::kCuda>, JRC_INITIALIZE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kGpuRopeCacheInitializeHip, kInitializeOn<Vendor::kHip>, JRC_INITIALIZE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kGpuRopeCacheExecuteCuda, kExecuteOn<Vendor::kCuda>, JRC_EXECUTE_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kGpuRopeCacheExecuteNoGraphCuda, kExecuteOn<Vendor::kCuda>, JRC_EXECUTE_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kGpuRopeCacheExecuteHip, kExecuteOn<Vendor::kHip>, JRC_EXECUTE_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kGpuRopeCacheExecuteNoGraphHip, kExecuteOn<Vendor::kHip>, JRC_EXECUTE_BINDING);

#undef JRC_INITIALIZE_BINDING
#undef JRC_EXECUTE_BINDING

}  // namespace jax_rope_cache

#ifdef JRC_LAUNCHER_TEST
// CPU-side harness for the driver paths (tests/test_hip_launcher.py builds this file with
// -DJRC_LAUNCHER_TEST and runs it against stub libamdhip64.so.7 / libcuda.so.1): the execute
// stages exactly as above, except that the stream is the constant kTestStream (a CPU backend has
// no GPU stream to hand over). Instantiate and initialize are the production symbols.
namespace jax_rope_cache {
constexpr uintptr_t kTestStream = 0x5157;
template <Vendor V>
constexpr auto kExecuteOnTestStream = [](auto&&... a) {
  return Execute(V, reinterpret_cast<void*>(kTestStream), std::forward<decltype(a)>(a)...);
};
#define JRC_TEST_BINDING \
  WithLaunchAttrs(ffi::Ffi::Bind().Ctx<ffi::DeviceOrdinal>().RemainingArgs().RemainingRets())
XLA_FFI_DEFINE_HANDLER_SYMBOL(kGpuRopeCacheExecuteHipTest, kExecuteOnTestStream<Vendor::kHip>, JRC_TEST_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kGpuRopeCacheExecuteNoGraphHipTest, kExecuteOnTestStream<Vendor::kHip>,
                              JRC_TEST_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(kGpuRopeCacheExecuteCudaTest, kExecuteOnTestStream<Vendor::kCuda>, JRC_TEST_BINDING);
#undef JRC_TEST_BINDING
}  // namespace jax_rope_cache
#endif  // JRC_LAUNCHER_TEST
