/*
 * keyinit's key derivation and host-generator seeding in C, for keyed data and keyed forwards
 * (_kernels/fill/folds.py, _host/states.py): fill_kernels.c includes this file, so both are in the
 * fill library.
 *
 * keyinit_derive is keys.fold_in's Philox step; keyinit_mt_seed is MT19937's init_by_array, which
 * Python's random.seed and numpy.random.seed run on a key.
 */
#ifndef KEYINIT_FILL_KEYS_H
#define KEYINIT_FILL_KEYS_H

/* Included by fill_kernels.c after common/philox.h (ki_philox4x32_10) and its KI_API. */

/*
 * Key derivation (docs/spec.md section 3; keyinit.keys): Philox4x32-10 of the counter
 * (x0, x1, x2, x3) under (k0, k1), its words 0 and 1 returned as word0 | word1 << 32. fold_in(K, int d)
 * is the counter (lo32(d), hi32(d), 2, 0); fold_in(K, str s) is (h0, h1, 3, h2) (keys.fold_counter).
 */
KI_API uint64_t keyinit_derive(uint32_t k0, uint32_t k1, uint32_t x0, uint32_t x1, uint32_t x2, uint32_t x3)
{
    const uint32_t ctr[4] = {x0, x1, x2, x3};
    uint32_t out[4];
    ki_philox4x32_10(ctr, k0, k1, out);
    return (uint64_t)out[0] | ((uint64_t)out[1] << 32);
}

/*
 * The 624 state words of MT19937 seeded by init_by_array(key[0..n-1]), key = (k0, k1) and n = 1 or 2
 * (Matsumoto and Nishimura's mt19937ar.c, as CPython's random.seed and numpy.random.seed use it; the
 * position after it is 624). keyed_samples seeds Python's random and numpy.random with it, writing
 * their state in place.
 */
KI_API void keyinit_mt_seed(uint32_t k0, uint32_t k1, int n, uint32_t *mt)
{
    enum { N = 624 };
    const uint32_t key[2] = {k0, k1};
    if (n < 1 || n > 2) return;
    mt[0] = 19650218u;
    for (int i = 1; i < N; i++) mt[i] = 1812433253u * (mt[i - 1] ^ (mt[i - 1] >> 30)) + (uint32_t)i;
    int i = 1, j = 0;
    for (int k = N > n ? N : n; k; k--) {
        mt[i] = (mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1664525u)) + key[j] + (uint32_t)j;
        i++;
        j++;
        if (i >= N) {
            mt[0] = mt[N - 1];
            i = 1;
        }
        if (j >= n) j = 0;
    }
    for (int k = N - 1; k; k--) {
        mt[i] = (mt[i] ^ ((mt[i - 1] ^ (mt[i - 1] >> 30)) * 1566083941u)) - (uint32_t)i;
        i++;
        if (i >= N) {
            mt[0] = mt[N - 1];
            i = 1;
        }
    }
    mt[0] = 0x80000000u;
}

#endif
