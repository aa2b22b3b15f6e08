"""``abtrain data fetch``: checksums, atomic writes, files kept, offline; from file URLs and a local HTTP server."""

import functools
import hashlib
import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from abtrain import data
from abtrain.data import load_fashion_mnist
from abtrain.fetch import FASHION_MNIST, FetchError, _content_sha256, fetch_fashion_mnist, user_data_dir
from helpers import free_port, make_fake_fashion

DEBIAN = Path("/usr/share/datasets/fashion-mnist")


def _checksums(directory: Path) -> dict[str, str]:
    out = {}
    for name in FASHION_MNIST:
        with open(directory / name, "rb") as fh:
            out[name] = _content_sha256(lambda: fh.read(1 << 16))
    return out


def _cli(*args, env=None):
    env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "abtrain", *args], capture_output=True, text=True, timeout=120,
                          env=env)


@pytest.fixture
def server(tmp_path):
    """A local HTTP server over a directory of generated Fashion-MNIST files."""
    root = make_fake_fashion(tmp_path / "served", n_train=64, n_test=16)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


def test_fetch_from_file_urls_loads_and_keeps_valid_files(tmp_path):
    src = make_fake_fashion(tmp_path / "src", n_train=64, n_test=16)
    sums = _checksums(src)
    said = []
    dst = fetch_fashion_mnist(tmp_path / "dst", base_url=src.as_uri(), checksums=sums, say=said.append)
    assert sorted(os.listdir(dst)) == sorted(FASHION_MNIST)  # no temporary file left behind
    ds = load_fashion_mnist(dst)
    assert len(ds.train) == 64 and len(ds.test) == 16
    assert all("downloaded, checksum ok" in line for line in said)
    # A second fetch keeps the valid files; a damaged one is replaced.
    (dst / "t10k-labels-idx1-ubyte.gz").write_bytes(b"\x1f\x8b damaged")
    said.clear()
    fetch_fashion_mnist(dst, base_url=src.as_uri(), checksums=sums, say=said.append)
    assert sum("present, checksum ok" in line for line in said) == 3
    assert said[-1].endswith("t10k-labels-idx1-ubyte.gz: downloaded, checksum ok")
    assert load_fashion_mnist(dst).test.y.tolist() == ds.test.y.tolist()


def test_checksum_mismatch_is_refused_and_nothing_is_left(server, tmp_path):
    _, url = server
    dst = tmp_path / "dst"
    with pytest.raises(FetchError, match="checksum mismatch"):  # generated files against the real checksums
        fetch_fashion_mnist(dst, base_url=url, say=lambda line: None)
    assert os.listdir(dst) == []
    p = _cli("data", "fetch", "fashion-mnist", "--data-dir", str(dst), "--base-url", url)
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "checksum mismatch" in lines[0] and "was not kept" in lines[0], p.stderr
    assert os.listdir(dst) == []


def test_good_fetch_over_http(server, tmp_path):
    root, url = server
    dst = fetch_fashion_mnist(tmp_path / "dst", base_url=url, checksums=_checksums(root), say=lambda line: None)
    assert len(load_fashion_mnist(dst).train) == 64


def test_truncated_download_is_refused(server, tmp_path):
    root, url = server
    sums = _checksums(root)
    whole = (root / "train-labels-idx1-ubyte.gz").read_bytes()
    (root / "train-labels-idx1-ubyte.gz").write_bytes(whole[: len(whole) // 2])
    dst = tmp_path / "dst"
    with pytest.raises(FetchError, match="train-labels-idx1-ubyte.gz: corrupt gzip data"):
        fetch_fashion_mnist(dst, base_url=url, checksums=sums, say=lambda line: None)
    assert sorted(os.listdir(dst)) == ["train-images-idx3-ubyte.gz"]  # the one before it, complete and verified


def test_offline_gives_one_clear_line_and_exit_code_1(tmp_path):
    dst = tmp_path / "dst"
    p = _cli("data", "fetch", "fashion-mnist", "--data-dir", str(dst), "--base-url", f"http://127.0.0.1:{free_port()}/")
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("abtrain: error: cannot download train-images-idx3-ubyte.gz")
    assert "connection refused" in lines[0] and "offline?" in lines[0] and "Traceback" not in p.stderr
    assert os.listdir(dst) == []
    # The environment variable is the same override.
    p = _cli("data", "fetch", "fashion-mnist", "--data-dir", str(dst),
             env={"ABTRAIN_FASHION_MNIST_URL": f"http://127.0.0.1:{free_port()}/"})
    assert p.returncode == 1 and "127.0.0.1" in p.stderr
    p = _cli("data", "fetch", "fashion-mnist", "--data-dir", str(dst), "--base-url", "ftp://example.org/")
    assert p.returncode == 2 and "must start with http://" in p.stderr


def test_user_data_dir_is_where_fetch_writes_and_the_loader_looks(tmp_path, monkeypatch):
    assert user_data_dir({"ABTRAIN_DATA": "/data/x"}) == Path("/data/x")
    assert user_data_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/abtrain")
    assert user_data_dir({"HOME": "/h"}).name == "abtrain"
    src = make_fake_fashion(tmp_path / "src", n_train=64, n_test=16)
    monkeypatch.setenv("ABTRAIN_DATA", str(tmp_path / "user"))
    monkeypatch.setattr(data, "DEFAULT_FASHION_DIR", str(tmp_path / "no-debian-package"))
    with pytest.raises(data.DataError, match="abtrain data fetch fashion-mnist"):
        load_fashion_mnist()
    dst = fetch_fashion_mnist(base_url=src.as_uri(), checksums=_checksums(src), say=lambda line: None)
    assert dst == tmp_path / "user" / "fashion-mnist"
    assert len(load_fashion_mnist().train) == 64


@pytest.mark.skipif(not all((DEBIAN / n).is_file() for n in FASHION_MNIST), reason="Debian's dataset-fashion-mnist "
                    "is not installed")
def test_real_checksums_accept_debians_files(tmp_path):
    """The published files' content, as Debian ships it (re-compressed), passes the built-in checksums."""
    dst = tmp_path / "dst"
    p = _cli("data", "fetch", "fashion-mnist", "--data-dir", str(dst), "--base-url", DEBIAN.as_uri())
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("downloaded, checksum ok") == 4 and f"Fashion-MNIST is in {dst}" in p.stdout
    assert all(hashlib.sha256((dst / n).read_bytes()).digest() == hashlib.sha256((DEBIAN / n).read_bytes()).digest()
               for n in FASHION_MNIST)
    ds = load_fashion_mnist(dst)
    assert (len(ds.train), len(ds.test)) == (60000, 10000)
