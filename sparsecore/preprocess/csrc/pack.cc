// Compiled host preprocessing of one stack for the host's local devices (see
// sparsecore/preprocess/native.py): the validated ragged ids of the stack's features in, every
// local device's packed buffers and counts out, SparseCore by SparseCore (`sparsecore_pack`);
// then each device's unique-row side-car from the written buffers, partition by partition
// (`sparsecore_side_car`); each on a few threads. One call per stack, not per device: with
// many devices and small stacks, a call's fixed cost (arguments, thread starts) outweighed
// its work. Same results, bit for bit, as the NumPy path
// (ragged.expand_feature, partition.merge_pairs, pack.pack_chunk, unique_rows), whose module
// docstrings state the rules; briefly:
//   an id e of a feature goes to bucket (SparseCore of its output row, partition
//   (e + col_shift) mod N) as row (e >> log2 N) + row_offset_in_shard;
//   a bucket's ids, stably sorted by row (input order is ascending samples), merge into
//   (row, sample) pairs, gains summed in input order in float32; with dropping allowed, pairs
//   past the limits (pair rank >= max_ids, column rank >= max_unique) are dropped;
//   a SparseCore's segment holds its partitions in order, each from the previous one's end
//   rounded up to 8 (unclamped, then clamped to the segment); row pointer t = the clamped end
//   of partition t, slots N..R-1 the end of the last partition rounded up to 8 -- so partition
//   t occupies [round8(row_pointers[t - 1]), row_pointers[t]), as the side-car reads it --
//   and every other slot is a pad;
//   the side-car lists the distinct rows of each partition over the device's SparseCores.
// A SparseCore's ids are sorted by a counting sort over (partition, lowest row digits) and, per
// bucket, least-significant-digit radix passes over the other row digits (stable), in arrays
// that fit the caches; workspaces are pooled, so warm calls allocate nothing.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

namespace {

struct FeatureInput {
  const void* values;       // int32 or int64 ids; one outside [0, vocabulary_size) is an error
  int64_t values_are_int64;
  const int64_t* offsets;   // [num_samples + 1]
  const float* gains;       // per id; null: every gain is 1
  int64_t num_samples;
  int64_t samples_per_sparsecore;  // output rows per SparseCore
  int64_t sample_offset;           // first sample of this feature in a SparseCore's batch
  int64_t col_shift;
  int64_t row_offset_in_shard;
  int64_t max_sequence_length;     // 0: pooled
  int64_t vocabulary_size;
};

struct StackParams {
  int64_t num_sparsecores;         // N, a power of two
  int64_t sparsecores_per_device;  // S; local SparseCore g is SparseCore g % S of local device g / S
  int64_t row_bits;                // bits of a row in a shard
  int64_t row_pointers_per_sparsecore;  // R >= N
  int64_t segment;                 // COO slots per SparseCore
  int64_t unique_width;            // U: side-car slots per partition
  int64_t max_ids;
  int64_t max_unique;
  int64_t allow_dropping;
  int64_t num_tables;
  const int64_t* table_row_starts;  // [num_tables + 1]: each table's first row in a shard, then 2^row_bits
  int64_t pad_id;                   // embedding and sample id of pad slots (gain NaN)
  int64_t sample_bits;              // bits of a sample id in a SparseCore's batch
};

// The host's buffers, D local devices of S SparseCores (G = D * S local SparseCores): a device's
// rows of each array follow the previous device's, so local SparseCore g's part of each is at g
// times its part's size, and device d's side-car at d times the side-car's size.
struct HostBuffers {
  int32_t* row_pointers;        // [G * R]
  int32_t* embedding_ids;       // [G * segment], uninitialised (every slot is written)
  int32_t* sample_ids;
  float* gains;
  int32_t* unique_ids;          // [D * N * U]
  int32_t* unique_counts;       // [D * N]
  int32_t* entry_unique_index;  // [G * segment]
};

// What the local SparseCores count, SparseCore by SparseCore.
struct HostCounts {
  int32_t* ids_per_bucket;      // [G, N] pairs before dropping
  int32_t* unique_per_bucket;   // [G, N] columns before dropping
  int32_t* kept_per_bucket;     // [G, N] pairs within the limits
  int32_t* table_ids_max;       // [G, num_tables]
  int32_t* table_unique_max;    // [G, num_tables]
  int64_t* dropped_ids;         // [G]
  int32_t* statuses;            // [G]
};

// One SparseCore's rows of a HostCounts.
struct SparseCoreCounts {
  int32_t* ids_per_bucket;
  int32_t* unique_per_bucket;
  int32_t* kept_per_bucket;
  int32_t* table_ids_max;
  int32_t* table_unique_max;
};

enum Status : int32_t {
  kOk = 0,
  kLimitExceeded = 1,
  kBufferOverflow = 2,
  kSideCarOverflow = 3,
  kOutOfMemory = 4,
  kIdOutOfRange = 5,
};

// A sorted id as one integer, row above sample: one comparison tells a new pair, and the row's
// digits are the high bits. 32 bits when row and sample fit in 31 (half the memory traffic of
// the sort), else 64 (rows and samples are below 2^31).
template <class Key>
struct KeyFormat {
  int64_t sample_bits;

  Key Make(uint32_t row, int32_t sample) const { return static_cast<Key>(row) << sample_bits | static_cast<uint32_t>(sample); }
  uint32_t Row(Key key) const { return static_cast<uint32_t>(key >> sample_bits); }
  int32_t Sample(Key key) const { return static_cast<int32_t>(key & ((Key{1} << sample_bits) - 1)); }
};

// Merged pairs, column by column: in the SparseCore's segment when they surely fit, else in
// the workspace. `counts` (ids merged into each pair) always live in the workspace.
struct Pairs {
  int32_t* rows;
  int32_t* samples;
  float* gains;
  int32_t* counts;
};

// Calls f(sample, id_index, id) for every id of `feature` whose output row lies on local
// SparseCore `sparsecore` of the host, in input order.
template <class Values, class F>
void ForEachId(const FeatureInput& feature, const StackParams& p, int64_t sparsecore, F&& f) {
  const Values* values = static_cast<const Values*>(feature.values);
  const int64_t q = feature.samples_per_sparsecore;
  const int64_t first_row = sparsecore * q;
  const int64_t end_row = first_row + q;
  const int32_t sample_base = static_cast<int32_t>(feature.sample_offset - first_row);
  if (feature.max_sequence_length == 0) {
    const int64_t end = std::min(end_row, feature.num_samples);
    for (int64_t b = first_row; b < end; ++b) {
      const int32_t sample = static_cast<int32_t>(b) + sample_base;
      for (int64_t i = feature.offsets[b]; i < feature.offsets[b + 1]; ++i) f(sample, i, values[i]);
    }
    return;
  }
  const int64_t m = feature.max_sequence_length;
  const int64_t end = std::min(feature.num_samples, (end_row + m - 1) / m);
  for (int64_t b = first_row / m; b < end; ++b) {
    for (int64_t i = feature.offsets[b]; i < feature.offsets[b + 1]; ++i) {
      const int64_t row = b * m + (i - feature.offsets[b]);
      if (row >= first_row && row < end_row) f(static_cast<int32_t>(row) + sample_base, i, values[i]);
    }
  }
}

// At least the number of ids that `ForEachIdOf` visits (exactly that for a pooled feature).
int64_t IdsBound(const FeatureInput& feature, const StackParams& p, int64_t sparsecore) {
  const int64_t q = feature.samples_per_sparsecore;
  const int64_t first_row = sparsecore * q;
  const int64_t m = std::max<int64_t>(feature.max_sequence_length, 1);
  const int64_t first = std::min(first_row / m, feature.num_samples);
  const int64_t end = std::min((first_row + q + m - 1) / m, feature.num_samples);
  const int64_t ids = feature.offsets[end] - feature.offsets[first];
  return feature.max_sequence_length ? std::min(ids, q) : ids;
}

template <class F>
void ForEachIdOf(const FeatureInput& feature, const StackParams& p, int64_t sparsecore, F&& f) {
  if (feature.values_are_int64) {
    ForEachId<int64_t>(feature, p, sparsecore, f);
  } else {
    ForEachId<int32_t>(feature, p, sparsecore, f);
  }
}

// Reusable per-thread storage: a call allocates nothing once its sizes have been seen.
struct Workspace {
  std::vector<uint32_t> keys32, key_scratch32;
  std::vector<uint64_t> keys64, key_scratch64;
  std::vector<float> gains, gain_scratch;
  std::vector<int32_t> pair_rows, pair_samples, pair_counts;
  std::vector<float> pair_gains;
  std::vector<int64_t> digit_starts, next;
  std::vector<int32_t> histogram, rows, merged, index;

  template <class T>
  static T* Sized(std::vector<T>& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
  }
};

template <class Key>
std::vector<Key>& KeyStorage(Workspace& w, bool scratch);
template <>
std::vector<uint32_t>& KeyStorage<uint32_t>(Workspace& w, bool scratch) { return scratch ? w.key_scratch32 : w.keys32; }
template <>
std::vector<uint64_t>& KeyStorage<uint64_t>(Workspace& w, bool scratch) { return scratch ? w.key_scratch64 : w.keys64; }

// Workspaces outlive calls (so warm calls allocate nothing), one per concurrent worker.
class WorkspacePool {
 public:
  std::unique_ptr<Workspace> Take() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (free_.empty()) return std::make_unique<Workspace>();
    std::unique_ptr<Workspace> w = std::move(free_.back());
    free_.pop_back();
    return w;
  }
  void Give(std::unique_ptr<Workspace> w) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(std::move(w));
  }

 private:
  std::mutex mutex_;
  std::vector<std::unique_ptr<Workspace>> free_;
};

WorkspacePool& Workspaces() {
  static WorkspacePool* pool = new WorkspacePool;  // never destroyed: workers may outlive exit
  return *pool;
}

// Runs f(i, workspace) for i in [0, count) on up to `threads` threads, the caller's included
// (fewer if the system has no more); returns false if a worker ran out of memory (the results
// are then incomplete).
template <class F>
bool ParallelFor(int64_t count, int64_t threads, F&& f) {
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  const auto work = [&] {
    try {
      std::unique_ptr<Workspace> w = Workspaces().Take();
      for (int64_t i; (i = next.fetch_add(1)) < count;) f(i, *w);
      Workspaces().Give(std::move(w));
    } catch (const std::bad_alloc&) {
      failed = true;
      next = count;
    }
  };
  std::vector<std::thread> helpers;
  try {
    for (int64_t h = 1; h < std::min(threads, count); ++h) helpers.emplace_back(work);
  } catch (const std::system_error&) {
    // No more threads to be had: the ones started and the caller do the work.
  }
  work();
  for (std::thread& helper : helpers) helper.join();
  return !failed;
}

// The row digits of the sort: the lowest `first_bits` are sorted together with the partition,
// the rest per partition in passes of at most 11 bits (a histogram that stays in L1).
struct RowDigits {
  int64_t first_bits;
  int64_t passes;
  int64_t bits;  // per later pass
};

// The first digit takes up to 10 bits, with (partition, digit) below 2^16 counters: measured on
// the benchmark's stacks (16 and 19 row bits, 4 partitions), it leaves one later pass of at most
// 9 bits, 1.2x faster for 19 bits than 8 + 11, no slower for 16. Nor more counters than about
// twice the SparseCore's `ids`: every counter is cleared, summed and copied once, which for a
// SparseCore of a few thousand ids (many devices, one table per stack) cost several times its
// sort.
RowDigits Digits(int64_t row_bits, int64_t partitions, int64_t ids) {
  const int64_t partition_bits = 64 - __builtin_clzll(static_cast<uint64_t>(std::max<int64_t>(partitions - 1, 1)));
  const int64_t id_bits = 64 - __builtin_clzll(static_cast<uint64_t>(std::max<int64_t>(ids, 1)));
  const int64_t key_bits = std::min<int64_t>(16, id_bits + 1);
  const int64_t first = std::clamp<int64_t>(key_bits - partition_bits, 0, std::min<int64_t>(10, row_bits));
  const int64_t rest = row_bits - first;
  const int64_t passes = (rest + 10) / 11;
  return RowDigits{first, passes, passes ? (rest + passes - 1) / passes : 0};
}

// One bucket's ids: keys and, when some feature has gains, their gains.
template <class Key>
struct Ids {
  Key* keys;
  float* gains;  // null: every gain is 1
};

// Below this many ids a bucket is insertion-sorted: its cost grows as n^2 / 4 (the first digit
// sorted the low row bits, so the high ones come in random order), a radix pass's as n plus its
// histogram; with a few dozen ids per partition (many SparseCores) the radix passes measured
// 1.2x faster at 24-64 ids.
constexpr int64_t kInsertionSortBelow = 24;

// Completes the stable sort by row of a bucket's `n` ids, sorted by the first digit: insertion
// sort when short, else LSD radix passes over the other digits (alternating between `ids` and
// `scratch`). Returns where the sorted ids are.
template <class Key>
Ids<Key> SortByRow(Ids<Key> ids, int64_t n, Ids<Key> scratch, KeyFormat<Key> format, const RowDigits& digits,
                   std::vector<int32_t>& histogram) {
  if (digits.passes == 0) return ids;
  if (n < kInsertionSortBelow) {
    for (int64_t i = 1; i < n; ++i) {
      const Key key = ids.keys[i];
      const float gain = ids.gains ? ids.gains[i] : 1.0f;
      int64_t j = i;
      for (; j > 0 && format.Row(ids.keys[j - 1]) > format.Row(key); --j) {
        ids.keys[j] = ids.keys[j - 1];
        if (ids.gains) ids.gains[j] = ids.gains[j - 1];
      }
      ids.keys[j] = key;
      if (ids.gains) ids.gains[j] = gain;
    }
    return ids;
  }
  const Key mask = (Key{1} << digits.bits) - 1;
  const int64_t radix = int64_t{1} << digits.bits;
  // Four interleaved histograms: hot rows repeat, and one counter bumped by consecutive ids
  // would chain every increment on the last.
  histogram.resize(4 * radix);
  int32_t* h = histogram.data();
  Ids<Key> from = ids, to = scratch;
  for (int64_t pass = 0; pass < digits.passes; ++pass) {
    const int64_t shift = format.sample_bits + digits.first_bits + pass * digits.bits;
    std::fill(h, h + 4 * radix, 0);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
      ++h[(from.keys[i] >> shift) & mask];
      ++h[radix + ((from.keys[i + 1] >> shift) & mask)];
      ++h[2 * radix + ((from.keys[i + 2] >> shift) & mask)];
      ++h[3 * radix + ((from.keys[i + 3] >> shift) & mask)];
    }
    for (; i < n; ++i) ++h[(from.keys[i] >> shift) & mask];
    int32_t sum = 0;
    for (int64_t d = 0; d < radix; ++d) {
      const int32_t c = h[d] + h[radix + d] + h[2 * radix + d] + h[3 * radix + d];
      h[d] = sum;
      sum += c;
    }
    if (from.gains) {
      for (int64_t i = 0; i < n; ++i) {
        const int32_t to_index = h[(from.keys[i] >> shift) & mask]++;
        to.keys[to_index] = from.keys[i];
        to.gains[to_index] = from.gains[i];
      }
    } else {
      for (int64_t i = 0; i < n; ++i) to.keys[h[(from.keys[i] >> shift) & mask]++] = from.keys[i];
    }
    std::swap(from, to);
  }
  return from;
}

// Merges sorted ids into (row, sample) pairs; returns the number of pairs. The boundaries are
// found branch-free (duplicates come at random: a branch per id would often mispredict); a
// pair's gain is its count, or its ids' gains summed in order in float32. `pairs.counts` holds
// n + 1 values.
template <class Key>
int64_t MergePairs(Ids<Key> ids, int64_t n, KeyFormat<Key> format, Pairs pairs) {
  int64_t j = -1, first = 0;
  Key previous = ~Key{0};  // no id's key: a key's top bit is always clear
  for (int64_t i = 0; i < n; ++i) {
    const Key key = ids.keys[i];
    const bool new_pair = key != previous;
    j += new_pair;
    first = new_pair ? i : first;
    previous = key;
    pairs.rows[j] = static_cast<int32_t>(format.Row(key));
    pairs.samples[j] = format.Sample(key);
    pairs.counts[j] = static_cast<int32_t>(first);  // the pair's first id, for now
  }
  const int64_t num_pairs = j + 1;
  pairs.counts[num_pairs] = static_cast<int32_t>(n);
  for (int64_t k = 0; k < num_pairs; ++k) {
    const int32_t start = pairs.counts[k], end = pairs.counts[k + 1];
    pairs.counts[k] = end - start;
    if (ids.gains == nullptr) {
      pairs.gains[k] = static_cast<float>(end - start);
    } else {
      float gain = 0.0f;
      for (int32_t i = start; i < end; ++i) gain += ids.gains[i];
      pairs.gains[k] = gain;
    }
  }
  return num_pairs;
}

int32_t Round8(int64_t x) { return static_cast<int32_t>((x + 7) & ~int64_t{7}); }

// Packs local SparseCore `sparsecore` of the host; returns its status.
template <class Key>
Status PackSparseCore(const StackParams& p, const FeatureInput* features, int64_t num_features, int64_t sparsecore,
                      HostBuffers* buffers, HostCounts* host_counts, Workspace& w) {
  const KeyFormat<Key> format{p.sample_bits};
  const int64_t n = p.num_sparsecores;
  const int64_t partition_bits = __builtin_ctzll(static_cast<uint64_t>(n));
  int64_t ids_bound = 0;
  for (int64_t f = 0; f < num_features; ++f) ids_bound += IdsBound(features[f], p, sparsecore);
  const RowDigits digits = Digits(p.row_bits, n, ids_bound);
  const uint32_t first_mask = (1u << digits.first_bits) - 1;
  const SparseCoreCounts counts{host_counts->ids_per_bucket + sparsecore * n,
                                host_counts->unique_per_bucket + sparsecore * n,
                                host_counts->kept_per_bucket + sparsecore * n,
                                host_counts->table_ids_max + sparsecore * p.num_tables,
                                host_counts->table_unique_max + sparsecore * p.num_tables};

  // Counting sort of the SparseCore's ids by (partition, first row digit), in input order.
  const int64_t digit_keys = n << digits.first_bits;
  int64_t* digit_starts = Workspace::Sized(w.digit_starts, digit_keys + 1);
  std::fill(digit_starts, digit_starts + digit_keys + 1, 0);
  bool with_gains = false, outside_vocabulary = false;
  for (int64_t f = 0; f < num_features; ++f) {
    const FeatureInput& feature = features[f];
    const uint64_t vocabulary = static_cast<uint64_t>(feature.vocabulary_size);
    with_gains |= feature.gains != nullptr;
    ForEachIdOf(feature, p, sparsecore, [&](int32_t, int64_t, int64_t e) {
      outside_vocabulary |= static_cast<uint64_t>(e) >= vocabulary;  // negative ids too
      const uint32_t row = static_cast<uint32_t>((e >> partition_bits) + feature.row_offset_in_shard);
      ++digit_starts[((((e + feature.col_shift) & (n - 1))) << digits.first_bits | (row & first_mask)) + 1];
    });
  }
  if (outside_vocabulary) return kIdOutOfRange;
  for (int64_t k = 0; k < digit_keys; ++k) digit_starts[k + 1] += digit_starts[k];
  const int64_t total = digit_starts[digit_keys];
  const Ids<Key> ids{Workspace::Sized(KeyStorage<Key>(w, false), total),
                     with_gains ? Workspace::Sized(w.gains, total) : nullptr};
  int64_t* next = Workspace::Sized(w.next, digit_keys);
  std::copy(digit_starts, digit_starts + digit_keys, next);
  for (int64_t f = 0; f < num_features; ++f) {
    const FeatureInput& feature = features[f];
    ForEachIdOf(feature, p, sparsecore, [&](int32_t sample, int64_t i, int64_t e) {
      const uint32_t row = static_cast<uint32_t>((e >> partition_bits) + feature.row_offset_in_shard);
      const int64_t slot = next[(((e + feature.col_shift) & (n - 1)) << digits.first_bits) | (row & first_mask)]++;
      ids.keys[slot] = format.Make(row, sample);
      if (with_gains) ids.gains[slot] = feature.gains ? feature.gains[i] : 1.0f;
    });
  }

  const auto bucket_start = [&](int64_t t) { return digit_starts[t << digits.first_bits]; };
  int64_t largest = 0;
  for (int64_t t = 0; t < n; ++t) largest = std::max(largest, bucket_start(t + 1) - bucket_start(t));
  const Ids<Key> scratch{Workspace::Sized(KeyStorage<Key>(w, true), largest),
                         with_gains ? Workspace::Sized(w.gain_scratch, largest) : nullptr};
  const Pairs spill{Workspace::Sized(w.pair_rows, largest), Workspace::Sized(w.pair_samples, largest),
                    Workspace::Sized(w.pair_gains, largest), Workspace::Sized(w.pair_counts, largest + 1)};
  std::fill(counts.table_ids_max, counts.table_ids_max + p.num_tables, 0);
  std::fill(counts.table_unique_max, counts.table_unique_max + p.num_tables, 0);
  bool over_limit = false, overflow = false;
  int64_t dropped = 0;
  int32_t* row_pointers = buffers->row_pointers + sparsecore * p.row_pointers_per_sparsecore;
  const int64_t segment_base = sparsecore * p.segment;
  int64_t next_start = 0;  // unclamped start of the next partition
  for (int64_t t = 0; t < n; ++t) {
    const int64_t size = bucket_start(t + 1) - bucket_start(t);
    const int64_t start = std::min(next_start, p.segment);
    const int64_t base = segment_base + start;
    // At most `size` pairs: when they fit, they are merged where they belong.
    const bool in_place = start + size <= p.segment;
    const Pairs pairs = in_place ? Pairs{buffers->embedding_ids + base, buffers->sample_ids + base,
                                         buffers->gains + base, spill.counts}
                                 : spill;
    const Ids<Key> bucket{ids.keys + bucket_start(t), with_gains ? ids.gains + bucket_start(t) : nullptr};
    const Ids<Key> sorted = SortByRow(bucket, size, scratch, format, digits, w.histogram);
    const int64_t num_pairs = MergePairs(sorted, size, format, pairs);

    // Pairs and columns before dropping, per table of the stack (a table's rows are one range
    // of the shard, so its pairs are one range of the bucket's).
    int64_t columns = 0;
    for (int64_t k = 0, lo = 0; k < p.num_tables; ++k) {
      const int64_t hi = k + 1 == p.num_tables
          ? num_pairs
          : std::lower_bound(pairs.rows + lo, pairs.rows + num_pairs, p.table_row_starts[k + 1]) - pairs.rows;
      int32_t table_columns = 0;
      for (int64_t i = lo; i < hi; ++i) table_columns += i == lo || pairs.rows[i] != pairs.rows[i - 1];
      counts.table_ids_max[k] = std::max<int32_t>(counts.table_ids_max[k], static_cast<int32_t>(hi - lo));
      counts.table_unique_max[k] = std::max(counts.table_unique_max[k], table_columns);
      columns += table_columns;
      lo = hi;
    }
    counts.ids_per_bucket[t] = static_cast<int32_t>(num_pairs);
    counts.unique_per_bucket[t] = static_cast<int32_t>(columns);
    const bool bucket_over_limit = num_pairs > p.max_ids || columns > p.max_unique;
    over_limit |= bucket_over_limit;

    // Dropping: pairs past max_ids, or whose column ranks max_unique or later.
    int64_t kept = num_pairs;
    if (bucket_over_limit && p.allow_dropping) {
      kept = 0;
      int64_t column = 0;
      for (int64_t i = 0; i < num_pairs; ++i) {
        column += i > 0 && pairs.rows[i] != pairs.rows[i - 1];
        const bool keep = i < p.max_ids && column < p.max_unique;
        const int32_t row = pairs.rows[i], count = pairs.counts[i];
        pairs.rows[kept] = row;
        pairs.samples[kept] = pairs.samples[i];
        pairs.gains[kept] = pairs.gains[i];
        pairs.counts[kept] = count;
        kept += keep;
        dropped += keep ? 0 : count;
      }
    }
    counts.kept_per_bucket[t] = static_cast<int32_t>(kept);

    // Placement in the segment; a full segment truncates (dropping) or is an error.
    const int64_t end = std::min(next_start + kept, p.segment);
    overflow |= next_start + kept > p.segment;
    next_start += Round8(kept);
    row_pointers[t] = static_cast<int32_t>(end);
    if (!in_place && !((over_limit || overflow) && !p.allow_dropping)) {
      std::copy(pairs.rows, pairs.rows + (end - start), buffers->embedding_ids + base);
      std::copy(pairs.samples, pairs.samples + (end - start), buffers->sample_ids + base);
      std::copy(pairs.gains, pairs.gains + (end - start), buffers->gains + base);
    }
    for (int64_t k = end - start; k < kept; ++k) dropped += pairs.counts[k];
  }
  std::fill(row_pointers + n, row_pointers + p.row_pointers_per_sparsecore, Round8(row_pointers[n - 1]));
  // Every slot that holds no entry is a pad (the buffers come uninitialised).
  for (int64_t t = 0; t < n; ++t) {
    const int64_t lo = segment_base + row_pointers[t];
    const int64_t hi = segment_base + (t + 1 < n ? Round8(row_pointers[t]) : p.segment);
    std::fill(buffers->embedding_ids + lo, buffers->embedding_ids + hi, static_cast<int32_t>(p.pad_id));
    std::fill(buffers->sample_ids + lo, buffers->sample_ids + hi, static_cast<int32_t>(p.pad_id));
    std::fill(buffers->gains + lo, buffers->gains + hi, std::numeric_limits<float>::quiet_NaN());
  }
  host_counts->dropped_ids[sparsecore] = dropped;
  if (over_limit && !p.allow_dropping) return kLimitExceeded;
  if (overflow && !p.allow_dropping) return kBufferOverflow;
  return kOk;
}

// The side-car of partition t of local device d, from its written buffers: the distinct rows of
// every SparseCore of the device (ascending in its slots), merged, and each slot's index among
// them (the device's flat side-car index); pads elsewhere (the side-car comes uninitialised).
Status SideCar(const StackParams& p, int64_t d, int64_t t, HostBuffers* buffers, Workspace& w) {
  const int64_t s_count = p.sparsecores_per_device, first = d * s_count;
  int64_t distinct = 0;
  int32_t* merged = Workspace::Sized(w.merged, 0);
  for (int64_t s = first; s < first + s_count; ++s) {
    const int32_t* row_pointers = buffers->row_pointers + s * p.row_pointers_per_sparsecore;
    const int32_t* ids = buffers->embedding_ids + s * p.segment;
    const int64_t lo = t == 0 ? 0 : Round8(row_pointers[t - 1]), hi = row_pointers[t];
    int32_t* rows = Workspace::Sized(w.rows, hi - lo);
    int64_t count = 0;
    for (int64_t k = lo; k < hi; ++k) {
      rows[count] = ids[k];
      count += count == 0 || rows[count - 1] != ids[k];
    }
    int32_t* out = Workspace::Sized(w.index, distinct + count);
    const int64_t total = std::set_union(merged, merged + distinct, rows, rows + count, out) - out;
    std::swap(w.merged, w.index);
    merged = w.merged.data();
    distinct = total;
  }
  if (distinct > p.unique_width) return kSideCarOverflow;
  const int64_t flat = t * p.unique_width;
  int32_t* unique_ids = buffers->unique_ids + d * p.num_sparsecores * p.unique_width + flat;
  std::copy(merged, merged + distinct, unique_ids);
  std::fill(unique_ids + distinct, unique_ids + p.unique_width, static_cast<int32_t>(p.pad_id));
  buffers->unique_counts[d * p.num_sparsecores + t] = static_cast<int32_t>(distinct);
  for (int64_t s = first; s < first + s_count; ++s) {
    const int32_t* row_pointers = buffers->row_pointers + s * p.row_pointers_per_sparsecore;
    const int32_t* ids = buffers->embedding_ids + s * p.segment;
    int32_t* index = buffers->entry_unique_index + s * p.segment;
    int64_t k = 0;
    for (int64_t slot = t == 0 ? 0 : Round8(row_pointers[t - 1]); slot < row_pointers[t]; ++slot) {
      while (merged[k] != ids[slot]) ++k;
      index[slot] = static_cast<int32_t>(flat + k);
    }
    const int64_t pads_end = t + 1 < p.num_sparsecores ? Round8(row_pointers[t]) : p.segment;
    std::fill(index + row_pointers[t], index + pads_end, static_cast<int32_t>(p.pad_id));
  }
  return kOk;
}

// Packs local SparseCore `sparsecore` (`PackSparseCore`), with everything it calls inlined into
// an instance per instruction set: on x86-64 also for x86-64-v3 (AVX2, BMI2) and v4 (AVX-512),
// chosen at load time; the shifts by a run-time count of the digit sorts and the wider
// loops measured ~1.1x faster than the baseline instruction set.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"), flatten))
#endif
Status PackOne(const StackParams& p, const FeatureInput* features, int64_t num_features, int64_t sparsecore,
               HostBuffers* buffers, HostCounts* counts, Workspace& w) {
  const bool narrow = p.row_bits + p.sample_bits <= 31;  // top bit clear: see MergePairs
  return narrow ? PackSparseCore<uint32_t>(p, features, num_features, sparsecore, buffers, counts, w)
                : PackSparseCore<uint64_t>(p, features, num_features, sparsecore, buffers, counts, w);
}

}  // namespace

// Packs the SparseCores of `num_devices` local devices on up to `threads` threads; each
// SparseCore's status goes to counts->statuses. Returns kOutOfMemory if memory ran out, else kOk.
extern "C" int32_t sparsecore_pack(const StackParams* params, const FeatureInput* features, int64_t num_features,
                                   HostBuffers* buffers, HostCounts* counts, int64_t num_devices,
                                   int64_t threads) {
  const int64_t sparsecores = num_devices * params->sparsecores_per_device;
  const bool done = ParallelFor(sparsecores, threads, [&](int64_t s, Workspace& w) {
    counts->statuses[s] = PackOne(*params, features, num_features, s, buffers, counts, w);
  });
  return done ? kOk : kOutOfMemory;
}

// Builds the side-cars of `num_devices` local devices from their written buffers, partition by
// partition, on up to `threads` threads.
extern "C" int32_t sparsecore_side_car(const StackParams* params, HostBuffers* buffers, int64_t num_devices,
                                       int64_t threads) {
  std::atomic<int32_t> status{kOk};
  const int64_t n = params->num_sparsecores;
  const bool done = ParallelFor(num_devices * n, threads, [&](int64_t k, Workspace& w) {
    if (SideCar(*params, k / n, k % n, buffers, w) != kOk) status = kSideCarOverflow;
  });
  return done ? status.load() : kOutOfMemory;
}
