/*
 * The thread pool of keyinit's C kernels: ki_parallel_for runs body(ctx, c) for
 * every chunk c in [0, nchunks) on up to nthreads threads (the calling thread
 * included), each thread taking the next chunk from an atomic counter. A thread
 * that cannot be started is simply not used. Kernels make every chunk a pure
 * function of its index, so values never depend on the thread count or on
 * which thread ran which chunk.
 *
 * Floating-point environment: with clear_fp, every thread (the caller too)
 * clears flush-to-zero and denormals-are-zero while it computes and restores
 * its own state afterwards (x86; elsewhere a no-op), so the caller's modes
 * cannot change a value. ki_fp_enter / ki_fp_leave do the same for code that
 * runs outside the pool.
 */
#ifndef KEYINIT_PARALLEL_H
#define KEYINIT_PARALLEL_H

#include <pthread.h>
#include <stdint.h>

#define KI_MAX_THREADS 256

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define KI_MXCSR_FTZ_DAZ 0x8040u
typedef unsigned int ki_fpstate_t;
static inline ki_fpstate_t ki_fp_enter(void)
{
    ki_fpstate_t saved = _mm_getcsr();
    _mm_setcsr(saved & ~KI_MXCSR_FTZ_DAZ);
    return saved;
}
static inline void ki_fp_leave(ki_fpstate_t saved) { _mm_setcsr(saved); }
#else
typedef int ki_fpstate_t;
static inline ki_fpstate_t ki_fp_enter(void) { return 0; }
static inline void ki_fp_leave(ki_fpstate_t saved) { (void)saved; }
#endif

typedef void (*ki_chunk_fn)(void *ctx, int64_t chunk);

typedef struct {
    ki_chunk_fn body;
    void *ctx;
    int64_t nchunks;
    int clear_fp;
    int64_t next __attribute__((aligned(64)));
} ki_pool_t;

static void *ki_pool_worker(void *arg)
{
    ki_pool_t *pool = (ki_pool_t *)arg;
    ki_fpstate_t saved = 0;
    if (pool->clear_fp) saved = ki_fp_enter();
    for (;;) {
        int64_t c = __atomic_fetch_add(&pool->next, 1, __ATOMIC_RELAXED);
        if (c >= pool->nchunks) break;
        pool->body(pool->ctx, c);
    }
    if (pool->clear_fp) ki_fp_leave(saved);
    return NULL;
}

static void ki_parallel_for(int64_t nchunks, int nthreads, int clear_fp, ki_chunk_fn body, void *ctx)
{
    if (nchunks <= 0) return;
    ki_pool_t pool = {.body = body, .ctx = ctx, .nchunks = nchunks, .clear_fp = clear_fp, .next = 0};
    if (nthreads > nchunks) nthreads = (int)nchunks;
    if (nthreads < 1) nthreads = 1;
    if (nthreads > KI_MAX_THREADS) nthreads = KI_MAX_THREADS;
    pthread_t threads[KI_MAX_THREADS];
    int started = 0;
    for (int t = 1; t < nthreads; t++) {
        if (pthread_create(&threads[started], NULL, ki_pool_worker, &pool) != 0) break;
        started++;
    }
    ki_pool_worker(&pool);
    for (int t = 0; t < started; t++) pthread_join(threads[t], NULL);
}

#endif /* KEYINIT_PARALLEL_H */
