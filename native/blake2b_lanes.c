/* Multi-buffer BLAKE2b-256 leaves: one message per 64-bit SIMD lane.
 *
 * Leaves of different blocks are independent (docs/block-keys.md), so N of
 * them run in the N lanes of a vector: 4 with AVX2, 8 with AVX-512F. One
 * compression of N messages costs about what one scalar compression costs,
 * because each lane does exactly the scalar arithmetic (vpaddq/vpxorq and
 * rotates on 64-bit words). All messages of a call have the same length, so
 * counters and final flags are shared by all lanes; only the message words
 * differ. Message words arrive transposed (word j of every lane in one
 * vector) via in-register transposes of rows loaded straight from the
 * caller's buffer.
 *
 * Built with __attribute__((target(...))) so the file compiles without
 * -mavx2/-mavx512f; blockhash.c calls a path only after b2b_cpu_has_*()
 * said the CPU (and OS) supports it. Elsewhere (non-x86, non-GCC) the entry
 * points hash nothing and the scalar code does all the work.
 */
#include "blake2b.h"

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>

int b2b_cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}

int b2b_cpu_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}

/* Split a message length into full 128-byte chunks hashed before the last one
 * and the last chunk's length (1..128): BLAKE2b flags the last NON-EMPTY chunk
 * as final, so a length that is a multiple of 128 ends on a full chunk. */
static inline size_t chunks_before_last(size_t len) { return (len - 1) / B2B_BLOCKBYTES; }

/* ------------------------------------------------------------ AVX-512F, 8 lanes */

#define T512 __attribute__((always_inline, target("avx512f"))) static inline

#define G8(a, b, c, d, x, y)                                        \
    do {                                                            \
        a = _mm512_add_epi64(a, _mm512_add_epi64(b, x));            \
        d = _mm512_ror_epi64(_mm512_xor_si512(d, a), 32);           \
        c = _mm512_add_epi64(c, d);                                 \
        b = _mm512_ror_epi64(_mm512_xor_si512(b, c), 24);           \
        a = _mm512_add_epi64(a, _mm512_add_epi64(b, y));            \
        d = _mm512_ror_epi64(_mm512_xor_si512(d, a), 16);           \
        c = _mm512_add_epi64(c, d);                                 \
        b = _mm512_ror_epi64(_mm512_xor_si512(b, c), 63);           \
    } while (0)

#define ROUND8(s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15) \
    do {                                                                             \
        G8(v0, v4, v8, v12, m[s0], m[s1]);                                           \
        G8(v1, v5, v9, v13, m[s2], m[s3]);                                           \
        G8(v2, v6, v10, v14, m[s4], m[s5]);                                          \
        G8(v3, v7, v11, v15, m[s6], m[s7]);                                          \
        G8(v0, v5, v10, v15, m[s8], m[s9]);                                          \
        G8(v1, v6, v11, v12, m[s10], m[s11]);                                        \
        G8(v2, v7, v8, v13, m[s12], m[s13]);                                         \
        G8(v3, v4, v9, v14, m[s14], m[s15]);                                         \
    } while (0)

T512 void compress8(__m512i h[8], const __m512i m[16], uint64_t t, int last) {
    __m512i v0 = h[0], v1 = h[1], v2 = h[2], v3 = h[3];
    __m512i v4 = h[4], v5 = h[5], v6 = h[6], v7 = h[7];
    __m512i v8 = _mm512_set1_epi64((long long)B2B_IV[0]);
    __m512i v9 = _mm512_set1_epi64((long long)B2B_IV[1]);
    __m512i v10 = _mm512_set1_epi64((long long)B2B_IV[2]);
    __m512i v11 = _mm512_set1_epi64((long long)B2B_IV[3]);
    __m512i v12 = _mm512_set1_epi64((long long)(B2B_IV[4] ^ t));
    __m512i v13 = _mm512_set1_epi64((long long)B2B_IV[5]);
    __m512i v14 = _mm512_set1_epi64((long long)(last ? ~B2B_IV[6] : B2B_IV[6]));
    __m512i v15 = _mm512_set1_epi64((long long)B2B_IV[7]);
    B2B_ROUNDS(ROUND8);
    h[0] = _mm512_xor_si512(h[0], _mm512_xor_si512(v0, v8));
    h[1] = _mm512_xor_si512(h[1], _mm512_xor_si512(v1, v9));
    h[2] = _mm512_xor_si512(h[2], _mm512_xor_si512(v2, v10));
    h[3] = _mm512_xor_si512(h[3], _mm512_xor_si512(v3, v11));
    h[4] = _mm512_xor_si512(h[4], _mm512_xor_si512(v4, v12));
    h[5] = _mm512_xor_si512(h[5], _mm512_xor_si512(v5, v13));
    h[6] = _mm512_xor_si512(h[6], _mm512_xor_si512(v6, v14));
    h[7] = _mm512_xor_si512(h[7], _mm512_xor_si512(v7, v15));
}

/* 8x8 transpose of 64-bit words: r[l] holds 8 consecutive words of lane l;
 * c[j] gets word j of every lane. Three stages (64-, 128-, 256-bit
 * interleaves), 24 shuffles for 8 lanes' worth of 64 message bytes. */
T512 void transpose8(const __m512i r[8], __m512i c[8]) {
    const __m512i lo = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0);   /* 0 1 8 9 4 5 12 13 */
    const __m512i hi = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2); /* 2 3 10 11 6 7 14 15 */
    __m512i t0 = _mm512_unpacklo_epi64(r[0], r[1]); /* a0 b0 a2 b2 a4 b4 a6 b6 */
    __m512i t1 = _mm512_unpackhi_epi64(r[0], r[1]); /* a1 b1 a3 b3 a5 b5 a7 b7 */
    __m512i t2 = _mm512_unpacklo_epi64(r[2], r[3]);
    __m512i t3 = _mm512_unpackhi_epi64(r[2], r[3]);
    __m512i t4 = _mm512_unpacklo_epi64(r[4], r[5]);
    __m512i t5 = _mm512_unpackhi_epi64(r[4], r[5]);
    __m512i t6 = _mm512_unpacklo_epi64(r[6], r[7]);
    __m512i t7 = _mm512_unpackhi_epi64(r[6], r[7]);
    __m512i u0 = _mm512_permutex2var_epi64(t0, lo, t2); /* a0 b0 c0 d0 a4 b4 c4 d4 */
    __m512i u2 = _mm512_permutex2var_epi64(t0, hi, t2); /* a2 b2 c2 d2 a6 b6 c6 d6 */
    __m512i u1 = _mm512_permutex2var_epi64(t1, lo, t3); /* a1 b1 c1 d1 a5 b5 c5 d5 */
    __m512i u3 = _mm512_permutex2var_epi64(t1, hi, t3);
    __m512i u4 = _mm512_permutex2var_epi64(t4, lo, t6); /* e0 f0 g0 h0 e4 f4 g4 h4 */
    __m512i u6 = _mm512_permutex2var_epi64(t4, hi, t6);
    __m512i u5 = _mm512_permutex2var_epi64(t5, lo, t7);
    __m512i u7 = _mm512_permutex2var_epi64(t5, hi, t7);
    c[0] = _mm512_shuffle_i64x2(u0, u4, 0x44); /* low 256 bits of each */
    c[4] = _mm512_shuffle_i64x2(u0, u4, 0xEE); /* high 256 bits of each */
    c[1] = _mm512_shuffle_i64x2(u1, u5, 0x44);
    c[5] = _mm512_shuffle_i64x2(u1, u5, 0xEE);
    c[2] = _mm512_shuffle_i64x2(u2, u6, 0x44);
    c[6] = _mm512_shuffle_i64x2(u2, u6, 0xEE);
    c[3] = _mm512_shuffle_i64x2(u3, u7, 0x44);
    c[7] = _mm512_shuffle_i64x2(u3, u7, 0xEE);
}

/* m[j] = word j of the 128-byte chunk at base + l*stride, lane l. */
T512 void load_msg8(const uint8_t *base, size_t stride, __m512i m[16]) {
    __m512i r[8];
    for (int l = 0; l < 8; l++) r[l] = _mm512_loadu_si512((const void *)(base + l * stride));
    transpose8(r, m);
    for (int l = 0; l < 8; l++) r[l] = _mm512_loadu_si512((const void *)(base + l * stride + 64));
    transpose8(r, m + 8);
}

__attribute__((target("avx512f"))) size_t b2b_leaves_avx512(const uint8_t *data, size_t block_bytes,
                                                            size_t nblocks, const uint64_t init[8],
                                                            uint8_t *out) {
    const size_t full = chunks_before_last(block_bytes);
    const size_t tail = block_bytes - full * B2B_BLOCKBYTES;
    /* A short last chunk is zero-padded here; zeroed once, since every group
     * overwrites the same first `tail` bytes of each lane's row. */
    _Alignas(64) uint8_t pad[8][B2B_BLOCKBYTES];
    memset(pad, 0, sizeof pad);
    size_t done = 0;
    for (; done + 8 <= nblocks; done += 8) {
        const uint8_t *base = data + done * block_bytes;
        __m512i h[8], m[16];
        for (int i = 0; i < 8; i++) h[i] = _mm512_set1_epi64((long long)init[i]);
        for (size_t c = 0; c < full; c++) {
            load_msg8(base + c * B2B_BLOCKBYTES, block_bytes, m);
            compress8(h, m, (uint64_t)(c + 1) * B2B_BLOCKBYTES, 0);
        }
        const uint8_t *last = base + full * B2B_BLOCKBYTES;
        if (tail == B2B_BLOCKBYTES) {
            load_msg8(last, block_bytes, m);
        } else {
            for (int l = 0; l < 8; l++) memcpy(pad[l], last + l * block_bytes, tail);
            load_msg8(pad[0], B2B_BLOCKBYTES, m);
        }
        compress8(h, m, (uint64_t)block_bytes, 1);
        /* Digest = the first 32 bytes of h, per lane. */
        _Alignas(64) uint64_t w[4][8];
        for (int i = 0; i < 4; i++) _mm512_store_si512((void *)w[i], h[i]);
        for (int l = 0; l < 8; l++)
            for (int i = 0; i < 4; i++) store64(out + (done + l) * LEAF_BYTES + 8 * i, w[i][l]);
    }
    return done;
}

/* --------------------------------------------------------------- AVX2, 4 lanes */

#define T256 __attribute__((always_inline, target("avx2"))) static inline

/* No 64-bit rotate before AVX-512: 32 is a dword swap, 24 and 16 are byte
 * shuffles (byte i <- byte i+3 / i+2 of the same word), 63 is (x >> 63) ^ (x + x). */
#define ROR32_4(x) _mm256_shuffle_epi32((x), _MM_SHUFFLE(2, 3, 0, 1))
#define ROR24_4(x) _mm256_shuffle_epi8((x), r24)
#define ROR16_4(x) _mm256_shuffle_epi8((x), r16)
#define ROR63_4(x) _mm256_xor_si256(_mm256_srli_epi64((x), 63), _mm256_add_epi64((x), (x)))

#define G4(a, b, c, d, x, y)                                  \
    do {                                                      \
        a = _mm256_add_epi64(a, _mm256_add_epi64(b, x));      \
        d = ROR32_4(_mm256_xor_si256(d, a));                  \
        c = _mm256_add_epi64(c, d);                           \
        b = ROR24_4(_mm256_xor_si256(b, c));                  \
        a = _mm256_add_epi64(a, _mm256_add_epi64(b, y));      \
        d = ROR16_4(_mm256_xor_si256(d, a));                  \
        c = _mm256_add_epi64(c, d);                           \
        b = ROR63_4(_mm256_xor_si256(b, c));                  \
    } while (0)

#define ROUND4(s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15) \
    do {                                                                             \
        G4(v0, v4, v8, v12, m[s0], m[s1]);                                           \
        G4(v1, v5, v9, v13, m[s2], m[s3]);                                           \
        G4(v2, v6, v10, v14, m[s4], m[s5]);                                          \
        G4(v3, v7, v11, v15, m[s6], m[s7]);                                          \
        G4(v0, v5, v10, v15, m[s8], m[s9]);                                          \
        G4(v1, v6, v11, v12, m[s10], m[s11]);                                        \
        G4(v2, v7, v8, v13, m[s12], m[s13]);                                         \
        G4(v3, v4, v9, v14, m[s14], m[s15]);                                         \
    } while (0)

T256 void compress4(__m256i h[8], const __m256i m[16], uint64_t t, int last) {
    const __m256i r24 = _mm256_setr_epi8(3, 4, 5, 6, 7, 0, 1, 2, 11, 12, 13, 14, 15, 8, 9, 10,
                                         3, 4, 5, 6, 7, 0, 1, 2, 11, 12, 13, 14, 15, 8, 9, 10);
    const __m256i r16 = _mm256_setr_epi8(2, 3, 4, 5, 6, 7, 0, 1, 10, 11, 12, 13, 14, 15, 8, 9,
                                         2, 3, 4, 5, 6, 7, 0, 1, 10, 11, 12, 13, 14, 15, 8, 9);
    __m256i v0 = h[0], v1 = h[1], v2 = h[2], v3 = h[3];
    __m256i v4 = h[4], v5 = h[5], v6 = h[6], v7 = h[7];
    __m256i v8 = _mm256_set1_epi64x((long long)B2B_IV[0]);
    __m256i v9 = _mm256_set1_epi64x((long long)B2B_IV[1]);
    __m256i v10 = _mm256_set1_epi64x((long long)B2B_IV[2]);
    __m256i v11 = _mm256_set1_epi64x((long long)B2B_IV[3]);
    __m256i v12 = _mm256_set1_epi64x((long long)(B2B_IV[4] ^ t));
    __m256i v13 = _mm256_set1_epi64x((long long)B2B_IV[5]);
    __m256i v14 = _mm256_set1_epi64x((long long)(last ? ~B2B_IV[6] : B2B_IV[6]));
    __m256i v15 = _mm256_set1_epi64x((long long)B2B_IV[7]);
    B2B_ROUNDS(ROUND4);
    h[0] = _mm256_xor_si256(h[0], _mm256_xor_si256(v0, v8));
    h[1] = _mm256_xor_si256(h[1], _mm256_xor_si256(v1, v9));
    h[2] = _mm256_xor_si256(h[2], _mm256_xor_si256(v2, v10));
    h[3] = _mm256_xor_si256(h[3], _mm256_xor_si256(v3, v11));
    h[4] = _mm256_xor_si256(h[4], _mm256_xor_si256(v4, v12));
    h[5] = _mm256_xor_si256(h[5], _mm256_xor_si256(v5, v13));
    h[6] = _mm256_xor_si256(h[6], _mm256_xor_si256(v6, v14));
    h[7] = _mm256_xor_si256(h[7], _mm256_xor_si256(v7, v15));
}

/* m[j] = word j of the 128-byte chunk at base + l*stride, lane l: four 4x4
 * transposes (64-bit unpacks, then 128-bit lane swaps). */
T256 void load_msg4(const uint8_t *base, size_t stride, __m256i m[16]) {
    for (int q = 0; q < 4; q++) {
        const uint8_t *p = base + 32 * q;
        __m256i r0 = _mm256_loadu_si256((const __m256i *)p);
        __m256i r1 = _mm256_loadu_si256((const __m256i *)(p + stride));
        __m256i r2 = _mm256_loadu_si256((const __m256i *)(p + 2 * stride));
        __m256i r3 = _mm256_loadu_si256((const __m256i *)(p + 3 * stride));
        __m256i t0 = _mm256_unpacklo_epi64(r0, r1); /* a0 b0 a2 b2 */
        __m256i t1 = _mm256_unpackhi_epi64(r0, r1); /* a1 b1 a3 b3 */
        __m256i t2 = _mm256_unpacklo_epi64(r2, r3); /* c0 d0 c2 d2 */
        __m256i t3 = _mm256_unpackhi_epi64(r2, r3); /* c1 d1 c3 d3 */
        m[4 * q + 0] = _mm256_permute2x128_si256(t0, t2, 0x20); /* a0 b0 c0 d0 */
        m[4 * q + 1] = _mm256_permute2x128_si256(t1, t3, 0x20);
        m[4 * q + 2] = _mm256_permute2x128_si256(t0, t2, 0x31); /* a2 b2 c2 d2 */
        m[4 * q + 3] = _mm256_permute2x128_si256(t1, t3, 0x31);
    }
}

__attribute__((target("avx2"))) size_t b2b_leaves_avx2(const uint8_t *data, size_t block_bytes,
                                                       size_t nblocks, const uint64_t init[8],
                                                       uint8_t *out) {
    const size_t full = chunks_before_last(block_bytes);
    const size_t tail = block_bytes - full * B2B_BLOCKBYTES;
    _Alignas(32) uint8_t pad[4][B2B_BLOCKBYTES];
    memset(pad, 0, sizeof pad);
    size_t done = 0;
    for (; done + 4 <= nblocks; done += 4) {
        const uint8_t *base = data + done * block_bytes;
        __m256i h[8], m[16];
        for (int i = 0; i < 8; i++) h[i] = _mm256_set1_epi64x((long long)init[i]);
        for (size_t c = 0; c < full; c++) {
            load_msg4(base + c * B2B_BLOCKBYTES, block_bytes, m);
            compress4(h, m, (uint64_t)(c + 1) * B2B_BLOCKBYTES, 0);
        }
        const uint8_t *last = base + full * B2B_BLOCKBYTES;
        if (tail == B2B_BLOCKBYTES) {
            load_msg4(last, block_bytes, m);
        } else {
            for (int l = 0; l < 4; l++) memcpy(pad[l], last + l * block_bytes, tail);
            load_msg4(pad[0], B2B_BLOCKBYTES, m);
        }
        compress4(h, m, (uint64_t)block_bytes, 1);
        _Alignas(32) uint64_t w[4][4];
        for (int i = 0; i < 4; i++) _mm256_store_si256((__m256i *)w[i], h[i]);
        for (int l = 0; l < 4; l++)
            for (int i = 0; i < 4; i++) store64(out + (done + l) * LEAF_BYTES + 8 * i, w[i][l]);
    }
    return done;
}

#else /* no x86 SIMD: the scalar path hashes every leaf */

int b2b_cpu_has_avx2(void) { return 0; }
int b2b_cpu_has_avx512(void) { return 0; }

size_t b2b_leaves_avx2(const uint8_t *data, size_t block_bytes, size_t nblocks,
                       const uint64_t init[8], uint8_t *out) {
    (void)data, (void)block_bytes, (void)nblocks, (void)init, (void)out;
    return 0;
}

size_t b2b_leaves_avx512(const uint8_t *data, size_t block_bytes, size_t nblocks,
                         const uint64_t init[8], uint8_t *out) {
    (void)data, (void)block_bytes, (void)nblocks, (void)init, (void)out;
    return 0;
}

#endif
