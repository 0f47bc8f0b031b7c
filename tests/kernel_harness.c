/* Runs the kernels on fixed pseudo-random inputs and writes their outputs, so that one ISA
 * level's build can be compared with another's (here NEON vs scalar, under qemu). */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
int paged_attention(const void *, const void *, const void *, const int64_t *, const int64_t *,
                    const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                    int64_t, int64_t, float, int, int, float *, float *, int);
int add_rms_norm(const void *, void *, const void *, void *, int64_t, int64_t, float, int, int);
int silu_mul(const void *, void *, int64_t, int64_t, int, int);
static uint32_t s = 12345;
static float rnd(void) { s = s * 1664525u + 1013904223u; return ((s >> 8) / 16777216.f) * 4.f - 2.f; }
static uint16_t bf(float x) { uint32_t u; memcpy(&u, &x, 4); return (uint16_t)(u >> 16); }
enum { KVH = 2, NB = 16, BS = 16, D = 64, SETS = 3, NQ = 7, W = 5 };
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
    fclose(f);
    return 0;
}
