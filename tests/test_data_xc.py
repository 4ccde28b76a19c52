"""XC text format: reader against an independent line-by-line parse, writer round trip, every bad input."""

from __future__ import annotations

import re

import numpy as np
import pytest
import scipy.sparse as sp

from xmc_repro.data import xc_format
from xmc_repro.data import (LabelCSR, read_labels, read_sparse_labels, read_sparse_matrix, read_xc,
                            shared_data_root, write_sparse_labels, write_xc)
from xmc_repro.errors import DataError


def naive_parse(path):
    """Reference parser: plain Python, one line at a time."""
    lines = open(path).read().split("\n")
    n, d, L = map(int, lines[0].split())
    labels, rows = [], []
    for line in lines[1 : 1 + n]:
        field, _, rest = line.partition(" ")
        labels.append(sorted({int(t) for t in field.split(",") if t}))
        row = {}
        for tok in rest.split():
            j, v = tok.split(":")
            row[int(j)] = row.get(int(j), 0.0) + float(v)
        rows.append(row)
    return n, d, L, labels, rows


def random_xc_text(rng, n=200, d=50, L=30, empty_rate=0.1):
    out = [f"{n} {d} {L}"]
    for _ in range(n):
        labs = [] if rng.random() < empty_rate else rng.choice(L, rng.integers(1, 6), replace=False).tolist()
        feats = rng.choice(d, rng.integers(0, 8), replace=False)
        vals = [rng.choice(["1", f"{rng.random():.6f}", f"{rng.normal():.4e}", "0.5", "3"]) for _ in feats]
        out.append(",".join(map(str, labs)) + " " + " ".join(f"{j}:{v}" for j, v in zip(feats, vals)))
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("chunk", [64, 1 << 20])
def test_reader_matches_naive_parser(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(xc_format, "CHUNK_BYTES", chunk)  # small chunks: lines straddle chunk borders
    rng = np.random.default_rng(chunk)
    path = tmp_path / "data.txt"
    path.write_text(random_xc_text(rng))
    n, d, L, labels, rows = naive_parse(path)
    data = read_xc(path)
    assert data.features.shape == (n, d) and data.labels.num_labels == L and data.num_features == d
    assert data.labels.to_lists() == labels
    for i in range(n):
        r = data.features[i]
        got = dict(zip(r.indices.tolist(), r.data.tolist()))
        assert got.keys() == rows[i].keys()
        np.testing.assert_allclose([got[k] for k in rows[i]], np.float32(list(rows[i].values())), rtol=1e-6)
    assert read_xc(path, labels_only=True).labels.to_lists() == labels


def test_writer_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    n, d, L = 40, 25, 12
    x = sp.random(n, d, density=0.2, random_state=2, dtype=np.float32, data_rvs=lambda k: rng.normal(size=k) * 100)
    x = sp.csr_matrix(x)
    lists = [sorted(rng.choice(L, rng.integers(0, 4), replace=False).tolist()) for _ in range(n)]
    labels = LabelCSR(np.cumsum([0] + [len(r) for r in lists]), np.concatenate([r for r in lists] + [[]]), L)
    path = tmp_path / "rt.txt"
    write_xc(path, x, labels)
    back = read_xc(path)
    assert back.labels.to_lists() == lists
    assert (back.features != x).nnz == 0  # bit-exact float32 values
    assert back.features.dtype == np.float32
    # dense input, all-zero rows and no labels at all
    dense = np.zeros((3, 4), np.float32)
    dense[1, 2] = 0.125
    empty = LabelCSR(np.zeros(4, np.int64), np.zeros(0, np.int64), 5)
    write_xc(path, dense, empty)
    back = read_xc(path)
    np.testing.assert_array_equal(back.features.toarray(), dense)
    assert back.labels.to_lists() == [[], [], []]


def test_sparse_label_files(tmp_path):
    lists = [[3, 1], [], [0, 4, 2]]
    labels = LabelCSR([0, 2, 2, 5], [3, 1, 0, 4, 2], 5)
    path = tmp_path / "trn_X_Y.txt"
    write_sparse_labels(path, labels)
    assert path.read_text().splitlines()[0] == "3 5"
    got = read_sparse_labels(path)
    assert got.to_lists() == [sorted(r) for r in lists] and got.num_labels == 5
    assert got.unsorted_rows == 2  # counted as the file lists them: [3, 1] and [0, 4, 2] are out of order
    assert read_labels(path).to_lists() == got.to_lists()  # told apart from XC files by the header
    m = read_sparse_matrix(path)
    assert m.shape == (3, 5) and m.nnz == 5


def test_edge_cases(tmp_path):
    path = tmp_path / "e.txt"
    # empty label field, labels without features, CRLF, tabs, repeated label, trailing blank line, no final newline
    path.write_bytes(b"4 6 5\r\n 0:1 5:2\r\n2,2,0\n1\t3:0.5\n4 1:1e-3 1:1")
    d = read_xc(path)
    assert d.labels.to_lists() == [[], [0, 2], [1], [4]]
    assert d.labels.unsorted_rows == 1  # "2,2,0": the repeat is no disorder, the fall to 0 is
    np.testing.assert_allclose(d.features.toarray()[3], [0, 1.001, 0, 0, 0, 0], rtol=1e-6)
    path.write_text("2 3 2\n0 0:1\n1 1:1\n\n\n")
    assert read_xc(path).labels.to_lists() == [[0], [1]]
    path.write_text("0 3 2\n")
    assert read_xc(path).labels.num_points == 0


BAD = [
    ("", "1: empty file"),
    ("3 4\n", "1: malformed header"),
    ("x 4 5\n", "1: malformed header"),
    ("2 4 5\r0 1:1\r1 0:1\r", "1: lines end in a bare carriage return (CR), not a newline; convert them"),
    ("2 4 5\n0 1:1\n1;2 0:1\n", ":3: label '1;2'"),
    ("2 4 5\n0 1:1\n1,,2 0:1\n", ":3: label ''"),
    ("2 4 5\n0 1:1\n1 0:1 2\n", ":3: entry '2' is not 'index:value'"),
    ("2 4 5\n0 1:1\n1 0:1:2\n", ":3: entry '0:1:2'"),
    ("2 4 5\n0 1:1\n1 0:\n", ":3: entry '0:'"),
    ("2 4 5\n0 1:1\n1 0:abc\n", ":3: value in '0:abc' is not a number"),
    ("2 4 5\n0 1:1\n1 0:1.5.3\n", ":3: value in '0:1.5.3'"),
    ("3 4 5\n0 1:1\n1 0:1\n1 0:1_0\n", ":4: value in '0:1_0'"),  # float() takes '1_0', the parser does not
    ("2 4 5\n0 1:1\n7 0:1\n", ":3: label id 7 >= 5"),
    ("2 4 5\n0 1:1\n1 4:1\n", ":3: feature index 4 >= 4"),
    ("2 4 5\n0 1:nan\n1 0:1\n", ":2: value nan"),
    ("2 4 5\n0 1:1\n1 0:inf\n", ":3: value inf"),
    ("2 4 5\n0 1:1\n1 0:1e300\n", ":3: value 1e+300"),
    ("3 4 5\n0 1:1\n1 0:1\n", ":4: the file ends after 2 data lines"),
    ("1 4 5\n0 1:1\n1 0:1\n", ":3: more data lines than the 1 points"),
]


@pytest.mark.parametrize("text,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_names_file_and_line(tmp_path, text, message):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(DataError) as info:
        read_xc(path)
    msg = str(info.value)
    assert msg.startswith(str(path)) and message in msg and "\n" not in msg, msg


def test_utf16_file_is_named_as_such(tmp_path):
    """Was 'malformed header' followed by the header's bytes with NULs between them."""
    path = tmp_path / "u.txt"
    text = "2 4 5\n0 1:1\n1 0:1\n"
    # UTF-32's mark begins with UTF-16's; a file without a mark was still a malformed header
    for encoding, named in (("utf-16", "UTF-16"), ("utf-32", "UTF-32"), ("utf-16-le", "UTF-16 or UTF-32")):
        path.write_bytes(text.encode(encoding))
        for read in (read_xc, read_labels):
            with pytest.raises(DataError, match=rf"u\.txt: {named} text \(NUL bytes in its first line\); save it as "
                                                "UTF-8 or ASCII"):
                read(path)


def test_bad_line_deep_in_a_large_file(tmp_path, monkeypatch):
    monkeypatch.setattr(xc_format, "CHUNK_BYTES", 256)
    lines = ["500 10 10"] + [f"{i % 10} {i % 10}:1" for i in range(500)]
    lines[377] = "3 2:1 x"
    path = tmp_path / "big.txt"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"big.txt:378: entry 'x'"):
        read_xc(path)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="file not found"):
        read_xc(tmp_path / "nope.txt")
    with pytest.raises(DataError, match="file not found"):
        read_labels(tmp_path / "nope.txt")


SHARED = shared_data_root()


@pytest.mark.skipif(not (SHARED / "Delicious").is_dir(), reason="shared data not available")
@pytest.mark.parametrize("name,n,d,L,avg", [("Bibtex", 4880, 1836, 159, 2.380), ("Delicious", 12920, 500, 983, 19.047)])
def test_real_files(name, n, d, L, avg):
    path = SHARED / name / f"{name.lower()}_train_xc.txt"
    data = read_xc(path)
    assert data.features.shape == (n, d) and data.labels.num_labels == L
    assert data.labels.nnz / n == pytest.approx(avg, abs=1e-3)
    _, _, _, labels, rows = naive_parse(path)
    assert data.labels.to_lists() == labels
    assert data.labels.unsorted_rows == 0  # so the authors' P@k (it assumes sorted labels) counts as ours here
    assert data.features.nnz == sum(len(r) for r in rows)
    if name == "Delicious":
        assert int((data.labels.lengths() == 0).sum()) == 10  # points without labels, per the data's README


def test_bom_and_crlf_files_are_simply_read(tmp_path):
    plain = b"3 5 3\n0,1 0:1.0 2:0.5\n2 1:1.0\n1 3:0.25 4:1\n"
    (tmp_path / "plain.txt").write_bytes(plain)
    (tmp_path / "bom_crlf.txt").write_bytes(b"\xef\xbb\xbf" + plain.replace(b"\n", b"\r\n"))
    a, b = read_xc(tmp_path / "plain.txt"), read_xc(tmp_path / "bom_crlf.txt")
    assert a.labels.to_lists() == b.labels.to_lists() == [[0, 1], [2], [1]]
    assert (a.features != b.features).nnz == 0
    (tmp_path / "labels.txt").write_bytes(b"\xef\xbb\xbf2 3\r\n0:1 2:1\r\n1:1\r\n")
    assert read_labels(tmp_path / "labels.txt").to_lists() == [[0, 2], [1]]


def test_blank_line_inside_the_data_is_named(tmp_path):
    lines = [f"{i % 3} {i % 5}:1" for i in range(41)]
    path = tmp_path / "blank.txt"
    path.write_text("41 5 3\n" + "\n".join(lines[:10] + [""] + lines[10:]) + "\n")  # line 12 is blank
    with pytest.raises(DataError) as info:
        read_xc(path)
    message = str(info.value)
    assert message.startswith(f"{path}:12: blank line") and "remove the blank line" in message, message
    assert "header's point count" not in message  # fixing the header would read the blank line as a point


def test_files_that_are_no_text_files(tmp_path, monkeypatch):
    import gzip

    with gzip.open(tmp_path / "train.txt.gz", "wt") as handle:
        handle.write("1 5 3\n0 0:1\n")
    with pytest.raises(DataError, match=r"train.txt.gz: gzip-compressed; decompress it first \(gunzip -k "):
        read_xc(tmp_path / "train.txt.gz")
    with pytest.raises(DataError, match=r": is a directory, expected a data file"):
        read_xc(tmp_path)
    with pytest.raises(DataError, match=r": is a directory, expected a data file"):
        read_labels(tmp_path)
    # PermissionError (chmod does not stop root, so the open itself is made to fail)
    path = tmp_path / "locked.txt"
    path.write_text("1 5 3\n0 0:1\n")
    original = type(path).open

    def denied(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(path), "open", denied)
    with pytest.raises(DataError, match=r"locked.txt: cannot be read \(Permission denied\); make it readable"):
        read_xc(path)


@pytest.mark.parametrize("text,what", [("1 5 0\n 0:1\n", "labels"), ("1 0 3\n0\n", "features")])
def test_header_declaring_zero_labels_or_features_names_the_file(tmp_path, text, what):
    path = tmp_path / "zero.txt"
    path.write_text(text)
    with pytest.raises(DataError, match=rf"^{path}:1: the header declares 0 {what}; fix it"):
        read_xc(path)
    (tmp_path / "zero_labels.txt").write_text("1 0\n\n")
    with pytest.raises(DataError, match=r"zero_labels.txt:1: the header declares 0 columns"):
        read_labels(tmp_path / "zero_labels.txt")


def test_a_header_count_beyond_int32_is_refused_instead_of_wrapping_indices(tmp_path):
    """Feature 2**31 was stored as -2**31 in the CSR matrix (a crash later)."""
    path = tmp_path / "huge.txt"
    path.write_text("2 3000000000 3\n0 2147483648:1\n1 5:1\n")
    with pytest.raises(DataError, match=rf"^{path}:1: the header declares 3000000000 features, more than the "
                                        "2147483647 this reader indexes; fix the header"):  # fmt: skip
        read_xc(path)


def test_l2_and_tfidf_normalisation_do_not_overflow_near_float32_max():
    from xmc_repro.data.features import normalize_rows, tfidf_rows

    x = sp.csr_matrix(np.array([[3e38, 3e38, 0], [0, 0, 0], [1, 2, 2], [1e-40, 0, 1e-40]], np.float32))
    y = normalize_rows(x, "l2").toarray()
    assert y.dtype == np.float32 and np.isfinite(y).all()
    np.testing.assert_allclose(y[0], [2**-0.5, 2**-0.5, 0], rtol=1e-6)  # was all zeros: (3e38)^2 overflowed
    np.testing.assert_allclose(y[2], [1 / 3, 2 / 3, 2 / 3], rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(y, axis=1), [1, 0, 1, 1], rtol=1e-6)
    idf = np.array([1, 2, 3], np.float32)  # 3e38 * 2 overflowed float32 and the row came out all zeros
    weighted = tfidf_rows(sp.csr_matrix(np.array([[3e38, 1e38, 0], [1, 1, 1]], np.float32)), idf).toarray()
    assert weighted.dtype == np.float32
    np.testing.assert_allclose(weighted, [[3 / 13**0.5, 2 / 13**0.5, 0], np.array([1, 2, 3]) / 14**0.5], rtol=1e-6)


@pytest.mark.parametrize("block_nnz", [1 << 20, 3])  # one block; blocks of a row or a few, some rows longer
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_l2_normalisation_matches_a_dense_float64_reference(dtype, block_nnz, monkeypatch):
    """Odd shapes, empty rows, explicit zeros, negative values and a column listed twice in a row (summed); to the
    bit the values of scipy's float64 products (which the features of earlier runs came from)."""
    from xmc_repro.data import features
    from xmc_repro.data.features import normalize_rows

    monkeypatch.setattr(features, "NORMALIZE_BLOCK_NNZ", block_nnz)

    rng = np.random.default_rng(int(np.dtype(dtype).itemsize))
    dense = rng.integers(-3, 9, (37, 23)).astype(dtype) * (rng.random((37, 23)) < 0.3)
    dense[[0, 5, 36]] = 0
    x = sp.csr_matrix(dense)
    x.data[::7] = 0  # stored zeros
    first = int(np.flatnonzero(x.data)[0])  # a nonzero entry, listed again at the end of its row (the CSR
    r = int(np.searchsorted(x.indptr, first, side="right")) - 1  # arrays written directly)
    end = x.indptr[r + 1]
    twice = sp.csr_matrix((np.insert(x.data, end, 5), np.insert(x.indices, end, x.indices[first]),
                           x.indptr + (np.arange(38) > r)), shape=x.shape)
    assert twice.nnz == x.nnz + 1 and twice.toarray()[r].sum() == x.toarray()[r].sum() + 5
    for given in (x, twice):
        reference = given.toarray().astype(np.float64)  # toarray sums a repeated column
        norms = np.linalg.norm(reference, axis=1, keepdims=True)
        expected = np.divide(reference, norms, out=np.zeros_like(reference), where=norms > 0)
        got = normalize_rows(given, "l2")
        assert got.dtype == np.float32 and got.shape == x.shape
        np.testing.assert_allclose(got.toarray(), expected, rtol=1e-6, atol=1e-7)
        summed = sp.csr_matrix(given, dtype=np.float64)
        summed.sum_duplicates()
        peak = abs(summed).max(axis=1).toarray().ravel()
        scaled = sp.diags(1 / np.where(peak > 0, peak, 1)) @ summed
        norms = np.sqrt(np.asarray(scaled.multiply(scaled).sum(axis=1)).ravel())
        products = sp.csr_matrix(sp.diags(1 / np.where(norms > 0, norms, 1)) @ scaled, dtype=np.float32)
        assert np.array_equal(got.toarray(), products.toarray())


def test_labels_out_of_order_are_sorted_and_named_in_one_warning(tmp_path):
    from xmc_repro.data.sources import load_splits

    (tmp_path / "train.txt").write_text("3 4 6\n5,1,3 0:1\n0,2 1:1\n4,4 2:1\n")
    (tmp_path / "test.txt").write_text("2 4 6\n2,1 0:1\n3,0,5 1:1\n")
    cfg = {"kind": "xc", "data_dir": str(tmp_path), "train_file": "train.txt", "test_file": "test.txt"}
    with pytest.warns(UserWarning) as caught:
        train, test = load_splits(cfg)
    assert [str(w.message) for w in caught] == [
        f"{tmp_path / name}: {n} of {points} points list their labels out of ascending order; the authors' P@k "
        "can miss hits on such points, ours does not" for name, n, points in (("train.txt", 1, 3), ("test.txt", 2, 2))]
    assert train.labels.to_lists() == [[1, 3, 5], [0, 2], [4]] and test.labels.to_lists() == [[1, 2], [0, 3, 5]]


def test_repeated_feature_indices_are_summed_and_named_in_one_warning(tmp_path):
    """Summed without a word before: a repeat is often a faulty export."""
    from xmc_repro.data.sources import load_splits

    (tmp_path / "train.txt").write_text("3 4 6\n1 0:1 2:0\n0 1:1 3:2 1:0.5\n4 2:1 2:-1\n")
    (tmp_path / "test.txt").write_text("1 4 6\n2 0:1 0:0\n")
    cfg = {"kind": "xc", "data_dir": str(tmp_path), "train_file": "train.txt", "test_file": "test.txt",
           "normalize": "none"}
    with pytest.warns(UserWarning) as caught:
        train, test = load_splits(cfg)
    summed = ("the values of a repeated index are summed (to 0 where they cancel); if they should not add up, fix "
              "the export")
    assert [str(w.message) for w in caught] == [
        f"{tmp_path / 'train.txt'}:3: 2 lines list a feature index more than once; {summed}",
        f"{tmp_path / 'test.txt'}:2: 1 line lists a feature index more than once; {summed}"]
    np.testing.assert_array_equal(train.features.toarray(), [[1, 0, 0, 0], [0, 1.5, 0, 2], [0, 0, 0, 0]])


def test_blank_lines_read_as_points_are_named_in_one_warning(tmp_path):
    """A stray blank line where the header's count allows a point is read as a point without labels or features."""
    from xmc_repro.data.sources import load_splits

    (tmp_path / "train.txt").write_text("4 4 6\n1,5 0:1\n\n0,2 1:1\n4 2:1\n")  # line 3 is blank
    (tmp_path / "test.txt").write_text("2 4 6\n1,2 0:1\n3 1:1\n\n\n")  # trailing blank lines: not points
    cfg = {"kind": "xc", "data_dir": str(tmp_path), "train_file": "train.txt", "test_file": "test.txt"}
    with pytest.warns(UserWarning) as caught:
        train, test = load_splits(cfg)
    assert [str(w.message) for w in caught] == [f"{tmp_path / 'train.txt'}:3: 1 blank line read as point without "
                                                "labels or features; if stray, remove them and fix the header's point "
                                                "count"]
    assert train.labels.to_lists() == [[1, 5], [], [0, 2], [4]] and test.labels.num_points == 2


def test_a_data_warning_prints_as_the_one_line_it_says(monkeypatch):
    import warnings

    from xmc_repro import console
    from xmc_repro.errors import DataWarning

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)  # put back after the test
    console.quiet()  # what the command line does first
    assert warnings.formatwarning(DataWarning("t.txt: x"), DataWarning, "sources.py", 9) == "warning: t.txt: x\n"
    assert "sources.py:9" in warnings.formatwarning(UserWarning("y"), UserWarning, "sources.py", 9, "")


@pytest.mark.parametrize("unlabelled, what", [("train.txt", "training"), ("test.txt", "test")])
def test_a_split_without_any_label_is_refused(tmp_path, unlabelled, what):
    """Every point unlabelled (e.g. a features-only file): a training set teaches nothing; a test set gives every
    test P@k 0 and, validated on test, epochs chosen on nothing."""
    from xmc_repro.data.sources import load_splits

    for name in ("train.txt", "test.txt"):
        (tmp_path / name).write_text("2 4 6\n 0:1 2:0.5\n 1:1\n" if name == unlabelled else "2 4 6\n0 0:1\n3 1:1\n")
    cfg = {"kind": "xc", "data_dir": str(tmp_path), "train_file": "train.txt", "test_file": "test.txt"}
    with pytest.raises(DataError, match=rf"^{re.escape(str(tmp_path / unlabelled))}: no {what} point has a label"):
        load_splits(cfg)


def test_reading_holds_little_more_than_the_matrix_it_makes(tmp_path, monkeypatch):
    """Peak memory (numpy's allocations, traced) against the float32 CSR matrix that comes out: parsed chunks wait
    for the rest of the file as int32 / float32 arrays (float64 views held each chunk's whole float64 number
    stream: a peak of 4.2 times the matrix; Amazon-670K's bag-of-words file took 1.4 GiB for 272 MiB)."""
    import tracemalloc

    rng = np.random.default_rng(0)
    x = sp.random(4000, 3000, density=0.02, format="csr", random_state=rng, dtype=np.float32)
    path = tmp_path / "data.txt"
    write_xc(path, x, LabelCSR(np.arange(4001), rng.integers(0, 50, 4000), 50))
    monkeypatch.setattr(xc_format, "CHUNK_BYTES", 1 << 16)  # many chunks, each small beside the whole file
    tracemalloc.start()
    try:
        read = read_xc(path).features
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * (read.data.nbytes + read.indices.nbytes + read.indptr.nbytes)
