// when_any: race several tasks on one io_context; the first to finish wins, the others are
// stopped through their std::stop_token and awaited before when_any returns.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/diagnostics.hpp>
#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/engine/task.hpp>
#include <ringverbs/engine/when_all.hpp>

#include <array>
#include <atomic>
#include <cstddef>
#include <exception>
#include <optional>
#include <stdexcept>
#include <stop_token>
#include <system_error>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace ringverbs {

// What co_await when_any(io, f0, f1, ...) gives: the index of the task that won (its
// factory's position among the arguments) and its value, held in the variant's alternative of
// that same index (std::monostate for a task<void>).
template <typename... Ts>
struct when_any_result {
    std::size_t index;
    std::variant<std::conditional_t<std::is_void_v<Ts>, std::monostate, Ts>...> value;
};

// What co_await when_any(io, n, factory) gives for tasks of one type T (not void): the index of
// the task that won and its value.
template <typename T>
struct when_any_winner {
    std::size_t index;
    T value;
};

namespace detail {

// The race between when_any's children. Invariants:
// - A child stores its outcome (value or exception) in its slot, then sets its `done` flag
//   (release). The first child to get there (`deciding`) becomes the decider; the others end.
// - The decider does not decide at once: it goes to the back of the loop (io.schedule()), so
//   that every task ending in the same loop turn has ended by then. The winner is the lowest
//   index done at that point: a tie is decided by position, never by the order in which the
//   kernel posted the completions. Only then is stop requested: losers' waits end cancelled.
// - `winner` is written once, by the decider, before it ends; the parent reads it after the
//   latch reached zero, which the decider's end takes part in (acq_rel).
// - The parent resumes only when every child ended, so no task frame outlives the co_await.
struct when_any_race {
    when_any_race(io_context& ctx, std::atomic<bool>* flags, std::size_t children)
        : io(&ctx), done(flags), latch{children + 1, {}, {}} {}

    io_context* io;
    std::atomic<bool>* done; // one flag per child, in when_any's frame
    std::stop_source stop;   // its token goes to every factory
    when_all_latch latch;    // children still running, plus the parent while it starts them
    std::atomic<bool> deciding{false};
    std::size_t winner = 0;

    void decide() noexcept {
        std::size_t w = 0;
        while (!done[w].load(std::memory_order_acquire)) // the decider's own flag is set
            ++w;
        winner = w;
        stop.request_stop();
    }
};

template <typename V>
struct when_any_slot {
    std::optional<V> value;
    std::exception_ptr error;
};

// Forwards a stop of the awaiting coroutine's token to every task of the race.
struct when_any_forward_stop {
    std::stop_source* to;
    void operator()() const noexcept { to->request_stop(); }
};

template <bool Indexed, typename F>
auto make_raced_task(F& factory, std::size_t index, std::stop_token token) {
    if constexpr (Indexed)
        return factory(index, std::move(token));
    else
        return factory(std::move(token));
}

// The factory is when_any's (it lives in its frame): a lambda coroutine's captures stay valid
// for as long as its task runs. The task is a local of this frame, destroyed before `done`.
template <bool Indexed, typename F, typename V>
when_all_child run_raced(when_any_race& race, std::size_t index, F& factory,
                         when_any_slot<V>& slot) {
    try {
        auto t = make_raced_task<Indexed>(factory, index, race.stop.get_token());
        if constexpr (std::is_void_v<typename decltype(t)::value_type>) {
            co_await std::move(t);
            slot.value.emplace();
        } else {
            slot.value.emplace(co_await std::move(t));
        }
    } catch (...) {
        slot.error = std::current_exception();
    }
    race.done[index].store(true, std::memory_order_release);
    if (!race.deciding.exchange(true, std::memory_order_acq_rel)) {
        co_await race.io->schedule(); // let every task that ends in this loop turn end
        race.decide();
    }
}

// A loser's exception cannot reach the awaiter: a cancellation (what a stopped wait throws) is
// expected and dropped; anything else is one line to the diagnostics sink.
inline void report_lost(std::size_t index, std::size_t winner,
                        const std::exception_ptr& error) noexcept {
    if (!error || index == winner) return;
    try {
        std::rethrow_exception(error);
    } catch (const std::system_error& e) {
        if (e.code() == std::errc::operation_canceled) return;
        diagnose("when_any: task %zu failed after task %zu won: %s", index, winner, e.what());
    } catch (const std::exception& e) {
        diagnose("when_any: task %zu failed after task %zu won: %s", index, winner, e.what());
    } catch (...) {
        diagnose("when_any: task %zu failed after task %zu won (not a std::exception)", index,
                 winner);
    }
}

template <typename F, typename... Args>
using raced_value_t = typename std::invoke_result_t<F&, Args...>::value_type;

template <std::size_t... I, typename... Fs>
task<when_any_result<raced_value_t<Fs, std::stop_token>...>>
race_tasks(std::index_sequence<I...>, io_context& io, std::stop_token outer, Fs... factories) {
    using result = when_any_result<raced_value_t<Fs, std::stop_token>...>;
    std::array<std::atomic<bool>, sizeof...(Fs)> done{};
    when_any_race race(io, done.data(), sizeof...(Fs));
    std::tuple<when_any_slot<when_all_value_t<raced_value_t<Fs, std::stop_token>>>...> slots;
    auto children = std::tuple{run_raced<false>(race, I, factories, std::get<I>(slots))...};
    {
        std::stop_callback<when_any_forward_stop> forward(outer, when_any_forward_stop{&race.stop});
        co_await start_all<decltype(children)>{race.latch, children};
    }
    const std::size_t w = race.winner;
    (report_lost(I, w, std::get<I>(slots).error), ...);
    std::exception_ptr error;
    ((I == w ? (void)(error = std::get<I>(slots).error) : void()), ...);
    if (error) std::rethrow_exception(error);
    std::optional<decltype(result::value)> value;
    ((I == w ? (void)value.emplace(std::in_place_index<I>, std::move(*std::get<I>(slots).value))
             : void()),
     ...);
    co_return result{w, std::move(*value)};
}

template <typename F>
task<std::conditional_t<std::is_void_v<raced_value_t<F, std::size_t, std::stop_token>>, std::size_t,
                        when_any_winner<raced_value_t<F, std::size_t, std::stop_token>>>>
race_indexed(io_context& io, std::stop_token outer, std::size_t count, F factory) {
    using T = raced_value_t<F, std::size_t, std::stop_token>;
    if (count == 0) throw std::invalid_argument("ringverbs::when_any: no task to race");
    std::vector<std::atomic<bool>> done(count);
    when_any_race race(io, done.data(), count);
    std::vector<when_any_slot<when_all_value_t<T>>> slots(count);
    std::vector<when_all_child> children;
    children.reserve(count);
    for (std::size_t i = 0; i < count; ++i)
        children.push_back(run_raced<true>(race, i, factory, slots[i]));
    {
        std::stop_callback<when_any_forward_stop> forward(outer, when_any_forward_stop{&race.stop});
        co_await start_all<decltype(children)>{race.latch, children};
    }
    const std::size_t w = race.winner;
    for (std::size_t i = 0; i < count; ++i)
        report_lost(i, w, slots[i].error);
    if (slots[w].error) std::rethrow_exception(slots[w].error);
    if constexpr (std::is_void_v<T>)
        co_return w;
    else
        co_return when_any_winner<T>{w, std::move(*slots[w].value)};
}

} // namespace detail

// co_await when_any(io, f0, f1, ...): races tasks on `io`, the context the awaiting coroutine
// runs on. Each factory is called once, with a std::stop_token, as its task starts (in argument
// order, inside the co_await), and returns a task<T> that observes the token (passes it to its
// awaits: `sleep_for(io, 5s, token)`, `recv(io, fd, buf, token)`):
//
//   auto r = co_await when_any(io,
//       [&](std::stop_token st) { return recv_reply(io, fd, st); },        // task<reply>
//       [&](std::stop_token st) -> task<void> { co_await sleep_for(io, 1s, st); });
//   if (r.index == 1) ...; // timed out; else std::get<0>(r.value) is the reply
//
// - The first task to finish, with a value or an exception, wins. Tasks that finish in the same
//   loop turn (synchronously while they start, or resumed in the same turn) tie, and the lowest
//   index of them wins. The winner is known one loop turn after it finished.
// - Then the token is stopped, and when_any waits until every other task has ended: when it
//   resumes, no task of it runs and every task frame is destroyed. A task that ignores its token
//   delays when_any until it ends on its own.
// - Gives the winner's index and value, or rethrows the winner's exception. The losers' values
//   are dropped, and so are their std::errc::operation_canceled errors (what a stopped wait
//   throws); any other exception of a loser goes to the diagnostics sink as one line
//   ("when_any: task 1 failed after task 0 won: ..."), since no awaiter can receive it.
// - The factories live in when_any's frame until it ends: a lambda coroutine's captures stay
//   valid while its task runs.
// - Allocates the coroutine frames (when_any's, one per task and the tasks' own) and the
//   std::stop_source's shared state (C++20 has no allocation-free stop source), nothing else.
// - The tasks should end on `io`'s thread; like when_all, the awaiting coroutine resumes on the
//   thread the last task ended on.
template <typename... Fs>
requires(sizeof...(Fs) > 0 && (std::is_invocable_v<Fs&, std::stop_token> && ...))
    task<when_any_result<typename std::invoke_result_t<
        Fs&, std::stop_token>::value_type...>> when_any(io_context& io, Fs... factories) {
    return detail::race_tasks(std::index_sequence_for<Fs...>{}, io, std::stop_token{},
                              std::move(factories)...);
}

// The same, and a stop of `stop` (the awaiting coroutine's own token) stops every task too:
// they end cancelled, and the first of them to end wins as above (its operation_canceled is
// rethrown, unless it finished with a value before the stop reached it).
template <typename... Fs>
requires(sizeof...(Fs) > 0 && (std::is_invocable_v<Fs&, std::stop_token> && ...))
    task<when_any_result<typename std::invoke_result_t<
        Fs&, std::stop_token>::value_type...>> when_any(io_context& io, std::stop_token stop,
                                                        Fs... factories) {
    return detail::race_tasks(std::index_sequence_for<Fs...>{}, io, std::move(stop),
                              std::move(factories)...);
}

// co_await when_any(io, n, factory): races n tasks of one type, task i made by
// factory(i, token); the rules above hold. Gives when_any_winner<T>{index, value}, or only the
// index for task<void>. Throws std::invalid_argument for n == 0. Allocates, besides the frames,
// the stop source's state and three arrays of n (like when_all over a vector).
template <typename F>
requires std::is_invocable_v<F&, std::size_t, std::stop_token> task<std::conditional_t<
    std::is_void_v<typename std::invoke_result_t<F&, std::size_t, std::stop_token>::value_type>,
    std::size_t,
    when_any_winner<typename std::invoke_result_t<F&, std::size_t, std::stop_token>::value_type>>>
when_any(io_context& io, std::size_t n, F factory) {
    return detail::race_indexed(io, std::stop_token{}, n, std::move(factory));
}

// The same, stopped also by `stop`, the awaiting coroutine's own token.
template <typename F>
requires std::is_invocable_v<F&, std::size_t, std::stop_token> task<std::conditional_t<
    std::is_void_v<typename std::invoke_result_t<F&, std::size_t, std::stop_token>::value_type>,
    std::size_t,
    when_any_winner<typename std::invoke_result_t<F&, std::size_t, std::stop_token>::value_type>>>
when_any(io_context& io, std::stop_token stop, std::size_t n, F factory) {
    return detail::race_indexed(io, std::move(stop), n, std::move(factory));
}

} // namespace ringverbs
