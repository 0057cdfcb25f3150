"""What the command line's modules share without importing each other: the one-line usage
error, and the names of what parsing leaves on the namespace."""

from __future__ import annotations

from specc.errors import _one_line

SPEC_FLAG_OVERRIDES = "spec_flag_overrides"  # (config name, value text, flag) from the spec's megatron.flags
MEGATRON_NOTES = "megatron_notes"  # lines for the run's log: Megatron flags accepted that change nothing here
MEGATRON_REFUSED = "megatron_refused"  # (flag as given, why) of Megatron flags refused with a reason
COMMAND_FLAGS = "command_flags"  # the CommandLineFlags of the parser that made the namespace


class UsageError(SystemExit):
    """A mistake on the command line (an unknown flag, a bad value, a missing argument): one line
    `error: WHAT (hint: ...)` and exit code 2, never the whole usage."""

    def __init__(self, prog: str, message: str, hint: str | None = None):
        super().__init__(2)
        self.prog, self.message = prog, message
        self.hint = hint if hint is not None else f"hint: see {prog} --help"

    def format(self) -> str:
        return _one_line(f"error: {self.message} ({self.hint})")


class UsageErrors(UsageError):
    """Several mistakes on one command line (refused and unknown flags): all of them at once, one
    line each, in the order they were given, rather than one per run."""

    def __init__(self, errors: list):
        super().__init__(errors[0].prog, errors[0].message, errors[0].hint)
        self.errors = errors

    def format(self) -> str:
        return "\n".join(e.format() for e in self.errors)
