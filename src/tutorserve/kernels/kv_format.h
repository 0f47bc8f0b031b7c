/* How a layer's KV cache ([kv_heads, blocks, block_size, head_dim] each) holds its values: the
 * `cache_format` that the KV write, attention and the decode loop take.
 *
 * KV_BF16_PAIRED is bfloat16 with each block stored in 32-bit words in the order the bf16
 * dot-product instruction takes two products a lane: K as [head_dim / 2][block_size], a word
 * being one key's two adjacent dims (one key per lane in the scores); V as
 * [block_size / 2][head_dim], a word being one dim of two adjacent keys (one dim per lane in
 * the values). Attention then loads a tile as it lies, where the row layout costs it a 16 x 16
 * word transpose of K per tile (about as many instructions as the products) and an unpacking
 * of V. Only attention's bf16 path reads it (bf16 queries, head size 64 or 128, blocks of a
 * multiple of 16 keys). */
#ifndef TUTORSERVE_KV_FORMAT_H
#define TUTORSERVE_KV_FORMAT_H
enum { KV_F32 = 0, KV_BF16 = 1, KV_BF16_PAIRED = 2 };
#endif
