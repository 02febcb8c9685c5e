// A Q4_1 weight matrix times fp32 activations on the CPU (AVX2, FMA, F16C): the
// projections of the packaged model's layers, for every step (decode and prefill).
//
// The scheme is llama.cpp's Q4_1 (its block_q4_1 and ggml_vec_dot_q4_1_q8_1 are
// the reference this follows in spirit): each row of W [out, in] is cut into
// groups of 32 weights, a group being a scale d, a minimum m and 32 levels q in
// 0..15, its weights q * d + m. Unlike llama.cpp the activations are not
// rounded to 8 bits (Q8_1): they stay fp32, and
//
//     y[t, o] = sum over groups g of  d_g * (sum_j q_j x[t, j])  +  m_g * (sum_j x[t, j])
//
// is accumulated in fp32: exact to fp32 rounding against dequantize-then-matmul
// (tests/gpu_worker/test_q4_1_kernel.py).
//
// Layout (gpu_worker/q4_1_kernel.py packs it): levels [out, in / 2] uint8, where
// byte k of a row's group holds the group's element k in its low nibble and
// element k + 16 in its high one (as llama.cpp's qs); scales and minimums
// [out, in / 32] fp16, as llama.cpp keeps them.
//
// Every output element goes through the same operations in the same order
// whatever the number of rows of x, how they are blocked, or the threads: a
// request's result does not depend on what else is in its batch (up to the rows
// where q4_1_dequantize and torch's fp32 matmul take over: a prefill, where a GEMM
// that reuses each weight across rows is faster). Compiled with -ffp-contract=off
// so that the compiler fuses nothing on its own.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kGroup = 32;
// Rows of x that share one decoding of a group's levels.
constexpr int64_t kRowsAtOnce = 4;
// Output rows per task of the thread pool.
constexpr int64_t kOutputGrain = 16;

inline float horizontal_sum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

// A group's 32 levels as four vectors of 8 floats: elements 0-7, 8-15, 16-23, 24-31.
// Bytes 0-7 widened to 32-bit lanes hold elements 0-7 (low nibbles) and 16-23
// (high); bytes 8-15, elements 8-15 and 24-31.
inline void decode_levels(const uint8_t* bytes, __m256 levels[4]) {
  const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  const __m256i second =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8)));
  const __m256i nibble = _mm256_set1_epi32(0x0F);
  levels[0] = _mm256_cvtepi32_ps(_mm256_and_si256(first, nibble));
  levels[1] = _mm256_cvtepi32_ps(_mm256_and_si256(second, nibble));
  levels[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4));
  levels[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4));
}

inline float half_to_float(uint16_t bits) { return _cvtsh_ss(bits); }

// The sum of each group of 32 values of each row of x: [rows, groups].
void group_sums(const float* x, int64_t rows, int64_t in, float* sums) {
  const int64_t groups = in / kGroup;
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t g = 0; g < groups; ++g) {
      const float* values = x + t * in + g * kGroup;
      __m256 sum = _mm256_add_ps(_mm256_loadu_ps(values), _mm256_loadu_ps(values + 8));
      sum = _mm256_add_ps(sum, _mm256_loadu_ps(values + 16));
      sum = _mm256_add_ps(sum, _mm256_loadu_ps(values + 24));
      sums[t * groups + g] = horizontal_sum(sum);
    }
  }
}

// sum over groups g of minimum_g * sums[g]: 8 groups a vector, the rest one by one.
inline float minimums_term(const uint16_t* row_minimums, const float* sums, int64_t groups) {
  __m256 vector_part = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const __m256 minimum = _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(row_minimums + g)));
    vector_part = _mm256_fmadd_ps(minimum, _mm256_loadu_ps(sums + g), vector_part);
  }
  float term = horizontal_sum(vector_part);
  for (; g < groups; ++g) {
    term = std::fma(half_to_float(row_minimums[g]), sums[g], term);
  }
  return term;
}

// y[t, o] for R rows t of x (from x, their group sums from sums) and one output row o,
// its levels decoded from the packed bytes as they are used. Even and odd groups
// accumulate apart (two chains of FMAs in flight), added at the end.
template <int R>
void dot_rows(const float* x, const float* sums, int64_t in, const uint8_t* row_levels,
              const uint16_t* row_scales, const uint16_t* row_minimums, float* y,
              int64_t out) {
  const int64_t groups = in / kGroup;
  __m256 accumulated[2][R];
  for (int r = 0; r < R; ++r) {
    accumulated[0][r] = _mm256_setzero_ps();
    accumulated[1][r] = _mm256_setzero_ps();
  }
  __m256 levels[4];
  for (int64_t g = 0; g < groups; ++g) {
    decode_levels(row_levels + g * (kGroup / 2), levels);
    const __m256 scale = _mm256_set1_ps(half_to_float(row_scales[g]));
    for (int r = 0; r < R; ++r) {
      const float* values = x + r * in + g * kGroup;
      __m256 dot = _mm256_mul_ps(levels[0], _mm256_loadu_ps(values));
      dot = _mm256_fmadd_ps(levels[1], _mm256_loadu_ps(values + 8), dot);
      dot = _mm256_fmadd_ps(levels[2], _mm256_loadu_ps(values + 16), dot);
      dot = _mm256_fmadd_ps(levels[3], _mm256_loadu_ps(values + 24), dot);
      accumulated[g & 1][r] = _mm256_fmadd_ps(scale, dot, accumulated[g & 1][r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float scaled = horizontal_sum(_mm256_add_ps(accumulated[0][r], accumulated[1][r]));
    y[r * out] = scaled + minimums_term(row_minimums, sums + r * groups, groups);
  }
}

struct Operands {
  const float* x;
  const float* sums;
  const uint8_t* levels;
  const uint16_t* scales;
  const uint16_t* minimums;
  float* y;
  int64_t rows, in, out;
};

// Output rows [begin, end), decoding each row's levels as it goes (few rows of x).
void rows_decoding(const Operands& a, int64_t begin, int64_t end) {
  const int64_t groups = a.in / kGroup;
  for (int64_t o = begin; o < end; ++o) {
    const uint8_t* row_levels = a.levels + o * (a.in / 2);
    const uint16_t* row_scales = a.scales + o * groups;
    const uint16_t* row_minimums = a.minimums + o * groups;
    int64_t t = 0;
    for (; t + kRowsAtOnce <= a.rows; t += kRowsAtOnce) {
      dot_rows<kRowsAtOnce>(a.x + t * a.in, a.sums + t * groups, a.in, row_levels, row_scales,
                            row_minimums, a.y + t * a.out + o, a.out);
    }
    for (; t < a.rows; ++t) {
      dot_rows<1>(a.x + t * a.in, a.sums + t * groups, a.in, row_levels, row_scales,
                  row_minimums, a.y + t * a.out + o, a.out);
    }
  }
}

// The matrix itself, fp32 [out, in]: levels * scale + minimum, rounded twice (a
// product, then a sum) as the GGUF reader rounds them, so that a prefill through it
// runs on the very weights the file holds.
at::Tensor q4_1_dequantize(const at::Tensor& levels, const at::Tensor& scales,
                           const at::Tensor& minimums) {
  TORCH_CHECK(levels.dim() == 2 && levels.scalar_type() == at::kByte && levels.is_contiguous(),
              "q4_1_dequantize: levels must be a contiguous 2-D uint8 tensor");
  const int64_t out = levels.size(0);
  const int64_t in = levels.size(1) * 2;
  const int64_t groups = in / kGroup;
  TORCH_CHECK(in % kGroup == 0, "q4_1_dequantize: ", in, " columns, not a multiple of 32");
  for (const at::Tensor* table : {&scales, &minimums}) {
    TORCH_CHECK(table->scalar_type() == at::kHalf && table->is_contiguous() &&
                    table->dim() == 2 && table->size(0) == out && table->size(1) == groups,
                "q4_1_dequantize: scales and minimums must be contiguous fp16 [", out, ", ",
                groups, "]");
  }
  at::Tensor weights = at::empty({out, in}, levels.options().dtype(at::kFloat));
  const uint8_t* level_data = levels.data_ptr<uint8_t>();
  const auto* scale_data = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const auto* minimum_data = reinterpret_cast<const uint16_t*>(minimums.data_ptr<at::Half>());
  float* weight_data = weights.data_ptr<float>();
  at::parallel_for(0, out * groups, kOutputGrain * groups, [&](int64_t begin, int64_t end) {
    __m256 decoded[4];
    for (int64_t group = begin; group < end; ++group) {
      decode_levels(level_data + group * (kGroup / 2), decoded);
      const __m256 scale = _mm256_set1_ps(half_to_float(scale_data[group]));
      const __m256 minimum = _mm256_set1_ps(half_to_float(minimum_data[group]));
      for (int part = 0; part < 4; ++part) {
        const __m256 weight = _mm256_add_ps(_mm256_mul_ps(decoded[part], scale), minimum);
        _mm256_storeu_ps(weight_data + group * kGroup + 8 * part, weight);
      }
    }
  });
  return weights;
}

at::Tensor q4_1_linear(const at::Tensor& x_in, const at::Tensor& levels, const at::Tensor& scales,
                       const at::Tensor& minimums) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "q4_1_linear: x must be a 2-D fp32 CPU tensor, got ", x_in.sizes(), " ",
              x_in.scalar_type());
  TORCH_CHECK(levels.dim() == 2 && levels.scalar_type() == at::kByte && levels.is_contiguous(),
              "q4_1_linear: levels must be a contiguous 2-D uint8 tensor");
  const int64_t out = levels.size(0);
  const int64_t in = levels.size(1) * 2;
  TORCH_CHECK(in % kGroup == 0, "q4_1_linear: ", in, " columns, not a multiple of 32");
  TORCH_CHECK(x_in.size(1) == in, "q4_1_linear: x has ", x_in.size(1), " columns, W has ", in);
  for (const at::Tensor* table : {&scales, &minimums}) {
    TORCH_CHECK(table->scalar_type() == at::kHalf && table->is_contiguous() &&
                    table->dim() == 2 && table->size(0) == out && table->size(1) == in / kGroup,
                "q4_1_linear: scales and minimums must be contiguous fp16 [", out, ", ",
                in / kGroup, "]");
  }
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0);
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0 || out == 0) {
    return y;
  }
  at::Tensor sums = at::empty({rows, in / kGroup}, x.options());
  group_sums(x.data_ptr<float>(), rows, in, sums.data_ptr<float>());
  const Operands operands{
      x.data_ptr<float>(),
      sums.data_ptr<float>(),
      levels.data_ptr<uint8_t>(),
      reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
      reinterpret_cast<const uint16_t*>(minimums.data_ptr<at::Half>()),
      y.data_ptr<float>(),
      rows,
      in,
      out,
  };
  at::parallel_for(0, out, kOutputGrain, [&](int64_t begin, int64_t end) {
    rows_decoding(operands, begin, end);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(orcapod, m) {
  m.def("q4_1_linear(Tensor x, Tensor levels, Tensor scales, Tensor minimums) -> Tensor");
  m.def("q4_1_dequantize(Tensor levels, Tensor scales, Tensor minimums) -> Tensor");
}

TORCH_LIBRARY_IMPL(orcapod, CPU, m) {
  m.impl("q4_1_linear", &q4_1_linear);
  m.impl("q4_1_dequantize", &q4_1_dequantize);
}
