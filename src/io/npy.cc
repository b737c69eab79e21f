#include "moed/npy.h"

#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>

#include "core/enum_names.h"

namespace moed {

static_assert(std::endian::native == std::endian::little,
              "moed's .npy layer reads little-endian data straight into memory");

namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;
constexpr size_t kAlign = 64;         // numpy.save aligns the data to 64 bytes
constexpr size_t kGrowthDigits = 21;  // spare header room numpy.save leaves for shape[0]
constexpr char kSupported[] = "<f4, <f8, <i4, <i8, |b1, <u2, |u1";

constexpr EnumName<NpyDType> kDescrs[] = {
    {NpyDType::kF32, "<f4"}, {NpyDType::kF64, "<f8"},  {NpyDType::kI32, "<i4"},
    {NpyDType::kI64, "<i8"}, {NpyDType::kBool, "|b1"}, {NpyDType::kU16, "<u2"},
    {NpyDType::kU8, "|u1"},
};

std::string shape_to_string(std::span<const int64_t> shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  if (shape.size() == 1) s += ",";
  return s + ")";
}

// Product of the dims, or an error when it or its byte count overflows int64.
StatusOr<int64_t> checked_num_elements(std::span<const int64_t> shape, size_t elem_size,
                                       const std::string& name) {
  for (int64_t d : shape) {
    if (d == 0) return int64_t{0};
  }
  int64_t n = 1;
  const int64_t limit = std::numeric_limits<int64_t>::max() / int64_t(elem_size);
  for (int64_t d : shape) {
    if (d > limit / n) {
      return invalid_argument(name, ": shape ", shape_to_string(shape),
                              " is too large (its byte count overflows int64)");
    }
    n *= d;
  }
  return n;
}

// The Python dict literal of a .npy header, e.g.
//   {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
// Only what numpy writes is accepted: string keys, a string descr, True/False and a tuple of
// non-negative ints, in any order, each once.
class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& name) : text_(text), name_(name) {}

  Status parse(NpyArray* out) {
    bool have_descr = false, have_order = false, have_shape = false;
    skip_ws();
    MOED_RETURN_IF_ERROR(expect('{'));
    MOED_RETURN_IF_ERROR(parse_items('}', "expected ',' or '}'", [&]() -> Status {
      std::string key;
      MOED_RETURN_IF_ERROR(parse_string(&key));
      skip_ws();
      MOED_RETURN_IF_ERROR(expect(':'));
      skip_ws();
      if (key == "descr" && !have_descr) {
        have_descr = true;
        MOED_RETURN_IF_ERROR(parse_descr(&out->dtype));
      } else if (key == "fortran_order" && !have_order) {
        have_order = true;
        bool fortran = false;
        MOED_RETURN_IF_ERROR(parse_bool(&fortran));
        if (fortran) {
          return invalid_argument(name_, ": fortran_order is True; moed reads C-order arrays only");
        }
      } else if (key == "shape" && !have_shape) {
        have_shape = true;
        MOED_RETURN_IF_ERROR(parse_shape(&out->shape));
      } else if (key == "descr" || key == "fortran_order" || key == "shape") {
        return error(str_cat("key '", key, "' appears twice"));
      } else {
        return error(str_cat("unexpected key '", key, "'"));
      }
      return ok_status();
    }));
    skip_ws();
    if (pos_ != text_.size()) return error("unexpected text after '}'");
    if (!have_descr) return missing("descr");
    if (!have_order) return missing("fortran_order");
    if (!have_shape) return missing("shape");
    return ok_status();
  }

 private:
  char peek() const { return pos_ < text_.size() ? text_[pos_] : '\0'; }
  void skip_ws() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' ||
                                   text_[pos_] == '\n' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }
  Status error(const std::string& what) const {
    return invalid_argument(name_, ": malformed .npy header (", what, " at offset ", pos_, ")");
  }
  Status missing(const char* key) const {
    return invalid_argument(name_, ": malformed .npy header (no '", key, "' key)");
  }
  Status expect(char c) {
    if (peek() != c) return error(str_cat("expected '", c, "'"));
    ++pos_;
    return ok_status();
  }

  // Items up to `close` (the opening bracket read), comma-separated, a trailing comma allowed;
  // item() parses one. `bad_separator` is the error when neither a comma nor `close` follows.
  template <typename Item>
  Status parse_items(char close, const char* bad_separator, const Item& item) {
    for (;;) {
      skip_ws();
      if (peek() == close) break;
      MOED_RETURN_IF_ERROR(item());
      skip_ws();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() != close) return error(bad_separator);
    }
    ++pos_;  // close
    return ok_status();
  }

  // 'text' or "text", without escapes (numpy never writes any in these fields).
  Status parse_string(std::string* s) {
    const char quote = peek();
    if (quote != '\'' && quote != '"') return error("expected a quoted string");
    const size_t end = text_.find(quote, pos_ + 1);
    if (end == std::string_view::npos) return error("unterminated string");
    const std::string_view body = text_.substr(pos_ + 1, end - pos_ - 1);
    if (body.find('\\') != std::string_view::npos) return error("escape in a string");
    *s = std::string(body);
    pos_ = end + 1;
    return ok_status();
  }

  Status parse_descr(NpyDType* t) {
    if (peek() == '[') {
      return invalid_argument(name_, ": dtype is a structured (record) dtype, which is not ",
                              "supported (expected one of ", kSupported, ")");
    }
    std::string descr;
    MOED_RETURN_IF_ERROR(parse_string(&descr));
    for (const EnumName<NpyDType>& candidate : kDescrs) {
      if (descr == candidate.name) {
        *t = candidate.value;
        return ok_status();
      }
    }
    return invalid_argument(name_, ": dtype '", descr, "' is not supported (expected one of ",
                            kSupported, ")");
  }

  Status parse_bool(bool* b) {
    const std::string_view rest = text_.substr(pos_);
    if (rest.starts_with("True")) {
      *b = true;
      pos_ += 4;
    } else if (rest.starts_with("False")) {
      *b = false;
      pos_ += 5;
    } else {
      return error("expected True or False");
    }
    return ok_status();
  }

  Status parse_shape(std::vector<int64_t>* shape) {
    MOED_RETURN_IF_ERROR(expect('('));
    shape->clear();
    // "(5)" is an int in Python, not a tuple; numpy writes "(5,)".
    return parse_items(')', "expected ',' or ')' in the shape", [&]() -> Status {
      int64_t dim = 0;
      MOED_RETURN_IF_ERROR(parse_dim(&dim));
      shape->push_back(dim);
      return ok_status();
    });
  }

  Status parse_dim(int64_t* dim) {
    if (peek() == '-') {
      return invalid_argument(name_, ": shape has a negative dimension");
    }
    if (peek() < '0' || peek() > '9') return error("expected a dimension");
    int64_t v = 0;
    while (peek() >= '0' && peek() <= '9') {
      const int digit = peek() - '0';
      if (v > (std::numeric_limits<int64_t>::max() - digit) / 10) {
        return invalid_argument(name_, ": a shape dimension does not fit int64");
      }
      v = v * 10 + digit;
      ++pos_;
    }
    *dim = v;
    return ok_status();
  }

  std::string_view text_;
  const std::string& name_;
  size_t pos_ = 0;
};

uint32_t read_le(const uint8_t* p, int bytes) {
  uint32_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// "[1][2]" for flat index 5 of shape (2, 3); "" for a 0-d array.
std::string index_string(const std::vector<int64_t>& shape, int64_t flat) {
  std::vector<int64_t> index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    index[d] = flat % shape[d];
    flat /= shape[d];
  }
  std::string s;
  for (int64_t i : index) s += str_cat("[", i, "]");
  return s;
}

template <typename T>
T element(const NpyArray& a, int64_t i) {
  T v;
  std::memcpy(&v, a.data.data() + size_t(i) * sizeof(T), sizeof(T));
  return v;
}

bool is_integer(NpyDType t) { return t != NpyDType::kF32 && t != NpyDType::kF64; }

// Element i of an integer or bool array (is_integer(a.dtype)) as int64.
int64_t integer_element(const NpyArray& a, int64_t i) {
  switch (a.dtype) {
    case NpyDType::kI32:
      return element<int32_t>(a, i);
    case NpyDType::kI64:
      return element<int64_t>(a, i);
    case NpyDType::kU16:
      return element<uint16_t>(a, i);
    case NpyDType::kU8:
      return element<uint8_t>(a, i);
    case NpyDType::kBool:
      return element<uint8_t>(a, i) != 0;
    case NpyDType::kF32:
    case NpyDType::kF64:
      break;
  }
  MOED_CHECK(false, "integer_element on ", npy_descr(a.dtype));
  return 0;
}

// NpyArrays built by hand must still hold as many bytes as their shape says.
Status check_size(const NpyArray& a) {
  const uint64_t need = uint64_t(a.num_elements()) * npy_dtype_size(a.dtype);
  if (a.data.size() != need) {
    return invalid_argument(a.name, ": ", a.data.size(), " data bytes for shape ", a.shape_string(),
                            " of ", npy_descr(a.dtype), " (expected ", need, ")");
  }
  return ok_status();
}

Status wrong_dtype(const NpyArray& a, const char* as, const char* expected) {
  return invalid_argument(a.name, ": dtype '", npy_descr(a.dtype), "' cannot be read as ", as,
                          " (expected one of ", expected, ")");
}

// Integer conversions with a range check on every value.
template <typename T>
StatusOr<std::vector<T>> to_integers(const NpyArray& a, const char* as, const char* expected,
                                     int64_t lo, int64_t hi) {
  MOED_RETURN_IF_ERROR(check_size(a));
  const int64_t n = a.num_elements();
  if (!is_integer(a.dtype)) return wrong_dtype(a, as, expected);
  std::vector<T> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t v = integer_element(a, i);
    if (v < lo || v > hi) {
      return invalid_argument(a.name, ": value", index_string(a.shape, i), " = ", v,
                              " does not fit ", as, " [", lo, ", ", hi, "]");
    }
    out[size_t(i)] = T(v);
  }
  return out;
}

// Float conversions: an array of T is copied; one of the other float type, Other, is
// converted, and a value that does not convert exactly is an error.
template <typename T, typename Other>
StatusOr<std::vector<T>> to_floats(const NpyArray& a, NpyDType same, NpyDType other, const char* as,
                                   const char* expected) {
  MOED_RETURN_IF_ERROR(check_size(a));
  const int64_t n = a.num_elements();
  std::vector<T> out(static_cast<size_t>(n));
  if (a.dtype == same) {
    if (n) std::memcpy(out.data(), a.data.data(), size_t(n) * sizeof(T));
    return out;
  }
  if (a.dtype != other) return wrong_dtype(a, as, expected);
  for (int64_t i = 0; i < n; ++i) {
    const Other d = element<Other>(a, i);
    const T f = T(d);
    if (Other(f) != d && !std::isnan(d)) {
      return invalid_argument(a.name, ": value", index_string(a.shape, i), " = ", d,
                              " is not exactly a ", as);
    }
    out[size_t(i)] = f;
  }
  return out;
}

}  // namespace

const char* npy_descr(NpyDType t) { return enum_name(kDescrs, t, "?"); }

size_t npy_dtype_size(NpyDType t) {
  switch (t) {
    case NpyDType::kF64:
    case NpyDType::kI64:
      return 8;
    case NpyDType::kF32:
    case NpyDType::kI32:
      return 4;
    case NpyDType::kU16:
      return 2;
    case NpyDType::kBool:
    case NpyDType::kU8:
      return 1;
  }
  return 0;
}

int64_t NpyArray::num_elements() const {
  // NOTE: a zero anywhere makes the product 0; multiplying in order first could overflow
  // (shape (760, 1005, ..., 0) is a valid empty array the parser accepts).
  for (int64_t d : shape) {
    if (d == 0) return 0;
  }
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string NpyArray::shape_string() const { return shape_to_string(shape); }

StatusOr<NpyArray> parse_npy(std::span<const uint8_t> bytes, const std::string& name) {
  if (bytes.size() < 10 || std::memcmp(bytes.data(), kMagic, kMagicLen) != 0) {
    return invalid_argument(name, ": not a .npy file (it does not start with \\x93NUMPY)");
  }
  const int major = bytes[6], minor = bytes[7];
  if (major < 1 || major > 3 || minor != 0) {
    return invalid_argument(name, ": .npy format version ", major, ".", minor,
                            " is not supported (expected 1.0, 2.0 or 3.0)");
  }
  const size_t len_bytes = major == 1 ? 2 : 4;
  const size_t header_begin = kMagicLen + 2 + len_bytes;
  if (bytes.size() < header_begin) {
    return invalid_argument(name, ": truncated .npy preamble (", bytes.size(), " bytes)");
  }
  const size_t header_len = read_le(bytes.data() + kMagicLen + 2, int(len_bytes));
  if (header_len > bytes.size() - header_begin) {
    return invalid_argument(name, ": truncated .npy header (it declares ", header_len,
                            " bytes; the file has ", bytes.size() - header_begin, ")");
  }
  const std::string_view header(reinterpret_cast<const char*>(bytes.data()) + header_begin,
                                header_len);
  NpyArray a;
  a.name = name;
  MOED_RETURN_IF_ERROR(HeaderParser(header, name).parse(&a));
  const size_t elem = npy_dtype_size(a.dtype);
  MOED_ASSIGN_OR_RETURN(const int64_t n, checked_num_elements(a.shape, elem, name));
  const uint64_t need = uint64_t(n) * elem;
  const size_t data_begin = header_begin + header_len;
  const uint64_t have = bytes.size() - data_begin;
  if (have < need) {
    return invalid_argument(name, ": truncated data (shape ", a.shape_string(), " of ",
                            npy_descr(a.dtype), " needs ", need, " bytes; the file has ", have,
                            ")");
  }
  if (have > need) {
    return invalid_argument(name, ": ", have - need, " unexpected bytes after the data (shape ",
                            a.shape_string(), " of ", npy_descr(a.dtype), " needs ", need, ")");
  }
  a.data.assign(bytes.begin() + std::ptrdiff_t(data_begin), bytes.end());
  return a;
}

StatusOr<NpyArray> read_npy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return invalid_argument(path, ": cannot open (", std::strerror(errno), ")");
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)),
                             std::istreambuf_iterator<char>());
  if (in.bad()) return internal_error(path, ": read failed (", std::strerror(errno), ")");
  return parse_npy(bytes, path);
}

StatusOr<std::vector<uint8_t>> encode_npy(NpyDType dtype, std::span<const int64_t> shape,
                                          const void* data) {
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) return invalid_argument("shape[", i, "] = ", shape[i], " is negative");
  }
  const size_t elem = npy_dtype_size(dtype);
  MOED_ASSIGN_OR_RETURN(const int64_t n, checked_num_elements(shape, elem, "write_npy"));
  const size_t nbytes = size_t(n) * elem;
  if (nbytes > 0 && data == nullptr) {
    return invalid_argument("write_npy: data is null for shape ", shape_to_string(shape));
  }
  // Laid out as numpy.save does: sorted keys, spare room to grow shape[0], padding to 64.
  std::string dict = str_cat("{'descr': '", npy_descr(dtype),
                             "', 'fortran_order': False, 'shape': ", shape_to_string(shape), ", }");
  if (!shape.empty()) {
    const size_t digits = std::to_string(shape[0]).size();
    if (digits < kGrowthDigits) dict.append(kGrowthDigits - digits, ' ');
  }
  // Version 1.0 stores the header length in 16 bits; 2.0 in 32.
  auto padded = [&](size_t preamble) {
    return dict.size() + 1 + (kAlign - (preamble + dict.size() + 1) % kAlign) % kAlign;
  };
  const int major = padded(kMagicLen + 4) <= 0xffff ? 1 : 2;
  const size_t preamble = kMagicLen + 2 + (major == 1 ? 2 : 4);
  const size_t header_len = padded(preamble);
  if (header_len > std::numeric_limits<uint32_t>::max()) {
    return invalid_argument("write_npy: a header of ", header_len, " bytes is too large");
  }
  dict.append(header_len - dict.size() - 1, ' ');
  dict.push_back('\n');
  std::vector<uint8_t> out;
  out.reserve(preamble + dict.size() + nbytes);
  out.insert(out.end(), kMagic, kMagic + kMagicLen);
  out.push_back(uint8_t(major));
  out.push_back(0);
  for (size_t i = 0; i < preamble - kMagicLen - 2; ++i)
    out.push_back(uint8_t(dict.size() >> (8 * i)));
  out.insert(out.end(), dict.begin(), dict.end());
  if (nbytes) {
    const auto* p = static_cast<const uint8_t*>(data);
    out.insert(out.end(), p, p + nbytes);
  }
  return out;
}

Status write_npy(const std::string& path, NpyDType dtype, std::span<const int64_t> shape,
                 const void* data) {
  auto encoded = encode_npy(dtype, shape, data);
  if (!encoded.ok()) return encoded.status().with_context(path);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return invalid_argument(path, ": cannot open for writing (", std::strerror(errno), ")");
  out.write(reinterpret_cast<const char*>(encoded->data()), std::streamsize(encoded->size()));
  out.close();
  if (!out) return internal_error(path, ": write failed (", std::strerror(errno), ")");
  return ok_status();
}

Status write_npy(const std::string& path, NpyDType dtype, std::initializer_list<int64_t> shape,
                 const void* data) {
  return write_npy(path, dtype, std::span<const int64_t>(shape.begin(), shape.size()), data);
}

StatusOr<std::vector<float>> npy_to_f32(const NpyArray& a) {
  return to_floats<float, double>(a, NpyDType::kF32, NpyDType::kF64, "float32", "<f4, <f8");
}

StatusOr<std::vector<double>> npy_to_f64(const NpyArray& a) {
  return to_floats<double, float>(a, NpyDType::kF64, NpyDType::kF32, "float64", "<f8, <f4");
}

StatusOr<std::vector<int32_t>> npy_to_i32(const NpyArray& a) {
  return to_integers<int32_t>(a, "int32", "<i4, <i8, |u1, <u2, |b1",
                              std::numeric_limits<int32_t>::min(),
                              std::numeric_limits<int32_t>::max());
}

StatusOr<std::vector<int64_t>> npy_to_i64(const NpyArray& a) {
  return to_integers<int64_t>(a, "int64", "<i8, <i4, |u1, <u2, |b1",
                              std::numeric_limits<int64_t>::min(),
                              std::numeric_limits<int64_t>::max());
}

StatusOr<std::vector<uint8_t>> npy_to_u8(const NpyArray& a) {
  if (a.dtype == NpyDType::kU16) return wrong_dtype(a, "uint8", "|u1, |b1, <i4, <i8");
  return to_integers<uint8_t>(a, "uint8", "|u1, |b1, <i4, <i8", 0, 255);
}

StatusOr<std::vector<bf16>> npy_to_bf16(const NpyArray& a) {
  MOED_RETURN_IF_ERROR(check_size(a));
  if (a.dtype != NpyDType::kU16) return wrong_dtype(a, "bf16 bit patterns", "<u2");
  std::vector<bf16> out(size_t(a.num_elements()));
  if (!out.empty()) std::memcpy(out.data(), a.data.data(), out.size() * 2);
  return out;
}

}  // namespace moed
