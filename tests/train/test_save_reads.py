"""A checkpoint save reads a bounded number of bytes, whatever the checkpoint's size: the digests
are taken from the bytes as they are written (not read back), and retention confirms the
previous checkpoint by its files' sizes (stat), not by hashing it again. Counted with the
kernel's own tally of the bytes this process read (/proc/self/io, rchar: page-cache hits
included)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs /proc/self/io (Linux)")


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def _checkpoint_bytes(ckpt: Path) -> int:
    return sum(p.stat().st_size for p in ckpt.iterdir() if p.is_file())


def _reads_per_save(parity_base, run: Path, model: dict, async_: bool) -> tuple[list[int], int]:
    """Four saves with keep_last = 1 (each one confirms the previous and lets an older one go);
    the bytes read by each of the last three, and the size of one checkpoint."""
    from ckpt_helpers import cfg_of, job

    from ndtrain.train.checkpoint import list_checkpoints, verify_checkpoint
    from ndtrain.train.trainer import Trainer

    cfg = cfg_of(job(parity_base, run, model=model, train={"steps": 10},
                     checkpoint={"keep_last": 1, "async": async_}))
    trainer = Trainer(cfg, run_dir=None, log=False)
    ck = trainer.checkpointer(run, cfg)
    ck._info = lambda text: None
    reads = []
    for i in range(4):
        trainer.train_step()
        before = _rchar()
        ck.save()
        ck.wait()  # an async save's background write and publish count too
        if i:  # the first save has no previous checkpoint to confirm
            reads.append(_rchar() - before)
    ck.finish()
    trainer.close()
    kept = list_checkpoints(run / "checkpoints")
    assert [c.name for c in kept] == ["step_00000003", "step_00000004"]  # keep_last = 1 plus the confirmed one
    assert [verify_checkpoint(c) for c in kept] == [None, None]  # the digests taken while writing match the files
    return reads, _checkpoint_bytes(kept[-1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_", [False, True])
def test_bytes_read_per_save_do_not_grow_with_the_checkpoint(async_, parity_base, tmp_path):
    small_reads, small = _reads_per_save(parity_base, tmp_path / "small", {"n_layers": 1, "dim": 32, "n_heads": 4,
                                                                         "n_kv_heads": 2, "ffn_dim": 64}, async_)
    big_reads, big = _reads_per_save(parity_base, tmp_path / "big", {"n_layers": 4, "dim": 128, "ffn_dim": 512},
                                     async_)
    assert big > 10 * small, (small, big)  # two sizes far apart: a read that grows with it shows
    # Before: every save read the previous checkpoint back (hash) and its own shards (digests),
    # about twice the checkpoint. Now what a save reads is its manifest and DCP metadata: small,
    # and the same for both sizes up to the metadata's few hundred bytes more per tensor name.
    assert max(big_reads) < big / 20, (big_reads, big)
    assert max(big_reads) - min(small_reads) < (big - small) / 50, (small_reads, big_reads, small, big)
