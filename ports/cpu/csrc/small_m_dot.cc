// Float32 products of a few activation rows with a weight matrix, streaming the weights once.
//
// y[M, N] = x[M, K] . W, W stored either [K, N] ("kn": contracted on its first axis) or [N, K] ("nk": on its
// last, as a tied embedding used as the LM head). Each output element is accumulated in an order that depends
// only on K, never on M or on how the work is split between threads, so a row's result does not depend on the
// rows beside it. The columns are split into blocks that the threads of XLA's intra-op pool claim from a shared
// counter; the calling thread claims blocks too and waits only for blocks another thread has started, so the call
// cannot deadlock when the pool is busy.
//
// A second entry, "packed", multiplies any number of rows by a weight packed ahead of time into column panels,
// W [P, K, kPanel] (panel p holds columns p * kPanel .. + kPanel - 1, each weight row's kPanel floats contiguous, the
// last panel zero-padded). Its weights stream once, front to back, for up to kChunk rows: every row's running sums
// for a panel stay in registers, so a product of a few rows costs what reading the weights does. More rows are
// taken kChunk at a time over a panel that stays in L2. The sum order is the same, k increasing, for every row.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kVec = 16;        // floats per SIMD group the compiler vectorizes
constexpr int64_t kColBlock = 512;  // "kn": most columns per work block (2 KB of each weight row)
constexpr int64_t kRowBlock = 64;   // "nk": weight rows (output columns) per work block
constexpr int64_t kMaxRows = 12;    // "nk": activation rows held in registers at once
constexpr int64_t kMaxM = 16;       // rows of x a call may have

using Vec = float __attribute__((vector_size(kVec * sizeof(float))));

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(Vec));
  return v;
}
inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof(Vec)); }

inline float lane_sum(Vec v) {
  // A fixed pairwise order, so the sum is the same on every call.
  float a[kVec];
  std::memcpy(a, &v, sizeof(Vec));
  for (int64_t w = kVec / 2; w >= 1; w /= 2)
    for (int64_t i = 0; i < w; ++i) a[i] += a[i + w];
  return a[0];
}

// "kn": columns [c0, c1) of y for every row. y[m, c] = sum over k in increasing order of x[m, k] * w[k, c]. The
// weight rows are read kUnroll at a time, up to 2 KB of each; every row of x then sweeps them out of L1 into its running
// sums, kept in a small buffer that stays in L1 too.
constexpr int64_t kUnroll = 8;

void kn_block(const float* x, const float* w, float* y, int64_t m_rows, int64_t k_dim, int64_t n_dim, int64_t c0,
              int64_t c1) {
  const int64_t width = c1 - c0;
  const int64_t vecs = width / kVec;
  alignas(64) float acc[kMaxM * kColBlock];
  std::fill(acc, acc + m_rows * kColBlock, 0.0f);
  int64_t k = 0;
  for (; k + kUnroll <= k_dim; k += kUnroll) {
    const float* wk = w + k * n_dim + c0;
    for (int64_t m = 0; m < m_rows; ++m) {
      const float* xm = x + m * k_dim + k;
      float* a = acc + m * kColBlock;
      for (int64_t v = 0; v < vecs; ++v) {
        Vec s = load(a + v * kVec);
        for (int64_t u = 0; u < kUnroll; ++u) s += xm[u] * load(wk + u * n_dim + v * kVec);
        store(a + v * kVec, s);
      }
    }
  }
  for (; k < k_dim; ++k) {
    const float* wk = w + k * n_dim + c0;
    for (int64_t m = 0; m < m_rows; ++m) {
      const float xm = x[m * k_dim + k];
      float* a = acc + m * kColBlock;
      for (int64_t v = 0; v < vecs; ++v) store(a + v * kVec, load(a + v * kVec) + xm * load(wk + v * kVec));
    }
  }
  for (int64_t m = 0; m < m_rows; ++m) {
    float* a = acc + m * kColBlock;
    for (int64_t c = vecs * kVec; c < width; ++c) {
      float s = 0.0f;
      for (int64_t kk = 0; kk < k_dim; ++kk) s += x[m * k_dim + kk] * w[kk * n_dim + c0 + c];
      a[c] = s;
    }
    std::memcpy(y + m * n_dim + c0, a, width * sizeof(float));
  }
}

// "nk": output columns (weight rows) [r0, r1). y[m, r] = lane_sum of 16 running sums over k, then the tail.
template <int64_t MR>
void nk_rows(const float* x, const float* w, float* y, int64_t k_dim, int64_t n_dim, int64_t r0, int64_t r1) {
  const int64_t vec_end = (k_dim / kVec) * kVec;
  for (int64_t r = r0; r < r1; ++r) {
    const float* wr = w + r * k_dim;
    Vec acc[MR];
    for (int64_t m = 0; m < MR; ++m) acc[m] = Vec{};
    for (int64_t k = 0; k < vec_end; k += kVec) {
      const Vec wv = load(wr + k);
      for (int64_t m = 0; m < MR; ++m) acc[m] += load(x + m * k_dim + k) * wv;
    }
    for (int64_t m = 0; m < MR; ++m) {
      float s = lane_sum(acc[m]);
      for (int64_t k = vec_end; k < k_dim; ++k) s += x[m * k_dim + k] * wr[k];
      y[m * n_dim + r] = s;
    }
  }
}

using NkFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
constexpr NkFn kNk[kMaxRows + 1] = {nullptr,     nk_rows<1>,  nk_rows<2>, nk_rows<3>, nk_rows<4>,
                                     nk_rows<5>,  nk_rows<6>,  nk_rows<7>, nk_rows<8>, nk_rows<9>,
                                     nk_rows<10>, nk_rows<11>, nk_rows<12>};

void nk_block(const float* x, const float* w, float* y, int64_t m_rows, int64_t k_dim, int64_t n_dim, int64_t r0,
              int64_t r1) {
  for (int64_t m0 = 0; m0 < m_rows; m0 += kMaxRows) {
    const int64_t mr = std::min<int64_t>(kMaxRows, m_rows - m0);
    kNk[mr](x + m0 * k_dim, w, y + m0 * n_dim, k_dim, n_dim, r0, r1);
  }
}


// "packed": y[m, p * kPanel + j] = sum over k in increasing order of x[m, k] * w[p, k, j].
constexpr int64_t kPanel = 32;  // columns per panel: two SIMD groups
constexpr int64_t kChunk = 12;  // rows whose sums (2 groups each) stay in registers at once

template <int64_t MR>
void packed_rows(const float* x, const float* wp, float* y, int64_t k_dim, int64_t n_dim, int64_t p) {
  const float* w = wp + p * k_dim * kPanel;
  Vec a0[MR], a1[MR];
  for (int64_t m = 0; m < MR; ++m) a0[m] = a1[m] = Vec{};
  for (int64_t k = 0; k < k_dim; ++k) {
    const Vec w0 = load(w + k * kPanel), w1 = load(w + k * kPanel + kVec);
    for (int64_t m = 0; m < MR; ++m) {
      const float xm = x[m * k_dim + k];
      a0[m] += xm * w0;
      a1[m] += xm * w1;
    }
  }
  const int64_t c0 = p * kPanel, width = std::min(kPanel, n_dim - c0);
  for (int64_t m = 0; m < MR; ++m) {
    float* ym = y + m * n_dim + c0;
    if (width == kPanel) {
      store(ym, a0[m]);
      store(ym + kVec, a1[m]);
    } else {
      alignas(64) float tmp[kPanel];
      store(tmp, a0[m]);
      store(tmp + kVec, a1[m]);
      std::memcpy(ym, tmp, width * sizeof(float));
    }
  }
}

using PackedFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t);
constexpr PackedFn kPacked[kChunk + 1] = {nullptr,          packed_rows<1>,  packed_rows<2>, packed_rows<3>,
                                          packed_rows<4>,   packed_rows<5>,  packed_rows<6>, packed_rows<7>,
                                          packed_rows<8>,   packed_rows<9>,  packed_rows<10>, packed_rows<11>,
                                          packed_rows<12>};

void packed_block(const float* x, const float* w, float* y, int64_t m_rows, int64_t k_dim, int64_t n_dim, int64_t p0,
                  int64_t p1) {
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t m0 = 0; m0 < m_rows; m0 += kChunk) {
      const int64_t mr = std::min<int64_t>(kChunk, m_rows - m0);
      kPacked[mr](x + m0 * k_dim, w, y + m0 * n_dim, k_dim, n_dim, p);
    }
}

enum class Form { kn, nk, packed };

struct Work {
  const float* x;
  const float* w;
  float* y;
  int64_t m, k, n, block, blocks;  // "packed": blocks of `block` panels
  Form form;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Claims and runs blocks until none is left; returns how many this thread ran.
  void drain() {
    for (;;) {
      const int64_t b = next.fetch_add(1);
      if (b >= blocks) return;
      if (form == Form::packed) {
        const int64_t panels = (n + kPanel - 1) / kPanel;
        packed_block(x, w, y, m, k, n, b * block, std::min(panels, (b + 1) * block));
      } else {
        const int64_t lo = b * block, hi = std::min(n, lo + block);
        if (form == Form::nk)
          nk_block(x, w, y, m, k, n, lo, hi);
        else
          kn_block(x, w, y, m, k, n, lo, hi);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Runs `work` on the calling thread and up to pool.num_threads() - 1 of the pool's, returning when every block is done.
void run(ffi::ThreadPool& pool, const std::shared_ptr<Work>& work) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->blocks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  while (work->done.load(std::memory_order_acquire) < work->blocks) std::this_thread::yield();
}

std::shared_ptr<Work> new_work(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& w, ffi::ResultBuffer<ffi::F32>& y,
                               int64_t m, int64_t k, int64_t n, Form form) {
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->w = w.typed_data();
  work->y = y->typed_data();
  work->m = m;
  work->k = k;
  work->n = n;
  work->form = form;
  return work;
}

ffi::Error SmallMDot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> y, bool nk) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("small_m_dot: x and w must be 2-D");
  const int64_t m = xd[0], k = xd[1];
  const int64_t n = nk ? wd[0] : wd[1];
  if ((nk ? wd[1] : wd[0]) != k) return ffi::Error::InvalidArgument("small_m_dot: contracted sizes differ");
  if (m > kMaxM) return ffi::Error::InvalidArgument("small_m_dot: at most 16 rows");
  auto work = new_work(x, w, y, m, k, n, nk ? Form::nk : Form::kn);
  // "kn": as few blocks as threads where they fit, so that narrow matrices (576 or 960 columns) split evenly
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t even = ((n + threads - 1) / threads + kVec - 1) / kVec * kVec;
  work->block = nk ? kRowBlock : std::min(kColBlock, even);
  work->blocks = (n + work->block - 1) / work->block;
  run(pool, work);
  return ffi::Error::Success();
}

ffi::Error PackedDot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("packed_dot: x [M, K], w [P, K, 32] and y [M, N] expected");
  const int64_t m = xd[0], k = xd[1], n = yd[1], panels = wd[0];
  if (wd[1] != k || wd[2] != kPanel) return ffi::Error::InvalidArgument("packed_dot: w is not [P, K, 32] for x's K");
  if (yd[0] != m || panels != (n + kPanel - 1) / kPanel)
    return ffi::Error::InvalidArgument("packed_dot: y's shape does not match x and w");
  auto work = new_work(x, w, y, m, k, n, Form::packed);
  // a panel a block: the threads claim them in turn
  work->block = 1;
  work->blocks = panels;
  run(pool, work);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecSmallMDot, SmallMDot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("nk"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecPackedDot, PackedDot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
