/* A stand-in for the HIP runtime (libamdhip64.so.7) on a machine without an AMD GPU, so CI can
 * drive the launcher's HIP path (kernels/ffi/gpu_launcher.cc) end to end. Built by
 * tests/test_hip_launcher.py with the system C compiler:
 *     cc -shared -fPIC -O1 -Wl,-soname,libamdhip64.so.7 -o libamdhip64.so.7 hip_stub.c
 *
 * It implements exactly the entry points the launcher binds (hipInit, hipGetDevice, hipSetDevice,
 * hipGetDevicePropertiesR0600, hipRuntimeGetVersion, hipModuleLoadData, hipModuleGetFunction,
 * hipModuleLaunchKernel, hipGetErrorString), the few more a ctypes check drives (hipMalloc, hipFree,
 * hipMemcpy, hipDeviceSynchronize, hipModuleUnload: "device" memory is host memory, a launch runs
 * nothing) and appends one JSON line per call to $HIP_STUB_LOG
 * (hipInit's names the library: -DSTUB_SONAME="\"libamdhip64.so.N\"" at build), with what a test needs
 * to check: the code object loaded (size, FNV-1a 64 hash, ELF e_flags), the symbol asked for, and
 * for each launch the grid, block, dynamic shared memory, stream, the current device and the
 * bytes of the `extra` kernarg buffer (HIP_LAUNCH_PARAM_BUFFER_POINTER / _SIZE / _END).
 *
 * As a real runtime, the current device is per thread (each thread starts on device 0), and (as
 * newer HIP runtimes do) hipModuleLaunchKernel fails with hipErrorInvalidResourceHandle when the
 * calling thread's current device is not the device the module was loaded on.
 *
 * Behaviour knobs (environment):
 *   HIP_STUB_ARCH        gcnArchName the device reports ("gfx942:sramecc+:xnack-"); "" = do not
 *                        report one (hipGetDevicePropertiesR0600 fails with hipErrorNotSupported)
 *   HIP_STUB_ACCEPT_MACH ELF e_flags & 0xff (EF_AMDGPU_MACH) hipModuleLoadData accepts, as a real
 *                        runtime only accepts code objects of the device's ISA (default: any)
 *   HIP_STUB_DEVICES     number of devices (default 8); hipSetDevice beyond it fails
 *   HIP_STUB_INIT_ERROR  hipInit returns this error code
 *   HIP_STUB_LAUNCH_ERROR hipModuleLaunchKernel returns this error code
 *   HIP_STUB_RUNTIME_VERSION what hipRuntimeGetVersion reports (HIP_VERSION encoding, major * 10^7 +
 *                        minor * 10^5 + patch; default 70100000 = 7.1.0)
 *   HIP_STUB_MAX_CO_VERSION hipModuleLoadData refuses (hipErrorNoBinaryForGpu) AMDHSA code objects of
 *                        a higher code-object version, as a ROCm < 6.3 runtime refuses v6
 *   HIP_STUB_PEEK_WORDS  for the first N 8-byte kernarg words, also log the first 4 bytes at the
 *                        address the word holds (CI runs on a CPU backend, where buffers are host
 *                        memory: the test checks each pointer reaches the right operand)
 * hipDeviceProp_tR0600 facts used: 1472 bytes, char name[256] at 0, char gcnArchName[256] at 1160
 * (the ROCm 6.x / 7.x headers; see docs/rocm.md, "Arch selection").
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int hipError_t;
enum { kSuccess = 0, kInvalidValue = 1, kInvalidDevice = 101, kInvalidImage = 200, kNoBinaryForGpu = 209,
       kInvalidHandle = 400, kNotFound = 500, kNotSupported = 801 };

#define PROP_SIZE 1472
#define PROP_GCN_ARCH_NAME 1160

#ifndef STUB_SONAME
#define STUB_SONAME "libamdhip64.so.7"
#endif

static __thread int g_device = 0; /* the calling thread's current device */

static void log_line(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
#include <stdarg.h>
static void log_line(const char* fmt, ...) {
  const char* path = getenv("HIP_STUB_LOG");
  if (!path || !*path) return;
  FILE* f = fopen(path, "a");
  if (!f) return;
  va_list ap;
  va_start(ap, fmt);
  vfprintf(f, fmt, ap);
  va_end(ap);
  fputc('\n', f);
  fclose(f);
}

static int env_int(const char* name, int dflt) {
  const char* v = getenv(name);
  return (v && *v) ? (int)strtol(v, NULL, 0) : dflt;
}

hipError_t hipInit(unsigned flags) {
  log_line("{\"call\": \"hipInit\", \"flags\": %u, \"lib\": \"%s\"}", flags, STUB_SONAME);
  return env_int("HIP_STUB_INIT_ERROR", 0);
}

hipError_t hipGetDevice(int* device) {
  if (!device) return kInvalidValue;
  *device = g_device;
  return kSuccess;
}

hipError_t hipSetDevice(int device) {
  log_line("{\"call\": \"hipSetDevice\", \"device\": %d}", device);
  if (device < 0 || device >= env_int("HIP_STUB_DEVICES", 8)) return kInvalidDevice;
  g_device = device;
  return kSuccess;
}

hipError_t hipRuntimeGetVersion(int* version) {
  if (!version) return kInvalidValue;
  *version = env_int("HIP_STUB_RUNTIME_VERSION", 70100000);
  return kSuccess;
}

hipError_t hipGetDevicePropertiesR0600(void* prop, int device) {
  const char* arch = getenv("HIP_STUB_ARCH");
  log_line("{\"call\": \"hipGetDevicePropertiesR0600\", \"device\": %d}", device);
  if (!prop) return kInvalidValue;
  if (!arch || !*arch) return kNotSupported;
  memset(prop, 0, PROP_SIZE);
  strncpy((char*)prop, "HIP stub device", 255);
  strncpy((char*)prop + PROP_GCN_ARCH_NAME, arch, 255);
  return kSuccess;
}

/* ---- modules ------------------------------------------------------------------------------- */
typedef struct {
  const unsigned char* image;
  uint64_t size;
  uint64_t hash;
  uint32_t flags;
  int device;
} Module;

typedef struct {
  Module* module;
  char name[256];
} Function;

static uint64_t rd(const unsigned char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

/* Size of an ELF64 image: the end of its section header table (it comes last in a code object). */
static uint64_t elf_size(const unsigned char* p) {
  uint64_t shoff = rd(p + 0x28, 8), shentsize = rd(p + 0x3A, 2), shnum = rd(p + 0x3C, 2);
  uint64_t end = shoff + shentsize * shnum;
  return end < 64 ? 64 : end;
}

hipError_t hipModuleLoadData(void** module, const void* image) {
  const unsigned char* p = (const unsigned char*)image;
  if (!module || !p) return kInvalidValue;
  if (memcmp(p, "\x7f" "ELF", 4) != 0 || p[4] != 2 || p[5] != 1) {
    log_line("{\"call\": \"hipModuleLoadData\", \"result\": %d}", kInvalidImage);
    return kInvalidImage;
  }
  Module* m = (Module*)calloc(1, sizeof(Module));
  m->image = p;
  m->size = elf_size(p);
  m->flags = (uint32_t)rd(p + 0x30, 4);
  m->device = g_device;
  uint64_t h = 1469598103934665603ull; /* FNV-1a 64 */
  for (uint64_t i = 0; i < m->size; ++i) h = (h ^ p[i]) * 1099511628211ull;
  m->hash = h;
  int accept = env_int("HIP_STUB_ACCEPT_MACH", -1);
  hipError_t r = (accept >= 0 && (int)(m->flags & 0xff) != accept) ? kNoBinaryForGpu : kSuccess;
  int max_co = env_int("HIP_STUB_MAX_CO_VERSION", 99);
  if (p[7] == 64 && p[8] + 2 > max_co) r = kNoBinaryForGpu; /* EI_OSABI AMDGPU_HSA, EI_ABIVERSION */
  log_line("{\"call\": \"hipModuleLoadData\", \"device\": %d, \"size\": %llu, \"fnv1a64\": \"%016llx\", "
           "\"e_flags\": %u, \"result\": %d}",
           m->device, (unsigned long long)m->size, (unsigned long long)m->hash, m->flags, r);
  if (r != kSuccess) {
    free(m);
    return r;
  }
  *module = m;
  return kSuccess;
}

/* The symbol must be in the image (as a NUL-delimited string of its string tables). */
static int image_has_symbol(const Module* m, const char* name) {
  size_t n = strlen(name);
  for (uint64_t i = 0; i + n + 2 <= m->size; ++i)
    if (m->image[i] == 0 && memcmp(m->image + i + 1, name, n) == 0 && m->image[i + 1 + n] == 0) return 1;
  return 0;
}

hipError_t hipModuleGetFunction(void** function, void* module, const char* name) {
  Module* m = (Module*)module;
  if (!function || !m || !name) return kInvalidValue;
  int found = image_has_symbol(m, name);
  log_line("{\"call\": \"hipModuleGetFunction\", \"name\": \"%s\", \"module_fnv1a64\": \"%016llx\", \"result\": %d}",
           name, (unsigned long long)m->hash, found ? kSuccess : kNotFound);
  if (!found) return kNotFound;
  Function* f = (Function*)calloc(1, sizeof(Function));
  f->module = m;
  strncpy(f->name, name, sizeof(f->name) - 1);
  *function = f;
  return kSuccess;
}

hipError_t hipModuleLaunchKernel(void* function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                 unsigned bz, unsigned shmem, void* stream, void** params, void** extra) {
  Function* f = (Function*)function;
  if (!f) return kInvalidValue;
  const unsigned char* buf = NULL;
  size_t size = 0;
  int ended = 0;
  for (int i = 0; extra && i < 16; i += 2) {
    uintptr_t key = (uintptr_t)extra[i];
    if (key == 0x03) { ended = 1; break; }               /* HIP_LAUNCH_PARAM_END */
    if (key == 0x01) buf = (const unsigned char*)extra[i + 1]; /* HIP_LAUNCH_PARAM_BUFFER_POINTER */
    else if (key == 0x02) size = *(const size_t*)extra[i + 1]; /* HIP_LAUNCH_PARAM_BUFFER_SIZE */
    else return kInvalidValue;
  }
  char* hex = (char*)malloc(2 * size + 1);
  for (size_t i = 0; i < size && buf; ++i) sprintf(hex + 2 * i, "%02x", buf[i]);
  hex[buf ? 2 * size : 0] = 0;
  int peek = env_int("HIP_STUB_PEEK_WORDS", 0);
  char* peeks = (char*)calloc(16 * (size_t)(peek > 0 ? peek : 1) + 2, 1);
  char* q = peeks;
  *q++ = '[';
  for (int w = 0; buf && w < peek && (size_t)(8 * w + 8) <= size; ++w) {
    const unsigned char* at = (const unsigned char*)(uintptr_t)rd(buf + 8 * w, 8);
    if (w) *q++ = ',';
    if ((uintptr_t)at >= 0x10000) q += sprintf(q, "\"%02x%02x%02x%02x\"", at[0], at[1], at[2], at[3]);
    else q += sprintf(q, "null"); /* not a pointer: never dereferenced */
  }
  *q++ = ']';
  *q = 0;
  hipError_t r = env_int("HIP_STUB_LAUNCH_ERROR", 0);
  if (r == kSuccess && g_device != f->module->device) r = kInvalidHandle;
  log_line("{\"call\": \"hipModuleLaunchKernel\", \"name\": \"%s\", \"module_fnv1a64\": \"%016llx\", "
           "\"module_device\": %d, \"device\": %d, \"grid\": [%u, %u, %u], \"block\": [%u, %u, %u], \"shmem\": %u, "
           "\"stream\": %llu, \"kernel_params\": %s, \"extra_ended\": %s, \"kernarg_size\": %zu, "
           "\"kernarg\": \"%s\", \"peek\": %s, \"result\": %d}",
           f->name, (unsigned long long)f->module->hash, f->module->device, g_device, gx, gy, gz, bx, by, bz, shmem,
           (unsigned long long)(uintptr_t)stream, params ? "true" : "false", ended ? "true" : "false", size, hex, peeks,
           r);
  free(hex);
  free(peeks);
  return r;
}

/* ---- memory and synchronisation (tests/test_rocm_f16_conversion.py's host side) ---------------- */
hipError_t hipMalloc(void** ptr, size_t size) {
  if (!ptr) return kInvalidValue;
  *ptr = calloc(1, size ? size : 1);
  log_line("{\"call\": \"hipMalloc\", \"size\": %zu, \"device\": %d}", size, g_device);
  return *ptr ? kSuccess : kInvalidValue;
}

hipError_t hipFree(void* ptr) {
  log_line("{\"call\": \"hipFree\"}");
  free(ptr);
  return kSuccess;
}

hipError_t hipMemcpy(void* dst, const void* src, size_t size, int kind) {
  log_line("{\"call\": \"hipMemcpy\", \"size\": %zu, \"kind\": %d}", size, kind);
  if (!dst || !src) return kInvalidValue;
  memcpy(dst, src, size);
  return kSuccess;
}

hipError_t hipDeviceSynchronize(void) {
  log_line("{\"call\": \"hipDeviceSynchronize\", \"device\": %d}", g_device);
  return kSuccess;
}

hipError_t hipModuleUnload(void* module) {
  log_line("{\"call\": \"hipModuleUnload\"}");
  free(module);
  return kSuccess;
}

const char* hipGetErrorString(hipError_t e) {
  switch (e) {
    case kSuccess: return "hipSuccess";
    case kInvalidValue: return "hipErrorInvalidValue";
    case kInvalidDevice: return "hipErrorInvalidDevice";
    case kInvalidImage: return "hipErrorInvalidImage";
    case kNoBinaryForGpu: return "hipErrorNoBinaryForGpu";
    case kInvalidHandle: return "hipErrorInvalidResourceHandle";
    case kNotFound: return "hipErrorNotFound";
    case kNotSupported: return "hipErrorNotSupported";
    default: return "hipErrorUnknown (stub)";
  }
}
