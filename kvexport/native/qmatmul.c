/* kvexport's quantized weight matmul for ONNX Runtime's CPU execution provider.
 *
 * Op `QMatMul` in domain `ai.kvexport`: the inputs and attributes of com.microsoft `MatMulNBits` with 4 bits (or
 * 8, on AVX512-VNNI only), symmetric blocks (no zero points: a stored q stands for (q - 8) * scale at 4 bits,
 * (q - 128) * scale at 8), float scales, block_size a multiple of 32 dividing K: Y[M, N] = A[M, K] @ dequant(B)^T.
 * kvexport.native swaps it in for such MatMulNBits nodes when an engine is loaded; the artifact on disk keeps the
 * standard op.
 *
 * Why: at batch 1 a decode step streams every weight once, and ONNX Runtime's quantized kernels (MLAS, int8
 * compute) read their blocks below the memory's rate on the CPUs measured (docs/performance.md). Here the weights
 * are repacked once, when the session is made, so that one 512-bit vector holds 16 output rows x 4 k-steps: the dot
 * products need no horizontal reduction (one VNNI dpbusd per 16 rows x 4 values, u8 weights x s8 activations), and
 * a row group's block scales are one vector load. Activations are quantized to int8 per 32-block, as MLAS does at
 * accuracy_level 4 with blocks of 32.
 *
 * Packed layout, for row group g (rows 16g..16g+15, padded past N with zeros) and 32-block b, bits/8 * 512 bytes
 * at ((g * nb) + b) * 64 * bits:
 *   4 bits: byte [j * 64 + r * 4 + i] holds, for row r, the value at k = 32b + 8j + i in its low nibble and at
 *           k = 32b + 8j + 4 + i in its high nibble (j, i in 0..3);
 *   8 bits: byte [j * 64 + r * 4 + i] holds row r's value at k = 32b + 4j + i (j in 0..7);
 *   scales: 16 floats a row group and block of block_size (as stored: one per row), at
 *           ((g * K / block_size) + b / (block_size / 32)) * 16.
 *
 * Threading: ONNX Runtime's intra-op pool (KernelContext_ParallelFor), so `intra_op_num_threads` holds.
 */
#define _GNU_SOURCE /* madvise, MADV_HUGEPAGE */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <immintrin.h>
#include <sys/mman.h>

#include "onnxruntime_c_api.h"
#include "ops.h"

#define ROWS 16
#define QBLK 32
#define MTILE 64

static const OrtApi *g_ort = NULL;

typedef struct {
  int64_t K, N, nb, groups;
  uint8_t *w;    /* groups * nb * 256 */
  float *scale;  /* groups * nb * 16 */
  int isa;       /* 2: AVX512-VNNI, 1: AVX2 + FMA */
  int bits;      /* 4: 256 packed bytes a group and 32-block; 8: 512 */
  int32_t zp;    /* the stored value of zero: 8 or 128 */
  int64_t per;   /* 32-blocks a scale block (block_size / 32): one scale a row and block, as stored */
} QKernel;

/* ---------------------------------------------------------------- activation quantization (per 32-block) */

/* Each 32-block of a row: scale = amax / 127 (a NaN left out of amax), q = x * (127 / amax) rounded to nearest even
 * (cvtps2dq under the default rounding mode, as lrintf) and clipped to +-127, and the sum of the q (times the
 * weights' zero point, taken off once per block). */
__attribute__((target("avx512f,avx512bw"))) static void quantize_block_avx512(const float *x, int8_t *qo, float *s,
                                                                               int32_t *zsum) {
  const __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
  /* max(a, b) gives b where a is NaN: a NaN is left out of amax */
  const __m512 m = _mm512_max_ps(_mm512_abs_ps(x1), _mm512_max_ps(_mm512_abs_ps(x0), _mm512_setzero_ps()));
  const float amax = _mm512_reduce_max_ps(m), inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  const __m512i v0 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(inv))), lo), hi);
  const __m512i v1 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(inv))), lo), hi);
  _mm_storeu_si128((__m128i *)qo, _mm512_cvtepi32_epi8(v0));
  _mm_storeu_si128((__m128i *)(qo + 16), _mm512_cvtepi32_epi8(v1));
  *s = amax / 127.f;
  *zsum = _mm512_reduce_add_epi32(_mm512_add_epi32(v0, v1));
}

__attribute__((target("avx2,fma"))) static void quantize_block_avx2(const float *x, int8_t *qo, float *s,
                                                                    int32_t *zsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; i++) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i)), m);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  const float amax = _mm_cvtss_f32(h), inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i v[4], sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; i++) {
    v[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i),
                                                                              _mm256_set1_ps(inv))), lo), hi);
    sum = _mm256_add_epi32(sum, v[i]);
  }
  /* to bytes: the packs work per 128-bit lane, so the 32-bit groups come out as 0 4 1 5 2 6 3 7 */
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  _mm256_storeu_si256((__m256i *)qo, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(1, 0, 3, 2)));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1)));
  *s = amax / 127.f;
  *zsum = _mm_cvtsi128_si32(t);
}

static void quantize_rows(const float *a, int64_t m0, int64_t m1, int64_t K, int isa, int8_t *q, float *s,
                          int32_t *zsum) {
  const int64_t nb = K / QBLK;
  for (int64_t m = m0; m < m1; m++)
    for (int64_t b = 0; b < nb; b++) {
      const int64_t at = m * K + b * QBLK;
      if (isa == 2)
        quantize_block_avx512(a + at, q + at, s + m * nb + b, zsum + m * nb + b);
      else
        quantize_block_avx2(a + at, q + at, s + m * nb + b, zsum + m * nb + b);
    }
}

#define QUANT_ROWS 16 /* activation rows a quantizing task takes */

typedef struct {
  const float *a;
  int64_t M, K;
  int isa;
  int8_t *q;
  float *s;
  int32_t *zsum;
} QuantJob;

static void quantize_task(void *data, size_t i) {
  const QuantJob *Q = (const QuantJob *)data;
  const int64_t m0 = (int64_t)i * QUANT_ROWS, m1 = m0 + QUANT_ROWS < Q->M ? m0 + QUANT_ROWS : Q->M;
  quantize_rows(Q->a, m0, m1, Q->K, Q->isa, Q->q, Q->s, Q->zsum);
}

/* ---------------------------------------------------------------- kernels: row groups [g0, g1) x rows [m0, m1) */

typedef struct {
  const QKernel *k;
  const int8_t *q;
  const float *s;
  const int32_t *zsum;
  float *y;
  int64_t M, chunks_g, gchunk, mtiles;
} Job;

__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void run_avx512(const Job *J, int64_t g0, int64_t g1,
                                                                               int64_t m0, int64_t m1) {
  const QKernel *k = J->k;
  const int64_t nb = k->nb, K = k->K, N = k->N;
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MTILE];
  for (int64_t g = g0; g < g1; g++) {
    const uint8_t *w = k->w + g * nb * 64 * k->bits;
    const float *ws = k->scale + g * (nb / k->per) * ROWS;
    for (int64_t m = m0; m < m1; m++) acc[m - m0] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
      __m512i w0, w1, w2, w3, w4, w5, w6, w7;
      if (k->bits == 4) {
        const uint8_t *wb = w + b * 256;
        _mm_prefetch((const char *)(wb + 1024), _MM_HINT_T0);
        _mm_prefetch((const char *)(wb + 1024 + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(wb + 1024 + 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(wb + 1024 + 192), _MM_HINT_T0);
        __m512i v0 = _mm512_loadu_si512(wb), v1 = _mm512_loadu_si512(wb + 64);
        __m512i v2 = _mm512_loadu_si512(wb + 128), v3 = _mm512_loadu_si512(wb + 192);
        w0 = _mm512_and_si512(v0, lo4), w1 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), lo4);
        w2 = _mm512_and_si512(v1, lo4), w3 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), lo4);
        w4 = _mm512_and_si512(v2, lo4), w5 = _mm512_and_si512(_mm512_srli_epi16(v2, 4), lo4);
        w6 = _mm512_and_si512(v3, lo4), w7 = _mm512_and_si512(_mm512_srli_epi16(v3, 4), lo4);
      } else {
        const uint8_t *wb = w + b * 512;
        for (int p = 0; p < 8; p++) _mm_prefetch((const char *)(wb + 2048 + p * 64), _MM_HINT_T0);
        w0 = _mm512_loadu_si512(wb), w1 = _mm512_loadu_si512(wb + 64);
        w2 = _mm512_loadu_si512(wb + 128), w3 = _mm512_loadu_si512(wb + 192);
        w4 = _mm512_loadu_si512(wb + 256), w5 = _mm512_loadu_si512(wb + 320);
        w6 = _mm512_loadu_si512(wb + 384), w7 = _mm512_loadu_si512(wb + 448);
      }
      const __m512 sw = _mm512_loadu_ps(ws + (b / k->per) * ROWS);
      for (int64_t m = m0; m < m1; m++) {
        const int32_t *x = (const int32_t *)(J->q + m * K + b * QBLK);
        __m512i d = _mm512_set1_epi32(-k->zp * J->zsum[m * nb + b]);
        d = _mm512_dpbusd_epi32(d, w0, _mm512_set1_epi32(x[0]));
        d = _mm512_dpbusd_epi32(d, w1, _mm512_set1_epi32(x[1]));
        d = _mm512_dpbusd_epi32(d, w2, _mm512_set1_epi32(x[2]));
        d = _mm512_dpbusd_epi32(d, w3, _mm512_set1_epi32(x[3]));
        d = _mm512_dpbusd_epi32(d, w4, _mm512_set1_epi32(x[4]));
        d = _mm512_dpbusd_epi32(d, w5, _mm512_set1_epi32(x[5]));
        d = _mm512_dpbusd_epi32(d, w6, _mm512_set1_epi32(x[6]));
        d = _mm512_dpbusd_epi32(d, w7, _mm512_set1_epi32(x[7]));
        const __m512 sc = _mm512_mul_ps(sw, _mm512_set1_ps(J->s[m * nb + b]));
        acc[m - m0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sc, acc[m - m0]);
      }
    }
    const int64_t n0 = g * ROWS, rows = N - n0 < ROWS ? N - n0 : ROWS;
    const __mmask16 mask = (__mmask16)((1u << rows) - 1u);
    for (int64_t m = m0; m < m1; m++) _mm512_mask_storeu_ps(J->y + m * N + n0, mask, acc[m - m0]);
  }
}

/* AVX2 (4-bit only): the same packed layout, each 64-byte vector taken as two halves of 8 rows; u8 x s8 through
 * maddubs, whose pair sums (at most 15 * 127 * 2 = 3810) the 8 vectors of a 32-block add in 16 bits without
 * overflow (8 * 3810 = 30480 < 32767), then one madd with ones widens them to the 4-value sums. */
__attribute__((target("avx2,fma"))) static inline __m256i dot2_avx2(__m256i w, int32_t x) {
  return _mm256_maddubs_epi16(w, _mm256_set1_epi32(x));
}

__attribute__((target("avx2,fma"))) static void run_avx2(const Job *J, int64_t g0, int64_t g1, int64_t m0,
                                                         int64_t m1) {
  const QKernel *k = J->k;
  const int64_t nb = k->nb, K = k->K, N = k->N;
  const __m256i lo4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MTILE][2];
  float tmp[ROWS];
  for (int64_t g = g0; g < g1; g++) {
    const uint8_t *w = k->w + g * nb * 64 * k->bits;
    const float *ws = k->scale + g * (nb / k->per) * ROWS;
    for (int64_t m = m0; m < m1; m++) acc[m - m0][0] = acc[m - m0][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
      const uint8_t *wb = w + b * 64 * k->bits;
      for (int p = 0; p < k->bits; p++) /* a 32-block's 4 or 8 lines, four blocks ahead */
        _mm_prefetch((const char *)(wb + 4 * 64 * k->bits + p * 64), _MM_HINT_T0);
      for (int h = 0; h < 2; h++) {
        __m256i u[8];
        if (k->bits == 4) {
          for (int j = 0; j < 4; j++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(wb + j * 64 + h * 32));
            u[2 * j] = _mm256_and_si256(v, lo4);
            u[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
          }
        } else {
          for (int j = 0; j < 8; j++) u[j] = _mm256_loadu_si256((const __m256i *)(wb + j * 64 + h * 32));
        }
        const __m256 sw = _mm256_loadu_ps(ws + (b / k->per) * ROWS + h * 8);
        for (int64_t m = m0; m < m1; m++) {
          const int32_t *x = (const int32_t *)(J->q + m * K + b * QBLK);
          __m256i d16 = dot2_avx2(u[0], x[0]);
          for (int j = 1; j < 8; j++) d16 = _mm256_add_epi16(d16, dot2_avx2(u[j], x[j]));
          const __m256i d = _mm256_sub_epi32(_mm256_madd_epi16(d16, ones),
                                             _mm256_set1_epi32(k->zp * J->zsum[m * nb + b]));
          const __m256 sc = _mm256_mul_ps(sw, _mm256_set1_ps(J->s[m * nb + b]));
          acc[m - m0][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), sc, acc[m - m0][h]);
        }
      }
    }
    const int64_t n0 = g * ROWS, rows = N - n0 < ROWS ? N - n0 : ROWS;
    for (int64_t m = m0; m < m1; m++) {
      _mm256_storeu_ps(tmp, acc[m - m0][0]);
      _mm256_storeu_ps(tmp + 8, acc[m - m0][1]);
      memcpy(J->y + m * N + n0, tmp, (size_t)rows * sizeof(float));
    }
  }
}

static void job_part(void *data, size_t i) {
  const Job *J = (const Job *)data;
  const int64_t mt = (int64_t)i / J->chunks_g, gc = (int64_t)i % J->chunks_g;
  const int64_t g0 = gc * J->gchunk, g1 = g0 + J->gchunk < J->k->groups ? g0 + J->gchunk : J->k->groups;
  const int64_t m0 = mt * MTILE, m1 = m0 + MTILE < J->M ? m0 + MTILE : J->M;
  if (J->k->isa == 2)
    run_avx512(J, g0, g1, m0, m1);
  else
    run_avx2(J, g0, g1, m0, m1);
}

/* ---------------------------------------------------------------- ONNX Runtime glue */

/* KVEXPORT_QMATMUL_ISA=avx2 takes the AVX2 kernel on a CPU that has AVX512-VNNI too (the tests run both where
 * they can). */
static int cpu_isa(void) {
  __builtin_cpu_init();
  const char *ask = getenv("KVEXPORT_QMATMUL_ISA");
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni") && !(ask != NULL && strcmp(ask, "avx2") == 0))
    return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
  return 0;
}

static OrtStatus *fail(const char *msg) { return kvx_fail(g_ort, msg); }

static void free_kernel(QKernel *k) {
  if (k == NULL) return;
  free(k->w);
  free(k->scale);
  free(k);
}

/* Memory for the packed weights. With `huge` (the node's attribute huge_pages, 1 unless set to 0: kvexport's load
 * option of that name), 2 MiB aligned and marked for transparent huge pages before it is first written, so that a
 * step's stream of weights takes few TLB misses (where the system's THP mode is `madvise` or `always`; elsewhere
 * the advice is ignored). */
static void *alloc_packed(size_t bytes, int huge) {
  const size_t page = (size_t)2 << 20;
  void *p = NULL;
  if (!huge || bytes < page) return aligned_alloc(64, (bytes + 63) / 64 * 64);
  bytes = (bytes + page - 1) / page * page;
  if (posix_memalign(&p, page, bytes) != 0) return NULL;
#ifdef MADV_HUGEPAGE
  madvise(p, bytes, MADV_HUGEPAGE);
#endif
  return p;
}

static OrtStatus *repack(QKernel *k, const uint8_t *B, const float *S, int64_t block, int huge) {
  const int64_t nb = k->nb, bytes_row = k->K * k->bits / 8, sblocks = k->K / block;
  const int64_t gb = 64 * k->bits; /* packed bytes a group and 32-block */
  k->w = (uint8_t *)alloc_packed((size_t)(k->groups * nb * gb), huge);
  k->scale = (float *)alloc_packed((size_t)(k->groups * sblocks * ROWS * sizeof(float)), huge);
  if (k->w == NULL || k->scale == NULL) return g_ort->CreateStatus(ORT_FAIL, "QMatMul: out of memory");
  memset(k->w, k->bits == 4 ? 0x88 : 0x80, (size_t)(k->groups * nb * gb)); /* padding rows hold zeros */
  memset(k->scale, 0, (size_t)(k->groups * sblocks * ROWS * sizeof(float)));
  for (int64_t n = 0; n < k->N; n++) {
    const int64_t g = n / ROWS, r = n % ROWS;
    const uint8_t *row = B + n * bytes_row; /* MatMulNBits: 4 bits: element k in byte k/2, low nibble first */
    for (int64_t b = 0; b < nb; b++) {
      uint8_t *dst = k->w + (g * nb + b) * gb + r * 4;
      if (k->bits == 4) {
        uint8_t q[QBLK];
        for (int i = 0; i < QBLK / 2; i++) {
          q[2 * i] = row[b * 16 + i] & 0x0F;
          q[2 * i + 1] = row[b * 16 + i] >> 4;
        }
        for (int j = 0; j < 4; j++)
          for (int i = 0; i < 4; i++) dst[j * 64 + i] = (uint8_t)(q[8 * j + i] | (q[8 * j + 4 + i] << 4));
      } else { /* 8 bits: vector j holds k = 32b + 4j .. 32b + 4j + 3 of each row */
        for (int j = 0; j < 8; j++) memcpy(dst + j * 64, row + b * QBLK + 4 * j, 4);
      }
    }
    for (int64_t sb = 0; sb < sblocks; sb++) k->scale[(g * sblocks + sb) * ROWS + r] = S[n * sblocks + sb];
  }
  return NULL;
}

static OrtStatus *ORT_API_CALL create_kernel(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info,
                                             void **out) {
  (void)op;
  (void)api;
  int64_t K = 0, N = 0, bits = 0, block = 0;
  RETURN_IF(g_ort->KernelInfoGetAttribute_int64(info, "K", &K));
  RETURN_IF(g_ort->KernelInfoGetAttribute_int64(info, "N", &N));
  RETURN_IF(g_ort->KernelInfoGetAttribute_int64(info, "bits", &bits));
  RETURN_IF(g_ort->KernelInfoGetAttribute_int64(info, "block_size", &block));
  int64_t huge = 1;
  OrtStatus *absent = g_ort->KernelInfoGetAttribute_int64(info, "huge_pages", &huge);
  if (absent != NULL) {
    g_ort->ReleaseStatus(absent);
    huge = 1;
  }
  if (bits != 4 && bits != 8) return fail("QMatMul: bits must be 4 or 8");
  if (block < QBLK || block % QBLK != 0 || K % block != 0)
    return fail("QMatMul: block_size must be a multiple of 32 dividing K");
  const int isa = cpu_isa();
  if (isa == 0) return fail("QMatMul: this CPU has neither AVX512-VNNI nor AVX2+FMA");
  /* AVX2's maddubs would saturate on 8-bit weights (255 * 127 * 2 > 32767) */
  if (bits == 8 && isa != 2) return fail("QMatMul: 8-bit weights need AVX512-VNNI");
  const OrtValue *bv = NULL, *sv = NULL;
  int bconst = 0, sconst = 0;
  RETURN_IF(g_ort->KernelInfoGetConstantInput_tensor(info, 1, &bconst, &bv));
  RETURN_IF(g_ort->KernelInfoGetConstantInput_tensor(info, 2, &sconst, &sv));
  if (!bconst || !sconst || bv == NULL || sv == NULL) return fail("QMatMul: weights and scales must be initializers");
  int64_t dims[8];
  size_t rank = 0;
  ONNXTensorElementDataType type;
  int64_t count = 1;
  RETURN_IF(kvx_dims(g_ort, bv, dims, &rank, &type));
  for (size_t i = 0; i < rank; i++) count *= dims[i];
  if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 || count != N * K * bits / 8)
    return fail("QMatMul: B is not N x K*bits/8 uint8");
  RETURN_IF(kvx_dims(g_ort, sv, dims, &rank, &type));
  count = 1;
  for (size_t i = 0; i < rank; i++) count *= dims[i];
  if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || count != N * (K / block))
    return fail("QMatMul: scales are not N x K/block_size float");
  void *bp = NULL, *sp = NULL;
  RETURN_IF(g_ort->GetTensorMutableData((OrtValue *)bv, &bp));
  RETURN_IF(g_ort->GetTensorMutableData((OrtValue *)sv, &sp));
  QKernel *k = (QKernel *)calloc(1, sizeof(QKernel));
  if (k == NULL) return g_ort->CreateStatus(ORT_FAIL, "QMatMul: out of memory");
  k->K = K;
  k->N = N;
  k->nb = K / QBLK;
  k->groups = (N + ROWS - 1) / ROWS;
  k->isa = isa;
  k->bits = (int)bits;
  k->zp = bits == 4 ? 8 : 128;
  k->per = block / QBLK;
  OrtStatus *st = repack(k, (const uint8_t *)bp, (const float *)sp, block, huge != 0);
  if (st != NULL) {
    free_kernel(k);
    return st;
  }
  *out = k;
  return NULL;
}

static OrtStatus *ORT_API_CALL compute(void *kernel, OrtKernelContext *ctx) {
  const QKernel *k = (const QKernel *)kernel;
  const OrtValue *av = NULL;
  RETURN_IF(g_ort->KernelContext_GetInput(ctx, 0, &av));
  int64_t dims[8];
  size_t rank = 0;
  ONNXTensorElementDataType type;
  RETURN_IF(kvx_dims(g_ort, av, dims, &rank, &type));
  if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) return fail("QMatMul: A must be float");
  if (rank < 1 || dims[rank - 1] != k->K) return fail("QMatMul: A's last dimension is not K");
  int64_t M = 1;
  for (size_t i = 0; i + 1 < rank; i++) M *= dims[i];
  dims[rank - 1] = k->N;
  OrtValue *yv = NULL;
  RETURN_IF(g_ort->KernelContext_GetOutput(ctx, 0, dims, rank, &yv));
  if (M == 0) return NULL;
  void *ap = NULL, *yp = NULL;
  RETURN_IF(g_ort->GetTensorMutableData((OrtValue *)av, &ap));
  RETURN_IF(g_ort->GetTensorMutableData(yv, &yp));
  const int64_t nb = k->nb;
  int8_t *q = (int8_t *)malloc((size_t)(M * k->K) + (size_t)(M * nb) * (sizeof(float) + sizeof(int32_t)));
  if (q == NULL) return g_ort->CreateStatus(ORT_FAIL, "QMatMul: out of memory");
  float *s = (float *)(q + M * k->K);
  int32_t *zsum = (int32_t *)(s + M * nb);
  OrtStatus *st = NULL;
  if (M <= QUANT_ROWS) /* a decode step's row or few: not worth the pool */
    quantize_rows((const float *)ap, 0, M, k->K, k->isa, q, s, zsum);
  else {
    QuantJob Q = {(const float *)ap, M, k->K, k->isa, q, s, zsum};
    st = g_ort->KernelContext_ParallelFor(ctx, quantize_task, (size_t)((M + QUANT_ROWS - 1) / QUANT_ROWS), 0, &Q);
  }
  if (st != NULL) {
    free(q);
    return st;
  }
  Job J = {k, q, s, zsum, (float *)yp, M, 0, 0, (M + MTILE - 1) / MTILE};
  /* 8 row groups (128 rows) a task: enough tasks to balance two to a few dozen threads, few enough to keep
   * each one's weights a long sequential stream */
  J.gchunk = 8;
  J.chunks_g = (k->groups + J.gchunk - 1) / J.gchunk;
  st = g_ort->KernelContext_ParallelFor(ctx, job_part, (size_t)(J.chunks_g * J.mtiles), 0, &J);
  free(q);
  return st;
}

static void ORT_API_CALL destroy(void *kernel) { free_kernel((QKernel *)kernel); }

static const char *ORT_API_CALL op_name(const OrtCustomOp *op) {
  (void)op;
  return "QMatMul";
}
static ONNXTensorElementDataType ORT_API_CALL in_type(const OrtCustomOp *op, size_t i) {
  (void)op;
  return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static size_t ORT_API_CALL in_count(const OrtCustomOp *op) {
  (void)op;
  return 3;
}
static ONNXTensorElementDataType ORT_API_CALL out_type(const OrtCustomOp *op, size_t i) {
  (void)op;
  (void)i;
  return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
}
static size_t ORT_API_CALL out_count(const OrtCustomOp *op) {
  (void)op;
  return 1;
}

static OrtCustomOp g_op;
static OrtCustomOpDomain *g_domain = NULL;

/* Entry point for SessionOptions.register_custom_ops_library: QMatMul here, Int8CacheAttention and
 * Fp32CacheAttention (attention.c). */
OrtStatus *ORT_API_CALL RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
  if (g_ort == NULL) {
    g_ort = base->GetApi(ORT_API_VERSION);
    if (g_ort == NULL) return NULL; /* cannot even make a status: ONNX Runtime older than the header */
    kvx_common(&g_op);
    g_op.GetName = op_name;
    g_op.GetInputType = in_type;
    g_op.GetInputTypeCount = in_count;
    g_op.GetOutputType = out_type;
    g_op.GetOutputTypeCount = out_count;
    g_op.CreateKernelV2 = create_kernel;
    g_op.KernelComputeV2 = compute;
    g_op.KernelDestroy = destroy;
    RETURN_IF(g_ort->CreateCustomOpDomain("ai.kvexport", &g_domain));
    RETURN_IF(g_ort->CustomOpDomain_Add(g_domain, &g_op));
    RETURN_IF(g_ort->CustomOpDomain_Add(g_domain, kvx_attention_op(g_ort, 0)));
    RETURN_IF(g_ort->CustomOpDomain_Add(g_domain, kvx_attention_op(g_ort, 1)));
  }
  return g_ort->AddCustomOpDomain(options, g_domain);
}
