"""scripts/gpu_continue_heads.sh: the chain of warm-started continuations (dry run: the script it would start)."""

import gzip
import os
import shutil
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_continue_heads.sh"


def _run(tmp_path, *args, **env):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, WORK=str(tmp_path / "work"), REPO=str(tmp_path / "repo"), **env))


def _dry_chain(tmp_path, chain, **env):
    """The script a dry ``start`` of ``chain`` prints: its lines, the training lines among them, and WORK."""
    r = _run(tmp_path, "start", CHAIN=chain, DRY="1", **env)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    return lines, [x for x in lines if "gpu_train_session.sh" in x], tmp_path / "work"


def _wait(work, name):
    """The chain's line that waits for warm start ``name``."""
    return f"for i in $(seq 360); do [ -f {work}/warm/{name}/head.safetensors ] && break; sleep 5; done"


def _copy(lines, work, name):
    """Index of the chain's line that keeps ``name``'s best head as a warm start."""
    return next(i for i, x in enumerate(lines) if f"cp -r {work}/heads/{name}/best_head {work}/warm/{name}" in x)


def test_dry_chain_trains_each_head_from_its_warm_start_in_order(tmp_path):
    lines, train, work = _dry_chain(tmp_path, "wp3 w3l2", STEPS="100")
    assert len(train) == 2
    assert (f'VARIANTS="wp3:partition.num_stages=3,partition.anchors=[0,10],head.checkpoint={work}/warm/p3,'
            'train.lr=5.0e-4,train.max_steps=100"') in train[0]
    assert f"head.checkpoint={work}/warm/s3l2," in train[1] and "SEQUENTIAL=1" in train[1]
    assert all("head.lm_head_from_target=true head.tower_init_layer=-1" in x for x in train)
    # each head waits for its warm start before training, and the chain says when it is done
    assert lines.index(_wait(work, "p3")) < lines.index(train[0])
    assert "CHAIN DONE" in lines[-1]
    assert not (tmp_path / "repo").exists()  # a dry run starts nothing


def test_joined_heads_train_at_once_in_one_session(tmp_path):
    _, train, _ = _dry_chain(tmp_path, "w2+w3 w4")
    assert len(train) == 2 and "SEQUENTIAL" not in train[0] and "SEQUENTIAL=1" in train[1]
    assert "w2:partition.num_stages=2," in train[0] and " w3:partition.num_stages=3," in train[0]
    assert f"OUT={tmp_path / 'work'}/out_w2_w3 " in train[0]
    assert _run(tmp_path, "start", CHAIN="w2+w9", DRY="1").returncode == 2


def test_unknown_head_and_usage_are_errors(tmp_path):
    r = _run(tmp_path, "start", CHAIN="w2 w5", DRY="1")
    assert r.returncode == 2 and "unknown head 'w5'" in r.stderr
    assert _run(tmp_path, "bogus").returncode == 2


def test_a_fresh_head_in_the_chain_becomes_the_next_heads_warm_start(tmp_path):
    lines, train, work = _dry_chain(tmp_path, "s2l2 w2l2")
    # the fresh head: the equal-tokens recipe (default lr, 3,600 steps, its tower depth), no checkpoint
    assert 'VARIANTS="s2l2:partition.num_stages=2,head.num_layers=2,train.max_steps=3600"' in train[0]
    assert "head.checkpoint" not in train[0] and "train.lr=" not in train[0]
    # its best head is copied to the warm starts only if the run produced one, before the continuation waits for it
    copy = _copy(lines, work, "s2l2")
    assert lines[copy].startswith(f"[ -f {work}/heads/s2l2/best_head/head.safetensors ] &&")
    wait = lines.index(_wait(work, "s2l2"))
    assert lines.index(train[0]) < copy < wait < lines.index(train[1])
    assert f"head.checkpoint={work}/warm/s2l2,train.lr=5.0e-4" in train[1]


def test_a_group_cannot_hold_a_head_and_its_own_warm_start(tmp_path):
    r = _run(tmp_path, "start", CHAIN="s4+w4", DRY="1")
    assert r.returncode == 2 and 'put them in order: "s4 w4"' in r.stderr


def test_a_continued_head_is_the_warm_start_of_a_third_run(tmp_path):
    lines, train, work = _dry_chain(tmp_path, "s3l2 w3l2 x3l2")
    assert len(train) == 3 and "head.num_layers=2,train.max_steps=3600" in train[0]
    # w3l2 continues s3l2 (not trained fresh), and its best head becomes x3l2's warm start
    assert f"w3l2:partition.num_stages=3,head.checkpoint={work}/warm/s3l2,train.lr=5.0e-4" in train[1]
    assert f"x3l2:partition.num_stages=3,head.checkpoint={work}/warm/w3l2,train.lr=5.0e-4" in train[2]
    copy = _copy(lines, work, "w3l2")
    wait = lines.index(_wait(work, "w3l2"))
    assert lines.index(train[1]) < copy < wait < lines.index(train[2])
    # x3l2 is the fourth run's warm start: its best head is kept too
    assert _copy(lines, work, "x3l2") > lines.index(train[2])


def test_fourth_to_sixth_runs_continue_the_one_before_and_each_is_kept(tmp_path):
    lines, train, work = _dry_chain(tmp_path, "y3l2 z3l2 a3l2 y2l2")
    assert len(train) == 4
    # y3l2 waits for a carried x3l2 (nothing in this chain trains it), z3l2 for y3l2 trained just before it
    assert lines.index(_wait(work, "x3l2")) < lines.index(train[0])
    assert f"y3l2:partition.num_stages=3,head.checkpoint={work}/warm/x3l2,train.lr=5.0e-4" in train[0]
    assert f"z3l2:partition.num_stages=3,head.checkpoint={work}/warm/y3l2,train.lr=5.0e-4" in train[1]
    assert f"a3l2:partition.num_stages=3,head.checkpoint={work}/warm/z3l2,train.lr=5.0e-4" in train[2]
    assert f"y2l2:partition.num_stages=2,head.checkpoint={work}/warm/x2l2,train.lr=5.0e-4" in train[3]
    assert all("head.num_layers" not in x for x in train)  # the tower depth comes from the warm start's config
    assert lines.index(train[0]) < _copy(lines, work, "y3l2") < lines.index(train[1])
    assert lines.index(train[1]) < _copy(lines, work, "z3l2") < lines.index(train[2])
    assert _copy(lines, work, "a3l2") > lines.index(train[2])  # b3l2's warm start


def test_sixth_run_waits_for_a_carried_fifth(tmp_path):
    lines, train, work = _dry_chain(tmp_path, "a3l2 z2l2 a2l2")
    assert len(train) == 3
    assert lines.index(_wait(work, "z3l2")) < lines.index(train[0])  # carried: nothing in this chain trains it
    assert f"a3l2:partition.num_stages=3,head.checkpoint={work}/warm/z3l2,train.lr=5.0e-4" in train[0]
    assert f"z2l2:partition.num_stages=2,head.checkpoint={work}/warm/y2l2,train.lr=5.0e-4" in train[1]
    assert lines.index(train[1]) < _copy(lines, work, "z2l2") < lines.index(_wait(work, "z2l2")) < lines.index(train[2])
    assert f"a2l2:partition.num_stages=2,head.checkpoint={work}/warm/z2l2,train.lr=5.0e-4" in train[2]


def test_any_head_continues_run_after_run_by_letter(tmp_path):
    lines, train, work = _dry_chain(tmp_path, "x2 ap6 e2l2 h4")
    assert f"x2:partition.num_stages=2,head.checkpoint={work}/warm/w2,train.lr=5.0e-4" in train[0]
    assert (f"ap6:partition.num_stages=6,partition.anchors=[0,5],head.checkpoint={work}/warm/zp6,"
            "train.lr=5.0e-4") in train[1]
    assert f"e2l2:partition.num_stages=2,head.checkpoint={work}/warm/d2l2,train.lr=5.0e-4" in train[2]
    assert f"h4:partition.num_stages=4,head.checkpoint={work}/warm/g4,train.lr=5.0e-4" in train[3]
    assert _copy(lines, work, "e2l2") > lines.index(train[2])  # f2l2's warm start
    assert not any(f"heads/h4/best_head {work}/warm" in x for x in lines)  # the 13th run: the last letter
    r = _run(tmp_path, "start", CHAIN="i2", DRY="1")
    assert r.returncode == 2 and "unknown head 'i2'" in r.stderr and "letters w x y z" in r.stderr


def test_the_runs_of_one_base_share_its_compile_cache(tmp_path):
    """Each run trains under its own name, and so compiled from nothing on every fresh machine (train_<name>.bin):
    a head alone in its item now starts from its base's cache, the chain's newest (WORK) before a carried one, and
    leaves its own there for the next run and for `fetch` when it differs from the one it started from. The chain's
    cache lines are run here in a scratch tree."""
    lines, train, work = _dry_chain(tmp_path, "w6 x6 w2+w3")
    cache = [x for x in lines if "compile_cache/train_" in x and "gpu_train_session.sh" not in x]
    assert len(cache) == 4 and not any("train_w2" in x or "train_w3" in x for x in cache)  # a group: its own
    before_w6, after_w6, before_x6, after_x6 = cache
    assert lines.index(before_w6) < lines.index(train[0]) < lines.index(after_w6) < lines.index(before_x6)
    tree = tmp_path / "tree"
    (tree / "runs" / "compile_cache").mkdir(parents=True)
    (tree / "runs" / "compile_cache" / "train_6.bin").write_text("carried")

    def run(line):
        assert subprocess.run(["bash", "-c", line], cwd=tree, timeout=30).returncode == 0

    run(before_w6)
    assert (tree / "runs" / "compile_cache" / "train_w6.bin").read_text() == "carried"
    run(after_w6)  # it compiled nothing new: the carried cache is not kept to be sent back where it came from
    assert not (work / "compile_cache").exists()
    (tree / "runs" / "compile_cache" / "train_w6.bin").write_text("w6's")  # what the run saved
    run(after_w6)  # kept gzip'd: an n = 6 cache (~70 MB) is over what one call sends back, gzip'd it is ~8 MB
    kept = work / "compile_cache" / "train_6.bin.gz"
    assert gzip.decompress(kept.read_bytes()) == b"w6's"
    assert not (work / "compile_cache" / "train_6.bin").exists()
    assert not [p for p in (work / "compile_cache").iterdir() if p.name.endswith(".part")]
    run(before_x6)  # the chain's newest, not the carried one
    assert (tree / "runs" / "compile_cache" / "train_x6.bin").read_text() == "w6's"
    # x6 compiled nothing new: the base's cache is left as it was (same mtime), so `fetch` does not send it again
    os.utime(kept, (1_000_000, 1_000_000))
    run(after_x6)
    assert kept.stat().st_mtime == 1_000_000
    (tree / "runs" / "compile_cache" / "train_x6.bin").write_text("x6's")  # it did compile more: replaced
    run(after_x6)
    assert gzip.decompress(kept.read_bytes()) == b"x6's"
    # carried gzip'd (a cache is ~37 MB, ~4.5 MB gzip'd): unpacked under the run's name
    (tree / "runs" / "compile_cache" / "train_6.bin").unlink()
    (tree / "runs" / "compile_cache" / "train_w6.bin").unlink()
    (tree / "runs" / "compile_cache" / "train_6.bin.gz").write_bytes(gzip.compress(b"carried gzip'd"))
    shutil.rmtree(work / "compile_cache")
    run(before_w6)
    assert (tree / "runs" / "compile_cache" / "train_w6.bin").read_bytes() == b"carried gzip'd"
    run(after_w6)  # compared with the carried .gz it started from: unchanged, not kept
    assert not (work / "compile_cache").exists()
    # a corrupt (truncated) .gz: no partial file under the run's name (it would count as its cache and go back)
    (tree / "runs" / "compile_cache" / "train_w6.bin").unlink()
    (tree / "runs" / "compile_cache" / "train_6.bin.gz").write_bytes(gzip.compress(os.urandom(4000))[:2000])
    run(before_w6)
    assert not [p.name for p in (tree / "runs" / "compile_cache").iterdir() if p.name.startswith("train_w6.bin")]
    assert "'compile_cache/train_*.bin.gz'" in SCRIPT.read_text()  # returned by wait / fetch
    # and only so: no run packs every cache of its CACHE_DIR into its own $OUT as well (~70 MB a base at n = 6)
    assert train and all(" CACHE_RETURN_MB=0 " in x for x in train)
