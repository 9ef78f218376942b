// The owner's arithmetic of the stand-in lookup as an XLA:CPU custom call (see
// sparsecore/kernels/cpu.py): partials[w, sample] += gain * table[row] over the first used[w]
// entries of every window w; entries with a row outside [0, V) or a sample outside [0, B) add
// nothing, samples no entry names are zero.
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
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Entries ahead of the current one whose table row is prefetched: the reads are random rows of a
// table far larger than the caches, the one cost of this kernel that the arithmetic cannot hide.
constexpr int64_t kPrefetchDistance = 16;
constexpr int64_t kCacheLine = 64;

struct Bag {
  const float* table;
  const int32_t* rows;
  const int32_t* samples;
  const float* gains;
  const int32_t* used;
  float* out;
  int64_t vocabulary, dim, entries, batch, ranges;
};

// One entry that counts, in sample order: the table row and its gain.
struct Term {
  int32_t row;
  float gain;
};

// Task `task` = (window, sample range): the range's output rows. The task's entries that count
// are first put in sample order, each with its row and gain (a counting sort: stable, so each
// sample's entries keep their buffer order); each sample's row is then summed in a small
// accumulator and written once. Summing in place entry by entry instead costs a read and a
// write of an output row per entry (the window's rows do not fit in L1), ~30% slower.
// Compiled for AVX-512 and AVX2 too (chosen at load time): the sums are then 16 or 8 lanes wide.
__attribute__((target_clones("avx512f", "avx2", "default")))
void RunTask(const Bag& bag, int64_t task) {
  const int64_t window = task / bag.ranges, range = task % bag.ranges;
  const int64_t per_range = (bag.batch + bag.ranges - 1) / bag.ranges;
  const int64_t first = std::min(range * per_range, bag.batch);
  const int64_t last = std::min(first + per_range, bag.batch);
  const int64_t count = std::clamp<int64_t>(bag.used[window], 0, bag.entries);
  const int32_t* rows = bag.rows + window * bag.entries;
  const int32_t* samples = bag.samples + window * bag.entries;
  const float* gains = bag.gains + window * bag.entries;
  auto counts = [&](int64_t p) {
    return samples[p] >= first && samples[p] < last && rows[p] >= 0 && rows[p] < bag.vocabulary;
  };
  thread_local std::vector<int32_t> starts, next;
  thread_local std::vector<Term> terms;
  thread_local std::vector<float> sum;
  starts.assign(last - first + 1, 0);
  for (int64_t p = 0; p < count; ++p) {
    if (counts(p)) ++starts[samples[p] - first + 1];
  }
  for (int64_t s = 1; s <= last - first; ++s) starts[s] += starts[s - 1];
  next.assign(starts.begin(), starts.end() - 1);
  terms.resize(starts[last - first]);
  for (int64_t p = 0; p < count; ++p) {
    if (counts(p)) terms[next[samples[p] - first]++] = Term{rows[p], gains[p]};
  }
  const int64_t total = terms.size(), dim = bag.dim;
  sum.resize(dim);
  float* __restrict acc = sum.data();
  for (int64_t s = first; s < last; ++s) {
    std::fill(acc, acc + dim, 0.0f);
    for (int64_t k = starts[s - first]; k < starts[s - first + 1]; ++k) {
      if (k + kPrefetchDistance < total) {
        const char* line = reinterpret_cast<const char*>(bag.table + int64_t{terms[k + kPrefetchDistance].row} * dim);
        for (int64_t byte = 0; byte < dim * int64_t{sizeof(float)}; byte += kCacheLine) __builtin_prefetch(line + byte);
      }
      const float gain = terms[k].gain;
      const float* __restrict source = bag.table + int64_t{terms[k].row} * dim;
      for (int64_t d = 0; d < dim; ++d) acc[d] += gain * source[d];
    }
    std::memcpy(bag.out + (window * bag.batch + s) * dim, acc, sizeof(float) * dim);
  }
}

struct Tasks {
  Bag bag;
  int64_t total;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mutex;
  std::condition_variable finished;

  // Claim and run tasks until none is left.
  void Work() {
    for (int64_t task; (task = next.fetch_add(1)) < total;) {
      RunTask(bag, task);
      if (done.fetch_add(1) + 1 == total) {
        std::lock_guard<std::mutex> lock(mutex);
        finished.notify_all();
      }
    }
  }
};

ffi::Error EmbeddingBag(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> rows,
                        ffi::Buffer<ffi::S32> samples, ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::S32> used,
                        ffi::ResultBuffer<ffi::F32> out) {
  const auto table_dims = table.dimensions(), entry_dims = rows.dimensions(), out_dims = out->dimensions();
  if (table_dims.size() != 2 || entry_dims.size() != 2 || out_dims.size() != 3) {
    return ffi::Error::InvalidArgument("embedding_bag: table [V, D], entries [W, P], output [W, B, D] expected");
  }
  const int64_t windows = entry_dims[0], dim = table_dims[1];
  const int64_t entries = windows * entry_dims[1];
  if (samples.element_count() != entries || gains.element_count() != entries || used.element_count() != windows ||
      out_dims[0] != windows || out_dims[2] != dim) {
    return ffi::Error::InvalidArgument("embedding_bag: operand shapes disagree");
  }
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  auto tasks = std::make_shared<Tasks>();
  tasks->bag = Bag{table.typed_data(), rows.typed_data(), samples.typed_data(), gains.typed_data(),
                   used.typed_data(), out->typed_data(), table_dims[0], dim, entry_dims[1], out_dims[1],
                   std::clamp<int64_t>((threads + windows - 1) / std::max<int64_t>(windows, 1), 1,
                                       std::max<int64_t>(out_dims[1], 1))};
  tasks->total = windows * tasks->bag.ranges;
  for (int64_t helper = 1; helper < std::min(threads, tasks->total); ++helper) {
    pool.Schedule([tasks] { tasks->Work(); });
  }
  tasks->Work();
  std::unique_lock<std::mutex> lock(tasks->mutex);
  tasks->finished.wait(lock, [&] { return tasks->done.load() == tasks->total; });
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
