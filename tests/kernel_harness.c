/* Runs the kernels on fixed pseudo-random inputs and writes their outputs, so that one ISA
 * level's build can be compared with another's (here NEON vs scalar, under qemu): attention,
 * norm and activation, rotary embedding and the KV write, and the quantized-weight matmul and
 * dequantizer in every format (and every repacked layout, sixteen rows at a time). */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
int paged_attention(const void *, const void *, const void *, const int64_t *, const int64_t *,
                    const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                    int64_t, int64_t, float, int, int, float *, float *, int);
int add_rms_norm(const void *, void *, const void *, void *, int64_t, int64_t, float, int, int);
int silu_mul(const void *, void *, int64_t, int64_t, int, int);
int quant_matmul(const void *, int, int64_t, int64_t, const void *, int, int64_t, int64_t, void *,
                 int, int64_t, int);
int quant_dequantize(const void *, int, int64_t, const int64_t *, int64_t, void *, int, int);
int quant_repack16(const void *, int, int64_t, int64_t, void *);
int rotary_embedding(const int64_t *, void *, void *, int64_t, int64_t, int64_t, int64_t, int64_t,
                     int64_t, int64_t, int64_t, const void *, const void *, int64_t, int, int,
                     int);
int write_kv(const void *, const void *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
             const int64_t *, void *, void *, int64_t, int64_t, int, int, int);
static uint32_t s = 12345;
static float rnd(void) { s = s * 1664525u + 1013904223u; return ((s >> 8) / 16777216.f) * 4.f - 2.f; }
static uint16_t bf(float x) { uint32_t u; memcpy(&u, &x, 4); return (uint16_t)(u >> 16); }
enum { KVH = 2, NB = 16, BS = 16, D = 64, SETS = 3, NQ = 7, W = 5 };
/* nblocks random blocks of a format (a row of `fmts` in main: id, bytes per block, half offsets),
 * their fp16 scales small and finite. */
static void fill_blocks(uint8_t *blocks, const int *fmt, int nblocks) {
    const int nb = fmt[1];
    for (int i = 0; i < nblocks * nb; i++) { s = s * 1664525u + 1013904223u; blocks[i] = s >> 24; }
    for (int b = 0; b < nblocks; b++)
        for (int h = 2; h < 4; h++)
            if (fmt[h] >= 0) {
                s = s * 1664525u + 1013904223u;
                const uint16_t half = 0x2000 | (s >> 22); /* 2^-7 .. 2^-6 */
                memcpy(blocks + b * nb + fmt[h], &half, 2);
            }
}
int main(int argc, char **argv) {
    static float q[SETS * KVH * NQ * D], k[KVH * NB * BS * D], v[KVH * NB * BS * D];
    static uint16_t kb[KVH * NB * BS * D], vb[KVH * NB * BS * D];
    static float out[SETS * KVH * NQ * D], lse[SETS * KVH * NQ];
    for (int i = 0; i < SETS * KVH * NQ * D; i++) q[i] = rnd();
    for (int i = 0; i < KVH * NB * BS * D; i++) { k[i] = rnd(); v[i] = rnd(); kb[i] = bf(k[i]); vb[i] = bf(v[i]); }
    int64_t tables[SETS * W] = {3, 7, 1, 0, 0, 9, 2, 4, 11, 5, 15, 0, 0, 0, 0};
    int64_t lens[SETS] = {40, 77, 1}, causal[SETS] = {30, 60, 0};
    FILE *f = fopen(argv[1], "wb");
    for (int mode = 0; mode < 3; mode++) { /* f32 KV; bf16 KV; f32 KV causal */
        paged_attention(q, mode == 1 ? (void *)kb : k, mode == 1 ? (void *)vb : v, tables, lens,
                        mode == 2 ? causal : NULL, SETS, KVH, NQ, 1, D, NB, BS, W, 0.125f, 0,
                        mode == 1, out, lse, 1);
        fwrite(out, sizeof out, 1, f); fwrite(lse, sizeof lse, 1, f);
    }
    static float x[8 * 576], r[8 * 576], wgt[576], o[8 * 576], gu[8 * 1536 * 2], so[8 * 1536];
    for (int i = 0; i < 8 * 576; i++) { x[i] = rnd(); r[i] = rnd(); }
    for (int i = 0; i < 576; i++) wgt[i] = 1.f + 0.1f * rnd();
    for (int i = 0; i < 8 * 1536 * 2; i++) gu[i] = 4 * rnd();
    add_rms_norm(x, r, wgt, o, 8, 576, 1e-5f, 0, 1);
    silu_mul(gu, so, 8, 1536, 0, 1);
    fwrite(o, sizeof o, 1, f); fwrite(r, sizeof r, 1, f); fwrite(so, sizeof so, 1, f);
    /* Quantized rows of every format (random codes, small fp16 scales), 5 rows of 512. */
    static const int fmts[8][4] = {/* ggml id, bytes per block of 32 or 256, half offsets */
        {2, 18, 0, -1}, {3, 20, 0, 2}, {6, 22, 0, -1}, {7, 24, 0, 2},
        {8, 34, 0, -1}, {12, 144, 0, 2}, {13, 176, 0, 2}, {14, 210, 208, -1}};
    static uint8_t blocks[5 * 2 * 210 * 8];
    static float qx[3 * 512], qy[3 * 5], deq[5 * 512];
    static uint16_t qxb[3 * 512];
    for (int i = 0; i < 3 * 512; i++) { qx[i] = rnd(); qxb[i] = bf(qx[i]); }
    for (int t = 0; t < 8; t++) {
        const int id = fmts[t][0];
        fill_blocks(blocks, fmts[t], 5 * 512 / (id >= 12 ? 256 : 32));
        quant_matmul(blocks, id, 5, 512, qx, 0, 3, 512, qy, 0, 5, 1);
        fwrite(qy, sizeof qy, 1, f);
        quant_matmul(blocks, id, 5, 512, qxb, 1, 3, 512, qy, 0, 5, 1); /* bf16 activations */
        quant_dequantize(blocks, id, 512, NULL, 5, deq, 0, 1);
        fwrite(qy, sizeof qy, 1, f); fwrite(deq, sizeof deq, 1, f);
    }
    /* x as 8 tokens of 6 query and 3 key heads of 64: rotate them, then write the keys (and the
     * norm's output as values) into a cache of 3 heads x 32 slots. */
    static float cs[16 * 64], sn[16 * 64], kc[3 * 32 * 64], vc[3 * 32 * 64];
    for (int i = 0; i < 16 * 64; i++) { cs[i] = rnd(); sn[i] = rnd(); }
    int64_t pos[8] = {7, 0, 15, 3, 3, 9, 1, 12}, slots[8] = {31, 0, 5, 17, 2, 30, 8, 16};
    rotary_embedding(pos, x, x + 6 * 64, 8, 6, 3, 64, 576, 64, 576, 64, cs, sn, 16, 0, 0, 1);
    write_kv(x + 6 * 64, o + 6 * 64, 8, 3, 64, 576, 576, 64, slots, kc, vc, 32, 16, 0, 0, 1);
    fwrite(x, sizeof x, 1, f); fwrite(kc, sizeof kc, 1, f); fwrite(vc, sizeof vc, 1, f);
    /* 16 rows of 512 in each format with a repacked layout, repacked: matmul on 3 activation
     * rows, dequantized. */
    static uint8_t packed[16 * 16 * 34];
    static float ry[3 * 16], rdeq[16 * 512];
    for (int t = 0; t < 8; t++) {
        const int id = fmts[t][0];
        if (id == 7 || id == 13) continue; /* Q5_1, Q5_K: no repacked layout */
        fill_blocks(blocks, fmts[t], 16 * 512 / (id >= 12 ? 256 : 32));
        quant_repack16(blocks, id, 16, 512, packed);
        quant_matmul(packed, 256 | id, 16, 512, qx, 0, 3, 512, ry, 0, 16, 1);
        quant_dequantize(packed, 256 | id, 512, NULL, 16, rdeq, 0, 1);
        fwrite(ry, sizeof ry, 1, f); fwrite(rdeq, sizeof rdeq, 1, f);
    }
    fclose(f);
    return 0;
}
