// nothrow: await without exceptions. `co_await nothrow(aw)` gives a result<T> (T: what
// `co_await aw` gives) holding either the value or the failure the await would have thrown:
// its error_code, its message, the exception itself. Works with every awaitable of ringverbs
// (each reports its failures as std::system_error or a class derived from it:
// completion_error, connection_reset, connection_rejected) and with any other awaitable, in a
// coroutine of any type.
//
//   auto r = co_await nothrow(q.recv(buf, wait_options(5s)));
//   if (!r) {
//       if (r.error() == std::errc::timed_out) ...;  // no try/catch; a co_await may follow
//       log(r.what());
//   } else {
//       use(r->byte_len);
//   }
//
// Only std::system_error (and what derives from it) and std::bad_alloc (as
// errc::not_enough_memory) become a result; any other exception (a bug: std::logic_error, an
// exception of the user's own task) propagates from the co_await as before.
#pragma once

#include <ringverbs/config.hpp>

#include <coroutine>
#include <exception>
#include <new>
#include <optional>
#include <system_error>
#include <type_traits>
#include <utility>

namespace ringverbs {

// The value of an await, or why it failed. Failed: error() is the error_code the await would
// have thrown, what() its message, exception() the exception (rethrow() throws it). value(),
// operator* and operator-> of a failed result: value() throws the failure, the others are
// undefined (check first).
template <typename T>
class result {
  public:
    static_assert(!std::is_reference_v<T>, "ringverbs::result holds values");

    template <typename... Args>
    explicit result(std::in_place_t, Args&&... args)
        : value_(std::in_place, std::forward<Args>(args)...) {}
    result(std::error_code error, std::exception_ptr failure) noexcept
        : error_(error), failure_(std::move(failure)) {}

    bool ok() const noexcept { return value_.has_value(); }
    explicit operator bool() const noexcept { return ok(); }

    T& value() & {
        rethrow_if_failed();
        return *value_;
    }
    const T& value() const& {
        rethrow_if_failed();
        return *value_;
    }
    T&& value() && {
        rethrow_if_failed();
        return std::move(*value_);
    }
    T& operator*() & noexcept { return *value_; }
    const T& operator*() const& noexcept { return *value_; }
    T&& operator*() && noexcept { return std::move(*value_); }
    T* operator->() noexcept { return &*value_; }
    const T* operator->() const noexcept { return &*value_; }

    // The failure's error_code: empty when ok().
    std::error_code error() const noexcept { return error_; }
    // The failure's message (what() of the exception), or "" when ok().
    const char* what() const noexcept { return message_of(failure_); }
    // The exception the await threw, or null when ok().
    std::exception_ptr exception() const noexcept { return failure_; }
    // Throws the failure (as the plain co_await would have); nothing when ok().
    void rethrow_if_failed() const {
        if (failure_) std::rethrow_exception(failure_);
    }

  private:
    static const char* message_of(const std::exception_ptr& e) noexcept {
        if (!e) return "";
        try {
            std::rethrow_exception(e);
        } catch (const std::exception& x) {
            return x.what(); // the object e refers to, alive as long as e
        } catch (...) {
            return "unknown exception";
        }
    }

    std::optional<T> value_;
    std::error_code error_;
    std::exception_ptr failure_;

    template <typename>
    friend class result;
};

// result<void>: the await ended well, or why not.
template <>
class result<void> {
  public:
    result() noexcept = default;
    result(std::error_code error, std::exception_ptr failure) noexcept
        : error_(error), failure_(std::move(failure)) {}

    bool ok() const noexcept { return failure_ == nullptr; }
    explicit operator bool() const noexcept { return ok(); }
    void value() const { rethrow_if_failed(); }
    std::error_code error() const noexcept { return error_; }
    const char* what() const noexcept { return failure_ ? result<int>::message_of(failure_) : ""; }
    std::exception_ptr exception() const noexcept { return failure_; }
    void rethrow_if_failed() const {
        if (failure_) std::rethrow_exception(failure_);
    }

  private:
    std::error_code error_;
    std::exception_ptr failure_;
};

namespace detail {

// The awaiter `co_await a` uses: a's operator co_await (member or free), else a itself.
template <typename A>
decltype(auto) awaiter_of(A&& a) {
    if constexpr (requires { static_cast<A&&>(a).operator co_await(); })
        return static_cast<A&&>(a).operator co_await();
    else if constexpr (requires { operator co_await(static_cast<A&&>(a)); })
        return operator co_await(static_cast<A&&>(a));
    else
        return static_cast<A&&>(a);
}

// The awaiter of `co_await nothrow(a)`. A: the awaitable's type, a reference for an lvalue.
// Holds a's own awaiter (what operator co_await made) or a pointer to a, when a is its own.
// A failure thrown by any of the three steps (ringverbs' awaits post in await_ready or
// await_suspend and may fail there) is kept and given by await_resume; the coroutine is then
// resumed at once, as a plain co_await resumes it to rethrow.
template <typename A>
class nothrow_awaiter {
    using awaiter_type = decltype(awaiter_of(std::declval<A>()));
    static constexpr bool own_awaiter = std::is_reference_v<awaiter_type>;
    using stored = std::conditional_t<own_awaiter, std::remove_reference_t<A>*, awaiter_type>;
    using value_type = std::remove_cvref_t<
        decltype(std::declval<std::remove_reference_t<awaiter_type>&>().await_resume())>;

  public:
    explicit nothrow_awaiter(A&& a) : inner_(make(static_cast<A&&>(a))) {}
    nothrow_awaiter(const nothrow_awaiter&) = delete;
    nothrow_awaiter& operator=(const nothrow_awaiter&) = delete;

    bool await_ready() {
        try {
            return static_cast<bool>(inner().await_ready());
        } catch (...) {
            keep_failure();
            return true; // await_resume gives it
        }
    }
    // The inner await_suspend's form, except that void becomes bool (false: it failed).
    template <typename P>
    auto await_suspend(std::coroutine_handle<P> h) {
        using R = decltype(inner().await_suspend(h));
        if constexpr (std::is_void_v<R>) {
            try {
                inner().await_suspend(h);
                return true;
            } catch (...) {
                keep_failure();
                return false;
            }
        } else if constexpr (std::is_same_v<R, bool>) {
            try {
                return static_cast<bool>(inner().await_suspend(h));
            } catch (...) {
                keep_failure();
                return false;
            }
        } else {
            try {
                return std::coroutine_handle<>(inner().await_suspend(h));
            } catch (...) {
                keep_failure();
                return std::coroutine_handle<>(h);
            }
        }
    }
    result<value_type> await_resume() {
        if (failure_) return result<value_type>(error_, std::move(failure_));
        try {
            if constexpr (std::is_void_v<value_type>) {
                inner().await_resume();
                return result<void>();
            } else {
                return result<value_type>(std::in_place, inner().await_resume());
            }
        } catch (...) {
            keep_failure();
            return result<value_type>(error_, std::move(failure_));
        }
    }

  private:
    // In a handler: keeps a std::system_error (or std::bad_alloc, as errc::not_enough_memory);
    // rethrows anything else.
    void keep_failure() {
        try {
            throw;
        } catch (const std::system_error& e) {
            error_ = e.code();
            failure_ = std::current_exception();
        } catch (const std::bad_alloc&) {
            error_ = std::make_error_code(std::errc::not_enough_memory);
            failure_ = std::current_exception();
        }
    }
    static stored make(A&& a) {
        if constexpr (own_awaiter)
            return &a;
        else
            return awaiter_of(static_cast<A&&>(a));
    }
    decltype(auto) inner() {
        if constexpr (own_awaiter)
            return *inner_;
        else
            return (inner_);
    }

    stored inner_;
    std::error_code error_;
    std::exception_ptr failure_;
};

// Whether nothrow_awaitable<A> holds the awaitable itself (a movable rvalue: a task, what
// when_all gives) rather than referring to it.
template <typename A>
inline constexpr bool nothrow_owns = !std::is_reference_v<A> && std::is_move_constructible_v<A>;

// What nothrow() returns, awaitable once, as an rvalue. A movable rvalue awaitable (a task, what
// when_all gives) is moved in and lives as long as this object; an lvalue, or an awaitable that
// cannot move (ringverbs' own: sleep_for, a qp's request, cq::next, ...), is referred to and
// must outlive the await: `co_await nothrow(aw)` in one expression, where the temporary does.
template <typename A>
class nothrow_awaitable {
    static constexpr bool owns = nothrow_owns<A>;
    using held = std::conditional_t<owns, A, std::remove_reference_t<A>*>;

  public:
    explicit nothrow_awaitable(A&& a) : aw_(hold(static_cast<A&&>(a))) {}
    nothrow_awaitable(const nothrow_awaitable&) = delete;
    nothrow_awaitable& operator=(const nothrow_awaitable&) = delete;

    nothrow_awaiter<A> operator co_await() && {
        return nothrow_awaiter<A>(static_cast<A&&>(get()));
    }

  private:
    static held hold(A&& a) {
        if constexpr (owns)
            return held(static_cast<A&&>(a));
        else
            return &a;
    }
    std::remove_reference_t<A>& get() noexcept {
        if constexpr (owns)
            return aw_;
        else
            return *aw_;
    }

    held aw_;
};

} // namespace detail

// co_await nothrow(aw): aw's value as a result<T>, its system_error as the result's failure.
// Await it in the expression that makes it. A task (any movable awaitable) is moved in, so
// `auto n = nothrow(a_task()); co_await std::move(n);` is fine; ringverbs' own awaitables do
// not move, so the returned object refers to them, and the temporary is gone at the end of the
// full expression: `auto n = nothrow(sleep_for(io, 1s)); co_await std::move(n);` awaits a
// destroyed object. Clang rejects that (-Wdangling, through [[clang::lifetimebound]]); GCC
// does not see it. (`co_await n` on an lvalue never compiles: await the rvalue.)
template <typename A>
requires detail::nothrow_owns<A> detail::nothrow_awaitable<A> nothrow(A&& aw) {
    return detail::nothrow_awaitable<A>(static_cast<A&&>(aw));
}
template <typename A>
requires(!detail::nothrow_owns<A>) detail::nothrow_awaitable<A> nothrow(
    A&& aw RINGVERBS_LIFETIMEBOUND) {
    return detail::nothrow_awaitable<A>(static_cast<A&&>(aw));
}

} // namespace ringverbs
