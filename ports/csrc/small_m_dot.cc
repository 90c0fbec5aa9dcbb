// Float32 products of a few activation rows with a weight matrix, streaming the weights once.
//
// y[M, N] = x[M, K] . W, W stored either [K, N] ("kn": contracted on its first axis) or [N, K] ("nk": on its
// last, as a tied embedding used as the LM head). Each output element is accumulated in an order that depends
// only on K, never on M or on how the work is split between threads, so a row's result does not depend on the
// rows beside it. The columns are split into blocks that the threads of XLA's intra-op pool claim from a shared
// counter; the calling thread claims blocks too and waits only for blocks another thread has started, so the call
// cannot deadlock when the pool is busy.
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

struct Work {
  const float* x;
  const float* w;
  float* y;
  int64_t m, k, n, block, blocks;
  bool nk;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Claims and runs blocks until none is left; returns how many this thread ran.
  void drain() {
    for (;;) {
      const int64_t b = next.fetch_add(1);
      if (b >= blocks) return;
      const int64_t lo = b * block, hi = std::min(n, lo + block);
      if (nk)
        nk_block(x, w, y, m, k, n, lo, hi);
      else
        kn_block(x, w, y, m, k, n, lo, hi);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error SmallMDot(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> y, bool nk) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("small_m_dot: x and w must be 2-D");
  const int64_t m = xd[0], k = xd[1];
  const int64_t n = nk ? wd[0] : wd[1];
  if ((nk ? wd[1] : wd[0]) != k) return ffi::Error::InvalidArgument("small_m_dot: contracted sizes differ");
  if (m > kMaxM) return ffi::Error::InvalidArgument("small_m_dot: at most 16 rows");
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->w = w.typed_data();
  work->y = y->typed_data();
  work->m = m;
  work->k = k;
  work->n = n;
  work->nk = nk;
  // "kn": as few blocks as threads where they fit, so that narrow matrices (576 or 960 columns) split evenly
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t even = ((n + threads - 1) / threads + kVec - 1) / kVec * kVec;
  work->block = nk ? kRowBlock : std::min(kColBlock, even);
  work->blocks = (n + work->block - 1) / work->block;
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->blocks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->drain(); });
  work->drain();
  while (work->done.load(std::memory_order_acquire) < work->blocks) std::this_thread::yield();
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
