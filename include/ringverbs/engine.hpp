// The io_uring engine in one include: tasks, the io_context, polls, timers, sockets, files,
// signals (signal_set), when_all, when_any, nothrow. Needs liburing only (link ringverbs-engine).
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/error.hpp>
#include <ringverbs/engine/file_io.hpp>
#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/engine/nothrow.hpp>
#include <ringverbs/engine/poll.hpp>
#include <ringverbs/engine/signal_set.hpp>
#include <ringverbs/engine/socket.hpp>
#include <ringverbs/engine/task.hpp>
#include <ringverbs/engine/timer.hpp>
#include <ringverbs/engine/when_all.hpp>
#include <ringverbs/engine/when_any.hpp>
