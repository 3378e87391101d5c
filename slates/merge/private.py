"""Private paths: what a work volume keeps to itself (DESIGN.md section 5a).

Theory of operation.  Agents run git and compilers in their mounts, so a
work volume fills with `.git/` internals and build outputs that must never
be submitted or landed.  A path is *private* when

  1. one of its components is `.git` (git itself never tracks such a path);
  2. the green's own patterns (`green create --private PATTERN`, a
     `PrivatePolicy.patterns`) ignore it, read as one gitignore file at the
     volume root; or
  3. unless the policy says `submit_ignored`, the repository's own ignore
     rules ignore it: every `.gitignore` from the root down to the path's
     directory and `/.git/info/exclude`, exactly as `git check-ignore
     --no-index` decides.  A `.gitignore` file itself is never private by
     these rules: it is part of the project (it stays private only inside a
     private directory).

Git's precedence, mirrored from git's dir.c: a path is decided by the first
matching pattern in the order deepest `.gitignore` first, later lines before
earlier ones, `/.git/info/exclude` last; a `!` pattern that matches re-includes.
A directory that is ignored hides everything inside it: nothing beneath it
can be re-included, and its `.gitignore` files are never read.  So
`is_private` walks the path's ancestors from the root and stops at the first
private one.

Line grammar (also mirrored from dir.c, because pathspec's whole-spec
matching follows the gitignore documentation, not git, for directories and
re-inclusion): a UTF-8 BOM is skipped; lines end at LF with an optional CR
before it and at a NUL; lines starting with `#` are comments; trailing spaces
are trimmed unless escaped with a backslash; a leading `!` negates; one
trailing `/` makes the pattern match directories only; a pattern without
another `/` matches the basename at any depth, otherwise it is anchored at
the directory of its file (a leading `/` only anchors).  The glob itself
(`*`, `?`, `[...]`, `**`, backslash escapes) is translated to a regular
expression by pathspec's GitIgnoreSpecPattern, always fed in anchored form
so pathspec adds no implicit prefix; a segment of three or more stars is
git's `**`.  A line pathspec cannot translate (a trailing backslash, an
unclosed bracket) never matches in git, so it is skipped when read from a
file; as a policy pattern it is an InvalidArgument (`check_policy`).

Git matches bytes (`?` is one byte of a UTF-8 name), so matching runs on
byte strings held as latin-1 `str` (one character per byte), as pathspec
itself does for bytes: `.gitignore` contents are decoded as latin-1, and
paths and policy patterns (surrogateescape strings, possibly non-UTF-8) are
re-encoded to their bytes first.

Pure: the caller provides `read_file` (a lookup in the volume being
submitted); a matcher reads each `.gitignore` at most once and only along
the paths it is asked about, never walking the tree.  Called by submission
(slates.node.service) to leave private paths out of a diff and by landing
to keep them off disk.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from pathspec.patterns.gitignore.spec import GitIgnoreSpecPattern

from slates.errors import InvalidArgument

__all__ = [
    "PrivatePolicy",
    "PrivateMatcher",
    "check_policy",
    "GIT_DIR",
    "IGNORE_FILE",
    "EXCLUDE_FILE",
    "MAX_PATTERNS",
    "MAX_PATTERN_LENGTH",
]

GIT_DIR = ".git"
IGNORE_FILE = ".gitignore"
EXCLUDE_FILE = "/.git/info/exclude"
MAX_PATTERNS = 1000  # per policy; a green's policy travels in every submission
MAX_PATTERN_LENGTH = 4096  # git's own limit on a path (PATH_MAX)

_BOM = "\ufeff"
_BOM_BYTES = _BOM.encode().decode("latin-1")
_STARS_ONLY = re.compile(r"\*{3,}")
_NEGATED_SET = re.compile(r"(?<!\\)((?:\\\\)*)\[\^")  # `[^` opening a set, not `\[^`


@dataclasses.dataclass(frozen=True, slots=True)
class PrivatePolicy:
    """A green's rule for private paths, fixed at `green create`.

    `patterns`: extra gitignore-style patterns (`--private`), rooted at the
    volume root; `submit_ignored`: the repository's ignore rules do not apply
    (`.git/` and `patterns` stay private).
    """

    patterns: tuple[str, ...] = ()
    submit_ignored: bool = False

    def to_wire(self) -> list[Any]:
        return [list(self.patterns), self.submit_ignored]

    @classmethod
    def from_wire(cls, raw: Any) -> PrivatePolicy:
        match raw:
            case [list() as patterns, bool() as submit_ignored] if all(
                isinstance(pattern, str) for pattern in patterns
            ):
                policy = cls(tuple(patterns), submit_ignored)
            case _:
                raise InvalidArgument(
                    "a private-path policy is [patterns (list of str), submit_ignored (bool)]",
                    policy=repr(raw)[:200],
                )
        check_policy(policy)
        return policy


def check_policy(policy: PrivatePolicy) -> None:
    """InvalidArgument naming the first pattern that is not a useful gitignore pattern."""
    if len(policy.patterns) > MAX_PATTERNS:
        raise InvalidArgument(
            f"at most {MAX_PATTERNS} private patterns", count=len(policy.patterns)
        )
    for pattern in policy.patterns:
        reason = _invalid_reason(pattern)
        if reason is not None:
            raise InvalidArgument(
                f"private pattern {pattern!r} is not a valid gitignore pattern: {reason}",
                pattern=pattern,
            )


def _invalid_reason(pattern: str) -> str | None:
    """Why `pattern` would never match or is not one gitignore line (None: it is fine)."""
    if len(pattern) > MAX_PATTERN_LENGTH:
        return f"longer than {MAX_PATTERN_LENGTH} characters"
    for char, name in (("\0", "NUL"), ("\n", "newline"), ("\r", "carriage return")):
        if char in pattern:
            return f"it contains a {name}"
    if pattern.startswith(_BOM):
        return "it starts with a byte-order mark"
    try:
        _as_bytes(pattern)
    except InvalidArgument:
        return "it is not a file-name string (a lone surrogate)"
    if pattern.startswith("#"):
        return "it is a comment (write \\# for a leading #)"
    rule = _parse_line(_as_bytes(pattern))
    if rule is None:
        return "it is empty or matches nothing (a lone !, / or spaces)"
    body = pattern[1:] if pattern.startswith("!") else pattern
    if any(segment in (".", "..") for segment in body.rstrip("/").split("/")):
        return "paths never contain . or .. segments"
    if rule.regex is None:
        if _has_unsupported_bracket(pattern):
            return "[:classes:] and backslashes inside [...] are not supported"
        return "it has a trailing backslash, an unclosed [ or a reversed range; it never matches"
    return None


# -- patterns --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Rule:
    """One gitignore line, parsed as git's dir.c does.

    `regex`: the glob, matched against the basename (`basename_only`) or the
    path relative to the directory of the rule's file; None if the rule never
    matches (pathspec cannot translate it and git never matches it, or it has
    a bracket expression pathspec reads unlike git).  `match_prefix`: the regex ends in
    a trailing `**` and matches any path it is a prefix of.
    """

    negated: bool
    dir_only: bool
    basename_only: bool
    regex: re.Pattern[str] | None
    match_prefix: bool

    def matches(self, relative: str, basename: str, is_dir: bool) -> bool:
        if self.regex is None or (self.dir_only and not is_dir):
            return False
        subject = basename if self.basename_only else relative
        if self.regex.fullmatch(subject) is not None:
            return True
        return self.match_prefix and self.regex.search(subject) is not None


def _trim_trailing_spaces(line: str) -> str:
    """Git's trim_trailing_spaces: drop trailing spaces not escaped by a backslash."""
    end = len(line)
    while end > 0 and line[end - 1] == " ":
        backslashes = 0
        while end - 1 - backslashes > 0 and line[end - 2 - backslashes] == "\\":
            backslashes += 1
        if backslashes % 2 == 1:  # the last space is escaped: keep it
            break
        end -= 1
    return line[:end]


def _protect_trailing_whitespace(glob: str) -> str:
    """pathspec strips all trailing whitespace; git keeps tabs and escaped spaces.

    Each trailing whitespace character other than an escaped space becomes a
    one-character bracket expression, which pathspec leaves alone.
    """
    if glob.endswith("\\ ") or glob == glob.rstrip():
        return glob
    stripped = glob.rstrip()
    tail = glob[len(stripped) :]
    backslashes = len(stripped) - len(stripped.rstrip("\\"))
    if backslashes % 2 == 1:  # the first trailing character is escaped: a set says the same
        stripped = stripped[:-1]
    return stripped + "".join(f"[{char}]" for char in tail)


def _parse_line(line: str) -> _Rule | None:
    """A rule, or None for a line that is blank, a comment, or empty after its flags."""
    line = line.split("\0", 1)[0]
    if not line or line.startswith("#"):
        return None
    line = _trim_trailing_spaces(line)
    negated = line.startswith("!")
    body = line[1:] if negated else line
    dir_only = body.endswith("/")
    if dir_only:
        body = body[:-1]
    if not body:
        return None
    basename_only = "/" not in body
    anchored = body if basename_only or not body.startswith("/") else body[1:]
    segments = ["**" if _STARS_ONLY.fullmatch(seg) else seg for seg in anchored.split("/")]
    glob = _protect_trailing_whitespace("/".join(segments))
    if _has_unsupported_bracket(glob):
        return _Rule(negated, dir_only, basename_only, None, False)
    try:
        translated, include = GitIgnoreSpecPattern.pattern_to_regex("/" + glob)
    except ValueError:  # GitIgnorePatternError: e.g. a trailing backslash
        translated, include = None, None
    if translated is None or include is None:
        return _Rule(negated, dir_only, basename_only, None, False)
    if not basename_only:  # git's `[!x]` never matches the `/` between components
        translated = _NEGATED_SET.sub(r"\1[^/", translated)
    try:
        with warnings.catch_warnings():  # `[[]` is a valid set; re only warns of the future
            warnings.simplefilter("ignore", FutureWarning)
            regex = re.compile(translated)
    except re.error:  # e.g. a reversed range `[z-a]`, which git never matches either
        return _Rule(negated, dir_only, basename_only, None, False)
    # Only a trailing `**` (or a pattern that is all `**` and `*`) yields a regex
    # without pathspec's descendant group: it already means "anything below", so
    # finding it in the path is a match.
    return _Rule(negated, dir_only, basename_only, regex, not regex.groupindex)


def _has_unsupported_bracket(glob: str) -> bool:
    """A bracket expression pathspec would read unlike git: a `[:class:]` or a backslash.

    Scans as git's wildmatch does (a `]` right after `[`, `[!` or `[^` is a
    member).  Such a rule never matches (a path stays public rather than be
    hidden by a misread rule) and is an invalid policy pattern.
    """
    index, end = 0, len(glob)
    while index < end:
        char = glob[index]
        if char == "\\":
            index += 2
            continue
        if char != "[":
            index += 1
            continue
        inner = index + 1
        if inner < end and glob[inner] in "!^":
            inner += 1
        close = glob.find("]", inner + 1)
        if close < 0:
            return False  # unclosed: pathspec drops the rule, as git never matches it
        members = glob[inner:close]
        if "\\" in members or "[:" in members:
            return True
        index = close + 1
    return False


def _parse_file(content: bytes) -> tuple[_Rule, ...]:
    """The rules of one ignore file, in file order (later lines take precedence)."""
    text = content.decode("latin-1")
    if text.startswith(_BOM_BYTES):
        text = text[len(_BOM_BYTES) :]
    lines = text.split("\n")
    rules = []
    for line in lines:
        rule = _parse_line(line[:-1] if line.endswith("\r") else line)
        if rule is not None and rule.regex is not None:
            rules.append(rule)
    return tuple(rules)


@dataclasses.dataclass(frozen=True, slots=True)
class _RuleList:
    """The rules of one file and the directory they are relative to ('' is the root)."""

    base: str
    rules: tuple[_Rule, ...]

    def decide(self, relative_to_root: str, basename: str, is_dir: bool) -> bool | None:
        """True (ignored), False (re-included) or None (no rule matches)."""
        relative = relative_to_root[len(self.base) + 1 :] if self.base else relative_to_root
        for rule in reversed(self.rules):
            if rule.matches(relative, basename, is_dir):
                return not rule.negated
        return None


def _decide(lists: Iterable[_RuleList], relative: str, basename: str, is_dir: bool) -> bool:
    """Git's last_matching_pattern over lists given highest precedence first."""
    for rule_list in lists:
        verdict = rule_list.decide(relative, basename, is_dir)
        if verdict is not None:
            return verdict
    return False


# -- the matcher -----------------------------------------------------------------------


class PrivateMatcher:
    """Answers `is_private` for the paths of one volume under one policy.

    Caches the parsed ignore file of every directory it visited and the
    verdict for every directory, so asking about all paths of a tree costs
    one read per directory that holds a `.gitignore` and one decision per
    path.  The caches grow with the directories asked about; use one matcher
    per submission or landing.
    """

    def __init__(self, policy: PrivatePolicy, read_file: Callable[[str], bytes | None]) -> None:
        """read_file('/dir/.gitignore') -> its bytes, or None if absent (or not a regular file);
        called lazily, at most once per path (cached), only for the directories on the way to
        the paths asked about: never a walk of the whole tree."""
        check_policy(policy)
        self._policy = policy
        self._read_file = read_file
        policy_rules = (_parse_line(_as_bytes(pattern)) for pattern in policy.patterns)
        self._policy_list = _RuleList("", tuple(rule for rule in policy_rules if rule))
        self._exclude: _RuleList | None = None
        self._dir_lists: dict[str, _RuleList] = {}
        self._lists_of: dict[str, tuple[_RuleList, ...]] = {}
        self._dir_private: dict[str, bool] = {"": False}

    def is_private(self, path: str, is_dir: bool = False) -> bool:
        """Whether an absolute volume path ('/src/a.o') stays in the work volume.

        True for anything with a `.git` component, for paths the policy's
        patterns match and, unless `submit_ignored`, for paths git would
        ignore, and for everything inside a directory that is private.
        `is_dir` says whether the path is a directory (for `dir/` patterns).
        InvalidArgument for a path that is not absolute and normal.
        """
        components = _components(path)
        if not components:
            return False  # the root itself
        for depth in range(1, len(components)):
            if self._directory_private(components[:depth]):
                return True
        parent = "/".join(components[:-1])
        return self._decide(parent, components[-1], is_dir)

    def _directory_private(self, components: list[str]) -> bool:
        relative = "/".join(components)
        known = self._dir_private.get(relative)
        if known is None:
            parent = "/".join(components[:-1])
            known = self._decide(parent, components[-1], True)
            self._dir_private[relative] = known
        return known

    def _decide(self, parent: str, name: str, is_dir: bool) -> bool:
        """Whether `name` in the (not private) directory `parent` is private itself."""
        if name == GIT_DIR:
            return True
        relative = f"{parent}/{name}" if parent else name
        if _decide((self._policy_list,), relative, name, is_dir):
            return True
        if self._policy.submit_ignored or (name == IGNORE_FILE and not is_dir):
            return False
        return _decide(self._repository_lists(parent), relative, name, is_dir)

    def _repository_lists(self, parent: str) -> tuple[_RuleList, ...]:
        """The repository's rule lists for entries of `parent`, highest precedence first."""
        known = self._lists_of.get(parent)
        if known is not None:
            return known
        lists = []
        directory = parent
        while True:
            lists.append(self._directory_list(directory))
            if not directory:
                break
            directory = directory.rpartition("/")[0]
        if self._exclude is None:
            self._exclude = _RuleList("", self._read_rules(EXCLUDE_FILE))
        lists.append(self._exclude)
        self._lists_of[parent] = tuple(rule_list for rule_list in lists if rule_list.rules)
        return self._lists_of[parent]

    def _directory_list(self, directory: str) -> _RuleList:
        rule_list = self._dir_lists.get(directory)
        if rule_list is None:
            ignore_path = (
                f"/{_as_text(directory)}/{IGNORE_FILE}" if directory else f"/{IGNORE_FILE}"
            )
            rule_list = _RuleList(directory, self._read_rules(ignore_path))
            self._dir_lists[directory] = rule_list
        return rule_list

    def _read_rules(self, path: str) -> tuple[_Rule, ...]:
        content = self._read_file(path)
        return () if content is None else _parse_file(content)


def _components(path: str) -> list[str]:
    if not path.startswith("/"):
        raise InvalidArgument(f"not an absolute volume path: {path!r}", path=path)
    if path == "/":
        return []
    components = _as_bytes(path[1:]).split("/")
    if any(part in ("", ".", "..") for part in components):
        raise InvalidArgument(f"not a normal volume path: {path!r}", path=path)
    return components


def _as_bytes(text: str) -> str:
    """The bytes of a surrogateescape string, one latin-1 character per byte."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("latin-1")
    except UnicodeEncodeError as error:
        raise InvalidArgument(f"not a file-name string: {text!r}", text=text) from error


def _as_text(latin: str) -> str:
    """The surrogateescape string of bytes held as latin-1 characters."""
    return latin.encode("latin-1").decode("utf-8", "surrogateescape")
