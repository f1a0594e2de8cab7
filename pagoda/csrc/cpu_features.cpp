// The run-time CPU checks behind every kernel with an AVX-512 version (simd.h).

#include <cstdlib>
#include <strings.h>
#include <sys/syscall.h>
#include <unistd.h>

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

// Whether the CPU has AMX int8 tiles and Linux lets this process use them: the tile
// state is handed out on request only (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, once per process; pagoda.ops.cpu_kernels.amx_permitted asks the
// same for oneDNN).
bool cpu_has_amx_int8() {
  static const bool has = [] {
    __builtin_cpu_init();
    if (!cpu_has_avx512_vnni() || !__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8"))
      return false;
#if defined(__x86_64__) && defined(SYS_arch_prctl)
    constexpr long kReqXcompPerm = 0x1023, kGetXcompPerm = 0x1022, kXtiledata = 18;
    if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) != 0) return false;
    unsigned long granted = 0;
    syscall(SYS_arch_prctl, kGetXcompPerm, &granted);
    return (granted & (1ul << kXtiledata)) != 0;
#else
    return false;
#endif
  }();
  return has;
}

// Whether pagoda's AMX kernels run: the tiles are there (cpu_has_amx_int8) and
// PAGODA_CPU_ISA is neither "avx2" nor "avx512" (the latter keeps to the AVX-512 VNNI
// versions, for comparisons and tests).
bool use_amx() {
  const char* isa = std::getenv("PAGODA_CPU_ISA");
  return cpu_has_amx_int8() && !(isa && (strcasecmp(isa, "avx2") == 0 || strcasecmp(isa, "avx512") == 0));
}
