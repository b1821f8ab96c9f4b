// when_all: run several tasks concurrently on the current context and wait for all of them.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/task.hpp>

#include <atomic>
#include <coroutine>
#include <cstddef>
#include <exception>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace ringverbs {

namespace detail {

// Spelled out in when_all's signature too (public signatures name no detail type).
template <typename T>
using when_all_value_t = std::conditional_t<std::is_void_v<T>, std::monostate, T>;

// Counts the children still running, plus one for the parent while it starts them: whoever
// brings it to zero resumes the parent (or, if that is the parent itself, it does not suspend).
struct when_all_latch {
    std::atomic<std::size_t> remaining;
    std::coroutine_handle<> parent;
    std::exception_ptr error; // the first exception of a child
};

struct when_all_child_promise {
    when_all_latch* latch = nullptr;
    std::suspend_always initial_suspend() noexcept { return {}; }
    struct final_awaiter {
        bool await_ready() noexcept { return false; }
        std::coroutine_handle<>
        await_suspend(std::coroutine_handle<when_all_child_promise> self) noexcept {
            when_all_latch* l = self.promise().latch;
            if (l->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) return l->parent;
            return std::noop_coroutine();
        }
        void await_resume() noexcept {}
    };
    final_awaiter final_suspend() noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept {
        if (!latch->error) latch->error = std::current_exception();
    }
    std::coroutine_handle<when_all_child_promise> get_return_object() noexcept {
        return std::coroutine_handle<when_all_child_promise>::from_promise(*this);
    }
};

class when_all_child {
  public:
    using promise_type = when_all_child_promise;
    when_all_child(std::coroutine_handle<promise_type> h) noexcept : h_(h) {}
    when_all_child(when_all_child&& o) noexcept : h_(std::exchange(o.h_, {})) {}
    when_all_child& operator=(when_all_child&&) = delete;
    ~when_all_child() {
        if (h_) h_.destroy();
    }
    void start(when_all_latch& latch) noexcept {
        h_.promise().latch = &latch;
        h_.resume();
    }

  private:
    std::coroutine_handle<promise_type> h_;
};

template <typename T>
when_all_child run_child(task<T> t, std::optional<when_all_value_t<T>>& slot) {
    if constexpr (std::is_void_v<T>) {
        co_await std::move(t);
        slot.emplace();
    } else {
        slot.emplace(co_await std::move(t));
    }
}

template <typename Children>
struct start_all {
    when_all_latch& latch;
    Children& children;
    bool await_ready() const noexcept { return false; }
    bool await_suspend(std::coroutine_handle<> parent) noexcept {
        latch.parent = parent;
        if constexpr (requires { children.begin(); }) {
            for (auto& c : children)
                c.start(latch);
        } else {
            std::apply([&](auto&... c) { (c.start(latch), ...); }, children);
        }
        // The parent's own count: if every child already finished, do not suspend.
        return latch.remaining.fetch_sub(1, std::memory_order_acq_rel) != 1;
    }
    void await_resume() const noexcept {}
};

} // namespace detail

// co_await when_all(a(), b(), c()): runs the tasks concurrently and gives a tuple of their
// results (std::monostate for task<void>). Every task runs to its end even when one throws;
// then the first exception is rethrown.
template <typename... Ts>
task<std::tuple<std::conditional_t<std::is_void_v<Ts>, std::monostate, Ts>...>>
when_all(task<Ts>... tasks) {
    detail::when_all_latch latch{sizeof...(Ts) + 1, {}, {}};
    std::tuple<std::optional<detail::when_all_value_t<Ts>>...> slots;
    auto children = std::apply(
        [&](auto&... slot) { return std::tuple{detail::run_child(std::move(tasks), slot)...}; },
        slots);
    co_await detail::start_all<decltype(children)>{latch, children};
    if (latch.error) std::rethrow_exception(latch.error);
    co_return std::apply([](auto&... slot) { return std::tuple{std::move(*slot)...}; }, slots);
}

// co_await when_all(std::move(vector_of_tasks)): the same for a dynamic number of tasks of
// one type; gives their results in order (nothing for task<void>).
template <typename T>
task<std::conditional_t<std::is_void_v<T>, void, std::vector<T>>>
when_all(std::vector<task<T>> tasks) {
    detail::when_all_latch latch{tasks.size() + 1, {}, {}};
    std::vector<std::optional<detail::when_all_value_t<T>>> slots(tasks.size());
    std::vector<detail::when_all_child> children;
    children.reserve(tasks.size());
    for (std::size_t i = 0; i < tasks.size(); ++i)
        children.push_back(detail::run_child(std::move(tasks[i]), slots[i]));
    co_await detail::start_all<decltype(children)>{latch, children};
    if (latch.error) std::rethrow_exception(latch.error);
    if constexpr (!std::is_void_v<T>) {
        std::vector<T> out;
        out.reserve(slots.size());
        for (auto& s : slots)
            out.push_back(std::move(*s));
        co_return out;
    }
}

} // namespace ringverbs
