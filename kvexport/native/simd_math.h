/* Vector math that kvexport's native kernels share: attention.c (ONNX Runtime's custom ops) and
 * backends/intel/kvexport_intel/native/int8_paged_attention.cpp (the intel target's OpenVINO op, which includes this
 * header from the installed kvexport.native package). C and C++; each function carries its own target attribute, so
 * that a file compiled without AVX-512 may still hold callers that dispatch to it at run time. */
#ifndef KVEXPORT_NATIVE_SIMD_MATH_H
#define KVEXPORT_NATIVE_SIMD_MATH_H

#include <immintrin.h>

/* 16 vectors -> one vector of their 16 sums */
__attribute__((target("avx512f"))) static inline __m512 sum16(const __m512 *v) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; i++)
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; i++)
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(d0, d1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* e^x to about 2 ulp; 0 below -104 (a masked score) */
__attribute__((target("avx512f,fma"))) static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

/* r[i] = row i (16 floats) -> r[d] = column d (16 floats: row 0..15's element d) */
__attribute__((target("avx512f"))) static inline void transpose16(__m512 *r) {
  __m512 t[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; k++) {
    t[k] = _mm512_shuffle_f32x4(r[k], r[4 + k], _MM_SHUFFLE(2, 0, 2, 0));
    t[4 + k] = _mm512_shuffle_f32x4(r[k], r[4 + k], _MM_SHUFFLE(3, 1, 3, 1));
    t[8 + k] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], _MM_SHUFFLE(2, 0, 2, 0));
    t[12 + k] = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], _MM_SHUFFLE(3, 1, 3, 1));
  }
  for (int k = 0; k < 4; k++) {
    r[k] = _mm512_shuffle_f32x4(t[k], t[8 + k], _MM_SHUFFLE(2, 0, 2, 0));
    r[8 + k] = _mm512_shuffle_f32x4(t[k], t[8 + k], _MM_SHUFFLE(3, 1, 3, 1));
    r[4 + k] = _mm512_shuffle_f32x4(t[4 + k], t[12 + k], _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + k] = _mm512_shuffle_f32x4(t[4 + k], t[12 + k], _MM_SHUFFLE(3, 1, 3, 1));
  }
}

/* 8 vectors -> one vector of their 8 sums */
__attribute__((target("avx2,fma"))) static inline __m256 sum8(const __m256 *v) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* e^x as exp16 computes it; 0 below -87 (a masked score) */
__attribute__((target("avx2,fma"))) static inline __m256 exp8(__m256 x) {
  const __m256 masked = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(masked, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

/* r[i] = row i (8 floats) -> r[d] = column d (8 floats: row 0..7's element d) */
__attribute__((target("avx2"))) static inline void transpose8(__m256 *r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; i++) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; i++) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; k++) {
    r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
    r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
  }
}

#endif
