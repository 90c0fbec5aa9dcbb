// In-place row writes into KV-cache buffers on the CPU: one call writes every buffer it is given.
//
// Each buffer is [N, S, D] (any element type; N flat cache rows of S slots); its result aliases it, so XLA hands the
// same memory in and out and only the written slots change. `WriteRows` copies new[i] [N, T, D] into buffer i at
// slots start[n] .. start[n] + T - 1 of each row. `MoveRows` copies, per row, the slots src[n, 0..P-1] of each
// buffer (gathered first, so sources and destinations may overlap) to slots start[n] .. start[n] + P - 1. A start
// below 0 counts from the end and is then clamped to [0, S - T], as JAX's dynamic_update_slice does, so the results
// are those of the XLA ops they replace (`ports.cache`); a source slot outside [0, S) is clamped into it (XLA's
// gather reads NaN there; the engine never commits such a slot).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

struct Shape {
  int64_t n, s, d, width;  // rows, slots, slot width (elements), element bytes
};

// False unless b is [N, S, D].
bool shape_of(const ffi::AnyBuffer& b, Shape* out) {
  auto dims = b.dimensions();
  if (dims.size() != 3) return false;
  *out = Shape{dims[0], dims[1], dims[2], static_cast<int64_t>(ffi::ByteWidth(b.element_type()))};
  return true;
}

// The result buffer, holding the operand's contents (the same memory when XLA aliased them, as it does).
char* result_of(const ffi::AnyBuffer& in, ffi::Result<ffi::AnyBuffer>& out) {
  char* dst = static_cast<char*>(out->untyped_data());
  if (dst != in.untyped_data()) std::memcpy(dst, in.untyped_data(), in.size_bytes());
  return dst;
}

int64_t clamp(int64_t x, int64_t lo, int64_t hi) { return std::min(std::max(x, lo), hi); }

// Where a write of `width` slots starting at `start` lands in a row of `slots` (dynamic_update_slice's rule).
int64_t write_start(int64_t start, int64_t width, int64_t slots) {
  return clamp(start < 0 ? start + slots : start, 0, slots - width);
}

ffi::Error WriteRows(ffi::Buffer<ffi::S32> start, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (args.size() != 2 * rets.size()) return ffi::Error::InvalidArgument("WriteRows takes (buffer, new) pairs");
  const int32_t* st = start.typed_data();
  for (size_t i = 0; i < rets.size(); ++i) {
    auto buf = args.get<ffi::AnyBuffer>(2 * i);
    auto upd = args.get<ffi::AnyBuffer>(2 * i + 1);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (buf.has_error()) return buf.error();
    if (upd.has_error()) return upd.error();
    if (out.has_error()) return out.error();
    Shape b, u;
    if (!shape_of(*buf, &b) || !shape_of(*upd, &u)) return ffi::Error::InvalidArgument("WriteRows takes [N, S, D]");
    if (u.n != b.n || u.d != b.d || u.width != b.width || u.s > b.s)
      return ffi::Error::InvalidArgument("WriteRows: new rows do not fit the buffer");
    if (static_cast<int64_t>(start.element_count()) != b.n)
      return ffi::Error::InvalidArgument("WriteRows: one start per buffer row");
    char* dst = result_of(*buf, *out);
    const char* src = static_cast<const char*>(upd->untyped_data());
    const int64_t slot = b.d * b.width, span = u.s * slot;
    for (int64_t n = 0; n < b.n; ++n) {
      const int64_t s0 = write_start(st[n], u.s, b.s);
      std::memcpy(dst + (n * b.s + s0) * slot, src + n * span, span);
    }
  }
  return ffi::Error::Success();
}

ffi::Error MoveRows(ffi::Buffer<ffi::S32> src_slots, ffi::Buffer<ffi::S32> start, ffi::RemainingArgs args,
                    ffi::RemainingRets rets) {
  if (args.size() != rets.size()) return ffi::Error::InvalidArgument("MoveRows takes one result per buffer");
  auto sd = src_slots.dimensions();
  if (sd.size() != 2) return ffi::Error::InvalidArgument("MoveRows: source slots must be [N, P]");
  const int64_t rows = sd[0], p = sd[1];
  if (static_cast<int64_t>(start.element_count()) != rows)
    return ffi::Error::InvalidArgument("MoveRows: one start per buffer row");
  const int32_t* src = src_slots.typed_data();
  const int32_t* st = start.typed_data();
  std::vector<char> tmp;
  for (size_t i = 0; i < rets.size(); ++i) {
    auto buf = args.get<ffi::AnyBuffer>(i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (buf.has_error()) return buf.error();
    if (out.has_error()) return out.error();
    Shape b;
    if (!shape_of(*buf, &b)) return ffi::Error::InvalidArgument("MoveRows takes buffers [N, S, D]");
    if (b.n != rows || p > b.s) return ffi::Error::InvalidArgument("MoveRows: source slots do not fit the buffer");
    char* dst = result_of(*buf, *out);
    const int64_t slot = b.d * b.width;
    tmp.resize(p * slot);
    for (int64_t n = 0; n < rows; ++n) {
      char* row = dst + n * b.s * slot;
      for (int64_t j = 0; j < p; ++j)
        std::memcpy(tmp.data() + j * slot, row + clamp(src[n * p + j], 0, b.s - 1) * slot, slot);
      std::memcpy(row + write_start(st[n], p, b.s) * slot, tmp.data(), p * slot);
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecWriteRows, WriteRows,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::S32>>().RemainingArgs().RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecMoveRows, MoveRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets());
