/* One kernel of one linear layer y [M, N] = x [M, K] W^T + b as the native decode loop calls it: the kernel's
 * uniform entry and the layer's own tensors and settings, in the order that entry reads them. Every kernel
 * library exports such an entry next to its typed function; the loop holds two calls per linear (few rows,
 * many rows) and never knows the format. The ctypes mirror (native_linear.py) lays it out identically: every
 * field is 8 bytes, no padding. */
#ifndef LEANLM_LINEAR_CALL_H
#define LEANLM_LINEAR_CALL_H

#include <stdint.h>

#define LEANLM_CALL_TENSORS 6
#define LEANLM_CALL_INTS 2

typedef struct leanlm_linear_call leanlm_linear_call;

/* y [M, N] bf16 from x [M, K] bf16; min_parallel_bytes: the GEMVs' threshold for splitting over threads. */
typedef int (*leanlm_linear_fn)(const leanlm_linear_call *call, const uint16_t *x, uint16_t *y, int64_t M,
                                int64_t N, int64_t K, int threads, int64_t min_parallel_bytes);

struct leanlm_linear_call {
    leanlm_linear_fn fn; /* NULL: no kernel for these rows */
    const void *tensors[LEANLM_CALL_TENSORS]; /* the format's tensors (unused slots NULL) */
    int64_t ints[LEANLM_CALL_INTS];           /* the format's settings: group size, bits (unused slots 0) */
};

#endif
