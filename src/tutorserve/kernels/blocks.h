/* GGUF's block formats as the quant kernels read them: ggml's type ids, weights and bytes per
 * block, and the K-quants' packed scales. A format id with ROWS16 set is its blocks repacked
 * sixteen rows at a time (quant_rows16.c). */
#ifndef TUTORSERVE_BLOCKS_H
#define TUTORSERVE_BLOCKS_H
#include <stdint.h>
#include <string.h>

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
enum { ROWS16 = 256 };

/* Weights per block and bytes per block, or 0 for a format the kernels do not know. */
static inline int group_of(int fmt) {
    switch (fmt) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: return 32;
    case Q4_K: case Q5_K: case Q6_K: return 256;
    default: return 0;
    }
}
static inline int bytes_of(int fmt) {
    switch (fmt) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}

/* Formats with a layout repacked sixteen rows at a time (quant_rows16.c). */
static inline int repacks16(int fmt) {
    return fmt == Q4_0 || fmt == Q4_1 || fmt == Q5_0 || fmt == Q8_0 || fmt == Q4_K || fmt == Q6_K;
}

static inline uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* A Q4_K/Q5_K block's eight 6-bit (scale, min) pairs, from their 12 packed bytes at s, as
 * eight scale bytes and eight min bytes (byte j: sub-block j's). Pairs 0-3 are the low six
 * bits of bytes 0-3 and 4-7; pairs 4-7 the nibbles of bytes 8-11, with their top two bits in
 * the top bits of bytes 0-3 and 4-7. A 32-bit word at a time. */
static inline void k4_scales(const uint8_t *s, uint64_t *sc, uint64_t *mn) {
    const uint32_t lo = u32_at(s), hi = u32_at(s + 4), top = u32_at(s + 8);
    const uint32_t sc47 = (top & 0x0F0F0F0F) | (lo >> 6 & 0x03030303) << 4;
    const uint32_t mn47 = (top >> 4 & 0x0F0F0F0F) | (hi >> 6 & 0x03030303) << 4;
    *sc = (lo & 0x3F3F3F3F) | (uint64_t)sc47 << 32;
    *mn = (hi & 0x3F3F3F3F) | (uint64_t)mn47 << 32;
}
#endif
