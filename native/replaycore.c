/* Trace replay core: kvstore.sim.SimWarehouse's single-tier accounting with
 * the lru, fifo, prefix_lru, s3fifo and belady policies and per-class TTL expiry,
 * over interned uint32 block ids. Every step mirrors the Python code in
 * kvstore/sim.py and kvstore/eviction/ operation for operation (including
 * tie-breaks, stale-entry rules and the order victims are removed), so hit
 * counts are bit-identical; tests/kvstore/test_replay_native.py checks that.
 *
 * Plain C11, no intrinsics. Every index read from a caller's buffer is
 * bounds-checked before the replay starts.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NIL (-1)
#define NEVER INT64_MAX              /* Belady: "never used again" (math.inf) */
#define DEPTH_SLOTS (1LL << 20)      /* kvstore.sim._DEPTH_SLOTS */

enum { P_LRU = 0, P_PREFIX_LRU = 1, P_S3FIFO = 2, P_BELADY = 3, P_FIFO = 4, P_COUNT = 5 };
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
} Policy;

static void *xcalloc(size_t n, size_t sz) { return calloc(n ? n : 1, sz); }

static int pol_init(Policy *p, int policy, int64_t n_keys, int64_t block_bytes,
                    int64_t n_groups) {
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

/* the EvictionPolicy interface */
static void pol_insert(Policy *p, int32_t k, double now) {
    switch (p->policy) {
    case P_LRU:
    case P_FIFO: l_append(&p->lru, p->prev, p->next, k); p->tag[k] = T_MAIN; break;
    case P_PREFIX_LRU: plru_push(p, k, now); break;
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
    switch (p->policy) {
    case P_LRU:
    case P_FIFO: return p->lru.head;
    case P_PREFIX_LRU: return plru_head(p);
    case P_S3FIFO: return s3_victim(p);
    default: return bel_top(p, &t);
    }
}

static int pol_bypass(Policy *p, int32_t k) {
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
    /* TTL queues, one per class, in expiry order (kvstore.sim._due) */
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

static PyObject *py_replay(PyObject *self, PyObject *args) {
    PyObject *o_ids, *o_off, *o_ns, *o_t, *o_cls, *o_ttl, *o_next, *o_hits;
    long long n_keys, cap, bb;
    int policy, expiring;
    if (!PyArg_ParseTuple(args, "OOOOOOOOLLLip", &o_ids, &o_off, &o_ns, &o_t, &o_cls, &o_ttl,
                          &o_next, &o_hits, &n_keys, &cap, &bb, &policy, &expiring))
        return NULL;
    if (policy < 0 || policy >= P_COUNT) return PyErr_Format(PyExc_ValueError, "bad policy");
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
    int ok = pol_init(&p, policy, n_keys, bb, a.n_req) == 0 && res && cls_of;
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
    return out;
}

/* next_req[u] = index of the next request after u's that uses the same block
 * (-1: none); kvstore.sim.Future.of over interned ids. */
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
     "capacity_bytes, block_bytes, policy, expiring) -> dict"},
    {"next_uses", py_next_uses, METH_VARARGS, "next_uses(ids, offsets, out, n_keys)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_replaycore",
                                    "kvstore.sim's replay loop in C", -1, methods};

PyMODINIT_FUNC PyInit__replaycore(void) { return PyModule_Create(&module); }
