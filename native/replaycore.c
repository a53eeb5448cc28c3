/* Trace replay core: studies.sim.SimWarehouse's single-tier accounting with
 * the lru, fifo, prefix_lru, s3fifo, belady, hit_density and session_density policies and
 * per-class TTL expiry,
 * over interned uint32 block ids. Every step mirrors the Python code in
 * studies/sim.py and kvstore/eviction/ operation for operation (including
 * tie-breaks, stale-entry rules and the order victims are removed), so hit
 * counts are bit-identical; tests/kvstore/test_replay_native.py checks that.
 *
 * Plain C11, no intrinsics. Every index read from a caller's buffer is
 * bounds-checked before the replay starts. hit_density's floating point is
 * the Python policy's float64 operations in the same order (no pairwise
 * sums, libm's log as math.log); -std=c11 keeps GCC from contracting a*b+c
 * into an FMA (ISO modes default to -ffp-contract=off).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NIL (-1)
#define NEVER INT64_MAX              /* Belady: "never used again" (math.inf) */
#define DEPTH_SLOTS (1LL << 20)      /* studies.sim._DEPTH_SLOTS */

enum { P_LRU = 0, P_PREFIX_LRU = 1, P_S3FIFO = 2, P_BELADY = 3, P_FIFO = 4, P_HIT_DENSITY = 5,
       P_SESSION_DENSITY = 6, P_COUNT = 7 };
enum { T_NONE = 0, T_SMALL = 1, T_MAIN = 2, T_GHOST = 3 };

/* ---------------------------------------------------------------- lists */

/* Intrusive doubly-linked lists over key indices; several lists may share
 * one prev/next pair when a key is in at most one of them at a time. */
typedef struct {
    int32_t head, tail;
    int64_t len;
} List;

static void l_init(List *l) { l->head = l->tail = NIL; l->len = 0; }

static void l_append(List *l, int32_t *prev, int32_t *next, int32_t k) {
    prev[k] = l->tail;
    next[k] = NIL;
    if (l->tail != NIL) next[l->tail] = k; else l->head = k;
    l->tail = k;
    l->len++;
}

static void l_unlink(List *l, int32_t *prev, int32_t *next, int32_t k) {
    if (prev[k] != NIL) next[prev[k]] = next[k]; else l->head = next[k];
    if (next[k] != NIL) prev[next[k]] = prev[k]; else l->tail = prev[k];
    prev[k] = next[k] = NIL;
    l->len--;
}

/* ---------------------------------------------------------------- Belady heap */

typedef struct {
    int64_t t;       /* next use (NEVER = inf) */
    uint64_t seq;    /* push order: ties go to the earliest push, as heapq's tuples */
    int32_t key;
} HEnt;

/* "a before b" = a is nearer the top: larger t, then smaller seq. */
static int h_before(const HEnt *a, const HEnt *b) {
    return a->t > b->t || (a->t == b->t && a->seq < b->seq);
}

static void h_sift_up(HEnt *h, int64_t i) {
    HEnt e = h[i];
    while (i > 0) {
        int64_t p = (i - 1) / 2;
        if (!h_before(&e, &h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = e;
}

static void h_sift_down(HEnt *h, int64_t n, int64_t i) {
    HEnt e = h[i];
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && h_before(&h[c + 1], &h[c])) c++;
        if (!h_before(&h[c], &e)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = e;
}

/* ---------------------------------------------------------------- hit_density types */

#define HD_BINS 40          /* hit_density._BINS */
#define HD_MAX_USES 4       /* hit_density._MAX_USES */

/* RecencyStacks (kvstore/eviction/prefix_lru.py): groups of keys pushed at one
 * instant, oldest first; a group's entries are popped last-pushed first. Each
 * group has a serial unique across all stacks, and a key's entry is live iff
 * at[key] is its group's serial (a key is in at most one stack), which is the
 * Python rule "its stack's _at[key] is the group's instant". */
typedef struct {
    double *g_t;
    int64_t *g_start, *g_end, *g_id;
    int64_t g_front, g_count, g_cap;
    int32_t *ent;
    int64_t ent_len, ent_cap;
} RStack;

typedef struct {            /* hit_density._Bucket */
    double reuses[HD_BINS], density[HD_BINS], starts;
    RStack lru;
} HBucket;

typedef struct {            /* heapq entry (-depth, seq, key) of a session's stack */
    int64_t nd;
    uint64_t seq;
    int32_t key;
} SEnt;

typedef struct {            /* session_density._Session */
    double last;
    int64_t holding;        /* _holding[s], 0 = not in it */
    uint64_t rank;          /* _holding's insertion order: serial of its last 0 -> 1 */
    int32_t grp;            /* its (class, turn bucket) group, -1 = none yet */
    int64_t gpos;           /* its live entry in that group, -1 = none */
    SEnt *heap;
    int64_t heap_len, heap_cap;
    int16_t bucket;         /* -1 = None */
    uint8_t exists, cls, turns;   /* turns capped at 9: only _turn_bucket(turns) is read */
} Sess;

/* The sessions holding blocks, per (class, turn bucket) group, in order of last
 * request: a session gains blocks only while it is the one being served (its
 * last is the newest), so appends keep the order; dead entries are skipped. */
typedef struct {
    double last;
    int32_t sid;
} GEnt;

typedef struct {
    GEnt *e;
    int64_t len, cap, front, live;
} Grp;

typedef struct {
    double *last;           /* _state: last use, uses so far (capped: only min(uses, 4) */
    uint8_t *uses, *has;    /* is ever read), class; has = key in _state */
    uint8_t *kcls;
    int16_t *where;         /* _where: resident key -> bucket, -1 = none */
    int32_t *gprev, *gnext; /* _ghost, oldest first */
    uint8_t *in_ghost;
    List ghost;
    int64_t n_where;
    HBucket *bk;            /* in creation order (the dict's iteration order) */
    int n_bk, n_cls, empty_cls;
    int16_t *bid;           /* (class, min(uses, 4)) -> bucket, -1 = not made yet */
    int64_t events, next_refresh, last_decay, refresh_every, half_life, serial;
    double ghost_factor, quantile, now, ln_factor, bin0;
    double edges[HD_BINS + 1], widths[HD_BINS];
    /* session_density: sessions by the trace's interned id */
    const uint32_t *req_sess;
    int64_t n_sess, n_known, n_holding, n_owned;
    Sess *ss;
    int32_t *known, *owner, *dep;
    Grp *grps;              /* by class * 5 + turn bucket */
    uint64_t hold_serial;
    int32_t current;
    int low_valid;
    int32_t low_sess;
    double low_score, min_starts;
    uint64_t seq;
} HD;

/* ---------------------------------------------------------------- state */

typedef struct {
    int policy;
    int64_t n_keys;
    int oom;
    /* lru / s3fifo lists */
    int32_t *prev, *next;
    uint8_t *tag;          /* s3fifo: which list the key is in */
    uint8_t *freq;         /* s3fifo: 2-bit reuse counter */
    List lru, small, mainq, ghost;
    int64_t small_bytes, main_bytes, block_bytes;
    double small_ratio;
    /* prefix_lru: groups of keys used at one instant, in one array of entries */
    int64_t *at;           /* key -> group serial of its last push, -1 = absent */
    int32_t *ent;
    int64_t ent_len, ent_cap;
    double *g_t;
    int64_t *g_start, *g_end;
    int64_t g_front, g_count, g_cap;
    /* belady */
    int64_t *nxt, *pending;
    uint8_t *has_pending, *in_next;
    int32_t *oprev, *onext; /* insertion order of the resident dict */
    List order;
    HEnt *heap;
    int64_t heap_len, heap_cap;
    uint64_t seq;
    /* hit_density (kvstore/eviction/hit_density.py); at[] holds a key's group serial */
    HD hd;
} Policy;

static void *xcalloc(size_t n, size_t sz) { return calloc(n ? n : 1, sz); }

static int pol_init(Policy *p, int policy, int64_t n_keys, int64_t block_bytes,
                    int64_t n_groups, const HD *hd_cfg) {
    memset(p, 0, sizeof(*p));
    p->policy = policy;
    p->n_keys = n_keys;
    p->block_bytes = block_bytes;
    p->small_ratio = 0.1;
    l_init(&p->lru); l_init(&p->small); l_init(&p->mainq); l_init(&p->ghost);
    l_init(&p->order);
    if (policy == P_LRU || policy == P_S3FIFO || policy == P_FIFO) {
        p->prev = malloc(sizeof(int32_t) * (size_t)(n_keys ? n_keys : 1));
        p->next = malloc(sizeof(int32_t) * (size_t)(n_keys ? n_keys : 1));
        p->tag = xcalloc((size_t)n_keys, 1);
        p->freq = xcalloc((size_t)n_keys, 1);
        if (!p->prev || !p->next || !p->tag || !p->freq) return -1;
    } else if (policy == P_PREFIX_LRU) {
        p->at = malloc(sizeof(int64_t) * (size_t)(n_keys ? n_keys : 1));
        p->g_cap = n_groups + 1;
        p->g_t = malloc(sizeof(double) * (size_t)p->g_cap);
        p->g_start = malloc(sizeof(int64_t) * (size_t)p->g_cap);
        p->g_end = malloc(sizeof(int64_t) * (size_t)p->g_cap);
        p->ent_cap = 1024;
        p->ent = malloc(sizeof(int32_t) * (size_t)p->ent_cap);
        if (!p->at || !p->g_t || !p->g_start || !p->g_end || !p->ent) return -1;
        for (int64_t k = 0; k < n_keys; k++) p->at[k] = -1;
    } else if (policy == P_SESSION_DENSITY) {
        HD *h = &p->hd;
        *h = *hd_cfg;
        h->ss = xcalloc((size_t)h->n_sess, sizeof(Sess));
        h->known = malloc(sizeof(int32_t) * (size_t)(h->n_sess ? h->n_sess : 1));
        h->owner = malloc(sizeof(int32_t) * (size_t)(n_keys ? n_keys : 1));
        h->dep = xcalloc((size_t)n_keys, sizeof(int32_t));
        h->bk = xcalloc((size_t)h->n_cls * (HD_MAX_USES + 1), sizeof(HBucket));
        h->bid = malloc(sizeof(int16_t) * (size_t)h->n_cls * (HD_MAX_USES + 1));
        h->grps = xcalloc((size_t)h->n_cls * (HD_MAX_USES + 1), sizeof(Grp));
        if (!h->ss || !h->known || !h->owner || !h->dep || !h->bk || !h->bid || !h->grps)
            return -1;
        for (int64_t k = 0; k < n_keys; k++) h->owner[k] = -1;
        for (int i = 0; i < h->n_cls * (HD_MAX_USES + 1); i++) h->bid[i] = -1;
        for (int64_t i = 0; i < h->n_sess; i++) {
            h->ss[i].bucket = -1;
            h->ss[i].grp = -1;
            h->ss[i].gpos = -1;
        }
        h->current = -1;
    } else if (policy == P_HIT_DENSITY) {
        HD *h = &p->hd;
        *h = *hd_cfg;
        size_t n = (size_t)(n_keys ? n_keys : 1);
        p->at = malloc(sizeof(int64_t) * n);
        h->last = xcalloc(n, sizeof(double));
        h->uses = xcalloc(n, 1);
        h->has = xcalloc(n, 1);
        h->kcls = xcalloc(n, 1);
        h->where = malloc(sizeof(int16_t) * n);
        h->gprev = malloc(sizeof(int32_t) * n);
        h->gnext = malloc(sizeof(int32_t) * n);
        h->in_ghost = xcalloc(n, 1);
        h->bk = xcalloc((size_t)h->n_cls * (HD_MAX_USES + 1), sizeof(HBucket));
        h->bid = malloc(sizeof(int16_t) * (size_t)h->n_cls * (HD_MAX_USES + 1));
        if (!p->at || !h->last || !h->uses || !h->has || !h->kcls || !h->where || !h->gprev ||
            !h->gnext || !h->in_ghost || !h->bk || !h->bid) return -1;
        for (int64_t k = 0; k < n_keys; k++) { p->at[k] = -1; h->where[k] = -1; }
        for (int i = 0; i < h->n_cls * (HD_MAX_USES + 1); i++) h->bid[i] = -1;
        l_init(&h->ghost);
    } else {
        p->nxt = xcalloc((size_t)n_keys, sizeof(int64_t));
        p->pending = xcalloc((size_t)n_keys, sizeof(int64_t));
        p->has_pending = xcalloc((size_t)n_keys, 1);
        p->in_next = xcalloc((size_t)n_keys, 1);
        p->oprev = malloc(sizeof(int32_t) * (size_t)(n_keys ? n_keys : 1));
        p->onext = malloc(sizeof(int32_t) * (size_t)(n_keys ? n_keys : 1));
        p->heap_cap = 1024;
        p->heap = malloc(sizeof(HEnt) * (size_t)p->heap_cap);
        if (!p->nxt || !p->pending || !p->has_pending || !p->in_next || !p->oprev ||
            !p->onext || !p->heap) return -1;
    }
    return 0;
}

static void pol_free(Policy *p) {
    free(p->prev); free(p->next); free(p->tag); free(p->freq);
    free(p->at); free(p->ent); free(p->g_t); free(p->g_start); free(p->g_end);
    free(p->nxt); free(p->pending); free(p->has_pending); free(p->in_next);
    free(p->oprev); free(p->onext); free(p->heap);
    HD *h = &p->hd;
    for (int b = 0; b < h->n_bk; b++) {
        RStack *s = &h->bk[b].lru;
        free(s->g_t); free(s->g_start); free(s->g_end); free(s->g_id); free(s->ent);
    }
    free(h->last); free(h->uses); free(h->has); free(h->kcls); free(h->where);
    free(h->gprev); free(h->gnext); free(h->in_ghost); free(h->bk); free(h->bid);
    if (h->ss)
        for (int64_t i = 0; i < h->n_sess; i++) free(h->ss[i].heap);
    if (h->grps)
        for (int i = 0; i < h->n_cls * (HD_MAX_USES + 1); i++) free(h->grps[i].e);
    free(h->ss); free(h->known); free(h->owner); free(h->dep); free(h->grps);
}

/* prefix_lru: RecencyStacks.push */
static void plru_push(Policy *p, int32_t k, double now) {
    int64_t g;
    if (p->g_count > p->g_front && now <= p->g_t[p->g_count - 1]) {
        g = p->g_count - 1;   /* same instant, or a late one joins the newest group */
    } else {
        if (p->g_count >= p->g_cap) { p->oom = 1; return; }
        g = p->g_count++;
        p->g_t[g] = now;
        p->g_start[g] = p->g_end[g] = p->ent_len;
    }
    if (p->ent_len >= p->ent_cap) {
        /* Drop the consumed front before growing: live entries start at the front group. */
        int64_t lo = p->g_front < p->g_count ? p->g_start[p->g_front] : p->ent_len;
        if (lo > p->ent_cap / 2) {
            memmove(p->ent, p->ent + lo, sizeof(int32_t) * (size_t)(p->ent_len - lo));
            for (int64_t i = p->g_front; i < p->g_count; i++) {
                p->g_start[i] -= lo;
                p->g_end[i] -= lo;
            }
            p->ent_len -= lo;
        } else {
            int64_t cap = p->ent_cap * 2;
            int32_t *e = realloc(p->ent, sizeof(int32_t) * (size_t)cap);
            if (!e) { p->oom = 1; return; }
            p->ent = e;
            p->ent_cap = cap;
        }
    }
    p->at[k] = g;
    p->ent[p->ent_len++] = k;
    p->g_end[g] = p->ent_len;
}

static int32_t plru_head(Policy *p) {
    while (p->g_front < p->g_count) {
        int64_t g = p->g_front;
        while (p->g_end[g] > p->g_start[g]) {
            int32_t k = p->ent[p->g_end[g] - 1];
            if (p->at[k] == g) return k;
            p->g_end[g]--;                                   /* stale: pop */
            if (g == p->g_count - 1) p->ent_len = p->g_end[g];
        }
        p->g_front++;
    }
    return NIL;
}

/* s3fifo */
static void s3_remember(Policy *p, int32_t k) {
    if (p->tag[k] != T_GHOST) {
        l_append(&p->ghost, p->prev, p->next, k);
        p->tag[k] = T_GHOST;
    }
    int64_t limit = p->mainq.len > 1 ? p->mainq.len : 1;
    while (p->ghost.len > limit) {
        int32_t old = p->ghost.head;
        l_unlink(&p->ghost, p->prev, p->next, old);
        p->tag[old] = T_NONE;
    }
}

static int32_t s3_victim(Policy *p) {
    for (;;) {
        int64_t total = p->small_bytes + p->main_bytes;
        if (p->small.len &&
            ((double)p->small_bytes >= p->small_ratio * (double)total || !p->mainq.len)) {
            int32_t k = p->small.head;
            if (p->freq[k] == 0) return k;
            l_unlink(&p->small, p->prev, p->next, k);         /* reused on probation */
            p->small_bytes -= p->block_bytes;
            p->freq[k] = 0;
            l_append(&p->mainq, p->prev, p->next, k);
            p->tag[k] = T_MAIN;
            p->main_bytes += p->block_bytes;
            continue;
        }
        if (!p->mainq.len) return NIL;
        int32_t k = p->mainq.head;
        if (p->freq[k] == 0) return k;
        p->freq[k]--;
        l_unlink(&p->mainq, p->prev, p->next, k);
        l_append(&p->mainq, p->prev, p->next, k);
    }
}

/* belady */
static int bel_heap_push(Policy *p, int64_t t, int32_t k) {
    if (p->heap_len >= p->heap_cap) {
        int64_t cap = p->heap_cap * 2;
        HEnt *h = realloc(p->heap, sizeof(HEnt) * (size_t)cap);
        if (!h) { p->oom = 1; return -1; }
        p->heap = h;
        p->heap_cap = cap;
    }
    p->heap[p->heap_len].t = t;
    p->heap[p->heap_len].seq = p->seq++;
    p->heap[p->heap_len].key = k;
    h_sift_up(p->heap, p->heap_len);
    p->heap_len++;
    return 0;
}

static void bel_push(Policy *p, int32_t k) {
    int64_t t = p->has_pending[k] ? p->pending[k] : NEVER;
    p->has_pending[k] = 0;
    p->nxt[k] = t;
    if (!p->in_next[k]) {
        p->in_next[k] = 1;
        l_append(&p->order, p->oprev, p->onext, k);
    }
    if (bel_heap_push(p, t, k)) return;
    if (p->heap_len > 4 * p->order.len + 64) {
        /* Rebuild from the resident keys in insertion order, fresh sequence numbers. */
        int64_t n = 0;
        for (int32_t q = p->order.head; q != NIL; q = p->onext[q]) {
            p->heap[n].t = p->nxt[q];
            p->heap[n].seq = p->seq++;
            p->heap[n].key = q;
            n++;
        }
        p->heap_len = n;
        for (int64_t i = n / 2 - 1; i >= 0; i--) h_sift_down(p->heap, n, i);
    }
}

static int bel_top(Policy *p, int64_t *t) {
    while (p->heap_len) {
        HEnt *e = &p->heap[0];
        if (p->in_next[e->key] && p->nxt[e->key] == e->t) {
            *t = e->t;
            return e->key;
        }
        p->heap[0] = p->heap[--p->heap_len];
        if (p->heap_len) h_sift_down(p->heap, p->heap_len, 0);
    }
    return NIL;
}

/* ---------------------------------------------------------------- hit_density */

/* RecencyStacks.push */
static void rs_push(Policy *p, RStack *s, int32_t k, double now) {
    int64_t g;
    if (s->g_count > s->g_front && now <= s->g_t[s->g_count - 1]) {
        g = s->g_count - 1;   /* same instant, or a late one joins the newest group */
    } else {
        if (s->g_front == s->g_count) s->g_front = s->g_count = s->ent_len = 0;  /* all gone */
        if (s->g_count >= s->g_cap) {
            if (s->g_front > s->g_cap / 2) {             /* drop consumed groups */
                int64_t f = s->g_front, n = s->g_count - f;
                memmove(s->g_t, s->g_t + f, sizeof(double) * (size_t)n);
                memmove(s->g_start, s->g_start + f, sizeof(int64_t) * (size_t)n);
                memmove(s->g_end, s->g_end + f, sizeof(int64_t) * (size_t)n);
                memmove(s->g_id, s->g_id + f, sizeof(int64_t) * (size_t)n);
                s->g_front = 0;
                s->g_count = n;
            } else {
                int64_t cap = s->g_cap ? s->g_cap * 2 : 64;
                double *t = realloc(s->g_t, sizeof(double) * (size_t)cap);
                if (t) s->g_t = t;
                int64_t *a = realloc(s->g_start, sizeof(int64_t) * (size_t)cap);
                if (a) s->g_start = a;
                int64_t *b = realloc(s->g_end, sizeof(int64_t) * (size_t)cap);
                if (b) s->g_end = b;
                int64_t *c = realloc(s->g_id, sizeof(int64_t) * (size_t)cap);
                if (c) s->g_id = c;
                if (!t || !a || !b || !c) { p->oom = 1; return; }
                s->g_cap = cap;
            }
        }
        g = s->g_count++;
        s->g_t[g] = now;
        s->g_start[g] = s->g_end[g] = s->ent_len;
        s->g_id[g] = p->hd.serial++;
    }
    if (s->ent_len >= s->ent_cap) {
        int64_t lo = s->g_start[s->g_front];   /* entries before the front group are dead */
        if (lo > s->ent_cap / 2) {
            memmove(s->ent, s->ent + lo, sizeof(int32_t) * (size_t)(s->ent_len - lo));
            for (int64_t i = s->g_front; i < s->g_count; i++) {
                s->g_start[i] -= lo;
                s->g_end[i] -= lo;
            }
            s->ent_len -= lo;
        } else {
            int64_t cap = s->ent_cap ? s->ent_cap * 2 : 256;
            int32_t *e = realloc(s->ent, sizeof(int32_t) * (size_t)cap);
            if (!e) { p->oom = 1; return; }
            s->ent = e;
            s->ent_cap = cap;
        }
    }
    p->at[k] = s->g_id[g];
    s->ent[s->ent_len++] = k;
    s->g_end[g] = s->ent_len;
}

/* RecencyStacks.head: pops stale entries and empty groups on the way */
static int32_t rs_head(Policy *p, RStack *s, double *t) {
    while (s->g_front < s->g_count) {
        int64_t g = s->g_front;
        while (s->g_end[g] > s->g_start[g]) {
            int32_t k = s->ent[s->g_end[g] - 1];
            if (p->at[k] == s->g_id[g]) { *t = s->g_t[g]; return k; }
            s->g_end[g]--;
            if (g == s->g_count - 1) s->ent_len = s->g_end[g];
        }
        s->g_front++;
    }
    return NIL;
}

/* hit_density._bin; log is libm's, as math.log */
static int hd_bin(const HD *h, double age) {
    if (age < h->bin0) return 0;
    double v = log(age / h->bin0) / h->ln_factor;
    if (v >= (double)(HD_BINS - 2)) return HD_BINS - 1;   /* int(v) + 1 >= _BINS - 1 */
    return (int)v + 1;
}

static int hd_bucket(HD *h, int c, int uses) {
    int i = c * (HD_MAX_USES + 1) + (uses < HD_MAX_USES ? uses : HD_MAX_USES);
    if (h->bid[i] < 0) h->bid[i] = (int16_t)h->n_bk++;   /* zeroed by xcalloc */
    return h->bid[i];
}

/* _Bucket.refresh, operation for operation */
static void hd_refresh_bucket(const HD *h, HBucket *b) {
    const double *r = b->reuses, *E = h->edges;
    double cum[HD_BINS], hits_c[HD_BINS + 1], occ_c[HD_BINS + 1];
    cum[0] = r[0];
    for (int k = 1; k < HD_BINS; k++) cum[k] = cum[k - 1] + r[k];
    double total = cum[HD_BINS - 1];
    if (b->starts <= 0 || total <= 0) {
        for (int k = 0; k < HD_BINS; k++) b->density[k] = 0.0;
        return;
    }
    double q = h->quantile * total;
    int i = 0;                                 /* searchsorted(cum, q), side left */
    while (i < HD_BINS && cum[i] < q) i++;
    double horizon = E[1 + i];                 /* i <= _BINS - 1: cum[-1] = total >= q */
    hits_c[0] = 0.0;
    occ_c[0] = 0.0;
    for (int k = 0; k < HD_BINS; k++) {
        double alive = b->starts - (k ? cum[k - 1] : 0.0);
        double m = alive - r[k] / 2;
        double occupancy = (m > 0.0 ? m : 0.0) * h->widths[k];
        hits_c[k + 1] = cum[k];
        occ_c[k + 1] = k ? occ_c[k] + occupancy : occupancy;
    }
    for (int k = 0; k < HD_BINS; k++) {
        double v = E[k] + horizon;
        int end = 0;                           /* searchsorted(edges, v), side right */
        while (end < HD_BINS + 1 && E[end] <= v) end++;
        if (end < k + 1) end = k + 1;
        if (end > HD_BINS) end = HD_BINS;
        double occ = occ_c[end] - occ_c[k];
        b->density[k] = occ > 0 ? (hits_c[end] - hits_c[k]) / (occ > 1e-12 ? occ : 1e-12)
                                : 0.0;
    }
}

/* refresh_buckets */
static void hd_refresh(HD *h) {
    if (h->events - h->last_decay >= h->half_life) {
        h->last_decay = h->events;
        for (int b = 0; b < h->n_bk; b++) {
            for (int k = 0; k < HD_BINS; k++) h->bk[b].reuses[k] *= 0.5;
            h->bk[b].starts *= 0.5;
        }
    }
    for (int b = 0; b < h->n_bk; b++) hd_refresh_bucket(h, &h->bk[b]);
}

/* HitDensity._use; c < 0 (or the class named "") keeps the key's class */
static int hd_use(HD *h, int32_t k, double now, int c) {
    if (now > h->now) h->now = now;
    int uses = 0;
    if (h->has[k]) {
        int ob = hd_bucket(h, h->kcls[k], h->uses[k]);
        h->bk[ob].reuses[hd_bin(h, now - h->last[k])] += 1.0;
        if (c < 0 || c == h->empty_cls) c = h->kcls[k];
        uses = h->uses[k];
    }
    if (uses < HD_MAX_USES) uses++;
    h->last[k] = now;
    h->uses[k] = (uint8_t)uses;
    h->kcls[k] = (uint8_t)c;
    h->has[k] = 1;
    int b = hd_bucket(h, c, uses);
    h->bk[b].starts += 1.0;
    h->events++;
    if (h->events >= h->next_refresh) {
        /* Early on, refresh at doubling intervals so the policy learns fast. */
        h->next_refresh = h->events + (h->events < h->refresh_every ? h->events
                                                                     : h->refresh_every);
        hd_refresh(h);
    }
    return b;
}

static void hd_forget_later(HD *h, int32_t k) {
    if (!h->in_ghost[k]) {              /* OrderedDict assignment keeps a key's place */
        l_append(&h->ghost, h->gprev, h->gnext, k);
        h->in_ghost[k] = 1;
    }
    int64_t m = h->n_where > 1024 ? h->n_where : 1024;
    int64_t limit = (int64_t)(h->ghost_factor * (double)m);
    while (h->ghost.len > limit) {
        int32_t old = h->ghost.head;
        l_unlink(&h->ghost, h->gprev, h->gnext, old);
        h->in_ghost[old] = 0;
        h->has[old] = 0;
    }
}

static void hd_admit(Policy *p, int32_t k, double now, int c) {
    HD *h = &p->hd;
    if (h->in_ghost[k]) {
        l_unlink(&h->ghost, h->gprev, h->gnext, k);
        h->in_ghost[k] = 0;
    }
    hd_use(h, k, now, c);
}

static void hd_insert(Policy *p, int32_t k) {
    HD *h = &p->hd;
    int b = hd_bucket(h, h->kcls[k], h->uses[k]);
    rs_push(p, &h->bk[b].lru, k, h->last[k]);
    h->where[k] = (int16_t)b;
    h->n_where++;
}

static void hd_touch(Policy *p, int32_t k, double now) {
    HD *h = &p->hd;
    if (h->where[k] < 0) return;
    p->at[k] = -1;                              /* old.lru.discard */
    int b = hd_use(h, k, now, -1);
    rs_push(p, &h->bk[b].lru, k, now);
    h->where[k] = (int16_t)b;
}

static void hd_remove(Policy *p, int32_t k) {
    HD *h = &p->hd;
    if (h->where[k] < 0) return;
    h->where[k] = -1;
    h->n_where--;
    p->at[k] = -1;
    hd_forget_later(h, k);
}

/* HitDensity._lowest: among each bucket's head, lowest density, then longest idle,
 * then the first bucket made */
static int32_t hd_lowest(Policy *p, double *score) {
    HD *h = &p->hd;
    int32_t best = NIL;
    double bs = 0.0, bt = 0.0;
    for (int b = 0; b < h->n_bk; b++) {
        double t;
        int32_t k = rs_head(p, &h->bk[b].lru, &t);
        if (k == NIL) continue;
        double sc = h->bk[b].density[hd_bin(h, h->now - h->last[k])];
        if (best == NIL || sc < bs || (sc == bs && t < bt)) {
            best = k;
            bs = sc;
            bt = t;
        }
    }
    *score = bs;
    return best;
}

static int hd_bypass(Policy *p, int32_t k) {
    HD *h = &p->hd;
    if (h->where[k] >= 0 || !h->n_where) return 0;
    double mine = h->bk[hd_bucket(h, h->kcls[k], h->uses[k])].density[0], low;
    if (hd_lowest(p, &low) == NIL) return 0;
    if (mine < low) {
        hd_forget_later(h, k);
        return 1;
    }
    return 0;
}

/* ---------------------------------------------------------------- session_density */

static int sd_turn_bucket(int turns) {      /* _turn_bucket: 1, 2, 3-4, 5-8, 9+ */
    return turns <= 1 ? 0 : turns <= 2 ? 1 : turns <= 4 ? 2 : turns <= 8 ? 3 : 4;
}

static int sd_bucket(HD *h, int c, int tb) {
    int i = c * (HD_MAX_USES + 1) + tb;
    if (h->bid[i] < 0) h->bid[i] = (int16_t)h->n_bk++;
    return h->bid[i];
}

/* heapq over (nd, seq): the smallest first */
static int se_less(const SEnt *a, const SEnt *b) {
    return a->nd < b->nd || (a->nd == b->nd && a->seq < b->seq);
}

static void sd_push(Policy *p, Sess *s, int32_t k) {
    HD *h = &p->hd;
    if (s->heap_len >= s->heap_cap) {
        int64_t cap = s->heap_cap ? s->heap_cap * 2 : 16;
        SEnt *e = realloc(s->heap, sizeof(SEnt) * (size_t)cap);
        if (!e) { p->oom = 1; return; }
        s->heap = e;
        s->heap_cap = cap;
    }
    SEnt e = {-(int64_t)h->dep[k], h->seq++, k};
    int64_t i = s->heap_len++;
    while (i > 0) {
        int64_t up = (i - 1) / 2;
        if (!se_less(&e, &s->heap[up])) break;
        s->heap[i] = s->heap[up];
        i = up;
    }
    s->heap[i] = e;
}

static void sd_pop(Sess *s) {
    SEnt e = s->heap[--s->heap_len];
    int64_t n = s->heap_len, i = 0;
    if (!n) return;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && se_less(&s->heap[c + 1], &s->heap[c])) c++;
        if (!se_less(&s->heap[c], &e)) break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    s->heap[i] = e;
}

static void sd_refresh_check(HD *h) {
    h->events++;
    if (h->events >= h->next_refresh) {
        h->next_refresh = h->events + (h->events < h->refresh_every ? h->events
                                                                     : h->refresh_every);
        hd_refresh(h);
    }
}

static int grp_is_live(const HD *h, int gi, int64_t i) {
    const Sess *s = &h->ss[h->grps[gi].e[i].sid];
    return s->grp == gi && s->gpos == i;
}

static void grp_kill(HD *h, Sess *s) {
    if (s->gpos < 0) return;
    h->grps[s->grp].live--;
    s->gpos = -1;
}

static void grp_append(Policy *p, int32_t si) {
    HD *h = &p->hd;
    Sess *s = &h->ss[si];
    int gi = s->grp;
    Grp *g = &h->grps[gi];
    if (g->len >= g->cap) {
        if (g->live <= g->cap / 2 && g->cap) {          /* compact: keep the live, in order */
            int64_t n = 0;
            for (int64_t i = g->front; i < g->len; i++) {
                if (!grp_is_live(h, gi, i)) continue;
                g->e[n] = g->e[i];
                h->ss[g->e[n].sid].gpos = n;
                n++;
            }
            g->len = n;
            g->front = 0;
        } else {
            int64_t cap = g->cap ? g->cap * 2 : 64;
            GEnt *e = realloc(g->e, sizeof(GEnt) * (size_t)cap);
            if (!e) { p->oom = 1; return; }
            g->e = e;
            g->cap = cap;
        }
    }
    g->e[g->len].last = s->last;
    g->e[g->len].sid = si;
    s->gpos = g->len++;
    g->live++;
}

/* SessionDensity.begin_request */
static void sd_begin(Policy *p, int32_t si, const uint32_t *ids, int64_t ns, double now, int c) {
    HD *h = &p->hd;
    if (now > h->now) h->now = now;
    Sess *s = &h->ss[si];
    if (!s->exists) {
        s->exists = 1;
        s->cls = (uint8_t)c;
        s->turns = 0;
        s->last = 0.0;
        s->bucket = -1;
        s->grp = -1;
        s->gpos = -1;
        h->known[h->n_known++] = si;
    } else if (s->bucket >= 0) {
        h->bk[s->bucket].reuses[hd_bin(h, now - s->last)] += 1.0;
    }
    if (s->turns < 9) s->turns++;
    s->last = now;
    if (c != h->empty_cls) s->cls = (uint8_t)c;     /* cls or s.cls */
    s->bucket = (int16_t)sd_bucket(h, s->cls, sd_turn_bucket(s->turns));
    h->bk[s->bucket].starts += 1.0;
    grp_kill(h, s);                          /* its last moved: re-enter at the end */
    s->grp = s->cls * (HD_MAX_USES + 1) + sd_turn_bucket(s->turns);
    if (s->holding) grp_append(p, si);
    h->current = si;
    for (int64_t j = 0; j < ns; j++) h->dep[ids[j]] = (int32_t)j;   /* a repeat: its last */
    h->low_valid = 0;
    sd_refresh_check(h);
}

static double sd_density(HD *h, int32_t si) {
    Sess *s = &h->ss[si];
    int b = s->bucket;
    if (b < 0) return 0.0;
    /* A bucket with too little history borrows the nearest fewer-turns one. */
    int tb = sd_turn_bucket(s->turns);
    while (h->bk[b].starts < h->min_starts && tb > 0) {
        tb--;
        int nb = h->bid[s->cls * (HD_MAX_USES + 1) + tb];
        if (nb >= 0) b = nb;
    }
    return h->bk[b].density[hd_bin(h, h->now - s->last)];
}

static void sd_disown(HD *h, int32_t si) {
    Sess *s = &h->ss[si];
    if (--s->holding) return;
    grp_kill(h, s);
    h->n_holding--;
    s->heap_len = 0;
    if (h->low_valid && h->low_sess == si) h->low_valid = 0;
}

static void sd_own(Policy *p, int32_t k, int32_t si) {
    HD *h = &p->hd;
    int32_t old = h->owner[k];
    if (old >= 0) sd_disown(h, old); else h->n_owned++;
    h->owner[k] = si;
    Sess *s = &h->ss[si];
    if (!s->holding++) {        /* si is the session being served: its last is the newest */
        s->rank = h->hold_serial++;
        grp_append(p, si);
        h->n_holding++;
    }
}

static void sd_insert(Policy *p, int32_t k, double now) {
    HD *h = &p->hd;
    if (now > h->now) h->now = now;
    int32_t si = h->current;
    sd_own(p, k, si);
    sd_push(p, &h->ss[si], k);
}

static void sd_touch(Policy *p, int32_t k, double now) {
    HD *h = &p->hd;
    if (now > h->now) h->now = now;
    int32_t si = h->current, old = h->owner[k];
    if (si < 0 || old < 0 || old == si) return;
    /* A shared block (a system prompt) now belongs to the session using it. */
    sd_own(p, k, si);
    sd_push(p, &h->ss[si], k);
}

static void sd_remove(Policy *p, int32_t k) {
    HD *h = &p->hd;
    int32_t si = h->owner[k];
    if (si < 0) return;
    h->owner[k] = -1;
    h->n_owned--;
    sd_disown(h, si);
}

static int32_t sd_top(HD *h, int32_t si) {
    Sess *s = &h->ss[si];
    while (s->heap_len) {
        int32_t k = s->heap[0].key;
        if (h->owner[k] == si) return k;
        sd_pop(s);
    }
    return NIL;
}

/* SessionDensity._lowest: -1 = LookupError */
static int32_t sd_lowest(HD *h, double *score) {
    if (h->low_valid) { *score = h->low_score; return h->low_sess; }
    /* Python scans _holding for the least (density, last), the first in _holding's
     * order among equals. Here: within a group every session has the same
     * (borrowed) bucket, so its density is a function of the idle bin, which
     * only grows towards the group's oldest entries: per bin, the oldest live
     * entry (the least rank among equal lasts) is the group's candidate, and a
     * binary search skips to the next bin. */
    int32_t best = -1;
    double bd = 0.0, bl = 0.0;
    uint64_t br = 0;
    int ng = h->n_cls * (HD_MAX_USES + 1);
    for (int gi = 0; gi < ng; gi++) {
        Grp *g = &h->grps[gi];
        if (!g->live) continue;
        int b = h->bid[gi], tb = gi % (HD_MAX_USES + 1), c = gi / (HD_MAX_USES + 1);
        while (h->bk[b].starts < h->min_starts && tb > 0) {
            tb--;
            int nb = h->bid[c * (HD_MAX_USES + 1) + tb];
            if (nb >= 0) b = nb;
        }
        const double *D = h->bk[b].density;
        while (g->front < g->len && !grp_is_live(h, gi, g->front)) g->front++;
        int64_t pos = g->front;
        while (pos < g->len) {
            const GEnt *e = &g->e[pos];
            if (!grp_is_live(h, gi, pos) || e->sid == h->current) { pos++; continue; }
            double l = e->last;
            int k = hd_bin(h, h->now - l);
            int32_t cs = e->sid;
            uint64_t cr = h->ss[cs].rank;
            int64_t q = pos + 1;
            for (; q < g->len && g->e[q].last == l; q++) {
                int32_t o = g->e[q].sid;
                if (grp_is_live(h, gi, q) && o != h->current && h->ss[o].rank < cr) {
                    cs = o;
                    cr = h->ss[o].rank;
                }
            }
            double d = D[k];
            if (best < 0 || d < bd || (d == bd && (l < bl || (l == bl && cr < br)))) {
                best = cs; bd = d; bl = l; br = cr;
            }
            if (k == 0) break;
            int64_t lo = q, hi = g->len;       /* first entry idle for a smaller bin */
            while (lo < hi) {
                int64_t mid = lo + (hi - lo) / 2;
                if (hd_bin(h, h->now - g->e[mid].last) >= k) lo = mid + 1; else hi = mid;
            }
            pos = lo;
        }
    }
    if (best < 0) {
        int32_t cur = h->current;
        if (cur >= 0 && h->ss[cur].holding) { *score = sd_density(h, cur); return cur; }
        return -1;
    }
    int64_t m = h->n_holding > 1024 ? h->n_holding : 1024;
    if (h->n_known > 4 * m) {
        /* bounded memory: forget sessions that hold nothing (they restart at turn 1) */
        int64_t kept = 0;
        for (int64_t i = 0; i < h->n_known; i++) {
            int32_t si = h->known[i];
            if (h->ss[si].holding || si == h->current) h->known[kept++] = si;
            else h->ss[si].exists = 0;
        }
        h->n_known = kept;
    }
    h->low_valid = 1;
    h->low_sess = best;
    h->low_score = bd;
    *score = bd;
    return best;
}

static int32_t sd_victim(Policy *p) {
    double score;
    int32_t si = sd_lowest(&p->hd, &score);
    return si < 0 ? NIL : sd_top(&p->hd, si);
}

static int sd_bypass(Policy *p) {
    HD *h = &p->hd;
    int32_t si = h->current;
    if (si < 0 || !h->n_owned) return 0;
    double low;
    if (sd_lowest(h, &low) < 0) return 0;
    return sd_density(h, si) < low;
}

/* the EvictionPolicy interface */
static void pol_insert(Policy *p, int32_t k, double now) {
    switch (p->policy) {
    case P_LRU:
    case P_FIFO: l_append(&p->lru, p->prev, p->next, k); p->tag[k] = T_MAIN; break;
    case P_PREFIX_LRU: plru_push(p, k, now); break;
    case P_HIT_DENSITY: hd_insert(p, k); break;
    case P_SESSION_DENSITY: sd_insert(p, k, now); break;
    case P_S3FIFO:
        p->freq[k] = 0;
        if (p->tag[k] == T_GHOST) {
            l_unlink(&p->ghost, p->prev, p->next, k);
            l_append(&p->mainq, p->prev, p->next, k);
            p->tag[k] = T_MAIN;
            p->main_bytes += p->block_bytes;
        } else {
            l_append(&p->small, p->prev, p->next, k);
            p->tag[k] = T_SMALL;
            p->small_bytes += p->block_bytes;
        }
        break;
    default: bel_push(p, k); break;
    }
}

static void pol_touch(Policy *p, int32_t k, double now) {
    switch (p->policy) {
    case P_LRU:
        l_unlink(&p->lru, p->prev, p->next, k);
        l_append(&p->lru, p->prev, p->next, k);
        break;
    case P_FIFO: break;                               /* uses do not reorder */
    case P_PREFIX_LRU: plru_push(p, k, now); break;
    case P_HIT_DENSITY: hd_touch(p, k, now); break;
    case P_SESSION_DENSITY: sd_touch(p, k, now); break;
    case P_S3FIFO:
        if (p->tag[k] == T_SMALL || p->tag[k] == T_MAIN) {
            if (p->freq[k] < 3) p->freq[k]++;
        }
        break;
    default: bel_push(p, k); break;
    }
}

static void pol_remove(Policy *p, int32_t k) {
    switch (p->policy) {
    case P_LRU:
    case P_FIFO:
        if (p->tag[k]) { l_unlink(&p->lru, p->prev, p->next, k); p->tag[k] = T_NONE; }
        break;
    case P_PREFIX_LRU: p->at[k] = -1; break;
    case P_HIT_DENSITY: hd_remove(p, k); break;
    case P_SESSION_DENSITY: sd_remove(p, k); break;
    case P_S3FIFO:
        if (p->tag[k] == T_SMALL) {
            l_unlink(&p->small, p->prev, p->next, k);
            p->tag[k] = T_NONE;
            p->small_bytes -= p->block_bytes;
            s3_remember(p, k);
        } else if (p->tag[k] == T_MAIN) {
            l_unlink(&p->mainq, p->prev, p->next, k);
            p->tag[k] = T_NONE;
            p->main_bytes -= p->block_bytes;
        }
        break;
    default:
        if (p->in_next[k]) {
            p->in_next[k] = 0;
            l_unlink(&p->order, p->oprev, p->onext, k);
        }
        break;
    }
}

static int32_t pol_victim(Policy *p) {
    int64_t t;
    double score;
    switch (p->policy) {
    case P_HIT_DENSITY: return hd_lowest(p, &score);
    case P_SESSION_DENSITY: return sd_victim(p);
    case P_LRU:
    case P_FIFO: return p->lru.head;
    case P_PREFIX_LRU: return plru_head(p);
    case P_S3FIFO: return s3_victim(p);
    default: return bel_top(p, &t);
    }
}

static int pol_bypass(Policy *p, int32_t k) {
    if (p->policy == P_HIT_DENSITY) return hd_bypass(p, k);
    if (p->policy == P_SESSION_DENSITY) return sd_bypass(p);
    if (p->policy != P_BELADY || !p->order.len) return 0;
    int64_t mine = p->has_pending[k] ? p->pending[k] : NEVER;
    int64_t top;
    if (bel_top(p, &top) == NIL) return 0;
    if (mine >= top) {
        p->has_pending[k] = 0;
        return 1;
    }
    return 0;
}

/* ---------------------------------------------------------------- the replay */

typedef struct {
    int64_t evictions, expirations, peak, used, stored;
    double area, t0, t;
    int err;             /* 1: time went backwards, 2: out of memory, 3: empty victim */
    int64_t err_at;
} Result;

typedef struct {
    /* TTL queues, one per class, in expiry order (studies.sim._due) */
    int32_t *qprev, *qnext;
    double *due;
    List *q;
    int *q_made, *q_order;
    int n_q;
} Ttl;

static void ttl_refresh(Ttl *x, int16_t *cls_of, int32_t h, int c, double due) {
    int old = cls_of[h];
    if (old >= 0 && old != c) l_unlink(&x->q[old], x->qprev, x->qnext, h);
    if (!x->q_made[c]) { x->q_made[c] = 1; x->q_order[x->n_q++] = c; }
    if (old == c) l_unlink(&x->q[c], x->qprev, x->qnext, h);
    x->due[h] = due;
    l_append(&x->q[c], x->qprev, x->qnext, h);
}

static void advance(Result *r, double t) {
    if (t > r->t) {
        r->area += (double)r->used * (t - r->t);
        r->t = t;
    }
}

typedef struct {
    const uint32_t *ids;
    const int64_t *off;
    const int32_t *nstore;
    const double *times;
    const uint8_t *cls;
    const double *ttls;
    const int32_t *next_req;
    int32_t *hits;
    int64_t n_req, n_keys;
    int n_cls, expiring;
    int64_t cap, bb;
} Args;

static void run(const Args *a, Policy *p, Result *r, uint8_t *res, int16_t *cls_of, Ttl *x) {
    memset(r, 0, sizeof(*r));
    for (int64_t i = 0; i < a->n_req; i++) {
        double now = a->times[i];
        if (i == 0) r->t0 = r->t = now;
        if (now < r->t) { r->err = 1; r->err_at = i; return; }
        if (a->expiring) {
            for (;;) {
                int best = -1;
                double best_due = now;
                for (int qi = 0; qi < x->n_q; qi++) {
                    List *q = &x->q[x->q_order[qi]];
                    if (q->len && x->due[q->head] < best_due) {
                        best = x->q_order[qi];
                        best_due = x->due[q->head];
                    }
                }
                if (best < 0) break;
                int32_t h = x->q[best].head;
                l_unlink(&x->q[best], x->qprev, x->qnext, h);
                advance(r, best_due);
                res[h] = 0;
                pol_remove(p, h);
                r->used -= a->bb;
                cls_of[h] = -1;
                r->expirations++;
            }
        }
        advance(r, now);
        const uint32_t *ids = a->ids + a->off[i];
        int64_t ns = a->nstore[i];
        int32_t hit = 0;
        for (int64_t j = 0; j < ns && res[ids[j]]; j++) hit++;
        a->hits[i] = hit;
        int c = a->cls[i];
        double ttl = a->ttls[c];
        if (p->policy == P_SESSION_DENSITY)
            sd_begin(p, (int32_t)p->hd.req_sess[i], ids, ns, now, c);
        for (int64_t j = 0; j < ns; j++) {
            int32_t h = (int32_t)ids[j];
            if (p->policy == P_BELADY) {
                int32_t k = a->next_req[a->off[i] + j];
                int64_t key = (k < 0 || a->times[k] - now > ttl)
                                  ? NEVER
                                  : (int64_t)k * DEPTH_SLOTS + (j < DEPTH_SLOTS - 1 ? j : DEPTH_SLOTS - 1);
                p->pending[h] = key;
                p->has_pending[h] = 1;
            }
            if (res[h]) {
                pol_touch(p, h, now);
            } else {
                if (a->bb > a->cap) continue;                  /* refused: no refresh */
                if (p->policy == P_HIT_DENSITY) hd_admit(p, h, now, c);
                if (r->used + a->bb > a->cap && pol_bypass(p, h)) continue;
                while (r->used + a->bb > a->cap) {
                    int32_t v = pol_victim(p);
                    if (v == NIL) { r->err = 3; r->err_at = i; return; }
                    pol_remove(p, v);
                    res[v] = 0;
                    r->used -= a->bb;
                    r->evictions++;
                    if (a->expiring && cls_of[v] >= 0)
                        l_unlink(&x->q[cls_of[v]], x->qprev, x->qnext, v);
                    cls_of[v] = -1;
                }
                pol_insert(p, h, now);
                res[h] = 1;
                r->used += a->bb;
                r->stored++;
                if (r->used > r->peak) r->peak = r->used;
            }
            if (p->oom) { r->err = 2; r->err_at = i; return; }
            if (a->expiring) ttl_refresh(x, cls_of, h, c, now + ttl);
            cls_of[h] = (int16_t)c;
        }
    }
}

/* ---------------------------------------------------------------- Python glue */

static int get_buf(PyObject *o, Py_buffer *b, Py_ssize_t itemsize, int writable,
                   const char *what) {
    if (PyObject_GetBuffer(o, b, writable ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS
                                          : PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (b->len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: buffer length %zd is not a multiple of %zd",
                     what, b->len, itemsize);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* hit_density's and session_density's settings: (edges f64[41], widths f64[40], ln_factor,
 * bin0, refresh_every, half_life, ghost_factor, quantile, first refresh, index of the class
 * named "" or -1[, sessions u32[requests], min_starts]); the sessions buffer goes to *bs
 * (the caller releases it) */
static int parse_hd(PyObject *o, HD *h, Py_buffer *bs, int *has_bs) {
    PyObject *o_e, *o_w, *o_s = Py_None;
    long long refresh_every, half_life, next_refresh;
    int empty_cls;
    if (o == Py_None || !PyTuple_Check(o)) {
        PyErr_SetString(PyExc_ValueError, "replay: hit_density needs its settings tuple");
        return -1;
    }
    if (!PyArg_ParseTuple(o, "OOddLLddLi|Od", &o_e, &o_w, &h->ln_factor, &h->bin0,
                          &refresh_every, &half_life, &h->ghost_factor, &h->quantile,
                          &next_refresh, &empty_cls, &o_s, &h->min_starts))
        return -1;
    if (o_s != Py_None) {
        if (get_buf(o_s, bs, 4, 0, "sessions")) return -1;
        *has_bs = 1;
        h->req_sess = bs->buf;
    }
    Py_buffer be, bw;
    if (get_buf(o_e, &be, 8, 0, "edges")) return -1;
    if (get_buf(o_w, &bw, 8, 0, "widths")) { PyBuffer_Release(&be); return -1; }
    int bad = be.len != 8 * (HD_BINS + 1) || bw.len != 8 * HD_BINS;
    if (!bad) {
        memcpy(h->edges, be.buf, sizeof(h->edges));
        memcpy(h->widths, bw.buf, sizeof(h->widths));
    }
    PyBuffer_Release(&be);
    PyBuffer_Release(&bw);
    if (bad || refresh_every < 1 || half_life < 1 || next_refresh < 1 || !(h->bin0 > 0) ||
        !(h->ln_factor > 0) || !(h->quantile > 0) || !(h->quantile <= 1)) {
        PyErr_SetString(PyExc_ValueError, "replay: bad hit_density settings");
        return -1;
    }
    h->refresh_every = refresh_every;
    h->half_life = half_life;
    h->next_refresh = next_refresh;
    h->empty_cls = empty_cls;
    return 0;
}

static PyObject *py_replay(PyObject *self, PyObject *args) {
    PyObject *o_ids, *o_off, *o_ns, *o_t, *o_cls, *o_ttl, *o_next, *o_hits, *o_hd = Py_None;
    long long n_keys, cap, bb;
    int policy, expiring;
    if (!PyArg_ParseTuple(args, "OOOOOOOOLLLip|O", &o_ids, &o_off, &o_ns, &o_t, &o_cls, &o_ttl,
                          &o_next, &o_hits, &n_keys, &cap, &bb, &policy, &expiring, &o_hd))
        return NULL;
    if (policy < 0 || policy >= P_COUNT) return PyErr_Format(PyExc_ValueError, "bad policy");
    HD hd_cfg;
    memset(&hd_cfg, 0, sizeof(hd_cfg));
    Py_buffer b_sess;
    int has_sess = 0;
    if ((policy == P_HIT_DENSITY || policy == P_SESSION_DENSITY) &&
        parse_hd(o_hd, &hd_cfg, &b_sess, &has_sess)) {
        if (has_sess) PyBuffer_Release(&b_sess);
        return NULL;
    }
    if (n_keys < 0 || n_keys > INT32_MAX || bb < 1 || cap < 0)
        return PyErr_Format(PyExc_ValueError, "bad n_keys, capacity or block size");
    Py_buffer b[8];
    int nb = 0;
    PyObject *out = NULL;
    Args a;
    memset(&a, 0, sizeof(a));
    if (get_buf(o_ids, &b[nb], 4, 0, "ids")) goto done;
    nb++;
    if (get_buf(o_off, &b[nb], 8, 0, "offsets")) goto done;
    nb++;
    if (get_buf(o_ns, &b[nb], 4, 0, "nstore")) goto done;
    nb++;
    if (get_buf(o_t, &b[nb], 8, 0, "times")) goto done;
    nb++;
    if (get_buf(o_cls, &b[nb], 1, 0, "classes")) goto done;
    nb++;
    if (get_buf(o_ttl, &b[nb], 8, 0, "ttls")) goto done;
    nb++;
    if (get_buf(o_hits, &b[nb], 4, 1, "hits")) goto done;
    nb++;
    int has_next = o_next != Py_None;
    if (has_next) {
        if (get_buf(o_next, &b[nb], 4, 0, "next_req")) goto done;
        nb++;
    }
    a.ids = b[0].buf; a.off = b[1].buf; a.nstore = b[2].buf; a.times = b[3].buf;
    a.cls = b[4].buf; a.ttls = b[5].buf; a.hits = b[6].buf;
    a.next_req = has_next ? b[7].buf : NULL;
    a.n_req = b[3].len / 8;
    a.n_cls = (int)(b[5].len / 8);
    a.n_keys = n_keys;
    a.cap = cap; a.bb = bb; a.expiring = expiring;
    int64_t n_ids = b[0].len / 4;
    if (b[1].len / 8 != a.n_req + 1 || b[2].len / 4 != a.n_req || b[4].len != a.n_req ||
        b[6].len / 4 != a.n_req || a.n_cls < 1 || a.n_cls > 32767 ||
        (has_next && b[7].len / 4 != n_ids)) {
        PyErr_SetString(PyExc_ValueError, "replay: array lengths disagree");
        goto done;
    }
    if (policy == P_SESSION_DENSITY) {
        if (!has_sess || b_sess.len / 4 != a.n_req) {
            PyErr_SetString(PyExc_ValueError, "replay: session_density needs sessions[requests]");
            goto done;
        }
        for (int64_t i = 0; i < a.n_req; i++) {
            if (hd_cfg.req_sess[i] >= INT32_MAX) {
                PyErr_SetString(PyExc_ValueError, "replay: session id >= 2**31 - 1");
                goto done;
            }
            if (hd_cfg.req_sess[i] >= hd_cfg.n_sess) hd_cfg.n_sess = hd_cfg.req_sess[i] + 1;
        }
    }
    if (policy == P_BELADY && !has_next) {
        PyErr_SetString(PyExc_ValueError, "replay: belady needs next_req");
        goto done;
    }
    if (a.off[0] != 0 || a.off[a.n_req] != n_ids) {
        PyErr_SetString(PyExc_ValueError, "replay: offsets must span the ids");
        goto done;
    }
    for (int64_t i = 0; i < a.n_req; i++) {
        if (a.off[i + 1] < a.off[i] || a.nstore[i] < 0 ||
            a.nstore[i] > a.off[i + 1] - a.off[i] || a.cls[i] >= a.n_cls) {
            PyErr_Format(PyExc_ValueError, "replay: request %lld out of bounds", (long long)i);
            goto done;
        }
    }
    for (int64_t u = 0; u < n_ids; u++) {
        if (a.ids[u] >= (uint64_t)n_keys ||
            (has_next && (a.next_req[u] < -1 || a.next_req[u] >= a.n_req))) {
            PyErr_Format(PyExc_ValueError, "replay: block use %lld out of bounds", (long long)u);
            goto done;
        }
    }
    Policy p;
    Result r;
    Ttl x;
    memset(&x, 0, sizeof(x));
    uint8_t *res = xcalloc((size_t)n_keys, 1);
    int16_t *cls_of = malloc(sizeof(int16_t) * (size_t)(n_keys ? n_keys : 1));
    hd_cfg.n_cls = a.n_cls < 256 ? a.n_cls : 256;     /* classes are uint8 */
    if (hd_cfg.empty_cls >= a.n_cls) hd_cfg.empty_cls = -1;
    int ok = pol_init(&p, policy, n_keys, bb, a.n_req, &hd_cfg) == 0 && res && cls_of;
    if (ok && expiring) {
        x.qprev = malloc(sizeof(int32_t) * (size_t)(n_keys ? n_keys : 1));
        x.qnext = malloc(sizeof(int32_t) * (size_t)(n_keys ? n_keys : 1));
        x.due = malloc(sizeof(double) * (size_t)(n_keys ? n_keys : 1));
        x.q = xcalloc((size_t)a.n_cls, sizeof(List));
        x.q_made = xcalloc((size_t)a.n_cls, sizeof(int));
        x.q_order = xcalloc((size_t)a.n_cls, sizeof(int));
        ok = x.qprev && x.qnext && x.due && x.q && x.q_made && x.q_order;
        if (ok) for (int c = 0; c < a.n_cls; c++) l_init(&x.q[c]);
    }
    if (ok) {
        for (int64_t k = 0; k < n_keys; k++) cls_of[k] = -1;
        Py_BEGIN_ALLOW_THREADS
        run(&a, &p, &r, res, cls_of, &x);
        Py_END_ALLOW_THREADS
    }
    pol_free(&p);
    free(res); free(cls_of);
    free(x.qprev); free(x.qnext); free(x.due); free(x.q); free(x.q_made); free(x.q_order);
    if (!ok || r.err == 2) {
        PyErr_NoMemory();
    } else if (r.err == 1) {
        PyErr_Format(PyExc_ValueError, "request %lld arrives before the previous one",
                     (long long)r.err_at);
    } else if (r.err == 3) {
        PyErr_SetString(PyExc_LookupError, "eviction requested from an empty cache");
    } else {
        out = Py_BuildValue("{s:L,s:L,s:L,s:d,s:d,s:d,s:L,s:L}", "evictions", r.evictions,
                            "expirations", r.expirations, "bytes_peak", r.peak, "area", r.area,
                            "t0", r.t0, "t_last", r.t, "used", r.used, "stored", r.stored);
    }
done:
    for (int i = 0; i < nb; i++) PyBuffer_Release(&b[i]);
    if (has_sess) PyBuffer_Release(&b_sess);
    return out;
}

/* next_req[u] = index of the next request after u's that uses the same block
 * (-1: none); studies.sim.Future.of over interned ids. */
static PyObject *py_next_uses(PyObject *self, PyObject *args) {
    PyObject *o_ids, *o_off, *o_out;
    long long n_keys;
    if (!PyArg_ParseTuple(args, "OOOL", &o_ids, &o_off, &o_out, &n_keys)) return NULL;
    Py_buffer bi, bo, bn;
    if (get_buf(o_ids, &bi, 4, 0, "ids")) return NULL;
    if (get_buf(o_off, &bo, 8, 0, "offsets")) { PyBuffer_Release(&bi); return NULL; }
    if (get_buf(o_out, &bn, 4, 1, "out")) {
        PyBuffer_Release(&bi); PyBuffer_Release(&bo); return NULL;
    }
    PyObject *ret = NULL;
    const uint32_t *ids = bi.buf;
    const int64_t *off = bo.buf;
    int32_t *out = bn.buf;
    int64_t n_ids = bi.len / 4, n_req = bo.len / 8 - 1;
    int32_t *last = NULL;
    if (n_req < 0 || n_req > INT32_MAX || bn.len / 4 != n_ids || off[0] != 0 ||
        off[n_req] != n_ids || n_keys < 0) {
        PyErr_SetString(PyExc_ValueError, "next_uses: array lengths disagree");
        goto end;
    }
    for (int64_t i = 0; i < n_req; i++)
        if (off[i + 1] < off[i]) { PyErr_SetString(PyExc_ValueError, "bad offsets"); goto end; }
    for (int64_t u = 0; u < n_ids; u++)
        if (ids[u] >= (uint64_t)n_keys) { PyErr_SetString(PyExc_ValueError, "id >= n_keys"); goto end; }
    last = malloc(sizeof(int32_t) * (size_t)(n_keys ? n_keys : 1));
    if (!last) { PyErr_NoMemory(); goto end; }
    for (int64_t k = 0; k < n_keys; k++) last[k] = -1;
    for (int64_t i = n_req - 1; i >= 0; i--) {
        for (int64_t u = off[i]; u < off[i + 1]; u++) out[u] = last[ids[u]];
        for (int64_t u = off[i]; u < off[i + 1]; u++) last[ids[u]] = (int32_t)i;
    }
    ret = Py_None;
    Py_INCREF(ret);
end:
    free(last);
    PyBuffer_Release(&bi); PyBuffer_Release(&bo); PyBuffer_Release(&bn);
    return ret;
}

static PyMethodDef methods[] = {
    {"replay", py_replay, METH_VARARGS,
     "replay(ids, offsets, nstore, times, classes, ttls, next_req, hits_out, n_keys, "
     "capacity_bytes, block_bytes, policy, expiring[, hit_density_settings]) -> dict"},
    {"next_uses", py_next_uses, METH_VARARGS, "next_uses(ids, offsets, out, n_keys)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_replaycore",
                                    "studies.sim's replay loop in C", -1, methods};

PyMODINIT_FUNC PyInit__replaycore(void) { return PyModule_Create(&module); }
