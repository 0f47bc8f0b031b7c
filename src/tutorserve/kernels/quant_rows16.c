/* Matmuls on weights repacked sixteen rows at a time, so that each vector lane computes one
 * output row: Q4_0, Q4_1, Q5_0 and Q8_0 here, the K-quants in quant_rows16_k.c.
 *
 * In GGUF's layout each row's blocks follow each other, so a vector holds one row's codes: its
 * lanes' products must be added across the vector at the end of every row, and each block's
 * scale is spread over the lanes that its codes occupy. Repacked, a block of sixteen rows holds
 * their sixteen scales (d, and Q4_1's m) side by side, then their codes as 32-bit words of
 * four bytes, one row per lane: word j of every row, then word j + 1. One 32-bit word of
 * activation codes, broadcast, meets a vector of sixteen rows' words in one integer
 * multiply-add (VNNI vpdpbusd, or vpmaddubsw + vpmaddwd), and the results are already the
 * sixteen rows' sums: no shuffles, no horizontal sums, one scale load per block for all rows.
 * llama.cpp interleaves Q4_0 rows in the same spirit on CPUs that gain from it. The bytes are
 * GGUF's, moved: a repacked weight is exactly as large.
 *
 * Byte j of a Q4 block holds code j in its low nibble and code j + 16 in its high one, so word
 * j (bytes 4j..4j+3) holds codes 4j..4j+3 low and 16+4j..16+4j+3 high, and each meets its own
 * four activation codes, whose scale (one per four, as in quant_x8.c) it is then multiplied by.
 *
 * Q5_0's fifth bits (a 32-bit word per row and block) are regrouped the same way: for word j,
 * one 64-bit mask for the low codes and one for the high ones, bit 4l + t for lane l's code t,
 * so that one masked byte move (AVX-512; AVX2 expands half a mask) ORs them into the codes.
 *
 * Q8_0's codes are whole signed bytes: repacked, word j holds codes 4j..4j+3 plus 128 (an
 * unsigned byte, as the integer multiply-add takes weights), and 128 Σ x is taken off again as
 * Q4_0's 8 Σ x is.
 *
 * Repacked block of sixteen rows: d[16] (half), Q4_1's m[16] (half), Q5_0's masks[4][2]
 * (uint64), then words[4][16] (Q8_0: words[8][16]).
 */
#include <stdlib.h>

#include "rows16.h"

void tutorserve_quantize_rows(const void *x, int x_bf16, int64_t batch, int64_t ldx, int64_t k,
                              int8_t *qx, float *dx, float *sx, int num_threads); /* quant_x8.c */
void tutorserve_decode_block(int fmt, const uint8_t *b, int8_t *q, float *scale,
                             float *offset); /* quant.c */

static int halves_of(int fmt) { return fmt == Q4_1 ? 2 : 1; } /* d, and Q4_1's m */
static int is_k(int fmt) { return fmt == Q4_K || fmt == Q6_K; }

/* GGUF rows (n of them, k weights each) → the repacked layout. 0; -1 for another format or
 * rows that do not come in sixteens of whole blocks. */
int quant_repack16(const void *src, int fmt, int64_t n, int64_t k, void *dst) {
    if (!repacks16(fmt) || n % LANES || k % group_of(fmt)) return -1;
    if (is_k(fmt)) return k_repack16(src, fmt, n, k, dst);
    const int nb = bytes_of(fmt), head = head_bytes(fmt);
    const int64_t blocks = k / 32;
    for (int64_t g = 0; g < n / LANES; g++)
        for (int64_t i = 0; i < blocks; i++) {
            uint8_t *o = (uint8_t *)dst + (g * blocks + i) * LANES * nb;
            uint64_t masks[8] = {0};
            for (int l = 0; l < LANES; l++) {
                const uint8_t *b = (const uint8_t *)src + ((g * LANES + l) * blocks + i) * nb;
                for (int h = 0; h < halves_of(fmt); h++)
                    memcpy(o + 2 * (h * LANES + l), b + 2 * h, 2);
                const uint32_t qh = fmt == Q5_0 ? u32_at(b + 2) : 0;
                for (int m = 0; m < 8; m++) /* m = 2j + h: bits 16h + 4j .. + 3 */
                    masks[m] |= (uint64_t)(qh >> (16 * (m & 1) + 4 * (m / 2)) & 0xF) << 4 * l;
                for (int j = 0; j < words_of(fmt); j++) {
                    const uint32_t word = u32_at(b + head + 4 * j) ^ (fmt == Q8_0 ? Q8_FLIP : 0);
                    memcpy(o + head * LANES + (j * LANES + l) * 4, &word, 4);
                }
            }
            if (fmt == Q5_0) memcpy(o + 2 * LANES, masks, sizeof masks); /* after d[16] */
        }
    return 0;
}

/* Lane l of a repacked group block, back in GGUF's layout at out. */
static void unpack16_block(const uint8_t *o, int fmt, int l, uint8_t *b) {
    const int head = head_bytes(fmt);
    for (int h = 0; h < halves_of(fmt); h++) memcpy(b + 2 * h, o + 2 * (h * LANES + l), 2);
    if (fmt == Q5_0) {
        uint64_t masks[8];
        uint32_t qh = 0;
        memcpy(masks, o + 2 * LANES, sizeof masks);
        for (int m = 0; m < 8; m++)
            qh |= (uint32_t)(masks[m] >> 4 * l & 0xF) << (16 * (m & 1) + 4 * (m / 2));
        memcpy(b + 2, &qh, sizeof qh);
    }
    for (int j = 0; j < words_of(fmt); j++) {
        const uint32_t word =
            u32_at(o + head * LANES + (j * LANES + l) * 4) ^ (fmt == Q8_0 ? Q8_FLIP : 0);
        memcpy(b + head + 4 * j, &word, 4);
    }
}

static void unpack_block(const uint8_t *group_block, int fmt, int l, uint8_t *out) {
    if (is_k(fmt))
        k_unpack16_block(group_block, fmt, l, out);
    else
        unpack16_block(group_block, fmt, l, out);
}

/* Row r of a repacked weight (k weights), back in GGUF's layout at out. */
void tutorserve_unpack16_row(const void *w, int fmt, int64_t r, int64_t k, uint8_t *out) {
    const int nb = bytes_of(fmt);
    const int64_t blocks = k / group_of(fmt), g = r / LANES;
    for (int64_t i = 0; i < blocks; i++)
        unpack_block((const uint8_t *)w + (g * blocks + i) * LANES * nb, fmt, (int)(r % LANES),
                     out + i * nb);
}

#if defined(TS_AVX512) || defined(TS_AVX2)
/* Activation rows a tile holds: with AVX-512's 32 registers, eight rows' sums (two each) and
 * the codes fit; AVX2's sixteen hold four. */
#if defined(TS_AVX512)
#define TILE_ROWS 8
#else
#define TILE_ROWS 4
#endif
/* Lanes part·W .. part·W + W − 1 of sixteen rows' group g, for ROWS activation rows from b0. */
__attribute__((always_inline)) static inline void group_tile(const Args *a, const int FMT,
                                                             int64_t g, int part, int64_t b0,
                                                             const int ROWS) {
    const int nb = bytes_of(FMT), head = head_bytes(FMT);
    vf acc[TILE_ROWS];
    for (int b = 0; b < ROWS; b++) acc[b] = vzero();
    for (int64_t i = 0; i < a->blocks; i++) {
        const uint8_t *blk = a->w + (g * a->blocks + i) * LANES * nb;
        vf part_sum[TILE_ROWS];
        for (int b = 0; b < ROWS; b++) part_sum[b] = vzero();
        for (int j = 0; j < words_of(FMT); j++) {
            const vi v = vi_load(blk + head * LANES + (j * LANES + part * W) * 4);
            if (FMT == Q8_0) {
                for (int b = 0; b < ROWS; b++) {
                    const int8_t *q = a->qx + (b0 + b) * a->k + i * 32;
                    const float dx = a->dx[((b0 + b) * a->k + i * 32) / 4 + j];
                    part_sum[b] = vfma(dot4_u8(v, word_at(q + 4 * j)), vset1(dx), part_sum[b]);
                }
                continue;
            }
            vi lo = vi_nibbles(v, 0), hi = vi_nibbles(v, 1);
            if (FMT == Q5_0) {
                lo = vi_or(lo, fifth_bits(blk + 2 * LANES, 2 * j, part));
                hi = vi_or(hi, fifth_bits(blk + 2 * LANES, 2 * j + 1, part));
            }
            for (int b = 0; b < ROWS; b++) {
                const int8_t *q = a->qx + (b0 + b) * a->k + i * 32;
                const float *dx = a->dx + (b0 + b) * a->k / 4 + i * 8;
                part_sum[b] = vfma(dot4(lo, word_at(q + 4 * j)), vset1(dx[j]), part_sum[b]);
                part_sum[b] =
                    vfma(dot4(hi, word_at(q + 16 + 4 * j)), vset1(dx[4 + j]), part_sum[b]);
            }
        }
        const vf d = halves(blk + 2 * part * W);
        for (int b = 0; b < ROWS; b++) {
            const float s = sum32(a, b0 + b, i * 32);
            if (FMT == Q4_1) {
                acc[b] = vfma(d, part_sum[b], acc[b]);
                acc[b] = vfma(halves(blk + 2 * LANES + 2 * part * W), vset1(s), acc[b]);
            } else { /* w = d (q - 8), Q5_0's d (q - 16), Q8_0's d (q + 128 - 128) */
                const float bias = FMT == Q8_0 ? 128.f : FMT == Q5_0 ? 16.f : 8.f;
                acc[b] = vfma(d, vsub(part_sum[b], vset1(bias * s)), acc[b]);
            }
        }
    }
    store_tile(a, g, part, b0, acc, ROWS);
}

__attribute__((always_inline)) static inline void group(const Args *a, int64_t g, int64_t batch,
                                                        const int FMT) {
    for (int part = 0; part < LANES / W; part++)
        for (int64_t b0 = 0; b0 < batch; b0 += TILE_ROWS) {
            switch (batch - b0 < TILE_ROWS ? batch - b0 : TILE_ROWS) {
            case 1: group_tile(a, FMT, g, part, b0, 1); break;
            case 2: group_tile(a, FMT, g, part, b0, 2); break;
            case 3: group_tile(a, FMT, g, part, b0, 3); break;
#if TILE_ROWS > 4
            case 4: group_tile(a, FMT, g, part, b0, 4); break;
            case 5: group_tile(a, FMT, g, part, b0, 5); break;
            case 6: group_tile(a, FMT, g, part, b0, 6); break;
            case 7: group_tile(a, FMT, g, part, b0, 7); break;
#endif
            default: group_tile(a, FMT, g, part, b0, TILE_ROWS); break;
            }
        }
}

static void any_group(const Args *a, int64_t g, int64_t batch, int fmt) {
    switch (fmt) {
    case Q4_0: group(a, g, batch, Q4_0); break;
    case Q4_1: group(a, g, batch, Q4_1); break;
    case Q5_0: group(a, g, batch, Q5_0); break;
    case Q8_0: group(a, g, batch, Q8_0); break;
    default: k_group(a, g, batch, fmt); break;
    }
}

#else /* scalar and NEON: plain C, each lane's blocks back in GGUF's layout and decoded */
static void any_group(const Args *a, int64_t g, int64_t batch, int fmt) {
    const int nb = bytes_of(fmt), size = group_of(fmt);
    uint8_t block[256];
    int8_t q[256 + 64];
    float scale[16], offset[16];
    for (int l = 0; l < LANES; l++)
        for (int64_t b0 = 0; b0 < batch; b0 += MAX_ROWS) {
            const int rows = batch - b0 < MAX_ROWS ? (int)(batch - b0) : MAX_ROWS;
            float acc[MAX_ROWS] = {0};
            for (int64_t i = 0; i < a->blocks; i++) {
                unpack_block(a->w + (g * a->blocks + i) * LANES * nb, fmt, l, block);
                tutorserve_decode_block(fmt, block, q, scale, offset);
                for (int b = 0; b < rows; b++) {
                    const int64_t at = (b0 + b) * a->k + i * size; /* this block's first x */
                    for (int c = 0; c < size / 16; c++) {
                        float sum = 0.f;
                        for (int four = 0; four < 4; four++) {
                            int32_t dot = 0;
                            for (int t = 0; t < 4; t++)
                                dot += q[16 * c + 4 * four + t] * a->qx[at + 16 * c + 4 * four + t];
                            sum += (float)dot * a->dx[(at + 16 * c) / 4 + four];
                        }
                        acc[b] += scale[c] * sum + offset[c] * a->sums[at / 16 + c];
                    }
                }
            }
            for (int b = 0; b < rows; b++)
                store_any(a->y, (b0 + b) * a->ldy + g * LANES + l, acc[b], a->y_bf16);
        }
}
#endif

/* y = x W^T as quant_matmul (quant.c) takes it, W repacked by quant_repack16. 0; -1 for another
 * format or shape; -2 when a buffer cannot be allocated. */
int quant_matmul_rows16(const void *w, int fmt, int64_t n, int64_t k, const void *x, int x_bf16,
                        int64_t batch, int64_t ldx, void *y, int y_bf16, int64_t ldy,
                        int num_threads) {
    if (!repacks16(fmt) || n % LANES || k % group_of(fmt)) return -1;
    int8_t *qx = malloc((size_t)(batch * k));
    float *scales = malloc(sizeof(float) * (size_t)(batch * (k / 2 + k / 16)));
    if (!qx || !scales) {
        free(qx), free(scales);
        return -2;
    }
    float *dx = scales, *sx = scales + batch * k / 4, *sums = sx + batch * k / 4;
    tutorserve_quantize_rows(x, x_bf16, batch, ldx, k, qx, dx, sx, num_threads);
    for (int64_t c = 0; c < batch * k / 16; c++)
        sums[c] = sx[4 * c] + sx[4 * c + 1] + sx[4 * c + 2] + sx[4 * c + 3];
    const Args a = {w, k / group_of(fmt), k, ldy, qx, dx, sums, y, y_bf16};
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t g = 0; g < n / LANES; g++) any_group(&a, g, batch, fmt);
    free(qx), free(scales);
    return 0;
}
