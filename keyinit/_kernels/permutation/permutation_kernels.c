/*
 * The keyed permutation of stream v1 (docs/spec.md section 16), for CPU tensors.
 * Bit-identical to keyinit/_draw/reference_permutation.py; integer arithmetic only.
 *
 *     b = bit_length(n - 1); rb = b / 2; lb = b - rb; x = (l << rb) | r
 *     round i (0..R-1, R = 12 if b <= 16 else 6): even i: l ^= F(i, r) & lmask;  odd i: r ^= F(i, l) & rmask
 *     F(i, v) = Philox4x32-10((v, i, 0, 0), Kp)[0]
 *     perm(p) = E(p), re-applied while >= n (cycle walking)
 *
 * Elements are processed in chunks of CHUNK, round by round over the chunk: the
 * round function of CHUNK independent elements is one ki_philox_first_words call
 * (philox.h's vector path); elements that must walk again are compacted and
 * processed the same way. Tasks of TASK positions run on parallel.h's pool.
 */
#include <stdint.h>

#include "../common/parallel.h"
#include "../common/philox.h"

/* rounds: 12 for domains of at most 16 bits, else 6 (spec section 16) */
#define KI_PERM_ROUNDS(b) ((b) <= 16 ? 12 : 6)
#define CHUNK 256
/* positions per task of the thread pool */
#define TASK 16384

#if CHUNK > KI_FIRST_WORDS_MAX
#error "CHUNK exceeds what ki_philox_first_words takes"
#endif

/* One Feistel pass (inverse: rounds reversed) of x[0..count) in place. */
static void feistel(uint32_t k0, uint32_t k1, int lb, int rb, int inverse, uint64_t *x, int count)
{
    uint32_t left[CHUNK], right[CHUNK], f[CHUNK];
    const uint32_t lmask = (uint32_t)((1ull << lb) - 1), rmask = (uint32_t)((1ull << rb) - 1);
    for (int j = 0; j < count; j++) {
        left[j] = (uint32_t)(x[j] >> rb);
        right[j] = (uint32_t)(x[j] & rmask);
    }
    const int rounds = KI_PERM_ROUNDS(lb + rb);
    for (int s = 0; s < rounds; s++) {
        int i = inverse ? rounds - 1 - s : s;
        if (i % 2 == 0) {
            ki_philox_first_words(right, (uint32_t)i, count, k0, k1, f);
            for (int j = 0; j < count; j++) left[j] ^= f[j] & lmask;
        } else {
            ki_philox_first_words(left, (uint32_t)i, count, k0, k1, f);
            for (int j = 0; j < count; j++) right[j] ^= f[j] & rmask;
        }
    }
    for (int j = 0; j < count; j++) x[j] = ((uint64_t)left[j] << rb) | right[j];
}

typedef struct {
    uint32_t k0, k1;
    int lb, rb, inverse;
    uint64_t n;
    const int64_t *positions; /* NULL: start + step * k */
    int64_t start, step;
    int64_t *out;
    int64_t count;
} job_t;

/* Positions begin .. end-1 of the job. */
static void run_range(const job_t *job, int64_t begin, int64_t end)
{
    uint64_t x[CHUNK], walk[CHUNK];
    int where[CHUNK];
    for (int64_t base = begin; base < end; base += CHUNK) {
        int count = (int)((end - base) < CHUNK ? (end - base) : CHUNK);
        for (int j = 0; j < count; j++)
            x[j] = job->positions ? (uint64_t)job->positions[base + j]
                                  : (uint64_t)(job->start + job->step * (base + j));
        feistel(job->k0, job->k1, job->lb, job->rb, job->inverse, x, count);
        int pending = 0;
        for (int j = 0; j < count; j++)
            if (x[j] >= job->n) {
                where[pending] = j;
                walk[pending++] = x[j];
            }
        while (pending) {
            feistel(job->k0, job->k1, job->lb, job->rb, job->inverse, walk, pending);
            int still = 0;
            for (int m = 0; m < pending; m++) {
                if (walk[m] >= job->n) {
                    where[still] = where[m];
                    walk[still++] = walk[m];
                } else {
                    x[where[m]] = walk[m];
                }
            }
            pending = still;
        }
        for (int j = 0; j < count; j++) job->out[base + j] = (int64_t)x[j];
    }
}

/* Task c: positions c*TASK .. (c+1)*TASK - 1 (ki_parallel_for's body). */
static void run_task(void *ctx, int64_t c)
{
    const job_t *job = (const job_t *)ctx;
    int64_t begin = c * TASK;
    run_range(job, begin, begin + TASK < job->count ? begin + TASK : job->count);
}

/*
 * out[k] = perm(p_k) (inverse = 0) or perm^-1(p_k) (inverse = 1) for k < count, where
 * p_k = positions[k] if positions is not NULL, else start + step * k. Every p_k must be
 * in [0, n), 2 <= n <= 2**62 (checked by the caller). Returns 0.
 */
int keyinit_permute(uint32_t k0, uint32_t k1, uint64_t n, int inverse, const int64_t *positions, int64_t start,
                    int64_t step, int64_t count, int64_t *out, int threads)
{
    int b = 64 - __builtin_clzll(n - 1);
    int rb = b / 2, lb = b - rb;
    job_t job = {k0, k1, lb, rb, inverse, n, positions, start, step, out, count};
    /* integer arithmetic only: the floating-point modes do not matter (clear_fp = 0) */
    ki_parallel_for((count + TASK - 1) / TASK, threads, 0, run_task, &job);
    return 0;
}
