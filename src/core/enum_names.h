// One table of {value, name} per enum, and the two lookups every enum's name_of / parse_of
// is built from, so each enum spells its names once.
//
//   constexpr EnumName<DType> kDTypeNames[] = {{DType::kF32, "f32"}, {DType::kF32, "fp32", false}};
//   const char* dtype_name(DType t) { return enum_name(kDTypeNames, t, "?"); }
//   StatusOr<DType> parse_dtype(std::string_view s) {
//     return parse_enum(kDTypeNames, s, "dtype", "is not one of");
//   }
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "moed/status.h"

namespace moed {

template <typename E>
struct EnumName {
  E value;
  const char* name;
  // Whether the name is shown in parse_enum's list of choices (aliases usually are not).
  bool listed = true;
};

// The first name of `value` in the table (its canonical name), or `unknown` if none.
template <typename E, size_t N>
const char* enum_name(const EnumName<E> (&table)[N], E value, const char* unknown) {
  for (const EnumName<E>& e : table) {
    if (e.value == value) return e.name;
  }
  return unknown;
}

// The value named `name`, or "<what> '<name>' <one_of> a, b, c" (the listed names).
template <typename E, size_t N>
StatusOr<E> parse_enum(const EnumName<E> (&table)[N], std::string_view name, std::string_view what,
                       std::string_view one_of) {
  std::string choices;
  for (const EnumName<E>& e : table) {
    if (e.name == name) return e.value;
    if (e.listed) choices += (choices.empty() ? "" : ", ") + std::string(e.name);
  }
  return invalid_argument(what, " '", name, "' ", one_of, " ", choices);
}

}  // namespace moed
