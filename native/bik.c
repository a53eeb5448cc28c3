/* Batch-invariant CPU kernels for the engine (engine/bik.py).
 *
 * Every output element is computed by one fixed sequence of IEEE operations
 * that depends only on its own row's inputs, never on how many rows share the
 * call, on how the work is split across threads, or on the SIMD width:
 *
 *   gemm     out[m][n] = (sum_k x[m][k] * w[k][n]) (+ bias[n]); the sum is
 *            ONE fused multiply-add chain over k = 0..K-1, starting from +0.
 *   rmsnorm  sum of squares in 16 lane partials (element i -> lane i % 16),
 *            then the halving tree (lane j += lane j + w, w = 8, 4, 2, 1).
 *   silu_mul g / (1 + exp(-g)) * u with the polynomial exp below.
 *   attend   scores: dot in 16 lane partials + halving tree, times scale;
 *            weights exp(s - max); denominator in 16 lane partials over the
 *            key index + halving tree; numerator one FMA chain over keys.
 *
 * The AVX-512, AVX2 and scalar paths perform the same operations on every
 * element (vector FMA == fmaf, correctly rounded), so they agree bit for bit:
 * blocks computed on an AVX2 node are the same bytes as on an AVX-512 node.
 * The build passes -ffp-contract=off so the compiler fuses nothing the code
 * does not fuse itself.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define BIK_X86 1
#else
#define BIK_X86 0
#endif

#define LANES 16

/* ------------------------------------------------------------------ exp */
/* exp(x) for x <= 0 (softmax weights) and any x in silu; clamped to
 * [-87, 88] so 2^n stays a normal float. Cody-Waite reduction, degree-7
 * Taylor polynomial in Horner form: < 2 ulp on the reduced range. */
#define EXP_LO (-87.0f)
#define EXP_HI (88.0f)
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO (-2.12194440e-4f)
static const float EXP_C[8] = {1.0f, 1.0f, 0.5f, 1.66666672e-1f, 4.16666679e-2f,
                               8.33333377e-3f, 1.38888892e-3f, 1.98412701e-4f};

static inline float exp_scalar(float x) {
    x = fminf(fmaxf(x, EXP_LO), EXP_HI);
    float n = rintf(x * LOG2E);
    float r = fmaf(n, -LN2_HI, x);
    r = fmaf(n, -LN2_LO, r);
    float p = EXP_C[7];
    for (int i = 6; i >= 0; i--) p = fmaf(p, r, EXP_C[i]);
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

/* ----------------------------------------------------------- thread pool */
/* tid: the running thread's index in [0, threads), for per-thread scratch. */
typedef void (*task_fn)(void *ctx, int64_t begin, int64_t end, int tid);

#define MAX_THREADS 64
#define SPIN_ROUNDS 20000 /* ~50-100 us of pause before a worker sleeps */

static int g_threads = 1;  /* total, the caller included */
static int g_started = 0;  /* workers running */
static pthread_t g_workers[MAX_THREADS];
static unsigned long g_start_gen[MAX_THREADS];
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t g_call_mu = PTHREAD_MUTEX_INITIALIZER;
static atomic_ulong g_gen;
static atomic_int g_pending;
static atomic_int g_sleepers;
static task_fn g_fn;
static void *g_ctx;
static int64_t g_n;
static int g_active;

static inline void cpu_relax(void) {
#if BIK_X86
    _mm_pause();
#endif
}

static void run_share(int i) {
    int a = g_active;
    if (i >= a) return;
    int64_t b = g_n * i / a, e = g_n * (i + 1) / a;
    if (b < e) g_fn(g_ctx, b, e, i);
}

static void *worker_main(void *arg) {
    int id = (int)(intptr_t)arg;
    /* The generation at creation: a job started right after it is still seen. */
    unsigned long seen = g_start_gen[id];
    for (;;) {
        unsigned long g;
        int spins = 0;
        while ((g = atomic_load(&g_gen)) == seen) {
            if (++spins < SPIN_ROUNDS) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&g_mu);
            atomic_fetch_add(&g_sleepers, 1);
            while ((g = atomic_load(&g_gen)) == seen) pthread_cond_wait(&g_cv, &g_mu);
            atomic_fetch_sub(&g_sleepers, 1);
            pthread_mutex_unlock(&g_mu);
            break;
        }
        seen = g;
        run_share(id);
        atomic_fetch_sub(&g_pending, 1);
    }
    return NULL;
}

static void after_fork_child(void) {
    /* Threads do not survive fork: the child starts its own on first use. */
    g_started = 0;
    pthread_mutex_init(&g_mu, NULL);
    pthread_cond_init(&g_cv, NULL);
    pthread_mutex_init(&g_call_mu, NULL);
    atomic_store(&g_pending, 0);
    atomic_store(&g_sleepers, 0);
}

static int ensure_workers(void) {
    static int atfork_done = 0;
    if (!atfork_done) {
        pthread_atfork(NULL, NULL, after_fork_child);
        atfork_done = 1;
    }
    while (g_started < g_threads - 1) {
        int id = g_started + 1;
        g_start_gen[id] = atomic_load(&g_gen);
        if (pthread_create(&g_workers[id], NULL, worker_main, (void *)(intptr_t)id) != 0)
            return -1;
        pthread_detach(g_workers[id]);
        g_started++;
    }
    return 0;
}

/* Runs fn over [0, n) split into contiguous ranges, one per thread, with at
 * least `grain` items each. The split decides only who computes an element,
 * never how: results do not depend on it. */
static void parallel_run(task_fn fn, void *ctx, int64_t n, int64_t grain) {
    if (n <= 0) return;
    int64_t want = grain > 0 ? n / grain : n;
    if (want < 1) want = 1;
    int t = g_threads;
    if (want < t) t = (int)want;
    pthread_mutex_lock(&g_call_mu);
    if (t <= 1 || ensure_workers() != 0 || g_started + 1 < t) {
        pthread_mutex_unlock(&g_call_mu);
        fn(ctx, 0, n, 0);
        return;
    }
    g_fn = fn;
    g_ctx = ctx;
    g_n = n;
    g_active = t;
    atomic_store(&g_pending, g_started);
    atomic_fetch_add(&g_gen, 1);
    if (atomic_load(&g_sleepers) > 0) {
        pthread_mutex_lock(&g_mu);
        pthread_cond_broadcast(&g_cv);
        pthread_mutex_unlock(&g_mu);
    }
    run_share(0);
    /* A descheduled worker (an oversubscribed host) must not cost a whole time
     * slice of spinning: yield after a short spin. */
    for (int spins = 0; atomic_load(&g_pending) > 0; spins++) {
        if (spins < 4096) cpu_relax();
        else sched_yield();
    }
    pthread_mutex_unlock(&g_call_mu);
}

/* ------------------------------------------------------------------ ISA */
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
static const char *ISA_NAMES[] = {"scalar", "avx2", "avx512"};
static int g_isa_max = ISA_SCALAR;
static int g_isa = ISA_SCALAR;

static void detect_isa(void) {
#if BIK_X86 && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) g_isa_max = ISA_AVX2;
    if (__builtin_cpu_supports("avx512f")) g_isa_max = ISA_AVX512;
#endif
    g_isa = g_isa_max;
}

/* Halving tree over 16 lane partials: lane j += lane j + w for w = 8, 4, 2, 1. */
static inline float tree16(float *s) {
    for (int w = 8; w >= 1; w >>= 1)
        for (int j = 0; j < w; j++) s[j] = s[j] + s[j + w];
    return s[0];
}

/* ----------------------------------------------------------------- GEMM */
/* Packed weights: panels of 16 columns, wp[p][k][16]; the last panel is
 * zero-padded. A panel is one contiguous K*64-byte stream. */
typedef struct {
    const float *x;
    int64_t ldx, M, K;
    const float *wp;
    int64_t N, np; /* columns, panels */
    const float *bias;
    float *out;
    int64_t ldo;
} gemm_args;

static void store_tile(const gemm_args *a, int64_t m0, int R, int64_t p0, int C,
                       const float *acc /* [R][C][16] */) {
    for (int r = 0; r < R; r++) {
        float *o = a->out + (m0 + r) * a->ldo;
        for (int c = 0; c < C; c++) {
            int64_t n0 = (p0 + c) * LANES;
            int64_t cnt = a->N - n0 < LANES ? a->N - n0 : LANES;
            const float *s = acc + ((int64_t)r * C + c) * LANES;
            if (a->bias) {
                for (int64_t j = 0; j < cnt; j++) o[n0 + j] = s[j] + a->bias[n0 + j];
            } else {
                memcpy(o + n0, s, (size_t)cnt * 4);
            }
        }
    }
}

static void tile_scalar(const gemm_args *a, int64_t m0, int R, int64_t p0, int C, float *acc) {
    const int64_t K = a->K, ps = K * LANES;
    memset(acc, 0, sizeof(float) * (size_t)(R * C * LANES));
    for (int64_t k = 0; k < K; k++)
        for (int r = 0; r < R; r++) {
            float xv = a->x[(m0 + r) * a->ldx + k];
            for (int c = 0; c < C; c++) {
                const float *w = a->wp + (p0 + c) * ps + k * LANES;
                float *s = acc + ((int64_t)r * C + c) * LANES;
                for (int j = 0; j < LANES; j++) s[j] = fmaf(xv, w[j], s[j]);
            }
        }
}

#if BIK_X86
#define DEF_T512(R, C)                                                                  \
    __attribute__((target("avx512f"))) static void t512_##R##_##C(                      \
        const gemm_args *a, int64_t m0, int64_t p0, float *acc) {                       \
        const int64_t K = a->K, ps = K * LANES;                                         \
        const float *w0 = a->wp + p0 * ps;                                              \
        const float *x0 = a->x + m0 * a->ldx;                                           \
        __m512 s[R][C];                                                                 \
        for (int r = 0; r < R; r++)                                                     \
            for (int c = 0; c < C; c++) s[r][c] = _mm512_setzero_ps();                  \
        for (int64_t k = 0; k < K; k++) {                                               \
            __m512 w[C];                                                                \
            for (int c = 0; c < C; c++) w[c] = _mm512_loadu_ps(w0 + c * ps + k * LANES); \
            for (int r = 0; r < R; r++) {                                               \
                __m512 xb = _mm512_set1_ps(x0[r * a->ldx + k]);                         \
                for (int c = 0; c < C; c++) s[r][c] = _mm512_fmadd_ps(xb, w[c], s[r][c]); \
            }                                                                           \
        }                                                                               \
        for (int r = 0; r < R; r++)                                                     \
            for (int c = 0; c < C; c++) _mm512_storeu_ps(acc + (r * C + c) * LANES, s[r][c]); \
    }
#define DEF_T256(R, C)                                                                  \
    __attribute__((target("avx2,fma"))) static void t256_##R##_##C(                     \
        const gemm_args *a, int64_t m0, int64_t p0, float *acc) {                       \
        const int64_t K = a->K, ps = K * LANES;                                         \
        const float *w0 = a->wp + p0 * ps;                                              \
        const float *x0 = a->x + m0 * a->ldx;                                           \
        __m256 s[R][2 * C];                                                             \
        for (int r = 0; r < R; r++)                                                     \
            for (int c = 0; c < 2 * C; c++) s[r][c] = _mm256_setzero_ps();              \
        for (int64_t k = 0; k < K; k++) {                                               \
            __m256 w[2 * C];                                                            \
            for (int c = 0; c < 2 * C; c++)                                             \
                w[c] = _mm256_loadu_ps(w0 + (c >> 1) * ps + k * LANES + (c & 1) * 8);   \
            for (int r = 0; r < R; r++) {                                               \
                __m256 xb = _mm256_set1_ps(x0[r * a->ldx + k]);                         \
                for (int c = 0; c < 2 * C; c++) s[r][c] = _mm256_fmadd_ps(xb, w[c], s[r][c]); \
            }                                                                           \
        }                                                                               \
        for (int r = 0; r < R; r++)                                                     \
            for (int c = 0; c < 2 * C; c++)                                             \
                _mm256_storeu_ps(acc + (r * C + (c >> 1)) * LANES + (c & 1) * 8, s[r][c]); \
    }
/* AVX-512: up to 6 rows x 4 panels (24 accumulators + 4 weight registers). */
DEF_T512(1, 1) DEF_T512(1, 2) DEF_T512(1, 3) DEF_T512(1, 4)
DEF_T512(2, 1) DEF_T512(2, 2) DEF_T512(2, 3) DEF_T512(2, 4)
DEF_T512(3, 1) DEF_T512(3, 2) DEF_T512(3, 3) DEF_T512(3, 4)
DEF_T512(4, 1) DEF_T512(4, 2) DEF_T512(4, 3) DEF_T512(4, 4)
DEF_T512(5, 1) DEF_T512(5, 2) DEF_T512(5, 3) DEF_T512(5, 4)
DEF_T512(6, 1) DEF_T512(6, 2) DEF_T512(6, 3) DEF_T512(6, 4)
/* AVX2: up to 3 rows x 2 panels (12 accumulators + 4 weight registers). */
DEF_T256(1, 1) DEF_T256(1, 2) DEF_T256(2, 1) DEF_T256(2, 2) DEF_T256(3, 1) DEF_T256(3, 2)

typedef void (*tile_fn)(const gemm_args *, int64_t, int64_t, float *);
static const tile_fn T512[6][4] = {
    {t512_1_1, t512_1_2, t512_1_3, t512_1_4}, {t512_2_1, t512_2_2, t512_2_3, t512_2_4},
    {t512_3_1, t512_3_2, t512_3_3, t512_3_4}, {t512_4_1, t512_4_2, t512_4_3, t512_4_4},
    {t512_5_1, t512_5_2, t512_5_3, t512_5_4}, {t512_6_1, t512_6_2, t512_6_3, t512_6_4}};
static const tile_fn T256[3][2] = {
    {t256_1_1, t256_1_2}, {t256_2_1, t256_2_2}, {t256_3_1, t256_3_2}};
#endif

/* Tile shape per ISA: rows x panels. Any shape gives the same bits. */
static const int TILE_R[3] = {4, 3, 6};
static const int TILE_C[3] = {1, 2, 4};

static void gemm_task(void *ctx, int64_t g0, int64_t g1, int tid) {
    (void)tid;
    const gemm_args *a = (const gemm_args *)ctx;
    const int isa = g_isa, TR = TILE_R[isa], TC = TILE_C[isa];
    float acc[6 * 4 * LANES];
    for (int64_t g = g0; g < g1; g++) {
        int64_t p0 = g * TC;
        int C = (int)(a->np - p0 < TC ? a->np - p0 : TC);
        for (int64_t m0 = 0; m0 < a->M; m0 += TR) {
            int R = (int)(a->M - m0 < TR ? a->M - m0 : TR);
#if BIK_X86
            if (isa == ISA_AVX512) T512[R - 1][C - 1](a, m0, p0, acc);
            else if (isa == ISA_AVX2) T256[R - 1][C - 1](a, m0, p0, acc);
            else tile_scalar(a, m0, R, p0, C, acc);
#else
            tile_scalar(a, m0, R, p0, C, acc);
#endif
            store_tile(a, m0, R, p0, C, acc);
        }
    }
}

/* ----------------------------------------------------------- rmsnorm */
typedef struct {
    const float *x;
    int64_t ldx, N;
    const float *w;
    float eps;
    float *out;
    int64_t ldo;
} norm_args;

static void norm_task(void *ctx, int64_t m0, int64_t m1, int tid) {
    (void)tid;
    const norm_args *a = (const norm_args *)ctx;
    for (int64_t m = m0; m < m1; m++) {
        const float *x = a->x + m * a->ldx;
        float s[LANES] = {0};
        for (int64_t i = 0; i < a->N; i++) s[i % LANES] = fmaf(x[i], x[i], s[i % LANES]);
        float mean = tree16(s) / (float)a->N;
        float inv = 1.0f / sqrtf(mean + a->eps);
        float *o = a->out + m * a->ldo;
        for (int64_t i = 0; i < a->N; i++) o[i] = a->w[i] * (x[i] * inv);
    }
}

/* ---------------------------------------------------------- silu_mul */
typedef struct {
    const float *gu; /* [M][2I]: gate columns then up columns */
    int64_t ldg, I;
    float *out;
    int64_t ldo;
} silu_args;

static void silu_task(void *ctx, int64_t m0, int64_t m1, int tid) {
    (void)tid;
    const silu_args *a = (const silu_args *)ctx;
    for (int64_t m = m0; m < m1; m++) {
        const float *g = a->gu + m * a->ldg, *u = g + a->I;
        float *o = a->out + m * a->ldo;
        for (int64_t i = 0; i < a->I; i++) {
            float t = exp_scalar(-g[i]);
            o[i] = g[i] / (1.0f + t) * u[i];
        }
    }
}

#if BIK_X86
__attribute__((target("avx512f"))) static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_C[7]);
    for (int i = 6; i >= 0; i--) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C[i]));
    __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

__attribute__((target("avx512f"))) static void silu_task512(void *ctx, int64_t m0, int64_t m1, int tid) {
    (void)tid;
    const silu_args *a = (const silu_args *)ctx;
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t m = m0; m < m1; m++) {
        const float *g = a->gu + m * a->ldg, *u = g + a->I;
        float *o = a->out + m * a->ldo;
        int64_t i = 0;
        for (; i + LANES <= a->I; i += LANES) {
            __m512 gv = _mm512_loadu_ps(g + i);
            __m512 t = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, t));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
        }
        for (; i < a->I; i++) {
            float t = exp_scalar(-g[i]);
            o[i] = g[i] / (1.0f + t) * u[i];
        }
    }
}

__attribute__((target("avx512f"))) static void norm_task512(void *ctx, int64_t m0, int64_t m1, int tid) {
    (void)tid;
    const norm_args *a = (const norm_args *)ctx;
    for (int64_t m = m0; m < m1; m++) {
        const float *x = a->x + m * a->ldx;
        __m512 s = _mm512_setzero_ps();
        int64_t i = 0;
        for (; i + LANES <= a->N; i += LANES) {
            __m512 v = _mm512_loadu_ps(x + i);
            s = _mm512_fmadd_ps(v, v, s);
        }
        float part[LANES];
        _mm512_storeu_ps(part, s);
        for (int64_t j = 0; i < a->N; i++, j++) part[j] = fmaf(x[i], x[i], part[j]);
        float mean = tree16(part) / (float)a->N;
        float inv = 1.0f / sqrtf(mean + a->eps);
        float *o = a->out + m * a->ldo;
        __m512 iv = _mm512_set1_ps(inv);
        for (i = 0; i + LANES <= a->N; i += LANES)
            _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_loadu_ps(a->w + i),
                                                  _mm512_mul_ps(_mm512_loadu_ps(x + i), iv)));
        for (; i < a->N; i++) o[i] = a->w[i] * (x[i] * inv);
    }
}
#endif

/* --------------------------------------------------------- attention */
/* One call covers several segments (a segment = consecutive query rows of one
 * sequence); each (row, head) is one work item. */
typedef struct {
    const float *q;          /* row r, head h at q + r*ldq + h*D */
    int64_t ldq, H, Hkv, D;
    const int64_t *seg;      /* per segment: row0, rows, q_start, K and V addresses,
                                floats between kv heads */
    int64_t nseg;
    const int64_t *item0;    /* first work item of each segment, nseg + 1 entries */
    int64_t window;          /* 0 = full attention */
    float scale;
    float *out;              /* row r, head h at out + r*ldo + h*D */
    int64_t ldo;
    int64_t max_keys;
    int64_t heads_per_pass;  /* query heads of one KV head attended together */
    float *scratch;          /* heads_per_pass * max_keys floats per thread */
} attn_args;

static inline int64_t find_seg(const attn_args *a, int64_t item) {
    int64_t lo = 0, hi = a->nseg - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (a->item0[mid] <= item) lo = mid; else hi = mid - 1;
    }
    return lo;
}

static void attend_one_scalar(const attn_args *a, const float *q, const float *K,
                              const float *V, int64_t nk, float *sc, float *o) {
    const int64_t D = a->D;
    float mx = -INFINITY;
    for (int64_t j = 0; j < nk; j++) {
        float s[LANES] = {0};
        const float *kj = K + j * D;
        for (int64_t d = 0; d < D; d++) s[d % LANES] = fmaf(q[d], kj[d], s[d % LANES]);
        sc[j] = tree16(s) * a->scale;
        if (sc[j] > mx) mx = sc[j];
    }
    float den[LANES] = {0};
    for (int64_t j = 0; j < nk; j++) {
        sc[j] = exp_scalar(sc[j] - mx);
        den[j % LANES] = den[j % LANES] + sc[j];
    }
    float total = tree16(den);
    for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
    for (int64_t j = 0; j < nk; j++) {
        const float *vj = V + j * D;
        for (int64_t d = 0; d < D; d++) o[d] = fmaf(sc[j], vj[d], o[d]);
    }
    for (int64_t d = 0; d < D; d++) o[d] = o[d] / total;
}

#if BIK_X86
/* Dot products of 16 keys at once with the SAME per-key arithmetic as
 * attend_one_scalar: each key's 16 lane partials go through the halving tree
 * (lane i + lane i+w, w = 8, 4, 2, 1), but four levels of two-vector permutes
 * run the tree for all 16 keys together (15 adds instead of 64). RED_LO/HI[l]
 * pick the operands of each level; UNPERM puts the 16 sums back in key order. */
static int RED_LO[4][16], RED_HI[4][16], UNPERM[16];

static void init_reduce_tables(void) {
    /* Level 1 (w=8): a = key 2i, b = key 2i+1 -> [a 8 sums | b 8 sums]. */
    for (int l = 0; l < 8; l++) {
        RED_LO[0][l] = l; RED_HI[0][l] = l + 8;
        RED_LO[0][l + 8] = 16 + l; RED_HI[0][l + 8] = 24 + l;
    }
    /* Levels 2-4 (w=4, 2, 1): each vector holds keys in groups of 2w lanes;
     * a group's first w lanes plus its last w lanes, a's groups then b's,
     * interleaved group by group. */
    int w = 4;
    for (int lev = 1; lev < 4; lev++, w >>= 1) {
        int groups = 16 / (2 * w), o = 0;
        for (int g = 0; g < groups; g++)
            for (int src = 0; src < 2; src++)
                for (int k = 0; k < w; k++, o++) {
                    RED_LO[lev][o] = src * 16 + g * 2 * w + k;
                    RED_HI[lev][o] = src * 16 + g * 2 * w + w + k;
                }
    }
    /* Which key each lane of the final vector holds: run the network on ids. */
    int ids[16][16];
    for (int t = 0; t < 16; t++)
        for (int l = 0; l < 16; l++) ids[t][l] = t;
    int n = 16;
    for (int lev = 0; lev < 4; lev++, n /= 2)
        for (int v = 0; v < n / 2; v++) {
            int out[16];
            for (int l = 0; l < 16; l++) {
                int sel = RED_LO[lev][l];
                out[l] = sel < 16 ? ids[2 * v][sel] : ids[2 * v + 1][sel - 16];
            }
            memcpy(ids[v], out, sizeof out);
        }
    for (int l = 0; l < 16; l++) UNPERM[ids[0][l]] = l;
}

__attribute__((target("avx512f"))) static inline __m512 tree16x16(__m512 *p) {
    int n = 16;
    for (int lev = 0; lev < 4; lev++, n /= 2) {
        __m512i lo = _mm512_loadu_si512((const void *)RED_LO[lev]);
        __m512i hi = _mm512_loadu_si512((const void *)RED_HI[lev]);
        for (int v = 0; v < n / 2; v++)
            p[v] = _mm512_add_ps(_mm512_permutex2var_ps(p[2 * v], lo, p[2 * v + 1]),
                                 _mm512_permutex2var_ps(p[2 * v], hi, p[2 * v + 1]));
    }
    return _mm512_permutexvar_ps(_mm512_loadu_si512((const void *)UNPERM), p[0]);
}

/* Scores, softmax weights (left in sc) and their sum, for one query head.
 * Instantiated per head size (NV = head_dim / 16; 0 = any): with NV known at
 * compile time the query and accumulators stay in registers (4x faster). */
#define DEF_WEIGHTS512(NV) \
__attribute__((target("avx512f"))) static float weights512_##NV( \
    const attn_args *a, const float *q, const float *K, int64_t nk, float *sc) { \
    const int64_t D = NV > 0 ? NV * LANES : a->D; \
    const int64_t nv = D / LANES; \
    __m512 qv[16]; \
    for (int64_t c = 0; c < nv; c++) qv[c] = _mm512_loadu_ps(q + c * LANES); \
    const __m512 scale = _mm512_set1_ps(a->scale); \
    __m512 mxv = _mm512_set1_ps(-INFINITY); \
    int64_t j = 0; \
    for (; j + LANES <= nk; j += LANES) { \
        __m512 p[LANES]; \
        for (int t = 0; t < LANES; t++) { \
            const float *kj = K + (j + t) * D; \
            __m512 s = _mm512_setzero_ps(); \
            for (int64_t c = 0; c < nv; c++) \
                s = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kj + c * LANES), s); \
            p[t] = s; \
        } \
        __m512 v = _mm512_mul_ps(tree16x16(p), scale); \
        _mm512_storeu_ps(sc + j, v); \
        mxv = _mm512_max_ps(mxv, v); \
    } \
    float mx = _mm512_reduce_max_ps(mxv); \
    for (; j < nk; j++) { \
        const float *kj = K + j * D; \
        __m512 s = _mm512_setzero_ps(); \
        for (int64_t c = 0; c < nv; c++) \
            s = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kj + c * LANES), s); \
        /* halving tree: (j, j+8), (j, j+4), (j, j+2), (j, j+1) */ \
        __m256 h8 = _mm256_add_ps(_mm512_castps512_ps256(s), \
                                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1))); \
        __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1)); \
        __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4)); \
        __m128 h1 = _mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)); \
        float v = _mm_cvtss_f32(h1) * a->scale; \
        sc[j] = v; \
        if (v > mx) mx = v; \
    } \
    __m512 den = _mm512_setzero_ps(); \
    mxv = _mm512_set1_ps(mx); \
    for (j = 0; j + LANES <= nk; j += LANES) { \
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + j), mxv)); \
        _mm512_storeu_ps(sc + j, e); \
        den = _mm512_add_ps(den, e); \
    } \
    float part[LANES]; \
    _mm512_storeu_ps(part, den); \
    for (int64_t l = 0; j < nk; j++, l++) { \
        sc[j] = exp_scalar(sc[j] - mx); \
        part[l] = part[l] + sc[j]; \
    } \
    float total = tree16(part); \
    return total; \
}

/* The weighted sum of values for hp query heads of one KV head at once: each
 * output element is still one FMA chain over the keys in order, but the hp * nv
 * chains are independent, so FMA latency no longer bounds the loop and each
 * value row is loaded once for all hp heads. */
#define DEF_VALUES512(NV) \
__attribute__((target("avx512f"))) static void values512_##NV( \
    const attn_args *a, const float *V, int64_t nk, float *const *sc, const float *total, \
    float *const *o, int hp) { \
    const int64_t D = NV > 0 ? NV * LANES : a->D, nv = D / LANES; \
    __m512 ov[16]; \
    for (int h = 0; h < hp; h++) \
        for (int64_t c = 0; c < nv; c++) ov[h * nv + c] = _mm512_setzero_ps(); \
    for (int64_t j = 0; j < nk; j++) { \
        const float *vj = V + j * D; \
        __m512 vv[16]; \
        for (int64_t c = 0; c < nv; c++) vv[c] = _mm512_loadu_ps(vj + c * LANES); \
        for (int h = 0; h < hp; h++) { \
            __m512 e = _mm512_set1_ps(sc[h][j]); \
            for (int64_t c = 0; c < nv; c++) \
                ov[h * nv + c] = _mm512_fmadd_ps(e, vv[c], ov[h * nv + c]); \
        } \
    } \
    for (int h = 0; h < hp; h++) { \
        __m512 tv = _mm512_set1_ps(total[h]); \
        for (int64_t c = 0; c < nv; c++) \
            _mm512_storeu_ps(o[h] + c * LANES, _mm512_div_ps(ov[h * nv + c], tv)); \
    } \
}

DEF_WEIGHTS512(0) DEF_WEIGHTS512(1) DEF_WEIGHTS512(2) DEF_WEIGHTS512(4) DEF_WEIGHTS512(8)
DEF_VALUES512(0) DEF_VALUES512(1) DEF_VALUES512(2) DEF_VALUES512(4) DEF_VALUES512(8)

typedef float (*weights_fn)(const attn_args *, const float *, const float *, int64_t, float *);
typedef void (*values_fn)(const attn_args *, const float *, int64_t, float *const *,
                          const float *, float *const *, int);
static weights_fn weights512_for(int64_t nv) {
    switch (nv) {
    case 1: return weights512_1;
    case 2: return weights512_2;
    case 4: return weights512_4;
    case 8: return weights512_8;
    default: return weights512_0;
    }
}
static values_fn values512_for(int64_t nv) {
    switch (nv) {
    case 1: return values512_1;
    case 2: return values512_2;
    case 4: return values512_4;
    case 8: return values512_8;
    default: return values512_0;
    }
}
#endif

static void attn_task(void *ctx, int64_t i0, int64_t i1, int tid) {
    const attn_args *a = (const attn_args *)ctx;
    const int64_t D = a->D, group = a->H / a->Hkv, hp = a->heads_per_pass;
    const int64_t passes = (group + hp - 1) / hp, per_row = a->Hkv * passes;
    float *scratch = a->scratch + (int64_t)tid * hp * a->max_keys;
    int64_t s = find_seg(a, i0);
    for (int64_t it = i0; it < i1; it++) {
        while (it >= a->item0[s + 1]) s++;
        const int64_t *sg = a->seg + s * 6;
        int64_t local = it - a->item0[s];
        int64_t r = local / per_row, rem = local % per_row;
        int64_t kvh = rem / passes, h0 = kvh * group + (rem % passes) * hp;
        int64_t h1 = h0 + hp < (kvh + 1) * group ? h0 + hp : (kvh + 1) * group;
        int64_t p = sg[2] + r;
        int64_t lo = a->window ? (p - a->window + 1 > 0 ? p - a->window + 1 : 0) : 0;
        int64_t nk = p - lo + 1;
        const float *K = (const float *)(uintptr_t)sg[3] + kvh * sg[5] + lo * D;
        const float *V = (const float *)(uintptr_t)sg[4] + kvh * sg[5] + lo * D;
        const float *q = a->q + (sg[0] + r) * a->ldq;
        float *o = a->out + (sg[0] + r) * a->ldo;
#if BIK_X86
        if (g_isa == ISA_AVX512 && D % LANES == 0 && D <= 256) {
            weights_fn weights = weights512_for(D / LANES);
            values_fn values = values512_for(D / LANES);
            float *scs[4], *outs[4], totals[4];
            for (int64_t h = h0; h < h1; h++) {
                scs[h - h0] = scratch + (h - h0) * a->max_keys;
                outs[h - h0] = o + h * D;
                totals[h - h0] = weights(a, q + h * D, K, nk, scs[h - h0]);
            }
            values(a, V, nk, scs, totals, outs, (int)(h1 - h0));
            continue;
        }
#endif
        for (int64_t h = h0; h < h1; h++) attend_one_scalar(a, q + h * D, K, V, nk, scratch, o + h * D);
    }
}

/* ------------------------------------------------------------ Python */
static void *ptr(unsigned long long p) { return (void *)(uintptr_t)p; }

static PyObject *py_pack(PyObject *self, PyObject *args) {
    unsigned long long w, out;
    long long K, N, ldw;
    if (!PyArg_ParseTuple(args, "KLLLK", &w, &K, &N, &ldw, &out)) return NULL;
    if (K < 1 || N < 1 || ldw < N) {
        PyErr_SetString(PyExc_ValueError, "pack: bad shape");
        return NULL;
    }
    const float *src = ptr(w);
    float *dst = ptr(out);
    int64_t np = (N + LANES - 1) / LANES;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t p = 0; p < np; p++)
        for (int64_t k = 0; k < K; k++) {
            float *d = dst + (p * K + k) * LANES;
            for (int64_t j = 0; j < LANES; j++) {
                int64_t n = p * LANES + j;
                d[j] = n < N ? src[k * ldw + n] : 0.0f;
            }
        }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_gemm(PyObject *self, PyObject *args) {
    gemm_args a;
    unsigned long long x, wp, bias, out;
    long long ldx, M, K, N, ldo;
    if (!PyArg_ParseTuple(args, "KLLLKLKKL", &x, &ldx, &M, &K, &wp, &N, &bias, &out, &ldo))
        return NULL;
    if (M < 0 || K < 1 || N < 1 || ldx < K || ldo < N) {
        PyErr_SetString(PyExc_ValueError, "gemm: bad shape");
        return NULL;
    }
    a.x = ptr(x); a.ldx = ldx; a.M = M; a.K = K; a.wp = ptr(wp); a.N = N;
    a.np = (N + LANES - 1) / LANES; a.bias = bias ? ptr(bias) : NULL; a.out = ptr(out);
    a.ldo = ldo;
    int64_t groups = (a.np + TILE_C[g_isa] - 1) / TILE_C[g_isa];
    /* ~16k multiply-adds per item at least, so tiny GEMMs stay on one thread. */
    int64_t per = M * K * TILE_C[g_isa] * LANES;
    int64_t grain = per > 0 ? (1 << 16) / per + 1 : groups;
    Py_BEGIN_ALLOW_THREADS
    parallel_run(gemm_task, &a, groups, grain);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_rmsnorm(PyObject *self, PyObject *args) {
    norm_args a;
    unsigned long long x, w, out;
    long long ldx, M, N, ldo;
    float eps;
    if (!PyArg_ParseTuple(args, "KLLLKfKL", &x, &ldx, &M, &N, &w, &eps, &out, &ldo))
        return NULL;
    a.x = ptr(x); a.ldx = ldx; a.N = N; a.w = ptr(w); a.eps = eps; a.out = ptr(out);
    a.ldo = ldo;
    task_fn fn = norm_task;
#if BIK_X86
    if (g_isa == ISA_AVX512) fn = norm_task512;
#endif
    Py_BEGIN_ALLOW_THREADS
    parallel_run(fn, &a, M, 64);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_silu_mul(PyObject *self, PyObject *args) {
    silu_args a;
    unsigned long long gu, out;
    long long ldg, M, I, ldo;
    if (!PyArg_ParseTuple(args, "KLLLKL", &gu, &ldg, &M, &I, &out, &ldo)) return NULL;
    a.gu = ptr(gu); a.ldg = ldg; a.I = I; a.out = ptr(out); a.ldo = ldo;
    task_fn fn = silu_task;
#if BIK_X86
    if (g_isa == ISA_AVX512) fn = silu_task512;
#endif
    int64_t grain = I > 0 ? 8192 / I + 1 : 1;
    Py_BEGIN_ALLOW_THREADS
    parallel_run(fn, &a, M, grain);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_attend(PyObject *self, PyObject *args) {
    attn_args a;
    unsigned long long q, seg, out;
    long long ldq, H, Hkv, D, nseg, window, ldo, max_keys;
    float scale;
    if (!PyArg_ParseTuple(args, "KLLLLKLLfKLL", &q, &ldq, &H, &Hkv, &D, &seg, &nseg,
                          &window, &scale, &out, &ldo, &max_keys))
        return NULL;
    if (H < 1 || Hkv < 1 || H % Hkv || D < 1 || nseg < 1 || max_keys < 1) {
        PyErr_SetString(PyExc_ValueError, "attend: bad shape");
        return NULL;
    }
    a.q = ptr(q); a.ldq = ldq; a.H = H; a.Hkv = Hkv; a.D = D; a.seg = ptr(seg);
    a.nseg = nseg; a.window = window; a.scale = scale; a.out = ptr(out); a.ldo = ldo;
    a.max_keys = max_keys;
    /* Up to 16 accumulator registers for the value sums, at most 4 heads. */
    int64_t nv = (D + LANES - 1) / LANES, hp = 16 / (nv ? nv : 1);
    a.heads_per_pass = hp < 1 ? 1 : (hp > 4 ? 4 : hp);
    int64_t group = H / Hkv;
    if (a.heads_per_pass > group) a.heads_per_pass = group;
    int64_t per_row = Hkv * ((group + a.heads_per_pass - 1) / a.heads_per_pass);
    int64_t *item0 = malloc(sizeof(int64_t) * (size_t)(nseg + 1));
    a.scratch = malloc(sizeof(float) * (size_t)(max_keys * a.heads_per_pass * g_threads));
    if (!a.scratch || !item0) {
        free(a.scratch);
        free(item0);
        return PyErr_NoMemory();
    }
    item0[0] = 0;
    for (int64_t i = 0; i < nseg; i++) item0[i + 1] = item0[i] + a.seg[i * 6 + 1] * per_row;
    a.item0 = item0;
    Py_BEGIN_ALLOW_THREADS
    parallel_run(attn_task, &a, item0[nseg], 2);
    Py_END_ALLOW_THREADS
    free(a.scratch);
    free(item0);
    Py_RETURN_NONE;
}

static PyObject *py_set_threads(PyObject *self, PyObject *args) {
    int n;
    if (!PyArg_ParseTuple(args, "i", &n)) return NULL;
    if (n < 1 || n > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "threads must be in [1, %d], got %d", MAX_THREADS, n);
        return NULL;
    }
    /* Workers are never stopped: with fewer threads the extra ones stay idle. */
    pthread_mutex_lock(&g_call_mu);
    g_threads = n;
    pthread_mutex_unlock(&g_call_mu);
    Py_RETURN_NONE;
}

static PyObject *py_set_isa(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    for (int i = 0; i <= g_isa_max; i++)
        if (strcmp(name, ISA_NAMES[i]) == 0) {
            g_isa = i;
            Py_RETURN_NONE;
        }
    PyErr_Format(PyExc_ValueError, "isa %s not supported on this CPU", name);
    return NULL;
}

static PyObject *py_isas(PyObject *self, PyObject *noargs) {
    PyObject *t = PyTuple_New(g_isa_max + 1);
    for (int i = 0; i <= g_isa_max; i++) PyTuple_SET_ITEM(t, i, PyUnicode_FromString(ISA_NAMES[i]));
    return t;
}

static PyObject *py_isa(PyObject *self, PyObject *noargs) {
    return PyUnicode_FromString(ISA_NAMES[g_isa]);
}

static PyMethodDef methods[] = {
    {"pack", py_pack, METH_VARARGS, "pack(w, K, N, ldw, out): [K, N] fp32 -> 16-column panels"},
    {"gemm", py_gemm, METH_VARARGS, "gemm(x, ldx, M, K, wp, N, bias, out, ldo)"},
    {"rmsnorm", py_rmsnorm, METH_VARARGS, "rmsnorm(x, ldx, M, N, w, eps, out, ldo)"},
    {"silu_mul", py_silu_mul, METH_VARARGS, "silu_mul(gu, ldg, M, I, out, ldo)"},
    {"attend", py_attend, METH_VARARGS,
     "attend(q, ldq, H, Hkv, D, seg, nseg, window, scale, out, ldo, "
     "max_keys)"},
    {"set_threads", py_set_threads, METH_VARARGS, "set_threads(n): threads per call"},
    {"set_isa", py_set_isa, METH_VARARGS, "set_isa(name): force a path (tests)"},
    {"isas", py_isas, METH_NOARGS, "paths this CPU supports, slowest first"},
    {"isa", py_isa, METH_NOARGS, "the path in use"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bik",
                                    "Batch-invariant CPU kernels (see engine/bik.py).", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__bik(void) {
    detect_isa();
    init_reduce_tables();
    return PyModule_Create(&module);
}
