// diagnostics: where ringverbs says what it cannot report to an awaiter (a QP reset because its
// flushes never came, a channel whose poll failed, an exception lost at ~io_context). Every such
// line goes through one sink; by default it is written to stderr as "ringverbs: <message>".
#pragma once

#include <ringverbs/config.hpp>

#include <string_view>

namespace ringverbs {

// Receives one diagnostic: a single line without the "ringverbs: " prefix or a newline. Called
// on the thread that found the problem (an io_context's thread, mostly), possibly inside the
// loop turn: it must not throw, block for long, or call back into ringverbs.
using diagnostics_sink = void (*)(std::string_view message) noexcept;

// Replaces the sink for the whole process and returns the previous one; nullptr restores the
// default (stderr). Thread-safe; a sink being called keeps running until it returns.
diagnostics_sink set_diagnostics_sink(diagnostics_sink sink) noexcept;

namespace detail {
// Formats (printf-like; at most 1023 characters, longer ones are cut) into a buffer on the
// stack and hands the line to the sink: no allocation.
[[gnu::format(printf, 1, 2)]] void diagnose(const char* format, ...) noexcept;
} // namespace detail

} // namespace ringverbs
