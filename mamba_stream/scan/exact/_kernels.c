/* The exact backend's kernels (`_build.py` compiles this file, `_kernels.py` calls it).
 *
 * One rule makes every result independent of chunking, batching, threads and instruction set:
 * each output element is computed by the same sequence of IEEE-754 basic operations (+, -, *, /,
 * sqrt, rint, exact scaling by powers of two), in the same order, whatever else is computed
 * beside it. So: no fused multiply-add the source does not write (built with -ffp-contract=off:
 * the compiler never fuses; the exact-2 products' fused multiply-adds are written out, one IEEE
 * fusedMultiplyAdd each), no reassociation (no -ffast-math), every reduction sequential in a
 * fixed order, and the transcendental functions
 * written here from basic operations in double precision instead of taken from libm or a vector
 * library. Vectorization only ever runs independent elements side by side.
 *
 * Each kernel's torch twin, in the Python module of the same name as its part below (`_unary.c`:
 * `_unary.py`, ...), performs the same operations in the same order and gives the same bits;
 * tests/scan/exact/ holds each pair equal with torch.equal.
 *
 * Every kernel exists for float (suffix _f32) and double (_f64): `T` below.
 *
 * The parts are included, not compiled on their own: one translation unit, in this order (each
 * uses what the ones before it define), compiled as the single file they were split from.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
/* vectors passed between static functions of this file only: no ABI is crossed */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

typedef int64_t i64;

#include "_threading.c" /* the pool of helper threads: pool_run */
#include "_unary.c"     /* the transcendentals in double, and the elementwise functions */
#include "_products.c"  /* the products, every weight format, exact-1 and exact-2, and on the pool */
#include "_norms.c"     /* mean, RMSNorm, gated RMSNorm */
#include "_conv.c"      /* the causal conv */
#include "_scans.c"     /* selective scan, SSD, Mamba-3's angles and trapezoid */
#include "_step.c"      /* a Mamba-1 or Mamba-2 layer's decode step in one call */
