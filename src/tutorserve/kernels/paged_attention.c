/* Attention over paged K/V, reading each key set's blocks where they lie in the cache.
 *
 * A "set" is a list of blocks and a key count: one decode row's own blocks, or the prompt
 * blocks that a course's students share. Each set has `nq` queries per KV head (the query heads
 * of a GQA group, times the rows that share the set). Keys are visited in tiles of 16 with an
 * online softmax (running max and sum; the accumulator is rescaled when the max grows), so
 * nothing is gathered and each K/V byte is read once per set. Outputs are float32 together with
 * the log-sum-exp of the scores, so that a caller can merge partial results (cascade attention).
 * Keys are taken in parts of PART, merged here the same way: a decode of a few KV heads (batch 1)
 * gives every thread work, and since parts are fixed by key position, not by the call's shape, a
 * query's result is the same bit for bit whatever else the call computes: a decode row alone, in a
 * batch, or a token verified with the speculative drafts after it (causal) all sum alike.
 *
 * Layouts (all contiguous):
 *   q       [sets, kv_heads, nq, dim] float32 or bfloat16 (`q_bf16`)
 *   k, v    [kv_heads, num_blocks, block_size, dim] in `kv_format` (kv_format.h): float32 or
 *           bfloat16, whose cache may be stored in bf16 while the model computes in float32 (half
 *           the bytes read); or bfloat16 with each block paired (KV_BF16_PAIRED), which only
 *           the bf16 path below reads
 *   tables  [sets, width] int64: the blocks of each set, in order
 *   lens    [sets] int64: keys of each set (its blocks hold them from the first slot on)
 *   causal  [sets] int64 or NULL: for a prefill chunk, the position of its first token; query
 *           i then sees keys up to position causal + i / group (NULL: every query sees all)
 *   out     [sets, kv_heads, nq, dim] float32
 *   lse     [sets, kv_heads, nq] float32 (-inf for a set with no keys)
 * Returns 0; -1 for a head size or format it does not take; -2 when the parts' buffer cannot be
 * allocated. Every level (simd.h) runs the float32 path, which widens K/V on load. The
 * AVX512-BF16 build takes q and K/V both in bf16 at head sizes 64 and 128 through the bf16
 * dot-product path.
 */
#include <stdlib.h>

#include "kv_format.h"
#include "simd.h"

enum { TILE = 16, QCHUNK = 32, MAX_DIM = 256, PREFETCH = 32, PART = 256 };

typedef struct {
    const void *q, *k, *v;
    const int64_t *tables, *lens, *causal;
    int64_t kv_heads, nq, group, dim, num_blocks, block_size, width;
    float scale;
    int q_bf16, kv_bf16, paired;
} Args;

/* Keys query i of a set may see: all of them, or with `causal`, those up to its own position
 * (queries are tokens times the `group` query heads of a KV head, tokens from causal[set]). */
static inline int64_t visible(const Args *a, int64_t set, int64_t i) {
    const int64_t len = a->lens[set];
    if (a->causal == NULL) return len;
    const int64_t limit = a->causal[set] + i / a->group + 1;
    return limit < len ? limit : len;
}

/* One work item: queries q0 .. q0 + nq - 1 of a set's KV head against its keys from `begin`
 * up to `end` (or as many as it has), written to out [nq, dim] and lse [nq]. */
typedef struct {
    int64_t set, head, q0, nq, begin, end;
    float *out, *lse;
} Part;

/* Where keys t0 .. t0 + TILE - 1 of a set start in a cache (elements), with one division per
 * tile. Keys from n on (past the set's end) repeat key t0: the caller gives them no weight. */
static inline void tile_offsets(const Args *a, const Part *w, int64_t t0, int64_t n,
                                int64_t at[TILE]) {
    const int64_t BS = a->block_size, *table = a->tables + w->set * a->width;
    int64_t b = t0 / BS, o = t0 % BS;
    for (int64_t j = 0; j < n; j++) {
        at[j] = ((w->head * a->num_blocks + table[b]) * BS + o) * a->dim;
        if (++o == BS) o = 0, b++;
    }
    for (int64_t j = n; j < TILE; j++) at[j] = at[0];
}

/* Keys a part reads: those its last query sees, within its range. */
static inline int64_t part_end(const Args *a, const Part *w) {
    const int64_t len = visible(a, w->set, w->q0 + w->nq - 1);
    return len < w->end ? len : w->end;
}

/* Asks for the rows of the tile `PREFETCH` keys ahead, so that the next blocks, wherever the
 * table put them, are in cache when their turn comes (the hardware prefetcher cannot follow a
 * jump from one block to another). A paired block larger than a tile holds a tile's keys
 * elsewhere than its rows would: every line of the block is still asked for, over its tiles. */
static inline void prefetch_tile(const Args *a, const Part *w, int64_t t0, int64_t len,
                                 const void *k, const void *v, int64_t elem) {
    if (t0 + PREFETCH >= len) return;
    int64_t at[TILE];
    const int64_t n = len - t0 - PREFETCH < TILE ? len - t0 - PREFETCH : TILE;
    tile_offsets(a, w, t0 + PREFETCH, n, at);
    for (int64_t j = 0; j < n; j++)
        for (int64_t c = 0; c < a->dim * elem; c += 64) {
            __builtin_prefetch((const char *)k + at[j] * elem + c);
            __builtin_prefetch((const char *)v + at[j] * elem + c);
        }
}

/* The float32 path, written over the level's vectors. Inlined into one copy per common head
 * size, so that the dim loops unroll and a query's accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_f32_dim(const Args *a, const Part *w,
                                                                  const int64_t D) {
    const int64_t set = w->set, head = w->head, q0 = w->q0, nq = w->nq, len = part_end(a, w);
    float q[QCHUNK * MAX_DIM], acc[QCHUNK * MAX_DIM];
    float kt[TILE * MAX_DIM], vt[TILE * MAX_DIM];
    float peak[QCHUNK], total[QCHUNK], p[TILE];
    const int64_t qbase = ((set * a->kv_heads + head) * a->nq + q0) * D;
    for (int64_t i = 0; i < nq * D; i += VL) vstore(q + i, vload_as(a->q, qbase + i, a->q_bf16));
    for (int64_t i = 0; i < nq; i++) {
        peak[i] = -INFINITY;
        total[i] = 0.f;
    }
    memset(acc, 0, sizeof(float) * nq * D);
    const vf scale = vset1(a->scale);
    const int64_t elem = a->kv_bf16 ? 2 : 4;
    for (int64_t t0 = w->begin; t0 < len; t0 += TILE) {
        const int64_t n = len - t0 < TILE ? len - t0 : TILE;
        int64_t at[TILE];
        tile_offsets(a, w, t0, n, at);
        prefetch_tile(a, w, t0, len, a->k, a->v, elem);
        for (int64_t j = 0; j < n; j++)
            for (int64_t c = 0; c < D; c += VL) {
                vstore(kt + j * D + c, vload_as(a->k, at[j] + c, a->kv_bf16));
                vstore(vt + j * D + c, vload_as(a->v, at[j] + c, a->kv_bf16));
            }
        for (int64_t i = 0; i < nq; i++) {
            const int64_t nv = visible(a, set, q0 + i) - t0; /* keys of this tile it sees */
            if (nv <= 0) continue;
            vf sc[TILE / VL];
            float m = peak[i];
            for (int64_t b = 0; b < TILE / VL; b++) {
                vf dots[VL];
                for (int64_t j = 0; j < VL; j++) {
                    vf s = vzero();
                    if (b * VL + j < n)
                        for (int64_t c = 0; c < D; c += VL)
                            s = vfma(vload(q + i * D + c), vload(kt + (b * VL + j) * D + c), s);
                    dots[j] = s;
                }
                sc[b] = vfirst(vmul(vsums(dots), scale), nv - b * VL, -INFINITY);
                m = fmaxf(m, vhmax(sc[b]));
            }
            const float rescale = peak[i] == -INFINITY ? 0.f : expf(peak[i] - m);
            float sum = 0.f;
            for (int64_t b = 0; b < TILE / VL; b++) {
                const vf e = vfirst(vexp(vsub(sc[b], vset1(m))), nv - b * VL, 0.f);
                vstore(p + b * VL, e);
                sum += vhsum(e);
            }
            total[i] = total[i] * rescale + sum;
            peak[i] = m;
            const int64_t keys = nv < n ? nv : n;
            float *o = acc + i * D;
            vf r[MAX_DIM / VL];
            for (int64_t c = 0; c < D / VL; c++) r[c] = vmul(vload(o + c * VL), vset1(rescale));
            for (int64_t j = 0; j < keys; j++) {
                const vf pj = vset1(p[j]);
                for (int64_t c = 0; c < D / VL; c++) r[c] = vfma(pj, vload(vt + j * D + c * VL), r[c]);
            }
            for (int64_t c = 0; c < D / VL; c++) vstore(o + c * VL, r[c]);
        }
    }
    for (int64_t i = 0; i < nq; i++) {
        const float inv = total[i] > 0.f ? 1.f / total[i] : 0.f;
        for (int64_t d = 0; d < D; d++) w->out[i * D + d] = acc[i * D + d] * inv;
        w->lse[i] = peak[i] + logf(total[i]);
    }
}

static void attend_f32_64(const Args *a, const Part *w) { attend_f32_dim(a, w, 64); }
static void attend_f32_128(const Args *a, const Part *w) { attend_f32_dim(a, w, 128); }
static void attend_f32_any(const Args *a, const Part *w) { attend_f32_dim(a, w, a->dim); }

#if defined(TS_BF16DOT)
/* The bfloat16 path: both products on the CPU's bf16 dot-product unit (two bf16 products
 * summed into each float32 lane per instruction). Scores: each lane is one key, so K is laid
 * out as [dim pair][key] and the query's dim pairs are broadcast. Values: each lane is one
 * dim, so V is laid out as [key pair][dim] and the probabilities' key pairs are broadcast
 * (probabilities are rounded to bf16 for this product, as PyTorch's flash attention does).
 * Queries go four at a time, so that their chains of dependent products overlap. */
enum { QB = 4 };

/* Lanes of a tile starting at key t0 that a query seeing `vis` keys may use. */
static inline __mmask16 lanes(int64_t vis, int64_t t0) {
    const int64_t n = vis - t0;
    return n <= 0 ? 0 : n >= TILE ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
}

static inline __m512bh bcast(uint32_t w) { return (__m512bh)_mm512_set1_epi32((int)w); }

/* kp[c][j] = dim pair c of the tile's key j (32-bit words), transposed sixteen by sixteen words
 * in registers. */
static inline void transpose_keys(const uint16_t *k, const int64_t at[TILE], int64_t D,
                                  uint32_t *kp) {
    for (int64_t h = 0; h < D / 32; h++) {
        __m512i r[16];
        for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_si512(k + at[j] + 32 * h);
        store_transposed16(r, kp + 16 * h * TILE, TILE);
    }
}

/* vp[m Z + z] (Z = D / 16): dims 16 z .. 16 z + 15 of the tile's keys 2m, 2m + 1, one dim a lane
 * (each lane's two bf16 halves the two keys). Paired values lie so, dim 16 z + l in lane l: a
 * full tile is read where it lies; in a tile of n < 16 keys those past n are zeros (the cache
 * there may hold anything, and a zero probability times an infinity is not zero). Rows are
 * unpacked in registers, into lane 4L + j: dim 32 (z / 2) + 8 L + 4 (z % 2) + j. */
static inline const __m512i *value_pairs(const Args *a, const uint16_t *vc, const int64_t at[TILE],
                                         int64_t n, int64_t o, int64_t D, __m512i *vp) {
    const int64_t Z = D / 16;
    if (a->paired) {
        const __m512i *lie =
            (const __m512i *)((const uint32_t *)(vc + at[0] - o * D) + o / 2 * D);
        if (n == TILE) return lie;
        for (int64_t m = 0; m < TILE / 2; m++) {
            const __mmask32 keep = 2 * m + 1 < n ? 0xFFFFFFFFu : 2 * m < n ? 0x55555555u : 0u;
            for (int64_t z = 0; z < Z; z++)
                vp[m * Z + z] = _mm512_maskz_loadu_epi16(keep, lie + m * Z + z);
        }
        return vp;
    }
    for (int64_t m = 0; m < TILE / 2; m++)
        for (int64_t h = 0; h < D / 32; h++) {
            const __m512i x = _mm512_loadu_si512(vc + at[2 * m] + 32 * h);
            const __m512i y = _mm512_loadu_si512(vc + at[2 * m + 1] + 32 * h);
            vp[m * Z + 2 * h] = _mm512_unpacklo_epi16(x, y);
            vp[m * Z + 2 * h + 1] = _mm512_unpackhi_epi16(x, y);
        }
    return vp;
}

/* Queries i0 .. i0 + QN - 1 (QN ≤ QB) of head size D against the tile's keys (dim pair c of
 * key j at kp[c ks + j]) and values (vt, as value_pairs lays them): scores, the online
 * softmax's update, values. Expanded for each QN, so that a GQA group of 3 or 7 queries fills
 * no slot with a repeat of the last. */
#define QUERY_BLOCK(QN, D)                                                                     \
    do {                                                                                       \
        __m512 s[QN][2];                                                                       \
        for (int u = 0; u < QN; u++) s[u][0] = s[u][1] = _mm512_setzero_ps();                  \
        for (int64_t c = 0; c < W; c += 2) {                                                   \
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + c * ks);                     \
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + (c + 1) * ks);               \
            for (int u = 0; u < QN; u++) {                                                     \
                const uint32_t *qw = (const uint32_t *)(q + (i0 + u) * D);                     \
                s[u][0] = _mm512_dpbf16_ps(s[u][0], k0, bcast(qw[c]));                         \
                s[u][1] = _mm512_dpbf16_ps(s[u][1], k1, bcast(qw[c + 1]));                     \
            }                                                                                  \
        }                                                                                      \
        float rescale[QN];                                                                     \
        for (int u = 0; u < QN; u++) {                                                         \
            const int64_t i = i0 + u;                                                          \
            const __mmask16 valid = lanes(visible(a, set, q0 + i), t0);                        \
            if (!valid) { /* a causal query past its keys: the tile changes nothing */         \
                rescale[u] = 1.f;                                                              \
                memset(pw[u], 0, sizeof pw[u]);                                                \
                continue;                                                                      \
            }                                                                                  \
            const __m512 sc = _mm512_mask_blend_ps(                                            \
                valid, minus_inf, _mm512_mul_ps(_mm512_add_ps(s[u][0], s[u][1]), scale));      \
            const float m = fmaxf(peak[i], _mm512_reduce_max_ps(sc));                          \
            /* masked: a query that sees no key of this tile (and maybe none yet) adds 0 */    \
            const __m512 e =                                                                   \
                _mm512_maskz_mov_ps(valid, vexp(_mm512_sub_ps(sc, _mm512_set1_ps(m))));        \
            rescale[u] = _mm512_cvtss_f32(vexp(_mm512_set1_ps(peak[i] - m)));                  \
            _mm256_store_si256((__m256i *)pw[u], (__m256i)_mm512_cvtneps_pbh(e));              \
            total[i] = total[i] * rescale[u] + _mm512_reduce_add_ps(e);                        \
            peak[i] = m;                                                                       \
        }                                                                                      \
        __m512 r[QN][Z];                                                                       \
        for (int u = 0; u < QN; u++)                                                           \
            for (int z = 0; z < Z; z++)                                                        \
                r[u][z] = _mm512_mul_ps(_mm512_load_ps(acc + (i0 + u) * D + 16 * z),           \
                                        _mm512_set1_ps(rescale[u]));                           \
        for (int m = 0; m < TILE / 2; m++)                                                     \
            for (int u = 0; u < QN; u++) {                                                     \
                const __m512bh pb = bcast(pw[u][m]);                                           \
                for (int z = 0; z < Z; z++)                                                    \
                    r[u][z] = _mm512_dpbf16_ps(                                                \
                        r[u][z], (__m512bh)_mm512_loadu_si512(vt + m * Z + z), pb);            \
            }                                                                                  \
        for (int u = 0; u < QN; u++)                                                           \
            for (int z = 0; z < Z; z++) _mm512_store_ps(acc + (i0 + u) * D + 16 * z, r[u][z]); \
    } while (0)

#define ATTEND_BF16(D)                                                                        \
static void attend_bf16_##D(const Args *a, const Part *w) {                                   \
    enum { W = D / 2, Z = D / 16 };                                                            \
    const int64_t set = w->set, head = w->head, q0 = w->q0, nq = w->nq, len = part_end(a, w);  \
    const uint16_t *q = (const uint16_t *)a->q + ((set * a->kv_heads + head) * a->nq + q0) * D;\
    const uint16_t *kc = (const uint16_t *)a->k, *vc = (const uint16_t *)a->v;                  \
    uint32_t kt[W * TILE] __attribute__((aligned(64)));                                        \
    __m512i vp[TILE / 2 * Z] __attribute__((aligned(64)));                                     \
    float acc[QCHUNK * D] __attribute__((aligned(64)));                                        \
    float peak[QCHUNK], total[QCHUNK];                                                         \
    uint32_t pw[QB][TILE / 2] __attribute__((aligned(64)));                                    \
    for (int64_t i = 0; i < nq; i++) {                                                         \
        peak[i] = -INFINITY;                                                                   \
        total[i] = 0.f;                                                                        \
    }                                                                                          \
    memset(acc, 0, sizeof(float) * nq * D);                                                    \
    const __m512 scale = _mm512_set1_ps(a->scale), minus_inf = _mm512_set1_ps(-INFINITY);     \
    for (int64_t t0 = w->begin; t0 < len; t0 += TILE) {                                        \
        const int64_t n = len - t0 < TILE ? len - t0 : TILE;                                   \
        int64_t at[TILE];                                                                      \
        tile_offsets(a, w, t0, n, at);                                                         \
        prefetch_tile(a, w, t0, len, kc, vc, 2);                                               \
        /* paired keys are read where they lie (the tile within one block, its lanes past n   \
         * masked); rows are transposed into kt */                                             \
        const int64_t o = t0 % a->block_size, ks = a->paired ? a->block_size : TILE;          \
        const uint32_t *kp = a->paired ? (const uint32_t *)(kc + at[0] - o * D) + o : kt;     \
        if (!a->paired) transpose_keys(kc, at, D, kt);                                         \
        const __m512i *vt = value_pairs(a, vc, at, n, o, D, vp);                               \
        for (int64_t i0 = 0; i0 < nq; i0 += QB) {                                              \
            switch (nq - i0 < QB ? nq - i0 : QB) {                                             \
            case 1: QUERY_BLOCK(1, D); break;                                                  \
            case 2: QUERY_BLOCK(2, D); break;                                                  \
            case 3: QUERY_BLOCK(3, D); break;                                                  \
            default: QUERY_BLOCK(QB, D); break;                                                \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
    /* Lane l of accumulator z holds the dim that lane of vp does (value_pairs). */            \
    for (int64_t i = 0; i < nq; i++) {                                                         \
        const float inv = total[i] > 0.f ? 1.f / total[i] : 0.f;                               \
        for (int z = 0; z < Z; z++)                                                            \
            for (int l = 0; l < 16; l++) {                                                     \
                const int d =                                                                  \
                    a->paired ? 16 * z + l : 32 * (z / 2) + 8 * (l / 4) + 4 * (z % 2) + l % 4; \
                w->out[i * D + d] = acc[i * D + 16 * z + l] * inv;                             \
            }                                                                                  \
        w->lse[i] = peak[i] + logf(total[i]);                                                  \
    }                                                                                          \
}
ATTEND_BF16(64)
ATTEND_BF16(128)
#endif

/* out, lse of each row from its parts' (each part's output already normalized by its own sum),
 * in part order. A row's parts past its keys add exact zeros, and one part alone is copied
 * exactly (e^0 = 1), so the sum does not depend on how many parts the call has. */
static void merge_parts(const float *part_out, const float *part_lse, int64_t parts,
                        int64_t rows, int64_t dim, float *out, float *lse, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows * parts * dim > 65536)
    for (int64_t r = 0; r < rows; r++) {
        float m = -INFINITY, sum = 0.f;
        for (int64_t p = 0; p < parts; p++) m = fmaxf(m, part_lse[p * rows + r]);
        for (int64_t d = 0; d < dim; d++) out[r * dim + d] = 0.f;
        for (int64_t p = 0; p < parts && m > -INFINITY; p++) {
            const float e = expf(part_lse[p * rows + r] - m);
            const float *o = part_out + (p * rows + r) * dim;
            for (int64_t d = 0; d < dim; d++) out[r * dim + d] += e * o[d];
            sum += e;
        }
        for (int64_t d = 0; d < dim && sum > 0.f; d++) out[r * dim + d] /= sum;
        lse[r] = m + logf(sum);
    }
}

int paged_attention(const void *q, const void *k, const void *v, const int64_t *tables,
                    const int64_t *lens, const int64_t *causal, int64_t sets, int64_t kv_heads,
                    int64_t nq, int64_t group, int64_t dim, int64_t num_blocks,
                    int64_t block_size, int64_t width, float scale, int q_bf16, int kv_format,
                    float *out, float *lse, int num_threads) {
    if (dim % 16 || dim > MAX_DIM) return -1;
    const Args a = {q,     k,   v,          tables,     lens,  causal, kv_heads, nq,
                    group, dim, num_blocks, block_size, width, scale,  q_bf16,   kv_format != KV_F32,
                    kv_format == KV_BF16_PAIRED};
    void (*attend)(const Args *, const Part *) =
        dim == 64 ? attend_f32_64 : dim == 128 ? attend_f32_128 : attend_f32_any;
#if defined(TS_BF16DOT)
    if (q_bf16 && a.kv_bf16 && dim == 64) attend = attend_bf16_64;
    if (q_bf16 && a.kv_bf16 && dim == 128) attend = attend_bf16_128;
    if (a.paired && !(q_bf16 && (dim == 64 || dim == 128) && block_size % TILE == 0)) return -1;
#else
    if (a.paired) return -1;
#endif
    const int64_t chunks = (nq + QCHUNK - 1) / QCHUNK, items = sets * kv_heads * chunks;
    int64_t longest = 0;
    for (int64_t s = 0; s < sets; s++) longest = lens[s] > longest ? lens[s] : longest;
    const int64_t parts = longest > PART ? (longest + PART - 1) / PART : 1;
    const int64_t rows = sets * kv_heads * nq;
    float *part_out = NULL;
    if (parts > 1 && !(part_out = malloc(sizeof(float) * (size_t)(parts * rows * (dim + 1)))))
        return -2;
    float *part_lse = parts > 1 ? part_out + parts * rows * dim : NULL;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t i = 0; i < items * parts; i++) {
        const int64_t p = i % parts, sh = i / parts / chunks, q0 = i / parts % chunks * QCHUNK;
        const int64_t row = sh * nq + q0;
        const Part w = {sh / kv_heads, sh % kv_heads, q0, nq - q0 < QCHUNK ? nq - q0 : QCHUNK,
                        p * PART, (p + 1) * PART,
                        parts > 1 ? part_out + (p * rows + row) * dim : out + row * dim,
                        parts > 1 ? part_lse + p * rows + row : lse + row};
        attend(&a, &w);
    }
    if (parts > 1) merge_parts(part_out, part_lse, parts, rows, dim, out, lse, num_threads);
    free(part_out);
    return 0;
}
