// .npy: fixtures written by NumPy (data/make_fixtures.py), round trips through write_npy,
// byte-for-byte agreement with numpy.save, and every error with its message.
#include "moed/npy.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

namespace moed {
namespace {

std::string fixture(const std::string& name) {
  return std::string(MOED_NPY_TEST_DATA) + "/" + name;
}

std::vector<uint8_t> file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("moed_npy_test_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

// A .npy image with a hand-written header (version 1.0 unless told).
std::vector<uint8_t> make_npy(const std::string& header, size_t data_bytes, int major = 1) {
  std::vector<uint8_t> b = {0x93, 'N', 'U', 'M', 'P', 'Y', uint8_t(major), 0};
  const size_t len_bytes = major == 1 ? 2 : 4;
  for (size_t i = 0; i < len_bytes; ++i) b.push_back(uint8_t(header.size() >> (8 * i)));
  b.insert(b.end(), header.begin(), header.end());
  b.resize(b.size() + data_bytes, 0);
  return b;
}

std::string parse_error(const std::vector<uint8_t>& bytes) {
  auto r = parse_npy(bytes, "x.npy");
  EXPECT_FALSE(r.ok());
  return r.ok() ? "" : r.status().message();
}

TEST(NpyRead, NumpyFixtures) {
  auto a = read_npy(fixture("f4_2x3.npy"));
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_EQ(a->dtype, NpyDType::kF32);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a->shape_string(), "(2, 3)");
  EXPECT_EQ(*npy_to_f32(*a), (std::vector<float>{-1.0f, -0.5f, 0.0f, 0.5f, 1.0f, 1.5f}));
  EXPECT_EQ(*npy_to_f64(*a), (std::vector<double>{-1.0, -0.5, 0.0, 0.5, 1.0, 1.5}));

  auto f8 = read_npy(fixture("f8_exact.npy"));
  ASSERT_TRUE(f8.ok());
  EXPECT_EQ(f8->dtype, NpyDType::kF64);
  const auto f = *npy_to_f32(*f8);
  EXPECT_EQ(f[0], 0.5f);
  EXPECT_EQ(f[2], 3.0f);
  EXPECT_TRUE(std::isinf(f[3]));

  auto i4 = read_npy(fixture("i4_3.npy"));
  ASSERT_TRUE(i4.ok());
  EXPECT_EQ(*npy_to_i32(*i4), (std::vector<int32_t>{7, -1, 2147483647}));
  EXPECT_EQ(*npy_to_i64(*i4), (std::vector<int64_t>{7, -1, 2147483647}));

  auto i8 = read_npy(fixture("i8_fits.npy"));
  ASSERT_TRUE(i8.ok());
  EXPECT_EQ(*npy_to_i32(*i8), (std::vector<int32_t>{1, -2, 2147483647, -2147483647 - 1}));

  auto b1 = read_npy(fixture("b1_5.npy"));
  ASSERT_TRUE(b1.ok());
  EXPECT_EQ(b1->dtype, NpyDType::kBool);
  EXPECT_EQ(*npy_to_u8(*b1), (std::vector<uint8_t>{1, 0, 1, 1, 0}));
  EXPECT_EQ(*npy_to_i32(*b1), (std::vector<int32_t>{1, 0, 1, 1, 0}));

  auto u1 = read_npy(fixture("u1_2x2x2.npy"));
  ASSERT_TRUE(u1.ok());
  EXPECT_EQ(u1->shape, (std::vector<int64_t>{2, 2, 2}));
  EXPECT_EQ(*npy_to_u8(*u1), (std::vector<uint8_t>{0, 1, 2, 3, 4, 5, 6, 7}));

  auto u2 = read_npy(fixture("u2_bf16.npy"));
  ASSERT_TRUE(u2.ok());
  const auto b = *npy_to_bf16(*u2);
  ASSERT_EQ(b.size(), 4u);
  EXPECT_EQ(bf16_to_float(b[0]), 1.0f);
  EXPECT_EQ(bf16_to_float(b[1]), -2.5f);
  EXPECT_EQ(b[2].bits, 0);
  EXPECT_EQ(b[3].bits, 0x7f80);

  auto scalar = read_npy(fixture("f4_scalar.npy"));
  ASSERT_TRUE(scalar.ok());
  EXPECT_TRUE(scalar->shape.empty());
  EXPECT_EQ(scalar->num_elements(), 1);
  EXPECT_EQ(scalar->shape_string(), "()");
  EXPECT_EQ(*npy_to_f32(*scalar), std::vector<float>{3.25f});

  auto empty = read_npy(fixture("f4_0x4.npy"));
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->shape, (std::vector<int64_t>{0, 4}));
  EXPECT_TRUE(npy_to_f32(*empty)->empty());
  EXPECT_TRUE(npy_to_i32(*read_npy(fixture("i4_3.npy"))).ok());
}

TEST(NpyRead, Versions2And3) {
  for (const char* name : {"i4_v2.npy", "i4_v3.npy"}) {
    auto a = read_npy(fixture(name));
    ASSERT_TRUE(a.ok()) << a.status().to_string();
    EXPECT_EQ(*npy_to_i32(*a), (std::vector<int32_t>{0, 1, 2})) << name;
  }
}

TEST(NpyRead, HeaderVariationsNumpyAccepts) {
  // Keys in any order, double quotes, no trailing comma, spaces, "(3,)" and "(3, )".
  for (const std::string header :
       {"{\"shape\": (3,), \"fortran_order\": False, \"descr\": \"<i4\"}\n",
        "{'descr':'<i4','fortran_order':False,'shape':(3, )}",
        "  { 'descr' : '<i4' , 'fortran_order' : False , 'shape' : ( 3 , ) , }   \n"}) {
    auto a = parse_npy(make_npy(header, 12), "x.npy");
    ASSERT_TRUE(a.ok()) << header << ": " << a.status().to_string();
    EXPECT_EQ(a->shape, std::vector<int64_t>{3});
  }
}

TEST(NpyWrite, MatchesNumpySaveByteForByte) {
  for (const char* name : {"f4_2x3.npy", "f8_exact.npy", "i4_3.npy", "i8_fits.npy", "b1_5.npy",
                           "u1_2x2x2.npy", "u2_bf16.npy", "f4_scalar.npy", "f4_0x4.npy"}) {
    auto a = read_npy(fixture(name));
    ASSERT_TRUE(a.ok()) << name;
    auto encoded = encode_npy(a->dtype, a->shape, a->data.data());
    ASSERT_TRUE(encoded.ok()) << name;
    EXPECT_EQ(*encoded, file_bytes(fixture(name))) << name;
  }
}

TEST(NpyWrite, RoundTripsEveryDType) {
  const std::string path = temp_path("round_trip.npy");
  std::vector<uint8_t> payload(2 * 3 * 4 * 8);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = uint8_t(i * 37 + 1);
  for (NpyDType t : {NpyDType::kF32, NpyDType::kF64, NpyDType::kI32, NpyDType::kI64,
                     NpyDType::kBool, NpyDType::kU16, NpyDType::kU8}) {
    for (const std::vector<int64_t>& shape :
         {std::vector<int64_t>{}, {0}, {5}, {2, 3, 4}, {1, 0, 7}, {12345678, 0}}) {
      ASSERT_TRUE(write_npy(path, t, shape, payload.data()).ok());
      auto a = read_npy(path);
      ASSERT_TRUE(a.ok()) << a.status().to_string();
      EXPECT_EQ(a->dtype, t);
      EXPECT_EQ(a->shape, shape);
      EXPECT_EQ(a->name, path);
      const size_t n = size_t(a->num_elements()) * npy_dtype_size(t);
      ASSERT_EQ(a->data.size(), n);
      if (n) {
        EXPECT_EQ(0, std::memcmp(a->data.data(), payload.data(), n));
      }
      EXPECT_EQ(file_bytes(path).size() % 64, n % 64) << "data starts 64-byte aligned";
    }
  }
  const float two[] = {1.0f, 2.0f};
  ASSERT_TRUE(write_npy(path, NpyDType::kF32, {2}, two).ok());
  EXPECT_EQ(*npy_to_f32(*read_npy(path)), (std::vector<float>{1.0f, 2.0f}));
  std::remove(path.c_str());
}

// Found by the fuzzer: an empty array whose other dims multiply past int64 before the 0.
TEST(NpyRead, EmptyArrayWithHugeOtherDims) {
  const std::vector<int64_t> shape = {760, 1005, 5555, 4555, 455, 555, 4550, 45555, 0};
  auto encoded = encode_npy(NpyDType::kF64, shape, nullptr);
  ASSERT_TRUE(encoded.ok()) << encoded.status().to_string();
  auto a = parse_npy(*encoded, "empty.npy");
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_EQ(a->shape, shape);
  EXPECT_EQ(a->num_elements(), 0);
  EXPECT_TRUE(a->data.empty());
}

TEST(NpyWrite, UsesVersion2WhenTheHeaderDoesNotFit16Bits) {
  const std::vector<int64_t> shape(25000, 1);  // "1, " per dim: a ~75 KB header
  const int32_t v = 42;
  auto encoded = encode_npy(NpyDType::kI32, shape, &v);
  ASSERT_TRUE(encoded.ok());
  EXPECT_EQ((*encoded)[6], 2);
  EXPECT_EQ(encoded->size() % 64, 4u);
  auto a = parse_npy(*encoded, "big.npy");
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_EQ(a->shape, shape);
  EXPECT_EQ(*npy_to_i32(*a), std::vector<int32_t>{42});
  // A small one stays 1.0.
  EXPECT_EQ((*encode_npy(NpyDType::kI32, std::vector<int64_t>{1}, &v))[6], 1);
}

TEST(NpyErrors, Fixtures) {
  EXPECT_EQ(read_npy(fixture("f4_fortran.npy")).status().message(),
            fixture("f4_fortran.npy") + ": fortran_order is True; moed reads C-order arrays only");
  EXPECT_EQ(
      read_npy(fixture("f4_big_endian.npy")).status().message(),
      fixture("f4_big_endian.npy") +
          ": dtype '>f4' is not supported (expected one of <f4, <f8, <i4, <i8, |b1, <u2, |u1)");
  EXPECT_EQ(
      read_npy(fixture("f2.npy")).status().message(),
      fixture("f2.npy") +
          ": dtype '<f2' is not supported (expected one of <f4, <f8, <i4, <i8, |b1, <u2, |u1)");
  EXPECT_EQ(read_npy(fixture("record.npy")).status().message(),
            fixture("record.npy") +
                ": dtype is a structured (record) dtype, which is not supported (expected one of "
                "<f4, <f8, <i4, <i8, |b1, <u2, |u1)");
  const auto missing = read_npy(temp_path("does_not_exist.npy"));
  EXPECT_EQ(missing.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(missing.status().message(),
            temp_path("does_not_exist.npy") + ": cannot open (No such file or directory)");
}

TEST(NpyErrors, Conversions) {
  auto big = *read_npy(fixture("i8_big.npy"));
  EXPECT_EQ(npy_to_i32(big).status().message(),
            fixture("i8_big.npy") +
                ": value[2] = 1099511627776 does not fit int32 [-2147483648, 2147483647]");
  EXPECT_EQ(npy_to_u8(*read_npy(fixture("i4_3.npy"))).status().message(),
            fixture("i4_3.npy") + ": value[1] = -1 does not fit uint8 [0, 255]");
  EXPECT_EQ(npy_to_f32(*read_npy(fixture("f8_inexact.npy"))).status().message(),
            fixture("f8_inexact.npy") + ": value[1][0] = 0.1 is not exactly a float32");
  EXPECT_EQ(npy_to_i32(*read_npy(fixture("f4_2x3.npy"))).status().message(),
            fixture("f4_2x3.npy") +
                ": dtype '<f4' cannot be read as int32 (expected one of <i4, <i8, |u1, <u2, |b1)");
  EXPECT_EQ(npy_to_bf16(*read_npy(fixture("i4_3.npy"))).status().message(),
            fixture("i4_3.npy") +
                ": dtype '<i4' cannot be read as bf16 bit patterns (expected one of <u2)");
  EXPECT_EQ(
      npy_to_f32(*read_npy(fixture("i4_3.npy"))).status().message(),
      fixture("i4_3.npy") + ": dtype '<i4' cannot be read as float32 (expected one of <f4, <f8)");
  NpyArray hand{"hand", NpyDType::kF32, {2}, std::vector<uint8_t>(4)};
  EXPECT_EQ(npy_to_f32(hand).status().message(),
            "hand: 4 data bytes for shape (2,) of <f4 (expected 8)");
}

TEST(NpyErrors, MalformedFiles) {
  const std::string ok = "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }\n";
  ASSERT_TRUE(parse_npy(make_npy(ok, 8), "x.npy").ok());

  EXPECT_EQ(parse_error({'P', 'K', 3, 4}),
            "x.npy: not a .npy file (it does not start with \\x93NUMPY)");
  auto v4 = make_npy(ok, 8);
  v4[6] = 4;
  EXPECT_EQ(parse_error(v4),
            "x.npy: .npy format version 4.0 is not supported (expected 1.0, 2.0 or 3.0)");
  auto short_header = make_npy(ok, 0);
  short_header.resize(30);
  EXPECT_EQ(parse_error(short_header),
            "x.npy: truncated .npy header (it declares 58 bytes; the file has 20)");
  auto v2_preamble = make_npy(ok, 0, 2);
  v2_preamble.resize(11);
  EXPECT_EQ(parse_error(v2_preamble), "x.npy: truncated .npy preamble (11 bytes)");
  EXPECT_EQ(parse_error(make_npy(ok, 7)),
            "x.npy: truncated data (shape (2,) of <f4 needs 8 bytes; the file has 7)");
  EXPECT_EQ(parse_error(make_npy(ok, 9)),
            "x.npy: 1 unexpected bytes after the data (shape (2,) of <f4 needs 8)");
  // Headers with no data after them that do not parse, and the message for each.
  const std::pair<std::string, std::string> bad_headers[] = {
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387904, 2), }",
       "x.npy: shape (4611686018427387904, 2) is too large (its byte count overflows int64)"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }",
       "x.npy: shape has a negative dimension"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }",
       "x.npy: a shape dimension does not fit int64"},
      {"{'descr': '<f4', 'fortran_order': False}", "x.npy: malformed .npy header (no 'shape' key)"},
      {"{'descr': '<f4', 'descr': '<f4'}",
       "x.npy: malformed .npy header (key 'descr' appears twice at offset 26)"},
      {"{'descr': '<f4', 'extra': 1}",
       "x.npy: malformed .npy header (unexpected key 'extra' at offset 26)"},
      {"{'descr' '<f4'}", "x.npy: malformed .npy header (expected ':' at offset 9)"},
      {"{'descr': '<f4", "x.npy: malformed .npy header (unterminated string at offset 10)"},
      {"{'fortran_order': 0}",
       "x.npy: malformed .npy header (expected True or False at offset 18)"},
      {"{'shape': (2 3)}",
       "x.npy: malformed .npy header (expected ',' or ')' in the shape at offset 13)"},
      {"", "x.npy: malformed .npy header (expected '{' at offset 0)"},
  };
  for (const auto& [header, message] : bad_headers) {
    EXPECT_EQ(parse_error(make_npy(header, 0)), message) << header;
  }
  EXPECT_EQ(parse_error(make_npy(ok + "x", 8)),
            "x.npy: malformed .npy header (unexpected text after '}' at offset 58)");
}

TEST(NpyErrors, Writing) {
  const float v = 1.0f;
  EXPECT_EQ(write_npy("w.npy", NpyDType::kF32, {2, -3}, &v).message(),
            "w.npy: shape[1] = -3 is negative");
  EXPECT_EQ(write_npy("w.npy", NpyDType::kF32, {2}, nullptr).message(),
            "w.npy: write_npy: data is null for shape (2,)");
  EXPECT_EQ(write_npy("/nonexistent-dir/w.npy", NpyDType::kF32, {1}, &v).message(),
            "/nonexistent-dir/w.npy: cannot open for writing (No such file or directory)");
  EXPECT_TRUE(encode_npy(NpyDType::kF32, std::vector<int64_t>{0}, nullptr).ok());
}

}  // namespace
}  // namespace moed
