/*
 * ggml_types.h: the GGUF tensor types the exact kernels read as stored, and their block sizes.
 *
 * Plain C, shared by the exact-gemm library (exact_gemm.c) and the MLX extension (exact_quant.cpp,
 * exact_layer.cpp), so both sides agree on what a row of blocks is. F32 (type 0) is not here: fp32
 * weights are multiplied by cblas_sgemm, never through exact_qgemm.
 */
#ifndef GGML_TYPES_H
#define GGML_TYPES_H

enum { /* ggml's type ids */
    GGML_TYPE_F16 = 1, GGML_TYPE_Q4_0 = 2, GGML_TYPE_Q4_1 = 3, GGML_TYPE_Q5_0 = 6, GGML_TYPE_Q5_1 = 7,
    GGML_TYPE_Q8_0 = 8, GGML_TYPE_Q4_K = 12, GGML_TYPE_Q5_K = 13, GGML_TYPE_Q6_K = 14, GGML_TYPE_BF16 = 30
};

/* Weights per block of type `fmt` (32, or 256 for a K-quant super-block); 0 for a type not read. */
static inline int ggml_type_weights(int fmt) {
    switch (fmt) {
    case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q6_K: return 256;
    case GGML_TYPE_F16: case GGML_TYPE_BF16: case GGML_TYPE_Q4_0: case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_0:
    case GGML_TYPE_Q5_1: case GGML_TYPE_Q8_0: return 32;
    default: return 0;
    }
}

/* Bytes per block of type `fmt` (ggml's type_size); 0 for a type not read. */
static inline int ggml_type_bytes(int fmt) {
    switch (fmt) {
    case GGML_TYPE_F16: case GGML_TYPE_BF16: return 64; /* 32 weights of 2 bytes */
    case GGML_TYPE_Q4_0: return 18;  /* fp16 d, 16 bytes of nibbles */
    case GGML_TYPE_Q4_1: return 20;  /* fp16 d, fp16 m, 16 bytes of nibbles */
    case GGML_TYPE_Q5_0: return 22;  /* fp16 d, 32 high bits, 16 bytes of nibbles */
    case GGML_TYPE_Q5_1: return 24;  /* fp16 d, fp16 m, 32 high bits, 16 bytes of nibbles */
    case GGML_TYPE_Q8_0: return 34;  /* fp16 d, 32 int8 */
    case GGML_TYPE_Q4_K: return 144; /* fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles */
    case GGML_TYPE_Q5_K: return 176; /* as Q4_K, then 32 bytes of high bits before the nibbles */
    case GGML_TYPE_Q6_K: return 210; /* 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, fp16 d */
    default: return 0;
    }
}

/* Bytes of one row of k weights of type `fmt`, or -1 when the type is not read or k is not whole blocks. */
static inline long ggml_row_bytes(int fmt, long k) {
    int per = ggml_type_weights(fmt);
    return per == 0 || k < 0 || k % per != 0 ? -1 : k / per * ggml_type_bytes(fmt);
}

#endif
