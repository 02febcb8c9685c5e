// A Q4_1 weight matrix times fp32 activations on the CPU (AVX2, FMA, F16C): the
// projections of the packaged model's layers, for every step (decode and prefill).
//
// The weights are llama.cpp's Q4_1 (its block_q4_1 is the reference): each row of
// W [out, in] is cut into groups of 32 weights, a group being a scale d, a minimum
// m (both fp16) and 32 levels q in 0..15, its weights q * d + m. Unlike llama.cpp
// the activations are not rounded to 8 bits: they stay fp32, and so do the sums.
//
// The scheme is a GEMM whose weight operand is decoded as it is needed (BLIS's
// register tiles, with a panel of W in registers or in a thread's cache):
//
//     y[t, o] = fma(x[t, K-1], w[K-1, o], ... fma(x[t, 1], w[1, o], fma(x[t, 0], w[0, o], 0)))
//
// one chain of FMAs per output element, columns k in order, where w[k, o] =
// fma(q, d, m) is the very fp32 weight the GGUF reader makes (q * d is exact in
// fp32, 4 bits times fp16's 11, so one rounding is the reader's product-then-sum).
// A vector holds 8 outputs; a broadcast x[t, k] multiplies them. Every output
// element goes through those operations in that order whatever the number of rows
// of x, how they are blocked, which path below runs them, or the threads: a
// request's result does not depend on what else is in its batch, at any size,
// prefill included. Exact to fp32 rounding against dequantize-then-matmul
// (tests/gpu_worker/test_q4_1_kernel.py). Compiled with -ffp-contract=off so that
// the compiler fuses nothing on its own.
//
// Layout (gpu_worker/q4_1_kernel.py packs it): output rows in panels of 16 (the
// last one padded with zero weights), a panel's columns in blocks of 8:
//   levels   [panels, in / 8, 64] uint8: a block is two vectors of 8 uint32 lanes,
//            the panel's outputs 0-7 then 8-15; lane i holds output i's levels of
//            the block's 8 columns, column j in bits 4j..4j+3 (a mask, a shift and
//            a conversion a column: no shuffles);
//   scales   [panels, in / 32, 16] fp16: d of the panel's 16 outputs, per group;
//   minimums [panels, in / 32, 16] fp16: m likewise.
//
// Threads share out the panels. Two paths, one arithmetic:
// - up to kFewRows rows (decode steps): every row uses each column as it is
//   decoded into two vectors. A lone row takes two panels at a time, so that four
//   chains of FMAs overlap their latency.
// - more rows: a few rows decode the panel's columns, use them and store them to
//   a thread's buffer [in, 16] fp32 (36 KiB for in = 576: it stays in L1/L2, never
//   in memory), and the others run a 6 x 16 register tile over the buffer. Each
//   weight is decoded once a call, so that the FMAs of the rows are nearly all the
//   work: from 64 rows on, about 95 % of the FMA units' peak (one Zen 4 core).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kGroup = 32;
// Outputs per panel: two vectors of 8 fp32 lanes.
constexpr int64_t kPanel = 16;
// Columns per block of levels: 8 nibbles to a 32-bit lane.
constexpr int64_t kBlock = 8;
constexpr int64_t kBlockBytes = kPanel * kBlock / 2;
// Calls of up to this many rows decode into registers only. It is also the most
// rows that decode at once: 4 rows x 2 vectors of sums, 2 of weights, 2 of levels
// and a broadcast are 13 of AVX2's 16 registers; a fifth row would spill.
constexpr int kFewRows = 4;
// Rows per tile over a decoded buffer: 6 x 2 sums + 2 weights + 1 broadcast = 15.
constexpr int kBufferRows = 6;
// Rows the tiles over a buffer get at least: one or two rows are two or four
// chains of FMAs, bound by their latency.
constexpr int kFewestBufferRows = 3;

// One panel's packed operands (see the layout above).
struct Panel {
  const uint8_t* levels;     // [in / 8, 64]
  const uint16_t* scales;    // [in / 32, 16]
  const uint16_t* minimums;  // [in / 32, 16]
};

struct PackedMatrix {
  const uint8_t* levels;
  const uint16_t* scales;
  const uint16_t* minimums;
  int64_t in;

  Panel panel(int64_t index) const {
    const int64_t groups = in / kGroup;
    return {levels + index * (in / kBlock) * kBlockBytes, scales + index * groups * kPanel,
            minimums + index * groups * kPanel};
  }
};

// A group's scales and minimums of the panel's 16 outputs, as fp32.
struct GroupTables {
  __m256 scale_low, scale_high, minimum_low, minimum_high;
};

inline GroupTables load_tables(const Panel& panel, int64_t group) {
  const auto* scales = reinterpret_cast<const __m128i*>(panel.scales + group * kPanel);
  const auto* minimums = reinterpret_cast<const __m128i*>(panel.minimums + group * kPanel);
  return {_mm256_cvtph_ps(_mm_loadu_si128(scales)), _mm256_cvtph_ps(_mm_loadu_si128(scales + 1)),
          _mm256_cvtph_ps(_mm_loadu_si128(minimums)),
          _mm256_cvtph_ps(_mm_loadu_si128(minimums + 1))};
}

// A block's levels of outputs 0-7 and 8-15, shifted right by 4 after each column.
struct LevelBlock {
  __m256i low, high;
};

inline LevelBlock load_block(const Panel& panel, int64_t block) {
  const auto* vectors = reinterpret_cast<const __m256i*>(panel.levels + block * kBlockBytes);
  return {_mm256_loadu_si256(vectors), _mm256_loadu_si256(vectors + 1)};
}

// The block's next column: its 16 weights fma(q, d, m).
inline void next_column(LevelBlock& block, const GroupTables& tables, __m256& low, __m256& high) {
  const __m256i nibble = _mm256_set1_epi32(0x0F);
  low = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(block.low, nibble)), tables.scale_low,
                        tables.minimum_low);
  high = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(block.high, nibble)),
                         tables.scale_high, tables.minimum_high);
  block.low = _mm256_srli_epi32(block.low, 4);
  block.high = _mm256_srli_epi32(block.high, 4);
}

// The sums of R rows of x for one panel: [row][outputs 0-7, 8-15], in registers.
template <int R>
struct Tile {
  __m256 sums[R][2];

  Tile() {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      sums[r][0] = sums[r][1] = _mm256_setzero_ps();
    }
  }

  // Column k of the R rows of x (a row every `in` floats) times its 16 weights.
  inline void accumulate(const float* x, int64_t in, int64_t k, __m256 low, __m256 high) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 value = _mm256_broadcast_ss(x + r * in + k);
      sums[r][0] = _mm256_fmadd_ps(value, low, sums[r][0]);
      sums[r][1] = _mm256_fmadd_ps(value, high, sums[r][1]);
    }
  }

  // The first `columns` outputs of each row into y (a row every `out` floats):
  // the last panel may hold fewer than 16.
  inline void store(float* y, int64_t out, int64_t columns) const {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      if (columns == kPanel) {
        _mm256_storeu_ps(y + r * out, sums[r][0]);
        _mm256_storeu_ps(y + r * out + 8, sums[r][1]);
      } else {
        alignas(32) float partial[kPanel];
        _mm256_store_ps(partial, sums[r][0]);
        _mm256_store_ps(partial + 8, sums[r][1]);
        std::memcpy(y + r * out, partial, columns * sizeof(float));
      }
    }
  }
};

// R rows of x times P adjacent panels, every column decoded as it is used (and, if
// kStore, stored to `decoded` [in, 16]; P is then 1). The panels take turns by
// blocks of 8 columns: each holds its levels and tables only while it decodes,
// and the CPU overlaps the panels' chains of FMAs.
template <int R, int P, bool kStore>
void decoding_tiles(const float* x, int64_t in, const Panel* panels, float* decoded, float* y,
                    int64_t out, int64_t columns_of_last) {
  static_assert(!kStore || P == 1, "one panel at a time is stored");
  Tile<R> tiles[P];
  for (int64_t group = 0; group < in / kGroup; ++group) {
    for (int64_t block = group * (kGroup / kBlock); block < (group + 1) * (kGroup / kBlock);
         ++block) {
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const GroupTables tables = load_tables(panels[p], group);
        LevelBlock levels = load_block(panels[p], block);
#pragma GCC unroll 8
        for (int j = 0; j < kBlock; ++j) {
          const int64_t k = block * kBlock + j;
          __m256 low, high;
          next_column(levels, tables, low, high);
          if constexpr (kStore) {
            _mm256_store_ps(decoded + k * kPanel, low);
            _mm256_store_ps(decoded + k * kPanel + 8, high);
          }
          tiles[p].accumulate(x, in, k, low, high);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) {
    tiles[p].store(y + p * kPanel, out, p == P - 1 ? columns_of_last : kPanel);
  }
}

// R rows of x times one panel whose weights are in `decoded` [in, 16].
template <int R>
void buffer_tile(const float* x, int64_t in, const float* decoded, float* y, int64_t out,
                 int64_t columns) {
  Tile<R> tile;
  for (int64_t k = 0; k < in; ++k) {
    tile.accumulate(x, in, k, _mm256_load_ps(decoded + k * kPanel),
                    _mm256_load_ps(decoded + k * kPanel + 8));
  }
  tile.store(y, out, columns);
}

// Calls a template's instance for a number of rows known at run time, 1..R.
template <int R, typename Run>
void with_rows(int64_t rows, const Run& run) {
  if constexpr (R > 1) {
    if (rows < R) {
      with_rows<R - 1>(rows, run);
      return;
    }
  }
  run(std::integral_constant<int, R>{});
}

int64_t columns_of(int64_t panel, int64_t out) { return std::min(kPanel, out - panel * kPanel); }

// Panels [begin, end) for a call of up to kFewRows rows.
template <int R>
void few_rows(const float* x, const PackedMatrix& w, int64_t begin, int64_t end, float* y,
              int64_t out) {
  // A lone row's two chains a panel would wait on the FMAs' latency: two panels.
  constexpr int P = R == 1 ? 2 : 1;
  int64_t p = begin;
  for (; p + P <= end; p += P) {
    Panel panels[P];
    for (int i = 0; i < P; ++i) {
      panels[i] = w.panel(p + i);
    }
    decoding_tiles<R, P, false>(x, w.in, panels, nullptr, y + p * kPanel, out,
                                columns_of(p + P - 1, out));
  }
  for (; p < end; ++p) {
    const Panel panel = w.panel(p);
    decoding_tiles<R, 1, false>(x, w.in, &panel, nullptr, y + p * kPanel, out, columns_of(p, out));
  }
}

// Panels [begin, end) for a call of more than kFewRows rows, `decoded` [in, 16]
// the thread's buffer.
void many_rows(const float* x, int64_t rows, const PackedMatrix& w, int64_t begin, int64_t end,
               float* decoded, float* y, int64_t out) {
  const int64_t in = w.in;
  const int64_t decoding_rows = std::min<int64_t>(kFewRows, rows - kFewestBufferRows);
  // The other rows in tiles as even as kBufferRows allows (8 are 4 + 4, not 6 + 2).
  const int64_t buffer_rows = rows - decoding_rows;
  const int64_t num_tiles = (buffer_rows + kBufferRows - 1) / kBufferRows;
  for (int64_t p = begin; p < end; ++p) {
    const Panel panel = w.panel(p);
    const int64_t columns = columns_of(p, out);
    with_rows<kFewRows>(decoding_rows, [&](auto r) {
      decoding_tiles<decltype(r)::value, 1, true>(x, in, &panel, decoded, y + p * kPanel, out,
                                                  columns);
    });
    int64_t t = decoding_rows;
    for (int64_t tile = 0; tile < num_tiles; ++tile) {
      const int64_t size = (rows - t + (num_tiles - tile) - 1) / (num_tiles - tile);
      with_rows<kBufferRows>(size, [&](auto r) {
        buffer_tile<decltype(r)::value>(x + t * in, in, decoded, y + t * out + p * kPanel, out,
                                        columns);
      });
      t += size;
    }
  }
}

void check_packed(const char* op, const at::Tensor& levels, const at::Tensor& scales,
                  const at::Tensor& minimums, int64_t out) {
  TORCH_CHECK(levels.dim() == 3 && levels.scalar_type() == at::kByte && levels.is_contiguous() &&
                  levels.size(2) == kBlockBytes,
              op, ": levels must be a contiguous uint8 tensor [panels, in / 8, 64]");
  const int64_t panels = levels.size(0);
  const int64_t in = levels.size(1) * kBlock;
  TORCH_CHECK(in % kGroup == 0, op, ": ", in, " columns, not a multiple of 32");
  for (const at::Tensor* table : {&scales, &minimums}) {
    TORCH_CHECK(table->scalar_type() == at::kHalf && table->is_contiguous() &&
                    table->dim() == 3 && table->size(0) == panels &&
                    table->size(1) == in / kGroup && table->size(2) == kPanel,
                op, ": scales and minimums must be contiguous fp16 [", panels, ", ", in / kGroup,
                ", 16]");
  }
  TORCH_CHECK(out > (panels - 1) * kPanel && out <= panels * kPanel, op, ": ", out,
              " outputs do not fill ", panels, " panels of 16");
}

at::Tensor q4_1_linear(const at::Tensor& x_in, const at::Tensor& levels, const at::Tensor& scales,
                       const at::Tensor& minimums, int64_t out) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "q4_1_linear: x must be a 2-D fp32 CPU tensor, got ", x_in.sizes(), " ",
              x_in.scalar_type());
  check_packed("q4_1_linear", levels, scales, minimums, out);
  const int64_t in = levels.size(1) * kBlock;
  TORCH_CHECK(x_in.size(1) == in, "q4_1_linear: x has ", x_in.size(1), " columns, W has ", in);
  const at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0);
  at::Tensor y = at::empty({rows, out}, x.options());
  if (rows == 0) {
    return y;
  }
  const PackedMatrix w{levels.data_ptr<uint8_t>(),
                       reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                       reinterpret_cast<const uint16_t*>(minimums.data_ptr<at::Half>()), in};
  const float* x_data = x.data_ptr<float>();
  float* y_data = y.data_ptr<float>();
  at::parallel_for(0, levels.size(0), 1, [&](int64_t begin, int64_t end) {
    if (rows <= kFewRows) {
      with_rows<kFewRows>(rows, [&](auto r) {
        few_rows<decltype(r)::value>(x_data, w, begin, end, y_data, out);
      });
    } else {
      // This task's buffer for one decoded panel (the allocator aligns it to 64 bytes).
      at::Tensor decoded = at::empty({in * kPanel}, x.options());
      many_rows(x_data, rows, w, begin, end, decoded.data_ptr<float>(), y_data, out);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(orcapod, m) {
  m.def(
      "q4_1_linear(Tensor x, Tensor levels, Tensor scales, Tensor minimums, int out_features) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(orcapod, CPU, m) { m.impl("q4_1_linear", &q4_1_linear); }
