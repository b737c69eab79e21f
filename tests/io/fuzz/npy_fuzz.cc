// libFuzzer target for the .npy parser (moed::parse_npy): any byte string must give either an
// array whose data size matches its shape, or an error status; never a crash, a hang or a
// read out of bounds (built with ASan + UBSan by run.sh).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "moed/npy.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto a = moed::parse_npy(std::span<const uint8_t>(data, size), "fuzz.npy");
  if (!a.ok()) return 0;
  const uint64_t need = uint64_t(a->num_elements()) * moed::npy_dtype_size(a->dtype);
  if (a->data.size() != need) std::abort();
  // The conversions must be safe on anything the parser accepts.
  (void)moed::npy_to_f32(*a).ok();
  (void)moed::npy_to_i32(*a).ok();
  (void)moed::npy_to_u8(*a).ok();
  // What parses re-encodes to something that parses to the same array.
  auto encoded = moed::encode_npy(a->dtype, a->shape, a->data.data());
  if (!encoded.ok()) std::abort();
  auto again = moed::parse_npy(*encoded, "again.npy");
  if (!again.ok() || again->shape != a->shape || again->data != a->data) std::abort();
  return 0;
}
