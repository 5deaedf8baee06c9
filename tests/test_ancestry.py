"""Roots compared as the file system knows them (``pykv.io.ancestry``): a bind mount, a symbolic link
or the same path twice never lets one directory join a set twice, or one root hide inside another,
for an engine (``DeviceSet.create``) or any command (issue 36)."""

from __future__ import annotations

import pytest
from mounts import bind  # noqa: F401  (fixture)
from test_cli_devices import ENGINE_COMMANDS, command_args
from treefactory import NS, add_block, key
from typer.testing import CliRunner

from pykv.commands.app import app
from pykv.deviceset import DeviceSet
from pykv.errors import InputError
from pykv.io.ancestry import holder_of, lineage
from pykv.tree import MARKER_NAME, STATE_DIR, KVTree

FIELD = "kv_connector_extra_config.roots"


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_line_refusal(result, *words):
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert result.stderr.startswith("pykv: error: ") and result.stderr.count("\n") == 1, result.stderr
    for word in words:
        assert str(word) in result.stderr, result.stderr
    return result.stderr


def refused(roots, *words):
    with pytest.raises(InputError) as caught:
        DeviceSet.create(roots)
    assert "\n" not in str(caught.value)
    for word in words:
        assert str(word) in str(caught.value), caught.value
    return str(caught.value)


def test_lineage_follows_the_real_parents(tmp_path, bind):
    (tmp_path / "a" / "sub").mkdir(parents=True)
    mount = bind(tmp_path / "a", tmp_path / "m")
    assert lineage(mount)[0] == lineage(tmp_path / "a")[0]
    assert lineage(tmp_path / "a")[0] in lineage(mount / "sub")
    assert lineage("/")[-1] == lineage("/")[0] and len(lineage("/")) == 1
    assert holder_of(mount / "sub", "sub", include_self=False) is not None
    assert holder_of(tmp_path / "a", "nothing-here", include_self=True) is None


def test_a_bind_mount_of_a_root_is_the_same_directory(tmp_path, bind):
    a = tmp_path / "a"
    a.mkdir()
    mount = bind(a, tmp_path / "m")
    refused([a, mount], f"{FIELD}[0] and {FIELD}[1]", "one directory", "overlap")
    assert list(a.iterdir()) == []  # refused before any marker was written
    for command in (["config", "--root", a, "--root", mount], ["serve", "m", "--dry-run", "--root", a, "--root", mount]):
        one_line_refusal(run(*command), "--root[0] and --root[1]", "one directory")


def test_a_root_inside_another_through_a_bind_mount_is_refused(tmp_path, bind):
    """``pykv fsck A M/sub --repair``, M a bind mount of A: the second tree is never quarantined."""
    a = KVTree.create(tmp_path / "a")
    add_block(a, key(0))
    inner = KVTree.create(a.root / "sub")  # made by hand (library): a tree inside the first
    add_block(inner, key(1))
    mount = bind(a.root, tmp_path / "m")
    refused([a.root, mount / "sub"], "overlap", f"{mount / 'sub'} lies inside {a.root}")
    refused([mount / "sub", a.root], "overlap", f"{mount / 'sub'} lies inside {a.root}")
    for command in (["fsck", "--repair"], ["gc", "--max-size", "0"], ["inspect"]):
        one_line_refusal(run(*command, a.root, mount / "sub"), "ROOT[0] and ROOT[1]", "lies inside")
    assert (a.root / "sub" / MARKER_NAME).is_file() and inner.contains(NS.id, key(1)) and a.contains(NS.id, key(0))
    assert not (a.root / STATE_DIR).exists()  # nothing moved to a quarantine


def test_a_symbolic_link_to_a_root_is_the_same_directory(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (tmp_path / "link").symlink_to(a)
    refused([a, tmp_path / "link"], "one directory")
    (a / "sub").mkdir()
    (tmp_path / "deep").symlink_to(a / "sub")
    refused([tmp_path / "deep", a], f"{tmp_path / 'deep'} lies inside {a}")
    assert sorted(p.name for p in a.iterdir()) == ["sub"]


def test_the_same_root_twice_is_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    refused([a, b, tmp_path / "b" / ".." / "a"], f"{FIELD}[0] and {FIELD}[2]", "one directory")
    DeviceSet.create([a, b])
    one_line_refusal(run("fsck", a, b, a), "ROOT[0] and ROOT[2]", "one directory")


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_every_engine_command_refuses_a_bind_mount_alias_and_nesting(tmp_path, bind, command):
    a = tmp_path / "a"
    (a / "sub").mkdir(parents=True)
    mount = bind(a, tmp_path / "m")
    args = command_args(command, tmp_path)
    one_line_refusal(run(*args, "--root", a, "--root", mount), "--root[0] and --root[1]", "one directory")
    one_line_refusal(run(*args, "--root", mount / "sub", "--root", a), "--root[0] and --root[1]",
                     f"{mount / 'sub'} lies inside {a}")
    assert sorted(p.name for p in a.iterdir()) == ["sub"] and list((a / "sub").iterdir()) == []


def test_a_bind_mount_of_a_subdirectory_still_lies_inside_the_tree(tmp_path, bind):
    """``M`` a bind mount of ``A/x``: ``M/..`` is ``M``'s mount point's parent, but the walk goes
    on from ``A`` (another mount shows it), so M is inside tree A to ``init``, a set and every
    command, and ``fsck --repair A M`` never moves M's files into A's quarantine."""
    a = KVTree.create(tmp_path / "a")
    add_block(a, key(0))
    (a.root / "x").mkdir()
    mount = bind(a.root / "x", tmp_path / "m")
    assert lineage(a.root)[0] in lineage(mount)
    assert holder_of(mount, MARKER_NAME, include_self=False) is not None
    one_line_refusal(run("init", mount), "lies inside the pykv tree", a.root)
    assert list(mount.iterdir()) == []
    inner = KVTree.create(a.root / "x")  # made by hand (library), as a copied marker would be
    add_block(inner, key(1))
    refused([a.root, mount], "overlap", f"{mount} lies inside {a.root}")
    for command in (["fsck", "--repair", "--grace", "0s"], ["gc", "--max-size", "0"], ["inspect"]):
        one_line_refusal(run(*command, a.root, mount), "ROOT[0] and ROOT[1]", "lies inside")
    assert (mount / MARKER_NAME).is_file() and inner.contains(NS.id, key(1))
    assert not (a.root / STATE_DIR).exists()  # nothing moved to a quarantine


def test_a_bind_mount_of_a_subdirectory_of_a_plain_directory_walks_its_real_parents(tmp_path, bind):
    (tmp_path / "plain" / "deep" / "er").mkdir(parents=True)
    mount = bind(tmp_path / "plain" / "deep" / "er", tmp_path / "m")
    chain = lineage(mount)
    assert chain[0] == lineage(tmp_path / "plain" / "deep" / "er")[0]
    assert lineage(tmp_path / "plain" / "deep")[0] in chain and lineage(tmp_path / "plain")[0] in chain
    assert lineage(tmp_path)[0] in chain and lineage("/")[0] in chain
    assert chain[:len(lineage(tmp_path)) + 1] == (chain[0], *lineage(tmp_path))  # the ``..`` chain first
    assert len(set(chain)) == len(chain)


def test_a_directory_mounted_inside_a_tree_still_lies_inside_it(tmp_path, bind):
    """The ``..`` chain is walked as well as the real parents': an outside directory bind-mounted
    at ``T/sub/inner`` lies inside tree T (``init`` refuses it, a set of both is refused)."""
    tree = KVTree.create(tmp_path / "t")
    (tree.root / "sub" / "inner").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    inner = bind(tmp_path / "outside", tree.root / "sub" / "inner")
    assert lineage(tree.root)[0] in lineage(inner)
    one_line_refusal(run("init", inner), "lies inside the pykv tree", tree.root)
    assert list((tmp_path / "outside").iterdir()) == []


def test_sibling_bind_mounts_of_one_file_system_are_not_nested(tmp_path, bind):
    (tmp_path / "fs" / "a").mkdir(parents=True)
    (tmp_path / "fs" / "b").mkdir()
    a = bind(tmp_path / "fs" / "a", tmp_path / "ma")
    b = bind(tmp_path / "fs" / "b", tmp_path / "mb")
    for root in (a, b):
        assert run("init", root).exit_code == 0
    assert lineage(a)[0] not in lineage(b) and lineage(b)[0] not in lineage(a)
    assert run("inspect", a, b).exit_code == 0


def test_a_parent_no_mount_shows_is_not_guessed(tmp_path):
    """Where no mount of the file system shows a bind mount's parent (a container given one
    subdirectory), or the path that would show it lies on another file system, there is no jump."""
    import os

    from pykv.io.ancestry import _hidden_parent
    from pykv.io.mounts import Mount
    (tmp_path / "a" / "b").mkdir(parents=True)
    device = os.stat(tmp_path).st_dev

    def mount(mount_id, point, root, dev="9:9"):
        return Mount(point, "ext4", "/dev/x", ("rw",), (), mount_id=mount_id, device=dev, root=root)
    bound = mount(2, "/elsewhere", "/a/b")
    showing = mount(1, str(tmp_path), "/")
    fd = _hidden_parent([showing, bound], 2, device)
    assert fd is not None and os.path.samestat(os.fstat(fd), os.stat(tmp_path / "a"))
    os.close(fd)
    assert _hidden_parent([bound], 2, device) is None  # nothing shows /a
    assert _hidden_parent([mount(1, str(tmp_path), "/", dev="8:8"), bound], 2, device) is None  # another fs
    assert _hidden_parent([showing, bound], 2, device + 1) is None  # what the path reaches is another fs
    assert _hidden_parent([showing, mount(2, "/elsewhere", "/")], 2, device) is None  # a file system's root
    assert _hidden_parent([showing, bound], 3, device) is None  # an unknown mount
    removed = mount(2, "/elsewhere", "/a/b//deleted")  # the kernel's mark of a removed source
    assert _hidden_parent([showing, removed], 2, device) is None
