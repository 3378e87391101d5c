"""slates_cli: the `slates` command-line front end.

Theory of operation: this package is thin on purpose.  `slates_cli.main`
parses arguments with click, calls a library function that returns plain
data, and prints that data (rich tables for people, JSON with `--json` for
programs).  Errors arrive as slates.errors.SlatesError and leave as
`error: <code>: <message>` on stderr with exit code 2 when the caller is at
fault and 1 otherwise.  Library-side work that is not yet in the SDK lives
beside the command that needs it (`slates_cli.demo`).
"""

__all__: list[str] = []
