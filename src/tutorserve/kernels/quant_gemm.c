/* A bf16 GEMM on weights repacked sixteen rows at a time (quant_rows16.c), or Q8_0 in GGUF's
 * layout (a tied LM head), for calls with many activation rows (large decode batches,
 * speculative verification, prefill chunks), at the levels with the bf16 dot product.
 *
 * The int8 tiles give every four activation codes their own scale, so each integer
 * multiply-add (64 products) is followed by a conversion and an FMA on the same port: 32
 * products a cycle at best, whatever the row count. Here a group of sixteen weight rows is
 * dequantized once per call into a panel of bf16 pairs, [k / 2][16] 32-bit words (lane l: row
 * l's weights 2p and 2p + 1), the very values quant_dequantize writes in bf16; each activation
 * row then costs one vdpbf16ps per pair (32 products) on its bf16 values as they are, with
 * nothing after it. A tile of eight activation rows loads a panel word once for eight
 * products and one broadcast each (more rows ran slower). On a 2-core Zen 4, at 64 rows, a
 * layer takes 16-52 % less time than on the int8 tiles and 24-41 % less than dequantizing for
 * PyTorch's GEMM (docs/benchmarks/quantization.md, *A bf16 GEMM on the blocks*). It is the
 * dequantized model's arithmetic, more exact than int8 activations, without a dequantized copy
 * in memory.
 */
#include <stdlib.h>

#include "rows16.h"

#if defined(TS_BF16DOT)
enum { GEMM_ROWS = 8 }; /* activation rows per tile */

/* Four codes per lane (bytes of `codes`, unsigned) at k positions at..at + 3 of the sixteen
 * rows, as scale · code + offset rounded to bf16 pairs: panel words at / 2 and at / 2 + 1. */
static inline void emit4(uint32_t *panel, int64_t at, vi codes, vf scale, vf offset) {
    /* cvtne2ps gives [first operand's 16 values above, second's below]; this interleaves them */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                           1, 16, 0);
    vf f[4];
    for (int t = 0; t < 4; t++)
        f[t] = vfma(vi_float(vi_and(vi_srl(codes, 8 * t), 0xFF)), scale, offset);
    for (int h = 0; h < 2; h++) {
        const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(f[2 * h + 1], f[2 * h]);
        _mm512_storeu_si512(panel + (at / 2 + h) * LANES, _mm512_permutexvar_epi16(pairs, v));
    }
}

/* Group g of a 32-weight format's repacked rows (k weights each) into its panel. The offsets
 * are decode's (quant.c): Q4_0's -8 d, Q5_0's -16 d, Q4_1's m; Q8_0's codes are stored plus
 * 128, so -128 d, which gives d q in one rounding as decode's d · q + 0 does. */
static void panel32(const uint8_t *w, int fmt, int64_t g, int64_t k, uint32_t *panel) {
    const int nb = bytes_of(fmt), head = head_bytes(fmt);
    const float bias = fmt == Q8_0 ? -128.f : fmt == Q5_0 ? -16.f : -8.f;
    for (int64_t i = 0; i < k / 32; i++) {
        const uint8_t *blk = w + (g * (k / 32) + i) * LANES * nb;
        const vf d = halves(blk);
        const vf offset = fmt == Q4_1 ? halves(blk + 2 * LANES) : vmul(d, vset1(bias));
        for (int j = 0; j < words_of(fmt); j++) {
            const vi v = vi_load(blk + head * LANES + j * LANES * 4);
            if (fmt == Q8_0) {
                emit4(panel, i * 32 + 4 * j, v, d, offset);
                continue;
            }
            vi lo = vi_nibbles(v, 0), hi = vi_nibbles(v, 1);
            if (fmt == Q5_0) {
                lo = vi_or(lo, fifth_bits(blk + 2 * LANES, 2 * j, 0));
                hi = vi_or(hi, fifth_bits(blk + 2 * LANES, 2 * j + 1, 0));
            }
            emit4(panel, i * 32 + 4 * j, lo, d, offset);
            emit4(panel, i * 32 + 16 + 4 * j, hi, d, offset);
        }
    }
}

/* Q4_K: sub-block s's scale d · sc and offset -dmin · mn, as decode computes them. */
static void panel_q4k(const uint8_t *w, int64_t g, int64_t k, uint32_t *panel) {
    for (int64_t i = 0; i < k / 256; i++) {
        const uint8_t *blk = w + (g * (k / 256) + i) * LANES * bytes_of(Q4_K);
        const vf d = halves(blk + Q4K_D), neg_dmin = vsub(vzero(), halves(blk + Q4K_DMIN));
        vi sc[2], mn[2];
        q4k_scale_words(blk, 0, sc, mn);
        for (int s = 0; s < 8; s++) { /* word 8 (s / 2) + j: sub-block s in its nibbles s % 2 */
            const vf scale = vmul(d, byte_lanes(sc[s / 4], s % 4));
            const vf offset = vmul(neg_dmin, byte_lanes(mn[s / 4], s % 4));
            for (int j = 0; j < 8; j++) {
                const vi v = vi_load(blk + Q4K_CODES + (8 * (s / 2) + j) * LANES * 4);
                emit4(panel, i * 256 + 32 * s + 4 * j, vi_nibbles(v, s % 2), scale, offset);
            }
        }
    }
}

/* Q6_K: codes as q6k_tile builds them (quant_rows16_k.c), scale d · sc per 16, offset -32 of
 * it. Positions: half h, quarter q, word t → 128 h + 32 q + 4 t, sub-block 8 h + 2 q + t / 4. */
static void panel_q6k(const uint8_t *w, int64_t g, int64_t k, uint32_t *panel) {
    for (int64_t i = 0; i < k / 256; i++) {
        const uint8_t *blk = w + (g * (k / 256) + i) * LANES * bytes_of(Q6_K);
        const vf d = halves(blk + Q6K_D);
        vf scale[16];
        for (int c = 0; c < 16; c++) scale[c] = vmul(d, int8s(blk + Q6K_SCALES + c * LANES));
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 8; t++) {
                const vi low[2] = {vi_load(blk + Q6K_LOW + (16 * h + t) * LANES * 4),
                                   vi_load(blk + Q6K_LOW + (16 * h + 8 + t) * LANES * 4)};
                const vi high = vi_load(blk + Q6K_HIGH + (8 * h + t) * LANES * 4);
                for (int q = 0; q < 4; q++) {
                    const vi pair = vi_sll(vi_and(vi_srl(high, 2 * q), 0x03030303), 4);
                    const vi codes = vi_or(vi_nibbles(low[q & 1], q >= 2), pair);
                    const vf s = scale[8 * h + 2 * q + t / 4];
                    emit4(panel, i * 256 + 128 * h + 32 * q + 4 * t, codes, s,
                          vmul(s, vset1(-32.f)));
                }
            }
    }
}

/* Q8_0 in GGUF's layout (a tied LM head keeps it: models/weights.py): each row's block gives its
 * sixteen pair words d q (decode's d q + 0) in one vector; sixteen rows' vectors transposed. */
static void panel_q8_rows(const uint8_t *w, int64_t g, int64_t k, uint32_t *panel) {
    for (int64_t i = 0; i < k / 32; i++) {
        __m512i r[LANES];
        for (int l = 0; l < LANES; l++) {
            const uint8_t *blk = w + ((g * LANES + l) * (k / 32) + i) * bytes_of(Q8_0);
            const vf d = vset1(half(blk));
            const vf lo = vmul(vload_i8((const int8_t *)blk + 2), d);
            const vf hi = vmul(vload_i8((const int8_t *)blk + 18), d);
            r[l] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        }
        store_transposed16(r, panel + i * 16 * LANES, LANES);
    }
}

static void fill_panel(const uint8_t *w, int fmt, int64_t g, int64_t k, uint32_t *panel) {
    switch (fmt) {
    case Q8_0: panel_q8_rows(w, g, k, panel); break;
    case Q4_K | ROWS16: panel_q4k(w, g, k, panel); break;
    case Q6_K | ROWS16: panel_q6k(w, g, k, panel); break;
    default: panel32(w, fmt & ~ROWS16, g, k, panel); break;
    }
}

/* ROWS activation rows (bf16, ldx apart) times the panel's sixteen weight rows, into y's
 * columns from col. Each row sums its even and its odd pairs in two chains (added at the end,
 * whatever ROWS is): a tail tile of a few rows would otherwise wait on the product's latency. */
__attribute__((always_inline)) static inline void gemm_tile(const uint32_t *panel, int64_t k,
                                                            const uint16_t *x, int64_t ldx,
                                                            void *y, int y_bf16, int64_t ldy,
                                                            int64_t col, const int ROWS) {
    vf acc[2][GEMM_ROWS];
    for (int b = 0; b < ROWS; b++) acc[0][b] = acc[1][b] = vzero();
    for (int64_t p = 0; p < k / 2; p += 2)
        for (int c = 0; c < 2; c++) {
            const __m512bh wp = (__m512bh)_mm512_loadu_si512(panel + (p + c) * LANES);
            for (int b = 0; b < ROWS; b++) {
                const int32_t pair = word_at((const int8_t *)(x + b * ldx + 2 * (p + c)));
                acc[c][b] = _mm512_dpbf16_ps(acc[c][b], wp, (__m512bh)_mm512_set1_epi32(pair));
            }
        }
    for (int b = 0; b < ROWS; b++)
        vstore_as((char *)y + b * ldy * (y_bf16 ? 2 : 4), col, vadd(acc[0][b], acc[1][b]), y_bf16);
}

static void gemm_group(const uint32_t *panel, int64_t k, const uint16_t *x, int64_t batch,
                       int64_t ldx, void *y, int y_bf16, int64_t ldy, int64_t col) {
    const int64_t row_bytes = ldy * (y_bf16 ? 2 : 4);
    for (int64_t b0 = 0; b0 < batch; b0 += GEMM_ROWS) {
        const uint16_t *xs = x + b0 * ldx;
        void *ys = (char *)y + b0 * row_bytes;
        switch (batch - b0 < GEMM_ROWS ? batch - b0 : GEMM_ROWS) {
        case 1: gemm_tile(panel, k, xs, ldx, ys, y_bf16, ldy, col, 1); break;
        case 2: gemm_tile(panel, k, xs, ldx, ys, y_bf16, ldy, col, 2); break;
        case 3: gemm_tile(panel, k, xs, ldx, ys, y_bf16, ldy, col, 3); break;
        case 4: gemm_tile(panel, k, xs, ldx, ys, y_bf16, ldy, col, 4); break;
        case 5: gemm_tile(panel, k, xs, ldx, ys, y_bf16, ldy, col, 5); break;
        case 6: gemm_tile(panel, k, xs, ldx, ys, y_bf16, ldy, col, 6); break;
        case 7: gemm_tile(panel, k, xs, ldx, ys, y_bf16, ldy, col, 7); break;
        default: gemm_tile(panel, k, xs, ldx, ys, y_bf16, ldy, col, GEMM_ROWS); break;
        }
    }
}
#endif

/* y = x W^T: W [n, k] rows of a repacked format (ROWS16 set) or Q8_0 in GGUF's layout, n a
 * multiple of 16; x [batch, k] bf16 rows ldx apart; y [batch, n] float32 or bf16 rows ldy
 * apart. 0; -1 for another format or shape; -2 when a panel cannot be allocated; -3 at a level
 * without the bf16 dot product. */
int quant_gemm(const void *w, int fmt, int64_t n, int64_t k, const void *x, int64_t batch,
               int64_t ldx, void *y, int y_bf16, int64_t ldy, int num_threads) {
#if defined(TS_BF16DOT)
    const int base = fmt & ~ROWS16;
    const int known = fmt & ROWS16 ? repacks16(base) : fmt == Q8_0;
    if (!known || n % LANES || k % group_of(base)) return -1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        uint32_t *panel = malloc(sizeof(uint32_t) * (size_t)(k / 2 * LANES));
        if (!panel) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t g = 0; g < n / LANES; g++) {
                fill_panel(w, fmt, g, k, panel);
                gemm_group(panel, k, x, batch, ldx, y, y_bf16, ldy, g * LANES);
            }
        }
        free(panel);
    }
    return failed ? -2 : 0;
#else
    (void)w, (void)fmt, (void)n, (void)k, (void)x, (void)batch, (void)ldx, (void)y, (void)y_bf16;
    (void)ldy, (void)num_threads;
    return -3;
#endif
}
