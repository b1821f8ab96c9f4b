#include <ringverbs/engine/diagnostics.hpp>
#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/engine/task.hpp>

#include <doctest/doctest.h>

#include <stdexcept>
#include <string>
#include <vector>

using namespace ringverbs;

namespace {

std::vector<std::string> captured;

void capture(std::string_view message) noexcept {
    captured.emplace_back(message);
}

// Restores the default sink whatever the test does.
struct sink_guard {
    diagnostics_sink previous;
    explicit sink_guard(diagnostics_sink s) noexcept : previous(set_diagnostics_sink(s)) {}
    ~sink_guard() { set_diagnostics_sink(previous); }
};

task<void> throws_at_once() {
    throw std::runtime_error("boom");
    co_return;
}

} // namespace

TEST_CASE("a replaced sink receives the library's diagnostics, one line each, without the prefix") {
    captured.clear();
    sink_guard guard(&capture);
    {
        io_context io;
        io.spawn(throws_at_once()); // never run: ~io_context runs it and cannot rethrow it
    }
    REQUIRE(captured.size() == 1);
    CHECK(captured[0] == "exception from a spawned task lost at io_context destruction: boom");
}

TEST_CASE("set_diagnostics_sink returns the previous sink; nullptr restores the default") {
    const diagnostics_sink original = set_diagnostics_sink(&capture);
    const bool original_is_set = original != nullptr;
    const bool original_is_not_ours = original != &capture;
    CHECK(original_is_set);
    CHECK(original_is_not_ours);
    const bool gave_back_ours = set_diagnostics_sink(nullptr) == &capture;
    CHECK(gave_back_ours);
    const bool nullptr_restored_default = set_diagnostics_sink(original) == original;
    CHECK(nullptr_restored_default);
}

TEST_CASE("a diagnostic longer than the buffer is cut, not overflowed") {
    captured.clear();
    sink_guard guard(&capture);
    const std::string long_text(5000, 'x');
    detail::diagnose("%s", long_text.c_str());
    REQUIRE(captured.size() == 1);
    CHECK(captured[0].size() == 1023);
    CHECK(captured[0] == long_text.substr(0, 1023));
}
