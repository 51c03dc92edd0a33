"""Byte corpus: reading, split, deterministic sharded batches, unigram entropy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kda_cp.data import ByteCorpus, DataConfig, load_corpus, stdlib_files, unigram_entropy
from kda_cp.parallel.sharding import shard_bounds


def _corpus(seq_len=37, batch_size=6, seed=3, n=20_000, val_fraction=0.05):
    rng = np.random.default_rng(1234)
    data = rng.integers(0, 256, size=n, dtype=np.uint8)
    cfg = DataConfig(seq_len=seq_len, batch_size=batch_size, seed=seed, val_fraction=val_fraction, val_batches=3)
    return ByteCorpus(cfg, data=data), data


def test_stdlib_corpus_is_python_source():
    files = stdlib_files()
    assert files == sorted(files) and len(files) > 100
    assert not any("site-packages" in p.parts or "test" in p.parts for p in files)
    data = load_corpus(max_bytes=200_000)
    assert data.dtype == np.uint8 and data.size == 200_000
    assert b"def " in data.tobytes() and b"import " in data.tobytes()


def test_path_file_and_folder(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"world")
    (tmp_path / "a.txt").write_bytes(b"hello ")
    assert load_corpus(str(tmp_path), pattern="*.txt").tobytes() == b"hello world"
    assert load_corpus(str(tmp_path / "b.txt")).tobytes() == b"world"
    with pytest.raises(ValueError, match="data.path"):
        load_corpus(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="pattern"):
        load_corpus(str(tmp_path), pattern="*.py")
    with pytest.raises(ValueError, match=r"data.pattern='\*.nothing': no file of the standard library"):
        load_corpus(pattern="*.nothing")


def test_split_disjoint_and_covering():
    corpus, data = _corpus()
    assert corpus.train.size + corpus.val.size == data.size
    assert corpus.val.size == math.floor(data.size * 0.05)
    np.testing.assert_array_equal(np.concatenate([corpus.train, corpus.val]), data)
    # Training windows never reach into the validation split.
    for step in range(50):
        off = corpus.train_offsets(step)
        assert (off >= 0).all() and (off + corpus.config.seq_len + 1 <= corpus.train.size).all()


def test_batches_deterministic_and_step_dependent():
    c1, _ = _corpus()
    c2, _ = _corpus()
    for step in (0, 1, 17):
        x1, y1 = c1.train_batch(step)
        x2, y2 = c2.train_batch(step)
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(c1.train_batch(0)[0], c1.train_batch(1)[0])
    c3, _ = _corpus(seed=4)
    assert not torch.equal(c1.train_batch(0)[0], c3.train_batch(0)[0])


def test_targets_are_next_bytes():
    corpus, _ = _corpus()
    off = corpus.train_offsets(5)
    x, y = corpus.train_batch(5)
    T = corpus.config.seq_len
    assert x.shape == y.shape == (6, T) and x.dtype == torch.int64
    for i, o in enumerate(off):
        window = torch.from_numpy(corpus.train[o : o + T + 1].astype(np.int64))
        assert torch.equal(x[i], window[:-1]) and torch.equal(y[i], window[1:])


@pytest.mark.parametrize("dp,cp", [(1, 2), (2, 3), (3, 1), (2, 4)])
def test_shards_tile_the_global_batch(dp, cp):
    corpus, _ = _corpus(seq_len=37, batch_size=6)
    X, Y = corpus.train_batch(9)
    rows = []
    for d in range(dp):
        parts = [corpus.train_batch(9, d, dp, r, cp) for r in range(cp)]
        for r, (x, _) in enumerate(parts):
            a, b = shard_bounds(37, cp)[r]
            assert x.shape == (6 // dp, b - a)
        rows.append((torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)))
    assert torch.equal(torch.cat([r[0] for r in rows]), X)
    assert torch.equal(torch.cat([r[1] for r in rows]), Y)
    # The val split is sharded the same way.
    Xv, _ = corpus.val_batch(1)
    assert torch.equal(torch.cat([corpus.val_batch(1, 0, 1, r, cp)[0] for r in range(cp)], 1), Xv)


def test_val_batches_fixed_and_inside_val_split():
    corpus, data = _corpus(val_fraction=0.1)
    x, y = corpus.val_batch(0)
    x2, _ = corpus.val_batch(0)
    assert torch.equal(x, x2)
    val = torch.from_numpy(corpus.val.astype(np.int64))
    T = corpus.config.seq_len
    assert torch.equal(x[0], val[:T]) and torch.equal(y[0], val[1 : T + 1])
    assert 1 <= corpus.num_val_batches() <= 3


def test_unigram_entropy():
    assert unigram_entropy(np.zeros(100, dtype=np.uint8)) == 0.0
    assert unigram_entropy(np.arange(256, dtype=np.uint8)) == pytest.approx(math.log(256))
    rng = np.random.default_rng(0)
    data = rng.integers(0, 4, size=50_000, dtype=np.uint8)
    p = np.bincount(data, minlength=4) / data.size
    assert unigram_entropy(data) == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-12)


def test_bad_config():
    with pytest.raises(ValueError, match="val_fraction"):
        DataConfig(val_fraction=0.0)
    with pytest.raises(ValueError, match="seq_len"):
        DataConfig(seq_len=0)
    corpus, _ = _corpus(batch_size=6)
    with pytest.raises(ValueError, match="batch_size"):
        corpus.train_batch(0, 0, 4, 0, 1)
    with pytest.raises(ValueError, match="too short"):
        ByteCorpus(DataConfig(seq_len=100, val_fraction=0.01), data=np.zeros(1000, dtype=np.uint8))
    # a float length used to fail in a slice, a negative seed in numpy, dp_size=0 as a ZeroDivisionError
    with pytest.raises(ValueError, match="data.seq_len must be an int, got 2.5"):
        DataConfig(seq_len=2.5)
    with pytest.raises(ValueError, match="data.seed must be >= 0, got -1"):
        DataConfig(seed=-1)
    with pytest.raises(ValueError, match=r"dp_size \(the data-parallel degree\) must be an int >= 1, got 0"):
        corpus.train_batch(0, 0, 0, 0, 1)
