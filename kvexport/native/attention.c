/* kvexport's attention over an int8 KV cache, for ONNX Runtime's CPU execution provider.
 *
 * Op `Int8CacheAttention` in domain `ai.kvexport`: the inputs, outputs and meaning of com.microsoft
 * `GroupQueryAttention` with kv_cache_bit_width 8 (ONNX Runtime 1.31): query (packed q|k|v, or q with key and value
 * apart), past_key/past_value int8 (B, H_kv, max_seq, D) sharing their buffer with present_key/present_value,
 * seqlens_k, total_sequence_length, cos/sin caches with position_ids (do_rotary, rotate-half), attention_bias, and
 * k_scale/v_scale per tensor (1) or per channel (1, H_kv, 1, D). A new token's key is rotated (as MLAS rotates,
 * fused multiply-add for multiply-add), stored as round(x * (1 / scale)) clipped to int8 at row
 * seqlens_k - S + 1 + s, and every query token attends over rows 0 .. its own, read as q * scale. Where present is
 * not bound to past's buffer, the held rows are copied into it and the rows past the new ones left zero. Not taken:
 * non-causal attention, softcap, local windows, smooth softmax, head sinks, qk output, interleaved rotation
 * (kvexport.native swaps only the nodes without them).
 *
 * Op `Fp32CacheAttention`, same domain: the same for a float cache (GroupQueryAttention without kv_cache_bit_width;
 * no k_scale/v_scale): the new rows stored as they come (the key rotated), the attention read from the rows where
 * they lie. One kernel serves both, the cache's element type a constant of it.
 *
 * Why: at a long context a decode step reads the whole cache once, and on the Zen 4 measured ONNX Runtime 1.31's CPU
 * kernel spends on an int8 cache about what it spends on an fp32 one four times its size (docs/backends/cpu.md).
 * Here each task takes one KV head and a run of cache rows for every query head of its group: 16 rows at a time
 * are widened to float once, their dot products with the group's queries (the key scale and softmax scale folded
 * into the query) come out of 16 accumulators reduced together, the softmax is taken over the run, and the value
 * rows are summed with the weights; the runs' partial results (max, sum, weighted values) are merged after, the
 * value scale applied once per channel. The cache is read once, in order, by 512-row runs spread over ONNX
 * Runtime's intra-op threads.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <immintrin.h>

#include "onnxruntime_c_api.h"
#include "ops.h"
#include "simd_math.h"

#define RUN 512      /* cache rows a task */
#define MAX_GROUP 16 /* query heads a KV head */
#define MAX_D 256

static const OrtApi *g_ort = NULL;

typedef struct {
  int64_t H, KV;
  float scale; /* 0: 1 / sqrt(D) */
  int rotary;
  int isa; /* cpu_isa() */
  int f32; /* Fp32CacheAttention: the cache is float, no scales */
} AKernel;

/* ---------------------------------------------------------------- helpers */

static OrtStatus *fail(const char *msg) { return kvx_fail(g_ort, msg); }

static int64_t count_of(const int64_t *dims, size_t rank) {
  int64_t n = 1;
  for (size_t i = 0; i < rank; i++) n *= dims[i];
  return n;
}


static OrtStatus *data_of(const OrtValue *v, void **p) {
  *p = NULL;
  return v == NULL ? NULL : g_ort->GetTensorMutableData((OrtValue *)v, p);
}

/* ---------------------------------------------------------------- the new rows: rotate, quantize, store */

/* MLAS's rotate-half, a fused multiply-add for each multiply-add as its vector kernels compute it, so that the
 * bytes stored match what ONNX Runtime's kernel stores. */
__attribute__((target("avx2,fma"))) static void rotate(const float *x, const float *cs, const float *sn,
                                                         int64_t half, int64_t D, float *out) {
  for (int64_t i = 0; i < half; i++) {
    const float re = x[i], im = x[i + half];
    out[i] = fmaf(re, cs[i], -(im * sn[i]));
    out[i + half] = fmaf(re, sn[i], im * cs[i]);
  }
  for (int64_t i = 2 * half; i < D; i++) out[i] = x[i];
}

static void quantize_row(const float *x, const float *scale, int64_t D, int8_t *q) {
  for (int64_t d = 0; d < D; d++) {
    float v = nearbyintf(x[d] * (1.0f / scale[d]));
    v = v < -128.f ? -128.f : (v > 127.f ? 127.f : (v == v ? v : 0.f)); /* NaN (a zero scale): 0, not UB */
    q[d] = (int8_t)v;
  }
}

/* ---------------------------------------------------------------- attention over runs of cache rows */

typedef struct {
  int64_t B, S, H, KV, G, D, max_seq, runs;
  const void *kc, *vc;   /* present caches (B, KV, max_seq, D): int8, or float where f32 */
  const float *q;        /* (B, S, H, D): rotated, times the key scale and the softmax scale */
  const int64_t *last;   /* (B, S): the last row each query token attends to */
  const float *bias;     /* attention_bias or NULL: bias[b * bb + h * bh + s * bs + j] */
  int64_t bb, bh, bs;
  float *part; /* per task and head of its group: max, sum, weighted values (D) */
  int isa, f32;
} AJob;

static inline __mmask16 first(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }

/* 16 cache rows (int8, stride D) -> float, zeros past the first n */
__attribute__((target("avx512f"))) static inline void widen16(const int8_t *rows, int64_t n, int64_t NV, float *out) {
  for (int64_t r = 0; r < 16; r++)
    for (int64_t c = 0; c < NV; c++) {
      const __m512 v = r < n ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(rows + (r * NV + c) * 16))))
                             : _mm512_setzero_ps();
      _mm512_storeu_ps(out + (r * NV + c) * 16, v);
    }
}

/* W rows of a float cache from row r0 of a run of n (stride D), zeros past the run: read where they lie but for the
 * run's last block, copied into `wide` so that nothing past the buffer is read */
static inline const float *float_rows(const float *cache, int64_t r0, int64_t n, int64_t D, int64_t W, float *wide) {
  const float *rows = cache + r0 * D;
  if (n - r0 >= W) return rows;
  memcpy(wide, rows, (size_t)((n - r0) * D) * sizeof(float));
  memset(wide + (n - r0) * D, 0, (size_t)((W - (n - r0)) * D) * sizeof(float));
  return wide;
}

/* 16 cache rows from row r0 of a run of n as float (stride D), zeros past the run */
__attribute__((target("avx512f"), always_inline)) static inline const float *rows16(const void *cache, int64_t r0,
                                                                                   int64_t n, int64_t NV, int F32,
                                                                                   float *wide) {
  if (F32) return float_rows((const float *)cache, r0, n, NV * 16, 16, wide);
  widen16((const int8_t *)cache + r0 * NV * 16, n - r0, NV, wide);
  return wide;
}

__attribute__((target("avx512f,fma"), always_inline)) static inline void attend_run(const AJob *J, size_t task,
                                                                                   const int64_t NV, const int F32) {
  const int64_t G = J->G, D = J->D;
  const int64_t run = (int64_t)task % J->runs, kvh = ((int64_t)task / J->runs) % J->KV;
  const int64_t bs_ = (int64_t)task / (J->runs * J->KV), b = bs_ / J->S, s = bs_ % J->S;
  float *part = J->part + (int64_t)task * G * (D + 2);
  const int64_t j0 = run * RUN, j1 = J->last[bs_] + 1 < j0 + RUN ? J->last[bs_] + 1 : j0 + RUN;
  if (j1 <= j0) {
    for (int64_t g = 0; g < G; g++) part[g * (D + 2)] = -INFINITY, part[g * (D + 2) + 1] = 0.f;
    return;
  }
  const int64_t n = j1 - j0, at = ((b * J->KV + kvh) * J->max_seq + j0) * D, esize = F32 ? 4 : 1;
  const char *K = (const char *)J->kc + at * esize, *V = (const char *)J->vc + at * esize;
  const float *q = J->q + ((b * J->S + s) * J->H + kvh * G) * D;
  float sc[MAX_GROUP * RUN] __attribute__((aligned(64)));
  float wide[16 * MAX_D] __attribute__((aligned(64)));

  /* scores: q . k for 16 rows at a time */
  for (int64_t r0 = 0; r0 < n; r0 += 16) {
    const float *kr = rows16(K, r0, n, NV, F32, wide);
    for (int64_t g = 0; g < G; g++) {
      __m512 acc[16];
      for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
      for (int64_t c = 0; c < NV; c++) {
        const __m512 qv = _mm512_loadu_ps(q + g * D + c * 16);
        for (int r = 0; r < 16; r++) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(kr + (r * NV + c) * 16), qv, acc[r]);
      }
      _mm512_storeu_ps(sc + g * RUN + r0, sum16(acc));
    }
  }
  /* softmax over the run, unnormalized: its max and its sum go to the merge */
  for (int64_t g = 0; g < G; g++) {
    float *x = sc + g * RUN;
    if (J->bias != NULL) {
      const float *bias = J->bias + b * J->bb + (kvh * G + g) * J->bh + s * J->bs + j0;
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 m = first(n - j);
        _mm512_mask_storeu_ps(x + j, m, _mm512_add_ps(_mm512_loadu_ps(x + j), _mm512_maskz_loadu_ps(m, bias + j)));
      }
    }
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 16) mx = _mm512_mask_max_ps(mx, first(n - j), mx, _mm512_loadu_ps(x + j));
    const float m = _mm512_reduce_max_ps(mx);
    memset(part + g * (D + 2) + 2, 0, (size_t)D * sizeof(float));
    if (m == -INFINITY) { /* every row of the run masked out */
      part[g * (D + 2)] = m;
      part[g * (D + 2) + 1] = 0.f;
      memset(x, 0, (size_t)n * sizeof(float));
      continue;
    }
    __m512 sum = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(m);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 k = first(n - j);
      const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_loadu_ps(x + j), mv)));
      _mm512_storeu_ps(x + j, e);
      sum = _mm512_add_ps(sum, e);
    }
    part[g * (D + 2)] = m;
    part[g * (D + 2) + 1] = _mm512_reduce_add_ps(sum);
  }
  /* weighted values */
  if (NV == 4 && G <= 6) {
    /* one row widened into registers, every head of the group summed from it: 4 x G accumulators */
    __m512 acc[6][4];
#pragma GCC unroll 6
    for (int g = 0; g < 6; g++)
      for (int c = 0; c < 4; c++) acc[g][c] = _mm512_setzero_ps();
    for (int64_t r = 0; r < n; r++) {
      __m512 v[4];
      for (int c = 0; c < 4; c++)
        v[c] = F32 ? _mm512_loadu_ps((const float *)V + r * 64 + c * 16)
                   : _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(V + r * 64 + c * 16))));
#pragma GCC unroll 6
      for (int g = 0; g < 6; g++) {
        if (g >= G) break;
        const __m512 w = _mm512_set1_ps(sc[g * RUN + r]);
        for (int c = 0; c < 4; c++) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
      }
    }
#pragma GCC unroll 6
    for (int g = 0; g < 6; g++) {
      if (g >= G) break;
      for (int c = 0; c < 4; c++) _mm512_storeu_ps(part + g * (D + 2) + 2 + c * 16, acc[g][c]);
    }
    return;
  }
  /* any other shape: 16 rows widened at a time, four sums a channel block to keep the adds apart */
  for (int64_t r0 = 0; r0 < n; r0 += 16) {
    const int64_t rows = n - r0 < 16 ? n - r0 : 16;
    const float *vr = rows16(V, r0, n, NV, F32, wide);
    for (int64_t g = 0; g < G; g++) {
      const float *p = sc + g * RUN + r0;
      float *o = part + g * (D + 2) + 2;
      for (int64_t c = 0; c < NV; c++) {
        __m512 a0 = _mm512_loadu_ps(o + c * 16), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(),
               a3 = _mm512_setzero_ps();
        int64_t r = 0;
        for (; r + 4 <= rows; r += 4) {
          a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[r]), _mm512_loadu_ps(vr + (r * NV + c) * 16), a0);
          a1 = _mm512_fmadd_ps(_mm512_set1_ps(p[r + 1]), _mm512_loadu_ps(vr + ((r + 1) * NV + c) * 16), a1);
          a2 = _mm512_fmadd_ps(_mm512_set1_ps(p[r + 2]), _mm512_loadu_ps(vr + ((r + 2) * NV + c) * 16), a2);
          a3 = _mm512_fmadd_ps(_mm512_set1_ps(p[r + 3]), _mm512_loadu_ps(vr + ((r + 3) * NV + c) * 16), a3);
        }
        for (; r < rows; r++) a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[r]), _mm512_loadu_ps(vr + (r * NV + c) * 16), a0);
        _mm512_storeu_ps(o + c * 16, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
      }
    }
  }
}

/* ---------------------------------------------------------------- the same with AVX2: 8 rows a block */

/* sum8 and exp8: simd_math.h */

/* 8 cache rows (int8, stride D) -> float, zeros past the first n */
__attribute__((target("avx2,fma"))) static inline void widen8(const int8_t *rows, int64_t n, int64_t NV, float *out) {
  for (int64_t r = 0; r < 8; r++)
    for (int64_t c = 0; c < NV; c++) {
      const __m256 v = r < n ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(rows + (r * NV + c) * 8))))
                             : _mm256_setzero_ps();
      _mm256_storeu_ps(out + (r * NV + c) * 8, v);
    }
}

/* 8 cache rows from row r0 of a run of n as float, as rows16 */
__attribute__((target("avx2,fma"))) static inline const float *rows8(const void *cache, int64_t r0, int64_t n,
                                                                     int64_t NV, int f32, float *wide) {
  if (f32) return float_rows((const float *)cache, r0, n, NV * 8, 8, wide);
  widen8((const int8_t *)cache + r0 * NV * 8, n - r0, NV, wide);
  return wide;
}

__attribute__((target("avx2,fma"))) static void attend_run_avx2(const AJob *J, size_t task) {
  const int64_t G = J->G, D = J->D, NV = D / 8;
  const int64_t run = (int64_t)task % J->runs, kvh = ((int64_t)task / J->runs) % J->KV;
  const int64_t bs_ = (int64_t)task / (J->runs * J->KV), b = bs_ / J->S, s = bs_ % J->S;
  float *part = J->part + (int64_t)task * G * (D + 2);
  const int64_t j0 = run * RUN, j1 = J->last[bs_] + 1 < j0 + RUN ? J->last[bs_] + 1 : j0 + RUN;
  if (j1 <= j0) {
    for (int64_t g = 0; g < G; g++) part[g * (D + 2)] = -INFINITY, part[g * (D + 2) + 1] = 0.f;
    return;
  }
  const int64_t n = j1 - j0, n8 = (n + 7) / 8 * 8, at = ((b * J->KV + kvh) * J->max_seq + j0) * D;
  const char *K = (const char *)J->kc + at * (J->f32 ? 4 : 1), *V = (const char *)J->vc + at * (J->f32 ? 4 : 1);
  const float *q = J->q + ((b * J->S + s) * J->H + kvh * G) * D;
  float sc[MAX_GROUP * RUN] __attribute__((aligned(32)));
  float wide[8 * MAX_D] __attribute__((aligned(32)));

  for (int64_t r0 = 0; r0 < n; r0 += 8) {
    const float *kr = rows8(K, r0, n, NV, J->f32, wide);
    for (int64_t g = 0; g < G; g++) {
      __m256 acc[8];
      for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
      for (int64_t c = 0; c < NV; c++) {
        const __m256 qv = _mm256_loadu_ps(q + g * D + c * 8);
        for (int r = 0; r < 8; r++) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(kr + (r * NV + c) * 8), qv, acc[r]);
      }
      _mm256_storeu_ps(sc + g * RUN + r0, sum8(acc));
    }
  }
  for (int64_t g = 0; g < G; g++) {
    float *x = sc + g * RUN;
    if (J->bias != NULL) {
      const float *bias = J->bias + b * J->bb + (kvh * G + g) * J->bh + s * J->bs + j0;
      for (int64_t j = 0; j < n; j++) x[j] += bias[j];
    }
    for (int64_t j = n; j < n8; j++) x[j] = -INFINITY; /* the block's rows past the run */
    __m256 mx = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n8; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(x + j));
    float lanes[8];
    _mm256_storeu_ps(lanes, mx);
    float m = lanes[0];
    for (int i = 1; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    memset(part + g * (D + 2) + 2, 0, (size_t)D * sizeof(float));
    if (m == -INFINITY) { /* every row of the run masked out */
      part[g * (D + 2)] = m;
      part[g * (D + 2) + 1] = 0.f;
      memset(x, 0, (size_t)n8 * sizeof(float));
      continue;
    }
    __m256 sum = _mm256_setzero_ps();
    const __m256 mv = _mm256_set1_ps(m);
    for (int64_t j = 0; j < n8; j += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv));
      _mm256_storeu_ps(x + j, e);
      sum = _mm256_add_ps(sum, e);
    }
    _mm256_storeu_ps(lanes, sum);
    float l = 0.f;
    for (int i = 0; i < 8; i++) l += lanes[i];
    part[g * (D + 2)] = m;
    part[g * (D + 2) + 1] = l;
  }
  /* weighted values: 8 rows widened at a time, four sums a channel block */
  for (int64_t r0 = 0; r0 < n; r0 += 8) {
    const int64_t rows = n - r0 < 8 ? n - r0 : 8;
    const float *vr = rows8(V, r0, n, NV, J->f32, wide);
    for (int64_t g = 0; g < G; g++) {
      const float *p = sc + g * RUN + r0;
      float *o = part + g * (D + 2) + 2;
      for (int64_t c = 0; c < NV; c++) {
        __m256 a0 = _mm256_loadu_ps(o + c * 8), a1 = _mm256_setzero_ps();
        int64_t r = 0;
        for (; r + 2 <= rows; r += 2) {
          a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[r]), _mm256_loadu_ps(vr + (r * NV + c) * 8), a0);
          a1 = _mm256_fmadd_ps(_mm256_set1_ps(p[r + 1]), _mm256_loadu_ps(vr + ((r + 1) * NV + c) * 8), a1);
        }
        if (r < rows) a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[r]), _mm256_loadu_ps(vr + (r * NV + c) * 8), a0);
        _mm256_storeu_ps(o + c * 8, _mm256_add_ps(a0, a1));
      }
    }
  }
}

__attribute__((target("avx512f,fma"))) static void attend_avx512(const AJob *J, size_t task) {
  if (J->D == 64 && J->f32)
    attend_run(J, task, 4, 1); /* the common head size, its loops unrolled */
  else if (J->D == 64)
    attend_run(J, task, 4, 0);
  else if (J->f32)
    attend_run(J, task, J->D / 16, 1);
  else
    attend_run(J, task, J->D / 16, 0);
}

static void attend_task(void *data, size_t task) {
  const AJob *J = (const AJob *)data;
  if (J->isa >= 2)
    attend_avx512(J, task);
  else
    attend_run_avx2(J, task);
}

/* ---------------------------------------------------------------- many new tokens (AVX-512, head size 32, 64, 128) */

/* A prompt's queries against the cache, head size PD (64 or 128; 32 over an int8 cache): each task holds up to 24
 * query rows (tokens x the query heads of one KV head) and walks the keys in steps of PT_KEYS (128; 64 measured
 * 7-10% slower, its per-step softmax and rescale twice as often) with a running softmax (the max, the sum and the
 * weighted values rescaled as the max grows). Keys are read from a transposed copy made per call (16 keys by PD
 * channels a block), so that a score is a broadcast query channel times 16 keys, no horizontal sums; the scores of
 * 24 rows against 16 keys sit in 24 registers whatever PD is. An int8 cache is widened to float in that copy (its
 * key scale is in the query, as for one token) and its value rows into a float copy of their own, the value scale
 * applied once per channel to the output. */
#define PT_ROWS 24
#define PT_KEYS 128
#define PT_MAX_D 128

typedef struct {
  int64_t B, S, H, KV, G, D, max_seq, tok, tiles, blocks;
  const void *kc, *vc; /* (B, KV, max_seq, D): float, or int8 where !f32 */
  float *kt;           /* (B, KV, blocks, D, 16) */
  float *vw;           /* int8 cache: its value rows as float (B, KV, blocks * 16, D); NULL for a float cache */
  const float *vs;     /* int8 cache: the value scales (KV, D) */
  int f32;
  const float *q;       /* (B, S, H, D): rotated, times the softmax scale (and an int8 cache's key scale) */
  const int64_t *last;  /* (B, S) */
  const float *bias;
  int64_t bb, bh, bs;
  float *out; /* (B, S, H, D) */
  int vnni;      /* an int8 cache with AVX512-VNNI: kt16 and vw16 instead of kt and vw */
  int16_t *kt16; /* (B, KV, blocks, D / 2, 16, 2): 16 keys by D / 2 channel pairs a block */
  int16_t *vw16; /* (B, KV, blocks * 8, D, 2): value rows two at a time, each channel's pair adjacent */
} PJob;

#define PT_TRANSPOSE_BLOCKS 16 /* 16-key blocks a transposing task takes */

/* the VNNI copies of blocks b0 .. b1 - 1 of one KV head (head size 32, 64 or 128): each key row widened to int16 and
 * its channel pairs transposed 16 keys at a time; each pair of value rows widened and interleaved channel by
 * channel */
__attribute__((target("avx512f,avx512bw"))) static void transpose_vnni(const PJob *J, int64_t bk, int64_t b0,
                                                                        int64_t b1) {
  const int64_t D = J->D, max_seq = J->max_seq;
  const int8_t *K8 = (const int8_t *)J->kc + bk * max_seq * D, *V8 = (const int8_t *)J->vc + bk * max_seq * D;
  for (int64_t blk = b0; blk < b1; blk++) {
    int16_t *to = J->kt16 + (bk * J->blocks + blk) * D * 16;
    for (int64_t u = 0; u < D / 32; u++) { /* channel pairs 16u .. 16u + 15 of 16 keys */
      __m512 r[16];
      for (int64_t j = 0; j < 16; j++) {
        const int64_t row = blk * 16 + j;
        r[j] = row < max_seq ? _mm512_castsi512_ps(_mm512_cvtepi8_epi16(
                                   _mm256_loadu_si256((const __m256i *)(K8 + row * D + u * 32))))
                             : _mm512_setzero_ps();
      }
      transpose16(r);
      for (int64_t c = 0; c < 16; c++) _mm512_storeu_ps((float *)(to + ((u * 16 + c) * 16) * 2), r[c]);
    }
    int16_t *vto = J->vw16 + (bk * J->blocks + blk) * 8 * D * 2;
    for (int64_t jp = 0; jp < 8; jp++) {
      const int64_t ra = blk * 16 + 2 * jp, rb = ra + 1;
      for (int64_t c = 0; c < D / 16; c++) {
        const __m512i a = ra < max_seq ? _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(V8 + ra * D + c * 16)))
                                       : _mm512_setzero_si512();
        const __m512i b = rb < max_seq ? _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(V8 + rb * D + c * 16)))
                                       : _mm512_setzero_si512();
        _mm512_storeu_si512((void *)(vto + (jp * D + c * 16) * 2),
                            _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(b, 16)));
      }
    }
  }
}

static void transpose_task(void *data, size_t task) {
  const PJob *J = (const PJob *)data;
  const int64_t D = J->D, per = (J->blocks + PT_TRANSPOSE_BLOCKS - 1) / PT_TRANSPOSE_BLOCKS;
  const int64_t bk = (int64_t)task / per, b0 = ((int64_t)task % per) * PT_TRANSPOSE_BLOCKS;
  const int64_t b1 = b0 + PT_TRANSPOSE_BLOCKS < J->blocks ? b0 + PT_TRANSPOSE_BLOCKS : J->blocks;
  if (J->vnni) {
    transpose_vnni(J, bk, b0, b1);
    return;
  }
  const float *K = J->f32 ? (const float *)J->kc + bk * J->max_seq * D : NULL;
  const int8_t *K8 = J->f32 ? NULL : (const int8_t *)J->kc + bk * J->max_seq * D;
  const int8_t *V8 = J->f32 ? NULL : (const int8_t *)J->vc + bk * J->max_seq * D;
  for (int64_t blk = b0; blk < b1; blk++) {
    float *to = J->kt + (bk * J->blocks + blk) * D * 16;
    float *vto = J->f32 ? NULL : J->vw + (bk * J->blocks + blk) * 16 * D;
    for (int64_t j = 0; j < 16; j++) {
      const int64_t row = blk * 16 + j;
      if (row >= J->max_seq)
        for (int64_t d = 0; d < D; d++) to[d * 16 + j] = 0.f;
      else if (K != NULL)
        for (int64_t d = 0; d < D; d++) to[d * 16 + j] = K[row * D + d];
      else
        for (int64_t d = 0; d < D; d++) to[d * 16 + j] = (float)K8[row * D + d];
      if (vto != NULL) /* the value row as it is held, as float; zeros past the cache */
        for (int64_t d = 0; d < D; d++) vto[j * D + d] = row < J->max_seq ? (float)V8[row * D + d] : 0.f;
    }
  }
}

/* One group of up to PT_ROWS query rows: its queries, running softmax and weighted values (PD channels used). */
typedef struct {
  float Q[PT_ROWS * PT_MAX_D] __attribute__((aligned(64)));
  float O[PT_ROWS * PT_MAX_D] __attribute__((aligned(64)));
  int16_t Q16[PT_ROWS * PT_MAX_D] __attribute__((aligned(64))); /* VNNI: Q as int16, row r times 1 / qs[r] */
  float qs[PT_ROWS];
  float m[PT_ROWS], l[PT_ROWS];
  int64_t last[PT_ROWS], s0, nr;
} PGroup;

/* One row's running softmax over a step's scores x (PT_KEYS floats, the first nb blocks of 16 computed): masked by
 * the row's last key and biased, the new max, the old sums and weighted values rescaled, the weights left in x, or
 * with p16 as int16 at 1/P16_SCALE in p16 (the VNNI form). A row with nothing to attend here gets zero weights. */
#define P16_SCALE 32767.f

__attribute__((target("avx512f,fma"), always_inline)) static inline void row_softmax(const PJob *J, PGroup *R,
                                                                                    int64_t r, float *x, int16_t *p16,
                                                                                    int64_t b, int64_t kvh, int64_t k0,
                                                                                    int64_t nb, const int PD) {
  const int64_t G = J->G;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  if (r >= R->nr || R->last[r] < k0) { /* a padding row, or one whose keys all came before this step */
    if (p16 != NULL)
      memset(p16, 0, PT_KEYS * sizeof(int16_t));
    else
      memset(x, 0, PT_KEYS * sizeof(float));
    return;
  }
  const int64_t i = r / G, g = r % G;
  const float *bias = J->bias == NULL ? NULL : J->bias + b * J->bb + (kvh * G + g) * J->bh + (R->s0 + i) * J->bs + k0;
  __mmask16 valid[PT_KEYS / 16];
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t sb = 0; sb < PT_KEYS / 16; sb++) {
    const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(k0 + sb * 16)));
    valid[sb] = sb < nb ? _mm512_cmple_epi32_mask(key, _mm512_set1_epi32((int)R->last[r])) : 0;
    __m512 v = _mm512_load_ps(x + sb * 16);
    if (bias != NULL) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(valid[sb], bias + sb * 16));
    v = _mm512_mask_blend_ps(valid[sb], _mm512_set1_ps(-INFINITY), v);
    _mm512_store_ps(x + sb * 16, v);
    mx = _mm512_max_ps(mx, v);
  }
  const float top = _mm512_reduce_max_ps(mx);
  if (top == -INFINITY) { /* every key of this step masked for this row */
    if (p16 != NULL)
      memset(p16, 0, PT_KEYS * sizeof(int16_t));
    else
      memset(x, 0, PT_KEYS * sizeof(float));
    return;
  }
  const float mnew = top > R->m[r] ? top : R->m[r];
  const float alpha = R->m[r] == -INFINITY ? 0.f : (mnew == R->m[r] ? 1.f : expf(R->m[r] - mnew));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < PT_KEYS / 16; sb++) {
    const __m512 e = _mm512_maskz_mov_ps(valid[sb], exp16(_mm512_sub_ps(_mm512_load_ps(x + sb * 16),
                                                                        _mm512_set1_ps(mnew))));
    sum = _mm512_add_ps(sum, e);
    if (p16 != NULL)
      _mm256_store_si256((__m256i *)(p16 + sb * 16),
                         _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(e, _mm512_set1_ps(P16_SCALE)))));
    else
      _mm512_store_ps(x + sb * 16, e);
  }
  R->l[r] = R->l[r] * alpha + _mm512_reduce_add_ps(sum);
  R->m[r] = mnew;
  if (alpha != 1.f)
    for (int c = 0; c < PD / 16; c++)
      _mm512_store_ps(R->O + r * PD + c * 16, _mm512_mul_ps(_mm512_load_ps(R->O + r * PD + c * 16), _mm512_set1_ps(alpha)));
}

/* keys k0 .. k0 + nk - 1 (nk <= PT_KEYS) for one group */
__attribute__((target("avx512f,fma"), always_inline)) static inline void prompt_step(const PJob *J, PGroup *R,
                                                                                    const float *KT, const float *V,
                                                                                    int64_t b, int64_t kvh, int64_t k0,
                                                                                    int64_t nk, float *P, const int PD) {
  const int64_t nb = (nk + 15) / 16;
  /* scores of every row against 16 keys at a time */
  for (int64_t sb = 0; sb < nb; sb++) {
    const float *kt = KT + (k0 / 16 + sb) * PD * 16;
    __m512 acc[PT_ROWS];
#pragma GCC unroll 24
    for (int r = 0; r < PT_ROWS; r++) acc[r] = _mm512_setzero_ps();
    for (int d = 0; d < PD; d++) {
      const __m512 kv = _mm512_load_ps(kt + d * 16);
#pragma GCC unroll 24
      for (int r = 0; r < PT_ROWS; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(R->Q[r * PD + d]), kv, acc[r]);
    }
#pragma GCC unroll 24
    for (int r = 0; r < PT_ROWS; r++) _mm512_store_ps(P + r * PT_KEYS + sb * 16, acc[r]);
  }
  /* each row's running softmax: masked and biased scores, the new max, the rescale, the weights */
  for (int64_t r = 0; r < PT_ROWS; r++) row_softmax(J, R, r, P + r * PT_KEYS, NULL, b, kvh, k0, nb, PD);
  /* the weighted values, 16 channels at a time */
  for (int c = 0; c < PD / 16; c++) {
    __m512 acc[PT_ROWS];
#pragma GCC unroll 24
    for (int r = 0; r < PT_ROWS; r++) acc[r] = _mm512_load_ps(R->O + r * PD + c * 16);
    for (int64_t j = 0; j < nk; j++) {
      const __m512 v = _mm512_loadu_ps(V + (k0 + j) * PD + c * 16);
#pragma GCC unroll 24
      for (int r = 0; r < PT_ROWS; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(P[r * PT_KEYS + j]), v, acc[r]);
    }
#pragma GCC unroll 24
    for (int r = 0; r < PT_ROWS; r++) _mm512_store_ps(R->O + r * PD + c * 16, acc[r]);
  }
}


/* acc += pairs of int16 of a times the pair at *b (broadcast), by lane. Written out because GCC 12 copies the
 * accumulator of _mm512_dpwssd_epi32 through other registers and the stack: twice the instructions. */
__attribute__((target("avx512f,avx512vnni"), always_inline)) static inline __m512i dpwssd_bcst(__m512i acc, __m512i a,
                                                                                           const int32_t *b) {
  __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(a), "m"(*b));
  return acc;
}

/* The same step over an int8 cache with AVX512-VNNI: the scores are int16 queries (each row scaled to its largest
 * channel, 15 bits) times the int8 keys widened to int16, two channels a lane by vpdpwssd into int32, so that each
 * instruction does the work of two float FMAs; the weights, at most 1 after the running max is taken off, go to
 * int16 as round(p * 32767) and the values, int8 widened, are summed two keys a lane the same way, each step's sum
 * added to the float output times 1 / 32767. The float softmax (max, exp, sum) is the float kernel's: l sums the
 * weights before rounding. Sums stay within int32: at most 128 channels x 32767 x 128 per score (head size 128),
 * PT_KEYS (128) keys x 32767 x 128 per value channel and step, 5.4e8 < 2^31. */
__attribute__((target("avx512f,avx512bw,avx512vnni,fma"), always_inline)) static inline void prompt_step_vnni(
    const PJob *J, PGroup *R, const int16_t *KT, const int16_t *V, int64_t b, int64_t kvh, int64_t k0, int64_t nk,
    float *P, int16_t *P16, const int PD) {
  const int64_t nb = (nk + 15) / 16;
  const int32_t *Q32 = (const int32_t *)R->Q16;
  for (int64_t sb = 0; sb < nb; sb++) {
    const int16_t *kt = KT + (k0 / 16 + sb) * PD * 16;
    __m512i acc[PT_ROWS];
#pragma GCC unroll 24
    for (int r = 0; r < PT_ROWS; r++) acc[r] = _mm512_setzero_si512();
    for (int c = 0; c < PD / 2; c++) {
      const __m512i kv = _mm512_load_si512((const void *)(kt + c * 32));
#pragma GCC unroll 24
      for (int r = 0; r < PT_ROWS; r++) acc[r] = dpwssd_bcst(acc[r], kv, Q32 + r * (PD / 2) + c);
    }
#pragma GCC unroll 24
    for (int r = 0; r < PT_ROWS; r++)
      _mm512_store_ps(P + r * PT_KEYS + sb * 16, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_set1_ps(R->qs[r])));
  }
  for (int64_t r = 0; r < PT_ROWS; r++) row_softmax(J, R, r, P + r * PT_KEYS, P16 + r * PT_KEYS, b, kvh, k0, nb, PD);
  const int32_t *P32 = (const int32_t *)P16;
  const int64_t pairs = (nk + 1) / 2;
  for (int c = 0; c < PD / 16; c++) {
    __m512i acc[PT_ROWS];
#pragma GCC unroll 24
    for (int r = 0; r < PT_ROWS; r++) acc[r] = _mm512_setzero_si512();
    for (int64_t jp = 0; jp < pairs; jp++) {
      const __m512i v = _mm512_load_si512((const void *)(V + ((k0 / 2 + jp) * PD + c * 16) * 2));
#pragma GCC unroll 24
      for (int r = 0; r < PT_ROWS; r++) acc[r] = dpwssd_bcst(acc[r], v, P32 + r * (PT_KEYS / 2) + jp);
    }
#pragma GCC unroll 24
    for (int r = 0; r < PT_ROWS; r++)
      _mm512_store_ps(R->O + r * PD + c * 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_set1_ps(1.f / P16_SCALE),
                                                               _mm512_load_ps(R->O + r * PD + c * 16)));
  }
}

#define PT_GROUPS 4 /* row groups a task takes, each step of keys read once for all of them */

/* A task's row groups: their queries (and with VNNI, each row as int16 at 32767 / its largest magnitude), running
 * softmax state and last rows; returns how many groups, and the last key any of them attends to in *maxlast. */
__attribute__((target("avx512f,fma"), always_inline)) static inline int64_t prompt_groups(const PJob *J, size_t task,
                                                                                          PGroup *R, int64_t *maxlast,
                                                                                          const int PD, const int VNNI) {
  const int64_t G = J->G, b = (int64_t)task / (J->KV * J->tiles), kvh = ((int64_t)task / J->tiles) % J->KV;
  const int64_t first = ((int64_t)task % J->tiles) * J->tok * PT_GROUPS; /* the task's first token */
  int64_t groups = 0;
  *maxlast = -1;
  for (int64_t q = 0; q < PT_GROUPS && first + q * J->tok < J->S; q++, groups++) {
    PGroup *g_ = &R[q];
    g_->s0 = first + q * J->tok;
    const int64_t ntok = J->S - g_->s0 < J->tok ? J->S - g_->s0 : J->tok;
    g_->nr = ntok * G;
    if (VNNI)
      memset(g_->Q16, 0, sizeof(int16_t) * PT_ROWS * PD);
    else
      memset(g_->Q, 0, sizeof(float) * PT_ROWS * PD);
    memset(g_->O, 0, sizeof(float) * PT_ROWS * PD);
    for (int64_t r = 0; r < PT_ROWS; r++) {
      g_->qs[r] = 0.f, g_->m[r] = -INFINITY, g_->l[r] = 0.f, g_->last[r] = -1;
      if (r >= g_->nr) continue;
      const int64_t i = r / G, g = r % G;
      const float *x = J->q + ((b * J->S + g_->s0 + i) * J->H + kvh * G + g) * PD;
      if (VNNI) {
        float top = 0.f;
        for (int d = 0; d < PD; d++) top = fabsf(x[d]) > top ? fabsf(x[d]) : top;
        const float to16 = top > 0.f ? 32767.f / top : 0.f;
        g_->qs[r] = top / 32767.f;
        for (int d = 0; d < PD; d++) g_->Q16[r * PD + d] = (int16_t)nearbyintf(x[d] * to16);
      } else
        memcpy(g_->Q + r * PD, x, PD * sizeof(float));
      g_->last[r] = J->last[b * J->S + g_->s0 + i];
      *maxlast = g_->last[r] > *maxlast ? g_->last[r] : *maxlast;
    }
  }
  return groups;
}

/* each group's rows, normalized (and an int8 cache's value scale applied), to the output */
static inline void prompt_out(const PJob *J, size_t task, const PGroup *R, int64_t groups, const int PD) {
  const int64_t G = J->G, b = (int64_t)task / (J->KV * J->tiles), kvh = ((int64_t)task / J->tiles) % J->KV;
  const float *vs = J->f32 ? NULL : J->vs + kvh * PD;
  for (int64_t q = 0; q < groups; q++)
    for (int64_t r = 0; r < R[q].nr; r++) {
      const int64_t i = r / G, g = r % G;
      float *o = J->out + ((b * J->S + R[q].s0 + i) * J->H + kvh * G + g) * PD;
      const float inv = R[q].l[r] > 0.f ? 1.f / R[q].l[r] : 0.f;
      if (vs == NULL)
        for (int d = 0; d < PD; d++) o[d] = R[q].O[r * PD + d] * inv;
      else
        for (int d = 0; d < PD; d++) o[d] = R[q].O[r * PD + d] * inv * vs[d];
    }
}

__attribute__((target("avx512f,fma"), always_inline)) static inline void prompt_rows(const PJob *J, size_t task,
                                                                                    const int PD) {
  const int64_t b = (int64_t)task / (J->KV * J->tiles), kvh = ((int64_t)task / J->tiles) % J->KV;
  PGroup R[PT_GROUPS];
  float P[PT_ROWS * PT_KEYS] __attribute__((aligned(64)));
  int64_t maxlast;
  const int64_t groups = prompt_groups(J, task, R, &maxlast, PD, 0);
  const float *KT = J->kt + (b * J->KV + kvh) * J->blocks * PD * 16;
  const float *V = J->f32 ? (const float *)J->vc + (b * J->KV + kvh) * J->max_seq * PD
                          : J->vw + (b * J->KV + kvh) * J->blocks * 16 * PD;
  for (int64_t k0 = 0; k0 <= maxlast; k0 += PT_KEYS) {
    const int64_t nk = maxlast + 1 - k0 < PT_KEYS ? maxlast + 1 - k0 : PT_KEYS;
    for (int64_t q = 0; q < groups; q++) prompt_step(J, &R[q], KT, V, b, kvh, k0, nk, P, PD);
  }
  prompt_out(J, task, R, groups, PD);
}

__attribute__((target("avx512f,avx512bw,avx512vnni,fma"), always_inline)) static inline void prompt_rows_vnni(
    const PJob *J, size_t task, const int PD) {
  const int64_t b = (int64_t)task / (J->KV * J->tiles), kvh = ((int64_t)task / J->tiles) % J->KV;
  PGroup R[PT_GROUPS];
  float P[PT_ROWS * PT_KEYS] __attribute__((aligned(64)));
  int16_t P16[PT_ROWS * PT_KEYS] __attribute__((aligned(64)));
  int64_t maxlast;
  const int64_t groups = prompt_groups(J, task, R, &maxlast, PD, 1);
  const int16_t *KT = J->kt16 + (b * J->KV + kvh) * J->blocks * PD * 16;
  const int16_t *V = J->vw16 + (b * J->KV + kvh) * J->blocks * 16 * PD;
  for (int64_t k0 = 0; k0 <= maxlast; k0 += PT_KEYS) {
    const int64_t nk = maxlast + 1 - k0 < PT_KEYS ? maxlast + 1 - k0 : PT_KEYS;
    for (int64_t q = 0; q < groups; q++) prompt_step_vnni(J, &R[q], KT, V, b, kvh, k0, nk, P, P16, PD);
  }
  prompt_out(J, task, R, groups, PD);
}

__attribute__((target("avx512f,fma"))) static void prompt_task(void *data, size_t task) {
  const PJob *J = (const PJob *)data;
  if (J->D == 64)
    prompt_rows(J, task, 64); /* each head size its own loops, unrolled */
  else if (J->D == 128)
    prompt_rows(J, task, 128);
  else
    prompt_rows(J, task, 32);
}

__attribute__((target("avx512f,avx512bw,avx512vnni,fma"))) static void prompt_task_vnni(void *data, size_t task) {
  const PJob *J = (const PJob *)data;
  if (J->D == 64)
    prompt_rows_vnni(J, task, 64);
  else if (J->D == 128)
    prompt_rows_vnni(J, task, 128);
  else
    prompt_rows_vnni(J, task, 32);
}

/* ---------------------------------------------------------------- ONNX Runtime glue */

/* 3: AVX-512 with AVX512-VNNI and -BW (an int8 cache's prompts in int16), 2: AVX-512, 1: AVX2 + FMA, 0: none.
 * KVEXPORT_ATTENTION_ISA=avx512 or avx2 takes that narrower kernel on a CPU that has a wider one too (the tests run
 * each where they can). */
static int cpu_isa(void) {
  __builtin_cpu_init();
  const char *ask = getenv("KVEXPORT_ATTENTION_ISA");
  const int cap = ask != NULL && strcmp(ask, "avx2") == 0 ? 1 : (ask != NULL && strcmp(ask, "avx512") == 0 ? 2 : 3);
  if (!__builtin_cpu_supports("fma")) return 0;
  if (__builtin_cpu_supports("avx512f") && cap >= 2)
    return cap == 3 && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni") ? 3 : 2;
  return __builtin_cpu_supports("avx2") ? 1 : 0;
}

static OrtCustomOp g_op, g_op_f32;

static OrtStatus *ORT_API_CALL create_kernel(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info,
                                             void **out) {
  (void)api;
  int64_t H = 0, KV = 0, rotary = 0;
  float scale = 0.f;
  RETURN_IF(g_ort->KernelInfoGetAttribute_int64(info, "num_heads", &H));
  RETURN_IF(g_ort->KernelInfoGetAttribute_int64(info, "kv_num_heads", &KV));
  OrtStatus *absent = g_ort->KernelInfoGetAttribute_float(info, "scale", &scale);
  if (absent != NULL) {
    g_ort->ReleaseStatus(absent);
    scale = 0.f;
  }
  absent = g_ort->KernelInfoGetAttribute_int64(info, "do_rotary", &rotary);
  if (absent != NULL) {
    g_ort->ReleaseStatus(absent);
    rotary = 0;
  }
  if (H <= 0 || KV <= 0 || H % KV != 0 || H / KV > MAX_GROUP)
    return fail("CacheAttention: num_heads must be a multiple of kv_num_heads, at most 16 times it");
  const int isa = cpu_isa();
  if (isa == 0) return fail("CacheAttention: this CPU has neither AVX-512 nor AVX2+FMA");
  AKernel *k = (AKernel *)calloc(1, sizeof(AKernel));
  if (k == NULL) return g_ort->CreateStatus(ORT_FAIL, "CacheAttention: out of memory");
  k->H = H, k->KV = KV, k->scale = scale, k->rotary = rotary != 0, k->isa = isa, k->f32 = op == &g_op_f32;
  *out = k;
  return NULL;
}

/* per-channel scales (H_kv * D) from a k_scale/v_scale input: one value (per tensor) or H_kv * D */
static OrtStatus *channel_scales(const OrtValue *v, int64_t KV, int64_t D, float *out) {
  if (v == NULL) return fail("CacheAttention: k_scale and v_scale are required");
  int64_t dims[8];
  size_t rank = 0;
  ONNXTensorElementDataType type;
  RETURN_IF(kvx_dims(g_ort, v, dims, &rank, &type));
  const int64_t n = count_of(dims, rank);
  if (type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || (n != 1 && n != KV * D))
    return fail("CacheAttention: a scale is neither one float nor one per KV head and channel");
  void *p = NULL;
  RETURN_IF(data_of(v, &p));
  for (int64_t i = 0; i < KV * D; i++) out[i] = ((const float *)p)[n == 1 ? 0 : i];
  return NULL;
}

static OrtStatus *ORT_API_CALL compute(void *kernel, OrtKernelContext *ctx) {
  const AKernel *k = (const AKernel *)kernel;
  const int64_t H = k->H, KV = k->KV, G = H / KV;
  const OrtValue *in[14] = {NULL}; /* NULL: an optional input the node leaves out */
  size_t given = 0;
  RETURN_IF(g_ort->KernelContext_GetInputCount(ctx, &given));
  for (size_t i = 0; i < 14 && i < given; i++) RETURN_IF(g_ort->KernelContext_GetInput(ctx, i, &in[i]));
  if (in[0] == NULL || in[3] == NULL || in[4] == NULL || in[5] == NULL || in[6] == NULL)
    return fail("CacheAttention: query, past_key, past_value, seqlens_k and total_sequence_length are required");
  if (in[11] != NULL) return fail("CacheAttention: head_sink is not taken");
  int64_t qd[8], pd[8], dims[8];
  size_t qr = 0, pr = 0, rank = 0;
  ONNXTensorElementDataType type;
  RETURN_IF(kvx_dims(g_ort, in[0], qd, &qr, &type));
  if (qr != 3 || type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) return fail("CacheAttention: query is not (B, S, hidden) float");
  const ONNXTensorElementDataType ctype = k->f32 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
  const size_t esize = k->f32 ? sizeof(float) : 1;
  RETURN_IF(kvx_dims(g_ort, in[3], pd, &pr, &type));
  if (pr != 4 || type != ctype) return fail("CacheAttention: past_key is not (B, H_kv, max_seq, D) of the op's cache type");
  const int64_t B = qd[0], S = qd[1], D = pd[3], max_seq = pd[2];
  const int packed = in[1] == NULL;
  if (pd[0] != B || pd[1] != KV || D % 16 != 0 || D > MAX_D)
    return fail("CacheAttention: past_key's batch or heads differ from the query's, or its head size is not a multiple of 16 up to 256");
  if (qd[2] != (packed ? (H + 2 * KV) * D : H * D)) return fail("CacheAttention: query's width is not the heads' (packed q|k|v or q)");
  RETURN_IF(kvx_dims(g_ort, in[4], dims, &rank, &type));
  if (rank != 4 || type != ctype || memcmp(dims, pd, sizeof(int64_t) * 4) != 0)
    return fail("CacheAttention: past_value is not past_key's shape and type");
  if (!packed) {
    if (in[2] == NULL) return fail("CacheAttention: key without value");
    for (int i = 1; i <= 2; i++) {
      RETURN_IF(kvx_dims(g_ort, in[i], dims, &rank, &type));
      if (rank != 3 || dims[0] != B || dims[1] != S || dims[2] != KV * D)
        return fail("CacheAttention: key/value are not (B, S, H_kv * D)");
    }
  }
  RETURN_IF(kvx_dims(g_ort, in[5], dims, &rank, &type));
  if (count_of(dims, rank) != B || type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32) return fail("CacheAttention: seqlens_k is not (B) int32");
  void *p = NULL;
  RETURN_IF(data_of(in[5], &p));
  const int32_t *seqlens = (const int32_t *)p;
  RETURN_IF(kvx_dims(g_ort, in[6], dims, &rank, &type));
  if (count_of(dims, rank) != 1 || type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32)
    return fail("CacheAttention: total_sequence_length is not one int32");
  RETURN_IF(data_of(in[6], &p));
  const int64_t total = *(const int32_t *)p;

  /* rotary tables and positions */
  const float *cs = NULL, *sn = NULL;
  const int64_t *pos = NULL;
  int64_t half = 0, table = 0;
  if (k->rotary) {
    if (in[7] == NULL || in[8] == NULL) return fail("CacheAttention: do_rotary without cos_cache and sin_cache");
    RETURN_IF(kvx_dims(g_ort, in[7], dims, &rank, &type));
    if (rank != 2 || 2 * dims[1] > D) return fail("CacheAttention: cos_cache is not (positions, rotary_dim / 2)");
    table = dims[0], half = dims[1];
    RETURN_IF(data_of(in[7], &p));
    cs = (const float *)p;
    RETURN_IF(data_of(in[8], &p));
    sn = (const float *)p;
    if (in[9] != NULL) {
      RETURN_IF(kvx_dims(g_ort, in[9], dims, &rank, &type));
      if (count_of(dims, rank) != B * S || type != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64)
        return fail("CacheAttention: position_ids is not (B, S) int64");
      RETURN_IF(data_of(in[9], &p));
      pos = (const int64_t *)p;
    }
  }
  /* attention bias (B or 1, H or 1, S, total) */
  const float *bias = NULL;
  int64_t bb = 0, bh = 0, bsd = 0;
  if (in[10] != NULL) {
    RETURN_IF(kvx_dims(g_ort, in[10], dims, &rank, &type));
    if (rank != 4 || type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || (dims[0] != 1 && dims[0] != B) ||
        (dims[1] != 1 && dims[1] != H) || dims[2] != S || dims[3] != total)
      return fail("CacheAttention: attention_bias is not (B or 1, H or 1, S, total_sequence_length) float");
    bsd = dims[3], bh = dims[1] == 1 ? 0 : S * bsd, bb = dims[0] == 1 ? 0 : dims[1] * S * bsd;
    RETURN_IF(data_of(in[10], &p));
    bias = (const float *)p;
  }

  /* outputs: present shares past's buffer where the caller bound it so; else past is copied in first */
  int64_t od[3] = {B, S, H * D};
  OrtValue *ov = NULL, *pk = NULL, *pv = NULL;
  RETURN_IF(g_ort->KernelContext_GetOutput(ctx, 0, od, 3, &ov));
  RETURN_IF(g_ort->KernelContext_GetOutput(ctx, 1, pd, 4, &pk));
  RETURN_IF(g_ort->KernelContext_GetOutput(ctx, 2, pd, 4, &pv));
  void *outp = NULL, *kc = NULL, *vc = NULL, *kpast = NULL, *vpast = NULL, *qp = NULL, *kp = NULL, *vp = NULL;
  RETURN_IF(data_of(ov, &outp));
  RETURN_IF(data_of(pk, &kc));
  RETURN_IF(data_of(pv, &vc));
  RETURN_IF(data_of(in[3], &kpast));
  RETURN_IF(data_of(in[4], &vpast));
  RETURN_IF(data_of(in[0], &qp));
  if (!packed) {
    RETURN_IF(data_of(in[1], &kp));
    RETURN_IF(data_of(in[2], &vp));
  }
  /* present apart from past (not bound in place): each row's held rows copied, the rest zero, as ONNX Runtime's
   * kernel leaves them */
  for (int64_t b = 0; b < B; b++) {
    const int64_t held = (int64_t)seqlens[b] + 1 - S;
    if (held < 0 || seqlens[b] >= max_seq) continue; /* refused below */
    for (int i = 0; i < 2; i++) {
      char *to = (char *)(i ? vc : kc);
      const char *from = (const char *)(i ? vpast : kpast);
      if (to == from) continue;
      for (int64_t h = 0; h < KV; h++) {
        const size_t off = (size_t)((b * KV + h) * max_seq * D) * esize;
        memcpy(to + off, from + off, (size_t)(held * D) * esize);
        memset(to + off + (size_t)(held * D) * esize, 0, (size_t)((max_seq - held) * D) * esize);
      }
    }
  }
  if (B * S == 0) return NULL;

  /* scratch: scales, rotated queries, last rows, the runs' partial results; runs up to the longest row only */
  int64_t rows_held = 1;
  for (int64_t b = 0; b < B; b++) rows_held = seqlens[b] + 1 > rows_held ? seqlens[b] + 1 : rows_held;
  rows_held = rows_held < max_seq ? rows_held : max_seq;
  /* the tiled prompt kernel takes it: head size 64 or 128, or 32 over an int8 cache (over a float one ONNX Runtime's
   * kernel was the faster at 32: kvexport.native.TILED_HEAD_SIZES) */
  const int prompt = k->isa >= 2 && (D == 64 || D == 128 || (D == 32 && !k->f32)) && S > 1;
  const int64_t runs = (rows_held + RUN - 1) / RUN, tasks = prompt ? 0 : B * S * KV * runs;
  const size_t floats = (size_t)(2 * KV * D + B * S * H * D + 2 * D + tasks * G * (D + 2));
  int64_t *last = (int64_t *)malloc((size_t)(B * S) * sizeof(int64_t) + floats * sizeof(float));
  if (last == NULL) return g_ort->CreateStatus(ORT_FAIL, "CacheAttention: out of memory");
  float *ks = (float *)(last + B * S), *vs = ks + KV * D, *qs = vs + KV * D, *tmp = qs + B * S * H * D;
  float *part = tmp + 2 * D;
  const float scale = k->scale != 0.f ? k->scale : 1.0f / sqrtf((float)D);
  OrtStatus *st = NULL;
  if (k->f32) { /* a float cache: no scales */
    if (in[12] != NULL || in[13] != NULL) st = fail("Fp32CacheAttention: a float cache takes no k_scale or v_scale");
    for (int64_t i = 0; i < KV * D; i++) ks[i] = vs[i] = 1.f;
  } else {
    st = channel_scales(in[12], KV, D, ks);
    if (st == NULL) st = channel_scales(in[13], KV, D, vs);
  }
  for (int64_t b = 0; st == NULL && b < B; b++) {
    const int64_t past = (int64_t)seqlens[b] + 1 - S;
    if (past < 0 || seqlens[b] >= max_seq || (bias != NULL && seqlens[b] >= total)) {
      st = fail("CacheAttention: seqlens_k is outside the cache (or past total_sequence_length)");
      break;
    }
    for (int64_t s = 0; s < S; s++) {
      const int64_t row = past + s, bs_ = b * S + s;
      last[bs_] = row;
      const float *x = (const float *)qp + bs_ * qd[2];
      const float *kx = packed ? x + H * D : (const float *)kp + bs_ * KV * D;
      const float *vx = packed ? x + (H + KV) * D : (const float *)vp + bs_ * KV * D;
      const int64_t at = pos != NULL ? pos[bs_] : row;
      if (k->rotary && (at < 0 || at >= table)) {
        st = fail("CacheAttention: a position is outside the cos/sin tables");
        break;
      }
      for (int64_t h = 0; h < H; h++) {
        const float *xh = x + h * D, *sc = ks + (h / G) * D;
        float *qh = qs + (bs_ * H + h) * D;
        if (k->rotary) rotate(xh, cs + at * half, sn + at * half, half, D, qh);
        else memcpy(qh, xh, (size_t)D * sizeof(float));
        for (int64_t d = 0; d < D; d++) qh[d] *= sc[d] * scale;
      }
      for (int64_t h = 0; h < KV; h++) {
        const int64_t off = ((b * KV + h) * max_seq + row) * D;
        const float *kh = kx + h * D;
        if (k->rotary) rotate(kh, cs + at * half, sn + at * half, half, D, tmp), kh = tmp;
        if (k->f32) {
          memcpy((float *)kc + off, kh, (size_t)D * sizeof(float));
          memcpy((float *)vc + off, vx + h * D, (size_t)D * sizeof(float));
        } else {
          quantize_row(kh, ks + h * D, D, (int8_t *)kc + off);
          quantize_row(vx + h * D, vs + h * D, D, (int8_t *)vc + off);
        }
      }
    }
  }
  if (st == NULL && prompt) {
    const int64_t tok = PT_ROWS / G, blocks = (rows_held + 15) / 16;
    const int vnni = !k->f32 && k->isa == 3;
    /* the transposed keys, and for an int8 cache its value rows after them: as float, or with VNNI as int16 */
    const size_t copy = (size_t)(B * KV * blocks * D * 16), esz = vnni ? sizeof(int16_t) : sizeof(float);
    void *kt = aligned_alloc(64, (k->f32 ? 1 : 2) * copy * esz);
    if (kt == NULL) st = g_ort->CreateStatus(ORT_FAIL, "CacheAttention: out of memory");
    PJob P = {B, S, H, KV, G, D, max_seq, tok, (S + tok * PT_GROUPS - 1) / (tok * PT_GROUPS), blocks, kc, vc,
              vnni ? NULL : (float *)kt, k->f32 || vnni || kt == NULL ? NULL : (float *)kt + copy, vs, k->f32,
              qs, last, bias, bb, bh, bsd, (float *)outp, vnni, vnni ? (int16_t *)kt : NULL,
              vnni && kt != NULL ? (int16_t *)kt + copy : NULL};
    if (st == NULL)
      st = g_ort->KernelContext_ParallelFor(
          ctx, transpose_task, (size_t)(B * KV * ((blocks + PT_TRANSPOSE_BLOCKS - 1) / PT_TRANSPOSE_BLOCKS)), 0, &P);
    if (st == NULL)
      st = g_ort->KernelContext_ParallelFor(ctx, vnni ? prompt_task_vnni : prompt_task, (size_t)(B * KV * P.tiles), 0, &P);
    free(kt);
    free(last);
    return st;
  }
  if (st == NULL) {
    AJob J = {B, S, H, KV, G, D, max_seq, runs, kc, vc, qs, last, bias, bb, bh, bsd, part, k->isa, k->f32};
    st = g_ort->KernelContext_ParallelFor(ctx, attend_task, (size_t)tasks, 0, &J);
  }
  /* merge the runs of each query head; the value scale once per channel */
  for (int64_t bs_ = 0; st == NULL && bs_ < B * S; bs_++)
    for (int64_t h = 0; h < H; h++) {
      const int64_t kvh = h / G, g = h % G;
      float m = -INFINITY, l = 0.f;
      float *o = (float *)outp + (bs_ * H + h) * D;
      for (int64_t r = 0; r < runs; r++) {
        const float *pr_ = part + ((bs_ * KV + kvh) * runs + r) * G * (D + 2) + g * (D + 2);
        if (pr_[1] > 0.f && pr_[0] > m) m = pr_[0];
      }
      memset(tmp, 0, (size_t)D * sizeof(float));
      for (int64_t r = 0; r < runs; r++) {
        const float *pr_ = part + ((bs_ * KV + kvh) * runs + r) * G * (D + 2) + g * (D + 2);
        if (!(pr_[1] > 0.f)) continue;
        const float w = expf(pr_[0] - m);
        l += w * pr_[1];
        for (int64_t d = 0; d < D; d++) tmp[d] += w * pr_[2 + d];
      }
      for (int64_t d = 0; d < D; d++) o[d] = l > 0.f ? tmp[d] * vs[kvh * D + d] / l : 0.f;
    }
  free(last);
  return st;
}

static void ORT_API_CALL destroy(void *kernel) { free(kernel); }

static const char *ORT_API_CALL op_name(const OrtCustomOp *op) {
  return op == &g_op_f32 ? "Fp32CacheAttention" : "Int8CacheAttention";
}
static ONNXTensorElementDataType ORT_API_CALL in_type(const OrtCustomOp *op, size_t i) {
  switch (i) {
    case 3:
    case 4:
      return op == &g_op_f32 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
    case 5:
    case 6:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    case 9:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
    default:
      return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
}
static size_t ORT_API_CALL in_count(const OrtCustomOp *op) {
  (void)op;
  return 14;
}
static ONNXTensorElementDataType ORT_API_CALL out_type(const OrtCustomOp *op, size_t i) {
  return i == 0 || op == &g_op_f32 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
}
static size_t ORT_API_CALL out_count(const OrtCustomOp *op) {
  (void)op;
  return 3;
}
static OrtCustomOpInputOutputCharacteristic ORT_API_CALL in_required(const OrtCustomOp *op, size_t i) {
  (void)op;
  return (i == 0 || (i >= 3 && i <= 6)) ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
}

static void define(OrtCustomOp *op) {
  kvx_common(op);
  op->GetName = op_name;
  op->GetInputType = in_type;
  op->GetInputTypeCount = in_count;
  op->GetOutputType = out_type;
  op->GetOutputTypeCount = out_count;
  op->GetInputCharacteristic = in_required; /* most inputs are optional */
  op->CreateKernelV2 = create_kernel;
  op->KernelComputeV2 = compute;
  op->KernelDestroy = destroy;
}

const OrtCustomOp *kvx_attention_op(const OrtApi *api, int f32) {
  if (g_ort == NULL) {
    g_ort = api;
    define(&g_op);
    define(&g_op_f32);
  }
  return f32 ? &g_op_f32 : &g_op;
}
