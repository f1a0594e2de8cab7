// The run-time CPU checks behind every kernel with an AVX-512 version (simd.h).

#include <cstdlib>
#include <strings.h>

#include "simd.h"

bool cpu_has_avx512_vnni() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return has;
}

// Whether the AVX-512 versions run: the CPU has them and PAGODA_CPU_ISA is not "avx2"
// (any case; read at every call, so a test can compare the two versions in one process).
bool use_avx512() {
  const char* isa = std::getenv("PAGODA_CPU_ISA");
  return cpu_has_avx512_vnni() && !(isa && strcasecmp(isa, "avx2") == 0);
}
