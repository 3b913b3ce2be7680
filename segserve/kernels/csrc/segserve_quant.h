/* What segserve_cpu.c calls in segserve_quant.c: the product of float32 rows with GGUF-block weights.
 * The weight-format codes are ggml's type ids (ggml.h's enum ggml_type), so the Python side passes the
 * GGUF file's own tensor_type; 0 (ggml's F32) stands for the plain dt weights sg_linear always took. */
#ifndef SEGSERVE_QUANT_H
#define SEGSERVE_QUANT_H

#include <stddef.h>
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
 * format.
 * Threads: the work is shared by the calling team through orphaned ``omp for`` loops (each ending in
 * the team's barrier); every thread of a parallel region must call it with the same arguments, or it is
 * called outside any region and runs on the calling thread alone. It opens no region of its own, so
 * the decode stack can run a whole step's products inside one (segserve_cpu.c). */
int sg_quant_matmul(int dt, int ydt, int wqt, int64_t M, int64_t N, int64_t K, const float *xf,
                    int64_t ldxf, const void *w, const void *bias, void *y, int64_t ldy, int accumulate);

/* The same product with integer activations (segserve_quant_vnni.c): each row of xf in blocks of 32
 * values rounded to 16-bit fixed point, (amax / 127 / 256) (256 q1 + q2) with q1, q2 int8 and the float32
 * step kept (each value off by at most amax / 32512), then integer dot products of q1 and q2 with the
 * stored nibbles or bytes (AVX-512 VNNI vpdpbusd), each block's sum scaled by the two blocks' scales in
 * float32 (Q4_1's m term times the rounded block's sum): the exact product of the dequantized weights
 * with the rounded x, up to float32 summation. Integer dot products with the weight blocks are
 * llama.cpp's approach (ggml-cpu's vec_dot kernels, there with 8-bit activations). Each row of x streams
 * the weights once: meant for one-row products. Arguments, shapes, returns and threads as
 * sg_quant_matmul, plus scratch: a buffer shared by the team, 64-byte aligned, of
 * sg_quant_i8_scratch_bytes(M, K) bytes, for the fixed-point rows; -1 also when the library was built
 * for a CPU without AVX-512 VNNI (see sg_quant_int8_built). */
int sg_quant_matmul_i8(int dt, int ydt, int wqt, int64_t M, int64_t N, int64_t K, const float *xf,
                       int64_t ldxf, const void *w, const void *bias, void *y, int64_t ldy, int accumulate,
                       void *scratch);

/* Bytes of sg_quant_matmul_i8's scratch for M rows of K values (a multiple of 64). */
size_t sg_quant_i8_scratch_bytes(int64_t M, int64_t K);

/* 1 when this library was compiled with AVX-512 VNNI (sg_quant_matmul_i8 works), else 0. */
int sg_quant_int8_built(void);

#endif
