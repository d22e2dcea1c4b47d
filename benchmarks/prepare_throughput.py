"""`ndtrain prepare` throughput (MB of text per second), 1 vs 2 workers, on a parquet corpus made
from the default corpus (the Python standard library's .py files, one row per file).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/prepare_throughput.py --mb 24 --passes 3

Per pass, and interleaved so machine load hits both alike:
- byte tokenizer: the whole `ndtrain prepare` command (read parquet, tokenize, write shards, hash);
- BPE (vocab 8192, trained once beforehand on the same text): the tokenization phase alone
  (`encode_units`: workers read their units and run the batch encoder single-threaded), which is
  what --workers parallelises; BPE training itself runs on all cores whatever --workers says.
Prints the median MB/s per setting and the 2-worker/1-worker ratio, with the load average.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_parquet(out: Path, mb: float, files: int) -> int:
    """The default corpus as `files` parquet files (column `text`); returns the bytes of text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ndtrain.data.sources import collect

    paths, _ = collect(None)
    texts, total, cap = [], 0, int(mb * 1e6)
    for f in paths:
        t = Path(f.path).read_bytes().decode("utf-8", errors="replace")
        texts.append(t)
        total += len(t.encode())
        if total >= cap:
            break
    out.mkdir(parents=True, exist_ok=True)
    per = -(-len(texts) // files)
    for i in range(files):
        pq.write_table(pa.table({"text": texts[i * per:(i + 1) * per]}), out / f"part-{i:03d}.parquet",
                       row_group_size=256)
    return total


def time_prepare(corpus: Path, out: Path, workers: int) -> tuple[float, int]:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([str(ROOT / ".venv/bin/ndtrain"), "prepare", str(corpus), "--out", str(out),
                    "--workers", str(workers)], check=True, capture_output=True)
    seconds = time.perf_counter() - t0
    from ndtrain.data.manifest import read_manifest

    return seconds, read_manifest(out)["num_bytes"]


def time_bpe_encode(units, tok, workers: int) -> float:
    import numpy as np

    from ndtrain.data.encode import encode_units

    t0 = time.perf_counter()
    for _ in encode_units(units, tok, np.dtype(np.uint16), workers):
        pass
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=24.0, help="MB of stdlib text in the parquet corpus")
    p.add_argument("--files", type=int, default=8, help="parquet files (work units)")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--bpe-mb", type=float, default=8.0, help="MB of the corpus tokenized in the BPE timing")
    a = p.parse_args()
    from ndtrain.data.sources import collect, plan_units, sample_texts
    from ndtrain.data.tokenizer import BPETokenizer

    with tempfile.TemporaryDirectory(prefix="ndtrain-prep-bench-") as tmp:
        tmp = Path(tmp)
        total = make_parquet(tmp / "corpus", a.mb, a.files)
        bpe_corpus_bytes = make_parquet(tmp / "bpe-corpus", a.bpe_mb, a.files)
        files, _ = collect([str(tmp / "bpe-corpus")])
        units = plan_units(files, "text")
        t0 = time.perf_counter()
        tok = BPETokenizer.train(sample_texts(files, units, int(a.bpe_mb * 1e6)), 8192)
        train_s = time.perf_counter() - t0
        rates: dict[str, list[float]] = {}
        load = [os.getloadavg()[0]]
        for _ in range(a.passes):
            for w in (1, 2):
                s, nbytes = time_prepare(tmp / "corpus", tmp / f"out{w}", w)
                rates.setdefault(f"byte prepare, workers={w}", []).append(nbytes / 1e6 / s)
            for w in (1, 2):
                s = time_bpe_encode(units, tok, w)
                rates.setdefault(f"bpe tokenize, workers={w}", []).append(bpe_corpus_bytes / 1e6 / s)
            load.append(os.getloadavg()[0])
    print(f"parquet corpus: {total / 1e6:.1f} MB of stdlib text in {a.files} files; BPE timing on "
          f"{bpe_corpus_bytes / 1e6:.1f} MB (tokenizer trained once in {train_s:.1f} s, vocab {tok.vocab_size})")
    print(f"{'setting':<28} {'median MB/s':>11}   passes")
    for name, r in rates.items():
        print(f"{name:<28} {statistics.median(r):>11.2f}   {', '.join(f'{x:.2f}' for x in r)}")
    for kind in ("byte prepare", "bpe tokenize"):
        one, two = statistics.median(rates[f"{kind}, workers=1"]), statistics.median(rates[f"{kind}, workers=2"])
        print(f"{kind}: 2 workers / 1 worker = {two / one:.2f}x")
    print(f"load average (1 min) during the run: {', '.join(f'{x:.2f}' for x in load)}; cores: {os.cpu_count()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
