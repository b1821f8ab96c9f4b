// How a failed verb becomes a std::system_error. libibverbs mixes three conventions (NULL plus
// errno, -1 plus errno, and the errno as the return value); these helpers hide which one a verb
// uses so every wrapper reports the verb's name and the real errno.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/error.hpp>

#include <cerrno>

namespace ringverbs::verbs {

// Turns the return value of a verb that "returns 0 or the errno" (ibv_modify_qp,
// ibv_req_notify_cq, ibv_post_send, ibv_query_port, ibv_dealloc_pd, ...) into a positive errno,
// or 0 on success. Some providers break the documented convention and return -1 with errno set,
// or -errno; both are folded in so the caller never reports "Unknown error -1".
[[nodiscard]] inline int verb_errno(int ret) noexcept {
    if (ret >= 0) return ret;
    if (ret == -1) return errno != 0 ? errno : EIO;
    return -ret;
}

// Cold path of verb_check(): throws make_system_error(verb_errno(ret), verb). Kept out of line so
// the inline hot paths (post, poll, arm) stay small.
[[noreturn]] void throw_verb_error(int ret, const char* verb);

// Throws a std::system_error naming `verb` when `ret` reports a failure (see verb_errno()).
inline void verb_check(int ret, const char* verb) {
    if (ret != 0) [[unlikely]]
        throw_verb_error(ret, verb);
}

// The errno left by a verb that returned NULL (ibv_alloc_pd, ibv_create_cq, ...). A provider that
// forgets to set errno would otherwise produce a "Success" error; EIO stands in for "unknown".
[[nodiscard]] inline int errno_or_eio(int saved_errno) noexcept {
    return saved_errno != 0 ? saved_errno : EIO;
}

} // namespace ringverbs::verbs
