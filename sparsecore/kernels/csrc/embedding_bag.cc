// The owner's arithmetic of the stand-in lookup as XLA:CPU custom calls (see
// sparsecore/kernels/cpu.py): partials[w, sample] += gain * table[row] over the entries of every
// window w; entries with a row outside [0, V) or a sample outside [0, B) add nothing, samples no
// entry names are zero. Two sources of entries:
//   SparseCoreEmbeddingBag: routed windows (rows, samples, gains [W, P], used [W]), as the
//     routing of a mesh of devices delivers them;
//   SparseCoreEmbeddingBagSegments: one device's packed buffers read in place, as a SparseCore
//     reads them: window s is SparseCore s's segment, partition t its slots
//     [round_up(row_pointers[t - 1], 8), row_pointers[t]) (from 0 for t = 0), row
//     t * rows_per_shard + embedding id.
// The first writes its output [W, B, D] whole; the second writes one output per block of samples
// of every window (one feature's activations each, sample_offsets[f] the block's first sample),
// [W, samples, dim], with the first dim <= D columns of each sum: the lookup returns each
// feature's activations without slicing them out of the stack's. Samples in no block are not
// summed.
//
// Work is split into (window, sample range) tasks, so no two tasks write one output row and no
// atomics are needed: one task per window, or where there are fewer windows than threads, each
// window's samples in as many ranges as it takes to occupy the threads (every task then scans
// its window's entries and keeps those of its samples). The tasks are claimed from a shared
// counter by the calling thread and by helpers scheduled on XLA's intra-op thread pool, and the
// caller waits only for tasks a helper has already claimed: if the pool is busy (another custom
// call waiting the same way, say), the caller does all the work itself instead of waiting for a
// thread that may never come.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Terms ahead of the current one whose table row is prefetched: the reads are random rows of a
// table far larger than the caches, the one cost of this kernel that the arithmetic cannot hide.
constexpr int64_t kPrefetchDistance = 16;
constexpr int64_t kCacheLine = 64;

// The entries of routed windows.
struct Windows {
  const int32_t* rows;
  const int32_t* samples;
  const float* gains;
  const int32_t* used;
  int64_t slots;  // P

  template <class F>
  void ForEach(int64_t window, F&& f) const {
    const int64_t base = window * slots, count = std::clamp<int64_t>(used[window], 0, slots);
    for (int64_t p = base; p < base + count; ++p) f(samples[p], rows[p], gains[p]);
  }
};

// The entries of one device's packed buffers, partition by partition.
struct Segments {
  const int32_t* row_pointers;
  const int32_t* ids;
  const int32_t* samples;
  const float* gains;
  int64_t partitions, pointers_per_sparsecore, segment, readable, rows_per_shard;

  template <class F>
  void ForEach(int64_t sparsecore, F&& f) const {
    const int32_t* ends = row_pointers + sparsecore * pointers_per_sparsecore;
    const int64_t base = sparsecore * segment;
    int64_t start = 0;
    for (int64_t t = 0; t < partitions; ++t) {
      const int64_t end = std::min<int64_t>(ends[t], readable), row = t * rows_per_shard;
      for (int64_t p = std::max<int64_t>(start, 0); p < end; ++p) f(samples[base + p], row + ids[base + p], gains[base + p]);
      start = (int64_t{ends[t]} + 7) / 8 * 8;
    }
  }
};

// Where the sums of samples [first, first + samples) of every window go: sample s of window w is
// row w * samples + s - first of `data`, which gets the first `dim` columns of its sum.
struct Block {
  float* data;
  int64_t first, samples, dim;
};

// What every task shares: the table, the output blocks (in sample order, disjoint) and the split.
struct Bag {
  const float* table;
  std::vector<Block> blocks;
  int64_t vocabulary, dim, batch, ranges;
};

// One entry that counts, in sample order: the table row and its gain.
struct Term {
  int32_t row;
  float gain;
};

// The widest sums held in registers: 128 floats are 8 AVX-512 or 16 AVX2 registers.
constexpr int64_t kRegisterColumns = 128;

// Samples [first, last) of `window` in `block`, from their terms: sample s sums terms
// [starts[s - first], starts[s - first + 1]) in a small accumulator and writes the block's dim
// columns of it once. Summing in place entry by entry instead costs a read and a write of an
// output row per entry (a window's rows do not fit in L1), ~30% slower. The accumulator holds
// kColumns columns (the block's dim rounded up, within the table's rows), a count known at
// compile time, so it stays in registers; kColumns = 0 sums the block's dim, a count known at
// run time, in memory, where every term waits for the store of the one before (1.3-1.5x the
// time at dims 64 and 128).
template <int64_t kColumns>
__attribute__((always_inline)) inline void SumBlock(const Bag& bag, const Block& block, int64_t window, int64_t first,
                                                    int64_t last, const int32_t* starts, const Term* terms,
                                                    int64_t total) {
  const int64_t stride = bag.dim, columns = kColumns ? kColumns : block.dim;
  thread_local std::vector<float> scratch;
  scratch.resize(kColumns ? 0 : columns);
  for (int64_t s = first; s < last; ++s) {
    float registers[kColumns ? kColumns : 1] = {};
    float* __restrict acc = kColumns ? registers : scratch.data();
    if (!kColumns) std::fill(acc, acc + columns, 0.0f);
    for (int64_t k = starts[s - first]; k < starts[s - first + 1]; ++k) {
      if (k + kPrefetchDistance < total) {
        const char* line = reinterpret_cast<const char*>(bag.table + int64_t{terms[k + kPrefetchDistance].row} * stride);
        for (int64_t byte = 0; byte < columns * int64_t{sizeof(float)}; byte += kCacheLine) __builtin_prefetch(line + byte);
      }
      const float gain = terms[k].gain;
      const float* __restrict source = bag.table + int64_t{terms[k].row} * stride;
      for (int64_t d = 0; d < columns; ++d) acc[d] += gain * source[d];
    }
    std::memcpy(block.data + (window * block.samples + s - block.first) * block.dim, acc, sizeof(float) * block.dim);
  }
}

// `SumBlock<columns>(args...)` if `columns` is one of 8, 16, ..., 8 * sizeof...(k) (an instance
// each); whether it was.
template <size_t... k, class... Args>
__attribute__((always_inline)) inline bool SumInRegisters(std::index_sequence<k...>, int64_t columns,
                                                          const Args&... args) {
  return ((columns == 8 * int64_t{k + 1} && (SumBlock<8 * (k + 1)>(args...), true)) || ...);
}

// Samples [first, last) of `window`, from their terms (sample s: terms [starts[s - first],
// starts[s - first + 1])), block by block; samples in no block are not summed. Compiled for
// AVX-512 and AVX2 too (chosen at load time): the sums are then 16 or 8 lanes wide.
__attribute__((target_clones("avx512f", "avx2", "default")))
void SumTerms(const Bag& bag, int64_t window, int64_t first, int64_t last, const int32_t* starts,
              const Term* terms) {
  const int64_t total = starts[last - first];
  for (const Block& block : bag.blocks) {
    const int64_t begin = std::max(first, block.first), end = std::min(last, block.first + block.samples);
    if (begin >= end) continue;
    const int32_t* block_starts = starts + (begin - first);
    const int64_t columns = (block.dim + 7) / 8 * 8;
    if (columns > bag.dim ||
        !SumInRegisters(std::make_index_sequence<kRegisterColumns / 8>(), columns, bag, block, window, begin, end,
                        block_starts, terms, total)) {
      SumBlock<0>(bag, block, window, begin, end, block_starts, terms, total);
    }
  }
}

// Task `task` = (window, sample range): the range's output rows. The window's entries that count
// are put in sample order, each with its row and gain (a counting sort: stable, so each sample's
// entries keep their buffer order), then summed (`SumTerms`).
template <class Source>
void RunTask(const Bag& bag, const Source& source, int64_t task) {
  const int64_t window = task / bag.ranges, range = task % bag.ranges;
  const int64_t per_range = (bag.batch + bag.ranges - 1) / bag.ranges;
  const int64_t first = std::min(range * per_range, bag.batch);
  const int64_t last = std::min(first + per_range, bag.batch);
  auto counts = [&](int64_t sample, int64_t row) {
    return sample >= first && sample < last && row >= 0 && row < bag.vocabulary;
  };
  thread_local std::vector<int32_t> starts, next;
  thread_local std::vector<Term> terms;
  starts.assign(last - first + 1, 0);
  source.ForEach(window, [&](int64_t sample, int64_t row, float) {
    if (counts(sample, row)) ++starts[sample - first + 1];
  });
  for (int64_t s = 1; s <= last - first; ++s) starts[s] += starts[s - 1];
  next.assign(starts.begin(), starts.end() - 1);
  terms.resize(starts[last - first]);
  source.ForEach(window, [&](int64_t sample, int64_t row, float gain) {
    if (counts(sample, row)) terms[next[sample - first]++] = Term{static_cast<int32_t>(row), gain};
  });
  SumTerms(bag, window, first, last, starts.data(), terms.data());
}

template <class Source>
struct Tasks {
  Bag bag;
  Source source;
  int64_t total;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mutex;
  std::condition_variable finished;

  // Claim and run tasks until none is left.
  void Work() {
    for (int64_t task; (task = next.fetch_add(1)) < total;) {
      RunTask(bag, source, task);
      if (done.fetch_add(1) + 1 == total) {
        std::lock_guard<std::mutex> lock(mutex);
        finished.notify_all();
      }
    }
  }
};

// Every block's rows of `windows` windows of `batch` samples, on the pool's threads and this one.
template <class Source>
void Run(ffi::ThreadPool& pool, const float* table, std::vector<Block> blocks, int64_t vocabulary, int64_t dim,
         int64_t windows, int64_t batch, const Source& source) {
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t ranges = std::clamp<int64_t>((threads + windows - 1) / std::max<int64_t>(windows, 1), 1,
                                             std::max<int64_t>(batch, 1));
  auto tasks = std::make_shared<Tasks<Source>>();
  tasks->bag = Bag{table, std::move(blocks), vocabulary, dim, batch, ranges};
  tasks->source = source;
  tasks->total = windows * ranges;
  for (int64_t helper = 1; helper < std::min(threads, tasks->total); ++helper) {
    pool.Schedule([tasks] { tasks->Work(); });
  }
  tasks->Work();
  std::unique_lock<std::mutex> lock(tasks->mutex);
  tasks->finished.wait(lock, [&] { return tasks->done.load() == tasks->total; });
}

ffi::Error EmbeddingBag(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> rows,
                        ffi::Buffer<ffi::S32> samples, ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::S32> used,
                        ffi::ResultBuffer<ffi::F32> out) {
  const auto table_dims = table.dimensions(), entry_dims = rows.dimensions(), out_dims = out->dimensions();
  if (table_dims.size() != 2 || entry_dims.size() != 2 || out_dims.size() != 3) {
    return ffi::Error::InvalidArgument("embedding_bag: table [V, D], entries [W, P], output [W, B, D] expected");
  }
  const int64_t windows = entry_dims[0], dim = table_dims[1], entries = windows * entry_dims[1];
  if (samples.element_count() != entries || gains.element_count() != entries || used.element_count() != windows ||
      out_dims[0] != windows || out_dims[2] != dim) {
    return ffi::Error::InvalidArgument("embedding_bag: operand shapes disagree");
  }
  Run(pool, table.typed_data(), {Block{out->typed_data(), 0, out_dims[1], dim}}, table_dims[0], dim, windows,
      out_dims[1], Windows{rows.typed_data(), samples.typed_data(), gains.typed_data(), used.typed_data(), entry_dims[1]});
  return ffi::Error::Success();
}

ffi::Error EmbeddingBagSegments(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> row_pointers,
                                ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> samples, ffi::Buffer<ffi::F32> gains,
                                int64_t partitions, int64_t readable, int64_t rows_per_shard, int64_t batch,
                                ffi::Span<const int64_t> sample_offsets, ffi::RemainingRets outs) {
  const auto table_dims = table.dimensions();
  if (table_dims.size() != 2 || outs.size() == 0 || outs.size() != sample_offsets.size()) {
    return ffi::Error::InvalidArgument(
        "embedding_bag_segments: table [V, D] and one output per sample offset (at least one) expected");
  }
  const int64_t dim = table_dims[1], slots = ids.element_count(), pointers = row_pointers.element_count();
  std::vector<Block> blocks;
  int64_t sparsecores = 0, end = 0;
  for (size_t f = 0; f < outs.size(); ++f) {
    auto out = outs.get<ffi::Buffer<ffi::F32>>(f);
    if (out.has_error()) return out.error();
    const auto dims = (*out)->dimensions();
    if (f == 0 && dims.size() == 3) sparsecores = dims[0];
    if (dims.size() != 3 || dims[0] != sparsecores || sample_offsets[f] < end || dims[1] < 1 ||
        dims[1] > batch - sample_offsets[f] || dims[2] < 1 || dims[2] > dim) {
      return ffi::Error::InvalidArgument(
          "embedding_bag_segments: outputs [S, samples, dim <= D] expected, their samples in order and disjoint "
          "within the batch");
    }
    end = sample_offsets[f] + dims[1];
    blocks.push_back(Block{(*out)->typed_data(), sample_offsets[f], dims[1], dims[2]});
  }
  if (sparsecores < 1 || slots % sparsecores || pointers % sparsecores || pointers / sparsecores < partitions ||
      samples.element_count() != slots || gains.element_count() != slots || readable > slots / sparsecores) {
    return ffi::Error::InvalidArgument("embedding_bag_segments: operand shapes disagree");
  }
  Run(pool, table.typed_data(), std::move(blocks), table_dims[0], dim, sparsecores, batch,
      Segments{row_pointers.typed_data(), ids.typed_data(), samples.typed_data(), gains.typed_data(), partitions,
               pointers / sparsecores, slots / sparsecores, readable, rows_per_shard});
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseCoreEmbeddingBag, EmbeddingBag,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SparseCoreEmbeddingBagSegments, EmbeddingBagSegments,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("partitions")
                                  .Attr<int64_t>("readable")
                                  .Attr<int64_t>("rows_per_shard")
                                  .Attr<int64_t>("batch")
                                  .Attr<ffi::Span<const int64_t>>("sample_offsets")
                                  .RemainingRets());
