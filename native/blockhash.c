/* BLAKE2b (RFC 7693) and the kvserve block-key chain, written for kvserve.
 *
 * The chain (docs/block-keys.md) is two-level:
 *   leaf_i = BLAKE2b-256(person, tokens of block i)            independent per block
 *   key_i  = BLAKE2b-128(salt=key_{i-1}, person, leaf_i)       one compression, sequential
 * Leaves are hashed several blocks at a time in SIMD lanes when the CPU has
 * AVX2 or AVX-512F (blake2b_lanes.c, chosen at run time); the scalar code
 * here hashes whatever is left and runs the chain. Every path gives the same
 * bytes; tests force each one.
 *
 * Speed: the twelve rounds are unrolled with compile-time message schedules
 * so every m[SIGMA[r][i]] becomes a register/stack load at a fixed offset,
 * and the rotations are plain 64-bit rotates gcc turns into `ror`.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "blake2b.h"

static inline uint64_t rotr64(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

/* The mixing function G (RFC 7693 §3.1) on state words a, b, c, d. */
#define G(a, b, c, d, x, y)              \
    do {                                 \
        a = a + b + (x);                 \
        d = rotr64(d ^ a, 32);           \
        c = c + d;                       \
        b = rotr64(b ^ c, 24);           \
        a = a + b + (y);                 \
        d = rotr64(d ^ a, 16);           \
        c = c + d;                       \
        b = rotr64(b ^ c, 63);           \
    } while (0)

/* One round with message schedule s0..s15 (a row of SIGMA, written out). */
#define ROUND(s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15) \
    do {                                                                            \
        G(v0, v4, v8, v12, m[s0], m[s1]);                                           \
        G(v1, v5, v9, v13, m[s2], m[s3]);                                           \
        G(v2, v6, v10, v14, m[s4], m[s5]);                                          \
        G(v3, v7, v11, v15, m[s6], m[s7]);                                          \
        G(v0, v5, v10, v15, m[s8], m[s9]);                                          \
        G(v1, v6, v11, v12, m[s10], m[s11]);                                        \
        G(v2, v7, v8, v13, m[s12], m[s13]);                                         \
        G(v3, v4, v9, v14, m[s14], m[s15]);                                         \
    } while (0)

/* Compression F (RFC 7693 §3.2) on message words: h <- F(h, m, t, last).
 * Always inlined so a caller with known-zero words (the chain step: 32 bytes
 * of message in a 128-byte block) gets those additions folded away. */
__attribute__((always_inline)) static inline void b2b_compress_words(uint64_t h[8],
                                                                     const uint64_t m[16],
                                                                     uint64_t t, int last) {
    uint64_t v0 = h[0], v1 = h[1], v2 = h[2], v3 = h[3];
    uint64_t v4 = h[4], v5 = h[5], v6 = h[6], v7 = h[7];
    uint64_t v8 = B2B_IV[0], v9 = B2B_IV[1], v10 = B2B_IV[2], v11 = B2B_IV[3];
    uint64_t v12 = B2B_IV[4] ^ t, v13 = B2B_IV[5]; /* high counter word: messages < 2^64 B */
    uint64_t v14 = last ? ~B2B_IV[6] : B2B_IV[6], v15 = B2B_IV[7];
    B2B_ROUNDS(ROUND);
    h[0] ^= v0 ^ v8;
    h[1] ^= v1 ^ v9;
    h[2] ^= v2 ^ v10;
    h[3] ^= v3 ^ v11;
    h[4] ^= v4 ^ v12;
    h[5] ^= v5 ^ v13;
    h[6] ^= v6 ^ v14;
    h[7] ^= v7 ^ v15;
}

static void b2b_compress(uint64_t h[8], const uint8_t *block, uint64_t t, int last) {
    uint64_t m[16];
    for (int i = 0; i < 16; i++) m[i] = load64(block + 8 * i);
    b2b_compress_words(h, m, t, last);
}

/* Hash a whole message already laid out in memory (no streaming state needed):
 * every full 128-byte block but the last is compressed in place; the last
 * (possibly partial, possibly empty) block is zero-padded on the stack.
 * `prefix` is an optional full block hashed first (the padded key). */
static void b2b_hash(uint64_t h[8], const uint8_t *prefix, const uint8_t *data, size_t len) {
    uint64_t t = 0;
    if (prefix) {
        t = B2B_BLOCKBYTES;
        if (len == 0) {
            b2b_compress(h, prefix, t, 1);
            return;
        }
        b2b_compress(h, prefix, t, 0);
    }
    while (len > B2B_BLOCKBYTES) {
        t += B2B_BLOCKBYTES;
        b2b_compress(h, data, t, 0);
        data += B2B_BLOCKBYTES;
        len -= B2B_BLOCKBYTES;
    }
    t += len;
    if (len == B2B_BLOCKBYTES) {
        b2b_compress(h, data, t, 1);
    } else {
        uint8_t last[B2B_BLOCKBYTES] = {0};
        if (len) memcpy(last, data, len);
        b2b_compress(h, last, t, 1);
    }
}

/* ------------------------------------------------------------- hash paths */

static int always(void) { return 1; }

/* How leaves are hashed: a registry, so tests and benches can force each path
 * and the dispatch is one table lookup. The scalar path has no lane routine. */
typedef struct {
    const char *name;
    int (*supported)(void);
    b2b_leaves_fn leaves; /* NULL: scalar only */
} hash_path;

static const hash_path PATHS[] = {
    {"scalar", always, NULL},
    {"avx2", b2b_cpu_has_avx2, b2b_leaves_avx2},
    {"avx512", b2b_cpu_has_avx512, b2b_leaves_avx512},
};
#define N_PATHS (sizeof PATHS / sizeof PATHS[0])

static const hash_path *best_path = &PATHS[0]; /* set at module init */

/* ------------------------------------------------------------------ chain */

/* Leaves per batch: 64 * 32 B = 2 KiB of digests, hot in L1 for the chain. */
#define LEAF_BATCH 64

static void leaf_scalar(const uint64_t init[8], const uint8_t *msg, size_t len, uint8_t *out) {
    uint64_t h[8];
    memcpy(h, init, sizeof h);
    b2b_hash(h, NULL, msg, len);
    for (int i = 0; i < 4; i++) store64(out + 8 * i, h[i]);
}

/* key = BLAKE2b-128(salt=prev, person, leaf): `init` has the person and the
 * digest length mixed in; the 32-byte leaf is the whole (single-block) message. */
static inline void chain_step(const uint64_t init[8], uint64_t prev[2], const uint8_t *leaf) {
    uint64_t h[8];
    memcpy(h, init, sizeof h);
    h[4] ^= prev[0];
    h[5] ^= prev[1];
    const uint64_t m[16] = {load64(leaf), load64(leaf + 8), load64(leaf + 16), load64(leaf + 24)};
    b2b_compress_words(h, m, LEAF_BYTES, 1);
    prev[0] = h[0];
    prev[1] = h[1];
}

static void chain_blocks(const uint8_t *data, size_t nblocks, size_t block_bytes,
                         const uint8_t root[KEY_BYTES], const uint8_t person[KEY_BYTES],
                         const hash_path *path, uint8_t *out) {
    uint64_t leaf_init[8], chain_init[8];
    b2b_init_params(leaf_init, LEAF_BYTES, 0, NULL, person);
    b2b_init_params(chain_init, KEY_BYTES, 0, NULL, person);
    uint64_t prev[2] = {load64(root), load64(root + 8)};
    uint8_t leaves[LEAF_BATCH * LEAF_BYTES];
    for (size_t i = 0; i < nblocks; i += LEAF_BATCH) {
        size_t n = nblocks - i < LEAF_BATCH ? nblocks - i : LEAF_BATCH;
        const uint8_t *blk = data + i * block_bytes;
        size_t k = path->leaves ? path->leaves(blk, block_bytes, n, leaf_init, leaves) : 0;
        for (; k < n; k++) leaf_scalar(leaf_init, blk + k * block_bytes, block_bytes,
                                       leaves + k * LEAF_BYTES);
        for (k = 0; k < n; k++) {
            chain_step(chain_init, prev, leaves + k * LEAF_BYTES);
            store64(out, prev[0]);
            store64(out + 8, prev[1]);
            out += KEY_BYTES;
        }
    }
}

/* ---------------------------------------------------------------- Python */

/* Token buffers: raw bytes (itemsize 1) or 4-byte unsigned integers. */
static int token_bytes_ok(const Py_buffer *view) {
    if (view->itemsize == 1) return 1;
    if (view->itemsize != 4 || view->format == NULL) return 0;
    const char *f = view->format;
    if (*f == '<' || *f == '=' || *f == '@') f++;
    return (f[0] == 'I' || f[0] == 'L') && f[1] == '\0';
}

/* The path named `name` (NULL: the fastest this CPU supports), or NULL with
 * ValueError naming the choices. */
static const hash_path *find_path(const char *name) {
    if (name == NULL) return best_path;
    char supported[64] = "";
    for (size_t i = 0; i < N_PATHS; i++) {
        if (!PATHS[i].supported()) continue;
        if (supported[0]) strcat(supported, ", ");
        strcat(supported, PATHS[i].name);
    }
    for (size_t i = 0; i < N_PATHS; i++) {
        if (strcmp(name, PATHS[i].name) != 0) continue;
        if (PATHS[i].supported()) return &PATHS[i];
        PyErr_Format(PyExc_ValueError, "hash path '%s' is not supported by this CPU (supported: %s)",
                     name, supported);
        return NULL;
    }
    PyErr_Format(PyExc_ValueError, "unknown hash path '%s': expected one of scalar, avx2, avx512 "
                 "(this CPU supports: %s)", name, supported);
    return NULL;
}

/* Shared by chain() and chain_list(): parse, validate, hash (GIL released). */
static PyObject *chain_impl(PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"", "", "", "", "path", NULL};
    Py_buffer tokens, root, person;
    Py_ssize_t block_tokens;
    PyObject *obj;
    const char *path_name = NULL;
    /* Tokens: any C-contiguous buffer, asked for with its format so a numpy
     * int64 array is refused rather than hashed as raw bytes. */
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "Ony*y*|$z", kwlist, &obj, &block_tokens,
                                     &root, &person, &path_name))
        return NULL;
    const hash_path *path = find_path(path_name);
    if (path == NULL) {
        PyBuffer_Release(&root);
        PyBuffer_Release(&person);
        return NULL;
    }
    if (PyObject_GetBuffer(obj, &tokens, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&root);
        PyBuffer_Release(&person);
        return NULL;
    }
    PyObject *result = NULL;
    if (!token_bytes_ok(&tokens)) {
        PyErr_Format(PyExc_TypeError,
                     "tokens must be bytes or a buffer of 4-byte unsigned integers (got format '%s')",
                     tokens.format ? tokens.format : "?");
        goto done;
    }
    if (tokens.len % 4 != 0) {
        PyErr_Format(PyExc_ValueError, "token buffer length %zd is not a multiple of 4", tokens.len);
        goto done;
    }
    if (block_tokens < 1 || block_tokens > (PY_SSIZE_T_MAX / 4)) {
        PyErr_Format(PyExc_ValueError, "block_tokens must be >= 1, got %zd", block_tokens);
        goto done;
    }
    if (root.len != KEY_BYTES || person.len != KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "root and person must be %d bytes (got %zd and %zd)",
                     KEY_BYTES, root.len, person.len);
        goto done;
    }
    size_t block_bytes = (size_t)block_tokens * 4;
    size_t nblocks = (size_t)tokens.len / block_bytes;
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(nblocks * KEY_BYTES));
    if (result == NULL) goto done;
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    const uint8_t *data = (const uint8_t *)tokens.buf;
    const uint8_t *r = (const uint8_t *)root.buf, *p = (const uint8_t *)person.buf;
    uint8_t root_copy[KEY_BYTES], person_copy[KEY_BYTES];
    memcpy(root_copy, r, KEY_BYTES);
    memcpy(person_copy, p, KEY_BYTES);
    Py_BEGIN_ALLOW_THREADS
    chain_blocks(data, nblocks, block_bytes, root_copy, person_copy, path, out);
    Py_END_ALLOW_THREADS
done:
    PyBuffer_Release(&tokens);
    PyBuffer_Release(&root);
    PyBuffer_Release(&person);
    return result;
}

static PyObject *py_chain(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    return chain_impl(args, kwargs);
}

/* Split n*16 bytes into a list of n 16-byte bytes objects (what kvstore.keys returns);
 * done here because a Python slicing loop costs ~20% of the hashing time. */
static PyObject *py_chain_list(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    PyObject *flat = chain_impl(args, kwargs);
    if (flat == NULL) return NULL;
    Py_ssize_t n = PyBytes_GET_SIZE(flat) / KEY_BYTES;
    PyObject *list = PyList_New(n);
    if (list != NULL) {
        const char *p = PyBytes_AS_STRING(flat);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *key = PyBytes_FromStringAndSize(p + i * KEY_BYTES, KEY_BYTES);
            if (key == NULL) {
                Py_CLEAR(list);
                break;
            }
            PyList_SET_ITEM(list, i, key);
        }
    }
    Py_DECREF(flat);
    return list;
}

static PyObject *py_blake2b(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"data", "digest_size", "key", "salt", "person", NULL};
    Py_buffer data, key = {0}, salt = {0}, person = {0};
    Py_ssize_t digest_size = B2B_OUTBYTES;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|$ny*y*y*", kwlist, &data, &digest_size,
                                     &key, &salt, &person))
        return NULL;
    PyObject *result = NULL;
    if (digest_size < 1 || digest_size > B2B_OUTBYTES) {
        PyErr_Format(PyExc_ValueError, "digest_size must be in 1..64, got %zd", digest_size);
        goto done;
    }
    if (key.len > B2B_KEYBYTES || salt.len > B2B_SALTBYTES || person.len > B2B_PERSONALBYTES) {
        PyErr_SetString(PyExc_ValueError, "key <= 64, salt <= 16, person <= 16 bytes");
        goto done;
    }
    /* Shorter salt/person are zero-padded, as hashlib does. */
    uint8_t salt16[B2B_SALTBYTES] = {0}, person16[B2B_PERSONALBYTES] = {0};
    uint8_t keyblock[B2B_BLOCKBYTES] = {0}, digest[B2B_OUTBYTES];
    if (salt.len) memcpy(salt16, salt.buf, (size_t)salt.len);
    if (person.len) memcpy(person16, person.buf, (size_t)person.len);
    if (key.len) memcpy(keyblock, key.buf, (size_t)key.len);
    uint64_t h[8];
    b2b_init_params(h, (size_t)digest_size, (size_t)key.len, salt16, person16);
    const uint8_t *d = (const uint8_t *)data.buf;
    size_t len = (size_t)data.len;
    int keyed = key.len > 0;
    Py_BEGIN_ALLOW_THREADS
    b2b_hash(h, keyed ? keyblock : NULL, d, len);
    Py_END_ALLOW_THREADS
    for (int i = 0; i < 8; i++) store64(digest + 8 * i, h[i]);
    result = PyBytes_FromStringAndSize((const char *)digest, digest_size);
done:
    PyBuffer_Release(&data);
    if (key.obj) PyBuffer_Release(&key);
    if (salt.obj) PyBuffer_Release(&salt);
    if (person.obj) PyBuffer_Release(&person);
    return result;
}

/* Names of the paths this CPU can run, slowest first (the last is the default). */
static PyObject *py_paths(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    PyObject *names = PyList_New(0);
    if (names == NULL) return NULL;
    for (size_t i = 0; i < N_PATHS; i++) {
        if (!PATHS[i].supported()) continue;
        PyObject *name = PyUnicode_FromString(PATHS[i].name);
        if (name == NULL || PyList_Append(names, name) < 0) {
            Py_XDECREF(name);
            Py_DECREF(names);
            return NULL;
        }
        Py_DECREF(name);
    }
    PyObject *result = PyList_AsTuple(names);
    Py_DECREF(names);
    return result;
}

#define KWFN(f) (PyCFunction)(void (*)(void))(f)

static PyMethodDef methods[] = {
    {"chain", KWFN(py_chain), METH_VARARGS | METH_KEYWORDS,
     "chain(tokens, block_tokens, root16, person16, /, *, path=None) -> bytes\n\n"
     "Key chain over the full blocks of a little-endian uint32 token buffer: "
     "n_full_blocks * 16 bytes. Releases the GIL while hashing. `path` forces "
     "how leaves are hashed ('scalar', 'avx2', 'avx512'; None: the fastest)."},
    {"chain_list", KWFN(py_chain_list), METH_VARARGS | METH_KEYWORDS,
     "chain_list(tokens, block_tokens, root16, person16, /, *, path=None) -> list[bytes]\n\n"
     "Same chain as chain(), one 16-byte bytes object per full block."},
    {"paths", py_paths, METH_NOARGS,
     "paths() -> tuple[str, ...]\n\nHash paths this CPU supports, slowest first."},
    {"blake2b", KWFN(py_blake2b), METH_VARARGS | METH_KEYWORDS,
     "blake2b(data, *, digest_size=64, key=b'', salt=b'', person=b'') -> bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_blockhash",
    "BLAKE2b (RFC 7693) and kvserve's block-key chain, in C.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__blockhash(void) {
    for (size_t i = 0; i < N_PATHS; i++)
        if (PATHS[i].supported()) best_path = &PATHS[i];
    return PyModule_Create(&module);
}
