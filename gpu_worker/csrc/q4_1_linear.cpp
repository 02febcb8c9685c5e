// A grouped-quantized weight matrix times fp32 activations on the CPU (AVX2, FMA,
// F16C), for every step (decode and prefill): Q4_1 for the packaged model's layers,
// Q8_0 for its LM head (the tied embedding).
//
// The weights are llama.cpp's (its block_q4_1 and block_q8_0 are the reference):
// each row of W [out, in] is cut into groups of 32 weights, a group being a scale
// d (fp16) and 32 levels q, its weights
//   Q4_1: q * d + m, q in 0..15 and m the group's minimum (fp16);
//   Q8_0: q * d, q in -127..127.
// Unlike llama.cpp the activations are not rounded to 8 bits: they stay fp32, and
// so do the sums.
//
// The scheme is a GEMM whose weight operand is decoded as it is needed (BLIS's
// register tiles, with a panel of W in registers or in a thread's cache):
//
//     y[t, o] = fma(x[t, K-1], w[K-1, o], ... fma(x[t, 1], w[1, o], fma(x[t, 0], w[0, o], 0)))
//
// one chain of FMAs per output element, columns k in order, where w[k, o] =
// fma(q, d, m) is the very fp32 weight the GGUF reader makes (q * d is exact in
// fp32, 4 bits times fp16's 11, so one rounding is the reader's product-then-sum).
// Q8_0 has no minimum, so its scale comes out of each group's sum, as in llama.cpp's
// dot products (a multiply a weight fewer; as exact, within fp32 rounding):
//
//     y[t, o] = fma(d[G-1, o], s[t, G-1, o], ... fma(d[0, o], s[t, 0, o], 0))
//
// where s[t, g, o] is the chain of FMAs above over group g's columns, with w = q.
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
//   levels   Q4_1: [panels, in / 8, 64] uint8: a block is two vectors of 8 uint32
//            lanes, the panel's outputs 0-7 then 8-15; lane i holds output i's
//            levels of the block's 8 columns, column j in bits 4j..4j+3 (a mask, a
//            shift and a conversion a column: no shuffles);
//            Q8_0: [panels, in / 8, 128] int8: column by column, the levels of the
//            panel's 16 outputs (one 16-byte load and two sign extensions a column);
//   scales   [panels, in / 32, 16] fp16: d of the panel's 16 outputs, per group;
//   minimums [panels, in / 32, 16] fp16: m likewise (Q4_1 only).
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
#include <cmath>
#include <limits>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kGroup = 32;
// Outputs per panel: two vectors of 8 fp32 lanes.
constexpr int64_t kPanel = 16;
// Columns per block of levels: 8 nibbles to a 32-bit lane.
constexpr int64_t kBlock = 8;
// Calls of up to this many rows decode into registers only. It is also the most
// rows that decode at once: 4 rows x 2 vectors of sums, 2 of weights, 2 of levels
// and a broadcast are 13 of AVX2's 16 registers; a fifth row would spill.
constexpr int kFewRows = 4;
// Rows per tile over a decoded buffer: 6 x 2 sums + 2 weights + 1 broadcast = 15.
constexpr int kBufferRows = 6;
// Rows the tiles over a buffer get at least: one or two rows are two or four
// chains of FMAs, bound by their latency.
constexpr int kFewestBufferRows = 3;

// A row's 16 outputs [0-7, 8-15] into y, its first `columns` only (the last panel may
// hold fewer than 16).
inline void store_row(__m256 low, __m256 high, float* y, int64_t columns) {
  if (columns == kPanel) {
    _mm256_storeu_ps(y, low);
    _mm256_storeu_ps(y + 8, high);
  } else {
    alignas(32) float partial[kPanel];
    _mm256_store_ps(partial, low);
    _mm256_store_ps(partial + 8, high);
    std::memcpy(y, partial, columns * sizeof(float));
  }
}

// One panel's packed operands (see the layout above).
struct Panel {
  const uint8_t* levels;     // [in / 8, block bytes]
  const uint16_t* scales;    // [in / 32, 16]
  const uint16_t* minimums;  // [in / 32, 16], or null (Q8_0)
};

struct PackedMatrix {
  const uint8_t* levels;
  const uint16_t* scales;
  const uint16_t* minimums;
  int64_t in;

  template <typename Format>
  Panel panel(int64_t index) const {
    const int64_t groups = in / kGroup;
    return {levels + index * (in / kBlock) * Format::kBlockBytes, scales + index * groups * kPanel,
            minimums == nullptr ? nullptr : minimums + index * groups * kPanel};
  }
};

// A group's 16 fp16 values of the panel's outputs (scales or minimums), as fp32.
inline void load_table(const uint16_t* table, int64_t group, __m256& low, __m256& high) {
  const auto* halves = reinterpret_cast<const __m128i*>(table + group * kPanel);
  low = _mm256_cvtph_ps(_mm_loadu_si128(halves));
  high = _mm256_cvtph_ps(_mm_loadu_si128(halves + 1));
}

// How each format stores and decodes a panel's block of 8 columns: its group's
// tables, its levels, and the weights of its next column (outputs 0-7 and 8-15).
struct Q41 {
  static constexpr int64_t kBlockBytes = kPanel * kBlock / 2;
  // Whether each group's sums are scaled (a column's weights are then its levels).
  static constexpr bool kScalesGroupSums = false;
  static constexpr bool kHasMinimums = true;
  static constexpr const char* kName = "q4_1_linear";
  static constexpr const char* kIntegerName = "q4_1_i16_linear";
  static constexpr at::ScalarType kLevelType = at::kByte;
  static constexpr const char* kLevelTypeName = "uint8";

  struct Tables {
    __m256 scale_low, scale_high, minimum_low, minimum_high;
  };
  // The levels of outputs 0-7 and 8-15, shifted right by 4 after each column.
  struct Block {
    __m256i low, high;
  };

  static Tables load_tables(const Panel& panel, int64_t group) {
    const auto* scales = reinterpret_cast<const __m128i*>(panel.scales + group * kPanel);
    const auto* minimums = reinterpret_cast<const __m128i*>(panel.minimums + group * kPanel);
    return {_mm256_cvtph_ps(_mm_loadu_si128(scales)), _mm256_cvtph_ps(_mm_loadu_si128(scales + 1)),
            _mm256_cvtph_ps(_mm_loadu_si128(minimums)),
            _mm256_cvtph_ps(_mm_loadu_si128(minimums + 1))};
  }

  static Block load_block(const Panel& panel, int64_t block) {
    const auto* vectors = reinterpret_cast<const __m256i*>(panel.levels + block * kBlockBytes);
    return {_mm256_loadu_si256(vectors), _mm256_loadu_si256(vectors + 1)};
  }

  // The block's next column: its 16 weights fma(q, d, m).
  static void next_column(Block& block, const Tables& tables, __m256& low, __m256& high) {
    const __m256i nibble = _mm256_set1_epi32(0x0F);
    low = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(block.low, nibble)),
                          tables.scale_low, tables.minimum_low);
    high = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(block.high, nibble)),
                           tables.scale_high, tables.minimum_high);
    block.low = _mm256_srli_epi32(block.low, 4);
    block.high = _mm256_srli_epi32(block.high, 4);
  }

  // The block's columns `pair` and `pair` + 4 as two 16-bit levels a 32-bit lane
  // (outputs 0-7, 8-15), for madd (*activations rounded to 16-bit integers* below):
  // a lane holds them 16 bits apart, so a shift and a mask.
  static void column_pairs(const Block& block, int pair, __m256i& low, __m256i& high) {
    const __m256i nibble_pairs = _mm256_set1_epi32(0x000F000F);
    low = _mm256_and_si256(_mm256_srli_epi32(block.low, 4 * pair), nibble_pairs);
    high = _mm256_and_si256(_mm256_srli_epi32(block.high, 4 * pair), nibble_pairs);
  }
};

struct Q80 {
  static constexpr int64_t kBlockBytes = kPanel * kBlock;
  static constexpr bool kScalesGroupSums = true;
  static constexpr bool kHasMinimums = false;
  static constexpr const char* kName = "q8_0_linear";
  static constexpr const char* kIntegerName = "q8_0_i16_linear";
  static constexpr at::ScalarType kLevelType = at::kChar;
  static constexpr const char* kLevelTypeName = "int8";

  struct Tables {
    __m256 scale_low, scale_high;
  };
  // The next column's 16 levels.
  struct Block {
    const __m128i* column;
  };

  static Tables load_tables(const Panel& panel, int64_t group) {
    Tables tables;
    load_table(panel.scales, group, tables.scale_low, tables.scale_high);
    return tables;
  }

  static Block load_block(const Panel& panel, int64_t block) {
    return {reinterpret_cast<const __m128i*>(panel.levels + block * kBlockBytes)};
  }

  // The block's next column: its 16 levels q, as fp32 (each group's sums are scaled).
  static void next_column(Block& block, const Tables&, __m256& low, __m256& high) {
    const auto* levels = reinterpret_cast<const uint8_t*>(block.column++);
    low = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(levels))));
    high = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(levels + 8))));
  }

  // The block's columns `pair` and `pair` + 4 as two 16-bit levels a 32-bit lane
  // (outputs 0-7, 8-15): the two columns' bytes interleaved, then sign-extended.
  static void column_pairs(const Block& block, int pair, __m256i& low, __m256i& high) {
    const __m128i first = _mm_loadu_si128(block.column + pair);
    const __m128i second = _mm_loadu_si128(block.column + pair + 4);
    low = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(first, second));
    high = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(first, second));
  }
};

// The scaled sums of the groups done, [row][16 outputs], of a format that scales
// each group's sums (kept in memory, the L1, apart from a tile's registers).
template <typename Format, int R, bool = Format::kScalesGroupSums>
struct Totals {
  alignas(32) float rows[R][kPanel] = {};
};

// Nothing for a format whose sums are not scaled by group.
template <typename Format, int R>
struct Totals<Format, R, false> {};

// The sums of R rows of x for one panel: [row][outputs 0-7, 8-15], in registers
// (for a format that scales each group's sums, the current group's).
template <typename Format, int R>
struct Tile {
  __m256 sums[R][2];

  Tile() {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      sums[r][0] = sums[r][1] = _mm256_setzero_ps();
    }
  }

  // The end of a group's columns: its sums scaled into `totals` (a format that
  // scales them), then zero again.
  inline void end_group(const Panel& panel, int64_t group, Totals<Format, R>& totals) {
    if constexpr (Format::kScalesGroupSums) {
      float(*rows)[kPanel] = totals.rows;
      const typename Format::Tables tables = Format::load_tables(panel, group);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        _mm256_store_ps(rows[r],
                        _mm256_fmadd_ps(tables.scale_low, sums[r][0], _mm256_load_ps(rows[r])));
        _mm256_store_ps(rows[r] + 8, _mm256_fmadd_ps(tables.scale_high, sums[r][1],
                                                     _mm256_load_ps(rows[r] + 8)));
        sums[r][0] = sums[r][1] = _mm256_setzero_ps();
      }
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
  // the last panel may hold fewer than 16. A format that scales each group's sums
  // stores its totals.
  inline void store(float* y, int64_t out, int64_t columns, const Totals<Format, R>& totals) const {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      if constexpr (Format::kScalesGroupSums) {
        std::memcpy(y + r * out, totals.rows[r], columns * sizeof(float));
      } else {
        store_row(sums[r][0], sums[r][1], y + r * out, columns);
      }
    }
  }
};

// R rows of x times P adjacent panels, every column decoded as it is used (and, if
// kStore, stored to `decoded` [in, 16]; P is then 1). The panels take turns by
// blocks of 8 columns: each holds its levels and tables only while it decodes,
// and the CPU overlaps the panels' chains of FMAs.
template <typename Format, int R, int P, bool kStore>
void decoding_tiles(const float* x, int64_t in, const Panel* panels, float* decoded, float* y,
                    int64_t out, int64_t columns_of_last) {
  static_assert(!kStore || P == 1, "one panel at a time is stored");
  Tile<Format, R> tiles[P];
  Totals<Format, R> totals[P];
  for (int64_t group = 0; group < in / kGroup; ++group) {
    for (int64_t block = group * (kGroup / kBlock); block < (group + 1) * (kGroup / kBlock);
         ++block) {
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        const typename Format::Tables tables = Format::load_tables(panels[p], group);
        typename Format::Block levels = Format::load_block(panels[p], block);
#pragma GCC unroll 8
        for (int j = 0; j < kBlock; ++j) {
          const int64_t k = block * kBlock + j;
          __m256 low, high;
          Format::next_column(levels, tables, low, high);
          if constexpr (kStore) {
            _mm256_store_ps(decoded + k * kPanel, low);
            _mm256_store_ps(decoded + k * kPanel + 8, high);
          }
          tiles[p].accumulate(x, in, k, low, high);
        }
      }
    }
    if constexpr (Format::kScalesGroupSums) {
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        tiles[p].end_group(panels[p], group, totals[p]);
      }
    }
  }
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p) {
    tiles[p].store(y + p * kPanel, out, p == P - 1 ? columns_of_last : kPanel, totals[p]);
  }
}

// R rows of x times one panel whose decoded columns are in `decoded` [in, 16].
template <typename Format, int R>
void buffer_tile(const float* x, int64_t in, const Panel& panel, const float* decoded, float* y,
                 int64_t out, int64_t columns) {
  Tile<Format, R> tile;
  Totals<Format, R> totals;
  for (int64_t group = 0; group < in / kGroup; ++group) {
    for (int64_t k = group * kGroup; k < (group + 1) * kGroup; ++k) {
      tile.accumulate(x, in, k, _mm256_load_ps(decoded + k * kPanel),
                      _mm256_load_ps(decoded + k * kPanel + 8));
    }
    tile.end_group(panel, group, totals);
  }
  tile.store(y, out, columns, totals);
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
template <typename Format, int R>
void few_rows(const float* x, const PackedMatrix& w, int64_t begin, int64_t end, float* y,
              int64_t out) {
  // A lone row's two chains a panel would wait on the FMAs' latency: two panels.
  constexpr int P = R == 1 ? 2 : 1;
  int64_t p = begin;
  for (; p + P <= end; p += P) {
    Panel panels[P];
    for (int i = 0; i < P; ++i) {
      panels[i] = w.panel<Format>(p + i);
    }
    decoding_tiles<Format, R, P, false>(x, w.in, panels, nullptr, y + p * kPanel, out,
                                        columns_of(p + P - 1, out));
  }
  for (; p < end; ++p) {
    const Panel panel = w.panel<Format>(p);
    decoding_tiles<Format, R, 1, false>(x, w.in, &panel, nullptr, y + p * kPanel, out,
                                        columns_of(p, out));
  }
}

// Panels [begin, end) for a call of more than kFewRows rows, `decoded` [in, 16]
// the thread's buffer.
template <typename Format>
void many_rows(const float* x, int64_t rows, const PackedMatrix& w, int64_t begin, int64_t end,
               float* decoded, float* y, int64_t out) {
  const int64_t in = w.in;
  const int64_t decoding_rows = std::min<int64_t>(kFewRows, rows - kFewestBufferRows);
  // The other rows in tiles as even as kBufferRows allows (8 are 4 + 4, not 6 + 2).
  const int64_t buffer_rows = rows - decoding_rows;
  const int64_t num_tiles = (buffer_rows + kBufferRows - 1) / kBufferRows;
  for (int64_t p = begin; p < end; ++p) {
    const Panel panel = w.panel<Format>(p);
    const int64_t columns = columns_of(p, out);
    with_rows<kFewRows>(decoding_rows, [&](auto r) {
      decoding_tiles<Format, decltype(r)::value, 1, true>(x, in, &panel, decoded,
                                                          y + p * kPanel, out, columns);
    });
    int64_t t = decoding_rows;
    for (int64_t tile = 0; tile < num_tiles; ++tile) {
      const int64_t size = (rows - t + (num_tiles - tile) - 1) / (num_tiles - tile);
      with_rows<kBufferRows>(size, [&](auto r) {
        buffer_tile<Format, decltype(r)::value>(x + t * in, in, panel, decoded,
                                                y + t * out + p * kPanel, out, columns);
      });
      t += size;
    }
  }
}

// The packed operands' shapes and types (a minimums table for Q4_1 only);
// returns the number of columns.
template <typename Format>
int64_t check_packed(const at::Tensor& levels, const at::Tensor& scales,
                     const at::Tensor* minimums, int64_t out) {
  const char* op = Format::kName;
  TORCH_CHECK(levels.dim() == 3 && levels.scalar_type() == Format::kLevelType &&
                  levels.is_contiguous() && levels.size(2) == Format::kBlockBytes,
              op, ": levels must be a contiguous ", Format::kLevelTypeName,
              " tensor [panels, in / 8, ", Format::kBlockBytes, "]");
  const int64_t panels = levels.size(0);
  const int64_t in = levels.size(1) * kBlock;
  TORCH_CHECK(in % kGroup == 0, op, ": ", in, " columns, not a multiple of 32");
  for (const at::Tensor* table : {&scales, minimums}) {
    TORCH_CHECK(table == nullptr ||
                    (table->scalar_type() == at::kHalf && table->is_contiguous() &&
                     table->dim() == 3 && table->size(0) == panels &&
                     table->size(1) == in / kGroup && table->size(2) == kPanel),
                op, ": scales and minimums must be contiguous fp16 [", panels, ", ", in / kGroup,
                ", 16]");
  }
  TORCH_CHECK(out > (panels - 1) * kPanel && out <= panels * kPanel, op, ": ", out,
              " outputs do not fill ", panels, " panels of 16");
  return in;
}

// An op's operands, checked (`op` names it in every message): x [rows, in] fp32
// made contiguous, y [rows, out] to fill, and the packed matrix.
struct Operands {
  at::Tensor x, y;
  PackedMatrix w;
  int64_t rows;
};

template <typename Format>
Operands checked_operands(const char* op, const at::Tensor& x_in, const at::Tensor& levels,
                          const at::Tensor& scales, const at::Tensor* minimums, int64_t out) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), op,
              ": x must be a 2-D fp32 CPU tensor, got ", x_in.sizes(), " ", x_in.scalar_type());
  const int64_t in = check_packed<Format>(levels, scales, minimums, out);
  TORCH_CHECK(x_in.size(1) == in, op, ": x has ", x_in.size(1), " columns, W has ", in);
  at::Tensor x = x_in.contiguous();
  const int64_t rows = x.size(0);
  at::Tensor y = at::empty({rows, out}, x.options());
  const PackedMatrix w{
      reinterpret_cast<const uint8_t*>(levels.data_ptr()),
      reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
      minimums == nullptr ? nullptr
                          : reinterpret_cast<const uint16_t*>(minimums->data_ptr<at::Half>()),
      in};
  return {x, y, w, rows};
}

template <typename Format>
at::Tensor grouped_linear(const at::Tensor& x_in, const at::Tensor& levels,
                          const at::Tensor& scales, const at::Tensor* minimums, int64_t out) {
  const Operands operands =
      checked_operands<Format>(Format::kName, x_in, levels, scales, minimums, out);
  const at::Tensor &x = operands.x, &y = operands.y;
  const PackedMatrix& w = operands.w;
  const int64_t rows = operands.rows;
  const int64_t in = w.in;
  if (rows == 0) {
    return y;
  }
  const float* x_data = x.data_ptr<float>();
  float* y_data = y.data_ptr<float>();
  at::parallel_for(0, levels.size(0), 1, [&](int64_t begin, int64_t end) {
    if (rows <= kFewRows) {
      with_rows<kFewRows>(rows, [&](auto r) {
        few_rows<Format, decltype(r)::value>(x_data, w, begin, end, y_data, out);
      });
    } else {
      // This task's buffer for one decoded panel (the allocator aligns it to 64 bytes).
      at::Tensor decoded = at::empty({in * kPanel}, x.options());
      many_rows<Format>(x_data, rows, w, begin, end, decoded.data_ptr<float>(), y_data, out);
    }
  });
  return y;
}

// ---------------------------------------------------------------------------
// Q4_1 and Q8_0 with activations rounded to 16-bit integers (llama.cpp's Q4_1 x
// Q8_1 dot product, ggml_vec_dot_q4_1_q8_1, is the scheme studied, with twice its
// bits: its 8-bit activations took a third of the greedy answers of
// bench/quant_agreement.py away from float32's on SmolLM2, whose activations have
// outliers): each row's group of 32 values is cut to int16 levels v and a scale
// e = max|x| / 32767 (x ~ v * e), so that a group's products are integers, 16 of
// them to one madd:
//
//     y[t, o] = sum over groups g of  d[g, o] * e[t, g] * S[t, g, o]  +  m[g, o] * X[t, g]
//
// where S = sum of q * v over the group (exact, in int32: at most 32 x 127 x 32767)
// and, for Q4_1, X the group's sum of the fp32 x (not of v * e: the minimum's term
// stays exact). Per group, in order: total = fma(d * e, S, total), then (Q4_1)
// total = fma(m, X, total). Only x's rounding strays from the exact kernel above
// (at most half a level, 1.5e-5 of the group's largest value); each row is rounded
// alone and every row count runs the same tiles, so a row's result does not depend
// on its batch.
//
// The levels are the exact kernel's layouts, read as pairs of columns p and p + 4
// in 16-bit halves of a 32-bit lane (each format's column_pairs: Q4_1's lane
// shifted right by 4p and masked with 0x000F000F; Q8_0's two columns interleaved
// and sign-extended); x's levels come packed to match, a 32-bit word per row,
// block and p, and madd multiplies the pairs and adds them into int32.

// 32-bit words of x's levels per block of 8 columns: columns (p, p + 4), p = 0..3.
constexpr int64_t kWordsPerBlock = 4;

// Rows of x as the integer tiles read them (``quantize_rows``).
struct QuantizedRows {
  const int32_t* words;   // [rows, in / 8, 4]: per block, v of columns (p, p + 4)
  const float* scales;    // [rows, in / 32]: e
  const float* sums;      // [rows, in / 32]: X
  int64_t in;

  int64_t groups() const { return in / kGroup; }
  QuantizedRows from(int64_t row) const {
    return {words + row * (in / kBlock) * kWordsPerBlock, scales + row * groups(),
            sums + row * groups(), in};
  }
};

// The largest and the sum of a vector's 8 lanes.
inline float largest_lane(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Rows of x [rows, in] rounded to int16 per group of 32: the words, scales and
// sums above (the same for a row in any call: each row alone, each group's
// operations in one order).
void quantize_rows(const float* x, int64_t rows, int64_t in, int32_t* words, float* scales,
                   float* sums) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m128i low_halves = _mm_set1_epi32(0xFFFF);
  for (int64_t g = 0; g < rows * (in / kGroup); ++g) {
    const float* group = x + g * kGroup;
    __m256 values[kGroup / kBlock];
    __m256 largest = _mm256_setzero_ps();
    __m256 sum = _mm256_setzero_ps();
    // x - x is 0 for a finite x, NaN for an infinity or a NaN.
    __m256 finite = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int64_t b = 0; b < kGroup / kBlock; ++b) {
      values[b] = _mm256_loadu_ps(group + b * kBlock);
      largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, values[b]));
      sum = _mm256_add_ps(sum, values[b]);
      finite = _mm256_and_ps(
          finite, _mm256_cmp_ps(_mm256_sub_ps(values[b], values[b]), _mm256_setzero_ps(),
                                _CMP_EQ_OQ));
    }
    const bool all_finite = _mm256_movemask_ps(finite) == 0xFF;
    // A NaN or an infinity in the group makes its scale NaN, and so the group's
    // outputs, as the exact kernel's would be non-finite.
    const float scale =
        all_finite ? largest_lane(largest) / 32767.0f : std::numeric_limits<float>::quiet_NaN();
    scales[g] = scale;
    sums[g] = lane_sum(sum);
    // Levels are zero for a group of zeros (or subnormals whose scale is zero) and for a
    // non-finite group. x / scale rather than x * (1 / scale): a subnormal scale has no
    // finite inverse. Rounded to nearest, ties to even.
    const bool rounds = all_finite && scale > 0.0f;
    const __m256 divisor = _mm256_set1_ps(rounds ? scale : 1.0f);
    int32_t* block_words = words + g * (kGroup / kBlock) * kWordsPerBlock;
    for (int64_t b = 0; b < kGroup / kBlock; ++b) {
      __m256 level = _mm256_round_ps(_mm256_div_ps(values[b], divisor),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      level = _mm256_min_ps(_mm256_set1_ps(32767.0f),
                            _mm256_max_ps(_mm256_set1_ps(-32767.0f), level));
      const __m256i levels = rounds ? _mm256_cvtps_epi32(level) : _mm256_setzero_si256();
      // Word p holds columns p and p + 4 (the nibbles a 32-bit lane holds 16 bits apart).
      const __m128i words_of_block =
          _mm_or_si128(_mm_and_si128(_mm256_castsi256_si128(levels), low_halves),
                       _mm_slli_epi32(_mm256_extracti128_si256(levels, 1), 16));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(block_words + b * kWordsPerBlock),
                       words_of_block);
    }
  }
}

// sum + madd(pairs, word): the 16-bit pairs' products added into the int32 lanes, as
// one unit the compiler does not take apart. Written with intrinsics, GCC computed a
// block's 32 madds of 4 rows ahead of their adds (integer sums may be reordered) and
// spilled them to the stack: 1.1-1.3x this form's time from 4 rows up.
inline __m256i add_products(__m256i sum, __m256i pairs, __m256i word) {
  __m256i products;
  asm("vpmaddwd %[word], %[pairs], %[products]\n\t"
      "vpaddd %[products], %[sum], %[sum]"
      : [sum] "+x"(sum), [products] "=&x"(products)
      : [pairs] "x"(pairs), [word] "x"(word));
  return sum;
}

// R rows of quantized x times one panel (a lone row too: one panel at a time
// measured faster than two side by side here).
template <typename Format, int R>
void integer_tile(const QuantizedRows& x, const Panel& panel, float* y, int64_t out,
                  int64_t columns) {
  __m256 totals[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    totals[r][0] = totals[r][1] = _mm256_setzero_ps();
  }
  for (int64_t group = 0; group < x.groups(); ++group) {
    // The group's integer sums S, [row][outputs 0-7, 8-15].
    __m256i sums[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      sums[r][0] = sums[r][1] = _mm256_setzero_si256();
    }
#pragma GCC unroll 4
    for (int64_t block = group * (kGroup / kBlock); block < (group + 1) * (kGroup / kBlock);
         ++block) {
      const typename Format::Block levels = Format::load_block(panel, block);
#pragma GCC unroll 4
      for (int pair = 0; pair < kWordsPerBlock; ++pair) {
        __m256i pairs[2];
        Format::column_pairs(levels, pair, pairs[0], pairs[1]);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256i word = _mm256_set1_epi32(
              x.words[(r * (x.in / kBlock) + block) * kWordsPerBlock + pair]);
          sums[r][0] = add_products(sums[r][0], pairs[0], word);
          sums[r][1] = add_products(sums[r][1], pairs[1], word);
        }
      }
    }
    __m256 scale_low, scale_high, minimum_low, minimum_high;
    load_table(panel.scales, group, scale_low, scale_high);
    if constexpr (Format::kHasMinimums) {
      load_table(panel.minimums, group, minimum_low, minimum_high);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 e = _mm256_broadcast_ss(x.scales + r * x.groups() + group);
      totals[r][0] = _mm256_fmadd_ps(_mm256_mul_ps(scale_low, e), _mm256_cvtepi32_ps(sums[r][0]),
                                     totals[r][0]);
      totals[r][1] = _mm256_fmadd_ps(_mm256_mul_ps(scale_high, e),
                                     _mm256_cvtepi32_ps(sums[r][1]), totals[r][1]);
      if constexpr (Format::kHasMinimums) {
        const __m256 sum = _mm256_broadcast_ss(x.sums + r * x.groups() + group);
        totals[r][0] = _mm256_fmadd_ps(minimum_low, sum, totals[r][0]);
        totals[r][1] = _mm256_fmadd_ps(minimum_high, sum, totals[r][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    store_row(totals[r][0], totals[r][1], y + r * out, columns);
  }
}

// Rows per integer tile: 4 rows' integer sums and totals are 16 vectors (the
// compiler keeps what fits in registers; measured faster than 2 or 6 rows).
constexpr int kIntegerRows = 4;

template <typename Format>
at::Tensor integer_linear(const at::Tensor& x_in, const at::Tensor& levels,
                          const at::Tensor& scales, const at::Tensor* minimums, int64_t out) {
  const Operands operands =
      checked_operands<Format>(Format::kIntegerName, x_in, levels, scales, minimums, out);
  const at::Tensor &x = operands.x, &y = operands.y;
  const PackedMatrix& w = operands.w;
  const int64_t rows = operands.rows;
  const int64_t in = w.in;
  if (rows == 0) {
    return y;
  }
  at::Tensor words = at::empty({rows, in / kBlock, kWordsPerBlock}, x.options().dtype(at::kInt));
  at::Tensor row_scales = at::empty({rows, in / kGroup}, x.options());
  at::Tensor row_sums = at::empty({rows, in / kGroup}, x.options());
  const float* x_data = x.data_ptr<float>();
  int32_t* words_data = words.data_ptr<int32_t>();
  float* scales_data = row_scales.data_ptr<float>();
  float* sums_data = row_sums.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    quantize_rows(x_data + begin * in, end - begin, in,
                  words_data + begin * (in / kBlock) * kWordsPerBlock,
                  scales_data + begin * (in / kGroup), sums_data + begin * (in / kGroup));
  });
  const QuantizedRows quantized{words_data, scales_data, sums_data, in};
  float* y_data = y.data_ptr<float>();
  at::parallel_for(0, levels.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = 0; t < rows; t += kIntegerRows) {
      const QuantizedRows tile_rows = quantized.from(t);
      float* tile_y = y_data + t * out;
      with_rows<kIntegerRows>(std::min<int64_t>(kIntegerRows, rows - t), [&](auto r) {
        for (int64_t p = begin; p < end; ++p) {
          integer_tile<Format, decltype(r)::value>(tile_rows, w.panel<Format>(p),
                                                   tile_y + p * kPanel, out, columns_of(p, out));
        }
      });
    }
  });
  return y;
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& levels, const at::Tensor& scales,
                       const at::Tensor& minimums, int64_t out) {
  return grouped_linear<Q41>(x, levels, scales, &minimums, out);
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& levels, const at::Tensor& scales,
                       int64_t out) {
  return grouped_linear<Q80>(x, levels, scales, nullptr, out);
}

at::Tensor q4_1_i16_linear(const at::Tensor& x, const at::Tensor& levels,
                           const at::Tensor& scales, const at::Tensor& minimums, int64_t out) {
  return integer_linear<Q41>(x, levels, scales, &minimums, out);
}

at::Tensor q8_0_i16_linear(const at::Tensor& x, const at::Tensor& levels,
                           const at::Tensor& scales, int64_t out) {
  return integer_linear<Q80>(x, levels, scales, nullptr, out);
}

}  // namespace

TORCH_LIBRARY(orcapod, m) {
  m.def(
      "q4_1_linear(Tensor x, Tensor levels, Tensor scales, Tensor minimums, int out_features) -> "
      "Tensor");
  m.def("q8_0_linear(Tensor x, Tensor levels, Tensor scales, int out_features) -> Tensor");
  m.def(
      "q4_1_i16_linear(Tensor x, Tensor levels, Tensor scales, Tensor minimums, int out_features) "
      "-> Tensor");
  m.def("q8_0_i16_linear(Tensor x, Tensor levels, Tensor scales, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(orcapod, CPU, m) {
  m.impl("q4_1_linear", &q4_1_linear);
  m.impl("q8_0_linear", &q8_0_linear);
  m.impl("q4_1_i16_linear", &q4_1_i16_linear);
  m.impl("q8_0_i16_linear", &q8_0_i16_linear);
}
