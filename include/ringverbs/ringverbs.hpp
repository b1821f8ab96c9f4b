// Everything of the engine in one include.
#pragma once

#include <ringverbs/detail/config.hpp>

#include <ringverbs/error.hpp>
#include <ringverbs/file_io.hpp>
#include <ringverbs/io_context.hpp>
#include <ringverbs/poll.hpp>
#include <ringverbs/socket.hpp>
#include <ringverbs/task.hpp>
#include <ringverbs/timer.hpp>
#include <ringverbs/when_all.hpp>
