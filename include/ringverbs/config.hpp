// Included first by every ringverbs header: a consumer compiling in an older C++ gets one clear
// error instead of a wall of errors from <coroutine>, concepts and designated initializers.
#pragma once

#if __cplusplus < 202002L
#error "ringverbs needs C++20 (coroutines): compile with -std=c++20 or meson's cpp_std=c++20"
// A missing include is fatal in GCC and Clang: compilation stops here, after the line above.
#include <ringverbs-needs-cpp20>
#endif

// On a parameter: the function's result refers to the argument, so a result kept in a variable
// past the full expression of a temporary argument dangles. Clang warns (-Wdangling); other
// compilers ignore it.
#if defined(__clang__) && defined(__has_cpp_attribute)
#if __has_cpp_attribute(clang::lifetimebound)
#define RINGVERBS_LIFETIMEBOUND [[clang::lifetimebound]]
#endif
#endif
#ifndef RINGVERBS_LIFETIMEBOUND
#define RINGVERBS_LIFETIMEBOUND
#endif
