// What a test does less of under ThreadSanitizer.
//
// ThreadSanitizer runs code 5-15x slower. It looks for unordered accesses between threads, so
// it needs every kind of step the threads take, not the long loops and largest shapes that
// the Release and ASan+UBSan passes (scripts/test.sh) run in full: under it, loops that hunt
// rare orders run fewer rounds, and code with no threads of its own is left to those passes.
#pragma once

namespace moed::testing {

#ifdef __SANITIZE_THREAD__
inline constexpr bool kUnderTsan = true;
#else
inline constexpr bool kUnderTsan = false;
#endif

}  // namespace moed::testing
