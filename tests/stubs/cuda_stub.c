/* A stand-in libcuda.so.1 for tests/test_hip_launcher.py: it has every symbol the launcher binds
 * for CUDA, logs each call to $HIP_STUB_LOG ({"call": "cu..."}) and fails all of them, so a test
 * sees which driver a handler bound when both libraries are loaded in one process.
 *     cc -shared -fPIC -O1 -Wl,-soname,libcuda.so.1 -o libcuda.so.1 cuda_stub.c
 */
#include <stdio.h>
#include <stdlib.h>

static int logged(const char* name) {
  const char* path = getenv("HIP_STUB_LOG");
  if (path && *path) {
    FILE* f = fopen(path, "a");
    if (f) {
      fprintf(f, "{\"call\": \"%s\"}\n", name);
      fclose(f);
    }
  }
  return 999; /* CUDA_ERROR_UNKNOWN */
}

int cuInit(unsigned flags) { (void)flags; logged("cuInit"); return 0; }
int cuDeviceGet(int* d, int o) { (void)d; (void)o; return logged("cuDeviceGet"); }
int cuDeviceGetAttribute(int* v, int a, int d) { (void)v; (void)a; (void)d; return logged("cuDeviceGetAttribute"); }
int cuDevicePrimaryCtxRetain(void** c, int d) { (void)c; (void)d; return logged("cuDevicePrimaryCtxRetain"); }
int cuCtxPushCurrent_v2(void* c) { (void)c; return logged("cuCtxPushCurrent_v2"); }
int cuCtxPopCurrent_v2(void** c) { (void)c; return logged("cuCtxPopCurrent_v2"); }
int cuCtxGetCurrent(void** c) { (void)c; return logged("cuCtxGetCurrent"); }
int cuModuleLoadData(void** m, const void* i) { (void)m; (void)i; return logged("cuModuleLoadData"); }
int cuModuleGetFunction(void** f, void* m, const char* n) { (void)f; (void)m; (void)n; return logged("cuModuleGetFunction"); }
int cuLaunchKernel(void* f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g, unsigned s, void* st,
                   void** p, void** x) {
  (void)f, (void)a, (void)b, (void)c, (void)d, (void)e, (void)g, (void)s, (void)st, (void)p, (void)x;
  return logged("cuLaunchKernel");
}
int cuGetErrorString(int e, const char** s) {
  (void)e;
  *s = "CUDA stub error";
  return 0;
}
