/* error.c - the calling thread's last error message and short names of error codes. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include "tier/base.h"

static _Thread_local char last_msg[1024];

const char *tier_last_error(void) { return last_msg; }

void tier_clear_error(void) { last_msg[0] = '\0'; }

int tier_fail(int code, const char *fmt, ...)
{
	/* formatted aside first: callers may pass tier_last_error() itself to extend the message */
	char msg[sizeof last_msg];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	memcpy(last_msg, msg, sizeof msg);
	tier_log(TIER_LOG_DEBUG, "error %s: %s", tier_strerror(code), last_msg);
	return code;
}

const char *tier_strerror(int code)
{
	static const struct { int code; const char *name; } names[] = {
		{ -ENOMEM, "ENOMEM" }, { -EINVAL, "EINVAL" }, { -EIO, "EIO" }, { -ENOSPC, "ENOSPC" },
		{ -ENOENT, "ENOENT" }, { -EACCES, "EACCES" }, { -EBUSY, "EBUSY" }, { -EAGAIN, "EAGAIN" },
		{ -ERANGE, "ERANGE" }, { -ENODEV, "ENODEV" }, { -EEXIST, "EEXIST" }, { -E2BIG, "E2BIG" },
		{ -EBADMSG, "EBADMSG" }, { -ENOTSUP, "ENOTSUP" }, { -ECANCELED, "ECANCELED" },
		{ -EOVERFLOW, "EOVERFLOW" }, { -ENOTDIR, "ENOTDIR" }, { -EROFS, "EROFS" },
		{ -ESRCH, "ESRCH" }, { -ENODATA, "ENODATA" }, { -EPERM, "EPERM" }, { -EPROTO, "EPROTO" }, { -ETIMEDOUT, "ETIMEDOUT" },
	};
	for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
		if (names[i].code == code)
			return names[i].name;
	return strerror(code < 0 ? -code : code);
}
