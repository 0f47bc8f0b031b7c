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

/* The j-th 6-bit (scale, min) pair of a Q4_K/Q5_K block's 12 packed bytes. */
static inline void scale_min_k4(int j, const uint8_t *s, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | (s[j - 4] >> 6) << 4;
        *mn = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
}

static inline uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}
#endif
