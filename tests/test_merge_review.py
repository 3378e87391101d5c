"""Regressions from the merge review: hard links, mounts, names and checkpoints.

Each test is one finding of the review, driven through the in-process
service (tests/test_merge_service.py's Service helper), and ends, where it
matters, by replaying the journal into a second service.
"""

from __future__ import annotations

import pytest

from slates.core.volume import ROOT_INO
from tests.test_merge_service import Service, assert_same_state


def hardlinked() -> tuple[Service, str]:
    """A green whose /f and /g are two names of one file."""
    service = Service()
    green = service.green({"/f": b"data"})
    work = service.work(green)
    ino = service.call("stat", volume=work, path="/f")["ino"]
    service.call("fs.link", volume=work, ino=ino, new_parent=ROOT_INO, new_name="g")
    service.call("fs.destroy", volume=work)
    assert service.submit(work)["ok"]
    return service, green


def test_both_names_of_a_hard_linked_file_can_move() -> None:
    service, green = hardlinked()
    work = service.work(green)
    service.call("rename", volume=work, src="/f", dst="/x")
    service.call("rename", volume=work, src="/g", dst="/y")
    assert service.submit(work)["ok"]
    assert service.tree(green) == service.tree(work)
    assert_same_state(service.svc, service.replayed())


def test_removing_one_name_of_a_hard_linked_file_keeps_the_other() -> None:
    service, green = hardlinked()
    one, two = service.work(green), service.work(green)
    service.call("unlink", volume=one, path="/f")
    service.call("unlink", volume=two, path="/g")
    assert service.submit(one)["ok"] and service.submit(two)["ok"]
    assert service.tree(green) == {}  # both removals are kept
    service, green = hardlinked()
    remover, editor = service.work(green), service.work(green)
    service.call("unlink", volume=remover, path="/f")
    service.edit(editor, "/g", 0, 4, b"DATA")
    assert service.submit(remover)["ok"]
    assert service.submit(editor)["ok"]  # the file lives on under /g: no conflict
    assert service.read(green, "/g") == b"DATA"


def test_a_user_file_named_like_a_staging_name_survives_a_move() -> None:
    service = Service()
    green = service.green({"/.slates-merge-0": b"precious", "/a": b"A"})
    work = service.work(green)
    service.call("rename", volume=work, src="/a", dst="/c")
    assert service.submit(work)["ok"]
    assert service.tree(green) == {"/.slates-merge-0": b"precious", "/c": b"A"}


def test_a_mounted_work_volume_moves_on_and_never_merges_a_change_twice_or_drops_one() -> None:
    service = Service()
    green = service.green({"/f": b"0123456789"})
    work = service.work(green)
    held = service.call("fs.lookup", volume=work, parent=ROOT_INO, name="f")["ino"]  # a mount
    service.edit(work, "/f", 0, 0, b"X")
    result = service.submit(work)
    assert result["ok"] and result["rebased"] is True and result["made_version"] is True
    assert service.svc.volumes[work].handles(held) == 1  # the kernel's reference moved along
    again = service.submit(work)  # nothing new: nothing happens
    assert again["ok"] and again["nothing"] and not again["made_version"]
    assert service.read(green, "/f") == b"X0123456789"
    service.edit(work, "/f", 0, 1, b"")  # a change after the acceptance...
    result = service.submit(work)
    assert result["ok"] and result["made_version"], result
    assert service.read(green, "/f") == b"0123456789"  # ...is the next version, once
    assert service.raw("fs.getattr", volume=work, ino=held)["ok"]
    assert_same_state(service.svc, service.replayed())


def test_a_mounted_green_keeps_a_removed_file_while_the_kernel_holds_it() -> None:
    service = Service()
    green = service.green({"/f": b"hello", "/k": b"k"})
    ino = service.call("fs.lookup", volume=green, parent=ROOT_INO, name="f")["ino"]
    work = service.work(green)
    service.call("unlink", volume=work, path="/f")
    assert service.submit(work)["ok"]
    assert service.raw("fs.getattr", volume=green, ino=ino)["ok"]  # unlinked, still open
    replayed = service.replayed()
    assert replayed.volumes[green].handles(ino) == service.svc.volumes[green].handles(ino) == 1


@pytest.mark.parametrize("through", ["journal", "checkpoint"])
def test_names_that_are_not_utf8_survive_the_ledger(through: str) -> None:
    service = Service()
    green = service.green({"/a": b"a"})
    work = service.work(green)
    service.call(
        "fs.create", volume=work, parent=ROOT_INO, name="caf\udce9", mode=0o644, uid=0, gid=0
    )
    assert service.submit(work)["ok"]
    service.svc.checkpoint()  # raised UnicodeEncodeError before
    if through == "checkpoint":
        assert_same_state(service.svc, service.restored())
    else:
        assert_same_state(service.svc, service.replayed())


def test_editing_a_file_whose_names_were_removed_one_by_one_is_a_conflict() -> None:
    """Each version removed one name (the other link remained): only the head shows it gone."""
    service, green = hardlinked()
    one, two, editor = service.work(green), service.work(green), service.work(green)
    service.call("unlink", volume=one, path="/f")
    service.call("unlink", volume=two, path="/g")
    service.edit(editor, "/f", 0, 4, b"DATA")
    assert service.submit(one)["ok"] and service.submit(two)["ok"]
    result = service.submit(editor)
    assert not result["ok"]
    assert [c["kind"] for c in result["conflicts"]] == ["modify vs delete"]
    assert service.tree(green) == {}


def test_owner_changes_are_submitted_and_competing_ones_conflict() -> None:
    service = Service()
    green = service.green({"/f": b"data", "/g": b"more"})
    one, two = service.work(green), service.work(green)
    for work, uid in ((one, 1000), (two, 2000)):
        ino = service.call("stat", volume=work, path="/f")["ino"]
        service.call("fs.setattr", volume=work, ino=ino, uid=uid, gid=uid)
    assert service.submit(one)["ok"]
    assert service.call("stat", volume=green, path="/f")["uid"] == 1000
    result = service.submit(two)
    assert [c["kind"] for c in result["conflicts"]] == ["attributes"]
    assert_same_state(service.svc, service.replayed())
