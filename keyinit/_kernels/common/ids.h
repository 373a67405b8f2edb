/*
 * Distribution and dtype ids of the C kernels. They come from ONE table,
 * keyinit/_kernels/common/ids.py, which the Triton kernels import too; the build
 * (keyinit/_kernels/common/build.py) passes it to every compile as -D definitions:
 *
 *   KI_DIST_BITS, KI_DIST_UNIFORM, KI_DIST_NORMAL, KI_DIST_TRUNCATED_NORMAL,
 *   KI_DIST_BERNOULLI, KI_DIST_RANDINT, KI_DIST_COUNT;
 *   KI_DTYPE_FLOAT32, KI_DTYPE_FLOAT64, KI_DTYPE_BFLOAT16, KI_DTYPE_FLOAT16,
 *   KI_DTYPE_BOOL, KI_DTYPE_INT64, KI_DTYPE_INT32, KI_DTYPE_INT16, KI_DTYPE_INT8,
 *   KI_DTYPE_UINT8, KI_DTYPE_COUNT.
 *
 * Ids run from 0 to COUNT - 1. No kernel source defines an id of its own.
 */
#ifndef KEYINIT_IDS_H
#define KEYINIT_IDS_H

#if !defined(KI_DIST_COUNT) || !defined(KI_DTYPE_COUNT) || !defined(KI_DIST_RANDINT) || !defined(KI_DTYPE_UINT8)
#error "the kernel ids come from keyinit/_kernels/common/ids.py: build through keyinit._kernels.common.build"
#endif

#endif /* KEYINIT_IDS_H */
