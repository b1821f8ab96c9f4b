// task<T>: the coroutine type of ringverbs. Lazy (starts when awaited), move-only, one
// awaiter. An exception thrown in the task reaches the awaiter from co_await.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/error.hpp>

#include <atomic>
#include <coroutine>
#include <exception>
#include <new>
#include <stdexcept>
#include <type_traits>
#include <utility>

namespace ringverbs {

template <typename T = void>
class task;

namespace detail {

// The awaiter of a task and the task's final suspend race to set `done_`:
// - the awaiter starts the child inside await_suspend; if the child runs to its end before
//   await_suspend returns, the awaiter sees `done_` already set and does not suspend at all;
// - otherwise the child, finishing later, sees the flag set by the awaiter and transfers to it.
// A loop of a million synchronously completing co_awaits therefore runs in constant stack
// at any optimisation level (GCC at -O0 does not turn symmetric transfer into a tail call),
// while asynchronous completions still resume the awaiter by symmetric transfer.
class task_promise_base {
  public:
    std::suspend_always initial_suspend() noexcept { return {}; }

    struct final_awaiter {
        bool await_ready() noexcept { return false; }
        template <typename Promise>
        std::coroutine_handle<> await_suspend(std::coroutine_handle<Promise> self) noexcept {
            task_promise_base& p = self.promise();
            if (p.done_.exchange(true, std::memory_order_acq_rel)) return p.continuation_;
            return std::noop_coroutine();
        }
        void await_resume() noexcept {}
    };
    final_awaiter final_suspend() noexcept { return {}; }

    void unhandled_exception() noexcept { exception_ = std::current_exception(); }

    // Called by the awaiter: starts the task. Returns true when the awaiter must suspend
    // (the task is still running), false when the task already finished.
    bool start(std::coroutine_handle<> self, std::coroutine_handle<> continuation) noexcept {
        continuation_ = continuation;
        self.resume();
        return !done_.exchange(true, std::memory_order_acq_rel);
    }

  protected:
    void rethrow_if_failed() {
        if (exception_) std::rethrow_exception(exception_);
    }

  private:
    std::coroutine_handle<> continuation_;
    std::exception_ptr exception_;
    std::atomic<bool> done_{false};
};

template <typename T>
class task_promise final : public task_promise_base {
  public:
    task_promise() noexcept {}
    ~task_promise() {
        if (has_value_) value_.~T();
    }

    task<T> get_return_object() noexcept;

    template <typename U>
    requires std::is_convertible_v<U&&, T>
    void return_value(U&& v) noexcept(std::is_nothrow_constructible_v<T, U&&>) {
        ::new (static_cast<void*>(std::addressof(value_))) T(std::forward<U>(v));
        has_value_ = true;
    }

    T take() {
        rethrow_if_failed();
        return std::move(value_);
    }

  private:
    union {
        T value_;
    };
    bool has_value_ = false;
};

template <>
class task_promise<void> final : public task_promise_base {
  public:
    task<void> get_return_object() noexcept;
    void return_void() noexcept {}
    void take() { rethrow_if_failed(); }
};

} // namespace detail

template <typename T>
class [[nodiscard]] task {
  public:
    using promise_type = detail::task_promise<T>;
    using value_type = T;

    task() noexcept = default;
    explicit task(std::coroutine_handle<promise_type> h) noexcept : handle_(h) {}
    task(task&& other) noexcept : handle_(std::exchange(other.handle_, {})) {}
    task& operator=(task&& other) noexcept {
        if (this != &other) {
            if (handle_) handle_.destroy();
            handle_ = std::exchange(other.handle_, {});
        }
        return *this;
    }
    task(const task&) = delete;
    task& operator=(const task&) = delete;
    ~task() {
        if (handle_) handle_.destroy();
    }

    // True when this task holds a coroutine (not default-constructed or moved from).
    explicit operator bool() const noexcept { return static_cast<bool>(handle_); }

    // co_await runs the task and gives its result, or rethrows its exception. A task can be
    // awaited once.
    auto operator co_await() && noexcept {
        struct awaiter {
            std::coroutine_handle<promise_type> h;
            bool await_ready() const noexcept { return !h; }
            bool await_suspend(std::coroutine_handle<> caller) noexcept {
                return h.promise().start(h, caller);
            }
            T await_resume() {
                if (!h) throw std::logic_error("ringverbs::task: awaited an empty task");
                return h.promise().take();
            }
        };
        return awaiter{handle_};
    }

  private:
    std::coroutine_handle<promise_type> handle_;
};

namespace detail {
template <typename T>
task<T> task_promise<T>::get_return_object() noexcept {
    return task<T>{std::coroutine_handle<task_promise<T>>::from_promise(*this)};
}
inline task<void> task_promise<void>::get_return_object() noexcept {
    return task<void>{std::coroutine_handle<task_promise<void>>::from_promise(*this)};
}
} // namespace detail

} // namespace ringverbs
