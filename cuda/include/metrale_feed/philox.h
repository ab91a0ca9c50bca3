/* Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): a
 * counter-based generator, so a draw is a pure function of (key, counter) with no state to carry
 * between calls, rows, devices or ranks. Integer arithmetic only: the same bits everywhere. */
#ifndef METRALE_FEED_PHILOX_H
#define METRALE_FEED_PHILOX_H

#include "metrale_feed/argmax_rule.h"

typedef struct mf_philox4 {
    uint32_t v[4];
} mf_philox4;

MF_HD void mf_mulhilo32(uint32_t a, uint32_t b, uint32_t *hi, uint32_t *lo) {
    uint64_t p = (uint64_t)a * (uint64_t)b;
    *hi = (uint32_t)(p >> 32);
    *lo = (uint32_t)p;
}

MF_HD mf_philox4 mf_philox4x32_10(mf_philox4 c, uint32_t k0, uint32_t k1) {
    for (int round = 0; round < 10; ++round) {
        if (round) {  /* the key schedule: Weyl increments between rounds */
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        uint32_t hi0, lo0, hi1, lo1;
        mf_mulhilo32(0xD2511F53u, c.v[0], &hi0, &lo0);
        mf_mulhilo32(0xCD9E8D57u, c.v[2], &hi1, &lo1);
        mf_philox4 n;
        n.v[0] = hi1 ^ c.v[1] ^ k0;
        n.v[1] = lo1;
        n.v[2] = hi0 ^ c.v[3] ^ k1;
        n.v[3] = lo0;
        c = n;
    }
    return c;
}

/* The 32 random bits of id v at (seed, position): word v % 4 of the block whose counter is
 * (v / 4, position, 0, 0) under the key (seed low, seed high). A pure function of its arguments,
 * whatever row, batch, backend or vocabulary split asks for it. */
MF_HD uint32_t mf_philox_bits(uint64_t seed, uint32_t position, uint32_t v) {
    mf_philox4 c;
    c.v[0] = v >> 2;
    c.v[1] = position;
    c.v[2] = 0u;
    c.v[3] = 0u;
    mf_philox4 r = mf_philox4x32_10(c, (uint32_t)seed, (uint32_t)(seed >> 32));
    return r.v[v & 3u];
}

#endif
