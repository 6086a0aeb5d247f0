/* The driver every few-row kernel (GEMV) shares: rows of x in passes of at most LEANLM_MAX_ROWS (each pass reads
 * the weight once), and each pass split over threads into contiguous ranges of whole blocks of weight rows.
 * A kernel supplies its pass as a function of (its arguments, m0, m, n_begin, n_end); every output element is
 * computed by one thread in the same order whatever the split, so results do not depend on the thread count. */
#ifndef LEANLM_ROW_DRIVER_H
#define LEANLM_ROW_DRIVER_H

#include <omp.h>
#include <stdint.h>

#define LEANLM_MAX_ROWS 8 /* rows of x handled per pass over W; larger M loops over passes */

/* Rows [m0, m0 + m) of x (m <= LEANLM_MAX_ROWS) against weight rows [n_begin, n_end). */
typedef void (*leanlm_pass_fn)(const void *args, int64_t m0, int64_t m, int64_t n_begin, int64_t n_end);

/* Threads for N weight rows in blocks of block_n: at most num_threads and one per block, and one when the weight
 * is smaller than min_parallel_bytes (waking the OpenMP pool would cost more than a second core saves). */
static inline int leanlm_pass_threads(int num_threads, int64_t N, int64_t block_n, int64_t weight_bytes,
                                      int64_t min_parallel_bytes) {
    const int64_t num_blocks = (N + block_n - 1) / block_n;
    int threads = num_threads < 1 ? 1 : num_threads;
    if (threads > num_blocks) threads = (int)num_blocks;
    return weight_bytes >= min_parallel_bytes ? threads : 1;
}

/* One pass on `threads` threads: each streams one contiguous range of whole blocks of W. */
static inline void leanlm_split_pass(leanlm_pass_fn pass, const void *args, int64_t m0, int64_t m, int64_t N,
                                     int64_t block_n, int threads) {
    if (threads <= 1) { /* no OpenMP call at all: even an if(0) parallel region costs ~1 us */
        pass(args, m0, m, 0, N);
        return;
    }
    const int64_t num_blocks = (N + block_n - 1) / block_n;
#pragma omp parallel num_threads(threads)
    {
        const int tid = omp_get_thread_num(), nthr = omp_get_num_threads();
        const int64_t n_begin = num_blocks * tid / nthr * block_n;
        int64_t n_end = num_blocks * (tid + 1) / nthr * block_n;
        if (n_end > N) n_end = N;
        if (n_begin < n_end) pass(args, m0, m, n_begin, n_end);
    }
}

/* All M rows: passes of at most LEANLM_MAX_ROWS, each split as leanlm_split_pass. */
static inline void leanlm_row_passes(leanlm_pass_fn pass, const void *args, int64_t M, int64_t N, int64_t block_n,
                                     int threads) {
    for (int64_t m0 = 0; m0 < M; m0 += LEANLM_MAX_ROWS) {
        const int64_t m = M - m0 < LEANLM_MAX_ROWS ? M - m0 : LEANLM_MAX_ROWS;
        leanlm_split_pass(pass, args, m0, m, N, block_n, threads);
    }
}

#endif
