/* Q4_K and Q6_K matmuls on weights repacked sixteen rows at a time (quant_rows16.c has the idea
 * and the 32-weight formats). A K-quant block holds 256 weights of one row; repacked, the
 * blocks of sixteen rows at one position become one group block of the same bytes, each of a
 * block's fields stored for the sixteen rows side by side (the `Field` tables), so that one
 * vector load takes a field of every row:
 *
 *   Q4_K  d[16], dmin[16] (half); the 12 bytes of packed 6-bit (scale, min) pairs as three
 *         32-bit words per row; the 128 bytes of nibbles as 32 words per row. Word w's low
 *         nibbles are codes of sub-block 2(w / 8), its high ones of sub-block 2(w / 8) + 1.
 *   Q6_K  the 128 bytes of low nibbles as 32 words, the 64 of 2-bit high pairs as 16 words,
 *         the 16 int8 scales, d.
 *
 * The (scale, min) pairs are unpacked in vectors, sixteen rows at once, with k4_scales' shifts
 * and masks; each sub-block's per-row scale is then one byte of a word per lane. Q6_K's codes
 * (0-63, w = d sc (q - 32)) are a low nibble ORed with a high pair shifted in, per byte. As in
 * quant_rows16.c, codes meet a broadcast word of four activation codes in one integer
 * multiply-add per word, and the offsets (min, 32) meet the activations' sums per sub-block.
 */
#include "rows16.h"

/* A field of a block: its offset in GGUF's block, and the bytes of each of its `count` items,
 * which go to the repacked group block as count × 16 items, item e of lane l at (e 16 + l). */
typedef struct {
    int offset, size, count;
} Field;
static const Field Q4K_FIELDS[] = {{0, 2, 1}, {2, 2, 1}, {4, 4, 3}, {16, 4, 32}, {0, 0, 0}};
static const Field Q6K_FIELDS[] = {{0, 4, 32}, {128, 4, 16}, {192, 1, 16}, {208, 2, 1}, {0, 0, 0}};

static const Field *fields_of(int fmt) { return fmt == Q4_K ? Q4K_FIELDS : Q6K_FIELDS; }

/* GGUF's block b of lane l ↔ the group block o (to_group: which way). */
static void move_block(uint8_t *o, uint8_t *b, int fmt, int l, int to_group) {
    int at = 0;
    for (const Field *f = fields_of(fmt); f->size; f++) {
        for (int e = 0; e < f->count; e++) {
            uint8_t *grouped = o + at + (e * LANES + l) * f->size;
            uint8_t *own = b + f->offset + e * f->size;
            memcpy(to_group ? grouped : own, to_group ? own : grouped, (size_t)f->size);
        }
        at += f->count * LANES * f->size;
    }
}

int k_repack16(const void *src, int fmt, int64_t n, int64_t k, void *dst) {
    const int nb = bytes_of(fmt);
    const int64_t blocks = k / 256;
    for (int64_t g = 0; g < n / LANES; g++)
        for (int64_t i = 0; i < blocks; i++)
            for (int l = 0; l < LANES; l++)
                move_block((uint8_t *)dst + (g * blocks + i) * LANES * nb,
                           (uint8_t *)src + ((g * LANES + l) * blocks + i) * nb, fmt, l, 1);
    return 0;
}

void k_unpack16_block(const uint8_t *group_block, int fmt, int lane, uint8_t *out) {
    move_block((uint8_t *)group_block, out, fmt, lane, 0);
}

#if defined(TS_AVX512) || defined(TS_AVX2)
/* Σ over four codes per word, for the activation codes from `at` (row b's index), into ps. */
#define FOUR_CODES(codes, at_of_b)                                                            \
    for (int b = 0; b < ROWS; b++) {                                                          \
        const int64_t at = (b0 + b) * a->k + (at_of_b);                                       \
        ps[b] = vfma(dot4(codes, word_at(a->qx + at)), vset1(a->dx[at / 4]), ps[b]);          \
    }

__attribute__((always_inline)) static inline void q4k_tile(const Args *a, int64_t g, int part,
                                                           int64_t b0, const int ROWS) {
    vf acc[MAX_ROWS];
    for (int b = 0; b < ROWS; b++) acc[b] = vzero();
    for (int64_t i = 0; i < a->blocks; i++) {
        const uint8_t *blk = a->w + (g * a->blocks + i) * LANES * bytes_of(Q4_K);
        const vf d = halves(blk + Q4K_D + 2 * part * W);
        const vf dmin = halves(blk + Q4K_DMIN + 2 * part * W);
        vi sc[2], mn[2];
        q4k_scale_words(blk, part, sc, mn);
        for (int p = 0; p < 4; p++) { /* sub-blocks 2p and 2p + 1: one word's two nibbles */
            vf ps2[2][MAX_ROWS];
            for (int b = 0; b < ROWS; b++) ps2[0][b] = ps2[1][b] = vzero();
            for (int j = 0; j < 8; j++) {
                const vi v = vi_load(blk + Q4K_CODES + ((8 * p + j) * LANES + part * W) * 4);
                for (int high = 0; high < 2; high++) {
                    const vi codes = vi_nibbles(v, high);
                    vf *ps = ps2[high];
                    FOUR_CODES(codes, i * 256 + 64 * p + 32 * high + 4 * j)
                }
            }
            for (int s = 2 * p; s < 2 * p + 2; s++) {
                const vf scale = vmul(d, byte_lanes(sc[s / 4], s % 4));
                const vf min = vmul(dmin, byte_lanes(mn[s / 4], s % 4));
                for (int b = 0; b < ROWS; b++) {
                    acc[b] = vfma(scale, ps2[s & 1][b], acc[b]);
                    acc[b] = vfma(min, vset1(-sum32(a, b0 + b, i * 256 + 32 * s)), acc[b]);
                }
            }
        }
    }
    store_tile(a, g, part, b0, acc, ROWS);
}

/* Q6_K's half h (128 weights) in two passes of 16 weights per quarter q: quarter q takes the
 * low (q 0, 1) or high (q 2, 3) nibbles of the low words at 16h (q even) or 16h + 8 (odd) and
 * pair q of the high words at 8h, so one pass of four word positions t loads three words and
 * feeds four sub-blocks, c = 8h + 2q + (t >= 4). */
__attribute__((always_inline)) static inline void q6k_tile(const Args *a, int64_t g, int part,
                                                           int64_t b0, const int ROWS) {
    vf acc[MAX_ROWS];
    for (int b = 0; b < ROWS; b++) acc[b] = vzero();
    for (int64_t i = 0; i < a->blocks; i++) {
        const uint8_t *blk = a->w + (g * a->blocks + i) * LANES * bytes_of(Q6_K);
        const vf d = halves(blk + Q6K_D + 2 * part * W);
        for (int h = 0; h < 2; h++)
            for (int second = 0; second < 2; second++) {
                vf ps4[4][MAX_ROWS];
                for (int q = 0; q < 4; q++)
                    for (int b = 0; b < ROWS; b++) ps4[q][b] = vzero();
                for (int t = 4 * second; t < 4 * second + 4; t++) {
                    const vi low[2] = {
                        vi_load(blk + Q6K_LOW + ((16 * h + t) * LANES + part * W) * 4),
                        vi_load(blk + Q6K_LOW + ((16 * h + 8 + t) * LANES + part * W) * 4)};
                    const vi high = vi_load(blk + Q6K_HIGH + ((8 * h + t) * LANES + part * W) * 4);
                    for (int q = 0; q < 4; q++) {
                        const vi pair = vi_sll(vi_and(vi_srl(high, 2 * q), 0x03030303), 4);
                        const vi codes = vi_or(vi_nibbles(low[q & 1], q >= 2), pair);
                        vf *ps = ps4[q];
                        FOUR_CODES(codes, i * 256 + 128 * h + 32 * q + 4 * t)
                    }
                }
                for (int q = 0; q < 4; q++) {
                    const int c = 8 * h + 2 * q + second;
                    const vf scale = vmul(d, int8s(blk + Q6K_SCALES + c * LANES + part * W));
                    for (int b = 0; b < ROWS; b++) {
                        const float s = a->sums[((b0 + b) * a->k + i * 256 + 16 * c) / 16];
                        acc[b] = vfma(scale, vsub(ps4[q][b], vset1(32.f * s)), acc[b]);
                    }
                }
            }
    }
    store_tile(a, g, part, b0, acc, ROWS);
}

#define TILES(tile)                                                                           \
    for (int part = 0; part < LANES / W; part++)                                             \
        for (int64_t b0 = 0; b0 < batch; b0 += MAX_ROWS) {                                   \
            switch (batch - b0 < MAX_ROWS ? batch - b0 : MAX_ROWS) {                          \
            case 1: tile(a, g, part, b0, 1); break;                                           \
            case 2: tile(a, g, part, b0, 2); break;                                           \
            case 3: tile(a, g, part, b0, 3); break;                                           \
            default: tile(a, g, part, b0, MAX_ROWS); break;                                   \
            }                                                                                 \
        }

void k_group(const Args *a, int64_t g, int64_t batch, int fmt) {
    if (fmt == Q4_K) {
        TILES(q4k_tile)
    } else {
        TILES(q6k_tile)
    }
}
#endif
