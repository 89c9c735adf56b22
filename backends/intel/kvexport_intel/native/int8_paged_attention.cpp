// kvexport's paged attention over an int8 block cache, an OpenVINO op (opset "kvexport", type
// Int8PagedAttention) that the intel target's paged form runs in place of OpenVINO's PagedAttentionExtension when
// the engine holds its cache as `i8` (kvexport_intel.int8_blocks builds the graph and compiles this file).
//
// Why: OpenVINO 2026.4's only 8-bit cache is u8 with an f32 scale and an f32 zero point per token and head: 72
// bytes per 64 values at head_dim 64, 0.281x an f32 cache. Here a token's key (and value) for one KV head is
// stored as head_dim int8 values, symmetric, with one f32 scale (its largest magnitude / 127): 68 bytes per 64,
// 0.266x.
//
// Inputs (PagedAttentionExtension's ports 0-2 and 5-10, the caches in this op's layout):
//   0 query (T, H*D) f32, 1 key (T, KV*D) f32 (rotated), 2 value (T, KV*D) f32
//   3 key_cache, 4 value_cache: int8 (blocks, KV, BS, D + 4); a block's rows for one KV head are BS*(D+4) bytes:
//     BS rows of D int8 values, then the BS rows' f32 scales
//   5 past_lens (n) i32, 6 subsequence_begins (n+1) i32, 7 block_indices i32, 8 block_indices_begins (n+1) i32:
//     as OpenVINO GenAI fills them (sequence s holds past_lens[s] tokens; its new tokens are
//     subsequence_begins[s] .. subsequence_begins[s+1] of the T rows; its block table is block_indices over
//     block_indices_begins[s] .. [s+1])
//   9 scale () f32 (the softmax scale), 10 sliding_window () i32 (0: none; else a key at most window - 1
//     positions behind the query is seen)
// Output: (T, H*D) f32. Attributes: heads, kv_heads, head_dim, block_size.
//
// Each new token's key and value are quantized and written into its sequence's blocks (slot past_lens[s] + j)
// first; then every new token attends causally over its sequence's slots, all read from the blocks, so a token is
// attended as the cache holds it whether it came in a prompt or a decode step. The caches are the request's own
// tensors (kvexport_intel.paged.PagedRows binds them once; the plugin hands this op their memory): written in
// place, nothing copied.
//
// A decode step (one new token a sequence) splits each sequence's slots into runs of RUN for the threads (below
// SERIAL slots, all on the calling thread) and merges the runs' partial softmaxes after; a prompt takes tiles of QTILE tokens, each chunk of keys and values
// made ready once for the tile (keys transposed, so that a query row's scores come out of vector products over the
// head dimension without horizontal sums). Where the CPU has VNNI, scores are int8 products (the query rows rounded
// to int8 as the keys are), a decode step's too; where it has AVX512-BF16, a prompt's weighted values are bf16 pair
// products (the values' int8 exact, the weights rounded to bf16); a decode step's weighted values, and CPUs without
// them, compute in f32 (AVX2: int16 products, below). Where the CPU has AMX (and Linux lets the process use its
// tiles), a prompt tile's scores and weighted values are those same int8 and bf16 products on AMX tiles, 16 query
// rows at a time (amx_rows, below), their softmax in the same passes that scale the scores and round the weights.
#include <sys/syscall.h>
#include <tbb/parallel_for.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include <immintrin.h>

#include "simd_math.h"  // kvexport/native/simd_math.h (int8_blocks.library puts its folder on the include path)

#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>
#include <openvino/op/op.hpp>

namespace {

constexpr int64_t RUN = 512;   // cache slots a decode task reads
constexpr int64_t QTILE = 32;  // prompt tokens a task takes (QTILE_AMX where its prompts run on AMX tiles)
// On the 2-core AMX Xeon (benchmarks/i8_decode_op.py --prompt: a 4000-token prompt, one layer, 12/4 heads, head_dim
// 64): 58 ms a layer with tiles of 32 tokens on AMX, 50.8 with 64, 50.5 with 128 (the vector kernels 110, 106, 103)
constexpr int64_t QTILE_AMX = 64;
// A decode step reading fewer slots than this (summed over its sequences and KV heads) runs on the calling thread:
// waking the other costs more. On the Zen 4 (bench-125m int4 g32, `kvexport bench --step-pairs`, i8 against u8):
// prompt 32 0.91x u8's steps split over the threads, 0.97x on one; 256 and 512 1.020x / 1.015x split, 1.000x / 1.008x
// on one.
constexpr int64_t SERIAL = 1024;
constexpr int64_t MAX_D = 256;
constexpr int64_t MAX_BS = 64;
constexpr int64_t MAX_GROUP = 16;

// The bytes of a u8 query row (and the rows of four key values) the scores' tiles take (I8_AMX builds): the head size rounded up to
// 64, a tile's depth; the keys' rows past the head size stay zero, so the query's padding adds nothing.
constexpr int64_t amx_depth(int64_t D) { return (D + 63) / 64 * 64; }

struct Shape {
  int64_t H, KV, D, BS, G;  // query heads, KV heads, head size, block size, query heads a KV head
  int64_t row_bytes() const { return BS * (D + 4); }  // one block's bytes for one KV head
};

// Symmetric int8 with one f32 scale: x ~ q * scale, scale = max|x| / 127 (0 for an all-zero row, stored as 0s).
void quantize(const float* x, int64_t D, int8_t* q, float* scale) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t d = 0; d < D; d++) amax = std::max(amax, std::fabs(x[d]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t d = 0; d < D; d++) q[d] = (int8_t)std::nearbyint(std::min(127.f, std::max(-127.f, x[d] * inv)));
  *scale = amax / 127.f;
}

struct Seqs {
  const int32_t *past, *begins, *blocks, *block_begins;
  int64_t n;
  int64_t pos(int64_t s, int64_t t) const { return past[s] + (t - begins[s]); }  // slot of new row t of sequence s
  int32_t block(int64_t s, int64_t slot, int64_t BS) const { return blocks[block_begins[s] + slot / BS]; }
};

// A block's rows for KV head h: BS*D int8 values, then BS f32 scales.
inline int8_t* rows_of(int8_t* cache, const Shape& sh, int64_t block, int64_t h) {
  return cache + (block * sh.KV + h) * sh.row_bytes();
}
inline float* scales_of(int8_t* rows, const Shape& sh) { return reinterpret_cast<float*>(rows + sh.BS * sh.D); }
inline const float* scales_of(const int8_t* rows, const Shape& sh) {
  return reinterpret_cast<const float*>(rows + sh.BS * sh.D);
}

// exp(x) for x <= 0 in a form the compiler vectorizes (libm's expf is a call a lane): 2^n * e^r with
// r = x - n ln 2 in [-ln2/2, ln2/2], e^r by its degree-6 Taylor polynomial (relative error below 2e-7, about
// float's rounding); x below -87 (e^-87 ~ 1.6e-38) gives 0, as do the masked scores' -inf.
#pragma omp declare simd
inline float exp_neg(float x) {
  const float t = std::max(x, -87.f) * 1.44269504088896341f;
  const float n = (t + 12582912.f) - 12582912.f;  // t rounded to the nearest integer (1.5 * 2^23)
  const float r = (t - n) * 0.693147180559945309f;
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return x < -87.f ? 0.f : p * two_n;
}

// Slots lo..hi-1 of sequence s, head h, for the G query rows q (G x D, already scaled): each row's running max m,
// sum l and weighted values o (G x D), as a flash-attention pass leaves them. A block's rows are widened to f32
// once for the G rows.
// CD, CBS: the head size and block size where known when compiled (0: sh's), so that the loops over them unroll.
template <int64_t CD, int64_t CBS>
void attend_run(const float* q, int64_t G, int8_t* kc, int8_t* vc, const Shape& sh, const Seqs& seqs, int64_t s,
                int64_t h, int64_t lo, int64_t hi, float* m, float* l, float* o) {
  const int64_t D = CD ? CD : sh.D, BS = CBS ? CBS : sh.BS;
  for (int64_t g = 0; g < G; g++) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
    std::fill(o + g * D, o + (g + 1) * D, 0.f);
  }
  alignas(64) float score[MAX_GROUP][MAX_BS];
  alignas(64) float row[MAX_D];
  for (int64_t start = lo; start < hi;) {
    const int64_t slot0 = start % BS, n = std::min(BS - slot0, hi - start);
    const int32_t b = seqs.block(s, start, BS);
    int8_t* kb = rows_of(kc, sh, b, h);
    int8_t* vb = rows_of(vc, sh, b, h);
    const int8_t* krows = kb + slot0 * D;
    const float* ks = scales_of(kb, sh) + slot0;
    const int8_t* vrows = vb + slot0 * D;
    const float* vs = scales_of(vb, sh) + slot0;
    for (int64_t j = 0; j < n; j++) {
      const int8_t* k = krows + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; d++) row[d] = (float)k[d];
      for (int64_t g = 0; g < G; g++) {
        const float* qg = q + g * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; d++) dot += qg[d] * row[d];
        score[g][j] = dot * ks[j];
      }
    }
    for (int64_t g = 0; g < G; g++) {
      float mx = m[g], sum = 0.f;
      float* sg = score[g];
#pragma omp simd reduction(max : mx)
      for (int64_t j = 0; j < n; j++) mx = std::max(mx, sg[j]);
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < n; j++) {
        sg[j] = exp_neg(sg[j] - mx);
        sum += sg[j];
      }
      const float corr = exp_neg(m[g] - mx);
      l[g] = l[g] * corr + sum;
      m[g] = mx;
      if (corr != 1.f) {
        float* og = o + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) og[d] *= corr;
      }
    }
    for (int64_t j = 0; j < n; j++) {
      const int8_t* v = vrows + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; d++) row[d] = (float)v[d] * vs[j];
      for (int64_t g = 0; g < G; g++) {
        const float p = score[g][j];
        float* og = o + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) og[d] += p * row[d];
      }
    }
    start += n;
  }
}

// The first slot a query at position `pos` sees.
inline int64_t first_seen(int64_t pos, int64_t window) { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }

// A tile of new tokens t0..t1-1 of sequence s (positions p0..p0+t1-t0-1) for KV head h: every query head of the
// group over the slots each token sees, a block of keys and values widened to f32 once for the tile.
template <int64_t CD, int64_t CBS>
void attend_tile(const float* query, float* out, int8_t* kc, int8_t* vc, const Shape& sh, const Seqs& seqs,
                 int64_t s, int64_t h, int64_t t0, int64_t t1, float scale, int64_t window) {
  const int64_t D = CD ? CD : sh.D, BS = CBS ? CBS : sh.BS, G = sh.G, rows = (t1 - t0) * G;
  const int64_t p0 = seqs.pos(s, t0), plast = p0 + (t1 - t0) - 1;
  std::vector<float> buf(rows * (D + 2) + D * BS + BS * D);
  float *o = buf.data(), *m = o + rows * D, *l = m + rows, *kt = l + rows, *vf = kt + D * BS;
  std::vector<float> q(rows * D);
  for (int64_t t = t0; t < t1; t++)
    for (int64_t g = 0; g < G; g++) {
      const float* src = query + t * sh.H * D + (h * G + g) * D;
      float* dst = q.data() + ((t - t0) * G + g) * D;
      for (int64_t d = 0; d < D; d++) dst[d] = src[d] * scale;
    }
  for (int64_t r = 0; r < rows; r++) {
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  std::fill(o, o + rows * D, 0.f);
  alignas(64) float score[MAX_BS];
  for (int64_t start = (first_seen(p0, window) / BS) * BS; start <= plast; start += BS) {
    const int64_t n = std::min(BS, plast + 1 - start);
    const int32_t b = seqs.block(s, start, BS);
    const int8_t* krows = rows_of(kc, sh, b, h);
    const float* ks = scales_of(rows_of(kc, sh, b, h), sh);
    const int8_t* vrows = rows_of(vc, sh, b, h);
    const float* vs = scales_of(rows_of(vc, sh, b, h), sh);
    for (int64_t j = 0; j < n; j++)  // keys transposed: kt[d][j]
      for (int64_t d = 0; d < D; d++) kt[d * BS + j] = (float)krows[j * D + d] * ks[j];
    for (int64_t j = 0; j < n; j++)
#pragma omp simd
      for (int64_t d = 0; d < D; d++) vf[j * D + d] = (float)vrows[j * D + d] * vs[j];
    for (int64_t r = 0; r < rows; r++) {
      const int64_t pos = p0 + r / G, lo = std::max(start, first_seen(pos, window)) - start;
      const int64_t hi = std::min(n, pos + 1 - start);  // slots start+lo .. start+hi-1
      if (hi <= lo) continue;
      const float* qr = q.data() + r * D;
      for (int64_t j = 0; j < BS; j++) score[j] = 0.f;
      for (int64_t d = 0; d < D; d++) {
        const float x = qr[d];
        const float* kd = kt + d * BS;
#pragma omp simd
        for (int64_t j = 0; j < BS; j++) score[j] += x * kd[j];
      }
      float mx = m[r], sum = 0.f;
#pragma omp simd reduction(max : mx)
      for (int64_t j = lo; j < hi; j++) mx = std::max(mx, score[j]);
#pragma omp simd reduction(+ : sum)
      for (int64_t j = lo; j < hi; j++) {
        score[j] = exp_neg(score[j] - mx);
        sum += score[j];
      }
      const float corr = exp_neg(m[r] - mx);
      l[r] = l[r] * corr + sum;
      float* orow = o + r * D;
      if (corr != 1.f) {
#pragma omp simd
        for (int64_t d = 0; d < D; d++) orow[d] *= corr;
      }
      for (int64_t j = lo; j < hi; j++) {
        const float p = score[j];
        const float* v = vf + j * D;
#pragma omp simd
        for (int64_t d = 0; d < D; d++) orow[d] += p * v[d];
      }
      m[r] = mx;
    }
  }
  for (int64_t t = t0; t < t1; t++)
    for (int64_t g = 0; g < G; g++) {
      const int64_t r = (t - t0) * G + g;
      const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
      float* dst = out + t * sh.H * D + (h * G + g) * D;
      for (int64_t d = 0; d < D; d++) dst[d] = o[r * D + d] * inv;
    }
}

#ifdef __AVX512F__
// ---------------------------------------------------------------- AVX-512 (compiled where -march=native has it)

// sum16 (16 vectors -> one vector of their 16 sums), exp16 (e^x to about 2 ulp, 0 below -104) and transpose16 (16 x 16),
// and their AVX2 forms sum8, exp8 and transpose8: simd_math.h

inline __mmask16 first(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1u); }

inline __m512 widen(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }

// How the prompt kernel multiplies, where -march=native has the instructions (kernels() names the choice):
// - the scores of VNNI: each query row quantized to int8 (symmetric, one f32 scale a row, as the keys are stored) and
//   offset by 128 to u8, four u8 x s8 products a 32-bit lane a vpdpbusd (64 a vector: four times a vector FMA's),
//   the offset taken back out with each key's sum of values x 128; a decode step's scores too, the other way round
//   (attend_run_vnni: the keys as u8, the query's sum taking the offset out);
// - the weighted values of AVX512-BF16: the values' int8 (exact in bf16) in pairs of slots, the weights (softmax
//   times each slot's value scale) rounded to bf16, two products a 32-bit lane a vdpbf16ps (twice a vector FMA's);
// else f32 FMAs over the keys and values widened and scaled.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(KVEXPORT_I8_F32_PROMPTS)
#define I8_QK_VNNI 1
#define I8_QK_NAME "int8 (VNNI)"
#else
#define I8_QK_VNNI 0
#define I8_QK_NAME "f32"
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && !defined(KVEXPORT_I8_F32_PROMPTS)
#define I8_PV_BF16 1
#define I8_PV_NAME "bf16 (AVX512-BF16)"
#else
#define I8_PV_BF16 0
#define I8_PV_NAME "f32"
#endif

#if I8_QK_VNNI && I8_PV_BF16 && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)
#define I8_AMX 1
// AMX: eight tile registers of up to 16 rows of 64 bytes, configured per thread (ldtilecfg) and used only after
// Linux has granted the process the tiles' state (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, once; a kernel
// before 5.16, or one that refuses, leaves the VNNI and AVX512-BF16 kernels in use). Every tile here is 16 x 64
// bytes: tmm0-3 sums (16 x 16 int32 scores, or 16 x 16 f32 weighted values), tmm4 a block of 16 query rows (64 u8
// of each) or of their weights (32 bf16 slots of each), tmm5-7 keys or values in VNNI layout (16 rows of four int8
// of 16 keys; or of two bf16 slots of 16 dimensions).
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

bool amx_granted() {
  static const bool granted = [] {
    constexpr long ARCH_GET_XCOMP_PERM = 0x1022, ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    unsigned long features = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &features) == 0 && (features >> XFEATURE_XTILEDATA & 1)) return true;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
}

// This thread's tiles as the AMX kernel needs them for its call, and given back as they were after (OpenVINO's own
// AMX kernels share the threads and configure their tiles themselves).
struct TilesHeld {
  TileConfig saved{};
  TilesHeld() {
    _tile_storeconfig(&saved);
    TileConfig cfg{};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
  }
  ~TilesHeld() {
    if (saved.palette)
      _tile_loadconfig(&saved);
    else
      _tile_release();
  }
};
#define I8_AMX_QK_NAME "int8 (AMX-INT8)"
#define I8_AMX_PV_NAME "bf16 (AMX-BF16)"
#else
#define I8_AMX 0
#endif

#if I8_QK_VNNI
// The scores of NR query rows (u8, offset by 128; rows `row` of qu) over 64 keys (kd: their int8 four a 32-bit lane,
// kd[d4 * CHUNK + j]), written to sc + i * CHUNK: the u8 x s8 products summed, less the offset's share (kcorr), times
// the key's and the row's scales.
template <int64_t D4, int64_t CHUNK, int NR>
inline void scores_vnni(const uint8_t* qu, const int64_t* row, const int32_t* kd, const int32_t* kcorr,
                        const float* kscl, const float* qscl, float* sc) {
  constexpr int64_t D = 4 * D4;
  __m512i acc[NR][4];
  for (int i = 0; i < NR; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = _mm512_setzero_si512();
  for (int64_t d4 = 0; d4 < D4; d4++) {
    const __m512i k0 = _mm512_load_si512(kd + d4 * CHUNK), k1 = _mm512_load_si512(kd + d4 * CHUNK + 16);
    const __m512i k2 = _mm512_load_si512(kd + d4 * CHUNK + 32), k3 = _mm512_load_si512(kd + d4 * CHUNK + 48);
    for (int i = 0; i < NR; i++) {
      int32_t four;
      std::memcpy(&four, qu + row[i] * D + 4 * d4, 4);
      const __m512i x = _mm512_set1_epi32(four);
      acc[i][0] = _mm512_dpbusd_epi32(acc[i][0], x, k0);
      acc[i][1] = _mm512_dpbusd_epi32(acc[i][1], x, k1);
      acc[i][2] = _mm512_dpbusd_epi32(acc[i][2], x, k2);
      acc[i][3] = _mm512_dpbusd_epi32(acc[i][3], x, k3);
    }
  }
  for (int i = 0; i < NR; i++) {
    const __m512 qs = _mm512_set1_ps(qscl[row[i]]);
    for (int u = 0; u < 4; u++) {
      const __m512i dot = _mm512_sub_epi32(acc[i][u], _mm512_load_si512(kcorr + u * 16));
      _mm512_store_ps(sc + i * CHUNK + u * 16,
                      _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(_mm512_load_ps(kscl + u * 16), qs)));
    }
  }
}
#endif

// The vector operations the prompt kernel takes, W lanes of f32 at a time: AVX-512 (V16, 32 registers) or AVX2 (V8,
// 16 registers), whichever the file is compiled with; RB(D): the query rows a block holds in registers, CS(NV): the
// vectors of a row's values summed at a time.
struct V16 {
  using F = __m512;
  using M = __mmask16;
  static constexpr int64_t W = 16;
  static constexpr int64_t RB(int64_t D) { return D <= 64 ? 5 : 3; }  // RB x D/16 value sums and RB x 4 score sums
  static constexpr int64_t CS(int64_t NV) { return NV; }
  static constexpr int64_t CHUNK = 128;  // slots a tile's pass takes
  static F load(const float* p) { return _mm512_load_ps(p); }
  static F loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_store_ps(p, x); }
  static void storeu(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F zero() { return _mm512_setzero_ps(); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F widen(const int8_t* p) { return ::widen(p); }
  static M lanes(int64_t lo, int64_t hi) { return first(hi) & (M)~first(lo); }  // lanes lo <= i < hi
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F mask_max(F acc, M m, F x) { return _mm512_mask_max_ps(acc, m, acc, x); }
  static F maskz(M m, F x) { return _mm512_maskz_mov_ps(m, x); }
  static float reduce_max(F x) { return _mm512_reduce_max_ps(x); }
  static float reduce_add(F x) { return _mm512_reduce_add_ps(x); }
  static float lane0(F x) { return _mm512_cvtss_f32(x); }
  static F exp(F x) { return exp16(x); }
  static void transpose(F* r) { transpose16(r); }
  static F load_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }  // 0 past n
  static F sum_rows(const F* v) { return sum16(v); }  // W vectors -> one vector of their W sums
};
#define I8_SIMD "AVX-512"
using Vec = V16;
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// ---------------------------------------------------------------- AVX2 (compiled where -march=native has it)
// How the AVX2 prompt kernel multiplies (no VNNI, no bf16 here): in 16-bit integers, vpmaddwd's two products a 32-bit
// lane (16 a vector: twice a vector FMA's, at the FMA's rate on a Zen 4 limited to 256 bits):
// - the scores: each query row rounded to int8 (one f32 scale a row, as VNNI's kernel does) against the keys' int8,
//   both widened to int16 pairs: exact integer dots times the two scales;
// - the weighted values: each row's weights (softmax times each slot's value scale) over a chunk as int16, 32767 for
//   the largest (one f32 scale a row and chunk), against the values' int8 widened to int16, slots in pairs: at most
//   CHUNK x 0.5 / 32767 = 2^-9 of the largest value off at the output (each chunk's error at most that share of its
//   largest weight, and the softmax's sum at least the chunks' largest weights).
// On a Zen 4 limited to AVX2, a 4000-token prompt's attention (one layer, 12/4 heads, head_dim 64, two threads) took
// 124 ms this way against 177 ms in f32 FMAs (docs/backends/intel.md).
#ifndef KVEXPORT_I8_F32_PROMPTS
#define I8_QK_I16 1
#define I8_QK_NAME "int8 (AVX2, int16 pairs)"
#define I8_PV_I16 1
#define I8_PV_NAME "int16 (AVX2)"
#else
#define I8_QK_I16 0
#define I8_QK_NAME "f32"
#define I8_PV_I16 0
#define I8_PV_NAME "f32"
#endif

struct V8 {
  using F = __m256;
  using M = __m256;  // all ones in the lanes taken
  static constexpr int64_t W = 8;
  // 16 registers: two rows' 4 score sums and 4 key vectors; their values 4 vectors (32 values) at a time
  static constexpr int64_t RB(int64_t) { return 2; }
  static constexpr int64_t CS(int64_t NV) { return NV < 4 ? NV : 4; }
  // a chunk's keys and values within the L1: 2 x 128 x D int16, or 2 x 64 x D floats
  static constexpr int64_t CHUNK = I8_QK_I16 ? 128 : 64;
  static F load(const float* p) { return _mm256_load_ps(p); }
  static F loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_store_ps(p, x); }
  static void storeu(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F zero() { return _mm256_setzero_ps(); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F widen(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static M first(int64_t n) {  // lanes 0 .. n-1: eight all-ones words then eight zeros, read from 8 - n
    alignas(64) static const int32_t ones_then_zeros[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    const int64_t k = std::max<int64_t>(0, std::min<int64_t>(n, 8));
    return _mm256_loadu_ps(reinterpret_cast<const float*>(ones_then_zeros + 8 - k));
  }
  static M lanes(int64_t lo, int64_t hi) { return _mm256_andnot_ps(first(lo), first(hi)); }  // lanes lo <= i < hi
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F mask_max(F acc, M m, F x) { return _mm256_blendv_ps(acc, _mm256_max_ps(acc, x), m); }
  static F maskz(M m, F x) { return _mm256_and_ps(m, x); }
  static float reduce_max(F x) {
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_max_ss(a, _mm_movehdup_ps(a)));
  }
  static float reduce_add(F x) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
  }
  static float lane0(F x) { return _mm256_cvtss_f32(x); }
  static F exp(F x) { return exp8(x); }
  static void transpose(F* r) { transpose8(r); }
  static F load_first(const float* p, int64_t n) { return _mm256_maskload_ps(p, _mm256_castps_si256(lanes(0, n))); }
  static F sum_rows(const F* v) { return sum8(v); }
};
#define I8_SIMD "AVX2"
using Vec = V8;

#if I8_QK_I16
// The scores of NR query rows (int16; rows `row` of q16) over 32 keys (kd: their int16 two a 32-bit lane,
// kd[d2 * CHUNK + j]), written to sc + i * CHUNK: the products summed, times the key's and the row's scales.
template <int64_t D2, int64_t CHUNK, int NR>
inline void scores_i16(const int16_t* q16, const int64_t* row, const int32_t* kd, const float* kscl, const float* qscl,
                       float* sc) {
  constexpr int64_t D = 2 * D2;
  __m256i acc[NR][4];
  for (int i = 0; i < NR; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = _mm256_setzero_si256();
  for (int64_t d2 = 0; d2 < D2; d2++) {
    const __m256i k0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(kd + d2 * CHUNK));
    const __m256i k1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(kd + d2 * CHUNK + 8));
    const __m256i k2 = _mm256_load_si256(reinterpret_cast<const __m256i*>(kd + d2 * CHUNK + 16));
    const __m256i k3 = _mm256_load_si256(reinterpret_cast<const __m256i*>(kd + d2 * CHUNK + 24));
    for (int i = 0; i < NR; i++) {
      int32_t two;
      std::memcpy(&two, q16 + row[i] * D + 2 * d2, 4);
      const __m256i x = _mm256_set1_epi32(two);
      acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(x, k0));
      acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(x, k1));
      acc[i][2] = _mm256_add_epi32(acc[i][2], _mm256_madd_epi16(x, k2));
      acc[i][3] = _mm256_add_epi32(acc[i][3], _mm256_madd_epi16(x, k3));
    }
  }
  for (int i = 0; i < NR; i++) {
    const __m256 qs = _mm256_set1_ps(qscl[row[i]]);
    for (int u = 0; u < 4; u++)
      _mm256_store_ps(sc + i * CHUNK + u * 8, _mm256_mul_ps(_mm256_cvtepi32_ps(acc[i][u]),
                                                            _mm256_mul_ps(_mm256_load_ps(kscl + u * 8), qs)));
  }
}
#endif
#endif

#ifdef I8_SIMD
// A decode run's softmax over its n scores a head (sc[g], replaced by e^(score - max)), unnormalized: each head's max
// and sum go to the merge of the runs.
template <class V>
void run_softmax(float (*sc)[RUN + 16], int64_t G, int64_t n, float* m, float* l) {
  using F = typename V::F;
  for (int64_t g = 0; g < G; g++) {
    float* x = sc[g];
    F mx = V::set1(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < n; j += V::W) mx = V::mask_max(mx, V::lanes(0, n - j), V::loadu(x + j));
    const float mg = V::reduce_max(mx);
    const F mv = V::set1(mg);
    F sum = V::zero();
    for (int64_t j = 0; j < n; j += V::W) {
      const F e = V::maskz(V::lanes(0, n - j), V::exp(V::sub(V::loadu(x + j), mv)));
      V::storeu(x + j, e);
      sum = V::add(sum, e);
    }
    m[g] = mg;
    l[g] = V::reduce_add(sum);
  }
}

// attend_run with W rows' scores summed together (V::sum_rows) and one softmax over the run; NV = D / V::W. The
// builds without VNNI run it (AVX2; AVX-512 without VNNI), in f32; attend_run_vnni below is the VNNI builds'.
template <class V, int64_t NV>
void attend_run_simd(const float* q, int64_t G, int8_t* kc, int8_t* vc, const Shape& sh, const Seqs& seqs, int64_t s,
                     int64_t h, int64_t lo, int64_t hi, float* m, float* l, float* o) {
  using F = typename V::F;
  constexpr int64_t W = V::W, D = NV * W, CS = V::CS(NV);
  const int64_t BS = sh.BS, n = hi - lo;
  alignas(64) float sc[MAX_GROUP][RUN + 16];
  // scores, a block's piece at a time, W rows at a time
  for (int64_t start = lo; start < hi;) {
    const int64_t slot0 = start % BS, cnt = std::min(BS - slot0, hi - start), at = start - lo;
    const int32_t block = seqs.block(s, start, BS);
    int8_t* kb = rows_of(kc, sh, block, h);
    const int8_t* krows = kb + slot0 * D;
    const float* ks = scales_of(kb, sh) + slot0;
    // the blocks are scattered: ask for the next block's keys and this block's values while these keys are summed,
    // so that the memory has several requests in flight (the loads, not the arithmetic, had bounded this loop)
    const int8_t* next = start + cnt < hi ? rows_of(kc, sh, seqs.block(s, start + cnt, BS), h) : nullptr;
    const int8_t* vb = rows_of(vc, sh, block, h);
    for (int64_t r0 = 0; r0 < cnt; r0 += W) {
      const int64_t rows = std::min<int64_t>(W, cnt - r0);
      for (int64_t line = 0; line < W * D; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(vb + (slot0 + r0) * D + line), _MM_HINT_T0);
        if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + r0 * D + line), _MM_HINT_T0);
      }
      alignas(64) float wide[W * D];
      for (int64_t r = 0; r < W; r++)
        for (int64_t c = 0; c < NV; c++)
          V::store(wide + r * D + c * W, r < rows ? V::widen(krows + (r0 + r) * D + c * W) : V::zero());
      const F kscale = V::load_first(ks + r0, rows);
      for (int64_t g = 0; g < G; g++) {
        F acc[W];
        for (int r = 0; r < W; r++) acc[r] = V::zero();
        for (int64_t c = 0; c < NV; c++) {
          const F qv = V::loadu(q + g * D + c * W);
          for (int r = 0; r < W; r++) acc[r] = V::fmadd(V::load(wide + r * D + c * W), qv, acc[r]);
        }
        V::storeu(sc[g] + at + r0, V::mul(V::sum_rows(acc), kscale));
      }
    }
    start += cnt;
  }
  run_softmax<V>(sc, G, n, m, l);
  // weighted values: each row widened once for REG_G heads of the group, CS vectors of it at a time
  constexpr int64_t REG_G = V::W == 16 ? (NV <= 4 ? 6 : 3) : 2;  // heads whose sums stay in registers (REG_G x CS)
  for (int64_t c0 = 0; c0 < NV; c0 += CS)
    for (int64_t g0 = 0; g0 < G; g0 += REG_G) {
      const int64_t gs = std::min(REG_G, G - g0);
      F acc[REG_G][CS];
      for (int64_t g = 0; g < REG_G; g++)
        for (int64_t c = 0; c < CS; c++) acc[g][c] = V::zero();
      for (int64_t start = lo; start < hi;) {
        const int64_t slot0 = start % BS, cnt = std::min(BS - slot0, hi - start), at = start - lo;
        int8_t* vb = rows_of(vc, sh, seqs.block(s, start, BS), h);
        const int8_t* vrows = vb + slot0 * D + c0 * W;
        const float* vs = scales_of(vb, sh) + slot0;
        for (int64_t j = 0; j < cnt; j++) {
          F v[CS];
          for (int64_t c = 0; c < CS; c++) v[c] = V::widen(vrows + j * D + c * W);
          for (int64_t g = 0; g < REG_G; g++) {
            if (g >= gs) break;
            const F w = V::set1(sc[g0 + g][at + j] * vs[j]);
            for (int64_t c = 0; c < CS; c++) acc[g][c] = V::fmadd(w, v[c], acc[g][c]);
          }
        }
        start += cnt;
      }
      for (int64_t g = 0; g < gs; g++)
        for (int64_t c = 0; c < CS; c++) V::storeu(o + (g0 + g) * D + (c0 + c) * W, acc[g][c]);
    }
}

#if I8_QK_VNNI
// The weighted values of a block's rows for GR heads of the group: acc (GR x D, in memory between blocks) plus each
// row's values widened to f32 times its weights w[g * (RUN + 16) + j] (softmax times the row's value scale).
template <int64_t NV, int64_t GR>
inline void weigh_rows(float* acc, const float* w, const int8_t* vrows, int64_t cnt) {
  constexpr int64_t D = NV * 16;
  __m512 a[GR][NV];
  for (int64_t g = 0; g < GR; g++)
    for (int64_t c = 0; c < NV; c++) a[g][c] = _mm512_loadu_ps(acc + g * D + c * 16);
  for (int64_t j = 0; j < cnt; j++) {
    __m512 v[NV];
    for (int64_t c = 0; c < NV; c++) v[c] = widen(vrows + j * D + c * 16);
    for (int64_t g = 0; g < GR; g++) {
      const __m512 x = _mm512_set1_ps(w[g * (RUN + 16) + j]);
      for (int64_t c = 0; c < NV; c++) a[g][c] = _mm512_fmadd_ps(x, v[c], a[g][c]);
    }
  }
  for (int64_t g = 0; g < GR; g++)
    for (int64_t c = 0; c < NV; c++) _mm512_storeu_ps(acc + g * D + c * 16, a[g][c]);
}

// Rows of the next run asked for at each 16 rows' scores and at each 32 rows' weighted values: about the next run
// whole over this one (a run's 32 groups of scores and 16 blocks of values), in step with the arithmetic. On the
// Zen 4, a decode step over 4000 slots (12 query / 4 KV heads, head_dim 64, two threads, each layer's blocks out of
// the caches, as in a model): 150-165 us a layer with the old kernel (keys' products summed across lanes, no asking
// ahead), 140-148 with the keys transposed, 112-124 with this asking ahead (the blocks' bytes alone, read in the same
// order: 60-70 us), for 4/24 rows, 8/16, 12/8 or 0/32 alike within the noise; 16/0 135. The AVX2 kernel
// (attend_run_simd) asking ahead the same way ran slower there (limited to AVX2: 145 -> 187 us with the blocks in
// the caches, no faster out of them), so it does not.
constexpr int64_t AHEAD_SCORES = 4, AHEAD_VALUES = 24;

// The next run of a decode task's (sequence, KV head): the slots after its own, the run the thread most often takes
// next. rows(n) asks the memory for the keys and values of n more of its rows (their scales with every 16th), into
// the L2 (`prefetcht1`: needed a run later, and the L1's misses in flight left to this run's own loads; from memory,
// seven interleaved pairs of runs of the driver, 108-138 us a layer against 125-162 us with `prefetcht0`).
struct RunAhead {
  int8_t *kc, *vc;
  const Shape& sh;
  const int32_t* table;  // the sequence's block table
  int64_t h, at, hi;     // the next slot to ask for, the run's end
  int64_t index = 0, slot = 0;  // at's block in the table, and its slot in the block (no division a row)
  const char *kp = nullptr, *vp = nullptr;
  RunAhead(int8_t* kc, int8_t* vc, const Shape& sh, const Seqs& seqs, int64_t s, int64_t h, int64_t from)
      : kc(kc), vc(vc), sh(sh), table(seqs.blocks + seqs.block_begins[s]), h(h), at(from),
        hi(std::min<int64_t>(from + RUN, seqs.past[s] + 1)) {
    if (at < hi) {
      index = at / sh.BS;
      slot = at % sh.BS;
      locate();
    }
  }
  void locate() {
    kp = reinterpret_cast<const char*>(rows_of(kc, sh, table[index], h));
    vp = reinterpret_cast<const char*>(rows_of(vc, sh, table[index], h));
  }
  void rows(int64_t n) {
    for (const int64_t stop = std::min(hi, at + n); at < stop; at++) {
      for (int64_t line = 0; line < sh.D; line += 64) {
        _mm_prefetch(kp + slot * sh.D + line, _MM_HINT_T1);
        _mm_prefetch(vp + slot * sh.D + line, _MM_HINT_T1);
      }
      if (slot % 16 == 0) {
        _mm_prefetch(kp + sh.BS * sh.D + slot * 4, _MM_HINT_T1);
        _mm_prefetch(vp + sh.BS * sh.D + slot * 4, _MM_HINT_T1);
      }
      if (++slot == sh.BS && at + 1 < hi) {
        slot = 0;
        index++;
        locate();
      }
    }
  }
};

// A decode step's run with VNNI: the run's scores (each block's keys transposed 16 rows at a time, so that each 32-bit
// lane sums one row's u8 x s8 products over a broadcast of four of the query's values: no sums across lanes), one
// softmax over the run, then its weighted values. While it computes, it asks for the next run's keys and values (the
// run the thread most often takes next: the same head's next slots), a few rows at each step of its own, so that the
// memory streams through the whole task, the weighted values' part included, instead of in bursts.
template <int64_t NV>
void attend_run_vnni(const float* q, int64_t G, int8_t* kc, int8_t* vc, const Shape& sh, const Seqs& seqs, int64_t s,
                     int64_t h, int64_t lo, int64_t hi, float* m, float* l, float* o) {
  constexpr int64_t D = NV * 16, D4 = D / 4, NP = (D4 + 15) / 16, L = D4 % 16 ? D4 % 16 : 16;
  constexpr int64_t GR = NV <= 4 ? 6 : 3;  // heads whose value sums stay in registers (GR x NV)
  const int64_t BS = sh.BS, n = hi - lo;
  // the query rows rounded to int8 as the prompt kernel rounds them (one scale a row), four values a 32-bit lane, and
  // each row's sum x 128: the keys are multiplied as u8 (+128, their sign bits flipped), which that sum takes back out
  alignas(64) int32_t q4[MAX_GROUP][D4];
  int32_t qoff[MAX_GROUP];
  float qscl[MAX_GROUP];
  for (int64_t g = 0; g < G; g++) {
    int8_t qi[D];
    quantize(q + g * D, D, qi, qscl + g);
    std::memcpy(q4[g], qi, D);
    int32_t total = 0;
    for (int64_t d = 0; d < D; d++) total += qi[d];
    qoff[g] = 128 * total;
  }
  const __m512i flip = _mm512_set1_epi8(-128);
  alignas(64) float sc[MAX_GROUP][RUN + 16];
  RunAhead ahead(kc, vc, sh, seqs, s, h, hi);
  for (int64_t start = lo; start < hi;) {
    const int64_t slot0 = start % BS, cnt = std::min(BS - slot0, hi - start), at = start - lo;
    const int32_t block = seqs.block(s, start, BS);
    const int8_t* kb = rows_of(kc, sh, block, h);
    const int8_t* krows = kb + slot0 * D;
    const float* ks = scales_of(kb, sh) + slot0;
    const int8_t* next = start + cnt < hi ? rows_of(kc, sh, seqs.block(s, start + cnt, BS), h) : nullptr;
    const int8_t* vb = rows_of(vc, sh, block, h);
    for (int64_t r0 = 0; r0 < cnt; r0 += 16) {
      const int64_t rows = std::min<int64_t>(16, cnt - r0);
      for (int64_t line = 0; line < 16 * D; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(vb + (slot0 + r0) * D + line), _MM_HINT_T0);
        if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + r0 * D + line), _MM_HINT_T0);
      }
      ahead.rows(AHEAD_SCORES);
      alignas(64) int32_t part[MAX_GROUP][16];  // a piece's sums for the next piece to add to (D > 64)
      for (int64_t p = 0; p < NP; p++) {
        const int64_t lanes = p + 1 < NP ? 16 : L;
        __m512i t[16];
        {
          __m512 x[16];
          for (int64_t r = 0; r < 16; r++)
            x[r] = _mm512_castsi512_ps(r < rows ? _mm512_maskz_loadu_epi32(first(lanes), krows + (r0 + r) * D + p * 64)
                                                : _mm512_setzero_si512());
          transpose16(x);
          for (int64_t i = 0; i < 16; i++) t[i] = _mm512_xor_si512(_mm512_castps_si512(x[i]), flip);
        }
        for (int64_t g = 0; g < G; g++) {
          __m512i a[4] = {p > 0 ? _mm512_load_si512(part[g]) : _mm512_setzero_si512(), _mm512_setzero_si512(),
                          _mm512_setzero_si512(), _mm512_setzero_si512()};
#pragma GCC unroll 16
          for (int64_t i = 0; i < 16; i++)
            if (p + 1 < NP || i < L) a[i & 3] = _mm512_dpbusd_epi32(a[i & 3], t[i], _mm512_set1_epi32(q4[g][p * 16 + i]));
          _mm512_store_si512(part[g], _mm512_add_epi32(_mm512_add_epi32(a[0], a[1]), _mm512_add_epi32(a[2], a[3])));
        }
      }
      const __m512 kscale = _mm512_maskz_loadu_ps(first(rows), ks + r0);
      for (int64_t g = 0; g < G; g++) {
        const __m512i dot = _mm512_sub_epi32(_mm512_load_si512(part[g]), _mm512_set1_epi32(qoff[g]));
        _mm512_storeu_ps(sc[g] + at + r0, _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(kscale, _mm512_set1_ps(qscl[g]))));
      }
    }
    start += cnt;
  }
  run_softmax<V16>(sc, G, n, m, l);
  // the weights times each row's value scale, then the weighted values a block's piece at a time
  std::fill(o, o + G * D, 0.f);
  for (int64_t start = lo; start < hi;) {
    const int64_t slot0 = start % BS, cnt = std::min(BS - slot0, hi - start), at = start - lo;
    const int8_t* vb = rows_of(vc, sh, seqs.block(s, start, BS), h);
    const float* vs = scales_of(vb, sh) + slot0;
    for (int64_t g = 0; g < G; g++)
      for (int64_t j = 0; j < cnt; j += 16)
        _mm512_mask_storeu_ps(sc[g] + at + j, first(cnt - j),  // not the next piece's weights
                              _mm512_mul_ps(_mm512_loadu_ps(sc[g] + at + j), _mm512_maskz_loadu_ps(first(cnt - j), vs + j)));
    ahead.rows(cnt * AHEAD_VALUES / 32);
    const int8_t* vrows = vb + slot0 * D;
    for (int64_t g0 = 0; g0 < G; g0 += GR) {
      float* acc = o + g0 * D;
      const float* w = sc[g0] + at;
      switch (std::min(GR, G - g0)) {
        case 1: weigh_rows<NV, 1>(acc, w, vrows, cnt); break;
        case 2: weigh_rows<NV, 2>(acc, w, vrows, cnt); break;
        case 3: weigh_rows<NV, 3>(acc, w, vrows, cnt); break;
        case 4: weigh_rows<NV, 4>(acc, w, vrows, cnt); break;
        case 5: weigh_rows<NV, 5>(acc, w, vrows, cnt); break;
        default: weigh_rows<NV, GR>(acc, w, vrows, cnt); break;
      }
    }
    start += cnt;
  }
}
#endif

#if I8_AMX
// e^x for x <= 0 to about 4e-5 of it (0 below -104): exp16's reduction with a degree-4 polynomial, for the AMX
// kernel's weights, which are rounded to bf16 (2^-9 of each) anyway, and their sums.
inline __m512 exp16_short(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_setzero_ps()), _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
  __m512 p = _mm512_set1_ps(1.f / 24.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// attend_tile_simd's step for one block of 16 query rows (r0 .. r0 + nr - 1, padded to 16) over a chunk's slots
// jlo .. jhi - 1 (rounded out to multiples of 32) on AMX tiles: their int32 scores (u8 x s8, four products a 32-bit
// lane, a tile of 16 rows by 16 keys over 64 of the head's values a step) into sc, scaled in place as scores_vnni
// scales them while each row's maximum is taken; each row's softmax update, its weights (softmax times each slot's
// value scale) rounded to bf16 in the same pass; then the weighted values (bf16 pairs of slots, 32 slots a step,
// four tiles of 16 x 16 f32 sums for 64 of the head's dimensions) into pv, added to the rows' outputs o after their
// correction. q: the tile's u8 query rows, kt / vf: the chunk's keys (kq layout) and values (bf16 pairs), as the
// VNNI and AVX512-BF16 kernels hold them.
template <int64_t D, int64_t CHUNK>
void amx_rows(const float* q, float* o, const float* kt, const float* vf, float* sc, float* wt, float* pv,
              const int32_t* kcorr, const float* kscl, const float* vscl, const float* qscl, float* m, float* l,
              int64_t r0, int64_t nr, const int64_t* row, const int64_t* lo, const int64_t* hi, int64_t jlo,
              int64_t jhi) {
  constexpr int64_t DP = amx_depth(D), RB = 16;
  jlo = jlo / 32 * 32, jhi = (jhi + 31) / 32 * 32;  // the last chunk's keys and values past its slots are zeros
  int32_t* si = reinterpret_cast<int32_t*>(sc);
  const uint8_t* qu = reinterpret_cast<const uint8_t*>(q) + r0 * DP;
  const int32_t* kq = reinterpret_cast<const int32_t*>(kt);
  for (int64_t j = jlo; j < jhi; j += 32) {
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t d4 = 0; d4 < DP / 4; d4 += 16) {
      _tile_loadd(4, qu + 4 * d4, DP);
      _tile_loadd(5, kq + d4 * CHUNK + j, CHUNK * 4);
      _tile_loadd(6, kq + d4 * CHUNK + j + 16, CHUNK * 4);
      _tile_dpbusd(0, 4, 5);
      _tile_dpbusd(1, 4, 6);
    }
    _tile_stored(0, si + j, CHUNK * 4);
    _tile_stored(1, si + j + 16, CHUNK * 4);
  }
  uint16_t* w = reinterpret_cast<uint16_t*>(wt);  // row i's bf16 weights at w + i * 2 * CHUNK, in slot order
  alignas(64) float corr[RB];
  for (int64_t i = 0; i < RB; i++) {
    uint16_t* wi = w + i * 2 * CHUNK;
    if (hi[i] <= lo[i]) {  // nothing seen in this chunk (or a padding row)
      for (int64_t j = jlo; j < jhi; j += 32) _mm512_store_si512(wi + j, _mm512_setzero_si512());
      corr[i] = 1.f;
      continue;
    }
    const int64_t r = r0 + i;
    const __m512 qs = _mm512_set1_ps(qscl[row[i]]);
    float* x = sc + i * CHUNK;
    __m512 mx = _mm512_set1_ps(m[r]);
    for (int64_t j = jlo; j < jhi; j += 16) {
      const __mmask16 seen = first(hi[i] - j) & (__mmask16)~first(lo[i] - j);
      const __m512i dot = _mm512_sub_epi32(_mm512_load_si512(si + i * CHUNK + j), _mm512_load_si512(kcorr + j));
      const __m512 score = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(_mm512_load_ps(kscl + j), qs));
      _mm512_store_ps(x + j, score);
      mx = _mm512_mask_max_ps(mx, seen, mx, score);
    }
    const float mnew = _mm512_reduce_max_ps(mx);
    const __m512 mv = _mm512_set1_ps(mnew);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = jlo; j < jhi; j += 16) {
      const __mmask16 seen = first(hi[i] - j) & (__mmask16)~first(lo[i] - j);
      const __m512 e = _mm512_maskz_mov_ps(seen, exp16_short(_mm512_sub_ps(_mm512_load_ps(x + j), mv)));
      sum = _mm512_add_ps(sum, e);
      _mm256_store_si256(reinterpret_cast<__m256i*>(wi + j),
                         (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(e, _mm512_load_ps(vscl + j))));
    }
    corr[i] = std::exp(m[r] - mnew);  // 0 where nothing was seen before (m = -inf)
    l[r] = l[r] * corr[i] + _mm512_reduce_add_ps(sum);
    m[r] = mnew;
  }
  const uint32_t* vp = reinterpret_cast<const uint32_t*>(vf);
  for (int64_t c0 = 0; c0 + 64 <= D; c0 += 64) {  // four tiles of sums: 64 dimensions
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t j = jlo; j < jhi; j += 32) {  // 32 slots: 16 pairs
      _tile_loadd(4, w + j, CHUNK * 4);
      _tile_loadd(5, vp + j / 2 * D + c0, D * 4);
      _tile_loadd(6, vp + j / 2 * D + c0 + 16, D * 4);
      _tile_loadd(7, vp + j / 2 * D + c0 + 32, D * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, vp + j / 2 * D + c0 + 48, D * 4);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, pv + c0, D * 4);
    _tile_stored(1, pv + c0 + 16, D * 4);
    _tile_stored(2, pv + c0 + 32, D * 4);
    _tile_stored(3, pv + c0 + 48, D * 4);
  }
  if constexpr (D % 64 != 0) {  // the last 32 dimensions (head sizes 32 and 96): two tiles of sums
    constexpr int64_t c0 = D - 32;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t j = jlo; j < jhi; j += 32) {
      _tile_loadd(4, w + j, CHUNK * 4);
      _tile_loadd(5, vp + j / 2 * D + c0, D * 4);
      _tile_loadd(6, vp + j / 2 * D + c0 + 16, D * 4);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
    }
    _tile_stored(0, pv + c0, D * 4);
    _tile_stored(1, pv + c0 + 16, D * 4);
  }
  for (int64_t i = 0; i < nr; i++) {
    float* orow = o + (r0 + i) * D;
    const __m512 cv = _mm512_set1_ps(corr[i]);
    for (int64_t c = 0; c < D; c += 16)
      _mm512_store_ps(orow + c, _mm512_fmadd_ps(_mm512_load_ps(orow + c), cv, _mm512_load_ps(pv + i * D + c)));
  }
}
#endif

// attend_tile for blocks of 32 slots, CHUNK slots (four blocks) at a time: their keys transposed once for the tile,
// so that RB query rows' scores are vector products of broadcast query values over keys (no sums across lanes); one
// softmax update a row for the chunk; the RB rows' values summed together, each value vector loaded once for them.
// V: the vector operations (V16 or V8); NV = D / V::W. The VNNI and bf16 paths are V16's (I8_QK_VNNI, I8_PV_BF16).
// AMX (I8_AMX builds, head sizes 32, 64, 96 and 128, through attend_tile_amx): each block of 16 rows by amx_rows (the query
// rows padded to a multiple of 16 with zeros, their outputs dropped).
template <class V, int64_t NV, bool AMX = false>
void attend_tile_simd(const float* query, float* out, int8_t* kc, int8_t* vc, const Shape& sh, const Seqs& seqs,
                      int64_t s, int64_t h, int64_t t0, int64_t t1, float scale, int64_t window) {
  using F = typename V::F;
  constexpr int64_t W = V::W, D = NV * W, D4 = D / 4, BS = 32, CHUNK = V::CHUNK, CS = V::CS(NV), KG = 4 * W;
  constexpr int64_t RB = AMX ? 16 : V::RB(D);
  const int64_t G = sh.G, rows = (t1 - t0) * G, qrows = AMX ? (rows + 15) / 16 * 16 : rows;
  const int64_t p0 = seqs.pos(s, t0), plast = p0 + (t1 - t0) - 1;
  // floats: q (qrows x D; u8 rows where VNNI), o, keys (D x CHUNK), values (CHUNK x D), scores, weights, a block's
  // weighted values (AMX), scales
  std::vector<float> buf(qrows * D + rows * (D + 3) + 2 * D * CHUNK + 2 * RB * CHUNK + RB * D + 4 * CHUNK + 32);
  float* base = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
  float *q = base, *o = q + qrows * D, *kt = o + rows * D, *vf = kt + D * CHUNK, *sc = vf + CHUNK * D;
  float *wt = sc + RB * CHUNK, *pv = wt + RB * CHUNK, *kscl = pv + RB * D, *vscl = kscl + CHUNK, *m = vscl + CHUNK;
  float *l = m + rows, *qscl = l + rows;
  (void)pv;
  const F sv = V::set1(scale);
  for (int64_t t = t0; t < t1; t++)
    for (int64_t g = 0; g < G; g++) {
      const int64_t r = (t - t0) * G + g;
      const float* src = query + t * sh.H * D + (h * G + g) * D;
      F x[NV];
      for (int64_t c = 0; c < NV; c++) x[c] = V::mul(V::loadu(src + c * W), sv);
#if I8_QK_VNNI || I8_QK_I16
      // the row as int8 (q ~ qi * qscl[r], as quantize rounds the keys): + 128 as u8 for VNNI, int16 for AVX2
      alignas(64) float xs[D];
      int8_t qi[D];
      for (int64_t c = 0; c < NV; c++) V::store(xs + c * W, x[c]);
      quantize(xs, D, qi, qscl + r);
#if I8_QK_VNNI
      uint8_t* qu = reinterpret_cast<uint8_t*>(q) + r * (AMX ? amx_depth(D) : D);
      for (int64_t d = 0; d < D; d++) qu[d] = static_cast<uint8_t>(qi[d] + 128);
#else
      int16_t* q16 = reinterpret_cast<int16_t*>(q) + r * D;
      for (int64_t d = 0; d < D; d++) q16[d] = qi[d];
#endif
#else
      for (int64_t c = 0; c < NV; c++) V::store(q + r * D + c * W, x[c]);
#endif
    }
  for (int64_t r = 0; r < rows; r++) m[r] = -std::numeric_limits<float>::infinity(), l[r] = 0.f;
  std::fill(o, o + rows * D, 0.f);
  for (int64_t start = (first_seen(p0, window) / BS) * BS; start <= plast; start += CHUNK) {
    const int64_t n = std::min(CHUNK, plast + 1 - start), groups = (n + 63) / 64;  // 64-key groups
#if I8_QK_VNNI
    alignas(64) int32_t kcorr[CHUNK];  // each key's sum of values, times 128: what the queries' offset adds to a score
#endif
    // slots start + j, W at a time: keys transposed (kt[d][j], or kq[d / 4][j]: four int8 of a key a 32-bit lane),
    // values widened
    for (int64_t j0 = 0; j0 < groups * 64; j0 += W) {
      const int8_t* krow[W];
      const int8_t* vrow[W];
      for (int64_t e = 0; e < W; e++) {
        const int64_t j = j0 + e, slot = start + j;
        if (j < n) {
          const int32_t b = seqs.block(s, slot, BS);
          const int8_t* kb = rows_of(kc, sh, b, h);
          const int8_t* vb = rows_of(vc, sh, b, h);
          const int64_t at = slot % BS;
          krow[e] = kb + at * D, vrow[e] = vb + at * D;
          kscl[j] = scales_of(kb, sh)[at];
          vscl[j] = scales_of(vb, sh)[at];
        } else {
          krow[e] = vrow[e] = nullptr, kscl[j] = vscl[j] = 0.f;
        }
      }
#if I8_QK_VNNI
      int32_t* kq = reinterpret_cast<int32_t*>(kt);
      for (int64_t c4 = 0; c4 < D4; c4 += 16) {  // 16 of a key's D / 4 lanes at a time
        const __mmask16 cols = first(D4 - c4);
        __m512 r[16];
        for (int64_t e = 0; e < 16; e++)
          r[e] = krow[e] ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(cols, krow[e] + 4 * c4)) : _mm512_setzero_ps();
        transpose16(r);
        for (int64_t e = 0; e < 16 && c4 + e < D4; e++) _mm512_store_ps(kt + (c4 + e) * CHUNK + j0, r[e]);
      }
      __m512i ksum = _mm512_setzero_si512();
      for (int64_t d4 = 0; d4 < D4; d4++)
        ksum = _mm512_dpbusd_epi32(ksum, _mm512_set1_epi8(1), _mm512_load_si512(kq + d4 * CHUNK + j0));
      _mm512_store_si512(kcorr + j0, _mm512_slli_epi32(ksum, 7));
#elif I8_QK_I16
      for (int64_t c2 = 0; c2 < D / 2; c2 += 8) {  // 8 of a key's D / 2 int16 pairs (16 values) at a time
        __m256 r[8];
        for (int64_t e = 0; e < 8; e++)
          r[e] = krow[e] ? _mm256_castsi256_ps(_mm256_cvtepi8_epi16(
                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(krow[e] + 2 * c2))))
                         : _mm256_setzero_ps();
        transpose8(r);
        for (int64_t e = 0; e < 8; e++) _mm256_store_ps(kt + (c2 + e) * CHUNK + j0, r[e]);
      }
#else
      for (int64_t c = 0; c < NV; c++) {
        F r[W];
        for (int64_t e = 0; e < W; e++)
          r[e] = krow[e] ? V::mul(V::widen(krow[e] + c * W), V::set1(kscl[j0 + e])) : V::zero();
        V::transpose(r);
        for (int64_t e = 0; e < W; e++) V::store(kt + (c * W + e) * CHUNK + j0, r[e]);
      }
#endif
#if I8_PV_BF16
      // slots j, j + 1 in one 32-bit lane a dimension: vp[j / 2][d] = (bf16 v_j[d], bf16 v_j+1[d]); an int8 is exact
      // in bf16, whose bits are its f32's upper 16
      uint32_t* vp = reinterpret_cast<uint32_t*>(vf);
      for (int64_t e = 0; e < 16; e += 2)
        for (int64_t c = 0; c < NV; c++) {
          const __m512i lo = vrow[e] ? _mm512_castps_si512(widen(vrow[e] + c * 16)) : _mm512_setzero_si512();
          const __m512i hi = vrow[e + 1] ? _mm512_castps_si512(widen(vrow[e + 1] + c * 16)) : _mm512_setzero_si512();
          _mm512_store_si512(vp + (j0 + e) / 2 * D + c * 16,
                             _mm512_or_si512(_mm512_srli_epi32(lo, 16),
                                             _mm512_and_si512(hi, _mm512_set1_epi32((int32_t)0xFFFF0000u))));
        }
#elif I8_PV_I16
      // slots j, j + 1 in one 32-bit lane a dimension: vp[j / 2][d] = (int16 v_j[d], int16 v_j+1[d])
      int32_t* vp = reinterpret_cast<int32_t*>(vf);
      for (int64_t e = 0; e < 8; e += 2)
        for (int64_t c = 0; c < D / 16; c++) {
          const __m128i a = vrow[e] ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(vrow[e] + c * 16))
                                    : _mm_setzero_si128();
          const __m128i b = vrow[e + 1] ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(vrow[e + 1] + c * 16))
                                        : _mm_setzero_si128();
          __m256i* dst = reinterpret_cast<__m256i*>(vp + (j0 + e) / 2 * D + c * 16);
          _mm256_store_si256(dst, _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b)));
          _mm256_store_si256(dst + 1, _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a, b)));
        }
#else
      for (int64_t e = 0; e < W; e++)
        for (int64_t c = 0; c < NV; c++)
          V::store(vf + (j0 + e) * D + c * W, vrow[e] ? V::mul(V::widen(vrow[e] + c * W), V::set1(vscl[j0 + e]))
                                                      : V::zero());
#endif
    }
    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
      const int64_t nr = std::min(RB, rows - r0);
      int64_t row[RB], lo[RB], hi[RB];
      for (int64_t i = 0; i < RB; i++) {
        const int64_t r = r0 + std::min(i, nr - 1), pos = p0 + r / G;
        row[i] = r;
        lo[i] = std::max(start, first_seen(pos, window)) - start;
        hi[i] = i < nr ? std::min(n, pos + 1 - start) : 0;  // slots start+lo .. start+hi-1 seen (none: hi <= lo)
      }
      int64_t jlo = CHUNK, jhi = 0;  // the slots any of the rows sees
      for (int64_t i = 0; i < nr; i++) jlo = std::min(jlo, lo[i]), jhi = std::max(jhi, hi[i]);
      if (jhi <= jlo) continue;
#if I8_AMX
      if constexpr (AMX) {
        amx_rows<D, CHUNK>(q, o, kt, vf, sc, wt, pv, kcorr, kscl, vscl, qscl, m, l, r0, nr, row, lo, hi, jlo, jhi);
        continue;
      }
#endif
      // scores of the RB rows, 4 vectors of keys at a time: RB x 4 accumulators, one broadcast query value for four
      // products
#if I8_QK_VNNI
      for (int64_t g64 = jlo / 64; g64 * 64 < jhi; g64++) {
        const int32_t* kd = reinterpret_cast<const int32_t*>(kt) + g64 * 64;
        for (int64_t i = 0; i < RB; i += 2)  // two rows at a time (more accumulators, and GCC copies them around)
          if (i + 1 < RB)
            scores_vnni<D4, CHUNK, 2>(reinterpret_cast<const uint8_t*>(q), row + i, kd, kcorr + g64 * 64,
                                      kscl + g64 * 64, qscl, sc + i * CHUNK + g64 * 64);
          else
            scores_vnni<D4, CHUNK, 1>(reinterpret_cast<const uint8_t*>(q), row + i, kd, kcorr + g64 * 64,
                                      kscl + g64 * 64, qscl, sc + i * CHUNK + g64 * 64);
      }
#elif I8_QK_I16
      for (int64_t gk = jlo / KG; gk * KG < jhi; gk++) {
        const int32_t* kd = reinterpret_cast<const int32_t*>(kt) + gk * KG;
        for (int64_t i = 0; i < RB; i += 2)
          if (i + 1 < RB)
            scores_i16<D / 2, CHUNK, 2>(reinterpret_cast<const int16_t*>(q), row + i, kd, kscl + gk * KG, qscl,
                                        sc + i * CHUNK + gk * KG);
          else
            scores_i16<D / 2, CHUNK, 1>(reinterpret_cast<const int16_t*>(q), row + i, kd, kscl + gk * KG, qscl,
                                        sc + i * CHUNK + gk * KG);
      }
#else
      for (int64_t gk = jlo / KG; gk * KG < jhi; gk++) {
        F acc[RB][4];
#pragma GCC unroll 6
        for (int64_t i = 0; i < RB; i++) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = V::zero();
        const float* kd = kt + gk * KG;
#pragma GCC unroll 2
        for (int64_t d = 0; d < D; d++) {
          const F k0 = V::load(kd + d * CHUNK), k1 = V::load(kd + d * CHUNK + W);
          const F k2 = V::load(kd + d * CHUNK + 2 * W), k3 = V::load(kd + d * CHUNK + 3 * W);
#pragma GCC unroll 6
          for (int64_t i = 0; i < RB; i++) {
            const F x = V::set1(q[row[i] * D + d]);
            acc[i][0] = V::fmadd(x, k0, acc[i][0]);
            acc[i][1] = V::fmadd(x, k1, acc[i][1]);
            acc[i][2] = V::fmadd(x, k2, acc[i][2]);
            acc[i][3] = V::fmadd(x, k3, acc[i][3]);
          }
        }
#pragma GCC unroll 6
        for (int64_t i = 0; i < RB; i++)
#pragma GCC unroll 4
          for (int64_t u = 0; u < 4; u++) V::store(sc + i * CHUNK + gk * KG + u * W, acc[i][u]);
      }
#endif
      // each row's softmax update over the chunk (the slots it does not see count as -inf), and its weights: the
      // softmax times each slot's value scale (bf16, in slot order, where the values are summed in bf16 pairs)
      alignas(64) float corr[RB];
#if I8_PV_I16
      float wsc[RB];  // each row's weights' scale (the largest over 32767)
#endif
      const int64_t vlo = jlo / W, vhi = (jhi + W - 1) / W;  // the W-slot vectors any row sees
      for (int64_t i = 0; i < RB; i++) {
        const int64_t r = r0 + i;
        float* x = sc + i * CHUNK;
#if I8_PV_I16
        F wm = V::zero();  // the largest weight (softmax times the value scale)
#endif
        if (hi[i] <= lo[i]) {  // nothing seen in this chunk (or a padding row)
          for (int64_t v = vlo; v < vhi; v++) V::store(x + v * W, V::zero());
          corr[i] = 1.f;
        } else {
          // the vectors the row sees whole (fl <= v < fh) take no mask: the masks are the edges'
          const int64_t fl = (lo[i] + W - 1) / W, fh = hi[i] / W;
          F mx = V::set1(m[r]);
          for (int64_t v = vlo; v < vhi; v++)
            mx = v >= fl && v < fh ? V::max(mx, V::load(x + v * W))
                                   : V::mask_max(mx, V::lanes(lo[i] - v * W, hi[i] - v * W), V::load(x + v * W));
          const float mnew = V::reduce_max(mx);
          const F mv = V::set1(mnew);
          F sum = V::zero();
          for (int64_t v = vlo; v < vhi; v++) {
            const F e = V::exp(V::sub(V::load(x + v * W), mv));
            const F seen = v >= fl && v < fh ? e : V::maskz(V::lanes(lo[i] - v * W, hi[i] - v * W), e);
            V::store(x + v * W, seen);
            sum = V::add(sum, seen);
#if I8_PV_I16
            wm = V::max(wm, V::mul(seen, V::load(vscl + v * W)));
#endif
          }
          // e^(m - mnew) for the sums so far (0 where nothing was seen before: m = -inf, clamped by the exp)
          corr[i] = V::lane0(V::exp(V::set1(m[r] - mnew)));
          l[r] = l[r] * corr[i] + V::reduce_add(sum);
          m[r] = mnew;
        }
#if I8_PV_BF16
        uint16_t* w = reinterpret_cast<uint16_t*>(wt + i * CHUNK);
        for (int64_t v = vlo; v < vhi; v++)
          _mm256_store_si256(reinterpret_cast<__m256i*>(w + v * 16),
                             (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(x + v * 16),
                                                                       _mm512_load_ps(vscl + v * 16))));
#elif I8_PV_I16
        const float wmax = V::reduce_max(wm);
        const __m256 winv = _mm256_set1_ps(wmax > 0.f ? 32767.f / wmax : 0.f);
        wsc[i] = wmax / 32767.f;
        int16_t* w = reinterpret_cast<int16_t*>(wt + i * CHUNK);
        for (int64_t v = vlo; v < vhi; v++) {
          const __m256i wi = _mm256_cvtps_epi32(
              _mm256_mul_ps(_mm256_mul_ps(_mm256_load_ps(x + v * 8), _mm256_load_ps(vscl + v * 8)), winv));
          _mm_store_si128(reinterpret_cast<__m128i*>(w + v * 8),
                          _mm_packs_epi32(_mm256_castsi256_si128(wi), _mm256_extracti128_si256(wi, 1)));
        }
#endif
      }
      // the RB rows' values together, CS vectors of each at a time (all of them with 32 registers): each value vector
      // loaded once for the RB rows, RB x CS sums
#if I8_PV_I16
      for (int64_t c0 = 0; c0 < NV; c0 += CS) {
        __m256i acc[RB][CS];
        for (int64_t i = 0; i < RB; i++)
          for (int64_t c = 0; c < CS; c++) acc[i][c] = _mm256_setzero_si256();
        const int32_t* vp = reinterpret_cast<const int32_t*>(vf) + c0 * W;
        for (int64_t pair = vlo * 4; pair < vhi * 4; pair++) {  // slots 2 pair, 2 pair + 1
          __m256i v[CS];
          for (int64_t c = 0; c < CS; c++) v[c] = _mm256_load_si256(reinterpret_cast<const __m256i*>(vp + pair * D + c * 8));
          for (int64_t i = 0; i < RB; i++) {
            const __m256i w = _mm256_set1_epi32(reinterpret_cast<const int32_t*>(wt + i * CHUNK)[pair]);
            for (int64_t c = 0; c < CS; c++) acc[i][c] = _mm256_add_epi32(acc[i][c], _mm256_madd_epi16(w, v[c]));
          }
        }
        for (int64_t i = 0; i < RB; i++)
          for (int64_t c = 0; c < CS; c++)
            if (i < nr) {
              float* orow = o + (r0 + i) * D + (c0 + c) * W;
              _mm256_store_ps(orow, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][c]), _mm256_set1_ps(wsc[i]),
                                                    _mm256_mul_ps(_mm256_load_ps(orow), _mm256_set1_ps(corr[i]))));
            }
      }
#else
      for (int64_t c0 = 0; c0 < NV; c0 += CS) {
        F acc[RB][CS];
#pragma GCC unroll 6
        for (int64_t i = 0; i < RB; i++) {
          const float* orow = o + row[i] * D + c0 * W;
          const F cv = V::set1(corr[i]);
#pragma GCC unroll 16
          for (int64_t c = 0; c < CS; c++) acc[i][c] = V::mul(V::load(orow + c * W), cv);
        }
#if I8_PV_BF16
        const uint32_t* vp = reinterpret_cast<const uint32_t*>(vf) + c0 * W;
        for (int64_t pair = vlo * 8; pair < vhi * 8; pair++) {  // slots 2 pair, 2 pair + 1
          __m512i v[CS];
#pragma GCC unroll 8
          for (int64_t c = 0; c < CS; c++) v[c] = _mm512_load_si512(vp + pair * D + c * 16);
#pragma GCC unroll 6
          for (int64_t i = 0; i < RB; i++) {
            const __m512i w = _mm512_set1_epi32(reinterpret_cast<const int32_t*>(wt + i * CHUNK)[pair]);
#pragma GCC unroll 8
            for (int64_t c = 0; c < CS; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], (__m512bh)v[c], (__m512bh)w);
          }
        }
#else
        for (int64_t j = jlo; j < jhi; j++) {
          F w[RB];
#pragma GCC unroll 6
          for (int64_t i = 0; i < RB; i++) w[i] = V::set1(sc[i * CHUNK + j]);
#pragma GCC unroll 16
          for (int64_t c = 0; c < CS; c++) {
            const F v = V::load(vf + j * D + (c0 + c) * W);
#pragma GCC unroll 6
            for (int64_t i = 0; i < RB; i++) acc[i][c] = V::fmadd(w[i], v, acc[i][c]);
          }
        }
#endif
        // (over all RB, so that the sums stay registers in the loops above)
#pragma GCC unroll 6
        for (int64_t i = 0; i < RB; i++)
#pragma GCC unroll 16
          for (int64_t c = 0; c < CS; c++)
            if (i < nr) V::store(o + (r0 + i) * D + (c0 + c) * W, acc[i][c]);
      }
#endif
    }
  }
  for (int64_t t = t0; t < t1; t++)
    for (int64_t g = 0; g < G; g++) {
      const int64_t r = (t - t0) * G + g;
      const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
      float* dst = out + t * sh.H * D + (h * G + g) * D;
      for (int64_t c = 0; c < NV; c++) V::storeu(dst + c * W, V::mul(V::load(o + r * D + c * W), V::set1(inv)));
    }
}
#endif

// The kernels for a shape: AVX-512 for head sizes 32, 64, 96 and 128 (blocks of 32 for prompts) where compiled with it,
// else the loops above, specialized where the sizes are the usual ones.
using RunKernel = void (*)(const float*, int64_t, int8_t*, int8_t*, const Shape&, const Seqs&, int64_t, int64_t,
                           int64_t, int64_t, float*, float*, float*);
using TileKernel = void (*)(const float*, float*, int8_t*, int8_t*, const Shape&, const Seqs&, int64_t, int64_t,
                            int64_t, int64_t, float, int64_t);

#if I8_AMX
// attend_tile_simd's AMX form, with this thread's tiles configured for it over the call.
template <int64_t NV>
void attend_tile_amx(const float* query, float* out, int8_t* kc, int8_t* vc, const Shape& sh, const Seqs& seqs,
                     int64_t s, int64_t h, int64_t t0, int64_t t1, float scale, int64_t window) {
  TilesHeld held;
  attend_tile_simd<Vec, NV, true>(query, out, kc, vc, sh, seqs, s, h, t0, t1, scale, window);
}

// Whether a prompt of head size D runs on AMX tiles here.
bool amx_tiles(int64_t D) { return (D == 32 || D == 64 || D == 96 || D == 128) && amx_granted(); }
#endif

// Whether this shape's prompts take attend_tile_amx (and tiles of QTILE_AMX tokens).
bool amx_prompts(const Shape& sh) {
#if I8_AMX
  return sh.BS == 32 && amx_tiles(sh.D);
#else
  (void)sh;
  return false;
#endif
}

RunKernel run_kernel_for(const Shape& sh) {
#ifdef I8_SIMD
#if I8_QK_VNNI
  switch (sh.D) {
    case 32: return attend_run_vnni<2>;
    case 64: return attend_run_vnni<4>;
    case 96: return attend_run_vnni<6>;
    case 128: return attend_run_vnni<8>;
  }
#endif
  switch (sh.D) {
    case 32: return attend_run_simd<Vec, 32 / Vec::W>;
    case 64: return attend_run_simd<Vec, 64 / Vec::W>;
    case 96: return attend_run_simd<Vec, 96 / Vec::W>;
    case 128: return attend_run_simd<Vec, 128 / Vec::W>;
  }
#endif
  return sh.BS != 32 ? attend_run<0, 0> : sh.D == 64 ? attend_run<64, 32> : sh.D == 128 ? attend_run<128, 32>
                                                                                          : attend_run<0, 32>;
}

TileKernel tile_kernel_for(const Shape& sh) {
#if I8_AMX
  if (amx_prompts(sh)) switch (sh.D) {
      case 32: return attend_tile_amx<2>;
      case 64: return attend_tile_amx<4>;
      case 96: return attend_tile_amx<6>;
      case 128: return attend_tile_amx<8>;
    }
#endif
#ifdef I8_SIMD
  if (sh.BS == 32) switch (sh.D) {
      case 32: return attend_tile_simd<Vec, 32 / Vec::W>;
      case 64: return attend_tile_simd<Vec, 64 / Vec::W>;
      case 96: return attend_tile_simd<Vec, 96 / Vec::W>;
      case 128: return attend_tile_simd<Vec, 128 / Vec::W>;
    }
#endif
  return sh.BS != 32 ? attend_tile<0, 0> : sh.D == 64 ? attend_tile<64, 32> : sh.D == 128 ? attend_tile<128, 32>
                                                                                          : attend_tile<0, 32>;
}

class Int8PagedAttention : public ov::op::Op {
 public:
  OPENVINO_OP("Int8PagedAttention", "kvexport");

  Int8PagedAttention() = default;
  Int8PagedAttention(const ov::OutputVector& args, int64_t heads, int64_t kv_heads, int64_t head_dim,
                     int64_t block_size)
      : Op(args), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), block_size_(block_size) {
    constructor_validate_and_infer_types();
  }

  void validate_and_infer_types() override {
    NODE_VALIDATION_CHECK(this, get_input_size() == 11, "Int8PagedAttention takes 11 inputs, got ", get_input_size());
    NODE_VALIDATION_CHECK(this, heads_ > 0 && kv_heads_ > 0 && heads_ % kv_heads_ == 0 && heads_ / kv_heads_ <= MAX_GROUP,
                          "heads must be a multiple of kv_heads, at most ", MAX_GROUP, " a KV head");
    NODE_VALIDATION_CHECK(this, head_dim_ > 0 && head_dim_ <= MAX_D && head_dim_ % 4 == 0,
                          "head_dim must be a multiple of 4 up to ", MAX_D);
    NODE_VALIDATION_CHECK(this, block_size_ > 0 && block_size_ <= MAX_BS, "block_size must be 1..", MAX_BS);
    for (size_t i : {3, 4})
      NODE_VALIDATION_CHECK(this, get_input_element_type(i) == ov::element::i8, "the caches must be int8");
    auto shape = get_input_partial_shape(0);
    set_output_type(0, ov::element::f32, shape);
  }

  std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& args) const override {
    return std::make_shared<Int8PagedAttention>(args, heads_, kv_heads_, head_dim_, block_size_);
  }

  bool visit_attributes(ov::AttributeVisitor& v) override {
    v.on_attribute("heads", heads_);
    v.on_attribute("kv_heads", kv_heads_);
    v.on_attribute("head_dim", head_dim_);
    v.on_attribute("block_size", block_size_);
    return true;
  }

  bool has_evaluate() const override { return true; }

  bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override {
    const Shape sh{heads_, kv_heads_, head_dim_, block_size_, heads_ / kv_heads_};
    const auto& qt = inputs[0];
    const int64_t T = (int64_t)qt.get_shape()[0];
    if ((int64_t)qt.get_size() != T * sh.H * sh.D) return false;
    const float* query = qt.data<const float>();
    const float* key = inputs[1].data<const float>();
    const float* value = inputs[2].data<const float>();
    // the caches are written in place: the request's own tensors, which the plugin hands over as they are
    auto* kc = static_cast<int8_t*>(const_cast<void*>(inputs[3].data()));
    auto* vc = static_cast<int8_t*>(const_cast<void*>(inputs[4].data()));
    const Seqs seqs{inputs[5].data<const int32_t>(), inputs[6].data<const int32_t>(), inputs[7].data<const int32_t>(),
                    inputs[8].data<const int32_t>(), (int64_t)inputs[5].get_size()};
    const float scale = *inputs[9].data<const float>();
    const int64_t window = *inputs[10].data<const int32_t>();
    // the sequence inputs must describe slots inside the caches: anything else would write out of bounds
    const auto& cache_shape = inputs[3].get_shape();
    if (cache_shape.size() != 4 || inputs[4].get_shape() != cache_shape || (int64_t)cache_shape[1] != sh.KV ||
        (int64_t)cache_shape[2] != sh.BS || (int64_t)cache_shape[3] != sh.D + 4 ||
        (int64_t)inputs[1].get_size() != T * sh.KV * sh.D || (int64_t)inputs[2].get_size() != T * sh.KV * sh.D ||
        (int64_t)inputs[6].get_size() != seqs.n + 1 || (int64_t)inputs[8].get_size() != seqs.n + 1 ||
        seqs.begins[0] != 0 || seqs.begins[seqs.n] != T || seqs.block_begins[0] != 0 ||
        seqs.block_begins[seqs.n] > (int64_t)inputs[7].get_size())
      OPENVINO_THROW("Int8PagedAttention: inputs do not describe the caches (shapes or sequence bounds)");
    const int64_t num_blocks = (int64_t)cache_shape[0];
    for (int64_t s = 0; s < seqs.n; s++) {
      const int64_t held = seqs.past[s] + seqs.begins[s + 1] - seqs.begins[s];
      const int64_t table = seqs.block_begins[s + 1] - seqs.block_begins[s];
      if (seqs.past[s] < 0 || seqs.begins[s + 1] < seqs.begins[s] || table < 0 || held > table * sh.BS)
        OPENVINO_THROW("Int8PagedAttention: sequence ", s, " holds ", held, " slots but its block table has ", table,
                       " blocks of ", sh.BS);
      for (int64_t b = seqs.block_begins[s]; b < seqs.block_begins[s + 1]; b++)
        if (seqs.blocks[b] < 0 || seqs.blocks[b] >= num_blocks)
          OPENVINO_THROW("Int8PagedAttention: block ", seqs.blocks[b], " is not one of the caches' ", num_blocks);
    }
    outputs[0].set_shape(qt.get_shape());
    float* out = outputs[0].data<float>();

    // the new rows into their blocks
    std::vector<int64_t> seq_of(T);
    for (int64_t s = 0; s < seqs.n; s++)
      for (int64_t t = seqs.begins[s]; t < seqs.begins[s + 1]; t++) seq_of[t] = s;
    const auto store = [&](int64_t i) {
      const int64_t t = i / sh.KV, h = i % sh.KV, s = seq_of[t], slot = seqs.pos(s, t);
      const int32_t b = seqs.block(s, slot, sh.BS);
      int8_t* krows = rows_of(kc, sh, b, h);
      int8_t* vrows = rows_of(vc, sh, b, h);
      const int64_t at = slot % sh.BS, from = (t * sh.KV + h) * sh.D;
      quantize(key + from, sh.D, krows + at * sh.D, scales_of(krows, sh) + at);
      quantize(value + from, sh.D, vrows + at * sh.D, scales_of(vrows, sh) + at);
    };
    if (T * sh.KV * sh.D < 16384) {  // a decode step's few rows: less than waking the threads costs
      for (int64_t i = 0; i < T * sh.KV; i++) store(i);
    } else {
      tbb::parallel_for(int64_t(0), T * sh.KV, store);
    }

    bool one = true;  // one new token a sequence: a decode step
    for (int64_t s = 0; s < seqs.n; s++) one = one && seqs.begins[s + 1] - seqs.begins[s] == 1;
    if (one)
      decode(query, out, kc, vc, sh, seqs, scale, window);
    else
      prompt(query, out, kc, vc, sh, seqs, scale, window);
    return true;
  }

 private:
  // New tokens several a sequence (their rows already in the blocks): tiles of QTILE tokens a KV head on the threads.
  static void prompt(const float* query, float* out, int8_t* kc, int8_t* vc, const Shape& sh, const Seqs& seqs,
                     float scale, int64_t window) {
    const int64_t qtile = amx_prompts(sh) ? QTILE_AMX : QTILE;
    struct Tile {
      int64_t s, t0, t1;
    };
    std::vector<Tile> tiles;
    for (int64_t s = 0; s < seqs.n; s++)
      for (int64_t t = seqs.begins[s]; t < seqs.begins[s + 1]; t += qtile)
        tiles.push_back({s, t, std::min<int64_t>(t + qtile, seqs.begins[s + 1])});
    // the longest tiles (the latest positions) first, so the threads end together
    std::reverse(tiles.begin(), tiles.end());
    const TileKernel tile_kernel = tile_kernel_for(sh);
    tbb::parallel_for(int64_t(0), (int64_t)tiles.size() * sh.KV, [&](int64_t i) {
      const Tile& tile = tiles[i / sh.KV];
      tile_kernel(query, out, kc, vc, sh, seqs, tile.s, i % sh.KV, tile.t0, tile.t1, scale, window);
    });
  }

  static void decode(const float* query, float* out, int8_t* kc, int8_t* vc, const Shape& sh, const Seqs& seqs,
                     float scale, int64_t window) {
    const int64_t D = sh.D, G = sh.G;
    struct Task {
      int64_t s, h, lo, hi;
    };
    std::vector<Task> tasks;
    std::vector<int64_t> first(seqs.n * sh.KV + 1, 0);  // tasks of (s, h) are first[s*KV+h] .. first[s*KV+h+1]-1
    for (int64_t s = 0; s < seqs.n; s++) {
      const int64_t pos = seqs.past[s], lo = first_seen(pos, window);
      for (int64_t h = 0; h < sh.KV; h++) {
        for (int64_t a = lo; a <= pos; a += RUN) tasks.push_back({s, h, a, std::min(a + RUN, pos + 1)});
        first[s * sh.KV + h + 1] = (int64_t)tasks.size();
      }
    }
    const int64_t stride = G * (D + 2);  // a task's partial: m (G), l (G), o (G x D)
    std::vector<float> part(tasks.size() * stride);
    const RunKernel run_kernel = run_kernel_for(sh);
    const auto task = [&](int64_t i) {
      const Task& k = tasks[i];
      float q[MAX_GROUP * MAX_D];
      const float* src = query + seqs.begins[k.s] * sh.H * D + k.h * G * D;
      for (int64_t x = 0; x < G * D; x++) q[x] = src[x] * scale;
      float* p = part.data() + i * stride;
      run_kernel(q, G, kc, vc, sh, seqs, k.s, k.h, k.lo, k.hi, p, p + G, p + 2 * G);
    };
    int64_t slots = 0;
    for (const Task& k : tasks) slots += k.hi - k.lo;
    if (slots < SERIAL) {
      for (int64_t i = 0; i < (int64_t)tasks.size(); i++) task(i);
    } else {
      tbb::parallel_for(int64_t(0), (int64_t)tasks.size(), task);
    }
    for (int64_t s = 0; s < seqs.n; s++)
      for (int64_t h = 0; h < sh.KV; h++) {
        const int64_t a = first[s * sh.KV + h], z = first[s * sh.KV + h + 1];
        for (int64_t g = 0; g < G; g++) {
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t i = a; i < z; i++) mx = std::max(mx, part[i * stride + g]);
          float* dst = out + seqs.begins[s] * sh.H * D + (h * G + g) * D;
          std::fill(dst, dst + D, 0.f);
          float sum = 0.f;
          for (int64_t i = a; i < z; i++) {
            const float* p = part.data() + i * stride;
            const float w = std::exp(p[g] - mx);
            sum += p[G + g] * w;
            const float* o = p + 2 * G + g * D;
            for (int64_t d = 0; d < D; d++) dst[d] += o[d] * w;
          }
          const float inv = sum > 0.f ? 1.f / sum : 0.f;
          for (int64_t d = 0; d < D; d++) dst[d] *= inv;
        }
      }
  }

  int64_t heads_ = 0, kv_heads_ = 0, head_dim_ = 0, block_size_ = 0;
};

}  // namespace

// What the library's kernels for head size `head_dim` (blocks of 32) multiply with, for kvexport_intel.int8_blocks.kernels.
extern "C" const char* kvexport_i8_kernels(int64_t head_dim) {
#if I8_AMX
  if (amx_tiles(head_dim))
    return "decode: AVX-512, scores " I8_QK_NAME ", weighted values f32; prompts: AMX, scores " I8_AMX_QK_NAME
           ", weighted values " I8_AMX_PV_NAME;
#endif
#ifdef __AVX512F__
  if (head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128)
    return "decode: AVX-512, scores " I8_QK_NAME ", weighted values f32; prompts: AVX-512, scores " I8_QK_NAME
           ", weighted values " I8_PV_NAME;
#elif defined(I8_SIMD)
  if (head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128)
    return "decode: " I8_SIMD ", scores f32, weighted values f32; prompts: " I8_SIMD ", scores " I8_QK_NAME ", weighted values " I8_PV_NAME;
#endif
  (void)head_dim;
  return "decode: portable f32; prompts: portable f32";
}

OPENVINO_CREATE_EXTENSIONS(std::vector<ov::Extension::Ptr>({std::make_shared<ov::OpExtension<Int8PagedAttention>>()}));
