from __future__ import annotations

from treefactory import BLOCK_SIZE, HOUR, NS, OTHER_NS, add_block, key, make_tree

from pykv.maintenance.gc import run_gc
from pykv.maintenance.inspect import AGE_BUCKETS, age_bucket, inspect_tree, summarize
from pykv.maintenance.scan import Entry, Kind

NOW = 10**18
S = 10**9


def test_age_buckets():
    assert [age_bucket(a) for a in (0, 599, 600, 3599, 86399, 86400 * 6, 86400 * 29, 86400 * 400)] == \
        ["<10m", "<10m", "<1h", "<1h", "<1d", "<7d", "<30d", ">=30d"]
    assert len(AGE_BUCKETS) == 6


def test_summarize_is_per_namespace():
    entries = [Entry("/a", Kind.BLOCK, "aa", 100, 0, NOW - 60 * S), Entry("/b", Kind.BLOCK, "aa", 50, 0, NOW - 2 * HOUR * S),
               Entry("/c", Kind.BLOCK, "bb", 500, 0, NOW), Entry("/d", Kind.TEMP, "aa", 7, 0, NOW - 100 * S),
               Entry("/e", Kind.FOREIGN, None, 1, 0, NOW), Entry("/f", Kind.METADATA, "aa", 300, 0, NOW)]
    summary = summarize("/root", entries, now_ns=NOW)
    assert [(s.id, s.files, s.bytes, s.temp_files) for s in summary.namespaces] == \
        [("bb", 1, 500, 0), ("aa", 2, 150, 1), ("", 0, 0, 0)]
    assert (summary.files, summary.bytes, summary.temp_files, summary.temp_bytes, summary.foreign) == (3, 650, 1, 7, 1)
    assert summary.oldest_temp_age_s == 100
    assert summary.ages["<10m"] == 2 and summary.ages["<1d"] == 1


def test_inspect_tree_reads_descriptions_and_last_gc(tmp_path):
    tree = make_tree(tmp_path, NS, OTHER_NS)
    for i in range(3):
        add_block(tree, key(i))
    add_block(tree, key(9), namespace=OTHER_NS, published_ago=40 * 86400)
    assert inspect_tree(tree).last_gc is None
    run_gc(tree, 3 * BLOCK_SIZE)
    summary = inspect_tree(tree)
    assert summary.files == 3 and summary.bytes == 3 * BLOCK_SIZE
    by_id = {s.id: s for s in summary.namespaces}
    assert by_id[NS.id].description == "test/model bfloat16 tp0/1 pp0 16 tokens/block"
    assert by_id[NS.id].fields["model"] == "test/model"
    assert summary.last_gc["freed_files"] == 1
    assert summary.as_dict()["namespaces"][0]["ages"]


def test_namespaces_that_read_alike_show_what_tells_them_apart(tmp_path):
    import dataclasses
    seeded = dataclasses.replace(NS, extra=(("block_hash_seed", "abc"), ("platform", "cpu")), label="/models/m")
    other_seed = dataclasses.replace(seeded, extra=(("block_hash_seed", "def"), ("platform", "cpu")))
    other_layout = dataclasses.replace(seeded, kv_layout="HND")
    tree = make_tree(tmp_path, seeded, other_seed, other_layout)
    for i, space in enumerate((seeded, other_seed, other_layout)):
        add_block(tree, key(i), namespace=space)
    by_id = {s.id: s for s in inspect_tree(tree).namespaces}
    assert by_id[seeded.id].description == "/models/m bfloat16 tp0/1 pp0 16 tokens/block seed abc kv_layout=NHD"
    assert by_id[other_layout.id].description.endswith("seed abc kv_layout=HND")
    assert by_id[other_seed.id].description == "/models/m bfloat16 tp0/1 pp0 16 tokens/block seed def"
    assert by_id[other_seed.id].fields["extra.platform"] == "cpu" and by_id[other_seed.id].fields["model"] == "test/model"
