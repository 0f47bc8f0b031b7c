/* Scalar conversions between float32 and the 16-bit formats GGUF blocks and our tensors store. */
#ifndef TUTORSERVE_CONVERT_H
#define TUTORSERVE_CONVERT_H
#include "simd.h"

/* An IEEE half at p (unaligned, little-endian) as float32: one instruction where F16C or
 * NEON has it, bit manipulation in the scalar build. */
static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
#if defined(TS_AVX2) || defined(TS_AVX512)
    return _cvtsh_ss(h);
#elif defined(TS_NEON)
    __fp16 f;
    memcpy(&f, &h, sizeof f);
    return (float)f;
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = h >> 10 & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) {
        bits = sign | 0x7F800000u | man << 13;
    } else if (exp != 0) {
        bits = sign | (exp + 112) << 23 | man << 13;
    } else { /* zero or subnormal: man * 2^-24 */
        const float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
#endif
}

/* float32 → bfloat16 bits, to nearest, ties to even (as PyTorch converts). */
static inline uint16_t bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFFu + (u >> 16 & 1u)) >> 16);
}

/* Element i of a float32 (is_bf16 = 0) or bfloat16 row. */
static inline float load_any(const void *x, int64_t i, int is_bf16) {
    if (!is_bf16) return ((const float *)x)[i];
    const uint32_t bits = (uint32_t)((const uint16_t *)x)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Stores v at element i of a float32 or bfloat16 row. */
static inline void store_any(void *y, int64_t i, float v, int is_bf16) {
    if (is_bf16)
        ((uint16_t *)y)[i] = bf16_bits(v);
    else
        ((float *)y)[i] = v;
}
#endif
