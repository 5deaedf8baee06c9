"""The eviction lease on a real tree: one holder at a time, stale holders taken over, foreign files quarantined."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from hostile_leases import HOSTILE, check_outside_intact, plant, quarantined
from pykv.maintenance.lease import (CLOCK_SKEW_S, MAX_TERM_S, Lease, LeaseRefused, check_lease, quarantine_lease,
                                    read_lease)
from pykv.maintenance.scan import Kind, Scan
from pykv.tree import LEASE_NAME, KVTree, is_temp_of
from reliability.racing import contend_for_lease, race

TTL = 30.0


class Clock:
    """A settable wall clock."""

    def __init__(self, now: float | None = None) -> None:
        self.now = time.time() if now is None else now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def tree(tmp_path) -> KVTree:
    return KVTree.create(tmp_path / "tree")


def lease_path(tree: KVTree):
    return tree.state_dir / LEASE_NAME


def leftovers(tree: KVTree) -> list[str]:
    """What the lease left in ``.pykv`` besides the lease itself (temps of either)."""
    return sorted(n for n in os.listdir(tree.state_dir) if n != LEASE_NAME and is_temp_of(n, (LEASE_NAME,)))


def test_acquire_renew_release(tree):
    clock = Clock()
    a, b = Lease(tree, "a", ttl_s=TTL, clock=clock), Lease(tree, "b", ttl_s=TTL, clock=clock)
    assert a.acquire() and a.held
    assert read_lease(tree).holder == "a"
    assert not b.acquire() and not b.held
    before = read_lease(tree).expires_at
    clock.now += 5
    assert a.renew() and read_lease(tree).expires_at == before + 5
    assert a.acquire()  # acquiring a lease one holds renews it
    a.release()
    assert not lease_path(tree).exists() and not a.held
    assert b.acquire() and read_lease(tree).holder == "b"
    assert leftovers(tree) == []


def test_exactly_one_of_many_contenders_wins_a_free_lease(tree):
    contenders = [Lease(tree, f"h{i}", ttl_s=TTL) for i in range(8)]
    start, won = threading.Barrier(len(contenders)), []

    def contend(lease: Lease) -> None:
        start.wait()
        if lease.acquire():
            won.append(lease.holder)

    threads = [threading.Thread(target=contend, args=(lease,)) for lease in contenders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and read_lease(tree).holder == won[0]
    assert leftovers(tree) == []


def test_a_stale_lease_is_taken_over_and_its_holder_finds_it_lost(tree):
    clock_a, clock_b = Clock(), Clock()
    a, b = Lease(tree, "a", ttl_s=TTL, clock=clock_a), Lease(tree, "b", ttl_s=TTL, clock=clock_b)
    assert a.acquire()
    clock_b.now += TTL - 1
    assert not b.acquire()  # not yet expired
    clock_b.now += 2
    assert b.acquire() and read_lease(tree).holder == "b"
    assert not a.renew() and not a.held  # a (stalled) learns it lost the lease
    a.release()  # and its release never removes b's
    assert read_lease(tree).holder == "b"
    assert leftovers(tree) == []


def test_a_renew_near_or_past_its_expiry_never_overwrites_a_takeover(tree):
    clock_a, clock_b = Clock(), Clock()
    a, b = Lease(tree, "a", ttl_s=TTL, clock=clock_a), Lease(tree, "b", ttl_s=TTL, clock=clock_b)
    assert a.acquire()
    clock_a.now += TTL + 5  # a stalled past its expiry, and nobody took the lease: it renews
    assert a.renew() and read_lease(tree).holder == "a" and read_lease(tree).expires_at == clock_a.now + TTL
    clock_a.now += TTL - 0.5  # half a second before its expiry: renewed the takeover's way
    assert a.renew() and read_lease(tree).expires_at == clock_a.now + TTL
    clock_b.now = clock_a.now + TTL + 1
    assert b.acquire()  # a stalls past its expiry again, and b takes over
    clock_a.now += TTL + 2
    assert not a.renew() and read_lease(tree).holder == "b"
    assert leftovers(tree) == []


def test_a_crashed_holder_is_taken_over_after_its_expiry(tree):
    code = ("import sys, os; from pykv.tree import KVTree; from pykv.maintenance.lease import Lease\n"
            f"assert Lease(KVTree.open({str(tree.root)!r}), 'dead', ttl_s={TTL}).acquire()\n"
            "os._exit(0)  # no release: a crash")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert read_lease(tree).holder == "dead"
    assert not Lease(tree, "b", ttl_s=TTL).acquire()
    later = Clock(time.time() + TTL + 1)
    assert Lease(tree, "b", ttl_s=TTL, clock=later).acquire() and read_lease(tree).holder == "b"


def test_contenders_for_a_stale_lease_end_with_one_holder(tree):
    """Several engines take over one stale lease at once: the file names one of those that won, and
    if the residual race let two believe they won, the other one's next renew finds it lost."""
    stale = Clock(time.time() - 10 * TTL)
    assert Lease(tree, "dead", ttl_s=TTL, clock=stale).acquire()
    contenders = [Lease(tree, f"h{i}", ttl_s=TTL) for i in range(8)]
    start, won = threading.Barrier(len(contenders)), []

    def contend(lease: Lease) -> None:
        start.wait()
        if lease.acquire():
            won.append(lease)

    threads = [threading.Thread(target=contend, args=(lease,)) for lease in contenders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    holder = read_lease(tree).holder
    assert won and holder in {lease.holder for lease in won}
    assert [lease.holder for lease in won if lease.renew()] == [holder]
    assert leftovers(tree) == []


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_what_pykv_did_not_write_at_the_lease_name_is_moved_to_quarantine_and_taken_over(tree, tmp_path, case):
    plant(tree, case, tmp_path / "outside")
    assert check_lease(tree).fault.value == HOSTILE[case][1]
    assert Lease(tree, "a", ttl_s=TTL).acquire() and read_lease(tree).holder == "a"
    assert len(quarantined(tree)) == 1 and check_lease(tree) is None  # moved, never deleted
    check_outside_intact(tree, tmp_path / "outside")
    assert leftovers(tree) == []


def test_a_lease_within_pykvs_longest_term_is_pykvs_and_a_longer_ttl_is_cut(tree):
    clock = Clock()
    a = Lease(tree, "a", ttl_s=100 * MAX_TERM_S, clock=clock)
    assert a.acquire() and read_lease(tree).expires_at == clock.now + MAX_TERM_S
    assert check_lease(tree) is None and not Lease(tree, "b", ttl_s=TTL, clock=clock).acquire()
    clock.now -= CLOCK_SKEW_S - 1  # another node whose clock is behind, within the skew: still pykv's
    assert check_lease(tree, clock.now) is None and not Lease(tree, "c", ttl_s=TTL, clock=clock).acquire()
    assert quarantined(tree) == []


def test_a_lease_published_after_the_defect_was_judged_is_left_in_place(tree, tmp_path):
    path = plant(tree, "garbage", tmp_path / "outside")
    judged = check_lease(tree)
    path.rename(tmp_path / "outside" / "kept")  # (kept: its inode cannot be reused by the new lease)
    assert Lease(tree, "b", ttl_s=TTL).acquire()
    assert quarantine_lease(tree, "run", judged) is None  # moved, found to be another inode, linked back
    assert read_lease(tree).holder == "b" and quarantined(tree) == []
    assert not (tree.state_dir / "quarantine" / "run" / ".pykv" / LEASE_NAME).exists()


def test_a_lease_caught_mid_publish_is_read_once_its_temp_link_is_gone(tree):
    """A contender that loses the link race may stat the lease between the winner's link and
    its temp's unlink (two links): it waits for the temp to go instead of refusing the lease."""
    assert Lease(tree, "winner", ttl_s=TTL).acquire()
    temp = tree.state_dir / f"{LEASE_NAME}.tmp-mid-publish"
    os.link(lease_path(tree), temp)
    unlinker = threading.Timer(0.3, temp.unlink)
    unlinker.start()
    try:
        assert not Lease(tree, "loser", ttl_s=TTL).acquire()
        assert read_lease(tree).holder == "winner"
    finally:
        unlinker.join()


def test_a_second_link_that_outlives_a_publish_is_refused(tree, monkeypatch):
    from pykv.maintenance import lease as lease_module
    monkeypatch.setattr(lease_module, "PUBLISH_SETTLE_S", 0.2)
    assert Lease(tree, "winner", ttl_s=TTL).acquire()
    os.link(lease_path(tree), tree.state_dir / "kept-link")
    started = time.monotonic()
    with pytest.raises(LeaseRefused, match="not a lease pykv wrote"):
        read_lease(tree)
    assert time.monotonic() - started < 2  # bounded: never waits on a link that stays


def test_processes_racing_for_a_free_lease_never_see_a_publish_as_foreign(tmp_path):
    """Separate processes (no shared GIL) race for a free lease, round after round: one wins each
    round, and no loser mistakes the winner's publish in flight for a foreign file."""
    for round_ in range(15):
        tree = KVTree.create(tmp_path / f"round{round_}")
        reports, _ = race(contend_for_lease, [(str(tree.root), f"p{i}") for i in range(4)], method="fork", timeout=60)
        assert [error for _, _, error in reports] == [""] * 4
        assert sum(won for _, won, _ in reports) == 1


def test_scans_see_the_lease_and_its_temps_as_pykvs(tree):
    assert Lease(tree, "a", ttl_s=TTL).acquire()
    (tree.state_dir / f"{LEASE_NAME}.tmp.host.1.abcd").write_bytes(b"")  # a killed holder's temp
    kinds = {os.path.basename(e.path): e.kind for e in Scan.of(tree).entries}
    assert LEASE_NAME not in kinds  # pykv's own state file: skipped like gc.json
    assert kinds[f"{LEASE_NAME}.tmp.host.1.abcd"] is Kind.TEMP  # fsck removes it, never reports it foreign
