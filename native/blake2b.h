/* BLAKE2b (RFC 7693) pieces shared by the scalar code (blockhash.c) and the
 * multi-buffer SIMD leaves (blake2b_lanes.c). Written for kvserve from the RFC. */
#ifndef KVSERVE_BLAKE2B_H
#define KVSERVE_BLAKE2B_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define B2B_BLOCKBYTES 128
#define B2B_OUTBYTES 64
#define B2B_KEYBYTES 64
#define B2B_SALTBYTES 16
#define B2B_PERSONALBYTES 16
#define KEY_BYTES 16  /* kvserve block keys are BLAKE2b-128 */
#define LEAF_BYTES 32 /* leaf digests are BLAKE2b-256 */

static const uint64_t B2B_IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
    0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
    0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

/* The twelve rounds' message schedules (SIGMA rows 0..9, then rows 0 and 1
 * again), written out so every implementation expands the same table into
 * fixed offsets: B2B_ROUNDS(R) calls R(s0, ..., s15) once per round. */
#define B2B_ROUNDS(R)                                          \
    R(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);   \
    R(14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3);   \
    R(11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4);   \
    R(7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8);   \
    R(9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13);   \
    R(2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9);   \
    R(12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11);   \
    R(13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10);   \
    R(6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5);   \
    R(10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0);   \
    R(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);   \
    R(14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3)

static inline uint64_t load64(const uint8_t *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t v;
    memcpy(&v, p, sizeof v); /* unaligned-safe; compiles to one mov */
    return v;
#else
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) |
           ((uint64_t)p[3] << 24) | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) |
           ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
#endif
}

static inline void store64(uint8_t *p, uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(p, &v, sizeof v);
#else
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
#endif
}

/* h <- IV xor parameter block (RFC 7693 §2.5 / BLAKE2 spec §2.8). Only the
 * sequential-mode fields are used: digest length, key length, fanout=1,
 * depth=1, salt, personalisation. salt/person are 16 bytes or NULL (= zeros). */
static inline void b2b_init_params(uint64_t h[8], size_t outlen, size_t keylen,
                                   const uint8_t *salt, const uint8_t *person) {
    for (int i = 0; i < 8; i++) h[i] = B2B_IV[i];
    h[0] ^= 0x01010000ULL ^ ((uint64_t)keylen << 8) ^ (uint64_t)outlen;
    if (salt) {
        h[4] ^= load64(salt);
        h[5] ^= load64(salt + 8);
    }
    if (person) {
        h[6] ^= load64(person);
        h[7] ^= load64(person + 8);
    }
}

/* Multi-buffer leaves (blake2b_lanes.c): BLAKE2b-256 of `nblocks` messages of
 * `block_bytes` (>= 1) each, message k at data + k*block_bytes, all starting
 * from the state `init` (parameter block already mixed in); leaf k's 32 bytes
 * go to out + k*LEAF_BYTES. Each SIMD routine hashes the largest multiple of
 * its lane count and returns how many it did; the caller hashes the rest.
 * Call one only when its b2b_cpu_has_*() is true; without x86 SIMD support in
 * the compiler they hash nothing and report 0. */
typedef size_t (*b2b_leaves_fn)(const uint8_t *data, size_t block_bytes, size_t nblocks,
                                const uint64_t init[8], uint8_t *out);

size_t b2b_leaves_avx2(const uint8_t *data, size_t block_bytes, size_t nblocks,
                       const uint64_t init[8], uint8_t *out);
size_t b2b_leaves_avx512(const uint8_t *data, size_t block_bytes, size_t nblocks,
                         const uint64_t init[8], uint8_t *out);
int b2b_cpu_has_avx2(void);
int b2b_cpu_has_avx512(void);

#endif
