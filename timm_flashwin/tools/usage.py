"""``UsageError``: what the CLI reports as a mistake in what was asked (exit code 2). A room
of its own: verify, bench and hf_models raise it, and cli catches it."""


class UsageError(Exception):
    """A problem with what was asked (unknown model, no GPU, unusable checkpoint...)."""
