/* Which kernel levels this CPU runs, and which level this library was built as. Bits, in the
 * order of `isa.LEVELS`: 0 scalar, 1 neon, 2 avx2, 3 avx512, 4 avx512bf16. The CPU is asked at
 * run time (cpuid, which also reflects whether the OS saves the wider registers), so a library
 * cached on one machine is never trusted to fit another. */
#include "simd.h"

int tutorserve_cpu_levels(void) {
    int levels = 1;
#if defined(__aarch64__)
    levels |= 1 << 1; /* NEON is part of every AArch64 CPU */
#elif defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        levels |= 1 << 2;
    if ((levels & 1 << 2) && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq"))
        levels |= 1 << 3;
    /* Every CPU with AVX512-BF16 so far (Cooper Lake, Sapphire Rapids, Zen 4) has VNNI too. */
    if ((levels & 1 << 3) && __builtin_cpu_supports("avx512bf16") &&
        __builtin_cpu_supports("avx512vnni"))
        levels |= 1 << 4;
#endif
    return levels;
}

int tutorserve_level(void) {
#if defined(TS_BF16DOT)
    return 4;
#elif defined(TS_AVX512)
    return 3;
#elif defined(TS_AVX2)
    return 2;
#elif defined(TS_NEON)
    return 1;
#else
    return 0;
#endif
}
