// Float32 attention of query rows over a KV cache on the CPU: decode steps and speculative verifies (`Work`), and
// prefills (`LongWork`).
//
// out[n, r] = softmax over the visible slots of (q[n, r] . k[n, s]) * scale, times v[n, s], where the slots are those
// of one or two segments (the cache, and a deferred forward's new keys and values), one softmax over both. Row r of
// cache row n is query group r / T at position t = r % T of batch row b = n / heads_per_row; slot s of segment j is
// visible where vis_j[b, t, s]. q and the result are grouped [N, Q, D] or in the model's [B, T, H, D] layout
// (`RowLayout`). `Work`'s units are (n, a block of kBlock slots of one segment), claimed by the threads of XLA's
// intra-op pool; each keeps every row's max, sum and weighted values, and the calling thread merges the units in a
// fixed order. Each row is computed alone, in an order that depends only on the slots (16 rows of a verify share
// each vector in `lane_group`, which sums as the one-row `row_units` does), so a row's result does not depend on the
// rows beside it: a verified token attends as its AR step does, bit for bit. Only the 16-slot groups some row sees
// are computed. A row that sees no slot gets zeros.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kVec = 16;
constexpr int64_t kBlock = 256;  // slots per work unit
constexpr int64_t kMaxDim = 256;
constexpr int64_t kMaxQ = 64;  // query rows per cache row
constexpr int64_t kRowGroup = 6;  // rows whose weighted values accumulate together
constexpr int64_t kLaneRows = 10;  // rows from which 16 rows share each vector (`lane_group`)

using Vec = float __attribute__((vector_size(kVec * sizeof(float))));
using IVec = int32_t __attribute__((vector_size(kVec * sizeof(int32_t))));
using CVec = uint8_t __attribute__((vector_size(kVec)));  // kVec visibility flags (bool is one byte)

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(Vec));
  return v;
}
inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof(Vec)); }

inline float lane_sum(Vec v) {
  float a[kVec];
  std::memcpy(a, &v, sizeof(Vec));
  for (int64_t w = kVec / 2; w >= 1; w /= 2)
    for (int64_t i = 0; i < w; ++i) a[i] += a[i + w];
  return a[0];
}

// Lane j of the result = the sum of a[j]'s lanes, in a fixed order: halves added pairwise, four times.
inline Vec transpose_sum(const Vec* a) {
  Vec c[8], d[4], e[2];
  for (int p = 0; p < 8; ++p)
    c[p] = __builtin_shufflevector(a[2 * p], a[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * p], a[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int p = 0; p < 4; ++p)
    d[p] = __builtin_shufflevector(c[2 * p], c[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(c[2 * p], c[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int p = 0; p < 2; ++p)
    e[p] = __builtin_shufflevector(d[2 * p], d[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(d[2 * p], d[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// exp(x) for 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial of r scaled by 2^n; 0 below -87.
inline Vec vexp(Vec x) {
  const Vec lo = x < -87.0f ? Vec{} + 1.0f : Vec{};
  x = x < -87.0f ? Vec{} - 87.0f : x;
  x = x > 88.0f ? Vec{} + 88.0f : x;
  const Vec t = x * 1.44269504088896341f;
  const IVec n = __builtin_convertvector(t + (t < 0.0f ? Vec{} - 0.5f : Vec{} + 0.5f), IVec);
  const Vec nf = __builtin_convertvector(n, Vec);
  Vec r = x - nf * 0.693359375f;
  r = r - nf * -2.12194440e-4f;
  Vec p = Vec{} + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const IVec bits = (n + 127) << 23;
  Vec scale;
  std::memcpy(&scale, &bits, sizeof(Vec));
  const Vec out = p * scale;
  return lo > 0.0f ? Vec{} : out;
}

// Where row r of cache row n sits in q and the result: grouped [N, Q, D] (heads == 0), or the model's [B, T, H, D]
// (query head (n's KV head) * G + r / T at position r % T).
struct RowLayout {
  int64_t q_rows, dim, t_len, heads_per_row, heads;
  int64_t at(int64_t n, int64_t r) const {
    if (heads == 0) return (n * q_rows + r) * dim;
    const int64_t groups = heads / heads_per_row, b = n / heads_per_row, h = (n % heads_per_row) * groups + r / t_len;
    return ((b * t_len + r % t_len) * heads + h) * dim;
  }
};

struct Segment {
  const float* k;
  const float* v;
  const bool* vis;  // [B, T, S]
  int64_t slots;
};

// The slots a visibility row of `len` flags sees: [lo, hi) from the first to the last (lo >= hi: none), and whether
// it sees every slot between them (an interval: a mask is then two comparisons).
struct Span {
  int64_t lo, hi;
  bool interval;
};

inline Span span_of(const bool* v, int64_t len) {
  int64_t a = 0, b = len, count = 0;
  uint64_t w;
  for (; a + 8 <= len; a += 8) {  // bools are bytes 0 / 1
    std::memcpy(&w, v + a, 8);
    if (w) break;
  }
  while (a < len && !v[a]) ++a;
  for (; b - 8 >= a; b -= 8) {
    std::memcpy(&w, v + b - 8, 8);
    if (w) break;
  }
  while (b > a && !v[b - 1]) --b;
  int64_t j = a;
  for (; j + 8 <= b; j += 8) {  // a word's bit count is its true bytes
    std::memcpy(&w, v + j, 8);
    count += __builtin_popcountll(w);
  }
  for (; j < b; ++j) count += v[j];
  return {a, b, count == b - a};
}

// Calls f(std::integral_constant<int, V>) for the head width dim = V * kVec (V = 1 .. kMaxDim / kVec), so that a
// unit's loops over the width have compile-time bounds and their sums stay in registers.
template <int V, class F>
void with_width(int64_t dim, F&& f) {
  if constexpr (V > 0) {
    if (dim == V * kVec) return f(std::integral_constant<int, V>{});
    with_width<V - 1>(dim, f);
  }
}

// Work units 0 .. total - 1, claimed in turn by XLA's intra-op threads and the calling thread (`run_units`).
struct Queue {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t total = 0;

  template <class F>
  void drain(F&& unit) {
    for (;;) {
      const int64_t i = next.fetch_add(1);
      if (i >= total) return;
      unit(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Runs every unit of `work` (a `Queue` with a `drain()`) once, on the pool's threads and this one; returns when all
// are done.
template <class W>
void run_units(ffi::ThreadPool& pool, const std::shared_ptr<W>& work) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  while (work->done.load(std::memory_order_acquire) < work->total) std::this_thread::yield();
}

struct Work : Queue {
  const float* q;  // [N, Q, D], or [B, T, H, D] when heads > 0
  Segment seg[2];
  int64_t segments, n_rows, q_rows, dim, t_len, heads_per_row;
  int64_t heads = 0;  // > 0: q and the result in the model's [B, T, H, D] layout (no grouping transposes)
  float scale;
  std::vector<std::pair<int64_t, int64_t>> units;  // (segment, first slot), for every n in turn
  int64_t units_per_n;
  std::vector<float> part;  // [N, units_per_n, Q, D + 2]: max, sum, weighted values

  float* slot(int64_t n, int64_t u, int64_t r) { return part.data() + ((n * units_per_n + u) * q_rows + r) * (dim + 2); }

  int64_t row_at(int64_t n, int64_t r) const { return RowLayout{q_rows, dim, t_len, heads_per_row, heads}.at(n, r); }

  // Scores of one query row against kVec slots (keys ks[j * dim ..], j < kVec): lane j = q . k_j.
  template <int V>
  Vec scores16(const Vec* qv, const float* ks) const {
    Vec a[kVec];
    for (int64_t j = 0; j < kVec; ++j) {
      const float* kj = ks + j * V * kVec;
      Vec x = qv[0] * load(kj);
      for (int64_t i = 1; i < V; ++i) x += qv[i] * load(kj + i * kVec);
      a[j] = x;
    }
    return transpose_sum(a);
  }

  // Scores of kVec rows (in the lanes; qt[d] holds dimension d of each) against one slot's key ks, each row's in
  // `scores16`'s order: per lane l of a dimension vector the products of dimensions l, 16 + l, ... in turn, then
  // those 16 partial sums added pairwise as `transpose_sum` adds them. Bit for bit `scores16`'s lane for the slot,
  // at a fraction of its cost per row: no shuffles, and one pass over the key for 16 rows.
  template <int V>
  Vec lane_scores(const Vec* qt, const float* ks) const {
    Vec a[kVec];
    for (int64_t l = 0; l < kVec; ++l) a[l] = qt[l] * ks[l];
    for (int64_t i = 1; i < V; ++i)
      for (int64_t l = 0; l < kVec; ++l) a[l] += qt[i * kVec + l] * ks[i * kVec + l];
    for (int64_t w = kVec / 2; w >= 1; w /= 2)
      for (int64_t l = 0; l < w; ++l) a[l] += a[l + w];
    return a[0];
  }

  // `unit` for a head width of V vectors (compile-time, so that the products' accumulators stay in registers).
  // Only the 16-slot groups holding a slot some row sees are computed: the others would add exact zeros.
  template <int V>
  void unit_of(int64_t n, int64_t u) {
    const auto [j, s0] = units[u];
    const Segment& g = seg[j];
    const int64_t len = std::min(g.slots, s0 + kBlock) - s0;
    const int64_t b = n / heads_per_row;
    Span spans[kMaxQ];  // per query position t (the rows at t share its visibility)
    int64_t lo = len, hi = 0;
    for (int64_t t = 0; t < t_len; ++t) {
      spans[t] = span_of(g.vis + (b * t_len + t) * g.slots + s0, len);
      if (spans[t].lo < spans[t].hi) {
        lo = std::min(lo, spans[t].lo);
        hi = std::max(hi, spans[t].hi);
      }
    }
    if (lo >= hi) {  // no row sees a slot of this unit: the merge skips it
      for (int64_t r = 0; r < q_rows; ++r) slot(n, u, r)[0] = -std::numeric_limits<float>::infinity();
      return;
    }
    const int64_t begin = lo / kVec * kVec, end = std::min(len, (hi + kVec - 1) / kVec * kVec);
    int64_t lane_rows = 0;
    while (q_rows - lane_rows >= kLaneRows) {
      const int64_t rows = std::min<int64_t>(kVec, q_rows - lane_rows);
      lane_group<V>(n, u, g, s0, begin, end, lane_rows, rows, spans);
      lane_rows += rows;
    }
    if (lane_rows < q_rows) row_units<V>(n, u, g, s0, begin, end, lane_rows);
  }

  // Rows r0 .. r0 + rows - 1 (at most kVec), one per lane from the scores to the weighted values: per slot a vector
  // of the rows' scores (`lane_scores`), exponentials and weights. Each lane sums as `row_units` sums a row: the
  // exponentials' sum in 16 partial sums by slot mod 16, added pairwise as `lane_sum` adds; the weighted values
  // slot after slot, one fused multiply-add each. So a row's result does not depend on the rows beside it.
  template <int V>
  void lane_group(int64_t n, int64_t u, const Segment& g, int64_t s0, int64_t begin, int64_t end, int64_t r0,
                  int64_t rows, const Span* spans) {
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    const int64_t b = n / heads_per_row;
    Vec qt[V * kVec];
    alignas(64) int32_t lo_l[kVec], hi_l[kVec];
    bool intervals = true;
    const bool* vr[kVec];
    const float* qr[kVec];
    for (int64_t l = 0; l < kVec; ++l) {
      qr[l] = l < rows ? q + row_at(n, r0 + l) : nullptr;
      lo_l[l] = hi_l[l] = 0;  // lanes past `rows` see nothing
      if (l >= rows) continue;
      const Span& sp = spans[(r0 + l) % t_len];
      vr[l] = g.vis + (b * t_len + (r0 + l) % t_len) * g.slots + s0;
      if (sp.lo < sp.hi) {
        lo_l[l] = static_cast<int32_t>(sp.lo);
        hi_l[l] = static_cast<int32_t>(sp.hi);
        intervals &= sp.interval;
      }
    }
    for (int64_t d = 0; d < V * kVec; ++d) {
      alignas(64) float col[kVec];
      for (int64_t l = 0; l < kVec; ++l) col[l] = qr[l] ? qr[l][d] : 0.0f;
      qt[d] = load(col);
    }
    IVec lo_v, hi_v;
    std::memcpy(&lo_v, lo_l, sizeof(IVec));
    std::memcpy(&hi_v, hi_l, sizeof(IVec));
    thread_local std::vector<Vec> sc;  // sc[s]: the rows' scores at slot s, then their exponentials
    sc.resize(kBlock);
    Vec mv = Vec{} + kNegInf;
    for (int64_t s = begin; s < end; ++s) {
      // the key 8 slots on and this slot's value, fetched ahead: a verify's 16 rows compute long enough per slot
      // for the loads to land (a 5-token verify over a cache not in the CPU's caches: 103-128 -> 77-96 us; the
      // one-row path, memory-bound, measured no gain from it)
      const float* k_ahead = g.k + (n * g.slots + s0 + std::min<int64_t>(s + 8, end - 1)) * V * kVec;
      const float* v_here = g.v + (n * g.slots + s0 + s) * V * kVec;
      for (int64_t i = 0; i < V; ++i) {
        __builtin_prefetch(k_ahead + i * kVec, 0, 3);
        __builtin_prefetch(v_here + i * kVec, 0, 2);
      }
      const Vec x = lane_scores<V>(qt, g.k + (n * g.slots + s0 + s) * V * kVec) * scale;
      IVec keep;
      if (intervals) {
        const IVec sv = IVec{} + static_cast<int32_t>(s);
        keep = (sv >= lo_v) & (sv < hi_v);
      } else {
        alignas(64) int32_t k[kVec];
        for (int64_t l = 0; l < kVec; ++l) k[l] = l < rows && vr[l][s] ? -1 : 0;
        std::memcpy(&keep, k, sizeof(IVec));
      }
      const Vec m = keep != 0 ? x : Vec{} + kNegInf;
      sc[s] = m;
      mv = mv > m ? mv : m;
    }
    const Vec base = mv == kNegInf ? Vec{} : mv;  // a row that sees nothing: exponentials of -inf, zeros
    Vec part_sum[kVec];
    for (int64_t i = 0; i < kVec; ++i) part_sum[i] = Vec{};
    for (int64_t s = begin; s < end; ++s) {
      const Vec e = vexp(sc[s] - base);
      sc[s] = e;
      part_sum[s % kVec] += e;
    }
    for (int64_t w = kVec / 2; w >= 1; w /= 2)
      for (int64_t i = 0; i < w; ++i) part_sum[i] += part_sum[i + w];
    alignas(64) float m_l[kVec], l_l[kVec];
    store(m_l, mv);
    store(l_l, part_sum[0]);
    for (int64_t l = 0; l < rows; ++l) {
      float* out = slot(n, u, r0 + l);
      out[0] = m_l[l];
      out[1] = l_l[l];
    }
    // weighted values, 16 dimensions at a time: acc[i] holds dimension c * 16 + i of every row
    for (int64_t c = 0; c < V; ++c) {
      Vec acc[kVec];
      for (int64_t i = 0; i < kVec; ++i) acc[i] = Vec{};
      for (int64_t s = begin; s < end; ++s) {
        const Vec p = sc[s];
        const float* vs = g.v + (n * g.slots + s0 + s) * V * kVec + c * kVec;
        for (int64_t i = 0; i < kVec; ++i) acc[i] += p * vs[i];
      }
      alignas(64) float t[kVec][kVec];
      for (int64_t i = 0; i < kVec; ++i) store(t[i], acc[i]);
      for (int64_t l = 0; l < rows; ++l) {
        float* out = slot(n, u, r0 + l) + 2 + c * kVec;
        for (int64_t i = 0; i < kVec; ++i) out[i] = t[i][l];
      }
    }
  }

  // Rows r_first .. q_rows - 1 one at a time (an AR step's few): scores kVec slots to a vector (`scores16`), then
  // per row the max, the exponentials and their sum, and the weighted values kRowGroup rows at a time.
  template <int V>
  void row_units(int64_t n, int64_t u, const Segment& g, int64_t s0, int64_t begin, int64_t end, int64_t r_first) {
    constexpr int64_t vecs = V;
    const int64_t b = n / heads_per_row, full = begin + (end - begin) / kVec * kVec;
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    thread_local std::vector<float> scratch;
    scratch.resize(q_rows * kBlock);
    Vec qv[kMaxQ][kMaxDim / kVec];
    for (int64_t r = r_first; r < q_rows; ++r)
      for (int64_t i = 0; i < vecs; ++i) qv[r][i] = load(q + row_at(n, r) + i * kVec);
    for (int64_t s = begin; s < full; s += kVec) {
      const float* ks = g.k + (n * g.slots + s0 + s) * dim;
      for (int64_t r = r_first; r < q_rows; ++r) {
        const bool* vis = g.vis + (b * t_len + r % t_len) * g.slots + s0 + s;
        CVec seen;
        std::memcpy(&seen, vis, sizeof(CVec));
        const Vec x = scores16<V>(qv[r], ks) * scale;
        store(scratch.data() + r * kBlock + s, __builtin_convertvector(seen, IVec) != 0 ? x : Vec{} + kNegInf);
      }
    }
    for (int64_t r = r_first; r < q_rows; ++r) {
      const bool* vis = g.vis + (b * t_len + r % t_len) * g.slots + s0;
      for (int64_t s = full; s < end; ++s) {
        float x = kNegInf;
        if (vis[s]) {
          const float* ks = g.k + (n * g.slots + s0 + s) * dim;
          Vec a = qv[r][0] * load(ks);
          for (int64_t i = 1; i < vecs; ++i) a += qv[r][i] * load(ks + i * kVec);
          x = lane_sum(a) * scale;
        }
        scratch[r * kBlock + s] = x;
      }
    }
    // per row: max, exponentials and their sum
    for (int64_t r = r_first; r < q_rows; ++r) {
      float* sc = scratch.data() + r * kBlock;
      Vec mv = Vec{} + kNegInf;  // the max in any order: kVec lanes at a time
      int64_t i = begin;
      for (; i + kVec <= end; i += kVec) {
        const Vec x = load(sc + i);
        mv = mv > x ? mv : x;
      }
      float m = kNegInf;
      for (int64_t l = 0; l < kVec; ++l) m = std::max(m, mv[l]);
      for (; i < end; ++i) m = std::max(m, sc[i]);
      float* out = slot(n, u, r);
      out[0] = m;
      if (m == kNegInf) {
        std::fill(sc + begin, sc + end, 0.0f);
        out[1] = 0.0f;
        continue;
      }
      Vec l = Vec{};
      int64_t s = begin;
      for (; s + kVec <= end; s += kVec) {
        const Vec e = vexp(load(sc + s) - m);
        store(sc + s, e);
        l += e;
      }
      if (s < end) {
        alignas(64) float tail[kVec];
        std::fill(tail, tail + kVec, kNegInf);
        std::memcpy(tail, sc + s, (end - s) * sizeof(float));
        const Vec e = vexp(load(tail) - m);
        l += e;
        store(tail, e);
        std::memcpy(sc + s, tail, (end - s) * sizeof(float));
      }
      out[1] = lane_sum(l);
    }
    // the weighted values, kRowGroup rows at a time: each value row is loaded once per group
    // (a group's rows past q_rows weigh zero: compile-time bounds keep the sums in registers)
    for (int64_t r0 = r_first; r0 < q_rows; r0 += kRowGroup) {
      const int64_t rows = std::min<int64_t>(kRowGroup, q_rows - r0);
      Vec acc[kRowGroup][V];
      for (int64_t r = 0; r < kRowGroup; ++r)
        for (int64_t d = 0; d < V; ++d) acc[r][d] = Vec{};
      for (int64_t i = begin; i < end; ++i) {
        float p[kRowGroup];
        bool any = false;
        for (int64_t r = 0; r < kRowGroup; ++r) {
          p[r] = r < rows ? scratch[(r0 + r) * kBlock + i] : 0.0f;
          any |= p[r] != 0.0f;
        }
        if (!any) continue;
        const float* vs = g.v + (n * g.slots + s0 + i) * dim;
        for (int64_t d = 0; d < V; ++d) {
          const Vec vv = load(vs + d * kVec);
          for (int64_t r = 0; r < kRowGroup; ++r) acc[r][d] += p[r] * vv;
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* out = slot(n, u, r0 + r);
        for (int64_t d = 0; d < V; ++d) store(out + 2 + d * kVec, acc[r][d]);
      }
    }
  }

  void drain() {
    Queue::drain([this](int64_t i) {
      with_width<kMaxDim / kVec>(dim, [&](auto v) { unit_of<decltype(v)::value>(i / units_per_n, i % units_per_n); });
    });
  }

  void merge(float* y) {
    for (int64_t n = 0; n < n_rows; ++n)
      for (int64_t r = 0; r < q_rows; ++r) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t u = 0; u < units_per_n; ++u) m = std::max(m, slot(n, u, r)[0]);
        float* yr = y + row_at(n, r);
        std::fill(yr, yr + dim, 0.0f);
        if (m == -std::numeric_limits<float>::infinity()) continue;
        float l = 0.0f;
        for (int64_t u = 0; u < units_per_n; ++u) {
          const float* p = slot(n, u, r);
          if (p[0] == -std::numeric_limits<float>::infinity()) continue;
          const float c = std::exp(p[0] - m);
          l += p[1] * c;
          for (int64_t d = 0; d < dim; ++d) yr[d] += p[2 + d] * c;
        }
        const float inv = 1.0f / l;
        for (int64_t d = 0; d < dim; ++d) yr[d] *= inv;
      }
  }
};

// q [N, Q, D] (grouped rows), or [B, T, H, D] with N cache rows (the model's layout)
ffi::Error Attend(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, int64_t n_rows, const Segment* segs,
                  int64_t segments, const int64_t* slots, int64_t batch, int64_t t_len, float scale,
                  ffi::ResultBuffer<ffi::F32>& y) {
  const auto qd = q.dimensions();
  if (qd.size() != 3 && qd.size() != 4)
    return ffi::Error::InvalidArgument("cache_attention: q must be [N, Q, D] or [B, T, H, D]");
  const int64_t dim = qd[qd.size() - 1], heads = qd.size() == 4 ? qd[2] : 0;
  if (qd.size() == 3 && qd[0] != n_rows) return ffi::Error::InvalidArgument("cache_attention: q and k disagree on N");
  if (heads > 0 && (batch <= 0 || n_rows % batch || qd[0] != batch || qd[1] != t_len || heads % (n_rows / batch)))
    return ffi::Error::InvalidArgument("cache_attention: q [B, T, H, D] does not match the visibility or KV heads");
  const int64_t q_rows = heads > 0 ? heads / (n_rows / batch) * t_len : qd[1];
  if (dim % kVec || dim > kMaxDim) return ffi::Error::InvalidArgument("cache_attention: D must be a multiple of 16, <= 256");
  if (q_rows > kMaxQ) return ffi::Error::InvalidArgument("cache_attention: at most 64 query rows per cache row");
  if (batch <= 0 || n_rows % batch || t_len <= 0 || q_rows % t_len)
    return ffi::Error::InvalidArgument("cache_attention: N, Q and the visibility's [B, T] do not agree");
  auto work = std::make_shared<Work>();
  work->q = q.typed_data();
  work->segments = segments;
  work->n_rows = n_rows;
  work->q_rows = q_rows;
  work->dim = dim;
  work->t_len = t_len;
  work->heads_per_row = n_rows / batch;
  work->heads = heads;
  work->scale = scale;
  for (int64_t j = 0; j < segments; ++j) {
    work->seg[j] = segs[j];
    for (int64_t s0 = 0; s0 < slots[j]; s0 += kBlock) work->units.emplace_back(j, s0);
  }
  work->units_per_n = static_cast<int64_t>(work->units.size());
  work->total = n_rows * work->units_per_n;
  work->part.assign(work->total * q_rows * (dim + 2), 0.0f);
  run_units(pool, work);
  work->merge(y->typed_data());
  return ffi::Error::Success();
}

bool check_kv(ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v, ffi::Buffer<ffi::PRED>& vis, int64_t n_rows,
              int64_t dim, int64_t* slots, int64_t* batch, int64_t* t_len) {
  const auto kd = k.dimensions(), vd = v.dimensions(), md = vis.dimensions();
  if (kd.size() != 3 || vd.size() != 3 || md.size() != 3) return false;
  if (kd[0] != n_rows || kd[2] != dim || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] || md[2] != kd[1])
    return false;
  *slots = kd[1];
  *batch = md[0];
  *t_len = md[1];
  return true;
}

ffi::Error CacheAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                          ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> vis, ffi::ResultBuffer<ffi::F32> y,
                          float scale) {
  const auto qd = q.dimensions();
  const int64_t n_rows = k.dimensions().size() == 3 ? k.dimensions()[0] : 0;
  int64_t slots, batch, t_len;
  if (qd.size() < 3 || !check_kv(k, v, vis, n_rows, qd[qd.size() - 1], &slots, &batch, &t_len))
    return ffi::Error::InvalidArgument("cache_attention: k, v [N, S, D] and visibility [B, T, S] expected");
  const Segment seg{k.typed_data(), v.typed_data(), reinterpret_cast<const bool*>(vis.typed_data()), slots};
  return Attend(pool, q, n_rows, &seg, 1, &slots, batch, t_len, scale, y);
}

ffi::Error CacheAttention2(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> vis, ffi::Buffer<ffi::F32> k2,
                           ffi::Buffer<ffi::F32> v2, ffi::Buffer<ffi::PRED> vis2, ffi::ResultBuffer<ffi::F32> y,
                           float scale) {
  const auto qd = q.dimensions();
  const int64_t n_rows = k.dimensions().size() == 3 ? k.dimensions()[0] : 0, dim = qd[qd.size() - 1];
  int64_t slots[2], batch[2], t_len[2];
  if (qd.size() < 3 || !check_kv(k, v, vis, n_rows, dim, &slots[0], &batch[0], &t_len[0]) ||
      !check_kv(k2, v2, vis2, n_rows, dim, &slots[1], &batch[1], &t_len[1]) || batch[0] != batch[1] ||
      t_len[0] != t_len[1])
    return ffi::Error::InvalidArgument("cache_attention: two segments k, v [N, S, D], visibility [B, T, S] expected");
  const Segment segs[2] = {
      {k.typed_data(), v.typed_data(), reinterpret_cast<const bool*>(vis.typed_data()), slots[0]},
      {k2.typed_data(), v2.typed_data(), reinterpret_cast<const bool*>(vis2.typed_data()), slots[1]}};
  return Attend(pool, q, n_rows, segs, 2, slots, batch[0], t_len[0], scale, y);
}

// Many query rows (a prefill, a wide tree) over one segment: work units are (n, kVec consecutive query rows), the
// rows in the lanes of every vector. A unit walks the slots its rows see, kVec at a time, with an online softmax:
// scores as kVec x kVec products (query lanes against one slot's key, a broadcast), the running max and sum per
// lane, the weighted values per row in a small block kept in L1. Each row sums in an order that depends only on
// the slots, so a row's result does not depend on the rows beside it; it is not bit-equal to `Work`'s (another
// order), which serves decode steps and verifies.
struct LongWork : Queue {
  const float* q;  // [N, Q, D], or [B, T, H, D] when heads > 0
  const float* k;  // [N, S, D]
  const float* v;
  const bool* vis;  // [B, T, S]
  float* y;  // q's shape
  int64_t n_rows, q_rows, slots, dim, t_len, heads_per_row, blocks;
  int64_t heads = 0;  // > 0: q and y in the model's [B, T, H, D] layout (no grouping transposes around the call)
  float scale;

  int64_t row_at(int64_t n, int64_t r) const { return RowLayout{q_rows, dim, t_len, heads_per_row, heads}.at(n, r); }

  const bool* vis_row(int64_t n, int64_t r) const {
    return vis + ((n / heads_per_row) * t_len + r % t_len) * slots;
  }

  // `unit` for a head width of V vectors (compile-time: the weighted values' sums stay in registers)
  template <int V>
  void unit_of(int64_t n, int64_t blk) {
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    constexpr int64_t vecs = V, dv = V % 4 == 0 ? 4 : (V % 2 == 0 ? 2 : 1);
    const int64_t r0 = blk * kVec, rows = std::min<int64_t>(kVec, q_rows - r0);
    // each row's visible slots: [lo, hi), and whether they are all of it (an interval: no mask inside)
    int64_t lo = slots, hi = 0, inner_lo = 0, inner_hi = slots;
    bool intervals = true;
    const bool* vr[kVec];
    for (int64_t l = 0; l < rows; ++l) {
      vr[l] = vis_row(n, r0 + l);
      const auto [a, b, interval] = span_of(vr[l], slots);
      if (a >= b) {  // sees nothing: the block's masked path keeps the row at zero
        intervals = false;
        continue;
      }
      intervals &= interval;
      lo = std::min(lo, a);
      hi = std::max(hi, b);
      inner_lo = std::max(inner_lo, a);
      inner_hi = std::min(inner_hi, b);
    }
    alignas(64) float qt[kMaxDim][kVec];  // the rows' queries, transposed: qt[d] holds dimension d of every row
    alignas(64) float out[kVec][kMaxDim];
    alignas(64) float p[kVec][kVec];  // p[slot][row]
    const float* qr[kVec];
    for (int64_t l = 0; l < kVec; ++l) qr[l] = l < rows ? q + row_at(n, r0 + l) : nullptr;
    for (int64_t d = 0; d < dim; ++d)
      for (int64_t l = 0; l < kVec; ++l) qt[d][l] = qr[l] ? qr[l][d] : 0.0f;
    for (int64_t l = 0; l < kVec; ++l) std::fill(out[l], out[l] + dim, 0.0f);
    Vec m = Vec{} + kNegInf, sum = Vec{};
    const float* kn = k + n * slots * dim;
    const float* vn = v + n * slots * dim;
    for (int64_t j0 = lo / kVec * kVec; j0 < hi; j0 += kVec) {  // blocks at fixed slots: rows sum alike
      const int64_t nj = std::min<int64_t>(kVec, hi - j0);
      const float* kp[kVec];
      for (int64_t jj = 0; jj < kVec; ++jj) kp[jj] = kn + (j0 + std::min(jj, nj - 1)) * dim;
      Vec s[kVec];
      for (int64_t jj = 0; jj < kVec; ++jj) s[jj] = Vec{};
      for (int64_t d = 0; d < dim; ++d) {
        const Vec qd = load(qt[d]);
        for (int64_t jj = 0; jj < kVec; ++jj) s[jj] += qd * kp[jj][d];
      }
      const bool full = intervals && nj == kVec && rows == kVec && j0 >= inner_lo && j0 + kVec <= inner_hi;
      Vec bm = Vec{} + kNegInf;
      for (int64_t jj = 0; jj < kVec; ++jj) {
        s[jj] *= scale;
        if (!full) {
          alignas(64) float keep[kVec];
          for (int64_t l = 0; l < kVec; ++l) keep[l] = (jj < nj && l < rows && vr[l][j0 + jj]) ? 0.0f : kNegInf;
          s[jj] += load(keep);
        }
        bm = bm > s[jj] ? bm : s[jj];
      }
      const Vec m_new = m > bm ? m : bm;
      const Vec base = m_new == kNegInf ? Vec{} : m_new;  // a row that has seen nothing yet keeps zeros
      const Vec alpha = vexp(m - base);
      Vec add = Vec{};
      for (int64_t jj = 0; jj < kVec; ++jj) {
        const Vec e = vexp(s[jj] - base);
        store(p[jj], e);
        add += e;
      }
      sum = sum * alpha + add;
      m = m_new;
      alignas(64) float a[kVec];
      store(a, alpha);
      // out[row] = out[row] * alpha[row] + sum over the block's slots of p[slot][row] * v[slot], 4 rows at a time
      // (rows past `rows` weigh zero and stay zero)
      for (int64_t d0 = 0; d0 < vecs; d0 += dv) {
        for (int64_t l0 = 0; l0 < rows; l0 += 4) {
          Vec acc[4][dv];
          for (int64_t l = 0; l < 4; ++l)
            for (int64_t i = 0; i < dv; ++i) acc[l][i] = load(out[l0 + l] + (d0 + i) * kVec) * a[l0 + l];
          for (int64_t jj = 0; jj < nj; ++jj) {
            const float* vs = vn + (j0 + jj) * dim + d0 * kVec;
            Vec vv[dv];
            for (int64_t i = 0; i < dv; ++i) vv[i] = load(vs + i * kVec);
            for (int64_t l = 0; l < 4; ++l) {
              const float w = p[jj][l0 + l];
              for (int64_t i = 0; i < dv; ++i) acc[l][i] += w * vv[i];
            }
          }
          for (int64_t l = 0; l < 4; ++l)
            for (int64_t i = 0; i < dv; ++i) store(out[l0 + l] + (d0 + i) * kVec, acc[l][i]);
        }
      }
    }
    alignas(64) float total_l[kVec];
    store(total_l, sum);
    for (int64_t l = 0; l < rows; ++l) {
      float* o = y + row_at(n, r0 + l);
      if (!(total_l[l] > 0.0f)) {
        std::fill(o, o + dim, 0.0f);
        continue;
      }
      const float inv = 1.0f / total_l[l];
      for (int64_t d = 0; d < dim; ++d) o[d] = out[l][d] * inv;
    }
  }

  void drain() {  // the latest rows (the most slots, causally) first
    Queue::drain([this](int64_t i) {
      with_width<kMaxDim / kVec>(dim, [&](auto v) { unit_of<decltype(v)::value>(i % n_rows, blocks - 1 - i / n_rows); });
    });
  }
};

ffi::Error LongAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                         ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> vis, ffi::ResultBuffer<ffi::F32> y,
                         float scale) {
  const auto qd = q.dimensions();
  if (qd.size() != 3 && qd.size() != 4)
    return ffi::Error::InvalidArgument("long_attention: q must be [N, Q, D] or [B, T, H, D]");
  const int64_t n_rows = k.dimensions().size() == 3 ? k.dimensions()[0] : 0, dim = qd[qd.size() - 1];
  if (dim % kVec || dim > kMaxDim) return ffi::Error::InvalidArgument("long_attention: D must be a multiple of 16, <= 256");
  int64_t slots, batch, t_len;
  if (!check_kv(k, v, vis, n_rows, dim, &slots, &batch, &t_len))
    return ffi::Error::InvalidArgument("long_attention: k, v [N, S, D] and visibility [B, T, S] expected");
  if (batch <= 0 || n_rows % batch || t_len <= 0)
    return ffi::Error::InvalidArgument("long_attention: N and the visibility's [B, T] do not agree");
  const int64_t heads = qd.size() == 4 ? qd[2] : 0, kv_heads = n_rows / batch;
  if (heads > 0 && (qd[0] != batch || qd[1] != t_len || heads % kv_heads))
    return ffi::Error::InvalidArgument("long_attention: q [B, T, H, D] does not match the visibility or the KV heads");
  const int64_t q_rows = heads > 0 ? heads / kv_heads * t_len : qd[1];
  if (q_rows % t_len) return ffi::Error::InvalidArgument("long_attention: Q is not a multiple of the visibility's T");
  auto work = std::make_shared<LongWork>();
  work->q = q.typed_data();
  work->k = k.typed_data();
  work->v = v.typed_data();
  work->vis = reinterpret_cast<const bool*>(vis.typed_data());
  work->y = y->typed_data();
  work->n_rows = n_rows;
  work->q_rows = q_rows;
  work->slots = slots;
  work->dim = dim;
  work->t_len = t_len;
  work->heads_per_row = n_rows / batch;
  work->blocks = (q_rows + kVec - 1) / kVec;
  work->heads = heads;
  work->scale = scale;
  work->total = n_rows * work->blocks;
  run_units(pool, work);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecCacheAttention, CacheAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecCacheAttention2, CacheAttention2,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecLongAttention, LongAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
