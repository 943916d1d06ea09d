// Gaussian noise for DP-SGD: AES-128 in counter mode (AES-NI), Box-Muller in AVX2 float32, on OpenMP threads.
// Built at run time by Inductor's C++ toolchain (native_noise.py); compiled_psg uses it only on a CPU that has
// AES-NI, AVX2 and FMA (cpu_supported).
//
// The stream: the keystream word k (k = 0, 1, ...) is the little-endian 32-bit word k % 4 of AES_key(j) for the
// counter block j = k / 4 (128-bit little-endian). Words are taken in groups of 48 (12 blocks); in group g, for
// p in {0, 1} and m in 0..7, with lo, hi and b the words 48g + 24p + m, 48g + 24p + 8 + m and 48g + 24p + 16 + m,
//   u1 = (2^32 hi + lo + 1) / 2^64 in (0, 1] (to within one float32 step: three FMAs),   u2 = (b >> 8) / 2^24 in [0, 1) (exact),
//   r = std * sqrt(-2 log u1),   element 32g + 16p + m = r cos(2 pi u2),   element 32g + 16p + 8 + m = r sin(2 pi u2).
// The numbers depend on the key and the element's index only, not on the thread count. A 64-bit u1 puts the
// largest radius at sqrt(2 log 2^64) = 9.42 std; torch's float32 normal_ takes 24 bits and stops at 5.77 std,
// where the tail it cuts is a privacy loss the accountant does not see (see docs/training.md).
#include <cstdint>
#include <cstring>
#include <immintrin.h>

namespace {

#define F(x) _mm256_set1_ps(x)

// ---- AES-128 (FIPS-197) with AES-NI: key expansion and the encryption of 8 counter blocks ----

inline __m128i expand_step(__m128i key, __m128i assist) {
  assist = _mm_shuffle_epi32(assist, 0xff);
  key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
  key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
  key = _mm_xor_si128(key, _mm_slli_si128(key, 4));
  return _mm_xor_si128(key, assist);
}

struct RoundKeys {
  __m128i k[11];
};

#define EXPAND(i, rcon) K.k[i] = expand_step(K.k[i - 1], _mm_aeskeygenassist_si128(K.k[i - 1], rcon))

inline RoundKeys expand_key(uint64_t k0, uint64_t k1) {
  RoundKeys K;
  K.k[0] = _mm_set_epi64x((long long)k1, (long long)k0);  // key bytes: k0 then k1, little-endian
  EXPAND(1, 0x01); EXPAND(2, 0x02); EXPAND(3, 0x04); EXPAND(4, 0x08); EXPAND(5, 0x10);
  EXPAND(6, 0x20); EXPAND(7, 0x40); EXPAND(8, 0x80); EXPAND(9, 0x1b); EXPAND(10, 0x36);
  return K;
}

inline __m128i encrypt(__m128i block, const RoundKeys& K) {
  block = _mm_xor_si128(block, K.k[0]);
  for (int r = 1; r < 10; ++r) block = _mm_aesenc_si128(block, K.k[r]);
  return _mm_aesenclast_si128(block, K.k[10]);
}

// The 48 keystream words of group g, as six vectors of 8 words in stream order. Twelve blocks interleaved: each
// aesenc has a latency of several cycles, so independent blocks keep the AES unit busy.
inline void keystream_group(uint64_t g, const RoundKeys& K, __m256i w[6]) {
  __m128i b[12];
  for (int l = 0; l < 12; ++l) b[l] = _mm_xor_si128(_mm_set_epi64x(0, (long long)(12 * g + l)), K.k[0]);
  for (int r = 1; r < 10; ++r)
    for (int l = 0; l < 12; ++l) b[l] = _mm_aesenc_si128(b[l], K.k[r]);
  for (int l = 0; l < 12; ++l) b[l] = _mm_aesenclast_si128(b[l], K.k[10]);
  for (int i = 0; i < 6; ++i) w[i] = _mm256_set_m128i(b[2 * i + 1], b[2 * i]);
}

// The same words with VAES (two blocks per instruction), where the CPU has it: about 11% faster a draw.
__attribute__((target("aes,vaes,avx2"))) inline void keystream_group_vaes(uint64_t g, const RoundKeys& K,
                                                                          __m256i w[6]) {
  __m256i b[6];
  __m256i k = _mm256_broadcastsi128_si256(K.k[0]);
  for (int i = 0; i < 6; ++i)
    b[i] = _mm256_xor_si256(_mm256_set_epi64x(0, (long long)(12 * g + 2 * i + 1), 0, (long long)(12 * g + 2 * i)), k);
  for (int r = 1; r < 10; ++r) {
    k = _mm256_broadcastsi128_si256(K.k[r]);
    for (int i = 0; i < 6; ++i) b[i] = _mm256_aesenc_epi128(b[i], k);
  }
  k = _mm256_broadcastsi128_si256(K.k[10]);
  for (int i = 0; i < 6; ++i) w[i] = _mm256_aesenclast_epi128(b[i], k);
}

// ---- Box-Muller in float32: log on (0, 1] and the sine and cosine of a turn, by polynomials ----

// Natural log, x in (0, 1]: x = 2^e m with m in [sqrt(1/2), sqrt(2)), log(1 + f) = f - f^2/2 + f^3 P(f)
// (Cephes logf's polynomial: relative error about 1e-7).
inline __m256 log_unit(__m256 x) {
  __m256i xi = _mm256_castps_si256(x);
  __m256i e = _mm256_srai_epi32(_mm256_sub_epi32(xi, _mm256_set1_epi32(0x3f3504f3)), 23);
  __m256 m = _mm256_castsi256_ps(_mm256_sub_epi32(xi, _mm256_slli_epi32(e, 23)));
  __m256 f = _mm256_sub_ps(m, F(1.0f));
  __m256 p = F(7.0376836292E-2f);
  p = _mm256_fmadd_ps(p, f, F(-1.1514610310E-1f));
  p = _mm256_fmadd_ps(p, f, F(1.1676998740E-1f));
  p = _mm256_fmadd_ps(p, f, F(-1.2420140846E-1f));
  p = _mm256_fmadd_ps(p, f, F(1.4249322787E-1f));
  p = _mm256_fmadd_ps(p, f, F(-1.6668057665E-1f));
  p = _mm256_fmadd_ps(p, f, F(2.0000714765E-1f));
  p = _mm256_fmadd_ps(p, f, F(-2.4999993993E-1f));
  p = _mm256_fmadd_ps(p, f, F(3.3333331174E-1f));
  __m256 f2 = _mm256_mul_ps(f, f);
  __m256 r = _mm256_mul_ps(_mm256_mul_ps(p, f2), f);
  r = _mm256_add_ps(_mm256_fnmadd_ps(F(0.5f), f2, r), f);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(e), F(0.693147180559945309f), r);
}

// cos(2 pi u) and sin(2 pi u), u in [0, 1): quadrant q = round(4u), x = 2 pi (u - q/4) in [-pi/4, pi/4] (exact
// subtraction: u has 24 bits), Cephes sinf/cosf polynomials on x, then the rotation by q quarter turns.
inline void sincos_turn(__m256 u, __m256& c, __m256& s) {
  __m256 qf = _mm256_round_ps(_mm256_mul_ps(u, F(4.0f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256i q = _mm256_cvtps_epi32(qf);
  __m256 x = _mm256_mul_ps(_mm256_fnmadd_ps(qf, F(0.25f), u), F(6.28318530717958647692f));
  __m256 x2 = _mm256_mul_ps(x, x);
  __m256 sp = _mm256_fmadd_ps(_mm256_fmadd_ps(F(-1.9515295891E-4f), x2, F(8.3321608736E-3f)), x2,
                              F(-1.6666654611E-1f));
  __m256 sx = _mm256_fmadd_ps(_mm256_mul_ps(sp, x2), x, x);
  __m256 cp = _mm256_fmadd_ps(_mm256_fmadd_ps(F(2.443315711809948E-5f), x2, F(-1.388731625493765E-3f)), x2,
                              F(4.166664568298827E-2f));
  __m256 cx = _mm256_fmadd_ps(_mm256_mul_ps(cp, x2), x2, _mm256_fnmadd_ps(F(0.5f), x2, F(1.0f)));
  __m256 odd = _mm256_castsi256_ps(_mm256_slli_epi32(q, 31));  // odd q swaps sine and cosine
  __m256 cc = _mm256_blendv_ps(cx, sx, odd), ss = _mm256_blendv_ps(sx, cx, odd);
  // cos is negative in quadrants 1 and 2, sin in 2 and 3
  __m256i cos_sign = _mm256_slli_epi32(_mm256_and_si256(_mm256_add_epi32(q, _mm256_set1_epi32(1)),
                                                        _mm256_set1_epi32(2)), 30);
  __m256i sin_sign = _mm256_slli_epi32(_mm256_and_si256(q, _mm256_set1_epi32(2)), 30);
  c = _mm256_xor_ps(cc, _mm256_castsi256_ps(cos_sign));
  s = _mm256_xor_ps(ss, _mm256_castsi256_ps(sin_sign));
}

// (2^32 hi + lo + 1) / 2^64 in float32, from unsigned words (AVX2 converts signed ones: split off the low byte).
inline __m256 unit_from_64_bits(__m256i hi, __m256i lo) {
  const __m256i byte = _mm256_set1_epi32(0xff);
  __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_and_si256(lo, byte), _mm256_set1_epi32(1))),
                           F(5.42101086242752217e-20f));                                             // 2^-64
  s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 8)), F(1.38777878078144568e-17f), s);  // 2^-56
  s = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(hi, byte)), F(2.32830643653869629e-10f), s); // 2^-32
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 8)), F(5.9604644775390625e-08f), s);  // 2^-24
}

// The 32 numbers of a group's 48 words.
inline void box_muller(const __m256i w[6], float std, float* out) {
  for (int p = 0; p < 2; ++p) {
    __m256 u1 = unit_from_64_bits(w[3 * p + 1], w[3 * p]);
    __m256 u2 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(w[3 * p + 2], 8)), F(5.9604644775390625e-08f));
    __m256 r = _mm256_mul_ps(_mm256_sqrt_ps(_mm256_mul_ps(log_unit(u1), F(-2.0f))), F(std));
    __m256 c, s;
    sincos_turn(u2, c, s);
    _mm256_storeu_ps(out + 16 * p, _mm256_mul_ps(r, c));
    _mm256_storeu_ps(out + 16 * p + 8, _mm256_mul_ps(r, s));
  }
}

// The 32 numbers of group g.
inline void normal_group(uint64_t g, const RoundKeys& K, float std, float* out) {
  __m256i w[6];
  keystream_group(g, K, w);
  box_muller(w, std, out);
}

__attribute__((target("aes,vaes,avx2"))) inline void normal_group_vaes(uint64_t g, const RoundKeys& K, float std,
                                                                       float* out) {
  __m256i w[6];
  keystream_group_vaes(g, K, w);
  box_muller(w, std, out);
}

// Elements [first, first + n) on `threads` OpenMP threads. Dynamic chunks of 64 groups: a thread the OS
// deschedules on a busy machine leaves its work to the others (each group depends on its index alone, so the
// numbers do not change).
template <void (*group)(uint64_t, const RoundKeys&, float, float*)>
inline void fill_range(float* out, uint64_t first, int64_t n, const RoundKeys& K, float std, int threads) {
  const uint64_t end = first + (uint64_t)n, g0 = first / 32, g1 = (end + 31) / 32;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 64)
  for (uint64_t g = g0; g < g1; ++g) {
    const uint64_t lo = 32 * g > first ? 32 * g : first, hi = 32 * g + 32 < end ? 32 * g + 32 : end;
    if (lo == 32 * g && hi == 32 * g + 32) {
      group(g, K, std, out + (32 * g - first));
    } else {  // a group the range cuts: computed whole, its part copied
      alignas(32) float part[32];
      group(g, K, std, part);
      std::memcpy(out + (lo - first), part + (lo - 32 * g), sizeof(float) * (size_t)(hi - lo));
    }
  }
}

__attribute__((target("aes,vaes,avx2"))) void fill_range_vaes(float* out, uint64_t first, int64_t n,
                                                               const RoundKeys& K, float std, int threads) {
  fill_range<normal_group_vaes>(out, first, n, K, std, threads);
}

}  // namespace

extern "C" {

int cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("aes") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

// out[0:n] = elements [first, first + n) of the stream of key (k0, k1) with standard deviation std, on
// `threads` OpenMP threads; `wide` = 0 keeps 128-bit AES-NI where the CPU has VAES (for tests: the same numbers).
// Returns 1 when the VAES path ran, 0 for AES-NI. The caller keeps first + n below 2^64.
int normal_fill(float* out, uint64_t first, int64_t n, uint64_t k0, uint64_t k1, float std, int threads, int wide) {
  if (n <= 0) return 0;
  const RoundKeys K = expand_key(k0, k1);
  if (wide && __builtin_cpu_supports("vaes")) {
    fill_range_vaes(out, first, n, K, std, threads);
    return 1;
  }
  fill_range<normal_group>(out, first, n, K, std, threads);
  return 0;
}

int has_vaes() { return __builtin_cpu_supports("vaes"); }

// The keystream's words [48 first_group, 48 (first_group + groups)), for tests.
void keystream_words(uint32_t* out, int64_t groups, uint64_t first_group, uint64_t k0, uint64_t k1) {
  const RoundKeys K = expand_key(k0, k1);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i w[6];
    keystream_group(first_group + (uint64_t)g, K, w);
    for (int i = 0; i < 6; ++i) _mm256_storeu_si256((__m256i*)(out + 48 * g + 8 * i), w[i]);
  }
}

// The 32 numbers the kernel makes of 48 given words (for tests: the limit cases of the transform).
void box_muller_words(const uint32_t* words, float std, float* out) {
  __m256i w[6];
  for (int i = 0; i < 6; ++i) w[i] = _mm256_loadu_si256((const __m256i*)(words + 8 * i));
  box_muller(w, std, out);
}

// One AES-128 block encryption of (p0, p1) under (k0, k1), as two little-endian 64-bit words, for tests.
void encrypt_block(uint64_t k0, uint64_t k1, uint64_t p0, uint64_t p1, uint64_t* out) {
  const RoundKeys K = expand_key(k0, k1);
  _mm_storeu_si128((__m128i*)out, encrypt(_mm_set_epi64x((long long)p1, (long long)p0), K));
}

}  // extern "C"
