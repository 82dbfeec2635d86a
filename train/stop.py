"""What a run stopped on SIGTERM / SIGINT reports: :class:`Interrupted` and its exit status, which the trainer,
the command line and ``dres-launch`` share (this module imports nothing of the trainer)."""

# sysexits' EX_TEMPFAIL ("try again later"): the run stopped on a signal after saving, --resume auto continues it
EXIT_INTERRUPTED = 75


class Interrupted(RuntimeError):
    """The run stopped on SIGTERM / SIGINT; the message says what was saved (exit status
    :data:`EXIT_INTERRUPTED`)."""
