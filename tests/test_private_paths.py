"""Private paths (slates.merge.private): git's ignore rules, the green's policy, and bad input.

The unit tests pin each rule; `test_matches_git_check_ignore` compares the
matcher with real git on random trees (seeded; the seed is in every failure
message, set SLATES_PRIVATE_SEED to replay one).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slates.errors import InvalidArgument
from slates.merge.private import MAX_PATTERNS, PrivateMatcher, PrivatePolicy, check_policy


def matcher(
    files: dict[str, bytes], policy: PrivatePolicy | None = None
) -> tuple[PrivateMatcher, list[str]]:
    """A matcher over an in-memory volume, and the log of the files it read."""
    reads: list[str] = []

    def read_file(path: str) -> bytes | None:
        reads.append(path)
        return files.get(path)

    return PrivateMatcher(policy or PrivatePolicy(), read_file), reads


def private(
    files: dict[str, bytes],
    path: str,
    is_dir: bool = False,
    *,
    patterns: tuple[str, ...] = (),
    submit_ignored: bool = False,
) -> bool:
    policy = PrivatePolicy(patterns, submit_ignored)
    return matcher(files, policy)[0].is_private(path, is_dir)


# -- .git and the policy's own patterns --------------------------------------------------


def test_git_directory_and_everything_under_it_is_private() -> None:
    assert private({}, "/.git", is_dir=True)
    assert private({}, "/.git/objects/ab/cdef")
    assert private({}, "/.git/config")
    assert private({}, "/vendor/lib/.git/HEAD")  # a nested clone's internals too
    assert not private({}, "/.github/workflows/ci.yml")
    assert not private({}, "/.gitattributes")
    assert not private({}, "/")


def test_git_directory_stays_private_even_if_ignore_rules_reinclude_it() -> None:
    files = {"/.gitignore": b"!.git\n!.git/\n!*\n"}
    assert private(files, "/.git", is_dir=True)
    assert private(files, "/.git/index")
    assert private(files, "/.git/index", submit_ignored=True)


def test_policy_patterns_are_rooted_at_the_volume_root() -> None:
    policy = ("/out", "*.log", "cache/", "!keep.log")
    assert private({}, "/out", is_dir=True, patterns=policy)
    assert private({}, "/out/x.bin", patterns=policy)
    assert not private({}, "/src/out", patterns=policy)  # anchored at the root
    assert private({}, "/deep/dir/run.log", patterns=policy)  # no slash: at any depth
    assert not private({}, "/deep/keep.log", patterns=policy)  # a later negation re-includes
    assert private({}, "/a/cache", is_dir=True, patterns=policy)
    assert not private({}, "/a/cache", is_dir=False, patterns=policy)  # directory only


def test_policy_patterns_win_over_the_repository_rules() -> None:
    files = {"/.gitignore": b"!*.log\n"}
    assert private(files, "/run.log", patterns=("*.log",))


def test_submit_ignored_turns_off_the_repository_rules_only() -> None:
    files = {"/.gitignore": b"*.o\nbuild/\n", "/.git/info/exclude": b"*.tmp\n"}
    m, _ = matcher(files, PrivatePolicy(("*.secret",), submit_ignored=True))
    assert not m.is_private("/a.o")
    assert not m.is_private("/build/x")
    assert not m.is_private("/x.tmp")
    assert m.is_private("/.git/config")
    assert m.is_private("/key.secret")
    assert private(files, "/a.o") and private(files, "/x.tmp")


# -- the repository's ignore rules -------------------------------------------------------


def test_deeper_ignore_files_override_shallower_ones() -> None:
    files = {"/.gitignore": b"*.o\n", "/src/.gitignore": b"!a.o\n"}
    assert private(files, "/a.o")
    assert not private(files, "/src/a.o")
    assert not private(files, "/src/sub/a.o")
    assert private(files, "/src/b.o")
    files = {"/.gitignore": b"!a.o\n", "/src/.gitignore": b"*.o\n"}
    assert private(files, "/src/a.o")


def test_later_lines_override_earlier_ones() -> None:
    assert not private({"/.gitignore": b"*.o\n!*.o\n"}, "/a.o")
    assert private({"/.gitignore": b"!*.o\n*.o\n"}, "/a.o")


def test_info_exclude_has_the_lowest_precedence() -> None:
    assert private({"/.git/info/exclude": b"*.o\n"}, "/src/a.o")
    files = {"/.git/info/exclude": b"*.o\n", "/.gitignore": b"!a.o\n"}
    assert not private(files, "/src/a.o")
    assert private(files, "/src/b.o")


def test_directory_only_patterns_need_a_directory() -> None:
    files = {"/.gitignore": b"build/\n"}
    assert private(files, "/build", is_dir=True)
    assert private(files, "/src/build", is_dir=True)
    assert not private(files, "/build", is_dir=False)
    assert private(files, "/build/out.o")  # the directory on the way is a directory


def test_anchored_patterns_match_relative_to_their_file() -> None:
    files = {"/.gitignore": b"/lua\ndoc/*.html\n", "/src/.gitignore": b"/gen\nx/y\n"}
    assert private(files, "/lua")
    assert not private(files, "/src/lua")
    assert private(files, "/doc/a.html")
    assert not private(files, "/doc/sub/a.html")  # one `*` does not cross a slash
    assert not private(files, "/src/doc/a.html")
    assert private(files, "/src/gen")
    assert not private(files, "/gen")
    assert private(files, "/src/x/y")
    assert not private(files, "/x/y")


def test_double_star_forms() -> None:
    files = {"/.gitignore": b"**/tmp\na/**/b\nlogs/**\n"}
    assert private(files, "/tmp")
    assert private(files, "/p/q/tmp")
    assert private(files, "/a/b")
    assert private(files, "/a/x/y/b")
    assert not private(files, "/c/a/b")
    assert private(files, "/logs/x")
    assert private(files, "/logs/x/y")
    assert not private(files, "/logs", is_dir=True)  # `logs/**` is what is inside
    assert private({"/.gitignore": b"a/***/b\n"}, "/a/x/y/b")  # git reads `***` as `**`


def test_nothing_inside_an_ignored_directory_can_be_reincluded() -> None:
    files = {
        "/.gitignore": b"build/\n!build/keep.o\n",
        "/build/.gitignore": b"!*\n",
    }
    m, reads = matcher(files)
    assert m.is_private("/build/keep.o")
    assert m.is_private("/build/.gitignore")
    assert "/build/.gitignore" not in reads  # git never reads it


def test_a_reincluded_directory_is_searched_again() -> None:
    # The whitelist idiom: ignore everything, re-include directories and sources.
    files = {"/.gitignore": b"*\n!*/\n!*.c\n"}
    assert not private(files, "/src", is_dir=True)
    assert not private(files, "/src/main.c")
    assert private(files, "/src/main.o")
    assert not private(files, "/.gitignore")


def test_ignore_files_themselves_stay_public() -> None:
    files = {"/.gitignore": b"*\n!*/\n.gitignore\n", "/src/.gitignore": b".gitignore\n"}
    assert not private(files, "/.gitignore")
    assert not private(files, "/src/.gitignore")
    assert private(files, "/src/x")
    assert private(files, "/.gitignore", patterns=("/.gitignore",))  # the green may say so


def test_build_output_names_stay_public_unless_ignored() -> None:
    for path in ("/liblua.a", "/src/lvm.o", "/lua", "/build/out"):
        assert not private({}, path)
        assert not private({"/.gitignore": b"# *.o\n\n"}, path)


def test_trailing_spaces_escapes_and_line_endings() -> None:
    content = b"\xef\xbb\xbfbom.o\r\nspace\\ \ntrail   \ntab\t\n\\#hash\n\\!bang\n#comment\n"
    files = {"/.gitignore": content}
    assert private(files, "/bom.o")  # byte-order mark skipped, CRLF ends a line
    assert private(files, "/space ")
    assert not private(files, "/space")
    assert private(files, "/trail")
    assert not private(files, "/trail ")
    assert private(files, "/tab\t")  # git trims spaces only
    assert not private(files, "/tab")
    assert private(files, "/#hash")
    assert private(files, "/!bang")
    assert not private(files, "/#comment")
    assert private({"/.gitignore": b"esc\\ \t\n"}, "/esc \t")


def test_bracket_expressions() -> None:
    files = {"/.gitignore": b"*.py[cod]\n/a[!x]b\nx[[]\n[]y]z\n"}
    assert private(files, "/m.pyc") and private(files, "/p/m.pyo")
    assert not private(files, "/m.pyx")
    assert private(files, "/ayb")
    assert not private(files, "/a/b")  # a negated set never matches the `/` between names
    assert private(files, "/x[")
    assert private(files, "/]z") and private(files, "/yz")


def test_unsupported_bracket_expressions_never_match() -> None:
    # pathspec reads [:classes:] and backslashes inside [...] unlike git: such a rule is
    # dropped, so the path stays public (submitted) rather than hidden by a misread rule.
    files = {"/.gitignore": b"[[:digit:]].o\n[\\]]\n*.o\n"}
    assert not private(files, "/1.t")
    assert private(files, "/1.o")
    for pattern in ("[[:digit:]].o", "[\\]]"):
        with pytest.raises(InvalidArgument, match="not supported"):
            check_policy(PrivatePolicy((pattern,)))


def test_unmatchable_lines_in_a_file_are_skipped() -> None:
    files = {"/.gitignore": b"broken\\\n[abc\n!\n/\n[z-a]\n*.o\n"}
    assert private(files, "/a.o")
    assert not private(files, "/broken")
    assert not private(files, "/[abc")


def test_non_utf8_names_and_ignore_files_match_bytes() -> None:
    latin = b"caf\xe9".decode("utf-8", "surrogateescape")
    files = {"/.gitignore": b"caf\xe9.o\n[\xe9]\n", f"/{latin}/.gitignore": b"*.x\n"}
    assert private(files, f"/{latin}.o")
    assert private(files, b"/\xe9".decode("utf-8", "surrogateescape"))
    assert private(files, f"/{latin}/a.x")
    assert not private(files, "/café.o")  # UTF-8 é is two other bytes
    # `?` is one byte, as in git: UTF-8 é is two.
    assert not private({"/.gitignore": b"caf?.o\n"}, "/café.o")
    assert private({"/.gitignore": b"caf??.o\n"}, "/café.o")


# -- reading ------------------------------------------------------------------------------


def test_reads_are_lazy_cached_and_only_along_the_asked_paths() -> None:
    files = {"/.gitignore": b"*.o\n", "/a/b/.gitignore": b"!x.o\n"}
    m, reads = matcher(files)
    assert reads == []
    assert not m.is_private("/a/b/x.o")
    assert sorted(reads) == sorted(
        ["/.gitignore", "/a/.gitignore", "/a/b/.gitignore", "/.git/info/exclude"]
    )
    for path in ("/a/b/x.o", "/a/b/y.o", "/a/z.o", "/q.o"):
        m.is_private(path)
    assert sorted(reads) == sorted(set(reads))  # each at most once
    assert "/c/.gitignore" not in reads
    m.is_private("/c/d.o")
    assert reads[-1] == "/c/.gitignore"


def test_policy_private_directories_are_not_read() -> None:
    m, reads = matcher({}, PrivatePolicy(("/node_modules/",)))
    assert m.is_private("/node_modules/x/y.js")
    assert not any(path.startswith("/node_modules/") for path in reads)


def test_paths_must_be_absolute_and_normal() -> None:
    m, _ = matcher({})
    for bad in ("src/a.o", "", "/a//b", "/a/./b", "/a/../b", "/a/"):
        with pytest.raises(InvalidArgument):
            m.is_private(bad)


# -- the policy: validation and wire ------------------------------------------------------


@pytest.mark.parametrize(
    "pattern",
    ["", "   ", "!", "/", "!/", "#build", "a\0b", "a\nb", "a\rb", "foo\\", "[abc", "[z-a]",
     "[!]", "../x", "a/./b", "\ud800", "\ufeffx.o", "x" * 5000],
)  # fmt: skip
def test_check_policy_names_the_bad_pattern(pattern: str) -> None:
    policy = PrivatePolicy(("*.o", pattern))
    with pytest.raises(InvalidArgument) as error:
        check_policy(policy)
    assert error.value.details["pattern"] == pattern
    with pytest.raises(InvalidArgument):
        PrivatePolicy.from_wire(policy.to_wire())
    with pytest.raises(InvalidArgument):
        PrivateMatcher(policy, lambda path: None)


@pytest.mark.parametrize(
    "pattern", ["*.o", "build/", "/lua", "!keep.o", "**/tmp", "doc/*.html", "\\#x", "a\\ ",
                "[!a]*.o", "***", "a/**", "x y"]
)  # fmt: skip
def test_check_policy_accepts_gitignore_patterns(pattern: str) -> None:
    check_policy(PrivatePolicy((pattern,)))


def test_check_policy_bounds_the_number_of_patterns() -> None:
    with pytest.raises(InvalidArgument):
        check_policy(PrivatePolicy(("*.o",) * (MAX_PATTERNS + 1)))


_PATTERN = st.sampled_from(["*.o", "build/", "/lua", "!keep.o", "**/tmp", "doc/*.html"])


@given(st.lists(_PATTERN, max_size=5), st.booleans())
def test_policy_wire_round_trip(patterns: list[str], submit_ignored: bool) -> None:
    policy = PrivatePolicy(tuple(patterns), submit_ignored)
    assert PrivatePolicy.from_wire(policy.to_wire()) == policy


@pytest.mark.parametrize(
    "raw", [None, [], [["*.o"]], [["*.o"], 1], ["*.o", False], [[1], False],
            [["*.o"], False, 3], {"patterns": []}]
)  # fmt: skip
def test_malformed_wire_policy_is_invalid_argument(raw: object) -> None:
    with pytest.raises(InvalidArgument):
        PrivatePolicy.from_wire(raw)


# -- against real git ---------------------------------------------------------------------

_DIR_NAMES = ["src", "build", "doc", "lua", "tmp", "a", "b", "keep.o", "Build"]
_FILE_NAMES = ["a.o", "keep.o", "b.c", "x.html", "liblua.a", "lua", "tmp", "README", "b",
               "main.c", "#x", "!keep.o", "sp ", "caf\udce9.o", "café.o", "x.pyc", "x[", "]x",
               "Build"]  # fmt: skip
_LINES = [
    "*.o", "build/", "/lua", "!keep.o", "**/tmp", "doc/*.html", "!*.c", "*", "!*/", "tmp/",
    "!/build", "a/**", "a/**/b", "*.html", "!doc/", "# comment", "", "src/*.o", "/doc",
    "lua ", "sp\\ ", "\\!keep.o", "\\#x", "build/**/keep.o", "!build/", "?.o", "[ab].c",
    "[!a]*.o", "liblua.a", "*.a", "/*.o", "**/", "***", "!lua", "b/", "/b", "!/src/",
    "src/", "!tmp", "doc/**", "!**/keep.o", "*/", "caf?.o", "caf??.o", "**/a/*", "/a/b",
    "*.[oa]", "/a[!x]b", "[Bb]uild/", "*.py[cod]", "x[[]", "[z-a]", "a/[^x]", "[]a]*",
]  # fmt: skip


_IGNORE_FILE = st.lists(st.sampled_from(_LINES), max_size=6).map(lambda ls: "\n".join(ls).encode())
_DIRS = st.lists(st.sampled_from(["src", "build", "doc", "a", "b", "tmp"]), min_size=1, max_size=3)


@given(
    st.dictionaries(st.sampled_from(["/", "/src/", "/build/", "/a/b/"]), _IGNORE_FILE),
    _DIRS,
    st.sampled_from(_FILE_NAMES),
    st.lists(st.sampled_from(["*.o", "/tmp/", "!keep.o", "b"]), max_size=2),
)
def test_private_directories_hide_everything_inside_and_rules_only_add(
    ignore_files: dict[str, bytes], directory: list[str], name: str, patterns: list[str]
) -> None:
    files = {f"{prefix}.gitignore": content for prefix, content in ignore_files.items()}
    default = matcher(files, PrivatePolicy(tuple(patterns)))[0]
    submitted = matcher(files, PrivatePolicy(tuple(patterns), submit_ignored=True))[0]
    dir_path = "/" + "/".join(directory)
    path = f"{dir_path}/{name}"
    if default.is_private(dir_path, is_dir=True):
        assert default.is_private(path) and default.is_private(path, is_dir=True)
    for is_dir in (False, True):
        if submitted.is_private(path, is_dir):  # fewer rules never make more private
            assert default.is_private(path, is_dir)


def _random_tree(rng: random.Random) -> tuple[list[str], set[str], dict[str, bytes]]:
    """Paths (relative, dirs included), the set of directories, and ignore files."""
    dirs = [""]
    for _ in range(rng.randint(1, 6)):
        parent = rng.choice(dirs)
        if parent.count("/") < 2:
            child = f"{parent}/{rng.choice(_DIR_NAMES)}".lstrip("/")
            if child not in dirs:
                dirs.append(child)
    paths = set(dirs[1:])
    for directory in dirs:
        for name in rng.sample(_FILE_NAMES, rng.randint(1, 5)):
            path = f"{directory}/{name}".lstrip("/")
            if path not in dirs:
                paths.add(path)
    ignores: dict[str, bytes] = {}
    for directory in rng.sample(dirs, rng.randint(1, len(dirs))):
        lines = rng.choices(_LINES, k=rng.randint(1, 6))
        text = "\n".join(lines) + rng.choice(["\n", ""])
        ignores[f"{directory}/.gitignore".lstrip("/")] = text.encode("utf-8", "surrogateescape")
        paths.add(f"{directory}/.gitignore".lstrip("/"))
    if rng.random() < 0.3:
        ignores[".git/info/exclude"] = "\n".join(rng.choices(_LINES, k=3)).encode()
    return sorted(paths), set(dirs[1:]), ignores


def _git_ignored(root: Path, paths: list[str]) -> set[str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(root),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "XDG_CONFIG_HOME": str(root / ".xdg"),
    }
    stdin = b"".join(path.encode("utf-8", "surrogateescape") + b"\0" for path in paths)
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin", "-z"],
        cwd=root, input=stdin, capture_output=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    if done.returncode not in (0, 1):  # 1: nothing ignored
        raise RuntimeError(done.stderr.decode(errors="replace"))
    return {raw.decode("utf-8", "surrogateescape") for raw in done.stdout.split(b"\0") if raw}


@pytest.fixture()
def scratch() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="slates-private-"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory)


def _reader(root: Path) -> Callable[[str], bytes | None]:
    def read_file(path: str) -> bytes | None:
        target = os.path.join(os.fsencode(root), path[1:].encode("utf-8", "surrogateescape"))
        return Path(os.fsdecode(target)).read_bytes() if os.path.isfile(target) else None

    return read_file


def _seed() -> int:
    return int(os.environ.get("SLATES_PRIVATE_SEED", random.randrange(2**32)))


def _write_tree(
    template: Path, root: Path, paths: list[str], dirs: set[str], ignores: dict[str, bytes]
) -> None:
    shutil.copytree(template / ".git", root / ".git")
    for path in paths:
        target = root / path
        if path in dirs:
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(ignores.get(path, b"x"))
    if ".git/info/exclude" in ignores:
        (root / ".git/info").mkdir(parents=True, exist_ok=True)
        (root / ".git/info/exclude").write_bytes(ignores[".git/info/exclude"])


def test_matches_git_check_ignore(scratch: Path) -> None:
    seed = _seed()
    rng = random.Random(seed)
    subprocess.run(["git", "init", "-q", str(scratch)], check=True, timeout=60)
    for tree in range(100):
        root = scratch / f"t{tree}"
        paths, dirs, ignores = _random_tree(rng)
        _write_tree(scratch, root, paths, dirs, ignores)
        ignored = _git_ignored(root, paths)
        m = PrivateMatcher(PrivatePolicy(), _reader(root))
        for path in paths:
            if path.rsplit("/", 1)[-1] == ".gitignore":  # public unless its directory is not
                ancestors = ["/".join(path.split("/")[:i]) for i in range(1, path.count("/") + 1)]
                expected = any(ancestor in ignored for ancestor in ancestors)
            else:
                expected = path in ignored
            actual = m.is_private("/" + path, is_dir=path in dirs)
            assert actual == expected, (
                f"seed {seed} tree {tree}: {path!r} git ignored={expected}, matcher={actual}; "
                f"ignore files {ignores!r}"
            )
        shutil.rmtree(root)


def _valid_policy_pattern(line: str) -> bool:
    try:
        check_policy(PrivatePolicy((line,)))
    except InvalidArgument:
        return False
    return True


def test_policy_patterns_match_git_as_a_root_ignore_file(scratch: Path) -> None:
    """`--private` patterns read as git reads .git/info/exclude; with --submit-ignored
    the repository's own files are never read."""
    seed = _seed()
    rng = random.Random(seed)
    subprocess.run(["git", "init", "-q", str(scratch)], check=True, timeout=60)
    lines = [line for line in _LINES if _valid_policy_pattern(line)]
    for tree in range(40):
        root = scratch / f"p{tree}"
        paths, dirs, _ = _random_tree(rng)
        paths = [path for path in paths if not path.endswith(".gitignore")]
        patterns = tuple(rng.choices(lines, k=rng.randint(1, 6)))
        exclude = {".git/info/exclude": "\n".join(patterns).encode("utf-8", "surrogateescape")}
        _write_tree(scratch, root, paths, dirs, exclude)
        ignored = _git_ignored(root, paths)
        reads: list[str] = []
        m = PrivateMatcher(PrivatePolicy(patterns, submit_ignored=True), reads.append)
        for path in paths:
            actual = m.is_private("/" + path, is_dir=path in dirs)
            assert actual == (path in ignored), (
                f"seed {seed} tree {tree}: {path!r} git ignored={path in ignored}, "
                f"matcher={actual}; patterns {patterns!r}"
            )
        assert reads == [], f"seed {seed}: --submit-ignored read {reads}"
        shutil.rmtree(root)
