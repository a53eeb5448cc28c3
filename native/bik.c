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

/* Threads claim chunks of a job's items from one shared counter (dynamic
 * scheduling): on a host shared with other processes a descheduled worker no
 * longer holds up the call, the caller or a faster worker takes its share,
 * and uneven items (causal attention rows) balance themselves. Who computes
 * an item never changes how it is computed, so results do not depend on it.
 *
 * g_job packs (generation << 32) | next unclaimed item. A job's description
 * lives in g_slots[generation & 1]; a claim is a compare-and-swap on the
 * whole word, so it succeeds only while that job is current, and a late
 * worker that read a slot being rewritten for a later job claims nothing. */
typedef struct {
    task_fn fn;
    void *ctx;
    int64_t n, chunk;
    int active; /* threads that may take part (tid < active): per-thread scratch */
} job_slot;

static int g_threads = 1;  /* total, the caller included */
static int g_started = 0;  /* workers running */
static pthread_t g_workers[MAX_THREADS];
static uint64_t g_start_gen[MAX_THREADS];
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t g_call_mu = PTHREAD_MUTEX_INITIALIZER;
static job_slot g_slots[2];
static _Atomic uint64_t g_job;
static atomic_llong g_done; /* items of the current job finished */
static atomic_int g_sleepers;

static inline void cpu_relax(void) {
#if BIK_X86
    _mm_pause();
#endif
}

static inline uint64_t job_gen(uint64_t w) { return w >> 32; }

/* Claims and runs chunks of whatever job is current until none is left;
 * returns the generation it last saw. */
static uint64_t claim_loop(int tid) {
    for (;;) {
        uint64_t w = atomic_load(&g_job);
        uint64_t gen = job_gen(w);
        int64_t i = (int64_t)(w & 0xffffffffu);
        const job_slot *s = &g_slots[gen & 1];
        task_fn fn = s->fn;
        void *ctx = s->ctx;
        int64_t n = s->n, c = s->chunk;
        if (tid >= s->active || i >= n) return gen;
        int64_t e = n - i > c ? i + c : n;
        if (!atomic_compare_exchange_weak(&g_job, &w, (gen << 32) | (uint64_t)e)) continue;
        fn(ctx, i, e, tid);
        atomic_fetch_add(&g_done, e - i);
    }
}

static void *worker_main(void *arg) {
    int id = (int)(intptr_t)arg;
    /* The generation at creation: a job started right after it is still seen. */
    uint64_t seen = g_start_gen[id];
    for (;;) {
        int spins = 0;
        while (job_gen(atomic_load(&g_job)) == seen) {
            if (++spins < SPIN_ROUNDS) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&g_mu);
            atomic_fetch_add(&g_sleepers, 1);
            while (job_gen(atomic_load(&g_job)) == seen) pthread_cond_wait(&g_cv, &g_mu);
            atomic_fetch_sub(&g_sleepers, 1);
            pthread_mutex_unlock(&g_mu);
            break;
        }
        seen = claim_loop(id);
    }
    return NULL;
}

static void after_fork_child(void) {
    /* Threads do not survive fork: the child starts its own on first use. */
    g_started = 0;
    pthread_mutex_init(&g_mu, NULL);
    pthread_cond_init(&g_cv, NULL);
    pthread_mutex_init(&g_call_mu, NULL);
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
        g_start_gen[id] = job_gen(atomic_load(&g_job));
        if (pthread_create(&g_workers[id], NULL, worker_main, (void *)(intptr_t)id) != 0)
            return -1;
        pthread_detach(g_workers[id]);
        g_started++;
    }
    return 0;
}

/* Runs fn over [0, n) on up to g_threads threads, each taking part only when
 * there are at least `grain` items per thread. The split decides only who
 * computes an item, never how: results do not depend on it. */
static void parallel_run(task_fn fn, void *ctx, int64_t n, int64_t grain) {
    if (n <= 0) return;
    int64_t want = grain > 0 ? n / grain : n;
    if (want < 1) want = 1;
    int t = g_threads;
    if (want < t) t = (int)want;
    pthread_mutex_lock(&g_call_mu);
    if (t <= 1 || n > 0x7fffffff || ensure_workers() != 0 || g_started + 1 < t) {
        pthread_mutex_unlock(&g_call_mu);
        fn(ctx, 0, n, 0);
        return;
    }
    /* About 8 claims per thread: few enough that claiming costs nothing,
     * enough that one slow thread's last chunk is a small part. */
    int64_t chunk = n / ((int64_t)t * 8);
    uint64_t gen = job_gen(atomic_load(&g_job)) + 1;
    job_slot *s = &g_slots[gen & 1];
    s->fn = fn;
    s->ctx = ctx;
    s->n = n;
    s->chunk = chunk < 1 ? 1 : chunk;
    s->active = t;
    atomic_store(&g_done, 0);
    atomic_store(&g_job, gen << 32);
    if (atomic_load(&g_sleepers) > 0) {
        pthread_mutex_lock(&g_mu);
        pthread_cond_broadcast(&g_cv);
        pthread_mutex_unlock(&g_mu);
    }
    claim_loop(0);
    /* Only items already claimed are waited for; a worker descheduled before
     * it claimed anything costs nothing. Yield after a short spin so a
     * descheduled worker holding a claim gets the core back. */
    for (int spins = 0; atomic_load(&g_done) < n; spins++) {
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
 * zero-padded. A panel is one contiguous K*64-byte stream.
 *
 * Blocking (none of it changes a bit: every output element is still ONE FMA
 * chain over k = 0..K-1 in order, from +0; a K block only parks the running
 * sum in memory and picks it up again, which is exact in fp32):
 *   work item  = cp panels x about GEMM_MC rows (threads split items, never
 *                a chain): the item's rows stay in L2 while its panels stream
 *                past them (512 x 1536 inputs, 3 MB, did not);
 *   K block    = GEMM_KC values of k, so a weight block stays in L2 for long
 *                K (128 or 256, to keep it in L1, measured slower: L2 already
 *                feeds the tile);
 *   row tile   = TILE_R x TILE_C register accumulators per ISA. */
#define GEMM_KC 2048
#define GEMM_MC 128 /* rows per item target; an item holds at most GEMM_MC_MAX */
#define GEMM_MC_MAX 144
#define GEMM_CP_MAX 4

typedef struct {
    const float *x;
    int64_t ldx, M, K;
    const float *wp;
    int64_t N, np; /* columns, panels */
    const float *bias;
    float *out;
    int64_t ldo;
    int64_t cp;  /* panels per work item */
    int64_t mc;  /* rows per work item */
    int64_t nmb; /* row blocks: item i is panels (i / nmb) * cp.., rows (i % nmb) * mc.. */
} gemm_args;

/* Running sums of rows [m0, m0+R) x panels [p0, p0+C) over k in [k0, k1): acc
 * holds them between K blocks, row r panel c at acc + r * lda + c * 16. */
static void tile_scalar(const gemm_args *a, int64_t m0, int R, int64_t p0, int C, int64_t k0,
                        int64_t k1, float *acc, int64_t lda) {
    const int64_t ps = a->K * LANES;
    if (k0 == 0)
        for (int r = 0; r < R; r++) memset(acc + r * lda, 0, sizeof(float) * (size_t)(C * LANES));
    for (int64_t k = k0; k < k1; k++)
        for (int r = 0; r < R; r++) {
            float xv = a->x[(m0 + r) * a->ldx + k];
            for (int c = 0; c < C; c++) {
                const float *w = a->wp + (p0 + c) * ps + k * LANES;
                float *s = acc + r * lda + c * LANES;
                for (int j = 0; j < LANES; j++) s[j] = fmaf(xv, w[j], s[j]);
            }
        }
}

#if BIK_X86
#define DEF_T512(R, C)                                                                  \
    __attribute__((target("avx512f"))) static void t512_##R##_##C(                      \
        const gemm_args *a, int64_t m0, int64_t p0, int64_t k0, int64_t k1, float *acc, \
        int64_t lda) {                                                                  \
        const int64_t ps = a->K * LANES, ldx = a->ldx;                                  \
        const float *w0 = a->wp + p0 * ps;                                              \
        const float *x0 = a->x + m0 * ldx;                                              \
        __m512 s[R][C];                                                                 \
        for (int r = 0; r < R; r++)                                                     \
            for (int c = 0; c < C; c++)                                                 \
                s[r][c] = k0 ? _mm512_loadu_ps(acc + r * lda + c * LANES) : _mm512_setzero_ps(); \
        for (int64_t k = k0; k < k1; k++) {                                             \
            __m512 w[C];                                                                \
            for (int c = 0; c < C; c++) w[c] = _mm512_loadu_ps(w0 + c * ps + k * LANES); \
            for (int r = 0; r < R; r++) {                                               \
                __m512 xb = _mm512_set1_ps(x0[r * ldx + k]);                            \
                for (int c = 0; c < C; c++) s[r][c] = _mm512_fmadd_ps(xb, w[c], s[r][c]); \
            }                                                                           \
        }                                                                               \
        for (int r = 0; r < R; r++)                                                     \
            for (int c = 0; c < C; c++) _mm512_storeu_ps(acc + r * lda + c * LANES, s[r][c]); \
    }
#define DEF_T256(R, C)                                                                  \
    __attribute__((target("avx2,fma"))) static void t256_##R##_##C(                     \
        const gemm_args *a, int64_t m0, int64_t p0, int64_t k0, int64_t k1, float *acc, \
        int64_t lda) {                                                                  \
        const int64_t ps = a->K * LANES, ldx = a->ldx;                                  \
        const float *w0 = a->wp + p0 * ps;                                              \
        const float *x0 = a->x + m0 * ldx;                                              \
        __m256 s[R][2 * C];                                                             \
        for (int r = 0; r < R; r++)                                                     \
            for (int c = 0; c < 2 * C; c++)                                             \
                s[r][c] = k0 ? _mm256_loadu_ps(acc + r * lda + c * 8) : _mm256_setzero_ps(); \
        for (int64_t k = k0; k < k1; k++) {                                             \
            __m256 w[2 * C];                                                            \
            for (int c = 0; c < 2 * C; c++)                                             \
                w[c] = _mm256_loadu_ps(w0 + (c >> 1) * ps + k * LANES + (c & 1) * 8);   \
            for (int r = 0; r < R; r++) {                                               \
                __m256 xb = _mm256_set1_ps(x0[r * ldx + k]);                            \
                for (int c = 0; c < 2 * C; c++) s[r][c] = _mm256_fmadd_ps(xb, w[c], s[r][c]); \
            }                                                                           \
        }                                                                               \
        for (int r = 0; r < R; r++)                                                     \
            for (int c = 0; c < 2 * C; c++) _mm256_storeu_ps(acc + r * lda + c * 8, s[r][c]); \
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

typedef void (*tile_fn)(const gemm_args *, int64_t, int64_t, int64_t, int64_t, float *, int64_t);
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

static void gemm_task(void *ctx, int64_t i0, int64_t i1, int tid) {
    (void)tid;
    const gemm_args *a = (const gemm_args *)ctx;
    const int isa = g_isa, TR = TILE_R[isa], TC = TILE_C[isa];
    const int64_t lda = a->cp * LANES;
    float acc[GEMM_MC_MAX * GEMM_CP_MAX * LANES];
    for (int64_t it = i0; it < i1; it++) {
        const int64_t p0 = it / a->nmb * a->cp, m0 = it % a->nmb * a->mc;
        const int64_t pc = a->np - p0 < a->cp ? a->np - p0 : a->cp;
        const int64_t mr = a->M - m0 < a->mc ? a->M - m0 : a->mc;
        for (int64_t k0 = 0; k0 < a->K; k0 += GEMM_KC) {
            const int64_t k1 = a->K - k0 < GEMM_KC ? a->K : k0 + GEMM_KC;
            for (int64_t pp = 0; pp < pc; pp += TC) {
                const int C = (int)(pc - pp < TC ? pc - pp : TC);
                for (int64_t r = 0; r < mr; r += TR) {
                    const int R = (int)(mr - r < TR ? mr - r : TR);
                    float *t = acc + r * lda + pp * LANES;
#if BIK_X86
                    if (isa == ISA_AVX512) T512[R - 1][C - 1](a, m0 + r, p0 + pp, k0, k1, t, lda);
                    else if (isa == ISA_AVX2) T256[R - 1][C - 1](a, m0 + r, p0 + pp, k0, k1, t, lda);
                    else tile_scalar(a, m0 + r, R, p0 + pp, C, k0, k1, t, lda);
#else
                    tile_scalar(a, m0 + r, R, p0 + pp, C, k0, k1, t, lda);
#endif
                }
            }
        }
        /* The bias is added after the whole chain, as one rounding. */
        const int64_t n0 = p0 * LANES, n1 = (p0 + pc) * LANES < a->N ? (p0 + pc) * LANES : a->N;
        for (int64_t r = 0; r < mr; r++) {
            float *o = a->out + (m0 + r) * a->ldo + n0;
            const float *s = acc + r * lda;
            if (a->bias) {
                for (int64_t j = 0; j < n1 - n0; j++) o[j] = s[j] + a->bias[n0 + j];
            } else {
                memcpy(o, s, (size_t)(n1 - n0) * 4);
            }
        }
    }
}

/* Work items for a GEMM on `threads` threads: rows in blocks of about
 * GEMM_MC, panels in groups of cp. Few rows: cp in {4, 2, 1} that splits the
 * panels most evenly (N = 576 on 2 threads: 36 panels = 9 groups of 4, one
 * thread doing 5, or 18 of 2). */
static void gemm_plan(gemm_args *a, int threads, int isa) {
    const int64_t TR = TILE_R[isa];
    a->nmb = (a->M + GEMM_MC - 1) / GEMM_MC;
    if (a->nmb < 1) a->nmb = 1;
    int64_t mc = (a->M + a->nmb - 1) / a->nmb;
    if (a->nmb > 1) mc = (mc + TR - 1) / TR * TR;
    a->mc = mc < 1 ? 1 : mc;
    if (a->M > 0) a->nmb = (a->M + a->mc - 1) / a->mc;
    a->cp = GEMM_CP_MAX;
    if (a->nmb == 1 && threads > 1) {
        int64_t best = -1;
        for (int64_t cp = GEMM_CP_MAX; cp >= 1; cp /= 2) {
            int64_t items = (a->np + cp - 1) / cp;
            int64_t cost = (items + threads - 1) / threads * cp;
            if (best < 0 || cost < best) {
                best = cost;
                a->cp = cp;
            }
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
    /* The residual add fused in front (add_rmsnorm): row m normalizes
     * sum[m] = x[m] + d[m], written first; NULL d: plain rmsnorm of x. */
    const float *d;
    int64_t ldd;
    float *sum;
    int64_t lds;
} norm_args;

/* The row a norm task normalizes: x's row, or x + d written to sum's row
 * (one IEEE add per element, the same bits as torch's add; the row is then
 * read back from L1 by the norm). */
static inline const float *norm_row(const norm_args *a, int64_t m) {
    const float *x = a->x + m * a->ldx;
    if (!a->d) return x;
    const float *d = a->d + m * a->ldd;
    float *s = a->sum + m * a->lds;
    for (int64_t i = 0; i < a->N; i++) s[i] = x[i] + d[i];
    return s;
}

static void norm_task(void *ctx, int64_t m0, int64_t m1, int tid) {
    (void)tid;
    const norm_args *a = (const norm_args *)ctx;
    for (int64_t m = m0; m < m1; m++) {
        const float *x = norm_row(a, m);
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
        const float *x = norm_row(a, m);
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
#define ATT_PMAX 8   /* (row, head) pairs whose value sums stay in registers */
#define ATT_NPMAX 48 /* (row, head) pairs of one work item (AVX-512: up to 16 rows x 3 heads) */
#define ATT_SCRATCH (4 << 20) /* bytes of scores per thread that larger items may grow to */
#define ATT_VB_BYTES 32768 /* a block of V the value groups share: in L1 (48 KiB) */

/* The key (or value) rows one work item reads: a sequence's contiguous mirror,
 * or its blocks in the paged pool through its block table. Row j of the item
 * is the sequence's key off + j either way, and every kernel below reads a row
 * only through kv_row, so the arithmetic on each row, and so every bit of the
 * result, is the same whichever layout holds it. */
typedef struct {
    const float *base;       /* this KV head: row a at base + a*D (contiguous) or in block */
    const int64_t *tab;      /* block table, NULL when contiguous */
    int64_t off;             /* the key index of row 0 */
    int64_t shift, mask;     /* rows per block = 1 << shift */
    int64_t D;
} kv_rows;

static inline const float *kv_row(const kv_rows *r, int64_t j) {
    const int64_t a = r->off + j;
    return r->base + (r->tab ? (r->tab[a >> r->shift] << r->shift | (a & r->mask)) : a) * r->D;
}

/* Row j and how many rows from it, up to j1, lie one after the other (to the
 * end of its block): the hot loops walk each such run with a pointer, as they
 * walked the whole mirror (an address per row cost 1.5-1.8x, measured). */
static inline const float *kv_span(const kv_rows *r, int64_t j, int64_t j1, int64_t *n) {
    const int64_t left = r->tab ? r->mask + 1 - ((r->off + j) & r->mask) : j1 - j;
    *n = left < j1 - j ? left : j1 - j;
    return kv_row(r, j);
}

/* The addresses of rows j .. j+15. */
static inline void kv_rows16(const kv_rows *r, int64_t j, const float **out) {
    int64_t n;
    const float *row = kv_span(r, j, j + 16, &n);
    if (n == 16) {
        for (int t = 0; t < 16; t++) out[t] = row + t * r->D;
    } else {
        for (int t = 0; t < 16; t++) out[t] = kv_row(r, j + t);
    }
}

#define SEG_FIELDS 8  /* row0, rows, q_start, K, V, floats between kv heads, table, shift */

/* One call covers several segments (a segment = consecutive query rows of one
 * sequence); each (row, head) is one work item. */
typedef struct {
    const float *q;          /* row r, head h at q + r*ldq + h*D */
    int64_t ldq, H, Hkv, D;
    const int64_t *seg;      /* per segment, SEG_FIELDS each: row0, rows, q_start, K and V
                                addresses, floats between kv heads, block table address
                                (0: contiguous rows) and log2 of rows per block */
    int64_t nseg;
    const int64_t *item0;    /* first work item of each segment, nseg + 1 entries */
    int64_t window;          /* 0 = full attention */
    float scale;
    float *out;              /* row r, head h at out + r*ldo + h*D */
    int64_t ldo;
    int64_t max_keys;
    int64_t heads_per_pass;  /* query heads of one KV head attended together */
    int64_t rows_per_item;   /* consecutive query rows attended together */
    int64_t pairs_per_values; /* (row, head) pairs of one pass over V */
    float *scratch;          /* heads_per_pass * rows_per_item * max_keys floats per thread */
} attn_args;

static inline int64_t find_seg(const attn_args *a, int64_t item) {
    int64_t lo = 0, hi = a->nseg - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (a->item0[mid] <= item) lo = mid; else hi = mid - 1;
    }
    return lo;
}

static void attend_one_scalar(const attn_args *a, const float *q, const kv_rows *K,
                              const kv_rows *V, int64_t nk, float *sc, float *o) {
    const int64_t D = a->D;
    float mx = -INFINITY;
    for (int64_t j = 0; j < nk; j++) {
        float s[LANES] = {0};
        const float *kj = kv_row(K, j);
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
        const float *vj = kv_row(V, j);
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

/* Both score kernels: each pair's running maximum at -inf; the most keys of any pair. */
__attribute__((target("avx512f"))) static inline int64_t scores512_start(
    const int64_t *nk, int np, __m512 *mxv) {
    int64_t nkmax = 0;
    for (int p = 0; p < np; p++) {
        mxv[p] = _mm512_set1_ps(-INFINITY);
        if (nk[p] > nkmax) nkmax = nk[p];
    }
    return nkmax;
}

/* The rows of the 16 keys from j, and the next 16 keys' rows prefetched into L1
 * (nv chunks of 16 floats each) while these are used. */
static inline void key_block16(const kv_rows *K, int64_t j, int64_t nkmax, int64_t nv,
                               const float **kg) {
    kv_rows16(K, j, kg);
    if (j + 2 * LANES <= nkmax) {
        const float *kn[LANES];
        kv_rows16(K, j + LANES, kn);
        for (int t = 0; t < LANES; t++)
            for (int64_t c = 0; c < nv; c++)
                _mm_prefetch((const char *)(kn[t] + c * LANES), _MM_HINT_T0);
    }
}

/* The keys past each pair's last whole 16-key block, one at a time (the same
 * chain and tree as a block's), and each pair's maximum. */
#define DEF_SCORES512_TAIL(NV) \
__attribute__((target("avx512f"))) static void scores512_tail_##NV( \
    const attn_args *a, const float *const *q, const kv_rows *K, const int64_t *nk, int np, \
    float *const *sc, const __m512 *mxv, float *mx) { \
    const int64_t nv = NV > 0 ? NV : a->D / LANES; \
    for (int p = 0; p < np; p++) { \
        float m = _mm512_reduce_max_ps(mxv[p]); \
        __m512 qv[16]; \
        for (int64_t c = 0; c < nv; c++) qv[c] = _mm512_loadu_ps(q[p] + c * LANES); \
        for (int64_t j = nk[p] / LANES * LANES; j < nk[p]; j++) { \
            const float *kj = kv_row(K, j); \
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
            sc[p][j] = v; \
            if (v > m) m = v; \
        } \
        mx[p] = m; \
    } \
}

/* Scores of up to ATT_PMAX (query row, head) pairs that read the same keys
 * (rows of one sequence with the same first key, heads of one KV head):
 * each pair's scores are exactly what one pair alone computes (per key the
 * dot product in 16 lane partials, the halving tree, times scale), but the
 * loop runs over 16-key blocks outermost, so a 4 KiB block of K is read from
 * L2 once and from L1 by every other pair (before: K streamed from L2 once
 * per pair). Leaves the scores in sc[p] and their maximum in mx[p].
 * Instantiated per head size (NV = head_dim / 16; 0 = any): with NV known at
 * compile time the query and accumulators stay in registers (4x faster). */
#define DEF_SCORES512(NV) \
__attribute__((target("avx512f"))) static void scores512_##NV( \
    const attn_args *a, const float *const *q, const kv_rows *K, const int64_t *nk, int np, \
    float *const *sc, float *mx) { \
    const int64_t D = NV > 0 ? NV * LANES : a->D; \
    const int64_t nv = D / LANES; \
    const __m512 scale = _mm512_set1_ps(a->scale); \
    __m512 mxv[ATT_NPMAX]; \
    const int64_t nkmax = scores512_start(nk, np, mxv); \
    for (int64_t j = 0; j + LANES <= nkmax; j += LANES) { \
        const float *kg[LANES]; \
        key_block16(K, j, nkmax, nv, kg); \
        for (int p = 0; p < np; p++) { \
            if (j + LANES > nk[p]) continue; \
            __m512 qv[16]; \
            for (int64_t c = 0; c < nv; c++) qv[c] = _mm512_loadu_ps(q[p] + c * LANES); \
            __m512 pv[LANES]; \
            for (int t = 0; t < LANES; t++) { \
                const float *kj = kg[t]; \
                __m512 s = _mm512_setzero_ps(); \
                for (int64_t c = 0; c < nv; c++) \
                    s = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kj + c * LANES), s); \
                pv[t] = s; \
            } \
            __m512 v = _mm512_mul_ps(tree16x16(pv), scale); \
            _mm512_storeu_ps(sc[p] + j, v); \
            mxv[p] = _mm512_max_ps(mxv[p], v); \
        } \
    } \
    scores512_tail_##NV(a, q, K, nk, np, sc, mxv, mx); \
}

/* The same scores as scores512_<NV>, bit for bit, for items of many pairs:
 * the halving tree without its permutes. A 16-key block of K is laid out once
 * per block for every pair: vector X[c][g][m] holds lanes 4g..4g+3 of chunk c
 * (16 elements of the head) of keys m, 4 + m, 8 + m and 12 + m, one key per
 * 128-bit lane (a 4x4 transpose of 128-bit blocks, 8 shuffles). Each pair's
 * query chunk is broadcast to the four 128-bit lanes, so acc[m][g] holds the
 * same FMA chains (over c, from +0) as the 16 lane partials of those keys:
 * lane i*4 + e of acc[m][g] is partial 4g + e of key 4i + m. The tree's
 * first two levels (partial e + e+8, then + e+4) become vertical adds, its
 * last two (+ e+2, + e+1) four in-lane shuffles; each add takes its operands
 * in the tree's order, and the last one leaves the 16 keys in key order.
 * The permute tree spent 31 permutes a pair and block on the one shuffle
 * port that also runs half the FMAs; this spends 6, plus 128 a block shared
 * by the item's pairs (so items of few pairs keep the permute tree). */
#define ATT_QUAD_MIN 8 /* pairs of an item from which the transposed block pays */
#define DEF_SCORES512Q(NV) \
__attribute__((target("avx512f"))) static void scores512q_##NV( \
    const attn_args *a, const float *const *q, const kv_rows *K, const int64_t *nk, int np, \
    float *const *sc, float *mx) { \
    const __m512 scale = _mm512_set1_ps(a->scale); \
    __m512 mxv[ATT_NPMAX]; \
    __m512 X[NV][4][4]; \
    const int64_t nkmax = scores512_start(nk, np, mxv); \
    for (int64_t j = 0; j + LANES <= nkmax; j += LANES) { \
        const float *kg[LANES]; \
        key_block16(K, j, nkmax, NV, kg); \
        for (int m = 0; m < 4; m++) \
            for (int c = 0; c < NV; c++) { \
                const __m512 r0 = _mm512_loadu_ps(kg[m] + c * LANES); \
                const __m512 r1 = _mm512_loadu_ps(kg[4 + m] + c * LANES); \
                const __m512 r2 = _mm512_loadu_ps(kg[8 + m] + c * LANES); \
                const __m512 r3 = _mm512_loadu_ps(kg[12 + m] + c * LANES); \
                const __m512 t0 = _mm512_shuffle_f32x4(r0, r1, 0x44); \
                const __m512 t1 = _mm512_shuffle_f32x4(r0, r1, 0xEE); \
                const __m512 t2 = _mm512_shuffle_f32x4(r2, r3, 0x44); \
                const __m512 t3 = _mm512_shuffle_f32x4(r2, r3, 0xEE); \
                X[c][0][m] = _mm512_shuffle_f32x4(t0, t2, 0x88); \
                X[c][1][m] = _mm512_shuffle_f32x4(t0, t2, 0xDD); \
                X[c][2][m] = _mm512_shuffle_f32x4(t1, t3, 0x88); \
                X[c][3][m] = _mm512_shuffle_f32x4(t1, t3, 0xDD); \
            } \
        for (int p = 0; p < np; p++) { \
            if (j + LANES > nk[p]) continue; \
            /* Opaque per pair: the compiler would hold part of X in registers \
             * across pairs and spill the accumulators instead. */ \
            const __m512 *xt = &X[0][0][0]; \
            __asm__("" : "+r"(xt)); \
            __m512 acc[4][4]; \
            for (int m = 0; m < 4; m++) \
                for (int g = 0; g < 4; g++) acc[m][g] = _mm512_setzero_ps(); \
            for (int c = 0; c < NV; c++) \
                for (int g = 0; g < 4; g++) { \
                    const __m512 qb = \
                        _mm512_broadcast_f32x4(_mm_loadu_ps(q[p] + c * LANES + 4 * g)); \
                    for (int m = 0; m < 4; m++) \
                        acc[m][g] = _mm512_fmadd_ps(qb, xt[(c * 4 + g) * 4 + m], acc[m][g]); \
                } \
            __m512 v[4]; \
            for (int m = 0; m < 4; m++) \
                v[m] = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][2]), \
                                     _mm512_add_ps(acc[m][1], acc[m][3])); \
            const __m512 w01 = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x44), \
                                             _mm512_shuffle_ps(v[0], v[1], 0xEE)); \
            const __m512 w23 = _mm512_add_ps(_mm512_shuffle_ps(v[2], v[3], 0x44), \
                                             _mm512_shuffle_ps(v[2], v[3], 0xEE)); \
            const __m512 s = _mm512_mul_ps(_mm512_add_ps(_mm512_shuffle_ps(w01, w23, 0x88), \
                                                         _mm512_shuffle_ps(w01, w23, 0xDD)), \
                                           scale); \
            _mm512_storeu_ps(sc[p] + j, s); \
            mxv[p] = _mm512_max_ps(mxv[p], s); \
        } \
    } \
    scores512_tail_##NV(a, q, K, nk, np, sc, mxv, mx); \
}

/* Softmax weights exp(s - max) in place and their sum (16 lane partials over
 * the key index, then the halving tree). */
__attribute__((target("avx512f"))) static float expsum512(float *sc, int64_t nk, float mx) {
    __m512 den = _mm512_setzero_ps();
    const __m512 mxv = _mm512_set1_ps(mx);
    int64_t j = 0;
    for (; j + LANES <= nk; j += LANES) {
        __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sc + j), mxv));
        _mm512_storeu_ps(sc + j, e);
        den = _mm512_add_ps(den, e);
    }
    float part[LANES];
    _mm512_storeu_ps(part, den);
    for (int64_t l = 0; j < nk; j++, l++) {
        sc[j] = exp_scalar(sc[j] - mx);
        part[l] = part[l] + sc[j];
    }
    return tree16(part);
}

/* The weighted sums of values for P pairs at once over keys [j0, j1): each
 * output element is one FMA chain over its own keys in order, the P * NV
 * chains are independent (FMA latency no longer bounds the loop) and each
 * value row is loaded once for all P pairs. Keys every pair has run jointly;
 * a pair with more keys (a later causal row) continues its chains over the
 * rest. Between key ranges a chain's running sum is parked in o (a float
 * stored and loaded back is the same float): the caller walks V in blocks
 * that stay in L1 for every group of pairs, so V streams from L3 once per
 * item instead of once per group (values were 2x slower over a 5.5k context
 * than over 512 keys, on an Intel Xeon whose 2 MB L2 holds neither K nor V
 * of one KV head). The division by the denominator is values512_div's. */
#define ATT_PF 32 /* value rows prefetched ahead (the stream crosses 4 KiB pages) */
#define DEF_VALUES512(NV, P) \
__attribute__((target("avx512f"))) static void values512_##NV##_##P( \
    const kv_rows *V, int64_t j0, int64_t j1, const int64_t *nk, float *const *sc, \
    float *const *o) { \
    __m512 ov[P][NV]; \
    int64_t nmin = j1, nmax = j0; \
    for (int h = 0; h < P; h++) { \
        for (int c = 0; c < NV; c++) \
            ov[h][c] = j0 ? _mm512_loadu_ps(o[h] + c * LANES) : _mm512_setzero_ps(); \
        const int64_t e = nk[h] < j1 ? nk[h] : j1; \
        if (e < nmin) nmin = e; \
        if (e > nmax) nmax = e; \
    } \
    for (int64_t j = j0, n; j < nmin;) \
    for (const float *vj = kv_span(V, j, nmin, &n), *vend = vj + n * NV * LANES; vj < vend; \
         vj += NV * LANES, j++) { \
        if (vj + ATT_PF * NV * LANES < vend) \
            for (int c = 0; c < NV; c++) \
                _mm_prefetch((const char *)(vj + (ATT_PF * NV + c) * LANES), _MM_HINT_T0); \
        __m512 vv[NV]; \
        for (int c = 0; c < NV; c++) vv[c] = _mm512_loadu_ps(vj + c * LANES); \
        for (int h = 0; h < P; h++) { \
            __m512 e = _mm512_set1_ps(sc[h][j]); \
            for (int c = 0; c < NV; c++) ov[h][c] = _mm512_fmadd_ps(e, vv[c], ov[h][c]); \
        } \
    } \
    for (int64_t j = nmin > j0 ? nmin : j0; j < nmax; j++) { \
        const float *vj = kv_row(V, j); \
        __m512 vv[NV]; \
        for (int c = 0; c < NV; c++) vv[c] = _mm512_loadu_ps(vj + c * LANES); \
        for (int h = 0; h < P; h++) { \
            if (j >= nk[h]) continue; \
            __m512 e = _mm512_set1_ps(sc[h][j]); \
            for (int c = 0; c < NV; c++) ov[h][c] = _mm512_fmadd_ps(e, vv[c], ov[h][c]); \
        } \
    } \
    for (int h = 0; h < P; h++) \
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(o[h] + c * LANES, ov[h][c]); \
}

/* o / total, each of D elements: the one rounding after the numerator's chain. */
__attribute__((target("avx512f"))) static void values512_div(int64_t D, float total, float *o) {
    const __m512 tv = _mm512_set1_ps(total);
    for (int64_t d = 0; d < D; d += LANES)
        _mm512_storeu_ps(o + d, _mm512_div_ps(_mm512_loadu_ps(o + d), tv));
}

/* Any head size: the same chains, one pair at a time. */
__attribute__((target("avx512f"))) static void values512_any(
    int64_t D, const kv_rows *V, int64_t nk, const float *sc, float total, float *o) {
    const int64_t nv = D / LANES;
    for (int64_t c0 = 0; c0 < nv; c0 += 8) {
        const int64_t cn = nv - c0 < 8 ? nv - c0 : 8;
        __m512 ov[8];
        for (int64_t c = 0; c < cn; c++) ov[c] = _mm512_setzero_ps();
        for (int64_t j = 0, n; j < nk;)
        for (const float *vj = kv_span(V, j, nk, &n) + c0 * LANES, *vend = vj + n * D; vj < vend;
             vj += D, j++) {
            __m512 e = _mm512_set1_ps(sc[j]);
            for (int64_t c = 0; c < cn; c++)
                ov[c] = _mm512_fmadd_ps(e, _mm512_loadu_ps(vj + c * LANES), ov[c]);
        }
        __m512 tv = _mm512_set1_ps(total);
        for (int64_t c = 0; c < cn; c++)
            _mm512_storeu_ps(o + (c0 + c) * LANES, _mm512_div_ps(ov[c], tv));
    }
}

DEF_SCORES512_TAIL(0) DEF_SCORES512_TAIL(1) DEF_SCORES512_TAIL(2) DEF_SCORES512_TAIL(4)
DEF_SCORES512_TAIL(8)
DEF_SCORES512(0) DEF_SCORES512(1) DEF_SCORES512(2) DEF_SCORES512(4) DEF_SCORES512(8)
DEF_SCORES512Q(1) DEF_SCORES512Q(2) DEF_SCORES512Q(4) DEF_SCORES512Q(8)
DEF_VALUES512(1, 1) DEF_VALUES512(1, 2) DEF_VALUES512(1, 3) DEF_VALUES512(1, 4)
DEF_VALUES512(1, 5) DEF_VALUES512(1, 6) DEF_VALUES512(1, 7) DEF_VALUES512(1, 8)
DEF_VALUES512(2, 1) DEF_VALUES512(2, 2) DEF_VALUES512(2, 3) DEF_VALUES512(2, 4)
DEF_VALUES512(2, 5) DEF_VALUES512(2, 6) DEF_VALUES512(2, 7) DEF_VALUES512(2, 8)
DEF_VALUES512(4, 1) DEF_VALUES512(4, 2) DEF_VALUES512(4, 3) DEF_VALUES512(4, 4)
DEF_VALUES512(4, 5) DEF_VALUES512(4, 6)
DEF_VALUES512(8, 1) DEF_VALUES512(8, 2) DEF_VALUES512(8, 3)

typedef void (*scores_fn)(const attn_args *, const float *const *, const kv_rows *,
                          const int64_t *, int, float *const *, float *);
typedef void (*values_fn)(const kv_rows *, int64_t, int64_t, const int64_t *, float *const *,
                          float *const *);
static scores_fn scores512_for(int64_t nv) {
    switch (nv) {
    case 1: return scores512_1;
    case 2: return scores512_2;
    case 4: return scores512_4;
    case 8: return scores512_8;
    default: return scores512_0;
    }
}
/* scores512q_<nv>, or NULL where none is compiled (then the permute tree's). */
static scores_fn scores512q_for(int64_t nv) {
    switch (nv) {
    case 1: return scores512q_1;
    case 2: return scores512q_2;
    case 4: return scores512q_4;
    case 8: return scores512q_8;
    default: return NULL;
    }
}
/* values512_<nv>_<p>, or NULL where none is compiled (then values512_any). */
static values_fn values512_for(int64_t nv, int p) {
    static const values_fn V1[8] = {values512_1_1, values512_1_2, values512_1_3, values512_1_4,
                                    values512_1_5, values512_1_6, values512_1_7, values512_1_8};
    static const values_fn V2[8] = {values512_2_1, values512_2_2, values512_2_3, values512_2_4,
                                    values512_2_5, values512_2_6, values512_2_7, values512_2_8};
    static const values_fn V4[6] = {values512_4_1, values512_4_2, values512_4_3,
                                    values512_4_4, values512_4_5, values512_4_6};
    static const values_fn V8[3] = {values512_8_1, values512_8_2, values512_8_3};
    if (p < 1) return NULL;
    switch (nv) {
    case 1: return p <= 8 ? V1[p - 1] : NULL;
    case 2: return p <= 8 ? V2[p - 1] : NULL;
    case 4: return p <= 6 ? V4[p - 1] : NULL;
    case 8: return p <= 3 ? V8[p - 1] : NULL;
    default: return NULL;
    }
}

/* Pairs one work item attends together on the AVX-512 path: up to 24 value
 * accumulators (of 32 registers). */
static int64_t pairs512(int64_t D) {
    int64_t nv = D / LANES, p = 24 / (nv ? nv : 1);
    if (values512_for(nv, 1) == NULL) return 1;
    while (p > 1 && values512_for(nv, (int)p) == NULL) p--;
    return p < 1 ? 1 : (p > ATT_PMAX ? ATT_PMAX : p);
}
#endif

#if BIK_X86
/* AVX2 attention: the same per-element operations as attend_one_scalar, 8
 * lanes at a time. A 16-lane partial vector is two __m256 (lanes 0-7, 8-15):
 * each lane's FMA chain over d = lane, lane + 16, ... is unchanged, and the
 * halving tree is the AVX-512 tail's (lo + hi, then 4, 2, 1), so the bits
 * equal the scalar and AVX-512 paths'. What changes is only the schedule: the
 * pairs of a work item (the heads of one KV head, consecutive rows) share each
 * load of K and V, and several keys' and pairs' chains are interleaved so FMA
 * latency no longer bounds the loops (before: one pair at a time, two
 * dependent chains per key, 20-40 % of the machine). */
__attribute__((target("avx2,fma"))) static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_C[7]);
    for (int i = 6; i >= 0; i--) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C[i]));
    __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* Halving tree of one key's 8 sums h[l] = lane l + lane l+8 (the tree's first
 * level, done when the two halves met): then 4, 2, 1 as tree16. */
__attribute__((target("avx2,fma"))) static inline float tree8(const float *h) {
    __m256 h8 = _mm256_loadu_ps(h);
    __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));
    __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));
    __m128 h1 = _mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1));
    return _mm_cvtss_f32(h1);
}

/* tree8 of 8 consecutive keys (h: 8 x 8 sums) at once, sums in key order:
 * the same adds with the same operands, but each level's adds for all keys in
 * a few full-width instructions (7 adds instead of 24 half-empty ones). Level
 * w=4 pairs the 128-bit halves of two keys, w=2 and w=1 pick lanes with
 * shuffles; the last level leaves keys 0 2 4 6 1 3 5 7, put back in order. */
__attribute__((target("avx2,fma"))) static inline __m256 tree8x8(const float *h) {
    __m256 b[4];
    for (int i = 0; i < 4; i++) {
        __m256 x = _mm256_loadu_ps(h + 16 * i), y = _mm256_loadu_ps(h + 16 * i + 8);
        b[i] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20),
                             _mm256_permute2f128_ps(x, y, 0x31));
    }
    __m256 c0 = _mm256_add_ps(_mm256_shuffle_ps(b[0], b[1], 0x44),
                              _mm256_shuffle_ps(b[0], b[1], 0xee));
    __m256 c1 = _mm256_add_ps(_mm256_shuffle_ps(b[2], b[3], 0x44),
                              _mm256_shuffle_ps(b[2], b[3], 0xee));
    __m256 e = _mm256_add_ps(_mm256_shuffle_ps(c0, c1, 0x88), _mm256_shuffle_ps(c0, c1, 0xdd));
    return _mm256_permutevar8x32_ps(e, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

#define ATT_KB 64   /* keys per block: 16 KiB of K or V (D = 64) stays in L1 */
#define ATT_PS 3    /* pairs of one score tile */
#define ATT_PV 6    /* pairs of one value tile */

/* Dot products of P pairs with J keys (j, j+1, ...): P x J independent FMA
 * chains per half instead of one pair's two, each key row loaded once for the
 * P pairs (3 x 3 accumulators, 3 keys and a query fit AVX2's 16 registers;
 * 3 x 2 and 2 x 4 tiles, or both halves at once, measured slower).
 * Each chain is one lane half's 8 partials over d = half*8 + l + 16c in c
 * order, as in attend_one_scalar; the halves run one after the other and meet
 * as lo + hi (the tree's first level) in h[p] + (t + i) * 8. */
#define DEF_DOTS256(P, J) \
__attribute__((target("avx2,fma"))) static inline void dots256_##P##_##J( \
    const float *const *q, const kv_rows *K, int64_t D, int64_t j, float *const *h, int64_t t) { \
    __m256 acc[P][J]; \
    const float *kr[J]; \
    for (int i = 0; i < J; i++) kr[i] = kv_row(K, j + i); \
    for (int half = 0; half < 2; half++) { \
        for (int p = 0; p < P; p++) \
            for (int i = 0; i < J; i++) acc[p][i] = _mm256_setzero_ps(); \
        for (int64_t c = 8 * half; c < D; c += LANES) { \
            __m256 kv[J]; \
            for (int i = 0; i < J; i++) kv[i] = _mm256_loadu_ps(kr[i] + c); \
            for (int p = 0; p < P; p++) { \
                __m256 qv = _mm256_loadu_ps(q[p] + c); \
                for (int i = 0; i < J; i++) acc[p][i] = _mm256_fmadd_ps(qv, kv[i], acc[p][i]); \
            } \
        } \
        for (int p = 0; p < P; p++) \
            for (int i = 0; i < J; i++) { \
                float *dst = h[p] + (t + i) * 8; \
                _mm256_storeu_ps(dst, half ? _mm256_add_ps(_mm256_loadu_ps(dst), acc[p][i]) \
                                           : acc[p][i]); \
            } \
    } \
}
DEF_DOTS256(1, 1) DEF_DOTS256(2, 1) DEF_DOTS256(3, 1)
DEF_DOTS256(1, 3) DEF_DOTS256(2, 3) DEF_DOTS256(3, 3)

/* Keys [j0, j1) of P pairs (P <= ATT_PS), 3 at a time, then one at a time. */
__attribute__((target("avx2,fma"))) static void dots256(
    int P, const float *const *q, const kv_rows *K, int64_t D, int64_t j0, int64_t j1,
    float *const *h, int64_t kb) {
    int64_t j = j0;
    for (; j + 3 <= j1; j += 3) {
        if (P == 3) dots256_3_3(q, K, D, j, h, j - kb);
        else if (P == 2) dots256_2_3(q, K, D, j, h, j - kb);
        else dots256_1_3(q, K, D, j, h, j - kb);
    }
    for (; j < j1; j++) {
        if (P == 3) dots256_3_1(q, K, D, j, h, j - kb);
        else if (P == 2) dots256_2_1(q, K, D, j, h, j - kb);
        else dots256_1_1(q, K, D, j, h, j - kb);
    }
}

/* Scores of np pairs that read the same keys (rows of one sequence with the
 * same first key, heads of one KV head), each exactly what attend_one_scalar
 * computes: per key the 16 lane partials, the halving tree, times scale. Key
 * blocks run outermost so a block of K is read from L2/L3 once and from L1 by
 * every tile of pairs. The maximum is taken lane-wise with the scalar loop's
 * rule (a score replaces the running maximum only when greater), so it is the
 * same value (a zero's sign aside, which exp(s - max) does not see). */
__attribute__((target("avx2,fma"))) static void scores256(
    const attn_args *a, const float *const *q, const kv_rows *K, const int64_t *nk, int np,
    float *const *sc, float *mx) {
    const int64_t D = a->D;
    const __m256 scale = _mm256_set1_ps(a->scale);
    float hbuf[ATT_PS][ATT_KB * 8];
    __m256 mxv[ATT_NPMAX];
    float mxs[ATT_NPMAX];
    int64_t nkmax = 0;
    for (int p = 0; p < np; p++) {
        mxv[p] = _mm256_set1_ps(-INFINITY);
        mxs[p] = -INFINITY;
        if (nk[p] > nkmax) nkmax = nk[p];
    }
    for (int64_t kb = 0; kb < nkmax; kb += ATT_KB)
        for (int p0 = 0; p0 < np; p0 += ATT_PS) {
            const int P = np - p0 < ATT_PS ? np - p0 : ATT_PS;
            float *h[ATT_PS];
            int64_t end[ATT_PS], joint = kb + ATT_KB;
            for (int p = 0; p < P; p++) {
                h[p] = hbuf[p];
                end[p] = nk[p0 + p] < kb + ATT_KB ? nk[p0 + p] : kb + ATT_KB;
                if (end[p] < joint) joint = end[p];
            }
            if (joint < kb) joint = kb;
            /* Keys every pair of the tile has together, then each pair's own. */
            dots256(P, q + p0, K, D, kb, joint, h, kb);
            for (int p = 0; p < P; p++)
                if (end[p] > joint) dots256(1, q + p0 + p, K, D, joint, end[p], h + p, kb);
            for (int p = 0; p < P; p++) {
                const int64_t n = end[p] - kb;
                float *s = sc[p0 + p] + kb;
                int64_t t = 0;
                for (; t + 8 <= n; t += 8) {
                    __m256 v = _mm256_mul_ps(tree8x8(h[p] + t * 8), scale);
                    _mm256_storeu_ps(s + t, v);
                    mxv[p0 + p] = _mm256_max_ps(v, mxv[p0 + p]);
                }
                for (; t < n; t++) {
                    float v = tree8(h[p] + t * 8) * a->scale;
                    s[t] = v;
                    if (v > mxs[p0 + p]) mxs[p0 + p] = v;
                }
            }
        }
    for (int p = 0; p < np; p++) {
        float lanes[8], m = mxs[p];
        _mm256_storeu_ps(lanes, mxv[p]);
        for (int l = 0; l < 8; l++)
            if (lanes[l] > m) m = lanes[l];
        mx[p] = m;
    }
}

/* Softmax weights exp(s - max) in place and their sum (16 lane partials over
 * the key index as two vectors, then the halving tree). */
__attribute__((target("avx2,fma"))) static float expsum256(float *sc, int64_t nk, float mx) {
    const __m256 mxv = _mm256_set1_ps(mx);
    __m256 dlo = _mm256_setzero_ps(), dhi = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + LANES <= nk; j += LANES) {
        __m256 el = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + j), mxv));
        __m256 eh = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + j + 8), mxv));
        _mm256_storeu_ps(sc + j, el);
        _mm256_storeu_ps(sc + j + 8, eh);
        dlo = _mm256_add_ps(dlo, el);
        dhi = _mm256_add_ps(dhi, eh);
    }
    float part[LANES];
    _mm256_storeu_ps(part, dlo);
    _mm256_storeu_ps(part + 8, dhi);
    for (int64_t l = 0; j < nk; j++, l++) {
        sc[j] = exp_scalar(sc[j] - mx);
        part[l] = part[l] + sc[j];
    }
    return tree16(part);
}

/* Weighted values of P pairs (P <= ATT_PV) for the 16 output elements at c,
 * keys [j0, j1): each element's FMA chain goes on from the running sum parked
 * in o (exact: a float stored and loaded back is the same float), key by key
 * in order. 2P independent chains, each value row loaded once for all P. */
#define DEF_VALUES256(P) \
__attribute__((target("avx2,fma"))) static void values256_##P( \
    const kv_rows *V, int64_t D, int64_t c, int64_t j0, int64_t j1, float *const *sc, \
    float *const *o) { \
    __m256 lo[P], hi[P]; \
    for (int p = 0; p < P; p++) { \
        lo[p] = _mm256_loadu_ps(o[p] + c); \
        hi[p] = _mm256_loadu_ps(o[p] + c + 8); \
    } \
    for (int64_t j = j0, n; j < j1;) \
    for (const float *vj = kv_span(V, j, j1, &n) + c, *vend = vj + n * D; vj < vend; \
         vj += D, j++) { \
        const __m256 vl = _mm256_loadu_ps(vj), vh = _mm256_loadu_ps(vj + 8); \
        for (int p = 0; p < P; p++) { \
            const __m256 e = _mm256_set1_ps(sc[p][j]); \
            lo[p] = _mm256_fmadd_ps(e, vl, lo[p]); \
            hi[p] = _mm256_fmadd_ps(e, vh, hi[p]); \
        } \
    } \
    for (int p = 0; p < P; p++) { \
        _mm256_storeu_ps(o[p] + c, lo[p]); \
        _mm256_storeu_ps(o[p] + c + 8, hi[p]); \
    } \
}
DEF_VALUES256(1) DEF_VALUES256(2) DEF_VALUES256(3)
DEF_VALUES256(4) DEF_VALUES256(5) DEF_VALUES256(6)

typedef void (*values256_fn)(const kv_rows *, int64_t, int64_t, int64_t, int64_t, float *const *,
                             float *const *);
static const values256_fn VALUES256[ATT_PV] = {values256_1, values256_2, values256_3,
                                               values256_4, values256_5, values256_6};

/* The numerators of np pairs over the same V, by key blocks (a block of V is
 * read from L2/L3 once and from L1 by every tile and 16-element slice), then
 * the division by each pair's denominator. */
__attribute__((target("avx2,fma"))) static void values256(
    int64_t D, const kv_rows *V, const int64_t *nk, int np, float *const *sc,
    const float *total, float *const *o) {
    int64_t nkmax = 0;
    for (int p = 0; p < np; p++) {
        memset(o[p], 0, sizeof(float) * (size_t)D);
        if (nk[p] > nkmax) nkmax = nk[p];
    }
    for (int64_t kb = 0; kb < nkmax; kb += ATT_KB)
        for (int p0 = 0; p0 < np; p0 += ATT_PV) {
            const int P = np - p0 < ATT_PV ? np - p0 : ATT_PV;
            int64_t end[ATT_PV], joint = kb + ATT_KB;
            for (int p = 0; p < P; p++) {
                end[p] = nk[p0 + p] < kb + ATT_KB ? nk[p0 + p] : kb + ATT_KB;
                if (end[p] < joint) joint = end[p];
            }
            if (joint < kb) joint = kb;
            for (int64_t c = 0; c < D; c += LANES) {
                if (joint > kb) VALUES256[P - 1](V, D, c, kb, joint, sc + p0, o + p0);
                for (int p = 0; p < P; p++)
                    if (end[p] > joint) values256_1(V, D, c, joint, end[p], sc + p0 + p, o + p0 + p);
            }
        }
    for (int p = 0; p < np; p++) {
        const __m256 tv = _mm256_set1_ps(total[p]);
        for (int64_t d = 0; d < D; d += 8)
            _mm256_storeu_ps(o[p] + d, _mm256_div_ps(_mm256_loadu_ps(o[p] + d), tv));
    }
}

/* SwiGLU and RMSNorm on AVX2: the AVX-512 tasks' operations, 8 lanes at a time
 * (RMSNorm's 16 lane partials as two vectors). */
__attribute__((target("avx2,fma"))) static void silu_task256(void *ctx, int64_t m0, int64_t m1,
                                                             int tid) {
    (void)tid;
    const silu_args *a = (const silu_args *)ctx;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t m = m0; m < m1; m++) {
        const float *g = a->gu + m * a->ldg, *u = g + a->I;
        float *o = a->out + m * a->ldo;
        int64_t i = 0;
        for (; i + 8 <= a->I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 t = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            __m256 sv = _mm256_div_ps(gv, _mm256_add_ps(one, t));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(sv, _mm256_loadu_ps(u + i)));
        }
        for (; i < a->I; i++) {
            float t = exp_scalar(-g[i]);
            o[i] = g[i] / (1.0f + t) * u[i];
        }
    }
}

__attribute__((target("avx2,fma"))) static void norm_task256(void *ctx, int64_t m0, int64_t m1,
                                                             int tid) {
    (void)tid;
    const norm_args *a = (const norm_args *)ctx;
    for (int64_t m = m0; m < m1; m++) {
        const float *x = norm_row(a, m);
        __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + LANES <= a->N; i += LANES) {
            __m256 vl = _mm256_loadu_ps(x + i), vh = _mm256_loadu_ps(x + i + 8);
            lo = _mm256_fmadd_ps(vl, vl, lo);
            hi = _mm256_fmadd_ps(vh, vh, hi);
        }
        float part[LANES];
        _mm256_storeu_ps(part, lo);
        _mm256_storeu_ps(part + 8, hi);
        for (int64_t j = 0; i < a->N; i++, j++) part[j] = fmaf(x[i], x[i], part[j]);
        float mean = tree16(part) / (float)a->N;
        float inv = 1.0f / sqrtf(mean + a->eps);
        float *o = a->out + m * a->ldo;
        __m256 iv = _mm256_set1_ps(inv);
        for (i = 0; i + 8 <= a->N; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(a->w + i),
                                                  _mm256_mul_ps(_mm256_loadu_ps(x + i), iv)));
        for (; i < a->N; i++) o[i] = a->w[i] * (x[i] * inv);
    }
}

#endif

/* The first key a query at position p attends to. */
static inline int64_t first_key(const attn_args *a, int64_t p) {
    return a->window && p - a->window + 1 > 0 ? p - a->window + 1 : 0;
}

/* A work item: rows_per_item consecutive query rows of one segment x the
 * heads of one pass of one KV head. */
static void attn_task(void *ctx, int64_t i0, int64_t i1, int tid) {
    const attn_args *a = (const attn_args *)ctx;
    const int64_t D = a->D, group = a->H / a->Hkv, hp = a->heads_per_pass;
    const int64_t rb = a->rows_per_item;
    const int64_t passes = (group + hp - 1) / hp, per_block = a->Hkv * passes;
    float *scratch = a->scratch + (int64_t)tid * hp * rb * a->max_keys;
    int64_t s = find_seg(a, i0);
    for (int64_t it = i0; it < i1; it++) {
        while (it >= a->item0[s + 1]) s++;
        const int64_t *sg = a->seg + s * SEG_FIELDS;
        int64_t local = it - a->item0[s];
        int64_t blk = local / per_block, rem = local % per_block;
        int64_t kvh = rem / passes, h0 = kvh * group + (rem % passes) * hp;
        int64_t h1 = h0 + hp < (kvh + 1) * group ? h0 + hp : (kvh + 1) * group;
        int64_t r0 = blk * rb, r1 = r0 + rb < sg[1] ? r0 + rb : sg[1];
        const float *Kh = (const float *)(uintptr_t)sg[3] + kvh * sg[5];
        const float *Vh = (const float *)(uintptr_t)sg[4] + kvh * sg[5];
        /* Rows whose keys start at the same position share one pass over K
         * and V; a sliding window gives each row its own start. */
        for (int64_t ra = r0; ra < r1;) {
            int64_t lo = first_key(a, sg[2] + ra), rz = ra + 1;
            if (lo == 0)
                while (rz < r1 && first_key(a, sg[2] + rz) == 0) rz++;
            const int64_t *tab = (const int64_t *)(uintptr_t)sg[6];
            const int64_t shift = sg[7], mask = ((int64_t)1 << shift) - 1;
            const kv_rows Kr = {Kh, tab, lo, shift, mask, D}, Vr = {Vh, tab, lo, shift, mask, D};
            const kv_rows *K = &Kr, *V = &Vr;
            const float *qs[ATT_NPMAX];
            float *outs[ATT_NPMAX], *scs[ATT_NPMAX], mx[ATT_NPMAX], totals[ATT_NPMAX];
            int64_t nks[ATT_NPMAX];
            int np = 0;
            for (int64_t r = ra; r < rz; r++)
                for (int64_t h = h0; h < h1; h++, np++) {
                    qs[np] = a->q + (sg[0] + r) * a->ldq + h * D;
                    outs[np] = a->out + (sg[0] + r) * a->ldo + h * D;
                    scs[np] = scratch + np * a->max_keys;
                    nks[np] = sg[2] + r - lo + 1;
                }
            ra = rz;
#if BIK_X86
            if (g_isa == ISA_AVX512 && D % LANES == 0 && D <= 256) {
                scores_fn scores = np >= ATT_QUAD_MIN ? scores512q_for(D / LANES) : NULL;
                (scores ? scores : scores512_for(D / LANES))(a, qs, K, nks, np, scs, mx);
                for (int i = 0; i < np; i++) totals[i] = expsum512(scs[i], nks[i], mx[i]);
                const int pv = (int)a->pairs_per_values;
                int64_t nkmax = 0;
                for (int i = 0; i < np; i++)
                    if (nks[i] > nkmax) nkmax = nks[i];
                if (values512_for(D / LANES, pv < np ? pv : np)) {
                    /* Key blocks outermost: a block of V is read from L3 once
                     * and from L1 by every group of pairs. */
                    const int64_t vb = ATT_VB_BYTES / (D * 4) > 16 ? ATT_VB_BYTES / (D * 4) : 16;
                    for (int64_t kb = 0; kb < nkmax; kb += vb) {
                        const int64_t ke = kb + vb < nkmax ? kb + vb : nkmax;
                        for (int i = 0; i < np; i += pv) {
                            const int n = np - i < pv ? np - i : pv;
                            values512_for(D / LANES, n)(V, kb, ke, nks + i, scs + i, outs + i);
                        }
                    }
                    for (int i = 0; i < np; i++) values512_div(D, totals[i], outs[i]);
                } else {
                    for (int j = 0; j < np; j++)
                        values512_any(D, V, nks[j], scs[j], totals[j], outs[j]);
                }
                continue;
            }
            if (g_isa == ISA_AVX2 && D % LANES == 0) {
                scores256(a, qs, K, nks, np, scs, mx);
                for (int i = 0; i < np; i++) totals[i] = expsum256(scs[i], nks[i], mx[i]);
                values256(D, V, nks, np, scs, totals, outs);
                continue;
            }
#endif
            for (int i = 0; i < np; i++) attend_one_scalar(a, qs[i], K, V, nks[i], scs[i], outs[i]);
        }
    }
}

/* -------------------------------------------------------------- rope */
/* Rotary embedding, half-split ("rotate_half", HF Llama): per row m and head,
 * out[i] = x[i]*c - x[i+D/2]*s, out[i+D/2] = x[i+D/2]*c + x[i]*s with c, s the
 * tables' row at positions[m]: two products, each rounded, then one add: the
 * operations torch's element-wise version performs (no fusion: the build
 * passes -ffp-contract=off), so the bits are torch's. */
typedef struct {
    const float *x;
    int64_t ldx, H, D;        /* row m, head h at x + m*ldx + h*D */
    const int64_t *pos;
    const float *cos, *sin;   /* [P, D/2] */
    float *out;               /* [M, H, D] contiguous */
} rope_args;

static void rope_task(void *ctx, int64_t m0, int64_t m1, int tid) {
    (void)tid;
    const rope_args *a = (const rope_args *)ctx;
    const int64_t half = a->D / 2;
    for (int64_t m = m0; m < m1; m++) {
        const float *c = a->cos + a->pos[m] * half, *sn = a->sin + a->pos[m] * half;
        for (int64_t h = 0; h < a->H; h++) {
            const float *x1 = a->x + m * a->ldx + h * a->D, *x2 = x1 + half;
            float *o1 = a->out + (m * a->H + h) * a->D, *o2 = o1 + half;
            for (int64_t i = 0; i < half; i++) {
                float p = x1[i] * c[i], q = x2[i] * sn[i];
                float r = x2[i] * c[i], t = x1[i] * sn[i];
                o1[i] = p - q;
                o2[i] = r + t;
            }
        }
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
    gemm_plan(&a, g_threads, g_isa);
    int64_t items = (a.np + a.cp - 1) / a.cp * a.nmb;
    /* ~64k multiply-adds per item at least, so tiny GEMMs stay on one thread. */
    int64_t per = (a.M < a.mc ? a.M : a.mc) * K * a.cp * LANES;
    int64_t grain = per > 0 ? (1 << 16) / per + 1 : items;
    Py_BEGIN_ALLOW_THREADS
    parallel_run(gemm_task, &a, items, grain);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* rmsnorm and add_rmsnorm: one task per ISA, the add fused in front when d is set. */
static PyObject *run_norm(norm_args a, int64_t M) {
    if (M < 0 || a.N < 1) {
        PyErr_SetString(PyExc_ValueError, "rmsnorm: bad shape");
        return NULL;
    }
    task_fn fn = norm_task;
#if BIK_X86
    if (g_isa == ISA_AVX512) fn = norm_task512;
    else if (g_isa == ISA_AVX2) fn = norm_task256;
#endif
    Py_BEGIN_ALLOW_THREADS
    parallel_run(fn, &a, M, 64);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_rmsnorm(PyObject *self, PyObject *args) {
    norm_args a = {0};
    unsigned long long x, w, out;
    long long ldx, M, N, ldo;
    float eps;
    if (!PyArg_ParseTuple(args, "KLLLKfKL", &x, &ldx, &M, &N, &w, &eps, &out, &ldo))
        return NULL;
    a.x = ptr(x); a.ldx = ldx; a.N = N; a.w = ptr(w); a.eps = eps; a.out = ptr(out);
    a.ldo = ldo;
    return run_norm(a, M);
}

static PyObject *py_add_rmsnorm(PyObject *self, PyObject *args) {
    norm_args a = {0};
    unsigned long long x, d, sum, w, out;
    long long ldx, ldd, lds, M, N, ldo;
    float eps;
    if (!PyArg_ParseTuple(args, "KLKLKLLLKfKL", &x, &ldx, &d, &ldd, &sum, &lds, &M, &N, &w,
                          &eps, &out, &ldo))
        return NULL;
    a.x = ptr(x); a.ldx = ldx; a.d = ptr(d); a.ldd = ldd; a.sum = ptr(sum); a.lds = lds;
    a.N = N; a.w = ptr(w); a.eps = eps; a.out = ptr(out); a.ldo = ldo;
    return run_norm(a, M);
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
    else if (g_isa == ISA_AVX2) fn = silu_task256;
#endif
    int64_t grain = I > 0 ? 8192 / I + 1 : 1;
    Py_BEGIN_ALLOW_THREADS
    parallel_run(fn, &a, M, grain);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* attend: segments of 6 fields over contiguous mirrors; attend_paged: of
 * SEG_FIELDS, each with its block table (or 0) and log2 of rows per block. */
static PyObject *attend_call(PyObject *args, int fields) {
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
    int64_t *segs = malloc(sizeof(int64_t) * (size_t)(nseg * SEG_FIELDS));
    if (!segs) return PyErr_NoMemory();
    const int64_t *given = ptr(seg);
    for (int64_t i = 0; i < nseg; i++) {
        int64_t *d = segs + i * SEG_FIELDS;
        const int64_t *g = given + i * fields;
        for (int f = 0; f < SEG_FIELDS; f++) d[f] = f < fields ? g[f] : 0;
        if (d[6] && (d[7] < 0 || d[7] > 30)) {
            free(segs);
            PyErr_SetString(PyExc_ValueError, "attend: bad rows per block");
            return NULL;
        }
    }
    a.q = ptr(q); a.ldq = ldq; a.H = H; a.Hkv = Hkv; a.D = D; a.seg = segs;
    a.nseg = nseg; a.window = window; a.scale = scale; a.out = ptr(out); a.ldo = ldo;
    a.max_keys = max_keys;
    /* Pairs (row, head) attended together: as many as the value sums keep in
     * registers, the heads of one KV head first, then more rows. */
#if BIK_X86
    int64_t pmax = pairs512(D);
#else
    int64_t pmax = 4;
#endif
    int64_t group = H / Hkv;
    a.heads_per_pass = group < pmax ? group : pmax;
    /* Scores for twice that many pairs share each 16-key block of K (then two
     * groups over V): 1.1x over one group, measured; AVX-512 grows it below. */
    a.rows_per_item = 2 * pmax / a.heads_per_pass;
    if (a.rows_per_item * a.heads_per_pass > ATT_NPMAX) a.rows_per_item = ATT_NPMAX / a.heads_per_pass;
    if (a.rows_per_item < 1) a.rows_per_item = 1;
    a.pairs_per_values = pmax;
    int64_t per_block = Hkv * ((group + a.heads_per_pass - 1) / a.heads_per_pass);
#if BIK_X86
    if (g_isa == ISA_AVX512) {
        /* Every item streams its KV head's K and V from L3 once (past ~1k keys
         * neither fits a 2 MB L2), so fewer, larger items read less: up to
         * ATT_NPMAX pairs, 1.2-1.3x over 12 on an Intel Xeon at 5.5k keys
         * (measured; the AVX2 path did not move), as long as every thread
         * still gets two items and a thread's scores stay within ATT_SCRATCH. */
        int64_t maxrows = 1;
        for (int64_t i = 0; i < nseg; i++)
            if (segs[i * SEG_FIELDS + 1] > maxrows) maxrows = segs[i * SEG_FIELDS + 1];
        const int64_t blocks = (2 * (int64_t)g_threads + per_block - 1) / per_block;
        int64_t rb = (maxrows + blocks - 1) / blocks;
        if (rb > ATT_NPMAX / a.heads_per_pass) rb = ATT_NPMAX / a.heads_per_pass;
        const int64_t fit = ATT_SCRATCH / (4 * max_keys * a.heads_per_pass);
        if (rb > fit) rb = fit;
        if (rb > a.rows_per_item) a.rows_per_item = rb;
    }
#endif
    int64_t *item0 = malloc(sizeof(int64_t) * (size_t)(nseg + 1));
    a.scratch = malloc(sizeof(float) *
                       (size_t)(max_keys * a.heads_per_pass * a.rows_per_item * g_threads));
    if (!a.scratch || !item0) {
        free(a.scratch);
        free(item0);
        free(segs);
        return PyErr_NoMemory();
    }
    item0[0] = 0;
    for (int64_t i = 0; i < nseg; i++) {
        int64_t rows = a.seg[i * SEG_FIELDS + 1];
        item0[i + 1] = item0[i] + (rows + a.rows_per_item - 1) / a.rows_per_item * per_block;
    }
    a.item0 = item0;
    /* A second thread for as few as two items once one row of an item is
     * 2^18 multiply-adds or more (far above the cost of a hand-off): one decode
     * row over a long context is three items (one per KV head), which a grain
     * of 2 left to one thread. */
    const int64_t grain = a.heads_per_pass * max_keys * D >= (1 << 18) ? 1 : 2;
    Py_BEGIN_ALLOW_THREADS
    parallel_run(attn_task, &a, item0[nseg], grain);
    Py_END_ALLOW_THREADS
    free(a.scratch);
    free(item0);
    free(segs);
    Py_RETURN_NONE;
}

static PyObject *py_attend(PyObject *self, PyObject *args) { return attend_call(args, 6); }

static PyObject *py_attend_paged(PyObject *self, PyObject *args) {
    return attend_call(args, SEG_FIELDS);
}

static PyObject *py_rope(PyObject *self, PyObject *args) {
    rope_args a;
    unsigned long long x, pos, c, sn, out;
    long long ldx, M, H, D;
    if (!PyArg_ParseTuple(args, "KLLLLKKKK", &x, &ldx, &M, &H, &D, &pos, &c, &sn, &out))
        return NULL;
    if (M < 0 || H < 1 || D < 2 || D % 2 || ldx < H * D) {
        PyErr_SetString(PyExc_ValueError, "rope: bad shape");
        return NULL;
    }
    a.x = ptr(x); a.ldx = ldx; a.H = H; a.D = D; a.pos = ptr(pos); a.cos = ptr(c);
    a.sin = ptr(sn); a.out = ptr(out);
    int64_t grain = H * D > 0 ? 16384 / (H * D) + 1 : 1;
    Py_BEGIN_ALLOW_THREADS
    parallel_run(rope_task, &a, M, grain);
    Py_END_ALLOW_THREADS
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

static PyObject *py_threads(PyObject *self, PyObject *noargs) {
    return PyLong_FromLong(g_threads);
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
    {"add_rmsnorm", py_add_rmsnorm, METH_VARARGS,
     "add_rmsnorm(x, ldx, d, ldd, sum, lds, M, N, w, eps, out, ldo): sum = x + d, "
     "out = rmsnorm(sum)"},
    {"silu_mul", py_silu_mul, METH_VARARGS, "silu_mul(gu, ldg, M, I, out, ldo)"},
    {"rope", py_rope, METH_VARARGS, "rope(x, ldx, M, H, D, positions, cos, sin, out)"},
    {"attend", py_attend, METH_VARARGS,
     "attend(q, ldq, H, Hkv, D, seg, nseg, window, scale, out, ldo, "
     "max_keys)"},
    {"attend_paged", py_attend_paged, METH_VARARGS,
     "attend_paged(q, ldq, H, Hkv, D, seg, nseg, window, scale, out, ldo, max_keys): "
     "segments of 8 fields, keys read through each one's block table"},
    {"set_threads", py_set_threads, METH_VARARGS, "set_threads(n): threads per call"},
    {"threads", py_threads, METH_NOARGS, "threads per call"},
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
