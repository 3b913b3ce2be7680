/* What segserve_cpu.c calls in segserve_quant.c: the product of float32 rows with GGUF-block weights.
 * The weight-format codes are ggml's type ids (ggml.h's enum ggml_type), so the Python side passes the
 * GGUF file's own tensor_type; 0 (ggml's F32) stands for the plain dt weights sg_linear always took. */
#ifndef SEGSERVE_QUANT_H
#define SEGSERVE_QUANT_H

#include <stdint.h>

enum { WQT_DENSE = 0, WQT_Q4_0 = 2, WQT_Q4_1 = 3, WQT_Q8_0 = 8 };

/* Bytes of one 32-value block of format wqt, 0 for a format these kernels do not take. */
int64_t sg_quant_block_bytes(int wqt);

/* y[m, n] (= or +=) dequant(w)[n, :] . xf[m, :] (+ bias[n]) for m < M, n < N, float32 accumulation of
 * the exact dequantized weights (sum order: 16 lanes per block half, then the lanes).
 *   dt        dtype of bias and of the product's rounding (DT_F32 / DT_BF16 of segserve_cpu.c)
 *   ydt       dtype of y
 *   wqt       WQT_Q4_0, WQT_Q4_1 or WQT_Q8_0
 *   xf        (M, K) float32 rows with row stride ldxf (elements)
 *   w         (N, K / 32) blocks, row after row
 *   bias      (N,) dt or NULL
 *   y         (M, N) with row stride ldy; accumulate: y = round(y + round(product)), as sg_linear
 * K must be a positive multiple of 32, N >= 1, M >= 1. Returns 0, or -1 (ERR_SHAPE) on a bad shape or
 * format. */
int sg_quant_matmul(int dt, int ydt, int wqt, int64_t M, int64_t N, int64_t K, const float *xf,
                    int64_t ldxf, const void *w, const void *bias, void *y, int64_t ldy, int accumulate);

#endif
