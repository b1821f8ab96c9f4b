// nothrow(aw): the same awaits as their throwing form, the failure as a value.
#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/engine/nothrow.hpp>
#include <ringverbs/engine/task.hpp>
#include <ringverbs/engine/timer.hpp>
#include <ringverbs/engine/when_all.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <coroutine>
#include <memory>
#include <new>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <system_error>
#include <tuple>
#include <type_traits>
#include <utility>

using namespace std::chrono_literals;
using namespace ringverbs;

namespace {

task<int> seven() {
    co_return 7;
}

task<int> fails_with(int code, const char* what) {
    throw std::system_error(code, std::system_category(), what);
    co_return 0;
}

task<void> nothing() {
    co_return;
}

task<std::unique_ptr<int>> boxed(int v) {
    co_return std::make_unique<int>(v);
}

task<int> a_bug() {
    throw std::logic_error("a bug, not a failure");
    co_return 0;
}

task<int> out_of_memory() {
    throw std::bad_alloc();
    co_return 0;
}

// An awaitable that is its own awaiter and counts what was done to it, to show that nothrow
// uses an lvalue in place (no copy) and forwards every step.
struct counted {
    int readies = 0, suspends = 0, resumes = 0;
    bool await_ready() {
        ++readies;
        return false;
    }
    bool await_suspend(std::coroutine_handle<>) {
        ++suspends;
        return false; // resume at once
    }
    int await_resume() { return ++resumes; }
};

// Awaitables that fail in await_ready or await_suspend, as ringverbs' own do when a post fails.
struct fails_when_ready {
    bool await_ready() { throw std::system_error(ENOMEM, std::system_category(), "ibv_post_send"); }
    void await_suspend(std::coroutine_handle<>) {}
    int await_resume() { return 1; }
};
struct fails_when_suspending { // void form
    bool await_ready() { return false; }
    void await_suspend(std::coroutine_handle<>) {
        throw std::system_error(ENODEV, std::system_category(), "ibv_post_srq_recv");
    }
    int await_resume() { return 1; }
};
struct fails_when_handing_over { // symmetric transfer form
    bool await_ready() { return false; }
    std::coroutine_handle<> await_suspend(std::coroutine_handle<>) {
        throw std::system_error(EAGAIN, std::system_category(), "io_uring_submit");
    }
    void await_resume() {}
};

task<result<int>> made_elsewhere_and_returned() {
    co_return co_await nothrow(seven());
}

auto wrapped_seven() {
    return nothrow(seven()); // the task is moved into what nothrow returns
}

} // namespace

TEST_CASE("a value: ok(), operator*, value(), no error, empty what()") {
    io_context io;
    auto body = [&]() -> task<void> {
        auto r = co_await nothrow(seven());
        CHECK(r.ok());
        CHECK(static_cast<bool>(r));
        CHECK(*r == 7);
        CHECK(r.value() == 7);
        CHECK(!r.error());
        CHECK(std::string(r.what()).empty());
        CHECK(r.exception() == nullptr);
        auto v = co_await nothrow(nothing());
        CHECK(v.ok());
        v.value(); // does not throw
    };
    io.run(body());
}

TEST_CASE("a std::system_error becomes the result's failure: its code, its message, the "
          "exception; value() throws it as the plain co_await would") {
    io_context io;
    auto body = [&]() -> task<void> {
        auto r = co_await nothrow(fails_with(ETIMEDOUT, "some_verb"));
        CHECK(!r.ok());
        CHECK(r.error() == std::errc::timed_out);
        CHECK(std::string(r.what()).find("some_verb") != std::string::npos);
        CHECK(r.exception() != nullptr);
        CHECK_THROWS_AS(r.value(), std::system_error);
        CHECK_THROWS_AS(r.rethrow_if_failed(), std::system_error);
        // No handler to leave first: the next co_await follows directly.
        auto again = co_await nothrow(seven());
        CHECK(*again == 7);
    };
    io.run(body());
}

TEST_CASE("the engine's own awaits: a sleep cancelled by its stop_token gives "
          "operation_canceled, a sleep that ends gives ok, as result<void>") {
    io_context io;
    std::stop_source stop;
    stop.request_stop();
    auto body = [&]() -> task<void> {
        result<void> cancelled = co_await nothrow(sleep_for(io, 1h, stop.get_token()));
        CHECK(!cancelled);
        CHECK(cancelled.error() == std::errc::operation_canceled);
        CHECK(std::string(cancelled.what()).find("sleep_for") != std::string::npos);
        result<void> slept = co_await nothrow(sleep_for(io, 1ms));
        CHECK(slept.ok());
    };
    io.run(body());
}

TEST_CASE("move-only values; when_all through nothrow") {
    io_context io;
    auto body = [&]() -> task<void> {
        auto r = co_await nothrow(boxed(5));
        REQUIRE(r.ok());
        std::unique_ptr<int> p = std::move(r).value();
        CHECK(*p == 5);
        auto both = co_await nothrow(when_all(seven(), boxed(6)));
        REQUIRE(both.ok());
        CHECK(std::get<0>(*both) == 7);
        CHECK(*std::get<1>(*both) == 6);
        auto one_fails = co_await nothrow(when_all(seven(), fails_with(ECONNRESET, "peer")));
        CHECK(one_fails.error() == std::errc::connection_reset);
    };
    io.run(body());
}

TEST_CASE("std::bad_alloc becomes errc::not_enough_memory; any other exception propagates") {
    io_context io;
    auto body = [&]() -> task<void> {
        auto r = co_await nothrow(out_of_memory());
        CHECK(r.error() == std::errc::not_enough_memory);
        CHECK_THROWS_AS(r.value(), std::bad_alloc);
        bool propagated = false;
        try {
            (void)co_await nothrow(a_bug());
        } catch (const std::logic_error&) {
            propagated = true;
        }
        CHECK(propagated);
    };
    io.run(body());
}

TEST_CASE("a failure thrown by await_ready or await_suspend (a post that fails) is a result "
          "too, and the coroutine goes on at once") {
    io_context io;
    auto body = [&]() -> task<void> {
        auto a = co_await nothrow(fails_when_ready{});
        CHECK(a.error() == std::errc::not_enough_memory);
        CHECK(std::string(a.what()).find("ibv_post_send") != std::string::npos);
        auto b = co_await nothrow(fails_when_suspending{});
        CHECK(b.error() == std::errc::no_such_device);
        auto c = co_await nothrow(fails_when_handing_over{});
        CHECK(c.error() == std::errc::resource_unavailable_try_again);
        CHECK_THROWS_AS(c.value(), std::system_error);
    };
    io.run(body());
}

TEST_CASE("a task (movable) is moved into what nothrow returns: it may be kept, returned and "
          "awaited later") {
    io_context io;
    auto body = [&]() -> task<void> {
        auto kept = nothrow(seven());
        auto r = co_await std::move(kept);
        CHECK(*r == 7);
        auto w = co_await wrapped_seven();
        CHECK(*w == 7);
        auto m = co_await made_elsewhere_and_returned();
        CHECK(*m == 7);
    };
    io.run(body());
}

TEST_CASE("an lvalue awaitable is used in place; every step is forwarded") {
    io_context io;
    counted c;
    auto body = [&]() -> task<void> {
        auto r = co_await nothrow(c);
        CHECK(*r == 1);
    };
    io.run(body());
    CHECK(c.readies == 1);
    CHECK(c.suspends == 1);
    CHECK(c.resumes == 1);
}

// `auto n = nothrow(aw); co_await n;` does not compile (what nothrow returns is awaited once,
// as an rvalue); `co_await nothrow(aw)` does. An lvalue or an awaitable that cannot move is
// referred to, a movable one (a task) owned: the test above awaits one later.
template <typename T, typename = void>
struct awaitable_as_lvalue : std::false_type {};
template <typename T>
struct awaitable_as_lvalue<T, std::void_t<decltype(std::declval<T&>().operator co_await())>>
    : std::true_type {};
template <typename T, typename = void>
struct awaitable_as_rvalue : std::false_type {};
template <typename T>
struct awaitable_as_rvalue<T, std::void_t<decltype(std::declval<T&&>().operator co_await())>>
    : std::true_type {};
static_assert(!awaitable_as_lvalue<detail::nothrow_awaitable<counted&>>::value);
static_assert(awaitable_as_rvalue<detail::nothrow_awaitable<counted&>>::value);
