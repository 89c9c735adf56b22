// kvexport.QGemv: an OpenVINO extension op, Y[..., N] = X[..., K] @ dequant(W)^T over the weights NNCF compresses,
// read where OpenVINO's IR keeps them (no copy, no repacking), or over a bf16 copy of an f32 weight:
//   bits 4: W u4 [N, K / group, group], zero points u4 [N, K / group, 1], scales [N, K / group, 1];
//   bits 8: W u8 [N, K], zero points u8 [N, 1], scales [N, 1] (one group a row: INT8_ASYM);
//   bits 16: W bf16 [N, K] as bytes (kvexport_qgemv_bf16 rounds an f32 weight into it; zero points and scales unused).
// The op takes the bytes as u8 tensors (two 4-bit values a byte, the even index in the low nibble, as the IR packs
// them) and the scales as f16 or f32. With `flip` (INT4_SYM: signed 4-bit values, no zero points) each nibble is
// XORed with 8, which turns a two's-complement v into v + 8, and the caller gives zero points of 8.
// kvexport_intel.gemv builds the decode form's graph with it; prompts keep OpenVINO's FullyConnected (its AMX
// kernels).
//
// Why: at batch 1 a decode step streams every weight once. On the 2-core AMX Xeon the plugin's 4-bit kernel read
// bench-1b's int4 weights at ~12 GB/s (docs/performance.md), below the memory's rate, while kvexport's own 4-bit
// kernel for ONNX Runtime (kvexport/native/qmatmul.c) reads at ~23 GB/s. The dot products here are the same kind:
// activations quantized to int8 per 32-block (amax / 127, as OpenVINO's dynamic quantization and MLAS do), weights
// as unsigned bytes, one VNNI dpbusd per 64 bytes of a row, the zero point taken off through each block's sum of
// the quantized activations:  sum_k s_w (w_k - z) s_a q_k = s_w (sum_k w_k s_a q_k - z sum_k s_a q_k).
// A 4-bit row's 64 bytes hold 128 values; their low nibbles (even k) and high nibbles (odd k) each meet a copy of
// the activations laid out to match (ActRow), so that a 32-bit lane sums 4 products of the same 32-block.
//
// bf16: the activations are rounded to bf16 (as the plugin's FullyConnected does under a bf16 inference precision)
// and meet the weights in AVX512-BF16 dpbf16ps, 32 products a 64-byte load summed into f32 lanes. Steps of more
// than a few rows (prompts) take AMX-BF16 tiles where the CPU has them (amx_rows): the same bf16 copy serves both,
// so that an engine whose prompts run this op holds no other copy of the weights.
//
// Rows are split over OpenVINO's threads (tbb::parallel_for in the plugin's arena), a few contiguous runs a thread;
// a decode step's one row of X reads a run of 8-bit rows as two streams (row_pairs); a few rows of X meet a block of
// ROWS weight rows while they are in cache, so that they read the weights once.
#include <tbb/parallel_for.h>
#include <tbb/partitioner.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>
#include <openvino/op/op.hpp>

namespace {

constexpr int64_t QB = 32;    // activations' quantization block
constexpr int64_t ROWS = 64;  // weight rows a task takes from one activation row before the next row's turn
// runs of rows a thread: each a long sequential stream, a few a thread so that a late thread's share is taken up
// (on the 2-core AMX Xeon, 8192 x 2048 int4: 14.1 GB/s with one run a thread, 16.0 with 4)
constexpr int64_t PIECES = 4;
// bytes ahead of the row's stream to prefetch: a weight row is 1 KB at K 2048, and the hardware's prefetchers stop
// at every 4 KB page (one thread over 1 GB of int4 rows: 8.7 GB/s without, 9.6 with 1 KB, 18.9 with 2 KB on two)
constexpr int64_t PF = 2048;
// bf16 rows the same (a C driver over 1 GB of bf16 rows, two threads: 23-25 GB/s at 1-2 KB ahead, 15-17 at 4-8 KB,
// 10 with non-temporal prefetches; to L2 instead of L1 no different)
constexpr int64_t PF16 = 2048;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QGEMV_VNNI 1
#define QGEMV_KERNEL "AVX512-VNNI"
#else
#define QGEMV_VNNI 0
#define QGEMV_KERNEL "portable"
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define QGEMV_BF16 1
#define QGEMV_BF16_KERNEL "AVX512-BF16"
#else
#define QGEMV_BF16 0
#define QGEMV_BF16_KERNEL "portable"
#endif
#if QGEMV_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define QGEMV_AMX 1
#define QGEMV_ROWS_KERNEL "AMX-BF16"
#else
#define QGEMV_AMX 0
#endif
// rows of X from which a bf16 step takes AMX tiles instead of a dpbf16ps row at a time: GEMV_ROWS + 1 in
// kvexport_intel.gemv (steps of up to 2 rows are paced by the weights' stream alike, and the row kernel reads it
// fastest; from 3 rows each row's dot products of its own cost more than a tile's 16 rows)
constexpr int64_t AMX_ROWS = 3;
// bytes of X, as packed bf16 tiles, a pass over the weights takes: longer prompts read the weights once a pass
constexpr int64_t AMX_PASS_BYTES = 16 << 20;
constexpr int64_t AMX_NB = 128;   // weight rows a block (4 pairs of tiles)
constexpr int64_t AMX_KC = 2048;  // values of K a chunk: a block's chunk, 512 KB of bf16, stays in L2

// f32 -> bf16, rounded to nearest even (a NaN stays a NaN)
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float from_bf16(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      uint32_t m = man;
      do {
        e++;
        m <<= 1;
      } while (!(m & 0x400));
      bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((m & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One row of X, quantized per 32-block and laid out for the kernels.
struct ActRow {
  std::vector<int8_t> q;   // bits 8: q[k]; bits 4: per 128-chunk c, 64 bytes of even k then 64 of odd k (lane order)
  std::vector<float> sa;   // per lane of each 64-byte chunk: the scale of the 32-block it sums (16 a chunk)
  std::vector<float> qsa;  // bits 4: per lane, the sum of its 8 quantized values times that scale (16 a chunk; the
                           // portable form's zero-point term)
  float total = 0.f;       // bits 8: sum over k of s_a q_k
  std::vector<float> gsum;  // bits 4: per weight group, the sum over its k of s_a q_k
  std::vector<uint16_t> b;  // bits 16: x rounded to bf16, from bf16() on (aligned to 64 bytes: no load splits a line)
  const uint16_t* bf16() const {
    return reinterpret_cast<const uint16_t*>((reinterpret_cast<uintptr_t>(b.data()) + 63) & ~uintptr_t(63));
  }
};

void quantize(const float* x, int64_t K, int64_t group, int bits, ActRow& a) {
  if (bits == 16) {
    a.b.resize(K + 32);
    uint16_t* xb = const_cast<uint16_t*>(a.bf16());
    for (int64_t k = 0; k < K; k++) xb[k] = to_bf16(x[k]);
    return;
  }
  std::vector<int8_t> q(K);
  std::vector<float> s(K / QB);
  for (int64_t b = 0; b < K / QB; b++) {
    float amax = 0.f;
    for (int64_t i = 0; i < QB; i++) amax = std::max(amax, std::fabs(x[b * QB + i]));  // a NaN is left out
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    s[b] = amax / 127.f;
    for (int64_t i = 0; i < QB; i++)
      q[b * QB + i] = (int8_t)std::max(-127.f, std::min(127.f, std::nearbyint(x[b * QB + i] * inv)));
  }
  if (bits == 8) {
    a.q = q;
    a.sa.resize(K / 64 * 16);
    a.total = 0.f;
    for (int64_t c = 0; c < K / 64; c++)
      for (int64_t j = 0; j < 16; j++) a.sa[c * 16 + j] = s[(c * 64 + 4 * j) / QB];
    for (int64_t k = 0; k < K; k++) a.total += s[k / QB] * q[k];
    return;
  }
  const int64_t chunks = K / 128;
  a.q.resize(K);
  a.sa.resize(chunks * 16);
  a.qsa.resize(chunks * 16);
  for (int64_t c = 0; c < chunks; c++)
    for (int64_t j = 0; j < 16; j++) {
      int32_t sum = 0;
      for (int64_t t = 0; t < 4; t++) {
        const int64_t k = c * 128 + 8 * j + 2 * t;
        a.q[c * 128 + 4 * j + t] = q[k];           // meets the low nibbles
        a.q[c * 128 + 64 + 4 * j + t] = q[k + 1];  // the high nibbles
        sum += q[k] + q[k + 1];
      }
      const float sc = s[(c * 128 + 8 * j) / QB];
      a.sa[c * 16 + j] = sc;
      a.qsa[c * 16 + j] = sc * (float)sum;
    }
  a.gsum.assign(K / group, 0.f);
  for (int64_t c = 0; c < chunks; c++)
    for (int64_t j = 0; j < 16; j++) a.gsum[(c * 128 + 8 * j) / group] += a.qsa[c * 16 + j];
}

struct Weights {
  const uint8_t* w;
  const uint8_t* zp;
  const void* scale;
  bool scale_f16;
  int64_t N, K, group, bits;
  uint8_t flip;  // 0x88: signed 4-bit values, each nibble XORed with 8 (v + 8 against zero points of 8); else 0

  float s(int64_t i) const {
    return scale_f16 ? half_to_float(static_cast<const uint16_t*>(scale)[i]) : static_cast<const float*>(scale)[i];
  }
  int z(int64_t i) const { return bits == 8 ? zp[i] : (zp[i / 2] >> (4 * (i & 1))) & 0xf; }
};

// Row n of the weights against one activation row: the portable form (the vector kernels' reference).
float row_portable(const Weights& W, const ActRow& a, int64_t n) {
  if (W.bits == 16) {
    const uint16_t* w = reinterpret_cast<const uint16_t*>(W.w) + n * W.K;
    float acc = 0.f;
    const uint16_t* x = a.bf16();
    for (int64_t k = 0; k < W.K; k++) acc += from_bf16(w[k]) * from_bf16(x[k]);
    return acc;
  }
  if (W.bits == 8) {
    const uint8_t* w = W.w + n * W.K;
    float acc = 0.f;
    for (int64_t c = 0; c < W.K / 64; c++)
      for (int64_t j = 0; j < 16; j++) {
        int32_t d = 0;
        for (int64_t t = 0; t < 4; t++) d += (int32_t)w[c * 64 + 4 * j + t] * a.q[c * 64 + 4 * j + t];
        acc += (float)d * a.sa[c * 16 + j];
      }
    return W.s(n) * (acc - (float)W.z(n) * a.total);
  }
  const uint8_t* w = W.w + n * W.K / 2;
  const int64_t G = W.K / W.group;
  float acc = 0.f;
  for (int64_t c = 0; c < W.K / 128; c++)
    for (int64_t j = 0; j < 16; j++) {  // lane j sums k in [c * 128 + 8j, + 8): one group's
      const int64_t g = n * G + (c * 128 + 8 * j) / W.group;
      int32_t d = 0;
      for (int64_t t = 0; t < 4; t++) {
        const uint8_t byte = w[c * 64 + 4 * j + t] ^ W.flip;
        d += (int32_t)(byte & 0xf) * a.q[c * 128 + 4 * j + t] + (int32_t)(byte >> 4) * a.q[c * 128 + 64 + 4 * j + t];
      }
      acc += W.s(g) * ((float)d * a.sa[c * 16 + j] - (float)W.z(g) * a.qsa[c * 16 + j]);
    }
  return acc;
}

#if QGEMV_VNNI
// The int32 dot products of a 4-bit row's 64-byte chunk c (128 values) with the activations laid out for it: lane j
// sums k in [8j, 8j + 8), the low nibbles' products and the high nibbles'. The bytes PF ahead are prefetched.
template <bool FLIP>
inline __m512i dot4(const uint8_t* w, const int8_t* q, int64_t c) {
  const __m512i low = _mm512_set1_epi8(0x0f);
  __m512i v = _mm512_loadu_si512(w + c * 64);
  if (FLIP) v = _mm512_xor_si512(v, _mm512_set1_epi8((char)0x88));
  _mm_prefetch((const char*)(w + c * 64 + PF), _MM_HINT_T0);
  const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(q + c * 128)), hi,
                             _mm512_loadu_si512(q + c * 128 + 64));
}

// R rows of 8-bit weights (one group a row; rows n[0..R), written to y[n[r]]) against one activation row: a dpbusd
// per 64 bytes, its int32 sums scaled per 32-block of activations; the zero point's term once a row (ActRow::total).
// R = 2 reads two rows from two places at once, two sequential streams (row_pairs): on the Zen 4 (2 cores) one
// stream a thread read at 19 GB/s a core, and bench-1b's 8-bit matmuls took 1.08-1.12x as long with one as with two
// (the two forms in one process, docs/performance.md); 4-bit and bf16 rows gained nothing from it there (0.82x, 1.01x).
template <int R>
void rows_vnni8(const Weights& W, const ActRow& a, const int64_t* n, float* y) {
  const uint8_t* w[R];
  __m512 acc[R];
  for (int r = 0; r < R; r++) w[r] = W.w + n[r] * W.K, acc[r] = _mm512_setzero_ps();
  const int64_t chunks = W.K / 64;
  const int8_t* q = a.q.data();
  const float* sa = a.sa.data();
  for (int64_t c = 0; c < chunks; c++) {  // the activations' chunk loaded once for the R rows
    const __m512i qc = _mm512_loadu_si512(q + c * 64);
    const __m512 sc = _mm512_loadu_ps(sa + c * 16);
    for (int r = 0; r < R; r++) {
      _mm_prefetch((const char*)(w[r] + c * 64 + PF), _MM_HINT_T0);
      const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(w[r] + c * 64), qc);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sc, acc[r]);
    }
  }
  for (int r = 0; r < R; r++) y[n[r]] = W.s(n[r]) * (_mm512_reduce_add_ps(acc[r]) - (float)W.z(n[r]) * a.total);
}

// Row n of 4-bit weights against one activation row. Per 64 bytes (128 values): two dpbusd, their int32 sums
// scaled per 32-block of activations; each group's sum scaled by its weight scale into one of two accumulators (in
// turn, so that no chain of dependent FMAs paces the loop); the zero points' term summed in scalars, per group:
// s_w z sum_k s_a q_k over the group (ActRow::gsum). One sequential stream a thread, prefetched PF bytes ahead.
template <bool FLIP>
float row_vnni4(const Weights& W, const ActRow& a, int64_t n) {
  const int64_t G = W.K / W.group, per = W.group / 128;
  const uint8_t* w = W.w + n * W.K / 2;
  const int8_t* q = a.q.data();
  const float* sa = a.sa.data();
  auto group = [&](int64_t g) {  // the group's sum, scaled per 32-block of activations
    __m512 gacc = _mm512_setzero_ps();
    for (int64_t c = g * per; c < (g + 1) * per; c++)
      gacc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot4<FLIP>(w, q, c)), _mm512_loadu_ps(sa + c * 16), gacc);
    return gacc;
  };
  auto scale = [&](int64_t i) {
    return W.scale_f16 ? _cvtsh_ss(static_cast<const uint16_t*>(W.scale)[i]) : static_cast<const float*>(W.scale)[i];
  };
  auto zero = [&](int64_t i) { return (float)((W.zp[i >> 1] >> (4 * (i & 1))) & 0xf); };
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  float z0 = 0.f, z1 = 0.f;
  int64_t g = 0;
  for (; g + 1 < G; g += 2) {
    const int64_t i = n * G + g;
    const float s0 = scale(i), s1 = scale(i + 1);
    acc0 = _mm512_fmadd_ps(group(g), _mm512_set1_ps(s0), acc0);
    acc1 = _mm512_fmadd_ps(group(g + 1), _mm512_set1_ps(s1), acc1);
    z0 += s0 * zero(i) * a.gsum[g];
    z1 += s1 * zero(i + 1) * a.gsum[g + 1];
  }
  if (g < G) {
    const float s0 = scale(n * G + g);
    acc0 = _mm512_fmadd_ps(group(g), _mm512_set1_ps(s0), acc0);
    z0 += s0 * zero(n * G + g) * a.gsum[g];
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) - (z0 + z1);
}

// Row n of 4-bit weights in groups of GS (32 or 64) values: a 64-byte chunk holds 128 / GS groups, so each lane takes
// its group's weight scale and zero point (lane j sums k in [8j, 8j + 8)), both gathered into vectors per chunk.
template <int GS, bool FLIP>
float row_vnni4_small(const Weights& W, const ActRow& a, int64_t n) {
  constexpr int PER = 128 / GS;  // groups a chunk
  const int64_t G = W.K / GS, chunks = W.K / 128;
  const __m512i nibble = _mm512_set1_epi32(0xf);
  const __m512i lane_group = GS == 32 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                                      : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i shift = _mm512_slli_epi32(lane_group, 2);
  const uint8_t* w = W.w + n * W.K / 2;
  const int8_t* q = a.q.data();
  auto chunk = [&](int64_t c) {
    const __m512i d = dot4<FLIP>(w, q, c);
    const int64_t i0 = n * G + c * PER;  // the chunk's first group: even, so its zero points start a byte
    __m128 s4;
    if (W.scale_f16) {
      const uint16_t* h = static_cast<const uint16_t*>(W.scale) + i0;
      uint64_t bits = 0;
      std::memcpy(&bits, h, PER * 2);
      s4 = _mm_cvtph_ps(_mm_cvtsi64_si128((long long)bits));
    } else {
      float f[4] = {0.f, 0.f, 0.f, 0.f};
      std::memcpy(f, static_cast<const float*>(W.scale) + i0, PER * 4);
      s4 = _mm_loadu_ps(f);
    }
    const __m512 sw = _mm512_permutexvar_ps(lane_group, _mm512_castps128_ps512(s4));
    uint32_t zbits = 0;
    std::memcpy(&zbits, W.zp + i0 / 2, PER / 2);
    const __m512 z = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)zbits), shift),
                                                         nibble));
    const __m512 t = _mm512_fnmadd_ps(z, _mm512_loadu_ps(a.qsa.data() + c * 16),
                                      _mm512_mul_ps(_mm512_cvtepi32_ps(d), _mm512_loadu_ps(a.sa.data() + c * 16)));
    return _mm512_mul_ps(t, sw);
  };
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 1 < chunks; c += 2) {
    acc0 = _mm512_add_ps(acc0, chunk(c));
    acc1 = _mm512_add_ps(acc1, chunk(c + 1));
  }
  if (c < chunks) acc0 = _mm512_add_ps(acc0, chunk(c));
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#endif

#if QGEMV_BF16
// Row n of bf16 weights against one activation row in bf16: a dpbf16ps per 64 bytes (32 products summed in pairs
// into 16 f32 lanes), four accumulators in turn, one sequential stream prefetched PF bytes ahead; K's tail below 32
// values through masked loads.
float row_bf16(const Weights& W, const ActRow& a, int64_t n) {
  const int64_t K = W.K;
  const uint16_t* w = reinterpret_cast<const uint16_t*>(W.w) + n * K;
  const uint16_t* x = a.bf16();
  auto dot = [](__m512 acc, const uint16_t* p, const uint16_t* q) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(p), (__m512bh)_mm512_loadu_si512(q));
  };
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 128 <= K; k += 128) {
    const char* ahead = reinterpret_cast<const char*>(w + k) + PF16;
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    _mm_prefetch(ahead + 128, _MM_HINT_T0);
    _mm_prefetch(ahead + 192, _MM_HINT_T0);
    a0 = dot(a0, w + k, x + k);
    a1 = dot(a1, w + k + 32, x + k + 32);
    a2 = dot(a2, w + k + 64, x + k + 64);
    a3 = dot(a3, w + k + 96, x + k + 96);
  }
  for (; k + 32 <= K; k += 32) a0 = dot(a0, w + k, x + k);
  if (k < K) {
    const __mmask32 m = (__mmask32)((1ull << (K - k)) - 1);
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_maskz_loadu_epi16(m, w + k),
                          (__m512bh)_mm512_maskz_loadu_epi16(m, x + k));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
#endif

#if QGEMV_AMX
// AMX-BF16 (prompts): C^T = W X^T a 32 x 32 block at a time, in 4 accumulator tiles (0-3) from 2 tiles of weights
// (4, 5: 16 rows of W x 32 values, row-major as the decode steps read them) and 2 of activations (6, 7: 16 rows of
// X x 32 values, packed as the instruction's second operand wants: value pairs of a row side by side, rows along
// the tile's 64 bytes). The accumulators come out transposed (16 rows of W x 16 of X) and are turned into rows of Y
// in registers. Up to 32 rows of X, each weight tile meets X once and is read where W keeps it, its rows' streams
// prefetched; more rows, and a block of W (AMX_NB rows x AMX_KC values) is copied tile by tile into a buffer that
// stays in L2 (a tile read from W itself takes 16 lines 2K or more bytes apart, all in one L1 set) and meets every
// pair of X's tiles. On the 2-core AMX Xeon, one matmul of 512 rows: K 2048 x N 8192 or 16384, and K 8192 x N 2048,
// 1.06-1.07x the plugin's bf16 FullyConnected (paired, one process); bench-1b's prompts docs/performance.md.
struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux lends a process AMX's tile registers only once it asks (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); the
// plugin's own AMX kernels ask too. False where the kernel refuses: the rows then take dpbf16ps.
bool amx_granted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  auto lo = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  auto hi = [](__m512 a, __m512 b) {
    return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
  };
  for (int i = 0; i < 4; i++) {
    r[4 * i] = lo(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = hi(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = lo(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = hi(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 4; i++) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; i++) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd);
  }
}

// Rows [m0, m0 + 16) of X (f32, rows past M zero) as bf16 tiles, one a 32 values of K: tile kb's row p holds the
// pairs (x[m][32 kb + 2p], x[m][32 kb + 2p + 1]) of its 16 rows m, side by side.
void pack_rows(const float* x, int64_t M, int64_t K, int64_t m0, uint16_t* out) {
  uint32_t* dst = reinterpret_cast<uint32_t*>(out);
  alignas(64) uint32_t pairs[16];
  for (int64_t kb = 0; kb < K / 32; kb++, dst += 256)
    for (int64_t i = 0; i < 16; i++) {
      if (m0 + i < M) {
        const float* row = x + (m0 + i) * K + kb * 32;
        _mm512_store_si512(pairs, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16), _mm512_loadu_ps(row)));
      } else {
        std::memset(pairs, 0, sizeof pairs);
      }
      for (int64_t p = 0; p < 16; p++) dst[p * 16 + i] = pairs[p];
    }
}

// An accumulator tile (16 rows of W from n x 16 rows of X from m), turned into rows of Y (those below M).
inline void store_tile(const float* acc, int64_t n, int64_t m, int64_t M, int64_t N, float* y) {
  if (m >= M) return;
  __m512 r[16];
  for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(acc + i * 16);
  transpose16(r);
  for (int64_t j = 0; j < std::min<int64_t>(16, M - m); j++) _mm512_storeu_ps(y + (m + j) * N + n, r[j]);
}

// The 4 accumulator tiles: zeroed, or loaded from / stored to 4 x 256 floats (one tile after the other).
inline void zero_acc() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}
inline void load_acc(const float* from) {
  _tile_loadd(0, from, 64);
  _tile_loadd(1, from + 256, 64);
  _tile_loadd(2, from + 512, 64);
  _tile_loadd(3, from + 768, 64);
}
inline void store_acc(float* to) {
  _tile_stored(0, to, 64);
  _tile_stored(1, to + 256, 64);
  _tile_stored(2, to + 512, 64);
  _tile_stored(3, to + 768, 64);
}

// One step of 32 values of K: 2 weight tiles (a0, a1: rows `stride` bytes apart) meet 2 packed tiles of X.
inline void dot_step(const uint16_t* a0, const uint16_t* a1, int64_t stride, const uint16_t* x0, const uint16_t* x1) {
  _tile_loadd(4, a0, stride);
  _tile_loadd(5, a1, stride);
  _tile_loadd(6, x0, 64);
  _tile_loadd(7, x1, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// A 64-byte aligned pointer into `v`, grown to hold n values (a thread's scratch, kept between steps: a fresh one
// a step would be zeroed and faulted in).
template <typename T>
T* scratch(std::vector<T>& v, int64_t n) {
  if ((int64_t)v.size() < n + 64) v.resize(n + 64);
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63));
}

// Y[m, n] for rows m < M of a pass (xp: its rows packed, mp of them, a multiple of 32) and the weight rows [n0, n1)
// (multiples of 32) of bf16 W [N, K], in blocks of AMX_NB rows and chunks of AMX_KC values of K: a block's chunk
// is copied into `panel` (AMX_NB x AMX_KC values) and meets every pair of X's tiles, each pair once for the block's
// (up to 4) pairs of weight tiles, so that X's packed rows are read from beyond L2 once a block rather than once
// a 32 rows; sums over K longer than a chunk wait in `part` (f32, AMX_NB x mp) between chunks. The caller has
// loaded the tile configuration.
void amx_blocks(const uint16_t* W, int64_t K, int64_t N, const uint16_t* xp, int64_t M, int64_t mp, float* y,
                int64_t n0, int64_t n1, uint16_t* panel, float* part) {
  const int64_t KB = K / 32, mpairs = mp / 32;
  alignas(64) float acc[4][256];
  if (mpairs == 1) {  // at most 32 rows: each weight tile meets X once, so it is read where W keeps it
    const uint16_t* x0 = xp;
    const uint16_t* x1 = x0 + KB * 512;
    const int64_t stride = K * 2;
    for (int64_t nb = n0; nb < n1; nb += 32) {
      const uint16_t* w0 = W + nb * K;
      const uint16_t* w1 = w0 + 16 * K;
      zero_acc();
      for (int64_t kb = 0; kb < KB; kb++) {
        for (int r = 0; r < 32; r++)  // each of the 32 rows' streams, PF16 bytes ahead
          _mm_prefetch(reinterpret_cast<const char*>(w0 + r * K + kb * 32) + PF16, _MM_HINT_T0);
        dot_step(w0 + kb * 32, w1 + kb * 32, stride, x0 + kb * 512, x1 + kb * 512);
      }
      store_acc(acc[0]);
      for (int q = 0; q < 4; q++) store_tile(acc[q], nb + (q >> 1) * 16, (q & 1) * 16, M, N, y);
    }
    return;
  }
  for (int64_t nb = n0; nb < n1; nb += AMX_NB) {
    const int64_t pairs = std::min(AMX_NB, n1 - nb) / 32;
    for (int64_t k0 = 0; k0 < K; k0 += AMX_KC) {
      const int64_t kc = std::min(AMX_KC, K - k0) / 32;  // tiles of the chunk
      const bool first = k0 == 0, last = k0 + AMX_KC >= K;
      // the block's rows are one run of memory, read in order (prefetched as the row kernel's) into tiles: pair
      // p's tile kb of rows 0-15, then of rows 16-31
      for (int64_t r = 0; r < pairs * 32; r++) {
        const uint16_t* w = W + (nb + r) * K + k0;
        uint16_t* to = panel + (r / 32) * kc * 1024 + (r % 32) * 32;
        for (int64_t kb = 0; kb < kc; kb++) {
          _mm_prefetch(reinterpret_cast<const char*>(w + kb * 32) + PF16, _MM_HINT_T0);
          _mm512_store_si512(to + kb * 1024, _mm512_loadu_si512(w + kb * 32));
        }
      }
      for (int64_t mq = 0; mq < mpairs; mq++) {
        const uint16_t* x0 = xp + (2 * mq * KB + k0 / 32) * 512;
        const uint16_t* x1 = x0 + KB * 512;
        for (int64_t p = 0; p < pairs; p++) {
          float* kept = part + (p * mpairs + mq) * 1024;
          if (first)
            zero_acc();
          else
            load_acc(kept);
          const uint16_t* a = panel + p * kc * 1024;
          for (int64_t kb = 0; kb < kc; kb++)
            dot_step(a + kb * 1024, a + kb * 1024 + 512, 64, x0 + kb * 512, x1 + kb * 512);
          if (!last) {
            store_acc(kept);
            continue;
          }
          store_acc(acc[0]);
          for (int q = 0; q < 4; q++) store_tile(acc[q], nb + p * 32 + (q >> 1) * 16, mq * 32 + (q & 1) * 16, M, N, y);
        }
      }
    }
  }
}

// Y = X W^T over bf16 W through AMX tiles, for K a multiple of 32 and N's 32-row blocks (the rows past them are
// the caller's): X's rows in passes of AMX_PASS_BYTES once packed, each pass's blocks split over the threads.
void amx_rows(const uint16_t* W, int64_t K, int64_t N, const float* x, int64_t M, float* y) {
  const int64_t pass = std::max<int64_t>(32, AMX_PASS_BYTES / (K * 2) / 32 * 32), blocks = N / 32;
  thread_local std::vector<uint16_t> packed;
  uint16_t* xp = scratch(packed, std::min(pass, (M + 31) / 32 * 32) * K);
  const int64_t pieces = std::max(1, tbb::this_task_arena::max_concurrency());
  for (int64_t m0 = 0; m0 < M; m0 += pass) {
    const int64_t rows = std::min(pass, M - m0), mp = (rows + 31) / 32 * 32;
    tbb::parallel_for(int64_t(0), mp / 16, [&](int64_t mb) {
      pack_rows(x + m0 * K, rows, K, mb * 16, xp + mb * 16 * K);
    });
    tbb::parallel_for(int64_t(0), pieces, [&](int64_t t) {
      thread_local std::vector<uint16_t> panels;
      thread_local std::vector<float> parts;
      uint16_t* panel = scratch(panels, AMX_NB * std::min(AMX_KC, K));
      float* part = K > AMX_KC ? scratch(parts, AMX_NB * mp) : nullptr;
      TileConfig cfg;
      for (int i = 0; i < 8; i++) {
        cfg.rows[i] = 16;
        cfg.colsb[i] = 64;
      }
      _tile_loadconfig(&cfg);
      amx_blocks(W, K, N, xp, rows, mp, y + m0 * N, blocks * t / pieces * 32, blocks * (t + 1) / pieces * 32, panel,
                 part);
      _tile_release();
    }, tbb::simple_partitioner());
  }
}
#endif

class QGemv : public ov::op::Op {
 public:
  OPENVINO_OP("QGemv", "kvexport");

  QGemv() = default;
  QGemv(const ov::OutputVector& args, int64_t n, int64_t k, int64_t group, int64_t bits, int64_t flip = 0)
      : Op(args), n_(n), k_(k), group_(group), bits_(bits), flip_(flip) {
    constructor_validate_and_infer_types();
  }

  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 4, "QGemv takes 4 inputs, got ", get_input_size());
    NODE_VALIDATION_CHECK(this, bits_ == 4 || bits_ == 8 || bits_ == 16, "bits must be 4, 8 or 16 (bf16)");
    NODE_VALIDATION_CHECK(this, flip_ == 0 || bits_ == 4, "flip (signed values) is for 4 bits");
    NODE_VALIDATION_CHECK(this, n_ > 0 && k_ > 0 && k_ % (bits_ == 4 ? 128 : bits_ == 8 ? 64 : 1) == 0,
                          "K must be a positive multiple of 128 (4 bits) or 64 (8 bits)");
    NODE_VALIDATION_CHECK(this, bits_ != 4 ? group_ == k_ : ((group_ == 32 || group_ == 64 || group_ % 128 == 0) &&
                                                            k_ % group_ == 0),
                          "4 bits: the group must be 32, 64 or a multiple of 128 dividing K; 8 or 16 bits: one "
                          "group a row");
    for (size_t i : {1, 2})
      NODE_VALIDATION_CHECK(this, get_input_element_type(i) == ov::element::u8, "weights and zero points are u8 bytes");
    const auto st = get_input_element_type(3);
    NODE_VALIDATION_CHECK(this, st == ov::element::f16 || st == ov::element::f32, "scales are f16 or f32");
    auto shape = get_input_partial_shape(0);
    NODE_VALIDATION_CHECK(this, shape.rank().is_static() && shape.rank().get_length() >= 1, "X needs a rank");
    NODE_VALIDATION_CHECK(this, shape[shape.size() - 1].compatible(k_), "X's last dimension must be K");
    shape[shape.size() - 1] = n_;
    set_output_type(0, ov::element::f32, shape);
  }

  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<QGemv>(args, n_, k_, group_, bits_, flip_);
  }

  bool visit_attributes(ov::AttributeVisitor& v) override {
    v.on_attribute("n", n_);
    v.on_attribute("k", k_);
    v.on_attribute("group", group_);
    v.on_attribute("bits", bits_);
    v.on_attribute("flip", flip_);
    return true;
  }

  bool has_evaluate() const override { return true; }

  bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
    const auto& xt = inputs[0];
    const int64_t K = k_, N = n_, G = K / group_;
    const int64_t M = (int64_t)xt.get_size() / K;
    if ((int64_t)xt.get_size() != M * K || xt.get_element_type() != ov::element::f32)
      OPENVINO_THROW("QGemv: X must be f32 with last dimension ", K);
    if ((int64_t)inputs[1].get_byte_size() != N * K * bits_ / 8 ||
        (bits_ != 16 && ((int64_t)inputs[2].get_byte_size() != (N * G * bits_ + 7) / 8 ||
                         (int64_t)inputs[3].get_size() != N * G)))
      OPENVINO_THROW("QGemv: the weights, zero points or scales do not hold N x K values in groups of ", group_);
    auto oshape = xt.get_shape();
    oshape.back() = N;
    outputs[0].set_shape(oshape);
    const Weights W{static_cast<const uint8_t*>(inputs[1].data()), static_cast<const uint8_t*>(inputs[2].data()),
                    inputs[3].data(), inputs[3].get_element_type() == ov::element::f16, N, K, group_, bits_,
                    (uint8_t)(flip_ ? 0x88 : 0)};
    const float* x = xt.data<const float>();
    float* y = outputs[0].data<float>();
    int64_t n_done = 0;  // rows of W the AMX tiles took
#if QGEMV_AMX
    if (bits_ == 16 && M >= AMX_ROWS && K % 32 == 0 && N >= 32 && amx_granted()) {
      amx_rows(static_cast<const uint16_t*>(inputs[1].data()), K, N, x, M, y);
      n_done = N / 32 * 32;
      if (n_done == N) return true;
    }
#endif
    std::vector<ActRow> acts(M);
    if (M < 4) {  // a decode step's row or a few: not worth waking the other threads
      for (int64_t m = 0; m < M; m++) quantize(x + m * K, K, group_, (int)bits_, acts[m]);
    } else {
      tbb::parallel_for(int64_t(0), M, [&](int64_t m) { quantize(x + m * K, K, group_, (int)bits_, acts[m]); });
    }
    // contiguous runs of rows, a few a thread: long sequential streams, which the prefetchers follow
    const int64_t pieces = std::max(1, tbb::this_task_arena::max_concurrency()) * PIECES;
    const int64_t rest = N - n_done;
    tbb::parallel_for(int64_t(0), pieces, [&](int64_t t) {
      const int64_t n0 = n_done + rest * t / pieces, n1 = n_done + rest * (t + 1) / pieces;
      if (M == 1) return row_pairs(W, acts[0], n0, n1, y);
      for (int64_t b = n0; b < n1; b += ROWS)
        for (int64_t m = 0; m < M; m++) rows(W, acts[m], b, std::min(n1, b + ROWS), y + m * N);
    }, tbb::simple_partitioner());
    return true;
  }

  static void rows(const Weights& W, const ActRow& a, int64_t n0, int64_t n1, float* y) {
    int64_t n = n0;
#if QGEMV_BF16
    if (W.bits == 16) {
      for (; n < n1; n++) y[n] = row_bf16(W, a, n);
      return;
    }
#endif
#if QGEMV_VNNI
    if (W.bits == 8) {
      for (; n < n1; n++) rows_vnni8<1>(W, a, &n, y);
      return;
    }
    float (*row)(const Weights&, const ActRow&, int64_t) =
        W.bits == 16  ? row_portable
        : W.flip      ? (W.group == 32 ? row_vnni4_small<32, true> : W.group == 64 ? row_vnni4_small<64, true>
                                                                                   : row_vnni4<true>)
        : W.group == 32 ? row_vnni4_small<32, false>
        : W.group == 64 ? row_vnni4_small<64, false>
                        : row_vnni4<false>;
    for (; n < n1; n++) y[n] = row(W, a, n);
#else
    for (; n < n1; n++) y[n] = row_portable(W, a, n);
#endif
  }

  // Rows [n0, n1) of 8-bit weights against a decode step's one activation row, two at a time: row n0 + i with row
  // n0 + half + i, two sequential streams (rows_vnni8); other weights a row at a time.
  static void row_pairs(const Weights& W, const ActRow& a, int64_t n0, int64_t n1, float* y) {
#if QGEMV_VNNI
    if (W.bits == 8) {
      const int64_t half = (n1 - n0) / 2;
      for (int64_t i = 0; i < half; i++) {
        const int64_t n[2] = {n0 + i, n0 + half + i};
        rows_vnni8<2>(W, a, n, y);
      }
      return rows(W, a, n0 + 2 * half, n1, y);
    }
#endif
    rows(W, a, n0, n1, y);
  }

  int64_t n_ = 0, k_ = 0, group_ = 0, bits_ = 4, flip_ = 0;
};

}  // namespace

// What the library's kernels compute with, for kvexport_intel.gemv: 4/8-bit weights', bf16 weights'.
extern "C" const char* kvexport_qgemv_kernel() { return QGEMV_KERNEL; }
extern "C" const char* kvexport_qgemv_bf16_kernel() { return QGEMV_BF16_KERNEL; }
// What steps of AMX_ROWS rows or more over bf16 weights take: "AMX-BF16" (compiled for it, and the kernel lends this
// process the tiles), or "" (the row kernel's dot products).
extern "C" const char* kvexport_qgemv_bf16_rows_kernel() {
#if QGEMV_AMX
  if (amx_granted()) return QGEMV_ROWS_KERNEL;
#endif
  return "";
}

// dst[i] = src[i] rounded to bf16 (nearest even), over n values in runs on the calling process's TBB threads: the
// copy of an f32 weight that bits 16 read.
extern "C" void kvexport_qgemv_bf16(const float* src, uint16_t* dst, int64_t n) {
  constexpr int64_t RUN = 1 << 16;
  tbb::parallel_for(int64_t(0), (n + RUN - 1) / RUN, [&](int64_t r) {
    const int64_t i1 = std::min(n, (r + 1) * RUN);
    for (int64_t i = r * RUN; i < i1; i++) dst[i] = to_bf16(src[i]);
  });
}

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({std::make_shared<ov::OpExtension<QGemv>>()}));
