"""The installer's exceptions: every way an install is expected to fail.

    InstallError          base; the message is the node's reason, `retryable` says
    │                     whether trying the same thing again soon can help
    ├── SourceError       the release API or mirror could not be read (5xx, timeouts: retryable)
    ├── NoBuildError      no asset of the release fits this node
    ├── DownloadError     the transfer failed or was cut short (retryable), or was refused
    ├── ArchiveError      the archive is hostile, too large for its size, corrupt or truncated
    ├── CheckError        ldd or `--version` did not pass
    └── PackageError      the node's package manager could not install what ldd asked for

An install that fails with one of these is reported in those words and retried
by the service with capped backoff. Anything else is a fault of the installer
itself: the service reports it as an internal error, and it still costs only
that attempt.
"""

from __future__ import annotations


class InstallError(Exception):
    retryable: bool = False

    def __init__(self, message: str, *, retryable: bool | None = None) -> None:
        super().__init__(message)
        if retryable is not None:
            self.retryable = retryable


class SourceError(InstallError):
    pass


class NoBuildError(InstallError):
    pass


class DownloadError(InstallError):
    pass


class ArchiveError(InstallError):
    """The archive was refused; nothing outside the destination was written."""


class CheckError(InstallError):
    """An engine binary did not pass its checks; the message is the node's reason."""


class PackageError(InstallError):
    retryable = True
